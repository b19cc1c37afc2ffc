"""The key of a checked call: what choosing a backend for it may depend on (:class:`CallKey`).
Dispatch keeps its decisions under it, autotune its measurements under its named fields."""

from __future__ import annotations

import ast
import bisect
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .call import RoPECall, table_grad_wanted, wants_grad
from .spec import named_fields
from .tracing import exact_size


class CallKey(NamedTuple):
    """What choosing a backend for a call may depend on: dispatch keeps its decisions under it,
    and autotune stores its measurements under its fields (:meth:`fields`) with the candidates
    and the environment. Sizes enter as power-of-two buckets."""

    spec: tuple
    """The spec's static key with ``max_seqlen`` only as set or not (``RoPESpec.choice_key``:
    a thd loop passes a new batch's longest sequence every step), then the table's rotary dim;
    traced, the key as text (``static_text``), then the rotary dim."""
    device_type: str
    device_index: int | None
    shape_bucket: tuple
    sequences_bucket: int
    stride: str
    table: str
    start_positions: bool
    positions: bool
    requires_grad: bool
    in_place: bool
    split: tuple[int, int, int] | None
    k_shape_bucket: tuple | None
    positions_bounded: bool
    """Every position known inside the table (a backend that cannot guard reads needs it)."""
    table_grad: bool
    """The table itself wants a gradient."""
    size_class: int = 0
    """Which side of every declared element-count limit the call is on (dispatch's)."""
    grid_axis: bool = False
    """A dimension passes a secondary grid axis's 65,535 blocks."""
    norms: tuple | None = None
    """The norm stages' scopes (q's, k's; ``None`` for a side without), or ``None``."""
    cache: tuple[str, str, str] | None = None
    """A cache stage's kind, cache dtype and q output dtype, and v's head dim where it differs
    from k's (``CacheWrite.form``), or ``None``."""

    def fields(self) -> dict:
        """The named JSON fields autotune stores (``in_place``, ``qkv_split``, per-token
        ``positions`` and ``k_shape_bucket`` only when set, so single-tensor calls that
        return a new tensor keep the keys of earlier versions)."""
        spec = self.spec
        if len(spec) == 2:  # a traced call's: the spec's key as text, then the rotary dim
            spec = (*ast.literal_eval(spec[0]), spec[1])
        fields = {
            "spec": named_fields(spec),  # inverse only when set
            "shape_bucket": list(self.shape_bucket),
            "sequences_bucket": self.sequences_bucket, "stride": self.stride,
            "table": self.table, "start_positions": self.start_positions,
            "requires_grad": self.requires_grad,
        }
        if self.in_place:
            fields["in_place"] = True
        if self.split is not None:
            fields["qkv_split"] = list(self.split)
        if self.positions:
            fields["positions"] = True
        if self.k_shape_bucket is not None:
            fields["k_shape_bucket"] = list(self.k_shape_bucket)
        if self.norms is not None:
            fields["norms"] = list(self.norms)
        if self.cache is not None:
            fields["cache"] = list(self.cache)
        return fields


GRID_AXIS_LIMIT = 65536


def call_key(call: RoPECall, size_limits: Sequence[int] = ()) -> CallKey:
    """The :class:`CallKey` of a checked call (traceable: plain values, sizes compared);
    ``size_limits``: the sorted element-count limits backends declare."""
    t, traced = call.t, torch.compiler.is_compiling()
    spec = ((call.spec.static_text, exact_size(call.rotary_dim)) if traced
            else (*call.spec.choice_key, call.rotary_dim))
    split = (tuple(exact_size(n) for n in call.split) if traced and call.split is not None
             else call.split)
    return CallKey(
        spec, t.device.type, t.device.index,
        tuple(size_bucket(n, traced) for n in t.shape), size_bucket(call.batch, traced),
        stride_class(t),
        call.table_kind, call.start_positions is not None, call.positions is not None,
        wants_grad(call), call.in_place, split,
        None if call.k is None else tuple(size_bucket(n, traced) for n in call.k.shape),
        call.positions_bounded, table_grad_wanted(call.table, call.k_table),
        bisect.bisect_left(size_limits, t.numel()) if size_limits else 0,
        True if max(call.seq_len, call.batch) >= GRID_AXIS_LIMIT else False,  # a guard, no symbol
        None if call.norm is None and call.k_norm is None else
        tuple(None if n is None else n.scope for n in (call.norm, call.k_norm)),
        None if call.cache_write is None else call.cache_write.form,
    )


def stride_class(t: torch.Tensor) -> str:
    """``contiguous``, ``unit-last`` (rows strided, channels packed) or ``strided``: what of a
    tensor's layout dispatch's and autotune's keys hold."""
    if t.is_contiguous():
        return "contiguous"
    return "unit-last" if t.stride(-1) == 1 else "strided"


def size_bucket(n: object, traced: bool = False) -> int:
    """The power of two at or above ``n``: the size classes dispatch and autotune key on.
    ``traced`` (torch.compile or torch.export tracing, where a symbolic size passes for an
    int): the least power of two the size is known to stay at or below (0 where nothing bounds
    it), found without guarding on it, so a dynamic size is neither specialised nor narrowed
    (``torch.export`` refuses a guard narrowing a ``Dim``'s range, and each narrowed range
    would be a recompile of its own)."""
    if not traced:
        return 1 << max(n - 1, 0).bit_length()
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    bucket = 1
    while not statically_known_true(n <= bucket):
        if bucket >= _UNBOUNDED:
            return 0
        bucket *= 2
    return bucket


_UNBOUNDED = 1 << 48
