"""``RoPESpec.cos_sin_scale``: a factor on cos and sin (YaRN's and LongRoPE's attention factor,
as Hugging Face applies it), for every table kind and call kind, in every backend that serves
it; TransformerEngine's backend scales its output's rotated channels instead.

The hypothesis cases of the other modules draw scales too (tests/cases.py); these tests pin the
meaning: an angle table with the spec's scale equals the cos/sin cache with the factor inside.
"""

from __future__ import annotations

import math

import pytest
import torch

import rope_dispatch as rd
from cases import QKVCase, build, build_qkv, fixed_case
from reference import assert_matches, reference_forward_backward, reference_qkv_forward_backward
from rope_dispatch.backends.te import _scaled
from rope_dispatch.tables import from_hf_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_spec_refuses_a_scale_that_is_not_a_finite_positive_number(bad):
    with pytest.raises(rd.RoPEError, match=r"cos_sin_scale must be a finite number > 0, got"):
        rd.RoPESpec(layout="sbhd", dtype="bf16", cos_sin_scale=bad)



@pytest.mark.parametrize("bad", [1e39, 1e300, 1e-39, 1e-46, 1e-300])
def test_spec_refuses_a_scale_float32_cannot_hold(bad):
    """cos and sin are scaled in float32: a scale past its largest number became inf (every
    output NaN, where the formula is finite), one below its smallest normal number 0 or
    inexact (outputs 0 where the formula is not)."""
    with pytest.raises(rd.RoPEError, match=r"cos_sin_scale must lie in float32's normal range"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=bad)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("scale, magnitude", [(torch.finfo(torch.float32).max, 1e-38),
                                              (torch.finfo(torch.float32).tiny, 1e37)])
def test_the_extreme_scales_float32_holds_give_the_formula(backend, scale, magnitude, request):
    """The largest and smallest scales the spec takes, on inputs they bring to unit size: the
    float64 formula's numbers, forward and backward."""
    _use(backend, request)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 1, 2, 8, generator=gen) * magnitude).to(DEVICE).requires_grad_(True)
    grad_out = (torch.randn(4, 1, 2, 8, generator=gen) * magnitude).to(DEVICE)
    freqs = rd.tables.default_frequencies(8).angle_table(4, device=DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=scale)
    out = rd.apply(x, freqs, spec, backend=backend)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    ref_out, ref_grad = reference_forward_backward(x.cpu(), freqs, spec, grad_out.cpu())
    assert_matches(out, ref_out, torch.float32, "forward")
    assert_matches(grad, ref_grad, torch.float32, "backward")

def test_scale_is_part_of_the_static_key():
    plain = rd.RoPESpec(layout="sbhd", dtype="bf16")
    scaled = rd.RoPESpec(layout="sbhd", dtype="bf16", cos_sin_scale=1.25)
    assert plain.cos_sin_scale == 1.0
    assert plain.static_key != scaled.static_key
    assert scaled.static_fields()["cos_sin_scale"] == 1.25


