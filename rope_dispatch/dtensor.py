"""RoPE of :class:`torch.distributed.tensor.DTensor` inputs: one custom op with a sharding rule.

A DTensor call is checked here for what only the placements can say, then runs
``rope_dispatch::rope_shard``, a custom op whose sharding rule (registered with
``torch.distributed.tensor.experimental.register_sharding``) keeps the input's placements on
the output: DTensor runs it on every rank's local shard, with no collective. The op's body is
the ordinary call (:func:`rope_dispatch.dispatch._run`) on the local tensors, so a shard goes
through the same checks, backend choice and plans as any tensor.

What the shard cannot know, its tokens' global positions, travels as a per-token positions
tensor built on each rank from the shard's offset (no communication), a DTensor sharded like
the tokens: a rank holding tokens ``o .. o + n`` of the sequence reads table rows ``o .. o + n``
(plus ``start_positions``), exactly the rows the unsharded call reads. An angle table sharded
with the sequence (``Shard(0)`` on the mesh dims that shard the tokens' sequence, as torch's
context-parallel buffers are) is read at the shard's own rows instead. The op's backward is the
same op with the transposed rotation, so gradients keep the placements too.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import register_sharding

from .errors import RoPEError
from .registry import call_entry
from .spec import RoPESpec
from .tables import CosSinCache, PairCosSinCache, RateTable

_SEQ_DIM = {"sbhd": 0, "bshd": 1, "thd": 0}
_BATCH_DIM = {"sbhd": 1, "bshd": 0}


def is_dtensor(x: object) -> bool:
    return isinstance(x, DTensor)


# ---------------------------------------------------------------------------------------------
# The op, its sharding rule and its autograd formula


@functools.lru_cache(maxsize=64)
def _local_spec(layout: str, dtype: torch.dtype, interleaved: bool, scale: float,
                inverse: bool, offset: int, deinterleave: bool) -> RoPESpec:
    """One spec object per setting, so repeated shard calls reuse their plans (keyed by id)."""
    return RoPESpec(layout=layout, dtype=dtype, interleaved=interleaved, cos_sin_scale=scale,
                    inverse=inverse, rotary_offset=offset, deinterleave=deinterleave)


def _table(kind: str, table: torch.Tensor, sin: torch.Tensor | None) -> object:
    if kind == "cos_sin_cache":
        return CosSinCache(table, sin)
    if kind == "pair_cos_sin_cache":
        return PairCosSinCache(table)
    return table


@torch.library.custom_op("rope_dispatch::rope_shard", mutates_args=())
def rope_shard(
    t: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    positions: torch.Tensor | None, token_dims: int, layout: str, kind: str, interleaved: bool,
    scale: float, inverse: bool, offset: int, deinterleave: bool, backend: str | None,
) -> torch.Tensor:
    """One shard's rotation: the ordinary call on local tensors (new, contiguous output).
    ``token_dims`` leads the non-tensor arguments: DTensor keys its sharding decisions on the
    arguments from the first int on, so the layout and settings are part of that key."""
    spec = _local_spec(layout, t.dtype, interleaved, scale, inverse, offset, deinterleave)
    return call_entry()(t, _table(kind, table, sin), spec, None, backend, False, False,
                        positions=positions)


@rope_shard.register_fake
def _rope_shard_fake(t, table, sin, positions, token_dims, layout, kind, interleaved, scale,
                     inverse, offset, deinterleave, backend):
    return t.new_empty(t.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:4])
    ctx.settings = inputs[4:]


def _backward(ctx, grad):
    table, sin, positions = ctx.saved_tensors
    token_dims, layout, kind, interleaved, scale, inverse, offset, deinterleave, backend = (
        ctx.settings)
    # the transpose: the same channels (and pairing) turned the other way
    made = rope_shard(grad, table, sin, positions, token_dims, layout, kind, interleaved, scale,
                      not inverse, offset, deinterleave, backend)
    return (made,) + (None,) * 12


rope_shard.register_autograd(_backward, setup_context=_setup_context)


@register_sharding(torch.ops.rope_dispatch.rope_shard.default)
def _sharding(t, table, sin, positions, token_dims, layout, *settings):
    """Per mesh dim: the output placed as ``t``; a token dim sharded with its positions, the
    heads sharded with everything else replicated, or all replicated. A table sharded on its
    rows goes with the sequence dim (its rows are then the shard's own tokens); a replicated
    table never does, so DTensor cannot pick a strategy that reads the wrong rows."""
    seq = _SEQ_DIM[layout]
    table_sharded = any(isinstance(p, Shard) for p in table.placements)
    R = Replicate()

    def strategy(out, tab, pos):
        return ([out], [out, tab, None if sin is None else tab,
                        None if positions is None else pos])

    rules = [strategy(R, R, R), strategy(Shard(len(t.shape) - 2), R, R)]
    for d in range(token_dims):
        if d == seq and table_sharded:
            rules.append(strategy(Shard(d), Shard(0), R))
        else:
            rules.append(strategy(Shard(d), R, Shard(d)))
    return rules


# ---------------------------------------------------------------------------------------------
# The entry: a public call whose tensor is a DTensor


def _refuse(why: str) -> RoPEError:
    return RoPEError(f"DTensor call: {why}")


def _check_placements(x: DTensor, name: str, layout: str) -> None:
    last = x.dim() - 1
    for i, p in enumerate(x.placements):
        if isinstance(p, Partial):
            raise _refuse(
                f"{name} is Partial({p.reduce_op}) on mesh dim {i}; the rotation reads whole "
                "values: reduce it first (redistribute to Shard or Replicate)"
            )
        if not (p.is_shard() or p.is_replicate()) or isinstance(p, _StridedShard):
            raise _refuse(f"{name} has placement {p} on mesh dim {i}; expected Shard or Replicate")
        if isinstance(p, Shard) and p.dim == last:
            raise _refuse(
                f"{name} is sharded on its head dim (Shard({last}), mesh dim {i}); a rotation "
                "pairs channels across the whole head: shard batch, sequence or heads instead"
            )
        if isinstance(p, Shard) and layout == "thd" and p.dim == 0:
            raise _refuse(
                f"{name} is sharded on its token dim (Shard(0), mesh dim {i}) in layout 'thd': "
                "a shard of packed sequences cuts them at arbitrary tokens, and its cu_seqlens "
                "would no longer describe it; shard the heads, or use the zigzag split "
                "(RoPESpec cp_size/cp_rank, docs/context-parallel.md) on local tensors"
            )


def _as_dtensor(x: torch.Tensor | None, mesh, name: str) -> DTensor | None:
    """A table tensor as a DTensor on ``mesh``: a plain one replicated (no communication)."""
    if x is None:
        return None
    if isinstance(x, DTensor):
        if x.device_mesh is not mesh and x.device_mesh != mesh:
            raise _refuse(f"{name} lives on another device mesh than t")
        for i, p in enumerate(x.placements):
            if not (p.is_replicate() or (p.is_shard(0) and not isinstance(p, _StridedShard))):
                raise _refuse(
                    f"{name} has placement {p} on mesh dim {i}; a table is replicated, or "
                    "sharded on its rows (Shard(0)) with the sequence"
                )
        return x
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _table_tensors(freqs: object) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    if isinstance(freqs, CosSinCache):
        return "cos_sin_cache", freqs.cos, freqs.sin
    if isinstance(freqs, PairCosSinCache):
        return "pair_cos_sin_cache", freqs.table, None
    if isinstance(freqs, RateTable):
        raise _refuse(
            "a RateTable computes rows inside the Triton kernels from plain tensors; pass an "
            "angle table or a CosSinCache (replicated, or sharded with the sequence)"
        )
    if not isinstance(freqs, torch.Tensor):
        raise RoPEError(
            f"freqs must be an angle table, a CosSinCache or a PairCosSinCache, got "
            f"{type(freqs).__name__}"
        )
    if freqs.dim() == 4:
        if tuple(freqs.shape[1:3]) != (1, 1):
            raise RoPEError(f"freqs must be [s2, 1, 1, d2] or [s2, d2], got {tuple(freqs.shape)}")
        freqs = freqs.view(freqs.shape[0], freqs.shape[3])
    return "angles", freqs, None


def _local_index(x: torch.Tensor | None, offsets: tuple, sizes: tuple, name: str,
                 device: torch.device) -> torch.Tensor | None:
    """This rank's part of a global index tensor (plain, or a replicated DTensor), gathered
    by index: under torch.compile the offsets are symbols, one graph for every rank."""
    if x is None:
        return None
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            raise _refuse(f"{name} must be a plain tensor or a replicated DTensor")
        x = x.to_local()
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        x = x.index_select(d, torch.arange(n, device=device) + o)
    return x


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _positions(t: DTensor, spec: RoPESpec, start_positions, positions,
               table_sharded: bool) -> DTensor | None:
    """Each local token's table row as a DTensor sharded like the tokens (``None``: the shard's
    own index serves, rows local to a sharded table or an unsharded sequence from 0)."""
    layout, mesh = spec.layout, t.device_mesh
    tokens = t.dim() - 2
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    local_tokens, token_offset = tuple(local_shape[:tokens]), tuple(offset[:tokens])
    placements = [p if p.is_shard() and p.dim < tokens else Replicate() for p in t.placements]
    if table_sharded:
        if start_positions is not None or positions is not None:
            raise _refuse(
                "a table sharded with the sequence holds only this rank's rows, so "
                "start_positions or positions would need rows of other ranks; replicate it"
            )
        return None
    if positions is not None:
        if isinstance(positions, DTensor) and any(isinstance(p, Shard) for p in positions.placements):
            if list(positions.placements) != placements:
                raise _refuse(
                    f"positions has placements {positions.placements}, expected {placements} "
                    "(sharded as the tokens of t)"
                )
            return positions
        local = _local_index(positions, token_offset, local_tokens, "positions", t.device)
    elif layout == "thd":
        from rope_dispatch.backends.eager import positions as token_rows

        starts = _local_index(start_positions, (), (), "start_positions", t.device)
        if spec.cu_seqlens is None:
            raise RoPEError("layout 'thd' needs cu_seqlens in the spec, or per-token positions")
        local = token_rows(local_shape, "thd", spec.cu_seqlens, starts, 1, 0, t.device)
    else:
        seq, batch = _SEQ_DIM[layout], _BATCH_DIM[layout]
        if start_positions is None and not any(p.is_shard(seq) for p in t.placements):
            return None  # no shard of the sequence, no starts: the local index is the position
        rows = torch.arange(local_tokens[seq], device=t.device) + token_offset[seq]
        rows = rows[:, None] if seq == 0 else rows[None, :]
        if start_positions is not None:
            starts = _local_index(start_positions, (token_offset[batch],),
                                  (local_tokens[batch],), "start_positions", t.device).long()
            rows = rows + (starts[None, :] if batch == 1 else starts[:, None])
        local = rows.expand(local_tokens).contiguous()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape[:tokens],
                              stride=_contiguous_strides(t.shape[:tokens]))


def _check_spec(spec: RoPESpec) -> None:
    if spec.cp_size > 1:
        raise _refuse(
            f"spec.cp_size={spec.cp_size}: a DTensor's placements already say which tokens a rank "
            "holds; shard the sequence (Shard on its dim) with cp_size=1"
        )
    if spec.mrope_section is not None:
        raise _refuse("spec.mrope_section (multimodal position streams) is not supported")


def _prepare(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions, in_place,
             k_freqs, k, norms) -> tuple:
    """A DTensor call checked for what its placements allow: ``(table, sin, positions,
    settings)``, the op's arguments but the tensor and the backend."""
    from .spec import dtype_name

    if in_place:
        raise _refuse(
            "in-place rotation (apply_, apply_qk_) is not offered on DTensors; use apply or "
            "apply_qk, which return DTensors with the same placements"
        )
    if norms[0] is not None or norms[1] is not None:
        raise _refuse("a norm stage (HeadNorm) is not supported; normalize, then rotate")
    if k_freqs is not None and k_freqs is not freqs:
        raise _refuse("a separate k table (k_freqs) is not supported")
    if not isinstance(spec, RoPESpec):
        raise RoPEError(f"spec must be a rope_dispatch.RoPESpec, got {type(spec).__name__}")
    _check_spec(spec)
    if t.dtype != spec.dtype:
        raise RoPEError(
            f"t has dtype {dtype_name(t.dtype)} but spec.dtype is {dtype_name(spec.dtype)}; "
            "build the spec with the tensor's dtype"
        )
    rank = 3 if spec.layout == "thd" else 4
    if t.dim() != rank:
        raise RoPEError(f"t must have {rank} dims for layout {spec.layout!r}, got {tuple(t.shape)}")
    _check_placements(t, "t", spec.layout)
    if k is not None:
        if not isinstance(k, DTensor) or (k.device_mesh is not t.device_mesh
                                          and k.device_mesh != t.device_mesh):
            raise _refuse("q is a DTensor, so k must be a DTensor on the same mesh")
        _check_placements(k, "k", spec.layout)
        if list(k.placements) != list(t.placements):
            raise _refuse(f"k has placements {k.placements} but q {t.placements}; expected the same")
    mesh = t.device_mesh
    kind, table, sin = _table_tensors(freqs)
    table, sin = _as_dtensor(table, mesh, "freqs"), _as_dtensor(sin, mesh, "freqs.sin")
    table_sharded = any(p.is_shard() for p in table.placements)
    if table_sharded:
        seq = _SEQ_DIM[spec.layout]
        for i, (p, q) in enumerate(zip(table.placements, t.placements)):
            if p.is_shard() != q.is_shard(seq):
                raise _refuse(
                    f"freqs is {p} on mesh dim {i} but t is {q}; a table sharded on its rows "
                    f"must be sharded exactly where t's sequence (dim {seq}) is"
                )
        if table.shape[0] != t.shape[seq]:
            raise _refuse(
                f"freqs is sharded with the sequence, so it needs one row per token "
                f"({t.shape[seq]}), got {table.shape[0]}"
            )
    pos = _positions(t, spec, start_positions, positions, table_sharded)
    settings = (t.dim() - 2, spec.layout, kind, spec.interleaved, float(spec.cos_sin_scale),
                spec.inverse, spec.rotary_offset, spec.deinterleave)
    return table, sin, pos, settings


