"""RoPE of :class:`torch.distributed.tensor.DTensor` inputs: a custom op with a sharding rule.

A DTensor call is checked here for what only the placements can say, then runs
``rope_dispatch::rope_shard``, a custom op whose sharding rule (registered with
``torch.distributed.tensor.experimental.register_sharding``) keeps the input's placements on
the output: DTensor runs it on every rank's local shard, with no collective. The op's body is
the ordinary call (:func:`rope_dispatch.dispatch._run`) on the local tensors, so a shard goes
through the same checks, backend choice and plans as any tensor, its norm stage (a
:class:`~rope_dispatch.HeadNorm`, the weight replicated) and table kind included.

What the shard cannot know, its tokens' global positions, travels as a per-token positions
tensor built on each rank from the shard's offset (no communication), a DTensor sharded like
the tokens: a rank holding tokens ``o .. o + n`` of the sequence reads table rows ``o .. o + n``
(plus ``start_positions``), exactly the rows the unsharded call reads (``thd``: each token's
place in its packed sequence, from the global ``cu_seqlens``; multimodal RoPE: the three position
streams, sharded one dim later, each shard lowering its own). An angle table sharded
with the sequence (``Shard(0)`` on the mesh dims that shard the tokens' sequence, as torch's
context-parallel buffers are) is read at the shard's own rows instead. The op's backward is the
same op with the transposed rotation, so gradients keep the placements too; after a norm stage
it is ``rope_shard_norm_backward``, whose weight gradient is ``Partial`` (each rank's part of
the sum) wherever the tokens or heads are sharded, so torch reduces it. In-place calls rotate
each rank's local shard (:func:`_rotate_in_place`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.experimental import register_sharding

from .errors import RoPEError, RoPETypeError
from .norm import HeadNorm, head_norm_backward
from .registry import call_entry, get_backend
from .spec import RoPESpec
from .tables import CosSinCache, PairCosSinCache, RateTable, angles_2d, table_kind
from .tracing import exact_size, transformed

_SEQ_DIM = {"sbhd": 0, "bshd": 1, "thd": 0}
_BATCH_DIM = {"sbhd": 1, "bshd": 0}


# ---------------------------------------------------------------------------------------------
# The ops, their sharding rules and the autograd formula


class _Settings(NamedTuple):
    """The op's arguments after its tensors, but the backend (the schema's order)."""

    token_dims: int
    layout: str
    kind: str  # the table kind (tables.table_kind)
    rows: int  # a rate table's rows; 0 for the kinds that are tensors of rows
    interleaved: bool
    scale: float
    inverse: bool
    offset: int
    deinterleave: bool
    norm_scope: str | None  # the HeadNorm stage's scope, eps and offset; None: no norm stage
    eps: float
    norm_offset: float
    mrope: tuple | None  # the spec's mrope_section (three position streams) and its layout
    mrope_interleaved: bool


@functools.lru_cache(maxsize=64)
def _local_spec(s: _Settings, dtype: torch.dtype) -> RoPESpec:
    """One spec object per setting, so repeated shard calls reuse their plans (keyed by id)."""
    return RoPESpec(layout=s.layout, dtype=dtype, interleaved=s.interleaved,
                    cos_sin_scale=s.scale, inverse=s.inverse, rotary_offset=s.offset,
                    deinterleave=s.deinterleave, mrope_section=s.mrope,
                    mrope_interleaved=s.mrope_interleaved)


# A rate table per doubled-rates tensor a shard call met (the caller's RateTable's, replicated),
# so a backend that reads angle tables makes one once. The tensor is kept beside it: no other
# tensor can take its address while the entry lives.
_rate_tables: dict[tuple, tuple[torch.Tensor, RateTable]] = {}


def _rate_table(rates: torch.Tensor, rows: int, precise: bool) -> RateTable:
    key = (rates.data_ptr(), rates.device, rates.dtype, rates.shape[0], rows, precise)
    entry = _rate_tables.get(key)
    if entry is None:
        if len(_rate_tables) >= 4:
            _rate_tables.clear()
        # the doubled rates hold each float32 rate exactly (a precise table's too: its kernels'
        # fractions of a turn are made from them)
        table = RateTable(rates[: rates.shape[0] // 2].float(), rows, precise)
        entry = _rate_tables[key] = (rates, table)
    return entry[1]


def _table(kind: str, table: torch.Tensor, sin: torch.Tensor | None, rows: int) -> object:
    if kind == "cos_sin_cache":
        return CosSinCache(table, sin)
    if kind == "pair_cos_sin_cache":
        return PairCosSinCache(table)
    if kind in ("rates", "precise_rates"):
        return _rate_table(table, rows, kind == "precise_rates")
    return table


def _no_rows(kind: str, table: torch.Tensor) -> bool:
    """Whether this rank's part of a table sharded with the sequence is empty: it holds no
    tokens (an uneven split), so there is nothing to rotate, and no table a call could take."""
    return table.shape[0] == 0 and kind not in ("rates", "precise_rates")


def _local_call(t: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
                positions: torch.Tensor | None, weight: torch.Tensor | None, s: _Settings,
                backend: str | None) -> torch.Tensor:
    """The ordinary call on one shard's local tensors (a new, contiguous output)."""
    if _no_rows(s.kind, table):
        return t.new_empty(t.shape)
    spec = _local_spec(s, t.dtype)
    norm = None if weight is None else HeadNorm(weight, s.eps, offset=s.norm_offset,
                                                scope=s.norm_scope)
    return call_entry()(t, _table(s.kind, table, sin, s.rows), spec, None, backend, False, False,
                        positions=positions, norms=(norm, None))


