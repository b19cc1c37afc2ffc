"""Checking one call's tensors against its spec, producing the :class:`RoPECall` backends receive.

Shape, dtype and device checks cost a few integer comparisons and always run. Checks of the
*values* inside index tensors (``cu_seqlens``, ``start_positions``) need them on the host: they
run for free on CPU tensors, where every bad value gets a clear error. On a device they would
cost a device-to-host copy per call (a sync that serving engines and CUDA graphs cannot afford),
so device values are read only in strict mode, ``ROPE_DISPATCH_CHECK_VALUES=1``
(docs/semantics.md). Unread, they are never trusted blindly: a token whose position falls
outside the table gets NaN in its rotated channels from every backend that can guard its reads,
and backends that cannot (TransformerEngine) serve only calls whose positions are known to be in
range. Nothing is read while ``torch.compile`` traces or a CUDA graph is captured.
"""

from __future__ import annotations

import numbers
import sys
from typing import NamedTuple

import torch

from .env import env_raw_reader, env_reader, switch_value
from .errors import RoPEError, RoPETypeError
from .norm import HeadNorm, NormForm, check_norm
from .spec import RoPESpec, dtype_name
from .tables import (
    CosSinCache, PairCosSinCache, RateTable, RotaryTable, angles_2d, multimodal_rows, table_kind,
    table_requires_grad, table_shape, table_tensors,
)
from .overlap import expanded_dim, refuse_written_overlaps
from .tracing import fake, memoryless


TENSOR_KINDS = {
    "t": "single tensors (apply)",
    "qk": "q and k pairs (apply_qk)",
    "qkv": "packed qkv tensors (apply_qkv)",
}
"""What a call's tensors are, and how messages name them."""


class RoPECall(NamedTuple):
    """One checked call: what every backend receives (a tuple: cheap to build per call).

    It describes its tensors (``tensors``), its table kind (``table``: ``[s2, d2]`` float32
    angles, a :class:`CosSinCache`, a :class:`PairCosSinCache` or a :class:`RateTable`) and its
    positions: by index (plus ``start_positions``, one per sequence) or given per token
    (``positions``, shaped like ``t.shape[:-2]``).
    ``seq_len`` is the local sequence length ``s`` (tokens ``T`` for thd), ``batch`` is ``b``
    (the number of sequences for thd). ``in_place``: rotate ``t``'s first ``d2`` channels in
    place and return ``t`` (:func:`~rope_dispatch.apply_`); ``grad_in_place``: its backward may
    rotate the incoming gradient in place too.

    ``positions_bounded``: every token's table row is known to lie inside the table (its index
    values were read and checked, or ``spec.max_seqlen`` promises it); when not, backends that
    guard their reads mark out-of-range rows NaN.

    ``tensors`` is ``"t"`` for one tensor ``t`` ``[.., heads, head_dim]``, or ``"qkv"`` for a
    packed ``t`` ``[.., heads, q + k + v]`` (:func:`~rope_dispatch.apply_qkv`): each of its
    ``heads`` groups holds ``split = (q, k, v)`` channels, ``head_dim = k``, so a group holds
    ``q / k`` query heads, one key head and ``v / k`` value heads; ``k_table`` rotates k (``None``:
    ``table`` does). ``"qk"`` is a pair (:func:`~rope_dispatch.apply_qk`): ``t`` is q and ``k``
    is k, with the same leading dims and head dim and any head counts (GQA, MQA) and strides;
    ``heads`` is q's.
    """

    t: torch.Tensor
    table: RotaryTable
    spec: RoPESpec
    start_positions: torch.Tensor | None
    seq_len: int
    batch: int
    heads: int
    head_dim: int
    rotary_dim: int
    in_place: bool = False
    grad_in_place: bool = False
    tensors: str = "t"
    split: tuple[int, int, int] | None = None
    k_table: RotaryTable | None = None
    positions_bounded: bool = True
    positions: torch.Tensor | None = None
    k: torch.Tensor | None = None
    norm: HeadNorm | None = None
    """The norm stage of ``t`` (q of a pair or packed call) before the rotation."""
    k_norm: HeadNorm | None = None
    """k's norm stage (a pair or packed call)."""
    cache_write: tuple | None = None
    """The cache stage of a q and k pair (:func:`~rope_dispatch.rope_to_cache`), a
    :class:`~rope_dispatch.kv_cache.CacheWrite`: rotated k and v written into a KV cache, q
    given out (FP8 where asked)."""

    @property
    def norms(self) -> tuple[NormForm | None, NormForm | None] | None:
        """The norm stages' forms (q's, k's), or ``None`` without any."""
        if self.norm is None and self.k_norm is None:
            return None
        return tuple(None if n is None else n.form for n in (self.norm, self.k_norm))

    @property
    def table_len(self) -> int:
        return table_shape(self.table)[0]

    @property
    def table_kind(self) -> str:
        """``"angles"``, ``"cos_sin_cache"``, ``"pair_cos_sin_cache"`` or ``"rates"``."""
        return table_kind(self.table)


