"""q and k together (``apply_qk``, ``apply_qk_``): one call for a query and a key with their own
head counts (GQA, MQA) and strides, against the float64 reference, forward and backward, in
place, under torch.compile. On a CPU-only machine the Triton backend runs on its interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from cases import _strided, build, cases, fixed_case, positions_for
from reference import assert_matches, reference_forward_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
STRIDES = ("contiguous", "qkv-slice", "permuted", "channel-strided")


def build_qk(case, k_heads: int, k_strides: str, device: str, per_token: bool = False):
    """q from ``case``; k with ``k_heads`` heads laid out as ``k_strides``; positions if asked."""
    q, table, spec, starts, angles = build(case, device)
    gen = torch.Generator().manual_seed(case.seed + 3)
    shape = (*q.shape[:-2], k_heads, q.shape[-1])
    k = _strided(shape, k_strides, case.dtype, gen, device).requires_grad_(True)
    positions = positions_for(case, q, angles.shape[0]).to(device) if per_token else None
    return q, k, table, spec, (None if per_token else starts), positions, angles


def check_qk(case, k_heads, k_strides, backend, device=DEVICE, per_token=False):
    q, k, table, spec, starts, positions, angles = build_qk(case, k_heads, k_strides, device, per_token)
    q_out, k_out = rd.apply_qk(q, k, table, spec, start_positions=starts, positions=positions,
                               backend=backend)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous()
    gq = torch.randn(q.shape, dtype=torch.float32).to(q.dtype).to(device)
    gk = torch.randn(k.shape, dtype=torch.float32).to(k.dtype).to(device)
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    for name, x, out, g, grad in (("q", q, q_out, gq, grad_q), ("k", k, k_out, gk, grad_k)):
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, g, starts, positions)
        assert_matches(out, ref_out, x.dtype, f"{name} forward")
        assert_matches(grad, ref_grad, x.dtype, f"{name} backward")
    with torch.no_grad():  # in place: the same numbers, the inputs returned
        q2, k2 = q.detach().clone(), k.detach().clone()
        got = rd.apply_qk_(q2, k2, table, spec, start_positions=starts, positions=positions,
                           backend=backend)
    assert got[0] is q2 and got[1] is k2
    assert torch.equal(q2, q_out.detach()) and torch.equal(k2, k_out.detach())


qk_args = st.tuples(st.integers(1, 3), st.sampled_from(STRIDES), st.booleans())


@given(cases(), qk_args)
def test_eager_matches_reference(case, args):
    k_heads, k_strides, per_token = args
    if per_token:
        case = dataclasses.replace(case, cp_size=1, cp_rank=0, with_starts=False, per_token=True)
    check_qk(case, k_heads, k_strides, "eager", "cpu", per_token)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(cases(), qk_args)
def test_triton_matches_reference(case, args):
    k_heads, k_strides, per_token = args
    if per_token:
        case = dataclasses.replace(case, cp_size=1, cp_rank=0, with_starts=False, per_token=True)
    check_qk(case, k_heads, k_strides, "triton", DEVICE, per_token)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_triton_slices_of_one_fused_projection(layout):
    """q (8 heads) and k (2 heads) as views of one [.., 12, d] projection output, rotated in
    place: exactly their own channels change, v's heads and the pass-through channels do not."""
    case = fixed_case(layout=layout, heads=12, head_dim=16, rotary_dim=12, seqlens=(3, 5),
                      with_starts=True)
    fused, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    before = fused.clone()
    q, k = fused[..., :8, :], fused[..., 8:10, :]
    with torch.no_grad():
        rd.apply_qk_(q, k, table, spec, start_positions=starts, backend="triton")
    for name, sl in (("q", slice(0, 8)), ("k", slice(8, 10))):
        ref, _ = reference_forward_backward(before[..., sl, :], angles, spec,
                                            torch.zeros(before[..., sl, :].shape), starts)
        assert_matches(fused[..., sl, :], ref, fused.dtype, name)
    assert torch.equal(fused[..., 10:, :], before[..., 10:, :]), "v untouched"


@pytest.mark.usefixtures("triton_backend")
def test_triton_double_backward_and_grad_in_place():
    case = fixed_case(heads=4, head_dim=8, rotary_dim=8)
    q, k, table, spec, _, _, angles = build_qk(case, 2, "contiguous", DEVICE)
    q_out, k_out = rd.apply_qk(q, k, table, spec, backend="triton")
    vq, vk = torch.randn_like(q_out, requires_grad=True), torch.randn_like(k_out, requires_grad=True)
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (vq, vk), create_graph=True)
    wq, wk = torch.randn_like(gq), torch.randn_like(gk)
    sq, sk = torch.autograd.grad((gq, gk), (vq, vk), (wq, wk))
    assert_matches(sq, rd.apply(wq, table, spec, backend="eager").double(), torch.float32, "q")
    assert_matches(sk, rd.apply(wk, table, spec, backend="eager").double(), torch.float32, "k")
    x, y = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    a, b = rd.apply_qk_(x.clone(), y.clone(), table, spec, backend="triton", grad_in_place=True)
    ga, gb = torch.autograd.grad((a, b), (x, y), (torch.ones_like(a), torch.ones_like(b)))
    ra, rb = torch.autograd.grad(rd.apply_qk(x, y, table, spec, backend="eager"), (x, y),
                                 (torch.ones_like(a), torch.ones_like(b)))
    assert_matches(ga, ra.double(), torch.float32, "q grad in place")
    assert_matches(gb, rb.double(), torch.float32, "k grad in place")


