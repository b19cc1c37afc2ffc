"""The backend registry: interchangeable implementations that say *why not* in sentences.

A backend has three separate parts, after xformers' and vLLM's dispatchers:

- static availability (:meth:`Backend.unavailable_reasons`): is its package importable, is there a
  device for it. Evaluated once per process and cached.
- per-call support (:meth:`Backend.not_supported_reasons`): layout, dtype, device, features and
  sizes of one :class:`~rope_dispatch.call.RoPECall`. Capabilities are class attributes, so
  the generic checks here cover most of it; :meth:`Backend.extra_reasons` adds the rest.
- priority (:attr:`Backend.priority`): the fallback policy when nothing was measured.

A check returns a list of sentences with the actual values; an empty list means "supported".
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .call import TENSOR_KINDS, RoPECall, table_grad_wanted
from .errors import RoPEError, RoPETypeError, UnknownBackendError
from .spec import RoPESpec, dtype_name
from .table_kinds import TABLE_KINDS
from .tables import angles_2d, table_kind
from .tracing import constant_while_tracing

ALL_LAYOUTS = frozenset({"sbhd", "bshd", "thd"})
Plan = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
"""``run(t, freqs, spec, start_positions, positions, k, norms)``: see :meth:`Backend.plan`."""
ALL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Backend:
    """One way to run RoPE. Subclasses set the capability attributes and implement :meth:`apply`."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    layouts: ClassVar[frozenset[str]] = ALL_LAYOUTS
    dtypes: ClassVar[frozenset[torch.dtype]] = ALL_DTYPES
    supports_interleaved: ClassVar[bool] = True
    supports_context_parallel: ClassVar[bool] = True
    supports_start_positions: ClassVar[bool] = True
    supports_positions: ClassVar[bool] = False  # per-token positions (apply(..., positions=))
    tables: ClassVar[frozenset[str]] = frozenset({"angles", "cos_sin_cache"})
    """The table kinds it reads (:func:`~rope_dispatch.tables.table_kind`): ``"angles"``,
    ``"cos_sin_cache"`` (:class:`~rope_dispatch.CosSinCache`), ``"pair_cos_sin_cache"``
    (:class:`~rope_dispatch.PairCosSinCache`), ``"rates"`` (:class:`~rope_dispatch.RateTable`),
    ``"precise_rates"`` (a RateTable made with ``precise=True``: list it only where the backend
    honours the exact angles, as :meth:`~rope_dispatch.RateTable.angle_table` gives them)."""
    supports_autograd: ClassVar[bool] = True
    differentiates_table: ClassVar[bool] = False  # a gradient for a table that requires grad
    supports_in_place: ClassVar[bool] = False
    supports_norm: ClassVar[bool] = False
    """A norm stage before the rotation (:class:`~rope_dispatch.HeadNorm`)."""
    supports_inverse: ClassVar[bool] = False
    """The rotation by minus the angle (``RoPESpec.inverse``), forward and backward."""
    supports_rotary_offset: ClassVar[bool] = False
    """Rotary channels that start past a head's first channel (``RoPESpec.rotary_offset``)."""
    supports_deinterleave: ClassVar[bool] = False
    """Interleaved pairs in, halves out (``RoPESpec.deinterleave``), forward and backward."""
    supports_cache_write: ClassVar[bool] = False
    """A KV-cache stage after the rotation (:func:`~rope_dispatch.rope_to_cache`): rotated k and
    v written, quantized where the cache is FP8, at each token's slot of a cache descriptor."""
    supports_cache_v_head_dim: ClassVar[bool] = False
    """In that stage, a v (and v cache) whose head dim differs from k's: MLA's compressed kv
    written beside the rotated key part, or a model whose v heads are narrower than its k."""
    tensors: ClassVar[frozenset[str]] = frozenset({"t"})
    """The call kinds it serves (:data:`~rope_dispatch.call.TENSOR_KINDS`): ``"t"`` single
    tensors, ``"qkv"`` packed qkv tensors."""
    max_numel: ClassVar[int | None] = None
    compiles_per_spec: ClassVar[bool] = False
    """Its first call of each spec compiles code for seconds (``torch.compile``): the selftest
    checks it on one case unless asked to be thorough."""
    heavy_import: ClassVar[bool] = False
    """Probing it imports packages that take seconds to load (TransformerEngine, Dynamo): where
    the selftest checks CUDA, it probes and checks such a backend in a process of its own."""

    def unavailable_reasons(self) -> list[str]:
        """Why this backend cannot run in this process at all (missing package, no device)."""
        return []

    def extra_reasons(self, call: RoPECall) -> list[str]:
        """Backend-specific per-call reasons beyond the capability attributes."""
        return []

    def apply(self, call: RoPECall) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run RoPE on a checked call; differentiable with respect to ``call.t``. A packed qkv
        call returns ``(q, k, v)``, new contiguous tensors (q ``[.., h * q/d, d]``, k
        ``[.., h, k]``, v ``[.., h, v]`` for ``split = (q, k, v)``, ``d = k``)."""
        raise NotImplementedError

    def plan(self, call: RoPECall) -> Plan | None:
        """A function ``run(t, freqs, spec, start_positions, positions, k, norms)`` that runs
        this backend on a call equal to ``call`` but for its tensors' data (same spec and table
        objects; same shapes, strides, dtypes, devices and gradient mode of ``t``, ``k``, the
        index tensor, whose values are not read, and the norm weights), which dispatch keeps for
        repeated calls. It gets the spec, the table and the call's ``(q_norm, k_norm)`` with
        each call and keeps no tensor of the call: a plan must not keep a table alive. The
        default rebuilds the call around the new tensors; a backend may prepare more (the
        Triton backend binds its launch). A call with a cache stage
        (:func:`~rope_dispatch.rope_to_cache`) gets ``run(freqs, tensors)``, ``tensors`` as
        dispatch's ``_cache_form`` orders them, then the norm weights, from a backend that
        binds one, else ``None`` (the default: such calls are checked each time).
        """
        assert call.k_table is None, "calls with a separate k table are never planned"
        if call.cache_write is not None:
            return None  # a backend binds a cache stage's plan itself, or the call is checked
        # the sizes and settings the plan's key fixes, without the call's tensors
        form = call._replace(t=None, table=None, spec=None, start_positions=None, positions=None,
                             k=None, norm=None, k_norm=None)
        run = self.apply

        def run_call(
            t: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
            positions: torch.Tensor | None, k: torch.Tensor | None, norms: tuple,
        ) -> torch.Tensor | tuple[torch.Tensor, ...]:
            # an angle table as [s2, d2]; caches and rate tables pass as they are
            table = angles_2d(freqs) if table_kind(freqs) == "angles" else freqs  # type: ignore[arg-type]
            return run(form._replace(t=t, table=table, spec=spec, start_positions=start_positions,
                                     positions=positions, k=k, norm=norms[0], k_norm=norms[1]))

        return run_call

    @property
    def availability(self) -> tuple[str, ...]:
        """:meth:`unavailable_reasons`, evaluated once per process; a crash in the probe is a
        reason too."""
        if _REGISTRY.get(self.name) is self:
            # read through _probe, constant while tracing: traced code must not branch on the
            # cache, which the probe fills at trace time (a restarted trace, as Dynamo's for a
            # dynamic float, would take the other branch: SpeculationLog divergence)
            return _probe(self.name)
        cached = self.__dict__.get("_availability")
        return _run_probe(self) if cached is None else cached

    @property
    def available(self) -> bool:
        return not self.availability

    def not_supported_reasons(self, call: RoPECall) -> list[str]:
        """Every reason this backend cannot serve ``call``; empty when it can."""
        if self.availability:
            return list(self.availability)
        reasons = []
        t, spec = call.t, call.spec
        if call.tensors not in self.tensors:
            served = ", ".join(TENSOR_KINDS[kind] for kind in sorted(self.tensors))
            reasons.append(f"{TENSOR_KINDS[call.tensors]} are not supported; supports {served}")
        if t.device.type not in self.devices:
            reasons.append(
                f"tensor is on {t.device.type}; supports {', '.join(sorted(self.devices))}"
            )
        if spec.layout not in self.layouts:
            reasons.append(
                f"layout {spec.layout!r} is not supported; supports {', '.join(sorted(self.layouts))}"
            )
        if t.dtype not in self.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in self.dtypes))
            reasons.append(f"dtype {dtype_name(t.dtype)} is not supported; supports {names}")
        if spec.interleaved and not self.supports_interleaved:
            reasons.append("interleaved=True is not supported")
        if spec.cp_size > 1 and not self.supports_context_parallel:
            reasons.append(f"context parallelism (cp_size={spec.cp_size}) is not supported")
        if call.start_positions is not None and not self.supports_start_positions:
            reasons.append("start_positions is not supported")
        if call.positions is not None and not self.supports_positions:
            reasons.append("per-token positions are not supported")
        if call.table_kind not in self.tables:
            reasons.append(
                f"a {call.table_kind} table is not supported; reads {', '.join(sorted(self.tables))}"
            )
        if (call.norm is not None or call.k_norm is not None) and not self.supports_norm:
            reasons.append(
                "a norm before the rotation (norm=, q_norm=, k_norm=: HeadNorm) is not supported"
            )
        if spec.inverse and not self.supports_inverse:
            reasons.append("the inverse rotation (spec.inverse=True) is not supported")
        if spec.rotary_offset and not self.supports_rotary_offset:
            reasons.append(
                f"rotary channels past a head's first channel (spec.rotary_offset="
                f"{spec.rotary_offset}) are not supported; it rotates channels [0, d2) only"
            )
        if spec.deinterleave and not self.supports_deinterleave:
            reasons.append(
                "interleaved pairs in, halves out (spec.deinterleave=True) is not supported"
            )
        if call.cache_write is not None and not self.supports_cache_write:
            reasons.append(
                "a KV-cache write after the rotation (rope_to_cache) is not supported"
            )
        elif (call.cache_write is not None and call.cache_write.v_head_dim is not None
                and not self.supports_cache_v_head_dim):
            reasons.append(
                f"a v head dim of its own in the KV-cache write (v {call.cache_write.v_head_dim}, "
                f"k {call.k.shape[-1]}) is not supported"
            )
        if call.in_place and not self.supports_in_place:
            reasons.append("in-place rotation (apply_) is not supported; it writes a new tensor")
        if t.requires_grad and torch.is_grad_enabled() and not self.supports_autograd:
            reasons.append("t requires grad but this backend has no backward")
        if not self.differentiates_table and table_grad_wanted(call.table, call.k_table):
            reasons.append(
                "the table requires grad, and this backend computes no gradient for it (it "
                "treats the table as a constant, as TransformerEngine's fused kernel does); "
                "pass freqs.detach() for a constant table"
            )
        if self.max_numel is not None and t.numel() > self.max_numel:
            reasons.append(f"t has {t.numel():,} elements; at most {self.max_numel:,} supported")
        if not reasons:
            extra = self.extra_reasons(call)
            reasons.extend((extra,) if isinstance(extra, str) and extra else extra)
        return reasons


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`list_backends` reports for one backend."""

    name: str
    available: bool
    reasons: tuple[str, ...]
    priority: int
    description: str

    def __str__(self) -> str:
        state = "available" if self.available else "unavailable: " + "; ".join(self.reasons)
        return f"{self.name} (priority {self.priority}): {state}"


