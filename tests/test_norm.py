"""The norm stage (``HeadNorm``, QK-norm before RoPE): every backend that serves it against the
float64 reference (normalize, then rotate, from the formula), forward and backward, the norm
weights' gradients too; its in-place forms; its errors; the backends that refuse it."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from cases import _strided, build, cases, fixed_case, positions_for
from reference import assert_matches, reference_for, reference_head_norm, split_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
STRIDES = ("contiguous", "qkv-slice", "permuted", "channel-strided")


@dataclasses.dataclass(frozen=True)
class NormCase:
    scope: str
    offset: float
    eps: float
    k_norm: bool  # k has a norm too
    k_heads: int
    k_strides: str


norm_cases = st.builds(
    NormCase, st.sampled_from(("head", "heads")), st.sampled_from((0.0, 1.0)),
    st.sampled_from((1e-6, 1e-5)), st.sampled_from((True, True, False)), st.integers(1, 3),
    st.sampled_from(STRIDES),
)


def weight(n: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=gen) * 0.5 + 1.0).to(dtype).to(device)
    return w.requires_grad_(True)


def norm_of(x: torch.Tensor, case: NormCase, seed: int, w_dtype: torch.dtype) -> rd.HeadNorm:
    n = x.shape[-1] * (1 if case.scope == "head" else x.shape[-2])
    return rd.HeadNorm(weight(n, seed, w_dtype, x.device.type), case.eps, offset=case.offset,
                       scope=case.scope)


def reference(x, norm, angles, spec, starts, positions):
    """float64 ``rotate(norm(x))`` (the norm skipped where ``norm`` is None), on the CPU."""
    y = x if norm is None else reference_head_norm(x, norm.weight, norm.eps, norm.offset,
                                                    norm.scope)
    return reference_for(y, angles.cpu(), spec, starts, positions)


def check_pair(case, nc: NormCase, backend: str, device: str = DEVICE, per_token: bool = False,
               w_dtype: torch.dtype = torch.float32):
    q, table, spec, starts, angles = build(case, device)
    gen = torch.Generator().manual_seed(case.seed + 3)
    k = _strided((*q.shape[:-2], nc.k_heads, q.shape[-1]), nc.k_strides, case.dtype, gen,
                 device).requires_grad_(True)
    positions = positions_for(case, q, angles.shape[0]).to(device) if per_token else None
    if per_token:
        starts = None
    q_norm = norm_of(q, nc, case.seed + 5, w_dtype)
    k_norm = norm_of(k, nc, case.seed + 6, w_dtype) if nc.k_norm else None
    q_out, k_out = rd.apply_qk(q, k, table, spec, start_positions=starts, positions=positions,
                               q_norm=q_norm, k_norm=k_norm, backend=backend)
    gq = torch.randn(q.shape, generator=gen).to(q.dtype).to(device)
    gk = torch.randn(k.shape, generator=gen).to(k.dtype).to(device)
    weights = [n.weight for n in (q_norm, k_norm) if n is not None]
    grads = torch.autograd.grad((q_out, k_out), (q, k, *weights), (gq, gk))

    xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k)]
    ws = [w.detach().cpu().double().requires_grad_(True) for w in weights]
    norms = [None if n is None else dataclasses.replace(n_ref(n), weight=w)
             for n, w in zip((q_norm, k_norm), (ws[0], ws[1] if len(ws) > 1 else None))]
    pos = None if positions is None else positions.cpu()
    refs = [reference(x, n, angles, spec, None if starts is None else starts.cpu(), pos)
            for x, n in zip(xs, norms)]
    ref_grads = torch.autograd.grad(refs, xs + ws, (gq.cpu().double(), gk.cpu().double()))
    for name, got, want in (("q", q_out, refs[0]), ("k", k_out, refs[1])):
        assert_matches(got, want.detach(), case.dtype, f"{name} forward")
    for name, got, want in zip(("dq", "dk", "dw_q", "dw_k"), grads, ref_grads):
        scale = 1.0 if name.startswith("dq") or name.startswith("dk") else (
            1.0 + float(want.abs().max()))
        assert_matches(got / scale, want / scale,
                       case.dtype if got.dtype == case.dtype else torch.float32, name)
    return q, k, table, spec, starts, positions, q_norm, k_norm, q_out, k_out


@dataclasses.dataclass
class _Norm:
    weight: torch.Tensor
    eps: float
    offset: float
    scope: str


def n_ref(norm: rd.HeadNorm) -> _Norm:
    return _Norm(norm.weight, norm.eps, norm.offset, norm.scope)


def _pair_case(case, per_token):
    if per_token:
        case = dataclasses.replace(case, cp_size=1, cp_rank=0, with_starts=False, per_token=True)
    return case


@given(cases(), norm_cases, st.booleans())
def test_eager_matches_reference(case, nc, per_token):
    check_pair(_pair_case(case, per_token), nc, "eager", "cpu", per_token)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(cases(), norm_cases, st.booleans())
def test_triton_matches_reference(case, nc, per_token):
    check_pair(_pair_case(case, per_token), nc, "triton", DEVICE, per_token)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_triton_bf16_model_weights(w_dtype):
    """A bf16 model with bf16 or float32 norm weights (the weight's gradient in its dtype)."""
    case = fixed_case(dtype=torch.bfloat16, heads=4, head_dim=16, rotary_dim=8)
    nc = NormCase("head", 0.0, 1e-6, True, 2, "contiguous")
    *_, q_norm, _, _, _ = check_pair(case, nc, "triton", DEVICE, w_dtype=w_dtype)
    assert q_norm.weight.dtype == w_dtype


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
def test_the_smallest_eps_float32_holds_normalizes_a_zero_head_to_zero(backend):
    """eps at float32's smallest normal number (the smallest HeadNorm takes): an all-zero head
    comes out 0 as the float64 formula gives it, not 0 / 0 (a smaller eps was 0 in float32)."""
    eps = torch.finfo(torch.float32).tiny
    x = torch.randn(3, 1, 2, 8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x[1, 0, 0] = 0.0
    w = torch.linspace(0.5, 1.5, 8).to(DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    angles = rd.tables.default_frequencies(8).angle_table(3, device=DEVICE)
    for _ in range(3):  # the repeated calls' plans too
        with torch.no_grad():
            out = rd.apply(x, angles, spec, norm=rd.HeadNorm(w, eps), backend=backend)
        assert_matches(out, reference_for(reference_head_norm(x.cpu(), w, eps, 0.0, "head"),
                                          angles.cpu(), spec), torch.float32)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("scope", ["head", "heads"])
def test_the_smallest_eps_gives_a_zero_head_a_finite_gradient(backend, scope):
    """eps at float32's smallest normal number: an all-zero head's gradient is ``r * grad * w``
    (r = 2**63), finite in float32; the backward took r**3 (2**189, inf in float32) times the
    head's zero mean of grad * x, and the input's gradient came out NaN on both backends."""
    eps = torch.finfo(torch.float32).tiny
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1, 2, 8, generator=gen)
    x[1] = 0.0  # the whole token: a zero group for either scope
    x = x.to(DEVICE).requires_grad_(True)
    w = torch.linspace(0.5, 1.5, 8 if scope == "head" else 16).to(DEVICE).requires_grad_(True)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    angles = rd.tables.default_frequencies(8).angle_table(2, device=DEVICE)
    grad = (torch.randn(x.shape, generator=gen) * 1e-20).to(DEVICE)
    out = rd.apply(x, angles, spec, norm=rd.HeadNorm(w, eps, scope=scope), backend=backend)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    x64 = x.detach().cpu().double().requires_grad_(True)
    w64 = w.detach().cpu().double().requires_grad_(True)
    want = reference_for(reference_head_norm(x64, w64, eps, 0.0, scope), angles.cpu(), spec)
    want_dx, want_dw = torch.autograd.grad(want, (x64, w64), grad.cpu().double())
    assert torch.isfinite(dx).all()
    torch.testing.assert_close(dx.cpu().double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.cpu().double(), want_dw, rtol=1e-5, atol=1e-25)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_weights_that_are_not_dense(backend, layout):
    """A norm weight that is a strided view (every other entry of a parameter) or expanded (one
    value for every channel): the Triton kernels read a weight as one dense row, so its entries
    were read at the wrong places (silently wrong numbers); it is copied for the launch. Three
    calls each way (the plans of the repeated ones), forward and the weight's gradient, and the
    q and k pair, packed qkv and in-place forms."""
    gen = torch.Generator().manual_seed(5)
    source = (torch.rand(32, generator=gen) + 0.5).to(DEVICE).requires_grad_(True)
    w = source[::2] if layout == "strided" else source[:1].expand(16)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    angles = (torch.rand(8, 16, generator=gen) * 6 - 3).to(DEVICE)

    def ref(x, weight=w):
        return reference_for(reference_head_norm(x, weight, 1e-6, 0.0, "head"), angles, spec)

    for _ in range(3):
        x = torch.randn(4, 2, 2, 16, generator=gen).to(DEVICE)
        k = torch.randn(4, 2, 1, 16, generator=gen).to(DEVICE)
        qkv = torch.randn(4, 2, 1, 48, generator=gen).to(DEVICE)
        with torch.no_grad():
            norm = rd.HeadNorm(w, 1e-6)
            assert_matches(rd.apply(x, angles, spec, norm=norm, backend=backend), ref(x),
                           torch.float32, "apply")
            q_out, k_out = rd.apply_qk(x, k, angles, spec, q_norm=norm, k_norm=norm,
                                       backend=backend)
            assert_matches(q_out, ref(x), torch.float32, "q")
            assert_matches(k_out, ref(k), torch.float32, "k")
            y = x.clone()
            rd.apply_(y, angles, spec, norm=norm, backend=backend)
            assert_matches(y, ref(x), torch.float32, "apply_")
            q3, k3, _ = rd.apply_qkv(qkv, angles, spec, (16, 16, 16), q_norm=norm, k_norm=norm,
                                     backend=backend)
            assert_matches(q3, ref(qkv[..., :16]), torch.float32, "qkv q")
            assert_matches(k3, ref(qkv[..., 16:32]), torch.float32, "qkv k")
        out = rd.apply(x, angles, spec, norm=rd.HeadNorm(w, 1e-6), backend=backend)
        grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
        (grad,) = torch.autograd.grad(out, source, grad_out)
        s64 = source.detach().double().requires_grad_(True)
        expected = ref(x, s64[::2] if layout == "strided" else s64[:1].expand(16))
        (expected_grad,) = torch.autograd.grad(expected, s64, grad_out.double())
        assert_matches(out, expected, torch.float32, "forward with grad")
        assert_matches(grad, expected_grad, torch.float32, "weight gradient")


@pytest.mark.usefixtures("triton_backend")
def test_triton_backward_loop_with_a_short_last_program(monkeypatch):
    """A backward whose programs each take several token blocks, the last fewer than the rest
    (the loop's length runs whole waves, so it need not divide the blocks): gradients and the
    weights' partial sums against the reference."""
    from rope_dispatch.backends import triton_tiles

    chosen = []
    loop = triton_tiles.norm_token_loop

    def spy(blocks, head_groups, sms):
        chosen.append((blocks, loop(blocks, head_groups, sms)[0]))
        return loop(blocks, head_groups, sms)

    monkeypatch.setattr(triton_tiles, "norm_token_loop", spy)
    monkeypatch.setattr(triton_tiles, "sm_count", lambda device: 1)  # a GPU's as the CPU's
    case = fixed_case(layout="bshd", heads=4, head_dim=16, rotary_dim=16, seq=104, batch=1,
                      dtype=torch.float32)
    check_pair(case, NormCase("head", 0.0, 1e-6, True, 2, "contiguous"), "triton")
    assert any(iters > 1 and blocks % iters for blocks, iters in chosen), chosen


@pytest.mark.usefixtures("triton_backend")
def test_weight_gradient_sums_of_each_dtype_keep_their_own_launch(monkeypatch):
    """The weights' gradients are summed from the partial rows by a launch kept for reuse
    (on a GPU): weights of another dtype with the same shapes take a launch of their own, whose
    sums are right in that dtype (float64 column sums of the rows as the reference)."""
    from rope_dispatch.backends import triton_launch

    keys = []
    run_kept = triton_launch._run_kept

    def spy(key, addresses):
        keys.append(key)
        return run_kept(key, addresses)

    monkeypatch.setattr(triton_launch, "_run_kept", spy)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(7, 16, generator=gen).to(DEVICE), torch.randn(3, 16, generator=gen).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        weights = tuple(torch.ones(16, dtype=dtype, device=DEVICE) for _ in rows)
        for got, part in zip(triton_launch.weight_grads(rows, weights), rows):
            assert got.dtype == dtype
            assert_matches(got, part.double().sum(0).cpu(), dtype, f"{dtype} weight gradient")
    assert keys[0] != keys[1] and keys[0] == keys[2] and keys[1] == keys[3], keys


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("scope", ["head", "heads"])
def test_triton_backward_sizes_its_partial_sums_once_per_form(monkeypatch, scope):
    """The buffers of the weights' partial sums are sized from the launch's tiling the first
    time a backward of that form runs; a repeated backward (a training step's) takes the kept
    shapes and only the launch itself works out its arguments, with the same gradients. A
    backward of another sequence length sizes its own."""
    from rope_dispatch.backends import triton_launch

    tiled = []
    segment_arguments = triton_launch._segment_arguments

    def spy(*args):
        tiled.append(args[0].backward)
        return segment_arguments(*args)

    monkeypatch.setattr(triton_launch, "_segment_arguments", spy)
    monkeypatch.setattr(triton_launch, "_partial_shapes", {})
    widths = (16, 16) if scope == "head" else (4 * 16, 2 * 16)
    spec = rd.RoPESpec(layout="bshd", dtype=torch.float32)
    grads = []
    for seq in (6, 6, 9):
        torch.manual_seed(seq)  # the repeated backward's inputs equal the first's
        q = torch.randn(2, seq, 4, 16, device=DEVICE, requires_grad=True)
        k = torch.randn(2, seq, 2, 16, device=DEVICE, requires_grad=True)
        qw, kw = ((torch.rand(n, device=DEVICE) + 0.5).requires_grad_() for n in widths)
        table = rd.tables.angle_table(rd.tables.inverse_frequencies(16, 10000.0), seq).to(DEVICE)
        out = rd.apply_qk(q, k, table, spec, q_norm=rd.HeadNorm(qw, scope=scope),
                          k_norm=rd.HeadNorm(kw, scope=scope), backend="triton")
        tiled.clear()
        grads.append(torch.autograd.grad(out, (q, k, qw, kw), (torch.ones_like(out[0]),
                                                                torch.cos(out[1]))))
        backward_tilings = sum(tiled)
        if len(grads) != 2:
            assert backward_tilings >= 1, (seq, tiled)
        else:  # the interpreter's launch works out its arguments each time, a kept one not
            assert backward_tilings == (0 if torch.cuda.is_available() else 1), tiled
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads[2][0].shape[1] == 9


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("scope", ["head", "heads"])
def test_in_place_rewrites_whole_heads(backend, scope):
    """``apply_qk_`` with norms: the same numbers as ``apply_qk``, every channel of q and k
    rewritten (the pass-through ones normalized too), v's heads of the projection untouched;
    with grad, the same gradients."""
    case = fixed_case(layout="bshd", heads=4, head_dim=16, rotary_dim=8, seq=4, batch=2)
    nc = NormCase(scope, 1.0, 1e-6, True, 2, "contiguous")
    q, k, table, spec, starts, positions, q_norm, k_norm, q_out, k_out = check_pair(
        case, nc, backend, DEVICE)
    proj = torch.cat([q.detach(), k.detach(), k.detach()], dim=-2).clone()
    v_before = proj[..., 6:, :].clone()
    q_view, k_view = proj[..., :4, :], proj[..., 4:6, :]
    with torch.no_grad():
        got = rd.apply_qk_(q_view, k_view, table, spec, start_positions=starts,
                           q_norm=q_norm, k_norm=k_norm, backend=backend)
    assert got[0] is q_view and got[1] is k_view
    torch.testing.assert_close(q_view, q_out.detach(), rtol=0, atol=0)
    torch.testing.assert_close(k_view, k_out.detach(), rtol=0, atol=0)
    assert torch.equal(proj[..., 6:, :], v_before)
    # with grad: a non-leaf rotated in place, its gradients as out of place
    q2, k2 = (x.detach().clone().requires_grad_(True) for x in (q, k))
    q3, k3 = q2 * 1, k2 * 1
    rd.apply_qk_(q3, k3, table, spec, start_positions=starts, q_norm=q_norm, k_norm=k_norm,
                 backend=backend)
    g = torch.randn_like(q3), torch.randn_like(k3)
    dq, dk, dw = torch.autograd.grad((q3, k3), (q2, k2, q_norm.weight), g)
    q4, k4 = (x.detach().clone().requires_grad_(True) for x in (q, k))
    o = rd.apply_qk(q4, k4, table, spec, start_positions=starts, q_norm=q_norm, k_norm=k_norm,
                    backend=backend)
    want = torch.autograd.grad(o, (q4, k4, q_norm.weight), g)
    for got_, want_ in zip((dq, dk, dw), want):
        torch.testing.assert_close(got_, want_)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("written", ["t", "q", "k"])
def test_in_place_refuses_a_weight_in_the_memory_it_writes(backend, written):
    """A norm weight that shares memory with a tensor rotated in place would be overwritten
    while the call still reads it: refused, naming both, by a repeated (planned) call too; a
    weight beside it, in the same buffer but apart from every written element, is served."""
    device = DEVICE if backend == "triton" else "cpu"
    buffer = torch.rand(2, 3, 4, 8, device=device) + 0.5  # bshd: q's 2 heads, k's 1, a spare
    q, k, spare = buffer[..., :2, :], buffer[..., 2:3, :], buffer[0, 0, 3]
    table, spec = torch.rand(4, 8, device=device), rd.RoPESpec(layout="bshd", dtype="fp32")
    inside = {"t": q[0, 1, 1], "q": q[1, 2, 0], "k": k[0, 0, 0]}[written]
    if written == "t":
        def call(w):
            return rd.apply_(q, table, spec, norm=rd.HeadNorm(w), backend=backend)
    else:
        def call(w):
            norms = dict(q_norm=rd.HeadNorm(w)) if written == "k" else dict(k_norm=rd.HeadNorm(w))
            return rd.apply_qk_(q, k, table, spec, backend=backend, **norms)
    name = "norm" if written == "t" else "q_norm" if written == "k" else "k_norm"
    for _ in range(3):  # planned: a repeat with a weight inside what it writes is checked again
        with torch.no_grad():
            call(spare)  # the spare head: apart from q and k
    before = buffer.clone()
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(
                rd.RoPEError, match=f"{name}.weight shares memory with {written} "):
            call(inside)
        assert torch.equal(buffer, before)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("normed", ["q", "k"])
def test_in_place_serves_a_weight_in_the_pass_through_channels_of_a_tensor_without_a_norm(
        backend, normed):
    """Partial rotary: a tensor with no norm of its own has only its rotary channels written,
    so a weight in its pass-through channels is read, never overwritten. It was refused, the
    whole tensor taken for written; it is now served, with the float64 reference's numbers."""
    device = DEVICE if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(12)
    buffer = (torch.rand(1, 16, 3, 16, generator=gen) + 0.5).to(device)  # bshd: q 2 heads, k 1
    q, k = buffer[..., :2, :], buffer[..., 2:3, :]
    weight = (k if normed == "q" else q)[0, :, 0, 12]  # a pass-through channel of each token
    table, spec = (torch.rand(16, 8, generator=gen) * 6 - 3).to(device), rd.RoPESpec(
        layout="bshd", dtype="fp32")
    w64 = weight.cpu().double()
    norms = {f"{normed}_norm": rd.HeadNorm(weight, 1e-6)}
    for _ in range(2):  # planned the second time
        qd, kd = q.cpu().double(), k.cpu().double()
        want_q = reference_for(reference_head_norm(qd, w64, 1e-6, 0.0, "head")
                               if normed == "q" else qd, table.cpu(), spec)
        want_k = reference_for(reference_head_norm(kd, w64, 1e-6, 0.0, "head")
                               if normed == "k" else kd, table.cpu(), spec)
        with torch.no_grad():
            rd.apply_qk_(q, k, table, spec, backend=backend, **norms)
        assert_matches(q, want_q, torch.float32, "q")
        assert_matches(k, want_k, torch.float32, "k")
        assert torch.equal(weight.cpu().double(), w64)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_single_tensor_and_packed_qkv(backend, layout):
    """``apply(norm=)``, ``apply_(norm=)`` and ``apply_qkv(q_norm=, k_norm=)`` against the
    reference, forward and backward."""
    case = fixed_case(layout=layout, heads=2, head_dim=8, rotary_dim=4, interleaved=True)
    t, table, spec, starts, angles = build(case, DEVICE)
    norm = rd.HeadNorm(weight(16, 1, torch.float32, DEVICE), 1e-5, scope="heads")
    out = rd.apply(t, table, spec, norm=norm, backend=backend)
    g = torch.randn_like(out)
    dt, dw = torch.autograd.grad(out, (t, norm.weight), g)
    x = t.detach().double().cpu().requires_grad_(True)
    w = norm.weight.detach().double().cpu().requires_grad_(True)
    ref = reference(x, _Norm(w, 1e-5, 0.0, "heads"), angles, spec, starts, None)
    rdt, rdw = torch.autograd.grad(ref, (x, w), g.double().cpu())
    assert_matches(out, ref.detach(), case.dtype, "forward")
    assert_matches(dt, rdt, case.dtype, "backward")
    assert_matches(dw / (1 + rdw.abs().max()), rdw / (1 + rdw.abs().max()), case.dtype, "dw")
    with torch.no_grad():
        same = t.detach().clone()
        assert rd.apply_(same, table, spec, norm=norm, backend=backend) is same
    torch.testing.assert_close(same, out.detach(), rtol=0, atol=0)

    split = (16, 8, 8)
    qkv, table, spec, starts, angles = build(
        dataclasses.replace(case, head_dim=sum(split), rotary_dim=4), DEVICE)
    q_norm = rd.HeadNorm(weight(8, 2, torch.float32, DEVICE), offset=1.0)
    k_norm = rd.HeadNorm(weight(8, 3, torch.float32, DEVICE))
    outs = rd.apply_qkv(qkv, table, spec, split, q_norm=q_norm, k_norm=k_norm, backend=backend)
    gs = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, (qkv, q_norm.weight, k_norm.weight), gs)
    x = qkv.detach().double().cpu().requires_grad_(True)
    wq, wk = (n.weight.detach().double().requires_grad_(True) for n in (q_norm, k_norm))
    q, k, v = split_qkv(x, split)
    refs = (reference(q, _Norm(wq, 1e-6, 1.0, "head"), angles, spec, starts, None),
            reference(k, _Norm(wk, 1e-6, 0.0, "head"), angles, spec, starts, None), v)
    want = torch.autograd.grad(refs, (x, wq, wk), [g.double().cpu() for g in gs])
    for o, r, name in zip(outs, refs, "qkv"):
        assert_matches(o, r.detach(), case.dtype, name)
    assert_matches(got[0], want[0], case.dtype, "dqkv")
    for a, b in zip(got[1:], want[1:]):
        assert_matches(a / (1 + b.abs().max()), b / (1 + b.abs().max()), case.dtype, "dw")


@pytest.mark.usefixtures("triton_backend")
def test_traced_call_with_norm_matches():
    """Under torch.compile (fullgraph) a norm call takes the float32 composition: the same
    numbers as the eager call, gradients included."""
    case = fixed_case(layout="bshd", heads=2, head_dim=8, rotary_dim=8)
    q, table, spec, starts, angles = build(case, DEVICE)
    k = q.detach()[..., :1, :].clone().requires_grad_(True)
    q_norm = rd.HeadNorm(weight(8, 1, torch.float32, DEVICE))

    def step(q, k):
        a, b = rd.apply_qk(q, k, table, spec, q_norm=q_norm, backend="triton")
        return (a * a).sum() + b.sum()

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k)
    grads = torch.autograd.grad(got, (q, k, q_norm.weight))
    want = step(q, k)
    want_grads = torch.autograd.grad(want, (q, k, q_norm.weight))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


