"""``rope_dispatch.tables.from_hf_config`` on a config.json's fields (a dict or a namespace)
that lack a field: read as transformers' config class of its ``model_type`` sets it (its
default, or a value derived from the other fields), against that class's rotary embedding."""

from __future__ import annotations

import importlib
import json
import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rope_dispatch.tables import from_hf_config

KINDS = [dict, lambda fields: SimpleNamespace(**fields)]


def _built(raw: dict, rotary: bool = True):
    """transformers' config of ``raw`` and its rotary embedding (``None`` without ``rotary``),
    or a skip naming the version where this transformers has no such class or refuses the
    fields."""
    try:
        cls = transformers.CONFIG_MAPPING[raw["model_type"]]
    except KeyError:
        pytest.skip(f"transformers {transformers.__version__} has no {raw['model_type']}")
    try:
        hf = cls(**json.loads(json.dumps(raw)))
    except Exception as error:
        pytest.skip(f"transformers {transformers.__version__}'s {cls.__name__} refuses {raw}: "
                    f"{error}")
    if not rotary:
        return hf, None
    module = importlib.import_module(cls.__module__.replace(".configuration_", ".modeling_"))
    embedding = next(getattr(module, name) for name in dir(module)
                     if name.endswith("RotaryEmbedding"))
    return hf, embedding(hf)


def _rates(theta: float, dim: int) -> torch.Tensor:
    """float64 ``theta ** (-2k / dim)``."""
    return theta ** (-2 * torch.arange(dim // 2, dtype=torch.float64) / dim)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_type, layer_type", [
    ("gemma", None), ("gemma2", None), ("gemma3_text", "full_attention"),
    ("gemma3_text", "sliding_attention"), ("neomme", "full_attention"),
    ("neomme", "sliding_attention"),
])
def test_gemma_head_dim_default_without_head_dim(model_type, layer_type, kind):
    """Gemma's configs default head_dim (256; NeoMME's 64) whatever the width: a config.json
    without head_dim was read as hidden_size // num_attention_heads (288 here)."""
    raw = {"model_type": model_type, "hidden_size": 2304, "num_attention_heads": 8}
    hf, rotary = _built(raw)
    assert hf.head_dim != 2304 // 8
    f = from_hf_config(kind(raw), 16, layer_type=layer_type)
    name = "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
    torch.testing.assert_close(f.inv_freq, getattr(rotary, name), rtol=4e-7, atol=0)
    parameters = hf.rope_parameters if layer_type is None else hf.rope_parameters[layer_type]
    dim = int(hf.head_dim * parameters.get("partial_rotary_factor", 1.0))
    torch.testing.assert_close(f.inv_freq.double(), _rates(parameters["rope_theta"], dim),
                               rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_type", [
    "deepseek_v32", "glm_moe_dsa", "longcat_flash", "bailing_hybrid", "hy_v4", "axk2"])
