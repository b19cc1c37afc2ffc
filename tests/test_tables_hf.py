"""``rope_dispatch.tables``' rotary families against transformers 5.23 (pinned in the ``dev`` extra).

Configs are built with transformers' own config classes (nothing is downloaded). For each family
and several parameter sets the rates and the attention factor are compared with transformers'
init functions, the cos/sin cache with what transformers' rotary module returns for float32
input and positions ``0 .. n - 1``, and the angle table with a float64 evaluation of the
family's formula written out here. The families whose rates depend on the sequence length
(dynamic NTK, LongRoPE) are checked on both sides of their switch. TE's options are compared
with ``rope_dispatch.compat.te.RotaryPositionEmbedding``.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from rope_dispatch import tables
from rope_dispatch.compat.te import RotaryPositionEmbedding
from rope_dispatch.errors import RoPEError
from rope_dispatch.tables import (
    HF_ROPE_TYPES, CosSinCache, RotaryFrequencies, from_hf_config, from_te_options,
)

FLOAT32_EPS = torch.finfo(torch.float32).eps
RATES_RTOL = 4 * FLOAT32_EPS  # "within float32 rounding": a few units in the last place


# --- configs ----------------------------------------------------------------------------------

def llama(max_position_embeddings: int = 1024, **rope_parameters) -> LlamaConfig:
    rope_parameters.setdefault("rope_theta", 10000.0)
    return LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )


def neox(partial_rotary_factor: float, hidden_size: int = 256, **rope_parameters) -> GPTNeoXConfig:
    rope_parameters.setdefault("rope_theta", 10000.0)
    rope_parameters.setdefault("rope_type", "default")
    rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    return GPTNeoXConfig(
        hidden_size=hidden_size, num_attention_heads=4, max_position_embeddings=1024,
        rope_parameters=rope_parameters,
    )


def phi3(original: int = 256, max_position_embeddings: int = 1024, **rope_parameters) -> Phi3Config:
    """A Phi-3 config (head dim 32: 16 pairs) with LongRoPE factors that differ per pair."""
    rope_parameters.setdefault("rope_type", "longrope")
    rope_parameters.setdefault("rope_theta", 10000.0)
    rope_parameters.setdefault("short_factor", [1.0 + k / 40 for k in range(16)])
    rope_parameters.setdefault("long_factor", [1.0 + k ** 1.5 / 3 for k in range(16)])
    return Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=original, rope_parameters=rope_parameters,
    )


# (id, config factory, transformers' rotary module for it, table length)
CASES = [
    ("default", lambda: llama(rope_type="default"), LlamaRotaryEmbedding, 1024),
    ("default-theta5e5-head128", lambda: LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=128, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ), LlamaRotaryEmbedding, 512),
    ("default-partial-0.25", lambda: neox(0.25), GPTNeoXRotaryEmbedding, 1024),
    ("default-partial-odd-dim", lambda: neox(0.25, hidden_size=80), GPTNeoXRotaryEmbedding, 300),
    ("linear-2", lambda: llama(rope_type="linear", factor=2.0), LlamaRotaryEmbedding, 1024),
    ("linear-8-theta1e6", lambda: llama(rope_type="linear", factor=8.0, rope_theta=1e6),
     LlamaRotaryEmbedding, 1024),
    ("linear-partial-0.5", lambda: neox(0.5, rope_type="linear", factor=4.0),
     GPTNeoXRotaryEmbedding, 1024),
    ("dynamic-within", lambda: llama(rope_type="dynamic", factor=4.0), LlamaRotaryEmbedding, 1000),
    ("dynamic-beyond", lambda: llama(256, rope_type="dynamic", factor=2.0), LlamaRotaryEmbedding, 700),
    ("yarn-4", lambda: llama(2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
     LlamaRotaryEmbedding, 1024),
    ("yarn-betas-no-truncate", lambda: llama(
        4096, rope_type="yarn", factor=8.0, original_max_position_embeddings=512, beta_fast=16.0,
        beta_slow=2.0, truncate=False, rope_theta=50000.0,
    ), LlamaRotaryEmbedding, 1024),
    ("yarn-mscale-deepseek", lambda: llama(
        4096, rope_type="yarn", factor=40.0, original_max_position_embeddings=128, mscale=0.707,
        mscale_all_dim=1.0,
    ), LlamaRotaryEmbedding, 512),
    ("yarn-mscale-equal", lambda: llama(
        2048, rope_type="yarn", factor=16.0, original_max_position_embeddings=128, mscale=1.0,
        mscale_all_dim=1.0,
    ), LlamaRotaryEmbedding, 512),
    ("yarn-mscale-alone-ignored", lambda: llama(
        2048, rope_type="yarn", factor=16.0, original_max_position_embeddings=128, mscale=2.0,
    ), LlamaRotaryEmbedding, 512),
    ("yarn-attention-factor", lambda: llama(
        2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
        attention_factor=1.5,
    ), LlamaRotaryEmbedding, 512),
    ("yarn-factor-from-lengths", lambda: llama(
        2048, rope_type="yarn", factor=None, original_max_position_embeddings=256,
    ), LlamaRotaryEmbedding, 512),
    ("yarn-partial-0.5", lambda: llama(
        2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
        partial_rotary_factor=0.5,
    ), LlamaRotaryEmbedding, 512),
    ("longrope-short", lambda: phi3(), Phi3RotaryEmbedding, 200),
    ("longrope-long", lambda: phi3(), Phi3RotaryEmbedding, 1000),
    ("longrope-factor-attention", lambda: phi3(factor=3.0, attention_factor=1.25),
     Phi3RotaryEmbedding, 600),
    ("llama3.1", lambda: LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ), LlamaRotaryEmbedding, 512),
    ("llama3-small-context", lambda: llama(
        rope_type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
        original_max_position_embeddings=512, rope_theta=500000.0,
    ), LlamaRotaryEmbedding, 1024),
]
CASE_IDS = [case[0] for case in CASES]


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    name, make_config, module_class, length = request.param
    return name, make_config(), module_class, length


def hf_rates(config, module_class, seq_len: int) -> tuple[torch.Tensor, float]:
    """transformers' rates and attention factor for a sequence of ``seq_len`` positions."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # each model defines its own default
        return module_class.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def hf_cos_sin(config, module_class, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[length, d2]`` of a fresh rotary module for positions ``0 .. length - 1``."""
    module = module_class(config)
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    return cos[0], sin[0]


def angle_rounding(length: int) -> float:
    """How far cos or sin of two float32 evaluations of the same angle (up to ``length``
    radians, rates a unit in the last place apart) may differ: a few float32 steps of it."""
    return 4 * FLOAT32_EPS * length + 1e-6


# --- transformers' rates, attention factor and rotary module ------------------------------------

def test_rates_and_attention_factor_equal_transformers(case):
    _, config, module_class, length = case
    expected_rates, expected_factor = hf_rates(config, module_class, length)
    f = from_hf_config(config, length)
    assert f.rope_type == config.rope_parameters["rope_type"]
    assert f.inv_freq.dtype == torch.float32
    torch.testing.assert_close(f.inv_freq, expected_rates, rtol=RATES_RTOL, atol=0)
    assert f.attention_factor == pytest.approx(expected_factor, rel=1e-12)


def test_cos_sin_cache_equals_transformers_rotary_module(case):
    name, config, module_class, length = case
    cos, sin = hf_cos_sin(config, module_class, length)
    cache = from_hf_config(config, length).cos_sin_cache(length)
    assert isinstance(cache, CosSinCache)
    assert cache.cos.dtype == cache.sin.dtype == torch.float32
    assert cache.cos.shape == cos.shape
    # transformers' module computes a grown dynamic NTK base from a tensor in float32, its init
    # function in float64: their rates may be a unit in the last place apart (angles further).
    tolerance = angle_rounding(length) if name == "dynamic-beyond" else 2e-6
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=tolerance)
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=tolerance)


# --- float64 from the formulas -----------------------------------------------------------------

def formula_rates(rope_type: str, p: dict, dim: int, max_position_embeddings: int, seq_len: int):
    """float64 rates of a family, from its published definition."""
    pairs = (dim + 1) // 2
    theta = p["rope_theta"]
    if rope_type == "dynamic" and seq_len > max_position_embeddings:
        growth = p["factor"] * seq_len / max_position_embeddings - (p["factor"] - 1)
        theta = theta * growth ** (dim / (dim - 2))
    base = [theta ** (-2 * k / dim) for k in range(pairs)]
    if rope_type in ("default", "dynamic"):
        return base
    if rope_type == "linear":
        return [r / p["factor"] for r in base]
    if rope_type == "longrope":
        factors = p["long_factor"] if seq_len > p["original_max_position_embeddings"] else p["short_factor"]
        return [r / s for r, s in zip(base, factors)]
    original = p["original_max_position_embeddings"]
    factor = p["factor"] or max_position_embeddings / original
    if rope_type == "llama3":
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        rates = []
        for r in base:
            wavelength = 2 * math.pi / r
            if wavelength < original / high:
                rates.append(r)
            elif wavelength > original / low:
                rates.append(r / factor)
            else:
                s = (original / wavelength - low) / (high - low)
                rates.append((1 - s) * r / factor + s * r)
        return rates
    assert rope_type == "yarn"
    # the pair index whose rate turns `turns` times over the original length
    def pair(turns):
        return dim * math.log(original / (2 * math.pi * turns)) / (2 * math.log(theta))
    start, end = pair(p.get("beta_fast") or 32), pair(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        start, end = math.floor(start), math.ceil(end)
    start, end = max(start, 0), min(end, dim - 1)
    rates = []
    for k, r in enumerate(base):
        interpolated_share = min(max((k - start) / (end - start), 0.0), 1.0)
        rates.append(interpolated_share * r / factor + (1 - interpolated_share) * r)
    return rates


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_angle_table_matches_float64_formula(case, interleaved):
    _, config, _, length = case
    p = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    rates = torch.tensor(
        formula_rates(p["rope_type"], p, dim, config.max_position_embeddings, length),
        dtype=torch.float64,
    )
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rates)
    expected = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), -1)

    table = from_hf_config(config, length).angle_table(
        length, interleaved=interleaved, without_attention_factor=True
    )
    assert table.dtype == torch.float32 and table.is_contiguous()
    assert table.shape == (length, 1, 1, 2 * rates.numel())
    # float32 exponents and powers: rates within ~ln(theta) * 2**-24 relative of the exact ones
    torch.testing.assert_close(table[:, 0, 0].double(), expected, rtol=3e-6, atol=0)


def test_cos_sin_cache_carries_the_attention_factor():
    config = llama(2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=512)
    f = from_hf_config(config, 64)
    assert f.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    with pytest.raises(RoPEError, match=r"'yarn' table has attention_factor=1.13863.*cos_sin_cache"):
        f.angle_table(64)
    angles = f.angle_table(64, interleaved=True, without_attention_factor=True)[:, 0, 0].double()
    cache = f.cos_sin_cache(64, interleaved=True)
    torch.testing.assert_close(cache.cos, (angles.cos() * f.attention_factor).float(), rtol=0, atol=0)
    torch.testing.assert_close(cache.sin, (angles.sin() * f.attention_factor).float(), rtol=0, atol=0)


# --- sequence-length-dependent families: the switch ---------------------------------------------

@pytest.mark.parametrize("extra", [0, 1], ids=["at-max", "max+1"])
def test_dynamic_ntk_switches_after_max_position_embeddings(extra):
    config = llama(256, rope_type="dynamic", factor=4.0)
    length = 256 + extra
    f = from_hf_config(config, length)
    expected_rates, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=length)
    torch.testing.assert_close(f.inv_freq, expected_rates, rtol=RATES_RTOL, atol=0)
    default = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    assert torch.equal(f.inv_freq, default) == (extra == 0)
    assert f.max_positions == length

    cos, sin = hf_cos_sin(config, LlamaRotaryEmbedding, length)
    cache = f.cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=angle_rounding(length))
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=angle_rounding(length))


@pytest.mark.parametrize("extra", [0, 1], ids=["at-original", "original+1"])
def test_longrope_switches_to_long_factors_after_original_length(extra):
    config = phi3(original=256)
    length = 256 + extra
    f = from_hf_config(config, length)
    expected_rates, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=length)
    torch.testing.assert_close(f.inv_freq, expected_rates, rtol=RATES_RTOL, atol=0)
    assert f.attention_factor == pytest.approx(expected_factor, rel=1e-12)
    factors = config.rope_parameters["long_factor" if extra else "short_factor"]
    unscaled = tables.inverse_frequencies(32, 10000.0, device="cpu")
    torch.testing.assert_close(f.inv_freq * torch.tensor(factors), unscaled, rtol=RATES_RTOL, atol=0)

    cos, sin = hf_cos_sin(config, Phi3RotaryEmbedding, length)
    cache = f.cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=2e-6)


def test_length_dependent_rates_refuse_a_longer_table():
    f = from_hf_config(phi3(original=256), 256)
    assert f.angle_table(100, without_attention_factor=True).shape[0] == 100  # a prefix
    with pytest.raises(RoPEError, match=r"max_positions=257 exceeds the 256 positions .*'longrope'"):
        f.angle_table(257, without_attention_factor=True)
    static = from_hf_config(llama(rope_type="linear", factor=2.0), 16)
    assert static.max_positions is None and static.angle_table(5000).shape[0] == 5000


# --- how the config is read ---------------------------------------------------------------------

def test_per_layer_type_parameters_need_a_layer_type():
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    for layer_type in ("sliding_attention", "full_attention"):
        expected, _ = Gemma3RotaryEmbedding.compute_default_rope_parameters(config, layer_type=layer_type)
        f = from_hf_config(config, 32, layer_type=layer_type)
        torch.testing.assert_close(f.inv_freq, expected, rtol=RATES_RTOL, atol=0)
    with pytest.raises(RoPEError, match=r"per layer type \('sliding_attention', 'full_attention'\).*layer_type="):
        from_hf_config(config, 32)
    with pytest.raises(RoPEError, match=r"layer_type='chunked' is not in config.rope_parameters"):
        from_hf_config(config, 32, layer_type="chunked")


@pytest.mark.parametrize("top, own", [
    (None, False), (False, None), (False, True), (None, None), (True, False)])
def test_yarn_truncate_per_layer_type_is_read_at_the_top_level(top, own):
    """transformers' YaRN reads ``truncate`` from the top level of ``config.rope_parameters``
    only (default True), beside the layer types too: a layer type's own was read instead, and
    a top-level one made the parameters look flat (the layer type refused)."""
    full = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
            "original_max_position_embeddings": 1024}
    if own is not None:
        full["truncate"] = own
    parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                  "full_attention": full}
    if top is not None:
        parameters["truncate"] = top
    try:
        config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=32,
                                  max_position_embeddings=4096, rope_parameters=parameters)
    except AttributeError as e:  # transformers 5.17 reads every top-level value as a layer's
        assert top is not None, e
        pytest.skip(f"transformers {transformers.__version__} refuses a top-level truncate "
                    f"beside the layer types ({e})")
    module = Gemma3RotaryEmbedding(config)
    f = from_hf_config(config, 32, layer_type="full_attention")
    torch.testing.assert_close(f.inv_freq, module.full_attention_inv_freq, rtol=RATES_RTOL, atol=0)
    expected = formula_rates("yarn", dict(full, truncate=True if top is None else top), 32,
                             4096, 32)
    torch.testing.assert_close(f.inv_freq.double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=3e-6, atol=0)
    sliding = from_hf_config(config, 32, layer_type="sliding_attention")
    torch.testing.assert_close(sliding.inv_freq, module.sliding_attention_inv_freq,
                               rtol=RATES_RTOL, atol=0)
    with pytest.raises(RoPEError, match=r"per layer type \('sliding_attention', "
                                        r"'full_attention'\); pass layer_type="):
        from_hf_config(config, 32)


def test_duck_typed_config_and_transformers_4_rope_scaling():
    hf = llama(2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=512)
    plain = SimpleNamespace(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    )
    legacy = SimpleNamespace(
        head_dim=64, max_position_embeddings=2048, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    )
    expected = from_hf_config(hf, 100)
    for config in (plain, legacy):
        f = from_hf_config(config, 100)
        assert torch.equal(f.inv_freq, expected.inv_freq)
        assert f.attention_factor == expected.attention_factor
    assert plain.rope_parameters == {  # read, never written
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
    }


def test_phi3_original_length_attribute_wins():
    """Phi-3 keeps ``original_max_position_embeddings`` beside ``rope_parameters``; transformers
    gives the attribute priority, and so does ``from_hf_config`` on a duck-typed config."""
    config = SimpleNamespace(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=1024,
        original_max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 512,
                         "short_factor": [1.0] * 16, "long_factor": [2.0] * 16},
    )
    unscaled = tables.inverse_frequencies(32, 10000.0, device="cpu")
    # 300 positions: beyond the attribute's 256 (long factors, 2), within the dict's 512 (short, 1)
    torch.testing.assert_close(from_hf_config(config, 300).inv_freq, unscaled / 2, rtol=RATES_RTOL, atol=0)


def test_supported_types_are_transformers_init_functions():
    """Every rope type transformers 5.23 computes rates for is covered, except "proportional"
    (Gemma 4: per-layer head dims, zero rates for unrotated pairs)."""
    assert set(HF_ROPE_TYPES) == set(ROPE_INIT_FUNCTIONS) - {"proportional"} | {"default"}


def test_tables_module_never_imports_transformers():
    tree = ast.parse(inspect.getsource(tables))
    imported = [
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    ] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "transformers"]


# --- TransformerEngine's options ---------------------------------------------------------------

@pytest.mark.parametrize(
    "options, length",
    [
        (dict(), 64),
        (dict(rotary_percent=0.5, rotary_base=500000.0), 64),
        (dict(seq_len_interpolation_factor=2, pretrained_max_position_embeddings=128), 200),
        (dict(seq_len_interpolation_factor=2, pretrained_max_position_embeddings=128), 300),
        (dict(rotary_percent=1 / 128), 8),
    ],
    ids=["plain", "percent-base", "interpolation-fixed", "interpolation-dynamic", "rotary-dim-1"],
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_te_options_equal_rotary_position_embedding(options, length, interleaved):
    module = RotaryPositionEmbedding(128, interleaved=interleaved, **options)
    f = from_te_options(128, length, device=module.inv_freq.device, **options)
    assert torch.equal(f.angle_table(length, interleaved=interleaved, without_attention_factor=True),
                       module(length))
    interpolating = "seq_len_interpolation_factor" in options
    assert f.rope_type == ("linear" if interpolating else "default")
    assert f.max_positions == (length if interpolating else None)


# --- errors ------------------------------------------------------------------------------------

def test_unsupported_rope_type_names_it_and_the_supported_ones():
    config = SimpleNamespace(
        head_dim=64, max_position_embeddings=128,
        rope_parameters={"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    )
    with pytest.raises(RoPEError, match=r"'rope_type'\] is 'proportional'.*'default', 'linear', "
                                        r"'dynamic', 'yarn', 'longrope', 'llama3'"):
        from_hf_config(config, 16)


def _config(**rope_parameters):
    return SimpleNamespace(head_dim=64, max_position_embeddings=1024, rope_parameters=rope_parameters)


@pytest.mark.parametrize(
    "config, max_positions, message",
    [
        (_config(rope_type="default"), 0, r"max_positions must be a positive int, got 0"),
        (_config(rope_type="default"), 2.5, r"max_positions must be a positive int, got 2.5"),
        (_config(rope_type="default"), True, r"max_positions must be a positive int, got True"),
        (_config(rope_type="linear"), 8, r"config.rope_parameters has no 'factor', which rope_type 'linear'"),
        (_config(rope_type="linear", factor=-2.0), 8,
         r"config.rope_parameters \(rope_type 'linear'\): factor must be a finite number > 0, got -2.0"),
        (_config(rope_type="default", rope_theta=0.0), 8, r"rope_theta must be a finite number > 0, got 0.0"),
        # an int past float64's range (a JSON config's digits): float()'s OverflowError before
        (_config(rope_type="default", rope_theta=10**400), 8,
         r"rope_theta must be a finite number > 0, got 1000"),
        (_config(rope_type="yarn", factor=4.0, attention_factor=-(10**400)), 8,
         r"attention_factor must be a finite number > 0, got -1000"),
        (_config(rope_type="default", partial_rotary_factor=1.5), 8,
         r"config.rope_parameters\['partial_rotary_factor'\] must be in \(0, 1\], got 1.5"),
        (_config(rope_type="default", partial_rotary_factor=0.01), 8,
         r"rotary dim int\(head_dim \* partial_rotary_factor\) = int\(64 \* 0.01\) = 0 must be >= 2"),
        (_config(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0), 8,
         r"high_freq_factor must be greater than low_freq_factor, got high_freq_factor=1.0"),
        (_config(rope_type="llama3", factor=8.0, high_freq_factor=4.0), 8,
         r"has no 'low_freq_factor', which rope_type 'llama3' needs"),
        (_config(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 32), 8,
         r"short_factor must be 32 finite positive numbers \(one per pair\), "
         r"got \[1.0, 1.0, 1.0\]"),
        # an infinite factor stopped its pair (rate 0) without a word
        (_config(rope_type="longrope", short_factor=[1.0] * 32,
                 long_factor=[1.0] * 31 + [math.inf]), 2048,
         r"long_factor must be 32 finite positive numbers \(one per pair\), got \[1.0, .*inf\]"),
        (_config(rope_type="yarn", factor=4.0, attention_factor=0.0), 8,
         r"attention_factor must be a finite number > 0, got 0.0"),
        # DeepSeek's ratio with a zero denominator: a ZeroDivisionError before
        (_config(rope_type="yarn", factor=math.e, mscale=1.0, mscale_all_dim=-10.0), 8,
         r"mscale=1.0 and mscale_all_dim=-10.0 give YaRN's attention factor .* = 1.1 / 0 "
         r"with factor=2.71828"),
        # a negative ratio was named as the attention_factor the config does not give
        (_config(rope_type="yarn", factor=4.0, mscale=-100.0, mscale_all_dim=1.0), 8,
         r"mscale=-100.0 and mscale_all_dim=1.0 give .* = -12.8629 / 1.13863"),
        (_config(rope_type="yarn", factor=4.0, mscale=math.nan, mscale_all_dim=1.0), 8,
         r"mscale must be a finite number or None, got nan"),
        (_config(rope_type="dynamic", factor=2.0), -1, r"max_positions must be a positive int, got -1"),
        (SimpleNamespace(rope_parameters={"rope_type": "default"}), 8,
         r"config must have head_dim, or hidden_size and num_attention_heads"),
        (SimpleNamespace(head_dim=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), 8,
         r"config has no max_position_embeddings, which rope_type 'dynamic' needs"),
        (SimpleNamespace(head_dim=64, rope_parameters={"full": None}), 8,
         r"per layer type \('full'\); pass layer_type="),
        # flat parameters whose values are all None were read as per layer type
        (_config(rope_type=None), 8,
         r"^config.rope_parameters\['rope_type'\] is None; rope-dispatch builds tables for "),
        (_config(rope_type=None, factor=None), 8, r"\['rope_type'\] is None; rope-dispatch"),
    ],
)
def test_bad_configs_raise_rope_error_naming_the_field(config, max_positions, message):
    with pytest.raises(RoPEError, match=message):
        from_hf_config(config, max_positions)


def test_a_layer_type_without_rotary_embedding():
    config = SimpleNamespace(head_dim=64, rope_parameters={"full": {"rope_type": "default"}, "nope": None})
    with pytest.raises(RoPEError, match=r"\['nope'\] is None: layers of type 'nope' use no rotary"):
        from_hf_config(config, 8, layer_type="nope")


def test_builders_and_result_check_their_arguments():
    with pytest.raises(RoPEError, match=r"dim must be even for YaRN.*got 7"):
        tables.yarn_frequencies(7, factor=2.0, original_max_position_embeddings=64)
    with pytest.raises(RoPEError, match=r"dim \(the rotary dim\) must be an int >= 2, got 1"):
        tables.default_frequencies(1)
    with pytest.raises(RoPEError, match=r"inv_freq must be a float32 tensor \[d2 / 2\], got dtype float64"):
        RotaryFrequencies(torch.ones(4, dtype=torch.float64))
    f = tables.default_frequencies(8)
    with pytest.raises(RoPEError, match=r"interleaved must be a bool, got 1"):
        f.angle_table(4, interleaved=1)
    with pytest.raises(RoPEError, match=r"rotary_percent must be in \(0, 1\], got 2.0"):
        from_te_options(64, 16, rotary_percent=2.0)
    # a grown dynamic base past float64: float's OverflowError, or 'base' (no argument) named
    for dim, factor, seq_len in ((4, 1e200, 1000), (128, 1e300, 1000), (4, 2.0, 10**400)):
        words = re.escape(f"factor={factor!r} and seq_len={seq_len} grow the base past float64")
        with pytest.raises(RoPEError, match=words + f".*dim={dim}$"):
            tables.dynamic_ntk_frequencies(dim, factor=factor, max_position_embeddings=10,
                                           seq_len=seq_len)


@pytest.mark.parametrize("value", ["False", 1.5, None])
def test_without_attention_factor_must_be_a_bool(value):
    """A YaRN table's attention factor is dropped only on an explicit True: a truthy string or
    number (the factor itself passed by mistake) is refused, not read as True."""
    f = tables.yarn_frequencies(64, factor=4.0, original_max_position_embeddings=64)
    assert f.attention_factor != 1.0
    words = f"without_attention_factor must be a bool, got {value!r}"
    with pytest.raises(RoPEError, match=words):
        f.angle_table(8, without_attention_factor=value)
    with pytest.raises(RoPEError, match=words):
        f.rate_table(8, without_attention_factor=value)
    assert f.angle_table(8, without_attention_factor=True).shape == (8, 1, 1, 64)


class _PerLayerConfig:
    """A heterogeneous config as transformers 5.23 lays one out: rope parameters per layer
    type, each layer type's own config in ``per_layer_config``, and a global ``head_dim`` that
    raises (transformers' AmbiguousGlobalPerLayerAttributeError is a RuntimeError)."""

    rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}

    def __init__(self):
        self.per_layer_config = {
            kind: SimpleNamespace(head_dim=dim, rope_parameters=self.rope_parameters)
            for kind, dim in (("full_attention", 512), ("sliding_attention", 256))
        }

    @property
    def head_dim(self):
        raise RuntimeError("'head_dim' is a per-layer attribute")


def test_heterogeneous_config_reads_each_layer_types_own_head_dim():
    """Each layer type's rates come from that type's config (head dim 512 on full-attention
    layers, 256 on sliding ones), as the model builds its rotary embedding; without a layer
    type the per-layer attribute is a RoPEError, not the config's RuntimeError."""
    config = _PerLayerConfig()
    for layer_type, head_dim, theta in (("full_attention", 512, 1e6), ("sliding_attention", 256, 1e4)):
        f = from_hf_config(config, 32, layer_type=layer_type)
        assert f.rotary_dim == head_dim
        want = torch.tensor([theta ** (-2 * k / head_dim) for k in range(head_dim // 2)],
                            dtype=torch.float64)
        torch.testing.assert_close(f.inv_freq.double(), want, rtol=RATES_RTOL, atol=0)
    flat = _PerLayerConfig()
    flat.rope_parameters = {"rope_type": "default"}
    with pytest.raises(RoPEError, match=r"config.head_dim differs between layers .*per-layer.*layer_type="):
        from_hf_config(flat, 32)


def test_heterogeneous_transformers_config_equals_its_rotary_embedding():
    """EmbeddingGemma 2 (transformers 5.23) against its own rotary embedding's rates."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "EmbeddingGemma2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no EmbeddingGemma 2 (5.23 has)")
    from transformers.models.embedding_gemma2.modeling_embedding_gemma2 import (
        EmbeddingGemma2RotaryEmbedding,
    )

    config = transformers.EmbeddingGemma2Config().get_text_config()
    for layer_type in ("full_attention", "sliding_attention"):
        # the model builds each layer type's rotary embedding from that type's config
        expected, _ = EmbeddingGemma2RotaryEmbedding.compute_default_rope_parameters(
            config.per_layer_config[layer_type], layer_type=layer_type)
        f = from_hf_config(config, 32, layer_type=layer_type)
        torch.testing.assert_close(f.inv_freq, expected, rtol=RATES_RTOL, atol=0)


@pytest.mark.parametrize("kind", [dict, lambda fields: SimpleNamespace(**fields)])
def test_heterogeneous_config_json_reads_its_overrides_by_layer_index(kind):
    """A heterogeneous config.json (EmbeddingGemma 2's) keeps its per-layer fields as overrides
    by layer index ({"05": {"head_dim": 512}}), which transformers applies to those layers: the
    full-attention layers' head dim 512 was read as the global 256 (half the rates)."""
    import json

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "EmbeddingGemma2TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no EmbeddingGemma 2 (5.23 has)")
    from transformers.models.embedding_gemma2.modeling_embedding_gemma2 import (
        EmbeddingGemma2RotaryEmbedding,
    )

    raw = json.loads(transformers.EmbeddingGemma2TextConfig(
        num_hidden_layers=6, layer_types=["sliding_attention"] * 2 + ["full_attention"]
        + ["sliding_attention"] * 2 + ["full_attention"],
        per_layer_config={2: {"head_dim": 64}, 5: {"head_dim": 64}}, head_dim=32,
    ).to_json_string(use_diff=False))
    assert raw["per_layer_config"] == {"2": {"head_dim": 64}, "5": {"head_dim": 64}}
    module = EmbeddingGemma2RotaryEmbedding(transformers.EmbeddingGemma2TextConfig(**raw))
    for layer_type, head_dim in (("full_attention", 64), ("sliding_attention", 32)):
        padded = dict(raw, per_layer_config={"02": {"head_dim": 64}, "05": {"head_dim": 64}})
        f = from_hf_config(kind(raw), 32, layer_type=layer_type)
        assert torch.equal(from_hf_config(kind(padded), 32, layer_type=layer_type).inv_freq,
                           f.inv_freq)  # (24 layers' config.json pads its indices: "05")
        torch.testing.assert_close(f.inv_freq, getattr(module, f"{layer_type}_inv_freq"),
                                   rtol=RATES_RTOL, atol=0)
        theta = raw["rope_parameters"][layer_type]["rope_theta"]
        want = torch.tensor([theta ** (-2 * k / head_dim) for k in range(head_dim // 2)],
                            dtype=torch.float64)
        torch.testing.assert_close(f.inv_freq.double(), want, rtol=RATES_RTOL, atol=0)
    # layers of one type that differ (NeoMME's sliding windows): per_layer_config[layer_type]
    # raises ValueError, which transformers' rope functions pass over for the global config
    from transformers.models.neomme.modeling_neomme import NeoMMERotaryEmbedding

    neomme = json.loads(transformers.NeoMMEConfig().to_json_string(use_diff=False))
    assert neomme["per_layer_config"]  # (sliding_window 1024 on some sliding layers)
    module = NeoMMERotaryEmbedding(transformers.NeoMMEConfig(**json.loads(json.dumps(neomme))))
    for layer_type in ("full_attention", "sliding_attention"):
        f = from_hf_config(kind(neomme), 32, layer_type=layer_type)
        torch.testing.assert_close(f.inv_freq, getattr(module, f"{layer_type}_inv_freq"),
                                   rtol=RATES_RTOL, atol=0)


def test_qwen2_vl_checkpoint_config_of_rope_type_mrope():
    """Qwen2-VL's and Qwen2.5-VL's config.json name their rope type 'mrope' (default rates,
    several position streams): read as a plain object, as transformers' config reads it."""
    from transformers import Qwen2VLConfig

    saved = {"hidden_size": 1536, "num_attention_heads": 12, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0,
             "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    f = from_hf_config(SimpleNamespace(**saved), 64)
    assert f.rope_type == "default" and f.rotary_dim == 128
    hf_config = Qwen2VLConfig(text_config=saved).get_text_config()
    assert torch.equal(f.inv_freq, from_hf_config(hf_config, 64).inv_freq)
    torch.testing.assert_close(f.inv_freq, tables.default_frequencies(128, rope_theta=1e6).inv_freq,
                               rtol=0, atol=0)


def test_composite_config_is_read_through_its_text_config():
    from transformers import Gemma3Config

    config = Gemma3Config()
    text = config.get_text_config()
    for layer_type in ("sliding_attention", "full_attention"):
        want = from_hf_config(text, 64, layer_type=layer_type)
        got = from_hf_config(config, 64, layer_type=layer_type)
        assert torch.equal(got.inv_freq, want.inv_freq) and got.rotary_dim == text.head_dim


def test_rotary_dim_field_gives_the_rotated_channels():
    """GPT-J and CodeGen name their rotated channels in config.rotary_dim (64 of 256)."""
    from transformers import GPTJConfig

    config = GPTJConfig()
    f = from_hf_config(config, 16)
    assert f.rotary_dim == config.rotary_dim == 64
    torch.testing.assert_close(
        f.inv_freq.double(), torch.tensor([10000.0 ** (-2 * k / 64) for k in range(32)],
                                          dtype=torch.float64), rtol=RATES_RTOL, atol=0)
    wide = SimpleNamespace(head_dim=32, rotary_dim=64, rope_theta=10000.0)
    with pytest.raises(RoPEError, match=r"config.rotary_dim=64 is more than the head dim 32"):
        from_hf_config(wide, 16)


@pytest.mark.parametrize("rotary_dim", [1, 33])
def test_odd_rotary_dim_is_named(rotary_dim):
    """GPT-J's and CodeGen's modules rotate pairs of config.rotary_dim channels (an odd one
    fails in transformers): 33 gave a table of 34 channels, and 1 an error about
    ``int(head_dim * partial_rotary_factor)``, which the config did not use."""
    config = SimpleNamespace(head_dim=64, rotary_dim=rotary_dim)
    with pytest.raises(RoPEError, match=rf"^config.rotary_dim must be an even int >= 2 \(the "
                                        rf"channels rotate in pairs\), got {rotary_dim}$"):
        from_hf_config(config, 16)


@pytest.mark.parametrize("partial", [None, 0.5])
def test_rotary_dim_field_beside_rope_parameters_is_not_read(partial):
    """MiniMax-M3's text config keeps a ``rotary_dim`` field (64) that its rotary embedding does
    not read: transformers' module rotates ``head_dim * partial_rotary_factor`` channels of
    ``rope_parameters``, as every module of a config with ``rope_parameters`` does. The table
    had ``rotary_dim``'s 64 channels where the model rotates 128 (or 64 of a factor 0.5)."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLRotaryEmbedding,
    )

    rope_parameters = {"rope_type": "default", "rope_theta": 5e6}
    if partial is not None:
        rope_parameters["partial_rotary_factor"] = partial
    config = MiniMaxM3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                                   rotary_dim=64, rope_parameters=rope_parameters)
    f = from_hf_config(config, 40)
    dim = int(128 * (partial or 1.0))
    assert f.rotary_dim == dim
    rates = torch.tensor([5e6 ** (-2 * k / dim) for k in range(dim // 2)], dtype=torch.float64)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=3e-6, atol=0)
    cos, sin = hf_cos_sin(config, MiniMaxM3VLRotaryEmbedding, 40)
    cache = f.cos_sin_cache(40)
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=2e-6)


@pytest.mark.parametrize("length, mscale", [(64, 1.2432), (4096, 1.2432), (4097, 1.3)])
def test_longrope_short_and_long_mscale_are_the_attention_factor(length, mscale):
    """Phi-3.5-MoE's rotary embedding multiplies cos and sin by short_mscale up to the original
    length and by long_mscale beyond (the derived factor would be 1.19 for this checkpoint)."""
    config = SimpleNamespace(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                         "short_mscale": 1.2432, "long_mscale": 1.3,
                         "original_max_position_embeddings": 4096},
    )
    f = from_hf_config(config, length)
    assert f.attention_factor == mscale
    cache = f.cos_sin_cache(length)
    rates = [(2.0 if length > 4096 else 1.0) ** -1 * 10000.0 ** (-2 * k / 64) for k in range(32)]
    angle = (length - 1) * torch.tensor(rates, dtype=torch.float64)
    torch.testing.assert_close(cache.cos[-1, :32].double(), mscale * torch.cos(angle), rtol=0, atol=2e-4)


@pytest.mark.parametrize("length", [64, 2048])
@pytest.mark.parametrize("key", ["short_mscale", "long_mscale"])
@pytest.mark.parametrize("bad", [math.nan, "1.2", 0.0])
def test_bad_longrope_mscale_is_named(length, key, bad):
    """Phi-3.5-MoE's short_mscale and long_mscale are its attention factor; a bad one was
    named ``attention_factor``, a field the config does not have, and one the length did not
    select was not checked at all."""
    factors = [1.0] * 32
    config = _config(rope_type="longrope", short_factor=factors, long_factor=factors,
                     original_max_position_embeddings=1024, short_mscale=1.2, long_mscale=1.3)
    config.rope_parameters[key] = bad
    words = (rf"^config.rope_parameters \(rope_type 'longrope'\): {key} must be a finite "
             rf"number > 0, got {re.escape(repr(bad))}$")
    with pytest.raises(RoPEError, match=words):
        from_hf_config(config, length)


@pytest.mark.parametrize("length", [16, 64], ids=["short-used", "long-used"])
@pytest.mark.parametrize("key", ["short_factor", "long_factor"])
@pytest.mark.parametrize("bad", [[1.0, math.nan] + [1.0] * 6, [1.0] * 7 + [0.0], [1.0] * 7],
                         ids=["nan", "zero", "short"])
def test_longrope_checks_the_factor_list_the_length_does_not_select(length, key, bad):
    """Both lists are part of the model: a bad one was accepted while the sequence length
    selected the other, and the same config then failed (or ran wrong) at another length."""
    lists = {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8, key: bad}
    words = (rf"^{key} must be 8 finite positive numbers \(one per pair\), "
             rf"got {re.escape(repr(bad))}$")
    with pytest.raises(RoPEError, match=words):
        tables.longrope_frequencies(16, original_max_position_embeddings=32, seq_len=length,
                                    factor=2.0, **lists)


def test_numpy_numbers_and_bad_helper_arguments():
    np = pytest.importorskip("numpy")
    config = SimpleNamespace(head_dim=np.int64(64), max_position_embeddings=np.int64(4096),
                             rope_parameters={"rope_type": "linear", "factor": np.float32(2.0),
                                              "rope_theta": np.float64(10000.0)})
    f = from_hf_config(config, 16)
    assert f.rotary_dim == 64
    torch.testing.assert_close(f.inv_freq, tables.linear_frequencies(64, factor=2.0).inv_freq)
    # LongRoPE's per-pair factors as NumPy numbers or an array, as transformers takes them
    factors = [1.0 + k / 8 for k in range(32)]
    config.rope_parameters = {"rope_type": "longrope", "short_factor": np.array(factors),
                              "long_factor": [np.float32(v) for v in factors],
                              "original_max_position_embeddings": np.int64(1024)}
    plain = SimpleNamespace(head_dim=64, max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "short_factor": factors, "long_factor": factors,
        "original_max_position_embeddings": 1024})
    for length in (16, 2048):  # short_factor, then long_factor
        torch.testing.assert_close(from_hf_config(config, length).inv_freq,
                                   from_hf_config(plain, length).inv_freq, rtol=0, atol=0)
    # DeepSeek's YaRN mscale and mscale_all_dim as NumPy numbers
    config.rope_parameters = {"rope_type": "yarn", "factor": np.float32(40.0),
                              "mscale": np.float32(0.75), "mscale_all_dim": np.float64(1.0),
                              "original_max_position_embeddings": 128}
    plain.rope_parameters = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.75,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 128}
    numpy_yarn, plain_yarn = from_hf_config(config, 64), from_hf_config(plain, 64)
    assert numpy_yarn.attention_factor == plain_yarn.attention_factor != 1.0
    assert torch.equal(numpy_yarn.inv_freq, plain_yarn.inv_freq)
    with pytest.raises(RoPEError, match=r"layer_type must be a layer type's name \(a str\) or None, got \['x'\]"):
        from_hf_config(config, 16, layer_type=["x"])
    with pytest.raises(RoPEError,
                       match=r"int\(dim \* rotary_percent\) = int\(4 \* 0.2\) must be an int "
                             r">= 1, got 0"):
        from_te_options(4, 16, rotary_percent=0.2)
    with pytest.raises(RoPEError, match=r"dim \(the rotary dim\) must be an int >= 1, got 3.5"):
        tables.inverse_frequencies(3.5)
    with pytest.raises(RoPEError, match=r"base must be a finite number > 0, got -1"):
        tables.inverse_frequencies(8, -1)
    with pytest.raises(RoPEError, match=r"length must be an int >= 0 .* got 2.5"):
        tables.angle_table(tables.inverse_frequencies(8), 2.5)
    with pytest.raises(RoPEError, match=r"inv_freq must be a 1-D floating-point tensor of rates, got torch.float32 \(2, 4\)"):
        tables.angle_table(torch.ones(2, 4), 3)
    assert tables.angle_table(tables.inverse_frequencies(8), 0).shape == (0, 1, 1, 8)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rates_are_made_on_the_cpu_under_a_default_device(case):
    """The Hugging Face builders compute their rates on the CPU, as transformers does when a
    model is built, whatever torch's default device: under ``with torch.device("meta")``
    (models built empty, then materialised) every family gives the same real rates, and its
    tables can be made."""
    _, make_config, module_class, length = case
    config = make_config()
    expected, _ = hf_rates(config, module_class, length)
    with torch.device("meta"):
        f = from_hf_config(config, length)
    assert f.inv_freq.device == torch.device("cpu")
    torch.testing.assert_close(f.inv_freq, expected, rtol=RATES_RTOL, atol=0)
    assert f.cos_sin_cache(length).cos.device == torch.device("cpu")


@pytest.mark.parametrize("argument, value", [
    ("scale", float("nan")), ("scale", float("inf")), ("scale", 0.0), ("scale", -0.5),
    ("scale", "2"), ("scale", None), ("scale", True),
    ("offset", float("nan")), ("offset", float("-inf")), ("offset", "1"), ("offset", None),
    ("offset", False), ("offset", 2**70),
])
def test_angle_table_refuses_bad_offset_and_scale(argument, value):
    """A NaN or infinite scale or offset filled the table with NaN (or infinity) silently; a
    string, None or an int past int64 failed inside torch."""
    expected = "a finite number > 0" if argument == "scale" else "a finite number"
    message = rf"^{argument} must be {expected} .*got {re.escape(repr(value))}$"
    with pytest.raises(RoPEError, match=message):
        tables.angle_table(tables.inverse_frequencies(8), 4, **{argument: value})


def test_te_module_with_checked_offset_compiles_with_dynamic_sizes():
    """The offset and scale checks stay out of torch.compile's graph: TE's module traced with
    dynamic lengths and offsets (symbolic ints) gives its eager tables, without a graph break."""
    torch._dynamo.reset()
    module = RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=8)
    compiled = torch.compile(lambda n, offset: module(n, offset=offset), dynamic=True,
                             fullgraph=True, backend="eager")
    for n, offset in ((10, 1), (40, 3), (7, 0)):
        assert torch.equal(compiled(n, offset), module(n, offset=offset))


def test_angle_table_offset_and_scale_against_float64():
    """Offsets (negative ones too, as TransformerEngine takes them) and scales that are finite
    numbers, NumPy's included, give the angles of positions ``(p + offset) * scale``."""
    np = pytest.importorskip("numpy")
    rates = tables.inverse_frequencies(8)
    for offset, scale in ((-3, 0.5), (2.5, np.float32(0.25)), (np.int64(7), 1.0)):
        table = tables.angle_table(rates, 5, offset=offset, scale=scale)[:, 0, 0, :4].double()
        positions = (torch.arange(5, dtype=torch.float64) + float(offset)) * float(scale)
        expected = torch.outer(positions, rates.double())
        torch.testing.assert_close(table, expected, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("length", [300, 2048], ids=["short", "long"])
def test_phi3_su_rope_type_is_read_as_longrope(length):
    """Phi-3's first checkpoints name LongRoPE "su"; transformers 5.23's Phi-3 config renames
    it "longrope" (as "yarn" there), so a config read from such a checkpoint's JSON (a
    ``rope_scaling`` of type "su") has LongRoPE's rates and attention factor. It was refused as
    an unknown rope type."""
    factors = {"short_factor": [1.0 + k / 40 for k in range(16)],
               "long_factor": [1.0 + k ** 1.5 / 3 for k in range(16)],
               "original_max_position_embeddings": 256}
    sizes = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
                 original_max_position_embeddings=256)
    plain = SimpleNamespace(rope_theta=10000.0, rope_scaling={"type": "su", **factors}, **sizes)
    transformers_config = Phi3Config(rope_scaling={"type": "su", **factors}, **sizes)
    assert transformers_config.rope_parameters["rope_type"] == "longrope"  # transformers' rename
    f = from_hf_config(plain, length)
    assert f.rope_type == "longrope" and f.max_positions == length
    expected_rates, expected_factor = hf_rates(transformers_config, Phi3RotaryEmbedding, length)
    torch.testing.assert_close(f.inv_freq, expected_rates, rtol=RATES_RTOL, atol=0)
    assert f.attention_factor == pytest.approx(expected_factor, rel=1e-12)
    cos, sin = hf_cos_sin(transformers_config, Phi3RotaryEmbedding, length)
    cache = f.cos_sin_cache(length)
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=2e-6)
    # and against the float64 formula: default rates over the regime's per-pair factors
    chosen = factors["long_factor" if length > 256 else "short_factor"]
    rates = torch.tensor([10000.0 ** (-2 * k / 32) / chosen[k] for k in range(16)],
                         dtype=torch.float64)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=3e-6, atol=0)


def test_gpt_neox_rotary_pct_and_rotary_emb_base():
    """GPT-NeoX's config.json (Pythia's, and a transformers 4 GPTNeoXConfig's attributes) give
    the partial factor and the base as ``rotary_pct`` and ``rotary_emb_base``, which
    transformers 5.23's GPTNeoXConfig reads into ``rope_parameters``. A config with those names
    got the full head dim and base 10000 (every channel rotated, at the wrong rates)."""
    raw = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
               rotary_pct=0.25, rotary_emb_base=20000)
    transformers_config = GPTNeoXConfig(**raw)
    assert transformers_config.rope_parameters["partial_rotary_factor"] == 0.25
    f = from_hf_config(SimpleNamespace(**raw), 50)
    assert f.rotary_dim == 16
    rates = torch.tensor([20000.0 ** (-2 * k / 16) for k in range(8)], dtype=torch.float64)
    torch.testing.assert_close(f.inv_freq.double(), rates, rtol=3e-6, atol=0)
    cos, sin = hf_cos_sin(transformers_config, GPTNeoXRotaryEmbedding, 50)
    cache = f.cos_sin_cache(50)
    torch.testing.assert_close(cache.cos, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(cache.sin, sin, rtol=0, atol=2e-6)
    with pytest.raises(RoPEError, match=r"config.rotary_pct must be in \(0, 1\], got 2.0"):
        from_hf_config(SimpleNamespace(**{**raw, "rotary_pct": 2.0}), 50)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rotary_frequencies_refuse_rates_that_are_not_finite(bad):
    """A RotaryFrequencies of a NaN or infinite rate gave angle tables, caches and rate tables
    of NaN or infinite angles without a word (every token's pair rotated to NaN)."""
    rates = torch.tensor([1.0, bad, 0.25])
    with pytest.raises(RoPEError, match=rf"inv_freq must hold finite rates .*got {bad!r} at "
                                        r"pair 1 of 3$"):
        RotaryFrequencies(rates)
    # finite rates, zero and negative ones too, give the float64 products
    f = RotaryFrequencies(torch.tensor([1.0, 0.0, -0.25]))
    expected = torch.outer(torch.arange(4, dtype=torch.float64),
                           torch.tensor([1.0, 0.0, -0.25], dtype=torch.float64))
    torch.testing.assert_close(f.angle_table(4)[:, 0, 0, :3].double(), expected, rtol=0, atol=0)
    # rates without memory (models built on the meta device) are not read, nor traced ones
    with torch.device("meta"):
        assert from_te_options(64, 16).inv_freq.is_meta
    torch._dynamo.reset()
    rates = tables.inverse_frequencies(16)
    compiled = torch.compile(lambda x: RotaryFrequencies(rates * x).angle_table(8),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(())), tables.angle_table(rates, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_angle_table_refuses_half_precision_rates(dtype):
    """The table's positions were counted in the rates' dtype: bfloat16 rates (a model cast to
    bfloat16 casts its inv_freq buffer, TE's module too) gave row 257 the angles of position
    256, float16 rates row 2049 those of 2048, in a half-precision table."""
    rates = tables.inverse_frequencies(8)
    with pytest.raises(RoPEError, match=rf"inv_freq must be float32 \(or float64\) rates, got "
                                        rf"{str(dtype).removeprefix('torch.')}"):
        tables.angle_table(rates.to(dtype), 3000)
    with pytest.raises(RoPEError, match=r"inv_freq must be float32 \(or float64\) rates"):
        RotaryPositionEmbedding(8).to(dtype)(3000)
    # float64 rates give a float64 table of the exact products
    table = tables.angle_table(rates.double(), 3000)
    assert table.dtype == torch.float64
    expected = torch.outer(torch.arange(3000, dtype=torch.float64), rates.double())
    torch.testing.assert_close(table[:, 0, 0, :4], expected, rtol=0, atol=0)


def test_a_base_past_float32_is_refused():
    """The rates are float32 powers of the base: a base past float32's largest number is
    infinite there, so every rate but the first was 0 (those pairs never turned), without a
    word, from any builder, TE's options and a dynamic NTK base grown that far; one below its
    smallest is 0 there, and those rates were infinite."""
    big = 1e39
    words = r"must be within float32's range, 1.4013e-45 to 3.40282e\+38 .* got 1e\+39$"
    with pytest.raises(RoPEError, match="^base " + words):
        tables.inverse_frequencies(8, big)
    builders = {
        "default": lambda: tables.default_frequencies(8, rope_theta=big),
        "linear": lambda: tables.linear_frequencies(8, factor=2.0, rope_theta=big),
        "yarn": lambda: tables.yarn_frequencies(8, factor=2.0, rope_theta=big,
                                                original_max_position_embeddings=64),
        "llama3": lambda: tables.llama3_frequencies(8, factor=8.0, rope_theta=big,
                                                    original_max_position_embeddings=64),
        "longrope": lambda: tables.longrope_frequencies(
            8, short_factor=[1.0] * 4, long_factor=[1.0] * 4, original_max_position_embeddings=64,
            seq_len=8, factor=2.0, rope_theta=big),
        "dynamic": lambda: tables.dynamic_ntk_frequencies(
            8, factor=2.0, max_position_embeddings=64, seq_len=8, rope_theta=big),
    }
    for name, build in builders.items():
        with pytest.raises(RoPEError, match="rope_theta " + words):
            build()
    with pytest.raises(RoPEError, match="rotary_base " + words):
        from_te_options(8, 4, rotary_base=big)
    with pytest.raises(RoPEError, match="rotary_base " + words):
        RotaryPositionEmbedding(8, rotary_base=big)
    with pytest.raises(RoPEError, match=r"factor=1e\+35 and seq_len=1000 grow the base to "
                                        r"[0-9.]+e\+4[0-9], past float32's largest number"):
        tables.dynamic_ntk_frequencies(128, factor=1e35, max_position_embeddings=10,
                                       seq_len=1000)
    # one below float32's smallest number is 0 there: every rate but the first was infinite
    with pytest.raises(RoPEError, match=r"base must be within float32's range.* got 1e-46$"):
        tables.inverse_frequencies(8, 1e-46)
    # the largest float32 base still gives its float32 powers (none of them 0 here)
    top = torch.finfo(torch.float32).max
    rates = tables.inverse_frequencies(8, top).double()
    expected = torch.tensor([top ** (-k / 4) for k in range(4)], dtype=torch.float64)
    torch.testing.assert_close(rates, expected, rtol=1e-5, atol=0)
