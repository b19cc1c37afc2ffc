"""The model families whose attention calls its modeling module's standard
``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, served by
:func:`rope_dispatch.integrations.hf.patch` as Llama is (docs/hf.md, "What is supported").

A family is listed when, in transformers 5.23.0, (1) its modeling module defines
``apply_rotary_pos_emb`` with that signature computing ``x * cos + rotate_half(x) * sin`` on q and
k, with ``rotate_half`` the half-swap ``cat(-x2, x1)``, optionally on the first ``cos.shape[-1]``
channels only with the rest passed through (partial rotary), optionally in float32 or cast back
to q's dtype; (2) every class of the module that calls it passes q and k with per-token
``[b, s, d2]`` cos and sin (or cos and sin our call reads the same way: NeuCodec's and
XCodec2's one row per head with ``unsqueeze_dim=2``, Pixtral's ``[s, d2]`` with
``unsqueeze_dim=0``); and (3) a tiny random model of the family from its config gives the
same outputs and gradients patched and unpatched (tests/test_hf_families.py: where the family's
default model is multimodal or full size, its text model from a text sub-config or text model
class; another model of the module whose attention calls the function too, such as a vision or
audio encoder on random embeddings, run the same way; audio, image and time-series encoders on
random features, waveforms, pixels and series). A family that passed the first two but could
not be run cheaply would be left out (tests/test_hf_families.py's ``LEFT_OUT``, docs/hf.md);
in 5.23.0 none is.
"""

from __future__ import annotations

