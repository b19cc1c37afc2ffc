"""pytest plugin: TransformerEngine's own ``tests/pytorch/test_fused_rope.py``, unchanged, with
its fused calls served by ``rope_dispatch.compat.te``.

TE's tests compare ``apply_rotary_pos_emb(..., fused=True)`` with its unfused path (plain
PyTorch, the reference) and ``apply_fused_qkv_rotary_pos_emb`` with fused single-tensor calls.
This plugin replaces, inside TE's module, ``apply_rotary_pos_emb`` for ``fused=True`` calls,
``apply_fused_qkv_rotary_pos_emb`` and ``RotaryPositionEmbedding`` with rope-dispatch's
adapter; ``fused=False`` calls keep running TE's unfused code. ``ROPE_BACKEND`` picks the
backend that serves them (``triton`` in scripts/device_check.sh; unset, dispatch chooses and may
pick TE itself).

    PYTHONPATH=scripts python -m pytest -p te_parity path/to/test_fused_rope.py

TE's test file is public and is not part of this repository: fetch it from TransformerEngine's
repository at the release you test against.
"""

from __future__ import annotations

import inspect


def pytest_configure(config) -> None:
    import os

    import torch
    from transformer_engine.pytorch.attention import rope as te_rope

    from rope_dispatch.compat import te as ours

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and torch.cuda.is_available():
        # pytest-xdist workers share one GPU: each keeps its caching allocator within its share,
        # so one worker's cached blocks cannot starve another's next test (TE's fused QKV tests
        # allocate several GiB each).
        torch.cuda.set_per_process_memory_fraction(0.95 / workers)

    unfused = te_rope.apply_rotary_pos_emb
    parameters = list(inspect.signature(unfused).parameters)

    def apply_rotary_pos_emb(*args, **kwargs):
        bound = dict(zip(parameters, args), **kwargs)
        return (ours.apply_rotary_pos_emb if bound.get("fused") else unfused)(*args, **kwargs)

    te_rope.apply_rotary_pos_emb = apply_rotary_pos_emb
    te_rope.apply_fused_qkv_rotary_pos_emb = ours.apply_fused_qkv_rotary_pos_emb
    te_rope.RotaryPositionEmbedding = ours.RotaryPositionEmbedding


def pytest_report_header(config) -> str:
    import os

    import transformer_engine

    import rope_dispatch

    backend = os.environ.get("ROPE_BACKEND") or "dispatch chooses"
    return (
        f"te_parity: TransformerEngine {transformer_engine.__version__} (unfused path = reference), "
        f"fused calls -> rope_dispatch {rope_dispatch.__version__}.compat.te, backend: {backend}"
    )
