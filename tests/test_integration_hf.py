"""``rope_dispatch.integrations.hf``: transformers' ``apply_rotary_pos_emb`` against a float64
reference written from its formula and against transformers' own function, and ``patch`` on
tiny random Llama, Mistral, Qwen2, Qwen3 and Gemma models (same logits and gradients, and
``unpatch`` binds the original objects back)."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

import rope_dispatch as rd
from rope_dispatch.integrations import hf

TOKENS = 12
BATCH = 2
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM"),
    "Mistral": ("MistralConfig", "MistralForCausalLM"),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM"),
}


def modeling(family: str):
    """The modeling module whose global apply_rotary_pos_emb the family's attention calls."""
    return importlib.import_module(hf.SUPPORTED_MODELS[family][0])


@pytest.fixture(autouse=True)
def _restore_modeling_modules():
    """Every test leaves transformers' modules as it found them, whatever it patched."""
    saved = {f: modeling(f).apply_rotary_pos_emb for f in FAMILIES}
    yield
    for family, original in saved.items():
        modeling(family).apply_rotary_pos_emb = original
    hf._originals.clear()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim's two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin, unsqueeze_dim):
    """``x * cos + rotate_half(x) * sin`` in float64 on the first ``d2`` channels (``d2`` =
    cos's last dim), the rest copied; differentiable."""
    cos = cos.double().unsqueeze(unsqueeze_dim)
    sin = sin.double().unsqueeze(unsqueeze_dim)
    d2 = cos.shape[-1]

    def one(x):
        x = x.double()
        rotated = x[..., :d2] * cos + rotate_half(x[..., :d2]) * sin
        return torch.cat((rotated, x[..., d2:]), dim=-1)

    return one(q), one(k)


def inputs(dtype, unsqueeze_dim, heads=4, kv_heads=2, head_dim=16, rotary_dim=None, batch_cos=BATCH, seed=0,
           device="cpu"):
    """q and k as a model makes them: views of one projection output (non-contiguous), in
    ``[b, heads, s, d]`` for ``unsqueeze_dim=1`` and ``[b, s, heads, d]`` for 2; per-token cos
    and sin ``[batch_cos, s, d2]`` of random angles (the two halves equal), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = rotary_dim or head_dim
    width = (heads + 2 * kv_heads) * head_dim
    projected = torch.randn(BATCH, TOKENS, width, generator=gen).to(dtype).to(device)
    q = projected[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = projected[..., heads * head_dim : (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.rand(batch_cos, TOKENS, rotary_dim // 2, generator=gen, dtype=torch.float64) * 40
    angles = torch.cat((angles, angles), dim=-1)
    return (
        q.detach().requires_grad_(), k.detach().requires_grad_(),
        angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device),
    )


def tolerance(dtype):
    """Our result is float32 math rounded once to ``dtype``."""
    return dict(rtol=2**-8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_matches_the_formula_and_transformers(dtype, unsqueeze_dim, batch_cos):
    q, k, cos, sin = inputs(dtype, unsqueeze_dim, batch_cos=batch_cos)
    assert not q.is_contiguous() and q.shape[1 if unsqueeze_dim == 1 else 2] == 4
    out_q, out_k = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    ref_q, ref_k = reference(q, k, cos, sin, unsqueeze_dim)
    hf_q, hf_k = modeling("Llama").apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    for out, ref, theirs in ((out_q, ref_q, hf_q), (out_k, ref_k, hf_k)):
        assert out.shape == theirs.shape and out.dtype == theirs.dtype
        torch.testing.assert_close(out.double(), ref.detach(), **tolerance(dtype))
        if dtype == torch.float32:
            torch.testing.assert_close(out, theirs, rtol=1e-6, atol=1e-6)
        else:  # theirs rounds three times; ours once, so it is never further from the reference
            torch.testing.assert_close(out, theirs, rtol=2**-7, atol=2**-5)
            assert (out.double() - ref).abs().max() <= (theirs.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_gradients_flow_to_q_and_k_as_in_transformers(dtype, unsqueeze_dim):
    q, k, cos, sin = inputs(dtype, unsqueeze_dim, seed=1)
    gen = torch.Generator().manual_seed(2)
    grad_q, grad_k = (torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k))

    def grads(fn):
        q.grad = k.grad = None
        out_q, out_k = fn(q, k, cos, sin, unsqueeze_dim)
        torch.autograd.backward((out_q, out_k), (grad_q.to(out_q.dtype), grad_k.to(out_k.dtype)))
        return q.grad.clone(), k.grad.clone()

    ours = grads(hf.apply_rotary_pos_emb)
    exact = grads(reference)
    theirs = grads(modeling("Llama").apply_rotary_pos_emb)
    for g, ref, their in zip(ours, exact, theirs):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), ref.double(), **tolerance(dtype))
        if dtype == torch.float32:
            torch.testing.assert_close(g, their, rtol=1e-6, atol=1e-6)


def test_partial_rotary_passes_the_rest_through():
    """cos narrower than the head dim: the first d2 channels rotate, the rest are copied
    (transformers' own function would fail to broadcast)."""
    q, k, cos, sin = inputs(torch.float32, 1, head_dim=16, rotary_dim=8, seed=3)
    out_q, out_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    ref_q, ref_k = reference(q, k, cos, sin, 1)
    torch.testing.assert_close(out_q.double(), ref_q.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k.double(), ref_k.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(out_q[..., 8:], q[..., 8:])


def test_other_unsqueeze_dims_are_refused():
    q, k, cos, sin = inputs(torch.float32, 1)
    with pytest.raises(rd.RoPEError, match="unsqueeze_dim must be 1"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)


def test_token_index_cache_stays_small():
    q, k, cos, sin = inputs(torch.float32, 2)
    hf._token_rows.clear()
    for _ in range(3):
        hf.apply_rotary_pos_emb(q, k, cos, sin, 2)
    assert len(hf._token_rows) == 1
    for tokens in range(1, hf._MAX_TOKEN_ROWS + 10):
        hf._token_positions(cos[:, :tokens], q[:, :tokens])
    assert len(hf._token_rows) <= hf._MAX_TOKEN_ROWS


def tiny_model(family: str, attention: str = "sdpa") -> torch.nn.Module:
    """A two-layer model of ``family`` with random weights (no download), float32."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().train()


def step(model, ids, position_ids):
    """Logits and every parameter's gradient of one language-model loss."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "family, attention", [(f, "sdpa") for f in FAMILIES] + [("Llama", "eager")]
)
def test_patched_model_gives_the_same_logits_and_gradients(family, attention, monkeypatch):
    model = tiny_model(family, attention)
    module = modeling(family)
    original = module.apply_rotary_pos_emb
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    # per-row offsets: cos and sin differ per sequence, so each token reads its own row
    position_ids = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
    expected = [step(model, ids, p) for p in (None, position_ids)]

    calls = []
    apply_qk = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(1) or apply_qk(*a, **kw))
    assert hf.patch(model) is model
    hf.patch(model)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    for p, (logits, grads) in zip((None, position_ids), expected):
        got_logits, got_grads = step(model, ids, p)
        torch.testing.assert_close(got_logits, logits)
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, msg=name)
    assert len(calls) == 2 * model.config.num_hidden_layers

    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