@torch.library.custom_op("rope_dispatch::rope_shard", mutates_args=())
def rope_shard(
    t: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    positions: torch.Tensor | None, weight: torch.Tensor | None, token_dims: int, layout: str,
    kind: str, rows: int, interleaved: bool, scale: float, inverse: bool, offset: int,
    deinterleave: bool, norm_scope: str | None, eps: float, norm_offset: float,
    mrope: Sequence[int] | None, mrope_interleaved: bool, backend: str | None,
) -> torch.Tensor:
    """One shard's rotation (after its norm stage, where ``weight`` is given): the ordinary
    call on local tensors. ``token_dims`` leads the non-tensor arguments: DTensor keys its
    sharding decisions on the arguments from the first int on, so the layout and settings are
    part of that key."""
    s = _Settings(token_dims, layout, kind, rows, interleaved, scale, inverse, offset,
                  deinterleave, norm_scope, eps, norm_offset, _sections(mrope), mrope_interleaved)
    return _local_call(t, table, sin, positions, weight, s, backend)


def _sections(mrope: Sequence[int] | None) -> tuple | None:
    return None if mrope is None else tuple(mrope)


@rope_shard.register_fake
def _rope_shard_fake(t, table, sin, positions, weight, *settings):
    return t.new_empty(t.shape)


