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


def _assert_gemma3_rates(f, cos, sin, layer_type, scaling) -> None:
    """``f``'s cos and sin equal transformers' ``cos`` and ``sin`` (CPU), and its rates the
    float64 formula theta ** (-2k / d): 1e4 on sliding layers, 1e6 over the linear factor on
    global ones (GEMMA3_FIELDS' head dim, 32)."""
    cache = f.cos_sin_cache(cos.shape[1])
    torch.testing.assert_close(cache.cos, cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin[0], rtol=0, atol=2e-6)
    theta, factor = (1e4, 1.0) if layer_type == "sliding_attention" else (
        1e6, 8.0 if scaling else 1.0)
    rates = theta ** (-2 * torch.arange(16, dtype=torch.float64) / 32) / factor
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


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
    _assert_gemma3_rates(f, cos, sin, layer_type, scaling)
    with pytest.raises(RoPEError, match=r"per layer type \('sliding_attention', "
                                        r"'full_attention'\); pass layer_type="):
        from_hf_config(SimpleNamespace(**fields), length)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("composite", [False, True])
@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 8.0}, None])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma3_fields_without_a_local_base_are_split_per_layer_type(
        layer_type, scaling, composite, kind):
    """A Gemma 3 config.json without rope_local_base_freq (nor rope_theta) is split per layer
    type all the same: transformers' Gemma 3 config gives the sliding layers its default local
    base 1e4 and the full ones its default 1e6; it was read as one flat base of 1e4."""
    import json

    from transformers import Gemma3Config

    fields = {key: value for key, value in GEMMA3_FIELDS.items()
              if key not in ("rope_local_base_freq", "rope_theta")}
    fields["rope_scaling"] = scaling
    length = 64
    if composite:  # its text section without a model_type: built as Gemma 3's text config
        raw = {"model_type": "gemma3", "text_config": fields}
        hf = Gemma3Config(**json.loads(json.dumps(raw))).get_text_config()
        given = {"model_type": "gemma3", "text_config": kind(fields)}
    else:
        raw = dict(fields, model_type="gemma3_text")
        hf = Gemma3TextConfig(**json.loads(json.dumps(raw)))
        given = raw
    cos, sin = Gemma3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32),
                                         torch.arange(length)[None], layer_type=layer_type)
    f = from_hf_config(kind(given), length, layer_type=layer_type)
    _assert_gemma3_rates(f, cos, sin, layer_type, scaling)
    # a config of another family without rope_local_base_freq stays flat
    other = dict(fields, model_type="llama")
    assert from_hf_config(kind(other), length).rope_type == ("linear" if scaling else "default")


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("family, fields, dropped, head_dim", [
    ("JetMoe", dict(hidden_size=128, num_attention_heads=4, kv_channels=64), (), 64),
    ("JetMoe", dict(hidden_size=128, num_attention_heads=4), ("kv_channels",), 128),
    ("Zamba2", dict(hidden_size=64, num_attention_heads=4), (), 32),
    ("Zamba2", dict(hidden_size=64, num_attention_heads=4),
     ("attention_head_dim", "kv_channels"), 32),
    ("Zamba2", dict(hidden_size=64, num_attention_heads=4), ("attention_head_dim",), 32),
    ("Dbrx", dict(d_model=128, n_heads=8), (), 16),
])
def test_head_dim_under_the_names_transformers_maps(family, fields, dropped, head_dim, kind):
    """A config.json keeps the fields transformers' config classes map head_dim, hidden_size
    and num_attention_heads to (JetMoe's kv_channels, default 128; Zamba 2's attention head dim,
    which its config always sets to 2 * hidden_size // num_attention_heads; DBRX's d_model and
    n_heads): hidden_size // num_attention_heads was read instead (half JetMoe's and Zamba 2's
    rates), or nothing (DBRX's refused)."""
    import importlib
    import json

    import transformers

    folder = family.lower()
    config = getattr(transformers, f"{family}Config")(**fields)
    raw = json.loads(config.to_json_string(use_diff=False))
    for name in dropped:
        raw.pop(name)
    # (DBRX's sub-configs, made again from their JSON, refuse two of its keys in transformers 5.17)
    hf = getattr(transformers, f"{family}Config")(**raw) if dropped else config
    module = getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"),
                     f"{family}RotaryEmbedding")(hf)
    f = from_hf_config(kind(raw), 16)
    torch.testing.assert_close(f.inv_freq, module.inv_freq, rtol=4e-7, atol=0)
    theta = hf.rope_parameters["rope_theta"]
    rates = theta ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("composite", [False, True])