def test_bad_norms_are_named():
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    table, spec = torch.randn(4, 8), rd.RoPESpec(layout="bshd", dtype="fp32")
    with pytest.raises(rd.RoPEError, match=r"q_norm.weight has 7 entries but scope='head' needs head_dim = 8"):
        rd.apply_qk(q, k, table, spec, q_norm=rd.HeadNorm(torch.ones(7)))
    with pytest.raises(rd.RoPEError, match=r"k_norm.weight has 8 entries .* heads \* head_dim = 2 \* 8 = 16"):
        rd.apply_qk(q, k, table, spec, k_norm=rd.HeadNorm(torch.ones(8), scope="heads"))
    with pytest.raises(rd.RoPEError, match="scope must be one of"):
        rd.HeadNorm(torch.ones(8), scope="tokens")
    with pytest.raises(rd.RoPEError, match="eps must be positive, got 0"):
        rd.HeadNorm(torch.ones(8), eps=0)
    # float32 cannot hold them: eps 0 there (a zero head normalized to NaN, not 0), offset inf
    for eps in (1e-46, 1e-40, 1e39):
        with pytest.raises(rd.RoPEError, match="eps must lie in float32's normal range"):
            rd.HeadNorm(torch.ones(8), eps=eps)
    with pytest.raises(rd.RoPEError, match="offset must be a number float32 holds"):
        rd.HeadNorm(torch.ones(8), offset=-1e39)
    for name in ("eps", "offset"):  # ints past float64's range: float()'s OverflowError before
        with pytest.raises(rd.RoPEError, match=f"HeadNorm {name} must be a number float32 holds"):
            rd.HeadNorm(torch.ones(8), **{name: 10**400})
    with pytest.raises(rd.RoPEError, match="1-D float tensor"):
        rd.HeadNorm(torch.ones(8, dtype=torch.int64))
    with pytest.raises(rd.RoPETypeError, match="q_norm must be a rope_dispatch.HeadNorm"):
        rd.apply_qk(q, k, table, spec, q_norm=torch.ones(8))