_REGISTRY: dict[str, Backend] = {}
_BUILT_INS_LOADED = False
_loading = False  # the importing thread's own register() calls come back to _load_built_ins
_LOAD_LOCK = threading.RLock()


@constant_while_tracing
def _load_built_ins() -> bool:
    """Register the built-in backends (importing :mod:`rope_dispatch.backends` does) before the
    registry's first use. ``import rope_dispatch`` loads nothing by itself, so a program that
    imports a submodule directly (``from rope_dispatch.compat.te import ...``) still finds them.
    Other threads' first calls (``nn.DataParallel`` replicas, a serving thread pool) wait for
    the import rather than find the registry empty. Opaque to torch.compile, where a process's
    first call may be traced: the import would break the graph."""
    global _BUILT_INS_LOADED, _loading
    if not _BUILT_INS_LOADED:
        with _LOAD_LOCK:
            if not (_BUILT_INS_LOADED or _loading):
                _loading = True
                try:
                    importlib.import_module("rope_dispatch.backends")
                    _BUILT_INS_LOADED = True
                finally:
                    _loading = False
    return True


_on_invalidate: list[Callable[[], None]] = []


def on_invalidate(callback: Callable[[], None]) -> None:
    """Have ``callback`` run whenever decisions made so far may no longer hold: a backend
    registered or removed, measurements forgotten. Dispatch subscribes its caches, so this
    module never imports it."""
    _on_invalidate.append(callback)


