"""``integrations.hf.patch`` on Llama 4 (interleaved complex rotation, layers without RoPE, the
L2 QK norm after RoPE fused into the call) and on Qwen3-VL and Qwen3-VL-MoE (interleaved
M-RoPE sections, QK norm fused): tiny random models from configs give the same logits and
every parameter gradient patched and unpatched, and ``unpatch`` restores every module."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import transformers

import rope_dispatch as rd
from hf_steps import (
    MODEL_DEVICE, SAME, check_same, lm_step, random_norm_weights, replicate,
)
from rope_dispatch.integrations import hf, hf_llama4

TOKENS = 12
BATCH = 2
"""As tests/test_hf_qk_norm.py: float32 models, our float32 norm and rotation."""
EPS = 0.25
"""A large epsilon: an L2 norm left out, run twice or given another epsilon moves the logits."""
IDS = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
TOKEN_POSITIONS = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])


def modeling(family: str):
    return importlib.import_module(hf.SUPPORTED_MODELS[family][0])


pytestmark = pytest.mark.usefixtures("hf_modules_restored")


def llama4(**overrides) -> torch.nn.Module:
    """Two layers: the first with RoPE (and the L2 QK norm), the second without (``no_rope_layers``
    0); MoE on the second layer; random weights, float32."""
    config = transformers.Llama4TextConfig(**{**dict(
        hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
        num_local_experts=2, no_rope_layers=[1, 0], use_qk_norm=True, rms_norm_eps=EPS,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.1, attn_implementation="sdpa",
    ), **overrides})
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).float().train().to(MODEL_DEVICE)


def step(model, position_ids=TOKEN_POSITIONS):
    return lm_step(model, IDS, position_ids)


def spy(monkeypatch, module) -> list[dict]:
    calls = []
    real = module.apply_qk
    monkeypatch.setattr(module, "apply_qk", lambda *a, **kw: calls.append(dict(kw, args=a))
                        or real(*a, **kw))
    return calls


def own_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_llama4_norm_epsilon_set_after_the_patch_is_the_one_used():
    """The fused L2 norm reads qk_norm's eps at each call, as the other families' fused norms
    read theirs: an eps set after patch (it was kept from patch time) gives the unpatched
    model's results with that eps."""
    model = llama4()
    norm = next(m for m in model.modules() if type(m).__name__ == "Llama4TextL2Norm")
    expected = step(model)
    norm.eps = 1e-6
    hf.patch(model)
    norm.eps = EPS
    check_same(step(model), expected)
    hf.unpatch(model)


@pytest.mark.parametrize("use_qk_norm", [True, False])
def test_llama4_gives_the_same_logits_and_gradients(use_qk_norm, monkeypatch):
    model = llama4(use_qk_norm=use_qk_norm)
    rope, no_rope = (m for m in model.modules() if type(m).__name__ == "Llama4TextAttention")
    assert rope.use_rope and not no_rope.use_rope and not hasattr(no_rope, "qk_norm")
    module = modeling("Llama4")
    original = module.apply_rotary_emb
    expected = step(model)
    assert expected[1].keys() == {n for n, _ in model.named_parameters()}

    calls = spy(monkeypatch, hf_llama4)
    assert hf.patch(model) is model
    hf.patch(model)  # again: no change
    assert module.apply_rotary_emb is hf_llama4.apply_rotary_emb
    fused = ["model.layers.0.self_attn", "model.layers.0.self_attn.qk_norm"]
    assert own_forwards(model) == (fused if use_qk_norm else [])
    check_same(step(model), expected)
    assert len(calls) == 1  # the layer without RoPE is left alone
    (call,) = calls
    assert call["args"][3].interleaved and isinstance(call["args"][2], rd.PairCosSinCache)
    if use_qk_norm:
        norm = call["q_norm"]
        assert norm is call["k_norm"] and (norm.eps, norm.offset, norm.scope) == (EPS, 0.0, "head")
        assert torch.equal(norm.weight, torch.ones(16, device=MODEL_DEVICE))
    else:
        assert call["q_norm"] is call["k_norm"] is None

    hf.unpatch(model)
    assert module.apply_rotary_emb is original and own_forwards(model) == []
    check_same(step(model), expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Calling .zero_grad.. from a module created with")
def test_llama4_data_parallel_replica_runs_its_own_weights_fused(monkeypatch):
    """An ``nn.DataParallel`` replica of a fused attention runs the replica's weights, its norm
    still fused (tests/test_hf_qk_norm.py has the other families')."""
    model = llama4()
    expected = step(replicate(model))
    calls = spy(monkeypatch, hf_llama4)
    hf.patch(model)
    check_same(step(replicate(model)), expected)
    assert not [name for name, p in model.named_parameters() if p.grad is not None]
    assert [call["q_norm"] is not None for call in calls] == [True]


def test_llama4_fused_norm_is_the_one_the_model_would_apply(monkeypatch):
    """The comparison above is sensitive: a fused call with another epsilon fails it."""
    model = llama4()
    expected = step(model)
    hf.patch(model)
    real = hf_llama4.apply_qk

    def wrong(*args, q_norm=None, k_norm=None, **kwargs):
        norm = rd.HeadNorm(q_norm.weight, 1e-6)
        return real(*args, q_norm=norm, k_norm=norm, **kwargs)

    monkeypatch.setattr(hf_llama4, "apply_qk", wrong)
    logits, _ = step(model)
    assert (logits - expected[0]).abs().max() > 1e-3


def test_llama4_with_an_attention_factor_keeps_its_norm_unfused(monkeypatch):
    """YaRN scales ``freqs_cis`` by its attention factor; the norm after the rotation removes
    that scale, one before it would not: the norm stays transformers' and only RoPE moves."""
    model = llama4(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                        original_max_position_embeddings=16))
    assert model.model.rotary_emb.attention_scaling != 1.0
    expected = step(model)
    calls = spy(monkeypatch, hf_llama4)
    hf.patch(model)
    assert own_forwards(model) == []
    check_same(step(model), expected)
    assert [call["q_norm"] for call in calls] == [None]


