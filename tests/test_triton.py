"""The Triton backend against the float64 reference, forward and backward.

Without CUDA the kernels run on Triton's CPU interpreter: this module sets ``TRITON_INTERPRET=1``
for its own duration only (a module fixture restores it and re-probes the backend afterwards, so
other test modules still see the backend unavailable on a CPU-only machine). Shapes stay small
there. Tests marked ``gpu`` run the compiled kernels on large shapes, past 65,535 tokens and
past 2**31 elements, under torch.compile and opcheck.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import Case, build, cases, fixed_case
from reference import (
    assert_matches, reference_for, reference_forward_backward, reference_head_norm,
    reference_positions, reference_rope,
)
from rope_dispatch.backends.triton_rope import TritonBackend

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu


# the registered triton backend, on the interpreter when there is no CUDA device (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_backend")


@pytest.fixture
def general_kernel(monkeypatch):
    """Every call runs the general kernel, whose tile rule (``choose_config``) a test checks:
    small contiguous calls would otherwise take the lean kernel (``LEAN_MAX_BYTES``)."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    monkeypatch.setattr(triton_tiles, "LEAN_MAX_BYTES", 0)
    monkeypatch.setattr(triton_launch, "_compiled", {})


def check_case(case: Case, device: str = DEVICE) -> None:
    """triton's forward and backward of ``case`` match the float64 reference."""
    t, table, spec, starts, angles = build(case, device)
    out = rd.apply(t, table, spec, start_positions=starts, backend="triton")
    assert out.dtype == t.dtype and out.device == t.device and out.is_contiguous()
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t.cpu(), angles, spec, grad_out.cpu(), starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")
    with torch.no_grad():  # the direct launch path (no autograd op) gives the same numbers
        direct = rd.apply(t, table, spec, start_positions=starts, backend="triton")
    assert torch.equal(direct, out.detach())


@settings(max_examples=30 if not CUDA else 40, deadline=None)
@given(cases())
def test_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_layout_both_pairings_half_dtypes(layout, interleaved):
    for dtype, cache in ((torch.bfloat16, False), (torch.float16, True)):
        check_case(fixed_case(layout=layout, interleaved=interleaved, dtype=dtype, use_cache=cache,
                             rotary_dim=10, head_dim=16, with_starts=True, strides="qkv-slice"))


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("with_starts", [False, True])
def test_context_parallel_ranks(layout, cp_size, cp_rank, with_starts):
    seqlens = tuple(2 * cp_size * n for n in (1, 0, 3, 2))
    check_case(fixed_case(layout=layout, cp_size=cp_size, cp_rank=cp_rank, seq=6, seqlens=seqlens,
                         interleaved=cp_rank % 2 == 1, strides="permuted", with_starts=with_starts))


@settings(max_examples=20, deadline=None)
@given(cases(cp_sizes=(2, 3, 4), starts=(True,)))
def test_start_positions_with_context_parallelism(case):
    """TE 2.10+: a token's row is its sequence's start plus its zigzag position, both ways."""
    check_case(case)


@pytest.mark.parametrize("scan_limit", [0, 256])
@pytest.mark.parametrize("cp_size,cp_rank,with_starts", [(1, 0, True), (2, 1, False)])
def test_thd_sequence_lookup_both_ways(monkeypatch, scan_limit, cp_size, cp_rank, with_starts):
    """A token's sequence found by comparing it with every cu_seqlens offset (few sequences) or
    by binary search (``scan_limit`` 0) gives the reference's result, empty sequences included."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    monkeypatch.setattr(triton_tiles, "SEQ_SCAN_LIMIT", scan_limit)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    seqlens = tuple(2 * cp_size * n for n in (3, 0, 1, 0, 5, 2, 4))
    check_case(fixed_case(layout="thd", cp_size=cp_size, cp_rank=cp_rank, seqlens=seqlens,
                         with_starts=with_starts, heads=2))


# BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps: several token blocks with a ragged last one, heads
# split across programs, a tile of several heads, a head loop with a ragged last chunk.
LAUNCH_CONFIGS = [(2, 1, 1, 1), (4, 2, 1, 2), (1, 4, 1, 1), (2, 2, 2, 4), (8, 1, 3, 4), (1, 2, 3, 4)]


@pytest.mark.parametrize("config", LAUNCH_CONFIGS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_launch_configurations(config, layout):
    """Every way of cutting tokens and heads into programs gives the reference's result."""
    from rope_dispatch.backends import triton_rope, triton_tiles

    case = fixed_case(layout=layout, heads=5, seq=7, batch=3, seqlens=(5, 1, 9), rotary_dim=12,
                     with_starts=True, strides="channel-strided")
    t, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    bt, bh, hi, warps = config
    rot = angles.shape[1]
    full = triton_tiles.Config(bt, bh, hi, triton_tiles.next_pow2(rot // 2),
                               triton_tiles.next_pow2(16 - rot), warps)
    out = torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE)
    triton_rope.launch(
        triton_rope.Launch("t", layout, False, 1.0, 1, 0), (t,), (out,),
        triton_rope.Tables(table.view(table.shape[0], -1), None, spec.cu_seqlens, starts),
        config=full,
    )
    assert_matches(out, reference_for(t.cpu(), angles, spec, starts), t.dtype)


@pytest.mark.parametrize("axis_max", [1, 2])
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_token_blocks_spread_over_two_grid_axes(monkeypatch, axis_max, layout):
    """Token blocks past grid axis 1's limit go on along axis 2 (here a limit of 1 or 2 blocks
    instead of 65,535, with one-token tiles: with 2, the last program of an odd count has no
    token): every token is rotated once, for one tensor and for q and k in one launch."""
    from rope_dispatch.backends import triton_launch, triton_tiles
    from test_qk import check_qk

    monkeypatch.setattr(triton_tiles, "GRID_AXIS_MAX", axis_max)
    choose = triton_tiles.choose_config
    one_token_tiles = lambda *a, **kw: choose(*a, **kw)._replace(block_t=1, block_h=1)  # noqa: E731
    monkeypatch.setattr(triton_tiles, "choose_config", one_token_tiles)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    case = fixed_case(layout=layout, heads=2, seq=5, batch=3, seqlens=(4, 0, 3), with_starts=True)
    check_case(case)
    check_qk(case, 1, "qkv-slice", "triton")


def test_launch_grid_keeps_axes_within_limits():
    from rope_dispatch.backends.triton_tiles import GRID_AXIS_MAX, launch_grid

    for blocks in (1, 7, GRID_AXIS_MAX, GRID_AXIS_MAX + 1, 3 * GRID_AXIS_MAX - 1, 2**31 - 1):
        groups, y, z = launch_grid(5, blocks)
        assert groups == 5 and y <= GRID_AXIS_MAX and z <= GRID_AXIS_MAX
        assert blocks <= y * z < blocks + z, blocks  # every block, and fewer than z spare


def test_output_is_written_everywhere_and_input_untouched():
    case = fixed_case(layout="bshd", rotary_dim=6, head_dim=12, heads=4, seq=9)
    t, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    before = t.clone()
    out = rd.apply(t, table, spec, backend="triton")
    assert torch.isfinite(out).all()
    assert torch.equal(t, before)
    assert_matches(out, reference_for(t.cpu(), angles, spec), t.dtype)


