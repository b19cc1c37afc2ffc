"""The eager backend against the float64 reference, forward and backward, on random calls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

import rope_dispatch as rd
from cases import build, cases
from reference import assert_matches, reference_forward_backward


def check_backend(case, backend: str, device: str = "cpu") -> None:
    t, table, spec, starts, angles = build(case, device)
    out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
    assert out.dtype == t.dtype and out.device == t.device
    assert out.is_contiguous()
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out.cpu(), starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@given(cases())
def test_eager_matches_reference(case):
    check_backend(case, "eager")


@given(cases(cp_sizes=(2, 3, 4), starts=(True,)))
def test_start_positions_with_context_parallelism(case):
    """TE 2.10+: a token's row is its sequence's start plus its zigzag position; gradients too."""
    check_backend(case, "eager")


@pytest.mark.gpu
@given(cases())
def test_eager_matches_reference_on_cuda(case):
    check_backend(case, "eager", "cuda")


def test_partial_rotary_of_a_permuted_input_is_contiguous():
    """Partial rotary on a bshd view stored as [b, h, d, s]: the output is contiguous in the
    layout (torch.cat alone would keep the input's memory format) and right."""
    t = torch.randn(2, 3, 8, 4).permute(0, 3, 1, 2)  # bshd [2, 4, 3, 8]
    angles = torch.rand(4, 4) * 10
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    grad = torch.randn(2, 4, 3, 8)
    leaf = t.clone().requires_grad_(True)
    out = rd.apply(leaf, angles, spec, backend="eager")
    assert out.is_contiguous()
    (got,) = torch.autograd.grad(out, leaf, grad)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad)
    assert_matches(out, ref_out, torch.float32, "output")
    assert_matches(got, ref_grad, torch.float32, "gradient")


def test_input_is_not_modified():
    t = torch.randn(6, 2, 3, 8)
    before = t.clone()
    freqs = torch.rand(6, 1, 1, 8)
    rd.apply(t, freqs, rd.RoPESpec(layout="sbhd", dtype="fp32"), backend="eager")
    assert torch.equal(t, before)


def test_cache_and_angles_agree():
    t = torch.randn(2, 9, 4, 16, dtype=torch.bfloat16)
    freqs = torch.rand(12, 1, 1, 16) * 100
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    a = rd.apply(t, freqs, spec, backend="eager")
    b = rd.apply(t, rd.cos_sin_cache(freqs), spec, backend="eager")
    # The two tables differ in the last float32 bit, which can flip one bf16 rounding: at most
    # one bf16 ulp apart, i.e. 2^-7 relative (an absolute bound fails for |x| >= 2).
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


def test_sbhd_and_bshd_agree():
    t = torch.randn(7, 3, 2, 8)
    freqs = torch.rand(7, 8)
    sb = rd.apply(t, freqs, rd.RoPESpec(layout="sbhd", dtype="fp32"), backend="eager")
    bs = rd.apply(t.transpose(0, 1), freqs, rd.RoPESpec(layout="bshd", dtype="fp32"), backend="eager")
    torch.testing.assert_close(sb, bs.transpose(0, 1))
