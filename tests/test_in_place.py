"""``rope_dispatch.apply_``: in-place rotation against the float64 reference, forward and backward.

Each check rotates a tensor that is a view into a larger buffer (``cases.build`` makes qkv
slices, permuted and channel-strided layouts) and verifies three things: the rotary channels
hold the reference result, every other element of the buffer (pass-through channels, other
heads) is bit-for-bit unchanged, and autograd sees the new version. The eager backend runs
everywhere; triton on the CPU interpreter (small shapes) or on the GPU.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from cases import Case, build, cases, fixed_case
from reference import assert_matches, reference_for, reference_forward_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(params=["eager", "triton"])
def backend(request):
    if request.param == "triton":
        request.getfixturevalue("triton_backend")
    return request.param


def _buffer(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buffer.as_strided(like.shape, like.stride(), like.storage_offset())


def check_in_place(case: Case, backend: str, grad_in_place: bool = False) -> None:
    t, table, spec, starts, angles = build(case, DEVICE, requires_grad=False)
    d2 = case.rotary_dim
    grad_out = torch.randn(t.shape, dtype=torch.float32).to(t.dtype).to(DEVICE)
    ref_out, ref_grad = reference_forward_backward(t.cpu(), angles, spec, grad_out.cpu(), starts)

    # no gradient: the tensor itself is rotated, nothing else in its buffer changes
    buffer = _buffer(t)
    before, version = buffer.clone(), t._version
    out = rd.apply_(t, table, spec, start_positions=starts, backend=backend)
    assert out is t and t._version > version
    assert_matches(t[..., :d2], ref_out[..., :d2], t.dtype, "forward")
    expected = before.clone()
    _view(expected, t)[..., :d2] = t[..., :d2]
    assert torch.equal(buffer, expected), "apply_ wrote outside the rotary channels of t"

    # with a gradient: t is a view of a non-leaf; dL/dbuffer is the reference's dL/dt there
    leaf = before.clone().requires_grad_(True)
    x = _view(leaf * 1, t)
    rd.apply_(x, table, spec, start_positions=starts, backend=backend, grad_in_place=grad_in_place)
    assert_matches(x[..., :d2], ref_out[..., :d2], t.dtype, "forward with autograd")
    incoming = grad_out.clone()
    (grad,) = torch.autograd.grad(x, leaf, incoming)
    expected_grad = torch.zeros_like(leaf)
    _view(expected_grad, t).copy_(ref_grad.to(t.dtype))
    assert_matches(grad, expected_grad, t.dtype, "backward")
    if not grad_in_place:
        assert torch.equal(incoming, grad_out), "the backward changed the incoming gradient"


@settings(max_examples=25 if not CUDA else 60, deadline=None)
@given(cases())
def test_eager_in_place_matches_reference(case):
    check_in_place(case, "eager")


@settings(max_examples=20 if not CUDA else 60, deadline=None)
@given(cases())
def test_triton_in_place_matches_reference(triton_backend, case):
    check_in_place(case, "triton")


def _case(**changes) -> Case:
    """bf16 partial rotary on a qkv slice unless ``changes`` say otherwise."""
    defaults = dict(dtype=torch.bfloat16, seq=6, rotary_dim=8, strides="qkv-slice", seed=1)
    return fixed_case(**{**defaults, **changes})


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradient_in_place_gives_the_same_gradient(backend, layout, interleaved):
    check_in_place(_case(layout=layout, interleaved=interleaved), backend, grad_in_place=True)


def test_gradient_in_place_rotates_the_incoming_gradient(triton_backend):
    t, table, spec, _, _ = build(_case(strides="contiguous"), DEVICE, requires_grad=False)
    leaf = t.clone().requires_grad_(True)
    x = rd.apply_(leaf * 1, table, spec, backend="triton", grad_in_place=True)
    incoming = torch.randn_like(x)
    original = incoming.clone()
    (grad,) = torch.autograd.grad(x, leaf, incoming)
    # the backward rotated the incoming gradient itself (leaf * 1's backward then made grad
    # from it, equal in value)
    assert torch.equal(incoming, grad) and not torch.equal(incoming, original)
    # sum()'s gradient is expanded (one address for every element) and cannot be rotated in
    # place: a new gradient is made, the same as without grad_in_place
    x = rd.apply_(leaf * 1, table, spec, backend="triton", grad_in_place=True)
    (grad,) = torch.autograd.grad(x.sum(), leaf)
    x = rd.apply_(leaf * 1, table, spec, backend="triton")
    (expected,) = torch.autograd.grad(x.sum(), leaf)
    assert torch.equal(grad, expected)


def test_gradient_in_place_with_one_gradient_for_q_and_k(backend):
    """``q + k`` hands its one gradient to q and to k: rotating it in place for q and then for
    k rotated it twice (the Triton backend's gradients were off by order 1). The backward makes
    new gradients for such a pair, the float64 reference's."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    half = torch.rand(8, 4) * 3
    table = torch.cat((half, half), dim=-1).to(DEVICE)
    a, b = (torch.randn(4, 2, 2, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    q, k = rd.apply_qk_(a * 1, b * 1, table, spec, backend=backend, grad_in_place=True)
    g = torch.randn(4, 2, 2, 8, device=DEVICE)
    got = torch.autograd.grad(q + k, (a, b), g)
    for x, grad in zip((a, b), got):
        _, expected = reference_forward_backward(x.detach().cpu(), table.cpu(), spec, g.cpu())
        assert_matches(grad, expected, torch.float32, "gradient")


def test_double_backward_through_apply_(backend):
    """The gradient is differentiable with respect to the incoming gradient ``v``: the map is
    linear, so d<g, w>/dv is the forward of ``w`` (grad_in_place yields to create_graph)."""
    t, table, spec, _, _ = build(_case(dtype=torch.float32), DEVICE)
    leaf = t.detach().clone().requires_grad_(True)
    x = rd.apply_(leaf * 1, table, spec, backend=backend, grad_in_place=True)
    v = torch.randn_like(x).requires_grad_(True)
    (g,) = torch.autograd.grad(x, leaf, v, create_graph=True)
    w = torch.randn_like(g)
    (dv,) = torch.autograd.grad(g, v, w)
    assert_matches(dv, rd.apply(w, table, spec, backend="eager"), torch.float32, "double backward")


def test_empty_tensor_is_not_expanded(backend):
    """An empty tensor with a stride-0 dim (as torch makes some empty results) shares no
    memory: rotated in place like torch's own in-place ops, not refused as expanded."""
    q = torch.randn(2, 16, 0, device=DEVICE).permute(2, 0, 1) * 1.0  # [T=0, h=2, d=16]
    assert 0 in q.stride()
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 0], device=DEVICE))
    assert rd.apply_(q, torch.rand(4, 16, device=DEVICE), spec, backend=backend) is q


