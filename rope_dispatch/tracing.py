"""What rope-dispatch tells ``torch.compile``'s tracer (Dynamo), without importing Dynamo first.

Importing ``torch._dynamo`` takes about 1 s on a development CPU and 4.5 s on the GPU
machine's host (sympy and the tracer's modules), more than ``import torch`` itself there. A
program that never compiles should not pay it for ``import rope_dispatch``; one that compiles
imports Dynamo anyway, and the marks below are read when it traces. It also says when a
call's tensors have no memory to read (:func:`memoryless`: traced, or ``torch.func``'s).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

transformed = torch._C._are_functorch_transforms_active
"""Whether a ``torch.func`` transform (grad, jvp, vmap) runs: its tensors are wrappers with no
memory of their own (no ``data_ptr``, no inference flag to read)."""

_FORWARD_AD = torch.autograd.forward_ad


def forward_ad() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``): any
    tensor may carry a tangent, which only torch ops carry on (a kernel launch, a compiled
    function, drops it: the output had none, or an in-place call's the input's, unrotated)."""
    return _FORWARD_AD._current_level >= 0


def memoryless() -> bool:
    """Whether a call's tensors may have no memory to read: fake tensors while torch.compile
    traces or a ``FakeTensorMode`` is active (shape propagation, memory estimation), or a
    ``torch.func`` transform's wrappers. Checks that read addresses or values skip then."""
    return (torch.compiler.is_compiling() or transformed()
            or (_dispatch_modes() > 0 and _fake_mode_active()))


_dispatch_modes = torch._C._len_torch_dispatch_stack  # 0 on every ordinary call: 30 ns
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never fake (asked before the fake tensor module's own test)."""


def recompile_limit_hit(exc: BaseException) -> bool:
    """Whether ``exc`` is Dynamo refusing a new graph past its recompile limit: a state of this
    process (the graphs its earlier calls compiled), not of the call."""
    return any(type(e).__name__ in ("FailOnRecompileLimitHit", "RecompileLimitExceeded")
               for e in (exc, exc.__cause__) if e is not None)


def distributed(t: object) -> bool:
    """Whether ``t`` is a DTensor, asked only once torch's DTensor module is loaded (a program
    without one never imports it through us)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(_FAKE_MODE) is not None


def fake(*tensors: object) -> bool:
    """Whether a ``FakeTensorMode`` is active, or one of ``tensors`` is a fake tensor: tensors
    without memory, on which no kernel may launch and no value may be read (a compiled kernel
    given their addresses crashed the process)."""
    if _dispatch_modes() > 0 and _fake_mode_active():
        return True
    for t in tensors:
        if isinstance(t, torch.Tensor) and type(t) not in PLAIN_TENSORS:
            module = sys.modules.get("torch._subclasses.fake_tensor")
            if module is not None and module.is_fake(t):
                return True
    return False


def exact_size(n: object) -> int:
    """A count (``n >= 0``) as a plain int while Dynamo traces, where ``dynamic=True`` makes a
    table's last dim, and an int an object holds, a symbol: found by comparisons, each a guard,
    so the graph is specialised to it (a rotary dim, a split or a rank never changes in a
    model)."""
    if n < 1:
        return 0
    high = 1
    while n > high:
        high *= 2
    low = high // 2  # low < n <= high
    while high - low > 1:
        middle = (low + high) // 2
        if n > middle:
            low = middle
        else:
            high = middle
    return high


def symbolic(n: int) -> bool:
    """Whether ``n``, an int met while Dynamo traces, is a symbol (a caller's int that changed
    between calls, or any with ``dynamic=True``), found without a guard on its value (Dynamo
    passes a symbol's ``isinstance(n, int)`` and ``type(n) is int``); a plain int's value is
    known, so some power of two bounds it and it equals the bound's bisection."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(n < 0):  # (a plain negative int)
        return False
    low, high = -1, 1
    while not statically_known_true(n <= high):
        if high >= 1 << 62:
            return True
        high *= 2
    while high - low > 1:
        middle = (low + high) // 2
        if statically_known_true(n <= middle):
            high = middle
        else:
            low = middle
    return not statically_known_true(n == high)


def constant_while_tracing(fn: F) -> F:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it: Dynamo calls it once
    at trace time and keeps its result in the graph instead of tracing its body (a ContextVar,
    environment reads, file reads, optional imports). torch's decorator sets this one
    attribute, as torch does itself for functions it must not import Dynamo to mark
    (``justknobs_check``); ``tests/test_traceable.py`` checks that the two agree."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def import_dynamo() -> ModuleType:
    """``torch._dynamo``, imported without the warning torch's tracing modules give at import
    when NumPy is absent: rope-dispatch uses no NumPy, and a fresh install stays quiet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                                category=UserWarning)
        import torch._dynamo

    return torch._dynamo
