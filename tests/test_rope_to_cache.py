"""``rope_to_cache``: norm, rotate, quantize and write k and v into a KV cache, against a float64
reference written here from the formula (the rotation from tests/reference.py).

The reference: normalize and rotate in float64, cast to float32, divide by the scale, cast to
the cache's dtype (as torch casts). The eager backend computes in float32, so a value may round
to the neighbour of the reference's where the float64 value lies within float32 error of a
rounding boundary: :func:`assert_rounds_like` accepts exactly the casts of the values within
that error. Every cache layout (vLLM paged, FlashInfer NHD and HND, SGLang flat), model-dtype
and FP8 caches, padded tokens skipped, and every byte the call must not write left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from reference import reference_rope

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("vllm", "flashinfer-NHD", "flashinfer-HND", "flat")
EPS = 1e-6


def angle_table(rows: int, d2: int, interleaved: bool) -> torch.Tensor:
    """float32 angles ``[rows, d2]``, each pair's angle twice (TransformerEngine's table)."""
    rates = 1e4 ** -(torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    pairs = torch.outer(torch.arange(rows, dtype=torch.float64), rates)
    doubled = pairs.repeat_interleave(2, -1) if interleaved else torch.cat((pairs, pairs), -1)
    return doubled.float()


def norm64(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x / sqrt(mean(x**2) + eps) * weight`` over each head (HeadNorm's formula)."""
    x = x.double()
    if weight is None:
        return x
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def cast(x64: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """As the cache stores a float64 value: float32, divided by the scale, cast."""
    if dtype not in FP8:
        return x64.to(torch.float32).to(dtype)
    return (x64.to(torch.float32) / torch.tensor(scale, dtype=torch.float32)).to(dtype)


def assert_rounds_like(got: torch.Tensor, ref64: torch.Tensor, scale: float, what: str) -> None:
    """``got`` (any dtype) lies between the casts of the float64 reference moved down and up
    by float32 error; FP8 values are further mostly the reference's own cast."""
    window = 3e-5 * ref64.abs() + 2e-6
    low = cast(ref64 - window, got.dtype, scale).double()
    high = cast(ref64 + window, got.dtype, scale).double()
    value = got.double()
    bad = ~((low <= value) & (value <= high))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} values off, e.g. got {value[bad][:4].tolist()}"
        f" for {(ref64[bad][:4] / scale).tolist()}"
    )
    if got.dtype in FP8 and got.numel() >= 64:
        exact = (value == cast(ref64, got.dtype, scale).double()).double().mean()
        assert exact > 0.95, f"{what}: only {float(exact):.3f} of the values are the reference's cast"


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes (any pattern, NaNs too): what a cache held before the call."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


@dataclass
class Built:
    """A cache descriptor, its k and v caches as ``[pages, page_size, heads, dim]`` views, and
    where each written token lands: ``{token: (page, entry)}``."""

    cache: rd.KVCache
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    places: dict[int, tuple[int, int]]


