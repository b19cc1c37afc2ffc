"""``python -m rope_dispatch.selftest``: what this machine can run, and proof that it is right.

Prints versions, every backend's availability with reasons, the overrides in force, how
planned launches reach a GPU (one call into C, or Triton's launcher and why) and the autotune
cache, then checks every available backend against the float64 reference
(:mod:`rope_dispatch.reference`) over a quick grid of calls covering every feature, forward and
backward, with timings (``--thorough``: the whole grid). Where CUDA is checked, backends that
compile per spec (``torch.compile``) or import packages for seconds (TransformerEngine) are
probed and checked in processes of their own meanwhile (:class:`Worker`). Exit code 1 when any
check fails. ``--json`` prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass


def command_line() -> argparse.ArgumentParser:
    """The command line; it needs no torch, so ``__main__`` reads it before importing torch."""
    parser = argparse.ArgumentParser(
        prog="python -m rope_dispatch.selftest",
        description="What this machine can run, and proof that it is right: versions, every "
        "backend's availability with reasons, then every available backend checked against a "
        "float64 reference, forward and backward, with timings. Exit status: 0 when every "
        "check passed; 1 when a check failed, none could run, or ROPE_BACKEND, ROPE_AUTOTUNE, "
        "ROPE_AUTOTUNE_HOT_CALLS, ROPE_DISPATCH_CHECK_VALUES or ROPE_DISPATCH_LINEAR_TABLES "
        "holds a value the calls refuse; 2 for bad arguments (--device cuda where torch sees "
        "no GPU too).")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--cache-entries", action="store_true",
                        help="list every autotune cache entry (one line each, or in the JSON "
                        "document); by default only their number and the cache's path")
    parser.add_argument("--thorough", action="store_true",
                        help="every backend on every case of the grid (slower: torch.compile "
                        "compiles each)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "all"), default="auto",
                        help="devices to check (default auto: CUDA when present, else the CPU; "
                        "all: both)")
    parser.add_argument("--worker", metavar="NAMES", help=argparse.SUPPRESS)  # see Worker
    return parser


PRESTARTED = ("te", "compile")
"""The built-in backends :func:`checked_apart`, in the registry's order: ``python -m
rope_dispatch.selftest`` starts their :class:`Worker` processes before it imports torch
(:func:`prestart`). A test keeps this in step with the registry."""


def cuda_likely() -> bool:
    """Whether torch will probably see a GPU, judged without importing it: a GPU driver's device
    node (NVIDIA's, or ROCm's), and ``CUDA_VISIBLE_DEVICES`` not hiding every device. A wrong
    guess costs time only: :func:`run` kills workers it does not use, and starts those it
    needs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd"))


