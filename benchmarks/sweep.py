"""``python -m benchmarks.sweep``: RoPE's share of a device copy across sizes.

``benchmarks.bench`` times a few Llama-like shapes; this sweep walks sequence length from
128 to 131,072 (the token count for thd) for several (batch, heads, head dim) series, so a
reader sees where each implementation reaches the copy's bandwidth and where launch and tail
effects hold it back. Per point it measures a device-to-device copy of the tensor's bytes (the
ceiling: RoPE reads the tensor once and writes it once) and, for our triton backend (with
the point's angle table, the same table with its rows read, and its cos and sin in ``t``'s
dtype: Liger's inputs),
TransformerEngine's fused ``apply_rotary_pos_emb`` and Liger-Kernel's ``rope_forward`` /
``rope_backward`` (where importable and the layout fits their API): the forward, the
backward's launch alone, forward+backward through autograd, each as the median of
``triton.testing.do_bench`` and as % of the copy, and the kernels one forward and one
forward+backward launch (counted with ``torch.profiler``). From 64 MiB, where the target is
95% of the copy, our forward and backward kernel are timed in turn with the copy
(:func:`in_turn_ms`); our in-place ``apply_``, Liger's like, is timed at every point. Below
64 MiB each forward and backward kernel is also timed by the profiler after an L2 flush
(:func:`profiled_kernel_times`): there a call takes a few microseconds, and ``do_bench``'s
events around it add the launch's latency and any lag of the host. Ours in place, forward and
backward, is timed so too and compared with Liger's in-place kernels: after the flush, which
leaves the L2 full of dirty lines, a kernel writing a new output first frees as many lines as
it writes, one rewriting what it read does not. Where the calls of two implementations are
neighbours (one trace, one host-clock round), ours minus theirs is kept as a paired interval
(:func:`paired_intervals`), so a lead of a few nanoseconds can be told from the clock's steps.

Writes ``sweep.json`` and ``sweep.md`` to ``--out`` after every point (a run cut short keeps
what it measured) and, with matplotlib, ``sweep-<layout>.png``: % of copy against sequence
length, one panel per series.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run by path (python benchmarks/sweep.py): the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rope_dispatch as rd  # noqa: E402
from benchmarks.bench import (  # noqa: E402
    Impl, Inputs, Shape, _liger_peer, _ours, _ours_in_place, _seqlens, _te_peer, _versions,
    bench_ms, cold_kernel_samples, cold_kernel_us, graph_replay_us, host_rounds, make_inputs,
    paired_difference, pyplot, rows_read, time_mode, written_replay_us,
)

LAYOUTS = ("sbhd", "bshd", "thd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SEQ_LENS = (128, 512, 2048, 8192, 32768, 131072)
SIDE_SEQ_LENS = (2048, 32768)  # the head-dim and partial-rotary series: a short and a long point
QUICK_SEQ_LENS = (512, 8192)
MAX_TENSOR_BYTES = 1 << 30  # points whose input tensor is larger are left out
LARGE_TENSOR_BYTES = 64 << 20  # the "95% of copy" target covers inputs of at least this size
THD_SEQS_PER_BATCH = 4  # thd packs 4 * batch sequences into the token count
NOT_KERNELS = ("Memcpy", "Memset", "Context Sync", "Stream Sync", "Event Sync", "Stream Wait")
IMPLEMENTATIONS = {
    "triton": "triton", "triton-rows": "triton (table rows read)",
    "triton-cache": "triton (cos/sin cache, t's dtype)", "te": "TE fused (peer)",
    "liger": "Liger (peer)",
}
MODES = ("fwd", "bwd kernel", "fwd+bwd")
# The host-clock fwd+bwd, in turn. With 9 rounds of 20 calls, run Q's ratios to TE's API were
# within 4% at 12 of the 16 points where ours was slower, up to 1.215 at one: the host's noise
# at ~120 us a call. From 64 MiB a call takes 0.15-2 ms of GPU time; with 5 rounds of 10 the
# host-bound points of exactly 64 MiB (calls of 110-190 us) read 0.94 in one run and 1.03 in
# the next (run AB). Each round's ratio of ours to TE's API spread over 0.87-1.05 (10th-90th
# percentile) at the points below 64 MiB, where medians of 15 rounds moved by up to 0.08 within
# one run, and those of 9 rounds at 64 MiB by up to 0.18 (run AF): 40 rounds of 40 below 64 MiB and 20 of 20 from there, whole cycles of the
# balanced orders of five implementations and of thd's four (bench.balanced_orders: 10 and 4).
HOST_CALLS, HOST_ROUNDS = 40, 40
LARGE_HOST_CALLS, LARGE_HOST_ROUNDS = 20, 20


@dataclass(frozen=True)
class Series:
    """Points that differ only in sequence length: one line in a plot."""

    batch: int
    heads: int
    head_dim: int
    rotary_dim: int
    seq_lens: tuple[int, ...]
    why: str
    qkv: tuple[int, int, int] | None = None  # a packed qkv split; heads are then head groups


SERIES = (
    Series(1, 1, 128, 128, SEQ_LENS, "one head: a GQA key, or a tensor-parallel shard of one"),
    Series(1, 8, 128, 128, SEQ_LENS, "8 heads: Llama-3's keys, or 32 query heads over 4 ranks"),
    Series(4, 8, 128, 128, SEQ_LENS, "the same heads, batch 4 (16 packed sequences for thd)"),
    Series(1, 32, 128, 128, SEQ_LENS, "32 heads: Llama-3 8B's queries on one GPU"),
    Series(1, 8, 64, 64, SIDE_SEQ_LENS, "head dim 64"),
    Series(1, 8, 256, 256, SIDE_SEQ_LENS, "head dim 256"),
    Series(1, 32, 128, 64, SIDE_SEQ_LENS, "partial rotary: rotary dim half the head dim"),
)
QKV_SERIES = (
    Series(1, 8, 128, 128, SEQ_LENS, "packed qkv, 8 head groups of 4 query heads, a key and a "
           "value head (Llama-3 8B's 32 / 8 heads): TE's fused-QKV call", qkv=(512, 128, 128)),
)
QKV_LAYOUTS = ("sbhd", "bshd")  # TransformerEngine's fused-QKV API takes no packed (thd) batch
QUICK_SERIES = (
    Series(1, 8, 128, 128, QUICK_SEQ_LENS, "8 heads"),
    Series(1, 1, 128, 128, (2048,), "one head"),
    Series(1, 32, 128, 64, (2048,), "partial rotary"),
)


def dtype_name(dtype: torch.dtype) -> str:
    """The command line's name for ``dtype`` (bf16, fp16, fp32)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def make_point(layout: str, dtype: torch.dtype, series: Series, seq: int) -> Shape:
    """One sweep point as a bench ``Shape``; for thd, ``seq`` tokens in ``4 * batch`` packed
    sequences of fixed pseudo-random lengths."""
    rot = f" rot{series.rotary_dim}" if series.rotary_dim < series.head_dim else ""
    dims = f"h{series.heads} d{series.head_dim}{rot} {dtype_name(dtype)}"
    if series.qkv is not None:
        q_len, d, v_len = series.qkv
        dims = (f"g{series.heads} q{q_len // d}x{d} k{d} v{v_len}{rot} {dtype_name(dtype)}")
        if layout not in QKV_LAYOUTS:
            raise ValueError(f"a packed qkv point takes a layout of {QKV_LAYOUTS}, got {layout!r}")
        return Shape(f"qkv {layout} s{seq} b{series.batch} {dims}", layout, dtype, seq,
                     series.batch, series.heads, series.head_dim, series.rotary_dim,
                     qkv=series.qkv)
    if layout != "thd":
        return Shape(f"{layout} s{seq} b{series.batch} {dims}", layout, dtype, seq, series.batch,
                     series.heads, series.head_dim, series.rotary_dim)
    n = THD_SEQS_PER_BATCH * series.batch
    lengths = tuple(_seqlens(seq, n, torch.Generator().manual_seed(0)))
    return Shape(f"thd {n} seqs T{seq} {dims}", layout, dtype, seq, n, series.heads,
                 series.head_dim, series.rotary_dim, n_seqs=n, seqlens=lengths)