def test_a_norms_form_is_read_only_and_its_weight_replaceable():
    """eps, offset and scope are fixed when a HeadNorm is made (its launches and plans are
    compiled for its form): assigning or deleting ``form`` raised nothing and left the norm
    computing with one form while reporting another. The weight may still be replaced."""
    gen = torch.Generator().manual_seed(37)
    x, angles = torch.randn(5, 2, 3, 8, generator=gen), torch.rand(5, 8, generator=gen) * 6
    norm = rd.HeadNorm(torch.rand(8, generator=gen) + 0.5, 0.25)
    form = norm.form
    with pytest.raises(AttributeError, match="HeadNorm.form is fixed when the norm is made"):
        norm.form = form._replace(eps=1e-6)
    with pytest.raises(AttributeError, match="HeadNorm.form is fixed"):
        del norm.form
    assert norm.form is form and norm.eps == 0.25
    norm.weight = weight = torch.rand(8, generator=gen) + 0.5
    assert norm.weight is weight
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    want = reference_for(reference_head_norm(x, weight, 0.25, 0.0, "head"), angles, spec)
    assert_matches(rd.apply(x, angles, spec, norm=norm, backend="eager"), want, torch.float32)


def test_init_again_on_a_made_norm_is_refused():
    """Calling ``__init__`` again on a made norm changed its fixed form (and weight) behind the
    read-only ``form``: refused, the norm left as it was and computing with its own form."""
    gen = torch.Generator().manual_seed(38)
    x, angles = torch.randn(5, 2, 3, 8, generator=gen), torch.rand(5, 8, generator=gen) * 6
    weight = torch.rand(8, generator=gen) + 0.5
    norm = rd.HeadNorm(weight, 0.25, offset=1.0)
    form = norm.form
    with pytest.raises(AttributeError, match=r"HeadNorm is made once: __init__ called again on "
                                             r"HeadNorm\(weight\[8\], eps=0.25, offset=1.0"):
        norm.__init__(torch.ones(8), 1e-6, scope="head")
    assert norm.form is form and norm.weight is weight

    class Scaled(rd.HeadNorm):
        pass

    sub = Scaled(weight, 0.25)
    with pytest.raises(AttributeError, match="Scaled is made once"):
        rd.HeadNorm.__init__(sub, weight, 0.5)
    assert sub.eps == 0.25
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    want = reference_for(reference_head_norm(x, weight, 0.25, 1.0, "head"), angles, spec)
    assert_matches(rd.apply(x, angles, spec, norm=norm, backend="eager"), want, torch.float32)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickled_or_copied_norm_normalizes_as_the_original(protocol):
    """A HeadNorm pickled at any protocol (protocols 0 and 1 raised TypeError: a class with
    __slots__ and no __getstate__) or copied keeps its weight, eps, offset and scope."""
    gen = torch.Generator().manual_seed(31)
    x, angles = torch.randn(5, 2, 3, 8, generator=gen), torch.rand(5, 8, generator=gen) * 6
    norm = rd.HeadNorm(torch.rand(24, generator=gen) + 0.5, 0.125, offset=1.0, scope="heads")
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    want = reference_for(reference_head_norm(x, norm.weight, 0.125, 1.0, "heads"), angles, spec)
    for copied in (pickle.loads(pickle.dumps(norm, protocol)), copy.copy(norm),
                   copy.deepcopy(norm)):
        assert (copied.eps, copied.offset, copied.scope) == (0.125, 1.0, "heads")
        assert copied.form is norm.form
        assert_matches(rd.apply(x, angles, spec, norm=copied, backend="eager"), want,
                       torch.float32)
    assert copy.copy(norm).weight is norm.weight


