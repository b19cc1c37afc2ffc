"""``integrations.hf.patch`` on every family of ``hf_families.STANDARD_FAMILIES`` (the families
whose attention calls the standard ``apply_rotary_pos_emb``): a tiny random model of each, built
from its config (one or two layers, hidden size 64, no download), gives the same outputs and
parameter gradients patched and unpatched, and ``unpatch`` binds the original function back.
The families whose modeling module has the standard function but that cannot be built cheaply
here are listed as skipped, with the reason, and are not in ``STANDARD_FAMILIES``."""

from __future__ import annotations

import importlib

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


def mrope(sections):
    return dict(rope_type="default", rope_theta=10000.0, mrope_section=sections)


MODEL_TYPES = {
    "Aria": "aria_text",
    "Cosmos3Edge": "cosmos3_edge_text",
    "EmbeddingGemma2": "embedding_gemma2_text",
    "Glm4vMoe": "glm4v_moe_text",
    "GraniteDocling": "granite_docling_text",
    "Molmo2": "molmo2_text",
    "MuseGlimmer": "muse_glimmer_text",
    "MuseSpark": "muse_spark_text",
    "Qwen3_5": "qwen3_5_text",
    "Qwen3_5Moe": "qwen3_5_moe_text",
}
"""Family -> its text model's ``model_type`` where that is not the folder name."""
OVERRIDES = {
    "Bamba": dict(attn_layer_indices=[1]),
    "Cosmos3Edge": dict(rope_parameters=mrope([2, 3, 3])),
    "Dots1": dict(first_k_dense_replace=1, n_shared_experts=1),
    "Esm": dict(position_embedding_type='rotary', num_key_value_heads=4),
    "Esmc": dict(num_key_value_heads=4),
    "Falcon": dict(head_dim=None),
    "Gemma2": dict(attn_implementation="eager"),
    "Glm4vMoe": dict(rope_parameters=mrope([2, 1, 1])),
    "GPTNeoXJapanese": dict(attn_implementation="eager"),
    "GraniteSWA": dict(attn_implementation="eager"),
    "GraniteMoeSWA": dict(attn_implementation="eager"),
    "HYV4": dict(attn_implementation="eager"),
    "Lfm2Moe": dict(layer_types=['full_attention', 'full_attention'], num_dense_layers=1),
    "Lfm3": dict(layer_types=['conv', 'full_attention']),
    "MiMoV2Flash": dict(attn_implementation="eager"),
    "PaddleOCR": dict(rope_parameters=mrope([2, 3, 3])),
    "Qwen3_5": dict(**HYBRID),
    "Qwen3_5Moe": dict(**HYBRID),
    "Qwen3Next": dict(**HYBRID),
    "RecurrentGemma": dict(block_types=['recurrent', 'attention']),
    "VaultGemma": dict(attn_implementation="eager"),
    "Zaya": dict(num_experts_per_tok=1),
}
"""Family -> the settings its tiny config needs besides :data:`COMMON` (``None``: left unset):
a full-attention layer for the hybrid families, sections summing to half the rotary dim for
the multimodal ones, eager attention where the family has no sdpa path."""

LEFT_OUT = {
    "needs audio, image or time-series inputs to run": [
        "idefics", "kyutai_speech_to_text", "mimi", "nemotron3_diarization", "neucodec",
        "pixtral", "pocket_tts_audio_tokenizer", "timesfm2_5", "xcodec2",
    ],
    "its default vision or audio sub-configs are too large to build in a unit test": [
        "deepseek_ocr2", "dia", "emu3", "exaone4_5", "glmasr", "granite4_vision", "mllama",
        "phi4_multimodal", "step3p7", "t5gemma", "t5gemma2", "unlimited_ocr",
    ],
    "no text model class to build from a config alone": [
        "esmfold2", "lasr", "modernbert_decoder", "nemotron3_5_transcribe", "qwen2_5_omni",
        "qwen3_omni_moe", "voxtral_realtime",
    ],
    "its config does not build from generic tiny settings": [
        "chameleon", "cohere_compass", "dbrx", "glm_image", "gradium_phonon_tts", "hunyuan_vl",
        "pocket_tts", "zamba2",
    ],
    "a tiny model made no call to the module function (RoPE off by default or elsewhere)": [
        "dots3_note", "flint", "granitemoehybrid",
    ],
    "other classes of the module (an indexer, a protein encoder) call the function too, "
    "with shapes not verified": ["evolla", "minimax_m3_vl"],
}
"""Folders whose modeling module defines the standard function but that are not served."""


def modeling(folder: str):
    return importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")


def tiny_model(family: str) -> torch.nn.Module:
    """The family's text model (no head) from a tiny config, random weights, float32, in eval
    mode (dropout and router jitter off; gradients still flow)."""
    folder = STANDARD_FAMILIES[family][0]
    settings = {**COMMON, **OVERRIDES.get(family, {})}
    settings = {name: value for name, value in settings.items() if value is not None}
    config = transformers.AutoConfig.for_model(MODEL_TYPES.get(family, folder), **settings)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).float().eval().to(MODEL_DEVICE)


def step(model):
    """The last hidden state and every parameter gradient of a loss on it."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    out = model(input_ids=ids.to(MODEL_DEVICE))
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


PARAMS = [pytest.param(family, id=family) for family in STANDARD_FAMILIES] + [
    pytest.param(folder, id=f"{folder}-left-out", marks=pytest.mark.skip(reason=reason))
    for reason, folders in LEFT_OUT.items() for folder in folders
]


@pytest.mark.parametrize("family", PARAMS)
def test_patched_family_gives_the_same_outputs_and_gradients(family, monkeypatch):
    model = tiny_model(family)
    module = modeling(STANDARD_FAMILIES[family][0])
    original = module.apply_rotary_pos_emb
    monkeypatch.setattr(module, "apply_rotary_pos_emb", original)  # put back whatever happens
    monkeypatch.setattr(hf, "_originals", {})
    expected = step(model)
    calls = []
    real = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert hf.patch(model) is model
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    hidden, grads = step(model)
    assert calls, "the patched model made no RoPE call"
    torch.testing.assert_close(hidden, expected[0], **SAME)
    assert grads.keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, msg=name, **SAME)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


def test_left_out_families_are_not_listed():
    folders = {folder for folder, _ in STANDARD_FAMILIES.values()}
    for left in LEFT_OUT.values():
        assert not folders & set(left)
