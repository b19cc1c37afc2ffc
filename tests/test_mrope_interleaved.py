"""Interleaved multimodal RoPE (Qwen3-VL: ``RoPESpec(mrope_section=..., mrope_interleaved=True)``):
the temporal, height and width sections spread across the frequency pairs instead of following
each other. Checked against a float64 reference written pair by pair from the rule, on every
call kind and table kind, on the eager, compiled and Triton backends, and against transformers'
own Qwen3-VL rotary embedding."""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from cases import mrope_qk_inputs
from reference import assert_forward_backward, assert_matches, reference_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SECTIONS = (3, 3, 2)  # 8 pairs: stream of pair j = T H W T H W T H
D2 = 16
TABLE_LEN = 40


def stream_of_pair(j: int, sections) -> int:
    """Qwen3-VL's rule: pair ``j`` of a half reads the height stream where ``j % 3 == 1`` and
    ``j < 3 h``, the width stream where ``j % 3 == 2`` and ``j < 3 w``, else the temporal one."""
    _, h, w = sections
    if j % 3 == 1 and j < 3 * h:
        return 1
    if j % 3 == 2 and j < 3 * w:
        return 2
    return 0


def token_angles(angles, streams, sections) -> torch.Tensor:
    """float64 ``[tokens, d2]``: channel ``c`` at the position of its pair's stream."""
    d2 = angles.shape[1]
    out = torch.empty(streams.shape[1], d2, dtype=torch.float64)
    for c in range(d2):
        s = stream_of_pair(c % (d2 // 2), sections)
        for token in range(streams.shape[1]):
            out[token, c] = float(angles[int(streams[s, token]), c])
    return out


def expected(t, angles, streams, sections=SECTIONS, scale=1.0):
    tokens = streams.reshape(3, -1)
    own = torch.arange(tokens.shape[1]).view(streams.shape[1:])
    return reference_rope(t.cpu(), token_angles(angles, tokens, sections), own, False,
                          scale)


def spec(layout, dtype=torch.float32, **fields):
    return rd.RoPESpec(layout=layout, dtype=dtype, mrope_section=SECTIONS, mrope_interleaved=True,
                       **fields)


def test_the_rule_gives_each_stream_its_section_size():
    for sections in [(24, 20, 20), (3, 3, 2), (8, 0, 0), (2, 1, 1), (4, 2, 2)]:
        pairs = [stream_of_pair(j, sections) for j in range(sum(sections))]
        assert [pairs.count(s) for s in range(3)] == list(sections)
    assert [stream_of_pair(j, SECTIONS) for j in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]


def _use(backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_backend")


@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_apply_matches_the_rule_forward_and_backward(backend, layout, request):
    _use(backend, request)
    if backend == "compile" and not rd.get_backend("compile").available:
        pytest.skip("the compile backend is not available here")
    gen = torch.Generator().manual_seed(len(layout))
    shape = {"sbhd": (5, 2, 3, 20), "thd": (9, 3, 20)}[layout]
    t = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_(True)
    angles = torch.rand(TABLE_LEN, D2, generator=gen) * 40 - 20  # halves unequal on purpose
    streams = torch.randint(0, TABLE_LEN, (3, *shape[:-2]), generator=gen)
    out = rd.apply(t, angles.view(TABLE_LEN, 1, 1, D2).to(DEVICE), spec(layout),
                   positions=streams.to(DEVICE), backend=backend)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    assert_forward_backward(out, t, grad_out, lambda x: expected(x, angles, streams),
                            torch.float32)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_q_and_k_with_a_cos_sin_cache_and_a_pair_cache_in_place(backend, request):
    _use(backend, request)
    gen = torch.Generator().manual_seed(4)
    q, k, angles, streams = mrope_qk_inputs(gen, TABLE_LEN, D2, DEVICE)
    cache = rd.cos_sin_cache(angles.view(TABLE_LEN, 1, 1, D2).to(DEVICE))
    q_out, k_out = rd.apply_qk(q, k, cache, spec("thd"), positions=streams.to(DEVICE),
                               backend=backend)
    assert_matches(q_out, expected(q, angles, streams), torch.float32, "q")
    assert_matches(k_out, expected(k, angles, streams), torch.float32, "k")

    pair = torch.rand(TABLE_LEN, D2 // 2, generator=gen, dtype=torch.float64) * 30
    pair_cache = rd.PairCosSinCache(torch.cat((pair.cos(), pair.sin()), -1).float().to(DEVICE))
    t = torch.randn(6, 2, 2, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    pos = torch.randint(0, TABLE_LEN, (3, 6, 2), generator=gen, dtype=torch.int32)
    out = rd.apply_(t.clone(), pair_cache, spec("sbhd", "bf16", cos_sin_scale=1.2),
                    positions=pos.to(DEVICE), backend=backend)
    assert_matches(out, expected(t, torch.cat((pair, pair), -1), pos, scale=1.2), torch.bfloat16)


def test_interleaved_and_contiguous_sections_differ():
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(6, 2, 16, generator=gen)
    angles = torch.rand(TABLE_LEN, 1, 1, D2, generator=gen) * 40
    streams = torch.randint(0, TABLE_LEN, (3, 6), generator=gen)
    contiguous = rd.RoPESpec(layout="thd", dtype="fp32", mrope_section=SECTIONS)
    a = rd.apply(t, angles, contiguous, positions=streams, backend="eager")
    b = rd.apply(t, angles, spec("thd"), positions=streams, backend="eager")
    assert not torch.allclose(a, b)
    assert spec("thd").static_fields()["mrope_interleaved"] is True
    assert "mrope_interleaved" not in contiguous.static_fields()


def test_matches_transformers_qwen3_vl():
    """Our angle table from the config's rates, the three position-id streams and
    ``mrope_interleaved`` give what transformers' Qwen3-VL rotary embedding and its
    apply_rotary_pos_emb give."""
    transformers = pytest.importorskip("transformers")
    qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    from rope_dispatch.tables import default_frequencies

    sections = (6, 5, 5)
    config = transformers.Qwen3VLTextConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": list(sections), "mrope_interleaved": True},
    )
    rotary = qwen3_vl.Qwen3VLTextRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(6)
    position_ids = torch.randint(0, 60, (3, 2, 5), generator=gen)
    q = torch.randn(2, 4, 5, 32, generator=gen)
    k = torch.randn(2, 2, 5, 32, generator=gen)
    cos, sin = rotary(q, position_ids)
    hf_q, hf_k = qwen3_vl.apply_rotary_pos_emb(q, k, cos, sin)
    table = default_frequencies(32, rope_theta=10000.0).angle_table(64)
    ours = rd.RoPESpec(layout="bshd", dtype="fp32", mrope_section=sections, mrope_interleaved=True)
    ours_q, ours_k = rd.apply_qk(q.transpose(1, 2), k.transpose(1, 2), table, ours,
                                 positions=position_ids, backend="eager")
    torch.testing.assert_close(ours_q.transpose(1, 2), hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k.transpose(1, 2), hf_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(mrope_interleaved=True), "mrope_interleaved=True needs mrope_section"),
    (dict(mrope_section=(1, 4, 3), mrope_interleaved=True), r"\(1, 4, 3\) cannot be interleaved"),
    (dict(mrope_section=(2, 3, 3), mrope_interleaved=1), "mrope_interleaved: expected True or"),
])
def test_bad_specs_are_refused_by_name(fields, message):
    with pytest.raises(rd.RoPEError, match=message):
        rd.RoPESpec(layout="thd", dtype="fp32", **fields)