def test_gradient_keeps_a_dense_input_layout():
    x = torch.randn(3, 6, 2, 8, device=DEVICE).permute(1, 0, 2, 3).requires_grad_(True)  # sbhd view
    freqs = torch.rand(6, 1, 1, 8, device=DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(x, freqs, spec, backend="triton")
    assert out.is_contiguous()
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    assert grad.stride() == x.stride()
    _, ref_grad = reference_forward_backward(x.cpu(), freqs.view(6, 8).cpu(), spec, grad_out.cpu())
    assert_matches(grad, ref_grad, torch.float32, "backward")


def test_stride_zero_gradient():
    """``out.sum()`` hands the backward an expanded gradient (all strides 0)."""
    x = torch.randn(4, 2, 3, 8, device=DEVICE, requires_grad=True)
    freqs = torch.rand(4, 8, device=DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    (grad,) = torch.autograd.grad(rd.apply(x, freqs, spec, backend="triton").sum(), x)
    _, ref_grad = reference_forward_backward(x.cpu(), freqs.cpu(), spec, torch.ones(x.shape))
    assert_matches(grad, ref_grad, torch.float32, "backward")


def test_double_backward_is_the_forward():
    """The transpose of the transpose is the forward map, so the op is twice differentiable."""
    x = torch.randn(3, 2, 2, 8, device=DEVICE, requires_grad=True)
    freqs = torch.rand(3, 8, device=DEVICE) * 10
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(x, freqs, spec, backend="triton")
    v = torch.randn_like(out, requires_grad=True)
    (grad,) = torch.autograd.grad(out, x, v, create_graph=True)
    w = torch.randn_like(grad)
    (grad_v,) = torch.autograd.grad(grad, v, w)
    ref = reference_for(w.detach().cpu(), freqs.cpu(), spec)
    assert_matches(grad_v, ref, torch.float32, "double backward")


def test_empty_inputs():
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    for shape in ((0, 2, 3, 8), (4, 2, 0, 8)):
        x = torch.randn(shape, device=DEVICE)
        out = rd.apply(x, torch.rand(4, 8, device=DEVICE), spec, backend="triton")
        assert out.shape == x.shape


def test_large_angles_keep_float32_accuracy():
    """Positions far beyond 2*pi: the in-kernel sin/cos must stay within float32 rounding."""
    x = torch.randn(4, 1, 2, 16, device=DEVICE)
    freqs = (torch.rand(4, 16) * 2e5).to(DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(x, freqs, spec, backend="triton")
    assert_matches(out, reference_for(x.cpu(), freqs.cpu(), spec), torch.float32)


def _rounded_apart(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The share of ``got``'s elements that differ from ``exact`` (float64) rounded to nearest
    in ``got``'s dtype: float32 math rounded once is off only where float32's own error crosses
    a rounding boundary (well under 1%); a conversion that truncates is off at about half."""
    return (got.cpu() != exact.to(got.dtype)).float().mean().item()


@pytest.mark.parametrize("kernel", ["lean", "general"])
def test_bfloat16_outputs_and_gradients_round_to_nearest(request, kernel):
    """bf16 outputs, input gradients, a norm's outputs and its weights' gradients are the
    float32 results rounded to nearest, as the GPU converts (the CPU interpreter's own
    conversion to bfloat16 truncates: ``_rounded`` rounds around it)."""
    if kernel == "general":
        request.getfixturevalue("general_kernel")
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(16, 2, 4, 32, generator=gen) * 3).bfloat16().to(DEVICE).requires_grad_(True)
    grad_out = torch.randn(x.shape, generator=gen).bfloat16().to(DEVICE)
    angles = torch.rand(16, 32, generator=gen) * 6
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    out = rd.apply(x, angles.to(DEVICE), spec, backend="triton")
    (grad,) = torch.autograd.grad(out, x, grad_out)
    want, want_grad = reference_forward_backward(x.cpu(), angles, spec, grad_out.cpu())
    assert _rounded_apart(out, want) < 0.01 and _rounded_apart(grad, want_grad) < 0.01
    in_place = x.detach().clone()
    rd.apply_(in_place, angles.to(DEVICE), spec, backend="triton")
    assert torch.equal(in_place, out)

    weight = (torch.rand(32, generator=gen) + 0.5).bfloat16().to(DEVICE).requires_grad_(True)
    norm = rd.HeadNorm(weight, eps=1e-6)
    normed = rd.apply(x, angles.to(DEVICE), spec, norm=norm, backend="triton")
    x64 = x.detach().cpu().double().requires_grad_(True)
    w64 = weight.detach().cpu().double().requires_grad_(True)
    exact = reference_for(reference_head_norm(x64, w64, 1e-6, 0.0, "head"), angles, spec)
    weight_grad, = torch.autograd.grad(normed, weight, grad_out)
    exact_weight_grad, = torch.autograd.grad(exact, w64, grad_out.cpu().double())
    assert _rounded_apart(normed, exact) < 0.01
    assert _rounded_apart(weight_grad, exact_weight_grad) <= 1 / 32


@pytest.mark.parametrize("kernel", ["lean", "general"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["angles", "cache", "rates"])
def test_signed_zeros_come_out_as_the_formula_gives_them(request, kernel, interleaved, kind):
    """Inputs and gradients of signed zeros (angle 0 at row 0, so ``-x sin`` is a zero whose
    sign is the formula's): each output's sign bit is the float64 formula's, forward and
    backward (Triton's unary minus, ``0 - sin``, once made +0 of a zero sine)."""
    if kernel == "general":
        request.getfixturevalue("general_kernel")
    gen = torch.Generator().manual_seed(7)
    sign = lambda shape: torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign((4, 1, 2, 8)) * 0.0).to(DEVICE).requires_grad_(True)
    grad_out = (sign((4, 1, 2, 8)) * 0.0).to(DEVICE)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8)
    rates = rd.RateTable(inv_freq.to(DEVICE), 4)
    angles = rd.tables.angle_table(inv_freq, 4, interleaved=interleaved).reshape(4, 8)
    table = {"angles": angles.to(DEVICE), "cache": rd.cos_sin_cache(angles.to(DEVICE)),
             "rates": rates}[kind]
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", interleaved=interleaved)
    out = rd.apply(x, table, spec, backend="triton")
    (grad,) = torch.autograd.grad(out, x, grad_out)
    pos = torch.arange(4)[:, None]
    expected = reference_rope(x.detach().cpu(), angles, pos, interleaved)
    expected_grad = reference_rope(grad_out.cpu(), angles, pos, interleaved, inverse=True)
    assert not out.detach().cpu().any() and not grad.cpu().any()
    assert torch.equal(out.detach().cpu().signbit(), expected.signbit()), "forward"
    assert torch.equal(grad.cpu().signbit(), expected_grad.signbit()), "backward"


@pytest.mark.parametrize("apart", [None, (5, 3), (0, 7)])
def test_each_half_of_a_row_gets_its_own_angles(apart):
    """A model's table repeats its angles in both halves; an entry of the second half that
    differs (``apart``: row, channel) still rotates by its own angle, forward and backward (a
    kernel sharing the first half's sines across a tile would fail here)."""
    freqs = torch.rand(8, 8) * 50
    table = torch.cat((freqs, freqs), dim=-1)
    if apart is not None:
        table[apart[0], 8 + apart[1]] += 1.0
    x = torch.randn(8, 1, 2, 16, device=DEVICE, requires_grad=True)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(x, table.to(DEVICE), spec, backend="triton")
    grad_out = torch.randn(out.shape).to(DEVICE)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    ref_out, ref_grad = reference_forward_backward(x.cpu(), table, spec, grad_out.cpu())
    assert_matches(out, ref_out, torch.float32, "forward")
    assert_matches(grad, ref_grad, torch.float32, "backward")


def test_opcheck_contiguous_and_permuted():
    from torch.library import opcheck

    op = torch.ops.rope_dispatch.triton_rope.default
    angles = torch.rand(8, 8, device=DEVICE) * 5
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32, device=DEVICE)
    contiguous = torch.randn(6, 2, 3, 16, device=DEVICE, requires_grad=True)
    permuted = torch.randn(2, 6, 3, 16, device=DEVICE).transpose(0, 1).requires_grad_(True)
    packed = torch.randn(6, 3, 16, device=DEVICE, requires_grad=True)  # 12 global tokens, cp 2
    q, k = torch.randn(6, 2, 4, 16, device=DEVICE), torch.randn(6, 2, 1, 16, device=DEVICE)
    qkv = torch.randn(6, 2, 2, 64, device=DEVICE, requires_grad=True)
    from rope_dispatch.backends.triton_launch import Launch
    from rope_dispatch.backends.triton_rope import op_launch

    def described(tensors, layout, interleaved=False, scale=1.0, cp=(1, 0), **fields):
        return op_launch(Launch(tensors, layout, interleaved, scale, *cp, **fields))

    for args in (
        ([contiguous], angles, None, None, None, None, None, described("t", "sbhd")),
        ([permuted], angles.cos(), angles.sin(), None, None, None, None,
         described("t", "sbhd", True, 1.25, inverse=True)),
        ([packed], angles, None, None, None, cu, None, described("t", "thd", cp=(2, 1))),
        ([q.requires_grad_(True), k.requires_grad_(True)], angles, None, None, None, None, None,
         described("qk", "bshd", inverse=True)),
        ([qkv], angles, None, angles, None, None, None,
         described("qkv", "sbhd", split=(32, 16, 16))),
        ([contiguous], angles[:, :4], None, None, None, None, None,
         described("t", "sbhd", offset=4, deinterleave=True)),
    ):
        opcheck(op, (*args, 0, ""))
    # with the memory checks of a compiled in-place call (its rotary dim), which find it apart
    opcheck(op, ([contiguous], angles, None, None, None, None, None, described("t", "sbhd"), 8, ""))
    # the twin that rotates its inputs in place (a compiled in-place call needing no gradient),
    # after the memory checks whose result it takes
    inplace = torch.ops.rope_dispatch.triton_rope_.default
    q, k, checked = q.detach(), k.detach(), torch.zeros((), device=DEVICE)
    for args in (([q, k], angles, None, None, None, None, None,
                  op_launch(Launch("qk", "bshd", False, 1.0, 1, 0), in_place=True), checked),
                 ([permuted.detach()], angles.cos(), angles.sin(), None, None, None, None,
                  op_launch(Launch("t", "sbhd", True, 1.25, 1, 0, inverse=True), in_place=True),
                  checked)):
        opcheck(inplace, args)


@pytest.mark.parametrize("views", [False, True])
def test_compiled_in_place_call_without_gradient_rotates_its_inputs_in_place(views):
    """A compiled in-place call that needs no gradient (a decode step) is its memory checks and
    one launch on the inputs' own memory: the mutating op ``triton_rope_`` with no output to
    allocate and no copy back, q and k whole tensors or views of one projection, positions on
    the device."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    angles = (torch.rand(32, 16, generator=gen) * 6).to(DEVICE)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    proj = torch.randn(3, 1, 6 * 16, generator=gen).to(DEVICE)
    pos = torch.tensor([[5], [0], [31]], device=DEVICE)
    want_q, want_k = (reference_for(proj[..., a:b].unflatten(-1, (-1, 16)).cpu().double(),
                                    angles.cpu(), spec, positions=pos.cpu())
                      for a, b in ((0, 64), (64, 96)))

    def step(proj, q, k):
        if views:
            q, k = proj[..., :64].unflatten(-1, (4, 16)), proj[..., 64:].unflatten(-1, (2, 16))
        rd.apply_qk_(q, k, angles, spec, positions=pos, backend="triton")

    q = proj[..., :64].unflatten(-1, (4, 16)).contiguous()
    k = proj[..., 64:].unflatten(-1, (2, 16)).contiguous()
    with torch.inference_mode():
        _, code = run_and_get_code(torch.compile(step, fullgraph=True), proj, q, k)
    calls = [line for line in "\n".join(code).splitlines()
             if line.split("= ")[-1].lstrip().startswith("torch.ops.rope_dispatch.")]
    assert len(calls) == 2, calls
    assert "written_apart_first.default" in calls[0] and "triton_rope_.default" in calls[1], calls
    assert "copy_" not in "\n".join(code)
    got_q, got_k = (proj[..., :64].unflatten(-1, (4, 16)), proj[..., 64:].unflatten(-1, (2, 16))
                    ) if views else (q, k)
    assert_matches(got_q, want_q, torch.float32, "q")
    assert_matches(got_k, want_k, torch.float32, "k")


def test_compiled_in_place_call_without_gradient_moves_the_version_counters():
    """A tensor a graph saved for its backward, then rotated in place by a compiled call under
    ``no_grad``: that backward refuses, as after an eager in-place call (no silently wrong
    gradient from the rotated values)."""
    torch._dynamo.reset()
    x = torch.randn(2, 1, 2, 16, device=DEVICE, requires_grad=True)
    q = x * 2
    saved = (q * q).sum()  # keeps q for its backward
    angles = torch.rand(8, 16, device=DEVICE)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    rotate = torch.compile(lambda q: rd.apply_(q, angles, spec, backend="triton"), fullgraph=True)
    version = q._version
    with torch.no_grad():
        rotate(q)
    assert q._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_compile_fullgraph_forward_and_backward():
    """torch.compile(fullgraph=True) over code calling rope_dispatch.apply: no graph break."""
    backend = "inductor" if CUDA else "aot_eager"
    freqs = (torch.rand(16, 1, 1, 8) * 10).to(DEVICE)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", rotary_dim=8)

    def attention_input(q):
        return rd.apply(q * 2, freqs, spec, backend="triton") + 1

    compiled = torch.compile(attention_input, fullgraph=True, backend=backend)
    q = torch.randn(2, 8, 3, 16, device=DEVICE, requires_grad=True)
    out = compiled(q)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, q, grad_out)
    ref_out, ref_grad = reference_forward_backward(q.detach().cpu() * 2, freqs.view(16, 8).cpu(),
                                                   spec, grad_out.cpu())
    assert_matches(out, ref_out + 1, torch.float32)
    assert_matches(grad, 2 * ref_grad, torch.float32, "backward")


def test_unavailable_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes "import triton" raise ImportError
    reasons = TritonBackend().unavailable_reasons()
    assert len(reasons) == 1 and "triton is not importable" in reasons[0]


def test_unavailable_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = TritonBackend().unavailable_reasons()
    assert len(reasons) == 1 and "no CUDA device" in reasons[0] and "TRITON_INTERPRET" in reasons[0]


@pytest.mark.parametrize("value, on", [("true", True), ("ON", True), ("yes", True),
                                       ("0", False), ("nope", False)])
def test_the_interpreter_switch_reads_as_triton_reads_it(monkeypatch, value, on):
    """Triton interprets its kernels for TRITON_INTERPRET=true, on or yes too (any case); the
    backend read only 1, and said a switch Triton had honoured was "not set"."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = TritonBackend().unavailable_reasons()
    nowhere = [r for r in reasons if "no CUDA device" in r]
    assert not nowhere if on else nowhere and f"TRITON_INTERPRET is {value!r}" in nowhere[0]


def test_cpu_tensor_refused_without_interpreter(triton_backend):
    from rope_dispatch.backends import triton_launch

    if triton_launch._kernels.INTERPRETED:
        assert "cpu" in triton_backend.devices
        return
    call = rd.check_call(torch.randn(2, 1, 1, 4), torch.rand(2, 4), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    reasons = triton_backend.not_supported_reasons(call)
    assert reasons and "tensor is on cpu" in reasons[0]


@pytest.mark.parametrize("dtype, tile", [(torch.bfloat16, (4, 8)), (torch.float32, (2, 8))])
def test_wide_heads_the_l2_holds_match_the_reference(dtype, tile):
    """Head dim 256 in a call the L2 holds takes RESIDENT_ROWS rows a tile (16 KiB), and
    rotates forward and backward, out of place and in place, as the reference does: on the GPU
    the sweep's 2,048 tokens of 8 heads, on the interpreter 16 tokens."""
    from rope_dispatch.backends import triton_tiles

    tokens = 2048 if CUDA else 16
    sms = triton_tiles.sm_count(0) if CUDA else 1
    element_size = torch.empty(0, dtype=dtype).element_size()
    assert triton_tiles.choose_config(tokens, 8, 256, 256, element_size, False, sms)[:2] == tile
    t = torch.randn(tokens, 1, 8, 256).to(dtype).to(DEVICE)
    freqs = _te_freqs(tokens, 256, DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    _rope_check_gpu(t, freqs, spec)
    positions = reference_positions("sbhd", tuple(t.shape))
    in_place = t.clone()
    assert rd.apply_(in_place, freqs, spec, backend="triton") is in_place
    assert_matches(in_place, reference_rope(t, freqs.view(tokens, 256), positions, False), dtype)


# ---------------------------------------------------------------- GPU: compiled kernels, big sizes


def _rope_check_gpu(t, freqs, spec, starts=None, grad=True):
    """Forward (and backward) against the float64 reference computed on t's device."""
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    leaf = t.detach().requires_grad_(grad)
    out = rd.apply(leaf, freqs, spec, start_positions=starts, backend="triton")
    positions = reference_positions(
        spec.layout, tuple(t.shape),
        cu_seqlens=None if spec.cu_seqlens is None else spec.cu_seqlens.tolist(),
        cp_size=spec.cp_size, cp_rank=spec.cp_rank,
        start_positions=None if starts is None else starts.tolist(),
    )
    ref = reference_rope(t.detach(), angles, positions, spec.interleaved)
    assert_matches(out, ref, t.dtype)
    del ref
    if grad:
        grad_out = torch.randn_like(out)
        (g,) = torch.autograd.grad(out, leaf, grad_out)
        # the transpose: the reference's vector-Jacobian product via float64 autograd
        x64 = t.detach().double().requires_grad_(True)
        (ref_g,) = torch.autograd.grad(reference_rope(x64, angles, positions, spec.interleaved), x64,
                                       grad_out.double())
        assert_matches(g, ref_g, t.dtype, "backward")


def _te_freqs(s2, rot, device="cuda"):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.outer(torch.arange(s2, dtype=torch.float64), inv)
    return torch.cat((ang, ang), -1).float().view(s2, 1, 1, rot).to(device)


@gpu
@pytest.mark.parametrize("layout,rot,dtype", [
    ("sbhd", 128, torch.bfloat16), ("bshd", 128, torch.bfloat16), ("sbhd", 64, torch.bfloat16),
    ("bshd", 256, torch.float32), ("sbhd", 96, torch.float16),
])
def test_gpu_large_shapes(layout, rot, dtype):
    head_dim = max(rot, 128)
    heads = 32 if head_dim == 128 else 8
    shape = (4096, 2, heads, head_dim) if layout == "sbhd" else (2, 4096, heads, head_dim)
    t = torch.randn(shape, device="cuda").to(dtype)
    _rope_check_gpu(t, _te_freqs(4096, rot), rd.RoPESpec(layout=layout, dtype=dtype))


@gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_thd_many_sequences_cache(interleaved):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 3000, (12,), generator=gen)
    cu = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))).int().cuda()
    t = torch.randn(int(lengths.sum()), 16, 128, device="cuda", dtype=torch.bfloat16)
    spec = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=cu, interleaved=interleaved,
                       max_seqlen=int(lengths.max()))
    _rope_check_gpu(t, _te_freqs(3000, 128), spec)
    angles = _te_freqs(3000, 128)
    a = rd.apply(t, angles, spec, backend="triton")
    b = rd.apply(t, rd.cos_sin_cache(angles), spec, backend="triton")
    # One bf16 rounding apart (2^-7 relative), after the angle path's sine and cosine (the
    # GPU's approximations, about 1e-6 off) met the cache's float32 ones: up to
    # (|x_a| + |x_b|) * 2e-6 absolute, which outweighs the rounding where the rotation nearly
    # cancels (one element in 32 million failed a fixed 1e-6 bound in run S)
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7,
                               atol=4e-6 * float(t.abs().max()))


