"""Per-token positions (``apply(..., positions=P)``): every backend that takes them against the
float64 reference, forward and backward, in place and packed; thd token batches with no
offsets at all. On a CPU-only machine the Triton backend runs on its interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from cases import QKVCase, build, build_qkv, cases, fixed_case, positions_for
from reference import assert_matches, reference_for, reference_forward_backward, reference_qkv_forward_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

per_token_cases = cases(cp_sizes=(1,), starts=(False,)).map(lambda c: dataclasses.replace(c, per_token=True))


def check_positions(case, backend: str, device: str, drop_offsets: bool = False) -> None:
    t, table, spec, _, angles = build(case, device)
    positions = positions_for(case, t, angles.shape[0]).to(device)
    if drop_offsets and spec.layout == "thd":
        spec = rd.RoPESpec(layout="thd", dtype=spec.dtype, interleaved=spec.interleaved)
    out = rd.apply(t, table, spec, positions=positions, backend=backend)
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, positions=positions)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@given(per_token_cases, st.booleans())
def test_eager_matches_reference(case, drop_offsets):
    check_positions(case, "eager", "cpu", drop_offsets)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(per_token_cases, st.booleans())
def test_triton_matches_reference(case, drop_offsets):
    check_positions(case, "triton", DEVICE, drop_offsets)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_in_place_with_positions(backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(layout="bshd", rotary_dim=10, head_dim=16, strides="qkv-slice", per_token=True)
    t, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    positions = positions_for(case, t, angles.shape[0]).to(DEVICE)
    expected = reference_for(t.cpu(), angles, spec, positions=positions.cpu())
    same = rd.apply_(t, table, spec, positions=positions, backend=backend)
    assert same is t
    assert_matches(t, expected, t.dtype, "in place")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_packed_qkv_with_positions(backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    base = fixed_case(layout="thd", heads=2, head_dim=8, rotary_dim=6, seqlens=(3, 4), per_token=True,
                      interleaved=True)
    case = QKVCase(base, q_heads=2, v_heads=1, own_k_table=True)
    qkv, table, k_table, spec, _, q_angles, k_angles = build_qkv(case, DEVICE)
    rows = min(q_angles.shape[0], k_angles.shape[0])
    positions = positions_for(base, qkv, rows).to(DEVICE)
    outs = rd.apply_qkv(qkv, table, spec, case.split, k_freqs=k_table, positions=positions, backend=backend)
    grads = [torch.randn_like(o) for o in outs]
    (grad,) = torch.autograd.grad(outs, qkv, grads)
    ref_outs, ref_grad = reference_qkv_forward_backward(
        qkv, q_angles, k_angles, spec, case.split, grads, positions=positions
    )
    for name, out, ref in zip("qkv", outs, ref_outs):
        assert_matches(out, ref, qkv.dtype, name)
    assert_matches(grad, ref_grad, qkv.dtype, "packed gradient")


def test_te_does_not_take_per_token_positions():
    from rope_dispatch.backends.te import TEBackend, TEInfo

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", lambda t, f, **k: t, frozenset()))
    call = rd.check_call(torch.randn(4, 2, 1, 8), torch.rand(8, 8), rd.RoPESpec(layout="sbhd", dtype="fp32"),
                         positions=torch.zeros(4, 2, dtype=torch.long))
    assert "per-token positions are not supported" in backend.not_supported_reasons(call)


def test_explain_and_autotune_key_name_positions():
    from rope_dispatch import autotune

    t = torch.randn(4, 2, 1, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    positions = torch.tensor([[3, 0], [4, 9], [5, 2], [6, 1]])
    assert rd.explain(t, torch.rand(10, 8), spec, positions=positions).chosen is not None
    call = rd.check_call(t, torch.rand(10, 8), spec, positions=positions)
    fields = autotune.key_fields(autotune.call_signature(call, [rd.get_backend("eager")]))
    assert fields["positions"] is True
    plain = rd.check_call(t, torch.rand(10, 8), spec)
    assert "positions" not in autotune.key_fields(autotune.call_signature(plain, [rd.get_backend("eager")]))


def test_compile_backend_takes_positions():
    """The compile backend traces the eager math with the per-token index (one thd case: each
    new spec compiles)."""
    if not rd.get_backend("compile").available:
        pytest.skip("compile backend unavailable: " + "; ".join(rd.get_backend("compile").availability))
    case = fixed_case(layout="thd", seqlens=(3, 6, 4), per_token=True, interleaved=True, rotary_dim=10)
    check_positions(case, "compile", "cpu", drop_offsets=True)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("index", ["positions", "start_positions", "spec.cu_seqlens"])
@pytest.mark.parametrize("call", ["apply", "apply_qk", "apply_"])
def test_an_index_written_between_forward_and_backward(index, call):
    """An index tensor written in place after the forward (a buffer of positions or offsets
    reused for the next micro-batch): eager's backward gives the forward's gradient (the float64
    reference's); the Triton backend's backward reads the index again, so it once placed each
    token's gradient at the new rows (off by 4). It now raises RoPEError naming the tensor, as
    for the table."""
    gen = torch.Generator().manual_seed(3)
    angles = (torch.rand(16, 8, generator=gen) * 6 - 3).to(DEVICE)
    if index == "spec.cu_seqlens":
        given = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
        spec = rd.RoPESpec(layout="thd", dtype=torch.float32, cu_seqlens=given)
        shape, kwargs = (6, 2, 8), {}
    else:
        spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
        shape = (3, 2, 2, 8)
        given = (torch.randint(0, 8, (3, 2), generator=gen) if index == "positions"
                 else torch.tensor([1, 2])).to(DEVICE)
        kwargs = {index: given}
    saved = given.clone()
    x = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_(True)
    for backend in ("eager", "triton"):
        if call == "apply":
            out = rd.apply(x, angles, spec, backend=backend, **kwargs)
        elif call == "apply_qk":
            out = rd.apply_qk(x, x.detach(), angles, spec, backend=backend, **kwargs)[0]
        else:
            out = rd.apply_(x * 1, angles, spec, backend=backend, **kwargs)
        grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
        with torch.no_grad():
            given[1] += 2
        if backend == "triton":
            with pytest.raises(rd.RoPEError, match=f"{index} was modified in place"):
                torch.autograd.grad(out, x, grad_out)
        else:
            (got,) = torch.autograd.grad(out, x, grad_out)
            x64 = x.detach().double().requires_grad_(True)
            if index == "spec.cu_seqlens":
                ref = reference_for(x64, angles, spec.with_cu_seqlens(saved.cpu()))
            else:
                ref = reference_for(x64, angles, spec, **{index: saved.cpu()})
            (want,) = torch.autograd.grad(ref, x64, grad_out.double())
            assert_matches(got, want, torch.float32, f"{backend} gradient")
        with torch.no_grad():
            given.copy_(saved)
