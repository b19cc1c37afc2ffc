"""Packed qkv calls (``rope_dispatch.apply_qkv``): every backend that serves them against the
float64 reference, forward and backward, and the errors and reasons around them.

On a CPU-only machine the Triton backend runs on its interpreter (small shapes); tests marked
``gpu`` run the compiled kernel and TransformerEngine's fused QKV on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import QKVCase, build_qkv, fixed_case, qkv_cases
from reference import assert_matches, reference_qkv_forward_backward, split_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def check_qkv(case: QKVCase, backend: str, device: str = "cpu", grad: bool = True) -> None:
    """``backend``'s q, k, v and packed gradient match the reference; shapes are TE's."""
    qkv, table, k_table, spec, starts, q_angles, k_angles = build_qkv(case, device, grad)
    outs = rd.apply_qkv(qkv, table, spec, case.split, k_freqs=k_table, start_positions=starts,
                        backend=backend)
    lead, groups = qkv.shape[:-2], qkv.shape[-2]
    q_len, d, v_len = case.split
    expected = [(*lead, groups * q_len // d, d), (*lead, groups, d), (*lead, groups, v_len)]
    assert [tuple(o.shape) for o in outs] == expected
    assert all(o.is_contiguous() and o.dtype == qkv.dtype for o in outs)
    grad_outs = [torch.randn(o.shape, dtype=torch.float32).to(qkv.dtype).to(device) for o in outs]
    ref_outs, ref_grad = reference_qkv_forward_backward(
        qkv, q_angles, k_angles, spec, case.split, grad_outs, starts
    )
    for name, out, ref in zip("qkv", outs, ref_outs):
        assert_matches(out, ref, qkv.dtype, name)
    assert torch.equal(outs[2].cpu(), split_qkv(qkv.detach().cpu(), case.split)[2]), "v is a copy"
    if grad:
        (grad_qkv,) = torch.autograd.grad(outs, qkv, grad_outs)
        assert grad_qkv.shape == qkv.shape
        assert_matches(grad_qkv, ref_grad, qkv.dtype, "packed gradient")


@given(qkv_cases())
def test_eager_matches_reference(case):
    check_qkv(case, "eager")


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(qkv_cases())
def test_triton_matches_reference(case):
    check_qkv(case, "triton", DEVICE)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_triton_gqa_start_positions_context_parallel(layout):
    """GQA (4 query heads a group), two value heads, partial interleaved rotary, start
    positions under context parallelism, k with its own cos/sin cache."""
    base = fixed_case(layout=layout, heads=2, head_dim=8, rotary_dim=6, interleaved=True,
                      cp_size=2, cp_rank=1, seq=6, seqlens=(8, 0, 4), with_starts=True,
                      use_cache=True, strides="permuted")
    check_qkv(QKVCase(base, q_heads=4, v_heads=2, own_k_table=True), "triton", DEVICE)


@pytest.mark.parametrize("form", ["list", "numpy"])
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_split_as_a_list(backend, form, request):
    """``split`` as a list, the form of TE's ``qkv_split_arg_list``, or of NumPy integers (the
    sizes a config computes): the checked call, the call that plans and the planned call all
    match the reference."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = QKVCase(fixed_case(heads=2, head_dim=8, rotary_dim=8), 2, 1, False)
    qkv, table, _, spec, _, angles, _ = build_qkv(case, DEVICE)
    split = (list(case.split) if form == "list"
             else tuple(pytest.importorskip("numpy").int64(n) for n in case.split))
    grad_outs = None
    for _ in range(3):
        outs = rd.apply_qkv(qkv, table, spec, split, backend=backend)
        if grad_outs is None:
            grad_outs = [torch.randn_like(o) for o in outs]
            ref_outs, ref_grad = reference_qkv_forward_backward(
                qkv, angles, angles, spec, case.split, grad_outs
            )
        for name, out, ref in zip("qkv", outs, ref_outs):
            assert_matches(out, ref, qkv.dtype, name)
        (grad,) = torch.autograd.grad(outs, qkv, grad_outs)
        assert_matches(grad, ref_grad, qkv.dtype, "packed gradient")