@pytest.mark.usefixtures("triton_backend")
def test_triton_compile_fullgraph():
    case = fixed_case(layout="bshd", heads=4, head_dim=8, rotary_dim=8)
    q, k, table, spec, _, _, angles = build_qk(case, 1, "qkv-slice", DEVICE)

    def scores(q, k):
        qo, ko = rd.apply_qk(q, k, table, spec, backend="triton")
        return (qo.sum(-2, keepdim=True) * ko).sum()

    compiled = torch.compile(scores, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    got = torch.autograd.grad(compiled(q, k), (q, k))
    want = torch.autograd.grad(scores(q, k), (q, k))
    for a, b in zip(got, want):
        assert_matches(a, b.double(), torch.float32, "gradient through compile")


@pytest.mark.parametrize(
    "k, words",
    [
        (torch.randn(5, 2, 1, 8), ["k (5, 2, 1, 8) must match q (5, 2, 3, 16)", "head dim"]),
        (torch.randn(4, 2, 1, 16), ["k (4, 2, 1, 16) must match q"]),
        (torch.randn(5, 2, 1, 16).double(), ["k is float64", "q is float32"]),
        ("k", ["k must be a torch.Tensor", "str"]),
    ],
)
def test_bad_pairs(k, words):
    q = torch.randn(5, 2, 3, 16)
    with pytest.raises((rd.RoPEError, TypeError)) as info:
        rd.apply_qk(q, k, torch.rand(8, 16), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("empty", ["q", "k"])
def test_a_side_without_heads_leaves_the_other_rotated(request, backend, empty):
    """q or k with no heads: the other is still rotated (the pair's launch had skipped both)."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(heads=3, head_dim=8, rotary_dim=8, with_starts=True)
    full, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    none = full[..., :0, :]
    q, k = (none, full) if empty == "q" else (full, none)
    want, _ = reference_forward_backward(full, angles, spec, torch.zeros(full.shape), starts)
    outs = rd.apply_qk(q, k, table, spec, start_positions=starts, backend=backend)
    assert_matches(outs[1 if empty == "q" else 0], want, full.dtype, "out of place")
    assert outs[0 if empty == "q" else 1].shape == none.shape
    x = full.clone()
    pair = (none, x) if empty == "q" else (x, none)
    rd.apply_qk_(*pair, table, spec, start_positions=starts, backend=backend)
    assert_matches(x, want, full.dtype, "in place")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_in_place_pair_of_views_with_a_gradient(request, backend):
    """q and k as views of projections (``proj(x).view(...)``), rotated in place with grad on:
    forward and gradients as the reference's (torch refuses a Function that rotates views in
    place and returns both, so the pair goes one tensor at a time there)."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8, layout="bshd")
    x, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    a = x.flatten(-2).clone().requires_grad_(True)
    b = x[..., :1, :].flatten(-2).clone().requires_grad_(True)
    q, k = (a * 1).unflatten(-1, (2, 8)), (b * 1).unflatten(-1, (1, 8))
    assert q._is_view() and k._is_view()
    gq, gk = torch.randn(q.shape).to(DEVICE), torch.randn(k.shape).to(DEVICE)
    qo, ko = rd.apply_qk_(q, k, table, spec, backend=backend)
    assert qo is q and ko is k
    grad_a, grad_b = torch.autograd.grad((qo, ko), (a, b), (gq, gk))
    for name, src, out, g, grad in (("q", x, qo, gq, grad_a), ("k", x[..., :1, :], ko, gk, grad_b)):
        ref_out, ref_grad = reference_forward_backward(src, angles, spec, g)
        assert_matches(out, ref_out, x.dtype, f"{name} forward")
        assert_matches(grad.unflatten(-1, src.shape[-2:]), ref_grad, x.dtype, f"{name} backward")


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("frozen", ["q", "k"])
def test_a_side_without_a_gradient_stays_without_one(request, backend, in_place, frozen):
    """Only one of q and k requires grad (a frozen projection: LoRA on q alone, say): the other
    side comes out as apply gives it, with no gradient and no graph, its original untouched in
    place; the gradient of the side that has one is the reference's."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8)
    x, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    leaf = x.clone().requires_grad_(True)
    live, still = leaf * 1, x[..., :1, :].clone()
    q, k = (still, live) if frozen == "q" else (live, still)
    call = rd.apply_qk_ if in_place else rd.apply_qk
    outs = call(q, k, table, spec, backend=backend)
    out, frozen_out = (outs[1], outs[0]) if frozen == "q" else outs
    assert not frozen_out.requires_grad and frozen_out.grad_fn is None
    assert not still.requires_grad and still.is_leaf
    g = torch.randn(out.shape).to(DEVICE)
    (grad,) = torch.autograd.grad(out, leaf, g)
    ref_out, ref_grad = reference_forward_backward(x, angles, spec, g)
    assert_matches(out, ref_out, x.dtype, "forward")
    assert_matches(grad, ref_grad, x.dtype, "backward")
    assert_matches(frozen_out, reference_forward_backward(
        x[..., :1, :], angles, spec, torch.zeros(frozen_out.shape))[0], x.dtype, "frozen side")


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("used", ["q", "k"])
@pytest.mark.parametrize("norms", [False, True])
def test_an_unused_side_gets_no_gradient(request, backend, used, norms):
    """Only one of the pair's outputs reaches the loss: the other input (and its norm weight)
    gets None, as two apply calls give it, not a zero tensor (an optimizer steps a zero
    gradient: weight decay, moments); the used side's gradients are the reference's."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8)
    x, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    q, k = x.clone().requires_grad_(True), x[..., :1, :].clone().requires_grad_(True)
    w_q, w_k = (torch.ones(8, device=DEVICE, requires_grad=True) for _ in range(2))
    kw = dict(q_norm=rd.HeadNorm(w_q, 1e-6), k_norm=rd.HeadNorm(w_k, 1e-6)) if norms else {}
    outs = rd.apply_qk(q, k, table, spec, backend=backend, **kw)
    out = outs[0] if used == "q" else outs[1]
    g = torch.randn(out.shape).to(DEVICE)
    grads = torch.autograd.grad(out, (q, k, w_q, w_k), g, allow_unused=True)
    live, idle = (0, 1) if used == "q" else (1, 0)
    assert grads[idle] is None and grads[2 + idle] is None, grads
    assert (grads[2 + live] is not None) == norms
    if not norms:
        src = q if used == "q" else k
        ref_grad = reference_forward_backward(src.detach(), angles, spec, g)[1]
        assert_matches(grads[live], ref_grad, x.dtype, "backward")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_an_unused_side_gets_no_gradient_under_selective_checkpointing(request, backend):
    """Under a dispatch mode (selective activation checkpointing's) the triton backend runs
    its custom op: k's output unused, k gets None there too, as two apply calls give it."""
    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    if backend == "triton":
        request.getfixturevalue("triton_backend")
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8)
    x, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    q, k = x.clone().requires_grad_(True), x[..., :1, :].clone().requires_grad_(True)

    def body(q, k):
        return rd.apply_qk(q, k, table, spec, backend=backend)[0] * 1.0

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    def context():
        return create_selective_checkpoint_contexts(policy)

    out = checkpoint(body, q, k, use_reentrant=False, context_fn=context)
    g = torch.randn(out.shape).to(DEVICE)
    grad_q, grad_k = torch.autograd.grad(out, (q, k), g, allow_unused=True)
    assert grad_k is None, grad_k
    ref_grad = reference_forward_backward(x, angles, spec, g)[1]
    assert_matches(grad_q, ref_grad, x.dtype, "backward")


