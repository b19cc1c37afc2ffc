"""DTensor inputs across processes: 2 and 4 gloo ranks on the CPU, and 2 NCCL ranks of one GPU
each (tensors on the GPUs, the Triton kernels, Inductor), one DeviceMesh.

Every rank builds the same full tensors, cuts its shard locally (``src_data_rank=None``: no
communication), and calls the public API on the DTensor. Inside a ``CommDebugMode`` the forward
and the backward must make no collective at all (no all-gather, no redistribution), the output
and the gradient must keep the input's placements, and their full tensors (gathered after the
check) must match the float64 reference of the unsharded call (tests/reference.py), whose
positions are its own Python loops: a shard of the sequence must rotate its tokens at their
global positions. A spawned job that hangs is killed at a deadline.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import rope_dispatch as rd
from ranks import join_ranks
from reference import (
    assert_matches, reference_forward_backward, reference_qkv_forward_backward, reference_rope,
)

JOB_DEADLINE_S = 240
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
F32 = torch.float32


def _placements(names):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if n is None else Shard(n) for n in names]


def _shard(x, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x, mesh, placements, src_data_rank=None)


def _no_comm(fn, what):
    """``fn()`` run under CommDebugMode, asserting it made no collective."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        made = fn()
    assert comm.get_total_counts() == 0, f"{what}: collectives {comm.get_comm_counts()}"
    return made


def _assert_no_collective(graphs, what):
    """The compiled forward and backward each run the op, and neither communicates."""
    assert len(graphs) == 2, f"{what}: {len(graphs)} graphs, expected a forward and a backward"
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert any("rope_dispatch.rope_shard" in t for t in targets), f"{what}: {targets}"
        comm = [t for t in targets if "c10d" in t or "all_gather" in t or "all_reduce" in t]
        assert not comm, f"{what}: collectives in the compiled graph: {comm}"


def _table_of_kind(kind, rows, rotary, interleaved, gen):
    """A table of ``kind`` (``"rates"``, ``"precise_rates"``, ``"pair"``) and its angles
    ``[rows, rotary]`` from the formula: a rate table's the float32 products ``p * rate`` (the
    exact float64 ones where precise), a pair cache's the float64 angles its cosines and sines
    were rounded from."""
    half = rotary // 2
    if kind == "pair":
        a = torch.rand(rows, half, generator=gen, dtype=torch.float64) * 40 - 20
        table = rd.PairCosSinCache(torch.cat((a.cos(), a.sin()), -1).float())
    else:
        rates = torch.rand(half, generator=gen) * 2
        precise = kind == "precise_rates"
        p = torch.arange(rows, dtype=torch.float64 if precise else torch.float32)
        a = p[:, None] * (rates.double() if precise else rates)[None, :]
        table = rd.RateTable(rates, rows, precise=precise)
    return table, a.repeat_interleave(2, -1) if interleaved else torch.cat((a, a), -1)


def _compiled(call, compiled, graphs):
    """``call`` as run: itself (``compiled=None``), compiled by Inductor (``"inductor"``), or
    by Dynamo and AOT autograd, keeping the forward and backward graphs in ``graphs``."""
    if compiled is None:
        return call
    if compiled == "inductor":
        return torch.compile(call, backend="inductor", fullgraph=True)
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, inputs):
        graphs.append(gm)
        return gm

    return torch.compile(call, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                         fullgraph=True)


def _check_single(mesh, case, rank, compiled=None, backend="eager", table="angles",
                  device="cpu"):
    """One ``apply`` case: forward and backward against the float64 reference. ``table``: the
    kind of ``freqs`` (an angle table, or what :func:`_table_of_kind` makes); ``device``: where
    the call's tensors live (the mesh's device)."""
    layout, shape, shard, table_sharded, with_starts, rotary, interleaved, *extra = case
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen)
    grad_out = torch.randn(shape, generator=gen)
    cu = None
    if layout == "thd":
        cu = torch.tensor([0, 3, 3, 7, shape[0]], dtype=torch.int32)
        seqs, longest = 4, shape[0]
    else:
        seqs = shape[1] if layout == "sbhd" else shape[0]
        longest = shape[0] if layout == "sbhd" else shape[1]
    starts = torch.randint(0, 5, (seqs,), generator=gen) if with_starts else None
    rows = longest if table_sharded else longest + 6
    angles = torch.rand(rows, rotary, generator=gen) * 40 - 20
    spec = rd.RoPESpec(layout=layout, dtype=F32, interleaved=interleaved,
                       cu_seqlens=None if cu is None else cu.to(device),
                       **(extra[0] if extra else {}))
    placements = _placements(shard)
    xd = _shard(x.to(device), mesh, placements).requires_grad_(True)
    gd = _shard(grad_out.to(device), mesh, placements)
    freqs = angles.view(rows, 1, 1, rotary).to(device)
    if table != "angles":
        freqs, angles = _table_of_kind(table, rows, rotary, interleaved, gen)
    if table_sharded:
        seq = 0 if layout == "sbhd" else 1
        freqs = _shard(angles.to(device), mesh,
                       _placements([0 if s == seq else None for s in shard]))
    at = None if starts is None else starts.to(device)

    def call(t):
        return rd.apply(t, freqs, spec, start_positions=at, backend=backend)

    graphs = []
    run = _compiled(call, compiled, graphs)
    what = f"{layout} {shape} {placements} {table} {'sharded' if table_sharded else 'replicated'}"
    what += f" rank {rank} ({backend}, {compiled or 'not compiled'})"

    def both():
        out = run(xd)
        return out, torch.autograd.grad(out, xd, gd)[0]

    if compiled is None:
        out, grad = _no_comm(both, what)
    else:  # CommDebugMode is a dispatch mode, under which torch.compile would not compile
        out, grad = both()
    if compiled == "graphs":
        _assert_no_collective(graphs, what)
    assert tuple(out.placements) == tuple(placements), f"{what}: output {out.placements}"
    assert tuple(grad.placements) == tuple(placements), f"{what}: gradient {grad.placements}"
    ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out, starts)
    assert_matches(out.full_tensor(), ref_out, F32, f"{what} forward")
    assert_matches(grad.full_tensor(), ref_grad, F32, f"{what} backward")


