"""Rotary tables: the float32 angle table ``freqs``, the optional precomputed cos/sin caches,
and rate tables (the rates an angle table is made of, for kernels that multiply them out)."""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import RoPEError, RoPETypeError


@dataclass(frozen=True, eq=False)
class CosSinCache:
    """``cos`` and ``sin`` of an angle table, each ``[s2, d2]``, contiguous, float32 (or both
    bfloat16 or float16: a model's own per-token values, widened to float32 by the kernels).

    Build it once with :func:`cos_sin_cache` and pass it wherever ``apply`` takes ``freqs``:
    kernels then read the two tables instead of evaluating sin/cos per element.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        _check_cos_sin(self.cos, self.sin)

    @property
    def seq_len(self) -> int:
        return self.cos.shape[0]

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[1]

    @property
    def device(self) -> torch.device:
        return self.cos.device

    def to(self, device: torch.device | str) -> CosSinCache:
        return CosSinCache(self.cos.to(device), self.sin.to(device))

    @property
    def _version(self) -> int:
        """cos's and sin's version counters summed, a tensor's ``_version`` for the pair: it
        moves whenever either is written (each only grows). The Triton backend checks its
        halves flag against it."""
        return self.cos._version + self.sin._version


@dataclass(frozen=True, eq=False)
class PairCosSinCache:
    """One float32 table ``[s2, d2]`` holding, for each position, the cosines of its ``d2 / 2``
    pair angles followed by their sines: the layout vLLM, SGLang and FlashInfer call
    ``cos_sin_cache``. Pair ``k`` (channels ``k`` and ``k + d2/2``, or ``2k`` and ``2k + 1`` when
    interleaved) turns by the angle whose cosine is ``table[p, k]`` and sine
    ``table[p, d2/2 + k]``. Wrap an engine's cache with it (no copy) and pass it as ``freqs``.
    """

    table: torch.Tensor

    def __post_init__(self) -> None:
        _check_pair_table(self.table)

    @property
    def seq_len(self) -> int:
        return self.table.shape[0]

    @property
    def rotary_dim(self) -> int:
        return self.table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.table.device


_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUILD_IT = "build it with rope_dispatch.cos_sin_cache(freqs)"


def _described(x: torch.Tensor) -> str:
    return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"


def _check_cos_sin(cos: object, sin: object) -> None:
    """Refuse, when it is built, a CosSinCache the kernels could not read as pairs; each
    condition with its own sentence and the values."""
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise RoPETypeError(
            f"CosSinCache of {type(cos).__name__} cos and {type(sin).__name__} sin; expected "
            f"two [s2, d2] tensors: {_BUILD_IT}"
        )
    got = f"cos {_described(cos)}, sin {_described(sin)}"
    if cos.dtype not in _CACHE_DTYPES or sin.dtype != cos.dtype:
        raise RoPEError(
            f"CosSinCache's cos and sin must share one dtype among float32, bfloat16 and "
            f"float16, got {got}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise RoPEError(
            f"CosSinCache's cos and sin must be [s2, d2] tensors of the same shape (one row per "
            f"position), got {got}; {_BUILD_IT}"
        )
    if cos.device != sin.device:
        raise RoPEError(
            f"CosSinCache's cos is on {cos.device} but sin on {sin.device}; expected one device"
        )
    if cos.shape[0] < 1:
        raise RoPEError(f"CosSinCache's tables must have at least one position (row), got {got}")
    if cos.shape[1] < 2 or cos.shape[1] % 2:
        raise RoPEError(
            f"CosSinCache's tables must have an even d2 >= 2 (channels rotate in pairs), got {got}"
        )
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise RoPEError(
            f"CosSinCache's cos and sin must be contiguous, got strides {cos.stride()} and "
            f"{sin.stride()}; pass cos.contiguous() and sin.contiguous()"
        )


def _check_pair_table(table: object) -> None:
    """Refuse, when it is built, a PairCosSinCache the kernels could not read."""
    if not isinstance(table, torch.Tensor):
        raise RoPETypeError(
            f"PairCosSinCache's table must be a float32 tensor [s2, d2] (cosines, then sines), "
            f"got {type(table).__name__}"
        )
    if table.dtype != torch.float32 or table.dim() != 2:
        raise RoPEError(
            f"PairCosSinCache's table must be a float32 tensor [s2, d2] (cosines, then sines), "
            f"got {_described(table)}"
        )
    if table.shape[0] < 1 or table.shape[1] < 2 or table.shape[1] % 2:
        raise RoPEError(
            f"PairCosSinCache's table must have at least one position and an even d2 >= 2 (d2 / 2 "
            f"cosines, then d2 / 2 sines), got shape {tuple(table.shape)}"
        )
    if not table.is_contiguous():
        raise RoPEError(
            f"PairCosSinCache's table must be contiguous, got strides {table.stride()}; pass "
            "table.contiguous()"
        )


def _normal_tensors():
    """A context in which new tensors are normal ones: inference mode off where it is on (an
    inference tensor kept for later calls could not be saved for a backward). While tracing
    (where Dynamo cannot ask) nothing changes."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