@torch.library.custom_op("rope_dispatch::rope_shard_norm_backward", mutates_args=())
def rope_shard_norm_backward(
    grad: torch.Tensor, t: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    positions: torch.Tensor | None, weight: torch.Tensor, token_dims: int, layout: str,
    kind: str, rows: int, interleaved: bool, scale: float, inverse: bool, offset: int,
    deinterleave: bool, norm_scope: str, eps: float, norm_offset: float,
    mrope: Sequence[int] | None, mrope_interleaved: bool, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a normalized shard's rotation: of its input ``t``, and this shard's
    part of the weight's (its tokens' and heads' sum; the sharding rule says Partial). The
    rotation's transpose in float32, then the norm's gradient written out, rounded once."""
    s = _Settings(token_dims, layout, kind, rows, interleaved, scale, not inverse, offset,
                  deinterleave, None, eps, norm_offset, _sections(mrope), mrope_interleaved)
    turned = _local_call(grad.float(), table, sin, positions, None, s, backend)
    dx, dweight = head_norm_backward(t, weight, turned, eps, norm_offset, norm_scope)
    return dx.to(t.dtype), dweight.to(weight.dtype)


@rope_shard_norm_backward.register_fake
def _norm_backward_fake(grad, t, table, sin, positions, weight, *settings):
    return t.new_empty(t.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    t, table, sin, positions, weight = inputs[:5]
    # the input is read again only by a norm stage's backward
    ctx.save_for_backward(None if weight is None else t, table, sin, positions, weight)
    ctx.settings = inputs[5:]
    ctx.placements = t.placements  # the gradient's (see _placed)


def _backward(ctx, grad):
    t, table, sin, positions, weight = ctx.saved_tensors
    s, backend = _Settings(*ctx.settings[:-1]), ctx.settings[-1]
    none = (None,) * len(ctx.settings)
    if weight is None:  # the transpose: the same channels (and pairing) turned the other way
        made = rope_shard(grad, table, sin, positions, None, *s._replace(inverse=not s.inverse),
                          backend)
        return (_placed(made, ctx.placements), None, None, None, None) + none
    dx, dweight = rope_shard_norm_backward(grad, t, table, sin, positions, weight, *s, backend)
    return (_placed(dx, ctx.placements), None, None, None,
            dweight if ctx.needs_input_grad[4] else None) + none


def _placed(x: DTensor, placements: tuple) -> DTensor:
    """``x`` placed as given: DTensor replicates a dim sharded over more ranks than it has
    entries (one head on two ranks) before the op, and the result is sliced back (no
    communication), so outputs, gradients and in-place writes keep the input's layout."""
    return x if x.placements == placements else x.redistribute(x.device_mesh, placements)


rope_shard.register_autograd(_backward, setup_context=_setup_context)


def _placement_choices(t, table, positions, token_dims: int, layout: str):
    """Per mesh dim, the placements of ``t``, its table and its positions that need no
    communication: all replicated; the heads sharded, the rest replicated; a token dim sharded
    with its positions. A table sharded on its rows goes with the sequence dim (its rows are
    then the shard's own tokens); a replicated table never does, and without positions (each
    shard's local index is then its position) neither does the sequence, so DTensor cannot
    pick a strategy that reads the wrong rows (as it would redistributing one head on two
    ranks to the sequence)."""
    seq, R = _SEQ_DIM[layout], Replicate()
    table_sharded = any(isinstance(p, Shard) for p in table.placements)
    streams = 0 if positions is None else len(positions.shape) - token_dims  # mrope's 3: 1
    choices = [(R, R, R), (Shard(len(t.shape) - 2), R, R)]
    for d in range(token_dims):
        if d == seq and table_sharded:
            choices.append((Shard(d), Shard(0), R))
        elif d != seq or positions is not None:
            choices.append((Shard(d), R, Shard(d + streams)))
    return choices


@register_sharding(torch.ops.rope_dispatch.rope_shard.default)
def _sharding(t, table, sin, positions, weight, token_dims, layout, *settings):
    """The output placed as ``t``; a norm weight replicated."""
    return [([out], [out, tab, None if sin is None else tab, None if positions is None else pos,
                     None if weight is None else Replicate()])
            for out, tab, pos in _placement_choices(t, table, positions, token_dims, layout)]


@register_sharding(torch.ops.rope_dispatch.rope_shard_norm_backward.default)
def _norm_backward_sharding(grad, t, table, sin, positions, weight, token_dims, layout,
                            *settings):
    """The input's gradient placed as ``t``; the weight's Partial (a sum over the ranks) on
    every mesh dim that shards ``t``, as DTensor leaves a replicated parameter's gradient."""
    return [([out, Replicate() if out.is_replicate() else Partial()],
             [out, out, tab, None if sin is None else tab, None if positions is None else pos,
              Replicate()])
            for out, tab, pos in _placement_choices(t, table, positions, token_dims, layout)]


# ---------------------------------------------------------------------------------------------
# The entry: a public call whose tensor is a DTensor


def _refuse(why: str) -> RoPEError:
    return RoPEError(f"DTensor call: {why}")


def _check_placements(x: DTensor, name: str) -> None:
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


def _table_tensors(freqs: object, name: str
                   ) -> tuple[str, torch.Tensor, torch.Tensor | None, int]:
    """``(kind, table, sin, rows)``: the tensors the op takes for ``freqs`` (argument ``name``;
    a rate table's doubled rates, which each shard makes its RateTable of; ``rows`` is its row
    count)."""
    if isinstance(freqs, CosSinCache):
        return "cos_sin_cache", freqs.cos, freqs.sin, 0
    if isinstance(freqs, PairCosSinCache):
        return "pair_cos_sin_cache", freqs.table, None, 0
    if isinstance(freqs, RateTable):
        if isinstance(freqs.inv_freq, DTensor):
            raise _refuse(f"{name} is a RateTable of DTensor rates; build it of a plain "
                          "tensor (every rank computes the same rows from the same rates)")
        return table_kind(freqs), freqs._kernel_rates, None, freqs.rows
    if not isinstance(freqs, torch.Tensor):
        angles_2d(freqs, name)  # raises, saying what it may be (and what to build from rates)
    if freqs.dim() == 4:
        if tuple(freqs.shape[1:3]) != (1, 1):
            raise RoPEError(f"{name} must be [s2, 1, 1, d2] or [s2, d2], got "
                            f"{tuple(freqs.shape)}")
        freqs = freqs.view(freqs.shape[0], freqs.shape[3])
    return "angles", freqs, None, 0


def _whole(x: object, name: str) -> object:
    """A global index tensor given plain or as a replicated DTensor, as a plain tensor."""
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            raise _refuse(f"{name} must be a plain tensor or a replicated DTensor")
        return x.to_local()
    return x


def _local_index(x: torch.Tensor | None, offsets: tuple, sizes: tuple, name: str,
                 device: torch.device) -> torch.Tensor | None:
    """This rank's part of a global index tensor (plain, or a replicated DTensor), gathered
    by index: under torch.compile the offsets are symbols, one graph for every rank."""
    if x is None:
        return None
    x = _whole(x, name)
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        x = x.index_select(d, torch.arange(n, device=device) + o)
    return x


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _local_tokens(t: DTensor, tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's size and global offset along ``t``'s first ``tokens`` dims, by DTensor's
    rule for ``Shard`` (mesh dims in order, each splitting what the earlier ones left into
    chunks of ``ceil(n / ranks)``, the last ones shorter or empty), in integer arithmetic:
    ``torch.compile`` of torch 2.11 cannot trace DTensor's own helper for it (a graph break
    on ``Shard._local_shard_size_and_offset``)."""
    sizes, offsets = list(t.shape[:tokens]), [0] * tokens
    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate()
    for i, p in enumerate(t.placements):
        if isinstance(p, Shard) and p.dim < tokens:
            chunk = -(-sizes[p.dim] // mesh.size(i))
            start = min(chunk * coordinate[i], sizes[p.dim])
            sizes[p.dim] = min(sizes[p.dim] - start, chunk)
            offsets[p.dim] += start
    return tuple(sizes), tuple(offsets)


def _token_dim(p: object, tokens: int) -> int | None:
    """The token dim (of the first ``tokens``) that placement ``p`` shards, ``None`` for none,
    as a plain int: under ``torch.compile(dynamic=True)`` a placement's ``dim`` is traced as a
    symbol, which a new ``Shard`` does not take."""
    for d in range(tokens):
        if p.is_shard(d):
            return d
    return None


def _positions(t: DTensor, spec: RoPESpec, start_positions, positions,
               table_sharded: bool, table_len: int) -> DTensor | None:
    """Each local token's table row as a DTensor sharded like the tokens (``None``: the shard's
    own index serves, rows local to a sharded table or an unsharded sequence from 0); for
    multimodal RoPE the three position streams ``[3, *tokens]``, sharded one dim later, which
    each shard's call lowers for its own tokens."""
    layout, mesh = spec.layout, t.device_mesh
    tokens = t.dim() - 2
    local_tokens, token_offset = _local_tokens(t, tokens)
    lead = () if spec.mrope_section is None else (3,)  # the position streams
    placements = [Replicate() if d is None else Shard(d + len(lead))
                  for d in (_token_dim(p, tokens) for p in t.placements)]
    if table_sharded:
        if start_positions is not None or positions is not None:
            raise _refuse(
                "a table sharded with the sequence holds only this rank's rows, so "
                "start_positions or positions would need rows of other ranks; replicate it"
            )
        return None
    shape = (*lead, *t.shape[:tokens])
    if lead:
        if start_positions is not None or positions is None:
            raise RoPEError(
                "spec.mrope_section needs positions [3, *t.shape[:-2]] (the temporal, height "
                "and width position of every token) and no start_positions"
            )
        if tuple(positions.shape) != shape:
            raise RoPEError(f"positions must be [{', '.join(map(str, shape))}] for "
                            f"spec.mrope_section, got {tuple(positions.shape)}")
    start_positions = _whole(start_positions, "start_positions")
    sharded = isinstance(positions, DTensor) and any(p.is_shard() for p in positions.placements)
    if sharded and start_positions is not None:  # as the plain call (check_index) refuses
        raise RoPEError(
            "positions and start_positions cannot be combined: per-token positions already "
            "say each token's row; add the start to them instead"
        )
    if sharded and tuple(positions.shape) != shape:  # a shard's call sees only its part
        raise RoPEError(f"positions must have shape {list(shape)} (t.shape[:-2], one per token) "
                        f"for layout {layout!r}, got {tuple(positions.shape)}")
    if sharded and layout == "thd" and spec.cu_seqlens is not None:
        from .call import _check_cu_seqlens, _host_reads_allowed, reads_values

        if reads_values(spec) and _host_reads_allowed():  # the plain call's check of them
            _check_cu_seqlens(spec, t.shape[0], None, None, "freqs")
    if not (lead or sharded):
        positions = _whole(positions, "positions")
        from .call import check_index

        # the plain call's checks, against the global shape on every rank alike: a shard's
        # call sees only its part (a wrong size passed unnoticed, or failed on some ranks only)
        check_index(spec, t.shape, table_len, start_positions, positions, t.device, "freqs")
    elif not sharded:  # the streams' rows, on every rank alike (a shard lowers only its own)
        from .call import _positions_in_table

        _positions_in_table(_whole(positions, "positions"), table_len, t.device, "freqs")
    if positions is not None:
        if sharded:
            if list(positions.placements) != placements:
                raise _refuse(
                    f"positions has placements {positions.placements}, expected {placements} "
                    "(sharded as the tokens of t" + (", after the stream dim)" if lead else ")")
                )
            return positions
        local = _local_index(positions, (0,) * len(lead) + token_offset, lead + local_tokens,
                             "positions", t.device)
    elif layout == "thd":  # every token's row from the global cu_seqlens, then this rank's
        from rope_dispatch.backends.eager import positions as token_rows

        starts = _local_index(start_positions, (), (), "start_positions", t.device)
        if spec.cu_seqlens is None:
            raise RoPEError("layout 'thd' needs cu_seqlens in the spec, or per-token positions")
        rows = token_rows(t.shape, "thd", spec.cu_seqlens, starts, 1, 0, t.device)
        local = rows[token_offset[0]:token_offset[0] + local_tokens[0]].contiguous()
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
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_strides(shape))