# (layout, global shape, a Shard dim per mesh dim (None: Replicate), table sharded with the
# sequence, start_positions, rotary dim, interleaved[, other spec fields])
ONE_DIM = [
    ("sbhd", (6, 2, 2, 8), [0], False, True, 8, False),     # sequence (4 ranks: uneven, one empty)
    ("bshd", (4, 8, 2, 8), [0], False, True, 6, True),      # batch
    ("bshd", (2, 8, 2, 8), [1], True, False, 8, False),     # sequence, the table with it
    ("sbhd", (8, 2, 4, 16), [2], False, True, 12, True),    # heads (tensor parallel)
    ("thd", (12, 4, 8), [1], False, True, 8, False),        # heads of packed sequences
    ("bshd", (2, 8, 2, 8), [None], False, True, 8, False),  # replicated
    ("sbhd", (6, 2, 2, 16), [0], False, True, 8, False,     # sequence, DeepSeek's rope part:
     dict(rotary_offset=8, deinterleave=True)),             # the last channels, pairs in
    ("bshd", (2, 4, 4, 12), [2], False, False, 4, True, dict(rotary_offset=6)),  # heads, offset
    ("thd", (15, 2, 8), [0], False, True, 8, False),        # tokens of packed sequences: shards
                                                            # cut sequences (2 and 4 ranks)
]
TWO_DIM = [  # 4 ranks as a 2 x 2 mesh
    ("bshd", (2, 8, 2, 8), [0, 1], False, True, 8, False),  # batch x sequence
    ("bshd", (2, 8, 4, 8), [0, 2], False, True, 8, False),  # batch x heads (FSDP2 + TP)
    ("sbhd", (8, 2, 2, 8), [1, 0], True, False, 8, False),  # batch x sequence, table sharded
]
COMPILED = [ONE_DIM[0], ONE_DIM[2], ONE_DIM[3], ONE_DIM[8]]


# (layout, shape of t (q), k's head count (None: a single tensor), a Shard dim per mesh dim,
# rotary dim, the HeadNorm's scope (None: no norm) and offset, its weight ("plain": a tensor
# that requires grad; "replicated": a replicated DTensor parameter), the table kind)
NORMED = [
    ("sbhd", (8, 2, 2, 8), None, [0], 8, "head", 0.0, "plain", "angles"),  # sequence
    ("bshd", (4, 6, 2, 8), None, [0], 6, "heads", 1.0, "replicated", "angles"),  # batch, OLMo 2's
    ("bshd", (2, 6, 8, 8), 4, [2], 8, "head", 0.0, "replicated", "rates"),  # heads: Qwen3 + TP
]
NORMED_GRID = ("bshd", (2, 6, 4, 8), 2, [0, 2], 8, "head", 0.0, "replicated", "angles")
IN_PLACE = [
    ("sbhd", (6, 2, 2, 8), None, [0], 6, None, 0.0, None, "angles"),  # sequence, partial rotary
    ("bshd", (2, 6, 8, 8), 4, [2], 8, "head", 0.0, "replicated", "precise_rates"),  # heads
]


