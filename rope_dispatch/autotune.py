"""Choosing among several capable backends by measuring them once per machine.

When two or more backends can serve a call, :func:`select` times each of them on a private copy
of the call's tensor (forward, plus backward when ``t`` requires grad), keeps the fastest and
remembers it in memory and on disk. Later calls with the same key, in this process or any later
one on the same machine and software, read the choice instead of measuring.

The key (see :func:`key_fields`) is the spec's static fields, power-of-two shape buckets, the
stride class, the table kind, whether ``start_positions`` is given, whether the call needs a
backward, the sorted candidate names, and the environment: device name and capability, versions
of rope-dispatch, torch, triton and TransformerEngine, a sha256 of the backends' source files and
a schema version. It is hashed with sha256 over sorted JSON (Python's ``hash()`` differs between
processes).

Storage: one JSON file per key in ``<cache_dir()>/<device>-<environment hash>/``. Each file is
written to a temporary file in the same directory and moved into place with ``os.replace``, so
readers see a whole file or none, and processes tuning different keys never touch each other's
files: no lock is needed and no entry is lost. A corrupt, truncated or foreign file is ignored
with one warning and rewritten; an unwritable directory leaves the choices in memory.

A first call pays for no compilation: candidates that compile for seconds
(:attr:`~rope_dispatch.Backend.compiles_per_spec`, the ``compile`` backend) are left out of a
key's first measurement, which is bounded (:data:`MEASURE_BUDGET_SECONDS` of timed rounds).
They are measured once the key proves hot (its :func:`hot_calls`-th call in a process), by
:func:`tune` (``rope_dispatch.tune``), or never where only they can serve a call (then the
priority order decides, as it must run them anyway). Until then the decision is *pending*:
dispatch does not keep it, so the calls are counted.

Nothing is measured while ``torch.compile`` traces, while a CUDA graph is captured, or on a
tensor subclass (fake tensors): such calls use a cached choice or the priority order, and a
priority-order decision there is provisional so that a later real call measures.
``ROPE_AUTOTUNE=0`` turns measuring off: the priority order decides and the cache is not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import registry
from .call import CallKey, RoPECall, call_key, reads_values
from .registry import Backend
from .tracing import constant_while_tracing

SCHEMA_VERSION = 2
"""Bumped whenever the key or the entry format changes; old entries then stop matching (it is
part of the environment, so they live in another directory and are never read). 2: entries
may be pending (``deferred``: candidates not measured yet)."""

_log = logging.getLogger(__name__)

# Timed rounds, each timing every candidate in turn; a candidate's fastest round counts. Host
# noise only ever adds time, and in a fresh process the first rounds run on a cold host: with
# five 2 ms rounds and their median, forward+backward at sbhd s2048 h8 measured triton 154 us
# and TE 141 us, and TE was chosen, where 21 rounds of 100 calls in the same process gave 98
# and 101 us (H200).
_ROUNDS = 9
_ROUND_SECONDS = 4e-3  # a round repeats the call until it lasts about this long
_MAX_CALLS_PER_ROUND = 200
# A candidate must beat the first in priority order by more than this share to be chosen: at
# host-bound sizes one measurement of forward+backward swings by 10-30% between fresh processes
# (H200, sbhd s128 h8: triton 82-153 us, TE 94-158 us), and a tie must not hand a call to
# whichever backend the noise favoured.
_TIE_MARGIN = 0.05
_TURNS_BYTES = 64 << 20  # candidates of smaller calls are timed in turn (_time_backends)
_SLOW_CALL_SECONDS = 0.05  # calls slower than this get 3 rounds of one call
MEASURE_BUDGET_SECONDS = 0.5
"""Timed rounds stop once they have taken this long together (after the first round), so one
key's measurement stays well under a second however slow its calls: each candidate's
untimed first calls, its estimate and one round are all it is sure to get."""
HOT_CALLS = 100
"""The call of a key, in one process, at which candidates that compile for seconds are
measured (``ROPE_AUTOTUNE_HOT_CALLS`` overrides it): a key called this often is in a loop, where
seconds of compilation once per machine can pay; a script's few calls never pay them."""

