"""``rope_dispatch.compat.vllm``: vLLM's ``rotary_embedding`` and ``fused_qk_norm_rope`` against
their semantics (vLLM's CUDA kernels), written out here in float64."""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from rope_dispatch.compat.vllm import fused_qk_norm_rope, rotary_embedding

from reference import reference_cache_rope

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def engine_cache(max_pos: int, rot_dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """vLLM's cos_sin_cache layout, ``[cos(angles) | sin(angles)]``, of random pair angles."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(max_pos, rot_dim // 2, generator=gen, dtype=torch.float64) * 50
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def vllm_rope(x, positions, head_size, cache, is_neox, offset=0, inverse=False):
    """float64 RoPE as vLLM defines it: heads of ``head_size`` channels; with ``r`` the cache's
    width, channels ``offset .. offset + r`` rotate by ``cos = cache[p, k]``, ``sin = cache[p,
    r/2 + k]`` (minus that for ``inverse``), pair ``k`` being channels ``(k, k + r/2)`` (NeoX)
    or ``(2k, 2k + 1)``; the rest are untouched."""
    r = cache.shape[1]
    heads = x.detach().double().reshape(*positions.shape, -1, head_size)
    cos, sin = cache.double()[:, : r // 2], cache.double()[:, r // 2 :] * (-1 if inverse else 1)
    # per channel: pair k's cos and sin on both of its channels
    widen = (lambda t: torch.cat((t, t), -1)) if is_neox else (lambda t: t.repeat_interleave(2, -1))
    part = heads[..., offset : offset + r]
    out = heads.clone()
    out[..., offset : offset + r] = reference_cache_rope(part, widen(cos), widen(sin), positions,
                                                         not is_neox)
    return out.reshape(x.shape)


def rms_normed(x, weight, eps):
    """float64 ``x / sqrt(mean(x**2) + eps) * weight`` over each head's last dim."""
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def device_of(backend: str) -> str:
    """Where a backend's case runs: the GPU for Triton when there is one (else its CPU
    interpreter), the CPU for eager."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def err(got, want):
    return float(((got.double() - want).abs() / (1 + want.abs())).max())


# ---- rotary_embedding ---------------------------------------------------------------------

rope_args = st.tuples(
    st.integers(1, 7),                                  # tokens
    st.sampled_from(((4, 4), (4, 2), (4, 1), (2, 0))),  # q heads, kv heads (0: key None)
    st.sampled_from((8, 16)),                           # head_size
    st.booleans(),                                      # partial rotary
    st.booleans(),                                      # is_neox
    st.sampled_from((torch.float32, torch.bfloat16)),   # q/k dtype
    st.booleans(),                                      # cache in the query's dtype (vLLM's)
    st.booleans(),                                      # 3-D [T, heads, head_size] inputs
    st.integers(0, 2**16),
)


def check_rotary(backend, a):
    tokens, (heads, kv), head_size, partial, is_neox, dtype, cache_in_dtype, three_d, seed = a
    gen = torch.Generator().manual_seed(seed)
    rot = head_size // 2 if partial else head_size
    cache = engine_cache(32, rot, seed, dtype if cache_in_dtype else torch.float32)
    positions = torch.randint(0, 32, (tokens,), generator=gen)
    # q and k: slices of one fused projection; v after them must stay as it is
    qkv = torch.randn(tokens, (heads + 2 * max(kv, 1)) * head_size, generator=gen).to(dtype)
    qkv, cache, positions = (x.to(device_of(backend)) for x in (qkv, cache, positions))
    query = qkv[:, : heads * head_size]
    key = qkv[:, heads * head_size : (heads + kv) * head_size] if kv else None
    if three_d:
        query = query.view(tokens, heads, head_size)
        key = None if key is None else key.view(tokens, kv, head_size)
    rest = qkv[:, (heads + kv) * head_size :].clone()
    want_q = vllm_rope(query, positions, head_size, cache, is_neox)
    want_k = None if key is None else vllm_rope(key, positions, head_size, cache, is_neox)
    with rd.use_backend(backend):
        assert rotary_embedding(positions, query, key, head_size, cache, is_neox) is None
    assert err(query, want_q) <= TOL[dtype]
    if key is not None:
        assert err(key, want_k) <= TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv) * head_size :], rest), "the rest untouched"


@given(rope_args)
def test_rotary_embedding_matches_vllm_semantics(a):
    check_rotary("eager", a)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=2, deadline=None)
@given(rope_args)
def test_rotary_embedding_on_triton(a):
    check_rotary("triton", a)


@pytest.mark.parametrize("four_d", [False, True])
def test_batch_seq_positions(four_d):
    """vLLM also takes positions ``[batch, seq]`` with query ``[batch, seq, heads * head_size]``
    or ``[batch, seq, heads, head_size]``."""
    gen = torch.Generator().manual_seed(1)
    cache = engine_cache(16, 8, 1)
    positions = torch.randint(0, 16, (2, 3), generator=gen)
    query, key = torch.randn(2, 3, 4 * 8, generator=gen), torch.randn(2, 3, 2 * 8, generator=gen)
    if four_d:
        query, key = query.view(2, 3, 4, 8), key.view(2, 3, 2, 8)
    want_q = vllm_rope(query, positions, 8, cache, False)
    want_k = vllm_rope(key, positions, 8, cache, False)
    rotary_embedding(positions, query, key, 8, cache, False)
    assert err(query, want_q) <= 2e-6 and err(key, want_k) <= 2e-6


@pytest.mark.parametrize("offset, inverse", [(4, False), (0, True), (4, True)])
def test_rope_dim_offset_and_inverse(offset, inverse):
    """vLLM's two later arguments: rotate channels ``offset .. offset + rot_dim``; rotate by
    minus the angle. Inverse undoes the rotation."""
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 16, (5,), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        cache = engine_cache(16, 8, 2, dtype)
        query = torch.randn(5, 3 * 16, generator=gen).to(dtype)
        key = torch.randn(5, 16, generator=gen).to(dtype)
        before = query.clone()
        want_q = vllm_rope(query, positions, 16, cache, True, offset, inverse)
        want_k = vllm_rope(key, positions, 16, cache, True, offset, inverse)
        rotary_embedding(positions, query, key, 16, cache, True, offset, inverse)
        assert err(query, want_q) <= TOL[dtype] and err(key, want_k) <= TOL[dtype]
        if dtype == torch.float32:
            rotary_embedding(positions, query, None, 16, cache, True, offset, not inverse)
            assert err(query, before.double()) <= 1e-5


def test_a_half_cache_is_copied_once_and_again_after_a_write():
    """A bfloat16 cache is read through a float32 copy, kept across calls and made again when
    the cache is written in place."""
    from rope_dispatch.compat import vllm

    cache = engine_cache(16, 8, 3, torch.bfloat16)
    positions = torch.tensor([0, 5, 15])
    tables = []
    for step in range(3):
        if step == 2:
            cache.mul_(-1)
        query = torch.randn(3, 8)
        want = vllm_rope(query, positions, 8, cache, True)
        rotary_embedding(positions, query, None, 8, cache, True)
        assert err(query, want) <= 2e-6, step
        tables.append(vllm._table(cache, positions)[0])
    assert tables[0] is tables[1] is not tables[2]


def test_an_inference_half_cache_written_in_place_is_read_as_written():
    """An inference tensor has no version counter to tell a write into it: a bfloat16 cache
    made under inference mode (as vLLM's is where it converts the cache in its forward) is
    read at the call's own rows, so a write in place between calls is seen."""
    with torch.inference_mode():
        cache = engine_cache(16, 8, 3, torch.bfloat16)
        positions = torch.tensor([0, 5, 15])
        for step in range(3):
            if step == 2:
                cache.copy_(engine_cache(16, 8, 4, torch.bfloat16))
            query, key = torch.randn(3, 16), torch.randn(3, 8)
            want_q = vllm_rope(query, positions, 8, cache, True)
            want_k = vllm_rope(key, positions, 8, cache, True)
            rotary_embedding(positions, query, key, 8, cache, True)
            assert err(query, want_q) <= 2e-6 and err(key, want_k) <= 2e-6, step
            qkv, weight = torch.randn(3, 3 * 8), torch.rand(8) + 0.5
            want = [vllm_rope(x / x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
                              * weight.double(), positions, 8, cache, True)
                    for x in (qkv[:, :8], qkv[:, 8:16])]
            v = qkv[:, 16:].clone()
            fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, True, positions)
            assert max(err(qkv[:, :8], want[0]), err(qkv[:, 8:16], want[1])) <= 1e-5, step
            assert torch.equal(qkv[:, 16:], v)


def test_a_half_cache_given_new_memory_is_copied_again():
    """``cache.data = ...`` (new memory, no write torch counts) makes the float32 copy again,
    as a table given new memory is checked again (docs/semantics.md)."""
    cache = engine_cache(16, 8, 3, torch.bfloat16)
    positions = torch.tensor([1, 2, 3])
    for step in range(2):
        if step:
            cache.data = engine_cache(16, 8, 4, torch.bfloat16)
        query = torch.randn(3, 16)
        want = vllm_rope(query, positions, 8, cache, True)
        rotary_embedding(positions, query, None, 8, cache, True)
        assert err(query, want) <= 2e-6, step


@pytest.mark.parametrize("eager_first", [False, True])
def test_a_half_cache_traced_by_torch_compile(eager_first):
    """Both ops inside ``torch.compile(fullgraph=True)`` on a bfloat16 cache, before or after an
    eager call kept its float32 copy: the traced call makes its own copy (Dynamo raised
    Unsupported on the version counter and address the kept copy is checked by)."""
    torch._dynamo.reset()
    cache = engine_cache(16, 8, 6, torch.bfloat16)
    positions = torch.tensor([3, 0, 15])
    if eager_first:
        rotary_embedding(positions, torch.randn(3, 8), None, 8, cache, True)

    def step(query, key, qkv, positions):
        query, key, qkv = query.clone(), key.clone(), qkv.clone()
        rotary_embedding(positions, query, key, 8, cache, False)
        weight = torch.ones(8)
        fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, True, positions)
        return query, key, qkv

    query, key, qkv = torch.randn(3, 2 * 8), torch.randn(3, 8), torch.randn(3, 3 * 8)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(query, key, qkv, positions)
    normed = rms_normed(qkv.view(3, 3, 8)[:, :2], torch.ones(8), 1e-6).reshape(3, 16)
    wants = (vllm_rope(query, positions, 8, cache, False), vllm_rope(key, positions, 8, cache,
             False), torch.cat((vllm_rope(normed, positions, 8, cache, True), qkv[:, 16:]), -1))
    for name, out, want in zip(("query", "key", "qkv"), got, wants):
        assert err(out, want) <= 2e-6, name


