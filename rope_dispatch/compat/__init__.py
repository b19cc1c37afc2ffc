"""Drop-in adapters for other libraries' RoPE APIs: ``te`` (TransformerEngine 2.20.2),
``flashinfer`` (the serving engines' in-place q and k call, and FlashInfer's FP8 prologue:
``rope_quantize_fp8`` and its paged-KV-cache append) and ``vllm`` (vLLM's
``rotary_embedding`` and ``fused_qk_norm_rope`` ops)."""