def _check_spec(spec: RoPESpec) -> None:
    if spec.cp_size > 1:
        raise _refuse(
            f"spec.cp_size={spec.cp_size}: a DTensor's placements already say which tokens a rank "
            "holds; shard the sequence (Shard on its dim) with cp_size=1"
        )


def _replicated(x: torch.Tensor, mesh, name: str) -> DTensor:
    """A norm weight as a replicated DTensor on ``mesh``. A plain tensor is wrapped (no
    communication; differentiable: its gradient, the sum of every rank's part, comes back
    all-reduced, the full gradient on each rank, as the unsharded call's)."""
    if not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if x.device_mesh is not mesh and x.device_mesh != mesh:
        raise _refuse(f"{name} lives on another device mesh than t")
    for i, p in enumerate(x.placements):
        if not p.is_replicate():
            raise _refuse(
                f"{name} has placement {p} on mesh dim {i}; expected Replicate() (every rank "
                "normalizes with the whole weight): a plain tensor or a replicated DTensor"
            )
    return x


def _norm_stage(norm: object, name: str, t: DTensor) -> tuple[DTensor, tuple] | None:
    """A :class:`HeadNorm` checked for ``t``'s placements: its weight as a replicated DTensor
    and its settings (scope, eps, offset); the rest is checked on each shard."""
    if norm is None:
        return None
    if not isinstance(norm, HeadNorm):
        raise RoPETypeError(
            f"{name} must be a rope_dispatch.HeadNorm or None, got {type(norm).__name__}")
    heads, owner = t.dim() - 2, {"norm": "t", "q_norm": "q", "k_norm": "k"}[name]
    if norm.scope == "heads":
        for i, p in enumerate(t.placements):
            if isinstance(p, Shard) and p.dim == heads:
                raise _refuse(
                    f"{name} has scope='heads' (a token's heads normalized together), but "
                    f"{owner} is sharded on its heads (Shard({heads}), mesh dim {i}), so a rank "
                    "holds only some of each token's heads; use scope='head', or shard batch "
                    "or sequence"
                )
    return _replicated(norm.weight, t.device_mesh, f"{name}.weight"), (
        norm.scope, norm.eps, norm.offset)