def test_llama4_generation_is_unchanged():
    """Greedy decoding with a KV cache: the same tokens and step logits patched and unpatched."""
    model = llama4().eval()
    ids = IDS[:, :6].to(MODEL_DEVICE)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        hf.patch(model)
        got = model.generate(ids, **settings)
    hf.unpatch(model)
    assert torch.equal(got.sequences, expected.sequences)
    for step_logits, expected_logits in zip(got.logits, expected.logits):
        torch.testing.assert_close(step_logits, expected_logits, **SAME)


def test_llama4_output_that_skips_qk_norm_is_refused():
    """An attention forward that takes the normalized RoPE outputs past ``qk_norm``: raised,
    not silently normalized where transformers would not."""
    model = llama4()
    hf.patch(model)
    attention = next(m for m in model.modules() if type(m).__name__ == "Llama4TextAttention")
    attention.qk_norm.forward = lambda x: x.clone()
    with pytest.raises(rd.RoPEError, match="qk_norm did not receive them"):
        step(model)


def test_llama4_pre_hook_that_edits_qk_norms_input_in_place_is_refused():
    """A forward pre-hook writing ``qk_norm``'s input in place (steering, say): transformers
    normalizes the edited tensor, but the fused call normalized before the edit, so the call
    raises instead of returning another result."""
    model = llama4()
    attention = next(m for m in model.modules() if type(m).__name__ == "Llama4TextAttention")
    attention.qk_norm.register_forward_pre_hook(lambda m, args: args[0].add_(0.5))
    expected = step(model)
    hf.patch(model)
    with pytest.raises(rd.RoPEError, match="qk_norm's input was written in place"):
        step(model)
    hf.unpatch(model)
    check_same(step(model), expected)


def test_llama4_pre_hook_that_returns_an_edited_copy_is_refused():
    """The in-place refusal's message says to unpatch, not to return a copy: a pre-hook
    handing ``qk_norm`` a new tensor leaves the call's outputs unreceived, also refused."""
    model = llama4()
    hf.patch(model)
    attention = next(m for m in model.modules() if type(m).__name__ == "Llama4TextAttention")
    attention.qk_norm.register_forward_pre_hook(lambda m, args: (args[0] + 0.5,))
    with pytest.raises(rd.RoPEError, match="qk_norm did not receive them"):
        step(model)


def test_llama4_complex_table_is_required():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(rd.RoPEError, match="freqs_cis must be the complex"):
        hf_llama4.apply_rotary_emb(q, q, torch.ones(1, 4, 8))


