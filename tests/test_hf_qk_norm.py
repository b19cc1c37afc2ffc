"""``rope_dispatch.integrations.hf.patch`` on the QK-norm families (Qwen3, Qwen3-MoE, Gemma3,
OLMo2, GLM-4-MoE): q_norm, k_norm and RoPE reach rope-dispatch as one ``apply_qk`` call with
each family's weight, epsilon, offset and scope; tiny random models give the same logits and
parameter gradients patched and unpatched, and ``unpatch`` gives every module its forward back.

The norms' weights are random and their epsilon large (0.25), so a norm left out, run twice, or
given the wrong offset, scope or epsilon changes the logits well past the tolerance (the last
tests check that such a patch would be caught)."""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import rope_dispatch as rd
from hf_steps import MODEL_DEVICE, check_same, lm_step, random_norm_weights, replicate
from rope_dispatch.integrations import hf

TOKENS = 12
BATCH = 2
EPS = 0.25
"""Patched against unpatched in float32: our norm and rotation are float32 throughout, as
transformers' are in a float32 model; on CUDA the kernels' fused multiply-adds round apart."""
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rms_norm_eps=EPS,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)
"""Weights 5x transformers' default spread: attention then moves the logits (O(1)), so what a
norm does shows in them."""
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, **MOE)),
    "Gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    ),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "GLM-4-MoE": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM",
        dict(use_qk_norm=True, n_routed_experts=4, first_k_dense_replace=1, num_mtp_layers=0,
             **MOE),
    ),
}
"""Family -> (config class, model class, its tiny config's own settings): head dim 16 in all."""
NORMS = {
    "Qwen3": (0.0, "head", 16, 16, "variance_epsilon"),
    "Qwen3-MoE": (0.0, "head", 16, 16, "variance_epsilon"),
    "Gemma3": (1.0, "head", 16, 16, "eps"),
    "OLMo2": (0.0, "heads", 4 * 16, 2 * 16, "variance_epsilon"),
    "GLM-4-MoE": (0.0, "head", 16, 16, "variance_epsilon"),
}
"""What each family's fused call must carry, written from its modeling file: offset (Gemma3's
``x * (1 + w)``), scope (OLMo2 normalizes q and k over all their heads, before the head
split), q's and k's weight sizes, and the norm's attribute holding its epsilon."""
Q_EPS = 0.125
"""Set on every q_norm: the call must read each module's own epsilon (k_norm keeps EPS)."""


def modeling(family: str):
    return importlib.import_module(hf.SUPPORTED_MODELS[family][0])


@pytest.fixture(autouse=True)
def _restore_modeling_modules():
    """Every test leaves transformers' modules as it found them, whatever it patched."""
    saved = {family: modeling(family).apply_rotary_pos_emb for family in FAMILIES}
    yield
    for family, original in saved.items():
        modeling(family).apply_rotary_pos_emb = original
    hf._originals.clear()
    hf._holders.clear()


def tiny_model(family: str, **overrides) -> torch.nn.Module:
    """A two-layer float32 model of ``family`` with random weights (no download); the q_norm and
    k_norm weights random too, so that each weight, the offset and the scope count."""
    config_name, model_name, own = FAMILIES[family]
    config = getattr(transformers, config_name)(
        **{**COMMON, **own, **overrides}, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return random_norm_weights(getattr(transformers, model_name)(config).float().train())


def attentions(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "q_proj")]


IDS = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
POSITIONS = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
"""Per-row offsets: each sequence reads its own cos and sin rows."""


def step(model):
    return lm_step(model, IDS, POSITIONS)


