"""Calls under ``torch.func``'s transforms (``grad``, ``jvp``, ``vmap``: per-sample gradients,
forward-mode derivatives, Hessian-vector products of a model): every backend that takes the
call gives the float64 reference's values, and a patched Hugging Face model with QK norms has
the unpatched model's ``torch.func.grad``. The transforms' tensors are wrappers with no memory:
nothing on the way may read an address or launch a kernel on them."""

from __future__ import annotations

import pytest
import torch
import transformers

import rope_dispatch as rd
from reference import assert_matches, reference_for, reference_head_norm
from rope_dispatch.integrations import hf

SPEC = rd.RoPESpec(layout="sbhd", dtype="fp32")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["eager", "triton", "compile", "te"]


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(6, 2, 3, 8, generator=gen)
    angles = torch.rand(6, 1, 1, 8, generator=gen) * 6
    weight = torch.randn(8, generator=gen) * 0.5 + 1.0
    return t.to(DEVICE), angles.to(DEVICE), weight.to(DEVICE)


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "triton":  # on Triton's CPU interpreter without CUDA (conftest.py)
        request.getfixturevalue("triton_backend")
    if request.param == "te" and not rd.get_backend("te").available:
        pytest.skip("TransformerEngine is not installed (runs on the GPU machine)")
    return request.param


def _rotated(t, angles, weight=None):
    """float64 reference of one call: an optional head norm (eps 1e-6), then the rotation."""
    x = t if weight is None else reference_head_norm(t, weight, 1e-6, 0.0, "head")
    return reference_for(x, angles, SPEC)


def test_grad_is_the_transposed_rotation(backend):
    t, angles, _ = _inputs()
    w = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = t.double().requires_grad_(True)
    (expected,) = torch.autograd.grad((_rotated(x, angles) * w.double()).sum(), x)
    for call in range(3):  # a call met again is planned
        got = torch.func.grad(lambda x: (rd.apply(x, angles, SPEC, backend=backend) * w).sum())(t)
        assert_matches(got, expected, torch.float32, f"torch.func.grad {call}")


def test_jvp_of_a_linear_map_is_the_map(backend):
    t, angles, _ = _inputs()
    tangent = torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out, derivative = torch.func.jvp(lambda x: rd.apply(x, angles, SPEC, backend=backend),
                                     (t,), (tangent,))
    assert_matches(out, _rotated(t, angles), torch.float32, "jvp's value")
    assert_matches(derivative, _rotated(tangent, angles), torch.float32, "jvp's derivative")


@pytest.mark.parametrize("grad_mode", [True, False])
def test_vmap_over_the_batch_rotates_each_sample(backend, grad_mode):
    """Repeated (a call met again is planned), with and without grad mode."""
    t, angles, _ = _inputs()
    per_sample = torch.func.vmap(
        lambda x: rd.apply(x.unsqueeze(1), angles, SPEC, backend=backend).squeeze(1),
        in_dims=1, out_dims=1)
    with torch.set_grad_enabled(grad_mode):
        for call in range(3):
            assert_matches(per_sample(t), _rotated(t, angles), torch.float32, f"vmap {call}")


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_q_and_k_in_place_under_a_transform(backend, transform):
    """apply_qk_ on views of one tensor, repeated (a call met again keeps a plan, whose guard
    would compare q's and k's addresses)."""
    if backend == "compile":
        pytest.skip("the compile backend serves single tensors only")
    t, angles, _ = _inputs()

    def rotated(x):
        q, k = x[..., :2, :].clone(), x[..., 2:, :].clone()
        rd.apply_qk_(q, k, angles, SPEC, backend=backend)
        return torch.cat((q, k), -2)

    if backend == "te":  # TE writes new single or packed tensors: refused by name, as eagerly
        with pytest.raises(rd.BackendNotSupportedError, match="q and k pairs"):
            torch.func.jvp(rotated, (t,), (t,))
        return

    for call in range(3):
        if transform == "vmap":
            got = torch.func.vmap(lambda x: rotated(x.unsqueeze(1)).squeeze(1), in_dims=1,
                                  out_dims=1)(t)
        else:
            got = torch.func.jvp(rotated, (t,), (t,))[1]
        assert_matches(got, _rotated(t, angles), torch.float32, f"{transform} {call}")