def _use(backend: str, request: pytest.FixtureRequest) -> None:
    """Make ``backend`` usable here (Triton on its CPU interpreter where there is no GPU)."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")


def _yarn_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 64},
    )


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_angle_table_with_the_spec_scale_equals_the_cache_with_the_factor(backend, request):
    """YaRN: the angle table (factor left out) with ``cos_sin_scale = attention_factor`` gives
    what the cos/sin cache (factor inside) gives, q and k in one call, forward and backward."""
    _use(backend, request)
    frequencies = from_hf_config(_yarn_config(), 96)
    factor = frequencies.attention_factor
    assert factor > 1.1  # 0.1 ln 4 + 1
    angles = frequencies.angle_table(96, without_attention_factor=True, device=DEVICE)
    cache = frequencies.cos_sin_cache(96, device=DEVICE)
    q = torch.randn(2, 24, 4, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 24, 2, 32, device=DEVICE, requires_grad=True)
    scaled = rd.RoPESpec(layout="bshd", dtype="fp32", cos_sin_scale=factor)
    plain = rd.RoPESpec(layout="bshd", dtype="fp32")
    out = rd.apply_qk(q, k, angles, scaled, backend=backend)
    expected = rd.apply_qk(q, k, cache, plain, backend="eager")
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    grads = torch.autograd.grad(sum(o.square().sum() for o in out), (q, k))
    expected_grads = torch.autograd.grad(sum(o.square().sum() for o in expected), (q, k))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cos_sin_cache_is_scaled_in_float32(backend, cache_dtype, request):
    """A model's 16-bit cos and sin under a scale that is not a power of two: the scale
    multiplies the cache's values widened to float32 (a product rounded to 16 bits first was
    off by up to 6e-3), forward and backward, against float64 on the cache's own values."""
    _use(backend, request)
    gen = torch.Generator().manual_seed(11)
    angles = torch.rand(8, 8, generator=gen, dtype=torch.float64) * 40 - 20
    cache = rd.CosSinCache(angles.cos().to(cache_dtype).to(DEVICE),
                           angles.sin().to(cache_dtype).to(DEVICE))
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.25)
    x = torch.randn(8, 2, 3, 8, generator=gen).to(DEVICE).requires_grad_(True)
    grad_out = torch.randn(8, 2, 3, 8, generator=gen).to(DEVICE)
    out = rd.apply(x, cache, spec, backend=backend)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    x64 = x.detach().double().requires_grad_(True)
    cos, sin = (c.double()[:, None, None, :] for c in (cache.cos, cache.sin))
    want = 1.25 * (x64 * cos + torch.cat((-x64[..., 4:], x64[..., :4]), -1) * sin)
    (want_grad,) = torch.autograd.grad(want, x64, grad_out.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("kind", ["angles", "cache", "in_place", "partial_interleaved"])
def test_every_table_and_call_kind_scales_the_rotated_channels_only(backend, kind, request):
    _use(backend, request)
    case = fixed_case(scale=0.75, use_cache=kind == "cache", with_starts=True, head_dim=16,
                      rotary_dim=12 if kind == "partial_interleaved" else 16,
                      interleaved=kind == "partial_interleaved")
    t, table, spec, starts, angles = build(case, DEVICE)
    if kind == "in_place":
        x = t.detach().clone().requires_grad_(True)
        out = rd.apply_(x.clone(), table, spec, start_positions=starts, backend=backend)
        t = x
    else:
        out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
    grad_out = torch.randn(out.shape, dtype=torch.float32, device=DEVICE)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")
    d2 = case.rotary_dim
    torch.testing.assert_close(out[..., d2:], t[..., d2:])  # pass-through untouched


@pytest.mark.gpu
def test_triton_compiled_kernel_is_keyed_on_the_scale():
    """Two specs differing only in the scale, same tensors: the second call must not launch
    the first one's compiled kernel (the scale is a compile-time constant)."""
    t = torch.randn(16, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
    freqs = torch.rand(16, 1, 1, 64, device="cuda")
    outs = [
        rd.apply(t, freqs, rd.RoPESpec(layout="sbhd", dtype="bf16", cos_sin_scale=s),
                 backend="triton").float()
        for s in (1.0, 2.0, 1.0, 2.0)
    ]
    torch.testing.assert_close(outs[1], 2 * outs[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_te_output_is_scaled_in_its_rotated_channels_only():
    """TE's kernels have no factor: the backend scales the rotated channels of q and k of its
    output (v and the pass-through channels untouched)."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.5)
    qkv = torch.randn(4, 2, 2, 24)
    call = rd.check_call(qkv, torch.rand(4, 1, 1, 6), spec, split=(8, 8, 8))
    outs = tuple(torch.ones(4, 2, n, 8) for n in (2, 2, 2))
    scaled = _scaled(tuple(o.clone() for o in outs), call)
    for got, scale in zip(scaled, (1.5, 1.5, 1.0)):
        assert torch.equal(got[..., :6], torch.full_like(got[..., :6], scale))
        assert torch.equal(got[..., 6:], torch.ones_like(got[..., 6:]))
    single = rd.check_call(torch.randn(4, 2, 2, 8), torch.rand(4, 1, 1, 6), spec)
    assert torch.equal(_scaled(torch.ones(4, 2, 2, 8), single)[..., :6], torch.full((4, 2, 2, 6), 1.5))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_te_backend_serves_a_scale(packed):
    """TransformerEngine (on the GPU machine) with a cos/sin scale: single tensors and packed
    qkv, forward and backward, against the reference."""
    if not rd.get_backend("te").available:
        pytest.skip("TransformerEngine is not installed here")
    case = fixed_case(dtype=torch.bfloat16, seq=64, heads=4, head_dim=64, rotary_dim=32,
                      scale=1.3)
    if packed:
        qkv_case = QKVCase(case, q_heads=2, v_heads=1, own_k_table=False)
        qkv, table, _, spec, starts, angles, _ = build_qkv(qkv_case, "cuda")
        outs = rd.apply_qkv(qkv, table, spec, qkv_case.split, start_positions=starts, backend="te")
        grads = [torch.randn(o.shape, device="cuda").to(o.dtype) for o in outs]
        ref_outs, ref_grad = reference_qkv_forward_backward(qkv, angles, angles, spec,
                                                            qkv_case.split, grads, starts)
        for name, out, ref in zip("qkv", outs, ref_outs):
            assert_matches(out, ref, qkv.dtype, name)
        (grad,) = torch.autograd.grad(outs, qkv, grads)
        assert_matches(grad, ref_grad, qkv.dtype, "packed gradient")
        return
    t, table, spec, starts, angles = build(case, "cuda")
    out = rd.apply(t, table, spec, start_positions=starts, backend="te")
    grad_out = torch.randn(out.shape, device="cuda").to(out.dtype)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


def test_angle_table_error_points_at_the_spec_scale():
    frequencies = from_hf_config(_yarn_config(), 96)
    with pytest.raises(rd.RoPEError, match="cos_sin_scale"):
        frequencies.angle_table(96)
