"""Spies on the Triton kernels a launch runs, for tests that check which kernel and which
compile-time arguments the launcher chose."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest


class KernelSpy:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](...)`` calls ``record(name,
    kwargs)`` and then launches; every other attribute (``arg_names``, ...) is the kernel's."""

    def __init__(self, name: str, kernel: Any, record: Callable[[str, dict], None]):
        self.name, self.kernel, self.record = name, kernel, record

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.kernel, attr)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.record(self.name, kwargs)
            return launch(*args, **kwargs)

        return run


def spy_kernels(monkeypatch: pytest.MonkeyPatch, names: Iterable[str],
                record: Callable[[str, dict], None]) -> None:
    """Replace the kernels ``names`` of ``backends.triton_kernels`` by :class:`KernelSpy`s
    calling ``record`` (import the module only once the test's ``TRITON_INTERPRET`` is set).
    A repeated call whose compiled launch is kept (``triton_launch._compiled``, or a plan bound to
    it) passes no spy: the callers forget those."""
    from rope_dispatch.backends import triton_kernels

    for name in names:
        monkeypatch.setattr(triton_kernels, name,
                            KernelSpy(name, getattr(triton_kernels, name), record))
