"""``RoPESpec.cos_sin_scale``: a factor on cos and sin (YaRN's and LongRoPE's attention factor,
as Hugging Face applies it), for every table kind and call kind, in every backend that serves
it; TransformerEngine refuses it with the value in the sentence.

The hypothesis cases of the other modules draw scales too (tests/cases.py); these tests pin the
meaning: an angle table with the spec's scale equals the cos/sin cache with the factor inside.
"""

from __future__ import annotations

import math

import pytest
import torch

import rope_dispatch as rd
from cases import build, fixed_case
from reference import assert_matches, reference_forward_backward
from rope_dispatch.backends.te import TEInfo, parse_release, te_reasons
from rope_dispatch.tables import from_hf_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_spec_refuses_a_scale_that_is_not_a_finite_positive_number(bad):
    with pytest.raises(rd.RoPEError, match=r"cos_sin_scale must be a finite number > 0, got"):
        rd.RoPESpec(layout="sbhd", dtype="bf16", cos_sin_scale=bad)


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


def test_te_refuses_a_scale_with_the_value():
    t = torch.randn(4, 2, 2, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.5)
    call = rd.check_call(t, torch.rand(4, 1, 1, 8), spec)
    info = TEInfo("2.20.2", parse_release("2.20.2"), "fake.rope", lambda *a, **k: None, frozenset())
    reasons = te_reasons(call, info)
    assert any("cos_sin_scale=1.5" in r and "2.20.2" in r for r in reasons), reasons
    plain = rd.check_call(t, torch.rand(4, 1, 1, 8), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    assert not any("cos_sin_scale" in r for r in te_reasons(plain, info))


def test_angle_table_error_points_at_the_spec_scale():
    frequencies = from_hf_config(_yarn_config(), 96)
    with pytest.raises(rd.RoPEError, match="cos_sin_scale"):
        frequencies.angle_table(96)