def start_worker(names: list[str], device: str, thorough: bool) -> subprocess.Popen:
    """The process of a :class:`Worker` checking ``names`` on ``device`` (a ``--device``
    value: the worker resolves ``auto`` as this process does)."""
    command = [sys.executable, "-m", "rope_dispatch.selftest", "--worker", ",".join(names),
               "--device", device]
    # the quick run's one case compiles in this process rather than through Inductor's pool
    # of one process a core, whose start cost more than it saved there (run AZ2); a
    # thorough run's many compiles keep the pool
    env = dict(os.environ)
    if not thorough:
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return subprocess.Popen(command + ["--thorough"] * thorough, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def prestart(args: argparse.Namespace) -> dict[str, subprocess.Popen]:
    """The workers of :data:`PRESTARTED` started now, by name, where CUDA is likely checked
    (:func:`run` isolates only there); else none. Started before this process imports torch,
    their imports and compiles (the selftest's critical path) no longer wait for its own,
    seconds on a fresh GPU machine (run BB, docs/tuning.md)."""
    if args.worker or args.device == "cpu" or not cuda_likely():
        return {}
    started = {name: start_worker([name], args.device, args.thorough) for name in PRESTARTED}
    atexit.register(kill_unreaped, started)
    return started


def kill_unreaped(processes: dict[str, subprocess.Popen]) -> None:
    """Kill those of ``processes`` still running. At the interpreter's exit it ends the
    :func:`prestart` workers of a selftest that ended before their reports (its own ``import
    torch`` failed, a bad argument, an exception), so that none outlives it; the usual end
    (``os._exit``) comes after every worker's report or kill."""
    for process in processes.values():
        if process.poll() is None:
            process.kill()


if __name__ == "__main__":
    PRESTARTED_WORKERS = prestart(command_line().parse_args())

with warnings.catch_warnings():
    # torch 2.13 warns at import where NumPy is absent (its functional tensor class converts a
    # tensor through NumPy); rope-dispatch uses no NumPy, and a fresh install's selftest, which
    # imports torch here, stays quiet
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: E402

import rope_dispatch as rd  # noqa: E402
from rope_dispatch import autotune, autotune_cache, registry  # noqa: E402
from rope_dispatch.env import switch_value, unknown_variables  # noqa: E402
from rope_dispatch.errors import RoPEError  # noqa: E402
from rope_dispatch.guards import guard_kind  # noqa: E402
from rope_dispatch.reference import max_error, reference_apply  # noqa: E402
from rope_dispatch.tables import cos_sin_cache  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class GridCase:
    """One call of the selftest grid."""

    label: str
    layout: str
    dtype: torch.dtype
    head_dim: int = 64
    rotary_dim: int = 64
    interleaved: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    starts: bool = False
    cache: bool = False
    strided: bool = False
    qkv: bool = False  # a packed [.., h, 2d + d + d] tensor (apply_qkv), k with its own table
    qk: bool = False  # q and a 2-head k sliced out of one projection (apply_qk)
    scale: float = 1.0  # the spec's cos_sin_scale (an attention factor)
    rates: bool = False  # a RateTable (rates and a row count) instead of an angle table
    precise: bool = False  # the RateTable's exact angles (precise=True)
    # an angle table as models make it (float32 products of positions and rates), on a GPU long
    # enough that the triton backend reads it as rates (docs/tables.md, "Linear angle tables")
    model_table: bool = False
    norm: bool = False  # QK-norm before the rotation (HeadNorm on q and k, or on t)
    inverse: bool = False  # the rotation by minus the angle (RoPESpec.inverse)


GRID = (
    GridCase("sbhd bf16", "sbhd", torch.bfloat16),
    GridCase("bshd fp16 partial interleaved", "bshd", torch.float16, rotary_dim=32, interleaved=True),
    GridCase("sbhd fp32 cp 2/rank 1", "sbhd", torch.float32, cp_size=2, cp_rank=1),
    GridCase("bshd bf16 start_positions", "bshd", torch.bfloat16, starts=True),
    GridCase("sbhd bf16 qkv-slice cos/sin cache", "sbhd", torch.bfloat16, cache=True, strided=True),
    GridCase("thd bf16 partial start_positions", "thd", torch.bfloat16, rotary_dim=32, starts=True),
    GridCase("thd fp32 cp 2/rank 0 interleaved", "thd", torch.float32, cp_size=2, interleaved=True),
    GridCase("bshd fp32 start_positions cp 2/rank 1", "bshd", torch.float32, cp_size=2, cp_rank=1,
             starts=True),
    GridCase("sbhd bf16 packed qkv GQA partial", "sbhd", torch.bfloat16, rotary_dim=32, qkv=True),
    GridCase("thd fp16 packed qkv cp 2/rank 1 start", "thd", torch.float16, cp_size=2, cp_rank=1,
             starts=True, qkv=True),
    GridCase("bshd bf16 q+k slices start_positions", "bshd", torch.bfloat16, starts=True,
             strided=True, qk=True),
    GridCase("thd fp16 interleaved cache start x1.2", "thd", torch.float16,
             interleaved=True, cache=True, starts=True, scale=1.2),
    GridCase("bshd bf16 rate table interleaved partial start", "bshd", torch.bfloat16,
             rotary_dim=32, interleaved=True, starts=True, rates=True),
    GridCase("sbhd bf16 a model's angle table", "sbhd", torch.bfloat16,
             model_table=True),
    GridCase("bshd bf16 q+k QK-norm partial start", "bshd", torch.bfloat16, rotary_dim=32,
             starts=True, strided=True, qk=True, norm=True),
    GridCase("thd fp32 norm over heads interleaved", "thd", torch.float32, interleaved=True,
             norm=True),
    GridCase("bshd bf16 inverse q+k slices partial start", "bshd", torch.bfloat16,
             rotary_dim=32, starts=True, strided=True, qk=True, inverse=True),
    GridCase("sbhd fp32 precise rate table start", "sbhd", torch.float32, starts=True, rates=True,
             precise=True),
)
QKV_SPLIT = (128, 64, 64)  # two query heads, one key head and one value head of d 64 a group

QUICK = (
    GridCase("sbhd bf16 start cp 2/rank 1 partial", "sbhd", torch.bfloat16,
             rotary_dim=32, cp_size=2, cp_rank=1, starts=True),
    GRID[11],  # thd, interleaved, a cos/sin cache, start positions, a cos/sin scale
    GRID[8],  # packed qkv
    GRID[10],  # q and k, slices of one projection
    GRID[13],  # a model's angle table (read as rates by triton on a GPU)
    GRID[14],  # QK-norm and RoPE in one call
)
"""The default run: every feature once (start positions with context parallelism, partial and
interleaved rotary, thd, the cos/sin cache and scale, strided views, packed qkv, q and k pairs,
a model's angle table, QK-norm).
A backend whose first call of a spec compiles (:attr:`~rope_dispatch.Backend.compiles_per_spec`)
runs the first case only; ``--thorough`` runs the whole grid on every backend."""


def cases_for(backend: str, thorough: bool) -> tuple[GridCase, ...]:
    """The grid cases ``backend`` is checked on."""
    if thorough:
        return GRID
    return QUICK[:1] if registry.get_backend(backend).compiles_per_spec else QUICK


Job = tuple[str, GridCase, str, int]
"""``(backend, case, device, seed)``; a case's seed is its place in the backend's cases, so
every backend sees the same inputs for a case."""


def jobs_for(names: list[str], devices: list[str], thorough: bool) -> list[Job]:
    """Every check of the backends ``names`` on ``devices``, device by device."""
    return [
        (name, case, device, seed)
        for device in devices
        for name in names
        for seed, case in enumerate(cases_for(name, thorough), 1)
    ]


def check_jobs(jobs: list[Job], finished: Callable[[str], None]) -> list[dict]:
    """:func:`check` of each job in turn, each reported to ``finished`` as one line."""
    checks = []
    for name, case, device, seed in jobs:
        begun = time.perf_counter()
        checks.append(check(name, case, device, seed))
        finished(f"{name} on {device}: {case.label} ({time.perf_counter() - begun:.1f} s)")
    return checks


def versions() -> dict[str, str]:
    """Versions of everything a result depends on (packages read without importing them)."""
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, CUDA {torch.version.cuda})"
    else:
        device = f"CPU only ({platform.machine()}, {os.cpu_count()} cores)"
    installed = autotune.installed_versions()
    packages = ("rope-dispatch", "torch", "triton", "transformer-engine")
    return {
        "python": platform.python_version(),
        **{name: installed[name] or "not installed" for name in packages},
        "device": device,
    }