_PROVISIONAL = "provisional"
_OFF = "autotune off (ROPE_AUTOTUNE=0)"
_NOT_MEASURED = "would measure on first call"
_PENDING = "pending"
_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_ENVIRONMENT_FILE = "environment.json"
_ENVIRONMENT_DIR = re.compile(r"^[a-z0-9_]+-.+-[0-9a-f]{16}$")  # <device type>-<name>-<env hash>

_lock = threading.RLock()
_memory: dict[str, tuple[str, str]] = {}  # key digest -> (backend name, why)
_warned: set[str] = set()  # files and directories already warned about
_unwritable: set[str] = set()  # directories where writing failed: memory only from then on
_failed_backends: set[str] = set()  # backends already warned about for raising while measured
_pending: dict[str, int] = {}  # digest of a key whose deferred candidates are unmeasured -> calls


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Where one call's measurement lives: the key digest and the file that holds it."""

    digest: str
    path: Path
    fields: dict[str, Any]


def autotune_enabled() -> bool:
    """False when ``ROPE_AUTOTUNE`` is ``0`` (or ``false``/``off``/``no``)."""
    return os.environ.get("ROPE_AUTOTUNE", "1").strip().lower() not in {"0", "false", "off", "no"}


def hot_calls() -> int:
    """The call of a key at which its deferred candidates are measured: ``ROPE_AUTOTUNE_HOT_CALLS``
    (a positive integer), else :data:`HOT_CALLS`."""
    raw = os.environ.get("ROPE_AUTOTUNE_HOT_CALLS", "").strip()
    if not raw:
        return HOT_CALLS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        from .errors import RoPEError

        raise RoPEError(
            f"ROPE_AUTOTUNE_HOT_CALLS must be a positive integer (the call of a key at which "
            f"backends that compile are measured); got {raw!r}"
        )
    return value


def deferred(candidates: list[Backend]) -> list[str]:
    """The names of ``candidates`` that compile for seconds at their first call of a spec
    (:attr:`~rope_dispatch.Backend.compiles_per_spec`): a first call leaves them out."""
    return [b.name for b in candidates if b.compiles_per_spec]


def cache_dir() -> Path:
    """The cache root: ``ROPE_DISPATCH_CACHE_DIR``, else the user cache directory."""
    env = os.environ.get("ROPE_DISPATCH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rope-dispatch"))