def wants_grad(call: RoPECall) -> bool:
    """Whether the call's backward will run: grad is enabled and a tensor (``t``, ``k``) or a
    norm weight requires it."""
    if not torch.is_grad_enabled():
        return False
    if call.t.requires_grad or (call.k is not None and call.k.requires_grad):
        return True
    return any(n is not None and n.weight.requires_grad for n in (call.norm, call.k_norm))


def position_index(call: RoPECall) -> torch.Tensor | None:
    """The call's index tensor as every backend's kernels take it: ``start_positions``, 1-D
    (one per sequence), or the per-token ``positions``, 2-D in token order (``[s, b]``,
    ``[b, s]``, or ``[T, 1]`` for thd), so the two kinds never look alike."""
    positions = call.positions
    if positions is None:
        return call.start_positions
    return positions.unsqueeze(-1) if positions.dim() == 1 else positions


def k_call(call: RoPECall) -> RoPECall:
    """The k half of a ``"qk"`` call as a single-tensor call."""
    k = call.k
    return call._replace(t=k, heads=k.shape[-2], tensors="t", k=None, norm=call.k_norm,
                         k_norm=None)


def qkv_parts(call: RoPECall) -> tuple[RoPECall, RoPECall, torch.Tensor]:
    """A packed qkv call as two single-tensor calls, on views of ``t`` (q ``[.., h * q/d, d]``
    where the view allows it, else a copy; k ``[.., h, d]``) and the v view ``[.., h, v]``."""
    q_len, k_len, _ = call.split
    t = call.t
    # one split, not three slices: its backward cats the parts' gradients, where autograd would
    # add each slice's +0 padding to the others' and so turn a -0.0 gradient into +0.0
    q, k, v = t.split((q_len, k_len, t.shape[-1] - q_len - k_len), dim=-1)
    q = q.reshape(*q.shape[:-2], call.heads * q_len // k_len, k_len)
    single = dict(tensors="t", split=None, k_table=None, k_norm=None)
    q_call = call._replace(t=q, heads=q.shape[-2], **single)
    k_table = call.table if call.k_table is None else call.k_table
    k_call = call._replace(t=k, table=k_table, norm=call.k_norm, **single)
    return q_call, k_call, v


_check_values_raw, _encode_env = env_raw_reader("ROPE_DISPATCH_CHECK_VALUES")
_CHECK_VALUES_ON, _CHECK_VALUES_OFF = _encode_env("1"), _encode_env("0")
_check_values = env_reader("ROPE_DISPATCH_CHECK_VALUES")


def _strict_values() -> bool:
    """``ROPE_DISPATCH_CHECK_VALUES=1``: read and check device index values too (a sync per call).
    Unset, ``1`` and ``0`` are one comparison each; other spellings are parsed (``true``,
    ``off``, ...) and a value neither on nor off is refused by name (:func:`switch_value`)."""
    raw = _check_values_raw()
    return raw == _CHECK_VALUES_ON or (
        raw is not None and raw != _CHECK_VALUES_OFF
        and switch_value("ROPE_DISPATCH_CHECK_VALUES", _check_values(), False)
    )


def _host_reads_allowed() -> bool:
    if memoryless():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a CosSinCache may hold: float32, or a model's own dtype (as Hugging Face models make
their per-token cos and sin); kernels widen the values to float32 before the math."""


def _check_table(table: object, device: torch.device, argument: str = "freqs") -> RotaryTable:
    if isinstance(table, CosSinCache):
        cos, sin = table.cos, table.sin
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
            raise RoPEError(
                f"{argument} is a CosSinCache of {type(cos).__name__} cos and "
                f"{type(sin).__name__} sin; expected two [s2, d2] tensors: build it with "
                "rope_dispatch.cos_sin_cache(freqs)"
            )
        if (
            cos.dtype not in CACHE_DTYPES or sin.dtype != cos.dtype or cos.dim() != 2
            or cos.shape != sin.shape or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape[0] < 1 or cos.shape[1] < 2 or cos.shape[1] % 2
        ):
            raise RoPEError(
                f"{argument} is a CosSinCache whose tables are not a contiguous [s2, d2] pair of "
                f"one dtype among float32, bfloat16 and float16, with at least one position and "
                f"an even d2 >= 2 (cos {tuple(cos.shape)} {dtype_name(cos.dtype)}, sin "
                f"{tuple(sin.shape)} {dtype_name(sin.dtype)}); build it with "
                "rope_dispatch.cos_sin_cache(freqs)"
            )
        checked: RotaryTable = table
        table_device = cos.device
    elif isinstance(table, PairCosSinCache):
        t = table.table
        if (
            not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2
            or t.shape[1] < 2 or t.shape[1] % 2 or not t.is_contiguous()
        ):
            got = (
                f"{tuple(t.shape)} {dtype_name(t.dtype)}"
                + ("" if t.is_contiguous() else f" strides {t.stride()}")
                if isinstance(t, torch.Tensor) else type(t).__name__
            )
            raise RoPEError(
                f"{argument} is a PairCosSinCache whose table is not a contiguous float32 "
                f"[s2, d2] tensor with an even d2 (cosines, then sines), got {got}"
            )
        checked = table
        table_device = t.device
    elif isinstance(table, RateTable):  # checked when it was made (a frozen object)
        checked = table
        table_device = table.device
    else:
        checked = angles_2d(table, argument)  # type: ignore[arg-type]
        table_device = checked.device
    if table_device != device:
        raise RoPEError(
            f"{argument} is on {table_device} but t is on {device}; expected the same device"
        )
    return checked


def _reads(index: torch.Tensor) -> bool:
    """Whether an index tensor's values are read on the host: on the CPU, or in strict mode;
    never a fake or meta tensor's (it has none)."""
    return (index.is_cpu or (_strict_values() and not index.is_meta)) and not fake(index)


