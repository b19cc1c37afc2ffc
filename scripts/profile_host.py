"""Where a call's host time goes: cProfile of repeated serving and decode calls on the GPU, and
the device time of their kernels from torch.profiler (a developer's tool, not part of the
benchmark). Modes: ``grad [tokens [heads]]``, ``te``, ``front [rounds]`` (the dispatch front alone, on
the CPU), ``cores`` (``front`` pinned to each core in turn), ``gap [processes [cores]]``
(decode ``apply`` against its bound launch; with a count, in that many processes in turn,
pinned to the comma-separated cores if given), ``serving-gap`` (the same for ``apply_qk_`` and
``apply_``), ``serving-pieces [cpu]`` (their fronts' pieces timed apart), ``flag-host`` (forward +
backward reading a linear table as rates against reading its rows), ``grad-noise [rounds]``
(the sweep's forward + backward on the host clock, round by round, at the points where ours
trailed TE's API in a run), ``flag-paths [rounds]`` (what the sweep's flagged forward +
backward runs that the same calls reading rows do not), ``qkv`` (packed qkv through
``apply_qkv`` against TransformerEngine's ``apply_fused_qkv_rotary_pos_emb``, forward and
forward + backward on the host clock, from 1.5 to 192 MiB), ``qkv-pieces [tokens [layout]]``
(the same calls' backward piece by piece), or names of the serving calls
below."""
from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch

import rope_dispatch as rd
from rope_dispatch import bench


