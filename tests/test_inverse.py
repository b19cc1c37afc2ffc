"""``RoPESpec(inverse=True)``: the rotation by minus the angle (the transpose of the rotation),
forward and backward, on every backend that can, against the float64 reference written from
the formula (tests/reference.py); what refuses it, and how it keys decisions and plans.

Triton runs on its CPU interpreter here: its cases are few and small."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import QKVCase, build, build_qkv, cases, fixed_case, positions_for
from reference import (
    assert_matches, max_error, reference_forward_backward, reference_qkv_forward_backward,
)
from rope_dispatch import selftest
from rope_dispatch.call import check_call
from rope_dispatch.call_keys import call_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inverted(spec: rd.RoPESpec) -> rd.RoPESpec:
    """``spec`` with ``inverse=True``."""
    return rd.RoPESpec(**spec.static_fields(), cu_seqlens=spec.cu_seqlens, inverse=True)


def grad_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device)


def check(case, backend: str, device: str) -> None:
    """Forward and input gradient of an inverse ``apply`` against float64 autograd of the
    reference (unequal table halves: the transpose meets each partner's angle)."""
    t, table, spec, starts, angles = build(case, device)
    spec = inverted(spec)
    positions = None
    if case.per_token:
        positions, starts = positions_for(case, t, angles.shape[0]).to(device), None
    out = rd.apply(t, table, spec, start_positions=starts, positions=positions, backend=backend)
    grad_out = grad_like(out, case.seed)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts, positions)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


TRITON_CASES = [
    fixed_case(),  # the lean kernel
    fixed_case(layout="bshd", dtype=torch.bfloat16, interleaved=True, rotary_dim=8,
               with_starts=True, strides="qkv-slice", use_cache=True, scale=1.25),
    fixed_case(layout="thd", dtype=torch.float16, cp_size=2, cp_rank=1, seqlens=(4, 8, 0),
               with_starts=True, strides="permuted"),
    fixed_case(per_token=True, interleaved=True, rotary_dim=8, strides="channel-strided", seed=3),
]


@settings(max_examples=30, deadline=None)
@given(cases())
def test_eager_matches_the_reference(case):
    check(case, "eager", "cpu")


def test_eager_per_token_positions():
    check(fixed_case(layout="thd", per_token=True, rotary_dim=8, seed=4), "eager", "cpu")
    check(fixed_case(layout="bshd", per_token=True, interleaved=True, seed=6), "eager", "cpu")


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("case", TRITON_CASES, ids=["lean", "bshd-cache", "thd-cp", "per-token"])
def test_triton_matches_the_reference(case):
    check(case, "triton", DEVICE)


def test_compile_matches_the_reference():
    """One case: an inverse call's forward is the compiled transpose, its backward the
    compiled rotation (the graphs a plain call of the key uses)."""
    backend = rd.get_backend("compile")
    if not backend.available:
        pytest.skip("; ".join(backend.availability))
    check(fixed_case(layout="bshd", rotary_dim=8, with_starts=True), "compile", "cpu")


def test_compile_backend_uncompiled(monkeypatch):
    """The compile backend's autograd function with its "compiled" functions the eager math
    (no Inductor): more cases, and a double backward, whose gradient of the gradient is the
    inverse itself."""
    from rope_dispatch.backends import compiled

    monkeypatch.setattr(compiled, "_build", compiled._math)
    backend = compiled.CompileBackend()
    for case in TRITON_CASES[1:3]:
        t, table, spec, starts, angles = build(case)
        spec = inverted(spec)
        out = backend.apply(check_call(t, table, spec, starts))
        grad_out = grad_like(out, case.seed).requires_grad_(True)
        (grad,) = torch.autograd.grad(out, t, grad_out, create_graph=True)
        ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts)
        assert_matches(out, ref_out, t.dtype, "forward")
        assert_matches(grad, ref_grad, t.dtype, "backward")
        w = grad_like(grad, 2)
        (second,) = torch.autograd.grad(grad, grad_out, w)
        want = rd.apply(w, table, spec, start_positions=starts, backend="eager")
        assert_matches(second, want.double(), t.dtype, "double backward")