# ---------------------------------------------------------------------------------------------
# The key


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def dist_version(*names: str) -> str | None:
    """The version of the first installed distribution among ``names``, else ``None``."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def installed_versions() -> dict[str, str | None]:
    """Versions a result depends on, from package metadata (``None``: not installed).
    TransformerEngine is not imported; its distributions go by several names."""
    return {
        "rope-dispatch": dist_version("rope-dispatch"),
        "torch": torch.__version__,
        "triton": dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "transformer-engine": dist_version(
            "transformer-engine", "transformer_engine", "transformer-engine-cu12",
            "transformer-engine-cu13",
        ),
        "transformer-engine-torch": dist_version("transformer-engine-torch", "transformer_engine_torch"),
    }


@functools.lru_cache(maxsize=1)
def _kernel_sources_sha() -> str:
    """sha256 over the backends' source files of the installed package (name and bytes)."""
    from . import backends

    digest = hashlib.sha256()
    for folder in backends.__path__:
        for path in sorted(Path(folder).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_id(device: torch.device) -> tuple[str, int | None, int]:
    """What identifies a device's environment: type, index, and the CPU thread count."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "cuda", index, 0
    if device.type == "cpu":
        # CPU timings depend on the thread count, so it is part of the device.
        return "cpu", None, torch.get_num_threads()
    return device.type, device.index, 0


def _device_fields(kind: str, index: int | None, threads: int) -> dict[str, Any]:
    if kind == "cuda":
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "runtime": torch.version.hip or torch.version.cuda,
        }
    if kind == "cpu":
        return {"type": "cpu", "name": _cpu_name(), "machine": platform.machine(), "threads": threads}
    return {"type": kind, "name": kind if index is None else f"{kind}:{index}"}


@functools.lru_cache(maxsize=64)
def _environment_for(kind: str, index: int | None, threads: int) -> tuple[dict[str, Any], str, str]:
    """The environment of a device, its sha256 and its directory name (computed once)."""
    env = {
        "schema": SCHEMA_VERSION,
        "device": _device_fields(kind, index, threads),
        "versions": installed_versions(),
        "kernel_sources_sha256": _kernel_sources_sha(),
    }
    digest = _sha256_json(env)
    dev = env["device"]
    label = dev["name"]
    if "capability" in dev:
        label += "-sm" + "".join(str(c) for c in dev["capability"])
    return env, digest, f"{kind}-{_slug(label)}-{digest[:16]}"


def _environment(device: torch.device) -> dict[str, Any]:
    """Everything outside the call that a measurement depends on."""
    return _environment_for(*_device_id(device))[0]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-")[:60] or "device"


def environment_dir(device: torch.device | str) -> Path:
    """The cache subdirectory for ``device`` and the installed versions."""
    return cache_dir() / _environment_for(*_device_id(torch.device(device)))[2]


def call_signature(call: RoPECall, candidates: list[Backend]) -> tuple[CallKey, tuple[str, ...]]:
    """The call-dependent part of the key: the call's :class:`~rope_dispatch.call.CallKey`
    (dispatch's key too) and the candidates' names (traceable by Dynamo)."""
    return call_key(call), tuple(sorted(b.name for b in candidates))


def key_fields(signature: tuple[CallKey, tuple[str, ...]]) -> dict[str, Any]:
    """:func:`call_signature` as the named JSON fields stored in each entry."""
    key, names = signature
    return {**key.fields(), "candidates": list(names)}


def cache_key(device: torch.device, signature: tuple) -> CacheKey:
    """The sha256 key of a call signature on ``device`` and the file storing its measurement."""
    fields = key_fields(signature)
    _, environment, folder = _environment_for(*_device_id(device))
    digest = _sha256_json({"environment": environment, "call": fields})
    return CacheKey(digest, cache_dir() / folder / f"{digest}.json", fields)


def _call_key(call: RoPECall, candidates: list[Backend]) -> CacheKey:
    return cache_key(call.t.device, call_signature(call, candidates))


def _needs_grad(call: RoPECall) -> bool:
    return bool(call.t.requires_grad and torch.is_grad_enabled())


# ---------------------------------------------------------------------------------------------
# Files


def _warn_once(what: str, message: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"rope-dispatch autotune: {message}", RuntimeWarning, stacklevel=3)


_MAX_TIME_US = 1e15
"""Above any real time of one call, in microseconds (and no NaN is below it): a stored time
past it marks a corrupt entry."""


def _entry_problem(entry: Any, digest: str | None) -> str | None:
    """Why ``entry`` is not a valid cache entry (``None`` when it is)."""
    if not isinstance(entry, dict):
        return f"it holds a {type(entry).__name__}, not an entry object"
    if entry.get("schema") != SCHEMA_VERSION:
        return f"schema {entry.get('schema')!r} is not {SCHEMA_VERSION}"
    if digest is not None and entry.get("key") != digest:
        return "its key does not match its file name"
    times = entry.get("times_us")
    choice = entry.get("choice")
    if not isinstance(times, dict) or not all(
        type(v) in (int, float) and 0 <= v < _MAX_TIME_US for v in times.values()
    ):
        return "its times_us is not a mapping of backend names to times"
    if not isinstance(choice, str) or choice not in times:
        return f"its choice {choice!r} has no measured time"
    failed = entry.get("failed")
    if failed is not None and not (
        isinstance(failed, dict) and all(type(v) is str for v in failed.values())
    ):
        return "its failed is not a mapping of backend names to errors"
    pending = entry.get("deferred")
    if pending is not None and not (
        isinstance(pending, list) and all(type(v) is str for v in pending)
    ):
        return "its deferred is not a list of backend names"
    fields = entry.get("fields")
    if not isinstance(fields, dict) or not (
        isinstance(fields.get("spec"), dict) and isinstance(fields.get("shape_bucket"), list)
        and isinstance(fields.get("candidates"), list)
    ):
        return "it has no key fields"
    return None


def _read_json(path: Path) -> Any:
    """Parsed JSON of ``path``, ``None`` when it does not exist; raises ValueError when unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no entry, or no cache directory yet
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"it cannot be read ({exc})") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # nesting past the parser's depth: RecursionError
        raise ValueError(f"it is not valid JSON ({exc}); truncated or corrupt") from exc


def _read_entry(key: CacheKey) -> dict[str, Any] | None:
    """The valid entry stored for ``key``; a bad file warns once and reads as missing."""
    try:
        entry = _read_json(key.path)
    except ValueError as exc:
        _warn_once(str(key.path), f"ignoring cache file {key.path}: {exc}; it will be rewritten")
        return None
    if entry is None:
        return None
    problem = _entry_problem(entry, key.digest)
    if problem is None and entry["fields"].get("candidates") != key.fields["candidates"]:
        problem = "its candidates differ from this call's"
    if problem is not None:
        _warn_once(
            str(key.path), f"ignoring cache file {key.path}: {problem}; it will be rewritten"
        )
        return None
    return entry


def _write_json_atomic(path: Path, value: Any, attempts: int = 2) -> bool:
    """Write ``value`` to ``path`` through a temporary file and ``os.replace``; False on failure
    (one warning per directory, after which that directory is left alone). A temporary or
    folder removed under the write (another process's :func:`clear_cache`) is written again,
    up to ``attempts`` times in all."""
    folder = path.parent
    if str(folder) in _unwritable:
        return False
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, FileNotFoundError) and attempts > 1:
            return _write_json_atomic(path, value, attempts - 1)
        _unwritable.add(str(folder))
        _warn_once(
            str(folder),
            f"cannot write the cache in {folder} ({exc}); choices stay in memory for this process",
        )
        return False