def test_backends_without_the_stage_refuse_it():
    """A backend that does not declare ``supports_norm`` (TransformerEngine's) says why."""
    class RotationOnly(rd.Backend):
        name = "rotation-only"
        tensors = frozenset({"t", "qk"})

    call = rd.check_call(torch.randn(2, 3, 4, 8), torch.randn(4, 8),
                         rd.RoPESpec(layout="bshd", dtype="fp32"),
                         q_norm=rd.HeadNorm(torch.ones(8)))
    assert RotationOnly().not_supported_reasons(call) == [
        "a norm before the rotation (norm=, q_norm=, k_norm=: HeadNorm) is not supported"]
    assert not RotationOnly().not_supported_reasons(call._replace(norm=None))
    assert not rd.get_backend("te").supports_norm


def test_explain_names_the_norm_and_the_refusals():
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    table, spec = torch.randn(4, 8), rd.RoPESpec(layout="bshd", dtype="fp32")
    text = str(rd.explain(q, table, spec, k=k, q_norm=rd.HeadNorm(torch.ones(8)),
                          k_norm=rd.HeadNorm(torch.ones(8), offset=1.0)))
    assert "q_norm head (offset 0)" in text and "k_norm head (offset 1)" in text
    chosen = text.splitlines()[1]
    assert chosen.startswith(("backend: eager", "backend: triton")), text


