"""``integrations.hf.patch`` on every family of ``hf_families.STANDARD_FAMILIES`` (the families
whose attention calls the standard ``apply_rotary_pos_emb``), ``hf_families.MLA_FAMILIES``
(multi-head latent attention as DeepSeek-V3's) and ``hf_families.PAIR_FAMILIES`` (interleaved
pairs, Cohere's and GLM's): a tiny random model of each, built from its config
(one or two layers, hidden size 64, no download), gives the same outputs, parameter gradients and
q and k of every RoPE call patched and unpatched, and ``unpatch`` binds the original functions back.
Audio, image and time-series encoders run on random features, waveforms, pixels and series.
Where a family's default model is multimodal or full size, its text model is built from a text
sub-config or a text model class, with tiny vision, audio, encoder and decoder sub-configs; the
other models of a modeling module whose attention calls the function too (:data:`OTHER_CALLERS`)
are run the same way. The families whose modeling module has the standard function but that
cannot be run cheaply here are listed as skipped, with the reason, and are not in
``STANDARD_FAMILIES``."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable

import pytest
import torch
import transformers

from reference import assert_matches
from rope_dispatch.integrations import hf
from rope_dispatch.integrations.hf_families import MLA_FAMILIES, PAIR_FAMILIES, STANDARD_FAMILIES

WRITTEN_FOR = (5, 23)
"""The transformers release whose modeling files these tiny configs were written against (the
one CI installs, ``pyproject.toml``'s dev extra). Older releases name config fields and model
types otherwise (5.17's Bamba builds a 24 GB model from the same settings, its Mimi encoder has
no model type of its own) or lack the family: there the module is skipped, saying so."""
_INSTALLED = tuple(int(part) for part in transformers.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    _INSTALLED < WRITTEN_FOR,
    reason=f"tiny configs written for transformers {'.'.join(map(str, WRITTEN_FOR))}; "
           f"{transformers.__version__} is installed",
)

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


MLA = dict(
    num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, head_dim=None, n_group=1, topk_group=1,
    first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"],
    index_topk=4, index_head_dim=16, index_n_heads=2,
)
"""Multi-head latent attention as in tests/test_integration_hf.py's DeepSeek-V3: 8 rotary channels
of 16 per query head, one rotary key head; a dense and a MoE layer; where the family has a
sparse-attention indexer, one that keeps 4 of the 12 tokens, so its (rotated) scores choose what
each token attends to."""
CODEC = dict(
    num_key_value_heads=4, downsampling_ratios=[2, 2], semantic_model_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
"""NeuCodec's and XCodec2's decoder: RoPE across heads (cos per head, ``unsqueeze_dim=2``), which
needs as many key as query heads."""
SEANET = dict(num_filters=8, upsampling_ratios=[2, 2], upsample_groups=64, sliding_window=8)
"""Mimi's and the Pocket TTS audio tokenizer's encoder: 4 samples per transformer token."""


MODEL_TYPES = {
    "Dots3Note": "dots3_note_audio_encoder",
    "Dots3NoteText": "dots3_note_text",
    "GlmAsr": "glmasr_encoder",
    "Lasr": "lasr_encoder",
    "Mimi": "mimi_encoder",
    "MiniMaxM3VL": "minimax_m3_vl_text",
    "Nemotron3_5Transcribe": "nemotron3_5_transcribe_asr_audio",
    "Nemotron3_5Transcribe-timestamps": "nemotron3_5_transcribe_word_timestamp",
    "Nemotron3Diarization": "nemotron3_diarization_audio",
    "PocketTTSAudioTokenizer": "pocket_tts_audio_tokenizer_encoder",
    "Aria": "aria_text",
    "CohereCompass": "cohere_compass_text",
    "Cosmos3Edge": "cosmos3_edge_text",
    "DeepseekOcr2": "deepseek_ocr2_text",
    "DeepseekOcr2-vision": "deepseek_ocr2_encoder",
    "EmbeddingGemma2": "embedding_gemma2_text",
    "Emu3": "emu3_text_model",
    "Glm4vMoe": "glm4v_moe_text",
    "Glm4v": "glm4v_text",
    "GlmOcr": "glm_ocr_text",
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
    "Qwen2_5Omni": "qwen2_5_omni_text",
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
    "Dots3Note": dict(
        feature_size=16, downsample_hidden_size=8, adapter_input_size=64, adapter_out_dim=32),
    "Esm": dict(position_embedding_type='rotary', num_key_value_heads=4),
    "Esmc": dict(num_key_value_heads=4),
    "Evolla": dict(
        aligner_num_add_layers=1, resampler_depth=1, resampler_dim_head=16, resampler_heads=2,
        resampler_num_latents=4, protein_encoder_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            vocab_size=32, max_position_embeddings=64, token_dropout=False)),
    "Falcon": dict(head_dim=None),
    "Flint": dict(**SLIDING, attn_implementation="eager"),
    "Gemma2": dict(attn_implementation="eager"),
    "Glm4vMoe": dict(rope_parameters=mrope([2, 1, 1])),
    "Glm4v": dict(rope_parameters=mrope([2, 3, 3])),
    "GlmOcr": dict(rope_parameters=mrope([2, 3, 3])),
    "GlmAsr": dict(num_mel_bins=16),
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
    "Idefics": dict(
        freeze_text_layers=False, freeze_vision_layers=False, cross_layer_interval=2,
        vision_config=dict(embed_dim=32, image_size=28, patch_size=14, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2)),
    "KyutaiSpeechToText": dict(  # ids: the text token, then one per codebook
        ffn_dim=128, num_codebooks=2, codebook_vocab_size=16, audio_bos_token_id=15,
        audio_pad_token_id=160, sliding_window=8),
    "Lasr": dict(num_mel_bins=16, subsampling_conv_channels=32, conv_kernel_size=5),
    "Lfm2Moe": dict(layer_types=['full_attention', 'full_attention'], num_dense_layers=1),
    "Lfm3": dict(layer_types=['conv', 'full_attention']),
    "MiMoV2Flash": dict(attn_implementation="eager"),
    "Mimi": dict(**SEANET, codebook_size=16, codebook_dim=8, num_quantizers=2,
                 vector_quantization_hidden_dimension=8),
    "Nemotron3_5Transcribe": dict(num_mel_bins=16, subsampling_factor=2),
    "Nemotron3_5Transcribe-timestamps": dict(vocab_size=16, blank_token_id=15),
    "Nemotron3Diarization": dict(num_mel_bins=16, subsampling_factor=2),
    "MiniMaxM3VL": dict(  # layer 0 sparse: its indexer keeps 2 blocks of 2 tokens
        dense_intermediate_size=128, shared_intermediate_size=32, index_n_heads=2,
        index_head_dim=8, index_block_size=2, index_topk_blocks=2,
        layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"]),
    "NeuCodec": CODEC,
    "PaddleOCR": dict(rope_parameters=mrope([2, 3, 3])),
    "Pixtral": dict(image_size=56, patch_size=14),
    "PocketTTSAudioTokenizer": dict(**SEANET, latent_stride=2, latent_dim=8),
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
    "Qwen2_5Omni": dict(rope_parameters=mrope([2, 3, 3])),
    "Qwen2_5Omni-dit": dict(  # token-to-wave DiT: RoPE on each query's and key's first head
        emb_dim=16, num_embeds=32, mel_dim=8, enc_emb_dim=16, enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8,
        look_ahead_layers=[1], look_backward_layers=[0], block_size=4, dropout=0.0),
    "Qwen3OmniMoe": dict(rope_parameters=mrope([2, 3, 3])),
    "Qwen3OmniMoe-code2wav": dict(sliding_window=8),
    "RecurrentGemma": dict(block_types=['recurrent', 'attention']),
    "Step3p7": dict(
        **SLIDING, num_sliding_attention_heads=4, mlp_layer_types=["dense", "sparse"],
        share_expert_dim=32),
    "T5Gemma": dict(attn_implementation="eager", encoder=T5GEMMA, decoder=T5GEMMA),
    "TimesFm2_5": dict(
        patch_length=4, context_length=4 * TOKENS, horizon_length=8, output_quantile_len=16),
    "T5Gemma2": dict(
        vocab_size=132, image_token_index=130, eoi_token_index=131,
        attn_implementation="eager", decoder=T5GEMMA2, encoder=dict(
            text_config=T5GEMMA2, mm_tokens_per_image=4, boi_token_index=129,
            eoi_token_index=131, image_token_index=130, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14))),
    "VaultGemma": dict(attn_implementation="eager"),
    "VoxtralRealtime-encoder": dict(sliding_window=8),
    "Xcodec2": CODEC,
    "Zamba2": dict(
        layers_block_type=["mamba", "hybrid"], use_mem_rope=True, n_mamba_heads=4,
        mamba_d_state=8),
    "Zaya": dict(num_experts_per_tok=1),
    **{family: MLA for family in MLA_FAMILIES},
    **{f"{family}-halves": dict(MLA, rope_interleave=False)
       for family in ("AXK1", "Glm4MoeLite", "Mistral4", "Youtu")},
    "Dots3NoteText": dict(  # an indexed and a sliding-window layer, each MLA of its own size
        MLA, head_dim=16, layer_types=["indexed_attention", "sliding_attention"],
        sliding_window=8, shared_experts_intermediate_size=32, swa_num_attention_heads=4,
        swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=16,
        swa_qk_nope_head_dim=8, swa_v_head_dim=8),
}
"""Family -> the settings its tiny config needs besides :data:`COMMON` (``None``: left unset):
a full-attention layer for the hybrid families, sections summing to half the rotary dim for
the multimodal ones, eager attention where the family has no sdpa path, tiny vision, audio,
encoder and decoder sub-configs where the defaults are full size, RoPE switched on where it is
off by default (Zamba2, GraniteMoeHybrid) or a sliding layer where only those rotate (Flint); the
MLA families' ``-halves`` variants with ``rope_interleave=False`` (their attention then calls
``apply_rotary_pos_emb``)."""
VARIANTS = {f"{family}-halves": family for family in ("AXK1", "Glm4MoeLite", "Mistral4", "Youtu")}
"""A second configuration of a family, run through ``patch`` as the family is."""

LEFT_OUT: dict[str, list[str]] = {}
"""Folders whose modeling module defines the standard function but that are not served, by why."""


CONFIG_CLASSES = {"Qwen3OmniMoe-code2wav": "Qwen3OmniMoeCode2WavConfig",
                  "Qwen2_5Omni-dit": "Qwen2_5OmniDiTConfig"}
"""Family -> the class of its configuration module to build the config with, where its
``model_type`` is not registered."""
MODEL_CLASSES = {
    "Dots3Note": "Dots3NoteAudioModel",
    "Dots3NoteText": "Dots3NoteTextModel",
    "GlmAsr": "GlmAsrEncoder",
    "Evolla": "EvollaModel",
    "Lasr": "LasrEncoder",
    "Mimi": "MimiEncoderModel",
    "MiniMaxM3VL": "MiniMaxM3VLTextModel",
    "Nemotron3_5Transcribe": "Nemotron3_5TranscribeAsrAudioModel",
    "Nemotron3_5Transcribe-timestamps": "Nemotron3_5TranscribeWordTimestampModel",
    "Nemotron3Diarization": "Nemotron3DiarizationAudioModel",
    "NeuCodec": "NeuCodecDecoder",
    "PocketTTSAudioTokenizer": "PocketTTSAudioTokenizerEncoderModel",
    "Xcodec2": "Xcodec2Decoder",
    "DeepseekOcr2": "DeepseekOcr2TextModel",
    "DeepseekOcr2-vision": "DeepseekOcr2VisionEncoder",
    "Emu3": "Emu3TextModel",
    "Granite4Vision": "Granite4VisionTextModel",
    "Mllama": "MllamaTextModel",
    "Qwen2_5Omni": "Qwen2_5OmniThinkerTextModel",
    "Qwen2_5Omni-dit": "Qwen2_5OmniToken2WavDiTModel",
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


def noise(*shape: int) -> torch.Tensor:
    """Random ``[BATCH, *shape]`` values: audio features, a waveform, a time series, pixels."""
    generator = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, *shape, generator=generator).to(MODEL_DEVICE)


def kyutai_ids(ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, 3]`` ids: the text token, then one token of each of two codebooks."""
    return torch.stack((ids, ids % 16, ids.flip(1) % 16), dim=-1)


