"""``rope_to_cache``: norm, rotate, quantize and write k and v into a KV cache, against a float64
reference written here from the formula (the rotation from tests/reference.py).

The reference: normalize and rotate in float64, cast to float32, divide by the scale, cast to
the cache's dtype (as torch casts). The eager backend computes in float32, so a value may round
to the neighbour of the reference's where the float64 value lies within float32 error of a
rounding boundary: :func:`assert_rounds_like` accepts exactly the casts of the values within
that error. Every cache layout (vLLM paged, FlashInfer NHD and HND, SGLang flat), model-dtype
and FP8 caches, padded tokens skipped, and every byte the call must not write left as it was.

The eager composition and the Triton backend's fused launch are both checked so (on a CPU the
Triton kernels run on Triton's interpreter). The interpreter's float8 conversion is no cast at
all (it rounds without carrying into the exponent and never saturates), so the Triton backend
refuses FP8 there and its FP8 cases are GPU tests; the eager composition is checked on FP8 here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from reference import reference_rope

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu

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
    got = got.cpu()
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
    if shape[-1] == 0:  # no bytes (a v of no channels); a view of none would not reshape
        return torch.empty(shape, dtype=dtype)
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
                page_size: int = 4, v_dim: int | None = None, device: str = "cpu") -> Built:
    """A cache of ``layout`` on ``device`` with random contents and room for every token, each
    token not ``padded`` given its own random slot (the padded ones a skipping index); v's head
    dim ``v_dim`` (default k's); tensor scales are moved there too."""
    pages = tokens // page_size + 3
    k_scale, v_scale = (s.to(device) if isinstance(s, torch.Tensor) else s for s in scales)
    dims = (dim, dim if v_dim is None else v_dim)
    kept = [i for i in range(tokens) if not padded[i]]

    def made(shape: tuple[int, ...]) -> torch.Tensor:
        return random_bytes(shape, dtype, gen).to(device)

    if layout == "flat":
        k, v = (made((pages * page_size, heads, d)) for d in dims)
        slots = torch.randperm(pages * page_size, generator=gen)[: tokens].tolist()
        loc = torch.tensor([-1 if padded[i] else slots[i] for i in range(tokens)], device=device)
        cache = rd.FlatKVCache(k, v, loc, k_scale=k_scale, v_scale=v_scale)
        return Built(cache, k.unsqueeze(1), v.unsqueeze(1), {i: (slots[i], 0) for i in kept})
    if layout == "vllm":
        k, v = (made((pages, page_size, heads, d)) for d in dims)
        slots = torch.randperm(pages * page_size, generator=gen)[: tokens].tolist()
        mapping = torch.tensor([-1 if padded[i] else slots[i] for i in range(tokens)],
                               device=device)
        cache = rd.PagedKVCache(k, v, mapping, k_scale=k_scale, v_scale=v_scale)
        return Built(cache, k, v, {i: divmod(slots[i], page_size) for i in kept})
    hnd = layout.endswith("HND")
    k, v = (made((pages, heads, page_size, d) if hnd else (pages, page_size, heads, d))
            for d in dims)
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
    index = dict(dtype=torch.int32, device=device)
    cache = rd.FlashInferPagedKVCache(
        (k, v), torch.tensor(order, **index), torch.tensor(indptr, **index),
        torch.tensor(batch, **index), torch.tensor(place, **index),
        page_size=page_size, kv_layout="HND" if hnd else "NHD", k_scale=k_scale, v_scale=v_scale,
    )
    views = (k.transpose(1, 2), v.transpose(1, 2)) if hnd else (k, v)
    return Built(cache, *views, places)


def check_call_against_reference(
    layout: str, model: torch.dtype, cache_dtype: torch.dtype, *, tokens: int, kv_heads: int,
    group: int, dim: int, rotary: int, interleaved: bool, norms: bool, padded: list[bool],
    q_mode: str = "model", seed: int = 0, v_dim: int | None = None, backend: str = "eager",
    device: str = "cpu", tensor_scales: bool = False, inverse: bool = False,
) -> None:
    """One call of every feature asked, run by ``backend`` on ``device`` and checked against the
    float64 reference: q out, each written token's k and v, and every other byte of both
    caches. ``v_dim``: v's head dim (default k's); ``tensor_scales``: an FP8 cache's scales as
    float32 device scalars (else numbers); ``inverse``: the spec's inverse rotation."""
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
    given_scales = tuple(torch.tensor(s) for s in scales) if tensor_scales else scales
    built = build_cache(layout, tokens, kv_heads, dim, cache_dtype, padded, gen, given_scales,
                        v_dim=v_dim, device=device)
    k_before, v_before = built.k_pages.clone().cpu(), built.v_pages.clone().cpu()
    q_scale, q_out = None, None
    if q_mode == "fp8-scale":
        q_scale = torch.tensor(0.05, device=device)
    elif q_mode == "fp8-out":
        q_out = torch.empty(q.shape, dtype=torch.float8_e5m2, device=device)
    elif q_mode == "into-q":
        q_out = q_on = q.to(device)
    q_in = q.clone()

    spec = rd.RoPESpec(layout="thd", dtype=model, interleaved=interleaved, inverse=inverse)
    on = {"device": device}
    out = rd.rope_to_cache(
        q_on if q_mode == "into-q" else q.to(**on), k.to(**on), v.to(**on), angles.to(**on), spec,
        positions=positions.to(**on), cache=built.cache,
        q_norm=None if q_weight is None else rd.HeadNorm(q_weight.to(**on), EPS),
        k_norm=None if k_weight is None else rd.HeadNorm(k_weight.to(**on), EPS),
        q_out=q_out, q_scale=q_scale, backend=backend,
    )

    q_ref = reference_rope(norm64(q_in, q_weight), angles, positions, interleaved,
                           inverse=inverse)
    k_ref = reference_rope(norm64(k, k_weight), angles, positions, interleaved, inverse=inverse)
    if q_out is not None:
        assert out is q_out
    want_q = {"model": model, "into-q": model, "fp8-scale": torch.float8_e4m3fn,
              "fp8-out": torch.float8_e5m2}[q_mode]
    assert out.dtype == want_q and out.shape == q.shape and out.device.type == device
    assert_rounds_like(out, q_ref, 0.05 if q_mode == "fp8-scale" else 1.0, "q")

    k_pages, v_pages = built.k_pages.cpu(), built.v_pages.cpu()
    written = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for token, (page, entry) in built.places.items():
        written[page, entry] = True
        assert_rounds_like(k_pages[page, entry], k_ref[token], scales[0], f"k of token {token}")
        if v.shape[-1] == 0:
            continue
        assert_rounds_like(v_pages[page, entry], v[token].double(), scales[1],
                           f"v of token {token}")
    for name, after, before in (("k", k_pages, k_before), ("v", v_pages, v_before)):
        bytes_after, bytes_before = after.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(bytes_after[~written], bytes_before[~written]), (
            f"the call wrote {name} cache slots no token maps to")
    if not fp8_cache and q_mode in ("model", "into-q") and not norms and v_dim in (None, dim):
        # the write is the rotation apply_qk gives (on the same backend), bit for bit
        q_rot, k_rot = rd.apply_qk(q_in.to(**on), k.to(**on), angles.to(**on), spec,
                                   positions=positions.to(**on), backend=backend)
        assert torch.equal(out.cpu(), q_rot.cpu())
        for token, (page, entry) in built.places.items():
            assert torch.equal(k_pages[page, entry], k_rot[token].cpu())
            assert torch.equal(v_pages[page, entry], v[token])


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
    assert rd.call_keys.call_key(call).fields()["cache"] == ["flat", "float8_e4m3fn", "bfloat16", 12]
    text = str(rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache))
    assert "flat KV cache of float8_e4m3fn (v head dim 12), q out bfloat16" in text
    same = build_cache("flat", 5, 1, 8, torch.float8_e4m3fn, [False] * 5, gen)
    plain = rd.kv_cache.check_cache_call(q, k, v[..., :8], table, spec, positions=positions,
                                         cache=same.cache)
    assert not SameHeadDims().not_supported_reasons(plain)
    assert rd.call_keys.call_key(plain) != rd.call_keys.call_key(call)


@pytest.mark.parametrize("name, value", [
    ("in_place", True), ("split", (8, 8, 8)), ("start_positions", torch.zeros(1, dtype=torch.long)),
    ("k_freqs", "table"),
])
def test_explain_refuses_apply_arguments_beside_a_cache(name, value):
    """``explain(..., cache=)`` explains rope_to_cache, which takes no in_place, split,
    k_freqs or start_positions: given one, it is refused by name, where explain ignored it
    and explained a call other than the one asked about."""
    q, k, v, table, spec, positions, built = small_call()
    extra = {name: table if value == "table" else value}
    with pytest.raises(rd.RoPEError, match=f"{name} given with cache=: rope_to_cache takes none"):
        rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache, **extra)
    with pytest.raises(rd.RoPEError, match="v, q_out and q_scale are rope_to_cache's"):
        rd.explain(q, table, spec, k=k, v=v, positions=positions)