_call_entry: list[Callable[..., object]] = []


def set_call_entry(run: Callable[..., object]) -> None:
    """Dispatch hands over its call path (``_run``) at import, for code that runs a call but
    must not import dispatch (the DTensor op's body, on each shard)."""
    _call_entry[:] = [run]


def call_entry() -> Callable[..., object]:
    """The call path :func:`set_call_entry` was given (dispatch is loaded by then)."""
    if not _call_entry:
        from importlib import import_module

        import_module(f"{__package__}.dispatch")  # sets it
    return _call_entry[0]


def invalidate() -> None:
    """Tell every subscriber (:func:`on_invalidate`) that cached decisions are stale."""
    for callback in _on_invalidate:
        callback()


def register(backend: Backend) -> Backend:
    """Add a backend instance under its ``name`` (a later registration replaces an earlier one,
    a built-in one included). Anything else is refused by name here: once registered, it would
    fail every call of the process (a class's methods want an instance)."""
    if not isinstance(backend, Backend):
        hint = (f"; register an instance: register({backend.__name__}())"
                if isinstance(backend, type) and issubclass(backend, Backend) else "")
        raise RoPETypeError(
            f"register() takes an instance of rope_dispatch.Backend, got {backend!r}{hint}")
    name, priority = getattr(backend, "name", None), getattr(backend, "priority", None)
    if type(name) is not str or not name:
        raise RoPETypeError(
            f"a backend's name must be a non-empty string, got {name!r} ({type(backend).__name__})")
    if type(priority) not in (int, float):
        raise RoPETypeError(
            f"backend {name!r}: priority must be a number (higher is tried first), "
            f"got {priority!r}")
    if priority != priority:  # NaN: unordered, it would misplace other backends in the order
        raise RoPEError(f"backend {name!r}: priority must be a number (higher is tried first), "
                        f"got {priority!r}")
    problem = _declared_problem(backend)
    if problem is not None:
        raise RoPEError(f"backend {name!r}: {problem}")
    _load_built_ins()
    _REGISTRY[backend.name] = backend
    invalidate()
    return backend