@pytest.mark.parametrize("case", ["short", "batch", "flat", "xq", "xk"])
def test_llama4_shapes_are_refused_naming_its_own_arguments(case):
    """A ``freqs_cis`` of another sequence length, batch or rank, and an ``xq`` or ``xk``
    without its batch dim: errors naming ``freqs_cis``, ``xq`` and ``xk`` (the call has no
    ``cos``), with the shapes expected and got."""
    xq, xk = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    freqs_cis = torch.polar(torch.ones(2, 5, 8), torch.rand(2, 5, 8))
    table = {"short": freqs_cis[:, :3], "batch": torch.cat((freqs_cis, freqs_cis)),
             "flat": freqs_cis[0]}.get(case, freqs_cis)
    if case in ("xq", "xk"):
        xq, xk = (xq[0], xk) if case == "xq" else (xq, xk[0])
        expected = (rf"xq and xk must be 4-D, \[b, s, heads, d\]; got xq "
                    rf"{re.escape(str(tuple(xq.shape)))}, xk {re.escape(str(tuple(xk.shape)))}")
    else:
        expected = (r"freqs_cis must be \[batch, seq, rotary_dim / 2\] with batch 1 or q's batch 2 "
                    rf"and q's sequence length 5, got {re.escape(str(tuple(table.shape)))}")
    with pytest.raises(rd.RoPEError, match=expected):
        hf_llama4.apply_rotary_emb(xq, xk, table)


def test_the_kept_llama4_pair_table_is_never_another_calls():
    """A call interrupted between any two of its instructions by another call (a thread switch;
    any instruction on a free-threaded Python) gets the table of its own ``freqs_cis``: the
    kept table, its tensor and its key were read one by one."""
    from interleave import hammered, interrupted_at_every_instruction

    rows = [torch.polar(torch.ones(1, 3, 2), torch.full((1, 3, 2), 0.5 + i)) for i in range(3)]

    def holds(table: rd.PairCosSinCache, freqs_cis: torch.Tensor) -> bool:
        want = torch.cat((freqs_cis.real, freqs_cis.imag), -1).float().reshape(-1, 4)
        return torch.equal(table.table, want)

    ours, other = rows[0], rows[1]
    try:
        for before, between in ((other, ours), (ours, other), (None, ours)):
            def prepare(before=before):
                hf._forget()
                if before is not None:
                    hf_llama4._pair_table(before)

            results = interrupted_at_every_instruction(
                hf_llama4._pair_table.__code__, prepare, lambda: hf_llama4._pair_table(ours),
                lambda between=between: hf_llama4._pair_table(between))
            assert len(results) > 10
            for k, table in results:
                assert holds(table, ours), f"another call's table (interrupted at {k})"

        def work(i: int) -> None:
            for n in range(2000):
                freqs_cis = rows[(n // (i + 1)) % 3]
                assert holds(hf_llama4._pair_table(freqs_cis), freqs_cis), f"thread {i}, {n}"

        hammered(work)
    finally:
        hf._forget()


def test_llama4_dtype_rope_dispatch_does_not_compute_in_is_refused_by_name():
    """As the other families' call (docs/hf.md): a float64 model's call says to unpatch it."""
    q = torch.randn(1, 4, 2, 16, dtype=torch.float64)
    freqs_cis = torch.polar(torch.ones(1, 4, 8), torch.rand(1, 4, 8))
    with pytest.raises(rd.RoPEError, match="xq is torch.float64: .* hf.unpatch the model"):
        hf_llama4.apply_rotary_emb(q, q, freqs_cis)


def qwen3_vl(family: str, sections=(3, 3, 2)) -> torch.nn.Module:
    """A Qwen3-VL (or Qwen3-VL-MoE) model with a two-layer language model (head dim 16, so the
    interleaved ``mrope_section`` covers 8 pairs) and a one-block vision tower, random
    weights and QK-norm weights, float32."""
    config_name, model_name = {
        "Qwen3-VL": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
        "Qwen3-VL-MoE": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
    }[family]
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
        rms_norm_eps=EPS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        initializer_range=0.1, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=list(sections),
            mrope_interleaved=True,
        ),
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[0])
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision,
                                                attn_implementation="sdpa")
    torch.manual_seed(0)
    return random_norm_weights(getattr(transformers, model_name)(config).float().train())