@gpu
def test_gpu_past_65535_tokens_and_batch():
    """Sequence, batch and packed token counts beyond the 65,535 limit of secondary grid axes."""
    freqs = _te_freqs(72_000, 32)
    t = torch.randn(70_000, 2, 2, 32, device="cuda", dtype=torch.bfloat16)  # sbhd, s > 65,535
    _rope_check_gpu(t, freqs, rd.RoPESpec(layout="sbhd", dtype="bf16"))
    t = torch.randn(1, 70_000, 2, 32, device="cuda", dtype=torch.bfloat16)  # sbhd, b > 65,535
    starts = torch.randint(0, 100, (70_000,), device="cuda")
    _rope_check_gpu(t, freqs, rd.RoPESpec(layout="sbhd", dtype="bf16"), starts=starts)
    cu = torch.tensor([0, 8, 68_000, 140_000], dtype=torch.int32, device="cuda")  # global offsets
    t = torch.randn(70_000, 2, 32, device="cuda", dtype=torch.float16)
    spec = rd.RoPESpec(layout="thd", dtype="fp16", cu_seqlens=cu, cp_size=2, cp_rank=1)
    _rope_check_gpu(t, freqs, spec)


@gpu
def test_gpu_token_blocks_past_65535(monkeypatch):
    """One-token tiles on 70,000 tokens: 70,000 token blocks, over grid axes 1 and 2."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    choose = triton_tiles.choose_config
    one_token_tiles = lambda *a, **kw: choose(*a, **kw)._replace(block_t=1, block_h=1)  # noqa: E731
    monkeypatch.setattr(triton_tiles, "choose_config", one_token_tiles)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    freqs = _te_freqs(72_000, 32)
    t = torch.randn(70_000, 2, 32, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 70_000], dtype=torch.int32, device="cuda")
    _rope_check_gpu(t, freqs, rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=cu))
    assert triton_tiles.launch_grid(1, 70_000) == (1, 35_000, 2)


@gpu
def test_gpu_more_than_2_31_elements():
    """int64 offsets: a bf16 tensor of 2**31 + 2**21 elements, checked at its far end."""
    s, h, d = 16_400, 1024, 128  # 2,149,580,800 elements, 4.3 GB
    free, _ = torch.cuda.mem_get_info()
    if free < 10 * 2**30:
        pytest.skip(f"needs about 10 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    t = torch.empty(s, 1, h, d, device="cuda", dtype=torch.bfloat16)
    t[-4:].normal_()
    t[:4].normal_()
    freqs = _te_freqs(s, d)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    out = rd.apply(t, freqs, spec, backend="triton")
    angles = freqs.view(s, d)
    for rows in (slice(0, 4), slice(s - 4, s)):
        pos = torch.arange(s)[rows][:, None]
        ref = reference_rope(t[rows], angles, pos, False)
        assert_matches(out[rows], ref, torch.bfloat16, f"tokens {rows}")
    del out, t
    torch.cuda.empty_cache()


@gpu
def test_gpu_repeated_calls_follow_alignment_and_strides():
    """Repeated calls reuse compiled kernels; one specialised for aligned or unit-stride data
    must never be reused for data that is not."""
    freqs = _te_freqs(64, 64)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    buffer = torch.randn(64 * 2 * 4 * 64 * 2 + 8, device="cuda", dtype=torch.bfloat16)
    shape, strides = (64, 2, 4, 64), (512, 256, 64, 1)
    for offset in (0, 1, 0, 3, 8, 0):
        t = buffer[offset:].as_strided(shape, strides)
        for _ in range(2):
            _rope_check_gpu(t, freqs, spec, grad=offset == 0)
    wide = torch.randn(64, 2, 4, 128, device="cuda", dtype=torch.bfloat16)
    for t in (wide[..., ::2], wide[..., :64], wide[..., ::2]):  # channel stride 2, then 1, then 2
        _rope_check_gpu(t, freqs, spec)


@gpu
def test_gpu_output_is_the_only_allocation():
    t = torch.randn(1024, 4, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    freqs = _te_freqs(4096, 128)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    rd.apply(t, freqs, spec, backend="triton")  # compile and cache first
    # the table's second sight makes its linear-table flag (512 bytes, once per table)
    rd.apply(t, freqs, spec, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = rd.apply(t, freqs, spec, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra == out.numel() * out.element_size(), f"{extra} bytes allocated"


@gpu
def test_gpu_compile_inductor_thd_and_cache():
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 200, (5,), generator=gen)
    cu = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))).int().cuda()
    freqs = _te_freqs(256, 64)
    cache = rd.cos_sin_cache(freqs)
    spec = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=cu, max_seqlen=int(lengths.max()))

    def f(x):
        return rd.apply(x * 3, cache, spec, backend="triton")

    x = torch.randn(int(lengths.sum()), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch.compile(f, fullgraph=True)(x)
    grad_out = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, x, grad_out)
    ref_out, ref_g = reference_forward_backward((x * 3).detach().cpu(), freqs.view(256, 64).cpu(),
                                                spec, grad_out.cpu())
    assert_matches(out, ref_out, torch.bfloat16)
    assert_matches(g, 3 * ref_g, torch.bfloat16, "backward")


@pytest.mark.parametrize(
    "tokens, heads", [(128, 1), (512, 1), (2048, 1), (128, 8), (64, 32), (1, 1), ((1 << 17), 8)]
)
def test_tiles_give_every_sm_programs_unless_the_call_is_too_small(tokens, heads):
    """On a 132-SM GPU a call runs as at least two programs per SM, unless it has fewer tokens x
    heads than that (then one program per token and head, or, where it computes sines, per two
    tokens of one head of d 128: see the next test); large calls keep the full tile."""
    from rope_dispatch.backends import triton_tiles

    sms = 132
    bt, bh, iters, _, _, _ = triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, sms)
    programs = -(-tokens // bt) * -(-heads // (bh * iters))
    two_tokens = (bt, bh) == (2, 1) and tokens > 1
    assert programs * (2 if two_tokens else 1) >= min(2 * sms, tokens * heads)
    assert bt * bh * 128 * 2 <= triton_tiles.TILE_BYTES
    if tokens * heads * 128 * 2 > triton_tiles.RESIDENT_BYTES and heads < 32:  # 2 KiB tiles
        assert bt * bh * 128 * 2 == triton_tiles.STREAM_TILE_BYTES and bh == min(heads, 8)
    elif tokens * heads >= 2 * sms * 32:
        assert bt * bh * 128 * 2 == triton_tiles.TILE_BYTES  # a full tile: 8 KB


@pytest.mark.parametrize("tokens", [1, 4, 16, 32, 64, 1024, 16384])
def test_narrow_heads_beside_one_head_share_a_token_row_across_heads(tokens):
    """MLA's rope part (128 query heads of 64 bf16 channels beside one key head): a tile holds
    more of a token's heads than of its tokens (one table row serves them), at least 8 rows, as
    many programs as two an SM where the tokens allow it, and no more than 32 rows."""
    from rope_dispatch.backends import triton_tiles

    counts, sms = (128, 1), 132
    bt, bh, iters, _, _, warps = triton_tiles.choose_config(tokens, counts, 64, 64, 2, False, sms)
    assert iters == 1 and bh >= 8 * bt and 8 <= bt * bh <= 32
    assert warps * 16 <= max(16, bt * bh)  # a warp per 16 rows
    programs = triton_tiles.programs(tokens, counts, bt, bh)
    assert programs >= min(2 * sms, tokens * 17)  # 8-row tiles: 17 programs a token
    if programs > 2 * sms and bt * bh < 32:  # shrunk only as far as the programs need
        assert triton_tiles.programs(tokens, counts, *((2 * bt, bh) if bt < tokens else
                                                       (bt, 2 * bh))) < 2 * sms


@pytest.mark.parametrize("tokens", [1, 4, 16, 32, 64, 1024, 16384])
def test_narrow_heads_on_a_cache_take_the_same_tile_with_more_warps(tokens):
    """The same heads on a cos/sin cache (its rows loaded, not computed): the tile they take
    on angles, on at least 2 warps, a warp for every 8 rows (16 where per-token positions
    gather the rows, as on angles)."""
    from rope_dispatch.backends import triton_tiles

    counts, sms = (128, 1), 132
    on_angles = triton_tiles.choose_config(tokens, counts, 64, 64, 2, False, sms)
    on_cache = triton_tiles.choose_config(tokens, counts, 64, 64, 2, False, sms, sines=False)
    assert on_cache._replace(warps=0) == on_angles._replace(warps=0)
    assert on_cache.warps == max(2, on_cache.block_t * on_cache.block_h // 8)
    gathered = triton_tiles.choose_config(tokens, counts, 64, 64, 2, False, sms, sines=False,
                                          gathered=True)
    assert gathered == on_cache._replace(warps=max(2, on_angles.warps))


@pytest.mark.parametrize("tokens, heads, sines, tile", [
    (64, (32, 8), False, (1, 8)),  # a decode step's q and k on a cache: one token of 8 heads
    (128, 8, False, (1, 2)),
    (64, (32, 8), True, (2, 4)),  # sines computed: two tokens of half the heads
    (128, 8, True, (2, 1)),
    (512, 8, True, (2, 4)),
    (129, 8, True, (2, 1)),  # an odd count: as many programs or more
    (1, 32, True, (1, 1)),  # one token: nothing to pair
    (2048, 1, True, (4, 1)),
    (512, 1, True, (2, 1)),  # one head of 64 channels a half on 128 threads: two tokens
    (512, 1, False, (1, 1)),
    (16, 32, True, (2, 1)),
])
def test_small_calls_keep_a_tokens_heads_together_before_splitting_them(
    tokens, heads, sines, tile,
):
    """A call too small for full tiles on 132 SMs gives up tokens per program before heads: a
    program's heads share one table row, where 8 tokens of one head load 8 rows. Where that
    leaves one token of several heads and the kernel computes sines, the tile is two tokens of
    half the heads (each head's threads of a one-token tile compute its sines again), with no
    fewer programs; one token of one head of d 128 (64 channels a half for 128 threads) takes
    two tokens at half the programs."""
    from rope_dispatch.backends import triton_tiles

    counts = heads if isinstance(heads, tuple) else (heads,)
    bt, bh, *_ = triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, 132, sines=sines)
    assert (bt, bh) == tile
    cache_tile = triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, 132, sines=False)
    halved = cache_tile[:2] == (1, 1) and tile == (2, 1)  # one head: two tokens, half the programs
    assert triton_tiles.programs(tokens, counts, bt, bh) * (2 if halved else 1) >= (
        triton_tiles.programs(tokens, counts, *cache_tile[:2]))


@pytest.mark.parametrize("tokens, heads, min_rows, tile", [
    (128, 8, 1, (2, 1)),  # the rule in use: down to 2 rows for 2 programs an SM
    (128, 8, 8, (2, 4)),  # stops at 8 rows (1 x 8), then two tokens of half the heads
    (512, 1, 8, (8, 1)),
    (1, 40, 4, (1, 4)),
    (8192, 8, 16, (4, 8)),  # large enough for full tiles: no shrink to stop
])
def test_the_shrink_keeps_min_rows_a_program(tokens, heads, min_rows, tile):
    """``min_rows`` (the probe's knob, ``MIN_TILE_ROWS`` = 1 as shipped) stops the shrink for
    small calls before a program would hold fewer rows (a token's head each) than it asks."""
    from rope_dispatch.backends import triton_tiles

    bt, bh, *_ = triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, 132,
                                           min_rows=min_rows)
    assert (bt, bh) == tile
    assert bt * bh >= min(min_rows, tokens * heads)
    assert triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, 132) == (
        triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, 132, min_rows=1))