def _check_normed(mesh, case, rank, compiled=None, in_place=False, grad=True, backend="eager",
                  device="cpu"):
    """Normalize, then rotate (Qwen3's q_norm and k_norm): ``apply`` with ``norm=`` or
    ``apply_qk`` with ``q_norm=``/``k_norm=`` (``in_place``: ``apply_``/``apply_qk_`` on
    non-leaf copies, which come back as the same objects), forward and backward, the weights'
    gradients included, against the float64 reference. A replicated weight's gradient is
    Partial where the tensor is sharded (each rank's part of the sum, as DTensor leaves a
    parameter's), a plain weight's the whole sum, all-reduced by the backward (its only
    collective). ``grad=False``: under no_grad, forward only (in place: each rank's own
    memory written, the version counters moved). ``device``: as :func:`_check_single`'s."""
    from reference import reference_for, reference_head_norm
    from torch.distributed.tensor import DTensor, Replicate

    layout, shape, k_heads, shard, rotary, scope, offset, weight, kind = case
    gen = torch.Generator().manual_seed(13)
    shapes = [shape] if k_heads is None else [shape, (*shape[:-2], k_heads, shape[-1])]
    xs, gs = ([torch.randn(s, generator=gen) for s in shapes] for _ in range(2))
    ws = [] if scope is None else [
        torch.randn(s[-1] if scope == "head" else s[-2] * s[-1], generator=gen) for s in shapes]
    seqs, longest = (shape[1], shape[0]) if layout == "sbhd" else (shape[0], shape[1])
    starts = torch.randint(0, 5, (seqs,), generator=gen)
    if kind == "angles":
        angles = freqs = torch.rand(longest + 6, rotary, generator=gen) * 40 - 20
    else:
        freqs, angles = _table_of_kind(kind, longest + 6, rotary, False, gen)
    spec = rd.RoPESpec(layout=layout, dtype=F32)
    placements = _placements(shard)
    leaves = [_shard(x.to(device), mesh, placements).requires_grad_(grad) for x in xs]
    params = [w.clone().to(device) if weight == "plain" else
              _shard(w.to(device), mesh, [Replicate()] * mesh.ndim) for w in ws]
    params = [w.requires_grad_(grad) for w in params]
    at, table = starts.to(device), freqs.to(device) if kind == "angles" else freqs

    def call(*ts):
        norms = [rd.HeadNorm(w, 1e-5, offset=offset, scope=scope) for w in params] or [None]
        if in_place and grad:
            ts = [t.clone() for t in ts]  # non-leaf tensors, which may be written
        if k_heads is None:
            outs = ((rd.apply_ if in_place else rd.apply)(
                ts[0], table, spec, start_positions=at, norm=norms[0], backend=backend),)
        else:
            outs = (rd.apply_qk_ if in_place else rd.apply_qk)(
                *ts, table, spec, start_positions=at, q_norm=norms[0], k_norm=norms[1],
                backend=backend)
        if in_place and compiled is None:
            assert all(o is t for o, t in zip(outs, ts)), "in place: not the same objects"
        return outs

    graphs = []
    run = _compiled(call, compiled, graphs)
    what = f"{'in place ' if in_place else ''}{case} rank {rank} ({backend}, "
    what += f"{compiled or 'not compiled'})"
    if not grad:
        memory = [(x.to_local().data_ptr(), x._version) for x in leaves]
        with torch.no_grad():
            outs = _no_comm(lambda: run(*leaves), what)
        if in_place:
            assert all(x.to_local().data_ptr() == ptr and x._version > version
                       for x, (ptr, version) in zip(leaves, memory)), f"{what}: memory"
        got = [None] * (len(leaves) + len(params))
    else:
        def both():
            outs = run(*leaves)
            return outs, torch.autograd.grad(outs, leaves + params, grads)

        grads = [_shard(g.to(device), mesh, placements) for g in gs]
        if compiled is None:
            from torch.distributed.tensor.debug import CommDebugMode

            with CommDebugMode() as comm:
                outs, got = both()
            reduced = len(params) if weight == "plain" else 0
            assert comm.get_total_counts() == reduced, f"{what}: {comm.get_comm_counts()}"
        else:
            outs, got = both()
    if compiled == "graphs":
        _assert_no_collective(graphs, what)
    for i, (x, g, out) in enumerate(zip(xs, gs, outs)):
        xx = x.double().requires_grad_(True)
        ww = None if scope is None else ws[i].double().requires_grad_(True)
        normed = xx if ww is None else reference_head_norm(xx, ww, 1e-5, offset, scope)
        ref = reference_for(normed, angles, spec, starts)
        assert tuple(out.placements) == tuple(placements), f"{what}: output {out.placements}"
        assert_matches(out.full_tensor(), ref.detach(), F32, f"{what} forward {i}")
        if not grad:
            continue
        wanted = (xx,) if ww is None else (xx, ww)
        ref_grads = torch.autograd.grad(ref, wanted, g.double())
        dx, dw = got[i], None if ww is None else got[len(leaves) + i]
        assert tuple(dx.placements) == tuple(placements), f"{what}: gradient {dx.placements}"
        assert_matches(dx.full_tensor(), ref_grads[0], F32, f"{what} backward {i}")
        if isinstance(dw, DTensor):  # Partial where sharded: full_tensor() sums the parts
            assert [p.is_partial() for p in dw.placements] == [s is not None for s in shard], (
                f"{what}: weight gradient {dw.placements}")
            dw = dw.full_tensor()
        if ww is not None:
            assert_matches(dw, ref_grads[1], F32, f"{what} weight gradient {i}")


def _check_pairs(mesh, rank):
    """apply_qk (GQA, heads sharded; sequence sharded) and apply_qkv (heads sharded)."""
    gen = torch.Generator().manual_seed(11)
    world = mesh.size()
    spec = rd.RoPESpec(layout="sbhd", dtype=F32)
    angles = torch.rand(20, 8, generator=gen) * 10
    starts = torch.tensor([2, 5])
    for shard in (2, 0):
        q, k = torch.randn(8, 2, 2 * world, 8, generator=gen), torch.randn(8, 2, world, 8,
                                                                           generator=gen)
        gq, gk = (torch.randn(x.shape, generator=gen) for x in (q, k))
        placements = _placements([shard])
        qd, kd = (_shard(x, mesh, placements).requires_grad_(True) for x in (q, k))
        gqd, gkd = (_shard(x, mesh, placements) for x in (gq, gk))

        def both():
            out = rd.apply_qk(qd, kd, angles, spec, start_positions=starts, backend="eager")
            return out, torch.autograd.grad(out, (qd, kd), (gqd, gkd))

        (qo, ko), (dq, dk) = _no_comm(both, f"apply_qk Shard({shard}) rank {rank}")
        for x, out, g, got in ((q, qo, gq, dq), (k, ko, gk, dk)):
            assert out.placements == qd.placements and got.placements == qd.placements
            ref_out, ref_grad = reference_forward_backward(x, angles, spec, g, starts)
            assert_matches(out.full_tensor(), ref_out, F32, f"apply_qk Shard({shard}) forward")
            assert_matches(got.full_tensor(), ref_grad, F32, f"apply_qk Shard({shard}) backward")
    split = (16, 8, 8)
    qkv = torch.randn(8, 2, world, 32, generator=gen)
    placements = _placements([2])
    qkvd = _shard(qkv, mesh, placements).requires_grad_(True)
    q_shape = (8, 2, 2 * world, 8)
    grads = (torch.randn(q_shape, generator=gen), torch.randn(8, 2, world, 8, generator=gen),
             torch.randn(8, 2, world, 8, generator=gen))

    k_angles = torch.rand(20, 8, generator=gen) * 10
    for k_freqs in (None, k_angles):  # k by the q table, then by its own (k_freqs)

        def packed():
            outs = rd.apply_qkv(qkvd, angles, spec, split, start_positions=starts,
                                backend="eager", k_freqs=k_freqs)
            return outs, torch.autograd.grad(outs, qkvd,
                                             [_shard(g, mesh, placements) for g in grads])

        what = f"apply_qkv k_freqs={'given' if k_freqs is not None else None} rank {rank}"
        outs, (grad,) = _no_comm(packed, what)
        ref_outs, ref_grad = reference_qkv_forward_backward(
            qkv, angles, angles if k_freqs is None else k_freqs, spec, split, grads, starts)
        for out, ref in zip(outs, ref_outs):
            assert out.placements == qkvd.placements
            assert_matches(out.full_tensor(), ref, F32, f"{what} forward")
        assert grad.placements == qkvd.placements
        assert_matches(grad.full_tensor(), ref_grad, F32, f"{what} backward")


