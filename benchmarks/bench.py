"""``python -m benchmarks.bench``: RoPE speed against a device copy of the same bytes.

For each shape, every available backend of ours (through ``rope_dispatch.apply(...,
backend=name)``; triton also with a cos/sin cache, and in place through ``apply_``) and, when importable,
the peers TransformerEngine (fused ``apply_rotary_pos_emb``) and Liger-Kernel (``rope_forward`` /
``rope_backward``, where the shape fits its API) are timed forward, backward and
forward+backward (``torch.autograd.grad``), and for triton the backward's launch alone (the
transposed kernel without the autograd engine: where the autograd rows exceed it, the host
path sets the pace). Times are medians of ``triton.testing.do_bench``;
bandwidth counts one read and one write of the tensor; the ceiling is ``copy_`` of the same
bytes measured in the same run. A float64 check of every implementation's forward output is
reported next to its times.

The decode shape also reports ``rope_dispatch.apply`` end to end on the host clock (dispatch,
checks and launch included), since there the host, not the GPU, sets the pace.

Writes ``bench.json``, ``bench.md`` and (with matplotlib) ``bench.png`` (% of copy per shape,
grouped bars) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

import rope_dispatch as rd
from rope_dispatch.reference import max_error, reference_apply


@dataclass(frozen=True)
class Shape:
    """One benchmark shape; ``seq`` is tokens for thd (split into ``n_seqs`` sequences)."""

    name: str
    layout: str
    dtype: torch.dtype
    seq: int
    batch: int
    heads: int
    head_dim: int
    rotary_dim: int
    n_seqs: int = 0
    cp_size: int = 1  # context parallelism: the local part of rank cp_size - 1, with start_positions
    qkv: tuple[int, int, int] | None = None  # packed qkv split; heads are head groups
    seqlens: tuple[int, ...] | None = None  # thd lengths; None: make_inputs draws n_seqs of them

    def dims(self) -> tuple[int, ...]:
        width = self.head_dim if self.qkv is None else sum(self.qkv)
        if self.layout == "thd":
            return (self.seq, self.heads, width)
        if self.layout == "sbhd":
            return (self.seq, self.batch, self.heads, width)
        return (self.batch, self.seq, self.heads, width)

    def tensor_bytes(self) -> int:
        """Bytes of the input tensor: a call reads them once and writes as many."""
        return math.prod(self.dims()) * self.dtype.itemsize


SHAPES = (
    Shape("sbhd s4096 b4 h32 d128 bf16", "sbhd", torch.bfloat16, 4096, 4, 32, 128, 128),
    Shape("bshd s4096 b4 h32 d128 bf16", "bshd", torch.bfloat16, 4096, 4, 32, 128, 128),
    Shape("sbhd s4096 b4 h32 d128 rot64 bf16", "sbhd", torch.bfloat16, 4096, 4, 32, 128, 64),
    Shape("thd 12 seqs T26460 h32 d128 bf16", "thd", torch.bfloat16, 26460, 1, 32, 128, 128, 12),
    Shape("sbhd s2048 b16 h8 d256 fp32", "sbhd", torch.float32, 2048, 16, 8, 256, 256),
    Shape("sbhd s4096 b4 h32 d128 bf16 start+cp2", "sbhd", torch.bfloat16, 4096, 4, 32, 128, 128,
          cp_size=2),
    Shape("thd 12 seqs T26460 h32 d128 bf16 start+cp2", "thd", torch.bfloat16, 26460, 1, 32, 128,
          128, 12, cp_size=2),
    Shape("qkv sbhd s4096 b4 g8 q4x128 k128 v128 bf16", "sbhd", torch.bfloat16, 4096, 4, 8, 128,
          128, qkv=(512, 128, 128)),
    Shape("qkv bshd s4096 b2 g16 q2x128 k128 v128 rot64 bf16", "bshd", torch.bfloat16, 4096, 2, 16,
          128, 64, qkv=(256, 128, 128)),
    Shape("decode sbhd s1 b64 h32 d128 bf16", "sbhd", torch.bfloat16, 1, 64, 32, 128, 128),
)
DECODE = SHAPES[-1]
TABLE_LEN = 4096
MAX_START = 64  # start_positions of the start+cp shapes are drawn below this


@dataclass
class Inputs:
    t: torch.Tensor
    freqs: torch.Tensor  # [s2, 1, 1, d2] float32 angles, TE's duplicated-halves layout
    cache: rd.CosSinCache
    spec: rd.RoPESpec
    grad: torch.Tensor | tuple[torch.Tensor, ...]  # one per output (q, k, v for packed qkv)
    cu_seqlens: torch.Tensor | None
    starts: torch.Tensor | None = None
    split: tuple[int, int, int] | None = None

    def call_args(self) -> dict[str, Any]:
        """The keywords ``apply``/``apply_qkv``/``check_call`` take beyond ``t, table, spec``."""
        args: dict[str, Any] = {"start_positions": self.starts}
        return args if self.split is None else {**args, "split": self.split}


def _seqlens(total: int, n: int, gen: torch.Generator, multiple: int = 1) -> list[int]:
    """``n`` random lengths summing to ``total``, each a multiple of ``multiple`` (fixed seed)."""
    weights = torch.rand(n, generator=gen) + 0.25
    lengths = (weights / weights.sum() * (total // multiple)).long() * multiple
    lengths[-1] += total - int(lengths.sum())
    return lengths.tolist()


def make_inputs(shape: Shape, device: str = "cuda", draw_on_device: bool = False) -> Inputs:
    """The shape's tensor, gradient and tables, drawn with a fixed seed on the host, or on
    ``device`` with ``draw_on_device`` (other values; seconds less per GiB, for sweeps)."""
    gen = torch.Generator().manual_seed(0)
    device_gen = torch.Generator(device).manual_seed(0) if draw_on_device else None

    def normal(dims: tuple[int, ...]) -> torch.Tensor:
        if device_gen is not None:
            return torch.randn(dims, generator=device_gen, device=device, dtype=shape.dtype)
        return torch.randn(dims, generator=gen).to(shape.dtype).to(device)

    rot, cp = shape.rotary_dim, shape.cp_size
    inv = rd.tables.inverse_frequencies(rot, 10000.0)  # float32, as models make them
    t = normal(shape.dims())
    # thd under CP: shape.seq is the local token count; global lengths divide by 2 * cp
    lengths = (
        None if shape.layout != "thd"
        else list(shape.seqlens) if shape.seqlens is not None
        else _seqlens(shape.seq * cp, shape.n_seqs, gen, 2 * cp)
    )
    batch = len(lengths) if lengths else shape.batch
    starts = torch.randint(0, MAX_START, (batch,), generator=gen) if cp > 1 else None
    # The table covers the longest sequence, as a model's table does: for thd that is the
    # longest packed sequence, not the token count (TE's thd grid grows with the table length).
    longest = max(lengths) if lengths else shape.seq * cp
    table_len = max(TABLE_LEN, longest + (MAX_START if starts is not None else 0))
    # each angle the float32 product position x rate, as TransformerEngine's and Hugging
    # Face's rotary modules compute it (so the triton backend reads it as rates: docs/tables.md)
    freqs = rd.tables.angle_table(inv, table_len).to(device)
    cu = None
    common = dict(dtype=shape.dtype, cp_size=cp, cp_rank=cp - 1)
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.to(device)
        spec = rd.RoPESpec(layout="thd", cu_seqlens=cu, max_seqlen=max(lengths), **common)
    else:
        spec = rd.RoPESpec(layout=shape.layout, **common)
    if shape.qkv is None:
        grad: Any = normal(shape.dims())
    else:  # gradients of q [.., h * q/d, d], k [.., h, d] and v [.., h, v]
        lead, h = shape.dims()[:-2], shape.heads
        q_len, d, v_len = shape.qkv
        grad = tuple(
            normal(dims) for dims in ((*lead, h * q_len // d, d), (*lead, h, d), (*lead, h, v_len))
        )
    return Inputs(t, freqs, rd.cos_sin_cache(freqs), spec, grad, cu,
                  None if starts is None else starts.to(device), shape.qkv)


@dataclass
class Impl:
    """Something to time: forward, backward and forward+backward callables (or None)."""

    name: str
    fwd: Callable[[], Any]
    bwd: Callable[[], Any] | None
    fwd_bwd: Callable[[], Any] | None
    output: Callable[[], torch.Tensor]
    note: str = ""
    bytes_factor: float = 1.0  # bytes it moves relative to its ceiling's (Liger: + a 1-head k)
    rotary_only: bool = False  # moves only the rotary channels (d2 / d of the bytes)
    bwd_kernel: Callable[[], Any] | None = None  # the backward's launch alone, no autograd
    # for an in-place forward: writes the tensor it reads afresh, as a model's kernel before
    # it would (:func:`written_replay_us`)
    rewrite: Callable[[], Any] | None = None

    def copy_share(self, mode: str, rotary_share: float) -> float:
        """Bytes a ``mode`` call moves over the bytes of one copy of the tensor: two calls for
        fwd+bwd, Liger's extra k, and only the rotary channels (``rotary_share``) in place."""
        share = self.bytes_factor * (2 if mode == "fwd+bwd" else 1)
        return share * (rotary_share if self.rotary_only else 1)