def test_refusals_name_the_problem(backend):
    t, table, spec, _, _ = build(_case(strides="contiguous", dtype=torch.float32), DEVICE)
    with pytest.raises(rd.RoPEError, match="apply_ rotates t in place, but t is a leaf tensor that requires grad"):
        rd.apply_(t, table, spec, backend=backend)
    for _ in range(3):  # views of non-leaves, planned from the second call on
        rd.apply_((t * 1).view(t.shape), table, spec, backend=backend)
    with pytest.raises(rd.RoPEError, match="t is a view of a leaf tensor that requires grad"):
        rd.apply_(t.view(t.shape), table, spec, backend=backend)  # torch would refuse it after the write
    projection = t * 1
    with torch.no_grad():  # a slice of a projection, taken under no_grad: not a leaf's view
        part = projection[..., :8]
    with pytest.raises(rd.RoPEError, match="t is a view made with grad disabled .* requires grad"):
        rd.apply_(part, table, spec, backend=backend)
    expanded = torch.randn(1, 2, 3, 16, device=DEVICE).expand(6, 2, 3, 16)
    with pytest.raises(rd.RoPEError, match=r"dim 0 \(size 6\) has stride 0"):
        rd.apply_(expanded, table, spec, backend=backend)
    with torch.inference_mode():
        frozen = torch.randn(6, 2, 3, 16, device=DEVICE)
    with pytest.raises(rd.RoPEError, match="t is an inference tensor and inference mode is off"):
        rd.apply_(frozen, table, spec, backend=backend)
    with torch.inference_mode():  # inside inference mode it is allowed
        assert rd.apply_(frozen, table, spec, backend=backend) is frozen