def _check_multimodal(mesh, rank, compiled=None):
    """M-RoPE (``spec.mrope_section``): three position streams per token, given as a plain
    global ``[3, b, s]`` tensor, with the sequence or the heads sharded; forward and backward
    against channel ``c`` of each token rotated by the table row of its section's stream
    (``compiled``: as :func:`_compiled` runs it)."""
    gen = torch.Generator().manual_seed(13)
    sections, rows = (2, 1, 1), 12
    angles = torch.rand(rows, 8, generator=gen) * 40 - 20
    spec = rd.RoPESpec(layout="bshd", dtype=F32, mrope_section=sections)
    x = torch.randn(2, 8, 4, 8, generator=gen)
    grad_out = torch.randn(x.shape, generator=gen)
    streams = torch.randint(0, rows, (3, 2, 8), generator=gen)
    stream_of = [s for s, n in enumerate(sections) for _ in range(n)] * 2  # each half alike
    flat = streams.reshape(3, -1)
    per_token = torch.stack([angles.double()[flat[stream_of[c]], c] for c in range(8)], -1)
    own = torch.arange(flat.shape[1]).view(2, 8)
    xr = x.double().requires_grad_(True)
    ref_out = reference_rope(xr, per_token, own, False)
    (ref_grad,) = torch.autograd.grad(ref_out, xr, grad_out.double())
    for shard in (1, 2):  # the sequence, the heads
        placements = _placements([shard])
        xd = _shard(x, mesh, placements).requires_grad_(True)
        gd = _shard(grad_out, mesh, placements)
        what = f"mrope Shard({shard}) rank {rank} ({compiled or 'not compiled'})"
        graphs = []
        run = _compiled(lambda t: rd.apply(t, angles, spec, positions=streams, backend="eager"),
                        compiled, graphs)

        def both():
            out = run(xd)
            return out, torch.autograd.grad(out, xd, gd)[0]

        out, grad = _no_comm(both, what) if compiled is None else both()
        if compiled == "graphs":
            _assert_no_collective(graphs, what)
        assert tuple(out.placements) == tuple(placements), what
        assert_matches(out.full_tensor(), ref_out.detach(), F32, f"{what} forward")
        assert_matches(grad.full_tensor(), ref_grad, F32, f"{what} backward")


def _check_caches_and_positions(mesh, rank):
    """A CosSinCache of any values (sequence sharded, start positions) and per-token positions
    given as a plain global tensor (batch and sequence sharded on a 1-dim mesh: the sequence)."""
    from reference import reference_cache_rope

    gen = torch.Generator().manual_seed(5)
    shape = (8, 2, 2, 8)
    x, grad_out = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    cos, sin = torch.randn(14, 8, generator=gen), torch.randn(14, 8, generator=gen)
    starts = torch.tensor([4, 1])
    spec = rd.RoPESpec(layout="sbhd", dtype=F32)
    placements = _placements([0])
    xd = _shard(x, mesh, placements).requires_grad_(True)

    def cached():
        out = rd.apply(xd, rd.CosSinCache(cos, sin), spec, start_positions=starts,
                       backend="eager")
        return out, torch.autograd.grad(out, xd, _shard(grad_out, mesh, placements))[0]

    out, grad = _no_comm(cached, f"CosSinCache rank {rank}")
    rows = torch.arange(8)[:, None] + starts[None, :]
    full = x.double().requires_grad_(True)
    ref = reference_cache_rope(full, cos, sin, rows)
    (ref_grad,) = torch.autograd.grad(ref, full, grad_out.double())
    assert_matches(out.full_tensor(), ref.detach(), F32, "CosSinCache forward")
    assert_matches(grad.full_tensor(), ref_grad, F32, "CosSinCache backward")

    bshd = rd.RoPESpec(layout="bshd", dtype=F32)
    y = torch.randn(2, 8, 2, 8, generator=gen)
    positions = torch.randint(0, 14, (2, 8), generator=gen)
    angles = torch.rand(14, 8, generator=gen) * 10
    yd = _shard(y, mesh, _placements([1]))
    out = _no_comm(lambda: rd.apply(yd, angles, bshd, positions=positions, backend="eager"),
                   f"positions rank {rank}")
    assert out.placements == yd.placements
    ref = reference_rope(y, angles, positions, False)
    assert_matches(out.full_tensor(), ref, F32, "per-token positions forward")
    explained = rd.explain(yd, angles, bshd, positions=positions)  # this rank's shard call
    assert str(tuple(yd.to_local().shape)) in explained.call and explained.chosen, explained
    explained = rd.explain(yd, rd.RateTable(angles[1, :4], 14), bshd, positions=positions,
                           in_place=True, q_norm=rd.HeadNorm(torch.ones(8)))
    assert "norm head" in explained.call and explained.chosen, explained


