"""vLLM's two RoPE ops (``vllm._custom_ops.rotary_embedding`` and ``fused_qk_norm_rope``),
running on rope-dispatch.

One changed import moves code that calls them::

    from rope_dispatch.compat.vllm import fused_qk_norm_rope, rotary_embedding

Adapters: each maps vLLM's arguments onto views and one :func:`rope_dispatch.apply_qk_` (or
:func:`rope_dispatch.apply_` when ``key`` is ``None``) and returns ``None``, writing in place as
vLLM does. ``positions`` become the per-token positions of a thd call (``[num_tokens]``) or of a
bshd call (``[batch, seq]``); ``cos_sin_cache`` (cosines of the ``rot_dim / 2`` pair angles,
then their sines) a :class:`~rope_dispatch.PairCosSinCache`; ``is_neox`` the spec's
``interleaved`` (negated). The signatures are those of ``vllm/_custom_ops.py`` (vLLM commit
0002bde), the semantics those of its CUDA kernels (``csrc/pos_encoding_kernels.cu``,
``csrc/fused_qknorm_rope_kernel.cu``, commit 0f5257e): float32 math from the loaded values,
one rounding to the tensor's dtype.

Decisions, where vLLM's op and ours could differ:

- A float32 cache is read as it is; one that requires grad as a constant (vLLM's ops do not
  differentiate it). A bfloat16 or float16 one (vLLM's ``RotaryEmbedding`` hands its kernel
  the cache in the query's dtype) is widened to a float32 copy, made once per cache tensor
  and made again when the cache is written in place; an inference tensor (no version counter
  to tell a write), and a call traced by ``torch.compile``, on fake tensors or under a
  ``torch.func`` transform, widen the rows the call reads and keep nothing: exact, as vLLM's
  kernels widen each entry too. A write torch does not count (through ``.data``, DLPack) is
  not seen. Either cache must be contiguous, as vLLM's fused op checks. ``inverse=True`` is
  the spec's ``inverse`` (the rotation by minus the angle, exact: the transpose, whose pair
  shares one sine), on the same table.
- The fused op keeps the normalized value in float32 until the rotation, as vLLM's kernel does
  (its unfused path, ``RMSNorm`` then ``rotary_embedding``, rounds twice). Ours computes
  ``x * rsqrt(mean(x**2) + eps) * w``; vLLM's ``x * (rsqrtf(..) * w)`` with a warp-tree sum:
  the same value up to float32 rounding order. ``eps=0`` is taken, as vLLM takes it (an
  all-zero head is then ``0 * rsqrt(0) = NaN``, as the formula gives; :class:`HeadNorm`
  itself refuses an eps below float32's normal range).
- vLLM's argument checks are kept where the core would accept more: int64 ``positions``, a
  ``key`` head count dividing ``query``'s (``rotary_embedding``), ``q_weight``/``k_weight``
  ``[head_dim]`` of ``qkv``'s dtype, ``qkv`` ``[num_tokens, (hq + hk + hv) * head_dim]``. Each
  raises :class:`~rope_dispatch.RoPEError` naming the argument, and so does a ``query`` or
  ``qkv`` of a dtype the core refuses (float32, float16 and bfloat16 are taken).
- Limits of vLLM's kernels are not copied: the fused op takes any ``head_dim`` (vLLM: 64, 128,
  256), float32 ``qkv`` (vLLM: float16 and bfloat16) and any row stride (vLLM: contiguous);
  ``forced_token_heads_per_warp`` (a launch setting) is accepted and ignored.
- Two corners of vLLM's kernels are not copied: ``rotary_embedding`` steps through a 3-D
  ``key``'s heads with ``query``'s head stride (ours uses each tensor's own; they agree for
  contiguous tensors), and the fused kernel's NeoX pairing with partial rotary finds a channel's
  partner by a lane XOR, right only when ``(rot_dim / 2) / (head_dim / 32)`` is a power of two
  (ours pairs channel ``i`` with ``i + rot_dim / 2``, as ``rotary_embedding`` does).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Optional

import torch

from ..backends.eager import table_rows
from ..backends.written import door
from ..dispatch import apply_, apply_qk_
from ..errors import RoPEError, RoPETypeError
from ..norm import HeadNorm, zero_eps_norm
from ..spec import SUPPORTED_DTYPES, RoPESpec, constant_spec, dtype_name
from ..table_kinds import _normal_tensors
from ..tables import PairCosSinCache
from ..tracing import memoryless
from .flashinfer import _flag, _floating, _mapped, _pair_cache, _door_words

__all__ = ["rotary_embedding", "fused_qk_norm_rope"]

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_specs: dict[tuple, RoPESpec] = {
    (layout, dtype, interleaved, inverse): RoPESpec(layout=layout, dtype=dtype,
                                                    interleaved=interleaved, inverse=inverse)
    for layout in ("thd", "bshd") for dtype in SUPPORTED_DTYPES for interleaved in (False, True)
    for inverse in (False, True)
}
"""Each spec a door call can take, made at import (as :data:`.flashinfer._specs`)."""
_copies: dict[int, tuple[torch.Tensor, tuple, PairCosSinCache]] = {}
_MAX_COPIES = 4


def _spec(layout: str, dtype: torch.dtype, interleaved: bool,
          inverse: bool = False) -> RoPESpec:
    """A spec without offsets (positions come per token), from a small cache."""
    key = (layout, dtype, interleaved, inverse)
    spec = _specs.get(key)
    if spec is None:
        if torch.compiler.is_compiling():  # the trace's own (pydantic is not traced)
            return constant_spec(layout=layout, dtype=dtype, interleaved=interleaved,
                                 inverse=inverse)
        spec = _specs[key] = RoPESpec(layout=layout, dtype=dtype, interleaved=interleaved,
                                      inverse=inverse)
    return spec


@contextlib.contextmanager
def _named(argument: str):
    """A PairCosSinCache's complaint about its table, told as one about ``argument``."""
    try:
        yield
    except RoPEError as error:
        message = str(error).replace("PairCosSinCache's table", argument)
        raise type(error)(message) from error


