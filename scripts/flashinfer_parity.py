"""pytest plugin: FlashInfer's own ``tests/attention/test_rope.py``, unchanged, against
``rope_dispatch.compat.flashinfer``.

The file's tests of the functions our doors serve (``apply_rope_with_cos_sin_cache_inplace``,
``rope_quantize_fp8``, ``mla_rope_quantize_fp8`` and ``rope_quantize_fp8_append_paged_kv_cache``,
padded CUDA-graph batches included) compare each call with the file's own torch reference
(``tests/test_helpers/rope_reference.py``). This plugin puts a module named ``flashinfer`` in
``sys.modules`` whose RoPE functions are our doors, so no FlashInfer is installed or built; the
two paging helpers the tests build their inputs with (``get_seq_lens``,
``get_batch_indices_positions``) are written here from FlashInfer's documented semantics. The
file's other tests (FlashInfer's own ``apply_rope*`` and ``apply_llama31_rope*`` functions, its
cuTile backend) are deselected, and the cuTile cases of the tests kept skip (no cuda.tile).
Run it from a FlashInfer checkout (the tests import ``tests.test_helpers``), without its
conftest (which imports all of FlashInfer):

    PYTHONPATH=.:/path/to/rope-dispatch/scripts python -m pytest -p flashinfer_parity \
        --noconftest tests/attention/test_rope.py

FlashInfer's tests are public and are not part of this repository.
"""

from __future__ import annotations

import sys
import types

SERVED = {
    "test_rope_cos_sin_cache": "apply_rope_with_cos_sin_cache_inplace",
    "test_generalized_rope_quantize": "rope_quantize_fp8",
    "test_mla_rope_quantize": "mla_rope_quantize_fp8",
    "test_generalized_rope_quantize_append_kv_cache": "rope_quantize_fp8_append_paged_kv_cache",
    "test_rope_quantize_fp8_append_paged_kv_cache_decode": "rope_quantize_fp8_append_paged_kv_cache",
    "test_rope_quantize_fp8_append_paged_kv_cache_padding": "rope_quantize_fp8_append_paged_kv_cache",
}
"""The file's tests that call only our doors (and the two paging helpers), by the door they test."""


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """Each request's cached tokens: its pages but the last full, plus the last one's entries."""
    import torch

    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None):
    """Per appended token its request and its place in the request's cache: request ``i``'s
    ``n_i`` new tokens are its last ``n_i``, at ``seq_lens[i] - n_i ..``. Entries past the
    appended tokens (CUDA-graph padding) get request -1; their positions are left as they are
    (zeros when made here)."""
    import torch

    device, dtype = append_indptr.device, torch.int32
    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    if batch_indices is None:
        batch_indices = torch.full((nnz,), -1, dtype=dtype, device=device)
    else:
        batch_indices.fill_(-1)
    if positions is None:
        positions = torch.zeros(nnz, dtype=dtype, device=device)
    first, end = int(append_indptr[0]), int(append_indptr[-1])
    requests = torch.arange(counts.numel(), device=device)
    token = torch.arange(first, end, device=device)
    start = torch.repeat_interleave(append_indptr[:-1].long(), counts)
    cached = torch.repeat_interleave(seq_lens.long() - counts, counts)
    batch_indices[first:end] = torch.repeat_interleave(requests, counts).to(dtype)
    positions[first:end] = (token - start + cached).to(dtype)
    return batch_indices, positions


def pytest_configure(config) -> None:
    from rope_dispatch.compat import flashinfer as doors

    package = types.ModuleType("flashinfer")
    rope = types.ModuleType("flashinfer.rope")
    for name in sorted(set(SERVED.values())):
        setattr(rope, name, getattr(doors, name))
        setattr(package, name, getattr(doors, name))
    package.rope = rope
    package.get_seq_lens = get_seq_lens
    package.get_batch_indices_positions = get_batch_indices_positions
    package.__version__ = "rope_dispatch.compat.flashinfer"
    # FlashInfer's cuTile kernels are not served: the file's cuTile cases ask
    # ``is_cuda_tile_available()`` and skip, as they do on a FlashInfer without cuda.tile
    cutile = types.ModuleType("flashinfer.cutile")
    cutile_common = types.ModuleType("flashinfer.cutile.cutile_common")
    cutile_common.is_cuda_tile_available = lambda: False
    cutile.cutile_common = cutile_common
    package.cutile = cutile
    package.__path__ = []  # a package, so ``from flashinfer.cutile... import`` resolves
    sys.modules.update({"flashinfer": package, "flashinfer.rope": rope,
                        "flashinfer.cutile": cutile,
                        "flashinfer.cutile.cutile_common": cutile_common})


def pytest_collection_modifyitems(config, items) -> None:
    """Only the tests of :data:`SERVED` run; the others (FlashInfer functions the doors do not
    serve) are deselected."""
    kept = [item for item in items if getattr(item, "originalname", item.name) in SERVED]
    removed = [item for item in items if item not in kept]
    if removed:
        config.hook.pytest_deselected(items=removed)
        items[:] = kept


def pytest_report_header(config) -> str:
    import os

    import rope_dispatch

    backend = os.environ.get("ROPE_BACKEND") or "dispatch chooses"
    return (f"flashinfer_parity: FlashInfer's RoPE tests -> rope_dispatch {rope_dispatch.__version__}"
            f".compat.flashinfer (their torch reference kept), backend: {backend}")