def _ours(name: str, label: str, inp: Inputs, table: Any) -> Impl | None:
    """``rope_dispatch.apply`` (``apply_qkv`` for packed qkv) forced onto backend ``name``."""
    backend = rd.get_backend(name)
    t = inp.t.detach().requires_grad_(True)
    args = inp.call_args()
    if backend.not_supported_reasons(rd.check_call(t, table, inp.spec, **args)):
        return None
    run = rd.apply if inp.split is None else rd.apply_qkv
    leaf = inp.t.detach().requires_grad_(True)
    out_graph = run(leaf, table, inp.spec, backend=name, **args)

    def fwd():
        return run(inp.t, table, inp.spec, backend=name, **args)

    def bwd():
        return torch.autograd.grad(out_graph, leaf, inp.grad, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(run(leaf, table, inp.spec, backend=name, **args), leaf, inp.grad)

    kernel = _triton_transpose(inp, table) if name == "triton" else None
    return Impl(label, fwd, bwd, fwd_bwd, fwd, bwd_kernel=kernel)


def _triton_transpose(
    inp: Inputs, table: Any, grad: torch.Tensor | None = None,
) -> Callable[[], Any]:
    """The triton backward's work without the autograd engine: the transposed launch on the
    incoming gradient (one packed gradient for qkv), output allocation included; with ``grad``
    (not packed qkv), the launch of ``apply_``'s backward with ``grad_in_place=True`` instead,
    which rotates ``grad``'s rotary channels in place."""
    from rope_dispatch.backends import triton_rope, triton_tables, triton_tiles

    from rope_dispatch.tables import angles_2d

    spec = inp.spec
    tab, sin = triton_tables.flagged_tables(  # a linear angle table's flag, as apply finds it
        angles_2d(table) if isinstance(table, torch.Tensor) else table,
        triton_tables.rows_read(inp.t, spec.layout, inp.starts),
    )
    index = inp.starts
    forward = triton_rope.Launch(
        "t" if inp.split is None else "qkv", spec.layout, spec.interleaved,
        float(spec.cos_sin_scale), spec.cp_size, spec.cp_rank,
        positions=0 if index is None else 1,
        split=None if inp.split is None else tuple(inp.split))
    tabs = triton_rope.Tables(tab, sin, inp.cu_seqlens, index, *((tab, sin) if inp.split else ()))
    back = forward.transposed()
    grads = tuple(inp.grad) if inp.split is not None else (inp.grad,)

    def transpose():
        outs = triton_rope.outputs(back, grads)
        triton_rope.launch(back, grads, outs, tabs)
        return outs[0]

    def transpose_in_place():
        triton_rope.launch(forward.transposed(in_place=True), (grad,), (grad,), tabs)
        return grad
    return transpose if grad is None else transpose_in_place


def _ours_in_place(name: str, inp: Inputs) -> Impl | None:
    """``apply_`` on a buffer holding the input (each call rotates it again: the tables are
    rotations, so its scale stays), and its backward with ``grad_in_place=True``: both move
    ``d2 / d`` of the bytes. For triton, ``bwd_kernel`` is that backward's launch alone, on a
    buffer holding the gradient (:func:`_triton_transpose`)."""
    starts = inp.starts
    call = rd.check_call(inp.t, inp.freqs, inp.spec, starts, in_place=True)
    if rd.get_backend(name).not_supported_reasons(call):
        return None
    buffer, grad = inp.t.clone(), inp.grad.clone()
    leaf = inp.t.detach().requires_grad_(True)
    out_graph = rd.apply_(leaf.clone(), inp.freqs, inp.spec, start_positions=starts, backend=name,
                          grad_in_place=True)

    def fwd():
        return rd.apply_(buffer, inp.freqs, inp.spec, start_positions=starts, backend=name)

    def bwd():
        return torch.autograd.grad(out_graph, leaf, grad, retain_graph=True)

    def output():
        return rd.apply_(inp.t.clone(), inp.freqs, inp.spec, start_positions=starts, backend=name)

    kernel = _triton_transpose(inp, inp.freqs, grad) if name == "triton" else None
    return Impl(f"{name} in place", fwd, bwd, None, output, "apply_, grad_in_place=True",
                rotary_only=call.rotary_dim < call.head_dim, rewrite=lambda: buffer.copy_(inp.t),
                bwd_kernel=kernel)


def _te_peer(shape: Shape, inp: Inputs) -> Impl | None:
    """TransformerEngine's fused ``apply_rotary_pos_emb`` (``apply_fused_qkv_rotary_pos_emb``
    for packed qkv) called directly, with the same positions."""
    try:
        from transformer_engine.pytorch.attention import rope
    except Exception:  # noqa: BLE001 (not installed, or installed but broken)
        return None
    kwargs: dict[str, Any] = {"tensor_format": shape.layout}
    starts = None if inp.starts is None else inp.starts.int()
    if inp.cu_seqlens is not None:
        kwargs["cu_seqlens"] = inp.cu_seqlens
    if starts is not None:
        kwargs["start_positions"] = starts
    if shape.cp_size > 1:
        kwargs.update(cp_size=inp.spec.cp_size, cp_rank=inp.spec.cp_rank)
    if inp.split is None:
        def run(x):
            return rope.apply_rotary_pos_emb(x, inp.freqs, fused=True, **kwargs)
    elif hasattr(rope, "apply_fused_qkv_rotary_pos_emb"):
        def run(x):
            return rope.apply_fused_qkv_rotary_pos_emb(x, inp.freqs, inp.freqs, list(inp.split), **kwargs)
    else:
        return None
    leaf = inp.t.detach().requires_grad_(True)
    out_graph = run(leaf)

    def fwd():
        return run(inp.t)

    def bwd():
        return torch.autograd.grad(out_graph, leaf, inp.grad, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(run(leaf), leaf, inp.grad)

    kernel = None
    backward_op = getattr(getattr(rope, "tex", None), "fused_rope_backward", None)
    formats = getattr(rope, "QKVFormat", None)
    if inp.split is None and backward_op is not None and formats is not None:
        def kernel():  # what FusedRoPEFunc.backward calls
            return backward_op(inp.grad, inp.freqs, starts, formats[shape.layout], False,
                               inp.cu_seqlens, inp.spec.cp_size, inp.spec.cp_rank)

    return Impl("TE fused (peer)", fwd, bwd, fwd_bwd, fwd, bwd_kernel=kernel)


def _liger_peer(shape: Shape, inp: Inputs) -> Impl | None:
    """Liger rotates q and k in place in a [b, s, h, d] buffer; here k has one head."""
    if shape.layout == "thd" or shape.cp_size > 1 or shape.qkv is not None:
        return None
    try:
        from liger_kernel.ops.rope import LigerRopeFunction, rope_backward, rope_forward
    except Exception:  # noqa: BLE001
        return None
    b, s, h, d, rot = shape.batch, shape.seq, shape.heads, shape.head_dim, shape.rotary_dim
    dev = inp.t.device
    # same bytes as ours, in Liger's physical layout [b, s, h, d]
    source = inp.t.reshape(-1).view(b, s, h, d)  # a view: q, output's copy and rewrite's
    q = source.clone()
    k = torch.randn(b, s, 1, d, device=dev).to(shape.dtype)
    dq = inp.grad.reshape(-1).view(b, s, h, d).clone()
    dk = torch.randn(b, s, 1, d, device=dev).to(shape.dtype)
    cos = inp.cache.cos[:s, : rot // 2].repeat(1, 2)[None].to(shape.dtype).contiguous()
    sin = inp.cache.sin[:s, : rot // 2].repeat(1, 2)[None].to(shape.dtype).contiguous()

    def fwd():
        return rope_forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin, rotary_dim=rot)

    def bwd():
        return rope_backward(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin, rotary_dim=rot)

    # forward + backward as its users run it: its autograd.Function on leaves' views (it
    # rotates them in place, as a model's q and k), then the engine's backward
    q_leaf, k_leaf = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    grads = (dq.transpose(1, 2), dk.transpose(1, 2))

    def fwd_bwd():
        outs = LigerRopeFunction.apply(q_leaf.transpose(1, 2), k_leaf.transpose(1, 2), cos, sin,
                                       None, 1, rot)
        return torch.autograd.grad(outs, (q_leaf, k_leaf), grads)

    def output():
        fresh = source.clone()
        rope_forward(fresh.transpose(1, 2), k.clone().transpose(1, 2), cos, sin, rotary_dim=rot)
        return fresh.reshape(inp.t.shape) if shape.layout == "bshd" else None

    note = "in place; k with 1 head included in its bytes"
    if rot < d:
        note += "; in place it skips the pass-through channels"
    # rewrite writes q afresh (its one-head k, 1/h of the bytes, is left as the last call wrote)
    return Impl("Liger (peer)", fwd, bwd, fwd_bwd, output, note, bytes_factor=(h + 1) / h,
                rotary_only=rot < d, bwd_kernel=bwd, rewrite=lambda: q.copy_(source))


def _reference64(inp: Inputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """float64 RoPE of the inputs on their device (rope_dispatch.reference: the formula,
    independent of every backend)."""
    return reference_apply(rd.check_call(inp.t, inp.freqs, inp.spec, **inp.call_args()), inp.t)


def _error(out: Any, ref: torch.Tensor | tuple[torch.Tensor, ...]) -> float | None:
    """Largest error of an output (or of each of q, k, v) against the reference."""
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    if out is None or len(outs) != len(refs) or any(o.shape != r.shape for o, r in zip(outs, refs)):
        return None
    return max(max_error(o, r) for o, r in zip(outs, refs))


def bench_ms(fn: Callable[[], Any], rep: int = 100) -> float:
    """Median ms of ``fn`` over about ``rep`` ms of calls, each after an L2 flush
    (``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, rep=rep, return_mode="median"))


def device_copy_ms(moved: int, device: str = "cuda") -> float:
    """:func:`bench_ms` of a device-to-device copy that moves ``moved`` bytes (reads half of
    them, writes the other half): the ceiling a call moving as many bytes is compared with."""
    src = torch.empty(moved // 4, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))


Timed = TypeVar("Timed")


def time_mode(
    label: str, mode: str, fn: Callable[[], Any],
    timer: Callable[[Callable[[], Any]], Timed] | None = None,
) -> Timed | float | None:
    """``timer(fn)`` (default :func:`bench_ms`, ms), or ``None`` when the mode fails: one
    failing mode is reported on stderr, not fatal to the run."""
    try:
        return (timer or bench_ms)(fn)
    except Exception as exc:  # noqa: BLE001
        print(f"  {label} {mode}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def host_us_per_call(fn: Callable[[], Any], calls: int = 100, rounds: int = 21) -> tuple[float, float]:
    """``(host, end_to_end)`` us per call, medians over rounds of ``calls`` calls.

    ``host`` is the time to return from the calls (what the Python thread spends: checks,
    dispatch, launch), taken before the round's final synchronisation, with the GPU idle at the
    start of each round so its queue never fills; ``end_to_end`` includes that synchronisation,
    so it is the larger of host and GPU time per call.
    """
    return host_us_interleaved({"call": fn}, calls, rounds)["call"]


def host_us_interleaved(
    fns: dict[str, Callable[[], Any]], calls: int = 100, rounds: int = 21
) -> dict[str, tuple[float, float]]:
    """:func:`host_us_per_call` of several calls measured in turn within each round (the orders
    of :func:`balanced_orders`), so drifts of the host's speed during the run reach them all
    alike and their ratios hold; ``{name: (host, end_to_end)}``, medians over the rounds
    (:func:`host_rounds`). A rotating order kept each call behind the same neighbour, whose
    leftovers (garbage to collect, say) it then paid for on every round (docs/tuning.md)."""
    host, total = host_rounds(fns, calls, rounds)
    return {name: (statistics.median(host[name]), statistics.median(total[name])) for name in fns}


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` calls in which each takes every place equally often and follows every
    other equally often (a Williams design: ``n`` orders for even ``n``, ``2n`` for odd), so
    neither a place in the round nor a neighbour's leftovers favour one call over the rounds.
    The seeded random orders used before were the same at every point of a sweep, and in them
    one call came first in 8 of 31 rounds, another in 5."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    orders = [[(x + shift) % n for x in first] for shift in range(n)]
    if n % 2 and n > 1:
        orders += [order[::-1] for order in orders]
    return orders


def host_rounds(
    fns: dict[str, Callable[[], Any]], calls: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each round's host and end-to-end us per call of ``fns``, timed in turn in the next of
    :func:`balanced_orders` each round (a whole number of its cycles balances them fully). Each
    call is warmed up 20 times first; every timed run of ``calls`` calls starts with the GPU
    idle."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    names = list(fns)
    orders = balanced_orders(len(names))
    host: dict[str, list[float]] = {name: [] for name in names}
    total: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for index in orders[round_ % len(orders)]:
            name = names[index]
            fn = fns[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            host[name].append((issued - start) / calls * 1e6)
            total[name].append((done - start) / calls * 1e6)
    return host, total


def _record_hosts(report: Report, fns: dict[str, Callable[[], Any]]) -> None:
    """Host and end-to-end us per call of calls compared with each other (one interleaved
    measurement)."""
    for name, (host, total) in host_us_interleaved(fns).items():
        report.host[f"{name}: host us"] = host
        report.host[f"{name}: end to end us"] = total


@dataclass
class Row:
    shape: str
    impl: str
    mode: str
    us: float
    gbps: float
    copy_ratio: float
    max_error: float | None = None
    note: str = ""


@dataclass
class Report:
    device: str
    date: str
    versions: dict[str, str]
    rows: list[Row] = field(default_factory=list)
    copy_us: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    sweep: list[dict[str, Any]] = field(default_factory=list)


def run_shape(
    shape: Shape, report: Report, backends: list[str] | None, peers: bool, device: str = "cuda"
) -> None:
    inp = make_inputs(shape, device)
    nbytes = 2 * inp.t.numel() * inp.t.element_size()
    src, dst = inp.t.clone(), torch.empty_like(inp.t)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    report.copy_us[shape.name] = copy_ms * 1e3
    report.rows.append(Row(shape.name, "device copy", "copy", copy_ms * 1e3, nbytes / copy_ms / 1e6, 1.0))
    # An in-place call moves only the rotary channels: its ceiling is the copy's bandwidth on
    # that share of the bytes (torch's own strided copy of those channels is slower still).
    rotary_share = inp.freqs.shape[-1] / inp.t.shape[-1]
    ref = _reference64(inp)
    impls: list[Impl] = []
    for info in rd.list_backends():
        if not info.available or (backends is not None and info.name not in backends):
            continue
        impl = _ours(info.name, info.name, inp, inp.freqs)
        if impl is not None:
            impls.append(impl)
        if info.name == "triton":
            impl = _ours("triton", "triton+cache", inp, inp.cache)
            if impl is not None:
                impls.append(impl)
            impl = None if inp.split is not None else _ours_in_place("triton", inp)
            if impl is not None:
                impls.append(impl)
    if peers:
        impls.extend(p for p in (_te_peer(shape, inp), _liger_peer(shape, inp)) if p is not None)
    for impl in impls:
        try:
            err = _error(impl.output(), ref)
        except Exception as exc:  # noqa: BLE001 (a peer that fails is reported, not fatal)
            print(f"  {impl.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        modes = (("fwd", impl.fwd), ("bwd", impl.bwd), ("fwd+bwd", impl.fwd_bwd),
                 ("bwd kernel", impl.bwd_kernel))
        for mode, fn in modes:
            ms = None if fn is None else time_mode(impl.name, mode, fn)
            if ms is None:
                continue
            share = impl.copy_share(mode, rotary_share)
            moved = nbytes * share
            ratio = copy_ms * share / ms
            row = Row(shape.name, impl.name, mode, ms * 1e3, moved / ms / 1e6, ratio,
                      err if mode == "fwd" else None, impl.note)
            report.rows.append(row)
            print(f"  {impl.name:>16} {mode:>8} {row.us:9.1f} us {100 * ratio:5.0f}% of copy", flush=True)
    del inp, ref, src, dst
    if device == "cuda":
        torch.cuda.empty_cache()


def run_host(report: Report) -> None:
    """Decode-size ``apply`` end to end on the host clock, and where the time goes."""
    from rope_dispatch.backends import triton_rope, triton_tables, triton_tiles

    inp = make_inputs(DECODE)
    t, freqs, spec = inp.t, inp.freqs, inp.spec
    buffer = t.clone()
    calls: dict[str, Callable[[], Any]] = {
        "apply (auto)": lambda: rd.apply(t, freqs, spec),
        "apply_ (auto, in place)": lambda: rd.apply_(buffer, freqs, spec),
    }
    for info in rd.list_backends():
        if info.available:
            call = rd.check_call(t, freqs, spec)
            if not rd.get_backend(info.name).not_supported_reasons(call):
                calls[f"apply backend={info.name}"] = lambda n=info.name: rd.apply(t, freqs, spec, backend=n)
    if rd.get_backend("triton").available:
        table = freqs.view(freqs.shape[0], -1)
        out = torch.empty_like(t)
        call = rd.check_call(t, freqs, spec)
        bound = rd.get_backend("triton").plan(call)  # what apply keeps for a repeated call
        described = triton_rope.Launch("t", "sbhd", False, 1.0, 1, 0)
        tabs = triton_rope.Tables(table, None, None, None)
        calls.update({
            "check_call": lambda: rd.check_call(t, freqs, spec),
            "dispatch.choose": lambda: rd.dispatch.choose(call, "triton"),
            "triton rope (generic path)": lambda: triton_rope.rope(call),
            "triton bound launch (plan)": lambda: bound(t, freqs, spec, None, None, None,
                                                        (None, None)),
            "output allocation (empty_like)": lambda: torch.empty_like(t),
            "triton launch": lambda: triton_rope.launch(described, (t,), (out,), tabs),
        })
    _record_hosts(report, calls)
    if rd.get_backend("triton").available:
        report.host["triton kernel (do_bench) us"] = 1e3 * bench_ms(
            lambda: triton_rope.launch(described, (t,), (out,), tabs)
        )
        report.host["apply triton CUDA graph replay us"] = graph_replay_us(
            lambda: rd.apply(t, freqs, spec, backend="triton")
        )


SERVING_Q_HEADS, SERVING_K_HEADS, SERVING_HEAD_DIM = 32, 8, 128
SERVING_TOKENS = {"decode": 64, "prefill": 16384}


def serving_inputs(tokens: int, device: str = "cuda", max_pos: int = TABLE_LEN) -> dict[str, Any]:
    """A serving step's q [T, 32, 128] and k [T, 8, 128] (bf16, slices of one fused
    projection), positions on the device, the angle table, its engine-style pair cache, and the
    specs: thd without offsets (positions per token) and sbhd with s = 1 (a decode batch, for
    calls by start position and plain calls)."""
    gen = torch.Generator().manual_seed(1)
    heads = SERVING_Q_HEADS + 2 * SERVING_K_HEADS
    qkv = torch.randn(tokens, heads, SERVING_HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
    q, k = qkv[:, :SERVING_Q_HEADS], qkv[:, SERVING_Q_HEADS : SERVING_Q_HEADS + SERVING_K_HEADS]
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    rot = SERVING_HEAD_DIM
    inv = rd.tables.inverse_frequencies(rot, 10000.0)  # float32, as models make them
    angles = rd.tables.angle_table(inv, max_pos).view(max_pos, rot)  # float32 products, as engines
    pair = angles[:, : rot // 2]
    return dict(
        qkv=qkv, q=q, k=k, positions=positions,
        freqs=angles.to(device),
        pair_cache=rd.PairCosSinCache(torch.cat((pair.cos(), pair.sin()), -1).to(device)),
        rate_table=rd.RateTable(inv.float().to(device), max_pos),
        thd=rd.RoPESpec(layout="thd", dtype=torch.bfloat16),
        sbhd=rd.RoPESpec(layout="sbhd", dtype=torch.bfloat16),
    )


def run_serving(report: Report) -> None:
    """Serving-engine calls: decode q (32 heads) + k (8 heads), b64 d128 bf16, positions on the
    GPU, end to end on the host clock against one TransformerEngine call on q alone; the same
    call with per-token positions, start positions and none; the q+k kernel against Liger's q+k;
    prefill q+k in one launch against a copy of the same bytes."""
    from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

    d = serving_inputs(SERVING_TOKENS["decode"])
    q, k, pos, freqs, cache = d["q"], d["k"], d["positions"], d["freqs"], d["pair_cache"]
    q4, k4 = q.unsqueeze(0), k.unsqueeze(0)  # sbhd s=1: b = the decode batch
    q2, k2 = q.flatten(1), k.flatten(1)  # an engine's query and key: [tokens, heads * head_size]
    calls: dict[str, Callable[[], Any]] = {
        "apply_qk_ positions (angles)": lambda: rd.apply_qk_(q, k, freqs, d["thd"], positions=pos),
        "apply_qk_ positions (pair cache)": lambda: rd.apply_qk_(q, k, cache, d["thd"], positions=pos),
        "apply_qk_ start_positions": lambda: rd.apply_qk_(q4, k4, freqs, d["sbhd"], start_positions=pos),
        "apply_qk_ plain": lambda: rd.apply_qk_(q4, k4, freqs, d["sbhd"]),
        "flashinfer-style entry": lambda: apply_rope_with_cos_sin_cache_inplace(
            pos, q2, k2, SERVING_HEAD_DIM, cache.table),
        "two apply_ calls (q, k)": lambda: (rd.apply_(q4, freqs, d["sbhd"], start_positions=pos),
                                            rd.apply_(k4, freqs, d["sbhd"], start_positions=pos)),
    }
    try:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        te_pos, te_freqs = pos.int(), freqs.view(freqs.shape[0], 1, 1, -1)
        calls["TE apply_rotary_pos_emb on q alone (peer)"] = lambda: apply_rotary_pos_emb(
            q4, te_freqs, tensor_format="sbhd", start_positions=te_pos, fused=True)
    except Exception:  # noqa: BLE001 (not installed, or installed but broken)
        pass
    _record_hosts(report, {f"serving decode {name}": fn for name, fn in calls.items()})
    rows = rd.PairCosSinCache(cache.table[pos])  # token t's row at t: Liger's inputs
    kernels = {
        "apply_qk_ kernel (do_bench) us": calls["apply_qk_ positions (pair cache)"],
        "apply_qk_ kernel, rows gathered ahead as Liger takes them (do_bench) us": (
            lambda: rd.apply_qk_(q4.transpose(0, 1), k4.transpose(0, 1), rows, d["sbhd"])),
    }
    liger = _liger_qk(q, k, freqs, pos)
    if liger is not None:
        kernels["Liger q+k kernel, rows gathered ahead (do_bench, peer) us"] = liger
    for name, (cold, warm) in cold_warm_us(kernels, rounds=11).items():
        report.host[f"serving decode {name}"] = cold
        warm_name = name.replace("(do_bench", "(CUDA graph, L2 warm")
        report.host[f"serving decode {warm_name}"] = warm
    for name, us in cold_kernel_us(kernels).items():
        report.host[f"serving decode {name.replace('(do_bench', '(profiler, L2 flushed')}"] = us
    p = serving_inputs(SERVING_TOKENS["prefill"])
    q, k = p["q"], p["k"]
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    src, dst = torch.cat((q.flatten(), k.flatten())), torch.empty(q.numel() + k.numel(), dtype=q.dtype, device=q.device)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    name = f"prefill q+k T{SERVING_TOKENS['prefill']} q32 k8 d128 bf16"
    report.rows.append(Row(name, "device copy", "copy", copy_ms * 1e3, nbytes / copy_ms / 1e6, 1.0))
    rows_table = p["freqs"].clone()  # its own object: no flag of p["freqs"] reaches it
    for label, fn in (
        ("triton apply_qk (one launch)", lambda: rd.apply_qk(q, k, p["freqs"], p["thd"], positions=p["positions"])),
        ("triton apply_qk (table rows read)", rows_read(
            lambda: rd.apply_qk(q, k, rows_table, p["thd"], positions=p["positions"]))),
        ("triton apply_qk (pair cache)", lambda: rd.apply_qk(q, k, p["pair_cache"], p["thd"], positions=p["positions"])),
        ("triton apply_qk (rate table)", lambda: rd.apply_qk(q, k, p["rate_table"], p["thd"], positions=p["positions"])),
    ):
        ms = bench_ms(fn)
        report.rows.append(Row(name, label, "fwd", ms * 1e3, nbytes / ms / 1e6, copy_ms / ms))
        print(f"  {label:>30} {ms * 1e3:9.1f} us {100 * copy_ms / ms:5.0f}% of copy", flush=True)


def rows_read(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the triton backend reading every row of its angle tables: no call inside
    looks for a linear table's flag (``LINEAR_MIN_ROWS_READ`` raised around it). Give it a
    table of its own: a plan or flag made for a table by other calls would still serve it."""
    from rope_dispatch.backends import triton_rope, triton_tables, triton_tiles

    def run(*args: Any) -> Any:
        saved = triton_tables.LINEAR_MIN_ROWS_READ
        triton_tables.LINEAR_MIN_ROWS_READ = sys.maxsize
        try:
            return fn(*args)
        finally:
            triton_tables.LINEAR_MIN_ROWS_READ = saved

    return run


def _liger_qk(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, pos: torch.Tensor):
    """Liger's q+k kernel on the same tokens (in place, [b, h, s, d] views with s = 1 and the
    per-token cos/sin gathered ahead, as its API takes them), or None without Liger."""
    try:
        from liger_kernel.ops.rope import rope_forward
    except Exception:  # noqa: BLE001
        return None
    cos = freqs[pos].cos()[:, None, :].to(q.dtype).contiguous()  # [b, s=1, d]
    sin = freqs[pos].sin()[:, None, :].to(q.dtype).contiguous()
    qb, kb = q.unsqueeze(2).clone(), k.unsqueeze(2).clone()  # [b, h, s=1, d]
    return lambda: rope_forward(qb, kb, cos, sin)


def cold_warm_us(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """``(cold, warm)`` us per call of each of ``fns``, medians over ``rounds`` rounds that time
    them in turn (clocks and the host drift alike for all): cold by ``do_bench``, which flushes
    L2 before each call; warm from a CUDA graph (:func:`graph_replay_us`)."""
    cold: dict[str, list[float]] = {name: [] for name in fns}
    warm: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            cold[name].append(1e3 * bench_ms(fn))
            warm[name].append(graph_replay_us(fn))
    return {name: (statistics.median(cold[name]), statistics.median(warm[name])) for name in fns}


FLUSH_BYTES = 256 << 20  # what do_bench writes to flush the L2 before each call


def cold_kernel_us(
    fns: dict[str, Callable[[], Any]], calls: int = 50, copies: bool = False,
) -> dict[str, float]:
    """Median GPU time of the kernels one call of each of ``fns`` runs, each call after an L2
    flush (:func:`cold_kernel_samples`)."""
    return {name: statistics.median(us)
            for name, us in cold_kernel_samples(fns, calls, copies).items()}


def trace_order(names: Sequence[str], calls: int) -> list[str]:
    """The calls of a profiler trace of :func:`cold_kernel_samples`: rounds of one call of each
    of ``names``, in the next of :func:`balanced_orders` each round, as many whole cycles of
    them as give each name at least ``calls`` calls. Each name then takes every place in a
    round and follows every other equally often. In one fixed order a call ran after the same
    neighbour every time, and what that neighbour left in the caches counted: run AW4 timed ours
    in place twice under two names of one trace, and the second, which followed a call reading
    the same table, read 0.03-0.05 us less (medians) at 49 of 61 points."""
    orders = balanced_orders(len(names))
    rounds = -(-calls // len(orders)) * len(orders)
    return [names[i] for r in range(rounds) for i in orders[r % len(orders)]]


def cold_kernel_samples(
    fns: dict[str, Callable[[], Any]], calls: int = 50, copies: bool = False,
    dirty: bool = True,
) -> dict[str, list[float]]:
    """GPU time of the kernels of each call of each of ``fns`` (at least ``calls`` calls each, in
    rounds of one call of each in :func:`trace_order`: the i-th samples of two names come from
    neighbouring calls), each call after an L2 flush,
    from the profiler's device timestamps: the kernels' own time, without the launch
    latency and host lag that ``do_bench``'s events around a call include (a call whose host
    path outlasts the flush, as Liger's ``rope_forward`` on some hosts, leaves the GPU idle
    between the events). The calls run in turn in one trace, which the flushes' kernels cut
    into calls; a call must launch no kernel of the flush's name. Device copies (the
    profiler's ``Memcpy`` rows) count only with ``copies``: a device-to-device ``copy_`` timed
    the same way as the kernels it is the ceiling of. ``dirty``: the flush writes its buffer,
    as ``do_bench``'s does, and leaves the L2 full of dirty lines, which a call's first use of
    each line must write back to DRAM; otherwise it reads the buffer (a sum), leaving clean
    lines, so that only the call's own traffic reaches DRAM."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    cuda = torch.autograd.DeviceType.CUDA

    def kernels(prof: Any) -> list[Any]:
        return sorted((e for e in prof.events() if e.device_type == cuda
                       and (copies or not e.name.startswith("Memcpy"))),
                      key=lambda e: e.time_range.start)

    def flush_l2() -> None:
        if dirty:
            flush.zero_()
        else:
            flush.sum()

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush_l2()
        torch.cuda.synchronize()
    flush_kernels = kernels(prof)
    flush_names = {e.name for e in flush_kernels}
    for fn in fns.values():
        fn()
    order = trace_order(list(fns), calls)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for name in order:
            flush_l2()
            fns[name]()
        torch.cuda.synchronize()
    kernel_times = [(e.name, e.time_range.elapsed_us()) for e in kernels(prof)]
    return kernel_us_per_call(kernel_times, flush_names, order, len(flush_kernels))


def paired_difference(
    ours: Sequence[float], theirs: Sequence[float], level: float = 0.95,
) -> tuple[float, float, float]:
    """``(low, median, high)`` of the differences ``ours[i] - theirs[i]`` of paired samples
    (neighbouring calls of :func:`cold_kernel_samples`): their median, and the interval that
    holds the median difference with probability at least ``level`` whatever their
    distribution (the sign test's order statistics). An interval holding 0 says the two are
    level within what the samples can tell apart."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired_difference: got {len(ours)} and {len(theirs)} samples, "
                         "expected as many of each and at least one")
    diffs = sorted(a - b for a, b in zip(ours, theirs))
    n = len(diffs)
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2: [d_k, d_{n+1-k}]; with
    # too few pairs for any, k = 1: the whole range
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n // 2 and below + (p := math.comb(n, k) / 2 ** n) <= tail:
        below += p
        k += 1
    k = max(k, 1)
    return diffs[k - 1], statistics.median(diffs), diffs[n - k]


def kernel_us_per_call(
    kernel_times: Sequence[tuple[str, float]], flush_names: set[str], order: Sequence[str],
    flush_kernels: int = 1,
) -> dict[str, list[float]]:
    """Cut a trace's kernels (name, us; in start order) into calls at each flush (each run of
    ``flush_kernels`` kernels named in ``flush_names``: one flush's launches), and sum each
    call's kernels: ``{call name: [us per call]}`` for calls made in ``order``, each after one
    flush. Raises where the cut does not give one call with kernels per flush."""
    segments: list[float] = []
    into_flush = 0  # the current flush's kernels seen so far
    for name, us in kernel_times:
        if name in flush_names:
            if into_flush == 0:
                segments.append(0.0)
            into_flush = (into_flush + 1) % flush_kernels
        elif segments:
            segments[-1] += us
    if len(segments) != len(order) or not all(segments):
        raise RuntimeError(f"the trace holds {len(segments)} flushes for {len(order)} calls, or a "
                           "call without a kernel: a call launched a kernel named as the flush's")
    per_call: dict[str, list[float]] = {name: [] for name in order}
    for name, us in zip(order, segments):
        per_call[name].append(us)
    return per_call


def graph_replay_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """us per call of ``fn`` replayed from one CUDA graph of ``calls`` calls: no host path, and
    after the graph's first call the L2 holds what the calls share (the code, the table, the
    tensors of small calls), as for a model's layers in a captured step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1e3 * bench_ms(graph.replay) / calls


def written_replay_us(
    fn: Callable[[], Any], write: Callable[[], Any], calls: int = 20,
) -> float:
    """us per call of the in-place ``fn`` when ``write`` (a copy into the tensor ``fn`` reads)
    runs before each call, from CUDA graphs: the graph of ``write`` then ``fn``, less the graph
    of ``write`` alone. In a model the q and k that RoPE reads were just written by another
    kernel (the projection). :func:`graph_replay_us` of an in-place call instead has each call
    read what the previous one wrote, which favours, by our reading, a kernel whose programs
    land on the same SMs at every replay (one wave): at 2,048 tokens of 32 heads
    Liger's one-wave kernel took 6.51-6.53 us that way against ours' 7.24-7.25, and 7.28-7.32
    against ours' 7.00-7.01 after a copy (run AD)."""
    return graph_replay_us(lambda: (write(), fn()), calls) - graph_replay_us(write, calls)


def sweep_configs(heads: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps) around tiles of about 32 (token, head) rows."""
    h = 1 << (heads - 1).bit_length()
    out = []
    for bt, bh, hi, w in (
        (1, h, 1, 4), (2, h // 2, 1, 4), (4, h // 4, 1, 4), (8, h // 8, 1, 4), (2, h // 4, 1, 4),
        (4, h // 8, 1, 4), (8, h // 4, 1, 4), (1, h // 2, 1, 4), (4, h // 4, 1, 2),
        (4, h // 4, 1, 8), (4, h // 8, 2, 4), (2, h // 4, 2, 4),
    ):
        if bh >= 1 and bh * hi <= h:
            out.append((bt, bh, hi, w))
    return out


def run_sweep(report: Report, shapes: list[Shape], device: str = "cuda") -> None:
    """Time triton launch configurations (forward) on the large shapes; for tuning heuristics."""
    from rope_dispatch.backends import triton_rope, triton_tables, triton_tiles

    for shape in shapes:
        if shape.layout == "bshd" or shape is DECODE:  # bshd behaves as sbhd; decode is launch-bound
            continue
        inp = make_inputs(shape, device)
        table = inp.freqs.view(inp.freqs.shape[0], -1)
        out = torch.empty_like(inp.t)
        heads, d, rot = shape.heads, shape.head_dim, shape.rotary_dim
        copy_us = report.copy_us.get(shape.name)
        default = triton_tiles.choose_config(
            inp.t.numel() // (heads * d), heads, d, rot, inp.t.element_size(), False,
            triton_tiles.sm_count(inp.t.device.index),
        )
        results = []
        tried = [(default.block_t, default.block_h, default.head_iters, default.warps)]
        for bt, bh, hi, w in tried + sweep_configs(heads):
            config = default._replace(block_t=bt, block_h=bh, head_iters=hi, warps=w)

            def fn(config=config):
                triton_rope.launch(
                    triton_rope.Launch("t", shape.layout, False, 1.0, 1, 0), (inp.t,), (out,),
                    triton_rope.Tables(table, None, inp.cu_seqlens, None), config=config,
                )

            us = 1e3 * bench_ms(fn)
            results.append({"shape": shape.name, "config": config, "us": us,
                            "copy_ratio": None if copy_us is None else copy_us / us,
                            "default": config == default})
        results.sort(key=lambda r: r["us"])
        report.sweep.extend(results)
        best = results[0]
        dflt = next(r for r in results if r["default"])
        print(f"sweep {shape.name}: best {best['config']} {best['us']:.1f} us; "
              f"default {dflt['config']} {dflt['us']:.1f} us", flush=True)
        del inp, out
        if device == "cuda":
            torch.cuda.empty_cache()


def _versions() -> dict[str, str]:
    from rope_dispatch.autotune import dist_version, installed_versions

    found = {**installed_versions(), "liger-kernel": dist_version("liger-kernel", "liger_kernel")}
    return {"python": platform.python_version(), **{k: v for k, v in found.items() if v}}


def format_table(report: Report) -> str:
    """Markdown: one line per shape and implementation, fwd/bwd/fwd+bwd in us and % of copy."""
    lines = [
        "| shape | implementation | fwd us (% copy) | bwd us (% copy) "
        "| fwd+bwd us (% of 2 copies) | bwd kernel us (% copy) | max err |",
        "|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, str], dict[str, Row]] = {}
    for row in report.rows:
        cells.setdefault((row.shape, row.impl), {})[row.mode] = row
    for (shape, impl), modes in cells.items():
        if "copy" in modes:
            r = modes["copy"]
            lines.append(f"| {shape} | {impl} | {r.us:.1f} ({r.gbps / 1e3:.2f} TB/s) | | | | |")
            continue

        def cell(mode: str) -> str:
            r = modes.get(mode)
            return "-" if r is None else f"{r.us:.1f} ({100 * r.copy_ratio:.0f}%)"

        err = modes.get("fwd")
        err_text = "-" if err is None or err.max_error is None else f"{err.max_error:.1e}"
        note = f" ({modes['fwd'].note})" if "fwd" in modes and modes["fwd"].note else ""
        lines.append(
            f"| {shape} | {impl}{note} | {cell('fwd')} | {cell('bwd')} | {cell('fwd+bwd')} "
            f"| {cell('bwd kernel')} | {err_text} |"
        )
    if report.host:
        lines += ["", "| decode host path | us |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in report.host.items()]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(report: Report, path: Path) -> bool:
    """Grouped bars: % of copy per shape, one bar per implementation; a forward panel and a
    backward panel (through autograd, and hatched, the launch alone where measured). Shapes
    differ in more than size, so each stands on its own: no line joins them."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in report.rows if r.mode != "copy"]
    shapes = list(dict.fromkeys(r.shape for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(impls)}
    panels = (("forward", ("fwd",)), ("backward", ("bwd", "bwd kernel")))
    fig, axes = plt.subplots(2, 1, figsize=(max(12.0, 1.5 * len(shapes)), 10), sharex=True)
    for ax, (title, modes) in zip(axes, panels):
        bars: dict[tuple[str, str], dict[str, float]] = {}
        for row in rows:
            if row.mode in modes:
                bars.setdefault((row.impl, row.mode), {})[row.shape] = 100 * row.copy_ratio
        width = 0.8 / max(1, len(bars))
        for i, ((impl, mode), values) in enumerate(bars.items()):
            offset = (i - (len(bars) - 1) / 2) * width
            xs = [j + offset for j, shape in enumerate(shapes) if shape in values]
            alone = mode == "bwd kernel"
            ax.bar(xs, [values[s] for s in shapes if s in values], width, color=colors[impl],
                   hatch="///" if alone else None, edgecolor="white" if alone else None,
                   label=f"{impl}, launch alone" if alone else impl)
        ax.axhline(100, color="black", linewidth=0.8)
        ax.axhline(95, color="gray", linestyle=":", linewidth=0.8)
        ax.set_ylabel("% of a device copy of the same bytes")
        note = " (through autograd; hatched: the launch alone)" if len(modes) > 1 else ""
        ax.set_title(f"RoPE {title}{note}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xticks(range(len(shapes)))
    axes[-1].set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
    fig.suptitle(f"{report.device}, {report.date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(report: Report, out: Path) -> str:
    """Write bench.json and bench.md; returns the table."""
    (out / "bench.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    table = format_table(report)
    (out / "bench.md").write_text(f"{report.device}, {report.date}\n\n{table}\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json/.md/.png")
    parser.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to run")
    parser.add_argument(
        "--backends", default=None, help="comma-separated backends of ours (default: all available)"
    )
    parser.add_argument("--no-peers", action="store_true", help="skip TransformerEngine and Liger")
    parser.add_argument("--sweep", action="store_true", help="also time triton launch configurations")
    parser.add_argument("--serving", action="store_true",
                        help="also time serving calls: decode q+k with GPU positions, prefill q+k")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.bench needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    shapes = list(SHAPES)
    if args.shapes:
        wanted = [w.strip() for w in args.shapes.split(",")]
        shapes = [s for s in shapes if any(w in s.name for w in wanted)]
    backends = None if args.backends is None else [b.strip() for b in args.backends.split(",")]
    report = Report(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        versions=_versions(),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        print(f"shape {shape.name}", flush=True)
        run_shape(shape, report, backends, not args.no_peers)
        write(report, args.out)  # partial results survive a time limit
    if DECODE in shapes:
        run_host(report)
        write(report, args.out)
    if args.serving:
        run_serving(report)
        write(report, args.out)
    if args.sweep:
        run_sweep(report, shapes)
    table = write(report, args.out)
    plotted = plot(report, args.out / "bench.png")
    print(f"\n{report.device}, {report.date}, {report.versions}")
    print(table)
    print(f"\nwrote {args.out}/bench.json, bench.md" + (", bench.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