def small_call(cache_dtype=torch.bfloat16, tokens=5, layout="vllm", padded=None, device="cpu"):
    """q, k, v, table, spec, positions and a cache on ``device`` for error and backend tests."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(tokens, h, 8, generator=gen).bfloat16().to(device) for h in (4, 2, 2))
    spec = rd.RoPESpec(layout="thd", dtype="bf16")
    positions = torch.arange(tokens, device=device)
    built = build_cache(layout, tokens, 2, 8, cache_dtype, padded or [False] * tokens, gen,
                        device=device)
    return q, k, v, angle_table(32, 8, False).to(device), spec, positions, built


def triton_device() -> str:
    """Where the Triton backend runs: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_param(backend: str, request: pytest.FixtureRequest) -> tuple[str, str]:
    """``backend`` and the device its test runs on, the Triton backend made available."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
        return backend, triton_device()
    return backend, "cpu"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_every_token_padded_writes_nothing_and_still_rotates_q(backend, request):
    backend, device = backend_param(backend, request)
    q, k, v, table, spec, positions, built = small_call(padded=[True] * 5, device=device)
    before = built.k_pages.clone(), built.v_pages.clone()
    out = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                           backend=backend)
    assert torch.equal(built.k_pages.view(torch.int16), before[0].view(torch.int16))
    assert torch.equal(built.v_pages.view(torch.int16), before[1].view(torch.int16))
    assert torch.equal(out, rd.apply(q, table, spec, positions=positions, backend=backend))


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("side", ["q", "kv"])
def test_a_side_with_no_heads_leaves_the_other_served(backend, side, request):
    """q with no heads still writes k and v into the cache; k and v with no heads still give q
    rotated. The fused launch tiles both sides, so one without heads must not cancel it."""
    backend, device = backend_param(backend, request)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads = (0, 2) if side == "q" else (4, 0)
    q, k, v = (torch.randn(5, h, 8, generator=gen).to(device) for h in (heads, kv_heads, kv_heads))
    table, spec = angle_table(16, 8, False).to(device), rd.RoPESpec(layout="thd", dtype="fp32")
    positions = torch.tensor([3, 0, 7, 1, 2], device=device)
    slots = torch.tensor([4, 0, -1, 9, 2], device=device)
    k_cache, v_cache = (torch.zeros(12, kv_heads, 8, device=device) for _ in range(2))
    out = rd.rope_to_cache(q, k, v, table, spec, positions=positions,
                           cache=rd.FlatKVCache(k_cache, v_cache, slots), backend=backend)
    reference = (table.cpu(), positions.cpu(), False)
    assert_rounds_like(out, reference_rope(q.cpu(), *reference), 1.0, "q")
    k_ref = reference_rope(k.cpu(), *reference)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_rounds_like(k_cache[slot], k_ref[token], 1.0, "k")
            assert torch.equal(v_cache[slot], v[token])
    assert not k_cache[[1, 3, 5, 6, 7, 8, 10, 11]].any()


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


def test_scales_that_require_grad_are_taken_as_constants(recwarn):
    """Scale tensors that require grad (a module's parameters), grad mode on: the write has no
    backward, so they are its constants: no grad_fn on q's FP8 output, no warning from reading
    a CPU scale's value, the stores as with plain scales."""
    q, k, v, _, spec, positions, _ = small_call()
    table = angle_table(16, 8, False)
    kv = torch.zeros(2, 3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([3, 0, -1, 11, 6])
    scale = torch.nn.Parameter(torch.tensor(0.5))
    cache = rd.PagedKVCache(kv[0], kv[1], slots, k_scale=scale, v_scale=scale)
    out = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                           q_out=torch.empty(q.shape, dtype=torch.float8_e4m3fn), q_scale=scale)
    assert out.grad_fn is None and not out.requires_grad
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]
    assert_rounds_like(out, reference_rope(q, table, positions, False), 0.5, "q")
    k_ref = reference_rope(k, table, positions, False)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_rounds_like(kv[0].view(12, 2, 8)[slot], k_ref[token], 0.5, "k")


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


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout,field,value", [
    ("vllm", "slot_mapping", 10_000), ("vllm", "slot_mapping", -7),
    ("flat", "cache_loc", 10_000), ("flat", "cache_loc", -1),
    ("flashinfer-NHD", "batch_indices", 2), ("flashinfer-NHD", "batch_indices", -1),
    ("flashinfer-HND", "positions", "past its request's pages"),
    ("flashinfer-HND", "positions", -3), ("flashinfer-HND", "kv_indices", 99),
])
def test_a_slot_past_the_cache_is_skipped_where_values_are_not_read(layout, field, value,
                                                                   backend, request):
    """On a GPU nothing reads the indices on the host: a slot past the cache writes nothing
    (here: the values changed after the checks, as a CUDA graph replay would have them). The
    Triton kernel finds each token's place and skips it in the kernel."""
    backend, device = backend_param(backend, request)
    q, k, v, table, spec, positions, built = small_call(tokens=6, layout=layout, device=device)
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
    rd.get_backend(backend).apply(call)
    written = torch.zeros(built.k_pages.shape[:2], dtype=torch.bool)
    for place in places.values():
        written[place] = True
    for after, old in zip((built.k_pages.cpu(), built.v_pages.cpu()), before):
        old = old.cpu()
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
        (lambda: paged(k_scale=torch.tensor(-1.0)),
         "k_scale must be positive and finite, got -1.0"),
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
        (lambda: call(k=None), "k must be a torch.Tensor .* got None"),
        (lambda: call(spec=rd.RoPESpec(layout="bshd", dtype="bf16")), "layout 'thd'"),
        (lambda: call(q_scale=2.0, q_out=torch.empty_like(q)),
         "q_scale quantizes q to FP8, but q_out is bfloat16"),
        (lambda: call(q_out=torch.empty(5, 4, 8)), "q_out must be shaped like q"),
        (lambda: call(q_scale=torch.ones(3)), "q_scale must be a number or a float32 tensor"),
        (lambda: rd.FlashInferPagedKVCache((kc, vc), slots, slots, slots, slots, page_size=16),
         r"page_size=16 but the NHD cache \(4, 4, 2, 8\) has pages of 4"),
        (lambda: rd.FlashInferPagedKVCache((kc, vc), slots, slots, slots, slots, page_size=4.0),
         r"page_size must be an int or None \(the cache's: 4\), got 4.0"),
        (lambda: rd.FlashInferPagedKVCache((kc, vc), slots, slots, slots, slots, kv_layout="nhd"),
         "kv_layout must be 'NHD' or 'HND'"),
        (lambda: rd.FlatKVCache(kc, vc, slots), r"\[num_slots, kv_heads, head_dim\]"),
    ]
    kv = torch.zeros(2, 4, 4, 2, 8, dtype=torch.bfloat16)  # one [2, ...] buffer: its views
    flat = torch.zeros(kc.numel() + 8, dtype=torch.bfloat16)  # k and v 8 elements apart
    q_flat = torch.zeros(q.numel() + 8, dtype=q.dtype)  # q and a q_out 8 elements apart
    q_in_flat = q_flat[:q.numel()].view(q.shape).copy_(q)
    q_own = q.clone()  # and an FP8 q_out at q's address with q's strides: its bytes are others
    fp8_over_q = torch.empty(0, dtype=torch.float8_e4m3fn).set_(
        q_own.untyped_storage(), 0, q.shape, q.stride())
    cases += [
        (lambda: paged(k_scale=torch.tensor(float("inf"))),
         "k_scale must be positive and finite, got inf"),
        (lambda: paged(flat[:kc.numel()].view(kc.shape), flat[8:].view(kc.shape)),
         "share memory; v would overwrite k"),
        (lambda: call(q=q_in_flat, q_out=q_flat[8:].view(q.shape)),
         "q_out shares memory with q but is not q"),
        (lambda: call(q=q_own, q_out=fp8_over_q), "q_out shares memory with q but is not q"),
        (lambda: call(q=kc.view(-1)[:q.numel()].view(q.shape)),
         r"q \(5, 4, 8\) shares memory with PagedKVCache k_cache"),
    ]
    for make, message in cases:
        with pytest.raises(rd.RoPEError, match=message):
            make()
    k_view, v_view = kv[0], kv[1]
    assert paged(k_view, v_view).k_cache is k_view  # views of one buffer, apart: served
    split = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)  # k | v in each row: apart too
    assert paged(split[..., :8], split[..., 8:]).v_cache.shape == kc.shape
    with torch.enable_grad():
        for changes in (dict(q=q.clone().requires_grad_()),
                        dict(q_out=torch.zeros_like(q, requires_grad=True)),  # torch's copy_
                        # into it failed after the cache write; the Triton stage wrote it
                        dict(freqs=table.clone().requires_grad_()),
                        # a cache in autograd: written in place all the same, which torch forbids
                        dict(cache=paged(v_cache=vc.clone().requires_grad_())),
                        dict(q_norm=rd.HeadNorm(torch.ones(8, requires_grad=True)))):
            with pytest.raises(rd.RoPEError, match="has no backward"):
                call(**changes)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_q_out_sharing_memory_with_k_or_v_is_refused(backend, request):
    """One launch reads k and v while it writes q's output, so a q_out (or q in place) that
    shares an element with k or v is refused, naming it; q, k and v as disjoint views of one
    projection, q rotated in place, are served and agree with the eager composition."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(5, 8, 8, generator=gen).to(DEVICE)
    table, spec = angle_table(16, 8, False).to(DEVICE), rd.RoPESpec(layout="thd", dtype="fp32")
    positions = torch.arange(5, device=DEVICE)

    def call(q, k, v, q_out):
        cache = rd.FlatKVCache(torch.zeros(5, 2, 8, device=DEVICE),
                               torch.zeros(5, 2, 8, device=DEVICE), positions)
        out = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                               q_out=q_out, backend=backend)
        return out, cache.k_cache, cache.v_cache

    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    for q_out, name in ((qkv[:, 2:6], "k"), (qkv[:, ::2], "k"), (qkv[:, 3:7], "k")):
        with pytest.raises(rd.RoPEError, match=f"q_out shares memory with {name}"):
            call(q, k, v, q_out)
    with pytest.raises(rd.RoPEError, match="q_out shares memory with v"):
        call(qkv[:, 4:], qkv[:, :2], qkv[:, 2:4], qkv[:, 2:6])
    with pytest.raises(rd.RoPEError, match="q_out shares memory with k"):
        call(q, qkv[:, 2:4], v, q)  # q in place, k among its heads
    expected = call(q.clone(), k, v, None)
    got = call(q, k, v, q)  # q in place beside k and v: apart
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dual_tensors_of_forward_mode_ad_carry_their_tangents(backend, layout, request):
    """With a forward-mode AD level open (``torch.autograd.forward_ad``) q's output gets q's
    tangent rotated and the cache, at each written slot, k's rotated and v's (zero elsewhere):
    the Triton launch dropped them all, and the eager composition's store through an integer
    view dropped the cache's. Against the float64 reference (the rotation is linear), on a
    first call and on calls met again (planned where a device has plans)."""
    import torch.autograd.forward_ad as fwad

    backend, device = backend_param(backend, request)
    gen = torch.Generator().manual_seed(12)
    q, k, v, tq, tk, tv = (torch.randn(6, h, 8, generator=gen) for h in (4, 2, 2, 4, 2, 2))
    table, spec = angle_table(16, 8, False), rd.RoPESpec(layout="thd", dtype="fp32")
    positions = torch.tensor([3, 0, 7, 1, 2, 15])
    padded = [False, False, True, False, False, False]
    on = {"device": device}
    built = build_cache(layout, 6, 2, 8, torch.float32, padded, gen, device=device)
    reference = (table, positions, False)
    q_ref, k_ref = reference_rope(tq, *reference), reference_rope(tk, *reference)
    for repeat in range(3):
        args = (table.to(**on), spec)
        rd.rope_to_cache(q.to(**on), k.to(**on), v.to(**on), *args, positions=positions.to(**on),
                         cache=built.cache, backend=backend)  # (met outside forward AD)
        with fwad.dual_level():
            duals = [fwad.make_dual(x.to(**on), t.to(**on)) for x, t in ((q, tq), (k, tk), (v, tv))]
            out = rd.rope_to_cache(*duals, *args, positions=positions.to(**on),
                                   cache=built.cache, backend=backend)
            got = fwad.unpack_dual(out).tangent
            k_pages, v_pages = (fwad.unpack_dual(p).tangent for p in built.cache.pages())
        assert got is not None, f"q's output has no tangent (call {repeat})"
        assert_rounds_like(got, q_ref, 1.0, f"q's tangent (call {repeat})")
        assert k_pages is not None and v_pages is not None, f"no cache tangent (call {repeat})"
        written = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
        for token, (page, entry) in built.places.items():
            written[page, entry] = True
            assert_rounds_like(k_pages[page, entry], k_ref[token], 1.0, f"k's tangent {token}")
            assert torch.equal(v_pages[page, entry].cpu(), tv[token])
        for pages in (k_pages, v_pages):
            assert not pages.cpu()[~written].any(), "a tangent where no token was written"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_jvp_of_a_step_given_its_caches_gives_the_caches_their_tangents(backend, request):
    """``torch.func.jvp`` of a step that takes its caches as inputs (what jvp asks of a
    function that writes them) and returns them: the written slots' tangents are k's rotated
    and v's, the others the caches' own. The store through an integer view left every slot
    the cache's own tangent: a wrong derivative, silently."""
    backend, device = backend_param(backend, request)
    gen = torch.Generator().manual_seed(13)
    q, k, v, tk, tv = (torch.randn(5, h, 8, generator=gen) for h in (4, 2, 2, 2, 2))
    caches = tuple(torch.randn(12, 2, 8, generator=gen) for _ in range(4))  # 2 values, 2 tangents
    table, spec = angle_table(16, 8, False), rd.RoPESpec(layout="thd", dtype="fp32")
    positions, slots = torch.tensor([3, 0, 7, 1, 2]), torch.tensor([4, 0, -1, 9, 2])
    on = {"device": device}

    def step(k, v, k_cache, v_cache):
        rd.rope_to_cache(q.to(**on), k, v, table.to(**on), spec, positions=positions.to(**on),
                         cache=rd.FlatKVCache(k_cache, v_cache, slots.to(**on)), backend=backend)
        return k_cache, v_cache

    primals = tuple(x.to(**on) for x in (k, v, *caches[:2]))
    tangents = tuple(x.to(**on) for x in (tk, tv, *caches[2:]))
    _, (k_tangent, v_tangent) = torch.func.jvp(step, primals, tangents)
    k_ref = reference_rope(tk, table, positions, False)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_rounds_like(k_tangent[slot], k_ref[token], 1.0, f"k's tangent {token}")
            assert torch.equal(v_tangent[slot].cpu(), tv[token])
    kept = [1, 3, 5, 6, 7, 8, 10, 11]
    assert torch.equal(k_tangent[kept].cpu(), caches[2][kept])
    assert torch.equal(v_tangent[kept].cpu(), caches[3][kept])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_descriptors_fields_are_fixed_once_made(layout):
    """A planned call (a GPU's repeated step) passes the tensors and scales its descriptor
    held when made (``plan_parts``), a checked call its fields: a field replaced afterwards
    (``cache.slot_mapping = ...``) was written through by checked calls and not by planned
    ones, silently. Assigning or deleting any field is refused, naming it; the descriptor
    still serves its call."""
    q, k, v, table, spec, positions, built = small_call(layout=layout)
    cache = built.cache
    kind = type(cache).__name__
    for name in (*cache.index_names, "k_cache", "v_cache", "k_scale", "plan_parts"):
        words = (f"^{kind}.{name} is fixed when the descriptor is made .* make a new {kind} "
                 "for other tensors or scales$")
        with pytest.raises(AttributeError, match=words):
            setattr(cache, name, getattr(cache, name))
        with pytest.raises(AttributeError, match=words):
            delattr(cache, name)
    out = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                           backend="eager")
    k_ref = reference_rope(k, table, positions, False)
    assert_rounds_like(out, reference_rope(q, table, positions, False), 1.0, "q")
    for token, (page, entry) in built.places.items():
        assert_rounds_like(built.k_pages[page, entry], k_ref[token], 1.0, f"k of token {token}")


