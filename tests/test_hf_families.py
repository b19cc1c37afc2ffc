"""``integrations.hf.patch`` on every family of ``hf_families.STANDARD_FAMILIES`` (the families
whose attention calls the standard ``apply_rotary_pos_emb``): a tiny random model of each, built
from its config (one or two layers, hidden size 64, no download), gives the same outputs and
parameter gradients patched and unpatched, and ``unpatch`` binds the original function back.
Where a family's default model is multimodal or full size, its text model is built from a text
sub-config or a text model class, with tiny vision, audio, encoder and decoder sub-configs; the
other models of a modeling module whose attention calls the function too (:data:`OTHER_CALLERS`)
are run the same way. The families whose modeling module has the standard function but that
cannot be run cheaply here are listed as skipped, with the reason, and are not in
``STANDARD_FAMILIES``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import transformers

from rope_dispatch.integrations import hf
from rope_dispatch.integrations.hf_families import STANDARD_FAMILIES

TOKENS = 12
BATCH = 2
MODEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAME = dict(rtol=1e-4, atol=1e-5) if MODEL_DEVICE == "cuda" else dict(rtol=1e-5, atol=1e-6)
"""As the other HF tests: float32 models; on CUDA the kernels round apart by float32 error."""
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    attn_implementation="sdpa",
)
"""Settings every tiny config gets (a config ignores the ones it does not have)."""
HYBRID = dict(layer_types=["linear_attention", "full_attention"])
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
"""A sliding-window layer (a window shorter than the sequence) and a full one."""
ROPE = dict(rope_type="default", rope_theta=10000.0)
SUB = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)
"""An encoder's or decoder's sub-config (nested configs do not get :data:`COMMON`)."""
NO_TOKEN_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
"""Left at the family's defaults (sub-configs of their own, or outside the tiny vocabulary)."""


def mrope(sections):
    return dict(**ROPE, mrope_section=sections)


MODEL_TYPES = {
    "Aria": "aria_text",
    "CohereCompass": "cohere_compass_text",
    "Cosmos3Edge": "cosmos3_edge_text",
    "DeepseekOcr2": "deepseek_ocr2_text",
    "DeepseekOcr2-vision": "deepseek_ocr2_encoder",
    "EmbeddingGemma2": "embedding_gemma2_text",
    "Emu3": "emu3_text_model",
    "Glm4vMoe": "glm4v_moe_text",
    "GlmImage": "glm_image_text",
    "Granite4Vision": "granite4_vision_text",
    "GraniteDocling": "granite_docling_text",
    "HunYuanVL": "hunyuan_vl_text",
    "Mllama": "mllama_text_model",
    "ModernBertDecoder": "modernbert-decoder",
    "Molmo2": "molmo2_text",
    "MuseGlimmer": "muse_glimmer_text",
    "MuseSpark": "muse_spark_text",
    "Qwen3_5": "qwen3_5_text",
    "Qwen3_5Moe": "qwen3_5_moe_text",
    "Qwen3OmniMoe": "qwen3_omni_moe_text",
    "Qwen3OmniMoe-talker": "qwen3_omni_moe_talker_code_predictor",
    "Step3p7": "step3p5",
    "UnlimitedOcr": "unlimited_ocr_text",
    "VoxtralRealtime": "voxtral_realtime_text",
    "VoxtralRealtime-encoder": "voxtral_realtime_encoder",
}
"""Family (or other caller, :data:`OTHER_CALLERS`) -> its text model's ``model_type`` where that
is not the folder name."""
T5GEMMA = {**SUB, "num_hidden_layers": 2, "vocab_size": 128, "sliding_window": 8,
           "query_pre_attn_scalar": 16}