def rotate(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions,
           backend: str | None, *, in_place: bool = False, split=None, k_freqs=None, k=None,
           norms: tuple = (None, None)):
    """A public call (``apply``, ``apply_qk``, ``apply_qkv``) whose tensor is a DTensor: new
    DTensors with the input's placements, computed shard by shard without communication."""
    table, sin, pos, settings = _prepare(t, freqs, spec, start_positions, positions, in_place,
                                         k_freqs, k, norms)

    def one(x: DTensor) -> DTensor:
        return rope_shard(x, table, sin, pos, *settings, backend)

    if k is not None:
        return one(t), one(k)
    if split is None:
        return one(t)
    from .call import _check_split

    q_len, k_len, _ = _check_split(split, t.shape[-1])
    q = t[..., :q_len]
    q = q.reshape(*q.shape[:-2], q.shape[-2] * (q_len // k_len), k_len)
    return one(q), one(t[..., q_len:q_len + k_len]), t[..., q_len + k_len:].contiguous()


def shard_call(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions, *,
               in_place: bool = False, k_freqs=None, k=None, norms: tuple = (None, None)
               ) -> tuple:
    """This rank's part of a DTensor call as the plain call its shard runs: ``(t, freqs, spec,
    positions, k)``, local tensors (what :func:`~rope_dispatch.explain` explains)."""
    table, sin, pos, settings = _prepare(t, freqs, spec, start_positions, positions, in_place,
                                         k_freqs, k, norms)
    _, layout, kind, interleaved, scale, inverse, offset, deinterleave = settings
    local = _local_spec(layout, t.dtype, interleaved, scale, inverse, offset, deinterleave)
    sin = None if sin is None else sin.to_local()
    return (t.to_local(), _table(kind, table.to_local(), sin), local,
            None if pos is None else pos.to_local(), None if k is None else k.to_local())