def _version(t: torch.Tensor) -> tuple:
    """What a float32 copy of ``t`` (not an inference tensor) stays valid for: its version
    counter and its memory, shape and strides (``t.data = ...`` gives it new memory with no
    write torch counts)."""
    return (t._version, t.data_ptr(), t.shape, t.stride())


def _table(cos_sin_cache: object,
           positions: torch.Tensor) -> tuple[PairCosSinCache, torch.Tensor]:
    """The engine's cache as a PairCosSinCache, and the positions to read it at: itself when
    float32 (no copy), else a float32 copy, kept while the cache is unchanged (its version
    counter, memory, shape and strides). An inference tensor has no version counter to tell a
    write into it, and a call traced, on fake tensors or under torch.func has no memory or
    values to keep: there the call's own rows are widened instead, each token's at index
    ``i`` (a copy of the whole cache, 10^5 positions in vLLM's models, on every call would
    cost more than the rotation). A position outside the cache gives a NaN row there, as the
    kernels do."""
    if (not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dtype not in _CACHE_DTYPES
            or cos_sin_cache.dim() != 2):
        got = (f"{tuple(cos_sin_cache.shape)} {dtype_name(cos_sin_cache.dtype)}"
               if isinstance(cos_sin_cache, torch.Tensor) else type(cos_sin_cache).__name__)
        raise (RoPEError if isinstance(cos_sin_cache, torch.Tensor) else RoPETypeError)(
            f"cos_sin_cache must be a float32, bfloat16 or float16 tensor [max_position, rot_dim] "
            f"(cosines, then sines), got {got}"
        )
    if cos_sin_cache.dtype == torch.float32:
        return _pair_cache(cos_sin_cache), positions
    if not cos_sin_cache.is_contiguous():  # as a float32 one (vLLM's fused op checks it too)
        raise RoPEError(
            f"cos_sin_cache must be contiguous, got strides {cos_sin_cache.stride()}; pass a "
            "contiguous one (.contiguous())"
        )
    traced = memoryless()
    if (traced or cos_sin_cache.is_inference()) and (
            cos_sin_cache.shape[0] and cos_sin_cache.shape[1] >= 2
            and not cos_sin_cache.shape[1] % 2):  # else refused by the copy's checks
        flat = positions.reshape(-1)
        index = torch.arange(flat.shape[0], device=positions.device).view(positions.shape)
        if not flat.shape[0]:  # no token reads a row, but a table has at least one
            flat = flat.new_zeros(1)
        with _named("cos_sin_cache"), _normal_tensors():
            table = PairCosSinCache(table_rows(cos_sin_cache.detach(), flat).float()).table
        return PairCosSinCache(table), index
    key = id(cos_sin_cache)
    entry = None if traced else _copies.get(key)
    if entry is not None and entry[0] is cos_sin_cache and entry[1] == _version(cos_sin_cache):
        return entry[2], positions
    with _named("cos_sin_cache"), _normal_tensors():  # a copy autograd may save later
        # a constant (vLLM's ops never differentiate the cache): no graph kept with the copy
        table = PairCosSinCache(cos_sin_cache.detach().float()).table  # checks its shape
    wrapper = PairCosSinCache(table)
    if traced:
        return wrapper, positions
    if len(_copies) >= _MAX_COPIES:
        _copies.clear()
    _copies[key] = (cos_sin_cache, _version(cos_sin_cache), wrapper)
    return wrapper, positions


