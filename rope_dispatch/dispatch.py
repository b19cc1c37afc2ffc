"""Choosing a backend for a call, and the public ``apply``/``explain``/``use_backend``.

Order of choice: ``backend=`` argument > :func:`use_backend` scope > ``ROPE_BACKEND`` > the
autotune cache (a one-time measurement) > priority. A forced backend that cannot serve the call
raises with its reasons; it never falls back silently.

A decision is cached per :func:`decision_key` (the call's :class:`~rope_dispatch.call_keys.CallKey`,
which autotune's measurements are stored under too), so a call that is not planned pays the
key and a dict lookup, not the checks; planned calls (the second of a form on) pay neither.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import autotune, registry
from . import call as call_module
from .call import RoPECall, check_call, grad_leaf, reads_values, refuse_dtensors_beside
from .call_keys import CallKey, call_key
from .env import env_raw_reader, env_reader
from .errors import BackendNotSupportedError, NoBackendError, RoPEError, RoPETypeError
from .guards import Guard, apart_as_planned, constant_table, tensor_guard
from .kv_cache import KVCache, check_cache_call
from .norm import HeadNorm
from .registry import Backend
from .spec import RoPESpec
from .tables import RotaryTable, address_reader, table_requires_grad, table_tensors
from .tracing import (
    PLAIN_TENSORS, _dispatch_modes, constant_while_tracing, distributed, transformed,
)

_forced: contextvars.ContextVar[object] = contextvars.ContextVar("rope_backend", default=None)
_AUTOMATIC = object()  # use_backend(None)'s scope: no backend forced, ROPE_BACKEND's neither
_decisions: dict[tuple, tuple[Backend, str]] = {}
_MAX_DECISIONS = 4096
# Times decisions and plans were forgotten (clear_cache, register, a retune): one a call made
# while another thread forgot them is dropped again (it may be what the forgetting was for).
_forgotten = 0
_INT32_LIMIT = 2**31


def clear_decisions() -> None:
    """Forget cached decisions (after registering a backend or clearing the autotune cache)."""
    global _forgotten
    _forgotten += 1
    _decisions.clear()
    forget_plans()
    _size_limits.cache_clear()


registry.on_invalidate(clear_decisions)


def forget_plans() -> None:
    """Forget every plan (the next calls are checked again and planned anew)."""
    global _recent, _recent_run, _recent_cache
    _plans.clear()
    _met_once.clear()
    _recent = _recent_run = _recent_cache = None


@functools.cache
def _size_limits() -> tuple[int, ...]:
    """Every element-count limit a registered backend declares, plus the int32 offset limit."""
    limits = {_INT32_LIMIT - 1} | {b.max_numel for b in registry.backends() if b.max_numel}
    return tuple(sorted(limits))


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force backend ``name`` for the calls in this scope; ``None`` lifts every outer override,
    an outer scope's and ``ROPE_BACKEND``'s (the automatic choice; ``backend=`` still forces).
    The scope is a context variable's: threads started inside it do not inherit it."""
    if name is not None:
        registry.get_backend(name)
    token = _forced.set(_AUTOMATIC if name is None else name)
    try:
        yield
    finally:
        _forced.reset(token)


def requested_backend(backend: str | None = None) -> tuple[str | None, str]:
    """The forced backend name in force for a call and where it came from."""
    if backend is not None:
        return backend, "the backend= argument"
    return _scoped_or_env_backend()


_env_backend = env_reader("ROPE_BACKEND")


@constant_while_tracing
def _scoped_or_env_backend() -> tuple[str | None, str]:
    # Under torch.compile this is evaluated once at trace time and baked into the graph
    # (Dynamo cannot trace ContextVar.get), like the backend choice itself.
    scoped = _forced.get()
    if scoped is _AUTOMATIC:
        return None, "nothing"
    if scoped is not None:
        return scoped, "use_backend()"
    env = _env_backend() or None
    if env is not None:
        return env, "the ROPE_BACKEND environment variable"
    return None, "nothing"


_forced_get = _forced.get
_env_backend_raw, _ = env_raw_reader("ROPE_BACKEND")


def decision_key(call: RoPECall, forced: str | None) -> tuple[CallKey, str | None]:
    """What a backend choice may depend on: the call's :class:`~rope_dispatch.call_keys.CallKey`
    (with which side of every declared size limit it is on, so a limit is never hidden by a
    cached choice) and the backend forced, if any. Equal keys get the same backend."""
    return call_key(call, _size_limits()), forced


def capable_backends(call: RoPECall) -> tuple[list[Backend], dict[str, list[str]]]:
    """The backends that can serve ``call`` (highest priority first), and every other
    backend's reasons."""
    supported, rejected = [], {}
    for b in registry.backends():
        reasons = b.not_supported_reasons(call)
        if reasons:
            rejected[b.name] = reasons
        else:
            supported.append(b)
    return supported, rejected