@pytest.mark.parametrize("precise", [False, True])
def test_hessian_vector_products_on_a_rate_table(backend, precise):
    """jvp of grad (a Hessian-vector product) on a RateTable, repeated, then a plain call: the
    angle table the rates make under the transform is not kept on the table (it would hold the
    transform's wrappers past it). For L = sum(rope(x)^2) = sum(x^2), Hv = 2v."""
    t, _, _ = _inputs()
    rates = torch.rand(4, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    table = rd.RateTable(rates, 6, precise=precise)
    v = torch.randn(t.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    loss = torch.func.grad(lambda x: rd.apply(x, table, SPEC, backend=backend).pow(2).sum())
    for call in range(3):
        _, hv = torch.func.jvp(loss, (t,), (v,))
        assert_matches(hv, 2 * v.double(), torch.float32, f"Hv {call}")
    assert_matches(rd.apply(t, table, SPEC, backend=backend),
                   _rotated(t, table.angle_table()), torch.float32, "a plain call after")


@pytest.mark.parametrize("backend", ["eager", "triton"], indirect=True)
def test_per_sample_gradients_through_q_and_k_norms(backend):
    """vmap of grad (per-sample gradients) of apply_qk with both norms: the weights' gradient
    of each sample, against the float64 composition's."""
    t, angles, weight = _inputs()
    k = t[:, :, :1].clone()

    def loss(w, q_one, k_one):
        q_out, k_out = rd.apply_qk(q_one.unsqueeze(1), k_one.unsqueeze(1), angles, SPEC,
                                   q_norm=rd.HeadNorm(w), k_norm=rd.HeadNorm(w), backend=backend)
        return (q_out * q_out).sum() + k_out.sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 1, 1))(weight, t, k)
    for b in range(t.shape[1]):
        w = weight.double().requires_grad_(True)
        q_ref = _rotated(t[:, b:b + 1].double(), angles, w)
        k_ref = _rotated(k[:, b:b + 1].double(), angles, w)
        (expected,) = torch.autograd.grad((q_ref * q_ref).sum() + k_ref.sum(), w)
        assert_matches(got[b], expected, torch.float32, f"sample {b}'s weight gradient")


def test_a_patched_qk_norm_model_has_the_unpatched_models_functional_gradient(triton_backend):
    """torch.func.grad of a tiny Qwen3's loss over its parameters (functional_call), patched
    (q_norm, k_norm and RoPE as one call; the default backend, triton where it runs) and not."""
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval().to(DEVICE)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p):
        return torch.func.functional_call(model, p, (), dict(input_ids=ids, labels=ids)).loss

    expected = torch.func.grad(loss)(params)
    hf.patch(model)
    try:
        got = torch.func.grad(loss)(params)
    finally:
        hf.unpatch(model)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("entry", ["apply", "apply norm", "apply_", "apply_qk", "apply_qkv"])
def test_dual_tensors_of_forward_mode_ad_get_the_rotated_tangent(backend, entry):
    """``torch.autograd.forward_ad`` (dual tensors, no torch.func wrapper): the Triton kernels
    and the compile backend's compiled function dropped the tangent (the output had none, or an
    in-place call kept the input's tangent unrotated). Every backend gives the float64
    reference's derivative, on a first call and on calls met again (planned)."""
    import torch.autograd.forward_ad as fwad

    if backend in ("compile", "te") and entry != "apply" and entry != "apply norm":
        pytest.skip(f"the {backend} backend serves single tensors out of place only")
    if backend == "te" and entry == "apply norm":
        pytest.skip("the te backend refuses a norm stage (tests/test_norm.py checks that)")
    t, angles, weight = _inputs()
    gen = torch.Generator().manual_seed(3)
    tangent = torch.randn(t.shape, generator=gen).to(DEVICE)
    k, k_tangent = t[:, :, :1].clone(), torch.randn(6, 2, 1, 8, generator=gen).to(DEVICE)
    qkv = torch.cat((t, k, k), -2).transpose(-2, -1).reshape(6, 2, 1, 40)  # 3 q heads, k, v
    qkv_tangent = torch.randn(qkv.shape, generator=gen).to(DEVICE)

    def call(x, k, packed):
        if entry == "apply_qk":
            return rd.apply_qk(x, k, angles, SPEC, backend=backend)
        if entry == "apply_qkv":
            return rd.apply_qkv(packed, angles, SPEC, split=(24, 8, 8), backend=backend)[:2]
        if entry == "apply_":
            return (rd.apply_(x.clone(), angles, SPEC, backend=backend),)
        norm = rd.HeadNorm(weight, 1e-6) if entry == "apply norm" else None
        return (rd.apply(x, angles, SPEC, backend=backend, norm=norm),)

    def expected(x, k, packed):
        if entry == "apply_qkv":
            q = torch.stack([packed[..., 0, j * 8:(j + 1) * 8] for j in range(3)], -2)
            return _rotated(q, angles), _rotated(packed[..., 24:32], angles)
        w = weight if entry == "apply norm" else None
        return (_rotated(x, angles, w),) + ((_rotated(k, angles),) if entry == "apply_qk" else ())

    primals = (t.double(), k.double(), qkv.double())
    tangents = (tangent.double(), k_tangent.double(), qkv_tangent.double())
    _, wanted = torch.func.jvp(expected, primals, tangents)
    for repeat in range(3):
        call(t, k, qkv)  # (calls met outside forward AD: planned)
        with fwad.dual_level():
            outs = call(fwad.make_dual(t, tangent), fwad.make_dual(k, k_tangent),
                        fwad.make_dual(qkv, qkv_tangent))
            got = [fwad.unpack_dual(o).tangent for o in outs]
        for i, (g, w) in enumerate(zip(got, wanted)):
            assert g is not None, f"output {i}: no tangent (call {repeat})"
            assert_matches(g, w, torch.float32, f"output {i}'s tangent (call {repeat})")