def test_partial_factor_applies_to_the_class_head_dim(model_type, kind):
    """These configs set head_dim to qk_rope_head_dim (or default it): with a partial factor and
    no head_dim, a config.json was read as hidden_size // num_attention_heads times the
    factor, where transformers rotates int(head_dim * factor) of the class's head dim."""
    raw = {"model_type": model_type, "hidden_size": 1024, "num_attention_heads": 4,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 512,
                               "partial_rotary_factor": 0.5}}
    hf, rotary = _built(raw)
    assert hf.head_dim != 1024 // 4
    f = from_hf_config(kind(raw), 16)
    assert f.rotary_dim == int(hf.head_dim * 0.5)
    torch.testing.assert_close(f.inv_freq, rotary.inv_freq, rtol=4e-7, atol=0)
    assert f.attention_factor == pytest.approx(rotary.attention_scaling)
    # float64 YaRN: pairs faster than 32 turns in 512 positions kept, slower than 1 turn
    # divided by 4, a linear ramp between (beta_fast 32, beta_slow 1)
    d = f.rotary_dim
    rates = _rates(10000.0, d)
    bound = [d * math.log(512 / (n * 2 * math.pi)) / (2 * math.log(10000.0)) for n in (32, 1)]
    low, high = max(math.floor(bound[0]), 0), min(math.ceil(bound[1]), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    want = rates / 4 * ramp + rates * (1 - ramp)
    torch.testing.assert_close(f.inv_freq.double(), want, rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [1024, 5000])  # within, then beyond the default length 2048
def test_dynamic_scaling_reads_the_class_max_position_embeddings(length, kind):
    """Llama's config defaults max_position_embeddings (2048): dynamic NTK scaling without it
    in a config.json was refused."""
    raw = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    hf, rotary = _built(raw)
    f = from_hf_config(kind(raw), length)
    rates, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=length)
    torch.testing.assert_close(f.inv_freq, rates, rtol=4e-7, atol=0)
    # float64: the base grows to theta * (factor * length / 2048 - factor + 1) ** (d / (d - 2))
    original = hf.max_position_embeddings
    base = 10000.0 * ((2.0 * length / original - 1.0) ** (64 / 62) if length > original else 1.0)
    torch.testing.assert_close(f.inv_freq.double(), _rates(base, 64), rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_own_fields_come_first(kind):
    """The config.json's own fields are read before the class's defaults (and a config of a
    model_type transformers does not know keeps hidden_size // num_attention_heads)."""
    raw = {"model_type": "gemma", "hidden_size": 2304, "num_attention_heads": 8, "head_dim": 32,
           "max_position_embeddings": 512, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}
    hf, rotary = _built(raw)
    f = from_hf_config(kind(raw), 1024)
    assert f.rotary_dim == 32
    rates, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=1024)
    torch.testing.assert_close(f.inv_freq, rates, rtol=4e-7, atol=0)
    base = 10000.0 * (2.0 * 1024 / 512 - 1.0) ** (32 / 30)
    torch.testing.assert_close(f.inv_freq.double(), _rates(base, 32), rtol=4e-7, atol=0)
    unknown = {"model_type": "no_such_model", "hidden_size": 2304, "num_attention_heads": 8}
    assert from_hf_config(kind(unknown), 16).rotary_dim == 288


