"""``rope_dispatch.tables.from_hf_config`` on configs as they come from a Hub ``config.json``
(a plain namespace of its fields, or a transformers 4 config), against transformers 5.23,
which converts such fields when it builds its own config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from rope_dispatch.errors import RoPEError
from rope_dispatch.tables import from_hf_config

# a transformers 4 Gemma 3 config.json's rotary fields (Gemma 3 4B's, smaller)
GEMMA3_FIELDS = {
    "head_dim": 32, "hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 6,
    "max_position_embeddings": 8192, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 8.0}, None])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_transformers_4_gemma3_fields_per_layer_type(layer_type, scaling):
    """rope_theta and rope_scaling serve the full-attention layers, rope_local_base_freq the
    sliding ones, as transformers' Gemma 3 config converts them; cos and sin equal its rotary
    module's (CPU) for the converted config."""
    fields = dict(GEMMA3_FIELDS, rope_scaling=scaling)
    length = 64
    hf = Gemma3TextConfig(**fields)
    module = Gemma3RotaryEmbedding(hf)
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None],
                      layer_type=layer_type)
    f = from_hf_config(SimpleNamespace(**fields), length, layer_type=layer_type)
    cache = f.cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin[0], rtol=0, atol=2e-6)
    # and the float64 formula: theta ** (-2k / d), over the linear factor for global layers
    theta, factor = (1e4, 1.0) if layer_type == "sliding_attention" else (
        1e6, 8.0 if scaling else 1.0)
    pairs = torch.arange(16, dtype=torch.float64)
    rates = theta ** (-2 * pairs / 32) / factor
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)
    with pytest.raises(RoPEError, match=r"per layer type \('sliding_attention', "
                                        r"'full_attention'\); pass layer_type="):
        from_hf_config(SimpleNamespace(**fields), length)