@dataclass(frozen=True, eq=False)
class RateTable:
    """Rotation rates ``inv_freq`` ``[d2 / 2]`` (float32) and a row count: the angle table
    ``angle_table(inv_freq, rows)`` without its ``rows x d2`` floats.

    Pair ``k`` turns by ``float32(p) * inv_freq[k]`` at position ``p`` (one float32 multiply,
    as :func:`angle_table` and :meth:`RotaryFrequencies.angle_table` compute each entry), so a
    call gives the same results as with that angle table, bit for bit where the backend does the
    same float32 math on both. The Triton kernels compute the angles from the rates instead of
    reading a table row per token. Positions ``0 .. rows - 1`` are inside the table; any other
    position is treated as outside an angle table of ``rows`` rows (an error where the values
    are read, NaN rows where they are not).

    The rates are copied at construction (``inv_freq`` twice over, ``[d2]``, the form the
    kernels read); changing ``inv_freq`` in place afterwards changes nothing: build a new
    RateTable. They are constants, as an angle table's entries are: no gradient flows to
    ``inv_freq``. Backends that read whole angle tables (eager, compile, TransformerEngine) get
    :meth:`angle_table`, made on first use and kept on the object: ``rows x d2`` float32
    values per layout (halves, interleaved) used.
    """

    inv_freq: torch.Tensor
    rows: int

    def __post_init__(self) -> None:
        rates = self.inv_freq
        if not isinstance(rates, torch.Tensor):
            raise RoPEError(
                f"RateTable's inv_freq must be a float32 tensor [d2 / 2], got {type(rates).__name__}"
            )
        if rates.dtype != torch.float32:
            raise RoPEError(
                f"RateTable's inv_freq must be float32 rates (float32 products with positions "
                f"are what angle tables hold), got dtype {str(rates.dtype).removeprefix('torch.')}"
            )
        if rates.dim() != 1:
            raise RoPEError(
                f"RateTable's inv_freq must be 1-D [d2 / 2] (one rate per rotated pair), got "
                f"shape {tuple(rates.shape)}"
            )
        if rates.numel() < 1:
            raise RoPEError("RateTable's inv_freq must hold at least one rate, got an empty tensor")
        if not rates.is_contiguous():
            raise RoPEError(
                f"RateTable's inv_freq must be contiguous, got stride {rates.stride()}; pass "
                "inv_freq.contiguous()"
            )
        rows = self.rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise RoPEError(
                f"RateTable's rows must be a positive int (positions 0 .. rows - 1 are inside "
                f"the table), got {rows!r}"
            )
        # What the kernels read: the rates twice over, [d2], and a [rows, d2] view of it with
        # a row stride of 0 (its shape gives the launcher the table length and the rotary dim).
        # Constants, like an angle table's entries: no graph back to inv_freq, and a normal
        # tensor even when made under inference mode (autograd may save it later).
        with _normal_tensors():
            doubled = torch.cat((rates.detach(), rates.detach())).contiguous()
        object.__setattr__(self, "_kernel_rates", doubled)
        object.__setattr__(
            self, "_kernel_view", doubled.as_strided((rows, doubled.shape[0]), (0, 1))
        )
        object.__setattr__(self, "_angles", {})

    @property
    def seq_len(self) -> int:
        return self.rows

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def angle_table(self, interleaved: bool = False) -> torch.Tensor:
        """The equivalent float32 angle table ``[rows, 1, 1, d2]`` (halves, or pairs with
        ``interleaved``), made from the rates copied at construction on first use and kept on
        the object (``rows x d2`` floats per layout). Do not write to it."""
        angles = self._angles.get(interleaved)  # type: ignore[attr-defined]
        if angles is None:
            n = self.inv_freq.shape[0]
            rates = self._kernel_rates[:n]  # type: ignore[attr-defined]
            if torch.compiler.is_compiling():  # a traced graph computes it; nothing kept
                return angle_table(rates, self.rows, interleaved=bool(interleaved))
            with _normal_tensors():  # a first call under inference mode keeps no inference tensor
                angles = angle_table(rates, self.rows, interleaved=bool(interleaved))
            self._angles[bool(interleaved)] = angles  # type: ignore[attr-defined]
        return angles

    def angle_rows(self, interleaved: bool = False) -> torch.Tensor:
        """:meth:`angle_table` as ``[rows, d2]`` (a view): what backends that gather table rows
        read."""
        angles = self.angle_table(interleaved)
        return angles.view(angles.shape[0], angles.shape[3])


RotaryTable = torch.Tensor | CosSinCache | PairCosSinCache | RateTable

TABLE_KINDS = {
    torch.Tensor: "angles",
    CosSinCache: "cos_sin_cache",
    PairCosSinCache: "pair_cos_sin_cache",
    RateTable: "rates",
}
"""A checked table's kind by its type (an angle table is a plain ``[s2, d2]`` tensor)."""


def table_kind(table: RotaryTable) -> str:
    """``"angles"``, ``"cos_sin_cache"``, ``"pair_cos_sin_cache"`` or ``"rates"``."""
    return TABLE_KINDS.get(type(table), "angles")


def table_shape(table: RotaryTable) -> tuple[int, int]:
    """``(rows, rotary dim)`` of a checked table of any kind."""
    if isinstance(table, torch.Tensor):
        return table.shape[0], table.shape[1]
    return table.seq_len, table.rotary_dim