def test_explain_takes_norm_as_apply_names_it():
    """explain(..., norm=) explains apply(..., norm=): the same call's arguments work in both."""
    t, table = torch.randn(2, 3, 4, 8), torch.randn(4, 8)
    spec, norm = rd.RoPESpec(layout="bshd", dtype="fp32"), rd.HeadNorm(torch.ones(8), 1e-5)
    assert "norm head (offset 0)" in str(rd.explain(t, table, spec, norm=norm))
    with pytest.raises(rd.RoPEError, match="norm and q_norm both given"):
        rd.explain(t, table, spec, norm=norm, q_norm=norm)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("sides", ["q", "k", "shared"])
def test_repeated_one_sided_and_shared_norms_follow_each_calls_weights(backend, sides):
    """A plan made for a call with q's norm only, k's only, or one weight object for both is
    served to later calls with other weights (one plan per key), and their numbers are those
    weights'; a later call with two distinct weights where the plan saw one shared weight is
    checked again, and right too."""
    case = fixed_case(layout="bshd", heads=4, head_dim=16, rotary_dim=8, seq=3, batch=2)
    q, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    k = q[..., :2, :].clone()

    def weights(seed):
        return [weight(16, seed + i, torch.float32, DEVICE).detach() for i in range(2)]

    def norms(ws):
        if sides == "shared":
            return ws[0], ws[0]
        return (ws[0], None) if sides == "q" else (None, ws[1])

    def check(ws):
        qw, kw = norms(ws)
        got = rd.apply_qk_(q.clone(), k.clone(), table, spec, backend=backend,
                           q_norm=None if qw is None else rd.HeadNorm(qw, 1e-5),
                           k_norm=None if kw is None else rd.HeadNorm(kw, 1e-5))
        for x, w, out in zip((q, k), (qw, kw), got):
            norm = None if w is None else _Norm(w.cpu(), 1e-5, 0.0, "head")
            assert_matches(out, reference(x.cpu(), norm, angles, spec, None, None), case.dtype)

    with torch.no_grad():
        for seed in (1, 1, 1):  # planned at the second call
            check(weights(seed))
        planned = len(rd.dispatch._plans)
        for seed in (11, 21, 31):  # other weight objects and values, of the same form
            check(weights(seed))
        assert len(rd.dispatch._plans) == planned, "one plan serves other weights of one form"
        if sides == "shared":  # two weights where the plan saw one: checked again
            ws = weights(41)
            got = rd.apply_qk_(q.clone(), k.clone(), table, spec, backend=backend,
                               q_norm=rd.HeadNorm(ws[0], 1e-5), k_norm=rd.HeadNorm(ws[1], 1e-5))
            for x, w, out in zip((q, k), ws, got):
                assert_matches(out, reference(x.cpu(), _Norm(w.cpu(), 1e-5, 0.0, "head"), angles,
                                              spec, None, None), case.dtype)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("kind", ["t", "qk", "qk, k's norm only", "qkv"])