def spy(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``apply_qk`` call the patched models make."""
    calls = []
    real = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(dict(kw, table=a[2]))
                        or real(*a, **kw))
    return calls


def own_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_norms_and_rope_run_as_one_call_with_the_same_results(family, monkeypatch):
    model = tiny_model(family)
    offset, scope, q_size, k_size, eps_name = NORMS[family]
    for attention in attentions(model):
        assert getattr(attention.q_norm, eps_name) == EPS
        setattr(attention.q_norm, eps_name, Q_EPS)
    module = modeling(family)
    original = module.apply_rotary_pos_emb
    expected = step(model)
    norm_grads = [n for n in expected[1] if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norm_grads) == 2 * model.config.num_hidden_layers
    assert expected[1].keys() == {n for n, _ in model.named_parameters()}

    calls = spy(monkeypatch)
    assert hf.patch(model) is model
    hf.patch(model)  # again: no change
    check_same(step(model), expected)

    assert len(calls) == model.config.num_hidden_layers
    for call, attention in zip(calls, attentions(model)):
        for norm, module_norm, size, eps in ((call["q_norm"], attention.q_norm, q_size, Q_EPS),
                                             (call["k_norm"], attention.k_norm, k_size, EPS)):
            assert isinstance(norm, rd.HeadNorm)
            assert norm.weight is module_norm.weight and norm.weight.numel() == size
            assert (norm.offset, norm.scope, norm.eps) == (offset, scope, eps)

    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    assert own_forwards(model) == []
    check_same(step(model), expected, rtol=0, atol=0)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


def test_gemma3_sliding_and_full_layers_each_rotate_by_their_own_table(monkeypatch):
    """Gemma3 alternates local (sliding window, base 10,000) and global (base 1,000,000) layers:
    both are fused, each with its layer type's cos and sin."""
    model = tiny_model("Gemma3")
    assert [a.is_sliding for a in attentions(model)] == [True, False]
    expected = step(model)
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    sliding, full = (call["table"] for call in calls)
    assert not torch.allclose(sliding.cos, full.cos)
    assert all(call["q_norm"].offset == 1.0 for call in calls)


def test_glm_with_partial_rotary_normalizes_the_whole_head_and_rotates_half(monkeypatch):
    """GLM-4-MoE rotates half of each head (``partial_rotary_factor`` 0.5); its norms cover
    all 16 channels."""
    model = tiny_model("GLM-4-MoE")
    expected = step(model)
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    assert [call["table"].rotary_dim for call in calls] == [8, 8]
    assert all(call["q_norm"].weight.numel() == 16 for call in calls)


def test_glm_with_no_rotary_channel_still_normalizes():
    """GLM-4-MoE with ``partial_rotary_factor`` 0 (no channel rotated, as transformers allows):
    the fused norms still apply, the whole head passed through."""
    model = tiny_model("GLM-4-MoE", rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.0))
    expected = step(model)
    hf.patch(model)
    check_same(step(model), expected)


def test_glm_without_qk_norm_keeps_its_plain_rope_call(monkeypatch):
    model = tiny_model("GLM-4-MoE", use_qk_norm=False)
    expected = step(model)
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    assert [(call["q_norm"], call["k_norm"]) for call in calls] == [(None, None)] * 2
    assert own_forwards(model) == []


def test_a_fused_model_runs_unfused_once_the_family_name_is_not_ours(monkeypatch):
    """Once the family's RoPE name is no longer ours (another library bound transformers'
    function back, say), a model still fused runs its norms itself, with the same results."""
    first, second = tiny_model("Qwen3"), tiny_model("Qwen3")
    module = modeling("Qwen3")
    original = module.apply_rotary_pos_emb
    expected = step(second)
    hf.patch(first)
    hf.patch(second)
    hf.unpatch(first)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb  # second holds it
    module.apply_rotary_pos_emb = original
    calls = spy(monkeypatch)
    assert own_forwards(first) == [] and own_forwards(second)
    check_same(step(second), expected)
    assert calls == []


def test_a_norm_called_outside_its_attention_runs_as_before():
    model = tiny_model("Qwen3")
    norm = attentions(model)[0].q_norm
    x = torch.randn(BATCH, TOKENS, 4, 16, device=MODEL_DEVICE)
    want = norm(x)
    hf.patch(model)
    assert "forward" in vars(norm)
    assert torch.equal(norm(x), want)