def _format_rejections(rejected: dict[str, list[str]]) -> str:
    return "\n".join(f"  - {name}: {'; '.join(reasons)}" for name, reasons in rejected.items())


def _decide(call: RoPECall, forced: str | None, source: str) -> tuple[Backend, str]:
    if forced is not None:
        b = registry.get_backend(forced, source)
        reasons = b.not_supported_reasons(call)
        if reasons:
            raise BackendNotSupportedError(
                f"backend {forced!r} was forced by {source} but cannot serve this call "
                f"({_describe(call)}): {'; '.join(reasons)}"
            )
        return b, f"forced by {source}"
    supported, rejected = capable_backends(call)
    if not supported:
        raise NoBackendError(
            f"no backend can serve this call ({_describe(call)}):\n{_format_rejections(rejected)}"
        )
    if len(supported) == 1:
        return supported[0], "the only backend that supports this call"
    return autotune.select(call, supported)


def _describe(call: RoPECall) -> str:
    t = call.t
    packed = "" if call.split is None else f" packed qkv split {call.split},"
    if call.k is not None:
        packed = f" q and k {tuple(call.k.shape)} (k),"
    norms = "".join(f", {name} {n.scope} (offset {n.offset:g})"
                    for name, n in (("q_norm" if call.tensors != "t" else "norm", call.norm),
                                    ("k_norm", call.k_norm)) if n is not None)
    if call.cache_write is not None:
        kind, cache_dtype, q_dtype, *v_head_dim = call.cache_write.form
        v_dim = f" (v head dim {v_head_dim[0]})" if v_head_dim else ""
        norms += f", k and v written to a {kind} KV cache of {cache_dtype}{v_dim}, q out {q_dtype}"
    return (
        f"{call.spec.layout}{packed} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on "
        f"{t.device}, rotary dim {call.rotary_dim}{norms}"
        f"{', inverse' if call.spec.inverse else ''}"
        f"{f', from channel {call.spec.rotary_offset}' if call.spec.rotary_offset else ''}"
        f"{', interleaved pairs in, halves out' if call.spec.deinterleave else ''}"
    )


def choose(call: RoPECall, backend: str | None = None) -> Backend:
    """The backend that runs ``call``.

    Decisions are kept by :func:`decision_key` (sizes in power-of-two buckets): only a new
    key runs the checks. A repeated call does not get here at all: its plan runs.
    """
    return _choose(call, backend)[0]


def _choose(call: RoPECall, backend: str | None) -> tuple[Backend, bool]:
    """:func:`choose`, and whether the decision is final (cached, so a plan may keep it)."""
    forced, source = requested_backend(backend)
    if torch.compiler.is_compiling():
        # Traced code decides from metadata, once per trace, and leaves the memo dicts alone:
        # mutating them or calling C helpers such as bisect would break the graph.
        return _decide(call, forced, source)[0], False
    if forced is not None and type(forced) is not str:
        registry.get_backend(forced, source)  # refused by name, before it keys a memo
    key = decision_key(call, forced)
    decision = _decisions.get(key)
    if decision is None:
        forgotten = _forgotten
        decision = _decide(call, forced, source)
        if not autotune.decision_is_final(decision[1]):
            return decision[0], False
        if len(_decisions) >= _MAX_DECISIONS:
            _decisions.clear()
        _decisions[key] = decision
        if forgotten != _forgotten:  # forgotten meanwhile (another thread): kept, then dropped,
            _decisions.pop(key, None)  # so a forgetting after the check removes it too
            return decision[0], False
    return decision[0], True


class _Plan(NamedTuple):
    """A repeated call's checked and decided path: valid for tensors its ``guard`` accepts
    (their dtype, device, shape, strides and ``requires_grad``; the gradient mode where one
    requires grad) while ``freqs`` still holds the memory it held at plan time
    (``table_address``)."""

    guard: Guard
    address: Callable[[object], int | tuple[int, int]]  # address_reader's
    table_address: int | tuple[int, int]
    run: registry.Plan


class _PlanSet(NamedTuple):
    """The plans kept under one key (the ids of a spec and a table, the forced backend and the
    call's form), most recent first: one per tensor layout (and grad mode, for tensors that
    require grad) met, as a decode step's q and k, or the layers of a model sharing a spec and
    table. ``refs``: weak references whose callbacks drop the set when the spec or table dies,
    so a key's ids always name live objects and a plan never keeps a table alive."""

    refs: tuple[weakref.ref, ...]  # the spec's and the table's
    plans: tuple[_Plan, ...]
    forced: object  # the key's forced backend name, as the key holds it
    form: object  # the key's call form (None for a plain single tensor's call)


def _dropper(key: tuple) -> Callable[[weakref.ref], None]:
    """A weak reference callback removing the plans under ``key`` (the dict's own ``pop``,
    bound now: at interpreter exit the module's globals may be gone when the callback runs)."""
    pop = _plans.pop
    return lambda _ref: pop(key, None)


