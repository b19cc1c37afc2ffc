"""Shared test configuration: GPU tests skip with the reason where CUDA is absent; the autotune
cache lives in a temporary folder."""

from __future__ import annotations

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