T5GEMMA2 = {**T5GEMMA, "layer_types": SLIDING["layer_types"], "vocab_size": 132}
"""T5Gemma 2's image token ids lie above the ids the test draws (3 to 127)."""
OVERRIDES = {
    "Bamba": dict(attn_layer_indices=[1]),
    "Chameleon": dict(vocabulary_map={"<image>": 3}, vq_config=dict(
        embed_dim=8, num_embeddings=16, latent_channels=8, base_channels=32, resolution=16,
        channel_multiplier=[1], num_res_blocks=1, attn_resolutions=[])),
    "CohereCompass": dict(**SLIDING, rope_parameters=dict(
        sliding_attention=ROPE, full_attention=ROPE)),
    "Cosmos3Edge": dict(rope_parameters=mrope([2, 3, 3])),
    "Dbrx": dict(  # its attention reads attn_config.rope_theta and clamps q, k, v by clip_qkv
        d_model=64, attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "DeepseekOcr2": dict(mlp_layer_types=["dense", "sparse"], n_shared_experts=1),
    "Dia": dict(**NO_TOKEN_IDS, delay_pattern=[0, 1], encoder_config=SUB, decoder_config=dict(
        **SUB, num_channels=2, cross_hidden_size=64, cross_num_attention_heads=4,
        cross_head_dim=16, cross_num_key_value_heads=2)),
    "Dots1": dict(first_k_dense_replace=1, n_shared_experts=1),
    "Esm": dict(position_embedding_type='rotary', num_key_value_heads=4),
    "Esmc": dict(num_key_value_heads=4),
    "Falcon": dict(head_dim=None),
    "Flint": dict(**SLIDING, attn_implementation="eager"),
    "Gemma2": dict(attn_implementation="eager"),
    "Glm4vMoe": dict(rope_parameters=mrope([2, 1, 1])),
    "GlmImage": dict(rope_parameters=mrope([2, 3, 3])),
    "GPTNeoXJapanese": dict(attn_implementation="eager"),
    "GraniteSWA": dict(attn_implementation="eager"),
    "GraniteMoeSWA": dict(attn_implementation="eager"),
    "GraniteMoeHybrid": dict(
        **HYBRID, position_embedding_type="rope", mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=8, shared_intermediate_size=64),
    "GradiumPhononTTS": dict(flow_head_config=dict(
        hidden_size=32, num_hidden_layers=1, condition_dim=64, latent_dim=8,
        frequency_embedding_size=16, loss_weighting_num_layers=1), latent_dim=8),
    "HunYuanVL": dict(rope_parameters=dict(**ROPE, mrope_section=[2, 2, 2, 2])),
    "HYV4": dict(attn_implementation="eager"),
    "Lfm2Moe": dict(layer_types=['full_attention', 'full_attention'], num_dense_layers=1),
    "Lfm3": dict(layer_types=['conv', 'full_attention']),
    "MiMoV2Flash": dict(attn_implementation="eager"),
    "PaddleOCR": dict(rope_parameters=mrope([2, 3, 3])),
    "Phi4Multimodal": dict(
        rope_parameters=dict(**ROPE, partial_rotary_factor=0.5),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, crop_size=28, patch_size=14),
        audio_config=dict(
            hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
            ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
            input_size=16)),
    "PocketTTS": dict(vocab_size=None, flow_head_config=dict(  # audio token ids: 4000-4003
        hidden_size=32, num_hidden_layers=1, condition_dim=64, latent_dim=8,
        frequency_embedding_size=16, loss_weighting_num_layers=1), latent_dim=8),
    "Qwen3_5": dict(**HYBRID),
    "Qwen3_5Moe": dict(**HYBRID),
    "Qwen3Next": dict(**HYBRID),
    "Qwen3OmniMoe": dict(rope_parameters=mrope([2, 3, 3])),
    "Qwen3OmniMoe-code2wav": dict(sliding_window=8),
    "RecurrentGemma": dict(block_types=['recurrent', 'attention']),
    "Step3p7": dict(
        **SLIDING, num_sliding_attention_heads=4, mlp_layer_types=["dense", "sparse"],
        share_expert_dim=32),
    "T5Gemma": dict(attn_implementation="eager", encoder=T5GEMMA, decoder=T5GEMMA),
    "T5Gemma2": dict(
        vocab_size=132, image_token_index=130, eoi_token_index=131,
        attn_implementation="eager", decoder=T5GEMMA2, encoder=dict(
            text_config=T5GEMMA2, mm_tokens_per_image=4, boi_token_index=129,
            eoi_token_index=131, image_token_index=130, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14))),
    "VaultGemma": dict(attn_implementation="eager"),
    "VoxtralRealtime-encoder": dict(sliding_window=8),
    "Zamba2": dict(
        layers_block_type=["mamba", "hybrid"], use_mem_rope=True, n_mamba_heads=4,
        mamba_d_state=8),
    "Zaya": dict(num_experts_per_tok=1),
}
"""Family -> the settings its tiny config needs besides :data:`COMMON` (``None``: left unset):
a full-attention layer for the hybrid families, sections summing to half the rotary dim for
the multimodal ones, eager attention where the family has no sdpa path, tiny vision, audio,
encoder and decoder sub-configs where the defaults are full size, RoPE switched on where it is
off by default (Zamba2, GraniteMoeHybrid) or a sliding layer where only those rotate (Flint)."""