def _check_context_parallel(mesh, rank):
    """torch's own context parallelism: the angle table is one of the buffers it shards along
    the sequence (reordered for load balance as the tokens are), so a rank's plain call reads
    its own tokens' rows."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    gen = torch.Generator().manual_seed(3)
    shape = (2, 16, 2, 8)
    x, grad_out = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    angles = torch.rand(16, 8, generator=gen) * 40 - 20
    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    buffers = [x.clone(), angles.clone(), grad_out.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 0, 1]):
        local = buffers[0].clone().requires_grad_(True)
        assert local.shape[1] == 16 // mesh.size()
        out = rd.apply(local, buffers[1], spec, backend="eager")
        (grad,) = torch.autograd.grad(out, local, buffers[2])
        out_full, grad_full = context_parallel_unshard(mesh, [out.detach(), grad], [1, 1])
    ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out)
    assert_matches(out_full, ref_out, F32, f"context_parallel rank {rank} forward")
    assert_matches(grad_full, ref_grad, F32, f"context_parallel rank {rank} backward")


def _check_small_shards(mesh, rank, shard=(2,)):
    """A dim sharded over more ranks than it has entries (one head on every rank of the mesh):
    DTensor redistributes it for the op (its rule, the one collective allowed here; on a 2 x 2
    mesh it may pick the sequence for the heads, whose shards then need their positions), and
    the outputs and gradients still come back placed as the inputs, values as the reference; in
    place with a gradient too (the write needs the input's placements)."""
    gen = torch.Generator().manual_seed(13)
    spec = rd.RoPESpec(layout="sbhd", dtype=F32)
    angles = torch.rand(8, 8, generator=gen) * 10
    placements = _placements(shard)
    q, k = (torch.randn(8, 2, 1, 8, generator=gen) for _ in range(2))
    qd, kd = (_shard(x, mesh, placements).requires_grad_(True) for x in (q, k))
    g = torch.randn(q.shape, generator=gen)
    outs = rd.apply_qk(qd, kd, angles, spec, backend="eager")
    grads = torch.autograd.grad(outs, (qd, kd), (_shard(g, mesh, placements),) * 2)
    for x, out, grad in zip((q, k), outs, grads):
        assert out.placements == qd.placements and grad.placements == qd.placements, rank
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, g)
        assert_matches(out.full_tensor(), ref_out, F32, "one head on every rank: forward")
        assert_matches(grad.full_tensor(), ref_grad, F32, "one head on every rank: backward")
    y = qd * 1.0  # a non-leaf, rotated in place with a gradient
    assert rd.apply_(y, angles, spec, backend="eager") is y and y.placements == qd.placements
    (grad,) = torch.autograd.grad(y, qd, _shard(g, mesh, placements))
    ref_out, ref_grad = reference_forward_backward(q, angles, spec, g)
    assert_matches(y.full_tensor(), ref_out, F32, "one head on every rank, in place")
    assert_matches(grad.full_tensor(), ref_grad, F32, "one head on every rank, in place: backward")


def _check_empty_table_shard(mesh, rank):
    """A table sharded with an uneven sequence: the last rank holds no tokens and no rows (1
    token on 2 ranks, 5 on 4), and its call rotates nothing (out of place with a gradient, and
    in place under no_grad) instead of refusing its empty table."""
    gen = torch.Generator().manual_seed(17)
    seq = 2 * mesh.size() - 3
    x, grad_out = (torch.randn(seq, 2, 2, 8, generator=gen) for _ in range(2))
    angles = torch.rand(seq, 8, generator=gen) * 40 - 20
    spec = rd.RoPESpec(layout="sbhd", dtype=F32)
    placements = _placements([0])
    table = _shard(angles, mesh, placements)
    xd = _shard(x, mesh, placements).requires_grad_(True)
    out = rd.apply(xd, table, spec, backend="eager")
    (grad,) = torch.autograd.grad(out, xd, _shard(grad_out, mesh, placements))
    ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out)
    what = f"a table's empty shard, rank {rank}"
    assert_matches(out.full_tensor(), ref_out, F32, f"{what}: forward")
    assert_matches(grad.full_tensor(), ref_grad, F32, f"{what}: backward")
    y = _shard(x, mesh, placements)
    with torch.no_grad():
        rd.apply_(y, table, spec, backend="eager")
    assert_matches(y.full_tensor(), ref_out, F32, f"{what}: in place")


def _check_dynamic_shapes(mesh, rank):
    """``torch.compile(dynamic=True)``: the placements' dims are traced as symbols; the call
    traces (fullgraph) and serves two sequence lengths, uneven shards, forward and backward."""
    gen = torch.Generator().manual_seed(19)
    angles = torch.rand(24, 8, generator=gen) * 40 - 20
    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    starts = torch.tensor([3, 1])
    run = torch.compile(lambda t: rd.apply(t, angles, spec, start_positions=starts,
                                           backend="eager"),
                        backend="aot_eager", fullgraph=True, dynamic=True)
    placements = _placements([1])
    for seq in (7, 10):
        x, grad_out = (torch.randn(2, seq, 2, 8, generator=gen) for _ in range(2))
        xd = _shard(x, mesh, placements).requires_grad_(True)
        out = run(xd)
        (grad,) = torch.autograd.grad(out, xd, _shard(grad_out, mesh, placements))
        assert out.placements == xd.placements and grad.placements == xd.placements
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out, starts)
        what = f"dynamic shapes, s={seq}, rank {rank}"
        assert_matches(out.full_tensor(), ref_out, F32, f"{what}: forward")
        assert_matches(grad.full_tensor(), ref_grad, F32, f"{what}: backward")