def reads_values(spec: RoPESpec) -> bool:
    """Whether :func:`check_call` checks the values of ``spec.cu_seqlens`` (so a call cannot
    reuse an earlier call's checks: the offsets may have been rewritten in place)."""
    cu = spec.cu_seqlens
    return cu is not None and _reads(cu)


def _check_cu_seqlens(
    spec: RoPESpec, tokens: int, table_len: int | None, starts: list[int] | None, table_name: str
) -> bool:
    """``starts``: the values of ``start_positions`` when they were read, else ``None``;
    ``table_name``: the argument holding the shorter table. Returns whether the offsets bound
    every position inside the table (read and checked, or promised by ``max_seqlen``)."""
    cu = spec.cu_seqlens
    assert cu is not None
    cp = spec.cp_size
    if table_len is None:  # per-token positions: the offsets bound no position
        table_len = sys.maxsize
    if not _host_reads_allowed() or not reads_values(spec):
        if spec.max_seqlen is None:
            return False
        start = max(starts) if starts else 0
        if spec.max_seqlen + start > table_len:
            plus = f" + start_positions max {start}" if start else ""
            raise RoPEError(
                f"{table_name} has {table_len} positions but max_seqlen={spec.max_seqlen}"
                f"{plus} needs {spec.max_seqlen + start}; the table must cover the longest "
                "(global) sequence from its start position"
            )
        return True
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise RoPEError(f"cu_seqlens must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise RoPEError(
            f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}]={offsets[bad + 1]} < "
            f"cu_seqlens[{bad}]={offsets[bad]}"
        )
    if offsets[-1] != tokens * cp:
        raise RoPEError(
            f"cu_seqlens[-1]={offsets[-1]} must equal the total tokens t.shape[0]={tokens}"
            + (f" times cp_size={cp} (global offsets)" if cp > 1 else "")
        )
    if cp > 1:
        bad = next((i for i, n in enumerate(lengths) if n % (2 * cp)), None)
        if bad is not None:
            raise RoPEError(
                f"with cp_size={cp} every sequence length must be divisible by 2*cp_size="
                f"{2 * cp}; sequence {bad} has length {lengths[bad]}"
            )
    longest = max(lengths)
    if spec.max_seqlen is not None and longest > spec.max_seqlen:
        raise RoPEError(
            f"max_seqlen={spec.max_seqlen} but cu_seqlens holds a sequence of length {longest}"
        )
    if starts is not None:  # an empty sequence reads no row, wherever it would start (as TE)
        longest = max((n + s for n, s in zip(lengths, starts) if n), default=0)
    if longest > table_len:
        raise RoPEError(
            f"{table_name} has {table_len} positions but a sequence needs positions up to "
            f"{longest - 1}; expected {table_name}.shape[0] >= {longest}"
        )
    return True