def _found(test: Callable[[], bool]) -> bool:
    """A path test (``path.exists``, ``path.is_dir``), False where a directory on the way
    cannot be searched (another user's cache): a write that follows then fails and warns once."""
    try:
        return test()
    except OSError:
        return False


def _store(key: CacheKey, entry: dict[str, Any], device: torch.device) -> None:
    env_file = key.path.parent / _ENVIRONMENT_FILE
    if not _found(env_file.exists):
        _write_json_atomic(env_file, _environment(device))
    _write_json_atomic(key.path, entry)


# ---------------------------------------------------------------------------------------------
# Measuring


def _measuring_blocked(t: torch.Tensor) -> str | None:
    """Why the call's tensors cannot be timed now (``None`` when they can)."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"t is a {type(t).__name__}, not a plain tensor"
    if t.device.type == "meta":
        return "t is on the meta device"
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None:
        sync()  # other accelerators (xpu, mps): the current device


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same strides, so the user's tensor is never touched."""
    with torch.no_grad():
        try:
            x = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=t.device)
            x.copy_(t)
        except RuntimeError:  # overlapping strides (an expanded tensor) cannot be written
            x = t.clone()
    return x


def _with_tensor(call: RoPECall, t: torch.Tensor, **more: Any) -> RoPECall:
    """``call`` with another input tensor (RoPECall is a named tuple or a dataclass)."""
    replace = getattr(call, "_replace", None)
    return replace(t=t, **more) if replace is not None else dataclasses.replace(call, t=t, **more)