def test_a_half_cache_met_on_fake_tensors_is_not_kept():
    """A call under FakeTensorMode (shape propagation) on a bfloat16 cache makes its float32
    copy as a fake tensor: not kept, and no fake address read, so the next real call on that
    cache rotates by the cache's values (the kept fake copy gave errors near 3)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = engine_cache(16, 8, 7, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a fake tensor's address read
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            rotary_embedding(torch.tensor([0, 1, 2]), mode.from_tensor(torch.randn(3, 8)), None,
                             8, mode.from_tensor(cache), True)
            rotary_embedding(torch.tensor([0, 1, 2]), mode.from_tensor(torch.randn(3, 8)), None,
                             8, cache, True)
    positions, query = torch.tensor([3, 0, 15]), torch.randn(3, 16)
    want = vllm_rope(query, positions, 8, cache, True)
    rotary_embedding(positions, query, None, 8, cache, True)
    assert err(query, want) <= 2e-6


def test_a_traced_half_cache_widens_only_the_rows_read():
    """Traced, a bfloat16 cache of 4,096 positions is widened only at the call's rows (a
    float32 copy of it all on every call would cost more than the rotation): no float32 value
    of the graph has the cache's rows. A position past the cache gives a NaN row (its rotary
    channels NaN, the rest untouched), as the kernels give."""
    torch._dynamo.reset()
    cache = engine_cache(4096, 6, 7, torch.bfloat16)
    rows = []

    def backend(graph, inputs):
        for node in graph.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                rows.append(tuple(value.shape))
        return graph

    def step(query, positions):
        query = query.clone()
        rotary_embedding(positions, query, None, 8, cache, True)
        return query

    query, positions = torch.randn(3, 16), torch.tensor([3, 4095, 4096])
    got = torch.compile(step, fullgraph=True, backend=backend)(query, positions)
    assert rows and all(4096 not in shape for shape in rows), rows
    assert err(got[:2], vllm_rope(query[:2], positions[:2], 8, cache, True)) <= 2e-6
    heads = got[2].view(2, 8)
    assert heads[:, :6].isnan().all() and torch.equal(heads[:, 6:], query[2].view(2, 8)[:, 6:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_traced_half_cache_with_no_tokens(dtype):
    """Traced with no tokens (an idle rank's empty batch), a half cache widens no rows: both
    ops are no-ops, as in eager (the widened table had no row, and was refused as an empty
    cos_sin_cache though the cache has 16)."""
    torch._dynamo.reset()
    cache, weight = engine_cache(16, 8, 9, dtype), torch.ones(8)

    def step(query, key, qkv, positions):
        query, key, qkv = query.clone(), key.clone(), qkv.clone()
        rotary_embedding(positions, query, key, 8, cache, True)
        fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, True, positions)
        return query, key, qkv

    empty = (torch.randn(0, 16), torch.randn(0, 8), torch.randn(0, 24), torch.zeros(0).long())
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*empty)
    assert [tuple(t.shape) for t in got] == [(0, 16), (0, 8), (0, 24)]


def test_a_traced_half_cache_is_checked_as_in_eager():
    """A bfloat16 cache that eager refuses is refused traced too, in the same words: an odd
    width with the cache's own shape (not that of the rows read), a transposed one as not
    contiguous (it was taken, traced only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for cache, words in ((torch.rand(16, 7).bfloat16(), "got shape (16, 7)"),
                         (torch.rand(8, 16).bfloat16().t(), "must be contiguous")):
        for fake in (False, True):
            with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
                query = torch.randn(3, 16)
                with pytest.raises(rd.RoPEError) as info:
                    rotary_embedding(torch.tensor([0, 1, 2]), query, None, 8, cache, True)
            assert "cos_sin_cache" in str(info.value) and words in str(info.value), (
                fake, str(info.value))


def test_under_inference_mode():
    """vLLM runs its model under inference mode: the doors work there, on an inference-tensor
    bfloat16 cache too (which has no version counter), and the cache's copy is a normal tensor."""
    from rope_dispatch.compat import vllm

    with torch.inference_mode():
        cache = engine_cache(16, 8, 5, torch.bfloat16)
        positions = torch.tensor([3, 0, 15])
        query, key = torch.randn(3, 2 * 8).bfloat16(), torch.randn(3, 8).bfloat16()
        want_q = vllm_rope(query, positions, 8, cache, False)
        want_k = vllm_rope(key, positions, 8, cache, False)
        rotary_embedding(positions, query, key, 8, cache, False)
        assert err(query, want_q) <= 1.6e-2 and err(key, want_k) <= 1.6e-2
        qkv, weight = torch.randn(3, 3 * 8).bfloat16(), torch.ones(8).bfloat16()
        fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, False, positions)
        assert cache.is_inference() and not vllm._table(cache, positions)[0].table.is_inference()


# ---- fused_qk_norm_rope -------------------------------------------------------------------

fused_args = st.tuples(
    st.integers(1, 6),                                           # tokens
    st.sampled_from(((4, 2, 2), (2, 2, 2), (4, 1, 1), (3, 1, 0))),  # hq, hk, hv
    st.sampled_from((8, 16)),                                    # head_dim
    st.booleans(),                                               # partial rotary
    st.booleans(),                                               # is_neox
    st.sampled_from((torch.float32, torch.bfloat16)),
    st.booleans(),                                               # cache in qkv's dtype
    st.integers(0, 2**16),
)


def check_fused(backend, a):
    tokens, (hq, hk, hv), head_dim, partial, is_neox, dtype, cache_in_dtype, seed = a
    gen = torch.Generator().manual_seed(seed)
    rot = head_dim // 2 if partial else head_dim
    cache = engine_cache(32, rot, seed, dtype if cache_in_dtype else torch.float32)
    positions = torch.randint(0, 32, (tokens,), generator=gen)
    qkv = (torch.randn(tokens, (hq + hk + hv) * head_dim, generator=gen) * 3).to(dtype)
    q_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    qkv, cache, positions, q_weight, k_weight = (
        x.to(device_of(backend)) for x in (qkv, cache, positions, q_weight, k_weight))
    eps = 1e-6
    heads = qkv.double().view(tokens, -1, head_dim)
    q = rms_normed(heads[:, :hq], q_weight, eps)
    k = rms_normed(heads[:, hq : hq + hk], k_weight, eps)
    want_q = vllm_rope(q, positions, head_dim, cache, is_neox)
    want_k = vllm_rope(k, positions, head_dim, cache, is_neox)
    v = qkv[:, (hq + hk) * head_dim :].clone()
    pointer = qkv.data_ptr()
    with rd.use_backend(backend):
        assert fused_qk_norm_rope(qkv, hq, hk, hv, head_dim, eps, q_weight, k_weight, cache,
                                  is_neox, positions) is None
    assert qkv.data_ptr() == pointer
    got = qkv.view(tokens, -1, head_dim)
    assert err(got[:, :hq], want_q) <= TOL[dtype]
    assert err(got[:, hq : hq + hk], want_k) <= TOL[dtype]
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v), "v untouched, byte for byte"