_data_ptr = torch.Tensor.data_ptr
_Tensor = torch.Tensor
_NO_NORMS = (None, None)
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
# Dynamo knows this function (True while it traces); at run time one frame, is_compiling's two.
# Other tracers (export, make_fx) trace tensor subclasses, which never take the planned path.
_dynamo_compiling = torch.compiler.is_dynamo_compiling


_plans: dict[tuple, _PlanSet] = {}
_met_once: set[tuple] = set()  # keys met once and not planned yet (see _keep_plan)
# The plan set of apply's latest planned call, found by comparing a call's spec and table with
# its weak references, without the key's id() calls and hash (id() took 0.18 us on the GPU
# machine's Python 3.12). Replaced by the next set apply finds in _plans, dropped when a key's
# plans change or are forgotten; a set whose spec or table died matches no call. _run's calls
# (in place, q+k, qkv, index tensors) and rope_to_cache's keep their own, compared by form too.
_recent: _PlanSet | None = None
_recent_run: _PlanSet | None = None
_recent_cache: _PlanSet | None = None
_MAX_PLANS = 256  # keys
_MAX_PLANS_PER_KEY = 8


def apply(
    t: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    start_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    backend: str | None = None,
    norm: HeadNorm | None = None,
) -> torch.Tensor:
    """Rotary position embedding of ``t`` (TransformerEngine 2.20.2 ``apply_rotary_pos_emb``).

    ``freqs`` is the float32 angle table ``[s2, 1, 1, d2]`` (or ``[s2, d2]``), a
    :class:`~rope_dispatch.CosSinCache`, a :class:`~rope_dispatch.PairCosSinCache` (an
    engine's ``cos_sin_cache``) or a :class:`~rope_dispatch.RateTable` (the rates an angle
    table is made of). Returns a new tensor, contiguous in ``spec.layout``;
    differentiable with respect to ``t``.

    A token's table row is its place in its sequence (plus ``start_positions[b]``, one per
    sequence, and the zigzag offset under context parallelism), or it is given per token by
    ``positions``: an int tensor ``[s, b]`` (sbhd), ``[b, s]`` (bshd) or ``[T]`` (thd, where the
    spec then needs no ``cu_seqlens``), as continuous batching, chunked prefill and speculative
    decoding have them.

    A call repeating earlier ones' spec and table objects and its tensors' shapes, strides,
    dtypes, devices and gradient mode reuses their checks and decision (a *plan*, kept at the
    second such call): at decode size the host path, not the GPU, sets the pace. Calls whose
    index values are read on the host (CPU tensors, strict mode) are checked every time.

    ``norm``: a :class:`~rope_dispatch.HeadNorm` applied to ``t`` before the rotation, in the
    same pass (the whole head is normalized; the weight gets a gradient where it wants one).
    """
    global _recent
    if (
        start_positions is None and positions is None and norm is None and type(t) is _Tensor
        and not _dynamo_compiling() and (backend is None or type(backend) is str)
    ):
        # _run's lookup for a plain call (the same key), inlined: the decode path saves a
        # Python frame. The forced name as set (use_backend's, else ROPE_BACKEND's stored value,
        # bytes on POSIX: a backend= that is not a str, equal to it, must miss, and be refused)
        forced = backend if backend is not None else (_forced_get() or _env_backend_raw())
        entry = _recent
        if (
            entry is None or entry.refs[0]() is not spec or entry.refs[1]() is not freqs
            or entry.forced is not forced
        ):
            try:
                entry = _plans.get((id(spec), id(freqs), forced, None))
            except TypeError:  # an unhashable backend=: the checks name it
                entry = None
            if entry is not None:
                _recent = entry
        if entry is not None:
            for guard, address, planned_address, run in entry.plans:
                if guard(t) and address(freqs) == planned_address:
                    return run(t, freqs, spec, None, None, None, _NO_NORMS)
    return _run(t, freqs, spec, start_positions, backend, False, False, None, None, positions,
                norms=(norm, None))


def apply_(
    t: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    start_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    backend: str | None = None,
    grad_in_place: bool = False,
    norm: HeadNorm | None = None,
) -> torch.Tensor:
    """:func:`apply` in place: rotates the first ``d2`` channels of ``t`` and returns ``t``.

    The pass-through channels are neither read nor written, so with partial rotary the call
    moves ``d2 / d`` of the bytes :func:`apply` moves. Like torch's in-place ops it bumps
    ``t``'s version counter and refuses a leaf that requires grad; the backward makes a new
    gradient unless ``grad_in_place=True``, which lets it rotate the incoming gradient in place
    (also ``d2 / d`` of the bytes). Use that only where nothing else reads that gradient
    (a query or key whose only consumer is attention): a gradient that autograd shares with
    another branch (``t`` also used in a sum, say) would be changed under it.

    With a ``norm`` every channel is normalized, so the whole head is rewritten.
    """
    return _run(t, freqs, spec, start_positions, backend, True, grad_in_place, None, None, positions,
                norms=(norm, None))