def profile(name, fn, calls=2000, top=14):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    lines = [l for l in s.getvalue().splitlines() if l.strip()][3:]
    from rope_dispatch import dispatch

    plans = sorted({getattr(p.run, "__qualname__", "?")
                    for entry in dispatch._plans.values() for p in entry.plans})
    print(f"=== {name}: host {bench.host_us_per_call(fn)[0]:.2f} us/call; plans: {plans}")
    print("\n".join(lines[: top + 2]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0):
            print(f"  kernel {e.key[:60]}: {e.device_time_total / max(e.count, 1):.2f} us x {e.count}")


def plan_keys(spec=None, freqs=None, backend=None, form=...):
    """The keys of dispatch's kept plans, ``(id(spec), id(freqs), forced backend, call form)``,
    that match what is given (``form=None``: a plain single tensor's call)."""
    from rope_dispatch import dispatch

    wanted = (None if spec is None else id(spec), None if freqs is None else id(freqs), backend)
    return [key for key in dispatch._plans
            if all(w is None or w == k for w, k in zip(wanted, key)) and form in (..., key[3])]


def noop_plans(key):
    """Replace the runs of the plans under ``key`` by a no-op returning the call's tensor, so a
    call times dispatch's front alone; returns the no-op."""
    from rope_dispatch import dispatch

    def noop(t, *_):
        return t

    entry = dispatch._plans[key]
    dispatch._plans[key] = entry._replace(plans=tuple(p._replace(run=noop) for p in entry.plans))
    dispatch._recent = dispatch._recent_run = None  # the last plan sets may be the one replaced
    return noop


def taken_plans(x, fn) -> list[str]:
    """The qualified names of the plans whose guards pass ``x`` (what ``fn(x)`` runs), found
    by calling ``fn`` with each kept plan's run wrapped."""
    from rope_dispatch import dispatch

    seen: list[str] = []

    def wrap(run):
        def recording(*args):
            seen.append(getattr(run, "__qualname__", "?"))
            return run(*args)
        return recording

    saved = dict(dispatch._plans)
    for key, entry in saved.items():
        dispatch._plans[key] = entry._replace(
            plans=tuple(p._replace(run=wrap(p.run)) for p in entry.plans))
    dispatch._recent = dispatch._recent_run = None
    try:
        fn(x)
    finally:
        dispatch._plans.clear()
        dispatch._plans.update(saved)
        dispatch._recent = dispatch._recent_run = None
    return seen or ["none (the unplanned path)"]


def grad_pieces(tokens=128, heads=8):
    """The gradient path piece by piece, ours against TE's API on one machine: forward with
    requires_grad, backward alone (retain_graph), both, the autograd.Function without dispatch,
    and the autograd engine's floor (a multiply)."""
    from rope_dispatch.backends import triton_rope

    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    freqs, spec = d["freqs"], d["sbhd"]
    leaf = torch.randn(tokens, 1, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(leaf)
    fns = {
        "ours": lambda x: rd.apply(x, freqs, spec),
        "ours, triton forced": lambda x: rd.apply(x, freqs, spec, backend="triton"),
        "ours autograd.Function (no dispatch)": lambda x: triton_rope._RoPEFunction.apply(
            x, freqs, None, None, None, "sbhd", False, 1.0, 1, 0, False, None),
        "multiply (autograd floor)": lambda x: x * 2,
    }
    rows_table = freqs.clone()  # its own object: no flag of freqs serves it
    fns["ours, triton, table rows read (no flag)"] = bench.rows_read(
        lambda x: rd.apply(x, rows_table, spec, backend="triton"))
    from rope_dispatch import dispatch

    for _ in range(2):  # a key is planned at its second call
        rd.apply(leaf, freqs, spec, backend="triton")
    planned = [p for key in plan_keys(spec, freqs, "triton", form=None)
               for p in dispatch._plans[key].plans if p.guard(leaf)]
    if planned:
        fns["ours plan (no dispatch front)"] = lambda x, run=planned[0].run: run(
            x, freqs, spec, None, None, None)
    try:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        te_freqs = freqs.view(freqs.shape[0], 1, 1, -1)
        fns["TE"] = lambda x: apply_rotary_pos_emb(x, te_freqs, tensor_format="sbhd", fused=True)
    except Exception as exc:  # noqa: BLE001
        print("TE not importable:", exc)
    print(f"=== gradient path, sbhd s{tokens} b1 h{heads} d128 bf16: host us per call")
    pieces = {}
    for name, fn in fns.items():
        out = fn(leaf)
        fn(leaf)  # planned at the second call
        print(f"  {name}: plans taken {taken_plans(leaf, fn)}")
        pieces[(name, "fwd")] = lambda fn=fn: fn(leaf)
        pieces[(name, "bwd (retain_graph)")] = lambda out=out: torch.autograd.grad(
            out, leaf, grad, retain_graph=True)
        pieces[(name, "fwd+bwd")] = lambda fn=fn: torch.autograd.grad(fn(leaf), leaf, grad)
    flag = triton_rope._flag_of(triton_rope._kernel_tables(freqs, tokens)[1])
    if flag is not None:  # the planned calls' check of a linear table's flag, alone
        stream = triton_rope._current_stream(freqs.get_device())
        pieces[("flag check", "alone")] = lambda: triton_rope._flag_stale(flag, freqs, stream)
    times = bench.host_us_interleaved(pieces)  # in turn within each round: ratios hold
    if flag is not None:
        print(f"  flag check alone: {times[('flag check', 'alone')][0]:.2f} us")
    for name in fns:
        shown = "  ".join(f"{piece} {times[(name, piece)][0]:7.2f}"
                          for piece in ("fwd", "bwd (retain_graph)", "fwd+bwd"))
        print(f"  {name:>38}: {shown}")
    print("  dispatch's choice:", str(rd.explain(leaf, freqs, spec)).splitlines()[1])
    for name in ("ours, triton forced", "ours, triton, table rows read (no flag)", "TE"):
        if name in fns:
            profile(f"fwd+bwd {name}", lambda fn=fns[name]: torch.autograd.grad(fn(leaf), leaf, grad),
                    top=22)


def flag_host() -> None:
    """Forward + backward on the host clock at sweep points whose calls read a linear table as
    rates (the flag), in turn with the same calls reading rows (a table that is not linear,
    and the sweep's ``rows_read`` wrapper) and TE's API, with parts of the flag check left out
    in turn; then the check's parts alone, on the last point's table."""
    from rope_dispatch import sweep
    from rope_dispatch.backends import triton_rope

    shipped = triton_rope._flag_stale

    def querying(flag, freqs, stream):  # the check before run AB: a query every call
        return (flag._rope_version != freqs._version
                or (freqs.is_cuda and triton_rope._stream_capturing())
                or triton_rope._linear_tables_raw() == triton_rope._LINEAR_TABLES_OFF)

    phases = {  # (the check, the stream the calls run on: None for the default stream)
        "as shipped": (shipped, None),
        "capture query on every call": (querying, None),
        "flag check skipped": (lambda flag, freqs, stream: False, None),
        "as shipped, on a side stream": (shipped, torch.cuda.Stream()),
        "as shipped, again": (shipped, None),
    }
    flag = freqs = None
    for layout, seq, batch, heads in [("sbhd", 8192, 1, 1), ("sbhd", 2048, 4, 8)]:
        series = sweep.Series(batch, heads, 128, 128, (seq,), "probe")
        shape = sweep.make_point(layout, torch.bfloat16, series, seq)
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        impls = {name: sweep._build(name, shape, inp)[0] for name in ("triton", "triton-rows", "te")}
        bent = inp.freqs.clone()
        bent.view(-1)[1] += 0.5  # no longer position x rate: its rows are read, no wrapper
        impls["triton, table not linear"] = bench._ours("triton", "bent", inp, bent)
        fns = {name: impl.fwd_bwd for name, impl in impls.items() if impl is not None}
        # the planned flag path does not read LINEAR_MIN_ROWS_READ: the wrapper's cost alone
        fns["triton in rows_read's wrapper"] = bench.rows_read(fns["triton"])
        for fn in fns.values():
            fn()
            fn()
        leaf = inp.t.detach().requires_grad_(True)
        flagged = triton_rope._flag_of(triton_rope._kernel_tables(
            triton_rope.angles_2d(inp.freqs), triton_rope._rows_read(leaf, layout, None))[1])
        print(f"=== {shape.name}: flag {'set' if flagged is not None else 'none'}; "
              f"plans {taken_plans(leaf, lambda x: rd.apply(x, inp.freqs, inp.spec, backend='triton'))}")
        if flagged is not None:
            flag, freqs = flagged, inp.freqs
        for phase, (stale, stream) in phases.items():
            triton_rope._flag_stale = stale
            torch.cuda.synchronize()
            try:
                with torch.cuda.stream(stream):
                    times = bench.host_us_interleaved(fns, calls=40, rounds=31)
            finally:
                triton_rope._flag_stale = shipped
            print(f"  {phase:>34}: " + "  ".join(
                f"{n}: {h:6.1f}/{t:6.1f}" for n, (h, t) in times.items()))
    if flag is None:
        return
    device_index = freqs.get_device()
    stream = triton_rope._current_stream(device_index)
    print("=== the flag check's parts, host us per call")
    parts = {
        "_flag_stale": lambda: triton_rope._flag_stale(flag, freqs, stream),
        "_capturing_on": lambda: triton_rope._capturing_on(stream),
        "_current_stream": lambda: triton_rope._current_stream(device_index),
        "_stream_capturing": lambda: triton_rope._stream_capturing(),
        "_linear_tables_raw": lambda: triton_rope._linear_tables_raw(),
        "flag._rope_version": lambda: flag._rope_version,
        "freqs._version": lambda: freqs._version,
        "freqs.is_cuda": lambda: freqs.is_cuda,
        "nothing": lambda: None,
    }
    for name, us in loop_us_in_turn(parts, rounds=21, calls=20000).items():
        print(f"  {name:>24}: {us:.3f}")


def te_pieces():
    """Decode ``apply(backend="te")`` against TE's own call in turn: TE's function with the
    arguments our plan passes, our TE plan without the dispatch front, and through ``apply``."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    from rope_dispatch import dispatch

    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    freqs, spec = d["freqs"], d["sbhd"]
    x = torch.randn(1, 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    te_freqs = freqs.view(freqs.shape[0], 1, 1, -1)
    for _ in range(2):  # a key is planned at its second call
        rd.apply(x, freqs, spec, backend="te")
    (run,) = [p.run for key in plan_keys(spec, freqs, "te") for p in dispatch._plans[key].plans]
    calls = {
        "TE's function": lambda: apply_rotary_pos_emb(x, te_freqs, tensor_format="sbhd", fused=True),
        "our TE plan (no dispatch front)": lambda: run(x, freqs, spec, None, None, None),
        "apply backend=te": lambda: rd.apply(x, freqs, spec, backend="te"),
        "apply (auto)": lambda: rd.apply(x, freqs, spec),
    }
    print("=== decode sbhd s1 b64 h32 d128 bf16: host us per call, in turn")
    for name, (host, total) in bench.host_us_interleaved(calls).items():
        print(f"  {name:>34}: host {host:6.2f}  end to end {total:6.2f}")
    profile("apply backend=te", calls["apply backend=te"], top=16)
    profile("TE's function", calls["TE's function"], top=16)


def loop_us_in_turn(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Host us per call of each of ``fns`` in a tight loop of ``calls`` calls, no GPU sync:
    the median over ``rounds`` rounds, each timing them all in a new order (a fixed seed)."""
    times = {name: [] for name in fns}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(fns), len(fns)):
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def front(rounds: int = 41, calls: int = 20000) -> None:
    """The dispatch front of a planned decode-size ``apply`` alone: the plan's run replaced by a
    no-op, CPU tensors (no launch), timed in turn with a direct call of that no-op. Run on any
    host, it says how fast that host runs the front's Python, which the GPU benchmark's gap
    (``apply`` against the bound launch) measures with a launch around it."""
    t = torch.randn(1, 64, 32, 128)
    freqs = torch.randn(4096, 1, 1, 128)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    for _ in range(2):  # a key is planned at its second call
        rd.apply(t, freqs, spec)
    (key,) = plan_keys(spec, freqs)
    noop = noop_plans(key)
    fns = {"apply (front + no-op plan)": lambda: rd.apply(t, freqs, spec),
           "no-op plan called directly": lambda: noop(t, freqs, spec, None, None, None)}
    assert all(fn() is t for fn in fns.values())
    medians = loop_us_in_turn(fns, rounds, calls)
    for name, us in medians.items():
        print(f"  {name:>28}: {us:.3f} us (median of {rounds} rounds of {calls})")
    print(f"  dispatch front: {medians['apply (front + no-op plan)'] - medians['no-op plan called directly']:.3f} us")


def gap() -> None:
    """Decode ``apply`` against its bound launch, in turn, with the dispatch front alone (the
    same call on a second spec whose plan runs a no-op) and the front followed by the bound
    launch: whether the gap is the front's Python, and what that Python costs between
    launches rather than in a loop of its own."""
    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    x = torch.randn(1, 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    _front_gap("decode sbhd s1 b64 h32 d128 bf16", "apply (auto)",
               lambda spec: rd.apply(x, d["freqs"], spec), d["sbhd"], d["freqs"], (x, None, None, None))


GAP_ASKED_US = 1.5  # issue 11: apply end to end within this of the bound launch
NUMBER = r"(-?[\d.]+)"  # a figure in a child process's printed lines


def _pinned(core: int | None):
    """A ``preexec_fn`` running a child process on ``core`` alone (``None``: where the OS puts
    it)."""
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def gap_processes(processes: int, cores: list[int] | None = None) -> None:
    """:func:`gap` in ``processes`` new processes one after another: on one host the same code
    read 1.04-2.19 us between processes (run X), so the figure to judge is how many processes
    hold it and the median over them. ``cores``: pin process ``n`` to ``cores[n % len]``."""
    pattern = re.compile(rf"- bound launch: {NUMBER} us; front alone {NUMBER} us; front between "
                         rf"launches {NUMBER} us")
    launch = re.compile(rf"^\s*bound launch: host\s+{NUMBER}")
    rows = []
    for n in range(processes):
        core = cores[n % len(cores)] if cores else None
        out = subprocess.run([sys.executable, __file__, "gap"], capture_output=True, text=True,
                             check=True, preexec_fn=_pinned(core)).stdout
        found = pattern.search(out)
        bound = next(m for m in map(launch.match, out.splitlines()) if m)
        rows.append((float(bound[1]), *(float(x) for x in found.groups())))
        where = "" if core is None else f" (core {core})"
        print(f"  process {n + 1}{where}: bound launch {rows[-1][0]:6.2f} us; apply - bound "
              f"launch {rows[-1][1]:5.2f} us; front alone {rows[-1][2]:5.2f}; between launches "
              f"{rows[-1][3]:5.2f}", flush=True)
    gaps = [row[1] for row in rows]
    print(f"  apply - bound launch over {processes} processes: median "
          f"{statistics.median(gaps):.2f} us, {min(gaps):.2f}-{max(gaps):.2f}; within "
          f"{GAP_ASKED_US} us in {sum(g <= GAP_ASKED_US for g in gaps)} of {processes}")


def core_speeds() -> None:
    """:func:`front` in a new process pinned to each core in turn (11 rounds, the eager backend
    forced: a CPU call on a GPU machine would otherwise measure backends first): whether the
    spread of Python's speed between processes on one host (run X: a no-op call 0.10 against
    0.19 us) follows the core a process runs on."""
    noop = re.compile(rf"no-op plan called directly: {NUMBER} us")
    front_us = re.compile(rf"dispatch front: {NUMBER} us")
    for core in sorted(os.sched_getaffinity(0)):
        out = subprocess.run([sys.executable, __file__, "front", "11"], capture_output=True,
                             text=True, check=True, preexec_fn=_pinned(core),
                             env={**os.environ, "ROPE_BACKEND": "eager"}, timeout=120).stdout
        print(f"  core {core:3d}: no-op call {float(noop.search(out)[1]):.3f} us; apply's front "
              f"{float(front_us.search(out)[1]):.3f} us", flush=True)


def serving_gap() -> None:
    """:func:`gap` for the serving entries, whose calls take ``_run``'s lookup: decode
    ``apply_qk_`` of q (32 heads) and k (8) with per-token positions and a pair cache, and
    ``apply_`` of q with start positions."""
    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    q, k, pos = d["q"], d["k"], d["positions"]
    q4 = q.unsqueeze(0)
    _front_gap("decode apply_qk_ thd T64, q h32 + k h8, positions, pair cache", "apply_qk_",
               lambda spec: rd.apply_qk_(q, k, d["pair_cache"], spec, positions=pos),
               d["thd"], d["pair_cache"], (q, None, pos, k))
    _front_gap("decode apply_ sbhd s1 b64 h32, start positions", "apply_",
               lambda spec: rd.apply_(q4, d["freqs"], spec, start_positions=pos),
               d["sbhd"], d["freqs"], (q4, pos, None, None))


def serving_pieces(device: str = "cuda") -> None:
    """The serving fronts' pieces timed apart, in turn, on the plans of ``serving_gap``'s
    ``apply_qk_`` (the plans' runs replaced by no-ops): each entry, ``_run`` called directly,
    the call form, the guard of three tensors, the table's address, the reads a front makes,
    the tensor reads the form made before run Y (``is_leaf``, ``is_inference()``), and
    ``apply``'s front for scale. On the CPU (``cpu``) the index tensor is
    treated as a device one so that its calls are planned."""
    from rope_dispatch import call as call_module, dispatch

    if device == "cpu":
        call_module._reads = lambda index: False
    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"], device=device)
    q, k, pos, cache, freqs = d["q"], d["k"], d["positions"], d["pair_cache"], d["freqs"]
    x = torch.randn(1, 64, 32, 128, device=device, dtype=torch.bfloat16)
    thd, sbhd = d["thd"], d["sbhd"]
    for _ in range(2):  # a key is planned at its second call
        rd.apply_qk_(q, k, cache, thd, positions=pos)
        rd.apply(x, freqs, sbhd)
    noop_plans(plan_keys(thd, cache)[0])
    noop_plans(plan_keys(sbhd, freqs)[0])
    (entry,) = [dispatch._plans[key] for key in plan_keys(thd, cache)]
    guard, address = entry.plans[0].guard, entry.plans[0].address
    form = dispatch._planned_form(q, cache, None, pos, k, None, None, True, False)[1]
    other = tuple(form)
    reads, inference = call_module._reads, torch.is_inference_mode_enabled
    pieces = {
        "apply (front, no-op plan)": lambda: rd.apply(x, freqs, sbhd),
        "apply_qk_ (front, no-op plan)": lambda: rd.apply_qk_(q, k, cache, thd, positions=pos),
        "_run directly": lambda: dispatch._run(q, cache, thd, None, None, True, False,
                                               positions=pos, k=k),
        "_planned_form": lambda: dispatch._planned_form(q, cache, None, pos, k, None, None, True,
                                                        False),
        "guard(q, k, positions)": lambda: guard(q, k, pos),
        "table address": lambda: address(cache),
        "form compare": lambda: other != form,
        "q.is_leaf": lambda: q.is_leaf,
        "q.is_inference()": lambda: q.is_inference(),
        "is_inference_mode_enabled()": lambda: inference(),
        "_reads(positions)": lambda: reads(pos),
        "compile check": lambda: dispatch._dynamo_compiling(),
        "forced reads": lambda: dispatch._forced_get() or dispatch._env_backend_raw(),
        "weak references": lambda: entry.refs[0]() is thd and entry.refs[1]() is cache,
        "lambda alone": lambda: None,
    }
    medians = loop_us_in_turn(pieces, rounds=21, calls=2000)
    print(f"=== serving front pieces on {device} (python {sys.version.split()[0]}, torch "
          f"{torch.__version__}), us per call, median of 21 rounds in turn")
    for name, us in medians.items():
        print(f"  {name:>30}: {us:.3f}")


def _front_gap(title: str, label: str, call, spec, freqs, args: tuple) -> None:
    """``call(spec)`` against the plan it runs called directly (the bound launch), in turn,
    with the front alone (``call`` on a copy of ``spec`` whose plan runs a no-op) and the front
    followed by the bound launch. ``freqs`` is the call's table, ``args`` the plan's tensors
    ``(t, start_positions, positions, k)``."""
    from rope_dispatch import dispatch

    t, starts, positions, k = args
    noop_spec = spec.model_copy()
    for _ in range(2):  # a key is planned at its second call
        call(spec)
        call(noop_spec)
    (bound,) = [p.run for key in plan_keys(spec) for p in dispatch._plans[key].plans]
    (key,) = plan_keys(noop_spec)
    noop = noop_plans(key)

    def launch():
        return bound(t, freqs, spec, starts, positions, k)

    calls = {
        "bound launch": launch,
        label: lambda: call(spec),
        "front, no-op plan": lambda: call(noop_spec),
        "no-op called directly": lambda: noop(t, freqs, spec, starts, positions, k),
        "front, no-op plan, then bound launch": lambda: (call(noop_spec), launch()),
    }
    print(f"=== {title}, host us per call, in turn; plan: {bound.__qualname__}")
    times = bench.host_us_interleaved(calls)
    for name, (host, total) in times.items():
        print(f"  {name:>38}: host {host:6.2f}  end to end {total:6.2f}")
    host = {name: h for name, (h, _) in times.items()}
    print(f"  {label} - bound launch: {host[label] - host['bound launch']:.2f} us; front alone "
          f"{host['front, no-op plan'] - host['no-op called directly']:.2f} us; front between "
          f"launches {host['front, no-op plan, then bound launch'] - host['bound launch']:.2f} us")


GRAD_NOISE_POINTS = (  # points where ours trailed TE's API end to end in run AW5's sweep
    "bshd s8192 b1 h8 d128 bf16", "bshd s2048 b1 h8 d256 bf16", "bshd s8192 b1 h32 d128 bf16",
    "sbhd s8192 b1 h8 d128 bf16", "bshd s2048 b1 h8 d128 bf16",
)


def grad_noise(rounds: int = 120, names: Sequence[str] = GRAD_NOISE_POINTS) -> None:
    """How far one sweep's host-clock forward + backward figure moves: the sweep's
    implementations of each point in ``names`` (by default :data:`GRAD_NOISE_POINTS`), timed
    in turn for ``rounds`` rounds of the sweep's calls; per implementation the 10th, 50th and 90th percentile of its
    round times, ours over TE's API per round, and the medians of disjoint runs of the sweep's
    rounds (what one sweep would have reported)."""
    from rope_dispatch import sweep

    points = {p.name: p for p in sweep.sweep_points()}
    for name in names:
        shape = points[name]
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        impls = {}
        for impl_name in sweep.IMPLEMENTATIONS:
            impl, _ = sweep._build(impl_name, shape, inp)
            if impl is not None and impl.fwd_bwd is not None:
                impls[impl_name] = impl.fwd_bwd
        calls, chunk = sweep.host_clock_rounds(sweep.describe(shape)["points_at_least_64MB"])
        _, total = bench.host_rounds(impls, calls, rounds)
        print(f"{name}: {rounds} rounds of {calls} calls, end-to-end us per call", flush=True)
        for impl_name, times in total.items():
            deciles = statistics.quantiles(times, n=10)
            print(f"  {impl_name:>14}: p10 {deciles[0]:7.1f}  p50 {statistics.median(times):7.1f}"
                  f"  p90 {deciles[-1]:7.1f}")
        if "te" in total:
            ratio = [a / b for a, b in zip(total["triton"], total["te"])]
            deciles = statistics.quantiles(ratio, n=10)
            runs = [statistics.median(total["triton"][i:i + chunk])
                    / statistics.median(total["te"][i:i + chunk])
                    for i in range(0, rounds - chunk + 1, chunk)]
            print(f"  ours / TE per round: p10 {deciles[0]:.3f}  p50 {statistics.median(ratio):.3f}"
                  f"  p90 {deciles[-1]:.3f}; medians of {chunk} rounds: "
                  + " ".join(f"{r:.3f}" for r in runs), flush=True)
        del inp, impls


FLAG_PATH_POINTS = (  # F1's and F2's misses against TE's API (flagged), and a point reading rows
    "sbhd s8192 b1 h1 d128 bf16", "bshd s2048 b4 h8 d128 bf16", "sbhd s2048 b1 h1 d128 bf16",
    "sbhd s2048 b4 h8 d128 bf16", "thd 4 seqs T8192 h1 d128 bf16", "sbhd s512 b1 h8 d128 bf16",
)


def _call_counts(fn, calls: int = 200) -> tuple[dict[str, float], float]:
    """Calls per ``fn()`` of each Python function it runs (cProfile), and its profiled us per
    call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    counts = {}
    for (file, line, func), (_, ncalls, *_rest) in pstats.Stats(prof).stats.items():
        where = "~" if file == "~" else f"{os.path.basename(file)}:{line}"
        counts[f"{func} ({where})"] = ncalls / calls
    return counts, us


def _padded(check, us: float):
    """``check`` followed by ``us`` of busy host time: what a slower check would cost."""
    def padded(flag, freqs, stream):
        stale = check(flag, freqs, stream)
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass
        return stale
    return padded


def flag_paths(rounds: int = 31, profiled: bool = True) -> None:
    """Why the sweep's flagged points took more on the host clock than the same calls reading
    rows: each point of :data:`FLAG_PATH_POINTS` run as the sweep runs it (``run_point``, peers
    included), and at its host-clock step, besides the sweep's own figure, the Python
    functions each forward + backward of ours runs (cProfile, where ``triton`` and
    ``triton-rows`` differ; with ``profiled``), where each check of the flag runs (thread,
    stream) and what it answers, all of them in turn in the reverse order of names, and ours on
    a table object of its own (read as rates, like ``triton``'s, which TE's API and our in-place
    calls share) in turn with the two and TE's API, with the flag's check as shipped, left
    out, cut to one of its parts, and followed by 0.5 or 2 us of busy host time."""
    from rope_dispatch import sweep
    from rope_dispatch.backends import triton_rope

    points = {p.name: p for p in sweep.sweep_points()}
    measured, build = sweep.host_fwd_bwd_us, sweep._build
    built = {}

    def keeping(name, shape, inp):
        built["inp"] = inp
        return build(name, shape, inp)

    def diagnosing(impls, large=False):
        figures = measured(impls, large)
        fns = {name: impl.fwd_bwd for name, impl in impls.items() if impl.fwd_bwd is not None}
        print("  sweep figure: " + "  ".join(f"{n} {us:.1f}" for n, us in figures.items()))
        if profiled:
            counts = {name: _call_counts(fns[name]) for name in ("triton", "triton-rows")}
            ours, rows = counts["triton"][0], counts["triton-rows"][0]
            print(f"  profiled us per call: triton {counts['triton'][1]:.1f}, "
                  f"triton-rows {counts['triton-rows'][1]:.1f}; calls per call that differ:")
            for func in sorted(set(ours) | set(rows)):
                if abs(ours.get(func, 0) - rows.get(func, 0)) > 0.01:
                    print(f"    {func}: {ours.get(func, 0):.2f} / {rows.get(func, 0):.2f}")
        calls, _ = sweep.host_clock_rounds(large)
        inp = built["inp"]
        own = bench._ours("triton", "own table", inp, inp.freqs.clone())
        trio = {"triton": fns["triton"], "triton-rows": fns["triton-rows"],
                "triton, own table": own.fwd_bwd, "te": fns.get("te")}
        trio = {n: fn for n, fn in trio.items() if fn is not None}
        shipped = triton_rope._flag_stale
        seen = collections.Counter()

        def recording(flag, freqs, stream):
            stale = shipped(flag, freqs, stream)
            main = threading.current_thread() is threading.main_thread()
            seen[("main" if main else "other") + " thread", f"stream {stream:#x}",
                 "stale" if stale else "fresh"] += 1
            return stale

        triton_rope._flag_stale = recording
        try:
            for _ in range(10):
                trio["triton"]()
            torch.cuda.synchronize()
        finally:
            triton_rope._flag_stale = shipped
        print("  the check over 10 calls: " + "; ".join(
            f"{' '.join(k)}: {n}" for k, n in sorted(seen.items())))
        for phase, stale in (("as shipped", shipped),
                             ("check left out", lambda flag, freqs, stream: False),
                             ("version only", lambda flag, freqs, stream:
                                 flag._rope_version != freqs._version),
                             ("capture only", lambda flag, freqs, stream:
                                 triton_rope._capturing_on(stream)),
                             ("as shipped + 0.5 us", _padded(shipped, 0.5)),
                             ("as shipped + 2 us", _padded(shipped, 2.0)),
                             ("as shipped, again", shipped)):
            triton_rope._flag_stale = stale
            try:
                times = bench.host_us_interleaved(trio, calls=calls, rounds=rounds)
            finally:
                triton_rope._flag_stale = shipped
            print(f"  {phase:>18}: " + "  ".join(f"{n} {t:.1f}" for n, (_, t) in times.items()))
        reverse = bench.host_us_interleaved(dict(reversed(fns.items())), calls=calls, rounds=rounds)
        print("  names reversed: " + "  ".join(f"{n} {t:.1f}" for n, (_, t) in reverse.items()),
              flush=True)
        return figures

    sweep.host_fwd_bwd_us, sweep._build = diagnosing, keeping
    try:
        for name in FLAG_PATH_POINTS:
            print(f"=== {name}", flush=True)
            sweep.run_point(points[name], peers=True)
    finally:
        sweep.host_fwd_bwd_us, sweep._build = measured, build

def qkv_host() -> None:
    """Packed qkv (8 head groups of 4 query heads, one key and one value head, d 128, bf16) in
    sbhd and bshd: ``apply_qkv`` on the triton backend against TE's fused-QKV API, forward
    without grad and forward + backward through autograd, end to end on the host clock, the two
    in turn (``bench.host_us_interleaved``)."""
    from rope_dispatch import sweep

    for layout in ("sbhd", "bshd"):
        for seq, batch in ((128, 1), (512, 1), (2048, 1), (8192, 1), (4096, 4)):
            shape = bench.Shape(f"qkv {layout} s{seq} b{batch} g8 q4x128", layout, torch.bfloat16,
                                seq, batch, 8, 128, 128, qkv=(512, 128, 128))
            inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
            impls = {"triton": bench._ours("triton", "triton", inp, inp.freqs),
                     "te": bench._te_peer(shape, inp)}
            if impls["te"] is None:
                print("TransformerEngine's fused-QKV API is not importable: nothing to compare")
                return
            fwd_bwd = sweep.host_fwd_bwd_us(impls, shape.tensor_bytes() >= 64 << 20)
            fwd = bench.host_us_interleaved({n: i.fwd for n, i in impls.items()}, 40, 15)
            print(f"{shape.name} ({shape.tensor_bytes() / 2**20:.1f} MiB): fwd+bwd triton "
                  f"{fwd_bwd['triton']:.1f} te {fwd_bwd['te']:.1f} us (ratio "
                  f"{fwd_bwd['triton'] / fwd_bwd['te']:.3f}); forward without grad triton "
                  f"{fwd['triton'][1]:.1f} te {fwd['te'][1]:.1f} us", flush=True)


def _closure_value(fn, kind: type):
    """The value of type ``kind`` among ``fn``'s closure cells (a plan's bound launches)."""
    for cell in fn.__closure__ or ():
        if isinstance(cell.cell_contents, kind):
            return cell.cell_contents
    return None


def _timed_backward(function: type, spent: list[float]):
    """Wrap ``function.backward`` so each call adds its own host seconds (on the autograd
    engine's thread) to ``spent``; returns the original to put back."""
    original = function.backward

    def backward(ctx, *grads):
        start = time.perf_counter()
        result = original(ctx, *grads)
        spent.append(time.perf_counter() - start)
        return result

    function.backward = staticmethod(backward)
    return original


def qkv_pieces(seq: int = 512, layout: str = "sbhd") -> None:
    """Packed qkv's backward piece by piece, ours against TE's fused-QKV API on one machine:
    the backward through autograd (retain_graph), each Function's backward body on the main
    thread (ours: the plan's bound transposed launch; TE's: three ``contiguous`` and its C++
    call), their parts (the packed gradient's allocation, the launch alone), an engine floor (a
    Python Function of three outputs whose backward returns a kept tensor), and the host time
    each Function's backward spends on the engine's thread; and our forward's Function with six
    other backward bodies (a kept tensor, the allocation and launch without checks, TE's C++
    call, the allocation alone, the launch alone, a clone), which tell the body's share of the
    difference from the rest of the graph's (docs/benchmarks.md, run AQ). The bound launch's
    arguments are written out at each use, as the plan writes them: a helper's frame would be
    timed too."""
    from transformer_engine.pytorch.attention import rope

    from rope_dispatch import dispatch
    from rope_dispatch.backends import triton_rope

    shape = bench.Shape(f"qkv {layout} s{seq} b1 g8 q4x128", layout, torch.bfloat16, seq, 1, 8,
                        128, 128, qkv=(512, 128, 128))
    inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
    split, freqs, spec = inp.split, inp.freqs, inp.spec
    gq, gk, gv = inp.grad
    leaf = inp.t.detach().requires_grad_(True)
    for _ in range(3):  # planned at the second call, its transposed launch bound at a backward
        torch.autograd.grad(rd.apply_qkv(leaf, freqs, spec, split=split, backend="triton"),
                            leaf, inp.grad)
    runs = [p.run for key in plan_keys(spec, freqs, "triton")
            for p in dispatch._plans[key].plans if p.guard(leaf)]
    launches = next((v for v in (_closure_value(r, triton_rope._QKVLaunches) for r in runs)
                     if v is not None), None)
    if launches is None or launches.back is None or not launches.back_direct:
        print("no planned packed-qkv launch with a bound backward (and its direct call) was found")
        return
    ours_out = rd.apply_qkv(leaf, freqs, spec, split=split, backend="triton")
    fmt = rope.QKVFormat[layout]
    te_out = rope.apply_fused_qkv_rotary_pos_emb(leaf, freqs, freqs, list(split), tensor_format=layout)
    stream = triton_rope._current_stream(leaf.get_device())
    run, prefix, grid, rest = launches.back
    kept = leaf.new_empty(leaf.shape)
    gp = kept.data_ptr()
    oq, ok, ov = launches.offsets
    tp, sp, cp = launches.tables

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return gq.clone(), gk.clone(), gv.clone()

        @staticmethod
        def backward(ctx, a, b, c):
            return kept

    floor_out = Floor.apply(leaf)

    class KeptBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            return kept, None, None, None, None, None

    class BareBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            grad = a.new_empty(launches.shape)
            g = grad.data_ptr()
            run(*grid, stream, *prefix, a.data_ptr(), g + oq, b.data_ptr(), g + ok,
                c.data_ptr(), g + ov, tp, sp, tp, sp, cp, tp, *rest)
            return grad, None, None, None, None, None

    direct = launches.back_direct

    class DirectBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            return direct(stream, a, b, c, tp), None, None, None, None, None

    class TEBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            return (rope.tex.fused_qkv_rope_backward(a, b, c, freqs, freqs, list(split), fmt,
                                                     False, 1, 0), None, None, None, None, None)

    class AllocBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            return a.new_empty(launches.shape), None, None, None, None, None

    class LaunchBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            run(*grid, stream, *prefix, a.data_ptr(), gp + oq, b.data_ptr(), gp + ok,
                c.data_ptr(), gp + ov, tp, sp, tp, sp, cp, tp, *rest)
            return kept, None, None, None, None, None

    class CloneBody(triton_rope._PlannedQKVFunction):
        @staticmethod
        def backward(ctx, a, b, c):
            return kept.clone(), None, None, None, None, None

    variants = {name: triton_rope.c_apply(cls)(leaf, launches, freqs, None, None, stream)
                for name, cls in (("kept tensor", KeptBody), ("alloc + launch, no checks",
                                  BareBody), ("one direct call, no checks", DirectBody),
                                  ("TE's C++ call", TEBody), ("alloc only", AllocBody),
                                  ("launch only, kept tensor", LaunchBody),
                                  ("a clone of the kept tensor", CloneBody))}

    def ours_body():
        with torch.no_grad():
            return launches.backward(gq, gk, gv, freqs, None, None)

    def te_body():
        return rope.tex.fused_qkv_rope_backward(gq.contiguous(), gk.contiguous(), gv.contiguous(),
                                                freqs, freqs, list(split), fmt, False, 1, 0)

    pieces = {
        "ours bwd (autograd, retain_graph)": lambda: torch.autograd.grad(
            ours_out, leaf, inp.grad, retain_graph=True),
        "TE bwd (autograd, retain_graph)": lambda: torch.autograd.grad(
            te_out, leaf, inp.grad, retain_graph=True),
        "floor bwd (autograd, 3 outputs)": lambda: torch.autograd.grad(
            floor_out, leaf, inp.grad, retain_graph=True),
        **{f"ours, body: {name} (autograd)": lambda out=out: torch.autograd.grad(
            out, leaf, inp.grad, retain_graph=True) for name, out in variants.items()},
        "ours backward body (main thread)": ours_body,
        "TE backward body (main thread)": te_body,
        "TE C++ call alone": lambda: rope.tex.fused_qkv_rope_backward(
            gq, gk, gv, freqs, freqs, list(split), fmt, False, 1, 0),
        "ours: packed gradient allocation": lambda: gk.new_empty(launches.shape),
        "ours: the direct call (allocates)": lambda: direct(stream, gq, gk, gv, tp),
        "ours: launch alone (kept output)": lambda: run(
            *grid, stream, *prefix, gq.data_ptr(), gp + oq, gk.data_ptr(), gp + ok,
            gv.data_ptr(), gp + ov, tp, sp, tp, sp, cp, tp, *rest),
        "ours fwd (grad)": lambda: rd.apply_qkv(leaf, freqs, spec, split=split, backend="triton"),
        "TE fwd (grad)": lambda: rope.apply_fused_qkv_rotary_pos_emb(
            leaf, freqs, freqs, list(split), tensor_format=layout),
        "ours fwd+bwd": lambda: torch.autograd.grad(
            rd.apply_qkv(leaf, freqs, spec, split=split, backend="triton"), leaf, inp.grad),
        "TE fwd+bwd": lambda: torch.autograd.grad(rope.apply_fused_qkv_rotary_pos_emb(
            leaf, freqs, freqs, list(split), tensor_format=layout), leaf, inp.grad),
    }
    times = bench.host_us_interleaved(pieces, calls=100, rounds=21)
    print(f"=== {shape.name}: host / end-to-end us per call, in turn")
    for name, (host, total) in times.items():
        print(f"  {name:>36}: host {host:7.2f}  end to end {total:7.2f}")
    spent: dict[str, list[float]] = {"ours": [], "TE": []}
    originals = (_timed_backward(triton_rope._PlannedQKVFunction, spent["ours"]),
                 _timed_backward(rope.FusedQKVRoPEFunc, spent["TE"]))
    try:
        for _ in range(5):
            for name in ("ours bwd (autograd, retain_graph)", "TE bwd (autograd, retain_graph)"):
                for _ in range(200):
                    pieces[name]()
                torch.cuda.synchronize()
    finally:
        triton_rope._PlannedQKVFunction.backward = staticmethod(originals[0])
        rope.FusedQKVRoPEFunc.backward = staticmethod(originals[1])
    for name, values in spent.items():
        print(f"  {name} Function.backward on the engine's thread: median "
              f"{1e6 * statistics.median(values):.2f} us over {len(values)} calls")


def main():
    if sys.argv[1:2] == ["qkv"]:
        qkv_host()
        return
    if sys.argv[1:2] == ["qkv-pieces"]:  # qkv-pieces [tokens [layout]]
        qkv_pieces(*[int(a) if a.isdigit() else a for a in sys.argv[2:4]])
        return
    if sys.argv[1:2] == ["front"]:  # front [rounds]
        front(*(int(n) for n in sys.argv[2:3]))
        return
    if sys.argv[1:2] == ["cores"]:
        core_speeds()
        return
    if sys.argv[1:2] == ["gap"]:  # gap [processes [core,core,...]]
        if sys.argv[2:3]:
            cores = [int(c) for c in sys.argv[3].split(",")] if sys.argv[3:4] else None
            gap_processes(int(sys.argv[2]), cores)
        else:
            gap()
        return
    if sys.argv[1:2] == ["serving-gap"]:
        serving_gap()
        return
    if sys.argv[1:2] == ["serving-pieces"]:  # serving-pieces [cpu]
        serving_pieces(*sys.argv[2:3])
        return
    if sys.argv[1:2] == ["grad"]:  # grad [tokens [heads]]
        grad_pieces(*(int(n) for n in sys.argv[2:4]))
        return
    if sys.argv[1:2] == ["grad-noise"]:  # grad-noise [rounds [point name ...]]
        grad_noise(*(int(n) for n in sys.argv[2:3]), *([sys.argv[3:]] if sys.argv[3:] else []))
        return
    if sys.argv[1:2] == ["flag-paths"]:  # flag-paths [rounds]
        flag_paths(*(int(n) for n in sys.argv[2:3]), profiled="quiet" not in sys.argv)
        return
    if sys.argv[1:2] == ["flag-host"]:
        flag_host()
        return
    if sys.argv[1:2] == ["te"]:
        te_pieces()
        return
    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    q, k, pos, freqs, cache = d["q"], d["k"], d["positions"], d["freqs"], d["pair_cache"]
    q4, k4 = q.unsqueeze(0), k.unsqueeze(0)
    qc, kc = q4.contiguous(), k4.contiguous()
    x = torch.randn(1, 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    leaf = torch.randn(128, 1, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(leaf)
    calls = {
        "fwd+bwd autograd.grad s128 b1 h8": lambda: torch.autograd.grad(
            rd.apply(leaf, freqs, d["sbhd"]), leaf, grad),
        "apply decode plain (plan)": lambda: rd.apply(x, freqs, d["sbhd"]),
        "apply_qk_ positions (pair cache)": lambda: rd.apply_qk_(q, k, cache, d["thd"], positions=pos),
        "apply_qk_ start_positions": lambda: rd.apply_qk_(q4, k4, freqs, d["sbhd"], start_positions=pos),
        "apply_qk_ positions (angles)": lambda: rd.apply_qk_(q, k, freqs, d["thd"], positions=pos),
        "apply_qk_ plain": lambda: rd.apply_qk_(q4, k4, freqs, d["sbhd"]),
        "apply_qk_ plain contiguous": lambda: rd.apply_qk_(qc, kc, freqs, d["sbhd"]),
        "apply_ start_positions": lambda: rd.apply_(q4, freqs, d["sbhd"], start_positions=pos),
        "apply_ start_positions contiguous": lambda: rd.apply_(qc, freqs, d["sbhd"], start_positions=pos),
    }
    only = sys.argv[1:]
    for name, fn in calls.items():
        if not only or any(o in name for o in only):
            dispatch_plans_clear()
            profile(name, fn)


def dispatch_plans_clear():
    from rope_dispatch import dispatch

    dispatch.forget_plans()


if __name__ == "__main__":
    main()
