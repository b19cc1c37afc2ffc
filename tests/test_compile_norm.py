"""The compile backend with a norm stage (HeadNorm) against a float64 reference written here.

The reference normalizes from the formula, ``x / sqrt(mean(x**2) + eps) * (offset + w)`` over
``head_dim`` (``scope="head"``) or a token's heads together (``"heads"``), then rotates with
tests/reference.py; float64 autograd through both gives the gradients of ``t`` and the weight.
Compiling on a 2-core CPU takes tens of seconds per spec, so two specs are compiled; the
backend's plumbing and math over more forms run with the compile step stubbed out (``_build``
returning the uncompiled math).
"""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from cases import build, fixed_case
from reference import assert_matches, reference_for
from rope_dispatch.backends import compiled
from rope_dispatch.backends.compiled import CompileBackend, compile_key

needs_compile = pytest.mark.skipif(
    not rd.get_backend("compile").available, reason="torch.compile cannot run here"
)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                   scope: str) -> torch.Tensor:
    """float64 RMSNorm of each head (``"head"``) or of a token's heads together (``"heads"``)."""
    x = x.double()
    group = x.flatten(-2) if scope == "heads" else x
    y = group / torch.sqrt(group.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())
    return y.reshape(x.shape)


def norm_case(scope: str, offset: float, seed: int = 0, weight_dtype=torch.float32, **changes):
    """``(t, table, spec, starts, angles, norm)``: a fixed case (partial rotary by default)
    with a random weight of the scope's length."""
    c = fixed_case(rotary_dim=8, seed=seed, **changes)
    t, table, spec, starts, angles = build(c)
    gen = torch.Generator().manual_seed(seed + 11)
    size = c.head_dim if scope == "head" else c.heads * c.head_dim
    weight = (torch.rand(size, generator=gen) + 0.5 - offset).to(weight_dtype).requires_grad_(True)
    return t, table, spec, starts, angles, rd.HeadNorm(weight, 1e-5, offset=offset, scope=scope)


def check(out, t, angles, spec, starts, norm, seed: int = 0) -> None:
    """The forward, and ``t``'s and the weight's gradients (those that require one), against
    the float64 reference."""
    w = norm.weight
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 5))
    x = t.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = reference_for(reference_norm(x, w64, norm.eps, norm.offset, norm.scope), angles, spec, starts)
    ref_grad_t, ref_grad_w = torch.autograd.grad(ref, (x, w64), grad_out.double())
    assert_matches(out, ref, t.dtype, "forward")
    leaves = [leaf for leaf in (t, w) if leaf.requires_grad]
    grads = torch.autograd.grad(out, leaves, grad_out)
    for leaf, grad in zip(leaves, grads):
        expected = ref_grad_t if leaf is t else ref_grad_w
        assert grad.dtype == leaf.dtype
        assert_matches(grad, expected, leaf.dtype, "t's gradient" if leaf is t else "weight's gradient")


@pytest.fixture
def uncompiled(monkeypatch):
    """A fresh backend whose "compiled" functions are the uncompiled math: its autograd
    function, arguments and the norm's explicit backward, without Inductor's minutes."""
    monkeypatch.setattr(compiled, "_build", compiled._math)
    return CompileBackend()


