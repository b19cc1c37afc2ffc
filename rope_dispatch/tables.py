"""Rotary tables: the float32 angle table ``freqs`` and the optional precomputed cos/sin cache."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from .errors import RoPEError


@dataclass(frozen=True, eq=False)
class CosSinCache:
    """float32 ``cos`` and ``sin`` of an angle table, each ``[s2, d2]`` and contiguous.

    Build it once with :func:`cos_sin_cache` and pass it wherever ``apply`` takes ``freqs``:
    kernels then read the two tables instead of evaluating sin/cos per element.
    """

    cos: torch.Tensor
    sin: torch.Tensor

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


@dataclass(frozen=True, eq=False)
class PairCosSinCache:
    """One float32 table ``[s2, d2]`` holding, for each position, the cosines of its ``d2 / 2``
    pair angles followed by their sines: the layout vLLM, SGLang and FlashInfer call
    ``cos_sin_cache``. Pair ``k`` (channels ``k`` and ``k + d2/2``, or ``2k`` and ``2k + 1`` when
    interleaved) turns by the angle whose cosine is ``table[p, k]`` and sine
    ``table[p, d2/2 + k]``. Wrap an engine's cache with it (no copy) and pass it as ``freqs``.
    """

    table: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.table.shape[0]

    @property
    def rotary_dim(self) -> int:
        return self.table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.table.device


RotaryTable = torch.Tensor | CosSinCache | PairCosSinCache

TABLE_KINDS = {
    torch.Tensor: "angles",
    CosSinCache: "cos_sin_cache",
    PairCosSinCache: "pair_cos_sin_cache",
}
"""A checked table's kind by its type (an angle table is a plain ``[s2, d2]`` tensor)."""


def table_kind(table: RotaryTable) -> str:
    """``"angles"``, ``"cos_sin_cache"`` or ``"pair_cos_sin_cache"``."""
    return TABLE_KINDS.get(type(table), "angles")


def table_shape(table: RotaryTable) -> tuple[int, int]:
    """``(rows, rotary dim)`` of a checked table of any kind."""
    if isinstance(table, torch.Tensor):
        return table.shape[0], table.shape[1]
    return table.seq_len, table.rotary_dim


def kernel_tables(table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A checked table as the kernels read it: ``(angles, None)``; ``(cos, sin)``; for a pair
    cache ``(table, table[:, d2/2:])``, a sin view half as wide as the table (one value per
    pair: that width tells the kernels the kind)."""
    if type(table) is CosSinCache:
        return table.cos, table.sin
    if type(table) is PairCosSinCache:
        t = table.table
        return t, t[:, t.shape[1] // 2 :]
    return table, None


def table_address(table: object) -> int | tuple[int, int]:
    """Where a table's memory is (a plan checks it was not replaced with ``.data = ...``)."""
    if type(table) is CosSinCache:
        return table.cos.data_ptr(), table.sin.data_ptr()
    if type(table) is PairCosSinCache:
        return table.table.data_ptr()
    return table.data_ptr()  # type: ignore[attr-defined]


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
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(
            f"{argument} must be a float32 torch.Tensor [s2, 1, 1, d2] or [s2, d2], or a "
            f"CosSinCache; got {type(freqs).__name__}"
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
    kind (a pair cache's values repeated for both channels of each pair)."""
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
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base ** exponents)


def _autocast_off(device_type: str):
    """A context that turns autocast off for ``device_type`` (where autocast exists for it)."""
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
