"""Choosing among several capable backends by measuring them once per machine.

When two or more backends can serve a call, :func:`select` times each of them on a private copy
of the call's tensor (forward, plus backward when ``t`` requires grad), keeps the fastest and
remembers it in memory and on disk. Later calls with the same key, in this process or any later
one on the same machine and software, read the choice instead of measuring.

The key a measurement is stored under and its files (one JSON file per key and environment,
shared safely by processes) are :mod:`.autotune_cache`'s, whose public names are re-exported here.

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

import dataclasses
import datetime
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import autotune_cache, registry
from .autotune_cache import (
    SCHEMA_VERSION, CacheKey, cache_dir, cache_entries, cache_key, call_signature, clear_cache,
    dist_version, environment_dir, installed_versions, key_fields, lock, read_entry, store_entry,
)
from .call import RoPECall, reads_values, wants_grad
from .errors import RoPEError, user_stacklevel
from .registry import Backend
from .tracing import (
    PLAIN_TENSORS, constant_while_tracing, forward_ad, recompile_limit_hit, transformed,
)

__all__ = [
    "HOT_CALLS", "MEASURE_BUDGET_SECONDS", "SCHEMA_VERSION", "CacheKey", "autotune_enabled",
    "cache_dir", "cache_entries", "cache_key", "call_signature", "clear_cache",
    "decision_is_final", "deferred", "dist_version", "environment_dir", "hot_calls",
    "installed_versions", "key_fields", "peek", "select", "tune",
]

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
_OFF = "autotune off"  # the start of an off decision's why (_off_why)
_OFF_VALUES = frozenset({"0", "false", "off", "no"})
_ON_VALUES = frozenset({"", "1", "true", "on", "yes"})
_NOT_MEASURED = "would measure on first call"
_PENDING = "pending"
_HELD = (
    "held (met under saved-tensor hooks, as activation checkpointing sets: its forward and "
    "recomputation must run one backend, so no later measurement changes it in this process)"
)
_CACHE_STAGE = (
    "a KV-cache write is not measured (timing it would write the caller's cache, and rotate q "
    "again where q_out is q)"
)

_memory: dict[str, tuple[str, str]] = {}  # key digest -> (backend name, why)
_failed_backends: set[str] = set()  # backends already warned about for raising while measured
_pending: dict[str, int] = {}  # digest of a key whose deferred candidates are unmeasured -> calls
_unread: set[str] = set()  # digests whose file held nothing when a blocked call read it
_MAX_KEYS = 4096  # keys remembered at most (as dispatch's decisions): then all are forgotten


def _forget() -> None:
    """Empty this module's memory: :func:`clear_cache` calls it (its ``on_clear`` hook)."""
    _memory.clear()
    _failed_backends.clear()
    _pending.clear()
    _unread.clear()


autotune_cache.on_clear(_forget)


def _make_room() -> None:
    """Keep this module's memory bounded (a process meeting a new spec or shape bucket every
    few steps would otherwise grow it without end): at :data:`_MAX_KEYS` keys it is forgotten,
    as dispatch forgets its decisions; a key met again reads its file again (a pending key's
    count starts over, and under saved-tensor hooks its choice is held again before anything
    is measured). Called under :data:`lock`, before a key is looked up."""
    if len(_memory) >= _MAX_KEYS or len(_unread) >= _MAX_KEYS:
        _memory.clear()
        _pending.clear()
        _unread.clear()


def autotune_enabled() -> bool:
    """False when ``ROPE_AUTOTUNE`` is ``0`` (or ``false``/``off``/``no``), True when it is
    unset, empty or ``1`` (``true``/``on``/``yes``), any case; any other value is refused by
    name: a misspelt off (``disabled``) must not measure as if it were on."""
    raw = os.environ.get("ROPE_AUTOTUNE")
    value = "" if raw is None else raw.strip().lower()
    if value in _OFF_VALUES:
        return False
    if value in _ON_VALUES:
        return True
    raise RoPEError(
        f"ROPE_AUTOTUNE must be 0, false, off or no (measuring off) or 1, true, on or yes "
        f"(on; the default); got {raw!r}"
    )