def _count(name: str, value: object, least: int) -> int:
    """``value`` as an int: any integral number (a NumPy one from a config too), not a bool."""
    wrong_type = type(value) is not int and (isinstance(value, bool)
                                             or not isinstance(value, numbers.Integral))
    if wrong_type or value < least:
        kind = "a positive int" if least == 1 else f"an int >= {least}"
        raise (RoPETypeError if wrong_type else RoPEError)(f"{name} must be {kind}, got {value!r}")
    return int(value)


def _positions(name: str, positions: object, dims: tuple[int, ...]) -> torch.Tensor:
    """``positions`` checked as vLLM's op takes them: an int64 tensor of one of ``dims``."""
    if not isinstance(positions, torch.Tensor):
        raise RoPETypeError(f"{name} must be an int64 tensor, got {type(positions).__name__}")
    if positions.dtype != torch.int64:
        raise RoPEError(
            f"{name} must be int64 (vLLM's op reads int64), got {dtype_name(positions.dtype)}; "
            f"pass {name}.long()"
        )
    if positions.dim() not in dims:
        shapes = " or ".join(("[num_tokens]", "[batch, seq]")[d - 1] for d in dims)
        raise RoPEError(f"{name} must be {shapes}, got shape {tuple(positions.shape)}")
    return positions


