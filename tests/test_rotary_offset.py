"""Rotary channels past a head's first channel (``RoPESpec.rotary_offset``) and interleaved
pairs in, halves out (``RoPESpec.deinterleave``: DeepSeek V2/V3's ``rope_interleave``), on
every CPU backend, against the float64 reference written from the formula
(tests/reference.py), forward and backward: single tensors, in place, q and k with one shared
key head, packed qkv, per-token positions, thd, the norm stage, the inverse; the refusals.

q and k come in as slices of a projection's output (non-contiguous views), and their gradients
must reach that output. Triton runs on its CPU interpreter here: its shapes are tiny."""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from reference import (
    assert_matches, reference_for, reference_forward_backward, reference_head_norm,
    reference_qkv_forward_backward, reference_rope,
)
from rope_dispatch.call import check_call
from rope_dispatch.dispatch import choose
from rope_dispatch.tables import angle_table

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
D, D2 = 14, 8  # head dim, rotary dim
MODES = {  # name -> (rotary_offset, deinterleave)
    "offset": (D - D2, False),
    "deinterleave": (0, True),
    "offset-deinterleave": (4, True),
}
"""Offset 6: rotary channels 6..13 (DeepSeek's place, the last d2); offset 4 leaves channels on
both sides to pass through."""
needs_compile = pytest.mark.skipif(
    not rd.get_backend("compile").available, reason="torch.compile cannot run here"
)


@pytest.fixture(params=["eager", "triton"])
def backend(request) -> str:
    """Each backend whose kernels take every call kind: eager, and Triton (on its CPU
    interpreter where there is no GPU)."""
    if request.param == "triton":
        request.getfixturevalue("triton_backend")
    return request.param


def spec_for(mode: str, layout: str = "sbhd", dtype=torch.float32, **fields) -> rd.RoPESpec:
    offset, deinterleave = MODES[mode]
    return rd.RoPESpec(layout=layout, dtype=dtype, rotary_offset=offset,
                       deinterleave=deinterleave, **fields)


def angles(rows: int, seed: int = 0) -> torch.Tensor:
    """Random float32 angles ``[rows, D2]`` with unequal halves and pairs: every entry read."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, D2, generator=gen) * 12 - 6).float()


def projected(shape: tuple[int, ...], seed: int, device: str = DEVICE, dtype=torch.float32):
    """``(projection, view)``: a leaf ``[.., heads, D + 5]`` that requires grad and the
    non-contiguous ``[.., heads, D]`` slice of it that a call gets, as q_rot of a fused
    projection is."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(*shape[:-1], shape[-1] + 5, generator=gen).to(dtype).to(device)
    proj.requires_grad_(True)
    view = proj[..., 3:3 + shape[-1]]
    assert not view.is_contiguous()
    return proj, view


def tokens_shape(layout: str, heads: int = 2, seq: int = 3, batch: int = 2) -> tuple:
    return {"sbhd": (seq, batch, heads, D), "bshd": (batch, seq, heads, D),
            "thd": (seq * batch, heads, D)}[layout]


def grad_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device)


def check_projection_grad(proj: torch.Tensor, ref_grad: torch.Tensor, dtype) -> None:
    """The view's gradient landed in its projection's channels 3 .. 3 + D, zeros elsewhere."""
    assert proj.grad is not None
    assert_matches(proj.grad[..., 3:3 + D], ref_grad, dtype, "gradient in the projection")
    assert torch.count_nonzero(proj.grad[..., :3]) == 0
    assert torch.count_nonzero(proj.grad[..., 3 + D:]) == 0


