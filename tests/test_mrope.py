"""Multimodal RoPE (Qwen2-VL's ``mrope_section``): three position streams per token as a
position kind of every call (``apply``, ``apply_``, ``apply_qk``, ``apply_qkv``) and table kind,
against a float64 reference built channel by channel from the definition, and against
transformers' own Qwen2-VL rotary embedding.
"""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from cases import mrope_qk_inputs
from reference import assert_forward_backward, assert_matches, reference_rope
from rope_dispatch import call as call_module

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SECTIONS = (2, 3, 3)  # d2 = 16
D2 = 16
TABLE_LEN = 40


def _use(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "triton":
        request.getfixturevalue("triton_backend")


def _token_angles(angles: torch.Tensor, streams: torch.Tensor, sections) -> torch.Tensor:
    """float64 ``[tokens, d2]``: channel ``c`` of token ``t`` at the position of its section's
    stream, written out one channel at a time from the definition."""
    d2 = angles.shape[1]
    stream_of = []
    for stream, count in enumerate(sections):
        stream_of += [stream] * count
    out = torch.empty(streams.shape[1], d2, dtype=torch.float64)
    for c in range(d2):
        s = stream_of[c % (d2 // 2)]
        out[:, c] = angles.double()[streams[s].long(), c]
    return out


def _inputs(layout: str, seed: int, heads: int = 3, head_dim: int = 20, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shape = {"sbhd": (5, 2, heads, head_dim), "bshd": (2, 5, heads, head_dim),
             "thd": (9, heads, head_dim)}[layout]
    t = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    angles = torch.rand(TABLE_LEN, D2, generator=gen) * 40 - 20  # halves unequal on purpose
    streams = torch.randint(0, TABLE_LEN, (3, *shape[:-2]), generator=gen)
    spec = rd.RoPESpec(layout=layout, dtype=dtype, mrope_section=SECTIONS)
    return t, angles, streams, spec


def _expected(t, angles, streams, scale: float = 1.0):
    tokens = streams.reshape(3, -1)
    per_token = _token_angles(angles, tokens, SECTIONS)
    own = torch.arange(tokens.shape[1]).view(streams.shape[1:])
    return reference_rope(t.cpu(), per_token, own, False, scale)


def _table(kind: str, angles: torch.Tensor):
    angles = angles.to(DEVICE)
    if kind == "angles":
        return angles.view(TABLE_LEN, 1, 1, D2)
    return rd.cos_sin_cache(angles.view(TABLE_LEN, 1, 1, D2))


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("kind", ["angles", "cos_sin_cache"])
def test_apply_matches_the_definition_forward_and_backward(backend, layout, kind, request):
    _use(backend, request)
    t, angles, streams, spec = _inputs(layout, seed=len(layout) + len(kind))
    t.requires_grad_(True)
    out = rd.apply(t, _table(kind, angles), spec, positions=streams.to(DEVICE), backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_forward_backward(out, t, grad_out, lambda x: _expected(x, angles, streams), t.dtype)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_pair_cache_in_place_and_a_scale(backend, request):
    """An engine's pair cache (one angle per pair), rotated in place, with a cos/sin scale."""
    _use(backend, request)
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(6, 2, 2, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    pair = torch.rand(TABLE_LEN, D2 // 2, generator=gen, dtype=torch.float64) * 30
    cache = rd.PairCosSinCache(torch.cat((pair.cos(), pair.sin()), -1).float().to(DEVICE))
    streams = torch.randint(0, TABLE_LEN, (3, 6, 2), generator=gen, dtype=torch.int32)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16", mrope_section=SECTIONS, cos_sin_scale=1.2)
    expected = _expected(t, torch.cat((pair, pair), -1), streams, scale=1.2)
    out = rd.apply_(t.clone(), cache, spec, positions=streams.to(DEVICE), backend=backend)
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("kind", ["angles", "cos_sin_cache", "pair_cos_sin_cache", "rates"])
def test_no_tokens(backend, kind, request):
    """A call of no tokens returns an empty tensor for every table kind, as without sections:
    a cache's per-token rows were a cache of no rows, which its constructor refused."""
    _use(backend, request)
    angles = torch.rand(TABLE_LEN, D2 // 2, generator=torch.Generator().manual_seed(6)) * 9
    if kind == "pair_cos_sin_cache":
        halves = angles.double()
        table = rd.PairCosSinCache(torch.cat((halves.cos(), halves.sin()), -1).float().to(DEVICE))
    elif kind == "rates":
        table = rd.RateTable(angles[1].contiguous().to(DEVICE), TABLE_LEN)
    else:
        table = _table(kind, torch.cat((angles, angles), -1))
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", mrope_section=SECTIONS)
    t = torch.randn(2, 0, 3, 20).to(DEVICE)
    streams = torch.zeros(3, 2, 0, dtype=torch.long).to(DEVICE)
    out = rd.apply(t, table, spec, positions=streams, backend=backend)
    assert out.shape == t.shape
    q_out, k_out = rd.apply_qk(t, t[..., :1, :], table, spec, positions=streams, backend=backend)
    assert q_out.shape == t.shape and k_out.shape == (2, 0, 1, 20)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_q_and_k_pair_and_packed_qkv(backend, request):
    _use(backend, request)
    gen = torch.Generator().manual_seed(4)
    q, k, angles, streams = mrope_qk_inputs(gen, TABLE_LEN, D2, DEVICE)
    spec = rd.RoPESpec(layout="thd", dtype="fp32", mrope_section=SECTIONS)
    table = _table("angles", angles)
    q_out, k_out = rd.apply_qk(q, k, table, spec, positions=streams.to(DEVICE), backend=backend)
    assert_matches(q_out, _expected(q, angles, streams), torch.float32, "q")
    assert_matches(k_out, _expected(k, angles, streams), torch.float32, "k")

    qkv = torch.randn(7, 2, 64, generator=gen).to(DEVICE)  # a group: 2 query heads, k, v
    k_angles = torch.rand(TABLE_LEN, D2, generator=gen) * 40 - 20
    outs = rd.apply_qkv(qkv, table, spec, (32, 16, 16), k_freqs=_table("angles", k_angles),
                        positions=streams.to(DEVICE), backend=backend)
    q_heads = qkv[..., :32].reshape(7, 4, 16)
    assert_matches(outs[0], _expected(q_heads, angles, streams), torch.float32, "qkv q")
    assert_matches(outs[1], _expected(qkv[..., 32:48], k_angles, streams), torch.float32, "qkv k")
    assert torch.equal(outs[2], qkv[..., 48:])


def test_matches_transformers_qwen2_vl():
    """Our angle table from the config's rates plus the three position-id streams gives what
    transformers' Qwen2-VL rotary embedding and apply_rotary_pos_emb give."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    from rope_dispatch.tables import from_hf_config

    config = transformers.Qwen2VLTextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    rotary = qwen2_vl.Qwen2VLRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(6)
    position_ids = torch.randint(0, 60, (3, 2, 5), generator=gen)
    q = torch.randn(2, 2, 5, 32, generator=gen)
    k = torch.randn(2, 1, 5, 32, generator=gen)
    cos, sin = rotary(q, position_ids)
    hf_q, hf_k = qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
    table = from_hf_config(config, 64).angle_table(64)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", mrope_section=(4, 6, 6))
    ours_q, ours_k = rd.apply_qk(q.transpose(1, 2), k.transpose(1, 2), table, spec,
                                 positions=position_ids, backend="eager")
    torch.testing.assert_close(ours_q.transpose(1, 2), hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k.transpose(1, 2), hf_k, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument_and_value():
    t = torch.randn(5, 2, 3, 20)
    table = torch.rand(TABLE_LEN, 1, 1, D2)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", mrope_section=SECTIONS)
    streams = torch.randint(0, TABLE_LEN, (3, 5, 2))
    with pytest.raises(rd.RoPEError, match=r"needs positions \[3, \*t.shape\[:-2\]\]"):
        rd.apply(t, table, spec)
    with pytest.raises(rd.RoPEError, match=r"positions must be an int32/int64 tensor \[3, 5, 2\]"):
        rd.apply(t, table, spec, positions=streams[:, :, :1])
    with pytest.raises(rd.RoPEError, match="start_positions cannot be combined"):
        rd.apply(t, table, spec, positions=streams, start_positions=torch.zeros(2, dtype=torch.long))
    wide = rd.RoPESpec(layout="sbhd", dtype="fp32", mrope_section=(2, 3, 4))
    with pytest.raises(rd.RoPEError, match=r"covers 18 rotary channels .* d2=16"):
        rd.apply(t, table, wide, positions=streams)
    far = streams.clone()
    far[1, 0, 0] = TABLE_LEN
    with pytest.raises(rd.RoPEError, match=rf"positions must lie in \[0, {TABLE_LEN}\).* to {TABLE_LEN}"):
        rd.apply(t, table, spec, positions=far)
    with pytest.raises(rd.RoPEError, match="mrope_section needs interleaved=False"):
        rd.RoPESpec(layout="sbhd", dtype="fp32", mrope_section=SECTIONS, interleaved=True)


def test_unread_stream_outside_the_table_is_nan_in_its_channels_only(monkeypatch):
    """Positions the host does not read (device tensors): a height position past the table makes
    the height channels of that token NaN (both halves), every other value stays right."""
    monkeypatch.setattr(call_module, "_reads", lambda index: False)
    t, angles, streams, spec = _inputs("sbhd", seed=9)
    far = streams.clone()
    far[1, 2, 1] = TABLE_LEN + 3
    out = rd.apply(t, _table("angles", angles), spec, positions=far.to(DEVICE), backend="eager")
    height = [c for half in (0, D2 // 2) for c in range(half + 2, half + 5)]
    bad = out[2, 1][:, height]
    assert torch.isnan(bad).all()
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[2, 1, :, height] = False
    assert_matches(out[mask].view(-1), _expected(t, angles, streams)[mask.cpu()].view(-1), t.dtype)


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_a_call_under_fake_tensor_mode_leaves_real_calls_alone(backend, monkeypatch):
    """A first call under a ``FakeTensorMode`` (shape propagation, memory estimation): the
    index of each channel's stream it makes is a fake tensor, made for that call and never
    kept, so a later real call reads real values (it met the fake one: FakeTensorMode's
    "convert all Tensors to FakeTensors first")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rope_dispatch import table_kinds

    monkeypatch.setattr(table_kinds, "_channel_streams", {})  # no stream index made yet
    t, angles, streams, spec = _inputs("sbhd", seed=4)
    with FakeTensorMode():
        fake_t, fake_angles = torch.randn(t.shape, device=DEVICE), torch.rand(angles.shape,
                                                                              device=DEVICE)
        fake_streams = torch.randint(0, TABLE_LEN, streams.shape, device=DEVICE)
        assert rd.apply(fake_t, fake_angles, spec, positions=fake_streams,
                        backend=backend).shape == t.shape
    out = rd.apply(t, angles.to(DEVICE), spec, positions=streams.to(DEVICE), backend=backend)
    assert_matches(out, _expected(t, angles, streams), t.dtype)