def test_patched_generation_is_unchanged():
    """Greedy decoding with a KV cache and a left-padded batch (per-row positions at every
    step): the same tokens and step logits patched and unpatched."""
    model = tiny_model("Qwen3").eval()
    ids = torch.randint(1, 128, (BATCH, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    settings = dict(
        attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )

    def generate():
        with torch.no_grad():
            return model.generate(ids, **settings)

    expected = generate()
    hf.patch(model)
    got = generate()
    hf.unpatch(model)
    assert torch.equal(got.sequences, expected.sequences)
    for step_logits, expected_logits in zip(got.logits, expected.logits):
        torch.testing.assert_close(step_logits, expected_logits)


def test_unpatch_leaves_a_later_patch_alone():
    model = tiny_model("Llama")
    module = modeling("Llama")

    def later(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    hf.patch(model)
    module.apply_rotary_pos_emb = later
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is later


def test_unsupported_model_is_refused_by_name():
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0,
    )
    phi3 = transformers.Phi3ForCausalLM(config)
    for model in (phi3, torch.nn.Linear(2, 2)):
        with pytest.raises(rd.RoPEError) as err:
            hf.patch(model)
        message = str(err.value)
        assert type(model).__name__ in message
        assert all(family in message for family in FAMILIES)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_triton_backend_serves_the_call(triton_backend, unsqueeze_dim, batch_cos):
    """The GPU path (Triton's interpreter without CUDA): q and k of a model's shapes, per-token
    cos and sin, forward and gradients against the float64 reference, within one bf16 ulp (the
    interpreter rounds float32 to bf16 toward zero)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin = inputs(torch.bfloat16, unsqueeze_dim, batch_cos=batch_cos, seed=6, device=device)
    grad_q = torch.randn(q.shape).bfloat16().to(device)
    grad_k = torch.randn(k.shape).bfloat16().to(device)
    with rd.use_backend("triton"):
        out = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        torch.autograd.backward(out, (grad_q, grad_k))
    ours = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    ref = reference(q, k, cos, sin, unsqueeze_dim)
    torch.autograd.backward(ref, (grad_q.double(), grad_k.double()))
    for got, exact in zip((*out, *ours), (*ref, q.grad, k.grad)):
        torch.testing.assert_close(got.double(), exact.detach().double(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_layers_sharing_cos_and_sin_reuse_one_plan(monkeypatch, batch_cos):
    """A model hands the same cos and sin to every layer: after the first layer's call the
    others skip the checks, and values rewritten in place are still read."""
    from rope_dispatch import call as call_module
    from rope_dispatch import dispatch

    monkeypatch.setattr(call_module, "_reads", lambda index: False)  # the token index, as on a GPU
    checks = []
    real = dispatch.check_call
    monkeypatch.setattr(dispatch, "check_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    q, k, cos, sin = inputs(torch.float32, 1, seed=11, batch_cos=batch_cos)
    with torch.no_grad():
        for layer in range(3):
            got = hf.apply_rotary_pos_emb(q, k, cos, sin)
            for out, want in zip(got, reference(q, k, cos, sin, 1)):
                torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
        assert len(checks) == 1
        cos.mul_(-1)  # same tensor, new values
        got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for out, want in zip(got, reference(q, k, cos, sin, 1)):
        torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