@pytest.fixture(params=["eager", "triton"])
def backend(request) -> str:
    """Each backend that turns by minus the angle without compiling (triton: interpreted)."""
    if request.param == "triton":
        request.getfixturevalue("triton_backend")
    return request.param


def device_of(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def test_table_kinds(backend):
    """A pair cache and a rate table, each against the reference on its angle table."""
    device = device_of(backend)
    t, _, spec, starts, angles = build(fixed_case(layout="bshd", with_starts=True, seed=9), device)
    spec = inverted(spec)
    half = angles.shape[1] // 2
    gen = torch.Generator().manual_seed(5)
    pair = torch.rand(angles.shape[0], half, generator=gen, dtype=torch.float64) * 40
    rates = torch.rand(half, generator=gen) * 2
    cache = torch.cat((pair.cos(), pair.sin()), -1).float().to(device)
    tables = {  # each with its equivalent angle table
        "pair cache": (rd.PairCosSinCache(cache), torch.cat((pair, pair), -1)),
        "rates": (rd.RateTable(rates.to(device), angles.shape[0]),
                  rd.tables.angle_table(rates, angles.shape[0]).flatten(1)),
    }
    for name, (table, equivalent) in tables.items():
        out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
        grad_out = grad_like(out, 1)
        (grad,) = torch.autograd.grad(out, t, grad_out)
        ref_out, ref_grad = reference_forward_backward(t, equivalent, spec, grad_out, starts)
        assert_matches(out, ref_out, t.dtype, f"{name} forward")
        assert_matches(grad, ref_grad, t.dtype, f"{name} backward")


def test_in_place(backend):
    """``apply_`` rotates by minus the angle in place; its backward is the rotation."""
    device = device_of(backend)
    t, table, spec, _, angles = build(fixed_case(rotary_dim=8, seed=2), device)
    spec = inverted(spec)
    x = t.detach().clone().requires_grad_(True)
    y = x.clone()
    assert rd.apply_(y, table, spec, backend=backend) is y
    grad_out = grad_like(y, 2)
    (grad,) = torch.autograd.grad(y, x, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out)
    assert_matches(y, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


def test_q_and_k(backend):
    """``apply_qk`` on slices of one projection (GQA): each as an inverse ``apply``."""
    device = device_of(backend)
    case = fixed_case(layout="bshd", interleaved=True, with_starts=True, seed=8)
    _, table, spec, starts, angles = build(case, device)
    spec = inverted(spec)
    gen = torch.Generator().manual_seed(8)
    fused = torch.randn(2, 5, 6, 16, generator=gen).to(device)
    q = fused[..., :4, :].detach().requires_grad_(True)
    k = fused[..., 4:5, :].detach().requires_grad_(True)
    outs = rd.apply_qk(q, k, table, spec, start_positions=starts, backend=backend)
    grad_outs = [grad_like(o, i) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, (q, k), grad_outs)
    for x, out, grad, grad_out in zip((q, k), outs, grads, grad_outs):
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out, starts)
        assert_matches(out, ref_out, x.dtype, "forward")
        assert_matches(grad, ref_grad, x.dtype, "backward")


def test_packed_qkv(backend):
    """``apply_qkv``: q and k (k with its own table) by minus their angles, v copied; one
    packed gradient (the inverse's forward transposes, its backward rotates)."""
    device = device_of(backend)
    case = QKVCase(fixed_case(layout="thd", rotary_dim=8, with_starts=True, seed=12), q_heads=2,
                   v_heads=1, own_k_table=True)
    qkv, table, k_table, spec, starts, q_angles, k_angles = build_qkv(case, device)
    spec = inverted(spec)
    outs = rd.apply_qkv(qkv, table, spec, case.split, k_freqs=k_table, start_positions=starts,
                        backend=backend)
    grad_outs = [grad_like(o, i) for i, o in enumerate(outs)]
    (grad,) = torch.autograd.grad(outs, qkv, grad_outs)
    ref_outs, ref_grad = reference_qkv_forward_backward(
        qkv, q_angles, k_angles, spec, case.split, grad_outs, starts)
    for name, out, ref in zip("qkv", outs, ref_outs):
        assert_matches(out, ref, qkv.dtype, name)
    assert_matches(grad, ref_grad, qkv.dtype, "packed gradient")


def test_inverse_undoes_the_rotation(backend):
    """With a table of equal halves (as models build it) and no scale, the inverse of the
    rotation returns its input, and the rotation the inverse's, to float32 rounding."""
    device = device_of(backend)
    rates = rd.tables.inverse_frequencies(16, 10000.0)
    for interleaved in (False, True):
        angles = rd.tables.angle_table(rates, 12, interleaved=interleaved).to(device)
        plain = rd.RoPESpec(layout="sbhd", dtype="fp32", interleaved=interleaved)
        inverse = inverted(plain)
        t = torch.randn(6, 2, 3, 24, generator=torch.Generator().manual_seed(1)).to(device)
        for first, second in ((plain, inverse), (inverse, plain)):
            once = rd.apply(t, angles, first, backend=backend)
            back = rd.apply(once, angles, second, backend=backend)
            assert max_error(once, t) > 0.1, "it turned"
            assert max_error(back, t) <= 2e-6, (interleaved, first.inverse)


@pytest.mark.usefixtures("triton_backend")
def test_triton_double_backward():
    """The gradient of an inverse call's gradient with respect to the incoming gradient is the
    inverse itself (the transpose of a transpose)."""
    t, table, spec, _, _ = build(fixed_case(seed=5), DEVICE)
    spec = inverted(spec)
    out = rd.apply(t, table, spec, backend="triton")
    grad_out = grad_like(out, 3).requires_grad_(True)
    (grad,) = torch.autograd.grad(out, t, grad_out, create_graph=True)
    w = grad_like(grad, 4)
    (second,) = torch.autograd.grad(grad, grad_out, w)
    assert_matches(second, rd.apply(w, table, spec, backend="eager").double(), torch.float32)


@pytest.mark.usefixtures("triton_backend")
def test_triton_custom_op_and_its_autograd():
    """The traced path's op takes ``inverse``; its autograd formula is the op transposed."""
    from rope_dispatch.backends.triton_launch import Launch
    from rope_dispatch.backends.triton_rope import op_launch, triton_rope_op

    t, table, spec, _, angles = build(fixed_case(interleaved=True, seed=7), DEVICE)
    spec = inverted(spec)
    described = op_launch(Launch("t", "sbhd", True, 1.0, 1, 0, inverse=True))
    (out,) = triton_rope_op([t], table.reshape(table.shape[0], -1), None, None, None, None, None,
                            described, 0, "")
    grad_out = grad_like(out, 5)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@pytest.mark.usefixtures("triton_backend")
def test_triton_under_torch_compile():
    """Traced (fullgraph), the Triton backend's call is its custom op with ``inverse``, whose
    fake and autograd formula hold it too."""
    t, table, spec, _, angles = build(fixed_case(layout="bshd", rotary_dim=8, seed=13), DEVICE)
    spec = inverted(spec)
    step = torch.compile(lambda x, f: rd.apply(x, f, spec, backend="triton"), backend="aot_eager",
                         fullgraph=True)
    out = step(t, table)
    grad_out = grad_like(out, 6)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


def test_repeated_calls_keep_plain_and_inverse_apart():
    """Decisions and plans are per spec: alternating plain and inverse calls of one shape and
    table (planned after their first call) each give their own result."""
    t, table, spec, _, angles = build(fixed_case(seed=11), "cpu", requires_grad=False)
    inverse = inverted(spec)
    wants = {s.inverse: reference_forward_backward(t, angles, s, torch.ones(t.shape))[0]
             for s in (spec, inverse)}
    for _ in range(3):
        for s in (spec, inverse):
            got = rd.apply(t, table, s, backend="eager")
            assert_matches(got, wants[s.inverse], t.dtype, str(s.inverse))
    assert max_error(wants[True], wants[False]) > 0.1


def test_keys():
    """``inverse`` is in the static key (so dispatch's and autotune's keys tell the two apart),
    and named in a key's JSON fields and a spec's repr only when set: the keys of earlier
    versions' plain calls are unchanged."""
    plain = rd.RoPESpec(layout="sbhd", dtype="bf16")
    inverse = rd.RoPESpec(layout="sbhd", dtype="bf16", inverse=True)
    assert plain.static_key != inverse.static_key and plain != inverse
    assert "inverse" not in plain.static_fields() and "inverse" not in repr(plain)
    assert inverse.static_fields()["inverse"] is True and "inverse=True" in repr(inverse)
    t, table = torch.randn(4, 1, 2, 8).bfloat16(), torch.zeros(4, 8)
    plain_key, inverse_key = (call_key(check_call(t, table, s)) for s in (plain, inverse))
    assert plain_key != inverse_key
    assert "inverse" not in plain_key.fields()["spec"]
    assert inverse_key.fields()["spec"]["inverse"] is True
    assert plain_key.fields()["spec"] == {
        "layout": "sbhd", "dtype": "bfloat16", "rotary_dim": 8, "interleaved": False,
        "max_seqlen": None, "cp_size": 1, "cp_rank": 0, "cos_sin_scale": 1.0,
        "mrope_section": None,
    }
    assert str(rd.explain(t, table, inverse)).splitlines()[0].endswith(", inverse")
    entry = {"fields": {**inverse_key.fields(), "candidates": ["eager"]}, "choice": "eager",
             "times_us": {"eager": 3.0}}
    assert " inverse:" in selftest._entry_line(entry)


@pytest.mark.parametrize("value", ["yes", 1, None, 0.0])
def test_bad_values_are_refused_with_the_field(value):
    with pytest.raises(rd.RoPEError, match="inverse: expected True or False"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", inverse=value)


def test_with_a_norm_stage_it_is_refused():
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", inverse=True)
    t, table = torch.randn(1, 4, 2, 8), torch.zeros(4, 8)
    norm = rd.HeadNorm(torch.ones(8))
    with pytest.raises(rd.RoPEError, match=r"inverse=True .* norm stage \(norm=HeadNorm\)"):
        rd.apply(t, table, spec, norm=norm)
    with pytest.raises(rd.RoPEError, match=r"inverse=True .* norm stage \(k_norm=HeadNorm\)"):
        rd.apply_qk(t, t[..., :1, :], table, spec, k_norm=norm)


def test_te_refuses_it_with_the_reason():
    """TransformerEngine's functions have no inverse option."""
    from rope_dispatch.backends.te import INVERSE_REASON, TEBackend, TEInfo

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", lambda *a, **k: a[0],
                                            frozenset()))
    t, table = torch.randn(4, 1, 2, 8), torch.zeros(4, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    assert INVERSE_REASON not in backend.not_supported_reasons(check_call(t, table, spec))
    reasons = backend.not_supported_reasons(check_call(t, table, inverted(spec)))
    assert INVERSE_REASON in reasons and "have no inverse option" in INVERSE_REASON


def test_a_backend_without_it_refuses_it():
    """The capability defaults to off: a backend that does not declare it is never chosen."""
    class Plain(rd.Backend):
        name = "plain-only"
        devices = frozenset({"cpu"})

        def apply(self, call):
            return call.t.clone()

    call = check_call(torch.randn(4, 1, 2, 8), torch.zeros(4, 8),
                      rd.RoPESpec(layout="sbhd", dtype="fp32", inverse=True))
    assert Plain().not_supported_reasons(call) == [
        "the inverse rotation (spec.inverse=True) is not supported"]


def test_selftest_case():
    """The selftest's inverse case passes on eager (its shipped reference turns back too)."""
    case = next(c for c in selftest.GRID if c.inverse)
    result = selftest.check("eager", case, "cpu", 1)
    assert result["status"] == "ok", result
