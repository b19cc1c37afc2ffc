"""The compile backend: ``torch.compile`` of the eager math, on CPU (C++) and CUDA (Triton).

It compiles :func:`~rope_dispatch.backends.eager.rope_tensors` itself, so it has the eager
backend's semantics by construction. The forward and its transpose (the backward) are compiled
as two separate inference graphs inside an ``autograd.Function`` that saves only the tables, as a
fused kernel would: nothing the size of the input is kept for the backward, and a second
backward through the same graph (``retain_graph=True``) works, which Inductor's own autograd
graphs refuse once they donate buffers. A call with a norm stage (:class:`~rope_dispatch.HeadNorm`)
compiles :func:`~rope_dispatch.norm.head_norm` before the rotation; the norm is not linear, so
its backward is the rotation's transpose followed by the norm's explicit gradient
(:func:`~rope_dispatch.norm.head_norm_backward`, which also gives the weight's), and it saves
the input and the weight too. An inverse spec (``RoPESpec.inverse``) runs the same pair the
other way round: the transpose forward, the rotation as its backward. One pair of compiled
functions exists per *compile key*
(layout, dtype, rotary dim, interleaving, context parallelism, table kind, whether
``start_positions`` is given, device type, the norm's form). Each gets a code object of its own,
because Dynamo keeps its cache and its recompile limit per code object: sharing one would let
a handful of specs exhaust the limit and silently fall back to eager. Sequence, batch, head and
table-length dims are marked dynamic on the compiling call, so a new sequence length or batch
reuses the compiled code (a dim of size 1 is still specialised by Dynamo, so a first call with
``s == 1`` compiles once more when a longer sequence arrives).

The first call of a new key compiles, which takes seconds; :meth:`CompileBackend.warm_up` lets
the autotuner pay that before it starts timing. Inside an outer ``torch.compile`` the backend
returns the eager math unchanged, so the outer graph traces and fuses it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import types
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from rope_dispatch.call import RoPECall, position_index
from rope_dispatch.errors import user_stacklevel
from rope_dispatch.norm import head_norm, head_norm_backward
from rope_dispatch.registry import Backend
from rope_dispatch.spec import dtype_name
from rope_dispatch.tables import CosSinCache, RateTable
from rope_dispatch.tracing import (
    _dispatch_modes, fake, forward_ad, import_dynamo, memoryless, recompile_limit_hit,
)

from .eager import rope_eager, rope_tensors


class NormKey(NamedTuple):
    """What a compiled norm stage is specialised on: the norm's form (its constants enter the
    graph) and its weight's length and dtype."""

    scope: str
    eps: float
    offset: float
    weight_len: int
    weight_dtype: str


class CompileKey(NamedTuple):
    """What a compiled function is specialised on; every other size is a dynamic dim.

    ``max_seqlen`` is left out on purpose: thd callers may pass a new one every step and it
    does not enter the math.
    """

    device: str
    layout: str
    dtype: str
    rotary_dim: int
    interleaved: bool
    cp_size: int
    cp_rank: int
    table: str
    scale: float
    index: str
    """``"positions"``, ``"starts"`` or ``""``: which index tensor the call has."""
    norm: NormKey | None = None
    offset: int = 0
    """The spec's ``rotary_offset``."""
    deinterleave: bool = False


def compile_key(call: RoPECall) -> CompileKey:
    """The :class:`CompileKey` of a checked single-tensor call."""
    spec, norm = call.spec, call.norm
    return CompileKey(
        call.t.device.type,
        spec.layout,
        dtype_name(spec.dtype),
        call.rotary_dim,
        spec.interleaved,
        spec.cp_size,
        spec.cp_rank,
        call.table_kind,
        spec.cos_sin_scale,
        "positions" if call.positions is not None else (
            "starts" if call.start_positions is not None else ""
        ),
        None if norm is None else NormKey(
            *norm.form, norm.weight.shape[0], dtype_name(norm.weight.dtype)
        ),
        spec.rotary_offset,
        spec.deinterleave,
    )