LEFT_OUT = {
    "needs audio, image or time-series inputs to run": [
        "dots3_note", "glmasr", "idefics", "kyutai_speech_to_text", "lasr", "mimi",
        "nemotron3_5_transcribe", "nemotron3_diarization", "neucodec", "pixtral",
        "pocket_tts_audio_tokenizer", "timesfm2_5", "xcodec2",
    ],
    "its caller is the structure module's atom attention, with no text-only model": ["esmfold2"],
    "other classes of the module (an indexer, a protein encoder, a token-to-wave DiT rotating "
    "only its first head) call the function too, with shapes not verified": [
        "evolla", "minimax_m3_vl", "qwen2_5_omni",
    ],
}
"""Folders whose modeling module defines the standard function but that are not served."""


CONFIG_CLASSES = {"Qwen3OmniMoe-code2wav": "Qwen3OmniMoeCode2WavConfig"}
"""Family -> the class of its configuration module to build the config with, where its
``model_type`` is not registered."""
MODEL_CLASSES = {
    "DeepseekOcr2": "DeepseekOcr2TextModel",
    "DeepseekOcr2-vision": "DeepseekOcr2VisionEncoder",
    "Emu3": "Emu3TextModel",
    "Granite4Vision": "Granite4VisionTextModel",
    "Mllama": "MllamaTextModel",
    "Qwen3OmniMoe": "Qwen3OmniMoeThinkerTextModel",
    "Qwen3OmniMoe-code2wav": "Qwen3OmniMoeCode2WavTransformerModel",
    "Qwen3OmniMoe-talker": "Qwen3OmniMoeTalkerCodePredictorModel",
    "Step3p7": "Step3p7TextModel",
    "UnlimitedOcr": "UnlimitedOcrTextModel",
    "VoxtralRealtime": "VoxtralRealtimeTextModel",
    "VoxtralRealtime-encoder": "VoxtralRealtimeEncoder",
}
"""Family -> the class of its modeling module to build from the config, where
``AutoModel`` has no text-only model for it."""


def embeds(ids: torch.Tensor) -> torch.Tensor:
    """Random ``[b, s, 64]`` input embeddings, for a model that takes no ids."""
    generator = torch.Generator().manual_seed(6)
    return torch.randn(*ids.shape, COMMON["hidden_size"], generator=generator).to(ids.device)


INPUTS: dict[str, Callable[[torch.Tensor], dict]] = {
    "DeepseekOcr2-vision": lambda ids: dict(inputs_embeds=embeds(ids), num_patches=8),
    "Dia": lambda ids: dict(input_ids=ids, decoder_input_ids=torch.stack((ids, ids.flip(1)), -1)),
    "Qwen3OmniMoe-code2wav": lambda ids: dict(inputs_embeds=embeds(ids)),
    "Qwen3OmniMoe-talker": lambda ids: dict(inputs_embeds=embeds(ids)),
    "T5Gemma": lambda ids: dict(input_ids=ids, decoder_input_ids=ids.flip(1)),
    "T5Gemma2": lambda ids: dict(input_ids=ids, decoder_input_ids=ids.flip(1)),
    "VoxtralRealtime": lambda ids: dict(input_ids=ids, t_cond=embeds(ids)[:1, :1]),
    "VoxtralRealtime-encoder": lambda ids: dict(inputs_embeds=embeds(ids)),
}
"""Family -> its model's inputs, made from the ids (otherwise ``input_ids`` alone): an
encoder-decoder's decoder ids (Dia's: two codebook channels), Voxtral realtime's time
conditioning, embeddings for a model without ids."""
OTHER_CALLERS = {
    "DeepseekOcr2-vision": "DeepseekOcr2",
    "Qwen3OmniMoe-code2wav": "Qwen3OmniMoe",
    "Qwen3OmniMoe-talker": "Qwen3OmniMoe",
    "VoxtralRealtime-encoder": "VoxtralRealtime",
}
"""Another model of a family's modeling module whose attention calls the function too (a vision
or audio encoder run on random embeddings, a talker, a code-to-wave transformer) -> the family:
run alone, with the module's function rebound as :func:`hf.patch` rebinds it for the whole
model."""