def test_an_earlier_instance_forward_is_kept_and_given_back(monkeypatch):
    """An attention that already has an instance forward (an offload hook, say) is fused around
    it, and ``unpatch`` gives back that very object; a norm with one is left unfused."""
    model = tiny_model("Qwen3")
    first, second = attentions(model)
    hooked = []

    def hook(*args, **kwargs):
        hooked.append(1)
        return type(first).forward(first, *args, **kwargs)

    first.forward = hook
    second.k_norm.forward = second.k_norm.forward  # a bound method of its own
    k_norm_forward = vars(second.k_norm)["forward"]
    expected = step(model)
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    assert hooked == [1, 1]
    assert calls[0]["q_norm"] is not None and calls[1]["q_norm"] is calls[1]["k_norm"] is None
    hf.unpatch(model)
    assert vars(first)["forward"] is hook and vars(second.k_norm)["forward"] is k_norm_forward
    assert own_forwards(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn.k_norm"]


def test_a_copy_of_a_patched_model_runs_its_own_weights():
    """``copy.deepcopy`` (an EMA copy, say) rebinds the patched forwards to the copy."""
    model = tiny_model("OLMo2")
    hf.patch(model)
    twin = copy.deepcopy(model)
    attention = attentions(twin)[0]
    assert vars(attention)["forward"].args[0] is attention
    assert vars(attention.q_norm)["forward"].args[0] is attention.q_norm
    expected = step(model)
    with torch.no_grad():
        attention.q_norm.weight.mul_(2)
    with pytest.raises(AssertionError):
        check_same(step(twin), expected)


def test_a_copy_of_a_patched_model_stays_patched_until_it_is_unpatched(monkeypatch):
    """A ``copy.deepcopy`` of a patched model is patched as the model is: unpatching the
    original leaves the family's name ours and the copy fused (it ran unfused before, the name
    given back while the copy still held it); ``unpatch(copy)`` then gives everything back."""
    model = tiny_model("Qwen3")
    module = modeling("Qwen3")
    original = module.apply_rotary_pos_emb
    expected = step(model)
    hf.patch(model)
    twin = copy.deepcopy(model)
    hf.unpatch(model)
    assert own_forwards(model) == [] and module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    calls = spy(monkeypatch)
    check_same(step(twin), expected)
    assert len(calls) == 2 and all(call["q_norm"] is not None for call in calls)
    hf.unpatch(twin)
    assert module.apply_rotary_pos_emb is original and own_forwards(twin) == []
    # a copy made after its original was unpatched is not patched
    hf.patch(model)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    copy.deepcopy(model)
    hf.patch(model)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


@pytest.mark.filterwarnings("ignore:Calling .zero_grad.. from a module created with")
@pytest.mark.parametrize("family", ["Qwen3", "OLMo2"])
def test_a_data_parallel_replica_runs_its_own_weights_fused(family, monkeypatch):
    """``nn.DataParallel`` copies each module's ``__dict__`` into its replicas: the replica of a
    patched attention and of its norms must run the replica's weights (on its own GPU), still
    fused, and the gradients reach the replica's parameters, as unpatched."""
    model = tiny_model(family)
    expected = step(replicate(model))
    calls = spy(monkeypatch)
    hf.patch(model)
    twin = replicate(model)
    check_same(step(twin), expected)
    assert not [name for name, p in model.named_parameters() if p.grad is not None]
    assert len(calls) == 2 and all(call["q_norm"] is not None for call in calls)
    assert calls[0]["q_norm"].weight is attentions(twin)[0].q_norm.weight
    hf.unpatch(model)
    assert own_forwards(model) == [] and not [
        m for m in model.modules() if "_replicate_for_data_parallel" in vars(m)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices; runs on the "
                    "two-GPU machine (scripts/device_check.sh)")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_data_parallel_on_two_gpus_gives_the_unpatched_results():
    """A patched Qwen3 under a real ``nn.DataParallel`` over two GPUs (one row each): the
    replica on the second GPU runs its own weights there, fused, and the logits and every
    gradient (summed back onto the first GPU) are those of the unpatched model."""
    model = tiny_model("Qwen3").cuda(0)

    def run():
        model.zero_grad(set_to_none=True)
        wrapped = torch.nn.DataParallel(model, device_ids=[0, 1])
        out = wrapped(input_ids=IDS.cuda(0), position_ids=POSITIONS.cuda(0),
                      labels=IDS.cuda(0))
        out.loss.mean().backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}

    expected = run()
    hf.patch(model)
    try:
        got = run()
    finally:
        hf.unpatch(model)
    check_same(got, expected)