def _check_index_refusals(mesh):
    """start_positions, positions, cu_seqlens and the table's length are checked against the
    global shape on every rank, as the plain call checks them (a shard saw only its part: a
    wrong size passed, or failed on some ranks only with a message about rows)."""
    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    angles = torch.rand(16, 8)
    for shard in (1, 0, 2):  # the sequence, the batch, the heads
        x = _shard(torch.randn(2, 5, 2, 8), mesh, _placements([shard]))
        with pytest.raises(rd.RoPEError, match=r"positions must have shape \[b, s\] = \[2, 5\]"):
            rd.apply(x, angles, spec, positions=torch.zeros(2, 7, dtype=torch.long),
                     backend="eager")
        with pytest.raises(rd.RoPEError, match=r"start_positions must have shape \[2\]"):
            rd.apply(x, angles, spec, start_positions=torch.tensor([1, 2, 3]), backend="eager")
        with pytest.raises(rd.RoPEError, match="start_positions must be int32 or int64"):
            rd.apply(x, angles, spec, start_positions=torch.tensor([1.0, 2.0]), backend="eager")
        with pytest.raises(rd.RoPEError, match="start_positions max 12 .* needs 17"):
            rd.apply(x, angles, spec, start_positions=torch.tensor([12, 0]), backend="eager")
        with pytest.raises(rd.RoPEError, match="freqs has 4 positions but the sequence needs 5"):
            rd.apply(x, angles[:4], spec, backend="eager")
        tokens = _shard(torch.randn(5, 2, 8), mesh, _placements([0 if shard == 1 else 1]))
        thd = rd.RoPESpec(layout="thd", dtype=F32, cu_seqlens=torch.tensor([0, 3, 7]))
        with pytest.raises(rd.RoPEError, match=r"cu_seqlens\[-1\]=7 must equal the total"):
            rd.apply(tokens, angles, thd, backend="eager")
    x = _shard(torch.randn(2, 5, 2, 8), mesh, _placements([1]))
    sharded = _shard(torch.zeros(2, 5, dtype=torch.long), mesh, _placements([1]))  # as x's tokens
    with pytest.raises(rd.RoPEError, match="positions and start_positions cannot be combined"):
        rd.apply(x, angles, spec, positions=sharded, start_positions=torch.tensor([1, 2]),
                 backend="eager")
    longer = _shard(torch.zeros(2, 6, dtype=torch.long), mesh, _placements([1]))
    with pytest.raises(rd.RoPEError, match=r"positions must have shape \[2, 5\].*got \(2, 6\)"):
        rd.apply(x, angles, spec, positions=longer, backend="eager")  # on every rank alike
    streams = torch.zeros(3, 2, 8, dtype=torch.long)
    streams[1, 0, 7] = 16  # a row past the table, of a token only the last rank holds
    mrope = rd.RoPESpec(layout="bshd", dtype=F32, mrope_section=(2, 1, 1))
    x = _shard(torch.randn(2, 8, 2, 8), mesh, _placements([1]))
    with pytest.raises(rd.RoPEError, match=r"positions must lie in \[0, 16\).* 0 to 16"):
        rd.apply(x, angles, mrope, positions=streams, backend="eager")
    tokens = _shard(torch.randn(8, 2, 8), mesh, _placements([0]))
    thd = rd.RoPESpec(layout="thd", dtype=F32, cu_seqlens=torch.tensor([0, 3, 9]))
    rows = _shard(torch.arange(8), mesh, _placements([0]))  # positions sharded as the tokens
    with pytest.raises(rd.RoPEError, match=r"cu_seqlens\[-1\]=9 must equal the total"):
        rd.apply(tokens, angles, thd, positions=rows, backend="eager")
    offsets = _shard(torch.tensor([0, 3, 8]), mesh, _placements([None]))
    with pytest.raises(rd.RoPEError, match="cu_seqlens must be a plain tensor .* got a DTensor"):
        rd.RoPESpec(layout="thd", dtype=F32, cu_seqlens=offsets)
    with pytest.raises(rd.RoPEError, match="cu_seqlens must be a plain tensor .* got a DTensor"):
        thd.with_cu_seqlens(offsets)


def _check_k_refusals(mesh):
    """apply_qk's k must match q in dtype and every dim but the heads, as with plain tensors:
    each rank's k was rotated by q's positions, so some ranks accepted a k of other tokens
    (or of another dtype) and others failed naming rows."""
    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    angles = torch.rand(16, 8)
    for shard in (1, 0, 2):
        placements = _placements([shard])
        q = _shard(torch.randn(2, 5, 2, 8), mesh, placements)
        for k in (torch.randn(2, 6, 2, 8), torch.randn(3, 5, 2, 8)):
            with pytest.raises(rd.RoPEError, match=r"k \(.*\) must match q \(2, 5, 2, 8\)"):
                rd.apply_qk(q, _shard(k, mesh, placements), angles, spec, backend="eager")
        with pytest.raises(rd.RoPEError, match="k is bfloat16 on cpu but q is float32"):
            rd.apply_qk(q, _shard(torch.randn(2, 5, 2, 8, dtype=torch.bfloat16), mesh,
                                  placements), angles, spec, backend="eager")


def _check_plain_t_beside_dtensors(mesh):
    """A plain t (or q) with a DTensor table, index, k or norm weight is refused by name (torch
    raised 'got mixed torch.Tensor and DTensor' from inside a backend, or a tolist error)."""
    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    q, angles = torch.randn(2, 4, 2, 8), torch.rand(8, 8)
    replicated = _placements([None])
    cases = (
        ("freqs", lambda: rd.apply(q, _shard(angles, mesh, _placements([0])), spec)),
        ("start_positions", lambda: rd.apply(q, angles, spec, start_positions=_shard(
            torch.tensor([0, 1]), mesh, replicated))),
        ("k", lambda: rd.apply_qk(q, _shard(torch.randn(2, 4, 1, 8), mesh, replicated), angles,
                                  spec)),
        ("q_norm", lambda: rd.apply_qk(q, q.clone(), angles, spec, q_norm=rd.HeadNorm(
            _shard(torch.ones(8), mesh, replicated)))),
    )
    for name, call in cases:
        for backend in (None, "eager"):
            with rd.use_backend(backend) if backend else contextlib.nullcontext():
                with pytest.raises(rd.RoPEError, match=f"{name} is a DTensor but t is a plain"):
                    call()