def _key_name(key: CompileKey, transpose: bool = False) -> str:
    scaled = "" if key.scale == 1.0 else "_scaled"
    norm = key.norm
    normed = "" if norm is None else (
        f"_{norm.scope}norm{norm.weight_len}{norm.weight_dtype}{'_offset' if norm.offset else ''}"
    )
    return (
        f"rope_compiled_{key.device}_{key.layout}_{key.dtype}_d{key.rotary_dim}"
        f"{'_interleaved' if key.interleaved else ''}_cp{key.cp_size}r{key.cp_rank}_{key.table}"
        f"{scaled}{'_' + key.index if key.index else ''}{normed}"
        f"{f'_at{key.offset}' if key.offset else ''}{'_deinterleave' if key.deinterleave else ''}"
        f"{'_transpose' if transpose else ''}"
    )


def _math(key: CompileKey, transpose: bool) -> Callable:
    """The eager math for ``key`` (forward, or its transpose) as a function of tensors only.

    Without a norm: ``(t, a, b, cu_seqlens, start_positions)``. With one, the forward takes the
    weight after them and normalizes first (float32, rounded once at the end, as eager); the
    backward, ``(grad, .., weight, t)``, returns ``(dt, dweight)``: the rotation's transpose in
    float32, then the norm's gradient, each rounded to its input's dtype.
    """
    rotation = dict(layout=key.layout, interleaved=key.interleaved, cp_size=key.cp_size,
                    cp_rank=key.cp_rank, scale=key.scale, transpose=transpose,
                    offset=key.offset, deinterleave=key.deinterleave)
    norm = key.norm

    def rope_compiled(t, cos, sin, cu_seqlens, start_positions, *norm_args):
        # an angle table comes as cos with sin None: rope_tensors takes the rows' sines
        if norm is None:
            return rope_tensors(t, cos, sin, cu_seqlens, start_positions, **rotation)
        weight = norm_args[0]
        if not transpose:
            x = head_norm(t, weight, norm.eps, norm.offset, norm.scope)
            return rope_tensors(x, cos, sin, cu_seqlens, start_positions, dtype=t.dtype,
                                **rotation)
        x = norm_args[1]  # the forward's input; t is the output's gradient
        grad = rope_tensors(t, cos, sin, cu_seqlens, start_positions, dtype=torch.float32,
                            **rotation)
        dx, dweight = head_norm_backward(x, weight, grad, norm.eps, norm.offset, norm.scope)
        return dx.to(x.dtype), dweight.to(weight.dtype)

    return rope_compiled


def _build(key: CompileKey, transpose: bool) -> Callable:
    """A fresh function (own code object) running the math for ``key``, compiled."""
    rope_compiled = _math(key, transpose)
    name = _key_name(key, transpose)
    changes = {"co_name": name}
    if hasattr(rope_compiled.__code__, "co_qualname"):
        changes["co_qualname"] = name
    code = rope_compiled.__code__.replace(**changes)
    fn = types.FunctionType(code, rope_compiled.__globals__, name, None, rope_compiled.__closure__)
    return torch.compile(fn, fullgraph=True)


def _arguments(call: RoPECall) -> tuple:
    """The forward's arguments (:func:`_math`): ``t``, the table's tensors, the index tensors,
    and a norm's weight."""
    table = call.table
    if isinstance(table, CosSinCache):
        a, b = table.cos, table.sin
    elif isinstance(table, RateTable):  # its angle table, made once and kept on the object
        a, b = table.angle_rows(call.spec.interleaved), None
    else:
        a, b = table, None
    weight = () if call.norm is None else (call.norm.weight,)
    return call.t, a, b, call.spec.cu_seqlens, position_index(call), *weight