def test_a_bound_norm_plan_passes_each_calls_weights_in_its_slots(stand_in_binder, kind):
    """The Triton backend's plan of a norm call hands its bound launch exactly the tensors the
    launch's slots were made for, in their order: the data, the index (an address where there
    is none), then the weights of the call being served, not those of the call it was made for
    (the stand-in binder declines it: the numbers come from the generic path)."""
    from rope_dispatch.backends import triton_rope

    case = fixed_case(layout="sbhd", heads=2, head_dim=32 if kind == "qkv" else 8, rotary_dim=4,
                      seq=3, batch=2)
    x, table, spec, _, _ = build(case, DEVICE, requires_grad=False)
    split = (16, 8, 8) if kind == "qkv" else None
    k = None if kind in ("t", "qkv") else x[..., :1, :].clone()
    width = 8

    def norms(seed):
        ws = [rd.HeadNorm(weight(width, seed + i, torch.float32, DEVICE).detach()) for i in (0, 1)]
        return (ws[0], None) if kind == "t" else (None, ws[1]) if "only" in kind else tuple(ws)

    first, later = norms(1), norms(7)
    with torch.no_grad():
        call = rd.check_call(x, table, spec, k=k, split=split, q_norm=first[0], k_norm=first[1])
        run = triton_rope.plan(call, lambda *args: "generic")
        assert run(x, table, spec, None, None, k, later) == "generic"
    weights = tuple(n.weight for n in later if n is not None)
    data = (x,) if k is None else (x, k)
    passed = stand_in_binder["passed"]
    assert len(passed) == len(stand_in_binder["given"]) == len(data) + 1 + len(weights)
    assert all(a is b for a, b in zip(passed, data)), "the data first"
    assert isinstance(passed[len(data)], int), "an address standing for no index"
    assert all(a is b for a, b in zip(passed[len(data) + 1:], weights)), "the call's weights"


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_repeated_packed_calls_with_norms_are_planned_and_right(backend):
    """A packed qkv call with q's and k's norms, repeated without grad, runs its plan (one
    tensor and two weights per call) with each call's weights: the float64 reference's
    numbers at every call."""
    case = fixed_case(layout="sbhd", heads=2, head_dim=32, rotary_dim=4, seq=3, batch=2)
    split = (16, 8, 8)
    qkv, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    with torch.no_grad():
        before = len(rd.dispatch._plans)
        for seed in (1, 1, 2, 3):
            wq, wk = (weight(8, seed + i, torch.float32, DEVICE).detach() for i in (0, 10))
            outs = rd.apply_qkv(qkv, table, spec, split, q_norm=rd.HeadNorm(wq, offset=1.0),
                                k_norm=rd.HeadNorm(wk), backend=backend)
            q, k, v = split_qkv(qkv.double().cpu(), split)
            refs = (reference(q, _Norm(wq.cpu(), 1e-6, 1.0, "head"), angles, spec, starts, None),
                    reference(k, _Norm(wk.cpu(), 1e-6, 0.0, "head"), angles, spec, starts, None),
                    v)
            for o, r, name in zip(outs, refs, "qkv"):
                assert_matches(o, r, case.dtype, name)
        assert len(rd.dispatch._plans) == before + 1, "a repeated packed call is planned"


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_repeated_inference_calls_are_planned_and_follow_the_weights(backend):
    """Without grad, a repeated norm call runs its plan (decode's host path): the same numbers
    as a checked call, a weight whose storage moved (``.data =``, a module's ``.to()``) read
    where it now lies, another layer's weights of the same form served by the same plan, and
    no weight kept alive by it."""
    import gc
    import weakref

    case = fixed_case(layout="bshd", heads=4, head_dim=16, rotary_dim=8, seq=3, batch=2)
    q, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    k = q[..., :2, :].clone()
    w = {side: torch.nn.Parameter(weight(16, s, torch.float32, DEVICE).detach())
         for side, s in (("q", 1), ("k", 2))}

    def call(**kw):
        return rd.apply_qk_(q.clone(), k.clone(), table, spec, q_norm=rd.HeadNorm(w["q"], 1e-5),
                            k_norm=rd.HeadNorm(w["k"], offset=1.0), backend=backend, **kw)

    def want():
        return [reference(x.cpu(), _Norm(w[side].detach().cpu(), eps, off, "head"), angles, spec,
                          None, None)
                for x, side, eps, off in ((q, "q", 1e-5, 0.0), (k, "k", 1e-6, 1.0))]

    with torch.no_grad():
        first = call()
        before = len(rd.dispatch._plans)
        for _ in range(3):
            again = call()
        assert len(rd.dispatch._plans) == before + 1, "a repeated call is planned"
        for a, b, r in zip(first, again, want()):
            assert torch.equal(a, b)
            assert_matches(b, r, case.dtype)
        w["q"].data = w["q"].data * 3  # new storage, same parameter object
        for a, r in zip(call(), want()):
            assert_matches(a, r, case.dtype)
        planned = len(rd.dispatch._plans)
        # another layer's weights of the same form and layout: the same plan, their numbers
        w.update({side: torch.nn.Parameter(weight(16, s, torch.float32, DEVICE).detach())
                  for side, s in (("q", 3), ("k", 4))})
        for _ in range(2):
            for a, r in zip(call(), want()):
                assert_matches(a, r, case.dtype)
        assert len(rd.dispatch._plans) == planned, "one plan serves every layer of one form"
    gone = weakref.ref(w["q"])
    del w["q"]
    gc.collect()
    assert gone() is None, "a plan keeps no weight alive"


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("wants", ["weights", "data"])
def test_repeated_calls_wanting_a_gradient_are_checked_each_time(backend, wants):
    """A training step's norm call, repeated with the same tensors' layouts: where the weights
    (or q and k) want a gradient it is never planned (the weights are inputs of the autograd
    graph), and every step's weight gradients match the float64 reference's."""
    case = fixed_case(layout="bshd", heads=4, head_dim=16, rotary_dim=8, seq=3, batch=2)
    q0, table, spec, _, angles = build(case, DEVICE, requires_grad=False)
    k0 = q0[..., :2, :].clone()
    gen = torch.Generator().manual_seed(7)
    before = len(rd.dispatch._plans)
    for step in range(3):
        w = [weight(16, 11 + 2 * step + i, torch.float32, DEVICE) for i in range(2)]
        if wants == "data":
            w = [x.detach() for x in w]
        q, k = (x.clone().requires_grad_(wants == "data") for x in (q0, k0))
        q_norm, k_norm = rd.HeadNorm(w[0]), rd.HeadNorm(w[1], offset=1.0)
        outs = rd.apply_qk(q, k, table, spec, q_norm=q_norm, k_norm=k_norm, backend=backend)
        grads_out = [torch.randn(o.shape, generator=gen).to(o.dtype).to(DEVICE) for o in outs]
        wrt = w if wants == "weights" else [q, k]
        got = torch.autograd.grad(outs, wrt, grads_out)
        xs = [x.detach().cpu().double().requires_grad_(wants == "data") for x in (q0, k0)]
        ws = [x.detach().cpu().double().requires_grad_(wants == "weights") for x in w]
        ref = [reference(x, _Norm(wt, 1e-6, off, "head"), angles, spec, None, None)
               for x, wt, off in zip(xs, ws, (0.0, 1.0))]
        want = torch.autograd.grad(ref, ws if wants == "weights" else xs,
                                   [g.cpu().double() for g in grads_out])
        for a, b in zip(got, want):
            if wants == "weights":  # a sum over every token and head: compared at its scale
                scale = 1.0 + float(b.abs().max())
                assert_matches(a / scale, b / scale, torch.float32, f"step {step} dw")
            else:
                assert_matches(a, b, case.dtype, f"step {step} dq, dk")
    assert len(rd.dispatch._plans) == before, "a call wanting a gradient through norms is unplanned"


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_packed_qkv_with_norms_and_no_tokens(backend, layout):
    """A packed qkv of no tokens (a batch of empty sequences) with q and k norms: empty outputs
    and gradients, zero weight gradients, forward and backward (the backward once pointed a
    view past the empty storage)."""
    shape = (2, 0, 1, 8) if layout == "bshd" else (0, 1, 8)
    qkv = torch.randn(shape, device=DEVICE, requires_grad=True)
    cu = None if layout == "bshd" else torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    spec = rd.RoPESpec(layout=layout, dtype="fp32", cu_seqlens=cu)
    norms = [rd.HeadNorm(weight(2, seed, torch.float32, DEVICE)) for seed in (4, 5)]
    outs = rd.apply_qkv(qkv, torch.rand(4, 2, device=DEVICE), spec, (4, 2, 2), q_norm=norms[0],
                        k_norm=norms[1], backend=backend)
    assert [tuple(o.shape) for o in outs] == [(*shape[:-2], 2, 2), (*shape[:-2], 1, 2),
                                              (*shape[:-2], 1, 2)]
    grads = torch.autograd.grad(sum(o.sum() for o in outs), (qkv, *(n.weight for n in norms)))
    assert grads[0].shape == qkv.shape
    for g in grads[1:]:
        torch.testing.assert_close(g, torch.zeros(2, device=DEVICE), rtol=0, atol=0)