def _check_start_positions(
    start_positions: object, spec: RoPESpec, batch: int, seq_len: int, table_len: int,
    device: torch.device, table_name: str,
) -> list[int] | None:
    """Check ``start_positions``; return its values when they were read (see the module
    docstring for when), so the thd checks reuse them instead of syncing again."""
    if not isinstance(start_positions, torch.Tensor):
        raise RoPETypeError(
            f"start_positions must be an int tensor [b] or None, got {type(start_positions).__name__}"
        )
    if start_positions.dtype not in (torch.int32, torch.int64):
        raise RoPEError(
            f"start_positions must be int32 or int64, got {dtype_name(start_positions.dtype)}"
        )
    what = "number of sequences" if spec.layout == "thd" else "batch size"
    if tuple(start_positions.shape) != (batch,):
        raise RoPEError(
            f"start_positions must have shape [{batch}] (the {what}), got "
            f"{tuple(start_positions.shape)}"
        )
    if start_positions.device != device:
        raise RoPEError(
            f"start_positions is on {start_positions.device} but t is on {device}; expected the "
            "same device"
        )
    if not _host_reads_allowed() or not _reads(start_positions):
        return None
    starts = start_positions.tolist()
    if starts and min(starts) < 0:
        raise RoPEError(f"start_positions must be >= 0, got {min(starts)}")
    cp = spec.cp_size
    if spec.layout != "thd" and starts and max(starts) + seq_len * cp > table_len:
        span = f"sequence length {seq_len}" + (f" x cp_size={cp}" if cp > 1 else "")
        raise RoPEError(
            f"{table_name} has {table_len} positions but start_positions max {max(starts)} + {span} "
            f"needs {max(starts) + seq_len * cp}"
        )
    return starts


_new_call = tuple.__new__


def _check_split(split: object, channels: int) -> tuple[int, int, int]:
    """``split`` as three ints ``(q, k, v)`` that cut a packed qkv group of ``channels``."""
    if (
        not isinstance(split, (tuple, list)) or len(split) != 3
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in split)
    ):
        raise RoPEError(
            f"split must be three ints (q, k, v channels per head group), got {split!r}"
        )
    q_len, k_len, v_len = split = tuple(int(n) for n in split)
    if q_len <= 0 or k_len <= 0 or v_len <= 0:
        raise RoPEError(f"split must be positive (q, k, v channels), got {tuple(split)}")
    if q_len + k_len + v_len != channels:
        raise RoPEError(
            f"split {tuple(split)} sums to {q_len + k_len + v_len} but qkv's last dim is "
            f"{channels}; expected q + k + v == qkv.shape[-1]"
        )
    if q_len % k_len or v_len % k_len:
        raise RoPEError(
            f"split {tuple(split)}: k={k_len} is the head dim, so q={q_len} and v={v_len} must "
            "be multiples of it"
        )
    return q_len, k_len, v_len