def _outputs(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A backend's result as a tuple (a packed qkv call returns q, k and v)."""
    return result if isinstance(result, tuple) else (result,)


def _runner(backend: Backend, call: RoPECall) -> Callable[[RoPECall], Any]:
    """How ``backend`` serves repeated calls like ``call``: through its plan where dispatch
    would keep one (so a backend is timed on the host path its repeated calls take, a bound
    launch included), else through :meth:`Backend.apply`."""
    if (
        type(call) is not RoPECall or type(call.t) is not torch.Tensor or call.k_table is not None
        or call.spec.mrope_section is not None or reads_values(call.spec)
    ):
        return backend.apply
    run = backend.plan(call)
    return lambda c: run(c.t, c.table, c.spec, c.start_positions, c.positions, c.k)


def _prepared(backend: Backend, call: RoPECall, needs_grad: bool) -> tuple[Callable[[], None], float]:
    """``(once, estimate)``: one call of ``backend`` on a private copy of the call's tensor
    (with its backward when ``needs_grad``), compiled, planned and warm, and the seconds one
    call took. Run under the grad mode of the measurement."""
    x = _private_copy(call.t).requires_grad_(needs_grad)
    # a q and k pair: k is private too (an in-place call would rotate it at every round), and
    # its gradient is timed with q's, as training computes both
    k = None if call.k is None else _private_copy(call.k).requires_grad_(needs_grad)
    private = _with_tensor(call, x) if k is None else _with_tensor(call, x, k=k)
    leaves = (x,) if k is None else (x, k)
    warm_up = getattr(backend, "warm_up", None)
    if warm_up is not None:
        warm_up(private)  # compilation happens here, never inside a timed round
    # an in-place call with a gradient needs a non-leaf input: a clone per call, the same
    # extra copy for every candidate
    fresh = (lambda: _with_tensor(private, x.clone(), **(
        {} if call.k is None else {"k": private.k.clone()}
    ))) if call.in_place and needs_grad else (lambda: private)
    out = _outputs(backend.apply(fresh()))
    run = _runner(backend, private)  # planned after that first call, as dispatch plans
    grad_out = tuple(torch.ones_like(o) for o in out) if needs_grad else None

    def once() -> None:
        result = run(fresh())
        if needs_grad:
            torch.autograd.grad(_outputs(result), leaves, grad_out)

    once()  # first backward, lazy initialisation
    _synchronize(x.device)
    start = time.perf_counter()
    once()
    _synchronize(x.device)
    return once, time.perf_counter() - start


def _time_backends(
    backends: list[Backend], call: RoPECall, needs_grad: bool
) -> tuple[dict[str, float], dict[str, Exception]]:
    """Seconds per call of each backend (its fastest round), and the exception of each that
    raised.

    Every candidate is prepared first; then each round times them in turn, so a drift of the
    host or the GPU (clocks ramping up in a fresh process, another process's load) reaches them
    alike rather than whichever was timed during it. Calls of ``_TURNS_BYTES`` and more (bound
    by the GPU, whose times hold steady) are measured one candidate after the other, so only
    one candidate's copies of the tensors are alive at a time."""
    if len(backends) > 1 and call.t.numel() * call.t.element_size() >= _TURNS_BYTES:
        times: dict[str, float] = {}
        failed: dict[str, Exception] = {}
        for backend in backends:
            one, raised = _time_backends([backend], call, needs_grad)
            times.update(one)
            failed.update(raised)
        return times, failed
    device = call.t.device
    prepared: dict[str, tuple[Callable[[], None], int]] = {}
    failed: dict[str, Exception] = {}
    samples: dict[str, list[float]] = {}
    rounds = _ROUNDS
    with torch.enable_grad() if needs_grad else torch.no_grad():
        for backend in backends:
            try:
                once, estimate = _prepared(backend, call, needs_grad)
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                failed[backend.name] = exc
                continue
            if estimate >= _SLOW_CALL_SECONDS:
                rounds, calls = min(rounds, 3), 1
            else:
                calls = min(_MAX_CALLS_PER_ROUND, max(1, math.ceil(_ROUND_SECONDS / max(estimate, 1e-7))))
            prepared[backend.name] = once, calls
            samples[backend.name] = [estimate]  # a warm call: a sample, if rounds are cut
        began = time.perf_counter()
        for round_ in range(rounds):
            if round_ and time.perf_counter() - began > MEASURE_BUDGET_SECONDS:
                break
            for name, (once, calls) in list(prepared.items()):
                try:
                    _synchronize(device)
                    start = time.perf_counter()
                    for _ in range(calls):
                        once()
                    _synchronize(device)
                except Exception as exc:  # noqa: BLE001 - reported by the caller
                    failed[name] = exc
                    del prepared[name], samples[name]
                    continue
                samples[name].append((time.perf_counter() - start) / calls)
    return {name: min(times) for name, times in samples.items()}, failed


def _format_time(us: float) -> str:
    if us < 10:
        return f"{us:.1f} us"
    if us < 1000:
        return f"{us:.0f} us"
    if us < 1e6:
        return f"{us / 1000:.2f} ms"
    return f"{us / 1e6:.2f} s"


def _summary(times: dict[str, float], failed: dict[str, str]) -> str:
    """``triton 71 us vs te 125 us (1.76x), eager 900 us``: fastest first."""
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    text = f"{ranked[0][0]} {_format_time(ranked[0][1])}"
    if len(ranked) > 1:
        best, second = ranked[0][1], ranked[1][1]
        ratio = f" ({second / best:.2f}x)" if best > 0 else ""
        text += f" vs {ranked[1][0]} {_format_time(second)}{ratio}"
        text += "".join(f", {name} {_format_time(us)}" for name, us in ranked[2:])
    if failed:
        text += "; skipped " + ", ".join(f"{name} (raised {err})" for name, err in failed.items())
    return text


def _measure(call: RoPECall, candidates: list[Backend], key: CacheKey) -> dict[str, Any]:
    """Time every candidate; the entry that records the fastest."""
    needs_grad = _needs_grad(call)
    failed: dict[str, str] = {}
    out_of_memory = False
    seconds, raised = _time_backends(candidates, call, needs_grad)
    times = {name: sec * 1e6 for name, sec in seconds.items()}
    for name, exc in raised.items():  # a candidate that fails here would fail the real call too
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        failed[name] = error
        out_of_memory |= isinstance(exc, torch.OutOfMemoryError)
        if name not in _failed_backends:
            _failed_backends.add(name)
            warnings.warn(
                f"rope-dispatch autotune: backend {name!r} raised while being "
                f"measured ({error}); it is skipped for this call shape",
                RuntimeWarning,
                stacklevel=5,
            )
    _log.info("measured %s: %s", key.digest[:12], {**times, **failed})
    choice = min(times, key=times.__getitem__) if times else None
    first = next((b.name for b in candidates if b.name in times), None)
    if choice is not None and times[first] <= times[choice] * (1 + _TIE_MARGIN):
        choice = first  # within the noise of one measurement: priority decides
    return {
        "schema": SCHEMA_VERSION,
        "key": key.digest,
        "fields": key.fields,
        "choice": choice,
        "times_us": {name: round(us, 3) for name, us in times.items()},
        "failed": failed,
        "measured": "forward+backward" if needs_grad else "forward",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transient_failure": out_of_memory,
    }


# ---------------------------------------------------------------------------------------------
# The functions dispatch calls


def _priority(candidates: list[Backend]) -> str:
    return f"highest priority among {', '.join(b.name for b in candidates)}"


def _remembered(key: CacheKey) -> tuple[str, str] | None:
    """The remembered ``(backend name, why)`` for ``key``: from memory, else from its file. A
    pending entry's key (one with ``deferred`` candidates) is entered in :data:`_pending`."""
    hit = _memory.get(key.digest)
    if hit is None:
        entry = _read_entry(key)
        if entry is None:
            return None
        summary = _summary(entry["times_us"], entry.get("failed") or {})
        pending = entry.get("deferred") or []
        if pending:
            _pending.setdefault(key.digest, 0)
            why = _pending_why(pending, f"cached measurement from {key.path}: {summary}")
        else:
            why = f"cached measurement from {key.path}: {summary}"
        hit = _memory[key.digest] = (entry["choice"], why)
    return hit


def _pending_why(pending: list[str], decided: str) -> str:
    names = ", ".join(pending)
    return (
        f"{_PENDING} ({names} not measured yet: it compiles for seconds, so it is measured at "
        f"this key's call {hot_calls()} in a process, or by rope_dispatch.tune); {decided}"
    )


@constant_while_tracing
def _decide_while_tracing(device: str, signature: tuple) -> tuple[str | None, str | None]:
    """Run for real by Dynamo once at trace time (the graph keeps the answer), so reading the
    environment, hashing and file reads never enter traced code.

    ``(name, why)`` of a remembered choice; ``(None, why)`` when measuring is off; ``(None,
    None)`` when nothing is remembered.
    """
    if not autotune_enabled():
        return None, _OFF
    hit = _remembered(cache_key(torch.device(device), signature))
    return (None, None) if hit is None else hit


def _pick(
    candidates: list[Backend], hit: tuple[str | None, str | None] | None
) -> tuple[Backend, str] | None:
    if hit is not None and hit[0] is not None:
        for backend in candidates:
            if backend.name == hit[0]:
                return backend, hit[1]
    return None


def _provisional(candidates: list[Backend], blocked: str) -> tuple[Backend, str]:
    return candidates[0], (
        f"{_PROVISIONAL} ({blocked}, nothing measured yet): {_priority(candidates)}; "
        "a later eager call measures"
    )


def select(call: RoPECall, candidates: list[Backend]) -> tuple[Backend, str]:
    """The backend to run among ``candidates`` (highest priority first), and why.

    Reads the remembered measurement for this call's key or, the first time, measures every
    candidate that needs no compilation and remembers the fastest; those that compile for
    seconds are measured with the others at the key's :func:`hot_calls`-th call.
    """
    return _select(call, candidates, use_cache=True)


def tune(call: RoPECall, candidates: list[Backend], *, retune: bool = False) -> tuple[Backend, str]:
    """Measure ``call`` now, every candidate included (those that compile for seconds too),
    unless its key holds a complete measurement and not ``retune``; store the result.

    This is :func:`select` for ahead-of-time tuning (``rope_dispatch.tune``): with ``retune``
    an existing entry is measured again and overwritten.
    """
    return _select(call, candidates, use_cache=not retune, complete=True)


def _select(
    call: RoPECall, candidates: list[Backend], use_cache: bool, complete: bool = False
) -> tuple[Backend, str]:
    if torch.compiler.is_compiling():
        name, why = _decide_while_tracing(str(call.t.device), call_signature(call, candidates))
        if why == _OFF:
            return candidates[0], f"{_OFF}: {_priority(candidates)}"
        return _pick(candidates, (name, why)) or _provisional(candidates, "torch.compile is tracing")
    if not autotune_enabled():
        return candidates[0], f"{_OFF}: {_priority(candidates)}"
    blocked = _measuring_blocked(call.t)
    with _lock:
        key = _call_key(call, candidates)
        hit = _remembered(key) if use_cache else None
        picked = _pick(candidates, hit)
        if picked is not None:
            if key.digest not in _pending:
                return picked
            _pending[key.digest] += 1
            if blocked is not None or not (complete or _pending[key.digest] >= hot_calls()):
                return picked
        if blocked is not None:
            return _provisional(candidates, blocked)
        later = [] if complete or key.digest in _pending else deferred(candidates)
        quick = [b for b in candidates if b.name not in later]
        if later and len(quick) < 2:
            # nothing to compare without compiling: the first that needs no compilation (the
            # priority order where every candidate compiles: the call runs one of them anyway)
            first = (quick or candidates)[0]
            _pending[key.digest] = 1
            _memory[key.digest] = (first.name, _pending_why(later, (
                f"{first.name}, the only candidate that needs no compilation" if quick
                else _priority(candidates)
            )))
            return first, _memory[key.digest][1]
        entry = _measure(call, quick, key)
        if entry["choice"] is None:
            why = (
                "autotune: every candidate raised while measured "
                f"({'; '.join(f'{n}: {e}' for n, e in entry['failed'].items())}); "
                f"{_priority(candidates)}"
            )
            _pending.pop(key.digest, None)
            _memory[key.digest] = (candidates[0].name, why)
            return candidates[0], why
        if later:
            entry["deferred"] = later
        if not entry.pop("transient_failure"):
            _store(key, entry, call.t.device)
        why = f"autotuned ({entry['measured']}): {_summary(entry['times_us'], entry['failed'])}"
        if later:
            _pending[key.digest] = 1
            why = _pending_why(later, why)
        else:
            _pending.pop(key.digest, None)
        _memory[key.digest] = (entry["choice"], why)
        return _pick(candidates, _memory[key.digest])  # type: ignore[return-value]


def peek(call: RoPECall, candidates: list[Backend]) -> tuple[Backend, str]:
    """What :func:`select` would choose, without measuring anything."""
    if torch.compiler.is_compiling():
        name, why = _decide_while_tracing(str(call.t.device), call_signature(call, candidates))
        hit = None if name is None else (name, why)
        if why == _OFF:
            return candidates[0], f"{_OFF}: {_priority(candidates)}"
    elif not autotune_enabled():
        return candidates[0], f"{_OFF}: {_priority(candidates)}"
    else:
        with _lock:
            hit = _remembered(_call_key(call, candidates))
    picked = _pick(candidates, hit)
    if picked is not None:
        return picked
    later = deferred(candidates)
    quick = [b for b in candidates if b.name not in later]
    names = ", ".join(b.name for b in quick or candidates)
    if later and len(quick) < 2:
        first = (quick or candidates)[0]
        return first, (
            f"{_NOT_MEASURED}: nothing to compare but {', '.join(later)}, which compiles for "
            f"seconds and is measured once the key is hot; until then {first.name} runs"
        )
    deferring = f"; {', '.join(later)} only once the key is hot" if later else ""
    return quick[0], (
        f"{_NOT_MEASURED} (no cached measurement of {names} for this key{deferring}); "
        f"until then the priority order picks {quick[0].name}"
    )


def decision_is_final(why: str) -> bool:
    """Whether a decision may be cached in memory for the rest of the process.

    Priority-order decisions taken where measuring was impossible (tracing, graph capture) are
    not: the next real call measures. Nor are pending ones (candidates that compile not measured
    yet): the calls of their key are counted until it proves hot.
    """
    return not why.startswith((_PROVISIONAL, _NOT_MEASURED, _PENDING))


# ---------------------------------------------------------------------------------------------
# Inspecting and clearing


def _environment_dirs(root: Path) -> list[Path]:
    """The subdirectories of ``root`` named like ours; anything else there is left alone."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and _ENVIRONMENT_DIR.match(p.name))
    except OSError:
        return []


def _listing(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def cache_entries() -> list[dict[str, Any]]:
    """Every valid entry under :func:`cache_dir`, across devices and version sets.

    Each dict holds the entry's fields (``choice``, ``times_us``, ``failed``, ``measured``,
    ``fields``, ``created``) plus ``path`` and the ``environment`` of its directory.
    """
    root = cache_dir()
    entries: list[dict[str, Any]] = []
    if not _found(root.is_dir):
        return entries
    for folder in _environment_dirs(root):
        try:
            environment = _read_json(folder / _ENVIRONMENT_FILE)
        except ValueError:
            environment = None
        for path in _listing(folder):
            if not _ENTRY_NAME.match(path.name):
                continue
            try:
                entry = _read_json(path)
            except ValueError as exc:
                _warn_once(str(path), f"ignoring cache file {path}: {exc}; it will be rewritten")
                continue
            problem = _entry_problem(entry, path.stem)
            if problem is not None:
                _warn_once(str(path), f"ignoring cache file {path}: {problem}; it will be rewritten")
                continue
            entries.append({**entry, "path": str(path), "environment": environment})
    return entries


_STALE_SECONDS = 60.0
"""Age past which a temporary file is a dead writer's: a live one is renamed within a write."""


def _stale(path: Path) -> bool:
    """Whether the temporary ``path`` was last written over ``_STALE_SECONDS`` ago."""
    try:
        return time.time() - path.stat().st_mtime > _STALE_SECONDS
    except OSError:
        return False


def clear_cache(memory_only: bool = False) -> int:
    """Forget every measurement (and dispatch's cached decisions); returns the files removed.

    With ``memory_only`` the files stay and the next call of each key reads its file again.
    Only this module's files are removed: entries, environment files and stale temporaries
    (written over ``_STALE_SECONDS`` ago; a younger one may be another process's write).
    """
    with _lock:
        _memory.clear()
        _warned.clear()
        _unwritable.clear()
        _failed_backends.clear()
        _pending.clear()
        registry.invalidate()
        if memory_only:
            return 0
        removed = 0
        root = cache_dir()
        if not _found(root.is_dir):
            return 0
        for folder in _environment_dirs(root):
            for path in _listing(folder):
                name = path.name
                if _ENTRY_NAME.match(name) or name == _ENVIRONMENT_FILE or (
                    name.startswith(".tmp-") and name.endswith(".json") and _stale(path)
                ):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed += 1
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when nothing else is left in it
        return removed
