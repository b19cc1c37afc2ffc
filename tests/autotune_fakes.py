"""Two CPU backends with known relative speed for the autotune tests, importable by subprocesses.

Both compute with the eager math, so results stay checkable against the float64 reference. The
``slow`` one sleeps before each call and has the higher priority, so the priority order and a
measurement disagree: a test can tell which of the two decided.
"""

from __future__ import annotations

import time

import torch

from rope_dispatch import registry
from rope_dispatch.backends.eager import rope_eager
from rope_dispatch.call import RoPECall
from rope_dispatch.registry import Backend

SLOW_SECONDS = 0.004
_sleep = torch.compiler.disable(time.sleep)  # a graph break Dynamo need not warn about


class FakeBackend(Backend):
    """Eager math behind a fixed per-call delay; counts its calls."""

    devices = frozenset({"cpu"})

    def __init__(self, name: str, priority: int, delay: float) -> None:
        self.name = name  # type: ignore[misc]
        self.priority = priority  # type: ignore[misc]
        self.delay = delay
        self.calls = 0
        self.description = f"test backend ({name}, {delay * 1e3:.0f} ms delay)"  # type: ignore[misc]

    def apply(self, call: RoPECall) -> torch.Tensor:
        self.calls += 1
        if self.delay:
            _sleep(self.delay)
        return rope_eager(call)


class FailingBackend(FakeBackend):
    """Raises on every call: the autotuner must skip it."""

    def apply(self, call: RoPECall) -> torch.Tensor:
        self.calls += 1
        raise RuntimeError("this test backend always fails")


def compiling() -> FakeBackend:
    """A fake that declares it compiles per spec (as the compile backend does), with the highest
    priority and no delay: a first call must leave it out, a hot key or ``rd.tune`` measure it."""
    backend = FakeBackend("compiling", 90, 0.0)
    backend.compiles_per_spec = True  # type: ignore[misc]
    return backend


def install(*extra: Backend) -> tuple[dict[str, Backend], dict[str, FakeBackend]]:
    """Replace every registered backend by ``fast`` and ``slow`` (plus ``extra``).

    Returns the backends removed (for :func:`restore`) and the fakes by name.
    """
    removed = {b.name: registry.unregister(b.name) for b in registry.backends()}
    fakes = {"fast": FakeBackend("fast", 10, 0.0), "slow": FakeBackend("slow", 50, SLOW_SECONDS)}
    for backend in (*fakes.values(), *extra):
        registry.register(backend)
    return removed, fakes


def restore(removed: dict[str, Backend]) -> None:
    """Undo :func:`install`: drop every backend and register ``removed`` again."""
    for backend in registry.backends():
        registry.unregister(backend.name)
    for backend in removed.values():
        registry.register(backend)