STANDARD_FAMILIES: dict[str, tuple[str, str]] = {
    "Afmoe": ("afmoe", "AfmoeAttention"),
    "Apertus": ("apertus", "ApertusAttention"),
    "Arcee": ("arcee", "ArceeAttention"),
    "Aria": ("aria", "AriaTextAttention"),
    "Bamba": ("bamba", "BambaAttention"),
    "Beam": ("beam", "BeamAttention"),
    "BitNet": ("bitnet", "BitNetAttention"),
    "Chameleon": ("chameleon", "ChameleonAttention"),
    "CohereCompass": ("cohere_compass", "CohereCompassAttention"),
    "Cosmos3Edge": ("cosmos3_edge", "Cosmos3EdgeTextAttention"),
    "Csm": ("csm", "CsmAttention"),
    "Cwm": ("cwm", "CwmAttention"),
    "Dbrx": ("dbrx", "DbrxAttention"),
    "DeepseekOcr2": ("deepseek_ocr2", "DeepseekOcr2TextAttention"),
    "Dia": ("dia", "DiaSelfAttention"),
    "DiffLlama": ("diffllama", "DiffLlamaAttention"),
    "Doge": ("doge", "DogeAttention"),
    "Dots1": ("dots1", "Dots1Attention"),
    "Dots3Note": ("dots3_note", "Dots3NoteAudioAttention"),
    "EmbeddingGemma2": ("embedding_gemma2", "EmbeddingGemma2Attention"),
    "Emu3": ("emu3", "Emu3Attention"),
    "Esm": ("esm", "EsmSelfAttention"),
    "Esmc": ("esmc", "EsmcAttention"),
    "EsmFold2": ("esmfold2", "EsmFold2AtomAttention"),
    "EuroBert": ("eurobert", "EuroBertAttention"),
    "Evolla": ("evolla", "EvollaAttention"),
    "Exaone4": ("exaone4", "Exaone4Attention"),
    "ExaoneMoe": ("exaone_moe", "ExaoneMoeAttention"),
    "Falcon": ("falcon", "FalconAttention"),
    "FalconH1": ("falcon_h1", "FalconH1Attention"),
    "FlexOlmo": ("flex_olmo", "FlexOlmoAttention"),
    "Flint": ("flint", "FlintAttention"),
    "Gemma2": ("gemma2", "Gemma2Attention"),
    "Glm4vMoe": ("glm4v_moe", "Glm4vMoeTextAttention"),
    "GlmAsr": ("glmasr", "GlmAsrAttention"),
    "GlmImage": ("glm_image", "GlmImageTextAttention"),
    "GPTNeoX": ("gpt_neox", "GPTNeoXAttention"),
    "GPTNeoXJapanese": ("gpt_neox_japanese", "GPTNeoXJapaneseAttention"),
    "GradiumPhononTTS": ("gradium_phonon_tts", "GradiumPhononTTSAttention"),
    "Granite": ("granite", "GraniteAttention"),
    "Granite4Vision": ("granite4_vision", "Granite4VisionTextAttention"),
    "GraniteDocling": ("granite_docling", "GraniteDoclingTextAttention"),
    "GraniteMoeHybrid": ("granitemoehybrid", "GraniteMoeHybridAttention"),
    "GraniteSWA": ("granite_swa", "GraniteSWAAttention"),
    "GraniteMoe": ("granitemoe", "GraniteMoeAttention"),
    "GraniteMoeSWA": ("granitemoe_swa", "GraniteMoeSWAAttention"),
    "GraniteMoeShared": ("granitemoeshared", "GraniteMoeSharedAttention"),
    "Gte": ("gte", "GteAttention"),
    "HiggsAudioV2": ("higgs_audio_v2", "HiggsAudioV2Attention"),
    "Hrm": ("hrm_text", "HrmTextAttention"),
    "HunYuanDenseV1": ("hunyuan_v1_dense", "HunYuanDenseV1Attention"),
    "HunYuanMoEV1": ("hunyuan_v1_moe", "HunYuanMoEV1Attention"),
    "HunYuanVL": ("hunyuan_vl", "HunYuanVLDenseV1Attention"),
    "HYV3": ("hy_v3", "HYV3Attention"),
    "HYV4": ("hy_v4", "HYV4Attention"),
    "HyperCLOVAX": ("hyperclovax", "HyperCLOVAXAttention"),
    "Idefics": ("idefics", "IdeficsAttention"),
    "Jais2": ("jais2", "Jais2Attention"),
    "JetMoe": ("jetmoe", "JetMoeAttention"),
    "JinaEmbeddingsV3": ("jina_embeddings_v3", "JinaEmbeddingsV3Attention"),
    "Kolibri1": ("kolibri1", "Kolibri1Attention"),
    "KyutaiSpeechToText": ("kyutai_speech_to_text", "KyutaiSpeechToTextAttention"),
    "Laguna": ("laguna", "LagunaAttention"),
    "Lasr": ("lasr", "LasrEncoderAttention"),
    "Lfm2": ("lfm2", "Lfm2Attention"),
    "Lfm2Moe": ("lfm2_moe", "Lfm2MoeAttention"),
    "Lfm3": ("lfm3", "Lfm3Attention"),
    "Mellum": ("mellum", "MellumAttention"),
    "Mimi": ("mimi", "MimiAttention"),
    "MiMoV2Flash": ("mimo_v2_flash", "MiMoV2FlashAttention"),
    "MiniMax": ("minimax", "MiniMaxAttention"),
    "MiniMaxM2": ("minimax_m2", "MiniMaxM2Attention"),
    "MiniMaxM3VL": ("minimax_m3_vl", "MiniMaxM3VLAttention"),
    "Ministral": ("ministral", "MinistralAttention"),
    "Ministral3": ("ministral3", "Ministral3Attention"),
    "Mixtral": ("mixtral", "MixtralAttention"),
    "Mllama": ("mllama", "MllamaTextSelfAttention"),
    "ModernBert": ("modernbert", "ModernBertAttention"),
    "ModernBertDecoder": ("modernbert_decoder", "ModernBertDecoderAttention"),
    "Molmo2": ("molmo2", "Molmo2Attention"),
    "Moshi": ("moshi", "MoshiAttention"),
    "MuseGlimmer": ("muse_glimmer", "MuseGlimmerTextAttention"),
    "MuseSpark": ("muse_spark", "MuseSparkTextAttention"),
    "Nemotron": ("nemotron", "NemotronAttention"),
    "Nemotron3_5Transcribe": ("nemotron3_5_transcribe", "Nemotron3_5TranscribeAttention"),
    "Nemotron3Diarization": ("nemotron3_diarization", "Nemotron3DiarizationAttention"),
    "NeoMME": ("neomme", "NeoMMEAttention"),
    "NeuCodec": ("neucodec", "NeuCodecAttention"),
    "NomicBert": ("nomic_bert", "NomicBertAttention"),
    "Olmo": ("olmo", "OlmoAttention"),
    "Olmo3": ("olmo3", "Olmo3Attention"),
    "OlmoHybrid": ("olmo_hybrid", "OlmoHybridAttention"),
    "Olmoe": ("olmoe", "OlmoeAttention"),
    "PaddleOCR": ("paddleocr_vl", "PaddleOCRAttention"),
    "Persimmon": ("persimmon", "PersimmonAttention"),
    "Phi": ("phi", "PhiAttention"),
    "Phi3": ("phi3", "Phi3Attention"),
    "Phi4Multimodal": ("phi4_multimodal", "Phi4MultimodalAttention"),
    "Phimoe": ("phimoe", "PhimoeAttention"),
    "Pixtral": ("pixtral", "PixtralAttention"),
    "PocketTTS": ("pocket_tts", "PocketTTSAttention"),
    "PocketTTSAudioTokenizer": ("pocket_tts_audio_tokenizer", "PocketTTSAudioTokenizerAttention"),
    "Qwen2Moe": ("qwen2_moe", "Qwen2MoeAttention"),
    "Qwen3_5": ("qwen3_5", "Qwen3_5Attention"),
    "Qwen3_5Moe": ("qwen3_5_moe", "Qwen3_5MoeAttention"),
    "Qwen3Next": ("qwen3_next", "Qwen3NextAttention"),
    "Qwen2_5Omni": ("qwen2_5_omni", "Qwen2_5OmniAttention"),
    "Qwen3OmniMoe": ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextAttention"),
    "RecurrentGemma": ("recurrent_gemma", "RecurrentGemmaAttention"),
    "SeedOss": ("seed_oss", "SeedOssAttention"),
    "SmolLM3": ("smollm3", "SmolLM3Attention"),
    "SolarOpen": ("solar_open", "SolarOpenAttention"),
    "StableLm": ("stablelm", "StableLmAttention"),
    "Starcoder2": ("starcoder2", "Starcoder2Attention"),
    "Step3p7": ("step3p7", "Step3p7Attention"),
    "T5Gemma": ("t5gemma", "T5GemmaSelfAttention"),
    "T5Gemma2": ("t5gemma2", "T5Gemma2SelfAttention"),
    "TimesFm2_5": ("timesfm2_5", "TimesFm2_5Attention"),
    "Ultrabert": ("ultrabert", "UltrabertAttention"),
    "UnlimitedOcr": ("unlimited_ocr", "UnlimitedOcrTextAttention"),
    "VaultGemma": ("vaultgemma", "VaultGemmaAttention"),
    "VoxtralRealtime": ("voxtral_realtime", "VoxtralRealtimeTextAttention"),
    "Xcodec2": ("xcodec2", "Xcodec2Attention"),
    "Zamba2": ("zamba2", "Zamba2Attention"),
    "Zaya": ("zaya", "ZayaAttention"),
}
"""Family -> (its folder under ``transformers.models``, the attention class that calls
``apply_rotary_pos_emb``): the modeling module is ``transformers.models.<folder>.modeling_<folder>``."""