def _off_text() -> str:
    """``autotune off (ROPE_AUTOTUNE='no')``: the value that turned measuring off."""
    return f"{_OFF} (ROPE_AUTOTUNE={os.environ.get('ROPE_AUTOTUNE')!r})"


def _off_why(candidates: list[Backend]) -> str:
    return f"{_off_text()}: {_priority(candidates)}"


def hot_calls() -> int:
    """The call of a key at which its deferred candidates are measured: ``ROPE_AUTOTUNE_HOT_CALLS``
    (a positive integer), else :data:`HOT_CALLS`."""
    raw = os.environ.get("ROPE_AUTOTUNE_HOT_CALLS", "").strip()
    if not raw:
        return HOT_CALLS
    # decimal digits only: int() also takes 1_000, +5 and other scripts' digits
    value = int(raw) if raw.isascii() and raw.isdigit() else 0
    if value < 1:
        raise RoPEError(
            f"ROPE_AUTOTUNE_HOT_CALLS must be a positive integer (the call of a key at which "
            f"backends that compile are measured); got {raw!r}"
        )
    return value


def deferred(candidates: list[Backend]) -> list[str]:
    """The names of ``candidates`` that compile for seconds at their first call of a spec
    (:attr:`~rope_dispatch.Backend.compiles_per_spec`): a first call leaves them out."""
    return [b.name for b in candidates if b.compiles_per_spec]


def _call_key(call: RoPECall, candidates: list[Backend]) -> CacheKey:
    return cache_key(call.t.device, call_signature(call, candidates))


# ---------------------------------------------------------------------------------------------
# Measuring


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_set() -> bool:
    """Whether saved-tensor hooks are set: activation checkpointing (``use_reentrant=False``)
    or offloading, whose forward and recomputation must save the same tensors, so run the same
    backend."""
    return _top_hooks is not None and _top_hooks(False) is not None