def test_minimax_m3_rotary_dim_field_is_not_read_without_rope_parameters(kind, composite):
    """MiniMax-M3's config keeps a rotary_dim (64) that its model does not read: transformers
    rotates int(head_dim * partial_rotary_factor) = 128 channels. A config.json with rope_theta
    and no rope_parameters had it read as GPT-J's rotated channels (half the rates)."""
    import json

    import transformers
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLRotaryEmbedding,
    )

    fields = json.loads(transformers.MiniMaxM3VLTextConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, rotary_dim=64,
    ).to_json_string(use_diff=False))
    theta = fields.pop("rope_parameters")["rope_theta"]
    fields["rope_theta"] = theta
    module = MiniMaxM3VLRotaryEmbedding(transformers.MiniMaxM3VLTextConfig(**fields))
    if composite:  # its text section without a model_type
        fields.pop("model_type")
        fields = {"model_type": "minimax_m3_vl", "text_config": kind(fields)}
    f = from_hf_config(kind(fields), 16)
    torch.testing.assert_close(f.inv_freq, module.inv_freq, rtol=4e-7, atol=0)
    rates = theta ** (-2 * torch.arange(64, dtype=torch.float64) / 128)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("model_type, family", [
    ("deepseek_v3", "DeepseekV3"), ("glm4_moe_lite", "Glm4MoeLite"), ("minicpm3", "MiniCPM3")])
def test_latent_attention_partial_factor_applies_to_the_rope_head_dim(model_type, family, kind):
    """These configs always set head_dim to qk_rope_head_dim (GLM-4.7-Flash's maps it there), so
    transformers' rotary dim is int(qk_rope_head_dim * partial_rotary_factor). A config.json
    with a partial factor and no head_dim was read as hidden_size // num_attention_heads times
    the factor: other rates, or a YaRN dim refused as odd."""
    import importlib
    import json

    import transformers

    raw = json.loads(getattr(transformers, f"{family}Config")(
        hidden_size=256, num_attention_heads=4, qk_rope_head_dim=32, qk_nope_head_dim=32,
    ).to_json_string(use_diff=False))
    raw.pop("head_dim", None)
    raw["rope_parameters"].update(rope_type="yarn", factor=4.0, partial_rotary_factor=0.5,
                                  original_max_position_embeddings=512)
    hf = getattr(transformers, f"{family}Config")(**json.loads(json.dumps(raw)))
    module = getattr(importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"), f"{family}RotaryEmbedding")(hf)
    f = from_hf_config(kind(raw), 16)
    assert f.rotary_dim == 16
    torch.testing.assert_close(f.inv_freq, module.inv_freq, rtol=4e-7, atol=0)
    assert f.attention_factor == pytest.approx(module.attention_scaling)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("family, fields", [
    ("ModernBert", dict(global_rope_theta=80_000.0, local_rope_theta=5_000.0)),
    ("ModernBert", {}),
    ("ModernBertDecoder", dict(global_rope_theta=80_000.0)),
    ("Olmo3", dict(rope_theta=12_345.0)),
    ("Olmo3", {}),
    ("Gemma3Text", dict(rope_theta=12_345.0, rope_local_base_freq=5_000.0)),
    ("NeoMME", dict(rope_theta=12_345.0, partial_rotary_factor=0.5)),
    ("NeoMME", {}),
])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"type": "linear", "factor": 2.0}])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_flat_fields_split_per_layer_type_as_transformers_splits_them(
        family, fields, scaling, layer_type, kind):
    """A transformers 4 config.json of a model whose transformers 5.23 config splits its rope
    fields per layer type: ModernBERT's global_rope_theta and local_rope_theta (defaults 160000
    and 10000, its rope_scaling serving both), Olmo 3's rope_theta for the full layers (the
    sliding ones keep the default 500000), Gemma 3's too. ModernBERT's and Olmo 3's were read as
    flat (one base, 10000, for every layer; a layer type refused), and a legacy {"type": ...}
    rope_scaling, which transformers leaves at its default rope type there, was applied."""
    import importlib
    import json

    import transformers

    folder = {"Gemma3Text": "gemma3", "ModernBertDecoder": "modernbert_decoder"}.get(
        family, family.lower())
    config_class = getattr(transformers, f"{family}Config")
    raw = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, **fields,
               model_type=config_class.model_type)
    if family in ("Gemma3Text", "NeoMME"):  # (their own head_dim defaults)
        raw["head_dim"] = 16
    if scaling is not None:
        if family == "NeoMME":
            pytest.skip("NeoMME's config refuses rope_scaling")
        raw["rope_scaling"] = scaling
    hf = config_class(**json.loads(json.dumps(raw)))
    rotary = getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"),
                     f"{family.removesuffix('Text')}RotaryEmbedding")(hf)
    f = from_hf_config(kind(raw), 16, layer_type=layer_type)
    torch.testing.assert_close(f.inv_freq, getattr(rotary, f"{layer_type}_inv_freq"),
                               rtol=4e-7, atol=0)
    parameters = hf.rope_parameters[layer_type]
    factor = parameters.get("factor", 1.0) if parameters["rope_type"] == "linear" else 1.0
    dim = int(16 * parameters.get("partial_rotary_factor", 1.0))  # (NeoMME's full layers: 4)
    rates = parameters["rope_theta"] ** (-2 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    rates = rates / factor
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


# --- lengths written as JSON floats ------------------------------------------------------------

def _llama3(original):
    return {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}


@pytest.mark.parametrize("parameters, max_position_embeddings, length", [
    ({"type": "dynamic", "factor": 2.0}, 4096.0, 6000),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024.0}, 4096.0, 64),
    ({"type": "yarn", "original_max_position_embeddings": 1024.0}, 4096.0, 64),  # factor 4
    ({"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [3.0] * 16,
      "original_max_position_embeddings": 1024.0}, 4096, 2000),
    (_llama3(8192.0), 4096, 64),
])
def test_whole_number_floats_are_read_as_their_ints(parameters, max_position_embeddings, length):
    """A config.json may write a length as ``4096.0``; transformers' arithmetic takes it as
    4096 (its 5.23 config warns on a float original_max_position_embeddings and keeps it)."""
    def config(lengths):
        return SimpleNamespace(head_dim=32, max_position_embeddings=lengths(
            max_position_embeddings), rope_scaling={
                k: lengths(v) if k == "original_max_position_embeddings" else v
                for k, v in parameters.items()})
    got = from_hf_config(config(lambda v: v), length)
    want = from_hf_config(config(int), length)
    assert torch.equal(got.inv_freq, want.inv_freq)
    assert got.attention_factor == want.attention_factor
    assert got.max_positions == want.max_positions