def test_other_backends_say_why_they_refuse_and_explain_shows_the_stage(triton_backend):
    q, k, v, table, spec, positions, built = small_call(device=triton_device())
    text = str(rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache))
    assert "k and v written to a paged KV cache of bfloat16, q out bfloat16" in text
    # triton's fused stage and the eager composition both serve it; nothing is timed (it would
    # write the caller's cache)
    assert ("backend: triton (a KV-cache write is not measured (timing it would write the "
            "caller's cache, and rotate q again where q_out is q): highest priority among "
            "triton, eager)") in text
    assert "  - eager: could serve it, not chosen" in text
    reason = "a KV-cache write after the rotation (rope_to_cache) is not supported"
    assert reason in text.split("  - compile: ")[1]
    with pytest.raises(rd.BackendNotSupportedError, match=r"'compile' was forced .*KV-cache write"):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                         backend="compile")

    class RotationOnly(rd.Backend):
        name = "rotation-only"
        tensors = frozenset({"t", "qk"})
        supports_positions = True
        supports_norm = True

    fp8 = small_call(torch.float8_e4m3fn, device=triton_device())[-1].cache
    call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions, cache=fp8)
    assert RotationOnly().not_supported_reasons(call) == [reason]
    assert not RotationOnly().not_supported_reasons(call._replace(cache_write=None))
    # a decision made for apply_qk is never reused for the same tensors with a cache stage
    plain = rd.check_call(q, table, spec, positions=positions, k=k)
    assert rd.call_keys.call_key(call) != rd.call_keys.call_key(plain)
    assert rd.call_keys.call_key(call).fields()["cache"] == ["paged", "float8_e4m3fn", "bfloat16"]


# ---------------------------------------------------------------------------------------------
# The Triton backend's fused stage: one launch norms, rotates, quantizes and writes q, k and v
# (on a CPU through Triton's interpreter, small shapes; FP8 on a GPU only, see the docstring)