def _check_refusals(mesh):
    """What a DTensor call refuses, with its reason."""
    spec = rd.RoPESpec(layout="thd", dtype=F32, cu_seqlens=torch.tensor([0, 4, 8]))
    angles = torch.rand(8, 8)
    x = _shard(torch.randn(8, 2, 8), mesh, _placements([0]))
    with pytest.raises(rd.RoPEError, match="with layout thd a table's rows are positions"):
        rd.apply(x, _shard(angles, mesh, _placements([0])), spec, backend="eager")
    y = _shard(torch.randn(8, 2, 2, 8), mesh, _placements([3]))
    with pytest.raises(rd.RoPEError, match="head dim"):
        rd.apply(y, angles, rd.RoPESpec(layout="sbhd", dtype=F32), backend="eager")
    z = _shard(torch.randn(8, 2, 2, 8), mesh, _placements([0])).requires_grad_(True)
    with pytest.raises(rd.RoPEError, match="apply_ rotates t in place, but t is a leaf"):
        rd.apply_(z, angles, rd.RoPESpec(layout="sbhd", dtype=F32), backend="eager")
    with pytest.raises(rd.RoPEError, match="same tensor as q and k"):
        plain = z.detach()
        rd.apply_qk_(plain, plain, angles, rd.RoPESpec(layout="sbhd", dtype=F32), backend="eager")
    heads = _shard(torch.randn(8, 2, 2, 8), mesh, _placements([2]))
    with pytest.raises(rd.RoPEError, match="scope='heads'.*sharded on its heads"):
        rd.apply(heads, angles, rd.RoPESpec(layout="sbhd", dtype=F32),
                 norm=rd.HeadNorm(torch.ones(16), scope="heads"), backend="eager")
    weight = _shard(torch.ones(8), mesh, _placements([0]))
    with pytest.raises(rd.RoPEError, match="inv_freq must be a plain tensor, got a DTensor"):
        rd.RateTable(_shard(torch.rand(4), mesh, _placements([None])), 8)
    with pytest.raises(rd.RoPEError, match=r"norm.weight has placement S\(0\).*expected Replicate"):
        rd.apply(heads, angles, rd.RoPESpec(layout="sbhd", dtype=F32),
                 norm=rd.HeadNorm(weight), backend="eager")
    one_group = _shard(torch.randn(8, 1, 32), mesh, _placements([1]))
    with pytest.raises(rd.RoPEError, match="sharded on its 1 head groups .* do not divide"):
        rd.apply_qkv(one_group, angles, spec, (16, 8, 8), backend="eager")
    qkv = _shard(torch.randn(8, 2, 32), mesh, _placements([0]))  # k's table of other channels
    with pytest.raises(rd.RoPEError, match="k_freqs has rotary dim 6 but freqs has 8"):
        rd.apply_qkv(qkv, angles, spec, (16, 8, 8), k_freqs=angles[:, :6], backend="eager")
    with pytest.raises(rd.RoPETypeError, match="k_freqs must be"):  # named as the plain call
        rd.apply_qkv(qkv, angles, spec, (16, 8, 8), k_freqs=[1], backend="eager")
    with pytest.raises(rd.RoPETypeError, match="spec must be a rope_dispatch.RoPESpec, got str"):
        rd.apply(z, angles, "sbhd", backend="eager")
    for backend in (3, "nope"):  # refused by name before any shard's call, as a plain call
        with pytest.raises(rd.UnknownBackendError, match=f"unknown backend {backend!r}"):
            rd.apply(z, angles, rd.RoPESpec(layout="sbhd", dtype=F32), backend=backend)
    with pytest.raises(rd.RoPEError, match="cp_size"):
        rd.apply(z, angles, rd.RoPESpec(layout="sbhd", dtype=F32, cp_size=2), backend="eager")
    learned = torch.rand(8, 8, requires_grad=True)  # its gradient would be dropped: refused
    with pytest.raises(rd.RoPEError, match="freqs requires grad"):
        rd.apply(z, learned, rd.RoPESpec(layout="sbhd", dtype=F32), backend="eager")
    with torch.no_grad():  # no gradient asked: served
        rd.apply(z, learned, rd.RoPESpec(layout="sbhd", dtype=F32), backend="eager")
    for table in (angles, rd.RateTable(angles[0, :4], 8)):  # as the plain call refuses it
        with pytest.raises(rd.RoPEError, match="spec.rotary_dim=4 but freqs has last dim d2=8"):
            rd.apply(z, table, rd.RoPESpec(layout="sbhd", dtype=F32, rotary_dim=4),
                     backend="eager")


def _check_tune(mesh):
    """``rd.tune`` of a DTensor call tunes the plain call this rank's shard runs (its local
    tensor and per-token positions), as ``rd.explain`` explains it; it had measured nothing.
    The measurement itself is replaced by a record of the call it was given."""
    from rope_dispatch import autotune

    seen, real = [], autotune.tune
    autotune.tune = lambda call, supported, retune=False: (seen.append(call)
                                                           or (supported[0], "recorded"))
    os.environ["ROPE_AUTOTUNE"] = "1"
    try:
        x = _shard(torch.randn(8, 2, 2, 8), mesh, _placements([0]))
        rd.tune(x, torch.rand(8, 8), rd.RoPESpec(layout="sbhd", dtype=F32))
    finally:
        autotune.tune = real
        os.environ["ROPE_AUTOTUNE"] = "0"
    (call,) = seen
    assert type(call.t) is torch.Tensor and call.t.shape == x.to_local().shape
    assert call.positions is not None and call.positions.shape == x.to_local().shape[:2]


def _check_compiled_in_place_pair(mesh):
    """``apply_qk_`` on DTensor views of one buffer, compiled (``fullgraph=True``): its tensors
    are fake while it traces, so the check that q and k share no element runs in the graph, on
    each rank's real shards, and refuses as in eager (the compiled call wrote q over k); q and
    k apart rotate as the float64 reference does."""
    import torch._dynamo

    spec = rd.RoPESpec(layout="bshd", dtype=F32)
    gen = torch.Generator().manual_seed(7)  # every rank the same full tensors
    half = torch.rand(6, 4, dtype=torch.float64, generator=gen) * 3
    angles = torch.cat((half, half), dim=-1)  # TE's freqs: each pair's angle twice
    table = angles.float().view(6, 1, 1, 8)

    def step(buf, bad):
        q, k = buf[:, :, :1 + bad], buf[:, :, 1:2]
        rd.apply_qk_(q, k, table, spec, backend="eager")  # (no alias of buf back: a DTensor's
        # would be rebuilt by as_strided, which DTensor refuses)

    torch._dynamo.reset()
    run = torch.compile(step, fullgraph=True, backend="aot_eager")
    full, at = torch.rand(2, 6, 2, 8, generator=gen) + 0.5, torch.arange(6).expand(2, 6)
    for placements in (_placements([0]), _placements([1])):
        buf = _shard(full, mesh, placements)
        run(buf, 0)
        want = torch.cat([reference_rope(full[:, :, i:i + 1], angles, at, False)
                          for i in (0, 1)], dim=2)
        assert_matches(buf.full_tensor(), want, F32, f"compiled apply_qk_ {placements}")
        with pytest.raises(rd.RoPEError, match=r"^apply_qk_ cannot rotate q and k in place: "
                           r"they share memory .* overlap in their first 8 channels"):
            run(_shard(full, mesh, placements), 1)