def test_a_pair_without_k_is_refused():
    q = torch.randn(5, 2, 3, 16)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    for entry in (rd.apply_qk, rd.apply_qk_):
        with pytest.raises(TypeError, match="k must be a torch.Tensor, got None"):
            entry(q, None, torch.rand(8, 16), spec)


def test_in_place_pair_refusals():
    q = torch.randn(5, 2, 3, 16)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    with pytest.raises(rd.RoPEError, match="same tensor as q and k"):
        rd.apply_qk_(q, q, torch.rand(8, 16), spec)
    leaf = torch.randn(5, 2, 1, 16, requires_grad=True)
    with pytest.raises(rd.RoPEError, match="leaf tensor that requires grad"):
        rd.apply_qk_(q, leaf, torch.rand(8, 16), spec)


def _elements(t: torch.Tensor, width: int) -> set[int]:
    """The storage offsets of ``t[..., :width]``'s elements, one by one."""
    index = torch.zeros((), dtype=torch.int64) + t.storage_offset()
    for n, s in zip((*t.shape[:-1], width), t.stride()):
        index = index.unsqueeze(-1) + torch.arange(n) * s
    return set(index.flatten().tolist())


view_args = st.tuples(
    st.lists(st.integers(1, 4), min_size=2, max_size=4),
    st.lists(st.sampled_from([1, 2, 3, 5, 8, 16, 24, 40]), min_size=4, max_size=4),
    st.integers(0, 200),
)