def _records(call: RoPECall) -> bool:
    """Whether autograd records ``call``: ``t`` or its norm's weight wants a gradient."""
    wants = call.t.requires_grad or (call.norm is not None and call.norm.weight.requires_grad)
    return wants and torch.is_grad_enabled()


def _mark_dynamic(key: CompileKey, args: tuple) -> None:
    """Ask Dynamo for symbolic sizes where calls vary: every dim of ``t`` (and of a norm's
    saved input) but the head dim, and the heads dim too where a ``"heads"`` norm's weight
    fixes it; the table length; the number of sequences; every dim of the index tensor (per-token
    positions are ``[s, b]`` or ``[b, s]``: a static second dim, shared with ``t``'s, made a
    new batch, or bshd's new length, compile again)."""
    t, a, b, cu, index, *norm_args = args
    fixed = 2 if key.norm is not None and key.norm.scope == "heads" else 1
    dynamo = import_dynamo()
    for x in (t, *norm_args[1:]):
        for dim in range(x.dim() - fixed):
            dynamo.maybe_mark_dynamic(x, dim)
    for x in (a, b, cu):
        if x is not None:
            dynamo.maybe_mark_dynamic(x, 0)
    for dim in range(0 if index is None else index.dim()):
        dynamo.maybe_mark_dynamic(index, dim)


def _constants(args: tuple) -> tuple:
    """``args`` detached, to run under ``no_grad``: the compiled graphs are inference graphs,
    and Dynamo guards on each input's ``requires_grad`` and on the grad mode, so this way
    training and inference calls (a weight that wants a gradient or not) share one graph."""
    return tuple(x.detach() if x is not None and x.requires_grad else x for x in args)


def dynamo_problem(full: bool | None = None) -> str | None:
    """Why ``torch.compile`` cannot run in this Python at all, or ``None``.

    ``full``: ask Dynamo itself, importing it (quietly; :mod:`rope_dispatch.tracing`), which
    takes 1-4.5 s. By default only where Dynamo is imported already: the backends are probed at
    a program's first call, which must not pay that, so elsewhere this only checks that torch
    ships Dynamo, and the backend asks Dynamo before its first compile
    (:meth:`CompileBackend.confirm`)."""
    if full is None:
        full = "torch._dynamo" in sys.modules
    if not full:
        if importlib.util.find_spec("torch._dynamo") is None:
            return "torch.compile is not supported here: this torch has no torch._dynamo"
        return None
    check = getattr(import_dynamo().eval_frame, "check_if_dynamo_supported", None)
    if check is None:
        return None
    try:
        check()
    except Exception as exc:
        return f"torch.compile is not supported here: {exc}"
    return None


def _cxx_on_path() -> str | None:
    """The compiler Inductor's default config will run, looked up on ``PATH``: ``$CXX`` when
    set (whatever else is installed), else g++ (clang++ on macOS, cl on Windows)."""
    if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        return None  # Inductor installs g++ from conda where none is found
    default = {"darwin": "clang++", "win32": "cl"}.get(sys.platform, "g++")
    name = os.environ.get("CXX", default)
    if name and shutil.which(name):
        return None
    source = f"CXX={name!r}" if "CXX" in os.environ else name
    return (
        f"no C++ compiler for TorchInductor's CPU code: {source} is not on PATH; install g++ "
        "or set CXX to a working one"
    )


def cpu_compiler_problem(full: bool | None = None) -> str | None:
    """Why TorchInductor cannot build CPU code here (no working C++ compiler), or ``None``.

    ``full``: use Inductor's own lookup (``torch._inductor.config.cpp.cxx``, default ``$CXX`` or
    g++), so the answer matches what a compile would find; it imports Inductor (over a second),
    so by default only where Inductor's config is imported already, else ``PATH`` is searched
    (and the backend asks Inductor before its first compile). ``PATH`` too where that private
    helper is missing.
    """
    if full is None:
        full = "torch._inductor.config" in sys.modules
    if not full:
        return _cxx_on_path()
    try:
        from torch._inductor import cpp_builder

        find = cpp_builder.get_cpp_compiler
    except (ImportError, AttributeError):
        return _cxx_on_path()
    try:
        find()
    except Exception as exc:
        return (
            f"no C++ compiler for TorchInductor's CPU code ({exc}); install g++ or set CXX "
            "(or torch._inductor.config.cpp.cxx) to a working one"
        )
    return None