def test_llama3_float_original_length_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=16384,
                     rope_parameters=_llama3(8192.0))
    rates, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    raw = SimpleNamespace(head_dim=32, max_position_embeddings=16384,
                          rope_scaling=_llama3(8192.0))
    torch.testing.assert_close(from_hf_config(raw, 64).inv_freq, rates, rtol=5e-7, atol=0)


@pytest.mark.parametrize("config, message", [
    (SimpleNamespace(head_dim=32, max_position_embeddings=4096.5,
                     rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"config.max_position_embeddings must be a positive int \(or a float of a whole "
     r"number\), got 4096.5"),
    (SimpleNamespace(head_dim=32, max_position_embeddings=4096,
                     rope_scaling={"type": "yarn", "original_max_position_embeddings": 1024.5}),
     r"config.rope_scaling\['original_max_position_embeddings'\] must be a positive int "
     r"\(or a float of a whole number\), got 1024.5"),
    (SimpleNamespace(head_dim=32, max_position_embeddings=4096, original_max_position_embeddings=
                     float("inf"), rope_scaling=_llama3(None)),
     r"config.original_max_position_embeddings must be a positive int .*, got inf"),
    (SimpleNamespace(head_dim=32, max_position_embeddings=0.0,
                     rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"config.max_position_embeddings must be a positive int .*, got 0.0"),
])
def test_lengths_that_are_no_whole_number_are_named(config, message):
    with pytest.raises(RoPEError, match=message):
        from_hf_config(config, 8)


@pytest.mark.parametrize("length", [100, 10000])  # within, then beyond pretrained * factor
def test_te_pretrained_length_as_a_float(length):
    from rope_dispatch.compat.te import RotaryPositionEmbedding
    from rope_dispatch.tables import from_te_options

    module = RotaryPositionEmbedding(64, 1.0, 2, 4096.0)  # on the current CUDA device if any
    device = module.inv_freq.device
    f = from_te_options(64, length, seq_len_interpolation_factor=2,
                        pretrained_max_position_embeddings=4096.0, device=device)
    assert torch.equal(f.angle_table(length, device=device), module(length))
    # float64: positions times the scale, times theta ** (-2k / d)
    scale = 0.5 if length <= 8192 else 4096 / length
    rates = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = (torch.arange(length, dtype=torch.float64) * scale)[:, None] * rates
    torch.testing.assert_close(f.angle_table(length)[:, 0, 0, :32].cpu().double(), angles,
                               rtol=1e-6, atol=1e-5 * length)
    with pytest.raises(RoPEError, match=r"pretrained_max_position_embeddings must be a positive "
                                        r"int \(or a float of a whole number\), got 4096.5"):
        from_te_options(64, length, seq_len_interpolation_factor=2,
                        pretrained_max_position_embeddings=4096.5)


# --- configs whose attributes cannot be read --------------------------------------------------

def _raising(error: Exception):
    def read(self):
        raise error
    return property(read)


@pytest.mark.parametrize("name", ["rope_parameters", "rope_scaling", "head_dim", "rope_theta",
                                  "partial_rotary_factor", "get_text_config",
                                  "rope_local_base_freq"])
@pytest.mark.parametrize("error", [ValueError("no value"), KeyError("no key"),
                                   TypeError("no type")])
def test_an_attribute_that_raises_is_named(name, error):
    """A config class's property that raises (not the RuntimeError of transformers' per-layer
    attributes) escaped from_hf_config as that error, naming no field."""
    fields = {"head_dim": 64, "max_position_embeddings": 64, name: _raising(error)}
    config = type("RaisingConfig", (), fields)()
    with pytest.raises(RoPEError, match=rf"config.{name} could not be read: "
                                        rf"{type(error).__name__}: .*no ") as caught:
        from_hf_config(config, 16)
    assert caught.value.__cause__ is error


def test_get_text_config_that_raises_is_named():
    class Composite:
        head_dim, max_position_embeddings = 64, 64

        def get_text_config(self):
            raise ValueError("no text model")

    with pytest.raises(RoPEError, match=r"config.get_text_config\(\) failed: ValueError: no text"):
        from_hf_config(Composite(), 16)


# --- DeepSeek's latent attention ---------------------------------------------------------------

DEEPSEEK_V3_FIELDS = {  # DeepSeek-V3's config.json, its attention and rotary fields
    "hidden_size": 7168, "num_attention_heads": 128, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
    "rope_theta": 10000.0, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
}


@pytest.mark.parametrize("scaling", [DEEPSEEK_V3_FIELDS["rope_scaling"], None])
def test_deepseek_config_json_rotates_qk_rope_head_dim_channels(scaling):
    """A config.json of DeepSeek's MLA has no head_dim; hidden_size // num_attention_heads
    (56) was read as the rotary dim, where transformers rotates qk_rope_head_dim (64)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    fields = dict(DEEPSEEK_V3_FIELDS, rope_scaling=scaling)
    length = 64
    module = DeepseekV3RotaryEmbedding(DeepseekV3Config(**fields))
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    f = from_hf_config(SimpleNamespace(**fields), length)
    assert f.rotary_dim == 64
    cache = f.cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin[0], rtol=0, atol=2e-6)
    if scaling is None:  # float64: 10000 ** (-2k / 64)
        rates = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)
    # a partial factor given beside it is transformers' (Mistral 4's share of head_dim)
    shared = SimpleNamespace(head_dim=192, partial_rotary_factor=1 / 3, **fields)
    assert from_hf_config(shared, length).rotary_dim == 64
    with pytest.raises(RoPEError, match=r"config.qk_rope_head_dim must be a positive int, got 0"):
        from_hf_config(SimpleNamespace(**dict(fields, qk_rope_head_dim=0)), length)


# --- a config.json's dict ------------------------------------------------------------------------

class AttributeDict(dict):
    """A dict read by attribute, as hand-made config objects are: a missing key is a KeyError."""

    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("kind", [dict, AttributeDict])
@pytest.mark.parametrize("fields, layer_type", [
    (GEMMA3_FIELDS, "sliding_attention"),
    (GEMMA3_FIELDS, "full_attention"),
    (DEEPSEEK_V3_FIELDS, None),
    ({"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 2048,
      "rope_theta": 5e5, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, None),
])
def test_a_mapping_config_is_read_by_its_keys(kind, fields, layer_type):
    """json.load's dict was read by attributes only (a dict has none of them: refused as having
    no head_dim), and a dict read by attribute raised its KeyError for any field it lacks."""
    length = 3000
    want = from_hf_config(SimpleNamespace(**fields), length, layer_type=layer_type)
    got = from_hf_config(kind(fields), length, layer_type=layer_type)
    assert torch.equal(got.inv_freq, want.inv_freq)
    assert (got.attention_factor, got.rope_type) == (want.attention_factor, want.rope_type)


def test_a_mapping_config_against_float64():
    config = {"head_dim": 64, "rope_theta": 5e5, "max_position_embeddings": 1024,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    rates = 5e5 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64) / 4
    for kind in (dict, AttributeDict):
        got = from_hf_config(kind(config), 16).inv_freq.double()
        torch.testing.assert_close(got, rates, rtol=4e-7, atol=0)
    with pytest.raises(RoPEError, match=r"config must have head_dim, or hidden_size and "):
        from_hf_config(AttributeDict(rope_theta=5e5), 16)


# --- a composite config.json -----------------------------------------------------------------

@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_a_composite_config_json_is_read_through_its_text_section(kind, layer_type):
    """Gemma 3's vision-language config.json keeps its text model's fields under text_config;
    without get_text_config() (a transformers config's) the top level was read: no head_dim."""
    import json

    from transformers import Gemma3Config

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": GEMMA3_FIELDS,
           "vision_config": {"hidden_size": 64, "num_attention_heads": 4,
                             "intermediate_size": 128, "num_hidden_layers": 1}}
    length = 64
    text = Gemma3Config(**json.loads(json.dumps(raw))).get_text_config()
    cos, sin = Gemma3RotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32),
                                           torch.arange(length)[None], layer_type=layer_type)
    cache = from_hf_config(kind(raw), length, layer_type=layer_type).cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin[0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
@pytest.mark.parametrize("family, folder, rotary", [
    ("Qwen2_5Omni", "qwen2_5_omni", "Qwen2_5OmniRotaryEmbedding"),
    ("Dia", "dia", "DiaRotaryEmbedding"),
])
def test_a_config_json_read_through_the_text_config_transformers_picks(family, folder, rotary,
                                                                      kind):
    """Qwen Omni's get_text_config() is its thinker's text_config, Dia's its decoder_config:
    given as config.json fields the top level was read (no head dim: refused)."""
    import importlib
    import json

    import transformers

    config = getattr(transformers, f"{family}Config")()
    raw = json.loads(config.to_json_string(use_diff=False))
    module = getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"),
                     rotary)(config.get_text_config())

    def nested(fields):  # a namespace at every level, as a config.json parsed so would be
        return kind({k: nested(v) if isinstance(v, dict) and k.endswith("_config") else v
                     for k, v in fields.items()})

    f = from_hf_config(nested(raw), 16)
    torch.testing.assert_close(f.inv_freq, module.inv_freq, rtol=4e-7, atol=0)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    theta = text.rope_parameters["rope_theta"]
    rates = theta ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