@pytest.mark.usefixtures("triton_backend")
def test_a_head_norms_eps_offset_and_scope_are_fixed_and_its_weight_is_read_each_call():
    """What the launches are compiled for (eps, offset, scope) cannot be changed on a HeadNorm
    (a changed eps once left the Triton backend on the old one); a weight written or replaced
    is read by the next call, planned or not, on every backend."""
    norm = rd.HeadNorm(weight(8, 6, torch.float32, DEVICE).detach(), 1e-6, offset=1.0)
    for name, value in (("eps", 1.0), ("offset", 0.0), ("scope", "heads")):
        with pytest.raises(AttributeError):
            setattr(norm, name, value)
    assert (norm.eps, norm.offset, norm.scope) == (1e-6, 1.0, "head")
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8)
    t, table, spec, starts, angles = build(case, DEVICE)
    x = t.detach()
    for step in range(4):
        if step == 2:
            norm.weight.mul_(0.5)  # written in place
        if step == 3:
            norm.weight = norm.weight + 1  # replaced
        want = reference(x.double().cpu(), _Norm(norm.weight.double().cpu(), 1e-6, 1.0, "head"),
                         angles, spec, starts, None)
        for backend in ("eager", "triton"):
            got = rd.apply(x, table, spec, start_positions=starts, norm=norm, backend=backend)
            assert_matches(got, want, case.dtype, f"step {step} {backend}")


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_replaced_weight_is_checked_as_the_constructor_checks_it(backend):
    """A weight replaced after the norm was made, by what HeadNorm refuses (integers, complex
    numbers, 2-D, not a tensor), is refused naming the argument, planned or not: an integer
    weight was used, a complex one lost its imaginary part on eager and raised KeyError on
    triton, a 2-D one was said to have the wrong number of entries and a list AttributeError."""
    case = fixed_case(heads=2, head_dim=8, rotary_dim=8)
    t, table, spec, starts, _ = build(case, DEVICE)
    x = t.detach()
    for bad in (torch.ones(8, dtype=torch.int64, device=DEVICE),
                torch.ones(8, dtype=torch.complex64, device=DEVICE),
                torch.ones(2, 4, device=DEVICE), [1.0] * 8):
        norm = rd.HeadNorm(torch.ones(8, device=DEVICE))
        for _ in range(2):  # the repeated call's plan
            rd.apply(x, table, spec, start_positions=starts, norm=norm, backend=backend)
        norm.weight = bad
        with pytest.raises(rd.RoPEError, match=r"norm\.weight must be a 1-D float tensor"):
            rd.apply(x, table, spec, start_positions=starts, norm=norm, backend=backend)
        with pytest.raises(rd.RoPEError, match=r"k_norm\.weight must be a 1-D float tensor"):
            rd.apply_qk(x, x, table, spec, start_positions=starts, k_norm=norm, backend=backend)