def sweep_points(
    layouts: Sequence[str] = LAYOUTS, dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    quick: bool = False, qkv: bool = False,
) -> list[Shape]:
    """Every (layout, dtype, series, sequence length) whose input tensor fits the size cap;
    with ``qkv`` the packed-qkv series instead, in the layouts of ``QKV_LAYOUTS``."""
    points = []
    if qkv:
        layouts = [layout for layout in layouts if layout in QKV_LAYOUTS]
    for layout in layouts:
        for dtype in dtypes:
            for series in QKV_SERIES if qkv else QUICK_SERIES if quick else SERIES:
                for seq in series.seq_lens:
                    shape = make_point(layout, dtype, series, seq)
                    if shape.tensor_bytes() <= MAX_TENSOR_BYTES:
                        points.append(shape)
    return points


def bytes_moved(shape: Shape) -> int:
    """What one RoPE call must move: the tensor read once and written once."""
    return 2 * shape.tensor_bytes()


def describe(shape: Shape) -> dict[str, Any]:
    """The point's fields in the report: what the table shows and the plots group by."""
    return {
        "name": shape.name, "layout": shape.layout, "dtype": dtype_name(shape.dtype),
        "seq": shape.seq, "batch": shape.batch, "heads": shape.heads,
        "head_dim": shape.head_dim, "rotary_dim": shape.rotary_dim,
        "qkv": None if shape.qkv is None else list(shape.qkv),
        "seqlens": None if shape.seqlens is None else list(shape.seqlens),
        "tensor_bytes": shape.tensor_bytes(), "bytes_moved": bytes_moved(shape),
        "points_at_least_64MB": shape.tensor_bytes() >= LARGE_TENSOR_BYTES,
    }


def count_launches(fn: Callable[[], Any]) -> int | None:
    """Kernels one call of ``fn`` runs on the GPU (copies, memsets and synchronisations not
    counted), from a ``torch.profiler`` trace of a call after a warm one; None where the
    profiler fails."""
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.events()
    except Exception as exc:  # noqa: BLE001 (a failing call or profiler costs one column)
        print(f"  counting launches: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return sum(
        1 for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(NOT_KERNELS)
    )


def mode_key(mode: str) -> str:
    """A mode's prefix in the report's keys: ``fwd``, ``bwd_kernel``, ``fwd_bwd``."""
    return mode.replace("+", "_").replace(" ", "_")


IN_TURN_MODES = ("fwd", "bwd kernel")  # the modes of the 95% target
IN_TURN_ROUNDS, IN_TURN_REP_MS = 4, 25


def in_turn_ms(fn: Callable[[], Any], copy: Callable[[], Any]) -> tuple[float, float]:
    """``(fn, copy)``: the median ms of each over ``IN_TURN_ROUNDS`` rounds that time the copy,
    then ``fn`` (:func:`bench_ms` over ``IN_TURN_REP_MS`` ms each), so a drift of the GPU's
    speed during a point reaches both. Against one copy timed at the point's start, run V's
    two sweeps read an unchanged tile at 99.2% and 93.6%."""
    times, copies = [], []
    for _ in range(IN_TURN_ROUNDS):
        copies.append(bench_ms(copy, rep=IN_TURN_REP_MS))
        times.append(bench_ms(fn, rep=IN_TURN_REP_MS))
    return statistics.median(times), statistics.median(copies)


def pct_of_copy(copy_time: float, share: float, time: float) -> float:
    """A call's % of a device copy's bandwidth: the copy's time over the call's (one unit),
    times ``share``, the bytes the call moves over one copy's (:meth:`Impl.copy_share`)."""
    return 100 * copy_time * share / time