MODEL_CACHES = [(m, m) for m in MODEL_DTYPES]
FP8_CACHES = [(torch.bfloat16, d) for d in FP8] + [(torch.float16, torch.float8_e4m3fn)]
dtype_ids = lambda d: str(d).removeprefix("torch.")  # noqa: E731


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model,cache_dtype", MODEL_CACHES + [
    pytest.param(m, c, marks=gpu) for m, c in FP8_CACHES], ids=dtype_ids)
def test_triton_every_layout_and_cache_dtype(layout, model, cache_dtype):
    """GQA (4 query heads, 2 kv heads), partial rotary (24 of 32, the rest copied into the
    cache), padded tokens, q and k norms: one launch, against the float64 reference."""
    padded = [False, True, False, False, True, False, False, False, False, True, False]
    check_call_against_reference(
        layout, model, cache_dtype, tokens=len(padded), kv_heads=2, group=2, dim=32, rotary=24,
        interleaved=False, norms=True, padded=padded, backend="triton", device=DEVICE)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_without_norms_writes_what_its_apply_qk_gives(layout, interleaved):
    """No norm: q (new, or written into q itself) and the cache's k are the Triton backend's
    apply_qk rotation bit for bit, v the input's bits; interleaved pairs, partial rotary."""
    check_call_against_reference(
        layout, torch.bfloat16, torch.bfloat16, tokens=6, kv_heads=2, group=2, dim=16,
        rotary=12, interleaved=interleaved, norms=False,
        padded=[False, False, True, False, False, True],
        q_mode="into-q" if interleaved else "model", backend="triton", device=DEVICE)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype,kv_heads,dim,v_dim", [
    (torch.bfloat16, 1, 16, 64), (torch.bfloat16, 1, 8, 320), (torch.float16, 2, 16, 8),
    (torch.bfloat16, 2, 16, 0),
    pytest.param(torch.float8_e4m3fn, 1, 64, 512, marks=gpu),
    pytest.param(torch.float8_e5m2, 2, 32, 0, marks=gpu)],
    ids=["bf16-v64", "bf16-v320", "fp16-v8", "bf16-v0", "e4m3-mla-v512", "e5m2-v0"])
def test_triton_v_with_a_head_dim_of_its_own(layout, cache_dtype, kv_heads, dim, v_dim):
    """The fused launch writes a v wider or narrower than k, or none (MLA's compressed kv beside
    the rotated key part, FlashInfer's k_nope of no channels): k rotated, v as it is, every
    other byte of both caches untouched."""
    check_call_against_reference(
        layout, cache_dtype if cache_dtype not in FP8 else torch.bfloat16, cache_dtype,
        tokens=7, kv_heads=kv_heads, group=4, dim=dim, rotary=dim,
        interleaved=kv_heads == 2, norms=False,
        padded=[False, True, False, False, False, True, False],
        q_mode="fp8-scale" if cache_dtype in FP8 else "model", v_dim=v_dim, backend="triton",
        device=DEVICE)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inverse_rotation_into_the_cache(backend, layout, request):
    """``inverse=True``: q and k rotated by minus the angle; padded tokens write nothing (the
    Triton kernel's transposed rotation once wrote them to the cache's first entry, unscaled),
    FP8 stores scaled on a GPU."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    cache_dtype = torch.float8_e4m3fn if CUDA else torch.float32
    check_call_against_reference(
        layout, torch.float32, cache_dtype, tokens=6, kv_heads=2, group=2, dim=16, rotary=16,
        interleaved=False, norms=False, padded=[False, True, False, False, True, False],
        q_mode="fp8-scale" if CUDA else "model", backend=backend, device=DEVICE, inverse=True)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("heads,kv_heads,v_dim,wide_v,v_width", [
    (16, 1, 256, True, 64), (16, 1, 96, False, 96), (8, 2, 64, False, 64),
    (16, 1, 64, False, 64)], ids=["mla", "v-not-whole-heads", "gqa", "mqa"])
def test_triton_mla_shapes_take_the_wide_v_tile(monkeypatch, heads, kv_heads, v_dim, wide_v,
                                                v_width):
    """A v a whole number of heads wide (MLA: narrow rope heads beside the compressed kv) is
    copied as heads of q's width and takes ``WIDE_V_TILE``; a v of another width is copied
    whole, and GQA and MQA heads of the same width keep their own tiles. All against the
    float64 reference."""
    from kernel_spy import KernelSpy

    from rope_dispatch.backends import triton_norm_kernels, triton_tiles

    seen = []
    monkeypatch.setattr(triton_norm_kernels, "rope_norm_kernel", KernelSpy(
        "rope_norm_kernel", triton_norm_kernels.rope_norm_kernel,
        lambda name, kwargs: seen.append((kwargs["BLOCK_T"], kwargs["BLOCK_H"],
                                          kwargs["V_WIDTH"]))))
    tokens = 33 if DEVICE == "cpu" else 512  # the rule leaves every SM its programs
    check_call_against_reference(
        "vllm", torch.bfloat16, torch.bfloat16, tokens=tokens, kv_heads=kv_heads,
        group=heads // kv_heads, dim=64, rotary=64, interleaved=False, norms=False,
        padded=[False] * tokens, v_dim=v_dim, backend="triton", device=DEVICE)
    assert len(seen) == 1
    assert (seen[0][:2] == triton_tiles.WIDE_V_TILE) is wide_v, seen
    assert seen[0][2] == v_width, seen


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=12, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS), model=st.sampled_from(MODEL_DTYPES),
    fp8=st.sampled_from([None, *FP8] if CUDA else [None]), tokens=st.integers(1, 9),
    kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), dim=st.sampled_from([8, 16, 24]),
    rotary_part=st.sampled_from([1.0, 0.5]), interleaved=st.booleans(), norms=st.booleans(),
    padded=st.lists(st.booleans(), min_size=9, max_size=9),
    q_mode=st.sampled_from(["model", "into-q", *(("fp8-scale", "fp8-out") if CUDA else ())]),
    tensor_scales=st.booleans(), seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(layout, model, fp8, tokens, kv_heads, group, dim, rotary_part,
                                  interleaved, norms, padded, q_mode, tensor_scales, seed):
    rotary = max(2, int(dim * rotary_part) // 2 * 2)
    check_call_against_reference(
        layout, model, model if fp8 is None else fp8, tokens=tokens, kv_heads=kv_heads,
        group=group, dim=dim, rotary=rotary, interleaved=interleaved, norms=norms,
        padded=padded[:tokens], q_mode=q_mode, seed=seed, backend="triton", device=DEVICE,
        tensor_scales=tensor_scales)


@pytest.mark.skipif(CUDA, reason="the interpreter's refusal; FP8 runs on the GPU")
def test_triton_on_the_interpreter_leaves_fp8_to_eager(triton_backend):
    """An FP8 cache or q output: the interpreter's float8 conversion is no cast, so the Triton
    backend says so and the eager composition serves the call."""
    q, k, v, table, spec, positions, built = small_call(torch.float8_e5m2)
    text = str(rd.explain(q, table, spec, k=k, v=v, positions=positions, cache=built.cache))
    assert "backend: eager (the only backend that supports this call)" in text
    assert ("  - triton: an FP8 cache or q output (float8_e5m2) under TRITON_INTERPRET=1: the "
            "interpreter's float8 conversion rounds wrongly") in text
    q, k, v, table, spec, positions, built = small_call()
    with pytest.raises(rd.BackendNotSupportedError, match=r"FP8 cache or q output "
                                                          r"\(float8_e4m3fn\) under TRITON_INT"):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                         q_scale=0.5, backend="triton")


def test_the_compiled_launch_key_follows_the_cache_stage(triton_backend):
    """Every part of a cache stage the compiled kernel or its fixed arguments depend on keys
    the launch: cache kind, page size, cache and q dtypes, scales as numbers (by value) or
    device scalars, index dtypes and lengths; the same call keys the same launch."""
    from rope_dispatch.backends import triton_launch as tl

    def key(cache_dtype=torch.bfloat16, layout="vllm", tokens=5, q_scale=None, scales=(1.0, 1.0),
            int32=False):
        q, k, v, table, spec, positions, _ = small_call(tokens=tokens)
        built = build_cache(layout, tokens, 2, 8, cache_dtype, [False] * tokens,
                            torch.Generator().manual_seed(3), scales)
        if int32 and layout == "vllm":  # (a descriptor's fields are fixed: a new one)
            made = built.cache
            built.cache = rd.PagedKVCache(made.k_cache, made.v_cache, made.slot_mapping.int(),
                                          k_scale=made.k_scale, v_scale=made.v_scale)
        call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions,
                                            cache=built.cache, q_scale=q_scale)
        described = tl.describe(call)
        tabs = tl.current_tables(tl.call_tables(call), "thd")
        outs = (torch.empty(q.shape, dtype=call.cache_write.q_dtype), *built.cache.pages())
        addresses = tuple(t.data_ptr() + offset for t, offset in
                          tl.pointers(described, (q, k, v), outs, tabs))
        return tl.launch_key(described, (q, k, v), outs, tabs, addresses)

    made = [key(), key(layout="flat"), key(layout="flashinfer-NHD"), key(layout="flashinfer-HND"),
            key(torch.float8_e4m3fn), key(torch.float8_e5m2), key(q_scale=0.5),
            key(q_scale=torch.tensor(0.5)), key(torch.float8_e4m3fn, scales=(0.5, 1.0)),
            key(torch.float8_e4m3fn, scales=(torch.tensor(0.5), 1.0)), key(int32=True),
            key(tokens=6)]
    assert len(set(made)) == len(made)
    assert key() == key() and hash(key(q_scale=0.25)) == hash(key(q_scale=0.25))
    assert made[0].launch.store == (1, 4, (0, 0, 0), (torch.bfloat16, torch.bfloat16))
    assert made[9].launch.store.quant == (0, 2, 1)


# ---------------------------------------------------------------------------------------------
# The fused stage on the GPU: FP8 stores, CUDA graphs, no host sync


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_mode", ["fp8-scale", "fp8-out"])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_triton_fp8_q_and_cache_on_the_gpu(layout, q_mode, tensor_scales):
    """q out FP8 (e4m3 by q_scale, or an e5m2 q_out) and an e4m3 cache, scales as numbers or
    device scalars, interleaved and partial, norms on."""
    check_call_against_reference(
        layout, torch.bfloat16, torch.float8_e4m3fn, tokens=9, kv_heads=2, group=2, dim=64,
        rotary=32, interleaved=True, norms=True, padded=[False, True] + [False] * 7,
        q_mode=q_mode, backend="triton", device="cuda", tensor_scales=tensor_scales)


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("dtype,largest", [(torch.float8_e4m3fn, 448.0),
                                           (torch.float8_e5m2, 57344.0)])
def test_triton_fp8_stores_saturate_past_the_range(dtype, largest):
    """A value past the FP8 range is stored as the largest finite value of its sign (the
    GPU's saturating conversion, as serving engines' FP8 cache writes do), where torch's cast
    gives NaN (e4m3fn, before torch 2.13) or inf (e5m2); NaN stays NaN."""
    q = torch.zeros(3, 1, 8, device="cuda")
    k = torch.tensor([1e6, -1e6, float("nan")], device="cuda")[:, None, None].expand(3, 1, 8)
    v = k.clone()
    pages = torch.zeros(2, 4, 1, 8, dtype=dtype, device="cuda")
    cache = rd.PagedKVCache(pages, torch.zeros_like(pages), torch.tensor([0, 1, 2], device="cuda"))
    spec = rd.RoPESpec(layout="thd", dtype="fp32", rotary_dim=2)
    rd.rope_to_cache(q, k.contiguous(), v, torch.zeros(4, 2, device="cuda"), spec,
                     positions=torch.zeros(3, dtype=torch.int64, device="cuda"), cache=cache,
                     backend="triton")
    for stored in (pages[0, :3, 0].float().cpu(), cache.v_cache[0, :3, 0].float().cpu()):
        assert torch.equal(stored[0], torch.full((8,), largest))
        assert torch.equal(stored[1], torch.full((8,), -largest))
        assert stored[2].isnan().all()


def fp8_midpoints(dtype: torch.dtype) -> torch.Tensor:
    """The float64 midpoints between neighbouring finite values of an FP8 dtype, both signs:
    where a quotient one float32 ulp off would round to the other neighbour."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    finite = values[values.isfinite() & (values >= 0)].unique()
    mid = (finite[1:] + finite[:-1]) / 2
    return torch.cat((mid, -mid))