def test_a_forward_that_moves_q_off_the_norms_input_is_refused():
    """Something between the norm and the RoPE call that copies q (a later transformers, a
    hook): the norm cannot be applied where it was left out, so the call raises."""
    model = tiny_model("Qwen3")
    hf.patch(model)
    attentions(model)[0].q_norm.register_forward_hook(lambda m, args, out: out.clone())
    expected = "q is not the tensor that Qwen3Attention.q_norm handed on"
    with pytest.raises(rd.RoPEError, match=expected):
        step(model)


@pytest.mark.parametrize("family, part", [("Qwen3", "q"), ("OLMo2", "k")])
def test_a_hook_that_edits_the_norms_output_in_place_is_refused(family, part):
    """A forward hook writing the norm's output in place (steering, say) writes the norm's
    input there, which the RoPE call would normalize, edit and all: the unpatched model's
    result is out of reach, so the call raises instead of returning another one."""
    model = tiny_model(family)
    norm = getattr(attentions(model)[0], f"{part}_norm")
    norm.register_forward_hook(lambda m, args, out: out.add_(1.0))
    expected = step(model)
    hf.patch(model)
    with pytest.raises(rd.RoPEError, match=f"{part} was written in place after .*{part}_norm"):
        step(model)
    hf.unpatch(model)
    check_same(step(model), expected)


def test_a_norm_that_no_rope_call_takes_is_refused(monkeypatch):
    """An attention forward that normalizes q and then calls no RoPE: the forward raises."""
    model = tiny_model("Gemma3")
    hf.patch(model)
    cls = type(attentions(model)[0])

    def forward(self, hidden_states, *args, **kwargs):
        return self.o_proj(self.q_norm(hidden_states[..., :16]).repeat(1, 1, 4)), None

    monkeypatch.setattr(cls, "forward", forward)
    expected = "Gemma3Attention.q_norm handed its input on but no RoPE call took it"
    with pytest.raises(rd.RoPEError, match=expected):
        step(model)


@pytest.mark.parametrize("attribute, value, expected", [
    ("variance_epsilon", 0.0, r"model.layers.1.self_attn.k_norm must have a positive "
                              r"variance_epsilon or eps to fuse the norm, got 0.0"),
    ("weight", torch.nn.Parameter(torch.ones(4, 4)),
     r"model.layers.1.self_attn.k_norm.weight must be a 1-D tensor to fuse the norm, got "
     r"torch.Size\(\[4, 4\]\)"),
])
def test_a_norm_without_a_usable_weight_or_eps_is_refused_by_name(attribute, value, expected):
    model = tiny_model("Qwen3")
    module = modeling("Qwen3")
    original = module.apply_rotary_pos_emb
    setattr(attentions(model)[1].k_norm, attribute, value)
    with pytest.raises(rd.RoPEError, match=expected):
        hf.patch(model)
    assert module.apply_rotary_pos_emb is original and own_forwards(model) == []


@pytest.mark.parametrize("family, wrong", [
    ("Gemma3", dict(offset=0.0)),  # Gemma3 without its 1 + w
    ("Qwen3", dict(eps=1e-6)),  # the config's eps not read
    ("Qwen3", dict(offset=1.0)),  # Gemma's rule on Qwen3
])
def test_a_wrong_norm_would_be_caught(family, wrong, monkeypatch):
    """The comparison above is sensitive: the fused call with a wrong offset or epsilon fails it
    (the logits move by about 10%)."""
    model = tiny_model(family)
    expected = step(model)
    real = hf.apply_qk

    def mutated(*args, q_norm=None, k_norm=None, **kwargs):
        q_norm, k_norm = (rd.HeadNorm(n.weight, **{**dict(eps=n.eps, offset=n.offset,
                                                        scope=n.scope), **wrong})
                          for n in (q_norm, k_norm))
        return real(*args, q_norm=q_norm, k_norm=k_norm, **kwargs)

    monkeypatch.setattr(hf, "apply_qk", mutated)
    hf.patch(model)
    logits, _ = step(model)
    assert (logits - expected[0]).abs().max() > 0.01 * expected[0].abs().max()