def refuse_dtensors_beside(error: Exception, t: object, freqs: object, k_freqs: object,
                           k: object, start_positions: object, positions: object,
                           norms: tuple) -> None:
    """Raised from ``error`` (torch's, deep in a check or a backend, naming an aten op): a
    DTensor among a plain ``t``'s arguments, refused by name; a distributed call passes ``t``
    as a DTensor too. Asked only once a call failed, so a call that runs pays nothing."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or isinstance(t, module.DTensor) or isinstance(error, RoPEError):
        return
    named = (("freqs", freqs), ("k_freqs", k_freqs), ("k", k),
             ("start_positions", start_positions), ("positions", positions),
             ("q_norm", norms[0]), ("k_norm", norms[1]))
    for name, x in named:
        held = (x.weight,) if isinstance(x, HeadNorm) else table_tensors(x)
        if any(isinstance(h, module.DTensor) for h in held):
            raise RoPEError(
                f"{name} is a DTensor but t is a plain tensor; pass t (and k) as DTensors on "
                f"the same mesh (docs/context-parallel.md), or plain local tensors throughout"
            ) from error


def check_index(spec: RoPESpec, shape: torch.Size, table_len: int, start_positions: object,
                positions: object, device: torch.device,
                table_name: str) -> tuple[int, int, bool]:
    """The checks of a call's ``cu_seqlens``, ``start_positions`` or ``positions`` against
    ``t``'s shape and a table of ``table_len`` positions: ``(sequence length, batch, whether
    every position is known inside the table)``."""
    layout, rank = spec.layout, len(shape)
    cp = spec.cp_size
    cu = spec.cu_seqlens
    if rank == 3:
        seq_len = shape[0]
        if cu is None and positions is None:
            raise RoPEError(
                "layout 'thd' needs cu_seqlens in the spec (the [n+1] sequence offsets), or "
                "per-token positions with every call"
            )
        if cu is not None and cu.device != device:
            raise RoPEError(
                f"cu_seqlens is on {cu.device} but t is on {device}; expected the same device"
            )
        batch = 1 if cu is None else cu.numel() - 1
    else:
        seq_len, batch = (shape[0], shape[1]) if layout == "sbhd" else (shape[1], shape[0])
        if cp > 1 and seq_len % 2:
            raise RoPEError(
                f"with cp_size={cp} the local sequence length must be even (two chunks), got "
                f"{seq_len}"
            )
        needed = seq_len * cp
        if positions is None and needed > table_len:
            raise RoPEError(
                f"{table_name} has {table_len} positions but the sequence needs {needed} "
                f"(s={seq_len}" + (f" x cp_size={cp}" if cp > 1 else "") + "); expected "
                f"{table_name}.shape[0] >= {needed}"
            )
    if positions is not None:
        bounded = _check_positions(positions, start_positions, spec, shape, table_len, device,
                                   table_name)
        if cu is not None and reads_values(spec) and _host_reads_allowed():
            _check_cu_seqlens(spec, seq_len, None, None, table_name)
    else:
        starts = None
        if start_positions is not None:
            starts = _check_start_positions(
                start_positions, spec, batch, seq_len, table_len, device, table_name
            )
        bounded = start_positions is None or starts is not None
        if rank == 3:
            bounded = _check_cu_seqlens(spec, seq_len, table_len, starts, table_name) and bounded
    return seq_len, batch, bounded


def _named_t(k: object, split: object) -> str:
    """The caller's name for check_call's ``t``: apply_qk's and rope_to_cache's ``q``,
    apply_qkv's ``qkv``."""
    return "q" if k is not None else "qkv" if split is not None else "t"