def _worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.pop("ROPE_BACKEND", None)
    # the mesh is on the CPU, GPU or not: the Triton kernels run there on the interpreter (tiny shapes)
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cpu", (world,))
        for case in ONE_DIM:
            _check_single(mesh, case, rank)
        _check_pairs(mesh, rank)
        for case in NORMED:
            _check_normed(mesh, case, rank)
        for kind, case in (("rates", ONE_DIM[0]), ("precise_rates", ONE_DIM[7]),
                           ("pair", ("bshd", (2, 8, 2, 8), [1], False, True, 8, True))):
            _check_single(mesh, case, rank, table=kind)
        for case in IN_PLACE:
            _check_normed(mesh, case, rank, in_place=True)
            _check_normed(mesh, case, rank, in_place=True, grad=False)
        _check_refusals(mesh)
        _check_tune(mesh)
        _check_index_refusals(mesh)
        _check_k_refusals(mesh)
        _check_plain_t_beside_dtensors(mesh)
        _check_empty_table_shard(mesh, rank)
        _check_small_shards(mesh, rank)
        _check_context_parallel(mesh, rank)
        _check_caches_and_positions(mesh, rank)
        _check_multimodal(mesh, rank)
        if rd.get_backend("triton").available:  # each shard through the Triton kernels
            for case in (ONE_DIM[0], ONE_DIM[3], ONE_DIM[6], ONE_DIM[8]):
                _check_single(mesh, case, rank, backend="triton")
            _check_single(mesh, ONE_DIM[0], rank, backend="triton", table="precise_rates")
            _check_normed(mesh, NORMED[2], rank, backend="triton")  # the fused norm kernel
            _check_normed(mesh, IN_PLACE[1], rank, in_place=True, grad=False, backend="triton")
        if world == 4:
            grid = init_device_mesh("cpu", (2, 2))
            for case in TWO_DIM:
                _check_single(grid, case, rank)
            _check_normed(grid, NORMED_GRID, rank)
            _check_small_shards(grid, rank, (2, None))
            # 6 head groups split on both mesh dims: 3 a rank on one, then 2 and 1 on the other
            nested = _shard(torch.randn(4, 2, 6, 32), grid, _placements([2, 2]))
            with pytest.raises(rd.RoPEError, match=r"6 head groups \(mesh dims \[0, 1\], 4 ranks"):
                rd.apply_qkv(nested, torch.rand(4, 8), rd.RoPESpec(layout="sbhd", dtype=F32),
                             (16, 8, 8), backend="eager")
        else:  # torch.compile once, on the smaller job: the DTensor op traced, then run
            for case in COMPILED:
                torch._dynamo.reset()
                _check_single(mesh, case, rank, "graphs")
            for case, in_place in ((NORMED[2], False), (IN_PLACE[1], True)):
                torch._dynamo.reset()
                _check_normed(mesh, case, rank, "graphs", in_place=in_place)
            torch._dynamo.reset()
            _check_multimodal(mesh, rank, "graphs")
            _check_compiled_in_place_pair(mesh)
            torch._dynamo.reset()
            _check_dynamic_shapes(mesh, rank)
            torch._dynamo.reset()  # Inductor's code for one case: it compiles C++ on the CPU
            _check_single(mesh, COMPILED[0], rank, "inductor")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_across_processes(world, tmp_path):
    join_ranks(_worker, world, (world, str(tmp_path / "store")), "gloo job", JOB_DEADLINE_S)


def _gpu_worker(rank: int, world: int, init_file: str) -> None:
    """The mesh on one GPU a rank, NCCL between them (torchtitan's and FSDP2 + tensor parallel
    runs): each shard through the Triton kernels and the eager backend, a fused norm, in place
    under no_grad, and torch.compile of the DTensor op (its graphs, and Inductor's GPU code)."""
    os.environ.pop("ROPE_BACKEND", None)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT, device_id=device)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cuda", (world,))
        backends = ["eager"] + (["triton"] if rd.get_backend("triton").available else [])
        for backend in backends:
            for case in ONE_DIM:
                _check_single(mesh, case, rank, backend=backend, device=device)
            for case in NORMED:
                _check_normed(mesh, case, rank, backend=backend, device=device)
            heads = (*IN_PLACE[1][:-1], "angles")  # Qwen3's q and k, heads sharded, in place
            _check_normed(mesh, heads, rank, in_place=True, grad=False, backend=backend,
                          device=device)
        for case in COMPILED:
            torch._dynamo.reset()
            _check_single(mesh, case, rank, "graphs", device=device)
        torch._dynamo.reset()
        _check_single(mesh, COMPILED[2], rank, "inductor", device=device)
        torch._dynamo.reset()
        _check_normed(mesh, NORMED[2], rank, "inductor", device=device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_dtensor_on_two_gpus_over_nccl(tmp_path, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices for NCCL, found {torch.cuda.device_count()}")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (inherited by the ranks)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    join_ranks(_gpu_worker, 2, (2, str(tmp_path / "store")), "nccl job", JOB_DEADLINE_S)