def test_a_config_json_with_two_text_sections_is_refused():
    config = {"text_config": GEMMA3_FIELDS, "decoder": GEMMA3_FIELDS}
    with pytest.raises(RoPEError, match=r"several text sections \(decoder, text_config\)"):
        from_hf_config(config, 16, layer_type="full_attention")


# --- GPT-J's field names -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gptj", "codegen"])
def test_gptj_config_json_field_names(family):
    """GPT-J's and CodeGen's config.json name the width and head count n_embd and n_head (their
    transformers configs map them): refused as having no hidden_size before."""
    import transformers

    fields = {"n_embd": 256, "n_head": 4, "rotary_dim": 16, "n_positions": 2048}
    config_class = {"gptj": transformers.GPTJConfig, "codegen": transformers.CodeGenConfig}[family]
    hf = config_class(**fields)
    f = from_hf_config(SimpleNamespace(**fields), 16)
    assert torch.equal(f.inv_freq, from_hf_config(hf, 16).inv_freq)
    rates = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)
    with pytest.raises(RoPEError, match=r"config.rotary_dim=128 is more than the head dim 64"):
        from_hf_config(dict(fields, rotary_dim=128), 16)
    with pytest.raises(RoPEError, match=r"config.n_head must be a positive int, got 0"):
        from_hf_config(dict(fields, n_head=0), 16)