@pytest.mark.parametrize("tokens, heads, element_size, head_dim", [
    *((n, h, 2, 128) for n in (512, 2048, 32768) for h in ((32, 1), (32, 1, 1))),
    (512, (8, 1), 2, 128), (2048, (8, 1), 2, 128), (2048, (16, 1), 2, 64),
    (32768, (32, 1), 4, 128),
])
def test_a_one_head_key_leaves_the_query_tiles_of_several_heads(
        tokens, heads, element_size, head_dim):
    """In a launch over q and an MQA k (one head), q's tile holds at least ``MIN_HEAD_BYTES``
    of a token's heads (256-byte pieces of one head ran at two thirds of a copy's speed), k's
    programs masking the heads it lacks; every head of every tensor is covered."""
    from rope_dispatch.backends import triton_tiles

    bt, bh, iters, *_ = triton_tiles.choose_config(tokens, heads, head_dim, head_dim,
                                                  element_size, False, 132)
    per_head = head_dim * element_size
    assert bh * iters * per_head >= min(triton_tiles.MIN_HEAD_BYTES, max(heads) * per_head)
    assert bt * bh * per_head <= 2 * triton_tiles.TILE_BYTES
    groups = [-(-n // (bh * iters)) for n in heads]
    assert all(g * bh * iters >= n for g, n in zip(groups, heads))


@pytest.mark.parametrize("tokens", [8192, 32768])
def test_streamed_tiles_of_a_one_head_key_keep_one_head(tokens):
    """Streamed from DRAM (tokens smaller than a tile, more than the L2 holds), a launch over 8
    query heads and one key head keeps 2 KiB tiles of one head (8 x 1 ran at 92-98% of a copy,
    2 heads a tile at 85-89%)."""
    from rope_dispatch.backends import triton_tiles

    bt, bh, *_ = triton_tiles.choose_config(tokens, (8, 1), 128, 128, 2, False, 132)
    assert (bt, bh) == (triton_tiles.STREAM_TILE_BYTES // 256, 1)


@pytest.mark.parametrize("tokens", [2048, 32768])
@pytest.mark.parametrize("counts", [(8, 1), (4, 1), (1,)])
def test_cache_row_tiles_take_two_heads_of_the_widest_tensor(tokens, counts):
    """A launch reading a cos/sin cache's rows reads each token's whole cos and sin rows per
    program: beside a one-head key, q's tile takes two heads where ``MIN_HEAD_BYTES`` alone
    would give it one (float32 heads of d 128); a lone one-head tensor keeps one."""
    from rope_dispatch.backends import triton_tiles

    tile_tokens = triton_tiles.TABLE_TILE_BYTES // (64 * 4)
    _, bh, iters, *_ = triton_tiles.choose_config(tokens, counts, 128, 128, 4, False, 132,
                                                 tile_tokens, True, sines=False)
    assert bh * iters == (1 if max(counts) == 1 else triton_tiles.CACHE_ROW_MIN_HEADS)
    _, bh_angles, *_ = triton_tiles.choose_config(tokens, counts, 128, 128, 4, False, 132)
    assert bh_angles == 1, "an angle table's tiles keep the MIN_HEAD_BYTES rule"


def _qk_cache_tile(tokens: int, counts: tuple[int, ...], head_dim: int, size: int = 2,
                   rotary_dim: int | None = None, interleaved: bool = False) -> tuple[int, int]:
    """(tokens, heads) of the tile of a launch over ``counts`` heads reading a cos/sin cache
    of ``size``-byte entries as row tiles, as launch_qkv asks for it."""
    from rope_dispatch.backends import triton_tiles

    rotary_dim = rotary_dim or head_dim
    width = rotary_dim if interleaved else rotary_dim // 2
    tile_tokens = max(triton_tiles.TOKENS_PER_TILE,
                      triton_tiles.TABLE_TILE_BYTES // (triton_tiles.next_pow2(width) * size))
    bt, bh, iters, *_ = triton_tiles.choose_config(
        tokens, counts, head_dim, rotary_dim, size, interleaved, 132, tile_tokens, True,
        span_dim=head_dim, sines=False)
    return bt, bh * iters


@pytest.mark.parametrize("tokens, heads, head_dim, tile", [
    (16384, 32, 96, (1, 32)),  # Phi-3 mini, b4 s4096: 6 KiB a token
    (4096, 32, 96, (1, 32)),  # b1 s4096: 48 MiB, streamed
    (16384, 16, 128, (1, 16)),
    (16384, 16, 64, (1, 16)),
])
def test_streamed_qk_cache_rows_of_one_head_count_take_one_token_of_all_heads(
        tokens, heads, head_dim, tile):
    """q and k of one head count reading a cos/sin cache's rows from DRAM take one token x all
    their heads (their rows read once a token, not once every two heads) while a token's heads
    take at most ``QK_TOKEN_TILE_BYTES``; the rule leaves alone what it was not measured on."""
    from rope_dispatch.backends import triton_tiles

    assert _qk_cache_tile(tokens, (heads, heads), head_dim) == tile
    two_heads = (16 if head_dim > 64 else 32, triton_tiles.CACHE_ROW_MIN_HEADS)
    assert _qk_cache_tile(tokens, (heads, heads // 4), head_dim) == two_heads, "GQA"
    assert _qk_cache_tile(tokens, (heads,), head_dim)[0] > 1, "one tensor"
    assert _qk_cache_tile(tokens, (heads, heads), head_dim, rotary_dim=head_dim // 2)[0] > 1
    assert _qk_cache_tile(tokens, (heads, heads), head_dim, interleaved=True)[0] > 1
    resident = triton_tiles.RESIDENT_BYTES // (2 * heads * head_dim * 2)
    assert _qk_cache_tile(resident, (heads, heads), head_dim)[0] > 1, "the L2 holds it"


def test_qk_cache_rows_of_wide_tokens_keep_two_heads():
    """At 32 heads of d 128 (8 KiB a token) one token x 32 heads ran slower than 16 x 2."""
    from rope_dispatch.backends import triton_tiles

    assert _qk_cache_tile(16384, (32, 32), 128) == (16, triton_tiles.CACHE_ROW_MIN_HEADS)


@pytest.mark.parametrize("tokens", [2048, 32768])
@pytest.mark.parametrize("counts", [(8, 1), (16, 16), (2, 1)])
def test_qk_cache_rows_of_heads_of_256_channels_take_wide_head_tiles(tokens, counts):
    """A q and k launch of 16-bit heads of d 256 reading a cos/sin cache's rows (Gemma's)
    takes ``WIDE_HEAD_CACHE_TILE``, its heads capped by the widest tensor's; float32 heads
    and a lone tensor keep the earlier rules, and a call too small for every SM's programs
    shrinks as any other."""
    from rope_dispatch.backends import triton_tiles

    block_t, block_h = triton_tiles.WIDE_HEAD_CACHE_TILE
    wide = (block_t, min(block_h, max(counts)))
    assert _qk_cache_tile(tokens, counts, 256) == wide
    if wide[1] == block_h:
        assert _qk_cache_tile(tokens, counts, 256, size=4) != wide
        assert _qk_cache_tile(tokens, (max(counts),), 256) != wide
    small = _qk_cache_tile(16, counts, 256)
    assert small[0] * small[1] < block_t * block_h


@pytest.mark.parametrize("heads", [1, 3, 8, 32])
def test_one_tensor_takes_its_own_heads(heads):
    """A launch over one tensor (or tensors of one head count) fits its tile to its heads."""
    from rope_dispatch.backends import triton_tiles

    for counts in ((heads,), (heads, heads)):
        assert triton_tiles.tile_heads(counts, 128, 2) == 1 << (heads - 1).bit_length()


def test_launches_say_whether_they_compute_sines(monkeypatch, general_kernel):
    """The tile rule hears whether a launch computes sines: an angle table does, a cos/sin cache
    and a pair cache are read; for one tensor and for q and k in one launch."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    seen = []
    choose = triton_tiles.choose_config

    def record(*args, **kwargs):
        seen.append(kwargs["sines"])
        return choose(*args, **kwargs)

    monkeypatch.setattr(triton_tiles, "choose_config", record)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    freqs = _te_freqs(6, 8, DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    q, k = torch.randn(6, 1, 4, 8, device=DEVICE), torch.randn(6, 1, 2, 8, device=DEVICE)
    angles = freqs.view(6, 8).double()
    pair = rd.PairCosSinCache(torch.cat((angles[:, :4].cos(), angles[:, :4].sin()), -1).float())
    for table, computes in ((freqs, True), (rd.cos_sin_cache(freqs), False), (pair, False)):
        seen.clear()
        rd.apply(q, table, spec, backend="triton")
        rd.apply_qk_(q.clone(), k.clone(), table, spec, backend="triton")
        assert seen == [computes, computes]


@pytest.mark.parametrize("heads, tile", [(8, (2, 4)), (1, (2, 1))])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_two_token_tiles_of_small_calls_match_the_reference(monkeypatch, layout, heads, tile):
    """A small call that computes sines takes two tokens of half the heads per program (of one
    head, two tokens) and rotates forward and backward, out of place and in place, as the
    reference does: on the GPU the sweep's 512 tokens of 8 heads (2 x 4) or one (2 x 1), on the
    interpreter 16 tokens counted against 8 SMs (the same cuts)."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    tokens = 512 if CUDA else 16
    sms = triton_tiles.sm_count(0) if CUDA else 8
    if not CUDA:  # the interpreter's launches count one SM
        choose = triton_tiles.choose_config
        monkeypatch.setattr(triton_tiles, "choose_config",
                            lambda *a, **kw: choose(*a[:6], sms, *a[7:], **kw))
    monkeypatch.setattr(triton_launch, "_compiled", {})
    assert triton_tiles.choose_config(tokens, heads, 128, 128, 2, False, sms)[:2] == tile
    freqs = _te_freqs(tokens, 128, DEVICE)
    if layout == "thd":
        t = torch.randn(tokens, heads, 128).to(torch.bfloat16).to(DEVICE)
        cu = torch.tensor([0, tokens // 4, tokens // 2 + 1, tokens], dtype=torch.int32,
                          device=DEVICE)
        spec = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=cu)
    else:
        t = torch.randn(tokens, 1, heads, 128).to(torch.bfloat16).to(DEVICE)
        spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    _rope_check_gpu(t, freqs, spec)
    positions = reference_positions(layout, tuple(t.shape),
                                    cu_seqlens=None if layout != "thd" else cu.tolist())
    in_place = t.clone()
    assert rd.apply_(in_place, freqs, spec, backend="triton") is in_place
    assert_matches(in_place, reference_rope(t, freqs.view(tokens, 128), positions, False),
                   t.dtype)


@pytest.mark.parametrize("tokens, heads, head_dim, rotary_dim, tile", [
    (2048, 32, 128, 128, (2, 16)),  # 16 MiB: up to 16 heads of a token, then tokens
    (2048, 8, 256, 256, (4, 8)),  # rows of 512 bytes: RESIDENT_ROWS of them, 16 KiB
    (8192, 8, 128, 128, (4, 8)),
    (32768, 1, 128, 128, (8, 1)),  # one head: a 2 KiB tile at every size (rows are tokens)
    (8192, 1, 128, 128, (8, 1)),
    (32768, 1, 64, 64, (16, 1)),
    (2048, 32, 128, 64, (8, 4)),  # pass-through channels copied too: 8 tokens per tile
    (8192, 32, 128, 64, (8, 4)),  # 64 MiB, pass-through channels: 8 tokens per tile too
    (8192, 32, 128, 128, (8, 4)),  # 64 MiB, a token of 8 KiB: 8 tokens per tile
    (32768, 8, 128, 128, (1, 8)),  # 64 MiB, a token of 2 KiB: 2 KiB tiles, heads first
    (16384, 16, 128, 128, (1, 8)),  # half a token
    (65536, 4, 128, 128, (2, 4)),  # two whole tokens
    (1 << 18, 1, 128, 128, (8, 1)),
    (65536, 8, 64, 64, (2, 8)),
    (32768, 8, 256, 256, (1, 4)),
])
def test_tiles_put_a_tokens_heads_first(tokens, heads, head_dim, rotary_dim, tile):
    """With every channel rotated, a tile takes a token's heads before more tokens (one table
    row and its sines serve them all), with every SM given its programs: at most
    RESIDENT_BYTES (the L2 can hold the call) up to RESIDENT_HEADS in an 8 KiB tile (or
    RESIDENT_ROWS rows, up to 16 KiB), above it in a STREAM_TILE_BYTES tile where a token is
    smaller than 8 KiB, as a tensor of one head at every size. Larger tokens, and calls that
    copy pass-through channels, keep 8 tokens per tile."""
    from rope_dispatch.backends import triton_tiles

    config = triton_tiles.choose_config(tokens, heads, head_dim, rotary_dim, 2, False, 132)
    bt, bh = config[:2]
    assert (bt, bh) == tile
    resident = tokens * heads * head_dim * 2 <= triton_tiles.RESIDENT_BYTES
    full = rotary_dim == head_dim
    streamed = ((not resident or heads == 1) and full
                and heads * head_dim * 2 < triton_tiles.TILE_BYTES)
    tile_bytes = triton_tiles.STREAM_TILE_BYTES if streamed else triton_tiles.TILE_BYTES
    if resident and full and not streamed:
        tile_bytes = max(tile_bytes, min(triton_tiles.RESIDENT_ROWS * head_dim * 2, 2 * tile_bytes))
    assert bt * bh * head_dim * 2 == tile_bytes
    # streamed tiles of 8 heads or more (one or two tokens) run on 2 warps, the rest on 4
    many_heads = bh >= triton_tiles.STREAM_WARPS_HEADS
    assert config[5] == (triton_tiles.STREAM_WARPS if streamed and many_heads else 4)
    assert -(-tokens // bt) * -(-heads // bh) >= 2 * 132
    if resident and full and not streamed:
        assert bh == min(heads, triton_tiles.RESIDENT_HEADS)
    elif streamed:
        assert bh == min(heads, tile_bytes // (head_dim * 2))
    else:
        assert bt == triton_tiles.TOKENS_PER_TILE


@pytest.mark.parametrize("heads, head_dim, element_size, tile", [
    (8, 256, 2, (4, 8)),  # bf16 rows of 512 bytes: 32 rows where 8 KiB holds 16
    (8, 256, 4, (2, 8)),  # float32 rows of 1 KiB: 16 rows where 8 KiB holds 8
    (8, 128, 4, (2, 8)),  # float32 rows of 512 bytes: 16 already fit in 8 KiB
    (8, 512, 2, (2, 8)),  # bf16 rows of 1 KiB: 32 would pass 16 KiB, so 16
    (32, 128, 2, (2, 16)),  # bf16 rows of 256 bytes: 32 already fit in 8 KiB
    (32, 64, 2, (4, 16)),  # rows of 128 bytes: 64 fit in 8 KiB, the tile as before
])
def test_tiles_the_l2_holds_keep_their_rows_up_to_16_kib(heads, head_dim, element_size, tile):
    """A call the L2 can hold gets at least RESIDENT_ROWS (token, head) rows of 16-bit data
    per tile, half as many of float32, where they fit in 16 KiB: wide heads would otherwise get
    few rows per program (2 x 8 at head dim 256 in bf16, 4.45-4.56 us warm against 4.25-4.30
    for 4 x 8 on the H200)."""
    from rope_dispatch.backends import triton_tiles

    config = triton_tiles.choose_config(2048, heads, head_dim, head_dim, element_size, False, 132)
    assert config[:3] == (*tile, 1)


def test_in_place_partial_rotary_tiles_count_heads_by_their_span(monkeypatch, general_kernel):
    """In place on partial rotary a head moves its rotary channels but spans its head dim in
    memory: a call the L2 holds takes 2 KiB chunks of one head's channels, tokens first, and
    loops over 4 heads (16 tokens of d 128 at rotary dim 64 in bf16, 8 in float32), where the
    moved bytes alone gave 4 x 16; with too few programs for that, heads-first tiles counting
    heads by the span (2 x 16 of 8 KiB spanned, shrunk, then two tokens of half the heads where
    the kernel computes sines). Streamed calls keep the moved bytes'
    tile, and out of place (the head moved whole) nothing changes. ``apply_`` passes the
    span, and its rotation still matches the reference."""
    from rope_dispatch.backends import triton_tiles

    choose = triton_tiles.choose_config
    assert choose(2048, 32, 64, 64, 2, False, 132, span_dim=128)[:3] == (16, 1, 4)
    assert choose(2048, 32, 64, 64, 4, False, 132, span_dim=128)[:3] == (8, 1, 4)
    assert choose(8192, 2, 64, 64, 2, False, 132, span_dim=128)[:3] == (16, 1, 2)
    # too few programs: 1 x 16 by the span, cut as two tokens of 8 heads (sines once a tile)
    assert choose(256, 32, 64, 64, 2, False, 132, span_dim=128)[:3] == (2, 8, 1)
    assert choose(256, 32, 64, 64, 2, False, 132, span_dim=128, sines=False)[:3] == (1, 16, 1)
    assert choose(2048, 32, 48, 48, 2, False, 132, span_dim=128)[:3] == (16, 1, 4)  # 2,048 // 96
    assert choose(2048, 32, 64, 64, 2, False, 132)[:3] == (4, 16, 1)
    assert (choose(32768, 32, 64, 64, 2, False, 132, span_dim=128)
            == choose(32768, 32, 64, 64, 2, False, 132))
    assert (choose(2048, 32, 128, 64, 2, False, 132, span_dim=128)
            == choose(2048, 32, 128, 64, 2, False, 132))

    tokens = 64 if DEVICE == "cpu" else 512  # 4 MiB of rotary channels: the L2 holds them
    x = torch.randn(tokens, 1, 32, 128, device=DEVICE)
    angles = rd.tables.angle_table(rd.tables.inverse_frequencies(64, 10000.0), tokens)
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    expected = reference_for(x.cpu(), angles, spec)
    chosen = _record_configs(monkeypatch)
    out = rd.apply_(x, angles.to(DEVICE), spec, backend="triton")
    (config,) = chosen
    sms = 1 if DEVICE == "cpu" else triton_tiles.sm_count(x.device.index)
    assert config == choose(tokens, 32, 64, 64, 4, False, sms, span_dim=128)
    assert config != choose(tokens, 32, 64, 64, 4, False, sms)
    assert out is x
    assert_matches(out, expected, torch.float32)


def test_streamed_tiles_can_be_turned_off(monkeypatch):
    """``STREAM_TILE_BYTES = 0`` gives a call above RESIDENT_BYTES the 8-token tile it had
    before (the probe compares both rules)."""
    from rope_dispatch.backends import triton_tiles

    monkeypatch.setattr(triton_tiles, "STREAM_TILE_BYTES", 0)
    config = triton_tiles.choose_config(32768, 8, 128, 128, 2, False, 132)
    assert config[:2] == (8, 4) and config[5] == 4


def test_cos_sin_cache_row_tiles_keep_their_tokens_when_streamed():
    """A cos/sin cache read as row tiles keeps 8 tokens per tile above RESIDENT_BYTES (its row
    loads want them), where an angle table or a pair cache of the same call streams whole
    tokens."""
    from rope_dispatch.backends import triton_tiles

    call = (32768, 8, 256, 256, 2, False, 132, triton_tiles.TOKENS_PER_TILE)
    rows = triton_tiles.choose_config(*call, cache_rows=True)
    assert rows[:2] == (8, 2) and rows[5] == 4
    streamed = triton_tiles.choose_config(*call)
    assert streamed[:2] == (1, 4) and streamed[5] == 4  # 4 heads of d 256: 4 warps


@pytest.mark.parametrize(
    "dtype, rotary_dim, interleaved, kind, tokens",
    [
        (torch.bfloat16, 128, False, "cos_sin", 16),  # [t, 64] bf16: 8 tokens load 1 KB
        (torch.float16, 64, False, "cos_sin", 32),
        (torch.bfloat16, 128, True, "cos_sin", 8),  # whole rows, [t, 128]
        (torch.float32, 128, False, "cos_sin", 8),
        (torch.bfloat16, 128, False, "pair", 8),  # always float32
        (torch.float32, 128, False, "angles", 8),
    ],
)
def test_cos_sin_caches_get_tiles_whose_row_loads_fill_16_bytes_a_thread(
    dtype, rotary_dim, interleaved, kind, tokens, monkeypatch, general_kernel
):
    """A cos/sin cache is read as ``[BLOCK_T, BLOCK_R]`` row tiles: a tile holds enough tokens
    for ``TABLE_TILE_BYTES`` of each, with its heads halved to keep the tile's bytes; the
    other tables keep ``TOKENS_PER_TILE``. A launch picks its kind's tile (a cache's tokens
    even where the L2 could hold the call)."""
    from rope_dispatch.backends import triton_tables, triton_tiles
    from rope_dispatch.tables import kernel_tables

    # enough programs for every SM of a GPU at full tiles (the interpreter counts one SM)
    seq = 64 if DEVICE == "cpu" else 4096
    inv = rd.tables.inverse_frequencies(rotary_dim, 10000.0)
    angles = rd.tables.angle_table(inv, seq).view(seq, rotary_dim).to(DEVICE)
    cache = rd.tables.cos_sin_cache(angles)
    half = rotary_dim // 2
    table = {
        "cos_sin": rd.CosSinCache(cache.cos.to(dtype), cache.sin.to(dtype)),
        "pair": rd.PairCosSinCache(torch.cat((cache.cos[:, :half], cache.sin[:, :half]), -1)),
        "angles": angles,
    }[kind]
    tab, sin = kernel_tables(table)
    flags = triton_tables.table_flags(tab, sin)
    assert triton_tiles.tile_tokens(flags, tab, rotary_dim, interleaved) == tokens
    bt, bh, *_ = triton_tiles.choose_config(1 << 17, 32, 128, rotary_dim, 2, interleaved, 132,
                                           tokens)
    assert (bt, bh) == (tokens, triton_tiles.TILE_BYTES // (128 * 2) // tokens)  # 8 KiB tokens

    spec = rd.RoPESpec(layout="sbhd", dtype=dtype, interleaved=interleaved)
    x = torch.randn(seq, 1, 8, 128, dtype=dtype, device=DEVICE)
    chosen = _record_configs(monkeypatch)
    monkeypatch.setattr(triton_tiles, "RESIDENT_BYTES", 0)  # streamed, as a call of GBs is
    out = rd.apply(x, table, spec, backend="triton")
    (config,) = chosen
    sms = 1 if DEVICE == "cpu" else triton_tiles.sm_count(x.device.index)
    assert config == triton_tiles.choose_config(
        seq, 8, 128, rotary_dim, x.element_size(), interleaved, sms, tokens, kind == "cos_sin")
    if kind == "cos_sin" or rotary_dim < 128:  # a cache's row tiles keep their tokens
        assert config[0] == tokens
    else:  # 8 heads of d 128 are at most 4 KiB a token: 2 KiB tiles, heads first
        assert config[0] == 1 and config[1] * 128 * x.element_size() == 2048
    assert_matches(out, reference_for(x.cpu(), angles.cpu(), spec), dtype)


def _record_configs(monkeypatch) -> list:
    """The tiles every launch compiled from now on chooses (compiled launches forgotten)."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    chosen = []
    choose = triton_tiles.choose_config
    monkeypatch.setattr(triton_tiles, "choose_config",
                        lambda *a, **kw: chosen.append(choose(*a, **kw)) or chosen[-1])
    monkeypatch.setattr(triton_launch, "_compiled", {})
    rd.dispatch.forget_plans()
    return chosen


class _Tripling:
    """Stands in for a call's rotation: forward and its transpose multiply by 3."""

    data_count = 1

    class launch:
        tensors = "t"
        in_place = False
        norm = None

    def versions(self):
        return ()

    def forward(self, inputs):
        return (inputs[0] * 3,)

    def backward(self, grads, strides, sources=()):
        return (grads[0] * 3,)


def test_the_c_entry_of_the_function_records_the_same_graph():
    """Planned gradient calls enter the autograd.Function through the C entry, not
    ``Function.apply``: the output, the gradient and a double backward are as through
    ``apply``, and the node in the graph is the function's own backward."""
    from rope_dispatch.backends.triton_rope import RoPEFunction, c_apply

    x = torch.randn(3, 4, requires_grad=True)
    grad_out = torch.randn(3, 4, requires_grad=True)
    results = []
    for enter in (RoPEFunction.apply, c_apply(RoPEFunction)):
        out = enter(_Tripling(), x)
        assert type(out.grad_fn).__name__ == "RoPEFunctionBackward"
        (grad,) = torch.autograd.grad(out, x, grad_out, create_graph=True)
        (again,) = torch.autograd.grad(grad, grad_out, torch.ones(3, 4))
        results.append((out, grad, again))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], 3 * grad_out, rtol=0, atol=0)
    torch.testing.assert_close(results[1][2], torch.full((3, 4), 3.0), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["angles", "cos/sin cache", "pair cache"])
@pytest.mark.parametrize("calls", [1, 3])  # the third call of one spec and table is planned
def test_a_table_written_between_forward_and_backward_raises(kind, calls):
    """The backward reads the table again: one written in place after the forward raises (as
    autograd does for any tensor it keeps) instead of differentiating a rotation that never
    ran; the same backward with the table untouched matches the reference."""
    from rope_dispatch import dispatch

    dispatch.forget_plans()
    half = torch.rand(8, 4, generator=torch.Generator().manual_seed(5)) * 6
    angles = torch.cat((half, half), -1).view(8, 1, 1, 8)
    if kind == "angles":
        freqs, written = angles.clone().to(DEVICE), None
    elif kind == "cos/sin cache":
        freqs = rd.cos_sin_cache(angles.to(DEVICE))
        written = freqs.sin
    else:
        freqs = rd.PairCosSinCache(torch.cat((half.cos(), half.sin()), -1).to(DEVICE))
        written = freqs.table
    written = freqs if written is None else written
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    t = torch.randn(8, 2, 2, 8, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    t.requires_grad_(True)
    grad_out = torch.randn(t.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for _ in range(calls):
        out = rd.apply(t, freqs, spec, backend="triton")
    (grad,) = torch.autograd.grad(out, t, grad_out, retain_graph=True)
    _, expected = reference_forward_backward(t.detach().cpu(), angles, spec, grad_out.cpu())
    assert_matches(grad, expected, torch.float32, "backward, table untouched")
    with torch.no_grad():
        written.mul_(0.5)
    with pytest.raises(rd.RoPEError, match="modified in place between the forward and the"):
        torch.autograd.grad(out, t, grad_out)


@pytest.mark.parametrize("kind", ["angles", "cos/sin cache"])
def test_a_k_table_written_between_forward_and_backward_is_named(kind):
    """Packed qkv with k's own table: a write into k_freqs after the forward makes the backward
    raise naming k_freqs (it named freqs, which was untouched), and one into freqs names freqs."""
    angles = torch.rand(8, 4, generator=torch.Generator().manual_seed(8)) * 6
    angles = torch.cat((angles, angles), -1).view(8, 1, 1, 8).to(DEVICE)

    def table():
        return angles.clone() if kind == "angles" else rd.cos_sin_cache(angles)

    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    qkv = torch.randn(8, 2, 1, 24, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    for written, name in (("k", "k's table \\(k_freqs\\)"), ("q", "the table \\(freqs\\)")):
        freqs, k_freqs = table(), table()
        x = qkv.clone().requires_grad_(True)
        outs = rd.apply_qkv(x, freqs, spec, (8, 8, 8), k_freqs=k_freqs, backend="triton")
        target = k_freqs if written == "k" else freqs
        with torch.no_grad():
            (target if kind == "angles" else target.sin).mul_(0.5)
        with pytest.raises(rd.RoPEError, match=f"^{name} was modified in place between"):
            sum(o.sum() for o in outs).backward()