def kernel_tables(table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A checked table as the kernels read it: ``(angles, None)``; ``(cos, sin)``; for a pair
    cache ``(table, table[:, d2/2:])``, a sin view half as wide as the table (one value per
    pair: that width tells the kernels the kind); for a rate table ``(view, view)``, the same
    ``[rows, d2]`` view of the doubled rates twice, with a row stride of 0 (``sin is table``
    tells the kernels the kind)."""
    kind = type(table)
    if kind is CosSinCache:
        return table.cos, table.sin
    if kind is PairCosSinCache:
        t = table.table
        return t, t[:, t.shape[1] // 2 :]
    if kind is RateTable:
        view = table._kernel_view  # type: ignore[attr-defined]
        return view, view
    return table, None


_channel_streams: dict[tuple, torch.Tensor] = {}


def _streams_of_channels(sections: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """Which position stream (0 temporal, 1 height, 2 width) each of the ``d2`` rotary channels
    reads: the sections in each half (a pair's two channels share a stream); made once per
    device."""
    key = (sections, device)
    streams = _channel_streams.get(key)
    if streams is None:
        half = [stream for stream, count in enumerate(sections) for _ in range(count)]
        streams = torch.tensor(half + half, dtype=torch.long).to(device)
        _channel_streams[key] = streams
    return streams


def _gather_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t, c] = values[rows[c, t], c]`` ``[tokens, d2]``, NaN where the row falls outside
    ``values`` (never an out-of-bounds read, never a clamped row)."""
    n = values.shape[0]
    inside = (rows >= 0) & (rows < n)
    channels = torch.arange(values.shape[1], device=values.device)[:, None]
    picked = values[rows.clamp(0, max(n - 1, 0)), channels]
    return torch.where(inside, picked, float("nan")).t().contiguous()


def multimodal_rows(
    table: RotaryTable, streams: torch.Tensor, sections: tuple[int, int, int]
) -> RotaryTable:
    """A table of the same kind with one row per token for multimodal RoPE (Qwen2-VL):
    channel ``c`` of token ``t``'s row is the table's channel ``c`` at ``streams[s, t]``, where
    ``s`` is the stream of ``c``'s section (``sections`` = temporal, height, width channel
    counts of each half, summing to ``d2 / 2``). ``streams`` is ``[3, tokens]``. A pair cache's
    cosine and sine of pair ``k`` share the stream, as the two channels of the pair do. A rate
    table gives an angle table (rows gathered from its :meth:`RateTable.angle_table`, halves:
    multimodal RoPE is never interleaved)."""
    rows = streams.long()[_streams_of_channels(tuple(sections), table.device)]  # [d2, tokens]
    if isinstance(table, CosSinCache):
        return CosSinCache(_gather_rows(table.cos, rows), _gather_rows(table.sin, rows))
    if isinstance(table, PairCosSinCache):
        return PairCosSinCache(_gather_rows(table.table, rows))
    if isinstance(table, RateTable):
        return _gather_rows(table.angle_rows(), rows)
    return _gather_rows(table, rows)


def _cos_sin_address(table: CosSinCache) -> tuple[int, int]:
    return table.cos.data_ptr(), table.sin.data_ptr()


def _pair_address(table: PairCosSinCache) -> int:
    return table.table.data_ptr()


def _rates_address(table: RateTable) -> int:
    """The address of the doubled rates the kernels read."""
    return table._kernel_rates.data_ptr()  # type: ignore[attr-defined]


def _tensor_address(table: torch.Tensor) -> int:
    return table.data_ptr()


_ADDRESS_READERS: dict[type, Callable[[Any], int | tuple[int, int]]] = {
    CosSinCache: _cos_sin_address, PairCosSinCache: _pair_address, RateTable: _rates_address,
}


def address_reader(table: object) -> Callable[[Any], int | tuple[int, int]]:
    """:func:`table_address` for tables of ``table``'s type, with no type tests of its own: what
    a plan, made for one table object, calls on every call it serves."""
    return _ADDRESS_READERS.get(type(table), _tensor_address)


def table_requires_grad(table: object) -> bool:
    """Whether a gradient is asked of the table: an angle table, or a cos/sin cache member, that
    requires grad (a RateTable's rates are copied constants)."""
    if isinstance(table, torch.Tensor):
        return table.requires_grad
    if isinstance(table, CosSinCache):
        return table.cos.requires_grad or table.sin.requires_grad
    if isinstance(table, PairCosSinCache):
        return table.table.requires_grad
    return False


def table_address(table: object) -> int | tuple[int, int]:
    """Where a table's memory is (a plan checks it was not replaced with ``.data = ...``)."""
    return address_reader(table)(table)


# id(freqs) -> (weak reference to freqs, its address, whether it is [s2, 1, 1, d2]): tables
# checked lately. No tensor is held (a view would keep its base alive), so a table is freed as
# soon as its owner drops it, and its entry with it.
_recent_tables: dict[int, tuple[weakref.ref, int, bool]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _recent_tables.get(key)
    if entry is not None and entry[0] is ref:
        del _recent_tables[key]


def angles_2d(freqs: torch.Tensor, argument: str = "freqs") -> torch.Tensor:
    """Check an angle table ``[s2, 1, 1, d2]`` or ``[s2, d2]`` and return it as ``[s2, d2]``.

    The result is a view when the input is contiguous float32 (the usual case), so a call pays
    no copy; other strides are made contiguous here. The last few contiguous tables are
    remembered, so a training step that passes the same table to every layer checks it once
    (while it is the same object over the same memory and shape: ``freqs.data = ...`` or
    ``resize_`` start afresh).
    """
    if torch.compiler.is_compiling():
        return _angles_2d(freqs, argument)
    key = id(freqs)
    hit = _recent_tables.get(key)
    if hit is not None and hit[0]() is freqs and hit[1] == freqs.data_ptr():
        shape = freqs.shape
        if hit[2] and len(shape) == 4 and freqs.is_contiguous():
            return freqs.view(shape[0], shape[3])
        if not hit[2] and len(shape) == 2 and freqs.is_contiguous():
            return freqs
    table = _angles_2d(freqs, argument)
    if table.data_ptr() == freqs.data_ptr():  # a view, not a copy: worth remembering
        if len(_recent_tables) >= 8:
            _recent_tables.clear()
        _recent_tables[key] = (
            weakref.ref(freqs, lambda ref: _forget(key, ref)), freqs.data_ptr(), freqs.dim() == 4
        )
    return table


def _angles_2d(freqs: torch.Tensor, argument: str) -> torch.Tensor:
    if isinstance(freqs, RotaryFrequencies):
        raise RoPETypeError(
            f"{argument} is a RotaryFrequencies (rates, with no length), not a table; build a "
            f"table from it once and pass that: {argument}.cos_sin_cache(max_positions, "
            f"device=t.device) (it includes attention_factor="
            f"{freqs.attention_factor:.6g}), {argument}.angle_table(...) or, for the Triton "
            f"kernels, {argument}.rate_table(...)"
        )
    if not isinstance(freqs, torch.Tensor):
        raise RoPETypeError(
            f"{argument} must be a float32 torch.Tensor [s2, 1, 1, d2] or [s2, d2], a "
            f"CosSinCache, a PairCosSinCache or a RateTable; got {type(freqs).__name__}"
        )
    if freqs.dtype != torch.float32:
        raise RoPEError(
            f"{argument} must be float32 angles (bf16/fp16 angles lose position precision), "
            f"got dtype {str(freqs.dtype).removeprefix('torch.')}"
        )
    if freqs.dim() == 4:
        if freqs.shape[1] != 1 or freqs.shape[2] != 1:
            raise RoPEError(
                f"{argument} must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}"
            )
        freqs = freqs.view(freqs.shape[0], freqs.shape[3]) if freqs.is_contiguous() else (
            freqs.reshape(freqs.shape[0], freqs.shape[3])
        )
    elif freqs.dim() != 2:
        raise RoPEError(
            f"{argument} must have shape [s2, 1, 1, d2] or [s2, d2], got {tuple(freqs.shape)}"
        )
    if freqs.shape[0] < 1 or freqs.shape[1] < 2 or freqs.shape[1] % 2:
        raise RoPEError(
            f"{argument} must have at least one position and an even rotary dim d2 >= 2, "
            f"got shape {tuple(freqs.shape)}"
        )
    return freqs if freqs.is_contiguous() else freqs.contiguous()


def cos_sin_cache(freqs: torch.Tensor) -> CosSinCache:
    """Precompute float32 cos and sin of an angle table ``[s2, 1, 1, d2]`` (or ``[s2, d2]``).

    Evaluated in float64 and rounded once, so the cache is at least as accurate as the float32
    ``sincos`` a kernel would do; every backend gives the same results from either form.
    """
    angles = angles_2d(freqs).double()
    return CosSinCache(torch.cos(angles).float().contiguous(), torch.sin(angles).float().contiguous())


def table_cos_sin(table: RotaryTable, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[s2, d2]``, one value per channel, of a checked table of any
    kind (a pair cache's values repeated for both channels of each pair; a rate table's from
    its kept :meth:`RateTable.angle_table` in the call's layout)."""
    if isinstance(table, RateTable):
        angles = table.angle_rows(interleaved)
        return torch.cos(angles), torch.sin(angles)
    if isinstance(table, CosSinCache):
        return table.cos, table.sin
    if isinstance(table, PairCosSinCache):
        cos, sin = table.table.chunk(2, dim=-1)
        if interleaved:
            return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return torch.cos(table), torch.sin(table)


# --- building angle tables --------------------------------------------------------------------
# The float32 operations below, in this order, are those of TransformerEngine 2.20.2's
# RotaryPositionEmbedding, so a table built here on a device equals TE's on that device bit for
# bit (tests/test_compat_te.py). Options that choose a position scale (TE's interpolation,
# later other models' rules) compute it outside and pass it in as ``scale``.


def inverse_frequencies(
    dim: int, base: float = 10000.0, *, device: torch.device | str | int | None = None
) -> torch.Tensor:
    """float32 ``[ceil(dim / 2)]`` rotation rates ``1 / base ** (2k / dim)``, ``k = 0, 1, ...``.

    ``dim`` is the rotary dim (the table's last dim is ``2 * len(result)``); ``device`` is
    where the result lives (``None``: torch's default device). The exponent ``2k / dim`` and
    the power are float32, as in TransformerEngine.
    """
    dim = _rotary_dim(dim)
    base = _positive("base", base)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base ** exponents)


def _autocast_off(device_type: str):
    """A context that turns autocast off for ``device_type`` (where autocast exists for it)."""
    if torch.compiler.is_compiling() and device_type in ("cpu", "cuda"):
        # Dynamo traces the autocast context but not the availability check
        return torch.autocast(device_type=device_type, enabled=False)
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def angle_table(
    inv_freq: torch.Tensor, length: int, *, offset: int | float = 0, scale: float = 1.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """The angle table ``freqs`` ``[length, 1, 1, 2n]`` of rates ``inv_freq`` ``[n]``.

    Row ``p`` holds the angles of position ``(p + offset) * scale``, each rate once per
    rotated pair: ``[a_0 .. a_{n-1}, a_0 .. a_{n-1}]`` (the two halves, NeoX style) or, with
    ``interleaved``, ``[a_0, a_0, a_1, a_1, ...]``. ``scale`` shrinks positions (linear
    interpolation: ``1 / factor``); ``1.0`` leaves them unscaled. The result has ``inv_freq``'s
    dtype and device, is contiguous, and is computed with autocast off.
    """
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or not (
        inv_freq.is_floating_point()
    ):
        raise RoPEError(
            "inv_freq must be a 1-D floating-point tensor of rates, got "
            + (f"{inv_freq.dtype} {tuple(inv_freq.shape)}" if isinstance(inv_freq, torch.Tensor)
               else type(inv_freq).__name__)
        )
    if isinstance(length, bool) or not isinstance(length, (numbers.Integral, torch.SymInt)) or (
        length < 0
    ):
        raise RoPEError(f"length must be an int >= 0 (the table's rows), got {length!r}")
    with _autocast_off(inv_freq.device.type):
        positions = torch.arange(length, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        if scale != 1.0:
            positions = positions * scale
        angles = torch.outer(positions, inv_freq)  # one float32 multiply per entry
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    return angles.reshape(length, 1, 1, angles.shape[-1])


# --- rotary frequencies of model families -----------------------------------------------------
# Hugging Face models choose their rates by a "rope type" (transformers 5.23 reads it from
# ``config.rope_parameters``); TE's RotaryPositionEmbedding by its constructor options. Each
# builder below gives a RotaryFrequencies: the rates, the factor cos and sin are multiplied by,
# and, for TE, a factor on positions. The Hugging Face builders run transformers' float32
# operations in the same order on the CPU (where transformers computes its rates when a model
# is built), so their rates equal transformers' there (bit for bit with torch 2.13; the tests,
# tests/test_tables_hf.py, allow float32 rounding).

HF_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
"""The ``rope_type`` values of ``config.rope_parameters`` that :func:`from_hf_config` reads."""

_DeviceLike = torch.device | str | int | None


@dataclass(frozen=True, eq=False)
class RotaryFrequencies:
    """The rotation rates of one rotary family and how its cos and sin are scaled.

    - ``inv_freq``: float32 ``[d2 / 2]`` rates (radians per position), one per rotated pair.
    - ``attention_factor``: the factor cos and sin are multiplied by (transformers'
      ``attention_scaling``: YaRN and LongRoPE use it to keep attention logits in range;
      ``1.0`` for the other families).
    - ``rope_type``: the family's name (``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``,
      ``"longrope"``, ``"llama3"``; TE's options give ``"default"`` or ``"linear"``).
    - ``position_scale``: positions are multiplied by it before the rates (TE's position
      interpolation; Hugging Face's families fold their scaling into the rates and keep 1.0).
    - ``max_positions``: for rates chosen for one sequence length (dynamic NTK, LongRoPE, TE's
      interpolation), that length: the longest table they are valid for (rows of a shorter
      table are those of the long one, not the ones a shorter sequence would get). ``None``
      when the rates do not depend on the length.

    An angle table cannot carry ``attention_factor`` (YaRN's and LongRoPE's multiplier of cos
    and sin): :meth:`cos_sin_cache` includes it, and :meth:`angle_table` (like
    :meth:`rate_table`, the rates themselves for the Triton kernels to multiply out) refuses a
    factor other than 1.0 unless told that the caller applies it.
    """

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    rope_type: str = "default"
    position_scale: float = 1.0
    max_positions: int | None = None

    def __post_init__(self) -> None:
        rates = self.inv_freq
        if not isinstance(rates, torch.Tensor) or rates.dtype != torch.float32 or rates.dim() != 1:
            shown = (
                f"dtype {str(rates.dtype).removeprefix('torch.')}, shape {tuple(rates.shape)}"
                if isinstance(rates, torch.Tensor) else type(rates).__name__
            )
            raise RoPEError(f"inv_freq must be a float32 tensor [d2 / 2], got {shown}")
        if rates.numel() < 1:
            raise RoPEError("inv_freq must hold at least one rate, got an empty tensor")
        for name in ("attention_factor", "position_scale"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if not isinstance(self.rope_type, str):
            raise RoPEError(f"rope_type must be a str, got {self.rope_type!r}")
        if self.max_positions is not None:
            object.__setattr__(self, "max_positions", _count("max_positions", self.max_positions))

    @property
    def rotary_dim(self) -> int:
        """``d2``: the number of channels the rates rotate (two per rate)."""
        return 2 * self.inv_freq.shape[0]

    def angle_table(
        self, max_positions: int, *, device: _DeviceLike = None, interleaved: bool = False,
        without_attention_factor: bool = False,
    ) -> torch.Tensor:
        """float32 angles ``[max_positions, 1, 1, d2]`` of positions ``0 .. max_positions - 1``.

        Each angle is one float32 product ``position * inv_freq`` (as transformers computes
        ``inv_freq @ position_ids``; TE's options multiply positions by ``position_scale``
        first). The halves layout ``[a_0 .. a_{n-1}, a_0 .. a_{n-1}]``, or pairs with
        ``interleaved``. ``device``: where the table lives (``None``: where ``inv_freq`` is).
        An angle table cannot apply ``attention_factor``: where it is not 1.0 this raises
        (use :meth:`cos_sin_cache`) unless ``without_attention_factor=True`` says the caller
        applies it, as ``RoPESpec(cos_sin_scale=attention_factor)`` does in every backend.
        """
        if self.attention_factor != 1.0 and not without_attention_factor:
            raise RoPEError(
                f"this {self.rope_type!r} table has attention_factor={self.attention_factor:.6g}, "
                "which an angle table cannot carry; use cos_sin_cache(), which includes it, or "
                "pass without_attention_factor=True and give the call's RoPESpec "
                f"cos_sin_scale={self.attention_factor!r}"
            )
        length = self._checked_length(max_positions)
        if not isinstance(interleaved, bool):
            raise RoPEError(f"interleaved must be a bool, got {interleaved!r}")
        rates = self.inv_freq if device is None else self.inv_freq.to(device)
        return angle_table(rates, length, scale=self.position_scale, interleaved=interleaved)

    def rate_table(
        self, max_positions: int, *, device: _DeviceLike = None,
        without_attention_factor: bool = False,
    ) -> RateTable:
        """The rates as a :class:`RateTable` of ``max_positions`` rows: the same angles as
        :meth:`angle_table` (bit for bit: each is the float32 product ``position * inv_freq``),
        which the Triton kernels compute instead of reading a table row per token.

        Refused where positions are scaled (``position_scale``, TE's interpolation: the angle
        is then ``(position * scale) * rate``, which one multiply by a rate cannot reproduce;
        use :meth:`angle_table`), and, as by :meth:`angle_table`, where ``attention_factor``
        is not 1.0 unless ``without_attention_factor=True`` says the call's
        ``RoPESpec(cos_sin_scale=attention_factor)`` applies it. ``device``: where the rates
        live (``None``: where ``inv_freq`` is).
        """
        if self.position_scale != 1.0:
            raise RoPEError(
                f"these {self.rope_type!r} rates scale positions by "
                f"position_scale={self.position_scale:.6g} (TransformerEngine's interpolation), "
                "which a RateTable cannot carry (its angle is one product position * rate); "
                "use angle_table()"
            )
        if self.attention_factor != 1.0 and not without_attention_factor:
            raise RoPEError(
                f"this {self.rope_type!r} table has attention_factor={self.attention_factor:.6g}, "
                "which a RateTable cannot carry; use cos_sin_cache(), which includes it, or "
                "pass without_attention_factor=True and give the call's RoPESpec "
                f"cos_sin_scale={self.attention_factor!r}"
            )
        length = self._checked_length(max_positions)
        rates = self.inv_freq if device is None else self.inv_freq.to(device)
        return RateTable(rates.contiguous(), length)

    def cos_sin_cache(
        self, max_positions: int, *, device: _DeviceLike = None, interleaved: bool = False
    ) -> CosSinCache:
        """float32 cos and sin ``[max_positions, d2]`` of :meth:`angle_table`, multiplied by
        ``attention_factor`` as transformers' rotary modules multiply them.

        Evaluated in float64 from the float32 angles and rounded once, like
        :func:`cos_sin_cache`. Every backend that reads caches serves it as it is.
        """
        angles = self.angle_table(max_positions, device=device, interleaved=interleaved,
                                  without_attention_factor=True)
        angles = angles.view(angles.shape[0], angles.shape[3]).double()
        factor = self.attention_factor
        cos = (torch.cos(angles) * factor).float().contiguous()
        sin = (torch.sin(angles) * factor).float().contiguous()
        return CosSinCache(cos, sin)

    def _checked_length(self, max_positions: int) -> int:
        length = _count("max_positions", max_positions)
        if self.max_positions is not None and length > self.max_positions:
            raise RoPEError(
                f"max_positions={length} exceeds the {self.max_positions} positions these "
                f"{self.rope_type!r} rates were chosen for (they depend on the sequence length); "
                f"build them again for {length} positions"
            )
        return length


def _count(argument: str, value: object) -> int:
    """``value`` as a positive int, or a RoPEError naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RoPEError(f"{argument} must be a positive int, got {value!r}")
    return int(value)


def _positive(argument: str, value: object) -> float:
    """``value`` as a finite float > 0 (a Python or NumPy number), or a RoPEError naming
    ``argument``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        0 < float(value) < float("inf")
    ):
        raise RoPEError(f"{argument} must be a finite number > 0, got {value!r}")
    return float(value)


def _rotary_dim(dim: object, argument: str = "dim (the rotary dim)") -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2:
        raise RoPEError(f"{argument} must be an int >= 2, got {dim!r}")
    return int(dim)


def _cpu_rates(dim: int, base: float) -> torch.Tensor:
    """``1 / base ** (2k / dim)`` in float32 on the CPU, where transformers computes them."""
    return inverse_frequencies(dim, base, device="cpu")


def default_frequencies(dim: int, *, rope_theta: float = 10000.0) -> RotaryFrequencies:
    """The original RoPE rates ``1 / rope_theta ** (2k / dim)`` for a rotary dim ``dim``."""
    dim = _rotary_dim(dim)
    return RotaryFrequencies(_cpu_rates(dim, _positive("rope_theta", rope_theta)))


def linear_frequencies(
    dim: int, *, factor: float, rope_theta: float = 10000.0
) -> RotaryFrequencies:
    """Position interpolation: the default rates divided by ``factor`` (positions stretched
    ``factor`` times, so ``factor`` times the trained length fits)."""
    dim = _rotary_dim(dim)
    factor = _positive("factor", factor)
    rates = _cpu_rates(dim, _positive("rope_theta", rope_theta)) / factor
    return RotaryFrequencies(rates, rope_type="linear")


def dynamic_ntk_frequencies(
    dim: int, *, factor: float, max_position_embeddings: int, seq_len: int,
    rope_theta: float = 10000.0,
) -> RotaryFrequencies:
    """Dynamic NTK scaling: the default rates of a larger base, chosen for ``seq_len``.

    Up to ``max_position_embeddings`` positions the rates are the default ones. Beyond, the
    base grows to ``rope_theta * (factor * seq_len / max_position_embeddings - factor + 1)
    ** (dim / (dim - 2))``: transformers recomputes it each time a sequence outgrows the last
    length it saw, so the rates for ``seq_len`` are those of a sequence of that length.
    """
    dim = _rotary_dim(dim)
    if dim < 3:
        raise RoPEError(
            f"dim must be > 2 for dynamic NTK scaling (its exponent is dim / (dim - 2)), got {dim}"
        )
    factor = _positive("factor", factor)
    original = _count("max_position_embeddings", max_position_embeddings)
    length = _count("seq_len", seq_len)
    base = _positive("rope_theta", rope_theta)
    if length > original:
        base = base * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    return RotaryFrequencies(_cpu_rates(dim, base), rope_type="dynamic", max_positions=length)


def _yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(
    dim: int, *, factor: float, original_max_position_embeddings: int,
    rope_theta: float = 10000.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
    mscale: float | None = None, mscale_all_dim: float | None = None,
    attention_factor: float | None = None, truncate: bool = True,
) -> RotaryFrequencies:
    """YaRN (arXiv 2309.00071): pairs that turn fast over the trained length keep their rate,
    slow ones are interpolated by ``factor``, and a linear ramp blends the pairs between.

    The ramp runs over pair indices from the pair that turns ``beta_fast`` times in
    ``original_max_position_embeddings`` positions to the one that turns ``beta_slow`` times
    (rounded outwards when ``truncate``, clipped to ``[0, dim - 1]``). ``attention_factor``
    defaults to ``0.1 ln(factor) + 1``, or, when ``mscale`` and ``mscale_all_dim`` are both
    given and non-zero, to the ratio of that term with each of them as multiplier (DeepSeek's
    form); a given ``attention_factor`` is used as it is.
    """
    dim = _rotary_dim(dim)
    if dim % 2:
        raise RoPEError(f"dim must be even for YaRN (one ramp value per pair), got {dim}")
    factor = _positive("factor", factor)
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    base = _positive("rope_theta", rope_theta)
    if base == 1.0:
        raise RoPEError("rope_theta must not be 1 for YaRN (its ramp divides by log(rope_theta))")
    fast, slow = _positive("beta_fast", beta_fast), _positive("beta_slow", beta_slow)
    if not isinstance(truncate, bool):
        raise RoPEError(f"truncate must be a bool, got {truncate!r}")
    for argument, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RoPEError(f"{argument} must be a number or None, got {value!r}")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = (
                _yarn_magnitude(factor, mscale) / _yarn_magnitude(factor, mscale_all_dim)
            )
        else:
            attention_factor = _yarn_magnitude(factor)

    def pair_turning(turns: float) -> float:
        # The (fractional) pair index whose rate makes `turns` full turns in `original` positions.
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    ramp_start, ramp_end = pair_turning(fast), pair_turning(slow)
    if truncate:
        ramp_start, ramp_end = math.floor(ramp_start), math.ceil(ramp_end)
    ramp_start, ramp_end = max(ramp_start, 0), min(ramp_end, dim - 1)
    if ramp_start == ramp_end:
        ramp_end += 0.001  # a ramp of width 0 would divide by zero

    wavelength_terms = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kept = 1.0 / wavelength_terms
    interpolated = 1.0 / (factor * wavelength_terms)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - ramp_start) / (ramp_end - ramp_start)
    kept_share = 1 - ramp.clamp(0, 1)
    rates = interpolated * (1 - kept_share) + kept * kept_share
    return RotaryFrequencies(rates, attention_factor=attention_factor, rope_type="yarn")


def _factor_list(argument: str, values: object, count: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if (
        not isinstance(values, (list, tuple)) or len(values) != count
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)
    ):
        raise RoPEError(f"{argument} must be {count} positive numbers (one per pair), got {values!r}")
    return torch.tensor(values, dtype=torch.float32)


def longrope_frequencies(
    dim: int, *, short_factor: Sequence[float], long_factor: Sequence[float],
    original_max_position_embeddings: int, seq_len: int, factor: float,
    rope_theta: float = 10000.0, attention_factor: float | None = None,
) -> RotaryFrequencies:
    """LongRoPE (Phi-3 and later): the default rates, each divided by its own factor.

    ``long_factor`` serves a sequence longer than ``original_max_position_embeddings``
    (``seq_len`` decides, as transformers decides by the running sequence length),
    ``short_factor`` one up to that length. ``attention_factor`` defaults to
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 when ``factor <= 1``).
    """
    dim = _rotary_dim(dim)
    count = (dim + 1) // 2
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    length = _count("seq_len", seq_len)
    factor = _positive("factor", factor)
    base = _positive("rope_theta", rope_theta)
    if length > original:
        pair_factors = _factor_list("long_factor", long_factor, count)
    else:
        pair_factors = _factor_list("short_factor", short_factor, count)
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        elif original < 2:
            raise RoPEError(
                "original_max_position_embeddings must be >= 2 to derive LongRoPE's attention "
                f"factor (it divides by its log), got {original}"
            )
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    rates = 1.0 / (pair_factors * base ** exponents)
    return RotaryFrequencies(
        rates, attention_factor=attention_factor, rope_type="longrope", max_positions=length
    )


def llama3_frequencies(
    dim: int, *, factor: float, original_max_position_embeddings: int,
    low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, rope_theta: float = 10000.0,
) -> RotaryFrequencies:
    """Llama 3.1's rates: by wavelength ``2 pi / rate``. Wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their rate, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the
    band between blends the two linearly in ``original / wavelength``."""
    dim = _rotary_dim(dim)
    factor = _positive("factor", factor)
    original = _count("original_max_position_embeddings", original_max_position_embeddings)
    low = _positive("low_freq_factor", low_freq_factor)
    high = _positive("high_freq_factor", high_freq_factor)
    if high <= low:
        raise RoPEError(
            f"high_freq_factor must be greater than low_freq_factor, got high_freq_factor={high} "
            f"and low_freq_factor={low}"
        )
    rates = _cpu_rates(dim, _positive("rope_theta", rope_theta))
    wavelengths = 2 * math.pi / rates
    kept_below, scaled_above = original / high, original / low
    scaled = torch.where(wavelengths > scaled_above, rates / factor, rates)
    blend = (original / wavelengths - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelengths >= kept_below) & (wavelengths <= scaled_above)
    return RotaryFrequencies(torch.where(between, blended, scaled), rope_type="llama3")


def _te_position_scale(
    max_positions: int, seq_len_interpolation_factor: float | None,
    pretrained_max_position_embeddings: int | None,
) -> float:
    """TransformerEngine's position interpolation as a factor on positions (1.0: none).

    It applies only when both options are set: ``1 / factor``, or, for a table longer than
    ``pretrained * factor``, ``pretrained / max_positions`` (the table then just fits).
    """
    if seq_len_interpolation_factor is None or pretrained_max_position_embeddings is None:
        return 1.0
    if max_positions > pretrained_max_position_embeddings * seq_len_interpolation_factor:
        return 1 / (max_positions / pretrained_max_position_embeddings)
    return 1 / seq_len_interpolation_factor


def from_te_options(
    dim: int, max_positions: int, *, rotary_percent: float = 1.0,
    seq_len_interpolation_factor: float | None = None,
    pretrained_max_position_embeddings: int | None = None, rotary_base: float = 10000.0,
    device: _DeviceLike = None,
) -> RotaryFrequencies:
    """The rates of TE's ``RotaryPositionEmbedding(dim, rotary_percent,
    seq_len_interpolation_factor, pretrained_max_position_embeddings, rotary_base)`` for a
    table of ``max_positions`` rows.

    ``angle_table(max_positions, interleaved=...)`` then equals that module's
    ``forward(max_positions)`` bit for bit when the rates are computed on the same device
    (``device``; TE uses the current CUDA device, ``None`` means torch's default device).
    Interpolation (both options set) scales positions, not rates, by ``1 / factor``, or by
    ``pretrained / max_positions`` for a table longer than ``pretrained * factor``: the scale
    depends on ``max_positions``, so the result records that length.
    """
    dim = _rotary_dim(dim)
    length = _count("max_positions", max_positions)
    percent = _positive("rotary_percent", rotary_percent)
    if percent > 1.0:
        raise RoPEError(f"rotary_percent must be in (0, 1], got {rotary_percent!r}")
    if percent < 1.0:
        dim = _rotary_dim(
            int(dim * percent), f"the rotary dim int(dim * rotary_percent) = int({dim} * {percent})"
        )
    if seq_len_interpolation_factor is not None:
        seq_len_interpolation_factor = _positive(
            "seq_len_interpolation_factor", seq_len_interpolation_factor
        )
    if pretrained_max_position_embeddings is not None:
        _count("pretrained_max_position_embeddings", pretrained_max_position_embeddings)
    interpolating = (
        seq_len_interpolation_factor is not None and pretrained_max_position_embeddings is not None
    )
    scale = _te_position_scale(
        length, seq_len_interpolation_factor, pretrained_max_position_embeddings
    )
    rates = inverse_frequencies(dim, _positive("rotary_base", rotary_base), device=device)
    return RotaryFrequencies(
        rates, rope_type="linear" if interpolating else "default", position_scale=scale,
        max_positions=length if interpolating else None,
    )


# --- reading a Hugging Face config --------------------------------------------------------------
# Duck-typed: any object with transformers' attribute names works, and transformers is never
# imported. Where a value lives and what it defaults to follow transformers 5.23's
# modeling_rope_utils (RotaryEmbeddingConfigMixin.standardize_rope_params and the functions of
# ROPE_INIT_FUNCTIONS).


def _hf_rope_parameters(config: object, layer_type: str | None) -> tuple[dict, str]:
    """A copy of the config's flat rope parameters, and how to name them in messages."""
    where = "config.rope_parameters"
    parameters = getattr(config, "rope_parameters", None)
    if not parameters and getattr(config, "rope_scaling", None):  # a transformers 4 config
        where, parameters = "config.rope_scaling", config.rope_scaling  # type: ignore[attr-defined]
    parameters = parameters or {}
    if not isinstance(parameters, Mapping):
        raise RoPEError(f"{where} must be a mapping of rope parameters, got {parameters!r}")
    per_layer = bool(parameters) and all(
        value is None or isinstance(value, Mapping) for value in parameters.values()
    )
    if layer_type is None:
        if per_layer:
            raise RoPEError(
                f"{where} holds rope parameters per layer type ({', '.join(map(repr, parameters))}); "
                "pass layer_type= to choose one"
            )
        return dict(parameters), where
    if not per_layer or layer_type not in parameters:
        known = f"its layer types are {', '.join(map(repr, parameters))}" if per_layer else (
            "they are not given per layer type"
        )
        raise RoPEError(f"layer_type={layer_type!r} is not in {where}: {known}")
    if parameters[layer_type] is None:
        raise RoPEError(
            f"{where}[{layer_type!r}] is None: layers of type {layer_type!r} use no rotary embedding"
        )
    return dict(parameters[layer_type]), f"{where}[{layer_type!r}]"


def _hf_attribute(config: object, name: str) -> object:
    """``config.<name>``, ``None`` when unset; a RoPEError where the config holds it per layer
    (transformers raises a RuntimeError when the global value of a per-layer attribute is read)."""
    try:
        return getattr(config, name, None)
    except RuntimeError as error:
        raise RoPEError(
            f"config.{name} differs between layers ({error}); pass layer_type= or the layer's own "
            "config (config.per_layer_config[i])"
        ) from error


def _hf_layer_config(config: object, layer_type: str | None) -> object:
    """The config transformers reads a model's rotary embedding from: the text model's of a
    composite (vision-language) config, and of a heterogeneous config the one of
    ``layer_type``'s layers (``config.per_layer_config[layer_type]``), where head dims may
    differ between layer types."""
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        config = text_config() or config
    if layer_type is not None:
        per_layer = getattr(config, "per_layer_config", None)
        if per_layer is not None:
            try:
                return per_layer[layer_type]
            except (KeyError, IndexError, TypeError, ValueError):
                pass  # not a per-layer-type config: transformers reads the config itself
    return config


def _hf_head_dim(config: object) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when it is unset."""
    head_dim = _hf_attribute(config, "head_dim")
    if head_dim is None:
        hidden = _hf_attribute(config, "hidden_size")
        heads = _hf_attribute(config, "num_attention_heads")
        if hidden is None or heads is None:
            raise RoPEError(
                "config must have head_dim, or hidden_size and num_attention_heads; got "
                f"head_dim=None, hidden_size={hidden!r}, num_attention_heads={heads!r}"
            )
        head_dim = _count("config.hidden_size", hidden) // _count("config.num_attention_heads", heads)
    return _count("config.head_dim", head_dim)


def from_hf_config(
    config: object, max_positions: int, *, layer_type: str | None = None
) -> RotaryFrequencies:
    """The rotary frequencies of a Hugging Face model config, as transformers 5.23 computes them.

    Reads ``config.rope_parameters`` (``rope_type`` and its fields; ``config.rope_scaling`` for
    transformers 4 configs) with ``rope_theta``, ``partial_rotary_factor``, ``head_dim`` (or
    ``hidden_size // num_attention_heads``) and ``max_position_embeddings``, with transformers'
    defaults. The rotary dim is ``int(head_dim * partial_rotary_factor)``; every family honours
    ``partial_rotary_factor`` (as GPT-NeoX, Phi or GLM do; Llama's own default ignores it).
    ``layer_type`` picks one entry of per-layer-type parameters (Gemma 3's
    ``"sliding_attention"`` and ``"full_attention"``), and of a heterogeneous config (Gemma 4's,
    EmbeddingGemma 2's) that layer type's own config, with its own head dim. A composite
    (vision-language) config is read through its ``get_text_config()``. A config with a
    ``rotary_dim`` field (GPT-J, CodeGen) rotates that many channels; those models rotate
    interleaved pairs (``RoPESpec(interleaved=True)``). LongRoPE's ``short_mscale`` and
    ``long_mscale`` (Phi-3.5-MoE) are its attention factor up to and beyond
    ``original_max_position_embeddings``, as that model's rotary embedding applies them.

    ``max_positions`` is the length of the sequence the table serves. Dynamic NTK and LongRoPE
    choose their rates by it, as transformers does for a sequence of that length: dynamic NTK
    keeps the default rates up to ``max_position_embeddings`` and rescales for anything longer;
    LongRoPE uses ``short_factor`` up to ``original_max_position_embeddings`` and
    ``long_factor`` beyond. The result records that length (``max_positions``) for those
    families. Then::

        f = rope_dispatch.tables.from_hf_config(model.config, 4096)
        table = f.cos_sin_cache(4096, device="cuda")  # attention factor included

    Raises :class:`~rope_dispatch.RoPEError` for an unsupported ``rope_type`` (naming the
    supported ones: :data:`HF_ROPE_TYPES`), a missing field, or a value out of range.
    """
    length = _count("max_positions", max_positions)
    if layer_type is not None and not isinstance(layer_type, str):
        raise RoPEError(f"layer_type must be a layer type's name (a str) or None, got {layer_type!r}")
    config = _hf_layer_config(config, layer_type)
    parameters, where = _hf_rope_parameters(config, layer_type)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in HF_ROPE_TYPES:
        raise RoPEError(
            f"{where}['rope_type'] is {rope_type!r}; rope-dispatch builds tables for the rope "
            f"types {', '.join(map(repr, HF_ROPE_TYPES))}"
        )

    def value(key: str, fallback: object = None) -> object:
        found = parameters.get(key)
        return fallback if found is None else found

    def required(key: str) -> object:
        if parameters.get(key) is None:
            raise RoPEError(f"{where} has no {key!r}, which rope_type {rope_type!r} needs")
        return parameters[key]

    def max_position_embeddings() -> int:
        found = _hf_attribute(config, "max_position_embeddings")
        if found is None:
            raise RoPEError(
                f"config has no max_position_embeddings, which rope_type {rope_type!r} needs"
            )
        return _count("config.max_position_embeddings", found)

    def original_max_position_embeddings() -> int:
        # transformers gives a config attribute of this name priority (Phi-3 keeps it there).
        found = None
        if layer_type is None:
            found = _hf_attribute(config, "original_max_position_embeddings")
        if found is None:
            found = parameters.get("original_max_position_embeddings")
        return max_position_embeddings() if found is None else found

    theta = value("rope_theta", _hf_attribute(config, "rope_theta"))
    if theta is None:
        theta = _hf_attribute(config, "default_theta") or 10000.0
    partial = value("partial_rotary_factor", _hf_attribute(config, "partial_rotary_factor"))
    partial = 1.0 if partial is None else _positive(f"{where}['partial_rotary_factor']", partial)
    if partial > 1.0:
        raise RoPEError(f"{where}['partial_rotary_factor'] must be in (0, 1], got {partial!r}")
    head_dim = _hf_head_dim(config)
    dim = int(head_dim * partial)
    rotary_dim = _hf_attribute(config, "rotary_dim")
    if rotary_dim is not None:  # GPT-J, CodeGen: the rotated channels, given outright
        dim = _count("config.rotary_dim", rotary_dim)
        if dim > head_dim:
            raise RoPEError(
                f"config.rotary_dim={dim} is more than the head dim {head_dim}; expected at most that"
            )
    if dim < 2:
        raise RoPEError(
            f"the rotary dim int(head_dim * partial_rotary_factor) = int({head_dim} * {partial}) "
            f"= {dim} must be >= 2"
        )

    try:
        if rope_type == "default":
            return default_frequencies(dim, rope_theta=theta)
        if rope_type == "linear":
            return linear_frequencies(dim, factor=required("factor"), rope_theta=theta)
        if rope_type == "dynamic":
            # transformers rescales beyond max_position_embeddings (not the original length).
            return dynamic_ntk_frequencies(
                dim, factor=required("factor"), max_position_embeddings=max_position_embeddings(),
                seq_len=length, rope_theta=theta,
            )
        original = original_max_position_embeddings()
        if rope_type == "llama3":
            return llama3_frequencies(
                dim, factor=required("factor"), original_max_position_embeddings=original,
                low_freq_factor=required("low_freq_factor"),
                high_freq_factor=required("high_freq_factor"), rope_theta=theta,
            )
        original = _count("original_max_position_embeddings", original)
        # yarn and longrope derive a missing factor from the two lengths.
        factor = value("factor")
        if factor is None:
            factor = max_position_embeddings() / original
        if rope_type == "yarn":
            truncate = parameters.get("truncate", True)
            return yarn_frequencies(
                dim, factor=factor, original_max_position_embeddings=original, rope_theta=theta,
                beta_fast=value("beta_fast") or 32.0, beta_slow=value("beta_slow") or 1.0,
                mscale=value("mscale"), mscale_all_dim=value("mscale_all_dim"),
                attention_factor=value("attention_factor"),
                truncate=False if truncate is None else truncate,
            )
        # Phi-3.5-MoE gives its attention factor for each regime; its rotary embedding applies
        # the one of the running length (transformers 5.23 then keeps short_factor's rates at
        # any length, which its Phi-3 models and this function switch by that length).
        mscale = value("long_mscale" if length > original else "short_mscale")
        return longrope_frequencies(
            dim, short_factor=required("short_factor"), long_factor=required("long_factor"),
            original_max_position_embeddings=original, seq_len=length, factor=factor,
            rope_theta=theta, attention_factor=value("attention_factor") if mscale is None else mscale,
        )
    except RoPEError as error:
        if str(error).startswith("config"):  # already names the config field
            raise
        raise RoPEError(f"{where} (rope_type {rope_type!r}): {error}") from error