def _tiny_qwen3(layers: int = 2) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, head_dim=8,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=64, rms_norm_eps=0.25)
    model = transformers.Qwen3ForCausalLM(config)
    random_norm_weights(model)
    return model


def test_a_checkpointed_training_step_compiles_with_fullgraph():
    """Gradient checkpointing (``use_reentrant=False``) under ``torch.compile(fullgraph=True)``:
    the patched model's logits and gradients are the unpatched model's (the norms' hand-over
    to the RoPE call would be a side effect Dynamo refuses inside a checkpointed layer)."""
    base = _tiny_qwen3()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(MODEL_DEVICE)

    def step(patched):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if patched:
            hf.patch(model)
        try:
            out = torch.compile(model, backend="aot_eager", fullgraph=True)(
                input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
        finally:
            hf.unpatch(model)
        return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    want_logits, want_grads = step(False)
    logits, grads = step(True)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_fullgraph_forward_compiles_once():
    """The same input three times under ``fullgraph=True`` makes one graph, as unpatched (a
    norm form first met while tracing, interned after the graph, failed its guard once)."""
    model = _tiny_qwen3(1).eval()
    for layer in model.model.layers:
        layer.self_attn.q_norm.variance_epsilon = 1.2345e-5  # a form no earlier test made
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2)).to(MODEL_DEVICE)
    hf.patch(model)
    try:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        with torch.no_grad():
            for _ in range(3):
                compiled(input_ids=ids)
        assert counter.frame_count == 1
    finally:
        hf.unpatch(model)


def test_a_norm_epsilon_traced_as_a_dynamic_float():
    """``torch.compile(dynamic=True)`` traces a float argument as a symbolic float: a
    ``HeadNorm`` made from it inside the graph normalizes with its value."""
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 4, 3, 8, generator=gen), torch.rand(8, generator=gen) + 0.5
    angles = torch.rand(4, 8, generator=gen) * 6

    def call(x, weight, eps):
        return rd.apply(x, angles, spec, norm=rd.HeadNorm(weight, eps), backend="eager")

    torch._dynamo.reset()
    compiled = torch.compile(call, dynamic=True, fullgraph=True, backend="aot_eager")
    for eps in (0.25, 0.5):
        torch.testing.assert_close(compiled(x, weight, eps), call(x, weight, eps))


@pytest.mark.parametrize("forced", [None, "eager"])
def test_a_first_call_traced_in_a_fresh_process(forced):
    """A process whose first rope-dispatch call is compiled (``dynamic=True``: Dynamo traces
    twice; or with ``ROPE_BACKEND`` set): the backends' probe and load run at trace time,
    and the two traces and the registry agree."""
    code = textwrap.dedent("""
        import torch, transformers
        from rope_dispatch.integrations import hf
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(3, 64, (2, 6))
        with torch.no_grad():
            want = model(input_ids=ids).logits
            hf.patch(model)
            got = torch.compile(model, backend="aot_eager", dynamic=True,
                                fullgraph=True)(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        print("same logits")
    """)
    env = {k: v for k, v in os.environ.items() if k != "ROPE_BACKEND"}
    if forced:
        env["ROPE_BACKEND"] = forced
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and "same logits" in proc.stdout, proc.stderr[-3000:]


def _liger() -> tuple:
    """Liger-Kernel's ``rms_norm`` and ``monkey_patch`` modules (the test skips without them)."""
    try:  # (an ImportError where it is not installed; on a GPU machine whose TransformerEngine,
        # which Liger's import of peft loads, finds torch's cuDNN loaded first: an OSError)
        from liger_kernel.transformers import monkey_patch, rms_norm
    except (ImportError, OSError) as exc:
        pytest.skip(f"Liger-Kernel does not import here ({type(exc).__name__}: {exc})")
    return rms_norm, monkey_patch


@pytest.fixture
def liger_kernel(monkeypatch) -> list:
    """Liger's RMSNorm kernel stood in for by the formula (its Triton kernel needs a GPU), so
    Liger's norms run on the CPU: returns the weights it was called with."""
    rms_norm, _ = _liger()
    weights = []

    class Kernel:  # LigerRMSNormFunction.apply's arguments
        @staticmethod
        def apply(x, weight, eps, offset, *rest):
            weights.append(weight)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)

    monkeypatch.setattr(rms_norm, "LigerRMSNormFunction", Kernel)
    return weights