@pytest.mark.parametrize("scope", ["head", "heads"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_math_and_backward_uncompiled(uncompiled, scope, offset):
    layout = dict(layout="thd", interleaved=True, with_starts=True) if scope == "heads" else {}
    t, table, spec, starts, angles, norm = norm_case(scope, offset, seed=int(offset), **layout)
    out = uncompiled.apply(rd.check_call(t, table, spec, starts, q_norm=norm))
    check(out, t, angles, spec, starts, norm)
    assert uncompiled.is_compiled(rd.check_call(t, table, spec, starts, q_norm=norm))


@pytest.mark.parametrize("wants", ["weight", "t"])
def test_only_the_gradients_asked_for(uncompiled, wants):
    """A frozen input with a trained weight records the call too (and a frozen weight gets no
    gradient); the weight's gradient keeps its dtype."""
    t, table, spec, starts, angles, norm = norm_case("head", 1.0, weight_dtype=torch.bfloat16)
    (t if wants == "weight" else norm.weight).requires_grad_(False)
    out = uncompiled.apply(rd.check_call(t, table, spec, starts, q_norm=norm))
    assert out.requires_grad
    check(out, t, angles, spec, starts, norm)


@pytest.mark.parametrize("scope", ["head", "heads"])
def test_a_tensor_with_no_heads_gets_zero_gradients(uncompiled, scope):
    """No heads: a ``"heads"`` norm has no weights and its group no channels. The explicit
    backward once reshaped the weight's gradient to ``[-1, 0]``, which torch refuses for an
    empty tensor (eager's autograd gave empty gradients)."""
    t, table, spec, starts, angles, norm = norm_case(scope, 1.0, seed=4, heads=0)
    out = uncompiled.apply(rd.check_call(t, table, spec, starts, q_norm=norm))
    assert out.shape == t.shape
    check(out, t, angles, spec, starts, norm)


def test_double_backward_differentiates_the_norm_backward(uncompiled):
    """Under ``create_graph=True`` the backward runs with autograd on, so t's gradient can be
    differentiated again (for t and the weight)."""
    t, table, spec, starts, angles, norm = norm_case("heads", 0.0, seed=6)
    out = uncompiled.apply(rd.check_call(t, table, spec, starts, q_norm=norm))
    gen = torch.Generator().manual_seed(7)
    grad_out, probe = torch.randn(out.shape, generator=gen), torch.randn(out.shape, generator=gen)
    (grad_t,) = torch.autograd.grad(out, t, grad_out, create_graph=True)
    got = torch.autograd.grad(grad_t, (t, norm.weight), probe)
    x = t.detach().double().requires_grad_(True)
    w = norm.weight.detach().double().requires_grad_(True)
    ref = reference_for(reference_norm(x, w, norm.eps, 0.0, "heads"), angles, spec, starts)
    (ref_grad_t,) = torch.autograd.grad(ref, x, grad_out.double(), create_graph=True)
    expected = torch.autograd.grad(ref_grad_t, (x, w), probe.double())
    for what, a, e in zip(("t", "weight"), got, expected):
        assert_matches(a, e, torch.float32, f"double backward, {what}")


def test_key_holds_the_norm_form_and_weight():
    t, table, spec, starts, _, norm = norm_case("head", 0.0)
    key = compile_key(rd.check_call(t, table, spec, starts, q_norm=norm))
    assert compile_key(rd.check_call(t, table, spec, starts)).norm is None
    w = norm.weight.detach()
    for other in (
        rd.HeadNorm(w, 1e-6), rd.HeadNorm(w, 1e-5, offset=1.0), rd.HeadNorm(w.double(), 1e-5),
        rd.HeadNorm(w.repeat(3), 1e-5, scope="heads"),
    ):
        assert compile_key(rd.check_call(t, table, spec, starts, q_norm=other)) != key
    t2, table2, spec2, _, _, norm2 = norm_case("head", 0.0, seq=9, seed=4)
    # other values, other sizes: the same key
    assert compile_key(rd.check_call(t2, table2, spec2, q_norm=norm2)) == key


def test_explain_serves_norm_calls_and_names_what_it_refuses():
    t, table, spec, starts, _, norm = norm_case("head", 0.0)
    backend = rd.get_backend("compile")
    assert backend.not_supported_reasons(rd.check_call(t, table, spec, starts, q_norm=norm)) == []
    forced = rd.explain(t, table, spec, start_positions=starts, q_norm=norm, backend="compile")
    assert forced.chosen == "compile", str(forced)
    pair = rd.explain(t, table, spec, start_positions=starts, k=t.detach(), q_norm=norm,
                      k_norm=norm, backend="compile")
    assert pair.chosen is None
    assert pair.rejected["compile"] == [
        "q and k pairs (apply_qk) are not supported; supports single tensors (apply)"
    ]
    in_place = rd.explain(t.detach(), table, spec, start_positions=starts, q_norm=norm, in_place=True)
    assert any("in-place" in r for r in in_place.rejected["compile"])


@needs_compile
def test_compiled_head_norm_matches_reference_and_eager_and_does_not_recompile():
    """scope="head", offset 0, partial rotary; a new length and an inference call reuse it."""
    t, table, spec, starts, angles, norm = norm_case("head", 0.0, seed=2)
    with rd.use_backend("compile"):
        out = rd.apply(t, table, spec, norm=norm)
    eager = rd.apply(t, table, spec, norm=norm, backend="eager")
    torch.testing.assert_close(out, eager)  # float32 rounding: Inductor may reorder the mean
    check(out, t, angles, spec, starts, norm, seed=2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t2, table2, spec2, _, angles2, norm2 = norm_case("head", 0.0, seed=3, seq=9, batch=3)
    check(rd.apply(t2, table2, spec2, norm=norm2, backend="compile"), t2, angles2, spec2, None,
          norm2, seed=3)
    frozen = rd.HeadNorm(norm.weight.detach(), norm.eps)  # inference shares the forward graph
    rd.apply(t.detach(), table, spec, norm=frozen, backend="compile")
    with torch.no_grad():
        rd.apply(t, table, spec, norm=norm, backend="compile")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_compile
def test_compiled_heads_norm_with_offset_matches_reference():
    """scope="heads" (OLMo 2), offset 1 (Gemma), partial interleaved rotary, thd with starts."""
    t, table, spec, starts, angles, norm = norm_case(
        "heads", 1.0, seed=1, layout="thd", interleaved=True, with_starts=True
    )
    out = rd.apply(t, table, spec, start_positions=starts, norm=norm, backend="compile")
    eager = rd.apply(t, table, spec, start_positions=starts, norm=norm, backend="eager")
    torch.testing.assert_close(out, eager)
    check(out, t, angles, spec, starts, norm, seed=1)