@given(fused_args)
def test_fused_qk_norm_rope_matches_vllm_semantics(a):
    check_fused("eager", a)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=3, deadline=None)
@given(fused_args)
def test_fused_qk_norm_rope_on_triton(a):
    check_fused("triton", a)


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=pytest.mark.gpu)])
def test_fused_rounds_once(backend):
    """The normalized value is not rounded before the rotation (vLLM's fused kernel keeps it in
    float32): every bfloat16 result lies within half a unit in the last place of the float64
    value, which a result rounded after the norm too does not. (Triton's CPU interpreter
    narrows float32 to bfloat16 by its own rule, so the Triton case runs on the GPU.)"""
    gen = torch.Generator().manual_seed(4)
    tokens, head_dim = 64, 16
    cache = engine_cache(64, head_dim, 4)
    positions = torch.arange(tokens)
    qkv = torch.randn(tokens, 3 * head_dim, generator=gen).bfloat16()
    weight = (torch.rand(head_dim, generator=gen) + 0.5).bfloat16()
    normed = rms_normed(qkv.double().view(tokens, 3, head_dim)[:, :1], weight, 1e-6)
    want = vllm_rope(normed, positions, head_dim, cache, True)
    twice = vllm_rope(normed.bfloat16(), positions, head_dim, cache, True).bfloat16()
    qkv, weight, cache, positions = (x.to(device_of(backend)) for x in (qkv, weight, cache, positions))
    with rd.use_backend(backend):
        fused_qk_norm_rope(qkv, 1, 1, 1, head_dim, 1e-6, weight, weight, cache, True, positions)
    got = qkv.view(tokens, 3, head_dim)[:, :1].cpu()
    half_ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 9)

    def within(t):
        return bool(((t.double() - want).abs() <= half_ulp * (1 + 1e-3)).all())

    assert within(got)
    assert not within(twice)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_fused_takes_eps_zero(backend, request):
    """vLLM's fused op takes eps=0 (its kernel computes ``x * rsqrt(mean(x**2) + eps) * w``):
    a head of non-zero values is normalized by rsqrt(mean(x**2)), and an all-zero head gives
    what the formula gives, 0 * inf = NaN, in every channel. It was refused (HeadNorm's
    float32-normal range)."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    gen = torch.Generator().manual_seed(7)
    tokens, head_dim, (hq, hk, hv) = 5, 16, (2, 1, 1)
    cache = engine_cache(16, head_dim // 2, 7)
    positions = torch.randint(0, 16, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (hq + hk + hv) * head_dim, generator=gen)
    qkv[1, :head_dim] = 0  # token 1's first q head
    qkv[3, hq * head_dim : (hq + hk) * head_dim] = 0  # token 3's k head
    q_weight, k_weight = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim) + 0.5
    heads = qkv.double().view(tokens, -1, head_dim)
    want_q = vllm_rope(rms_normed(heads[:, :hq], q_weight, 0.0), positions, head_dim, cache, True)
    want_k = vllm_rope(rms_normed(heads[:, hq : hq + hk], k_weight, 0.0), positions, head_dim,
                       cache, True)
    assert want_q[1, 0].isnan().all() and want_k[3, 0].isnan().all()
    qkv, cache, positions, q_weight, k_weight = (
        x.to(device_of(backend)) for x in (qkv, cache, positions, q_weight, k_weight))
    with rd.use_backend(backend):
        fused_qk_norm_rope(qkv, hq, hk, hv, head_dim, 0.0, q_weight, k_weight, cache, True,
                           positions)
    got = qkv.view(tokens, -1, head_dim).cpu()
    for part, want in ((got[:, :hq], want_q), (got[:, hq : hq + hk], want_k)):
        assert torch.equal(part.isnan(), want.isnan())
        finite = ~want.isnan()
        assert err(part[finite], want[finite]) <= TOL[torch.float32]
    with pytest.raises(rd.RoPEError, match=r"eps must be positive, got -1e-30"):
        fused_qk_norm_rope(qkv, hq, hk, hv, head_dim, -1e-30, q_weight, k_weight, cache, True,
                           positions)


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_an_eps_zero_norm_copies_and_pickles(protocol):
    """The eps-0 norm the fused op makes (norm.zero_eps_norm) is copied and pickled as itself:
    its copy was made through HeadNorm's constructor, which refuses eps 0."""
    from rope_dispatch.norm import zero_eps_norm

    norm = zero_eps_norm(torch.rand(8) + 0.5)
    for twin in (copy.copy(norm), copy.deepcopy(norm),
                 pickle.loads(pickle.dumps(norm, protocol=protocol))):
        assert type(twin) is rd.HeadNorm and twin.form is norm.form
        assert (twin.eps, twin.offset, twin.scope) == (0.0, 0.0, "head")
        assert torch.equal(twin.weight, norm.weight)


