"""Shared test configuration: GPU tests are skipped, with the reason, where CUDA is absent."""

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