def _liger_norms(model, family: str, kind: str, offset: float | None = None) -> type:
    """``model``'s q_norm and k_norm made Liger-Kernel's as its patches make them: ``instance``
    rebinds each module's forward to ``LigerRMSNorm.forward`` (``_patch_rms_norm_module``, which
    ``apply_liger_kernel_to_*(model=...)`` runs, with the family's offset, or ``offset``, and
    casting mode); ``class`` puts Liger's class for the family in their place, as a model built
    after Liger's patch holds (the same weights). Returns ``LigerRMSNorm``."""
    rms_norm, monkey_patch = _liger()
    for attention in attentions(model):
        for part in ("q_norm", "k_norm"):
            norm = getattr(attention, part)
            if kind == "instance":
                gemma = family == "Gemma3"
                monkey_patch._patch_rms_norm_module(
                    norm, offset=NORMS[family][0] if offset is None else offset,
                    casting_mode="gemma" if gemma else "llama", in_place=False)
                continue
            liger = rms_norm.LigerRMSNormForOlmo2(norm.weight.shape[0], norm.variance_epsilon)
            with torch.no_grad():
                liger.weight.copy_(norm.weight)
            setattr(attention, part, liger.to(norm.weight.device))
    return rms_norm.LigerRMSNorm


@pytest.mark.parametrize("family, kind, offset", [
    ("Qwen3", "instance", None), ("Gemma3", "instance", None), ("OLMo2", "class", None),
    ("Qwen3", "instance", 1.0),
])
def test_norms_liger_made_its_own_are_fused_with_their_offset(family, kind, offset, monkeypatch):
    """A model whose q_norm and k_norm run Liger-Kernel's ``LigerRMSNorm`` (Liger's patch of the
    built model, or Liger's class in a model built after its patch): the norms fuse into the
    RoPE call with each module's weight, epsilon and offset (the family's, Gemma3's 1, or one
    of Liger's own), the results are those of the unpatched model with weights ``offset + w``
    in the family's form, and ``unpatch`` gives each norm Liger's forward back."""
    model = tiny_model(family)
    family_offset, scope, _, _, _ = NORMS[family]
    offset = family_offset if offset is None else offset
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for attention in attentions(shifted):
            for norm in (attention.q_norm, attention.k_norm):
                norm.weight += offset - family_offset
    expected = step(shifted)
    liger = _liger_norms(model, family, kind, offset)
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    assert len(calls) == model.config.num_hidden_layers
    for call, attention in zip(calls, attentions(model)):
        for norm, module_norm in ((call["q_norm"], attention.q_norm),
                                  (call["k_norm"], attention.k_norm)):
            assert norm.weight is module_norm.weight
            assert (norm.offset, norm.scope, norm.eps) == (offset, scope, EPS)
    hf.unpatch(model)
    for attention in attentions(model):
        for norm in (attention.q_norm, attention.k_norm):
            own = vars(norm).get("forward")
            if kind == "instance":
                assert own.__func__ is liger.forward and own.__self__ is norm
            else:
                assert own is None and type(norm).forward is liger.forward