class _Prepared(NamedTuple):
    """A DTensor call's op arguments but the tensor: the table, its sin half, the positions,
    the settings (no norm stage) and each side's norm stage (q's or t's, k's)."""

    table: DTensor
    sin: DTensor | None
    positions: DTensor | None
    settings: _Settings
    norms: tuple
    k_table: tuple | None = None
    """apply_qkv's own k table (``k_freqs``): ``(table, sin, kind, rows)``; ``None``: k reads
    ``table``."""


def _check_in_place(t: DTensor, k: DTensor | None, freqs: object) -> None:
    """What the plain in-place calls refuse, said of the DTensors."""
    from .call import _check_writable, table_grad_wanted

    if table_grad_wanted(freqs, None):
        raise RoPEError(
            f"{'apply_' if k is None else 'apply_qk_'} cannot rotate in place with a table "
            "that requires grad; pass freqs.detach() for a constant table"
        )
    _check_writable(t, "t" if k is None else "q")
    if k is not None:
        _check_writable(k, "k")
        if k is t:
            raise RoPEError("apply_qk_ got the same tensor as q and k; it would be rotated twice")


def _prepare(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions, in_place,
             k_freqs, k, norms, split=None) -> _Prepared:
    """A DTensor call checked for what its placements allow."""
    from .spec import dtype_name

    if not isinstance(spec, RoPESpec):
        raise RoPETypeError(f"spec must be a rope_dispatch.RoPESpec, got {type(spec).__name__}")
    _check_spec(spec)
    if t.dtype != spec.dtype:
        raise RoPEError(
            f"t has dtype {dtype_name(t.dtype)} but spec.dtype is {dtype_name(spec.dtype)}; "
            "build the spec with the tensor's dtype"
        )
    rank = 3 if spec.layout == "thd" else 4
    if t.dim() != rank:
        raise RoPEError(f"t must have {rank} dims for layout {spec.layout!r}, got {tuple(t.shape)}")
    _check_placements(t, "t")
    if k is not None:
        if not isinstance(k, DTensor) or (k.device_mesh is not t.device_mesh
                                          and k.device_mesh != t.device_mesh):
            raise _refuse("q is a DTensor, so k must be a DTensor on the same mesh")
        from .call import _check_k

        _check_k(t, k, in_place)  # the plain call's check, of the global shapes
        _check_placements(k, "k")
        if list(k.placements) != list(t.placements):
            raise _refuse(f"k has placements {k.placements} but q {t.placements}; expected the same")
    if in_place:
        _check_in_place(t, k, freqs)
    q_name = "norm" if k is None and split is None else "q_norm"
    stages = (_norm_stage(norms[0], q_name, t), _norm_stage(norms[1], "k_norm", t))
    kind, table, sin, rows, table_sharded = _op_table(freqs, "freqs", t, spec)
    d2 = table.shape[-1] if kind == "angles" else freqs.rotary_dim
    if spec.rotary_dim is not None and spec.rotary_dim != d2:  # the local spec has none
        raise RoPEError(
            f"spec.rotary_dim={spec.rotary_dim} but freqs has last dim d2={d2}; they must be equal"
        )
    k_table = None
    if k_freqs is not None and k_freqs is not freqs:  # apply_qkv's own k table
        k_kind, k_tab, k_sin, k_rows, k_sharded = _op_table(k_freqs, "k_freqs", t, spec)
        if k_sharded != table_sharded:
            raise _refuse("k_freqs and freqs must both be sharded with the sequence, or neither")
        k_d2 = k_tab.shape[-1] if k_kind == "angles" else k_freqs.rotary_dim
        if k_d2 != d2:
            raise RoPEError(f"k_freqs has rotary dim {k_d2} but freqs has {d2}; q and k must "
                            "rotate the same number of channels")
        k_table = (k_tab, k_sin, k_kind, k_rows)
    table_len = rows if kind in ("rates", "precise_rates") else table.shape[0]
    if k_table is not None:
        table_len = min(table_len, k_rows if k_kind in ("rates", "precise_rates")
                        else k_tab.shape[0])
    pos = _positions(t, spec, start_positions, positions, table_sharded, table_len)
    settings = _Settings(t.dim() - 2, spec.layout, kind, rows, spec.interleaved,
                         float(spec.cos_sin_scale), spec.inverse, spec.rotary_offset,
                         spec.deinterleave, None, 0.0, 0.0, _sections(spec.mrope_section),
                         spec.mrope_interleaved)
    return _Prepared(table, sin, pos, settings, stages, k_table)


