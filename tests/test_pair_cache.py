"""``PairCosSinCache`` (an engine's ``cos_sin_cache``: one cos and one sin per rotated pair) as
the table of any call, against the float64 reference on the equivalent angle table (each pair
angle given to both of its channels), forward and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import build, cases
from reference import assert_matches, reference_forward_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def check_pair_cache(case, backend: str, device: str) -> None:
    t, _, spec, starts, angles = build(dataclasses.replace(case, use_cache=False), device)
    gen = torch.Generator().manual_seed(case.seed + 11)
    pair = torch.rand(angles.shape[0], angles.shape[1] // 2, generator=gen, dtype=torch.float64) * 40
    cache = rd.PairCosSinCache(torch.cat((pair.cos(), pair.sin()), dim=-1).float().to(device))
    full = pair.repeat_interleave(2, dim=-1) if spec.interleaved else torch.cat((pair, pair), -1)
    out = rd.apply(t, cache, spec, start_positions=starts, backend=backend)
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, full, spec, grad_out, starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@given(cases())
def test_eager(case):
    check_pair_cache(case, "eager", "cpu")


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(cases())
def test_triton(case):
    check_pair_cache(case, "triton", DEVICE)


def test_te_and_compile_say_they_do_not_read_it():
    t = torch.randn(4, 2, 1, 8)
    cache = rd.PairCosSinCache(torch.rand(8, 8))
    explanation = rd.explain(t, cache, rd.RoPESpec(layout="sbhd", dtype="fp32"))
    if rd.get_backend("compile").available:
        assert "a pair_cos_sin_cache table is not supported" in " ".join(explanation.rejected["compile"])