def cu_for(layout: str) -> dict:
    if layout != "thd":
        return {}
    return {"cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)}


def check_apply(backend: str, mode: str, layout: str, starts: bool = False, table: str = "angles",
                seed: int = 0, interleaved: bool = False) -> None:
    spec = spec_for(mode, layout, interleaved=interleaved, **cu_for(layout))
    proj, t = projected(tokens_shape(layout), seed)
    rows = 8 if starts else 6
    a = angles(rows, seed).to(DEVICE)
    start_positions = (torch.tensor([2, 0], device=DEVICE) if starts else None)
    freqs = {"angles": a, "cache": rd.cos_sin_cache(a)}[table]
    out = rd.apply(t, freqs, spec, start_positions=start_positions, backend=backend)
    assert out.shape == t.shape and out.is_contiguous()
    grad_out = grad_like(out, seed)
    out.backward(grad_out)
    ref_out, ref_grad = reference_forward_backward(t, a, spec, grad_out, start_positions)
    assert_matches(out, ref_out, t.dtype, "forward")
    check_projection_grad(proj, ref_grad, t.dtype)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("mode", MODES)
def test_eager_matches_reference(mode, layout):
    check_apply("eager", mode, layout, starts=layout != "thd")


def test_offset_with_pairs_kept_in_place(backend):
    """rotary_offset with interleaved=True: pairs (o + 2k, o + 2k + 1), each where it is read."""
    check_apply(backend, "offset", "bshd", starts=True, interleaved=True)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("mode, layout, starts, table", [
    ("offset", "sbhd", False, "angles"),
    ("deinterleave", "bshd", True, "cache"),
    ("offset-deinterleave", "thd", False, "angles"),
    ("offset-deinterleave", "sbhd", True, "cache"),
])
def test_triton_matches_reference(mode, layout, starts, table):
    check_apply("triton", mode, layout, starts, table)


@needs_compile
@pytest.mark.parametrize("mode", ["offset", "offset-deinterleave"])
def test_compile_matches_reference(mode):
    check_apply("compile", mode, "bshd", starts=True)


@pytest.mark.usefixtures("triton_backend")
def test_triton_under_torch_compile():
    """Traced, a call goes to the Triton custom op, whose launch carries the offset and the
    pairing both ways (its autograd formula is the op transposed)."""
    spec = spec_for("offset-deinterleave", "bshd")
    a = angles(6).to(DEVICE)
    proj, t = projected(tokens_shape("bshd"), 13)
    compiled = torch.compile(lambda x: rd.apply(x, a, spec, backend="triton"), fullgraph=True,
                             backend="aot_eager")
    out = compiled(t)
    grad_out = grad_like(out, 14)
    out.backward(grad_out)
    ref_out, ref_grad = reference_forward_backward(t, a, spec, grad_out)
    assert_matches(out, ref_out, t.dtype, "forward")
    check_projection_grad(proj, ref_grad, t.dtype)


def test_rate_table_and_pair_cache(backend):
    """A rate table and a pair cache rotate pair ``k`` by one angle: deinterleaved, pair ``k`` of
    the input comes out at channels ``k`` and ``k + d2/2``, turned by rate ``k``."""
    spec = spec_for("offset-deinterleave")
    inv_freq = torch.tensor([1.0, 0.5, 0.25, 0.125])
    rates = rd.RateTable(inv_freq.to(DEVICE), 6)
    table = angle_table(inv_freq, 6).reshape(6, D2).to(DEVICE)  # halves, pair k: rate k
    pair = torch.cat((table[:, :D2 // 2].cos(), table[:, :D2 // 2].sin()), dim=-1)
    _, t = projected(tokens_shape("sbhd"), 5)
    expected = reference_for(t, table, spec)
    for freqs in (rates, rd.PairCosSinCache(pair.contiguous())):
        assert_matches(rd.apply(t, freqs, spec, backend=backend), expected, t.dtype, "forward")


@pytest.mark.parametrize("mode", MODES)
def test_in_place_moves_only_the_rotary_channels(backend, mode):
    spec = spec_for(mode)
    offset = spec.rotary_offset
    a = angles(6).to(DEVICE)
    _, view = projected(tokens_shape("sbhd"), 1)
    expected = rd.apply(view.detach(), a, spec, backend=backend)
    with torch.no_grad():
        t = view.detach().clone()
        before = t.clone()
        assert rd.apply_(t, a, spec, backend=backend) is t
    assert torch.equal(t, expected)
    assert torch.equal(t[..., :offset], before[..., :offset])
    assert torch.equal(t[..., offset + D2:], before[..., offset + D2:])
    # with grad: a non-leaf rotated in place, the gradient to the projection it came from
    proj, view = projected(tokens_shape("sbhd"), 1)
    x = view * 1.0
    rd.apply_(x, a, spec, backend=backend)
    grad_out = grad_like(x, 2)
    x.backward(grad_out)
    _, ref_grad = reference_forward_backward(view, a, spec, grad_out)
    check_projection_grad(proj, ref_grad, torch.float32)


def deepseek_qk(q_heads: int, layout: str = "bshd", seq: int = 2, batch: int = 1):
    """DeepSeek's shapes in small: ``q`` ``[.., q_heads, D]`` and one key head ``k`` ``[.., 1,
    D]``, each a slice of its projection's output."""
    q_proj, q = projected(tokens_shape(layout, q_heads, seq, batch), 11)
    k_proj, k = projected(tokens_shape(layout, 1, seq, batch), 12)
    return q_proj, q, k_proj, k


@pytest.mark.parametrize("mode", ["offset", "deinterleave"])
def test_one_key_head_for_many_query_heads(backend, mode):
    """q with 128 heads, k with one (DeepSeek's k_rot), by apply_qk and apply_qk_: forward,
    and gradients into both projections."""
    spec = spec_for(mode, "bshd")
    a = angles(4).to(DEVICE)
    q_proj, q, k_proj, k = deepseek_qk(128)
    q_out, k_out = rd.apply_qk(q, k, a, spec, backend=backend)
    gq, gk = grad_like(q_out, 3), grad_like(k_out, 4)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    for name, x, out, g, proj in (("q", q, q_out, gq, q_proj), ("k", k, k_out, gk, k_proj)):
        ref_out, ref_grad = reference_forward_backward(x, a, spec, g)
        assert_matches(out, ref_out, x.dtype, f"{name} forward")
        check_projection_grad(proj, ref_grad, x.dtype)
    with torch.no_grad():
        q2, k2 = q.detach().clone(), k.detach().clone()
        assert rd.apply_qk_(q2, k2, a, spec, backend=backend) == (q2, k2)
    assert torch.equal(q2, q_out.detach()) and torch.equal(k2, k_out.detach())


def test_in_place_pair_overlap_is_checked_on_the_rotary_channels():
    """apply_qk_ refuses q and k views whose rotary channels (from the offset on) share an
    element, as it does for the first d2 channels without an offset."""
    spec = spec_for("offset", "sbhd")  # rotary channels 6..13
    base = torch.randn(3, 2, 1, 2 * D)
    q, k = base[..., :D], base[..., 2:2 + D]  # rotary: base 6..13 and 8..15
    with pytest.raises(rd.RoPEError, match="overlap in their 8 rotary channels from channel 6"):
        rd.apply_qk_(q, k, angles(3), spec)
    q, k = base[..., :D], base[..., D - 6:2 * D - 6]  # rotary: base 6..13 and 14..21
    assert rd.apply_qk_(q, k, angles(3), spec) == (q, k)


@pytest.mark.parametrize("mode", ["offset", "offset-deinterleave"])
def test_packed_qkv(backend, mode):
    split = (2 * D, D, D)
    spec = spec_for(mode, "sbhd")
    gen = torch.Generator().manual_seed(21)
    qkv = torch.randn(3, 2, 2, sum(split), generator=gen).to(DEVICE).requires_grad_(True)
    a, k_a = angles(5, 1).to(DEVICE), angles(5, 2).to(DEVICE)
    outs = rd.apply_qkv(qkv, a, spec, split, k_freqs=k_a, backend=backend)
    grads = tuple(grad_like(o, i) for i, o in enumerate(outs))
    (grad,) = torch.autograd.grad(outs, qkv, grads)
    ref_outs, ref_grad = reference_qkv_forward_backward(qkv, a, k_a, spec, split, grads)
    for name, out, ref in zip("qkv", outs, ref_outs):
        assert_matches(out, ref, qkv.dtype, f"{name} forward")
    assert_matches(grad, ref_grad, qkv.dtype, "packed backward")


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_per_token_positions(backend, layout):
    spec = spec_for("offset-deinterleave", layout)
    proj, t = projected(tokens_shape(layout), 7)
    a = angles(9, 3).to(DEVICE)
    positions = torch.randint(0, 9, t.shape[:-2], generator=torch.Generator().manual_seed(8))
    positions = positions.to(DEVICE)
    out = rd.apply(t, a, spec, positions=positions, backend=backend)
    grad_out = grad_like(out, 9)
    out.backward(grad_out)
    ref_out, ref_grad = reference_forward_backward(t, a, spec, grad_out, positions=positions)
    assert_matches(out, ref_out, t.dtype, "forward")
    check_projection_grad(proj, ref_grad, t.dtype)


@pytest.mark.parametrize("mode", MODES)
def test_inverse_undoes_the_rotation(backend, mode):
    """The inverse spec is the transpose: for deinterleave it reads halves, turns back and
    re-interleaves, so it returns the input (a pair's two channels share one angle)."""
    spec = spec_for(mode)
    inverse = spec_for(mode, inverse=True)
    half = angles(6)[:, :D2 // 2]
    a = torch.cat((half, half), dim=-1).to(DEVICE)
    _, t = projected(tokens_shape("sbhd"), 4)
    out = rd.apply(t, a, spec, backend=backend)
    back = rd.apply(out, a, inverse, backend=backend)
    torch.testing.assert_close(back, t.detach(), rtol=0, atol=2e-6)
    ref = reference_rope(out.detach(), a, torch.arange(3)[:, None].expand(3, 2), False,
                         inverse=True, offset=spec.rotary_offset, deinterleave=spec.deinterleave)
    assert_matches(back, ref, torch.float32, "inverse forward")


def test_norm_stage_composes_on_eager_and_triton_says_why_not(request):
    """A norm over the whole head, then the offset (deinterleaved) rotation: eager serves it,
    weight gradient included; Triton's norm kernel refuses it with the value named."""
    spec = spec_for("offset-deinterleave")
    a = angles(6)
    proj, t = projected(tokens_shape("sbhd"), 6, device="cpu")
    weight = (torch.rand(D, generator=torch.Generator().manual_seed(1)) + 0.5).requires_grad_(True)
    norm = rd.HeadNorm(weight, 1e-6)
    out = rd.apply(t, a, spec, norm=norm, backend="eager")
    grad_out = grad_like(out, 10)
    out.backward(grad_out)
    x = t.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    normed = reference_head_norm(x, w, 1e-6, 0.0, "head")
    ref = reference_for(normed, a, spec)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), grad_out.double())
    assert_matches(out, ref, torch.float32, "forward")
    check_projection_grad(proj, ref_dx, torch.float32)
    assert_matches(weight.grad, ref_dw, torch.float32, "weight gradient")

    triton = request.getfixturevalue("triton_backend")
    call = check_call(t.detach().to(DEVICE), a.to(DEVICE), spec,
                      q_norm=rd.HeadNorm(weight.detach().to(DEVICE), 1e-6))
    reasons = triton.not_supported_reasons(call)
    assert any("spec.rotary_offset=4" in r and "eager" in r for r in reasons), reasons
    assert choose(call).name != "triton"  # eager or compile, which compose them too


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_the_shipped_reference_agrees(mode, inverse):
    """The selftest's vectorised reference (rope_dispatch/reference.py) against this one."""
    from rope_dispatch.reference import reference_apply

    spec = spec_for(mode, "bshd", inverse=inverse)
    t = torch.randn(2, 3, 2, D)
    a, starts = angles(6), torch.tensor([1, 2])
    call = check_call(t, a, spec, starts)
    torch.testing.assert_close(reference_apply(call, t), reference_for(t, a, spec, starts),
                               rtol=0, atol=1e-12)


def test_spec_errors_name_the_argument_and_value():
    with pytest.raises(rd.RoPEError, match=r"rotary_offset must be >= 0 .* got -2"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_offset=-2)
    with pytest.raises(rd.RoPEError, match="rotary_offset: expected an integer, got 1.5"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_offset=1.5)
    with pytest.raises(rd.RoPEError, match="deinterleave=True .* interleaved=False"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", deinterleave=True, interleaved=True)
    with pytest.raises(rd.RoPEError, match="deinterleave: expected True or False"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", deinterleave=1)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_offset=8)
    t = torch.randn(3, 2, 2, D)
    with pytest.raises(rd.RoPEError, match=r"rotary_offset=8 plus the rotary dim d2=8 .* is 16, "
                                           r"past the head dim d=14 .* rotary_offset <= 6"):
        rd.apply(t, angles(3), spec)
    qkv = torch.randn(3, 2, 2, 3 * D)
    with pytest.raises(rd.RoPEError, match=r"d=14 .*the k part of split"):
        rd.apply_qkv(qkv, angles(3), spec, (D, D, D))
    odd = torch.randn(3, 7)  # an odd rotary dim is no table
    with pytest.raises(rd.RoPEError):
        rd.apply(t, odd, spec_for("deinterleave"))


def test_a_spec_copied_with_an_update_is_validated_and_keyed_anew(request):
    """pydantic's ``model_copy(update=...)`` skips validation and kept the original's static key:
    a copy given an offset ran on the decision made for the spec without one (Triton, which
    cannot place a norm stage's rotation at an offset: wrong numbers), and bad values reached
    the kernels (a negative offset crashed in torch, cp_size=0 rotated at wrong positions)."""
    request.getfixturevalue("triton_backend")
    plain = rd.RoPESpec(layout="sbhd", dtype="fp32")
    a = angles(3).to(DEVICE)
    t = torch.randn(3, 2, 2, D, device=DEVICE)
    weight = (torch.rand(D, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE)
    norm = rd.HeadNorm(weight, 1e-6)
    rd.apply(t, a, plain, norm=norm, backend="triton")  # decided (and kept) for the plain spec
    copied = plain.model_copy(update={"rotary_offset": 4})
    assert copied.static_key == rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_offset=4).static_key
    try:
        out = rd.apply(t, a, copied, norm=norm, backend="triton")
    except rd.BackendNotSupportedError as error:
        assert "rotary_offset=4" in str(error)
    else:
        normed = reference_head_norm(t, weight, 1e-6, 0.0, "head")
        assert_matches(out, reference_for(normed, a, copied), torch.float32)
    for update, words in (({"rotary_offset": -2}, "rotary_offset must be >= 0"),
                          ({"cp_size": 0}, "cp_size must be >= 1"),
                          ({"cos_sin_scale": float("nan")}, "cos_sin_scale"),
                          ({"colour": 1}, "colour")):
        with pytest.raises(rd.RoPEError, match=words):
            plain.model_copy(update=update)
    assert plain.model_copy() == plain and plain.model_copy(deep=True) == plain


def test_keys_and_repr_name_the_fields_only_when_set():
    plain = rd.RoPESpec(layout="sbhd", dtype="fp32")
    assert "rotary_offset" not in repr(plain) and "deinterleave" not in repr(plain)
    assert "rotary_offset" not in plain.static_fields()
    spec = spec_for("offset-deinterleave")
    assert spec.static_fields()["rotary_offset"] == 4 and spec.static_fields()["deinterleave"]
    assert spec != plain and spec.static_key != spec_for("offset").static_key
    t = torch.randn(3, 2, 2, D)
    text = str(rd.explain(t, angles(3), spec))
    assert "from channel 4" in text and "interleaved pairs in, halves out" in text


def test_backends_without_the_capability_say_why():
    class FirstChannels(rd.Backend):
        name = "first-channels"

        def apply(self, call):
            raise AssertionError("never chosen")

    t = torch.randn(3, 2, 2, D)
    reasons = FirstChannels().not_supported_reasons(check_call(t, angles(3), spec_for(
        "offset-deinterleave")))
    assert any("spec.rotary_offset=4" in r for r in reasons), reasons
    assert any("spec.deinterleave=True" in r for r in reasons), reasons


def test_te_serves_the_offset_on_a_view_and_says_why_not_otherwise():
    """TransformerEngine rotates a head's first d2 channels: the te backend hands it the view
    from the offset on and copies the channels before it (checked with a stand-in for TE's
    function that marks the channels it rotates); packed qkv with an offset, and deinterleave,
    are refused with the value named."""
    from rope_dispatch.backends.te import DEINTERLEAVE_REASON, TEBackend, TEInfo

    def marking(t, freqs, **kwargs):  # TE's function as far as channels go: first d2 doubled
        d2 = freqs.shape[-1]
        return torch.cat((t[..., :d2] * 2, t[..., d2:]), dim=-1)

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", marking, frozenset(
        ["t", "freqs", "tensor_format", "start_positions", "interleaved", "fused",
         "cu_seqlens", "cp_size", "cp_rank"])))
    t = torch.randn(3, 2, 2, D)
    out = backend.apply(check_call(t, angles(3), spec_for("offset")))
    offset = D - D2
    torch.testing.assert_close(out, torch.cat((t[..., :offset], 2 * t[..., offset:]), dim=-1))
    assert out.is_contiguous()
    reasons = backend.not_supported_reasons(check_call(t, angles(3), spec_for("deinterleave")))
    assert DEINTERLEAVE_REASON in reasons
    qkv = torch.randn(3, 2, 2, 3 * D)
    call = check_call(qkv, angles(3), spec_for("offset"), split=(D, D, D))
    assert any("spec.rotary_offset=6" in r and "qkv" in r for r in backend.extra_reasons(call))


def test_rope_to_cache_refuses_with_the_value():
    spec = rd.RoPESpec(layout="thd", dtype="fp32", rotary_offset=6)
    q, k, v = torch.randn(2, 2, D), torch.randn(2, 1, D), torch.randn(2, 1, D)
    cache = rd.FlatKVCache(torch.zeros(4, 1, D), torch.zeros(4, 1, D),
                           torch.tensor([0, 1]))
    with pytest.raises(rd.RoPEError, match="rope_to_cache does not take spec.rotary_offset=6"):
        rd.rope_to_cache(q, k, v, angles(3), spec, positions=torch.tensor([0, 1]), cache=cache)


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("table", ["angles", "cache", "bf16 cache", "pair cache"])
def test_mla_rope_part_at_model_size_on_each_table_kind(table):
    """MLA's rope part as a model runs it: 512 tokens of 128 query heads, the last 64 of 192
    channels (a view of the projection), beside one key head, bf16: forward, gradients into
    the projections and in place, on angles and on a cos/sin cache of each kind, against the
    float64 reference (the tile of narrow heads beside one head)."""
    tokens, heads, nope, rot = 512, 128, 128, 64
    gen = torch.Generator().manual_seed(7)
    a = (torch.rand(tokens, rot // 2, generator=gen) * 12 - 6).repeat(1, 2).float().to(DEVICE)
    cos, sin = a.double().cos(), a.double().sin()
    freqs = {"angles": a, "cache": rd.CosSinCache(cos.float(), sin.float()),
             "bf16 cache": rd.CosSinCache(cos.bfloat16(), sin.bfloat16()),
             "pair cache": rd.PairCosSinCache(  # vLLM's: each pair's cosine, then its sine
                 torch.cat([cos[:, :rot // 2], sin[:, :rot // 2]], -1).float())}[table]
    q_proj = torch.randn(tokens, 1, heads, nope + rot, generator=gen).bfloat16().to(DEVICE)
    k_proj = torch.randn(tokens, 1, 1, rot, generator=gen).bfloat16().to(DEVICE)
    q_proj.requires_grad_(True)
    k_proj.requires_grad_(True)
    q = q_proj[..., nope:]
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.bfloat16)
    q_out, k_out = rd.apply_qk(q, k_proj, freqs, spec, backend="triton")
    gq, gk = grad_like(q_out, 3), grad_like(k_out, 4)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    for name, x, out, g, grad in (("q", q, q_out, gq, q_proj.grad[..., nope:]),
                                  ("k", k_proj, k_out, gk, k_proj.grad)):
        ref_out, ref_grad = reference_forward_backward(x, a, spec, g)
        assert_matches(out, ref_out, torch.bfloat16, f"{name} forward on {table}")
        assert_matches(grad, ref_grad, torch.bfloat16, f"{name} gradient on {table}")
    assert torch.count_nonzero(q_proj.grad[..., :nope]) == 0
    with torch.no_grad():
        q2, k2 = q_proj.detach().clone(), k_proj.detach().clone()
        rd.apply_qk_(q2[..., nope:], k2, freqs, spec, backend="triton")
    assert torch.equal(q2[..., nope:], q_out.detach()) and torch.equal(k2, k_out.detach())
    assert torch.equal(q2[..., :nope], q_proj.detach()[..., :nope])