@pytest.mark.usefixtures("triton_backend")
def test_triton_double_backward_is_the_forward():
    """The packed gradient's own gradient (with respect to q's, k's and v's gradients) is the
    forward map again: twice differentiable, like the single-tensor op."""
    case = QKVCase(fixed_case(heads=2, head_dim=8, rotary_dim=8), 2, 1, True)
    qkv, table, k_table, spec, _, _, _ = build_qkv(case, DEVICE)
    outs = rd.apply_qkv(qkv, table, spec, case.split, k_freqs=k_table, backend="triton")
    grad_outs = [torch.randn_like(o, requires_grad=True) for o in outs]
    (grad,) = torch.autograd.grad(outs, qkv, grad_outs, create_graph=True)
    w = torch.randn_like(grad)
    second = torch.autograd.grad(grad, grad_outs, w)
    with torch.no_grad():
        again = rd.apply_qkv(w, table, spec, case.split, k_freqs=k_table, backend="eager")
    for name, a, b in zip("qkv", second, again):
        assert_matches(a, b.double(), torch.float32, f"double backward {name}")


@pytest.mark.usefixtures("triton_backend")
def test_triton_compile_fullgraph():
    """torch.compile(fullgraph=True) around apply_qkv: the custom ops trace, forward and
    backward, with no graph break."""
    case = QKVCase(fixed_case(layout="bshd", heads=2, head_dim=8, rotary_dim=8), 2, 1, False)
    qkv, table, _, spec, _, angles, _ = build_qkv(case, DEVICE)

    def attention_inputs(x):
        q, k, v = rd.apply_qkv(x * 2, table, spec, case.split, backend="triton")
        return q.sum() + 2 * k.sum() + 3 * v.sum()

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    (grad,) = torch.autograd.grad(compiled(qkv), qkv)
    ones = [torch.full(s, float(c)) for s, c in (((2, 5, 4, 8), 1), ((2, 5, 2, 8), 2), ((2, 5, 2, 8), 3))]
    _, ref_grad = reference_qkv_forward_backward(qkv.detach() * 2, angles, angles, spec, case.split, ones)
    assert_matches(grad, 2 * ref_grad, torch.float32, "gradient through compile")


def test_explain_and_capabilities():
    case = QKVCase(fixed_case(), 2, 1, False)
    qkv, table, _, spec, _, _, _ = build_qkv(case, requires_grad=False)
    explanation = rd.explain(qkv, table, spec, split=case.split)
    assert "packed qkv split (32, 16, 16)" in explanation.call
    assert explanation.chosen is not None
    reasons = " ".join(explanation.rejected.get("compile", []))
    if rd.get_backend("compile").available:
        assert "packed qkv tensors (apply_qkv) are not supported" in reasons