def build_cache(layout: str, tokens: int, heads: int, dim: int, dtype: torch.dtype,
                padded: list[bool], gen: torch.Generator, scales: tuple = (1.0, 1.0),
                page_size: int = 4, v_dim: int | None = None) -> Built:
    """A cache of ``layout`` with random contents and room for every token, each token not
    ``padded`` given its own random slot (the padded ones a skipping index); v's head dim
    ``v_dim`` (default k's)."""
    pages = tokens // page_size + 3
    k_scale, v_scale = scales
    dims = (dim, dim if v_dim is None else v_dim)
    kept = [i for i in range(tokens) if not padded[i]]
    if layout == "flat":
        k, v = (random_bytes((pages * page_size, heads, d), dtype, gen) for d in dims)
        slots = torch.randperm(pages * page_size, generator=gen)[: tokens].tolist()
        loc = torch.tensor([-1 if padded[i] else slots[i] for i in range(tokens)])
        cache = rd.FlatKVCache(k, v, loc, k_scale=k_scale, v_scale=v_scale)
        return Built(cache, k.unsqueeze(1), v.unsqueeze(1), {i: (slots[i], 0) for i in kept})
    if layout == "vllm":
        k, v = (random_bytes((pages, page_size, heads, d), dtype, gen) for d in dims)
        slots = torch.randperm(pages * page_size, generator=gen)[: tokens].tolist()
        mapping = torch.tensor([-1 if padded[i] else slots[i] for i in range(tokens)])
        cache = rd.PagedKVCache(k, v, mapping, k_scale=k_scale, v_scale=v_scale)
        return Built(cache, k, v, {i: divmod(slots[i], page_size) for i in kept})
    hnd = layout.endswith("HND")
    k, v = (random_bytes((pages, heads, page_size, d) if hnd else (pages, page_size, heads, d),
                         dtype, gen) for d in dims)
    # two requests: each owns enough pages for every token, in a random order of the cache's
    half = pages // 2
    order = torch.randperm(pages, generator=gen).tolist()
    indptr = [0, half, pages]
    batch, place, places = [], [], {}
    chosen = {0: torch.randperm(half * page_size, generator=gen).tolist(),
              1: torch.randperm((pages - half) * page_size, generator=gen).tolist()}
    for i in range(tokens):
        r = i % 2
        p = chosen[r].pop()
        batch.append(-1 if padded[i] else r)
        place.append(p)
        if not padded[i]:
            places[i] = (order[indptr[r] + p // page_size], p % page_size)
    cache = rd.FlashInferPagedKVCache(
        (k, v), torch.tensor(order, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(batch, dtype=torch.int32), torch.tensor(place, dtype=torch.int32),
        page_size=page_size, kv_layout="HND" if hnd else "NHD", k_scale=k_scale, v_scale=v_scale,
    )
    views = (k.transpose(1, 2), v.transpose(1, 2)) if hnd else (k, v)
    return Built(cache, *views, places)


def check_call_against_reference(
    layout: str, model: torch.dtype, cache_dtype: torch.dtype, *, tokens: int, kv_heads: int,
    group: int, dim: int, rotary: int, interleaved: bool, norms: bool, padded: list[bool],
    q_mode: str = "model", seed: int = 0, v_dim: int | None = None,
) -> None:
    """One call of every feature asked, checked against the float64 reference: q out, each
    written token's k and v, and every other byte of both caches. ``v_dim``: v's head dim
    (default k's)."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(tokens, heads, dim, generator=gen).to(model)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(model)
    v = torch.randn(tokens, kv_heads, dim if v_dim is None else v_dim, generator=gen).to(model)
    angles = angle_table(40, rotary, interleaved)
    positions = torch.randint(0, 40, (tokens,), generator=gen)
    q_weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(model) if norms else None
    k_weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(model) if norms else None
    fp8_cache = cache_dtype in FP8
    scales = (0.03, 0.02) if fp8_cache else (1.0, 1.0)
    built = build_cache(layout, tokens, kv_heads, dim, cache_dtype, padded, gen, scales,
                        v_dim=v_dim)
    k_before, v_before = built.k_pages.clone(), built.v_pages.clone()
    q_scale, q_out = None, None
    if q_mode == "fp8-scale":
        q_scale = torch.tensor(0.05)
    elif q_mode == "fp8-out":
        q_out = torch.empty(q.shape, dtype=torch.float8_e5m2)
    elif q_mode == "into-q":
        q_out = q
    q_in = q.clone()

    spec = rd.RoPESpec(layout="thd", dtype=model, interleaved=interleaved)
    out = rd.rope_to_cache(
        q, k, v, angles, spec, positions=positions, cache=built.cache,
        q_norm=None if q_weight is None else rd.HeadNorm(q_weight, EPS),
        k_norm=None if k_weight is None else rd.HeadNorm(k_weight, EPS),
        q_out=q_out, q_scale=q_scale,
    )

    q_ref = reference_rope(norm64(q_in, q_weight), angles, positions, interleaved)
    k_ref = reference_rope(norm64(k, k_weight), angles, positions, interleaved)
    if q_out is not None:
        assert out is q_out
    want_q = {"model": model, "into-q": model, "fp8-scale": torch.float8_e4m3fn,
              "fp8-out": torch.float8_e5m2}[q_mode]
    assert out.dtype == want_q and out.shape == q.shape
    assert_rounds_like(out, q_ref, 0.05 if q_mode == "fp8-scale" else 1.0, "q")

    written = torch.zeros(built.k_pages.shape[:2], dtype=torch.bool)
    for token, (page, entry) in built.places.items():
        written[page, entry] = True
        assert_rounds_like(built.k_pages[page, entry], k_ref[token], scales[0], f"k of token {token}")
        if v.shape[-1] == 0:
            continue
        assert_rounds_like(built.v_pages[page, entry], v[token].double(), scales[1],
                           f"v of token {token}")
    for name, after, before in (("k", built.k_pages, k_before), ("v", built.v_pages, v_before)):
        bytes_after, bytes_before = after.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(bytes_after[~written], bytes_before[~written]), (
            f"the call wrote {name} cache slots no token maps to")
    if not fp8_cache and q_mode in ("model", "into-q") and not norms and v_dim in (None, dim):
        # the write is the rotation apply_qk gives, bit for bit
        q_rot, k_rot = rd.apply_qk(q_in, k, angles, spec, positions=positions, backend="eager")
        assert torch.equal(out, q_rot)
        for token, (page, entry) in built.places.items():
            assert torch.equal(built.k_pages[page, entry], k_rot[token])
            assert torch.equal(built.v_pages[page, entry], v[token])


CACHE_CASES = [(m, m) for m in MODEL_DTYPES] + [(torch.bfloat16, d) for d in FP8] + [
    (torch.float16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model,cache_dtype", CACHE_CASES,
                         ids=lambda d: str(d).removeprefix("torch."))
def test_every_layout_and_cache_dtype(layout, model, cache_dtype):
    """GQA (4 query heads a kv head), partial rotary (24 of 32), padded tokens, norms on."""
    padded = [False, True, False, False, True, False, False, False, False, True, False]
    check_call_against_reference(
        layout, model, cache_dtype, tokens=len(padded), kv_heads=2, group=4, dim=32, rotary=24,
        interleaved=False, norms=True, padded=padded)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_mode", ["model", "into-q", "fp8-scale", "fp8-out"])
def test_q_out_forms_and_the_write_as_apply_qk_gives_it(layout, q_mode):
    """q out in the model dtype (new, or into q itself) or FP8 with its own scale; without a
    norm the cache holds exactly what apply_qk returns for k."""
    check_call_against_reference(
        layout, torch.bfloat16, torch.bfloat16, tokens=7, kv_heads=1, group=3, dim=16,
        rotary=16, interleaved=True, norms=False, padded=[False, False, True, False, False,
                                                          False, True], q_mode=q_mode)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS), model=st.sampled_from(MODEL_DTYPES),
    fp8=st.sampled_from([None, *FP8]), tokens=st.integers(1, 12), kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]), dim=st.sampled_from([8, 16, 24, 64]),
    rotary_part=st.sampled_from([1.0, 0.5, 0.25]), interleaved=st.booleans(),
    norms=st.booleans(), padded=st.lists(st.booleans(), min_size=12, max_size=12),
    q_mode=st.sampled_from(["model", "into-q", "fp8-scale", "fp8-out"]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(layout, model, fp8, tokens, kv_heads, group, dim, rotary_part,
                           interleaved, norms, padded, q_mode, seed):
    rotary = max(2, int(dim * rotary_part) // 2 * 2)
    check_call_against_reference(
        layout, model, model if fp8 is None else fp8, tokens=tokens, kv_heads=kv_heads,
        group=group, dim=dim, rotary=rotary, interleaved=interleaved, norms=norms,
        padded=padded[:tokens], q_mode=q_mode, seed=seed)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype,v_dim", [(torch.bfloat16, 24), (torch.float8_e4m3fn, 40),
                                               (torch.float8_e5m2, 0)],
                         ids=["bf16-v24", "e4m3-v40", "e5m2-v0"])
def test_v_with_a_head_dim_of_its_own(layout, cache_dtype, v_dim):
    """v and its cache may have their own head dim (MLA's compressed kv written beside the
    rotated key part; none at all, too): k as before, v stored as it is, the rest untouched."""
    check_call_against_reference(
        layout, torch.bfloat16, cache_dtype, tokens=6, kv_heads=1, group=4, dim=16, rotary=16,
        interleaved=False, norms=False, padded=[False, False, True, False, False, False],
        q_mode="fp8-scale", v_dim=v_dim)


def test_a_v_head_dim_of_its_own_is_a_capability_and_part_of_the_key():
    """A backend serves a v head dim unlike k's only where it says so; such a call's decision
    key is not a same-head-dim call's."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, 8, generator=gen).bfloat16(), torch.randn(5, 1, 8, generator=gen).bfloat16()
    v = torch.randn(5, 1, 12, generator=gen).bfloat16()
    spec, table, positions = rd.RoPESpec(layout="thd", dtype="bf16"), angle_table(32, 8, False), torch.arange(5)
    built = build_cache("flat", 5, 1, 8, torch.float8_e4m3fn, [False] * 5, gen, v_dim=12)
    call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions, cache=built.cache)

    class SameHeadDims(rd.Backend):
        name = "same-head-dims"
        tensors = frozenset({"t", "qk"})
        supports_positions = True
        supports_cache_write = True

    assert SameHeadDims().not_supported_reasons(call) == [
        "a v head dim of its own in the KV-cache write (v 12, k 8) is not supported"]
    assert rd.get_backend("eager").not_supported_reasons(call) == []
    assert rd.call.call_key(call).fields()["cache"] == ["flat", "float8_e4m3fn", "bfloat16", 12]
    text = str(rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache))
    assert "flat KV cache of float8_e4m3fn (v head dim 12), q out bfloat16" in text
    same = build_cache("flat", 5, 1, 8, torch.float8_e4m3fn, [False] * 5, gen)
    plain = rd.kv_cache.check_cache_call(q, k, v[..., :8], table, spec, positions=positions,
                                         cache=same.cache)
    assert not SameHeadDims().not_supported_reasons(plain)
    assert rd.call.call_key(plain) != rd.call.call_key(call)


def small_call(cache_dtype=torch.bfloat16, tokens=5, layout="vllm", padded=None):
    """q, k, v, table, spec, positions and a cache for error and backend tests."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(tokens, 4, 8, generator=gen).bfloat16()
    k = torch.randn(tokens, 2, 8, generator=gen).bfloat16()
    v = torch.randn(tokens, 2, 8, generator=gen).bfloat16()
    spec = rd.RoPESpec(layout="thd", dtype="bf16")
    positions = torch.arange(tokens)
    built = build_cache(layout, tokens, 2, 8, cache_dtype, padded or [False] * tokens, gen)
    return q, k, v, angle_table(32, 8, False), spec, positions, built


def test_every_token_padded_writes_nothing_and_still_rotates_q():
    q, k, v, table, spec, positions, built = small_call(padded=[True] * 5)
    before = built.k_pages.clone(), built.v_pages.clone()
    out = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache)
    assert torch.equal(built.k_pages.view(torch.int16), before[0].view(torch.int16))
    assert torch.equal(built.v_pages.view(torch.int16), before[1].view(torch.int16))
    assert torch.equal(out, rd.apply(q, table, spec, positions=positions, backend="eager"))


def test_an_engine_cos_sin_cache_and_scale_tensors():
    """vLLM's own forms: its float32 cos/sin cache, tensor scales, views of one kv tensor."""
    q, k, v, _, spec, positions, _ = small_call()
    angles = angle_table(16, 8, False)[:, :4]
    engine = torch.cat((angles.cos(), angles.sin()), -1)
    kv = torch.zeros(2, 3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([3, 0, -1, 11, 6])
    cache = rd.PagedKVCache(kv[0], kv[1], slots, k_scale=torch.tensor(0.5),
                            v_scale=torch.tensor([0.25]))
    out = rd.rope_to_cache(q, k, v, rd.PairCosSinCache(engine), spec, positions=positions,
                           cache=cache)
    q_ref = reference_rope(q, angle_table(16, 8, False), positions, False)
    k_ref = reference_rope(k, angle_table(16, 8, False), positions, False)
    assert_rounds_like(out, q_ref, 1.0, "q")
    flat_k, flat_v = kv[0].view(12, 2, 8), kv[1].view(12, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_rounds_like(flat_k[slot], k_ref[token], 0.5, "k")
            assert_rounds_like(flat_v[slot], v[token].double(), 0.25, "v")
    assert not flat_k[[1, 2, 4, 5, 7, 8, 9, 10]].float().any()


def places_from_indices(cache: rd.KVCache) -> dict[int, tuple[int, int]]:
    """Where each token is written, read from the descriptor's index values in plain Python
    (tokens whose indices fall outside the cache are not written)."""
    pages, page_size = (cache.k_cache.shape[0], 1) if cache.kind == "flat" else (
        cache.k_cache.shape[0], cache.pages()[0].shape[1])
    if cache.kind != "flashinfer_paged":
        slots = (cache.cache_loc if cache.kind == "flat" else cache.slot_mapping).tolist()
        return {i: divmod(s, page_size) for i, s in enumerate(slots) if 0 <= s < pages * page_size}
    indptr, indices = cache.kv_indptr.tolist(), cache.kv_indices.tolist()
    places = {}
    for i, (b, p) in enumerate(zip(cache.batch_indices.tolist(), cache.positions.tolist())):
        if 0 <= b < len(indptr) - 1 and 0 <= p < (indptr[b + 1] - indptr[b]) * page_size:
            page = indices[indptr[b] + p // page_size]
            if 0 <= page < pages:
                places[i] = (page, p % page_size)
    return places


@pytest.mark.parametrize("layout,field,value", [
    ("vllm", "slot_mapping", 10_000), ("vllm", "slot_mapping", -7),
    ("flat", "cache_loc", 10_000), ("flat", "cache_loc", -1),
    ("flashinfer-NHD", "batch_indices", 2), ("flashinfer-NHD", "batch_indices", -1),
    ("flashinfer-HND", "positions", "past its request's pages"),
    ("flashinfer-HND", "positions", -3), ("flashinfer-HND", "kv_indices", 99),
])
def test_a_slot_past_the_cache_is_skipped_where_values_are_not_read(layout, field, value):
    """On a GPU nothing reads the indices on the host: a slot past the cache writes nothing
    (here: the values changed after the checks, as a CUDA graph replay would have them)."""
    q, k, v, table, spec, positions, built = small_call(tokens=6, layout=layout)
    cache = built.cache
    call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions, cache=cache)
    token = 1
    if field == "kv_indices":  # token 1's page (and any other token's there) past the cache
        b, p = int(cache.batch_indices[token]), int(cache.positions[token])
        token, value = int(cache.kv_indptr[b]) + p // 4, value
    elif value == "past its request's pages":  # request 0 owns 2 pages of 4: from 8 on
        cache.batch_indices[token] = 0
        others = set(built.places.values()) - {built.places[token]}
        value = next(p for p in range(8, 16) if (int(cache.kv_indices[p // 4]), p % 4) not in others)
    getattr(cache, field)[token] = value
    places = places_from_indices(cache)
    assert len(places) < 6
    before = built.k_pages.clone(), built.v_pages.clone()
    rd.get_backend("eager").apply(call)
    written = torch.zeros(built.k_pages.shape[:2], dtype=torch.bool)
    for place in places.values():
        written[place] = True
    for after, old in zip((built.k_pages, built.v_pages), before):
        assert torch.equal(after.view(torch.int16)[~written], old.view(torch.int16)[~written])
        assert (after[written] != old[written]).flatten(1).any(1).all()


def test_the_eager_composition_reads_no_value_on_the_host(monkeypatch):
    """The backend's work (after the checks) never copies a value to the host: on a GPU it
    would sync, and could not be captured in a CUDA graph."""
    q, k, v, table, spec, positions, built = small_call(torch.float8_e4m3fn, layout="flashinfer-HND",
                                                        padded=[False, True, False, False, False])
    call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions,
                                        cache=built.cache, q_scale=0.5)

    def refuse(*args, **kwargs):
        raise AssertionError("a value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    rd.get_backend("eager").apply(call)


@pytest.mark.parametrize("layout,field,value,message", [
    ("vllm", "slot_mapping", 40, r"PagedKVCache.slot_mapping holds slot 40 \(token 2\) but the "
                                 r"cache has 32 slots \(8 blocks of 4\)"),
    ("flat", "cache_loc", 99, r"FlatKVCache.cache_loc holds slot 99 \(token 2\) but the cache "
                              r"has 32 slots"),
    ("flashinfer-NHD", "positions", 31, r"FlashInferPagedKVCache.positions\[2\]=31 but request "
                                        r"0 owns 4 pages of 4"),
    ("flashinfer-HND", "batch_indices", 2, r"FlashInferPagedKVCache.batch_indices\[2\]=2 but "
                                           r"kv_indptr describes 2 requests"),
    ("flashinfer-NHD", "kv_indices", 8, r"FlashInferPagedKVCache.kv_indices\[\d+\]=8 \(token \d+\) "
                                        r"but the cache has 8 pages"),
])
def test_a_slot_past_the_cache_is_a_clear_error_on_the_cpu(layout, field, value, message):
    q, k, v, table, spec, positions, built = small_call(tokens=20, layout=layout)
    index = getattr(built.cache, field)
    if field == "kv_indices":
        b, p = int(built.cache.batch_indices[2]), int(built.cache.positions[2])
        index[int(built.cache.kv_indptr[b]) + p // 4] = value
    else:
        index[2] = value
    with pytest.raises(rd.RoPEError, match=message):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache)


def test_bad_arguments_are_named():
    q, k, v, table, spec, positions, built = small_call()
    kc, vc, slots = built.cache.k_cache, built.cache.v_cache, built.cache.slot_mapping

    def call(**changes):
        args = dict(q=q, k=k, v=v, freqs=table, spec=spec, positions=positions, cache=built.cache)
        args.update(changes)
        return rd.rope_to_cache(**args)

    def paged(k_cache=kc, v_cache=vc, slot_mapping=slots, **scales):
        return rd.PagedKVCache(k_cache, v_cache, slot_mapping, **scales)

    cases = [
        (lambda: call(cache=paged(kc[:, :, :1], vc[:, :, :1])),
         r"holds 1 kv heads of head dim 8 but k \(5, 2, 8\) has 2 heads of 8"),
        (lambda: call(cache=paged(kc[..., :4], vc[..., :4])), "1 kv heads|head dim 4"),
        (lambda: call(cache=paged(kc.float(), vc.float())),
         "k_cache has dtype float32 but k is bfloat16; a cache holds the model's dtype or FP8"),
        (lambda: paged(kc.int(), vc.int()), "k_cache has dtype int32"),
        (lambda: call(cache=paged(slot_mapping=slots[:4])),
         r"PagedKVCache.slot_mapping must have one entry per token \(5, k.shape\[0\]\), got shape \(4,\)"),
        (lambda: paged(slot_mapping=slots.float()),
         "PagedKVCache.slot_mapping must be a 1-D int32/int64 tensor, got float32"),
        (lambda: call(cache=paged(slot_mapping=slots.to("meta"))),
         "PagedKVCache.slot_mapping is on meta but k is on cpu"),
        (lambda: paged(k_scale=torch.ones(2)),
         r"PagedKVCache k_scale must be a number or a float32 tensor of one element .* got float32 \(2,\)"),
        (lambda: paged(v_scale=torch.ones((), dtype=torch.float16)),
         "PagedKVCache v_scale must be .* got float16"),
        (lambda: paged(k_scale=0.0), "k_scale must be a positive finite number, got 0.0"),
        (lambda: paged(k_scale=torch.tensor(-1.0)), "k_scale must be positive, got -1.0"),
        (lambda: paged(v_cache=vc[:-1]), "must have one dtype, device and shape but for the head dim"),
        (lambda: call(v=v[..., :4]), r"PagedKVCache v_cache \(4, 4, 2, 8\) holds a head dim of 8 but "
                                     r"v \(5, 2, 4\) has 4"),
        (lambda: paged(v_cache=kc), "are the same memory"),
        (lambda: paged(kc[0], vc[0]), r"\[num_blocks, block_size, kv_heads, head_dim\]"),
        (lambda: call(v=v[:, :1]), r"v must be \[T, kv_heads, head_dim\] with k's tokens and kv "
                                   r"heads \(5, 2\), dtype and device \(bfloat16 on cpu\) and any "
                                   r"head dim, got \(5, 1, 8\)"),
        (lambda: call(cache=kc), "cache must be a rope_dispatch.PagedKVCache"),
        (lambda: call(positions=None), "rope_to_cache needs positions"),
        (lambda: call(spec=rd.RoPESpec(layout="bshd", dtype="bf16")), "layout 'thd'"),
        (lambda: call(q_scale=2.0, q_out=torch.empty_like(q)),
         "q_scale quantizes q to FP8, but q_out is bfloat16"),
        (lambda: call(q_out=torch.empty(5, 4, 8)), "q_out must be shaped like q"),
        (lambda: call(q_scale=torch.ones(3)), "q_scale must be a number or a float32 tensor"),
        (lambda: rd.FlashInferPagedKVCache((kc, vc), slots, slots, slots, slots, page_size=16),
         r"page_size=16 but the NHD cache \(4, 4, 2, 8\) has pages of 4"),
        (lambda: rd.FlashInferPagedKVCache((kc, vc), slots, slots, slots, slots, kv_layout="nhd"),
         "kv_layout must be 'NHD' or 'HND'"),
        (lambda: rd.FlatKVCache(kc, vc, slots), r"\[num_slots, kv_heads, head_dim\]"),
    ]
    for make, message in cases:
        with pytest.raises(rd.RoPEError, match=message):
            make()
    with torch.enable_grad(), pytest.raises(rd.RoPEError, match="has no backward"):
        call(q=q.clone().requires_grad_())


def test_other_backends_say_why_they_refuse_and_explain_shows_the_stage(triton_backend):
    q, k, v, table, spec, positions, built = small_call(torch.float8_e4m3fn)
    text = str(rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache))
    assert "k and v written to a paged KV cache of float8_e4m3fn, q out bfloat16" in text
    assert "backend: eager (the only backend that supports this call)" in text
    reason = "a KV-cache write after the rotation (rope_to_cache) is not supported"
    assert f"  - triton: {reason}" in text
    assert reason in text.split("  - compile: ")[1]
    with pytest.raises(rd.BackendNotSupportedError, match=r"'triton' was forced .*KV-cache write"):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                         backend="triton")

    class RotationOnly(rd.Backend):
        name = "rotation-only"
        tensors = frozenset({"t", "qk"})
        supports_positions = True
        supports_norm = True

    call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions,
                                        cache=built.cache)
    assert RotationOnly().not_supported_reasons(call) == [reason]
    assert not RotationOnly().not_supported_reasons(call._replace(cache_write=None))
    # a decision made for apply_qk is never reused for the same tensors with a cache stage
    plain = rd.check_call(q, table, spec, positions=positions, k=k)
    assert rd.call.call_key(call) != rd.call.call_key(plain)
    assert rd.call.call_key(call).fields()["cache"] == ["paged", "float8_e4m3fn", "bfloat16"]