def check_call(
    t: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None = None,
    *, in_place: bool = False, grad_in_place: bool = False,
    split: tuple[int, int, int] | None = None, k_freqs: object = None,
    positions: torch.Tensor | None = None, k: torch.Tensor | None = None,
    q_norm: object = None, k_norm: object = None,
) -> RoPECall:
    """Check ``t``, ``freqs`` and ``start_positions`` (or per-token ``positions``) against
    ``spec``; raise a clear error or return the :class:`RoPECall` every backend takes.
    ``in_place`` adds the checks of :func:`~rope_dispatch.apply_` (``t`` must be writable).
    ``split`` makes ``t`` a packed qkv tensor (:func:`~rope_dispatch.apply_qkv`), whose k is
    rotated by ``k_freqs`` when given; ``k`` makes ``t`` the q of a q and k pair
    (:func:`~rope_dispatch.apply_qk`). ``q_norm`` and ``k_norm`` are the norm stages
    (:class:`~rope_dispatch.HeadNorm`) of ``t`` (q) and of k."""
    if not isinstance(spec, RoPESpec):
        raise RoPETypeError(f"spec must be a rope_dispatch.RoPESpec, got {type(spec).__name__}")
    if not isinstance(t, torch.Tensor):
        raise RoPETypeError(f"{_named_t(k, split)} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    for name, flag in (("in_place", in_place), ("grad_in_place", grad_in_place)):
        if type(flag) is not bool:  # a truthy "yes" is no answer
            raise RoPETypeError(f"{name} must be True or False, got {flag!r}")
    if t.dtype != spec.dtype:
        raise RoPEError(
            f"{_named_t(k, split)} has dtype {dtype_name(t.dtype)} but spec.dtype is "
            f"{dtype_name(spec.dtype)}; "
            "build the spec with the tensor's dtype"
        )
    # t.shape, t.device and table.shape are each read once: every read builds a new object, and
    # at decode size these checks are a measurable share of the call.
    shape = t.shape
    layout = spec.layout
    rank = 3 if layout == "thd" else 4
    if len(shape) != rank:
        raise RoPEError(
            f"{_named_t(k, split)} must have {rank} dims for layout {layout!r} "
            f"([{', '.join(layout)}]), got shape "
            f"{tuple(shape)}"
        )
    device = t.device
    table = _check_table(freqs, device)
    table_len, d2 = table_shape(table)
    if spec.rotary_dim is not None and spec.rotary_dim != d2:
        raise RoPEError(
            f"spec.rotary_dim={spec.rotary_dim} but freqs has last dim d2={d2}; they must be equal"
        )
    heads = shape[-2]
    kind, k_table, table_name = "t", None, "freqs"
    if split is not None:
        if in_place:
            raise RoPEError("a packed qkv call writes new q, k and v; it has no in-place form")
        if k is not None:
            raise RoPEError("k is for q and k pairs (apply_qk); a packed qkv call (split=) takes "
                            "its k from qkv's channels")
        kind, split = "qkv", _check_split(split, shape[-1])
        head_dim = split[1]
        q_heads, k_heads = heads * (split[0] // head_dim), heads
        if k_freqs is not None and k_freqs is not freqs:
            k_table = _check_k_table(k_freqs, table, device)
            if table_shape(k_table)[0] < table_len:
                table_len, table_name = table_shape(k_table)[0], "k_freqs"
    elif k_freqs is not None:
        raise RoPEError("k_freqs is for packed qkv calls (apply_qkv) only")
    else:
        head_dim = shape[-1]
        q_heads, k_heads = heads, 0
        if k is not None:
            kind = "qk"
            _check_k(t, k, in_place)
            k_heads = k.shape[-2]
    if d2 > head_dim:
        raise RoPEError(
            f"rotary dim d2={d2} (freqs' last dim) exceeds the head dim d={head_dim} of "
            f"{_named_t(k, split)} "
            f"{tuple(shape)}" + (f" (the k part of split {split})" if split else "")
        )
    offset = spec.rotary_offset
    if offset and offset + d2 > head_dim:
        raise RoPEError(
            f"spec.rotary_offset={offset} plus the rotary dim d2={d2} (freqs' last dim) is "
            f"{offset + d2}, past the head dim d={head_dim} of "
            f"{_named_t(k, split)} {tuple(shape)}"
            + (f" (the k part of split {split})" if split else "")
            + f"; expected rotary_offset + d2 <= d, so rotary_offset <= {head_dim - d2}"
        )
    if q_norm is not None or k_norm is not None:
        q_name = "norm" if kind == "t" else "q_norm"
        q_norm = check_norm(q_norm, q_name, q_heads, head_dim, device)
        if k_norm is not None and kind == "t":
            raise RoPEError("k_norm is for calls with a k (apply_qk, apply_qk_, apply_qkv)")
        k_norm = check_norm(k_norm, "k_norm", k_heads, head_dim, device)
        if spec.inverse:  # the fused norm kernel's backward pass is not the transpose
            named = q_name if q_norm is not None else "k_norm"
            raise RoPEError(
                f"spec.inverse=True cannot be combined with a norm stage ({named}=HeadNorm): "
                "an inverse rotation after a norm is not supported; normalize first, then "
                "rotate with the inverse spec"
            )
    if spec.mrope_section is not None:
        table, k_table, positions = _lower_multimodal(
            spec, table, k_table, positions, start_positions, shape, device, table_name
        )
        table_len = table_shape(table)[0]
    seq_len, batch, bounded = check_index(spec, shape, table_len, start_positions, positions,
                                          device, table_name)
    if in_place:
        if table_grad_wanted(table, k_table):
            raise RoPEError(
                f"{'apply_' if k is None else 'apply_qk_'} cannot rotate in place with a table "
                "that requires grad (the table's gradient needs the input the rotation "
                f"overwrites); use rope_dispatch.{'apply' if k is None else 'apply_qk'}, or pass "
                "freqs.detach() for a constant table"
            )
        _check_writable(t, "t" if k is None else "q")
        if k is not None:
            _check_writable(k, "k")
        refuse_written_overlaps(t, k, None if q_norm is None else q_norm.weight,
                                None if k_norm is None else k_norm.weight,
                                table_tensors(table), d2, offset)
    # tuple.__new__ directly: the named tuple's generated __new__ adds a Python frame per call
    return _new_call(RoPECall, (
        t, table, spec, start_positions, seq_len, batch, heads, head_dim, d2, in_place,
        in_place and grad_in_place, kind, split, k_table, bounded, positions, k, q_norm, k_norm,
        None,
    ))


def _check_k(q: torch.Tensor, k: object, in_place: bool) -> None:
    """k of a q and k pair: q's dtype, device, leading dims and head dim; any head count."""
    if not isinstance(k, torch.Tensor):
        raise RoPETypeError(f"k must be a torch.Tensor, got {type(k).__name__}")
    if k.dtype != q.dtype or k.device != q.device:
        raise RoPEError(
            f"k is {dtype_name(k.dtype)} on {k.device} but q is {dtype_name(q.dtype)} on "
            f"{q.device}; expected the same dtype and device"
        )
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise RoPEError(
            f"k {tuple(k.shape)} must match q {tuple(q.shape)} in every dim but the heads "
            "(dim -2): the same tokens and head dim"
        )
    if in_place and k is q:
        raise RoPEError("apply_qk_ got the same tensor as q and k; it would be rotated twice")


def _check_positions(
    positions: object, start_positions: object, spec: RoPESpec, shape: torch.Size,
    table_len: int, device: torch.device, table_name: str,
) -> bool:
    """Check per-token ``positions`` (one table row per token, shaped like ``t.shape[:-2]``);
    return whether their values were read and found inside the table."""
    if not isinstance(positions, torch.Tensor):
        raise RoPETypeError(
            f"positions must be an int tensor shaped like t.shape[:-2] or None, got "
            f"{type(positions).__name__}"
        )
    if start_positions is not None:
        raise RoPEError(
            "positions and start_positions cannot be combined: per-token positions already "
            "say each token's row; add the start to them instead"
        )
    if spec.cp_size > 1:
        raise RoPEError(
            f"positions cannot be combined with context parallelism (cp_size={spec.cp_size}): "
            "per-token positions already say each token's row; pass the global positions of "
            "this rank's tokens with cp_size=1"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise RoPEError(f"positions must be int32 or int64, got {dtype_name(positions.dtype)}")
    expected = tuple(shape[:-2])
    if tuple(positions.shape) != expected:
        names = {"sbhd": "[s, b]", "bshd": "[b, s]", "thd": "[T]"}[spec.layout]
        raise RoPEError(
            f"positions must have shape {names} = {list(expected)} for layout {spec.layout!r} "
            f"(one per token), got {tuple(positions.shape)}"
        )
    return _positions_in_table(positions, table_len, device, table_name)


def _positions_in_table(
    positions: torch.Tensor, table_len: int, device: torch.device, table_name: str
) -> bool:
    """``positions`` on ``t``'s ``device``, and, where their values may be read on the host,
    each a row of the table; returns whether that was established (an empty tensor needs no
    read)."""
    if positions.device != device:
        raise RoPEError(
            f"positions is on {positions.device} but t is on {device}; expected the same device"
        )
    if positions.numel() == 0:
        return True  # nothing to read (a branch: a traced size gives a guard, not a symbol)
    if not _host_reads_allowed() or not _reads(positions):
        return False
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= table_len:
        raise RoPEError(
            f"positions must lie in [0, {table_len}) ({table_name} has {table_len} rows), got "
            f"values from {low} to {high}"
        )
    return True


def _lower_multimodal(
    spec: RoPESpec, table: RotaryTable, k_table: RotaryTable | None, positions: object,
    start_positions: object, shape: torch.Size, device: torch.device, table_name: str,
) -> tuple[RotaryTable, RotaryTable | None, torch.Tensor]:
    """A multimodal call (``spec.mrope_section``) as a per-token one: each table becomes one row
    per token, channel ``c`` read at the position of its section's stream, and the positions
    become each token's own index. Backends never see the three streams: a row gather on the
    table (``tokens x d2`` values) is the whole cost, and every backend that takes per-token
    positions serves the call. A stream position outside the table gives NaN in that channel,
    never a clamped row; on the CPU (or in strict mode) it is an error naming the values."""
    if not isinstance(positions, torch.Tensor):
        raise RoPEError(
            f"spec.mrope_section={spec.mrope_section} needs positions [3, *t.shape[:-2]] (the "
            "temporal, height and width position of every token) with every call, got "
            f"{type(positions).__name__}"
        )
    if start_positions is not None:
        raise RoPEError(
            "start_positions cannot be combined with spec.mrope_section: the three position "
            "streams already say every token's rows; add the start to them instead"
        )
    tokens = tuple(shape[:-2])
    if positions.dtype not in (torch.int32, torch.int64) or tuple(positions.shape) != (3, *tokens):
        raise RoPEError(
            f"positions must be an int32/int64 tensor [3, {', '.join(map(str, tokens))}] for "
            f"spec.mrope_section (temporal, height and width streams, one per token), got "
            f"{dtype_name(positions.dtype)} {tuple(positions.shape)}"
        )
    rows, d2 = table_shape(table)
    if 2 * sum(spec.mrope_section) != d2:
        raise RoPEError(
            f"spec.mrope_section={spec.mrope_section} covers {2 * sum(spec.mrope_section)} "
            f"rotary channels (each half) but {table_name} has d2={d2}; expected sections "
            f"summing to d2 / 2 = {d2 // 2}"
        )
    _positions_in_table(positions, rows, device, table_name)
    streams = positions.reshape(3, -1)
    sections, interleaved = spec.mrope_section, spec.mrope_interleaved
    lowered = multimodal_rows(table, streams, sections, interleaved)
    k_lowered = None if k_table is None else multimodal_rows(k_table, streams, sections, interleaved)
    own = torch.arange(streams.shape[1], device=device, dtype=positions.dtype).view(tokens)
    return lowered, k_lowered, own


def _check_k_table(k_freqs: object, table: RotaryTable, device: torch.device) -> RotaryTable:
    """k's own table: the same kind and rotary dim as q's (one kernel rotates both)."""
    k_table = _check_table(k_freqs, device, "k_freqs")
    if table_kind(k_table) != table_kind(table):
        kinds = {"angles": "an angle table", "cos_sin_cache": "a CosSinCache",
                 "pair_cos_sin_cache": "a PairCosSinCache", "rates": "a RateTable",
                 "precise_rates": "a precise RateTable"}
        raise RoPEError(
            f"k_freqs is {kinds[table_kind(k_table)]} but freqs is {kinds[table_kind(table)]}; "
            "pass both in the same form"
        )
    k_d2, d2 = table_shape(k_table)[1], table_shape(table)[1]
    if k_d2 != d2:
        raise RoPEError(
            f"k_freqs has rotary dim {k_d2} but freqs has {d2}; q and k must rotate the same "
            "number of channels"
        )
    return k_table


def table_grad_wanted(table: RotaryTable, k_table: RotaryTable | None) -> bool:
    """Whether a call asks a gradient of its table (q's, or k's own): one requires grad, with
    grad enabled. Only backends that differentiate the table serve it."""
    return torch.is_grad_enabled() and (
        table_requires_grad(table) or (k_table is not None and table_requires_grad(k_table))
    )


def grad_leaf(t: torch.Tensor) -> bool:
    """Whether ``t`` is a leaf, or a view of one, as far as torch's in-place rule goes: with
    grad enabled torch refuses to write either in place when it requires grad."""
    base = t._base
    return t.is_leaf or (base is not None and base.is_leaf)


def _check_writable(t: torch.Tensor, name: str) -> None:
    """What an in-place rotation of ``t`` (the argument ``name``) needs, as torch's own
    in-place ops require it."""
    entry, out_of_place = ("apply_", "apply") if name == "t" else ("apply_qk_", "apply_qk")
    if t.requires_grad and torch.is_grad_enabled() and grad_leaf(t):
        base = t._base  # a view made under no_grad of a non-leaf is a leaf of its own
        what = ("a leaf tensor" if base is None else "a view of a leaf tensor" if base.is_leaf
                else "a view made with grad disabled (torch.no_grad) of a tensor")
        raise RoPEError(
            f"{entry} rotates {name} in place, but {name} is {what} that requires grad "
            f"(autograd needs its value); use rope_dispatch.{out_of_place}, or pass a non-leaf "
            f"such as {name}.clone()"
        )
    dim = expanded_dim(t)
    if dim is not None:
        raise RoPEError(
            f"{entry} cannot rotate {name} in place: dim {dim} (size {t.shape[dim]}) has stride "
            f"0, so its elements share memory (an expanded tensor); use rope_dispatch.{out_of_place}"
        )
    if memoryless():
        return  # inference tensors never reach a traced graph or a torch.func transform
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RoPEError(
            f"{entry} cannot rotate {name} in place: {name} is an inference tensor and inference "
            f"mode is off (torch forbids updating it there); use rope_dispatch.{out_of_place}"
        )