INPUTS: dict[str, Callable[[torch.Tensor], dict]] = {
    "DeepseekOcr2-vision": lambda ids: dict(inputs_embeds=embeds(ids), num_patches=8),
    "Dia": lambda ids: dict(input_ids=ids, decoder_input_ids=torch.stack((ids, ids.flip(1)), -1)),
    "Dots3Note": lambda ids: dict(  # 8 frames a token; the second chunk's last 2 tokens padding
        input_features=noise(16, 8 * TOKENS),
        chunk_sample_lengths=torch.tensor([8 * TOKENS, 8 * TOKENS - 16], device=ids.device) * 160),
    "Evolla": lambda ids: dict(  # a protein sequence for its encoder, which rotates too
        input_ids=ids, protein_input_ids=ids % 27 + 5, protein_attention_mask=torch.ones_like(ids)),
    "GlmAsr": lambda ids: dict(input_features=noise(16, 2 * TOKENS)),
    "Idefics": lambda ids: dict(
        input_ids=ids, pixel_values=noise(1, 3, 28, 28),
        image_attention_mask=torch.ones(*ids.shape, 1, dtype=torch.long, device=ids.device)),
    "KyutaiSpeechToText": lambda ids: dict(input_ids=kyutai_ids(ids)),
    "Lasr": lambda ids: dict(input_features=noise(4 * TOKENS + 9, 16)),  # two strided convs
    "Mimi": lambda ids: dict(input_values=noise(1, 4 * TOKENS)),
    "Nemotron3_5Transcribe": lambda ids: dict(input_features=noise(2 * TOKENS, 16)),
    "Nemotron3_5Transcribe-timestamps": lambda ids: dict(inputs_embeds=embeds(ids)[:, ::2]),
    "Nemotron3Diarization": lambda ids: dict(input_features=noise(2 * TOKENS, 16)),
    "NeuCodec": lambda ids: dict(hidden_states=noise(TOKENS, 96)),
    "Pixtral": lambda ids: dict(  # two images of 4 x 3 and 3 x 2 patches, in one sequence
        pixel_values=noise(3, 56, 42), image_sizes=torch.tensor([[56, 42], [42, 28]])),
    "PocketTTSAudioTokenizer": lambda ids: dict(input_values=noise(1, 4 * TOKENS)),
    "TimesFm2_5": lambda ids: dict(past_values=noise(4 * TOKENS)),
    "Xcodec2": lambda ids: dict(hidden_states=noise(TOKENS, 96)),
    "Qwen2_5Omni-dit": lambda ids: dict(  # a mel frame a token, half as many codes
        hidden_states=noise(TOKENS, 8), condition_vector=noise(10, 8),
        speaker_embedding=noise(TOKENS, 16), quantized_code=ids[:, :TOKENS // 2] % 32,
        time_step=torch.tensor(0.5, device=ids.device), apply_cfg=False),
    "Qwen3OmniMoe-code2wav": lambda ids: dict(inputs_embeds=embeds(ids)),
    "Qwen3OmniMoe-talker": lambda ids: dict(inputs_embeds=embeds(ids)),
    "T5Gemma": lambda ids: dict(input_ids=ids, decoder_input_ids=ids.flip(1)),
    "T5Gemma2": lambda ids: dict(input_ids=ids, decoder_input_ids=ids.flip(1)),
    "VoxtralRealtime": lambda ids: dict(input_ids=ids, t_cond=embeds(ids)[:1, :1]),
    "VoxtralRealtime-encoder": lambda ids: dict(inputs_embeds=embeds(ids)),
}
"""Family -> its model's inputs, made from the ids (otherwise ``input_ids`` alone): an
encoder-decoder's decoder ids (Dia's: two codebook channels), Voxtral realtime's time
conditioning, embeddings for a model without ids; random audio features, waveforms, pixels and
time series for the audio, image and time-series encoders."""
OTHER_CALLERS = {
    "DeepseekOcr2-vision": "DeepseekOcr2",
    "Nemotron3_5Transcribe-timestamps": "Nemotron3_5Transcribe",
    "Qwen2_5Omni-dit": "Qwen2_5Omni",
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


FAMILIES = {**STANDARD_FAMILIES, **MLA_FAMILIES,
            **{family: (folder, attention)
               for family, (folder, attention, _) in PAIR_FAMILIES.items()}}


def family_of(name: str) -> str:
    """The family of a test case: itself, or the family of a variant or another caller."""
    return VARIANTS.get(name) or OTHER_CALLERS.get(name) or name


def folder_of(family: str) -> str:
    return FAMILIES[family_of(family)][0]


class EsmFold2Atoms(torch.nn.Module):
    """ESMFold 2's caller of the function: its atom encoder (sliding-window attention rotated by
    a 3-D RoPE of each atom's reference coordinates and group id, per-atom cos and sin), tiny,
    run on random atoms: 12 atoms in 4 groups, coordinates and features drawn once."""

    def __init__(self):
        super().__init__()
        configuration = importlib.import_module("transformers.models.esmfold2.configuration_esmfold2")
        config = configuration.EsmFold2Config()
        config._attn_implementation = "sdpa"
        atoms = configuration.EsmFold2AtomEncoderConfig(
            hidden_size=32, output_dim=32, num_hidden_layers=2, num_attention_heads=2,
            head_dim=16, intermediate_size=64, num_spatial_rope_pairs_per_axis=1,
            num_uid_rope_pairs=4)  # 7 rotated pairs of 8: one left at angle 0
        self.encoder = modeling("esmfold2").EsmFold2AtomEncoder(config, atoms)
        generator = torch.Generator().manual_seed(8)
        self.register_buffer("atoms", torch.randn(BATCH, TOKENS, 32, generator=generator))
        self.register_buffer("features", torch.randn(BATCH, TOKENS, 32, generator=generator))
        self.register_buffer("coordinates", torch.randn(BATCH, TOKENS, 3, generator=generator) * 5)
        self.register_buffer("groups", torch.arange(TOKENS).div(3, rounding_mode="floor")
                             .expand(BATCH, TOKENS).contiguous())

    def forward(self, input_ids):
        rope = self.encoder.rotary_emb(self.coordinates, self.groups, dtype=self.atoms.dtype)
        mask = torch.ones(BATCH, TOKENS, dtype=torch.bool, device=self.atoms.device)
        return self.encoder(self.atoms, self.features, None, rope, mask, self.groups,
                            TOKENS // 3)[1]


def tiny_model(family: str) -> torch.nn.Module:
    """The family's text model (no head; or the model of :data:`OTHER_CALLERS`) from a tiny
    config, random weights, float32, in eval mode (dropout and router jitter off; gradients
    still flow); ESMFold 2's atom encoder (:class:`EsmFold2Atoms`)."""
    if family == "EsmFold2":
        torch.manual_seed(0)
        return EsmFold2Atoms().float().eval().to(MODEL_DEVICE)
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
    if not isinstance(out, torch.Tensor):  # a codec's decoder returns the waveform itself
        out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden = out
    hidden.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


PARAMS = [pytest.param(family, id=family) for family in [*FAMILIES, *VARIANTS]] + [
    pytest.param(folder, id=f"{folder}-left-out", marks=pytest.mark.skip(reason=reason))
    for reason, folders in LEFT_OUT.items() for folder in folders
]


def check_patched_equals_unpatched(family, monkeypatch, rebind):
    """Outputs and every gradient of ``family``'s tiny model, before and after ``rebind(model,
    module)``, are the same, and so are the q and k of each call of the module's RoPE functions
    (a call whose result reaches no output, such as an indexer's, is compared too), with at
    least one call to our functions after."""
    model = tiny_model(family)
    module = modeling(folder_of(family))
    names = [name for name in hf.SUPPORTED_MODELS[family_of(family)][2] if hasattr(module, name)]
    originals = {name: getattr(module, name) for name in names}
    theirs, ours = [], []
    for name, original in originals.items():
        monkeypatch.setattr(module, name, recording(original, theirs))
    expected = step(model, family)
    for name, original in originals.items():
        monkeypatch.setattr(module, name, original)  # and put back whatever happens
    monkeypatch.setattr(hf, "_originals", {})
    monkeypatch.setattr(hf, "_holders", weakref.WeakKeyDictionary())
    calls = []
    real = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rebind(model, module)
    replaced = {name: hf._replacement(name, originals[name]) for name in names}
    for name in names:
        assert getattr(module, name) is replaced[name]
        setattr(module, name, recording(replaced[name], ours))
    try:
        hidden, grads = step(model, family)
    finally:
        for name in names:
            setattr(module, name, replaced[name])
    assert calls, "the patched model made no RoPE call"
    assert len(ours) == len(theirs) == len(calls)
    for index, (got, want) in enumerate(zip(ours, theirs)):
        for part, (ours_t, theirs_t) in zip("qk", zip(got, want)):
            torch.testing.assert_close(ours_t, theirs_t, msg=f"call {index}, {part}", **SAME)
    torch.testing.assert_close(hidden, expected[0], **SAME)
    assert grads.keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, msg=name, **SAME)
    return model, originals


def recording(function, calls: list):
    """``function``, keeping each call's (q, k) result in ``calls``."""
    def record(*args, **kwargs):
        result = function(*args, **kwargs)
        calls.append(tuple(t.detach() for t in result))
        return result
    return record


@pytest.mark.parametrize("family", PARAMS)
def test_patched_family_gives_the_same_outputs_and_gradients(family, monkeypatch):
    def rebind(model, module):
        assert hf.patch(model) is model

    model, originals = check_patched_equals_unpatched(family, monkeypatch, rebind)
    hf.unpatch(model)
    module = modeling(folder_of(family))
    assert {name: getattr(module, name) for name in originals} == originals


@pytest.mark.parametrize("caller", sorted(OTHER_CALLERS))
def test_other_callers_of_the_function_give_the_same_outputs_and_gradients(caller, monkeypatch):
    """A model holding only another caller is not one that ``patch`` serves (it looks for the
    family's text attention), so the rebinding that ``patch`` makes is made directly."""
    check_patched_equals_unpatched(
        caller, monkeypatch,
        lambda model, module: monkeypatch.setattr(
            module, "apply_rotary_pos_emb",
            hf._replacement("apply_rotary_pos_emb", module.apply_rotary_pos_emb)),
    )


def test_left_out_families_are_not_listed():
    folders = {folder for folder, _ in FAMILIES.values()}
    for left in LEFT_OUT.values():
        assert not folders & set(left)
    assert set(OTHER_CALLERS.values()) | set(VARIANTS.values()) <= set(FAMILIES)


@pytest.mark.parametrize("family", ["GlmAsr", "Nemotron3_5Transcribe", "Nemotron3Diarization"])
def test_a_module_function_taking_position_ids_keeps_its_signature(family):
    """These modules' own ``apply_rotary_pos_emb`` takes ``position_ids`` fifth (unused):
    patched, a caller passing it by position (with ``unsqueeze_dim`` sixth) gets the module's
    own results, not a refused ``unsqueeze_dim``; unpatch restores the module's function."""
    model = tiny_model(family)
    module = modeling(folder_of(family))
    own = module.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=gen), torch.randn(2, 5, 2, 16, generator=gen)
    angles = torch.rand(2, 5, 8, generator=gen) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    position_ids = torch.arange(5).expand(2, 5)
    hf.patch(model)
    try:
        patched = module.apply_rotary_pos_emb
        assert patched is not own
        got = patched(q, k, cos, sin, position_ids, 2)
    finally:
        hf.unpatch(model)
    assert module.apply_rotary_pos_emb is own
    for x, out in zip((q, k), got):
        x64, c, s = x.double(), cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        half = x64.shape[-1] // 2
        rotated = torch.cat((-x64[..., half:], x64[..., :half]), -1)
        assert_matches(out, x64 * c + rotated * s, torch.float32)