_TABLE_NAMES = frozenset({*TABLE_KINDS.values(), "precise_rates"})


def _declared_problem(backend: Backend) -> str | None:
    """What is wrong with the capabilities ``backend`` declares (``None``: nothing). A name
    no call can have (``"SBHD"``, ``"bf16"`` for ``torch.bfloat16``, a tensor kind) refused
    every call with a reason that contradicted itself ("dtype bfloat16 is not supported;
    supports bf16"), or crashed each call (an unknown tensor kind)."""
    def declared(attr: str) -> object:  # a property (triton's devices) is not run: it probes
        value = inspect.getattr_static(backend, attr, None)
        return _COMPUTED if isinstance(value, property) else value

    def names_set(value: object) -> bool:
        return value is _COMPUTED or isinstance(value, Collection) and not isinstance(
            value, (str, bytes))

    known = {
        "layouts": (ALL_LAYOUTS, "layout names"), "tables": (_TABLE_NAMES, "table kinds"),
        "tensors": (frozenset(TENSOR_KINDS), "call kinds"),
    }
    for attr, (allowed, what) in known.items():
        value = declared(attr)
        if not names_set(value) or value is not _COMPUTED and not all(
                isinstance(v, Hashable) and v in allowed for v in value):
            return f"{attr} must be a set of {what} among {sorted(allowed)}, got {value!r}"
    dtypes = declared("dtypes")
    if not names_set(dtypes) or dtypes is not _COMPUTED and not all(
            isinstance(d, torch.dtype) for d in dtypes):
        names = ", ".join(f"torch.{dtype_name(d)}" for d in sorted(ALL_DTYPES, key=str))
        return f"dtypes must be a set of torch dtypes (of {names}), got {dtypes!r}"
    devices = declared("devices")
    if not names_set(devices) or devices is not _COMPUTED and not all(
            type(d) is str and d == d.strip().lower() and d for d in devices):
        return f"devices must be a set of device types such as 'cpu', 'cuda', got {devices!r}"
    return None