def _measuring_blocked(t: torch.Tensor) -> str | None:
    """Why the call's tensors cannot be timed now (``None`` when they can)."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if transformed():
        return "a torch.func transform runs"
    if forward_ad():  # the kernels' backends run the eager math then: their times would be its
        return "a forward-mode AD level is open"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    if type(t) not in PLAIN_TENSORS:
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
        or call.cache_write is not None or call.spec.mrope_section is not None
        or reads_values(call.spec)
    ):
        return backend.apply
    run = backend.plan(call)
    return lambda c: run(c.t, c.table, c.spec, c.start_positions, c.positions, c.k,
                         (c.norm, c.k_norm))


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
    # the measured runs keep their saved tensors to themselves: a checkpoint's hooks would
    # count them as its region's (and stop its recomputation on them)
    with torch.enable_grad() if needs_grad else torch.no_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_same, _same):
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
    needs_grad = wants_grad(call)
    failed: dict[str, str] = {}
    transient = False  # a failure of this process's state, not of the key: kept from the file
    # no torch dispatch mode sees the measured runs: a selective activation checkpoint's would
    # record their ops as its region's and hand their outputs to the recomputation's ops
    with _disable_current_modes():
        seconds, raised = _time_backends(candidates, call, needs_grad)
    times = {name: sec * 1e6 for name, sec in seconds.items()}
    for name, exc in raised.items():  # a candidate that fails here would fail the real call too
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        failed[name] = error
        # out of memory, or Dynamo's recompile limit reached by this process's earlier calls
        transient |= isinstance(exc, torch.OutOfMemoryError) or recompile_limit_hit(exc)
        if name not in _failed_backends:
            _failed_backends.add(name)
            warnings.warn(
                f"rope-dispatch autotune: backend {name!r} raised while being "
                f"measured ({error}); it is skipped for this call shape",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
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
        "transient_failure": transient,
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
        entry = read_entry(key)
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

    ``(name, why)`` of a remembered choice; ``(None, why)`` when measuring is off (``why``
    without the candidates: its start); ``(None, None)`` when nothing is remembered.
    """
    if not autotune_enabled():
        return None, _off_text()
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
    an existing entry is measured again and overwritten, and dispatch forgets its decisions and
    plans, which may hold the choice measured before.
    """
    chosen = _select(call, candidates, use_cache=not retune, complete=True)
    if retune:
        registry.invalidate()
    return chosen


def _select(
    call: RoPECall, candidates: list[Backend], use_cache: bool, complete: bool = False
) -> tuple[Backend, str]:
    if call.cache_write is not None:
        return candidates[0], f"{_CACHE_STAGE}: {_priority(candidates)}"
    if torch.compiler.is_compiling():
        name, why = _decide_while_tracing(str(call.t.device), call_signature(call, candidates))
        if name is None and why is not None:
            return candidates[0], f"{why}: {_priority(candidates)}"
        return _pick(candidates, (name, why)) or _provisional(candidates, "torch.compile is tracing")
    if not autotune_enabled():
        return candidates[0], _off_why(candidates)
    blocked = _measuring_blocked(call.t)
    with lock:
        _make_room()
        key = _call_key(call, candidates)
        # a blocked call reads a key's file once: calls that cannot measure (under vmap, say)
        # would otherwise read it on each call, none of them keeping a decision
        hit = None if not use_cache else (
            _memory.get(key.digest) if blocked is not None and key.digest in _unread
            else _remembered(key))
        picked = _pick(candidates, hit)
        if picked is not None:
            if key.digest not in _pending:
                return picked
            if _hooks_set():  # a checkpointed region: its recomputation must choose alike,
                del _pending[key.digest]  # so the choice holds from here on
                _memory[key.digest] = (picked[0].name, f"{_HELD}: {picked[1]}")
                return picked[0], _memory[key.digest][1]
            _pending[key.digest] += 1
            if blocked is not None or not (complete or _pending[key.digest] >= hot_calls()):
                return picked
        if blocked is not None:
            _unread.add(key.digest)
            return _provisional(candidates, blocked)
        later = ([] if complete or key.digest in _pending or hot_calls() == 1  # call 1 is hot
                 else deferred(candidates))
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
            store_entry(key, entry, call.t.device)
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
    if call.cache_write is not None:
        return candidates[0], f"{_CACHE_STAGE}: {_priority(candidates)}"
    hot = False  # a pending key whose next call is its hot call
    if torch.compiler.is_compiling():
        name, why = _decide_while_tracing(str(call.t.device), call_signature(call, candidates))
        hit = None if name is None else (name, why)
        if name is None and why is not None:
            return candidates[0], f"{why}: {_priority(candidates)}"
    elif not autotune_enabled():
        return candidates[0], _off_why(candidates)
    else:
        with lock:
            _make_room()
            key = _call_key(call, candidates)
            hit = _remembered(key)
            calls = _pending.get(key.digest)
            hot = calls is not None and calls + 1 >= hot_calls() and (
                _measuring_blocked(call.t) is None)
    picked = _pick(candidates, hit)
    if picked is not None and hot:  # select's count reaches the hot call: it measures
        return picked[0], (
            f"the next call is this key's call {hot_calls()} in this process, which measures "
            f"every candidate and runs the fastest (explain cannot know which); until then: "
            f"{picked[1]}"
        )
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
        f"{_NOT_MEASURED} (no cached measurement of {names} for this key{deferring}): that "
        f"call measures them and runs the fastest, which explain cannot know "
        f"({quick[0].name} is only the first in priority order)"
    )


def decision_is_final(why: str) -> bool:
    """Whether a decision may be cached in memory for the rest of the process.

    Priority-order decisions taken where measuring was impossible (tracing, graph capture) are
    not: the next real call measures. Nor are pending ones (candidates that compile not measured
    yet): the calls of their key are counted until it proves hot.
    """
    return not why.startswith((_PROVISIONAL, _NOT_MEASURED, _PENDING))