# ---- signatures and bad arguments ----------------------------------------------------------

def test_signatures_are_vllms():
    """vllm/_custom_ops.py (commit 0002bde5): names, order and defaults."""
    rope = inspect.signature(rotary_embedding).parameters
    assert list(rope) == ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox",
                          "rope_dim_offset", "inverse"]
    assert (rope["rope_dim_offset"].default, rope["inverse"].default) == (0, False)
    fused = inspect.signature(fused_qk_norm_rope).parameters
    assert list(fused) == ["qkv", "num_heads_q", "num_heads_k", "num_heads_v", "head_dim", "eps",
                           "q_weight", "k_weight", "cos_sin_cache", "is_neox", "position_ids",
                           "forced_token_heads_per_warp"]
    assert fused["forced_token_heads_per_warp"].default == -1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(positions=torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
         ["positions must be int64", "int32"]),
        (dict(positions=torch.zeros(1, 2, 2, dtype=torch.long)),
         ["positions must be [num_tokens] or [batch, seq]", "(1, 2, 2)"]),
        (dict(head_size=12), ["query must be [num_tokens, heads * head_size]", "head_size=12",
                              "(4, 32)"]),
        (dict(key=torch.randn(4, 3, 8)), ["key must be", "(4, 3, 8)"]),
        (dict(key=torch.randn(4, 48)), ["key has 3 heads, which does not divide query's 2"]),
        (dict(cos_sin_cache=torch.rand(8, 15)), ["cos_sin_cache must have", "even", "(8, 15)"]),
        (dict(cos_sin_cache=torch.rand(8, 15).bfloat16()), ["cos_sin_cache must have", "(8, 15)"]),
        (dict(cos_sin_cache=torch.rand(8, 16).double()),
         ["cos_sin_cache must be a float32, bfloat16 or float16", "float64"]),
        (dict(cos_sin_cache=torch.rand(8 * 16).bfloat16()),
         ["cos_sin_cache must be a float32, bfloat16 or float16 tensor [max_position, rot_dim]",
          "(128,) bfloat16"]),
        (dict(cos_sin_cache=torch.rand(8, 1, 16).half()), ["(8, 1, 16) float16"]),
        (dict(cos_sin_cache=torch.rand(8 * 16)),
         ["cos_sin_cache must be a float32, bfloat16 or float16 tensor [max_position, rot_dim]",
          "(128,) float32"]),
        (dict(cos_sin_cache=torch.rand(8, 32).bfloat16()[:, :16]),
         ["cos_sin_cache must be contiguous", "(32, 1)", "(.contiguous())"]),
        (dict(cos_sin_cache=torch.rand(16, 8).t()),
         ["cos_sin_cache must be contiguous", "(1, 8)", "(.contiguous())"]),
        (dict(cos_sin_cache=torch.rand(16, 8).bfloat16().t()),
         ["cos_sin_cache must be contiguous", "(1, 8)", "(.contiguous())"]),
        (dict(cos_sin_cache=torch.rand(8, 20)), ["rotary dim d2=20", "head dim d=16"]),
        (dict(rope_dim_offset=4), ["rope_dim_offset=4 + rot_dim=16 must be <= head_size=16"]),
        (dict(is_neox=1), ["is_neox must be a bool, got 1"]),
        (dict(key=torch.randn(4, 0)), ["key has 0 heads", "does not divide"]),
        (dict(positions=torch.tensor([0, 1, 2])), ["positions must have shape [T] = [4]"]),
        (dict(query=torch.randn(4, 32).double(), key=torch.randn(4, 16).double()),
         ["query must be float32, float16 or bfloat16, got float64"]),
        (dict(query=torch.ones(4, 32, dtype=torch.int32), key=torch.ones(4, 16, dtype=torch.int32)),
         ["query must be float32, float16 or bfloat16, got int32"]),
    ],
)
def test_rotary_embedding_bad_arguments(kwargs, words):
    args = dict(positions=torch.tensor([0, 1, 2, 3]), query=torch.randn(4, 32),
                key=torch.randn(4, 16), head_size=16, cos_sin_cache=torch.rand(8, 16),
                is_neox=True)
    args.update(kwargs)
    with pytest.raises(rd.RoPEError) as info:
        rotary_embedding(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "table" not in str(info.value), "names vLLM's argument, not the door's table"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_heads_v=2), ["qkv must be [num_tokens, (num_heads_q + num_heads_k + "
                               "num_heads_v) * head_dim]", "(2 + 1 + 2) * 8", "40", "(4, 32)"]),
        (dict(qkv=torch.randn(4, 4, 16)), ["qkv must be", "(4, 4, 16)"]),
        (dict(num_heads_k=0), ["num_heads_k must be a positive int, got 0"]),
        (dict(position_ids=torch.arange(4, dtype=torch.int32)), ["position_ids must be int64"]),
        (dict(position_ids=torch.zeros(2, 2, dtype=torch.long)),
         ["position_ids must be [num_tokens]", "(2, 2)"]),
        (dict(q_weight=torch.ones(16)), ["q_weight must be [head_dim] = [8]", "(16,)"]),
        (dict(k_weight=torch.ones(8).bfloat16()), ["k_weight must be", "float32", "bfloat16"]),
        (dict(cos_sin_cache=torch.rand(8, 7)), ["cos_sin_cache must have", "(8, 7)"]),
        (dict(cos_sin_cache=torch.rand(8, 10)), ["rotary dim d2=10", "head dim d=8"]),
        (dict(eps=-1e-6), ["eps must be positive, got -1e-06"]),
        (dict(eps=float("nan")), ["eps must be a finite number, got nan"]),
        (dict(eps="1e-6"), ["eps must be a finite number, got '1e-6'"]),
        (dict(qkv=torch.randn(4, 32).double(), q_weight=torch.ones(8).double(),
              k_weight=torch.ones(8).double()),
         ["qkv must be float32, float16 or bfloat16, got float64"]),
    ],
)
def test_fused_bad_arguments(kwargs, words):
    """Each error names vLLM's argument (eps, not the HeadNorm the door makes of it)."""
    args = dict(qkv=torch.randn(4, 32), num_heads_q=2, num_heads_k=1, num_heads_v=1,
                head_dim=8, eps=1e-6, q_weight=torch.ones(8), k_weight=torch.ones(8),
                cos_sin_cache=torch.rand(8, 8), is_neox=True, position_ids=torch.arange(4))
    args.update(kwargs)
    with pytest.raises(rd.RoPEError) as info:
        fused_qk_norm_rope(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "HeadNorm" not in str(info.value), str(info.value)


def test_arguments_of_a_wrong_type_raise_rope_type_error():
    """A wrong type is a RoPETypeError (a TypeError too), as README.md says of every error: a
    non-tensor query or key, a count that is no integer; a count of the right type but a bad
    value stays a plain RoPEError."""
    args = dict(positions=torch.tensor([0, 1, 2, 3]), query=torch.randn(4, 32),
                key=torch.randn(4, 16), head_size=16, cos_sin_cache=torch.rand(8, 16),
                is_neox=True)
    for bad in (dict(query=None), dict(key="key"), dict(query=[[0.0] * 32] * 4),
                dict(head_size=16.0), dict(head_size=True), dict(rope_dim_offset=None)):
        with pytest.raises(TypeError) as info:
            rotary_embedding(**{**args, **bad})
        assert isinstance(info.value, rd.RoPETypeError) and list(bad)[0] in str(info.value)
    fused = dict(qkv=torch.randn(4, 32), num_heads_q=2, num_heads_k=1, num_heads_v=1,
                 head_dim=8, eps=1e-6, q_weight=torch.ones(8), k_weight=torch.ones(8),
                 cos_sin_cache=torch.rand(8, 8), is_neox=True, position_ids=torch.arange(4))
    for bad in (dict(num_heads_q="2"), dict(head_dim=8.0), dict(num_heads_v=None)):
        with pytest.raises(rd.RoPETypeError, match=list(bad)[0]):
            fused_qk_norm_rope(**{**fused, **bad})
    for bad in (dict(head_size=0), dict(rope_dim_offset=-1)):
        with pytest.raises(rd.RoPEError) as info:
            rotary_embedding(**{**args, **bad})
        assert not isinstance(info.value, TypeError), info.value


def test_numpy_integer_counts_are_taken_as_vllm_takes_them():
    """head_size, rope_dim_offset and the fused op's head counts read from a NumPy config are
    integers vLLM takes; a bool (NumPy's too) is not a count."""
    cache, positions = engine_cache(16, 8, 3), torch.tensor([5, 0, 15])
    query, key = torch.randn(3, 32), torch.randn(3, 16)
    want_q = vllm_rope(query, positions, 16, cache, True, offset=4)
    want_k = vllm_rope(key, positions, 16, cache, True, offset=4)
    rotary_embedding(positions, query, key, np.int64(16), cache, True, np.int32(4))
    assert err(query, want_q) <= TOL[torch.float32] and err(key, want_k) <= TOL[torch.float32]
    qkv, weight = torch.randn(3, 24), torch.rand(8) + 0.5
    heads = qkv.double().view(3, 3, 8)
    want = [vllm_rope(rms_normed(heads[:, h : h + 1], weight, 1e-6), positions, 8, cache, True)
            for h in (0, 1)]
    fused_qk_norm_rope(qkv, np.int64(1), np.int64(1), np.uint8(1), np.int16(8), 1e-6, weight,
                       weight, cache, True, positions)
    for h in (0, 1):
        assert err(qkv.view(3, 3, 8)[:, h : h + 1], want[h]) <= TOL[torch.float32]
    for bad in (np.True_, True, 16.0):
        with pytest.raises(rd.RoPEError, match="head_size must be a positive int, got"):
            rotary_embedding(positions, query, key, bad, cache, True)


@pytest.mark.parametrize("flag", [np.True_, np.False_])
def test_numpy_bool_flags_are_taken_as_vllm_takes_them(flag):
    """is_neox and inverse given as NumPy bools (torch's ops take them for bool arguments) are
    the bools they hold, as the spec takes flags; other types stay refused."""
    cache, positions = engine_cache(16, 8, 8), torch.tensor([5, 0, 15])
    query = torch.randn(3, 32)
    want = vllm_rope(query, positions, 16, cache, bool(flag), inverse=bool(flag))
    rotary_embedding(positions, query, None, 16, cache, flag, 0, flag)
    assert err(query, want) <= TOL[torch.float32]
    qkv, weight = torch.randn(3, 24), torch.rand(8) + 0.5
    want = vllm_rope(rms_normed(qkv.double().view(3, 3, 8)[:, :1], weight, 1e-6), positions, 8,
                     cache, bool(flag))
    fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, flag, positions)
    assert err(qkv.view(3, 3, 8)[:, :1], want) <= TOL[torch.float32]
    with pytest.raises(rd.RoPEError, match="inverse must be a bool, got 'yes'"):
        rotary_embedding(positions, query, None, 16, cache, flag, 0, "yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_that_requires_grad_is_read_as_a_constant(dtype):
    """vLLM's ops do not differentiate their cache and take one that requires grad: so do the
    doors, in grad mode too (a float32 cache as it is, a bfloat16 one widened to a copy that
    keeps no graph)."""
    cache = engine_cache(16, 8, 6, dtype).requires_grad_()
    positions = torch.tensor([5, 0, 15])
    query, key = torch.randn(3, 32), torch.randn(3, 16)
    want_q = vllm_rope(query, positions, 16, cache.detach(), False)
    want_k = vllm_rope(key, positions, 16, cache.detach(), False)
    rotary_embedding(positions, query, key, 16, cache, False)
    assert err(query, want_q) <= TOL[torch.float32] and err(key, want_k) <= TOL[torch.float32]
    qkv, weight = torch.randn(3, 24), torch.rand(8) + 0.5
    heads = qkv.double().view(3, 3, 8)
    want = vllm_rope(rms_normed(heads[:, :2], weight, 1e-6), positions, 8, cache.detach(), True)
    fused_qk_norm_rope(qkv, 1, 1, 1, 8, 1e-6, weight, weight, cache, True, positions)
    assert err(qkv.view(3, 3, 8)[:, :2], want) <= TOL[torch.float32]
    assert cache.grad is None


def test_a_cache_that_requires_grad_is_read_at_its_memory_now():
    """A float32 cache that requires grad is read through a detached constant: one made on fake
    tensors is not kept, and one kept is made again when the cache gets new memory
    (``cache.data = ...``), so each call reads the cache's values (the kept constant read the
    old memory, or a fake tensor's, and errors near 2 came out)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = engine_cache(16, 8, 10).requires_grad_()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        rotary_embedding(torch.tensor([0, 1, 2]), mode.from_tensor(torch.randn(3, 8)), None, 8,
                         cache, True)
    positions = torch.tensor([3, 0, 15])
    for step in range(3):
        if step == 1:
            cache.data = engine_cache(16, 8, 11)
        if step == 2:
            with torch.no_grad():
                cache.mul_(-1)
        query = torch.randn(3, 16)
        want = vllm_rope(query, positions, 8, cache.detach(), True)
        rotary_embedding(positions, query, None, 8, cache, True)
        assert err(query, want) <= 2e-6, step


def test_core_errors_say_how_the_door_mapped_its_arguments():
    """A cache wider than the head is refused by the core, in its own names (t, freqs): the
    error says which of vLLM's arguments those are."""
    cache = torch.randn(16, 32)
    with pytest.raises(rd.RoPEError, match=r"exceeds the head dim .*rotary_embedding calls "
                       r"rope_dispatch\.apply_qk_ with q=query, k=key.*freqs=cos_sin_cache"):
        rotary_embedding(torch.arange(3), torch.randn(3, 32), torch.randn(3, 16), 16, cache, True)
    with pytest.raises(rd.RoPEError, match=r"rotary_embedding calls rope_dispatch\.apply_ "
                       r"with t=query \(as heads") as info:
        rotary_embedding(torch.arange(3), torch.randn(3, 32), None, 16, cache, True)
    assert "k=key" not in str(info.value), "apply_ has no k: key is None"
    with pytest.raises(rd.RoPEError, match=r"fused_qk_norm_rope calls rope_dispatch\.apply_qk_ "
                       r"with q=qkv's q heads.*positions=position_ids, q_norm=q_weight"):
        fused_qk_norm_rope(torch.randn(3, 64), 2, 1, 1, 16, 1e-6, torch.ones(16), torch.ones(16),
                           cache, True, torch.arange(3))


def _overlapping_door_call(door, device):
    """An in-place door's call whose memory the core refuses (q and k sharing elements, a norm
    weight inside what is written), its tensors made outside (a compiled call takes them)."""
    from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(16, 8, generator=gen).to(device)
    positions = torch.arange(3, device=device)
    buf = torch.randn(3, 64, generator=gen).to(device)
    q, k = buf[:, :32], buf[:, 16:48]  # k's first head is q's third
    if door == "flashinfer":
        return lambda: apply_rope_with_cos_sin_cache_inplace(positions, q, k, 8, cache)
    if door == "rotary_embedding":
        return lambda: rotary_embedding(positions, q, k, 8, cache, True)
    qkv = torch.randn(3, 6 * 8, generator=gen).to(device)
    weight = qkv[0, :8]  # q's norm weight inside what is written
    return lambda: fused_qk_norm_rope(qkv, 2, 2, 2, 8, 1e-6, weight, torch.ones(8, device=device),
                                      cache, True, positions)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("door, name", [("flashinfer", "apply_rope_with_cos_sin_cache_inplace"),
                                        ("rotary_embedding", "rotary_embedding"),
                                        ("fused_qk_norm_rope", "fused_qk_norm_rope")])
def test_compiled_in_place_doors_word_the_cores_refusals_as_eager(request, backend, door, name):
    """Compiled, an in-place door's memory checks run in the graph (on its real tensors), after
    the door's try/except has returned: the refusal lacked how the door maps its arguments onto
    the core's (query, key, q_weight), which the eager refusal gives. The same message now."""
    import torch._dynamo

    if backend == "triton":
        request.getfixturevalue("triton_backend")  # (its op checks the memory itself)
    call = _overlapping_door_call(door, device_of(backend))
    with torch.no_grad(), rd.use_backend(backend):
        with pytest.raises(rd.RoPEError) as eager:
            call()
        torch._dynamo.reset()
        with pytest.raises(rd.RoPEError) as compiled:
            torch.compile(call, fullgraph=True, backend="aot_eager")()
    assert f"({name} calls rope_dispatch.apply_qk_ with " in str(eager.value)
    assert str(compiled.value) == str(eager.value)



def test_a_door_in_another_thread_does_not_recompile_a_compiled_core_call():
    """A compiled core call's graph reads the door's words (backends.written.door, ``None``
    without a door): shared by the threads and guarded, a door running eagerly in another
    thread (a serving worker) made each entry here recompile. They are per thread."""
    import threading

    import torch._dynamo
    from rope_dispatch.backends import written

    graphs = []
    table, positions = rd.PairCosSinCache(torch.randn(16, 8)), torch.arange(3)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    spec = rd.RoPESpec(layout="thd", dtype=torch.float32)
    torch._dynamo.reset()
    run = torch.compile(lambda: rd.apply_qk_(q, k, table, spec, positions=positions),
                        backend=lambda gm, _: graphs.append(gm) or gm.forward)
    run()
    made = len(graphs)
    worker = threading.Thread(target=lambda: setattr(written.door, "words", ("(x)", "", "")))
    worker.start()
    worker.join()  # (as if in the middle of its door's call)
    run()
    assert len(graphs) == made