@pytest.mark.parametrize("family", ["Qwen3-VL", "Qwen3-VL-MoE"])
def test_qwen3_vl_gives_the_same_logits_and_gradients(family, monkeypatch):
    """``position_ids`` ``[3, b, s]`` with three different streams (so the interleaved sections
    matter): same logits and gradients, q_norm and k_norm in the RoPE call."""
    model = qwen3_vl(family)
    module = modeling(family)
    original = module.apply_rotary_pos_emb
    streams = torch.stack((TOKEN_POSITIONS, TOKEN_POSITIONS // 3 + 1, TOKEN_POSITIONS % 4))
    expected = step(model, streams)
    same_streams, _ = step(model, streams[:1].expand(3, -1, -1))
    assert not torch.allclose(expected[0], same_streams)

    calls = spy(monkeypatch, hf)
    hf.patch(model)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    check_same(step(model, streams), expected)
    assert len(calls) == 2
    assert all(isinstance(call["q_norm"], rd.HeadNorm) for call in calls)

    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original and own_forwards(model) == []
    check_same(step(model, streams), expected, rtol=0, atol=0)


def llama4_reference(q, k, freqs_cis, eps=None):
    """float64: each pair ``(2i, 2i + 1)`` times ``freqs_cis[..., i]`` as a complex number, then
    (with ``eps``) each head divided by the root of its mean square plus ``eps``."""
    def one(x):
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(pairs * freqs_cis.cdouble()[:, :, None, :]).flatten(-2)
        if eps is not None:
            out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + eps)
        return out

    return one(q), one(k)


@pytest.mark.parametrize("fused", [False, True])
def test_triton_backend_serves_the_llama4_call(triton_backend, fused):
    """The GPU path (Triton's interpreter without CUDA): bf16 q and k, per-token complex
    freqs_cis, with and without the L2 norm, forward and gradients against float64, within one
    bf16 ulp."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(BATCH, TOKENS, 4, 16, generator=gen).bfloat16().to(device).requires_grad_()
    k = torch.randn(BATCH, TOKENS, 2, 16, generator=gen).bfloat16().to(device).requires_grad_()
    angles = torch.rand(BATCH, TOKENS, 8, generator=gen, dtype=torch.float64) * 40
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)
    grads = [torch.randn(t.shape, generator=gen).bfloat16().to(device) for t in (q, k)]
    window = hf_llama4._window
    with rd.use_backend("triton"):
        window.attention, window.eps = (torch.nn.Module(), EPS) if fused else (None, None)
        try:
            out = hf_llama4.apply_rotary_emb(q, k, freqs_cis)
        finally:
            window.attention, window.eps, window.normalized = None, None, []
        torch.autograd.backward(out, grads)
    ours = (*out, q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    ref = llama4_reference(q, k, freqs_cis, EPS if fused else None)
    torch.autograd.backward(ref, [g.double() for g in grads])
    for got, exact in zip(ours, (*ref, q.grad, k.grad)):
        torch.testing.assert_close(got.double(), exact.detach().double(), rtol=2**-7, atol=1e-4)


def test_llama4_freqs_cis_gradient_survives_reentrant_checkpointing():
    """``freqs_cis`` made from angles that require grad, the call under
    ``checkpoint(use_reentrant=True)`` (its forward without grad, its recomputation with grad,
    on the same ``freqs_cis``): the angles' gradient equals the float64 reference's."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(BATCH, TOKENS, 4, 16, generator=gen)
    k = torch.randn(BATCH, TOKENS, 2, 16, generator=gen)
    base = torch.rand(BATCH, TOKENS, 8, generator=gen, dtype=torch.float64) * 4

    def angle_grad(dtype, call):
        angles = base.to(dtype).requires_grad_(True)
        out = call(q.to(dtype).requires_grad_(True), torch.polar(torch.ones_like(angles), angles))
        sum(o.square().sum() for o in out).backward()
        return angles.grad

    got = angle_grad(torch.float32, lambda x, freqs_cis: checkpoint(
        lambda x: hf_llama4.apply_rotary_emb(x, k, freqs_cis), x, use_reentrant=True))
    want = angle_grad(torch.float64, lambda x, freqs_cis: llama4_reference(x, k, freqs_cis))
    assert got is not None
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_llama4_module_imports_first():
    """``hf_llama4`` reads ``hf``'s helpers and ``hf`` loads ``hf_llama4``: either may be imported
    first, and ``hf`` then rebinds Llama 4's name to the one function."""
    import subprocess
    import sys

    code = ("from rope_dispatch.integrations import hf_llama4; from rope_dispatch.integrations "
            "import hf; assert hf._REPLACEMENTS['apply_rotary_emb'] is hf_llama4.apply_rotary_emb")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