def ieee_quotients_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` divided in float32 as IEEE rounds it (on the CPU), cast to ``dtype``
    saturating past its range, NaN kept: what an FP8 store of the fused stage must hold."""
    largest = torch.finfo(dtype).max
    quotient = x.cpu() / torch.tensor(scale, dtype=torch.float32)
    return torch.where(quotient.isnan(), quotient, quotient.clamp(-largest, largest)).to(dtype)


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("tensor_scale", [False, True])
def test_triton_fp8_stores_round_as_ieee_division(dtype, tensor_scale):
    """Every FP8 store holds the cast of the IEEE float32 quotient, byte for byte: every
    bfloat16 value widened, and for each scale the float32 values nearest to each FP8 rounding
    midpoint times the scale (where a quotient one ulp off would round the other way), zeros,
    subnormals, infinities and NaN; scales one (the quotient x itself), ordinary, with an
    all-ones significand, tiny and huge. v is copied into the cache; k's channels past its 2 rotary ones are stored as they
    are (the rotation's pass-through)."""
    widened = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()
    ones = torch.tensor([0x3C7FFFFF, 0x3FFFFFFF], dtype=torch.int32).view(torch.float32).tolist()
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45,
                             -1e-45, 1e-40, 2.0 ** -126, 2.0 ** -99, -(2.0 ** -100), 3e38])
    for scale in (1.0, 0.05, 0.3629, 1 / 3, 7.4e-6, 8360.37, *ones, 1.5 * 2.0 ** -79, 1e-25,
                  1e-35, 1e30, 1.7 * 2.0 ** 125):
        near = (fp8_midpoints(dtype) * scale).float()
        bits = near.view(torch.int32)
        x = torch.cat((widened, specials, *((bits + step).view(torch.float32)
                                            for step in (-2, -1, 0, 1, 2))))
        x = torch.cat((x, x[: -len(x) % 64]))
        tokens = len(x) // 64
        k = torch.cat((torch.zeros(tokens, 1, 2), x.view(tokens, 1, 64)[:, :, 2:]), -1)
        v = x.view(tokens, 1, 64)
        pages = torch.zeros(tokens, 1, 1, 64, dtype=dtype, device="cuda")
        value = torch.tensor(scale, device="cuda") if tensor_scale else scale
        cache = rd.PagedKVCache(pages, torch.zeros_like(pages),
                                torch.arange(tokens, device="cuda"), k_scale=value, v_scale=value)
        rd.rope_to_cache(torch.zeros(tokens, 1, 64, device="cuda"), k.cuda(), v.cuda(),
                         torch.zeros(4, 2, device="cuda"),
                         rd.RoPESpec(layout="thd", dtype="fp32", rotary_dim=2),
                         positions=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
                         cache=cache, backend="triton")
        for stored, source in ((cache.v_cache[:, 0, 0], v[:, 0]), (pages[:, 0, 0, 2:], k[:, 0, 2:])):
            want = ieee_quotients_cast(source, scale, dtype)
            got = stored.cpu()
            both_nan = got.float().isnan() & want.float().isnan()
            differ = (got.view(torch.uint8) != want.view(torch.uint8)) & ~both_nan
            assert not differ.any(), (
                f"scale {scale}: {int(differ.sum())} stores differ, first x "
                f"{source[differ][:4].tolist()} stored {got[differ][:4].float().tolist()} "
                f"want {want[differ][:4].float().tolist()}")


@pytest.mark.parametrize("cols,scale", [(24, 1.0), (600, 0.37), (512, 3e-3)])
def test_triton_quantizing_copy_divides_and_casts_as_the_stores(triton_backend, cols, scale):
    """The quantizing copy (FlashInfer's q_nope) stores the cast of the IEEE float32 quotient:
    rows of a slice of a wider tensor into a slice of another, wider rows taking two column
    blocks; zeros, infinities and NaN among them. On a GPU into each FP8 dtype byte for byte;
    on the CPU into float32, the quotient itself (exact at scale 1; within an ulp otherwise:
    the interpreter's fused multiply-add rounds twice). Channels that are not contiguous are
    left to the caller (``False``, out untouched)."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 5, cols + 8, generator=gen) * 4
    wide[0, 0, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40])
    # each form twice, the second time (other values) by the launch bound the first time
    for source_dtype, sign, dtype in itertools.product(
            (torch.float32, torch.bfloat16), (1, -1), FP8 if CUDA else (torch.float32,)):
        x = (sign * wide.to(DEVICE)).to(source_dtype)[..., 8:]
        out = torch.zeros(3, 5, cols + 2, dtype=dtype, device=DEVICE)[..., 1:-1]
        assert triton_backend.quantize(x, out, scale)
        want, got = ieee_quotients_cast(x.float(), scale, dtype), out.cpu()
        if CUDA or scale == 1.0:
            both_nan = got.float().isnan() & want.float().isnan()
            bits = torch.uint8 if dtype.itemsize == 1 else torch.int32
            differ = (got.view(bits) != want.view(bits)) & ~both_nan
            assert not differ.any(), (source_dtype, dtype, got[differ][:4], want[differ][:4])
        else:
            torch.testing.assert_close(got, want, rtol=2.0 ** -23, atol=0, equal_nan=True)
    out = torch.zeros(3, 5, cols // 2, dtype=torch.float32, device=DEVICE)
    assert not triton_backend.quantize(wide.to(DEVICE)[..., ::2][..., : cols // 2], out, scale)
    assert not out.any()


def serving_step(layout: str, tokens: int = 8, dtype: torch.dtype = torch.float8_e4m3fn):
    """A decode step's static tensors on the GPU: q, k, v, table, spec, positions, the cache
    (tensor scales), and a function that writes a new step's values into the index tensors."""
    gen = torch.Generator().manual_seed(4)
    built = build_cache(layout, tokens, 2, 64, dtype, [False] * tokens, gen,
                        (torch.tensor(0.02), torch.tensor(0.03)), page_size=4, device="cuda")
    q = torch.randn(tokens, 4, 64, generator=gen).bfloat16().cuda()
    k = torch.randn(tokens, 2, 64, generator=gen).bfloat16().cuda()
    v = torch.randn(tokens, 2, 64, generator=gen).bfloat16().cuda()
    spec = rd.RoPESpec(layout="thd", dtype="bf16")
    positions = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    return q, k, v, angle_table(64, 64, False).cuda(), spec, positions, built


def next_step(built: Built, positions: torch.Tensor, seed: int) -> None:
    """New positions, and each token a new place in the cache (some padded), in place."""
    gen = torch.Generator().manual_seed(seed)
    tokens = positions.shape[0]
    positions.copy_(torch.randint(0, 64, (tokens,), generator=gen))
    cache = built.cache
    if cache.kind == "flashinfer_paged":
        rows = cache.kv_indptr.tolist()[-1] * cache.page_size
        place = torch.randperm(rows, generator=gen)[:tokens]
        cache.batch_indices.copy_(torch.where(place % 3 == 0, -1, 0))  # request 0 owns all
        cache.kv_indptr.copy_(torch.tensor([0] + [rows // cache.page_size] * (
            cache.kv_indptr.shape[0] - 1)))
        cache.positions.copy_(place)
    else:
        index = cache.slot_mapping if cache.kind == "paged" else cache.cache_loc
        slots = torch.randperm(cache.k_cache.shape[0] * (4 if cache.kind == "paged" else 1),
                               generator=gen)[:tokens]
        index.copy_(torch.where(slots % 3 == 0, -1, slots))


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_stage_replays_in_a_cuda_graph_with_new_positions_and_slots(layout):
    """The step captured once in a CUDA graph: each replay with new positions, slots and
    inputs writes what a fresh eager call writes into a copy of the cache, no more."""
    q, k, v, table, spec, positions, built = serving_step(layout)
    cache, q_scale = built.cache, torch.tensor(0.1, device="cuda")
    call = lambda: rd.rope_to_cache(q, k, v, table, spec, positions=positions,  # noqa: E731
                                    cache=cache, q_scale=q_scale, backend="triton")
    next_step(built, positions, 0)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (1, 2, 3):
        next_step(built, positions, seed)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        k_copy, v_copy = cache.k_cache.clone(), cache.v_cache.clone()
        twin = copy_of(cache, k_copy, v_copy)
        want = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=twin,
                                q_scale=q_scale, backend="eager")
        graph.replay()
        torch.cuda.synchronize()
        assert_same_or_neighbour(out, want, "q")
        assert_same_or_neighbour(cache.k_cache, k_copy, "k cache")
        assert torch.equal(cache.v_cache.view(torch.uint8), v_copy.view(torch.uint8))


def copy_of(cache: rd.KVCache, k_cache: torch.Tensor, v_cache: torch.Tensor) -> rd.KVCache:
    """``cache``'s descriptor over other k and v tensors (the same index tensors and scales)."""
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    if cache.kind == "flashinfer_paged":
        return rd.FlashInferPagedKVCache((k_cache, v_cache), cache.kv_indices, cache.kv_indptr,
                                         cache.batch_indices, cache.positions,
                                         kv_layout=cache.kv_layout, **scales)
    if cache.kind == "paged":
        return rd.PagedKVCache(k_cache, v_cache, cache.slot_mapping, **scales)
    return rd.FlatKVCache(k_cache, v_cache, cache.cache_loc, **scales)


def assert_same_or_neighbour(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """FP8 tensors equal but where the eager composition's float32 rotation (its own rounding
    steps) and the kernel's fused multiply-adds land on neighbouring FP8 values."""
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    assert ((a - b).abs() <= 1).all(), f"{what}: values more than one FP8 step apart"
    assert (a == b).double().mean() > 0.97, f"{what}: too many values differ"


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["vllm", "flashinfer-HND"])
def test_triton_stage_never_syncs_after_its_first_call(layout):
    """Under torch.cuda.set_sync_debug_mode("error") any host sync raises: a call after the
    first (the first compiles) with new index values, tensor scales and an FP8 q reads nothing
    on the host."""
    q, k, v, table, spec, positions, built = serving_step(layout)
    q_scale = torch.tensor(0.1, device="cuda")
    next_step(built, positions, 0)
    rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                     q_scale=q_scale, backend="triton")
    next_step(built, positions, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                             q_scale=q_scale, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype,q_mode", [(torch.bfloat16, "new"), (torch.bfloat16, "given"),
                                                (torch.bfloat16, "in place"),
                                                (torch.float8_e4m3fn, "fp8-scale")])
def test_triton_repeated_steps_run_their_plan(layout, cache_dtype, q_mode, monkeypatch):
    """From the third step on, a decode step (new positions, slots, data and scale values; the
    descriptor kept or rebuilt) skips the checks and runs its bound launch, and writes what a
    fresh eager call writes into a copy of the cache, no more."""
    from rope_dispatch import dispatch

    q, k, v, table, spec, positions, built = serving_step(layout, dtype=cache_dtype)
    checked = []
    check = dispatch.check_cache_call
    monkeypatch.setattr(dispatch, "check_cache_call",
                        lambda *args, **kwargs: checked.append(1) or check(*args, **kwargs))
    q_scale = torch.tensor(0.1, device="cuda") if q_mode == "fp8-scale" else None
    q_out = torch.empty_like(q) if q_mode == "given" else q if q_mode == "in place" else None
    gen = torch.Generator().manual_seed(7)
    norm = rd.HeadNorm((torch.rand(64, generator=gen) + 0.5).cuda())
    for step in range(5):
        next_step(built, positions, step)
        for x in (q, k, v, norm.weight):
            x.copy_(torch.randn(x.shape, generator=gen))
        if q_scale is not None:
            q_scale.fill_(0.05 + 0.02 * step)
            built.cache.k_scale.fill_(0.02 + 0.01 * step)
        cache = built.cache if step % 2 else copy_of(built.cache, built.cache.k_cache,
                                                      built.cache.v_cache)
        k_copy, v_copy = cache.k_cache.clone(), cache.v_cache.clone()
        want = rd.rope_to_cache(q, k, v, table, spec, positions=positions,
                                cache=copy_of(cache, k_copy, v_copy), q_norm=norm, k_norm=norm,
                                q_scale=q_scale, backend="eager")
        got = rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                               q_norm=norm, k_norm=norm, q_out=q_out, q_scale=q_scale,
                               backend="triton")
        assert q_out is None or got is q_out
        if cache_dtype == torch.bfloat16:
            for a, b in ((got, want), (cache.k_cache, k_copy), (cache.v_cache, v_copy)):
                # the cache's untouched slots hold random bytes, NaN among them
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2,
                                           equal_nan=True)
        else:
            assert_same_or_neighbour(got, want, "q")
            assert_same_or_neighbour(cache.k_cache, k_copy, "k cache")
            assert torch.equal(cache.v_cache.view(torch.uint8), v_copy.view(torch.uint8))
    assert len(checked) == 5 + 2  # every eager call; triton's first two (met, then planned)


def test_repeated_steps_are_served_by_the_recent_plan_set(monkeypatch):
    """dispatch keeps rope_to_cache's most recent plan set, as apply's: a repeated step (same
    spec, table, backend and form) is served from it without looking its key up; steps
    alternating between two forms (q new, q in place) each get their own plans; after
    ``forget_plans`` no step is served from it. On the CPU (whose caches are checked every
    call, their index values read) the cache is given the planned form a GPU cache has, and
    the eager backend a plan that checks the step's tensors anew and runs eagerly."""
    from rope_dispatch import dispatch
    from rope_dispatch.backends.eager import EagerBackend, rope_to_cache_eager

    class CountedPlans(dict):
        lookups = 0

        def get(self, key, default=None):
            CountedPlans.lookups += 1
            return super().get(key, default)

    monkeypatch.setattr(dispatch, "_plans", CountedPlans())
    monkeypatch.setattr(dispatch, "_recent_cache", None)
    checks, runs = [], []
    real_check = dispatch.check_cache_call

    def counted_check(*args, **kwargs):
        checks.append(1)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(dispatch, "check_cache_call", counted_check)
    monkeypatch.setattr(rd.call, "_reads", lambda index: False)  # positions as a GPU's
    q, k, v, table, spec, positions, built = small_call()
    cache = built.cache
    object.__setattr__(cache, "plan_parts", ((cache.k_cache, cache.v_cache, cache.slot_mapping),
                                             (type(cache), None, 1.0, 1.0)))

    def plan(self, call):
        def run(freqs, tensors):
            runs.append(1)
            q_now, k_now, v_now, positions_now = tensors[:4]
            return rope_to_cache_eager(real_check(
                q_now, k_now, v_now, freqs, spec, positions=positions_now, cache=cache,
                q_out=q_now if call.cache_write.q_out is call.t else None))
        return run

    monkeypatch.setattr(EagerBackend, "plan", plan)

    def step(seed, in_place):
        gen = torch.Generator().manual_seed(seed)
        q_step = torch.randn(q.shape, generator=gen).bfloat16()
        want = reference_rope(q_step.double(), table, positions, False)
        got = rd.rope_to_cache(q_step, k, v, table, spec, positions=positions, cache=cache,
                               q_out=q_step if in_place else None, backend="eager")
        assert (got is q_step) is in_place
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)

    for seed in range(3):  # checked, checked and planned, then served
        for in_place in (False, True):
            step(10 * seed + in_place, in_place)
    assert len(checks) == 4 and len(runs) == 2
    lookups = CountedPlans.lookups
    step(40, True)
    assert len(runs) == 3 and CountedPlans.lookups == lookups, "looked up again"
    step(41, False)  # the other form: looked up once, then its set is the recent one
    step(42, False)
    assert len(runs) == 5 and CountedPlans.lookups == lookups + 1
    dispatch.forget_plans()
    step(43, False)
    assert len(checks) == 5 and len(runs) == 5, "a forgotten plan set served a step"


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("q_mode", ["new", "given", "in-place"])
def test_triton_stage_moves_the_version_of_what_it_writes(q_mode):
    """The caches and q's output are written by a kernel torch does not see, so their version
    counters move at every call, planned ones (on a GPU, from the third) included; tensors made
    under inference mode have none, and their calls write all the same."""
    q, k, v, table, spec, positions, built = small_call(device=DEVICE)
    cache = built.cache
    for step in range(4):
        q_step = q.clone()
        q_out = {"new": None, "given": torch.empty_like(q), "in-place": q_step}[q_mode]
        before = [cache.k_cache._version, cache.v_cache._version,
                  None if q_out is None else q_out._version]
        out = rd.rope_to_cache(q_step, k, v, table, spec, positions=positions, cache=cache,
                               q_out=q_out, backend="triton")
        assert cache.k_cache._version > before[0] and cache.v_cache._version > before[1], step
        assert q_out is None or (out is q_out and out._version > before[2]), step
    with torch.inference_mode():
        q, k, v, table, spec, positions, built = small_call(device=DEVICE)
        want = reference_rope(q.double().cpu(), table.cpu(), positions.cpu(), False)
        for _ in range(3):
            q_step = q.clone()
            out = rd.rope_to_cache(q_step, k, v, table, spec, positions=positions,
                                   cache=built.cache, backend="triton",
                                   q_out=q_step if q_mode == "in-place" else None)
            torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("q_out", ["new", "q", "buffer"])
@pytest.mark.parametrize("quant", ["none", "numbers", "tensors"])
@pytest.mark.parametrize("norms", ["none", "both", "k"])
def test_a_bound_cache_plan_takes_the_tensors_dispatch_guards_in_its_slots(
        monkeypatch, stand_in_binder, layout, q_out, quant, norms):
    """The Triton backend's plan of a rope_to_cache call binds its launch to take, in order,
    the tensors dispatch guards and passes for a repeated step (q, k, v, positions, the cache's
    plan parts, q's scale tensor, q's output unless new or q itself, the norm weights): each
    slot names the tensor dispatch passes there, or a view of its memory."""
    from rope_dispatch import dispatch
    from rope_dispatch.backends import triton_rope

    monkeypatch.setattr(rd.call, "_reads", lambda index: False)  # positions as a GPU's
    cache_dtype = torch.bfloat16 if quant == "none" else torch.float8_e4m3fn
    scales = {"none": (1.0, 1.0), "numbers": (0.5, 0.25),
              "tensors": (torch.tensor(0.5), torch.tensor(0.25))}[quant]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, h, 8, generator=gen).bfloat16() for h in (4, 2, 2))
    spec = rd.RoPESpec(layout="thd", dtype="bf16")
    positions = torch.arange(5)
    cache = build_cache(layout, 5, 2, 8, cache_dtype, [False] * 5, gen, scales).cache
    # a GPU cache's plan parts (a CPU cache has none: its index values are read): the caches,
    # their index tensors, the scales given as tensors, in the order kv_cache documents
    object.__setattr__(cache, "plan_parts", (
        (cache.k_cache, cache.v_cache, *rd.kv_cache.cache_index(cache),
         *(s for s in scales if isinstance(s, torch.Tensor))), ("cpu", quant)))
    # q quantized where its output can be FP8: new, or a buffer of FP8
    quantized_q = quant != "none" and q_out != "q"
    out = {"new": None, "q": q, "buffer": torch.empty(
        q.shape, dtype=torch.float8_e4m3fn if quantized_q else q.dtype)}[q_out]
    q_scale = (None if not quantized_q else torch.tensor([2.0]) if quant == "tensors" else 2.0)
    weights = [rd.HeadNorm(torch.rand(8, generator=gen) + 0.5) for _ in range(2)]
    q_norm, k_norm = {"none": (None, None), "both": tuple(weights), "k": (None, weights[1])}[norms]
    table = angle_table(32, 8, False)
    with torch.no_grad():
        call = rd.kv_cache.check_cache_call(q, k, v, table, spec, positions=positions, cache=cache,
                                            q_norm=q_norm, k_norm=k_norm, q_out=out,
                                            q_scale=q_scale)
        run = triton_rope.plan_cache(call)
        assert run is not None
        tensors, _ = dispatch._cache_form(q, k, v, positions, cache, out, q_scale, q_norm, k_norm)
        assert run(table, tensors) is NotImplemented  # the stand-in declined: checked instead
    given, passed = stand_in_binder["given"], stand_in_binder["passed"]
    assert passed == tensors
    assert len(given) == len(tensors)
    for slot, (named, sent) in enumerate(zip(given, tensors)):
        assert named is sent or named.data_ptr() == sent.data_ptr(), f"slot {slot}"


@gpu
@pytest.mark.usefixtures("triton_backend")
def test_repeated_calls_with_a_strided_slot_mapping():
    """A slot mapping that is a strided view (a column of an engine's ``[T, 2]`` buffer),
    rewritten in place each step: every step, the planned ones too, writes k rotated (the
    float64 reference's) and v to the slots its values name, and no other slot."""
    gen = torch.Generator().manual_seed(0)
    tokens, d = 6, 16
    spec, table = rd.RoPESpec(layout="thd", dtype="bf16"), angle_table(64, d, False)
    k_cache = torch.zeros(8, 4, 2, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.full((tokens, 2), -1, dtype=torch.int64, device="cuda")[:, 0]
    cache = rd.PagedKVCache(k_cache, v_cache, slots)
    tol = dict(rtol=1.6e-2, atol=1.6e-2)
    for step in range(5):
        slots.copy_(torch.randperm(32, generator=gen)[:tokens])
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        q, k, v = (torch.randn(tokens, h, d, generator=gen).bfloat16() for h in (4, 2, 2))
        before_k, before_v = k_cache.view(-1, 2, d).cpu(), v_cache.view(-1, 2, d).cpu()
        got = rd.rope_to_cache(q.cuda(), k.cuda(), v.cuda(), table.cuda(), spec,
                               positions=positions.cuda(), cache=cache, backend="triton")
        at = slots.cpu()
        others = torch.ones(before_k.shape[0], dtype=torch.bool)
        others[at] = False
        after_k, after_v = k_cache.view(-1, 2, d).cpu(), v_cache.view(-1, 2, d).cpu()
        torch.testing.assert_close(got.cpu().double(), reference_rope(q, table, positions, False),
                                   **tol, msg=f"q, step {step}")
        torch.testing.assert_close(after_k[at].double(), reference_rope(k, table, positions, False),
                                   **tol, msg=f"k, step {step}")
        assert torch.equal(after_v[at], v), f"v, step {step}"
        assert torch.equal(after_k[others], before_k[others]), f"other k slots, step {step}"
        assert torch.equal(after_v[others], before_v[others]), f"other v slots, step {step}"


@pytest.mark.parametrize("target", ["q in place", "q_out", "k_cache"])
def test_a_norm_weight_in_written_memory_is_refused(target):
    """A norm weight inside what rope_to_cache writes (q rotated in place, a separate q_out,
    the cache) would be read while it is overwritten: refused, naming both; a weight of its
    own is served."""
    q, k, v, table, spec, positions, built = small_call(cache_dtype=torch.bfloat16, layout="flat")
    q_out = torch.empty_like(q)
    weight = {"q in place": q[0, 1], "q_out": q_out[2, 0], "k_cache": built.cache.k_cache.view(
        -1, 8)[0]}[target]
    written = "q_out" if target != "k_cache" else "k_cache"
    given = dict(q_out=q if target == "q in place" else q_out)
    with pytest.raises(rd.RoPEError, match=f"q_norm.weight shares memory with {written} "):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                         q_norm=rd.HeadNorm(weight), **given)
    rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=built.cache,
                     q_norm=rd.HeadNorm(weight.clone()), **given)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("target", ["q in place", "q_out"])
def test_an_inference_q_out_outside_inference_mode_is_refused_before_any_write(
        backend, target, request):
    """torch forbids writing an inference tensor outside inference mode (apply_ refuses to
    rotate one in place there): q's output (q itself in place) made under inference mode is
    refused by name when the call is not, before the cache is written (the eager composition
    wrote k and v, then failed in torch's copy into q_out); under inference mode it is
    served."""
    backend, device = backend_param(backend, request)
    q, k, v, table, spec, positions, built = small_call(device=device)
    with torch.inference_mode():
        q_inf = q.clone()
        q_out = q_inf if target == "q in place" else torch.empty_like(q)
    pages = built.k_pages.view(torch.uint8), built.v_pages.view(torch.uint8)  # (NaN bytes too)
    before = pages[0].clone(), pages[1].clone()
    with pytest.raises(rd.RoPEError, match="^q_out is an inference tensor and inference mode is "
                                           "off"):
        rd.rope_to_cache(q_inf, k, v, table, spec, positions=positions, cache=built.cache,
                         q_out=q_out, backend=backend)
    assert torch.equal(pages[0], before[0]) and torch.equal(pages[1], before[1])
    with torch.inference_mode():
        out = rd.rope_to_cache(q_inf, k, v, table, spec, positions=positions, cache=built.cache,
                               q_out=q_out, backend=backend)
    assert out is q_out and not torch.equal(pages[0], before[0])


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_outputs_that_overlap_themselves_are_refused_before_any_write(backend, request):
    """q's output (q itself in place) or a cache whose places share elements (an as_strided
    view with overlapping rows) would take one write over another's: refused naming it, before
    anything is written, on a first call and after calls that were planned."""
    backend, device = backend_param(backend, request)
    table, spec = angle_table(16, 8, False).to(device), rd.RoPESpec(layout="thd", dtype="fp32")
    positions = torch.arange(4, device=device)
    q, k, v = (torch.randn(4, heads, 8, device=device) for heads in (2, 1, 1))
    k_cache, v_cache = torch.zeros(6, 1, 8, device=device), torch.zeros(6, 1, 8, device=device)
    cache = rd.FlatKVCache(k_cache, v_cache, positions)
    buffer = torch.randn(100, device=device)
    for _ in range(3):  # planned from the second call on; an overlapping q_out's strides differ
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                         q_out=buffer[:64].view(4, 2, 8), backend=backend)
    rows = buffer.as_strided((4, 2, 8), (8, 8, 1))  # token i's head 1 is token i + 1's head 0
    before = buffer.clone(), k_cache.clone()
    k_cache.zero_()
    for q_in, q_out in ((q, rows), (rows, rows)):
        with pytest.raises(rd.RoPEError, match=r"^rope_to_cache cannot write q's output: q_out "
                           r"\(4, 2, 8\) with strides \(8, 8, 1\) overlaps itself"):
            rd.rope_to_cache(q_in, k, v, table, spec, positions=positions, cache=cache,
                             q_out=q_out, backend=backend)
        assert torch.equal(buffer, before[0]) and not k_cache.any()
    slots = torch.zeros(100, device=device).as_strided((6, 1, 8), (4, 8, 1))
    with pytest.raises(rd.RoPEError, match=r"^rope_to_cache cannot write into this cache: "
                       r"FlatKVCache k_cache \(6, 1, 8\) with strides \(4, 8, 1\) overlaps"):
        rd.FlatKVCache(slots, v_cache, positions)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("target", ["q in place", "q_out", "k_cache"])
def test_a_table_in_written_memory_is_refused(backend, target, request):
    """A table inside what rope_to_cache writes (q rotated in place, a separate q_out, the
    cache) would be read while other tokens' results are written over it, as a norm weight
    would: refused, naming both, before anything is written; a table of its own is served."""
    backend, device = backend_param(backend, request)
    spec, positions = rd.RoPESpec(layout="thd", dtype="fp32"), torch.arange(4, device=device)
    q, k, v = (torch.randn(4, heads, 8, device=device) for heads in (2, 1, 1))
    cache = rd.FlatKVCache(torch.zeros(8, 1, 8, device=device),
                           torch.zeros(8, 1, 8, device=device), positions)
    q_out = q if target == "q in place" else torch.zeros_like(q)
    table = (cache.k_cache if target == "k_cache" else q_out).view(8, 8)
    table.uniform_(0, 3)
    before = q.clone(), q_out.clone(), cache.k_cache.clone()
    written = "k_cache" if target == "k_cache" else "q_out"
    with pytest.raises(rd.RoPEError, match=f"^freqs shares memory with {written} "):
        rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache, q_out=q_out,
                         backend=backend)
    after = q, q_out, cache.k_cache
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "written before the refusal"
    own = table.clone()
    expected = reference_rope(q.cpu(), own.cpu(), positions.cpu(), False)
    got = rd.rope_to_cache(q, k, v, own, spec, positions=positions, cache=cache, q_out=q_out,
                           backend=backend)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=2e-5, atol=2e-5)


def _overlapping(case: str, qkv: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor,
                 bad: bool) -> dict:
    """A rope_to_cache call's tensors: q [4, 2, 8], k and v [4, 1, 8] (views of ``qkv``), the
    flat caches [8, 1, 8], with ``case``'s tensor inside what the call writes where ``bad``."""
    q, k, v = qkv[:, :2], qkv[:, 2:3], qkv[:, 3:]
    made = {"q": q, "k": k, "v": v, "q_out": None, "weight": None, "freqs": table,
            "k_cache": k_cache, "v_cache": torch.zeros_like(k_cache)}
    if case == "v cache over k cache":
        made["v_cache"] = k_cache if bad else made["v_cache"]
    elif case == "q in the cache":
        made["q"] = k_cache.view(4, 2, 8) if bad else q
    elif case == "q_out over k":
        made["q_out"] = qkv[:, 1:3] if bad else torch.empty_like(q)
    elif case == "q_out over itself":  # token i's head 1 is token i + 1's head 0
        made["q_out"] = (torch.empty(40, device=q.device).as_strided(q.shape, (8, 8, 1)) if bad
                         else torch.empty_like(q))
    elif case == "norm weight in the cache":
        made["weight"] = k_cache.view(8, 8)[0] if bad else table[1] + 0.5
    else:  # the table in the cache
        made["freqs"] = k_cache.view(8, 8) if bad else table
    return made


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("case, refusal", [
    ("q in the cache", r"q \(4, 2, 8\) shares memory with FlatKVCache k_cache"),
    ("q_out over k", "q_out shares memory with k"),
    ("q_out over itself", r"^rope_to_cache cannot write q's output: q_out \(4, 2, 8\) with "
                          r"strides \(8, 8, 1\) overlaps itself"),
    ("norm weight in the cache", "q_norm.weight shares memory with k_cache"),
    ("table in the cache", "freqs shares memory with k_cache"),
    ("v cache over k cache", "FlatKVCache k_cache and FlatKVCache v_cache are the same memory"),
])
def test_compiled_calls_refuse_overlapping_memory(backend, case, refusal, request):
    """Under ``torch.compile(fullgraph=True)`` the call's tensors are fake while it traces, so
    its memory checks run in the graph, on its real tensors: q, q's output, a norm weight or the
    table inside what the call writes, and a q_out that overlaps itself, is refused as in eager
    (the compiled step wrote the cache, then read q, the weight or the table from it: q's
    output from the values just stored);
    the same step on memory apart gives the reference's q and cache. The descriptor, made in
    the step, has its caches checked there too (a v cache over the k cache)."""
    import torch._dynamo

    backend, device = backend_param(backend, request)
    spec, positions = rd.RoPESpec(layout="thd", dtype="fp32"), torch.arange(4, device=device)
    table = angle_table(8, 8, False).to(device)

    def step(q, k, v, q_out, weight, freqs, k_cache, v_cache):
        cache = rd.FlatKVCache(k_cache, v_cache, positions)
        norm = None if weight is None else rd.HeadNorm(weight)
        return rd.rope_to_cache(q, k, v, freqs, spec, positions=positions, cache=cache,
                                q_out=q_out, q_norm=norm, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for bad in (False, True):
        qkv = torch.rand(4, 4, 8, device=device) + 0.5
        made = _overlapping(case, qkv, torch.rand(8, 1, 8, device=device), table, bad)
        if bad:
            with pytest.raises(rd.RoPEError, match=refusal):
                compiled(**made)
            continue
        before = {name: None if x is None else x.detach().cpu().clone()
                  for name, x in made.items()}
        out = compiled(**made)
        k_cache, v_cache = made["k_cache"], made["v_cache"]
        angles, at = before["freqs"].double(), positions.cpu()
        want_q = reference_rope(norm64(before["q"], before["weight"]), angles, at, False)
        torch.testing.assert_close(out.cpu().double(), want_q, rtol=2e-5, atol=2e-5)
        want_k = reference_rope(before["k"].double(), angles, at, False)
        torch.testing.assert_close(k_cache[:4].cpu().double(), want_k, rtol=2e-5, atol=2e-5)
        assert torch.equal(v_cache[:4].cpu(), before["v"])