def _offsets(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The storage offset of every element of ``t[..., start:stop]``, one by one."""
    index = torch.zeros((), dtype=torch.int64) + t.storage_offset() + start * t.stride(-1)
    for n, s in zip((*t.shape[:-1], stop - start), t.stride()):
        index = index.unsqueeze(-1) + torch.arange(n) * s
    return index.flatten()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 13)), min_size=1, max_size=4),
       st.integers(0, 5), st.data())
def test_self_overlap_matches_enumeration(dims, offset, data):
    """Whether a view's window of channels addresses an element twice, against its elements
    listed one by one."""
    from rope_dispatch.overlap import self_overlap

    t = torch.zeros(400).as_strided([n for n, _ in dims], [s for _, s in dims], offset)
    start = data.draw(st.integers(0, t.shape[-1]))
    stop = data.draw(st.integers(start, t.shape[-1]))
    offsets = _offsets(t, start, stop)
    assert self_overlap(t, start, stop) is (offsets.unique().numel() < offsets.numel())


def test_overlapping_views_are_refused(backend):
    """A view whose places share elements (overlapping rows, as as_strided makes them) cannot
    be rotated in place: each write would land on another's result. Refused with the reason,
    as an expanded tensor is, on the first call and after calls that were planned; a view
    whose overlap lies only in channels the call neither reads nor writes is rotated."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    half = torch.rand(8, 2) * 3
    table = torch.cat((half, half), dim=-1).view(8, 1, 1, 4).to(DEVICE)  # rotary dim 4 of 8
    buffer = torch.randn(400, device=DEVICE)
    for _ in range(3):  # planned from the second call on: the overlapping view is not
        rd.apply_(buffer[:96].view(4, 3, 1, 8), table, spec, backend=backend)
    rows = buffer.as_strided((4, 3, 1, 8), (8, 16, 8, 1))  # row s + 2 is row s's batch 1
    with pytest.raises(rd.RoPEError, match=r"apply_ cannot rotate t in place: t \(4, 3, 1, 8\) "
                       r"with strides \(8, 16, 8, 1\) overlaps itself"):
        rd.apply_(rows, table, spec, backend=backend)
    heads = buffer.as_strided((4, 3, 2, 8), (48, 16, 2, 1))  # head 1's channels 0, 1: head 0's 2, 3
    with pytest.raises(rd.RoPEError, match="overlaps itself .* in channels 0..4"):
        rd.apply_(heads, table, spec, backend=backend)
    norm = rd.HeadNorm(torch.rand(8, device=DEVICE))
    q = torch.randn(4, 3, 2, 8, device=DEVICE)
    with pytest.raises(rd.RoPEError, match="apply_qk_ cannot rotate k in place"):
        rd.apply_qk_(q, heads, table, spec, backend=backend)
    passing = buffer.as_strided((4, 3, 2, 8), (48, 16, 6, 1))  # head 1 reads head 0's 6, 7
    with pytest.raises(rd.RoPEError, match="apply_ cannot rotate t in place: t .* overlaps"):
        rd.apply_(passing, table, spec, backend=backend, norm=norm)  # whole heads written
    before = buffer.clone()
    expected = reference_for(passing.cpu(), table.cpu(), spec)
    rd.apply_(passing, table, spec, backend=backend)  # channels 6, 7 neither read nor written
    assert_matches(passing[..., :4], expected[..., :4], torch.float32, "rotary channels")
    untouched = torch.ones(400, dtype=torch.bool)
    untouched[_offsets(passing, 0, 4)] = False
    assert torch.equal(buffer.cpu()[untouched], before.cpu()[untouched])


def test_a_table_in_the_memory_it_writes_is_refused(backend):
    """A table whose memory the call writes (an angle table, a cache's cos or sin, laid over
    the rotated tensor's elements) is read while other tokens' tiles are written: on a GPU the
    Triton launch read rows already rotated (errors of order 1). Refused naming both, on a first
    call and on a planned one whose tensor moved onto the table; a table in channels the call
    neither reads nor writes is served, with the reference's numbers."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    buffer = torch.rand(2, 8, 1, 1, 8, device=DEVICE)  # two [8, 1, 1, 8] tensors
    table = buffer[1].view(8, 8)  # the second one's memory, as rows of 8 angles
    for _ in range(3):  # planned from the second call on, the tensor apart from the table
        rd.apply_(buffer[0], table, spec, backend=backend)
    before = buffer.clone()
    with pytest.raises(rd.RoPEError, match=r"freqs shares memory with t \(8, 1, 1, 8\), which "
                       r"the call rotates in place while it reads the table"):
        rd.apply_(buffer[1], table, spec, backend=backend)  # the same strides, moved onto it
    cache = rd.CosSinCache(table.cos(), buffer[0].view(8, 8))
    with pytest.raises(rd.RoPEError, match=r"freqs shares memory with k \(8, 1, 1, 8\)"):
        rd.apply_qk_(buffer[1].clone(), buffer[0], cache, spec, backend=backend)
    assert torch.equal(buffer, before)
    wide = torch.rand(1, 1, 1, 24, device=DEVICE)  # rotary dim 8 of 24; the table in 16..24
    inside = wide.view(24)[16:].view(1, 8)
    expected = reference_for(wide.cpu(), inside.cpu(), spec)
    rd.apply_(wide, inside, spec, backend=backend)
    assert_matches(wide, expected, torch.float32, "a table in the pass-through channels")


class OutOfPlaceOnly(rd.Backend):
    """A backend that leaves ``supports_in_place`` at its default."""

    name = "out-of-place-only"
    priority = 1000

    def apply(self, call):
        raise AssertionError("never chosen for apply_")


def test_backends_without_in_place_say_so(monkeypatch):
    monkeypatch.setitem(rd.registry._REGISTRY, OutOfPlaceOnly.name, OutOfPlaceOnly())
    rd.dispatch.clear_decisions()
    t, table, spec, _, _ = build(_case(strides="contiguous"), DEVICE, requires_grad=False)
    reason = "in-place rotation (apply_) is not supported; it writes a new tensor"
    explanation = rd.explain(t, table, spec, in_place=True)
    assert explanation.rejected[OutOfPlaceOnly.name] == [reason]
    assert explanation.chosen in ("eager", "triton")
    with pytest.raises(rd.BackendNotSupportedError, match=r"in-place rotation \(apply_\)"):
        rd.apply_(t, table, spec, backend=OutOfPlaceOnly.name)
    rd.apply_(t, table, spec)  # dispatch passes over it
    assert not rd.get_backend("te").supports_in_place
    assert not rd.get_backend("compile").supports_in_place
    monkeypatch.undo()
    rd.dispatch.clear_decisions()


def test_repeated_in_place_calls_rotate_each_time(backend):
    """A repeated call reuses its plan; rotating twice by the same angles is rotating by twice
    the angles."""
    t, _, spec, _, _ = build(_case(strides="contiguous", dtype=torch.float32), DEVICE, requires_grad=False)
    half = torch.rand(12, 4) * 6  # both halves of a pair turn by the same angle: rotations
    table = torch.cat((half, half), dim=-1).view(12, 1, 1, 8).to(DEVICE)
    expected = rd.apply(t, 2 * table, spec, backend="eager")
    for _ in range(2):
        rd.apply_(t, table, spec, backend=backend)
    assert_matches(t, expected, torch.float32, "two rotations")


@pytest.mark.gpu
def test_gpu_in_place_partial_rotary_repeated_and_unaligned(triton_backend):
    """Large sbhd with rotary dim 64 of 128, through the first call, the bound launch of a
    repeated call, and an unaligned input that the bound launch must hand back."""
    from reference import reference_positions, reference_rope

    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    angles = torch.outer(torch.arange(2048, dtype=torch.float64), inv)
    freqs = torch.cat((angles, angles), dim=-1).float().view(2048, 1, 1, 64).cuda()
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    shape = (2048, 2, 8, 128)
    buffer = torch.randn(torch.Size(shape).numel() + 8, device="cuda").bfloat16()
    positions = reference_positions("sbhd", shape)
    for offset in (0, 0, 8, 1, 0):
        with torch.no_grad():
            x = buffer[offset:offset + torch.Size(shape).numel()].view(shape)
            original = x.clone()
            ref = reference_rope(original, freqs.view(2048, 64), positions, False)
            assert rd.apply_(x, freqs, spec) is x
        assert_matches(x, ref, torch.bfloat16, f"offset {offset}")
        assert torch.equal(x[..., 64:], original[..., 64:])



def _compiled_table():
    """An sbhd fp32 spec, rotary angles (float64) and their table on DEVICE; a compiler."""
    half = torch.rand(8, 4, dtype=torch.float64) * 3
    angles = torch.cat((half, half), dim=-1)
    compiler = "inductor" if CUDA else "aot_eager"
    return rd.RoPESpec(layout="sbhd", dtype="fp32"), angles, angles.float().view(8, 1, 1, 8).to(
        DEVICE), compiler


def _compiled(fn, compiler):
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=compiler)



_OVERLAPS = {  # a call's tensors in a [8, 1, 2, 8] buffer, apart (bad=0) or not; the refusal
    "q and k": (lambda buf, table, bad: {"t": buf[:, :, :1 + bad], "k": buf[:, :, 1:2],
                                         "table": table},
                r"apply_qk_ cannot rotate q and k in place: they share memory .* overlap in "
                r"their first 8 channels"),
    "norm weight": (lambda buf, table, bad: {"t": buf[:, :, :1], "table": table,
                                             "weight": buf[0, 0, 1 - bad]},
                    r"norm.weight shares memory with t \(8, 1, 1, 8\), which the call "
                    "rotates in place while it reads the weight"),
    "table": (lambda buf, table, bad: {"t": buf.view(2, 8, 1, 1, 8)[0],
                                       "table": buf.view(2, 8, 8)[1 - bad]},
              r"freqs shares memory with t \(8, 1, 1, 8\), which the call rotates in place "
              "while it reads the table"),
    "self-overlapping view": (lambda buf, table, bad: {
        "t": buf.as_strided((8, 1, 1, 8), (8 - 4 * bad, 8, 8, 1)),
        "table": table},
        r"apply_ cannot rotate t in place: t \(8, 1, 1, 8\) with strides \(4, 8, 8, 1\) "
        "overlaps itself"),
}


def _rotate_in_place(tensors, spec, backend):
    t, k, table, weight = (tensors.get(name) for name in ("t", "k", "table", "weight"))
    if k is not None:
        return rd.apply_qk_(t, k, table, spec, backend=backend)
    return rd.apply_(t, table, spec, backend=backend,
                     norm=None if weight is None else rd.HeadNorm(weight))


@pytest.mark.parametrize("case", list(_OVERLAPS))
def test_compiled_in_place_refuses_overlapping_memory(backend, case):
    """Under ``torch.compile(fullgraph=True)`` a call's tensors are fake while it traces, so
    the memory checks of an in-place call run in the graph, on its real tensors: q and k that
    share elements, a norm weight or a table inside what is written, and a view that overlaps
    itself are refused as in eager (they ran, and wrote whatever the last copy left); the same
    calls on memory apart rotate as the reference does."""
    _rotated_apart_refused_together(backend, case)


def test_compiled_in_place_call_after_a_door_was_traced(backend):
    """A door traced inside ``torch.compile`` sets the words of the in-graph checks and clears
    them, writes Dynamo replays after its graph: compiled in-place calls traced afterwards pass
    their own guards, rotate and refuse as before (Dynamo once failed every one of them,
    "Guard failed on the same frame it was created")."""
    from rope_dispatch.compat import vllm

    _, angles, _, compiler = _compiled_table()
    cache = torch.cat((angles[:, :4].cos(), angles[:, :4].sin()), -1).float().to(DEVICE)
    positions = torch.tensor([3, 0], device=DEVICE)
    q, k = torch.rand(2, 16, device=DEVICE), torch.rand(2, 8, device=DEVICE)
    want = [reference_for(x.unflatten(-1, (-1, 8)).cpu().double(), angles,
                          rd.RoPESpec(layout="thd", dtype="fp32"), positions=positions.cpu())
            for x in (q, k)]
    _compiled(lambda q, k: vllm.rotary_embedding(positions, q, k, 8, cache, True), compiler)(q, k)
    for x, expected, name in zip((q, k), want, "qk"):
        assert_matches(x.unflatten(-1, (-1, 8)), expected, torch.float32, name)
    for case in ("q and k", "table"):
        _rotated_apart_refused_together(backend, case)


def _rotated_apart_refused_together(backend, case):
    spec, angles, table, compiler = _compiled_table()
    views, refusal = _OVERLAPS[case]
    run = _compiled(lambda buf, bad: _rotate_in_place(views(buf, table, bad), spec, backend),
                    compiler)
    buf = torch.rand(8, 1, 2, 8, device=DEVICE) + 0.5
    before = views(buf.clone().cpu(), angles, 0)
    after = views(buf, table, 0)
    run(buf, 0)
    for name in ("t", "k"):
        if name in before:
            x = before[name].double()
            if "weight" in before:  # rms-normalized by the weight, then rotated
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * before["weight"]
            want = reference_for(x, before["table"].double(), spec)
            assert_matches(after[name], want, torch.float32, f"{case}: {name}")
    with pytest.raises(rd.RoPEError, match=refusal):
        run(buf, 1)