_COMPUTED = object()  # a capability a property computes (_declared_problem leaves it alone)


def unregister(name: str) -> Backend:
    """Remove the backend registered as ``name`` and return it (tests, plugins being unloaded)."""
    backend = get_backend(name)
    del _REGISTRY[name]
    invalidate()
    return backend


@constant_while_tracing
def _probe(name: str) -> tuple[str, ...]:
    """Run a backend's availability probe once; opaque to torch.compile, which would otherwise
    trace the optional imports inside it."""
    backend = _REGISTRY[name]
    cached = backend.__dict__.get("_availability")
    return _run_probe(backend) if cached is None else cached


def _run_probe(backend: Backend) -> tuple[str, ...]:
    try:
        found = backend.unavailable_reasons()
        # one sentence returned bare is one reason, not its letters
        reasons = (found,) if isinstance(found, str) else tuple(str(r) for r in found)
    except Exception as exc:  # an optional package that is broken, not merely missing
        reasons = (f"probing it raised {type(exc).__name__}: {exc}",)
    backend.__dict__["_availability"] = reasons
    return reasons


def backends() -> list[Backend]:
    """Registered backends, highest priority first."""
    _load_built_ins()
    return sorted(_REGISTRY.values(), key=lambda b: -b.priority)


def get_backend(name: str, source: str | None = None) -> Backend:
    """The backend registered as ``name``; an unknown name lists the known ones (and says
    where the name came from: ``source``, such as "the ROPE_BACKEND environment variable")."""
    # loaded before the registry is first read, and unconditionally: traced code that read
    # _REGISTRY before the load (constant while tracing, run behind Dynamo's back) would keep
    # seeing it empty, and a branch on the loaded state would diverge on a restarted trace
    _load_built_ins()
    backend = _REGISTRY.get(name) if isinstance(name, str) else None
    if backend is None:  # no try/except: `raise ... from None` breaks torch.compile tracing
        known = ", ".join(sorted(_REGISTRY))
        given = "" if source is None else f" (forced by {source})"
        close = name.strip().lower() if isinstance(name, str) else None
        hint = f"; did you mean {close!r}?" if close in _REGISTRY and close != name else ""
        raise UnknownBackendError(
            f"unknown backend {name!r}{given}; known backends: {known}{hint}")
    return backend


def list_backends(names: Collection[str] | None = None) -> list[BackendInfo]:
    """Every registered backend (or those of ``names``: one name or several), whether it is
    available here, and why not; only the backends listed are probed, and a name that is not
    registered raises :class:`UnknownBackendError`."""
    if isinstance(names, str):  # one name, not its letters
        names = (names,)
    elif names is not None and (isinstance(names, (bytes, bytearray))
                                or not isinstance(names, Collection)):
        raise RoPETypeError(
            f"list_backends() takes a backend name or a collection of names, got {names!r}")
    for name in names or ():  # a misspelt name raises (listing the known ones), not skipped
        get_backend(name)
    return [
        BackendInfo(b.name, b.available, b.availability, b.priority, b.description)
        for b in backends() if names is None or b.name in names
    ]
