"""Rotary table kinds: the float32 angle table ``freqs``, the optional precomputed cos/sin
caches, and rate tables (the rates an angle table is made of, for kernels that multiply them
out); their kernel forms and addresses, and the angle table's builder. Public through
:mod:`rope_dispatch.tables`."""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .errors import RoPEError, RoPETypeError
from .tracing import distributed, fake, memoryless


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
            f"PairCosSinCache's table must be contiguous, got strides {table.stride()}; pass a "
            "contiguous one (.contiguous())"
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

    The rates must be finite (a NaN or infinite one is refused). They are copied at
    construction (``inv_freq`` twice over, ``[d2]``, the form the kernels read); changing
    ``inv_freq`` in place afterwards changes nothing: build a new
    RateTable. They are constants, as an angle table's entries are: no gradient flows to
    ``inv_freq``. Backends that read whole angle tables (compile, TransformerEngine) get
    :meth:`angle_table`, made on first use and kept on the object: ``rows x d2`` float32
    values per layout (halves, interleaved) used; eager computes the angles of the positions a
    call reads (:meth:`angles_at`).

    ``precise=True`` (opt-in; its table kind is ``"precise_rates"``): each angle is the exact
    float64 product ``p * inv_freq[k]``, reduced modulo 2*pi before its sine and cosine, so
    the rotation is right to float32 rounding at every position, where the float32 product
    is off by up to 0.03 rad at 2^20 and 0.38 rad at 2^24 - 1 (d 128, base 10000). Not what
    models trained on float32 products saw; ``rows`` is then at most 2^24 (every position a
    float32 whole number). The kernels read each rate as its fraction of a turn
    (:func:`turn_fractions`); :meth:`angle_table` holds the reduced angles, in ``[-pi, pi]``.
    """

    inv_freq: torch.Tensor
    rows: int
    precise: bool = False

    def __post_init__(self) -> None:
        rates = self.inv_freq
        if not isinstance(rates, torch.Tensor):
            raise RoPEError(
                f"RateTable's inv_freq must be a float32 tensor [d2 / 2], got {type(rates).__name__}"
            )
        if distributed(rates):
            raise RoPEError(
                "RateTable's inv_freq must be a plain tensor, got a DTensor; build it of a plain "
                "tensor (every rank computes the same rows from the same rates), for DTensor "
                "inputs too"
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
        # NaN or infinite rates: NaN or infinite angles at every position (not read where the
        # rates have no memory: meta or fake tensors, a trace, a torch.func transform; nor while
        # a CUDA graph captures, where no value may be read)
        if not (memoryless() or rates.is_meta or fake(rates) or (
                rates.is_cuda and torch.cuda.is_current_stream_capturing())):
            refuse_non_finite(rates, "RateTable's inv_freq")
        rows, d2 = self.rows, 2 * rates.numel()
        most = ((1 << 63) - 1) // d2  # the kernels' [rows, d2] view counts its elements in int64
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not (
            1 <= rows <= most
        ):
            raise RoPEError(
                f"RateTable's rows must be a positive int with rows x d2 below 2**63 (positions "
                f"0 .. rows - 1 are inside the table, int64 positions; the kernels' [rows, d2] "
                f"view is an int64-sized tensor): at most {most} for d2 {d2}, got {rows!r}"
            )
        rows = int(rows)  # a NumPy integer, as sizes elsewhere
        object.__setattr__(self, "rows", rows)
        precise = self.precise
        if type(precise) is not bool:
            raise RoPETypeError(
                f"RateTable's precise must be a bool (True: exact angles reduced modulo 2*pi; "
                f"False: float32 products, as angle tables hold), got {precise!r} "
                f"({type(precise).__name__})"
            )
        if precise and rows > PRECISE_MAX_ROWS:
            raise RoPEError(
                f"RateTable's rows must be at most {PRECISE_MAX_ROWS} (2**24) with precise=True "
                f"(positions from 2**24 on are not all float32 whole numbers, and the exact "
                f"angle is promised below it), got rows={rows}"
            )
        # The rates twice over, [d2], and what the kernels read: a [rows, d2] view of them with
        # a row stride of 0 (its shape gives the launcher the table length and the rotary dim),
        # for a precise table of their fractions of a turn (int64, which tells the kernels).
        # Constants, like an angle table's entries: no graph back to inv_freq, and a normal
        # tensor even when made under inference mode (autograd may save it later).
        with _normal_tensors():
            doubled = torch.cat((rates.detach(), rates.detach())).contiguous()
            read = turn_fractions(doubled) if precise else doubled
        object.__setattr__(self, "_kernel_rates", doubled)
        object.__setattr__(self, "_kernel_view", read.as_strided((rows, read.shape[0]), (0, 1)))
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
        the object (``rows x d2`` floats per layout): a precise table's angles reduced modulo
        2*pi from float64 (:func:`reduced_angle_table`). Do not write to it."""
        _check_interleaved(interleaved)  # (before the lookup: 1 would find True's table)
        angles = self._angles.get(interleaved)  # type: ignore[attr-defined]
        if angles is None:
            n = self.inv_freq.shape[0]
            build = reduced_angle_table if self.precise else angle_table
            if memoryless():  # a traced graph (or a torch.func transform) computes it: not kept
                return build(self._kernel_rates[:n], self.rows,  # type: ignore[attr-defined]
                             interleaved=interleaved)
            # a first call under inference mode keeps no inference tensor, and no dispatch mode
            # sees it made, its rates' slice included (a selective checkpoint would count it
            # as the first call's, which its recomputation, finding it kept, does not make)
            with _normal_tensors(), _disable_current_modes():
                angles = build(self._kernel_rates[:n], self.rows,  # type: ignore[attr-defined]
                               interleaved=interleaved)
            self._angles[interleaved] = angles  # type: ignore[attr-defined]
        return angles

    def angles_at(self, pos: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        """float32 angles ``[..., d2]`` at integer positions ``pos`` ``[...]``: rows ``pos`` of
        :meth:`angle_table` (the same products, bit for bit) without making the table, NaN at
        positions outside ``0 .. rows - 1``."""
        rates = self._kernel_rates[: self.inv_freq.shape[0]]  # type: ignore[attr-defined]
        return _layout(self._products(pos.unsqueeze(-1), rates), interleaved)

    def _products(self, pos: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        """The table's float32 angles ``pos * rates`` (broadcast; a precise table's reduced
        from float64), NaN where ``pos`` lies outside ``0 .. rows - 1``."""
        with _autocast_off(pos.device.type):
            if self.precise:
                angles = _reduced(pos.double() * rates.double())
            else:
                angles = pos.float() * rates
        return torch.where((pos >= 0) & (pos < self.rows), angles, float("nan"))

    def angle_rows(self, interleaved: bool = False) -> torch.Tensor:
        """:meth:`angle_table` as ``[rows, d2]`` (a view): what backends that gather table rows
        read."""
        angles = self.angle_table(interleaved)
        return angles.view(angles.shape[0], angles.shape[3])


PRECISE_MAX_ROWS = 1 << 24
"""The most rows a precise :class:`RateTable` has: positions below 2^24."""


def _two_pi_scaled(bits: int) -> int:
    """``round(2 * pi * 2**bits)``, from Machin's ``pi = 16 atan(1/5) - 4 atan(1/239)`` in
    integers (16 guard bits cover the truncation of each series term)."""
    guard = bits + 16

    def atan_inverse(x: int) -> int:  # atan(1 / x) * 2**guard
        term = total = (1 << guard) // x
        n, sign = 1, 1
        while term:
            term //= x * x
            n, sign = n + 2, -sign
            total += sign * (term // n)
        return total

    pi = 16 * atan_inverse(5) - 4 * atan_inverse(239)
    return (2 * pi + (1 << 15)) >> 16


_TWO_PI_BITS = 192
_TWO_PI = _two_pi_scaled(_TWO_PI_BITS)


def turn_fractions(rates: torch.Tensor) -> torch.Tensor:
    """Each float32 rate's fraction of a turn, ``rate / (2 * pi)`` modulo 1, rounded to 64-bit
    fixed point: int64 (the bits of the unsigned fraction), on ``rates``' device. A whole
    position times it modulo 2^64 is that position's angle modulo 2*pi, in units of 2^-64
    turn, off by at most the position times 2^-65 (what a precise :class:`RateTable`'s kernels
    read)."""
    fractions = []
    for rate in rates.tolist():
        if not math.isfinite(rate):
            raise RoPEError(
                f"a precise RateTable's inv_freq must be finite (each rate's fraction of a turn "
                f"is computed exactly), got {rate!r} among its rates"
            )
        num, den = float(rate).as_integer_ratio()
        twice = (num << (65 + _TWO_PI_BITS)) // (den * _TWO_PI)  # 2 * rate / 2pi * 2^64
        unsigned = ((twice + 1) >> 1) % (1 << 64)
        fractions.append(unsigned - (1 << 64) if unsigned >> 63 else unsigned)
    return torch.tensor(fractions, dtype=torch.int64, device=rates.device)


RotaryTable = torch.Tensor | CosSinCache | PairCosSinCache | RateTable

TABLE_KINDS = {
    torch.Tensor: "angles",
    CosSinCache: "cos_sin_cache",
    PairCosSinCache: "pair_cos_sin_cache",
    RateTable: "rates",
}
"""A checked table's kind by its type (an angle table is a plain ``[s2, d2]`` tensor); a
precise RateTable's is ``"precise_rates"`` (:func:`table_kind`)."""


def table_kind(table: RotaryTable) -> str:
    """``"angles"``, ``"cos_sin_cache"``, ``"pair_cos_sin_cache"``, ``"rates"`` or, for a
    RateTable made with ``precise=True``, ``"precise_rates"``: a kind of its own, so a backend
    serves it only where it says so, and decisions, plans and tuning keys (which carry the
    kind) keep precise and float32-product tables apart."""
    kind = TABLE_KINDS.get(type(table), "angles")
    return "precise_rates" if kind == "rates" and table.precise else kind  # type: ignore[union-attr]


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


def _streams_of_channels(sections: tuple[int, int, int], interleaved: bool,
                         device: torch.device) -> torch.Tensor:
    """Which position stream (0 temporal, 1 height, 2 width) each of the ``d2`` rotary channels
    reads, the same in each half (a pair's two channels share a stream); made once per device.
    Contiguous (Qwen2-VL): the first ``t`` pairs temporal, the next ``h`` height, the last ``w``
    width. Interleaved (Qwen3-VL): pair ``j`` height where ``j % 3 == 1 and j < 3 h``, width
    where ``j % 3 == 2 and j < 3 w``, else temporal."""
    key = (sections, interleaved, device)
    streams = _channel_streams.get(key)
    if streams is None:
        if interleaved:
            _, h, w = sections
            half = [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
                    for j in range(sum(sections))]
        else:
            half = [stream for stream, count in enumerate(sections) for _ in range(count)]
        if memoryless():  # fake tensors (a FakeTensorMode's, a trace's): made here, not kept
            return torch.tensor(half + half, dtype=torch.long).to(device)
        with _disable_current_modes():  # (as RateTable.angle_table)
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


def _rate_rows(table: RateTable, rows: torch.Tensor) -> torch.Tensor:
    """:func:`_gather_rows` of a rate table's halves :meth:`~RateTable.angle_rows`, each angle
    computed from its channel's rate instead (the same values, bit for bit), so no table of
    ``rows x d2`` floats is made: a rate table may have any number of rows."""
    rates = table._kernel_rates[:, None]  # type: ignore[attr-defined]  # [d2, 1], halves
    return table._products(rows, rates).t().contiguous()


def multimodal_rows(
    table: RotaryTable, streams: torch.Tensor, sections: tuple[int, int, int],
    interleaved: bool = False,
) -> RotaryTable:
    """A table of the same kind with one row per token for multimodal RoPE (Qwen2-VL):
    channel ``c`` of token ``t``'s row is the table's channel ``c`` at ``streams[s, t]``, where
    ``s`` is the stream of ``c``'s section (``sections`` = temporal, height, width channel
    counts of each half, summing to ``d2 / 2``; ``interleaved``: Qwen3-VL's order of the
    sections across the pairs, see :func:`_streams_of_channels`). ``streams`` is ``[3, tokens]``.
    A pair cache's cosine and sine of pair ``k`` share the stream, as the two channels of the
    pair do. A rate table gives an angle table (the rows of its halves
    :meth:`RateTable.angle_table`, computed from the rates: multimodal RoPE rotates halves)."""
    channel_streams = _streams_of_channels(tuple(sections), interleaved, table.device)
    rows = streams.long()[channel_streams]  # [d2, tokens]
    if rows.shape[1] == 0:  # no tokens: one row (a cache has at least one), which none reads
        rows = rows.new_zeros(rows.shape[0], 1)
    if isinstance(table, CosSinCache):
        return CosSinCache(_gather_rows(table.cos, rows), _gather_rows(table.sin, rows))
    if isinstance(table, PairCosSinCache):
        return PairCosSinCache(_gather_rows(table.table, rows))
    if isinstance(table, RateTable):
        return _rate_rows(table, rows)
    return _gather_rows(table, rows)


def _cos_sin_address(table: CosSinCache) -> tuple[int, int]:
    return table.cos.data_ptr(), table.sin.data_ptr()


def _pair_address(table: PairCosSinCache) -> int:
    return table.table.data_ptr()


def _rates_address(table: RateTable) -> int:
    """The address of the doubled rates (or fractions of a turn) the kernels read."""
    return table._kernel_view.data_ptr()  # type: ignore[attr-defined]


def _tensor_address(table: torch.Tensor) -> int:
    return table.data_ptr()


_ADDRESS_READERS: dict[type, Callable[[Any], int | tuple[int, int]]] = {
    CosSinCache: _cos_sin_address, PairCosSinCache: _pair_address, RateTable: _rates_address,
}


def address_reader(table: object) -> Callable[[Any], int | tuple[int, int]]:
    """:func:`table_address` for tables of ``table``'s type, with no type tests of its own: what
    a plan, made for one table object, calls on every call it serves."""
    return _ADDRESS_READERS.get(type(table), _tensor_address)


def refuse_non_finite(rates: torch.Tensor, name: str) -> None:
    """Refuse 1-D ``rates`` (the argument ``name``) holding a NaN or an infinity, whose angles
    would be NaN or infinite at every position; the error names the first."""
    finite = torch.isfinite(rates)
    if not bool(finite.all()):
        pair = int((~finite).nonzero()[0, 0])
        raise RoPEError(
            f"{name} must hold finite rates (the angles would be NaN or infinite at every "
            f"position), got {rates[pair].item()!r} at pair {pair} of {rates.numel()}"
        )


def table_tensors(table: object) -> tuple[torch.Tensor, ...]:
    """The caller's tensors a table holds: an angle table, a cache's members (a RateTable's
    rates are copied constants: none)."""
    if isinstance(table, torch.Tensor):
        return (table,)
    if isinstance(table, CosSinCache):
        return table.cos, table.sin
    if isinstance(table, PairCosSinCache):
        return (table.table,)
    return ()


def table_requires_grad(table: object) -> bool:
    """Whether a gradient is asked of the table: one of its tensors (:func:`table_tensors`)
    requires grad."""
    for t in table_tensors(table):
        if t.requires_grad:
            return True
    return False


def table_address(table: object) -> int | tuple[int, int]:
    """Where a table's memory is (a plan checks it was not replaced with ``.data = ...``)."""
    return address_reader(table)(table)


# id(freqs) -> (weak reference to freqs, its address, its checked shape): tables checked
# lately. No tensor is held (a view would keep its base alive), so a table is freed as soon as
# its owner drops it, and its entry with it. The shape is part of the entry: resize_ to fewer
# elements keeps the address.
_recent_tables: dict[int, tuple[weakref.ref, int, torch.Size]] = {}


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
    if memoryless():
        return _angles_2d(freqs, argument)
    key = id(freqs)
    hit = _recent_tables.get(key)
    if hit is not None and hit[0]() is freqs and hit[1] == freqs.data_ptr():
        shape = freqs.shape
        if shape == hit[2] and freqs.is_contiguous():
            return freqs.view(shape[0], shape[3]) if len(shape) == 4 else freqs
    table = _angles_2d(freqs, argument)
    if fake(freqs):  # a fake tensor used outside its mode: no memory, nothing to remember
        return table
    if table.data_ptr() == freqs.data_ptr():  # a view, not a copy: worth remembering
        if len(_recent_tables) >= 8:
            _recent_tables.clear()
        _recent_tables[key] = (
            weakref.ref(freqs, lambda ref: _forget(key, ref)), freqs.data_ptr(), freqs.shape
        )
    return table


FREQUENCY_TYPES: tuple[type, ...] = ()
"""Rate objects that are not tables (``rope_dispatch.frequencies`` adds RotaryFrequencies), so
passing one where a table belongs says what to build from it."""


def add_frequency_type(kind: type) -> type:
    """Count ``kind`` among :data:`FREQUENCY_TYPES` (a class decorator)."""
    global FREQUENCY_TYPES
    FREQUENCY_TYPES += (kind,)
    return kind


def _angles_2d(freqs: torch.Tensor, argument: str) -> torch.Tensor:
    if isinstance(freqs, FREQUENCY_TYPES):
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
    if isinstance(freqs, (CosSinCache, PairCosSinCache, RateTable)):
        what = (
            "its angles are rates.angle_table(interleaved=...), in the layout of the calls"
            if isinstance(freqs, RateTable)
            else "it is a cos/sin table already: pass it as freqs as it is"
        )
        raise RoPETypeError(
            "cos_sin_cache takes an angle table (a float32 tensor [s2, 1, 1, d2] or [s2, d2]), "
            f"got a {type(freqs).__name__}; {what}"
        )
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
        return pair_channels(cos, interleaved), pair_channels(sin, interleaved)
    return torch.cos(table), torch.sin(table)


def pair_channels(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A pair cache's cosines or sines ``[.., d2 / 2]`` as one value per channel ``[.., d2]``:
    each pair's value given to both its channels (``2k`` and ``2k + 1`` when interleaved, ``k``
    and ``k + d2 / 2`` otherwise)."""
    return x.repeat_interleave(2, dim=-1) if interleaved else torch.cat((x, x), dim=-1)


# --- building angle tables --------------------------------------------------------------------
# The float32 operations below, in this order, are those of TransformerEngine 2.20.2's
# RotaryPositionEmbedding, so a table built here on a device equals TE's on that device bit for
# bit (tests/test_compat_te.py). Options that choose a position scale (TE's interpolation,
# later other models' rules) compute it outside and pass it in as ``scale``.


def _count(argument: str, value: object) -> int:
    """``value`` as a positive int, or a RoPEError naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RoPEError(f"{argument} must be a positive int, got {value!r}")
    return int(value)


def _positive(argument: str, value: object) -> float:
    """``value`` as a finite float > 0 (a Python or NumPy number), or a RoPEError naming
    ``argument``."""
    number = float("nan")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float64's range: no finite float either
            pass
    if not 0 < number < float("inf"):
        raise RoPEError(f"{argument} must be a finite number > 0, got {value!r}")
    return number


FLOAT32_MAX = torch.finfo(torch.float32).max


def _base(argument: str, value: object) -> float:
    """A rotary base: a finite number > 0 that float32 holds. The rates are float32 powers of
    it; a larger one is infinite in float32 (every rate but the first would be 0), one below
    float32's smallest number is 0 there (every rate but the first would be infinite)."""
    base = _positive(argument, value)
    if not 2.0**-149 <= base <= FLOAT32_MAX:
        raise RoPEError(
            f"{argument} must be within float32's range, {2.0**-149:.6g} to {FLOAT32_MAX:.6g} "
            f"(the rates are float32 powers of it; beyond, every rate but the first is 0 or "
            f"infinite), got {value!r}"
        )
    return base


def _rotary_dim(dim: object, argument: str = "dim (the rotary dim)", least: int = 2) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < least:
        raise RoPEError(f"{argument} must be an int >= {least}, got {dim!r}")
    return int(dim)


def inverse_frequencies(
    dim: int, base: float = 10000.0, *, device: torch.device | str | int | None = None
) -> torch.Tensor:
    """float32 ``[ceil(dim / 2)]`` rotation rates ``1 / base ** (2k / dim)``, ``k = 0, 1, ...``.

    ``dim`` is the rotary dim (the table's last dim is ``2 * len(result)``); ``device`` is
    where the result lives (``None``: torch's default device). The exponent ``2k / dim`` and
    the power are float32, as in TransformerEngine.
    """
    dim = _rotary_dim(dim, least=1)  # an odd dim is rounded up: 1 gives one rate, as in TE
    base = _base("base", base)
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


def _check_rates(inv_freq: object) -> None:
    """Refuse anything but a 1-D floating-point tensor of rates, naming ``inv_freq``; on the
    CPU (values read with no device sync) a NaN or infinite rate too, which would fill its
    pair's columns with NaN or infinite angles."""
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or not (
        inv_freq.is_floating_point()
    ):
        raise RoPEError(
            "inv_freq must be a 1-D floating-point tensor of rates, got "
            + (f"{inv_freq.dtype} {tuple(inv_freq.shape)}" if isinstance(inv_freq, torch.Tensor)
               else type(inv_freq).__name__)
        )
    if inv_freq.is_cpu and not (memoryless() or fake(inv_freq)):
        refuse_non_finite(inv_freq, "inv_freq")


def angle_table(
    inv_freq: torch.Tensor, length: int, *, offset: int | float = 0, scale: float = 1.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """The angle table ``freqs`` ``[length, 1, 1, 2n]`` of rates ``inv_freq`` ``[n]``.

    Row ``p`` holds the angles of position ``(p + offset) * scale``, each rate once per
    rotated pair: ``[a_0 .. a_{n-1}, a_0 .. a_{n-1}]`` (the two halves, NeoX style) or, with
    ``interleaved``, ``[a_0, a_0, a_1, a_1, ...]``. ``scale`` shrinks positions (linear
    interpolation: ``1 / factor``); ``1.0`` leaves them unscaled. The result has ``inv_freq``'s
    dtype (float32, or float64; half-precision rates are refused: positions counted in them
    would be rounded) and device, is contiguous, and is computed with autocast off.
    ``offset`` must be a finite number (negative ones too: TE takes any), ``scale`` a finite
    number > 0, the rates finite (read on the CPU only: no device sync).
    """
    _check_rates(inv_freq)
    if inv_freq.dtype not in (torch.float32, torch.float64):
        # its positions would be counted in that dtype: bfloat16 holds whole numbers to 256,
        # float16 to 2048, so later rows would hold the angles of rounded positions
        raise RoPEError(
            f"inv_freq must be float32 (or float64) rates, got "
            f"{str(inv_freq.dtype).removeprefix('torch.')}: the table's positions would be "
            "counted in that dtype, which rounds them; compute the rates in float32 (a model "
            "cast to half precision casts its inv_freq buffer too: inv_freq.float() keeps its "
            "rounded rates, inverse_frequencies() or tables.from_hf_config() gives them anew)"
        )
    if isinstance(length, bool) or not isinstance(length, (numbers.Integral, torch.SymInt)) or (
        length < 0
    ):
        raise RoPEError(f"length must be an int >= 0 (the table's rows), got {length!r}")
    _check_position_terms(offset, scale)
    with _autocast_off(inv_freq.device.type):
        positions = torch.arange(length, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        if scale != 1.0:
            positions = positions * scale
        angles = torch.outer(positions, inv_freq)  # one float32 multiply per entry
    angles = _layout(angles, interleaved)
    return angles.reshape(length, 1, 1, angles.shape[-1])


def _check_position_terms(offset: object, scale: object) -> None:
    """Refuse an ``offset`` that is not a finite number and a ``scale`` that is not a finite
    number > 0 (NaN or infinity would fill the table with NaN, a string or None would fail
    inside torch). Not while torch.compile traces (its ints and floats may be symbolic, which
    the checks would specialize or break on), nor symbolic sizes."""
    if torch.compiler.is_compiling():
        return
    symbolic = (torch.SymInt, torch.SymFloat)
    if not isinstance(offset, symbolic):
        if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not (
            -(2**63) < offset < 2**63 and math.isfinite(offset)
        ):
            raise RoPEError(
                f"offset must be a finite number (the first row's position), got {offset!r}"
            )
    if not isinstance(scale, symbolic):
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (
            0 < scale < math.inf
        ):
            raise RoPEError(
                f"scale must be a finite number > 0 (the factor on positions), got {scale!r}"
            )


def _check_interleaved(interleaved: object) -> None:
    """Refuse an ``interleaved`` that is not a bool (``"False"`` would pass for True)."""
    if type(interleaved) is not bool:
        raise RoPEError(f"interleaved must be a bool, got {interleaved!r}")


def _layout(angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """One angle per rate ``[..., n]`` as one per channel ``[..., 2n]``: the two halves (NeoX
    style) or, ``interleaved`` (a bool), each rate twice in a row."""
    _check_interleaved(interleaved)
    if interleaved:
        return angles.repeat_interleave(2, dim=-1)
    return torch.cat((angles, angles), dim=-1)


def _reduced(angles: torch.Tensor) -> torch.Tensor:
    """float64 angles reduced modulo 2*pi to ``[-pi, pi]``, then rounded to float32 once."""
    return (angles - torch.round(angles * (1 / math.tau)) * math.tau).float()


def reduced_angle_table(
    inv_freq: torch.Tensor, length: int, *, interleaved: bool = False
) -> torch.Tensor:
    """:func:`angle_table`'s float32 ``[length, 1, 1, 2n]`` of rates ``inv_freq`` ``[n]``
    (float32 values, or those values widened to float64), but each angle the float64 product
    ``p * inv_freq[k]`` (exact for ``p`` below 2^24) reduced modulo 2*pi to ``[-pi, pi]``,
    then rounded to float32 once: its sine and cosine are right to float32 rounding where the
    float32 product's are not (a precise :class:`RateTable`'s angles). Computed with autocast
    off, on ``inv_freq``'s device."""
    _check_rates(inv_freq)
    if isinstance(length, bool) or not isinstance(length, (numbers.Integral, torch.SymInt)) or (
        length < 0
    ):
        raise RoPEError(f"length must be an int >= 0 (the table's rows), got {length!r}")
    with _autocast_off(inv_freq.device.type):
        positions = torch.arange(length, device=inv_freq.device, dtype=torch.float64)
        angles = _reduced(torch.outer(positions, inv_freq.double()))
    angles = _layout(angles, interleaved)
    return angles.reshape(length, 1, 1, angles.shape[-1])