def _op_table(freqs: object, name: str, t: DTensor, spec: RoPESpec) -> tuple:
    """``(kind, table, sin, rows, sharded)``: ``freqs``' tensors as the op takes them, DTensors
    on ``t``'s mesh, checked against ``t``'s placements."""
    kind, table, sin, rows = _table_tensors(freqs, name)
    if torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (table, sin)):
        raise _refuse(
            f"{name} requires grad: a DTensor call does not differentiate its table (learned "
            "angles); detach it, or gather the tensors and call with plain ones"
        )
    mesh = t.device_mesh
    table, sin = _as_dtensor(table, mesh, name), _as_dtensor(sin, mesh, f"{name}.sin")
    sharded = any(p.is_shard() for p in table.placements)
    if sharded and (spec.layout == "thd" or spec.mrope_section is not None):
        raise _refuse(
            f"{name} has placements {table.placements}: with "
            f"{'layout thd' if spec.layout == 'thd' else 'spec.mrope_section'} a table's rows "
            "are positions, not tokens; replicate it"
        )
    if sharded:
        seq = _SEQ_DIM[spec.layout]
        for i, (p, q) in enumerate(zip(table.placements, t.placements)):
            if p.is_shard() != q.is_shard(seq):
                raise _refuse(
                    f"{name} is {p} on mesh dim {i} but t is {q}; a table sharded on its rows "
                    f"must be sharded exactly where t's sequence (dim {seq}) is"
                )
        if table.shape[0] != t.shape[seq]:
            raise _refuse(
                f"{name} is sharded with the sequence, so it needs one row per token "
                f"({t.shape[seq]}), got {table.shape[0]}"
            )
    return kind, table, sin, rows, sharded