@settings(max_examples=300, deadline=None)
@given(view_args, view_args, st.integers(0, 4))
def test_shared_element_matches_enumeration(a_args, b_args, width):
    """The in-place pair check against the two views' elements listed one by one."""
    from rope_dispatch.overlap import shared_element

    buf = torch.zeros(1000)
    (a_shape, a_strides, a_offset), (b_shape, b_strides, b_offset) = a_args, b_args
    width = min(width, a_shape[-1])
    b_shape = [*b_shape[:-1], a_shape[-1]]
    a = buf.as_strided(a_shape, a_strides[: len(a_shape)], a_offset)
    b = buf.as_strided(b_shape, b_strides[: len(b_shape)], b_offset)
    want = bool(_elements(a, width) & _elements(b, width))
    assert shared_element(a, b, width) is want
    assert shared_element(b, a, width) is want
    assert shared_element(a, b.clone(), width) is False


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.lists(st.integers(1, 3), min_size=1, max_size=3),
       st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 16),
       st.integers(1, 16), st.integers(0, 40), st.integers(0, 40))
def test_shared_element_of_windows_in_rows(period, counts, multiples, a_width, b_width, a_offset,
                                           b_offset):
    """Windows of channels in rows of one buffer with the same strides (slices of one
    projection's heads, whose check is told from each window's place in the row period) against
    the views' elements listed one by one."""
    from rope_dispatch.overlap import shared_element

    buf = torch.zeros(2000)
    strides = [period * m for m in multiples[: len(counts)]]
    counts = counts[: len(strides)]
    a_width, b_width = min(a_width, period), min(b_width, period)
    a = buf.as_strided((*counts, a_width), (*strides, 1), a_offset)
    b = buf.as_strided((*counts, b_width), (*strides, 1), b_offset)
    want = bool(_elements(a, a_width) & _elements(b, b_width))
    assert shared_element(a, b, a_width, b_width) is want
    assert shared_element(b, a, b_width, a_width) is want


def test_in_place_pair_sharing_memory_is_refused():
    """q and k whose rotary channels share elements would be rotated twice: refused with the
    layouts named, on the first call and on a planned one (same shapes and strides, k moved
    onto q's last head); views of disjoint heads, or meeting only in pass-through channels,
    are rotated."""
    import rope_dispatch.dispatch as dispatch

    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=8)
    table = torch.rand(8, 8)
    fused = torch.randn(5, 2, 12, 16)
    with pytest.raises(rd.RoPEError, match=r"share memory .* overlap in their first 8 channels"):
        rd.apply_qk_(fused[..., :8, :], fused[..., 7:9, :], table, spec, backend="eager")
    for _ in range(3):  # planned from the second call on
        x = fused.clone()
        rd.apply_qk_(x[..., :8, :], x[..., 8:10, :], table, spec, backend="eager")
    checked = []
    real_check = dispatch.check_call
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "check_call", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
        x = fused.clone()
        q, k = rd.apply_qk_(x[..., :8, :], x[..., 8:10, :], table, spec, backend="eager")
        assert not checked, "a pair placed as the planned one takes the plan"
        want_q = rd.apply(fused[..., :8, :], table, spec, backend="eager")
        assert torch.equal(q, want_q)
        with pytest.raises(rd.RoPEError, match="share memory"):
            rd.apply_qk_(x[..., :8, :], x[..., 7:9, :], table, spec, backend="eager")
        assert checked, "k moved onto q is checked again"
    flat = fused.flatten(-2)  # k's rotary channels are q's last pass-through ones
    q, k = flat[..., :16].unflatten(-1, (1, 16)), flat[..., 8:24].unflatten(-1, (1, 16))
    want_k = rd.apply(k, table, spec, backend="eager")
    rd.apply_qk_(q, k, table, spec, backend="eager")
    assert torch.equal(k, want_k)


def test_capabilities_explain_and_autotune_key():
    from rope_dispatch import autotune

    q, k = torch.randn(5, 2, 4, 16), torch.randn(5, 2, 1, 16)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    explanation = rd.explain(q, torch.rand(8, 16), spec, k=k)
    assert "q and k (5, 2, 1, 16)" in explanation.call
    if rd.get_backend("compile").available:
        assert "q and k pairs (apply_qk) are not supported" in " ".join(explanation.rejected["compile"])
    call = rd.check_call(q, torch.rand(8, 16), spec, k=k)
    fields = autotune.key_fields(autotune.call_signature(call, [rd.get_backend("eager")]))
    assert fields["k_shape_bucket"] == [8, 2, 1, 16]