def cuda_problem(index: int | None = None) -> str | None:
    """Why TorchInductor cannot build CUDA code here (no device, no triton, old GPU), or ``None``."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return (
            f"triton is not importable ({type(exc).__name__}: {exc}); TorchInductor needs it "
            "for CUDA code"
        )
    names = [n for n in (os.environ.get("CC"), "gcc", "clang", "cc") if n]
    if not any(shutil.which(n) for n in names):
        return (
            f"no C compiler for Triton's launcher: none of {', '.join(names)} is on PATH; "
            "install gcc or set CC"
        )
    major, minor = torch.cuda.get_device_capability(index)
    if major < 7:
        return (
            f"CUDA device {torch.cuda.get_device_name(index)} has compute capability "
            f"{major}.{minor}; TorchInductor's Triton code needs 7.0 or newer"
        )
    return None


class CompileBackend(Backend):
    """``torch.compile`` (Inductor) of the eager math: fused, generated kernels on CPU and CUDA."""

    name = "compile"
    description = "torch.compile of the eager math (Inductor: C++ on CPU, Triton on CUDA)"
    priority = 20
    supports_positions = True
    supports_norm = True  # single tensors: head_norm, then the rotation
    supports_inverse = True
    supports_rotary_offset = True
    supports_deinterleave = True
    tables = frozenset({"angles", "cos_sin_cache", "rates", "precise_rates"})
    compiles_per_spec = True
    heavy_import = True  # Dynamo and Inductor: seconds on a fresh machine

    def __init__(self) -> None:
        self._compiled: dict[tuple[CompileKey, bool], Callable] = {}
        self._ready: set[tuple[CompileKey, bool]] = set()  # (key, transpose) that ran compiled
        self._failed: dict[CompileKey, str] = {}
        self._over_limit: set[tuple[CompileKey, bool]] = set()  # warned: recompile limit hit
        self._device_problems: dict[tuple[str, int | None], str | None] = {}
        self._confirmed: dict[str, str | None] = {}  # device type -> confirm()'s answer

    def unavailable_reasons(self) -> list[str]:
        problem = dynamo_problem()
        if problem is not None:
            return [problem]
        cpu = self._device_problem(torch.device("cpu"))
        if cpu is None:
            return []
        cuda = cuda_problem()
        return [] if cuda is None else [f"CPU: {cpu}", f"CUDA: {cuda}"]

    def _device_problem(self, device: torch.device) -> str | None:
        slot = (device.type, device.index)
        if slot not in self._device_problems:
            if device.type == "cpu":
                self._device_problems[slot] = cpu_compiler_problem()
            else:
                self._device_problems[slot] = cuda_problem(device.index)
        return self._device_problems[slot]

    def confirm(self, device: torch.device) -> str | None:
        """The probe's full form, once per device type before the first compile there: Dynamo's
        own check, and on the CPU Inductor's compiler lookup (the probe that dispatch runs at a
        first call only searches ``PATH``). A problem found makes the backend unavailable (or
        refuse that device) from then on; it is returned, else ``None``."""
        kind = device.type
        if kind not in self._confirmed:
            problem = dynamo_problem(full=True)
            if problem is not None:
                self.__dict__["_availability"] = (problem,)
            elif kind == "cpu":
                problem = self._device_problems[(kind, None)] = cpu_compiler_problem(full=True)
            self._confirmed[kind] = problem
            if problem is not None:
                from rope_dispatch import dispatch

                dispatch.clear_decisions()
        return self._confirmed[kind]

    def extra_reasons(self, call: RoPECall) -> list[str]:
        reasons = []
        problem = self._device_problem(call.t.device)
        if problem is not None:
            # alone: the compile that found it (confirm) failed with it too, and its failure
            # would only say the same again
            return [problem]
        failure = self._failed.get(compile_key(call))
        if failure is not None:
            reasons.append(f"compiling this spec failed earlier in this process: {failure}")
        return reasons

    def explain_note(self, call: RoPECall) -> str:
        """Whether what this call runs (its backward too, where autograd records it) is
        compiled yet; the first call of a spec compiles."""
        if not self.available:
            return ""
        key = compile_key(call)
        if key in self._failed:
            return f"compiling this spec failed in this process, it runs eager: {self._failed[key]}"
        if self.is_compiled(call):
            return (
                "torch.compile: this spec is already compiled in this process; new sequence "
                "lengths and batch sizes reuse it"
            )
        return (
            "torch.compile: not compiled yet in this process; its first call of a new spec "
            "compiles it, which takes seconds (tens of seconds with a cold Inductor cache), so "
            "autotune measures it only once a key is hot (or by rope_dispatch.tune)"
        )

    def is_compiled(self, call: RoPECall) -> bool:
        """Whether what ``call`` needs (the forward, and the transpose when autograd records it)
        has already run compiled in this process."""
        key, inverse = compile_key(call), call.spec.inverse
        return (key, inverse) in self._ready and (
            not _records(call) or (key, not inverse) in self._ready)

    def warm_up(self, call: RoPECall) -> None:
        """Compile what running ``call`` needs, without timing it: the forward, and the backward
        too when autograd records the call (``t`` or a norm's weight requires grad, under grad
        mode).

        Call it under the grad mode that will be timed. Raises if compiling fails, so a tuner
        drops this backend rather than timing a fallback.
        """
        if torch.compiler.is_compiling():
            return
        if not _records(call):
            self._run(call, fallback=False)
            return
        x = call.t.detach().requires_grad_(True)
        out = self._run(call._replace(t=x), fallback=False)
        torch.autograd.grad(out, x, torch.ones_like(out))

    def apply(self, call: RoPECall) -> torch.Tensor:
        # inside an outer graph: let it trace the math; under a torch.func transform (grad, jvp,
        # vmap), torch ops, which every transform knows (a failure there is no compile failure);
        # under a dispatch mode (a selective checkpoint's), the ops, recorded alike each time;
        # with a forward-mode AD level open, the ops (a compiled function drops the tangents)
        if memoryless() or fake(call.t) or _dispatch_modes() or forward_ad():
            return rope_eager(call)
        return self._run(call, fallback=True)

    def _run(self, call: RoPECall, fallback: bool) -> torch.Tensor:
        key = compile_key(call)
        if key in self._failed:
            if fallback:
                return rope_eager(call)
            raise RuntimeError(f"torch.compile failed for this spec: {self._failed[key]}")
        args = _arguments(call)
        if _records(call):
            return _CompiledRoPE.apply(self, key, fallback, call.spec.inverse, *args)
        return self.run_compiled(key, call.spec.inverse, fallback, args)

    def run_compiled(self, key: CompileKey, transpose: bool, fallback: bool, args: tuple,
                     backward: bool = False) -> torch.Tensor:
        """The compiled forward (or transpose) of ``key`` on ``args``, compiling it on first use;
        ``backward``: it is ``_CompiledRoPE``'s backward (an inverse call's is the forward).

        A compile failure is remembered: with ``fallback`` the eager math answers (one warning)
        and later decisions refuse this key; without it the error propagates. It runs without
        grad on detached tensors (:func:`_constants`): autograd is ``_CompiledRoPE``'s; only a
        backward under ``create_graph=True`` runs as given, so a double backward differentiates
        it.
        """
        if backward and torch.is_grad_enabled():
            return self._run_compiled(key, transpose, fallback, args)
        with torch.no_grad():
            return self._run_compiled(key, transpose, fallback, _constants(args))

    def _run_compiled(self, key: CompileKey, transpose: bool, fallback: bool, args: tuple):
        slot = (key, transpose)
        fn = self._compiled.get(slot)
        if slot in self._ready:
            try:
                return fn(*args)
            except Exception as exc:
                # a layout met after Dynamo's per-function recompile limit (sizes of 0 and 1
                # and strides are specialised: an expanded or empty input each adds a graph);
                # fullgraph=True makes that a hard error. The graphs compiled so far still
                # serve their layouts; this one runs the eager math.
                if not (fallback and recompile_limit_hit(exc)):
                    raise
                if slot not in self._over_limit:
                    self._over_limit.add(slot)
                    warnings.warn(
                        f"rope_dispatch: {_key_name(key, transpose)} reached Dynamo's recompile "
                        f"limit ({_summary(exc)}); inputs of layouts not compiled yet run the "
                        "eager math", RuntimeWarning, stacklevel=user_stacklevel(),
                    )
                return _math(key, transpose)(*args)
        try:
            if fn is None:
                problem = self.confirm(args[0].device)
                if problem is not None:
                    raise RuntimeError(problem)
                fn = self._compiled[slot] = _build(key, transpose)
            _mark_dynamic(key, args)
            out = fn(*args)
        except Exception as exc:
            if not fallback:
                self._failed[key] = _summary(exc)
                raise
            try:
                out = _math(key, transpose)(*args)
            except Exception:
                raise exc from None  # the inputs are at fault, not the compiler
            self._failed[key] = _summary(exc)
            warnings.warn(
                f"rope_dispatch: torch.compile failed for {_key_name(key, transpose)} "
                f"({self._failed[key]}); running the eager math for it from now on",
                RuntimeWarning, stacklevel=user_stacklevel(),
            )
            return out
        self._ready.add(slot)
        return out


class _CompiledRoPE(torch.autograd.Function):
    """Compiled forward, compiled transpose as the backward (``inverse``: the other way
    round); saves only the tables, and with a norm stage its weight and ``t`` (the norm's
    gradient needs the input), and then also returns the weight's gradient."""

    @staticmethod
    def forward(ctx, backend, key, fallback, inverse, t, a, b, cu_seqlens, start_positions,
                *weight):
        ctx.backend, ctx.key, ctx.fallback, ctx.inverse = backend, key, fallback, inverse
        norm_saved = (*weight, t) if weight else ()  # the backward's norm arguments
        saved = (a, b, cu_seqlens, start_positions, *norm_saved)
        # autograd refuses to save an inference tensor (a table made under
        # torch.inference_mode, then used in training); it has no version to check: kept as is
        ctx.inference = tuple(x if x is not None and x.is_inference() else None for x in saved)
        ctx.save_for_backward(*(None if kept is not None else x
                                for x, kept in zip(saved, ctx.inference)))
        return backend.run_compiled(
            key, inverse, fallback, (t, a, b, cu_seqlens, start_positions, *weight)
        )

    @staticmethod
    def backward(ctx, grad):
        saved = tuple(x if kept is None else kept
                      for x, kept in zip(ctx.saved_tensors, ctx.inference))
        grads = ctx.backend.run_compiled(ctx.key, not ctx.inverse, ctx.fallback, (grad, *saved),
                                         backward=True)
        if ctx.key.norm is None:
            return None, None, None, None, grads, None, None, None, None
        grad_t, grad_weight = grads
        return (None, None, None, None, grad_t if ctx.needs_input_grad[4] else None, None, None,
                None, None, grad_weight if ctx.needs_input_grad[9] else None)


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__