def make_inputs(case: GridCase, device: str, gen: torch.Generator):
    """``(t, table, spec, start_positions, call_kwargs)`` for one grid case (table halves
    deliberately unequal; a qkv case's k has a table of its own)."""
    heads, batch, seq = (8, 2, 96) if device == "cuda" else (4, 2, 32)
    if case.model_table and device == "cuda":
        # 4,096 rows x rotary dim 64: triton's LINEAR_MIN_ROWS_READ (rows, not tokens: batch
        # entries share theirs); one head and one sequence keep the float64 reference quick
        heads, batch, seq = 1, 1, 4096
    cp = case.cp_size
    cu = None
    if case.layout == "thd":
        lengths = torch.tensor([seq, 6, 0, seq // 2]) * cp
        if cp > 1:
            lengths = (lengths // (2 * cp)) * 2 * cp
        cu = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).int()
        shape, batch, longest = (int(lengths.sum()) // cp, heads, case.head_dim), len(lengths), int(lengths.max())
    elif case.layout == "sbhd":
        shape, longest = (seq, batch, heads, case.head_dim), seq * cp
    else:
        shape, longest = (batch, seq, heads, case.head_dim), seq * cp
    starts = torch.randint(0, 9, (batch,), generator=gen) if case.starts else None
    s2 = longest + (0 if starts is None else int(starts.max())) + 3
    angles = (torch.rand(s2, 1, 1, case.rotary_dim, generator=gen) * 200 - 100).to(device)
    kwargs = {}
    if case.qkv:
        shape = (*shape[:-1], sum(QKV_SPLIT))
        k_angles = (torch.rand(angles.shape, generator=gen) * 200 - 100).to(device)
        kwargs = dict(split=QKV_SPLIT, k_freqs=cos_sin_cache(k_angles) if case.cache else k_angles)
    if case.strided:
        fused = torch.randn(*shape[:-2], 3 * shape[-2], shape[-1], generator=gen)
        t = fused[..., heads : 2 * heads, :]
        if case.qk:  # k: two heads of the same projection
            kwargs = dict(k=fused[..., 2 * heads : 2 * heads + 2, :].to(case.dtype).to(device))
    else:
        t = torch.randn(*shape, generator=gen)
    t = t.to(case.dtype).to(device)
    spec = rd.RoPESpec(
        layout=case.layout, dtype=case.dtype, rotary_dim=case.rotary_dim, interleaved=case.interleaved,
        cu_seqlens=None if cu is None else cu.to(device), cp_size=cp, cp_rank=case.cp_rank,
        cos_sin_scale=case.scale, inverse=case.inverse,
    )
    if case.rates:  # rates up to 2 radians per position
        table = rd.RateTable((torch.rand(case.rotary_dim // 2, generator=gen) * 2).to(device), s2,
                             precise=case.precise)
    elif case.model_table:
        rates = rd.tables.inverse_frequencies(case.rotary_dim, 10000.0)
        table = rd.tables.angle_table(rates, s2, interleaved=case.interleaved).to(device)
    else:
        table = cos_sin_cache(angles) if case.cache else angles
    if case.norm:  # q's norm (over the heads where there is no k) and k's, Gemma's offset
        heads_scope = "k" not in kwargs
        width = case.head_dim * (t.shape[-2] if heads_scope else 1)
        kwargs["norms"] = (
            rd.HeadNorm((torch.rand(width, generator=gen) + 0.5).to(device), 1e-5,
                        scope="heads" if heads_scope else "head"),
            rd.HeadNorm((torch.rand(case.head_dim, generator=gen) - 0.5).to(device), offset=1.0),
        )
    return t, table, spec, None if starts is None else starts.to(device), kwargs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check(backend: str, case: GridCase, device: str, seed: int) -> dict:
    """Forward and backward of one backend on one case against the reference, and a timing."""
    gen = torch.Generator().manual_seed(seed)
    t, table, spec, starts, kwargs = make_inputs(case, device, gen)
    result = {"backend": backend, "case": case.label, "device": device}
    x = t.detach().requires_grad_(True)
    k = kwargs.pop("k", None)
    norms = kwargs.pop("norms", (None, None))
    leaves = (x,) if k is None else (x, k.detach().requires_grad_(True))

    def outputs() -> tuple[torch.Tensor, ...]:
        if k is not None:
            return rd.apply_qk(*leaves, table, spec, start_positions=starts, backend=backend,
                               q_norm=norms[0], k_norm=norms[1])
        if case.qkv:
            return rd.apply_qkv(x, table, spec, start_positions=starts, backend=backend, **kwargs)
        return (rd.apply(x, table, spec, start_positions=starts, backend=backend,
                         norm=norms[0]),)

    try:
        outputs()  # checked below on a repeated call: what training and serving loops make
        outs = outputs()
    except rd.BackendNotSupportedError as exc:
        return result | {"status": "not supported", "detail": str(exc).split(": ", 1)[-1]}
    except Exception as exc:  # a backend that crashes is a failed check, not a crashed selftest
        return result | {"status": "FAIL", "detail": f"{type(exc).__name__}: {exc}"}
    grad_outs = [torch.randn(o.shape, generator=gen).to(t.dtype).to(device) for o in outs]
    grads = torch.autograd.grad(outs, leaves, grad_outs)
    # the float64 reference: one call per input tensor (a q and k pair is two calls)
    refs, ref_grads = [], []
    for leaf, norm in zip(leaves, norms):
        ref_x = leaf.detach().cpu().double().requires_grad_(True)
        ref = reference_apply(rd.check_call(leaf.detach(), table, spec, starts, q_norm=norm,
                                            **kwargs), ref_x)
        ref = ref if isinstance(ref, tuple) else (ref,)
        wanted = grad_outs[len(refs):len(refs) + len(ref)]
        ref_grads += torch.autograd.grad(ref, ref_x, [g.cpu().double() for g in wanted])
        refs += ref
    fwd_err = max(max_error(o, r) for o, r in zip(outs, refs))
    bwd_err = max(max_error(g, r) for g, r in zip(grads, ref_grads))
    tol = TOLERANCE[t.dtype]
    in_place = {}
    if rd.get_backend(backend).supports_in_place and not (case.qkv or case.qk):  # apply_ too
        y = t.detach().clone()
        with torch.no_grad():
            rd.apply_(y, table, spec, start_positions=starts, backend=backend, norm=norms[0])
        in_place = {"in_place_error": max_error(y, refs[0])}
    times = []
    for i in range(7):
        _sync(device)
        start = time.perf_counter()
        torch.autograd.grad(outputs(), leaves, grad_outs)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    shapes = [tuple(r.shape) for r in refs]
    ok = fwd_err <= tol and bwd_err <= tol and [tuple(o.shape) for o in outs] == shapes
    ok = ok and all(o.is_contiguous() for o in outs) and in_place.get("in_place_error", 0.0) <= tol
    return result | {
        "status": "ok" if ok else "FAIL",
        "forward_error": fwd_err,
        "backward_error": bwd_err,
        **in_place,
        "tolerance": tol,
        "fwd_bwd_ms": statistics.median(times) * 1e3,
    }


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included), from
    Linux's ``/proc``; ``None`` elsewhere. On a fresh machine the first import of torch, Triton
    and TransformerEngine from a cold disk can take longer than the checks themselves."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def direct_launch_state(devices: list[str], available: list[str]) -> str | None:
    """How the triton backend's planned launches reach a GPU: ``"one call into C"`` where the
    direct launcher (``backends/direct_launch.c``) is built and bound to the driver, else
    Triton's launcher with the reason; ``None`` where CUDA is not checked or triton is not
    available. After the checks, whose repeated calls have built it already."""
    if "cuda" not in devices or "triton" not in available:
        return None
    from rope_dispatch.backends import direct_launch

    if direct_launch.module() is not None:
        return "one call into C"
    return f"Triton's launcher ({direct_launch.unavailable_reason()})"


def _cache_report(entries: bool = False) -> dict:
    """Whether autotune is on, the cache's path and how many entries it holds (files named as
    entries, not read); with ``entries`` every valid entry too (``cache_entries``)."""
    try:
        report = {"autotune": autotune.autotune_enabled()}
    except RoPEError as exc:  # a value neither on nor off: every call that measures raises
        report = {"autotune": False, "autotune_problem": str(exc)}
    try:  # not a positive integer: every call of a key still pending raises
        if report["autotune"]:
            autotune.hot_calls()
    except RoPEError as exc:
        report["autotune_problem"] = str(exc)
    try:
        root = autotune.cache_dir()
        report["cache_dir"] = str(root)
        report["cache_entry_count"] = sum(
            1 for folder in autotune_cache._environment_dirs(root)
            for path in autotune_cache._listing(folder)
            if autotune_cache._ENTRY_NAME.match(path.name)
        )
        if entries:
            report["cache_entries"] = autotune.cache_entries()
            ignored = report["cache_entry_count"] - len(report["cache_entries"])
            if ignored:  # files named as entries that are not (each warned about)
                report["cache_entries_ignored"] = ignored
    except Exception as exc:
        report["cache_dir"] = report.get("cache_dir", f"unreadable: {exc}")
        report["cache_entry_count"] = f"unreadable: {exc}"
    return report


WORKER_LINE = "checked: "
"""How a worker's progress lines start on its stderr (its other lines are passed on as they are)."""
PROBED_LINE = "probed: "
"""How a worker says on its stderr, before its checks, whether its backends are available."""


class Worker:
    """``python -m rope_dispatch.selftest --worker NAMES``: the backends ``names`` probed and
    checked in a process of their own, started before this one probes the others, or, under
    ``python -m``, before this one imports torch (:func:`prestart`: ``process``).

    Backends that compile per spec or whose probe imports packages for seconds
    (:attr:`~rope_dispatch.Backend.heavy_import`: TransformerEngine and Dynamo, seconds on a
    GPU machine's host) then load and compile while this process checks the others (Triton's
    compiles, about 10 s there), and a compiler or import that crashes fails its own check
    rather than the selftest (runs Z and AZ, docs/tuning.md). Its progress lines go to
    ``finished``, each backend's availability to ``probed`` as ``(name, available)``, its other
    stderr lines to ``passed_on``; its report comes back as one JSON document on its stdout.
    """

    def __init__(self, names: list[str], devices: list[str], thorough: bool,
                 finished: Callable[[str], None], passed_on: Callable[[str], None],
                 probed: Callable[[str, bool], None] = lambda name, available: None,
                 process: subprocess.Popen | None = None) -> None:
        self.names, self.devices = names, devices
        self.prestarted = process is not None  # by :func:`prestart`, for the same devices
        self.proc = process or start_worker(names, "all" if len(devices) > 1 else devices[0],
                                            thorough)
        self.tail: collections.deque[str] = collections.deque(maxlen=3)
        self.relay = threading.Thread(target=self._relay, args=(finished, passed_on, probed),
                                      daemon=True)
        self.relay.start()

    def _relay(self, finished: Callable[[str], None], passed_on: Callable[[str], None],
               probed: Callable[[str, bool], None]) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            if line.startswith(WORKER_LINE):
                finished(line[len(WORKER_LINE):])
            elif line.startswith(PROBED_LINE):
                name, state = line[len(PROBED_LINE):].rsplit(" ", 1)
                probed(name, state == "available")
            else:
                self.tail.append(line)
                passed_on(line)

    def report(self) -> dict:
        """The worker's report once it is done: ``backends`` (as :func:`run` reports them),
        ``checks``, ``startup_s`` and ``checks_s``. Where it gave none (it crashed, or was
        killed), each of its backends is reported unavailable with the worker's last words, and
        failed on each device."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        code = self.proc.wait()
        self.relay.join()
        try:
            report = json.loads(out)
            return {key: report[key] for key in ("backends", "checks", "startup_s", "checks_s")}
        except (ValueError, KeyError, TypeError):
            said = " | ".join(line.strip() for line in self.tail if line.strip()) or "nothing"
            detail = (f"its check process exited with code {code} without a report; its last "
                      f"words: {said}")
            known = {b.name: b for b in registry.backends()}
            backends = [{"name": name, "available": False, "reasons": [detail],
                         "priority": getattr(known.get(name), "priority", 0),
                         "description": getattr(known.get(name), "description", "")}
                        for name in self.names]
            checks = [{"backend": name, "case": "(every case)", "device": device, "status": "FAIL",
                       "detail": detail} for device in self.devices for name in self.names]
            return {"backends": backends, "checks": checks, "startup_s": None, "checks_s": None}


def checked_apart(backend: rd.Backend) -> bool:
    """Whether the selftest, where it isolates, probes and checks ``backend`` in a
    :class:`Worker` of its own: it compiles per spec or imports packages for seconds, and is
    built in. A worker is a new interpreter, which registers only the built-in backends: one
    registered by the program running the selftest is checked in that program's process."""
    built_in = type(backend).__module__.startswith("rope_dispatch.backends.")
    return built_in and (backend.compiles_per_spec or backend.heavy_import)


def run(devices: list[str], progress: Callable[[str], None], thorough: bool = False,
        isolate: bool | None = None, started: dict[str, subprocess.Popen] | None = None,
        cache_entries: bool = False) -> dict:
    """Every available backend on its cases (:func:`cases_for`) and every device; the whole
    report as a dict. With ``isolate``, each backend :func:`checked_apart` is probed and checked
    by a :class:`Worker` of its own meanwhile, so this process never imports its packages; by
    default where CUDA is checked, whose other checks compile Triton kernels for seconds too.
    On the CPU the others take under a second: there a second interpreter's start would only
    add to the time (2.5 s on a 2-core machine). A worker's process in ``started``
    (:func:`prestart`, for these devices) serves its backend; those not needed are killed."""
    lock = threading.Lock()
    done, total = 0, 0

    def finished(line: str) -> None:
        nonlocal done
        with lock:
            done += 1
            progress(f"[{done}/{total or '?'}] {line}")

    def passed_on(line: str) -> None:
        with lock:
            progress(line)

    def probed(name: str, available: bool) -> None:
        nonlocal total
        if not available:  # counted as available until its worker said otherwise
            with lock:
                total -= len(jobs_for([name], devices, thorough))

    if isolate is None:
        isolate = "cuda" in devices
    known = registry.backends()
    registered = [b.name for b in known]
    isolated = [b.name for b in known if checked_apart(b)] if isolate else []
    unclaimed = dict(started or {})  # the prestarted processes no worker has taken yet
    workers = [Worker([name], devices, thorough, finished, passed_on, probed,
                      unclaimed.pop(name, None)) for name in isolated]
    for process in unclaimed.values():
        process.kill()
        process.wait()
    infos = {info.name: asdict(info) for info in rd.list_backends(
        [name for name in registered if name not in isolated])}
    own = jobs_for([name for name, info in infos.items() if info["available"]], devices, thorough)
    with lock:
        total += len(own) + len(jobs_for(isolated, devices, thorough))
    startup = process_age_s()
    checks_began = time.perf_counter()
    checks = check_jobs(own, finished)
    processes = []
    for worker in workers:
        report = worker.report()
        infos.update((info["name"], info) for info in report["backends"])
        checks += report["checks"]
        processes.append({"backends": worker.names, "prestarted": worker.prestarted,
                          "startup_s": report["startup_s"], "checks_s": report["checks_s"]})
    backends = [infos[name] for name in registered if name in infos]
    available = [info["name"] for info in backends if info["available"]]
    override = os.environ.get("ROPE_BACKEND") or None
    override_problem = None
    if override is not None and override not in infos:
        override_problem = (f"unknown backend (known: {', '.join(registered)}): every call "
                            "without backend= raises UnknownBackendError")
    elif override is not None and override not in available:
        override_problem = ("unavailable here: every call without backend= raises "
                            "BackendNotSupportedError")
    order = {name: i for i, name in enumerate(available)}
    cache = _cache_report(cache_entries)
    switches = []  # on/off variables neither on nor off: the calls that read them raise
    for name, default in (("ROPE_DISPATCH_CHECK_VALUES", False),
                          ("ROPE_DISPATCH_LINEAR_TABLES", True)):
        try:
            switch_value(name, os.environ.get(name), default)
        except RoPEError as exc:
            switches.append(str(exc))
    checks.sort(key=lambda c: (devices.index(c["device"]), order.get(c["backend"], len(order))))
    return {
        "versions": versions(),
        "backends": backends,
        "override": override,
        "override_problem": override_problem,
        "switch_problems": switches,
        "unknown_variables": unknown_variables(),  # noted, not failed: ROPE_ may be another's
        "plan_guards": guard_kind(),
        "planned_launches": direct_launch_state(devices, available),
        "cache": cache,
        "checks": checks,
        "startup_s": startup,
        "checks_s": time.perf_counter() - checks_began,
        "workers": processes,
        "ok": all(c["status"] != "FAIL" for c in checks) and bool(checks)
        and override_problem is None and "autotune_problem" not in cache and not switches,
    }


def run_worker(names: list[str], devices: list[str], thorough: bool) -> None:
    """A :class:`Worker`'s side: ``names`` probed (each said on stderr), the checks of those
    available here (each reported on stderr as it ends), then its report on stdout."""
    for name in names:
        registry.get_backend(name)  # an unknown name ends the worker with its error
    infos = rd.list_backends(names)
    for info in infos:
        state = "available" if info.available else "unavailable"
        print(f"{PROBED_LINE}{info.name} {state}", file=sys.stderr, flush=True)

    def finished(line: str) -> None:
        print(WORKER_LINE + line, file=sys.stderr, flush=True)

    startup = process_age_s()
    checks_began = time.perf_counter()
    checks = check_jobs(jobs_for([i.name for i in infos if i.available], devices, thorough),
                        finished)
    report = {"backends": [asdict(info) for info in infos], "checks": checks,
              "startup_s": startup, "checks_s": time.perf_counter() - checks_began}
    print(json.dumps(report, default=str), flush=True)


def _entry_line(entry: dict) -> str:
    """One autotune cache entry as a line: the call it covers (every key field that differs
    from a plain call's, so two lines differ where their keys do), the choice and the timings."""
    fields = entry.get("fields", {})
    spec = fields.get("spec", {})

    def bucket(name: str) -> str:
        return "x".join(str(n) for n in fields.get(name, []))

    parts = [f"{spec.get('layout')} {spec.get('dtype')} <= {bucket('shape_bucket')}"]
    if "k_shape_bucket" in fields:
        parts.append(f"k <= {bucket('k_shape_bucket')}")
    if "qkv_split" in fields:
        parts.append("qkv " + "+".join(str(n) for n in fields["qkv_split"]))
    parts.append(str(fields.get("stride", "")))
    parts.append(f"rotary {spec.get('rotary_dim')}")
    if spec.get("rotary_offset"):
        parts.append(f"from channel {spec['rotary_offset']}")
    if fields.get("table", "angles") != "angles":
        parts.append(str(fields["table"]))
    parts += [name for name, on in (
        ("interleaved", spec.get("interleaved")), ("deinterleave", spec.get("deinterleave")),
        ("start positions", fields.get("start_positions")),
        ("positions", fields.get("positions")), ("in place", fields.get("in_place")),
        ("grad", fields.get("requires_grad")), ("inverse", spec.get("inverse")),
    ) if on]
    if spec.get("cp_size", 1) != 1:
        parts.append(f"cp {spec.get('cp_rank')}/{spec.get('cp_size')}")
    if spec.get("cos_sin_scale", 1.0) != 1.0:
        parts.append(f"scale {spec.get('cos_sin_scale')}")
    if spec.get("mrope_section"):
        parts.append(f"mrope {spec.get('mrope_section')}"
                     + (" interleaved" if spec.get("mrope_interleaved") else ""))
    if fields.get("norms"):  # q's and k's norm scopes ("-": none)
        parts.append("norms " + "/".join(str(n or "-") for n in fields["norms"]))
    if fields.get("cache"):  # kind, cache dtype, q's output dtype (, v's head dim)
        kind, cache_dtype, q_dtype, *v_dim = fields["cache"]
        parts.append(f"to {kind} cache {cache_dtype}, q out {q_dtype}"
                     + "".join(f", v dim {n}" for n in v_dim))
    if spec.get("layout") == "thd":
        parts.append(f"<= {fields.get('sequences_bucket')} sequences")
        if spec.get("max_seqlen") is not None:
            parts.append(f"max_seqlen {spec['max_seqlen']}")
    times = ", ".join(f"{name} {us:.0f} us" for name, us in sorted(entry.get("times_us", {}).items()))
    return f"{' '.join(parts)}: {entry.get('choice')} ({times})"


def _print_report(report: dict) -> None:
    print("rope-dispatch selftest")
    for key, value in report["versions"].items():
        print(f"  {key:20s} {value}")
    print("\nbackends (highest priority first)")
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        print(f"  {b['name']:10s} {state}")
    print(f"\noverride: ROPE_BACKEND={report['override'] or '(unset)'}"
          + (f" (FAIL: {report['override_problem']})" if report.get("override_problem") else ""))
    for problem in report.get("switch_problems", []):
        print(f"FAIL: {problem}")
    for line in report.get("unknown_variables", []):
        print(f"NOTE: {line}; ignored")
    print("repeated calls: plans checked by " + (
        "torch's C++ tensor guards" if report["plan_guards"] == "torch"
        else "Python metadata comparisons (this torch release's C++ guards are not verified; "
             "slower host path at decode size)"
    ))
    if report["planned_launches"] is not None:
        print(f"planned launches on the GPU (allocation and launch): {report['planned_launches']}")
    cache = report["cache"]
    off = f"off (ROPE_AUTOTUNE={os.environ.get('ROPE_AUTOTUNE', '')})"
    if "autotune_problem" in cache:
        off = f"FAIL ({cache['autotune_problem']})"
    print(f"autotune: {'on' if cache['autotune'] and 'autotune_problem' not in cache else off}",
          end="")
    if "cache_dir" in cache:
        count = cache.get("cache_entry_count")
        print(f", cache {cache['cache_dir']} ({count} entries"
              + (f", {cache['cache_entries_ignored']} of them invalid and ignored: the warnings "
                 "above name them)" if cache.get("cache_entries_ignored")
                 else ")" if "cache_entries" in cache or not count
                 else "; --cache-entries lists them)"))
        for entry in cache.get("cache_entries", []):
            print(f"  {_entry_line(entry)}")
    else:
        print()
    print(
        f"\n{'backend':10s} {'device':6s} {'case':40s} {'status':14s} {'fwd err':>9s} "
        f"{'bwd err':>9s} {'apply_ err':>10s} {'fwd+bwd':>10s}"
    )
    for c in report["checks"]:
        if "forward_error" in c:
            in_place = f"{c['in_place_error']:10.2e}" if "in_place_error" in c else f"{'-':>10s}"
            print(
                f"{c['backend']:10s} {c['device']:6s} {c['case']:40s} {c['status']:14s} "
                f"{c['forward_error']:9.2e} {c['backward_error']:9.2e} {in_place} "
                f"{c['fwd_bwd_ms']:8.3f}ms"
            )
        else:
            print(f"{c['backend']:10s} {c['device']:6s} {c['case']:40s} {c['status']:14s} {c['detail']}")
    failed = sum(c["status"] == "FAIL" for c in report["checks"])
    for device, why in report.get("not_checked", {}).items():
        print(f"\n{device}: not checked ({why})")
    startup = report["startup_s"]
    began = "" if startup is None else (
        f" (begun {startup:.1f} s after the process started: interpreter, imports, backend probes)"
    )
    passed = sum(c["status"] == "ok" for c in report["checks"])
    refused = len(report["checks"]) - passed - failed  # "not supported": checked nothing
    refused_text = f", {refused} not supported" if refused else ""
    print(f"\n{'PASS' if report['ok'] else 'FAIL'}: {passed} checks passed, {failed} failed"
          f"{refused_text} in {report['checks_s']:.1f} s{began}")
    for worker in report["workers"]:
        if worker["checks_s"] is not None and any(c["backend"] in worker["backends"]
                                                  for c in report["checks"]):
            began = "" if worker["startup_s"] is None else (
                f", begun {worker['startup_s']:.1f} s after it started")
            early = " (started before this process imported torch)" if worker["prestarted"] else ""
            print(f"  {', '.join(worker['backends'])} in a process of its own{early}: checks "
                  f"{worker['checks_s']:.1f} s{began}")


def main(argv: list[str] | None = None, started: dict[str, subprocess.Popen] | None = None) -> int:
    """The selftest's command line (:func:`command_line`); ``started``: workers :func:`prestart`
    started for the same arguments."""
    parser = command_line()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    if args.worker:
        run_worker(args.worker.split(","), devices, args.thorough)
        return 0

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = run(devices, progress, args.thorough, started=started,
                 cache_entries=args.cache_entries)
    if args.device == "all" and "cuda" not in devices:
        report["not_checked"] = {"cuda": "no CUDA device is visible to torch"}
    try:
        if args.json:
            print(json.dumps(report, indent=2, default=str))
        else:
            _print_report(report)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`| head`): the exit status still says it all
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())  # what is left unwritten goes nowhere at exit
        os.close(null)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    code = main(started=PRESTARTED_WORKERS)
    # the report is out (a worker's too): the interpreter's teardown (CUDA, Triton, Inductor's
    # compile processes) would only keep the caller waiting, about 1 s (run AZ)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