@pytest.mark.parametrize("kind", KINDS)
def test_without_transformers_the_fields_are_read_as_they_are(kind, monkeypatch):
    """Where transformers cannot be imported, a missing head_dim is hidden_size //
    num_attention_heads and a missing max_position_embeddings is refused by name
    (docs/hf.md)."""
    import sys

    from rope_dispatch.errors import RoPEError

    monkeypatch.setitem(sys.modules, "transformers", None)
    raw = {"model_type": "gemma", "hidden_size": 2304, "num_attention_heads": 8}
    assert from_hf_config(kind(raw), 16).rotary_dim == 288
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(RoPEError, match=r"config has no max_position_embeddings, which "
                                        r"rope_type 'dynamic' needs"):
        from_hf_config(kind(raw), 16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
@pytest.mark.parametrize("model_type", [
    "mixtral", "longcat_flash", "bailing_hybrid", "smollm3", "qwen2_vl_text", "qwen2_5_vl"])
def test_the_class_base_without_rope_theta(model_type, scaling, kind):
    """Many configs default the base to other than 10000 (Mixtral's 1e6, LongCat-Flash's 1e7,
    Bailing-Hybrid's 6e6, SmolLM3's 2e6, Qwen2-VL's text model's 1e6): a config.json without
    rope_theta was read with 10000. (Qwen2.5-VL: its text section without a model_type.)"""
    raw = {"hidden_size": 256, "num_attention_heads": 4}
    if scaling is not None:
        raw["rope_scaling"] = scaling
    if model_type == "qwen2_5_vl":
        composite = {"model_type": model_type, "text_config": raw}
        hf, _ = _built(composite, rotary=False)
        hf = hf.get_text_config()
        module = importlib.import_module(type(hf).__module__.replace(
            ".configuration_", ".modeling_"))
        rotary = module.Qwen2_5_VLRotaryEmbedding(hf)
        given = {"model_type": model_type, "text_config": kind(raw)}
    else:
        raw["model_type"] = model_type
        hf, rotary = _built(raw)
        given = raw
    theta = hf.rope_parameters["rope_theta"]
    assert theta != 10000.0
    f = from_hf_config(kind(given), 16)
    torch.testing.assert_close(f.inv_freq, rotary.inv_freq, rtol=4e-7, atol=0)
    head_dim = getattr(hf, "head_dim", None) or 256 // 4
    dim = int(head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
    rates = _rates(theta, dim) / (2.0 if scaling else 1.0)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("model_type", [
    "gpt_neox", "phi", "stablelm", "persimmon", "glm", "glm4", "nemotron", "qwen3_next",
    "recurrent_gemma", "bamba"])
def test_the_class_partial_factor_without_one(model_type, dynamic, kind):
    """These configs default a partial rotary factor (GPT-NeoX's and StableLM's 0.25, Phi's,
    Persimmon's and GLM's 0.5, ...): a config.json without one (nor rotary_pct) rotated every
    channel of the head."""
    raw = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4,
           "rope_theta": 10000.0, "max_position_embeddings": 2048}
    if dynamic:
        if model_type == "recurrent_gemma":
            pytest.skip("RecurrentGemma's rotary embedding refuses rope types but default")
        raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    hf, rotary = _built(raw)
    partial = hf.rope_parameters["partial_rotary_factor"]
    assert partial < 1.0
    length = 5000 if dynamic else 16
    f = from_hf_config(kind(raw), length)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=length) if dynamic else (
        rotary.inv_freq, None)
    torch.testing.assert_close(f.inv_freq, want, rtol=4e-7, atol=0)
    head_dim = getattr(hf, "head_dim", None) or 256 // 4
    dim = int(head_dim * partial)
    base = 10000.0 * ((2.0 * length / 2048 - 1.0) ** (dim / (dim - 2)) if dynamic else 1.0)
    torch.testing.assert_close(f.inv_freq.double(), _rates(base, dim), rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("theta", [None, 500_000.0])
@pytest.mark.parametrize("model_type", [
    "apertus", "cwm", "gpt_oss", "openai_privacy_filter", "ministral3", "mistral4",
    "mistral_large4_text"])
def test_the_class_scaling_without_rope_parameters(model_type, theta, kind):
    """These configs default scaled rope parameters (Apertus's and CWM's Llama 3, GPT-OSS's and
    the Mistral 3/4 configs' YaRN): a config.json without rope_parameters or rope_scaling was
    read with the default rates (of the wrong base too), no attention factor."""
    from test_tables_hf import formula_rates

    raw = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4}
    if theta is not None:
        raw["rope_theta"] = theta
    hf, rotary = _built(raw)
    parameters = hf.rope_parameters
    assert parameters["rope_type"] != "default"
    f = from_hf_config(kind(raw), 16)
    torch.testing.assert_close(f.inv_freq, rotary.inv_freq, rtol=4e-7, atol=0)
    assert f.attention_factor == pytest.approx(rotary.attention_scaling)
    head_dim = getattr(hf, "head_dim", None) or 256 // 4
    dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
    rates = torch.tensor(formula_rates(parameters["rope_type"], parameters, dim,
                                       hf.max_position_embeddings, 16), dtype=torch.float64)
    # (YaRN's ramp is float32 arithmetic, as in transformers: a few float32 steps apart)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=3e-6, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("model_type", [
    "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "hy_v4", "bailing_hybrid",
    "mistral_large4_text", "unlimited_ocr_text", "deepseek_ocr2_text"])