def _heads(name: str, x: object, lead: torch.Size, head_size: int) -> torch.Tensor:
    """``x`` ``[*lead, heads * head_size]`` as a ``[*lead, heads, head_size]`` view, or ``x``
    itself when it is already ``[*lead, heads, head_size]``."""
    if isinstance(x, torch.Tensor):
        if x.dim() == len(lead) + 2 and x.shape[-1] == head_size:
            return x
        if x.dim() == len(lead) + 1 and x.shape[-1] % head_size == 0:
            return x.view(*x.shape[:-1], x.shape[-1] // head_size, head_size)
    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    tokens = "num_tokens" if len(lead) == 1 else "batch, seq"
    raise (RoPEError if isinstance(x, torch.Tensor) else RoPETypeError)(
        f"{name} must be [{tokens}, heads * head_size] or [{tokens}, heads, head_size] with "
        f"head_size={head_size} (positions {tuple(lead)}), got {got}"
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """Rotate ``query`` and ``key`` in place: vLLM's ``_custom_ops.rotary_embedding``.

    ``positions`` int64 ``[num_tokens]`` with ``query`` ``[num_tokens, heads * head_size]`` or
    ``[num_tokens, heads, head_size]``, or ``[batch, seq]`` with ``query`` ``[batch, seq,
    heads * head_size]`` or ``[batch, seq, heads, head_size]``; ``key`` the same with its own
    head count (dividing ``query``'s), or ``None``. ``cos_sin_cache`` ``[max_position,
    rot_dim]``: cosines, then sines; channels ``rope_dim_offset .. rope_dim_offset + rot_dim``
    of each head rotate, the rest are untouched. ``is_neox`` pairs channel ``i`` with ``i +
    rot_dim / 2``, else ``2i`` with ``2i + 1``; ``inverse`` rotates by minus the angle.
    Returns ``None``.
    """
    is_neox, inverse = _flag("is_neox", is_neox), _flag("inverse", inverse)
    head_size = _count("head_size", head_size, 1)
    offset = _count("rope_dim_offset", rope_dim_offset, 0)
    positions = _positions("positions", positions, (1, 2))
    lead = positions.shape
    q = _heads("query", query, lead, head_size)
    _floating("query", q)
    k = None if key is None else _heads("key", key, lead, head_size)
    if k is not None and (not k.shape[-2] or q.shape[-2] % k.shape[-2]):
        raise RoPEError(
            f"key has {k.shape[-2]} heads, which does not divide query's {q.shape[-2]}; vLLM's "
            "rotary_embedding requires num_heads % num_kv_heads == 0"
        )
    table, positions = _table(cos_sin_cache, positions)
    if offset:
        if offset + table.rotary_dim > head_size:
            raise RoPEError(
                f"rope_dim_offset={offset} + rot_dim={table.rotary_dim} must be <= "
                f"head_size={head_size}"
            )
        q = q[..., offset:]
        k = None if k is None else k[..., offset:]
    spec = _spec("thd" if len(lead) == 1 else "bshd", query.dtype, not is_neox, inverse)
    try:
        if k is None:
            door.state.words = _ROTARY_ALONE_DOOR  # (the in-graph checks' words, traced)
            apply_(q, table, spec, positions=positions)
        else:
            door.state.words = _ROTARY_DOOR
            apply_qk_(q, k, table, spec, positions=positions)
    except RoPEError as error:
        raise (_mapped(error, "rotary_embedding", _ROTARY_ALONE, "apply_") if k is None else
               _mapped(error, "rotary_embedding", _ROTARY_MAPPING, "apply_qk_")) from error
    finally:
        door.state.words = None


def _weight(name: str, weight: object, head_dim: int, dtype: torch.dtype) -> HeadNorm:
    if not isinstance(weight, torch.Tensor):
        raise RoPETypeError(f"{name} must be a tensor [head_dim], got {type(weight).__name__}")
    if tuple(weight.shape) != (head_dim,) or weight.dtype != dtype:
        raise RoPEError(
            f"{name} must be [head_dim] = [{head_dim}] of qkv's dtype {dtype_name(dtype)}, got "
            f"{tuple(weight.shape)} {dtype_name(weight.dtype)}"
        )
    return weight


def fused_qk_norm_rope(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
    forced_token_heads_per_warp: int = -1,
) -> None:
    """RMSNorm and rotate the q and k heads of a packed ``qkv`` in place: vLLM's
    ``_custom_ops.fused_qk_norm_rope`` (Qwen3's q_norm and k_norm, then RoPE).

    ``qkv`` ``[num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``: q heads,
    then k heads, then v heads. Each q head becomes ``x / sqrt(mean(x**2) + eps) * q_weight``
    (k heads with ``k_weight``, both ``[head_dim]``), then is rotated at ``position_ids``
    (int64 ``[num_tokens]``) as :func:`rotary_embedding` rotates, in float32 with one rounding;
    v is untouched. ``forced_token_heads_per_warp`` is ignored. Returns ``None``.
    """
    is_neox = _flag("is_neox", is_neox)
    hq = _count("num_heads_q", num_heads_q, 1)
    hk = _count("num_heads_k", num_heads_k, 1)
    hv = _count("num_heads_v", num_heads_v, 0)
    head_dim = _count("head_dim", head_dim, 1)
    if not isinstance(qkv, torch.Tensor):
        raise RoPETypeError(f"qkv must be a tensor, got {type(qkv).__name__}")
    width = (hq + hk + hv) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise RoPEError(
            f"qkv must be [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim] = "
            f"[num_tokens, ({hq} + {hk} + {hv}) * {head_dim}] = [num_tokens, {width}], got "
            f"{tuple(qkv.shape)}"
        )
    _floating("qkv", qkv)
    positions = _positions("position_ids", position_ids, (1,))
    q_weight = _weight("q_weight", q_weight, head_dim, qkv.dtype)
    k_weight = _weight("k_weight", k_weight, head_dim, qkv.dtype)
    try:
        # vLLM's kernel takes eps=0: rsqrt(mean(x**2) + 0), an all-zero head NaN (0 * inf)
        if isinstance(eps, numbers.Real) and not isinstance(eps, bool) and eps == 0:
            q_norm, k_norm = zero_eps_norm(q_weight), zero_eps_norm(k_weight)
        else:
            q_norm, k_norm = HeadNorm(q_weight, eps), HeadNorm(k_weight, eps)
    except RoPEError as error:  # HeadNorm's complaint about eps, told of the op's argument
        raise type(error)(str(error).replace("HeadNorm eps", "eps")) from error
    heads = qkv.view(qkv.shape[0], hq + hk + hv, head_dim)
    table, positions = _table(cos_sin_cache, positions)
    door.state.words = _FUSED_DOOR  # (the in-graph checks' words, traced)
    try:
        apply_qk_(heads[:, :hq], heads[:, hq : hq + hk], table,
                  _spec("thd", qkv.dtype, not is_neox), positions=positions, q_norm=q_norm,
                  k_norm=k_norm)
    except RoPEError as error:
        raise _mapped(error, "fused_qk_norm_rope", _FUSED_MAPPING, "apply_qk_") from error
    finally:
        door.state.words = None


# How each door maps its arguments onto the core's, for the core's errors (_mapped).
_ROTARY_MAPPING = ("q=query, k=key (each as heads of head_size, from rope_dim_offset), "
                   "freqs=cos_sin_cache, positions=positions")
_ROTARY_ALONE = ("t=query (as heads of head_size, from rope_dim_offset), freqs=cos_sin_cache, "
                 "positions=positions")
_FUSED_MAPPING = ("q=qkv's q heads, k=qkv's k heads (each [num_tokens, heads, head_dim]), "
                  "freqs=cos_sin_cache, positions=position_ids, q_norm=q_weight, k_norm=k_weight")
_ROTARY_DOOR = _door_words("rotary_embedding", _ROTARY_MAPPING, "apply_qk_")
_ROTARY_ALONE_DOOR = _door_words("rotary_embedding", _ROTARY_ALONE, "apply_")
_FUSED_DOOR = _door_words("fused_qk_norm_rope", _FUSED_MAPPING, "apply_qk_")