MLA_FAMILIES: dict[str, tuple[str, str]] = {
    "DeepseekV32": ("deepseek_v32", "DeepseekV32Attention"),
    "AXK1": ("axk1", "AXK1Attention"),
    "AXK2": ("axk2", "AXK2Attention"),
    "Glm4MoeLite": ("glm4_moe_lite", "Glm4MoeLiteAttention"),
    "MiniCPM3": ("minicpm3", "MiniCPM3Attention"),
    "Mistral4": ("mistral4", "Mistral4Attention"),
    "Youtu": ("youtu", "YoutuAttention"),
    "Dots3NoteText": ("dots3_note", "Dots3NoteTextAttention"),
}
"""The multi-head latent attention families besides DeepSeek-V3, served as it is: their modeling
modules define DeepSeek-V3's ``apply_rotary_pos_emb`` and (all but MiniCPM3)
``apply_rotary_pos_emb_interleave``, and their attention calls one of them on ``q_rot`` (every
query head) and ``k_rot`` (one key head shared by all); DeepSeek-V3.2's and AXK2's indexers call
``apply_rotary_pos_emb`` too, with ``unsqueeze_dim=2``. Dots 3 Note's text model (whose audio
encoder is :data:`STANDARD_FAMILIES`' ``Dots3Note``) calls ``apply_rotary_pos_emb_interleave`` in
its attention, of full and sliding-window layers alike, and in its indexer (``unsqueeze_dim=2``).
Listed as :data:`STANDARD_FAMILIES` is, after the same check on a tiny model (both
``rope_interleave`` settings where the config has one)."""

PAIR_FAMILIES: dict[str, tuple[str, str, bool]] = {
    "Cohere": ("cohere", "CohereAttention", False),
    "Cohere2": ("cohere2", "Cohere2Attention", False),
    "Cohere2Moe": ("cohere2_moe", "Cohere2MoeAttention", False),
    "Ernie4_5": ("ernie4_5", "Ernie4_5Attention", True),
    "Ernie4_5_Moe": ("ernie4_5_moe", "Ernie4_5_MoeAttention", True),
    "Glm": ("glm", "GlmAttention", True),
    "Glm4": ("glm4", "Glm4Attention", True),
    "Helium": ("helium", "HeliumAttention", True),
    "Glm4v": ("glm4v", "Glm4vTextAttention", False),
    "GlmOcr": ("glm_ocr", "GlmOcrTextAttention", False),
}
"""The families whose ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` rotates
interleaved pairs ``(2j, 2j+1)`` (their ``rotate_half`` is ``stack((-x[1::2], x[::2]))``):
family -> (folder, attention class, whether cos and sin come in halves). Cohere's rotary
embedding (and GLM-4V's and GLM-OCR's M-RoPE) repeats each pair's angle in place, so its cos
and sin are the per-channel values of ``RoPESpec(interleaved=True)``; the others get the
standard halves and take pair ``j``'s value from the first half
(``cos[..., :d2/2].repeat_interleave(2)``). Either form rotates the first ``cos.shape[-1]``
channels (GLM's partial rotary). Served by
:func:`~rope_dispatch.integrations.hf.apply_rotary_pos_emb_pairs` and
:func:`~rope_dispatch.integrations.hf.apply_rotary_pos_emb_pairs_of_halves` after the check on
a tiny model that :data:`STANDARD_FAMILIES` passed."""
