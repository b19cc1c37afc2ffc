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


def test_meta_tensors_get_the_shapes_torch_ops_give(monkeypatch):
    """A model built on torch.device("meta") (shape propagation, deferred init) runs its calls
    as torch ops run there: outputs of the CPU call's shape, dtype and strides, on meta, with no
    value read (not even in strict mode, whose checks read index tensors). In-place q and k of
    two meta tensors are apart (every meta storage starts at address 0); views of one that
    overlap are still refused."""
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")
    table = rd.tables.default_frequencies(8, rope_theta=10000.0).angle_table(16)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    thd = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=torch.tensor([0, 3, 7]))

    def calls(device):
        q = torch.randn(2, 5, 4, 8, dtype=torch.bfloat16, device=device).transpose(0, 1)
        k = torch.randn(2, 5, 2, 8, dtype=torch.bfloat16, device=device)
        freqs, starts = table.to(device), torch.tensor([1, 3], device=device)
        pos = torch.zeros(5, 2, dtype=torch.long, device=device)
        packed = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=thd.cu_seqlens.to(device))
        return [
            rd.apply(q, freqs, spec, start_positions=starts),
            rd.apply(k.transpose(0, 1), rd.cos_sin_cache(freqs), spec),
            *rd.apply_qk_(q.clone(), k.transpose(0, 1).clone(), freqs, spec, positions=pos),
            *rd.apply_qkv(torch.randn(5, 2, 1, 32, dtype=torch.bfloat16, device=device), freqs,
                          spec, split=(16, 8, 8)),
            rd.apply(q.reshape(10, 4, 8)[:7], freqs, packed),
        ]

    for _ in range(2):  # planned the second time
        with rd.use_backend("eager"):  # the automatic choice compiles code on the CPU
            on_cpu = calls("cpu")
        for out, expected in zip(calls("meta"), on_cpu, strict=True):
            assert out.device.type == "meta"
            assert (out.shape, out.dtype, out.stride()) == (
                expected.shape, expected.dtype, expected.stride())
    x = torch.empty(5, 2, 4, 12, dtype=torch.bfloat16, device="meta")
    with pytest.raises(rd.RoPEError, match="share memory"):
        rd.apply_qk_(x[..., :8], x[..., 4:], table.to("meta"), spec)


@pytest.mark.parametrize("kind", ["partial", "interleaved", "offset", "deinterleave", "qkv"])
def test_backward_keeps_negative_zero_gradients(kind):
    """A -0.0 gradient at angle 0 comes back as the transpose gives it (TE's kernel, the Triton
    backend): its pass-through channels -0.0, its rotated ones -0.0 where the partner's term is
    -0.0. Three slices of one tensor (or an interleaved pair's two strided slices) would add
    each other's +0 padding in autograd and make every such zero +0.0."""
    d = 8
    fields = {"partial": {}, "interleaved": {"interleaved": True}, "offset": {"rotary_offset": 2},
              "deinterleave": {"deinterleave": True}, "qkv": {}}[kind]
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32, **fields)
    freqs = torch.zeros(2, 1, 1, d if kind == "qkv" else 4)
    width = 3 * d if kind == "qkv" else d
    t = torch.full((1, 1, 2, width), -0.0, requires_grad=True)
    if kind == "qkv":
        outs = rd.apply_qkv(t, freqs, spec, split=(d, d, d), backend="eager")
    else:
        outs = (rd.apply(t, freqs, spec, backend="eager"),)
    (grad,) = torch.autograd.grad(outs, t, [torch.full_like(o, -0.0) for o in outs])
    # the formula (TE's backward kernel): g_i cos_i plus the partner's g sin (0 here), whose
    # sign flips on one member of each pair: -0.0 + -0.0 there, -0.0 + +0.0 on the other
    pairs = 4 if kind == "qkv" else 1
    assert int((~torch.signbit(grad)).sum()) == 2 * 2 * pairs  # 2 heads (+2 k heads)
    kept = {"partial": slice(4, 8), "interleaved": slice(4, 8), "offset": slice(0, 2),
            "deinterleave": slice(4, 8), "qkv": slice(16, 24)}[kind]
    assert bool(torch.signbit(grad[..., kept]).all())  # pass-through / v: copied, -0.0