def modeling(folder: str):
    return importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")


def folder_of(family: str) -> str:
    return STANDARD_FAMILIES[OTHER_CALLERS.get(family, family)][0]


def tiny_model(family: str) -> torch.nn.Module:
    """The family's text model (no head; or the model of :data:`OTHER_CALLERS`) from a tiny
    config, random weights, float32, in eval mode (dropout and router jitter off; gradients
    still flow)."""
    folder = folder_of(family)
    settings = {**COMMON, **OVERRIDES.get(family, {})}
    settings = {name: value for name, value in settings.items() if value is not None}
    if family in CONFIG_CLASSES:
        configuration = importlib.import_module(
            f"transformers.models.{folder}.configuration_{folder}")
        config = getattr(configuration, CONFIG_CLASSES[family])(**settings)
    else:
        config = transformers.AutoConfig.for_model(MODEL_TYPES.get(family, folder), **settings)
    torch.manual_seed(0)
    if family in MODEL_CLASSES:
        model = getattr(modeling(folder), MODEL_CLASSES[family])(config)
    else:
        model = transformers.AutoModel.from_config(config)
    return model.float().eval().to(MODEL_DEVICE)


def step(model, family):
    """The last hidden state and every parameter gradient of a loss on it."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    ids = ids.to(MODEL_DEVICE)
    out = model(**INPUTS[family](ids)) if family in INPUTS else model(input_ids=ids)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


PARAMS = [pytest.param(family, id=family) for family in STANDARD_FAMILIES] + [
    pytest.param(folder, id=f"{folder}-left-out", marks=pytest.mark.skip(reason=reason))
    for reason, folders in LEFT_OUT.items() for folder in folders
]


def check_patched_equals_unpatched(family, monkeypatch, rebind):
    """Outputs and every gradient of ``family``'s tiny model, before and after ``rebind(model,
    module)``, are the same, with at least one call to our function after."""
    model = tiny_model(family)
    module = modeling(folder_of(family))
    original = module.apply_rotary_pos_emb
    monkeypatch.setattr(module, "apply_rotary_pos_emb", original)  # put back whatever happens
    monkeypatch.setattr(hf, "_originals", {})
    expected = step(model, family)
    calls = []
    real = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rebind(model, module)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    hidden, grads = step(model, family)
    assert calls, "the patched model made no RoPE call"
    torch.testing.assert_close(hidden, expected[0], **SAME)
    assert grads.keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, msg=name, **SAME)
    return model, original


@pytest.mark.parametrize("family", PARAMS)
def test_patched_family_gives_the_same_outputs_and_gradients(family, monkeypatch):
    def rebind(model, module):
        assert hf.patch(model) is model

    model, original = check_patched_equals_unpatched(family, monkeypatch, rebind)
    hf.unpatch(model)
    assert module_function(family) is original


@pytest.mark.parametrize("caller", sorted(OTHER_CALLERS))
def test_other_callers_of_the_function_give_the_same_outputs_and_gradients(caller, monkeypatch):
    """A model holding only another caller is not one that ``patch`` serves (it looks for the
    family's text attention), so the rebinding that ``patch`` makes is made directly."""
    check_patched_equals_unpatched(
        caller, monkeypatch,
        lambda model, module: monkeypatch.setattr(
            module, "apply_rotary_pos_emb", hf.apply_rotary_pos_emb),
    )


def module_function(family):
    return modeling(folder_of(family)).apply_rotary_pos_emb


def test_left_out_families_are_not_listed():
    folders = {folder for folder, _ in STANDARD_FAMILIES.values()}
    for left in LEFT_OUT.values():
        assert not folders & set(left)
    assert set(OTHER_CALLERS.values()) <= set(STANDARD_FAMILIES)