@pytest.mark.parametrize(
    "split, k_freqs, words",
    [
        ((32, 16), None, ["split must be three ints", "(32, 16)"]),
        (None, None, ["split must be three ints", "got None"]),
        ((32, 16, 8.0), None, ["split must be three ints"]),
        ([32, 16, 8.0], None, ["split must be three ints", "[32, 16, 8.0]"]),
        ([32, [16], 16], None, ["split must be three ints", "[32, [16], 16]"]),
        ((32, 16, 0), None, ["split must be positive", "(32, 16, 0)"]),
        ((32, 16, 8), None, ["sums to 56", "qkv's last dim is 64"]),
        ((24, 16, 24), None, ["k=16 is the head dim", "q=24", "v=24"]),
        ((32, 16, 16), torch.rand(8, 1, 1, 12), ["k_freqs has rotary dim 12", "freqs has 16"]),
        ((32, 16, 16), torch.rand(3, 16), ["k_freqs has 3 positions", "needs 5"]),
        ((32, 16, 16), torch.rand(8, 16).double(), ["k_freqs must be float32", "float64"]),
        ((32, 16, 16), "cache", ["k_freqs is a CosSinCache but freqs is an angle table"]),
        ((32, 8, 24), torch.rand(8, 16), ["d2=16", "head dim d=8", "k part of split (32, 8, 24)"]),
    ],
)
def test_bad_qkv_calls(split, k_freqs, words):
    qkv = torch.randn(5, 2, 2, 64)
    if isinstance(k_freqs, str):
        k_freqs = rd.cos_sin_cache(torch.rand(8, 16))
    with pytest.raises(rd.RoPEError) as info:
        rd.apply_qkv(qkv, torch.rand(8, 16), rd.RoPESpec(layout="sbhd", dtype="fp32"), split,
                     k_freqs=k_freqs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("bad", [(8.0, 8, 8), [8.0, 8, 8], (torch.tensor(8), 8, 8)],
                         ids=["float", "float list", "tensor"])
def test_a_planned_split_does_not_admit_equal_non_ints(bad):
    """A split that compares equal to a planned one (8.0 == 8, tensor(8) == 8) is still
    refused as on a first call, not run by that plan."""
    qkv, table = torch.randn(4, 2, 2, 24), torch.rand(8, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    for _ in range(3):  # checked, planned, run by the plan
        rd.apply_qkv(qkv, table, spec, (8, 8, 8), backend="eager")
    with pytest.raises(rd.RoPEError, match="split must be three ints"):
        rd.apply_qkv(qkv, table, spec, bad, backend="eager")


def test_k_freqs_only_with_split():
    with pytest.raises(rd.RoPEError, match="k_freqs is for packed qkv calls"):
        rd.check_call(torch.randn(4, 1, 2, 8), torch.rand(4, 8),
                      rd.RoPESpec(layout="sbhd", dtype="fp32"), k_freqs=torch.rand(4, 8))


def test_k_is_refused_beside_a_split():
    """A packed qkv call takes its k from t: a k given beside ``split`` is refused by name,
    where check_call (and so explain) ignored it."""
    qkv, spec = torch.randn(4, 1, 2, 24), rd.RoPESpec(layout="sbhd", dtype="fp32")
    k = torch.randn(4, 1, 2, 8)
    with pytest.raises(rd.RoPEError, match=r"k is for q and k pairs \(apply_qk\)"):
        rd.check_call(qkv, torch.rand(4, 8), spec, split=(8, 8, 8), k=k)
    with pytest.raises(rd.RoPEError, match=r"k is for q and k pairs \(apply_qk\)"):
        rd.explain(qkv, torch.rand(4, 8), spec, split=(8, 8, 8), k=k)


def test_autotune_key_names_the_split():
    from rope_dispatch import autotune

    case = QKVCase(fixed_case(), 2, 1, False)
    qkv, table, _, spec, _, _, _ = build_qkv(case, requires_grad=False)
    call = rd.check_call(qkv, table, spec, split=case.split)
    fields = autotune.key_fields(autotune.call_signature(call, [rd.get_backend("eager")]))
    assert fields["qkv_split"] == [32, 16, 16]
    single = rd.check_call(qkv[..., :16].contiguous(), table, spec)
    assert "qkv_split" not in autotune.key_fields(autotune.call_signature(single, [rd.get_backend("eager")]))


# ---------------------------------------------------------------- GPU: compiled kernel, TE


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_large_on_gpu(layout, dtype):
    """A model-sized GQA call (8 groups of 4 query heads, d 128) against the reference."""
    base = fixed_case(layout=layout, dtype=dtype, seq=256, batch=2, heads=8, head_dim=128,
                      rotary_dim=128, seqlens=(100, 300, 0, 112), with_starts=True, seed=3)
    check_qkv(QKVCase(base, 4, 1, True), "triton", "cuda")


def _te_qkv_or_skip():
    backend = rd.get_backend("te")
    if not backend.available or backend.info.apply_qkv is None:
        pytest.skip("TransformerEngine with apply_fused_qkv_rotary_pos_emb is not available")
    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 128])
def test_te_fused_qkv_matches_reference(layout, interleaved, rotary_dim, monkeypatch):
    _te_qkv_or_skip()
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")  # TE serves checked start positions only
    base = fixed_case(layout=layout, dtype=torch.bfloat16, seq=64, batch=2, heads=4, head_dim=128,
                      rotary_dim=rotary_dim, interleaved=interleaved, seed=5)
    check_qkv(QKVCase(base, 4, 1, True), "te", "cuda")
    cp = dataclasses.replace(base, cp_size=2, cp_rank=1)
    check_qkv(QKVCase(cp, 2, 1, False), "te", "cuda")
    starts = dataclasses.replace(base, with_starts=True)
    check_qkv(QKVCase(starts, 2, 1, False), "te", "cuda", grad=False)


@pytest.mark.gpu
def test_te_fused_qkv_refusals(monkeypatch):
    _te_qkv_or_skip()
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")
    base = fixed_case(dtype=torch.bfloat16, seq=16, heads=2, head_dim=64, rotary_dim=64,
                      with_starts=True)
    qkv, table, _, spec, starts, _, _ = build_qkv(QKVCase(base, 2, 1, False), "cuda")
    reasons = " ".join(rd.explain(qkv, table, spec, split=(128, 64, 64), start_positions=starts).rejected["te"])
    assert "fused QKV backward" in reasons and "takes no start_positions" in reasons
    strided = qkv.detach().transpose(0, 1).contiguous().transpose(0, 1)
    reasons = " ".join(rd.explain(strided, table, spec, split=(128, 64, 64)).rejected["te"])
    assert "not contiguous" in reasons