def test_a_head_dim_the_class_replaces(model_type, partial, kind):
    """These configs set head_dim to qk_rope_head_dim whatever the fields say (their rotary
    embeddings read it): a config.json's own head_dim was read instead where it gives no
    qk_rope_head_dim (the class's 64) or gives a partial factor (a quarter of the rotated
    channels here)."""
    raw = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4,
           "head_dim": 16}
    if partial:
        raw["qk_rope_head_dim"] = 64
        raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 512,
                                  "partial_rotary_factor": 0.5}
    hf, rotary = _built(raw)
    assert hf.head_dim != 16
    f = from_hf_config(kind(raw), 16)
    torch.testing.assert_close(f.inv_freq, rotary.inv_freq, rtol=4e-7, atol=0)
    parameters = hf.rope_parameters
    dim = int(hf.head_dim * parameters.get("partial_rotary_factor", 1.0))
    assert f.rotary_dim == dim
    if parameters["rope_type"] == "default":
        torch.testing.assert_close(f.inv_freq.double(), _rates(parameters["rope_theta"], dim),
                                   rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize("field, value", [("head_dim", 32), ("attention_head_dim", 32), (None, 0)])
def test_zamba2_head_dim_field_is_kept(field, value, installed, kind, monkeypatch):
    """Zamba 2's config derives attention_head_dim (head_dim's alias) as 2 * hidden_size //
    num_attention_heads only where none is given, and its rotary embedding reads it: a
    config.json's own was replaced by the derived 128 here, with or without transformers."""
    import sys

    raw = {"model_type": "zamba2", "hidden_size": 256, "num_attention_heads": 4}
    if field is not None:
        raw[field] = value
    hf, rotary = _built(raw)
    if not installed:
        monkeypatch.setitem(sys.modules, "transformers", None)
    f = from_hf_config(kind(raw), 16)
    torch.testing.assert_close(f.inv_freq, rotary.inv_freq, rtol=4e-7, atol=0)
    dim = 2 * 256 // 4 if field is None else value
    torch.testing.assert_close(f.inv_freq.double(), _rates(hf.rope_parameters["rope_theta"], dim),
                               rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [16, 8000])  # short factors, then long ones (beyond 4096)
def test_phi4_multimodal_original_length_default(length, kind):
    """Phi-4-multimodal's config defaults original_max_position_embeddings to 4096 (and
    max_position_embeddings to 131072): a config.json's LongRoPE without it read the original
    length as 131072, so a factor of 1 and no attention factor (transformers': 32, and
    sqrt(1 + ln 32 / ln 4096)), and the short factors beyond 4096 positions."""
    raw = {"model_type": "phi4_multimodal", "hidden_size": 256, "num_attention_heads": 4,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.5] * 32,
                            "long_factor": [3.0] * 32}}
    hf, _ = _built(raw, rotary=False)
    assert hf.max_position_embeddings != hf.original_max_position_embeddings
    rates, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=length)
    f = from_hf_config(kind(raw), length)
    torch.testing.assert_close(f.inv_freq, rates, rtol=4e-7, atol=0)
    assert f.attention_factor == pytest.approx(attention)
    original = hf.original_max_position_embeddings
    factor = hf.max_position_embeddings / original
    assert f.attention_factor == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(original)))
    per_pair = 3.0 if length > original else 1.5
    torch.testing.assert_close(f.inv_freq.double(), _rates(10000.0, 64) / per_pair,
                               rtol=4e-7, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_type, section, rotary", [
    ("qwen2_5_omni", ("thinker_config", "text_config"), "Qwen2_5OmniRotaryEmbedding"),
    ("qwen3_omni_moe", ("thinker_config", "text_config"), "Qwen3OmniMoeThinkerTextRotaryEmbedding"),
    ("gemma3", ("text_config",), "Gemma3RotaryEmbedding")])
def test_a_text_section_deep_in_a_composite(model_type, section, rotary, kind):
    """A composite's text section without a model_type is built as the composite builds it
    (Qwen Omni's in its thinker's text_config, whose class is no sub-config of the composite's
    own): it was read with no class defaults (Qwen2.5-Omni's base 1e6 as 10000)."""
    text = {"hidden_size": 1024, "num_attention_heads": 4}
    raw = {"model_type": model_type}
    given = {"model_type": model_type}
    inner, inner_given = raw, given
    for name in section[:-1]:
        inner[name], inner_given[name] = {}, {}
        inner, inner_given = inner[name], inner_given[name]
    inner[section[-1]] = text
    inner_given[section[-1]] = text
    hf, _ = _built(raw, rotary=False)
    hf = hf.get_text_config()
    parameters = hf.rope_parameters
    layer_type = None
    if "full_attention" in parameters:
        layer_type, parameters = "full_attention", parameters["full_attention"]
    assert parameters["rope_theta"] != 10000.0 or hf.head_dim != 1024 // 4

    def wrap(fields):
        return kind({key: wrap(value) if isinstance(value, dict) else value
                     for key, value in fields.items()})

    f = from_hf_config(wrap(given), 16, layer_type=layer_type)
    head_dim = getattr(hf, "head_dim", None) or 1024 // 4
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    embedding = getattr(module, rotary)(hf)
    want = getattr(embedding, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq")
    torch.testing.assert_close(f.inv_freq, want, rtol=4e-7, atol=0)
    torch.testing.assert_close(f.inv_freq.double(), _rates(parameters["rope_theta"], head_dim),
                               rtol=4e-7, atol=0)
