"""Shared test configuration: GPU tests skip with the reason where CUDA is absent; the autotune
cache lives in a temporary folder."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; runs on the GPU machine (scripts/device_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_autotune(tmp_path_factory):
    """Tests never read or write the user's autotune cache, and choose by priority unless a
    test turns measuring on (tests/test_autotune.py does)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ROPE_DISPATCH_CACHE_DIR", str(tmp_path_factory.mktemp("rope-dispatch-cache")))
    mp.setenv("ROPE_AUTOTUNE", "0")
    yield
    mp.undo()


def _reprobe(backend) -> None:
    backend.__dict__.pop("availability", None)
    backend.__dict__.pop("_availability", None)
    import rope_dispatch as rd

    rd.dispatch.clear_decisions()


@pytest.fixture(scope="module")
def triton_backend():
    """The registered triton backend, on Triton's CPU interpreter when there is no CUDA device.

    ``TRITON_INTERPRET=1`` is set for the using module's duration only and the backend is
    re-probed afterwards, so other modules still see it unavailable on a CPU-only machine.
    """
    pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")
    import rope_dispatch as rd

    saved = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    backend = rd.get_backend("triton")
    _reprobe(backend)
    try:
        if not backend.available:
            pytest.skip(f"triton backend unavailable: {'; '.join(backend.availability)}")
        yield backend
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        _reprobe(backend)


@pytest.fixture
def stand_in_binder(monkeypatch):
    """The Triton backend's plans bound by a stand-in for ``bind_compiled`` (the real one needs a
    GPU's compiled launch): it records the tensors each pointer slot was made for (``"given"``)
    and, when a plan serves a call, the tensors that call hands the bound launch
    (``"passed"``), then declines it (``NotImplemented``) so the call takes the generic path."""
    import types

    from rope_dispatch.backends import triton_launch, triton_rope

    seen = {}

    def binder(described, inputs, outs, tabs, given, made=(), like=None):
        seen["given"] = tuple(given)

        def forward(stream, *tensors):
            seen["passed"] = tensors
            return NotImplemented

        return forward, types.SimpleNamespace(device=0)

    monkeypatch.setattr(triton_launch, "bind_compiled", binder)
    monkeypatch.setattr(triton_rope, "current_stream", lambda device: 0)
    return seen


@pytest.fixture
def hf_modules_restored():
    """Leaves transformers' modeling modules as the test found them, whatever it patched: each
    supported family's module-level RoPE names, and the integration's record of originals."""
    import importlib

    from rope_dispatch.integrations import hf

    modules = {}
    for family, (module, _, _) in hf.SUPPORTED_MODELS.items():
        try:
            modules[family] = importlib.import_module(module)
        except ModuleNotFoundError:  # a family newer than the installed transformers
            continue
    saved = {(family, name): getattr(modules[family], name)
             for family, (_, _, names) in hf.SUPPORTED_MODELS.items() if family in modules
             for name in names if hasattr(modules[family], name)}
    yield
    for (family, name), original in saved.items():
        setattr(modules[family], name, original)
    hf._originals.clear()
    hf._holders.clear()