def apply_qkv(
    qkv: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    split: tuple[int, int, int],
    *,
    k_freqs: torch.Tensor | RotaryTable | None = None,
    start_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    backend: str | None = None,
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of a packed qkv tensor, split and rotated in one pass: returns new ``(q, k, v)``.

    ``qkv`` is ``[s, b, h, q + k + v]`` (``[b, s, ...]`` for bshd, ``[T, h, ...]`` for thd) with
    ``split = (q, k, v)`` channels per head group, as TE's ``apply_fused_qkv_rotary_pos_emb``
    takes it. ``k`` is the head dim ``d``: a group holds ``q / d`` query heads (GQA), one key
    head and ``v / d`` value heads. Returns q ``[s, b, h * q / d, d]``, k ``[s, b, h, k]`` and v
    ``[s, b, h, v]``, contiguous: q rotated by ``freqs``, k by ``k_freqs`` (default ``freqs``), v
    copied. Positions, tables and ``start_positions`` are as in :func:`apply`; the backward
    writes one packed gradient. ``q_norm``, ``k_norm``: HeadNorms applied to q and k first."""
    if split is None:  # _run would take it for a single tensor's call and return one tensor
        raise RoPEError("split must be three ints (q, k, v channels per head group), got None")
    return _run(
        qkv, freqs, spec, start_positions, backend, False, False, split=split, k_freqs=k_freqs,
        positions=positions, norms=(q_norm, k_norm),
    )


def apply_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    positions: torch.Tensor | None = None,
    start_positions: torch.Tensor | None = None,
    backend: str | None = None,
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply` of q and k together, in one launch forward and one backward.

    q and k have the same leading dims and head dim and any head counts (GQA, MQA) and strides
    (slices of one fused projection); both are rotated by ``freqs`` at the same positions.
    Returns new ``(q_out, k_out)``, contiguous; differentiable with respect to both.
    ``q_norm`` and ``k_norm`` (:class:`~rope_dispatch.HeadNorm`, Qwen3's ``q_norm`` and
    ``k_norm``) normalize q and k first, in the same launch.
    """
    if k is None:
        raise RoPETypeError("k must be a torch.Tensor, got None; use rope_dispatch.apply for q alone")
    return _run(q, freqs, spec, start_positions, backend, False, False, None, None, positions, k,
                norms=(q_norm, k_norm))


def apply_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    positions: torch.Tensor | None = None,
    start_positions: torch.Tensor | None = None,
    backend: str | None = None,
    grad_in_place: bool = False,
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_qk` in place: rotates the first ``d2`` channels of q and k, in one launch,
    and returns ``(q, k)`` (see :func:`apply_` for the in-place rules and ``grad_in_place``).
    With a norm, every channel of that tensor is rewritten."""
    if k is None:
        raise RoPETypeError("k must be a torch.Tensor, got None; use rope_dispatch.apply_ for q alone")
    return _run(q, freqs, spec, start_positions, backend, True, grad_in_place, None, None,
                positions, k, norms=(q_norm, k_norm))


def _planned_form(
    t: torch.Tensor, freqs: object, start_positions: torch.Tensor | None,
    positions: torch.Tensor | None, k: torch.Tensor | None, k_freqs: object,
    split: tuple[int, int, int] | None, in_place: bool, grad_in_place: bool,
    q_norm: object, k_norm: object,
) -> tuple[tuple[torch.Tensor, ...], tuple] | None:
    """For any call but a plain single tensor's: the tensors a plan's guard checks (``t``, then
    ``k``, then the index tensor, then the norm weights) and the call's form (which arguments
    it has, for an in-place call whether inference mode is on, and the norms' forms), the last
    part of a plan's key; ``None`` when the call must be checked every time (index values read
    on the host, tensor subclasses, a separate k table, arguments that check_call refuses;
    norms as :func:`_with_norm_weights` says, whose checks the two-norm case inlines).

    The form reads no tensor: what else an in-place call's checks read of its tensors is implied
    by the guarded metadata (a tensor that needs no grad is a leaf) or checked by the plan's
    guard (:func:`_in_grad_state`). Inference mode is the exception: inside it a normal
    tensor's dispatch keys read as an inference tensor's do outside it, so a guard made there
    would accept, outside, an inference tensor, which torch forbids writing there."""
    tensors = (t,)
    # a plan's key holds split as a tuple (TE's qkv_split_arg_list is a list) of exact ints: 8.0
    # and tensor(8) equal 8 and would reuse its plan, so check_call sees any other split (and
    # any grad_in_place but a bool: 1 == True would find its plan)
    if split is not None and (type(split) not in (list, tuple) or {*map(type, split)} != {int}
                              ) or type(grad_in_place) is not bool:
        return None
    if k is not None:
        if type(k) is not _Tensor or k is t:
            return None
        tensors = (t, k)
    if k_freqs is not None and k_freqs is not freqs:
        return None
    index = positions if start_positions is None else start_positions
    if index is not None:
        if (
            type(index) is not _Tensor or (start_positions is not None and positions is not None)
            or call_module._reads(index)
        ):
            return None
        tensors += (index,)
    if q_norm is None and k_norm is None:
        q_form = k_form = None
    elif type(q_norm) is HeadNorm and type(k_norm) is HeadNorm:  # decode with QK-norm: inline
        q_weight, k_weight = q_norm.weight, k_norm.weight
        # (an index tensor is an integer one: it cannot require grad; no generator: a decode
        # step's host path)
        if type(q_weight) not in PLAIN_TENSORS or type(k_weight) not in PLAIN_TENSORS or (
                _grad_enabled() and (t.requires_grad or (k is not None and k.requires_grad)
                                     or q_weight.requires_grad or k_weight.requires_grad)):
            return None
        tensors += (q_weight, k_weight)
        q_form, k_form = q_norm.form, k_norm.form
    else:
        normed = _with_norm_weights(tensors, q_norm, k_norm)
        if normed is None:
            return None
        tensors, q_form, k_form = normed
    form = (
        in_place, in_place and _inference_mode(), grad_in_place, start_positions is None,
        positions is None, k is None, split and tuple(split), q_form, k_form,
    )
    return tensors, form


def _with_norm_weights(tensors: tuple, q_norm: object, k_norm: object) -> tuple | None:
    """``(tensors and the norm weights, q's norm form, k's)`` for a planned form (at least one
    norm given; q's weight first): a plan takes the weights with each call, as its other
    tensors, so its key holds the norms' forms and no weight's identity (no ``id()``: 0.18 us a
    call on Python 3.12), and the layers of a model share one plan. ``None`` (checked every
    time) for what is not a :class:`HeadNorm` of a plain weight, and where a gradient may be
    wanted: the weights are then inputs of the autograd graph. Tuples grow by ``+``: on a
    decode step's host path unpacking into a new tuple costs more."""
    q_form = k_form = None
    if q_norm is not None:
        if type(q_norm) is not HeadNorm or type(q_norm.weight) not in PLAIN_TENSORS:
            return None
        tensors += (q_norm.weight,)
        q_form = q_norm.form
    if k_norm is not None:
        if type(k_norm) is not HeadNorm or type(k_norm.weight) not in PLAIN_TENSORS:
            return None
        tensors += (k_norm.weight,)
        k_form = k_norm.form
    if _grad_enabled():
        for x in tensors:
            if x.requires_grad:
                return None
    return tensors, q_form, k_form


def _run(
    t: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
    backend: str | None, in_place: bool, grad_in_place: bool,
    split: tuple[int, int, int] | None = None, k_freqs: object = None,
    positions: torch.Tensor | None = None, k: torch.Tensor | None = None,
    norms: tuple = (None, None),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Every public call's path: its plan when one matches (see :func:`apply`), else the
    checks, the choice and the backend, then a plan for the next such call. ``norms``: q's
    (or ``t``'s) and k's :class:`~rope_dispatch.HeadNorm`, passed to a plan with each call."""
    global _recent_run
    if type(t) is not _Tensor and distributed(t):
        return _dtensor().rotate(t, freqs, spec, start_positions, positions, backend,
                                 in_place=in_place, split=split, k_freqs=k_freqs, k=k, norms=norms)
    key = None
    normed = norms[0] is not None or norms[1] is not None
    if type(t) is _Tensor and not _dynamo_compiling() and (
            backend is None or type(backend) is str):  # as apply's lookup
        if (
            start_positions is None and positions is None and k is None and split is None
            and not in_place and not normed
        ):
            inputs = (t,), None  # a plain single tensor: the form apply's own lookup uses
        else:
            inputs = _planned_form(
                t, freqs, start_positions, positions, k, k_freqs, split, in_place, grad_in_place,
                norms[0], norms[1],
            )
        if inputs is not None:
            tensors, form = inputs
            # the forced name as set (use_backend's, else ROPE_BACKEND's stored value)
            forced = backend if backend is not None else (_forced_get() or _env_backend_raw())
            entry = _recent_run
            if (
                entry is None or entry.refs[0]() is not spec or entry.refs[1]() is not freqs
                or entry.forced is not forced or entry.form != form
            ):
                try:
                    entry = _plans.get((id(spec), id(freqs), forced, form))
                except TypeError:  # an unhashable backend=: the checks name it
                    entry = None
                if entry is not None:
                    _recent_run = entry
            if entry is not None:
                for guard, address, planned_address, run in entry.plans:
                    if guard(*tensors) and address(freqs) == planned_address:
                        return run(t, freqs, spec, start_positions, positions, k, norms)
            key = (id(spec), id(freqs), forced, form)
    _refuse_torchscript()
    try:
        call = check_call(t, freqs, spec, start_positions, in_place=in_place,
                          grad_in_place=grad_in_place, split=split, k_freqs=k_freqs,
                          positions=positions, k=k, q_norm=norms[0], k_norm=norms[1])
        forgotten = _forgotten
        chosen, final = _choose(call, backend)
        out = chosen.apply(call)
    except (RuntimeError, NotImplementedError, TypeError) as error:  # a DTensor beside t?
        refuse_dtensors_beside(error, t, freqs, k_freqs, k, start_positions, positions, norms)
        raise
    if key is not None and final and not reads_values(spec) and spec.mrope_section is None:
        # planned after the call ran, so a backend can bind what that call compiled
        _keep_plan(key, tensors, spec, freqs, chosen, call, forgotten)
    return out


def _refuse_torchscript() -> None:
    """TorchScript records torch ops only: a kernel launched by a backend would be missing from
    its graph (wrong outputs), so ``torch.jit.trace`` is refused by name. (A plan's guard
    fails under it, so every traced call comes here.)"""
    if torch.jit.is_tracing():
        raise RoPEError(
            "torch.jit.trace cannot record rope-dispatch's calls (its backends launch kernels "
            "TorchScript does not see); use torch.export.export (a bounded Dim for a dynamic "
            "length) or torch.compile, which trace them"
        )


def _dtensor():
    """:mod:`rope_dispatch.dtensor` (its op and sharding rule registered at first import; the
    op's body runs :func:`_run` on each shard, found through ``registry.call_entry``)."""
    from . import dtensor

    return dtensor


registry.set_call_entry(_run)


def _in_grad_state(
    guard: Guard, enabled: bool, leaves: tuple[bool, ...] | None, table: weakref.ref
) -> Guard:
    """``guard``, and the gradient mode the plan was made in: what a plan runs for tensors that
    require grad depends on it (an autograd node or none). Tensors that need no grad run the
    same either way while the table needs none (:func:`~.guards.constant_table`). With grad
    enabled, the plan's table (by weak reference) must still not require grad: such calls need
    a backend that differentiates it, and are never planned. ``leaves``: for an in-place plan
    made with grad enabled, which tensors were leaves or views of one
    (:func:`~rope_dispatch.call.grad_leaf`; none of those that require grad, or the call would
    have been refused), checked too: such a tensor that requires grad must be refused again."""
    if not enabled:  # no gradient is asked of anything, the table's neither
        def check(*tensors: torch.Tensor) -> bool:
            return not _grad_enabled() and guard(*tensors)
    elif leaves is None:
        def check(*tensors: torch.Tensor) -> bool:
            return _grad_enabled() and guard(*tensors) and not table_requires_grad(table())
    else:
        def check(*tensors: torch.Tensor) -> bool:
            return (
                _grad_enabled() and guard(*tensors) and not table_requires_grad(table())
                and tuple(grad_leaf(x) for x in tensors) == leaves
            )

    return check


def _keep_plan(
    key: tuple, tensors: tuple[torch.Tensor, ...], spec: RoPESpec, freqs: object,
    chosen: Backend, call: RoPECall, forgotten: int,
) -> None:
    """Put ``chosen``'s plan for ``call`` first among ``key``'s plans, guarded by ``tensors``'
    metadata, in place of any plan those tensors would have met (one whose table has since
    moved). A key is planned the second time it is met: a spec or table made for one call (a
    new spec per step) would pay for a plan, about 6 us on the development CPU, and never use
    it. ``forgotten``: :data:`_forgotten` before the call was decided."""
    global _recent, _recent_run, _recent_cache
    if table_requires_grad(freqs):
        return  # needs a backend that differentiates the table while grad is on: never planned
    if transformed() or _dispatch_modes():  # torch.func's wrappers: no addresses to guard
        return  # on; a dispatch mode (a selective checkpoint's) would record a plan's ops
    entry = _plans.get(key)
    if entry is None:
        if key not in _met_once:
            if len(_met_once) >= _MAX_PLANS:
                _met_once.clear()
            _met_once.add(key)  # a reused id only makes a later key planned a call early
            return
        _met_once.discard(key)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        drop = _dropper(key)
        entry = _PlanSet((weakref.ref(spec, drop), weakref.ref(freqs, drop)), (), key[2], key[3])
    address = _data_ptr if type(freqs) is _Tensor else address_reader(freqs)
    kept = tuple(p for p in entry.plans if not p.guard(*tensors))[: _MAX_PLANS_PER_KEY - 1]
    guard = tensor_guard(*tensors)
    if any(x.requires_grad for x in tensors):
        enabled = _grad_enabled()
        leaves = tuple(grad_leaf(x) for x in tensors) if enabled and call.in_place else None
        guard = _in_grad_state(guard, enabled, leaves, weakref.ref(freqs))
    else:  # no autograd node while the table needs no gradient either (it may come to)
        guard = constant_table(guard, weakref.ref(freqs))
    weights = tuple(n.weight for n in (call.norm, call.k_norm) if n is not None)
    tables = table_tensors(freqs) if call.in_place else ()  # the caller's, whose address it guards
    if call.in_place and (call.k is not None or weights or tables):
        guard = apart_as_planned(guard, call.t, call.k, weights, tables)
    run = chosen.plan(call)
    if run is None:  # a cache stage the backend does not bind: checked every call
        return
    _plans[key] = entry._replace(plans=(_Plan(guard, address, address(freqs), run), *kept))
    _recent = _recent_run = _recent_cache = None
    if forgotten != _forgotten:  # decided before another thread forgot every plan: as _choose's
        _plans.pop(key, None)


def rope_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    positions: torch.Tensor,
    cache: KVCache,
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
    q_out: torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """A serving step's prologue: norm (optional), rotate q and k at ``positions``, write the
    rotated k and ``v`` into ``cache`` at each token's slot, and return q rotated.

    ``q`` ``[T, heads, d]``, ``k`` ``[T, kv_heads, d]`` and ``v`` ``[T, kv_heads, dv]`` (GQA,
    MQA; any strides; ``dv`` may differ from ``d``, the v cache's head dim then ``dv``: MLA's
    compressed kv beside the rotated key part),
    ``spec`` of layout ``"thd"``, ``positions`` ``[T]`` each token's table row (any table kind).
    ``cache``: a :class:`~rope_dispatch.PagedKVCache` (vLLM), a
    :class:`~rope_dispatch.FlashInferPagedKVCache` or a :class:`~rope_dispatch.FlatKVCache`
    (SGLang), of the model's dtype or FP8 (``x / scale``, the division in float32, cast as
    torch casts within the range; past it the Triton kernels saturate); with partial rotary,
    the channels past it go into the cache as they are. A token the cache skips (a negative
    slot, CUDA-graph padding) is still rotated in q. q comes back new in q's dtype, or written
    into ``q_out`` (q's dtype or FP8); an FP8 ``q_out`` or a ``q_scale`` (default
    ``float8_e4m3fn``) stores ``q / q_scale``. No host sync on a GPU; not
    differentiable. A repeated call (same spec, table, cache kind and scales, tensors of the
    same layouts; their data and the cache's index values may change) runs its plan, as
    :func:`apply`'s do: keep the descriptor, or rebuild it per step, as the engine does.
    """
    global _recent_cache
    key = None
    if not _dynamo_compiling() and (backend is None or type(backend) is str):  # as apply's
        inputs = _cache_form(q, k, v, positions, cache, q_out, q_scale, q_norm, k_norm)
        if inputs is not None:
            tensors, form = inputs
            forced = backend if backend is not None else (_forced_get() or _env_backend_raw())
            entry = _recent_cache  # as _run's lookup: a repeated step's needs neither the
            if (  # key's ids nor its hash
                entry is None or entry.refs[0]() is not spec or entry.refs[1]() is not freqs
                or entry.forced is not forced or entry.form != form
            ):
                try:
                    entry = _plans.get((id(spec), id(freqs), forced, form))
                except TypeError:  # an unhashable backend=: the checks name it
                    entry = None
                if entry is not None:
                    _recent_cache = entry
            if entry is not None:
                for guard, address, planned_address, run in entry.plans:
                    if guard(*tensors) and address(freqs) == planned_address:
                        out = run(freqs, tensors)
                        if out is not NotImplemented:
                            return out
                        break
            key = (id(spec), id(freqs), forced, form)
    if any(type(x) is not _Tensor and distributed(x) for x in (q, k, v)):
        raise RoPEError(
            "DTensor call: rope_to_cache writes into a KV cache of plain tensors, a serving "
            "step's; pass each rank's local tensors (DTensor.to_local())"
        )
    _refuse_torchscript()
    call = check_cache_call(q, k, v, freqs, spec, positions=positions, cache=cache,
                            q_norm=q_norm, k_norm=k_norm, q_out=q_out, q_scale=q_scale)
    forgotten = _forgotten
    chosen, final = _choose(call, backend)
    out = chosen.apply(call)
    if key is not None and final:
        _keep_plan(key, tensors, spec, freqs, chosen, call, forgotten)
    return out


def _cache_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cache: KVCache,
    q_out: torch.Tensor | None, q_scale: object, q_norm: object, k_norm: object,
) -> tuple[tuple[torch.Tensor, ...], tuple] | None:
    """A :func:`rope_to_cache` call's planned form, as :func:`_planned_form`'s: the guarded
    tensors (q, k, v, positions, the cache's ``plan_parts``, q's scale tensor, ``q_out`` unless
    it is q, the norm weights) and what the key fixes (the cache's part, worked out when it was
    made; q's scale and output; the norms' forms); ``None`` where it is checked every time
    (tensor subclasses, values read on the host, arguments the checks refuse)."""
    parts = getattr(cache, "plan_parts", None)
    if (
        parts is None or type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor
        or type(positions) is not _Tensor or (q_out is not None and type(q_out) is not _Tensor)
        or call_module._reads(positions)
    ):
        return None
    tensors = (q, k, v, positions) + parts[0]
    scale = type(q_scale)
    if scale is _Tensor:
        tensors += (q_scale,)
        scale = "tensor"
    elif q_scale is None or scale is float or scale is int:
        scale = q_scale
    else:
        return None
    if q_out is not None and q_out is not q:  # q in place: the key says so, q is guarded
        tensors += (q_out,)
    if q_norm is None and k_norm is None:
        q_form = k_form = None
    else:
        normed = _with_norm_weights(tensors, q_norm, k_norm)
        if normed is None:
            return None
        tensors, q_form, k_form = normed
    return tensors, ("cache", parts[1], scale, q_out is None, q_out is q, _inference_mode(),
                     q_form, k_form)


@dataclass
class Explanation:
    """Which backend a call would run on and why; every other backend's reasons."""

    call: str
    chosen: str | None
    why: str
    rejected: dict[str, list[str]] = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"call: {self.call}"]
        if self.chosen is None:
            lines.append(f"no backend: {self.why}")
        else:
            lines.append(f"backend: {self.chosen} ({self.why})")
            if self.chosen in self.notes:
                lines.append(f"  note: {self.notes[self.chosen]}")
        for name in self.passed_over:
            note = f"; {self.notes[name]}" if name in self.notes else ""
            lines.append(f"  - {name}: could serve it, not chosen{note}")
        for name, reasons in self.rejected.items():
            lines.append(f"  - {name}: {'; '.join(reasons)}")
        return "\n".join(lines)


def explain(
    t: torch.Tensor,
    freqs: torch.Tensor | RotaryTable,
    spec: RoPESpec,
    *,
    start_positions: torch.Tensor | None = None,
    backend: str | None = None,
    in_place: bool = False,
    split: tuple[int, int, int] | None = None,
    k_freqs: torch.Tensor | RotaryTable | None = None,
    positions: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
    v: torch.Tensor | None = None,
    cache: KVCache | None = None,
    q_out: torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    norm: HeadNorm | None = None,
) -> Explanation:
    """Which backend :func:`apply` (:func:`apply_` with ``in_place=True``, :func:`apply_qkv`
    with ``split``, :func:`apply_qk` with ``k``; ``q_norm`` is ``t``'s norm stage, ``k_norm``
    k's; ``norm``, as :func:`apply` names it, is ``q_norm``) would run for this call, why, and
    why not the others.

    It measures nothing: where the autotune cache holds no entry yet, it says the first call
    would measure the candidates. With a ``cache`` (and ``v``, ``q_out``, ``q_scale``) it
    explains :func:`rope_to_cache` of q ``t``, ``k`` and ``v``.
    """
    foreign = ((("start_positions", start_positions), ("split", split), ("k_freqs", k_freqs),
                ("in_place", in_place or None)) if cache is not None
               else (("v", v), ("q_out", q_out), ("q_scale", q_scale)))
    if norm is not None:  # apply's name for t's norm stage
        if q_norm is not None:
            raise RoPEError("norm and q_norm both given: norm is apply's name for q_norm; "
                            "give one")
        q_norm = norm
    if named := [name for name, value in foreign if value is not None]:  # refused, not ignored
        raise RoPEError(f"{', '.join(named)} given with cache=: rope_to_cache takes none of "
                        "start_positions, split, k_freqs, in_place" if cache is not None else
                        "v, q_out and q_scale are rope_to_cache's: explain it with cache= too")
    if type(t) is not _Tensor and distributed(t) and cache is None:  # this rank's shard call
        t, freqs, spec, positions, k, (q_norm, k_norm) = _dtensor().shard_call(
            t, freqs, spec, start_positions, positions, in_place=in_place, k_freqs=k_freqs, k=k,
            norms=(q_norm, k_norm), split=split)
        start_positions = k_freqs = None
    if cache is not None:
        call = check_cache_call(t, k, v, freqs, spec, positions=positions, cache=cache,
                                q_norm=q_norm, k_norm=k_norm, q_out=q_out, q_scale=q_scale)
    else:
        call = check_call(t, freqs, spec, start_positions, in_place=in_place, split=split,
                          k_freqs=k_freqs, positions=positions, k=k, q_norm=q_norm, k_norm=k_norm)
    forced, source = requested_backend(backend)
    supported, rejected = capable_backends(call)
    notes = {b.name: n for b in registry.backends() if (n := getattr(b, "explain_note", lambda c: "")(call))}
    if forced is not None:
        b = registry.get_backend(forced, source)
        if b.name in rejected:
            why = f"{forced!r} was forced by {source} but cannot serve it"
            return Explanation(_describe(call), None, why, rejected, [], notes)
        others = [s.name for s in supported if s is not b]
        return Explanation(_describe(call), b.name, f"forced by {source}", rejected, others, notes)
    if not supported:
        return Explanation(_describe(call), None, "every backend refused", rejected, [], notes)
    chosen, why = ((supported[0], "the only backend that supports this call")
                   if len(supported) == 1 else autotune.peek(call, supported))
    others = [s.name for s in supported if s is not chosen]
    return Explanation(_describe(call), chosen.name, why, rejected, others, notes)