@pytest.mark.parametrize("order", ["liger first", "ours first"])
def test_liger_s_own_model_patch_with_its_rope_keeps_the_norms_fused(order, liger_kernel,
                                                                     monkeypatch):
    """Liger's patch of a built Qwen3 (``apply_liger_kernel_to_qwen3(model=...)``: its RMSNorm
    for every norm, its RoPE in the modeling module): patched after it, the q and k norms run
    in our RoPE call. Patched before it (the Trainer applies Liger inside ``train()``), Liger
    takes the norms back and the model runs Liger's; patching again fuses them again."""
    rms_norm, monkey_patch = _liger()
    module = modeling("Qwen3")
    monkeypatch.setattr(module, "Qwen3RMSNorm", module.Qwen3RMSNorm)  # (Liger rebinds it)
    model = tiny_model("Qwen3")
    expected = step(model)
    calls = spy(monkeypatch)

    def liger_patch(target=model, rope=True):
        monkey_patch.apply_liger_kernel_to_qwen3(
            model=target, rope=rope, rms_norm=True, swiglu=False, cross_entropy=False,
            fused_linear_cross_entropy=False)

    if order == "ours first":
        twin = copy.deepcopy(model)
        hf.patch(model)
        liger_patch()  # (Liger's RoPE, which needs a GPU, is not run here)
        assert all(vars(a.q_norm)["forward"].__func__ is rms_norm.LigerRMSNorm.forward
                   for a in attentions(model))
        hf.patch(twin)  # unpatched with Liger's norms: nothing of ours stays on any module
        liger_patch(twin, rope=False)
        hf.unpatch(twin)
        assert not [m for m in twin.modules() if "_replicate_for_data_parallel" in vars(m)]
    else:
        liger_patch()
    hf.patch(model)
    liger_kernel.clear()
    check_same(step(model), expected)
    assert len(calls) == 2 and all(c["q_norm"] is not None and c["k_norm"] is not None
                                   for c in calls)
    layer_norms = [model.model.norm.weight] + [
        norm.weight for layer in model.model.layers
        for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    assert liger_kernel and all(any(w is x for x in layer_norms) for w in liger_kernel)
    hf.unpatch(model)


def test_a_liger_norm_called_outside_its_attention_runs_liger_bound_to_it(liger_kernel):
    """Outside its attention's forward a fused Liger norm runs Liger's forward with its own
    weight, in a data-parallel replica the replica's; a Liger norm without a weight
    (``elementwise_affine=False``) is left unfused, and with it its attention."""
    model = tiny_model("Qwen3")
    liger = _liger_norms(model, "Qwen3", "instance")
    weights = liger_kernel
    hf.patch(model)
    norm = attentions(model)[1].k_norm
    x = torch.randn(3, 16, device=norm.weight.device)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm.weight
    torch.testing.assert_close(norm(x), want)
    assert weights == [norm.weight]
    twin_norm = attentions(replicate(model))[1].k_norm
    assert twin_norm.weight is not norm.weight
    torch.testing.assert_close(twin_norm(x), want)
    assert weights[-1] is twin_norm.weight
    hf.unpatch(model)

    weightless = tiny_model("Qwen3")
    attention = attentions(weightless)[0]
    attention.q_norm = liger(16, EPS, elementwise_affine=False)
    hf.patch(weightless)
    assert "forward" not in vars(attention) and "forward" not in vars(attention.k_norm)
    assert "forward" in vars(attentions(weightless)[1])
    hf.unpatch(weightless)


def test_a_family_norm_is_known_by_its_class_not_the_module_name_now(monkeypatch):
    """A model built before Liger's patch of the modeling module (``Qwen3RMSNorm`` rebound to
    Liger's class there) still holds transformers' norms: they fuse."""
    module = modeling("Qwen3")
    model = tiny_model("Qwen3")
    expected = step(model)
    monkeypatch.setattr(module, "Qwen3RMSNorm", type("LigerRMSNorm", (torch.nn.Module,), {}))
    calls = spy(monkeypatch)
    hf.patch(model)
    check_same(step(model), expected)
    assert len(calls) == 2 and all(call["q_norm"] is not None for call in calls)
    hf.unpatch(model)


def test_a_pickled_patched_model_runs_fused_while_the_name_is_ours(monkeypatch):
    """A patched Qwen3 pickled loads with patch's forwards on its attentions and norms but is
    not held: it runs fused while the patched model holds the name, unfused once the name is
    given back, with the unpatched model's logits and gradients either way; ``unpatch`` of
    the loaded model removes its forwards."""
    import pickle

    module = modeling("Qwen3")
    original = module.apply_rotary_pos_emb
    model = tiny_model("Qwen3")
    expected = step(model)
    hf.patch(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert own_forwards(loaded) == own_forwards(model) != []
    calls = spy(monkeypatch)
    check_same(step(loaded), expected)
    assert len(calls) == 2 and all(call["q_norm"] is not None for call in calls)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    check_same(step(loaded), expected)
    assert len(calls) == 2
    hf.unpatch(loaded)
    assert own_forwards(loaded) == [] and module.apply_rotary_pos_emb is original