@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("call", ["apply", "apply_qk", "apply_qkv"])
@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_a_weight_written_between_forward_and_backward(call, layout):
    """A norm weight written in place after the forward: eager's backward gives the gradients
    of the forward's weight (the float64 reference's); the Triton backend's backward reads the
    weight again, so it once returned the gradients of the new weight (input gradients off by
    3.5 after doubling it). It now raises RoPEError naming the weight, as for the table, where
    it reads the written tensor, and follows eager where it read a dense copy."""
    gen = torch.Generator().manual_seed(9)
    source = (torch.rand(16, generator=gen) + 0.5).to(DEVICE).requires_grad_(True)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    angles = (torch.rand(6, 8, generator=gen) * 6 - 3).to(DEVICE)
    width = 24 if call == "apply_qkv" else 8  # packed: q, k and v of 8 channels each
    data = torch.randn(3, 2, 2, width, generator=gen).to(DEVICE).requires_grad_(True)
    k = torch.randn(3, 2, 1, 8, generator=gen).to(DEVICE)
    for backend in ("eager", "triton"):
        norm = rd.HeadNorm(source[:8] if layout == "dense" else source[::2], 1e-6)
        if call == "apply":
            out = rd.apply(data, angles, spec, norm=norm, backend=backend)
        elif call == "apply_qk":
            out = rd.apply_qk(data, k, angles, spec, q_norm=norm, backend=backend)[0]
        else:
            out = rd.apply_qkv(data, angles, spec, (8, 8, 8), q_norm=norm, backend=backend)[0]
        grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
        saved = source.detach().clone()
        with torch.no_grad():
            source.mul_(2.0)
        if backend == "triton" and layout == "dense":
            with pytest.raises(rd.RoPEError, match=r"norm weight \(HeadNorm.weight\) was "
                                                   r"modified in place"):
                torch.autograd.grad(out, (data, source), grad_out)
        else:
            got = torch.autograd.grad(out, (data, source), grad_out)
            d64 = data.detach().double().requires_grad_(True)
            s64 = saved.double().requires_grad_(True)
            w64 = s64[:8] if layout == "dense" else s64[::2]
            x64 = d64[..., :8] if call == "apply_qkv" else d64
            ref = reference_for(reference_head_norm(x64, w64, 1e-6, 0.0, "head"), angles, spec)
            want = torch.autograd.grad(ref, (d64, s64), grad_out.double())
            assert_matches(got[0], want[0], torch.float32, f"{backend} dx")
            scale = 1.0 + float(want[1].abs().max())
            assert_matches(got[1] / scale, want[1] / scale, torch.float32, f"{backend} dw")
        with torch.no_grad():
            source.copy_(saved)


@pytest.mark.parametrize("bad", [None, "w", torch.ones(()), torch.ones(2, 8)])
def test_a_norm_given_a_bad_weight_still_shows_itself(bad):
    """A norm's weight may be replaced by anything after it is made (each call checks it):
    repr raised AttributeError or IndexError for a non-tensor or a 0-d tensor, and a deleted
    weight made every call raise AttributeError; deleting it is refused, repr names the bad
    weight, and a call says what was wrong."""
    norm = rd.HeadNorm(torch.ones(8, device=DEVICE), 0.125)
    norm.weight = bad
    text = repr(norm)
    assert text.startswith("HeadNorm(weight=<") and "eps=0.125" in text, text
    assert (type(bad).__name__ if not isinstance(bad, torch.Tensor)
            else str(tuple(bad.shape))) in text, text
    with pytest.raises(rd.RoPEError, match="norm.weight must be a 1-D float tensor"):
        rd.apply(torch.randn(2, 1, 2, 8, device=DEVICE), torch.rand(2, 8, device=DEVICE),
                 rd.RoPESpec(layout="sbhd", dtype="fp32"), norm=norm, backend="eager")
    norm.weight = torch.ones(8, device=DEVICE)
    assert repr(norm) == "HeadNorm(weight[8], eps=0.125, offset=0.0, scope='head')"
    with pytest.raises(AttributeError, match="HeadNorm.weight cannot be deleted"):
        del norm.weight
    assert norm.weight.shape == (8,)


class NamedNorm(rd.HeadNorm):
    """A subclass with attributes of its own (pickled: defined at module level)."""

    __slots__ = ("layer",)

    def __init__(self, weight, layer):
        super().__init__(weight, 0.125, offset=1.0, scope="heads")
        self.layer = layer
        self.note = f"layer {layer}"  # (in the __dict__ of NamedNormWithDict, below)


class NamedNormWithDict(NamedNorm):
    pass


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_a_copied_subclass_of_a_norm_stays_one(protocol):
    """A HeadNorm subclass pickled or copied came back a plain HeadNorm (its type and its own
    attributes lost): __reduce__ named HeadNorm's constructor. It stays its class, keeps its
    attributes, and normalizes as the original."""
    gen = torch.Generator().manual_seed(41)
    x, angles = torch.randn(5, 2, 3, 8, generator=gen), torch.rand(5, 8, generator=gen) * 6
    norm = NamedNormWithDict((torch.rand(24, generator=gen) + 0.5).to(DEVICE), 3)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    want = reference_for(reference_head_norm(x, norm.weight.cpu(), 0.125, 1.0, "heads"),
                         angles, spec)
    for copied in (pickle.loads(pickle.dumps(norm, protocol)), copy.copy(norm),
                   copy.deepcopy(norm)):
        assert type(copied) is NamedNormWithDict
        assert (copied.layer, copied.note) == (3, "layer 3")
        assert (copied.eps, copied.offset, copied.scope) == (0.125, 1.0, "heads")
        assert copied.form is norm.form
        assert_matches(rd.apply(x.to(DEVICE), angles.to(DEVICE), spec, norm=copied,
                                backend="eager"), want, torch.float32)


def test_a_norms_scope_given_as_a_numpy_string_is_the_plain_name():
    """A scope given as a str subclass (NumPy's, read from a config) was kept as given: the
    norm's form held np.str_, its repr read scope=np.str_('heads'), and a plain 'heads' norm
    made later shared that interned form. The form holds the plain name."""
    np = pytest.importorskip("numpy")
    norm = rd.HeadNorm(torch.ones(16, device=DEVICE), 0.0625, scope=np.str_("heads"))
    assert type(norm.scope) is str and type(norm.form.scope) is str
    assert repr(norm) == "HeadNorm(weight[16], eps=0.0625, offset=0.0, scope='heads')"
    assert rd.HeadNorm(torch.ones(16, device=DEVICE), 0.0625, scope="heads").form is norm.form