def _one(x: DTensor, p: _Prepared, stage: tuple | None, backend: str | None) -> DTensor:
    """The op on one DTensor, after its norm stage where ``stage`` is given, placed as ``x``
    (:func:`_placed`)."""
    if stage is None:
        out = rope_shard(x, p.table, p.sin, p.positions, None, *p.settings, backend)
    else:
        weight, (scope, eps, offset) = stage
        settings = p.settings._replace(norm_scope=scope, eps=eps, norm_offset=offset)
        out = rope_shard(x, p.table, p.sin, p.positions, weight, *settings, backend)
    return _placed(out, x.placements)


def rotate(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions,
           backend: str | None, *, in_place: bool = False, split=None, k_freqs=None, k=None,
           norms: tuple = (None, None)):
    """A public call (``apply``, ``apply_qk``, ``apply_qkv``, and in place ``apply_`` and
    ``apply_qk_``) whose tensor is a DTensor: new DTensors with the input's placements (or the
    inputs, rotated in place), computed shard by shard without communication."""
    if backend is not None:  # refused by name here, as a plain call's, not inside each shard
        get_backend(backend, "the backend= argument")
    p = _prepare(t, freqs, spec, start_positions, positions, in_place, k_freqs, k, norms, split)
    if in_place:
        return _rotate_in_place(t, k, p, backend)
    if k is not None:
        return _one(t, p, p.norms[0], backend), _one(k, p, p.norms[1], backend)
    if split is None:
        return _one(t, p, p.norms[0], backend)
    from .call import _check_split

    q_len, k_len, _ = _check_split(split, t.shape[-1])
    groups = t.dim() - 2
    dims = [i for i, placement in enumerate(t.placements)
            if isinstance(placement, Shard) and placement.dim in (groups, -2)]
    ranks = math.prod(t.device_mesh.size(i) for i in dims)
    if q_len > k_len and t.shape[groups] % ranks:  # (sharded twice: split, then split again)
        raise _refuse(
            f"apply_qkv's tensor is sharded on its {t.shape[groups]} head groups (mesh dims "
            f"{dims}, {ranks} ranks), which do not divide evenly: its q heads "
            f"({q_len // k_len} a group) cannot be laid out as one sharded head dim; use a "
            "number of groups the mesh divides, or split q, k and v and call apply_qk"
        )
    q = t[..., :q_len]
    q = q.reshape(*q.shape[:-2], q.shape[-2] * (q_len // k_len), k_len)
    k_part = t[..., q_len:q_len + k_len]
    p_k = p
    if p.k_table is not None:
        k_tab, k_sin, k_kind, k_rows = p.k_table
        p_k = p._replace(table=k_tab, sin=k_sin,
                         settings=p.settings._replace(kind=k_kind, rows=k_rows))
    return (_one(q, p, p.norms[0], backend), _one(k_part, p_k, p.norms[1], backend),
            t[..., q_len + k_len:].contiguous())


def _rotate_in_place(t: DTensor, k: DTensor | None, p: _Prepared, backend: str | None):
    """``apply_``/``apply_qk_``: each rank's shard rotated in place; returns ``t`` (``(t, k)``).

    Where no gradient is wanted (eagerly), the ordinary in-place call runs on each rank's
    local tensors, so a backend writes only what the plain call writes, and the DTensors'
    version counters move as an in-place op moves them. Where one is wanted, or under
    torch.compile, the op makes the rotated shards apart and ``copy_`` writes them back (a
    local copy, no communication), as the eager backend's in-place path does: autograd records
    the write, and the backward makes a new gradient (``grad_in_place`` is not taken up)."""
    targets = (t,) if k is None else (t, k)
    weights = [stage[0] for stage in p.norms if stage is not None]
    wanted = torch.is_grad_enabled() and any(x.requires_grad for x in (*targets, *weights))
    if not wanted and not torch.compiler.is_compiling():
        if not _no_rows(p.settings.kind, p.table.to_local()):
            local, table, spec, pos, local_k, local_norms = _local_parts(t, k, p)
            call_entry()(local, table, spec, None, backend, True, False, positions=pos,
                         k=local_k, norms=local_norms)
        torch.autograd.graph.increment_version(targets)
        return t if k is None else (t, k)
    apart = None  # traced: the graph's check that q and k are apart, whose -0.0 each adds
    if k is not None and not torch.compiler.is_compiling():
        from .overlap import _check_apart

        _check_apart(t.to_local(), k.to_local(), t.shape[-1])  # every channel is written
    elif k is not None and not transformed():  # the same check, on the graph's real shards
        from .backends.written import written_apart_op

        apart = written_apart_op(t.to_local().detach(), k.to_local().detach(), None, None, [],
                                 exact_size(t.shape[-1]), 0, "")
    # a norm stage's backward reads its input, which the copy below overwrites: it reads a copy
    made = [_one(x.clone() if stage is not None and wanted else x, p, stage, backend)
            for x, stage in zip(targets, p.norms)]
    for x, out in zip(targets, made):
        x.copy_(out if apart is None else out + apart)
    return t if k is None else (t, k)


def _local_parts(t: DTensor, k: DTensor | None, p: _Prepared) -> tuple:
    """This rank's part of a prepared call as the plain call its shard runs: ``(t, freqs, spec,
    positions, k, norms)``, local tensors (views of the DTensors' own)."""
    s = p.settings
    local_spec = _local_spec(s, t.dtype)
    sin = None if p.sin is None else p.sin.to_local()
    norms = tuple(None if stage is None else HeadNorm(stage[0].to_local(), stage[1][1],
                                                      offset=stage[1][2], scope=stage[1][0])
                  for stage in p.norms)
    return (t.to_local(), _table(s.kind, p.table.to_local(), sin, s.rows), local_spec,
            None if p.positions is None else p.positions.to_local(),
            None if k is None else k.to_local(), norms)


def shard_call(t: DTensor, freqs: object, spec: RoPESpec, start_positions, positions, *,
               in_place: bool = False, k_freqs=None, k=None, norms: tuple = (None, None),
               split=None) -> tuple:
    """This rank's part of a DTensor call as the plain call its shard runs: ``(t, freqs, spec,
    positions, k, norms)``, local tensors (what :func:`~rope_dispatch.explain` explains)."""
    return _local_parts(t, k, _prepare(t, freqs, spec, start_positions, positions, in_place,
                                       k_freqs, k, norms, split))
