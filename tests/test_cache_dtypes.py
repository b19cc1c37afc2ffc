"""A CosSinCache in a model's own dtype (bf16, fp16: Hugging Face models hand their per-token cos
and sin over that way) is read as its values widened to float32: the same numbers as a float32
cache of those values, for every backend that reads caches, forward and backward."""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from reference import assert_matches, reference_forward_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _inputs(dtype, cache_dtype, device):
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(6, 2, 3, 16, generator=gen).to(dtype).to(device).requires_grad_()
    angles = torch.rand(6, 16, generator=gen, dtype=torch.float64) * 30
    low = rd.CosSinCache(angles.cos().to(cache_dtype).to(device), angles.sin().to(cache_dtype).to(device))
    wide = rd.CosSinCache(low.cos.float(), low.sin.float())
    return t, low, wide


def _run(backend, t, cache, spec, grad):
    out = rd.apply(t, cache, spec, backend=backend)
    (g,) = torch.autograd.grad(out, t, grad)
    return out, g


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_model_dtype_cache_equals_its_float32_widening(request, backend, cache_dtype):
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    device = DEVICE if backend == "triton" else "cpu"
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    t, low, wide = _inputs(torch.bfloat16, cache_dtype, device)
    grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(8)).bfloat16().to(device)
    out_low, grad_low = _run(backend, t, low, spec, grad)
    out_wide, grad_wide = _run(backend, t, wide, spec, grad)
    assert torch.equal(out_low, out_wide) and torch.equal(grad_low, grad_wide)
    # and the numbers are the formula's, from the widened values (an angle table that has them)
    angles = torch.atan2(low.sin.double(), low.cos.double()).cpu()
    scale = torch.sqrt(low.cos.double() ** 2 + low.sin.double() ** 2).cpu()
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad.float())
    # a bf16/fp16 pair is not exactly unit length: the reference rotates by the angle and scales
    rows = scale[:, None, None, :]
    rotated_part = ref_out.clone()
    rotated_part[..., :16] = ref_out[..., :16] * rows
    assert_matches(out_low, rotated_part, torch.bfloat16, "forward")


def test_mixed_or_wide_dtypes_are_refused():
    t = torch.randn(4, 1, 2, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    cos = torch.rand(4, 8)
    for pair, words in (
        ((cos.bfloat16(), cos.half()), "bfloat16"),
        ((cos.double(), cos.double()), "float64"),
    ):
        # refused when built, before any call
        with pytest.raises(rd.RoPEError, match="CosSinCache.*one dtype among float32, bfloat16 and float16") as info:
            rd.apply(t, rd.CosSinCache(*pair), spec)
        assert words in str(info.value)