def measure(
    impl: Impl, copy_ms: float, rotary_share: float, copy: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``impl``'s times (us and % of copy) and launch counts; a mode that fails is None. With
    ``copy``, the modes in ``IN_TURN_MODES`` are timed in turn with it (:func:`in_turn_ms`) and
    their % is of that copy (``<mode>_copy_us``), not of ``copy_ms``."""
    result: dict[str, Any] = {"label": impl.name}
    calls = {"fwd": impl.fwd, "bwd kernel": impl.bwd_kernel, "fwd+bwd": impl.fwd_bwd}
    for mode, fn in calls.items():
        key = mode_key(mode)
        result[f"{key}_us"] = result[f"{key}_pct_of_copy"] = None
        ceiling = copy_ms
        if fn is None:
            ms = None
        elif copy is not None and mode in IN_TURN_MODES:
            timed = time_mode(impl.name, mode, fn, lambda f: in_turn_ms(f, copy))
            ms, ceiling = timed if timed is not None else (None, copy_ms)
            result[f"{key}_copy_us"] = None if ms is None else 1e3 * ceiling
        else:
            ms = time_mode(impl.name, mode, fn, bench_ms)
        if ms is None:
            continue
        result[f"{key}_us"] = 1e3 * ms
        result[f"{key}_pct_of_copy"] = pct_of_copy(ceiling, impl.copy_share(mode, rotary_share), ms)
    result["launches_fwd"] = count_launches(impl.fwd)
    result["launches_fwd_bwd"] = None if impl.fwd_bwd is None else count_launches(impl.fwd_bwd)
    return result


def _build(name: str, shape: Shape, inp: Inputs) -> tuple[Impl | None, str]:
    """The implementation ``name`` for this point, or None and why it is absent."""
    if name == "triton":
        return _ours("triton", "triton", inp, inp.freqs), "the triton backend refuses the call"
    if name == "triton-rows":
        return rows_read_impl(inp, IMPLEMENTATIONS[name]), "the triton backend refuses the call"
    if name == "triton-cache":
        return (_ours("triton", IMPLEMENTATIONS[name], inp, model_dtype_cache(inp, shape.dtype)),
                "the triton backend refuses the call")
    if name == "te":
        return _te_peer(shape, inp), "TransformerEngine is not importable"
    if shape.layout == "thd":
        return None, "Liger's API takes no packed (thd) batch"
    if shape.qkv is not None:
        return None, "Liger's API takes q and k apart, not a packed qkv"
    return _liger_peer(shape, inp), "liger_kernel is not importable"


def rows_read_impl(inp: Inputs, label: str) -> Impl | None:
    """Ours on a copy of the point's angle table whose rows the kernels read (``rows_read``
    around every call, the copy its own object, so no plan or flag of the point's table reaches
    it). Beside ``triton``, what reading the table as rates saves."""
    table = inp.freqs.clone()
    impl = rows_read(lambda: _ours("triton", label, inp, table))()
    if impl is None:
        return None

    def rows(fn: Callable[[], Any] | None) -> Callable[[], Any] | None:
        return None if fn is None else rows_read(fn)

    return dataclasses.replace(
        impl, fwd=rows(impl.fwd), bwd=rows(impl.bwd), fwd_bwd=rows(impl.fwd_bwd),
        output=rows(impl.output), bwd_kernel=rows(impl.bwd_kernel),
    )


def model_dtype_cache(inp: Inputs, dtype: torch.dtype) -> rd.CosSinCache:
    """The point's cos and sin rounded to ``t``'s dtype: the inputs Liger's kernel takes (a
    model's own cos and sin, as Hugging Face models make them), so the two kernels read the
    same bytes and neither computes a sine."""
    return rd.CosSinCache(inp.cache.cos.to(dtype), inp.cache.sin.to(dtype))


def _measure_named(
    name: str, shape: Shape, inp: Inputs, copy_ms: float, kept: dict[str, Impl],
    copy: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Build and measure one implementation (in turn with ``copy`` where given: see
    :func:`measure`) and keep it in ``kept`` (for the point's host-clock measurement in
    turn)."""
    label = IMPLEMENTATIONS[name]
    try:
        impl, reason = _build(name, shape, inp)
        if impl is None:
            return {"label": label, "absent": reason}
        result = measure(impl, copy_ms, shape.rotary_dim / shape.head_dim, copy)
        kept[name] = impl
        return result
    except Exception as exc:  # noqa: BLE001 (a peer that fails is reported, not fatal)
        print(f"  {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"label": label, "absent": f"failed: {type(exc).__name__}: {exc}"}


def _in_place_times(
    impl: Impl | None, copy_ms: float, rotary_share: float, large: bool,
) -> dict[str, Any]:
    """Our ``apply_`` forward and the launch of its backward in place on the gradient, without
    the autograd engine (on ``d2 / d`` of the bytes: like for like with Liger's kernels, which
    always rotate in place): their times by ``do_bench`` and % of the copy's share of those
    bytes, and below 64 MiB the forward's time with the L2 warm; nothing where the triton
    backend refuses it in place (``impl`` None)."""
    if impl is None:
        return {}
    times: dict[str, Any] = {}
    for mode, fn in (("fwd", impl.fwd), ("bwd", impl.bwd_kernel)):
        key = f"{mode}_in_place"
        times.update({f"{key}_us": None, f"{key}_pct_of_copy": None})
        ms = time_mode(impl.name, mode, fn, bench_ms)
        if ms is not None:
            share = impl.copy_share(mode, rotary_share)
            times.update({f"{key}_us": 1e3 * ms,
                          f"{key}_pct_of_copy": pct_of_copy(copy_ms, share, ms)})
    if not large:
        times["fwd_in_place_warm_us"] = time_mode(impl.name, "fwd warm", impl.fwd, graph_replay_us)
        times["fwd_in_place_written_warm_us"] = _written_warm(impl)
    return times


def _written_warm(impl: Impl) -> float | None:
    """An in-place forward's us with the L2 warm, its input written by a copy just before each
    call (:func:`~benchmarks.bench.written_replay_us`), or None where it has no rewrite."""
    rewrite = impl.rewrite
    if rewrite is None:
        return None
    return time_mode(impl.name, "fwd warm after a write", impl.fwd,
                     lambda fn: written_replay_us(fn, rewrite))


def host_clock_rounds(large: bool) -> tuple[int, int]:
    """Calls per round and rounds of the host-clock forward + backward at a point below 64 MiB
    or (``large``) from there."""
    return (LARGE_HOST_CALLS, LARGE_HOST_ROUNDS) if large else (HOST_CALLS, HOST_ROUNDS)


def host_fwd_bwd_rounds(impls: dict[str, Impl], large: bool = False) -> dict[str, list[float]]:
    """Forward + backward through autograd, end to end on the host clock: each round's us per
    call (the final synchronisation included: the larger of host and GPU time, as a training
    step's calls run back to back), the implementations measured in turn within each round
    (:func:`~benchmarks.bench.host_rounds`), so the host's drift reaches them alike and the
    i-th rounds of two implementations are a pair. ``do_bench``'s figure flushes L2 between
    calls and so races the host path (about 100 us through autograd) against the GPU's: below
    64 MiB its single figures swing by tens of us, and at 64 MiB, where our two kernels take
    about 76 us, the same point gave 85-192 us across runs."""
    fns = {name: impl.fwd_bwd for name, impl in impls.items() if impl.fwd_bwd is not None}
    if not fns:
        return {}
    calls, rounds = host_clock_rounds(large)
    _, total = host_rounds(fns, calls, rounds)
    return total


def paired_intervals(
    samples: dict[str, list[float]], key: str, ours: str = "triton",
    others: dict[str, str] | None = None,
) -> dict[str, list[float]]:
    """Ours minus each other implementation's paired samples (neighbouring calls of one trace,
    or one round of the host clock) as ``[low, median, high]``, the sign test's 95% interval
    of the median difference (:func:`~benchmarks.bench.paired_difference`), keyed
    ``{key}_minus_{suffix}_us`` for each of ``others`` (sample name: key suffix; the peers by
    default). A positive low end is a lead of theirs that the samples tell apart from a tie;
    the medians alone moved by one or two 32 ns clock steps between two names of one kernel
    (run AW) and by up to 0.2 us between the same call at two twin points (run AY2)."""
    if others is None:
        others = {peer: peer for peer in PEERS}
    mine = samples.get(ours)
    if not mine:
        return {}
    return {f"{key}_minus_{suffix}_us": list(paired_difference(mine, samples[name]))
            for name, suffix in others.items() if len(samples.get(name, ())) == len(mine)}


def run_point(shape: Shape, peers: bool, device: str = "cuda") -> dict[str, Any]:
    """Measure one point: the copy, then each implementation (absent ones say why)."""
    record = describe(shape)
    inp = make_inputs(shape, device, draw_on_device=True)
    dst = torch.empty_like(inp.t)

    def copy() -> torch.Tensor:
        return dst.copy_(inp.t)

    copy_ms = bench_ms(copy)
    record["copy_us"] = 1e3 * copy_ms
    large = record["points_at_least_64MB"]
    if not large:
        record["copy_profiled_us"] = profiled_copy_us(copy)
    print(f"  device copy {record['copy_us']:9.1f} us", flush=True)
    results: dict[str, Any] = {}
    # the implementations stay built for one host-clock measurement in turn
    kept: dict[str, Impl] = {}
    for name, label in IMPLEMENTATIONS.items():
        if not name.startswith("triton") and not peers:
            results[name] = {"label": label, "absent": "--no-peers"}
        else:
            # the 95% target's figures from a copy timed in turn with them
            in_turn = copy if large and name == "triton" else None
            results[name] = _measure_named(name, shape, inp, copy_ms, kept, in_turn)
    del dst
    rotary_share = shape.rotary_dim / shape.head_dim
    in_place = None
    if "triton" in kept and inp.split is None:
        in_place = _ours_in_place("triton", inp)
        results["triton"].update(_in_place_times(in_place, copy_ms, rotary_share, large))
    host = host_fwd_bwd_rounds(kept, large)
    for name, rounds in host.items():
        us = statistics.median(rounds)
        results[name]["fwd_bwd_host_us"] = us
        results[name]["fwd_bwd_host_pct_of_copy"] = pct_of_copy(
            1e3 * copy_ms, kept[name].copy_share("fwd+bwd", rotary_share), us)
    results["triton"].update(paired_intervals(host, "fwd_bwd_host"))
    if not large:  # a CUDA graph of 20 calls: L2 warm below 64 MiB
        for name, impl in kept.items():
            results[name]["fwd_warm_us"] = time_mode(impl.name, "fwd warm", impl.fwd,
                                                     graph_replay_us)
            if impl.rewrite is not None:
                results[name]["fwd_written_warm_us"] = _written_warm(impl)
        profiled = dict(kept)
        if in_place is not None:
            profiled[IN_PLACE] = in_place
            # the same calls under a second name: what two samples of one kernel differ by
            profiled[IN_PLACE_AGAIN] = in_place
        measured, samples = profiled_kernel_times(profiled)
        for mode, by_name in samples.items():
            results["triton"].update(paired_intervals(by_name, f"{mode}_profiled"))
            in_place_key = IN_PLACE_KEYS[f"{mode}_profiled_us"].removesuffix("_us")
            results["triton"].update(paired_intervals(
                by_name, in_place_key, IN_PLACE, {"liger": "liger", IN_PLACE_AGAIN: "again"}))
        for name, times in measured.items():
            if name in SELF_KEYS:
                times = {SELF_KEYS[name][key]: us for key, us in times.items()}
                name = "triton"
            elif record["copy_profiled_us"]:  # % of copy by the profiler: the plots' figure
                share = kept[name].copy_share
                for mode in IN_TURN_MODES:
                    key = mode_key(mode)
                    if us := times.get(f"{key}_profiled_us"):
                        times[f"{key}_profiled_pct_of_copy"] = pct_of_copy(
                            record["copy_profiled_us"], share(mode, rotary_share), us)
            results[name].update(times)
    for result in results.values():
        print(f"  {result['label']:>16} {_cells(result)}", flush=True)
    kept.clear()
    record["implementations"] = results
    del inp
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


PROFILED_CALLS = 30  # at least this many calls of each mode in one trace (bench.trace_order)
IN_PLACE = "triton in place"  # ours in place among the profiled implementations
IN_PLACE_AGAIN = "triton in place, again"  # the same calls again, in the same trace
IN_PLACE_KEYS = {"fwd_profiled_us": "fwd_in_place_profiled_us",
                 "bwd_kernel_profiled_us": "bwd_in_place_profiled_us"}
"""Where ours in place's profiled times go in ``triton``'s results."""
SELF_KEYS = {
    IN_PLACE: IN_PLACE_KEYS,
    IN_PLACE_AGAIN: {"fwd_profiled_us": "fwd_in_place_again_profiled_us",
                     "bwd_kernel_profiled_us": "bwd_in_place_again_profiled_us"},
}
"""Where each of ours in place's two profiled series goes in ``triton``'s results. The second
times the same calls under another name (their i-th samples neighbours in one trace), so the
summary can say how far apart two medians of one kernel land: at 2 us a call the profiler's
clock steps by 32 ns on the H200, and a peer's lead of a step or less is within that."""


def profiled_copy_us(copy: Callable[[], Any]) -> float | None:
    """The device copy's time by the profiler, each call after an L2 flush: the ceiling of
    :func:`profiled_kernel_times`, timed as they are; None (said on stderr) where it fails."""
    try:
        return cold_kernel_us({"copy": copy}, calls=PROFILED_CALLS, copies=True)["copy"]
    except Exception as exc:  # noqa: BLE001 (reported, not fatal to the sweep)
        print(f"  copy profiled: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def profiled_kernel_times(
    impls: dict[str, Impl],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """Each implementation's forward and backward kernel by the profiler, each call after an L2
    flush (:func:`~benchmarks.bench.cold_kernel_samples`: the kernels' own time, every mode
    in turn in one trace): the medians, ``{name: {"fwd_profiled_us": us,
    "bwd_kernel_profiled_us": us}}``, and the samples, ``{"fwd" or "bwd_kernel": {name: [us per
    call]}}``, whose i-th entries come from neighbouring calls (:func:`paired_intervals`).
    Run Y5's ``do_bench`` figures below 64 MiB put identical kernels (ours with the table read
    as rates and as rows) up to 1 us apart, and Liger's forward at 4.5 us on one point and
    64.7 us on a like one, where its host path outlasted the flush. A trace that cannot be cut
    into calls (an implementation launching a kernel named as the flush's) is measured again
    one implementation at a time, and gives no samples (their calls are no longer
    neighbours); one that fails there is left out and said on stderr."""
    modes = {f"{name}\0{mode}": fn for name, impl in impls.items()
             for mode, fn in (("fwd", impl.fwd), ("bwd_kernel", impl.bwd_kernel)) if fn is not None}
    per_call: dict[str, list[float]] = {}  # the joint trace's samples: none from the fallback
    try:
        per_call = cold_kernel_samples(modes, calls=PROFILED_CALLS)
        measured = {key: statistics.median(us) for key, us in per_call.items()}
    except Exception:  # noqa: BLE001 (one implementation's kernels: measured alone below)
        measured = {}
        for name in impls:
            own = {key: fn for key, fn in modes.items() if key.split("\0")[0] == name}
            try:
                measured.update(cold_kernel_us(own, calls=PROFILED_CALLS) if own else {})
            except Exception as exc:  # noqa: BLE001 (reported, not fatal to the sweep)
                print(f"  {name} profiled: {type(exc).__name__}: {exc}", file=sys.stderr)
    times: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    for key, us in measured.items():
        name, mode = key.split("\0")
        times.setdefault(name, {})[f"{mode}_profiled_us"] = us
        if key in per_call:
            samples.setdefault(mode, {})[name] = per_call[key]
    return times, samples


def _time_cell(result: dict[str, Any], key: str) -> str:
    """``us (pct%)`` of one mode, or ``-`` where it was not measured."""
    us, pct = result.get(f"{key}_us"), result.get(f"{key}_pct_of_copy")
    return "-" if us is None else f"{us:.1f} ({pct:.0f}%)"


def _fwd_bwd_cell(result: dict[str, Any], fwd_key: str, bwd_key: str) -> str:
    """``fwd / bwd`` us of two of ``result``'s keys, ``-`` for one not measured."""
    return " / ".join("-" if (us := result.get(key)) is None else f"{us:.2f}"
                      for key in (fwd_key, bwd_key))


def _cells(result: dict[str, Any]) -> str:
    """An implementation's table cells: its modes, then its launch counts."""
    if "absent" in result:
        return f"absent ({result['absent']})"
    launches = "/".join("-" if n is None else str(n)
                        for n in (result.get("launches_fwd"), result.get("launches_fwd_bwd")))
    cells = [_time_cell(result, mode_key(m)) for m in MODES]
    for i, key in enumerate(("fwd_in_place", "bwd_in_place")):
        if result.get(f"{key}_us") is not None:
            cells[i] += f"; in place {_time_cell(result, key)}"
    times = " | ".join(cells)
    host, warm, in_place, written, in_place_written = (result.get(key) for key in (
        "fwd_bwd_host_us", "fwd_warm_us", "fwd_in_place_warm_us", "fwd_written_warm_us",
        "fwd_in_place_written_warm_us"))
    warm_cell = "-" if warm is None else f"{warm:.2f}"
    if written is not None:
        warm_cell += f" (written before: {written:.2f})"
    if in_place is not None:
        after = "" if in_place_written is None else f"; written before: {in_place_written:.2f}"
        warm_cell += f" (in place {in_place:.2f}{after})"
    profiled = _fwd_bwd_cell(result, "fwd_profiled_us", "bwd_kernel_profiled_us")
    if any(result.get(key) is not None for key in IN_PLACE_KEYS.values()):
        profiled += f" (in place {_fwd_bwd_cell(result, *IN_PLACE_KEYS.values())})"
    return (f"{times} | {'-' if host is None else f'{host:.1f}'} | {warm_cell} | {profiled} "
            f"| {launches}")


def format_table(points: Iterable[dict[str, Any]]) -> str:
    """Markdown: one line per point and implementation."""
    lines = [
        "| layout | dtype | seq (tokens for thd) | batch (sequences for thd) | heads | head dim "
        "| rotary dim | MiB moved | points_at_least_64MB | copy us | implementation "
        "| fwd us (% copy; ours in place too) | bwd kernel us (% copy; ours in place too) "
        "| fwd+bwd us (% of 2 copies) "
        "| fwd+bwd host clock us (in turn) | fwd us, L2 warm (CUDA graph; ours in place too; "
        "in place with the input written by a copy before each call) "
        "| kernel us by the profiler, L2 flushed (fwd / bwd; ours in place too) "
        "| launches fwd/fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lead = (f"| {p['layout']} | {p['dtype']} | {p['seq']} | {p['batch']} | {p['heads']} "
                f"| {p['head_dim']} | {p['rotary_dim']} | {p['bytes_moved'] / 2**20:.1f} "
                f"| {'yes' if p['points_at_least_64MB'] else 'no'} | {p['copy_us']:.1f}")
        for result in p["implementations"].values():
            if "absent" in result:
                why = " ".join(result["absent"].replace("|", "/").split())  # one table cell
                lines.append(f"{lead} | {result['label']} | absent: {why} | - | - | - | - | - "
                             "| - |")
            else:
                lines.append(f"{lead} | {result['label']} | {_cells(result)} |")
    return "\n".join(lines)


TARGET_PCT = 95.0  # issue 11: forward and backward kernel each at 95% of copy from 64 MiB on
PEERS = ("te", "liger")
MAX_LISTED = 40  # point-modes listed where a peer was faster


def _pct(point: dict[str, Any], name: str, key: str) -> float | None:
    return (point["implementations"].get(name) or {}).get(f"{key}_pct_of_copy")


def _us(point: dict[str, Any], name: str, key: str) -> float | None:
    return (point["implementations"].get(name) or {}).get(f"{key}_us")


def _interval(point: dict[str, Any], key: str, other: str) -> list[float] | None:
    """Ours minus ``other``'s paired samples of ``key`` (:func:`paired_intervals`), or None."""
    return (point["implementations"].get("triton") or {}).get(f"{key}_minus_{other}_us")


def _apart(interval: Sequence[float]) -> bool:
    """Whether a paired interval of ours minus theirs lies wholly above zero: a lead of theirs
    the samples tell apart from a tie."""
    return interval[0] > 0


def _lead_line(
    points: Sequence[dict[str, Any]], ours_key: str, peer: str, theirs_key: str,
    other: str | None = None,
) -> str | None:
    """Where ``peer``'s time (``theirs_key``) beat ours (``ours_key``), or None where no point
    has both; with ``other`` (the key suffix of :func:`paired_intervals`), also at how many of
    those points the paired samples tell the lead apart from a tie."""
    pairs = [(p, ours, theirs) for p in points
             if (ours := _us(p, "triton", ours_key)) and (theirs := _us(p, peer, theirs_key))]
    if not pairs:
        return None
    leads = [(ours - theirs, _interval(p, ours_key, other) if other else None)
             for p, ours, theirs in pairs if theirs < ours]
    line = f"{peer} faster at {len(leads)} of {len(pairs)} points"
    if leads:
        line += f", by {max(lead for lead, _ in leads):.2f} us at most"
    intervals = [interval for _, interval in leads if interval]
    if intervals:
        line += (f"; a lead the paired samples tell apart (95% interval of ours minus theirs "
                 f"above 0) at {sum(map(_apart, intervals))} of them")
    return line


def _compared(
    point: dict[str, Any], peer: str, mode: str, ours_mode: str | None = None,
) -> tuple[float, float, float, float, str, list[float] | None] | None:
    """``(ours us, peer's us, ours %, peer's %, how, interval)`` of one point-mode, ours in
    ``ours_mode`` (``mode`` by default; ``fwd_in_place``, ``bwd_in_place``), or None where
    either lacks it: the profiler's kernel time where both have one (below 64 MiB), its % of
    copy scaled from ``do_bench``'s (the same bytes in another time), else ``do_bench``'s;
    ``interval`` is ours minus the peer's paired samples where the run kept them (the
    profiler's trace, the host clock's rounds)."""
    ours_mode = ours_mode or mode
    figures = [(_us(point, name, key), _pct(point, name, key), _us(point, name, f"{key}_profiled"))
               for name, key in (("triton", ours_mode), (peer, mode))]
    if any(us is None or pct is None for us, pct, _ in figures):
        return None
    if all(profiled for _, _, profiled in figures):
        (ours, ours_pct, ours_k), (theirs, theirs_pct, theirs_k) = figures
        scaled = ours_pct * ours / ours_k, theirs_pct * theirs / theirs_k
        return (ours_k, theirs_k, *scaled, " (profiler)",
                _interval(point, f"{ours_mode}_profiled", peer))
    (ours, ours_pct, _), (theirs, theirs_pct, _) = figures
    return ours, theirs, ours_pct, theirs_pct, "", _interval(point, ours_mode, peer)


LIKE_FOR_LIKE = {"liger": {"fwd": "fwd_in_place", "bwd_kernel": "bwd_in_place"}}
"""Ours in the mode that does a peer's work, by peer and mode: Liger's kernels always rotate in
place, so ours in place (``apply_``, its backward in place on the gradient) is set against
them. Out of place, after the sweep's flush (a memset, which leaves the L2's lines dirty), a
call writes back one more dirty line for each line it writes (run BC); the summary lists ours
out of place against Liger's kernels too, apart from the headline."""


def summarize(points: Sequence[dict[str, Any]]) -> str:
    """The targets over the measured points, as lines of text: ours (``triton``) at 95% of copy
    forward and backward kernel on every point of 64 MiB and more; the point-modes where a
    peer's call takes less time and moves a larger share of the copy's bytes per second, like
    for like (:data:`LIKE_FOR_LIKE`; kernel time, below 64 MiB the profiler's where the points
    have it; and forward+backward end to end on the host clock); the profiler's kernel times
    below 64 MiB against each peer's (ours out of place against Liger's in-place kernels too),
    and ours in place against Liger's and against itself (the same calls twice in each trace:
    how far apart two medians of one kernel land); the forward below 64 MiB with the L2 warm
    against each peer (and ours in place against Liger's, replayed on their own output and
    with their input written by a copy before each call, as in a model); the host-clock
    forward+backward against each peer's; and what reading the table as rates gives over
    reading its rows. Where the point kept ours minus a peer's paired samples
    (:func:`paired_intervals`), each lead says whether their 95% interval lies above 0.
    Absent implementations and failed modes are left out."""
    lines = []
    large = [p for p in points if p["points_at_least_64MB"]]
    for mode in ("fwd", "bwd kernel"):
        shares = [(pct, p["name"]) for p in large
                  if (pct := _pct(p, "triton", mode_key(mode))) is not None]
        if shares:
            met = sum(pct >= TARGET_PCT for pct, _ in shares)
            low, where = min(shares)
            lines.append(f"triton {mode} at >= 64 MiB: {met} of {len(shares)} points at "
                         f"{TARGET_PCT:.0f}% of copy or more; lowest {low:.1f}% ({where})")
    behind, told_apart = [], 0
    for p in points:
        # like for like (LIKE_FOR_LIKE; out of place where ours in place is absent), and
        # faster in time and in share of the copy: a peer moving fewer bytes (Liger in place
        # on partial rotary against ours out of place) may take less time and still be slower.
        # Forward+backward through autograd on the host clock, in turn (do_bench's figure
        # races host and GPU)
        for mode in ("fwd", "bwd_kernel", "fwd_bwd_host"):
            for peer in PEERS:
                ours_mode = LIKE_FOR_LIKE.get(peer, {}).get(mode, mode)
                compared = _compared(p, peer, mode, ours_mode)
                if compared is None and ours_mode != mode:  # ours in place not timed here
                    ours_mode, compared = mode, _compared(p, peer, mode)
                if compared is None:
                    continue
                ours, theirs, ours_pct, theirs_pct, how, interval = compared
                if theirs < ours and theirs_pct > ours_pct:
                    line = (f"{p['name']} {ours_mode}{how}: {ours:.1f} us > {peer} "
                            f"{theirs:.1f} us")
                    if interval:
                        low, _, high = interval
                        line += (f"; ours - {peer} {low:+.3f} to {high:+.3f} us (95%): "
                                 + ("a lead" if _apart(interval) else "level within the samples"))
                    told_apart += interval is None or _apart(interval)
                    behind.append(line)
    lines.append(f"triton slower than a peer at {len(behind)} point-modes (like for like: "
                 "ours in place against Liger's in-place kernels; kernel time by do_bench from "
                 "64 MiB, by the profiler below); a lead the paired samples tell apart, or "
                 f"with none kept, at {told_apart}"
                 + "".join(f"\n  {line}" for line in behind[:MAX_LISTED])
                 + (f"\n  and {len(behind) - MAX_LISTED} more" if len(behind) > MAX_LISTED else ""))
    for peer in PEERS:
        # against Liger's in-place kernels out of place: not like for like (LIKE_FOR_LIKE)
        ours = "triton out of place (apply)" if peer in LIKE_FOR_LIKE else "triton"
        for what, key in (("forward", "fwd_profiled"), ("backward kernel", "bwd_kernel_profiled")):
            line = _lead_line(points, key, peer, key, peer)
            if line:
                lines.append(f"{ours} {what} below 64 MiB by the profiler (an L2 flush before "
                             f"each call): {line}")
    # an out-of-place kernel writes lines the L2 must first free (after a flush, dirty ones):
    # Liger rewrites the lines it read, as ours in place does
    for what, ours_key, theirs_key, again_key in (
        ("forward", "fwd_in_place_profiled", "fwd_profiled", "fwd_in_place_again_profiled"),
        ("backward", "bwd_in_place_profiled", "bwd_kernel_profiled",
         "bwd_in_place_again_profiled"),
    ):
        line = _lead_line(points, ours_key, "liger", theirs_key, "liger")
        if line:
            lines.append(f"triton in place (apply_) {what} below 64 MiB by the profiler, "
                         f"against Liger's in-place kernel: {line}")
        gaps = [abs(first - again) for p in points
                if (first := _us(p, "triton", ours_key))
                and (again := _us(p, "triton", again_key))]
        if gaps:  # medians of whole nanoseconds: apart by at least one
            apart = sum(gap >= 1e-3 for gap in gaps)
            by = f", by {max(gaps):.2f} us at most" if apart else ""
            # how often the paired test parts one kernel from itself: its false alarms
            selves = [interval for p in points if (interval := _interval(p, ours_key, "again"))]
            told = (f"; the paired samples tell the two apart (95% interval of the difference "
                    f"without 0) at {sum(low > 0 or high < 0 for low, _, high in selves)} of "
                    f"{len(selves)}") if selves else ""
            lines.append(f"triton in place (apply_) {what} below 64 MiB by the profiler, against "
                         f"itself (the same calls twice in each trace): apart at {apart} of "
                         f"{len(gaps)} points{by}{told}")
    # below 64 MiB a launch's latency sets the pace; L2 warm as in a model
    warm = [("triton forward", "fwd_warm", peer, " (a CUDA graph of 20 calls)") for peer in PEERS]
    warm.append(("triton in place (apply_) forward", "fwd_in_place_warm", "liger", ""))
    for what, ours_key, peer, how in warm:
        line = _lead_line(points, ours_key, peer, "fwd_warm")
        if line:
            lines.append(f"{what} below 64 MiB with the L2 warm{how}: {line}")
    # as in a model: the input just written by another kernel (written_replay_us)
    line = _lead_line(points, "fwd_in_place_written_warm", "liger", "fwd_written_warm")
    if line:
        lines.append("triton in place (apply_) forward below 64 MiB with the L2 warm, its input "
                     f"written by a copy before each call: {line}")
    for peer in PEERS:
        for layout in dict.fromkeys(p["layout"] for p in points):
            ratios = []
            for p in points:
                ours, theirs = _us(p, "triton", "fwd_bwd_host"), _us(p, peer, "fwd_bwd_host")
                if p["layout"] == layout and ours and theirs:
                    ratios.append(ours / theirs)
            if ratios:
                lines.append(
                    f"{layout} fwd+bwd end to end (host clock, in turn), triton / {peer}: median "
                    f"{statistics.median(ratios):.3f}, highest {max(ratios):.3f}, triton faster "
                    f"at {sum(r < 1 for r in ratios)} of {len(ratios)} points"
                )
    gains = [rows / ours for p in large
             if (ours := _us(p, "triton", "fwd")) and (rows := _us(p, "triton-rows", "fwd"))]
    if gains:
        lines.append(f"triton forward at >= 64 MiB, table rows read / read as rates: "
                     f"{statistics.median(gains):.2f}x median, {min(gains):.2f}-{max(gains):.2f}x")
    return "\n".join(lines)


@dataclass
class SweepReport:
    """What sweep.json holds: where and when, with which versions, and the measured points."""

    device: str
    date: str
    versions: dict[str, str]
    points: list[dict[str, Any]]


def write(report: SweepReport, out: Path) -> None:
    """sweep.json (everything) and sweep.md (the table), rewritten after each point."""
    (out / "sweep.json").write_text(json.dumps(report.__dict__, indent=1))
    header = f"{report.device}, {report.date}, {report.versions}"
    (out / "sweep.md").write_text(
        f"{header}\n\n{summarize(report.points)}\n\n{format_table(report.points)}\n"
    )


def series_key(point: dict[str, Any]) -> tuple:
    """What a plotted line holds fixed: everything but the sequence length."""
    qkv = point.get("qkv")
    return (point["dtype"], point["batch"], point["heads"], point["head_dim"], point["rotary_dim"],
            None if qkv is None else tuple(qkv))


def plotted_pct(result: dict[str, Any], mode: str) -> float | None:
    """The % of copy a plot shows for one implementation and mode: by the profiler's kernel
    times after an L2 flush against the copy's where the point has them (below 64 MiB, where
    ``do_bench``'s events add launch latency and host lag: run AE's sweep had ours at 53 us by
    them for a 3 us kernel), else by ``do_bench`` (from 64 MiB, timed in turn with a copy)."""
    key = mode_key(mode)
    return result.get(f"{key}_profiled_pct_of_copy") or result.get(f"{key}_pct_of_copy")


def plotted_in_place_pct(point: dict[str, Any], mode: str) -> float | None:
    """Ours in place's % of the copy's share of the rotary channels (the bytes it moves), as
    :func:`plotted_pct` takes it: by the profiler below 64 MiB, against the copy timed the
    same way, else ``do_bench``'s; ``mode`` is ``fwd`` or ``bwd kernel``. The line the plots
    set against Liger's in-place kernels (:data:`LIKE_FOR_LIKE`)."""
    ours = point["implementations"].get("triton") or {}
    key = "fwd_in_place" if mode == "fwd" else "bwd_in_place"
    us, copy_us = ours.get(f"{key}_profiled_us"), point.get("copy_profiled_us")
    if us and copy_us:
        return pct_of_copy(copy_us, point["rotary_dim"] / point["head_dim"], us)
    return ours.get(f"{key}_pct_of_copy")


def plot_layout(report: SweepReport, layout: str, path: Path) -> bool:
    """% of copy against sequence length for one layout: a panel per series, a line per
    implementation and mode (fwd solid, backward kernel dashed; :func:`plotted_pct`), ours in
    place too (:func:`plotted_in_place_pct`); False without matplotlib."""
    plt = pyplot()
    points = [p for p in report.points if p["layout"] == layout]
    if plt is None or not points:
        return False
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for p in sorted(points, key=lambda p: p["seq"]):
        groups.setdefault(series_key(p), []).append(p)
    cols = min(4, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)

    def implementation(name: str) -> Callable[[dict[str, Any], str], float | None]:
        return lambda p, mode: plotted_pct(p["implementations"].get(name) or {}, mode)

    lines = {label: implementation(name) for name, label in IMPLEMENTATIONS.items()}
    lines[IN_PLACE] = plotted_in_place_pct  # ours in place (apply_), Liger's like for like
    colors = {label: plt.cm.tab10(i) for i, label in enumerate(lines)}
    for ax, (key, group) in zip(axes.flat, groups.items()):
        dtype, batch, heads, head_dim, rot, qkv = key
        for label, pct_of in lines.items():
            for mode, style in (("fwd", "-"), ("bwd kernel", "--")):
                xy = [(p["seq"], pct) for p in group if (pct := pct_of(p, mode))]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", markersize=3, color=colors[label],
                            label=f"{label} {mode}")
        large = [p["seq"] for p in group if p["points_at_least_64MB"]]
        if large:
            ax.axvline(min(large), color="gray", linestyle=":", linewidth=0.8)
        ax.axhline(95, color="gray", linestyle=":", linewidth=0.8)
        ax.axhline(100, color="black", linewidth=0.6)
        ax.set_xscale("log", base=2)
        who = f"{batch} seqs" if layout == "thd" else f"b{batch}"
        rot_text = f" rot{rot}" if rot < head_dim else ""
        what = f"h{heads}" if qkv is None else f"qkv g{heads} q{qkv[0] // qkv[1]}x"
        ax.set_title(f"{who} {what} d{head_dim}{rot_text} {dtype}", fontsize=9)
        ax.set_xlabel("tokens" if layout == "thd" else "sequence length", fontsize=8)
        ax.set_ylabel("% of copy", fontsize=8)
        ax.grid(True, alpha=0.3)
    legend: dict[str, Any] = {}  # label -> line, over every panel (one may lack a peer)
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        legend.update(zip(labels, handles))
    spare = list(axes.flat)[len(groups):]
    for ax in spare:
        ax.axis("off")
    (spare[0] if spare else axes.flat[0]).legend(legend.values(), legend.keys(), fontsize=7,
                                                 loc="center" if spare else "best")
    fig.suptitle(f"RoPE {layout}: % of a device copy (dotted: 95%; inputs of 64 MiB and up "
                 f"right of the vertical line, below it kernel times by the profiler after an "
                 f"L2 flush) - {report.device}, {report.date}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(report: SweepReport, out: Path) -> list[Path]:
    """One ``sweep-<layout>.png`` per measured layout; none (and one line saying so) without
    matplotlib."""
    if pyplot() is None:
        print("matplotlib is not installed: no plots (the table and JSON are written)")
        return []
    layouts = dict.fromkeys(p["layout"] for p in report.points)
    paths = [out / f"sweep-{layout}.png" for layout in layouts]
    return [path for layout, path in zip(layouts, paths) if plot_layout(report, layout, path)]


def _choices(text: str, allowed: Iterable[str], what: str) -> list[str]:
    """A comma-separated option's names, each checked against ``allowed``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; 2 without a CUDA device."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for sweep.json, sweep.md and sweep-<layout>.png")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        type=lambda s: _choices(s, LAYOUTS, "unknown layout"),
                        help="comma-separated layouts (default: sbhd,bshd,thd)")
    parser.add_argument("--dtypes", default="bf16",
                        type=lambda s: _choices(s, DTYPES, "unknown dtype"),
                        help="comma-separated dtypes from bf16, fp16, fp32 (default: bf16)")
    parser.add_argument("--quick", action="store_true", help="a handful of points: a smoke run")
    parser.add_argument("--qkv", action="store_true",
                        help="the packed-qkv series instead (apply_qkv against TE's fused-QKV "
                             "API; sbhd and bshd)")
    parser.add_argument("--no-peers", action="store_true", help="skip TransformerEngine and Liger")
    parser.add_argument("--large", action="store_true",
                        help="only the points from 64 MiB (the 95%%-of-copy target's)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.sweep needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    points = sweep_points(args.layouts, [DTYPES[d] for d in args.dtypes], args.quick, args.qkv)
    if args.large:
        points = [p for p in points if p.tensor_bytes() >= LARGE_TENSOR_BYTES]
    report = SweepReport(torch.cuda.get_device_name(), datetime.date.today().isoformat(),
                         _versions(), [])
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"{len(points)} points; {report.device}; {report.versions}", flush=True)
    for i, shape in enumerate(points, 1):
        elapsed = time.perf_counter() - started
        print(f"[{i}/{len(points)}, {elapsed:.0f} s] {shape.name}", flush=True)
        report.points.append(run_point(shape, not args.no_peers))
        write(report, args.out)  # partial results survive a time limit
    plots = write_plots(report, args.out)
    print(f"\n{format_table(report.points)}\n\n{summarize(report.points)}\n")
    print(f"{len(points)} points in {time.perf_counter() - started:.0f} s; wrote "
          f"{args.out}/sweep.json, sweep.md" + "".join(f", {p.name}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
