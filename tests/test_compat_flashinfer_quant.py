"""FlashInfer's FP8 serving prologue (``rope_quantize_fp8``, ``mla_rope_quantize_fp8``,
``rope_quantize_fp8_append_paged_kv_cache``) in ``rope_dispatch.compat.flashinfer``, against a
float64 reference written here from FlashInfer's definition, on the CPU (the eager backend).

The definition (FlashInfer's ``flashinfer/rope.py`` docstrings and its kernels in
``include/flashinfer/pos_enc.cuh``): the rope parts turn over their whole width by the angles
of ``cos_sin_cache[pos_ids[i]]`` (cosines, then sines; NeoX pairs ``(j, j + rope_dim/2)``, else
``(2j, 2j + 1)``); every part is then multiplied by its quant scale (``quant_scale_q`` for q,
``quant_scale_kv`` for k and v) and cast to FP8. The append door writes token ``i`` of request
``b = batch_indices[i]`` at place ``p = positions[i]`` to page ``kv_indices[kv_indptr[b] + p //
page_size]``, entry ``p % page_size`` (NHD ``[pages, page_size, heads, d]``, HND ``[pages,
heads, page_size, d]``; MLA's ckv and kpe ``[pages, page_size, d]``), a GQA k entry being the
rotated rope part followed by the nope part; ``b < 0`` writes nothing.

The reference casts its float64 values as torch casts. The doors compute in float32, so a value
may round to the reference's neighbour where the float64 value lies within float32 error of an
FP8 rounding boundary: :func:`assert_fp8` accepts exactly the casts of values within that error
and wants nearly all values to be the reference's own cast. The shapes are those FlashInfer's
tests run (tests/attention/test_rope.py: MLA, GQA and MHA head and rope/no-rope configurations,
NHD and HND, page sizes 16 and 32, int32 and int64 pos_ids, a decode step after a prefill, CUDA-
graph padding), at CPU token counts.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import rope_dispatch as rd
from rope_dispatch.compat import flashinfer as fi
from rope_dispatch.compat.flashinfer import (
    mla_rope_quantize_fp8,
    rope_quantize_fp8,
    rope_quantize_fp8_append_paged_kv_cache,
)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_POS = 512

# (attention, qo heads, kv heads, rope_dim, no_rope_dim): the configurations FlashInfer tests
CONFIGS = [
    ("mla", 128, 1, 64, 512),
    ("mla", 64, 1, 128, 256),
    ("mla", 128, 1, 64, 128),
    ("mla", 32, 1, 32, 96),
    ("gqa", 32, 8, 64, 64),
    ("gqa", 64, 16, 128, 128),
    ("gqa", 24, 6, 32, 96),
    ("gqa", 32, 8, 128, 0),
    ("gqa", 64, 8, 128, 0),
    ("gqa", 64, 8, 64, 0),
    ("mha", 32, 32, 64, 64),
    ("mha", 16, 16, 128, 128),
    ("mha", 8, 8, 32, 96),
]
CONFIG_IDS = ["-".join(map(str, c)) for c in CONFIGS]


# ---------------------------------------------------------------------------- the reference


def engine_cache(rope_dim: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 ``[MAX_POS, rope_dim]`` cos|sin cache of random (unequal) pair angles."""
    angles = torch.rand(MAX_POS, rope_dim // 2, generator=gen, dtype=torch.float64) * 40
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotated64(x: torch.Tensor, cache: torch.Tensor, pos_ids: torch.Tensor,
              is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[nnz, heads, rope_dim]`` (or ``[nnz, rope_dim]``) turned in float64, and each
    value's size (the sum of its two products' magnitudes, what float32 error scales with)."""
    half = x.shape[-1] // 2
    row = cache.double()[pos_ids.long()]
    if x.dim() == 3:
        row = row[:, None, :]
    cos, sin = row[..., :half], row[..., half:]
    x = x.double()
    a, b = (x[..., :half], x[..., half:]) if is_neox else (x[..., 0::2], x[..., 1::2])
    first, second = a * cos - b * sin, b * cos + a * sin
    size1, size2 = (a * cos).abs() + (b * sin).abs(), (b * cos).abs() + (a * sin).abs()
    if is_neox:
        return torch.cat((first, second), -1), torch.cat((size1, size2), -1)
    return (torch.stack((first, second), -1).flatten(-2),
            torch.stack((size1, size2), -1).flatten(-2))


def plain64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A part that is only quantized: its float64 value and size."""
    return x.double(), x.double().abs()


def assert_fp8(got: torch.Tensor, value: torch.Tensor, size: torch.Tensor, scale: float,
               dtype: torch.dtype, what: str) -> None:
    """``got`` is ``value * scale`` cast to ``dtype`` as torch casts, up to float32 rounding:
    between the casts of that value moved down and up by float32 error, and mostly the cast
    itself."""
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == value.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(value.shape)}"
    want = value * scale
    slack = size * scale * 2.0**-20 + 1e-300
    low, high = (want - slack).to(dtype).double(), (want + slack).to(dtype).double()
    g = got.double()
    bad = ~((low <= g) & (g <= high))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} values off, e.g. got {g[bad][:4].tolist()} "
        f"for {want[bad][:4].tolist()}"
    )
    if got.numel():
        exact = (g == want.to(dtype).double()).double().mean()
        assert exact >= 0.98, f"{what}: only {float(exact):.3f} are the reference's own cast"


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Any bytes at all (NaN patterns too): what a cache or an output held before the call."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype)


def written(kv_indices, kv_indptr, batch_indices, positions, page_size) -> dict[int, tuple[int, int]]:
    """FlashInfer's placement: ``{token: (page, entry)}`` for every token written."""
    indices, indptr = kv_indices.tolist(), kv_indptr.tolist()
    out = {}
    for i, (b, p) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
        if b >= 0:
            out[i] = (indices[indptr[b] + p // page_size], p % page_size)
    return out


def assert_rest_unchanged(after: torch.Tensor, before: torch.Tensor,
                          slots: dict[int, tuple[int, int]], what: str) -> None:
    """Every entry of a ``[pages, page_size, ...]`` cache view but the written ones holds the
    bytes it held, byte for byte."""
    keep = torch.ones(after.shape[:2], dtype=torch.bool)
    for page, entry in slots.values():
        keep[page, entry] = False
    a, b = after.view(torch.uint8)[keep], before.view(torch.uint8)[keep]
    assert torch.equal(a, b), f"{what}: {int((a != b).sum())} bytes changed outside the written entries"


# ---------------------------------------------------------------------------- inputs


def parts(attention, heads, kv_heads, rope_dim, no_rope_dim, nnz, dtype, gen, apart):
    """q and k as FlashInfer's tests make them: the rope and nope parts slices of one tensor
    ``[..., rope_dim + no_rope_dim]`` (or, ``apart``, tensors of their own); a nope part of no
    channels is ``None``; MLA's k is 2-D."""
    k_lead = (nnz,) if attention == "mla" else (nnz, kv_heads)

    def split(lead):
        whole = torch.randn(*lead, rope_dim + no_rope_dim, generator=gen).to(dtype)
        rope, nope = whole[..., :rope_dim], whole[..., rope_dim:]
        if apart:
            rope, nope = rope.clone(), nope.clone()
        return rope, (nope if no_rope_dim else None)

    return (*split((nnz, heads)), *split(k_lead))


def out_tensors(mode, like_rope, like_nope_shape, dtype, gen):
    """Outputs as a caller gives them: ``None`` (returned), slices of one tensor ("slices", as
    FlashInfer's tests), or tensors of their own ("apart"); filled with random bytes."""
    if mode == "returned":
        return None, None
    rope_dim = like_rope.shape[-1]
    if mode == "slices":
        whole = random_bytes((*like_rope.shape[:-1], rope_dim + like_nope_shape[-1]), dtype, gen)
        return whole[..., :rope_dim], whole[..., rope_dim:]
    return (random_bytes(tuple(like_rope.shape), dtype, gen),
            random_bytes(tuple(like_nope_shape), dtype, gen))


def nope_shape(rope: torch.Tensor, no_rope_dim: int) -> tuple[int, ...]:
    return (*rope.shape[:-1], no_rope_dim)


def tokens(config: tuple, most: int = 19) -> int:
    """A CPU-sized token count: ``most`` (FlashInfer's tests run 1, 19, 128, ...), fewer for
    the widest heads (the float64 reference's cost), at least 2."""
    _, heads, _, rope_dim, no_rope_dim = config
    return max(2, min(most, 150_000 // (heads * (rope_dim + no_rope_dim))))


# ---------------------------------------------------------------------------- rope_quantize_fp8


@pytest.mark.parametrize("outs", ["returned", "slices", "apart"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("quant_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_rope_quantize_fp8(config, quant_dtype, is_neox, outs):
    attention, heads, kv_heads, rope_dim, no_rope_dim = config
    seed = CONFIGS.index(config) * 12 + FP8.index(quant_dtype) * 6 + is_neox * 3 + len(outs)
    gen = torch.Generator().manual_seed(seed)
    dtype = (torch.bfloat16, torch.float16)[seed % 2]
    nnz = 1 if seed % 5 == 0 else tokens(config)
    q_rope, q_nope, k_rope, k_nope = parts(*config, nnz, dtype, gen, apart=outs == "apart")
    cache = engine_cache(rope_dim, gen)
    pos_ids = torch.randint(0, MAX_POS, (nnz,), generator=gen)
    pos_ids = pos_ids.to((torch.int32, torch.int64)[seed % 3 > 0])
    scale_q, scale_kv = (0.75, 1.0, 2.0)[seed % 3], (1.5, 0.5, 1.0)[seed % 3]
    q_outs = out_tensors(outs, q_rope, nope_shape(q_rope, no_rope_dim), quant_dtype, gen)
    k_outs = out_tensors(outs, k_rope, nope_shape(k_rope, no_rope_dim), quant_dtype, gen)
    given = (q_outs[0], k_outs[0], q_outs[1], k_outs[1])

    # the dtype comes from quantize_dtype, else the outputs given, else the default (e4m3)
    default = outs != "returned" or (quant_dtype == torch.float8_e4m3fn and seed % 2 == 0)
    got = rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cache, pos_ids, is_neox=is_neox,
        quantize_dtype=None if default else quant_dtype,
        quant_scale_q=scale_q, quant_scale_kv=scale_kv, q_rope_out=given[0],
        k_rope_out=given[1], q_nope_out=given[2], k_nope_out=given[3],
    )
    assert isinstance(got, tuple) and len(got) == 4
    if outs != "returned":
        assert all(g is w for g, w in zip(got, given)), "the given outputs are returned"
    empty = torch.empty(*k_rope.shape[:-1], 0)
    want = (rotated64(q_rope, cache, pos_ids, is_neox), rotated64(k_rope, cache, pos_ids, is_neox),
            plain64(q_nope if q_nope is not None else empty.new_empty(*q_rope.shape[:-1], 0)),
            plain64(k_nope if k_nope is not None else empty))
    for name, g, (value, size), scale in zip(
            ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), got, want,
            (scale_q, scale_kv, scale_q, scale_kv)):
        assert_fp8(g, value, size, scale, quant_dtype, name)


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("quant_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("nnz", [1, 5])
def test_mla_rope_quantize_fp8_deepseek_shapes(nnz, quant_dtype, input_dtype):
    """FlashInfer's MLA test: q ``[nnz, 128, 576]``, k ``[nnz, 576]``, the first 64 channels
    rotated (interleaved pairs), outputs slices of one q and one k output tensor."""
    gen = torch.Generator().manual_seed(nnz)
    q = torch.randn(nnz, 128, 576, generator=gen).to(input_dtype)
    k = torch.randn(nnz, 576, generator=gen).to(input_dtype)
    cache = engine_cache(64, gen)
    pos_ids = torch.arange(nnz)
    q_out, k_out = torch.empty_like(q, dtype=quant_dtype), torch.empty_like(k, dtype=quant_dtype)
    got = mla_rope_quantize_fp8(
        q[..., :64], k[..., :64], q[..., 64:], k[..., 64:], cache, pos_ids, is_neox=False,
        q_rope_out=q_out[..., :64], k_rope_out=k_out[..., :64], q_nope_out=q_out[..., 64:],
        k_nope_out=k_out[..., 64:],
    )
    assert [g.data_ptr() for g in got] == [q_out.data_ptr(), k_out.data_ptr(),
                                          q_out[..., 64:].data_ptr(), k_out[..., 64:].data_ptr()]
    q_rot, q_size = rotated64(q[..., :64], cache, pos_ids, False)
    k_rot, k_size = rotated64(k[..., :64], cache, pos_ids, False)
    assert_fp8(q_out, torch.cat((q_rot, q[..., 64:].double()), -1),
               torch.cat((q_size, q[..., 64:].double().abs()), -1), 1.0, quant_dtype, "q_out")
    assert_fp8(k_out, torch.cat((k_rot, k[..., 64:].double()), -1),
               torch.cat((k_size, k[..., 64:].double().abs()), -1), 1.0, quant_dtype, "k_out")


def test_defaults_dtype_and_empty_parts():
    """quantize_dtype None and no outputs: float8_e4m3fn, outputs allocated like the inputs;
    None nope parts give ``[..., 0]`` outputs; no tokens at all is a call that does nothing."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 16, generator=gen).bfloat16()
    k = torch.randn(3, 2, 16, generator=gen).bfloat16()
    cache = engine_cache(16, gen)
    got = rope_quantize_fp8(q, k, None, None, cache, torch.tensor([0, 5, 9]))
    assert [tuple(g.shape) for g in got] == [(3, 4, 16), (3, 2, 16), (3, 4, 0), (3, 2, 0)]
    assert all(g.dtype == torch.float8_e4m3fn for g in got)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    nothing = rope_quantize_fp8(q[:0], k[:0], None, None, cache, torch.tensor([], dtype=torch.long))
    assert [tuple(g.shape) for g in nothing] == [(0, 4, 16), (0, 2, 16), (0, 4, 0), (0, 2, 0)]
    # the dtype of the first given output decides (FlashInfer's order: q_rope_out, k_rope_out, ...)
    k_out = torch.empty(3, 2, 16, dtype=torch.float8_e5m2)
    got = rope_quantize_fp8(q, k, None, None, cache, torch.tensor([0, 5, 9]), k_rope_out=k_out)
    assert got[1] is k_out and all(g.dtype == torch.float8_e5m2 for g in got)


def test_power_of_two_scales_multiply_exactly():
    """The quant scales multiply (FlashInfer stores ``x * quant_scale``, rope-dispatch ``x /
    scale``: the door passes ``1 / quant_scale``); for powers of two the parts that are only
    quantized are the reference's cast bit for bit."""
    gen = torch.Generator().manual_seed(11)
    q_rope, q_nope, k_rope, k_nope = parts("gqa", 8, 2, 32, 32, 12, torch.bfloat16, gen, False)
    cache = engine_cache(32, gen)
    pos = torch.randint(0, MAX_POS, (12,), generator=gen)
    for scale_q, scale_kv in ((4.0, 0.25), (0.5, 8.0)):
        got = rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos,
                                quant_scale_q=scale_q, quant_scale_kv=scale_kv)
        assert torch.equal(got[2].view(torch.uint8),
                           (q_nope.double() * scale_q).to(torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(got[3].view(torch.uint8),
                           (k_nope.double() * scale_kv).to(torch.float8_e4m3fn).view(torch.uint8))
        assert_fp8(got[1], *rotated64(k_rope, cache, pos, True), scale_kv, torch.float8_e4m3fn,
                   "k_rope_out")


# ---------------------------------------------------------------------------- the append door


def paged_metadata(nnz, page_size, gen, existing=(5, 0, 33), padding=1):
    """Three requests that already hold ``existing`` tokens and get the ``nnz`` new tokens
    spread over them (the first request gets what is left), on randomly ordered pages of a
    cache with spare pages; then ``padding`` tokens with ``batch_indices`` -1 (CUDA-graph
    padding). Returns kv_indices, kv_indptr, batch_indices, positions (int32) and the page
    count."""
    new = [nnz - nnz // 2 - nnz // 4, nnz // 2, nnz // 4]
    pages_per = [-(-(e + n) // page_size) for e, n in zip(existing, new)]
    max_pages = sum(pages_per) + 3
    order = torch.randperm(max_pages, generator=gen)[: sum(pages_per)]
    indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()])
    batch, place = [], []
    for b, (e, n) in enumerate(zip(existing, new)):
        batch += [b] * n
        place += list(range(e, e + n))
    batch += [-1] * padding
    place += [0] * padding
    as32 = dict(dtype=torch.int32)
    return (order.to(torch.int32), indptr.to(torch.int32), torch.tensor(batch, **as32),
            torch.tensor(place, **as32), max_pages)


def check_append(config, nnz, input_dtype, quant_dtype, kv_layout, page_size, is_neox, outs,
                 rope_idtype, seed, apart=False):
    attention, heads, kv_heads, rope_dim, no_rope_dim = config
    gen = torch.Generator().manual_seed(seed)
    kv_indices, kv_indptr, batch_indices, positions, max_pages = paged_metadata(nnz, page_size, gen)
    total = batch_indices.numel()
    q_rope, q_nope, k_rope, k_nope = parts(*config, total, input_dtype, gen, apart=apart)
    cache = engine_cache(rope_dim, gen)
    pos_ids = (torch.randint(0, MAX_POS, (total,), generator=gen)).to(rope_idtype)
    scale_q, scale_kv = (1.0, 0.625, 2.0)[seed % 3], (1.0, 1.75, 0.5)[seed % 3]
    head_dim = rope_dim + no_rope_dim
    if attention == "mla":
        v = None
        paged = (random_bytes((max_pages, page_size, no_rope_dim), quant_dtype, gen),
                 random_bytes((max_pages, page_size, rope_dim), quant_dtype, gen))
        views = (paged[1], paged[0])  # kpe, ckv: [pages, page_size, d]
    else:
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(input_dtype)
        shape = ((max_pages, page_size, kv_heads, head_dim) if kv_layout == "NHD"
                 else (max_pages, kv_heads, page_size, head_dim))
        paged = (random_bytes(shape, quant_dtype, gen), random_bytes(shape, quant_dtype, gen))
        views = tuple(c if kv_layout == "NHD" else c.transpose(1, 2) for c in paged)
    before = [c.clone() for c in views]
    q_outs = out_tensors(outs, q_rope, nope_shape(q_rope, no_rope_dim), quant_dtype, gen)

    got = rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cache, pos_ids, paged, kv_indices, kv_indptr,
        batch_indices, positions, is_neox=is_neox,
        quantize_dtype=quant_dtype if outs == "returned" else None,
        quant_scale_q=scale_q, quant_scale_kv=scale_kv, page_size=page_size, kv_layout=kv_layout,
        q_rope_out=q_outs[0], q_nope_out=q_outs[1],
    )
    assert isinstance(got, tuple) and len(got) == 2
    if outs != "returned":
        assert got[0] is q_outs[0] and got[1] is q_outs[1]
    # q: every token rotated, padding too (FlashInfer leaves a padding token's q rows alone)
    assert_fp8(got[0], *rotated64(q_rope, cache, pos_ids, is_neox), scale_q, quant_dtype, "q_rope_out")
    no_q_nope = q_rope.new_empty(*q_rope.shape[:-1], 0)
    assert_fp8(got[1], *plain64(q_nope if q_nope is not None else no_q_nope), scale_q,
               quant_dtype, "q_nope_out")

    slots = written(kv_indices, kv_indptr, batch_indices, positions, page_size)
    assert len(slots) == nnz
    k_rot, k_size = rotated64(k_rope, cache, pos_ids, is_neox)
    k_nope64 = k_nope.double() if k_nope is not None else k_rot[..., :0]
    if attention == "mla":
        wants = ((k_rot, k_size), (k_nope64, k_nope64.abs()))
        names = ("kpe_cache", "ckv_cache")
    else:
        wants = ((torch.cat((k_rot, k_nope64), -1), torch.cat((k_size, k_nope64.abs()), -1)),
                 plain64(v))
        names = ("k_cache", "v_cache")
    for view, old, (value, size), name in zip(views, before, wants, names):
        tokens = list(slots)
        entries = torch.stack([view[page, entry] for page, entry in slots.values()])
        assert_fp8(entries, value[tokens], size[tokens], scale_kv, quant_dtype, name)
        assert_rest_unchanged(view, old, slots, name)


@pytest.mark.parametrize("outs", ["returned", "slices", "apart"])
@pytest.mark.parametrize("quant_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_append_paged_kv_cache(config, kv_layout, quant_dtype, outs):
    seed = (CONFIGS.index(config) * 12 + (kv_layout == "HND") * 6 + FP8.index(quant_dtype) * 3
            + len(outs))
    check_append(config, nnz=1 if seed % 7 == 0 else tokens(config),
                 input_dtype=(torch.bfloat16, torch.float16)[seed % 2], quant_dtype=quant_dtype,
                 kv_layout=kv_layout, page_size=(16, 32)[seed % 4 > 1], is_neox=bool(seed % 3),
                 outs=outs, rope_idtype=(torch.int32, torch.int64)[seed % 5 > 1], seed=seed,
                 apart=outs == "apart")


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[4]],
                         ids=[i for c, i in zip(CONFIGS, CONFIG_IDS) if c[4]])
def test_append_parts_given_apart(config, is_neox):
    """GQA/MHA with nope channels: q and k parts of their own (not slices of one tensor) are
    joined by a copy, outputs of their own filled from one; the same values."""
    check_append(config, tokens(config, 7), torch.bfloat16, torch.float8_e4m3fn, "NHD", 16,
                 is_neox, "apart", torch.int64, seed=100 + CONFIGS.index(config), apart=True)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3], CONFIGS[4], CONFIGS[7], CONFIGS[11]],
                         ids=[CONFIG_IDS[i] for i in (0, 3, 4, 7, 11)])
@pytest.mark.parametrize("new_tokens", [1, 8])
def test_decode_after_prefill(config, kv_layout, new_tokens):
    """FlashInfer's decode case: a prefill of 10 tokens into request 0, then new tokens appended
    after them; the prefill's entries keep their bytes, the new ones hold the new tokens."""
    attention, heads, kv_heads, rope_dim, no_rope_dim = config
    gen = torch.Generator().manual_seed(new_tokens)
    page_size, existing, dtype = 16, 10, torch.float8_e5m2
    total = existing + new_tokens
    max_pages = -(-total // page_size)
    kv_indices = torch.arange(max_pages, dtype=torch.int32)
    kv_indptr = torch.tensor([0, max_pages, max_pages], dtype=torch.int32)
    cache = engine_cache(rope_dim, gen)
    if attention == "mla":
        paged = (torch.zeros(max_pages, page_size, no_rope_dim, dtype=dtype),
                 torch.zeros(max_pages, page_size, rope_dim, dtype=dtype))
    else:
        shape = ((max_pages, page_size, kv_heads, rope_dim + no_rope_dim) if kv_layout == "NHD"
                 else (max_pages, kv_heads, page_size, rope_dim + no_rope_dim))
        paged = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def step(first, count):
        q_rope, q_nope, k_rope, k_nope = parts(*config, count, torch.float16, gen, apart=False)
        v = None if attention == "mla" else torch.randn(count, kv_heads, rope_dim + no_rope_dim,
                                                        generator=gen).half()
        places = torch.arange(first, first + count, dtype=torch.int32)
        rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, cache, places.long(), paged, kv_indices,
            kv_indptr, torch.zeros(count, dtype=torch.int32), places, is_neox=False,
            quantize_dtype=dtype, page_size=page_size, kv_layout=kv_layout)
        k_rot, k_size = rotated64(k_rope, cache, places, False)
        nope = k_nope.double() if k_nope is not None else k_rot[..., :0]
        if attention == "mla":
            return [(k_rot, k_size), (nope, nope.abs())]
        return [(torch.cat((k_rot, nope), -1), torch.cat((k_size, nope.abs()), -1)), plain64(v)]

    views = (paged[1], paged[0]) if attention == "mla" else tuple(
        c if kv_layout == "NHD" else c.transpose(1, 2) for c in paged)
    step(0, existing)
    after_prefill = [c.clone() for c in views]
    wants = step(existing, new_tokens)
    slots = {i: ((existing + i) // page_size, (existing + i) % page_size) for i in range(new_tokens)}
    for view, old, (value, size), name in zip(views, after_prefill, wants, ("k", "v")):
        entries = torch.stack([view[page, entry] for page, entry in slots.values()])
        assert_fp8(entries, value, size, 1.0, dtype, f"{name} of the new tokens")
        assert_rest_unchanged(view, old, slots, f"{name} (the prefill's entries)")


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("config", [("gqa", 64, 8, 128, 0), ("mla", 128, 1, 64, 512)],
                         ids=["gqa", "mla"])
def test_padding_tokens_write_nothing(config, kv_layout):
    """FlashInfer's CUDA-graph padding case: 3 real decode tokens (requests of 30, 50 and 70
    tokens) padded to 5 with batch_indices -1; nothing but the 3 entries changes."""
    attention, heads, kv_heads, rope_dim, no_rope_dim = config
    gen = torch.Generator().manual_seed(3)
    page_size, lens = 16, [30, 50, 70]
    pages_per = [-(-n // page_size) for n in lens]
    max_pages = sum(pages_per) + 10
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist(), sum(pages_per),
                              sum(pages_per)], dtype=torch.int32)
    kv_indices = torch.arange(max_pages, dtype=torch.int32)
    batch_indices = torch.tensor([0, 1, 2, -1, -1], dtype=torch.int32)
    positions = torch.tensor([29, 49, 69, 0, 0], dtype=torch.int32)
    pos_ids = torch.tensor([29, 49, 69, 0, 0], dtype=torch.int32)
    q_rope, q_nope, k_rope, k_nope = parts(*config, 5, torch.bfloat16, gen, apart=False)
    cache = engine_cache(rope_dim, gen)
    if attention == "mla":
        v = None
        paged = (random_bytes((max_pages, page_size, no_rope_dim), torch.float8_e4m3fn, gen),
                 random_bytes((max_pages, page_size, rope_dim), torch.float8_e4m3fn, gen))
        views = paged
    else:
        v = torch.randn(5, kv_heads, rope_dim, generator=gen).bfloat16()
        shape = ((max_pages, page_size, kv_heads, rope_dim) if kv_layout == "NHD"
                 else (max_pages, kv_heads, page_size, rope_dim))
        paged = tuple(random_bytes(shape, torch.float8_e4m3fn, gen) for _ in range(2))
        views = tuple(c if kv_layout == "NHD" else c.transpose(1, 2) for c in paged)
    before = [c.clone() for c in views]
    rope_quantize_fp8_append_paged_kv_cache(
        q_rope=q_rope, k_rope=k_rope, q_nope=q_nope, k_nope=k_nope, v=v, cos_sin_cache=cache,
        pos_ids=pos_ids, paged_kv_cache=paged, kv_indices=kv_indices, kv_indptr=kv_indptr,
        batch_indices=batch_indices, positions=positions, page_size=page_size,
        kv_layout=kv_layout, quantize_dtype=torch.float8_e4m3fn, is_neox=False)
    slots = written(kv_indices, kv_indptr, batch_indices, positions, page_size)
    assert sorted(slots) == [0, 1, 2]
    for view, old in zip(views, before):
        assert_rest_unchanged(view, old, slots, "cache")


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_append_of_no_tokens_writes_nothing(attention):
    args = small(attention)
    for name in ("q_rope", "k_rope", "q_nope", "k_nope", "pos_ids"):
        args[name] = args[name][:0]
    fp8 = dict(dtype=torch.float8_e4m3fn)
    if attention == "mla":
        args.update(v=None, paged_kv_cache=(torch.ones(2, 4, 4, **fp8), torch.ones(2, 4, 8, **fp8)))
    else:
        args.update(v=torch.zeros(0, 2, 12, dtype=torch.bfloat16),
                    paged_kv_cache=(torch.ones(2, 4, 2, 12, **fp8), torch.ones(2, 4, 2, 12, **fp8)))
    none = torch.zeros(0, dtype=torch.int32)
    q_rope_out, q_nope_out = rope_quantize_fp8_append_paged_kv_cache(
        **args, kv_indices=torch.tensor([1], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 1], dtype=torch.int32), batch_indices=none, positions=none,
        page_size=4)
    assert q_rope_out.shape == (0, 4, 8) and q_nope_out.shape == (0, 4, 4)
    assert all(bool((c.float() == 1).all()) for c in args["paged_kv_cache"])


@pytest.mark.parametrize("given", ["q_nope", "k_nope"])
def test_append_with_one_nope_part_is_refused_by_name(given):
    """GQA/MHA joins each side's parts into one head: a nope part on one side only was refused
    as k's and q's joined shapes, which the caller never passed."""
    other = "k_nope" if given == "q_nope" else "q_nope"
    widths = (4, 0) if given == "q_nope" else (0, 4)
    with pytest.raises(rd.RoPEError, match=f"q_nope has {widths[0]} channels a head but "
                       f"k_nope {widths[1]}"):
        small_append(**{other: None})


# ---------------------------------------------------------------------------- the signatures


def test_signatures_are_flashinfers():
    """Names, order and defaults as FlashInfer's ``flashinfer/rope.py`` (0.6.17; 0.6.18 adds
    ``backend`` to rope_quantize_fp8)."""
    quant = ["q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids", "is_neox=True",
             "quantize_dtype=None", "quant_scale_q=1.0", "quant_scale_kv=1.0", "q_rope_out=None",
             "k_rope_out=None", "q_nope_out=None", "k_nope_out=None", "enable_pdl=False"]
    append = ["q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids",
              "paged_kv_cache", "kv_indices", "kv_indptr", "batch_indices", "positions",
              "is_neox=True", "quantize_dtype=None", "quant_scale_q=1.0", "quant_scale_kv=1.0",
              "page_size=16", "kv_layout='NHD'", "q_rope_out=None", "q_nope_out=None",
              "enable_pdl=False"]

    def form(function):
        return [p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                for p in inspect.signature(function).parameters.values()]

    assert form(rope_quantize_fp8) == quant + ["backend='cuda'"]
    assert form(mla_rope_quantize_fp8) == quant
    assert form(rope_quantize_fp8_append_paged_kv_cache) == append
    assert set(fi.__all__) >= {"rope_quantize_fp8", "mla_rope_quantize_fp8",
                               "rope_quantize_fp8_append_paged_kv_cache"}


def _door_with_outputs(door: str, q_rope_out, q_nope_out):
    """``door``'s call (small shapes) with q's outputs given, and what it writes into caches."""
    fp8 = dict(dtype=torch.float8_e4m3fn)
    if door == "gqa_append":
        args = small("gqa")
        args.update(v=torch.randn(5, 2, 12, generator=torch.Generator().manual_seed(0)).bfloat16())
        args["q_rope"] = args["q_rope"].clone()  # q's parts apart: its outputs are copied into
        caches = tuple(torch.zeros(4, 4, 2, 12, **fp8) for _ in range(2))
    else:
        args = small("mla")
        caches = (torch.zeros(4, 4, 4, **fp8), torch.zeros(4, 4, 8, **fp8))
    if door == "rope_quantize_fp8":
        caches = (torch.zeros(5, 8, **fp8), torch.zeros(5, 4, **fp8))
        args.update(k_rope_out=caches[0], k_nope_out=caches[1])
        call = rope_quantize_fp8
    else:
        index = dict(dtype=torch.int32)
        args.update(v=args.get("v"), paged_kv_cache=caches,
                    kv_indices=torch.tensor([2, 0, 1, 3], **index),
                    kv_indptr=torch.tensor([0, 2, 4], **index),
                    batch_indices=torch.tensor([0, 0, 1, 1, -1], **index),
                    positions=torch.tensor([0, 5, 2, 3, 0], **index), page_size=4)
        call = rope_quantize_fp8_append_paged_kv_cache
    args.update(q_rope_out=q_rope_out, q_nope_out=q_nope_out)
    return (lambda: call(**args)), caches


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "mla_append", "gqa_append"])
def test_q_outputs_that_share_memory_are_refused_before_any_write(door):
    """q_nope_out is written apart from the core's call (quantized beside it, or copied after
    it): one sharing memory with q_rope_out overwrote q's rotated part silently. It is refused
    by name before anything is written; disjoint slices of one buffer (how an engine lays q out)
    give what separate outputs give."""
    buf = torch.zeros(5, 4, 12, dtype=torch.float8_e4m3fn)
    run, caches = _door_with_outputs(door, buf[..., :8], buf[..., 4:8])
    with pytest.raises(rd.RoPEError, match="^q_nope_out shares memory with q_rope_out"):
        run()
    assert not buf.view(torch.uint8).any(), "q written before the refusal"
    assert not any(c.view(torch.uint8).any() for c in caches), "written before the refusal"
    with torch.no_grad():
        run, caches = _door_with_outputs(door, buf[..., 4:], buf[..., :4])
        run()
        apart = tuple(torch.zeros(5, 4, n, dtype=torch.float8_e4m3fn) for n in (8, 4))
        run_apart, caches_apart = _door_with_outputs(door, *apart)
        run_apart()
    assert torch.equal(buf[..., 4:].view(torch.uint8), apart[0].view(torch.uint8))
    assert torch.equal(buf[..., :4].view(torch.uint8), apart[1].view(torch.uint8))
    assert buf.view(torch.uint8).any()
    for c, c_apart in zip(caches, caches_apart):
        assert torch.equal(c.view(torch.uint8), c_apart.view(torch.uint8))


def test_joined_parts_are_views_when_adjacent():
    """Slices of one tensor are joined without a copy; tensors of their own by a copy."""
    whole = torch.randn(5, 4, 24)
    joined = fi._joined("q", whole[..., :8], whole[..., 8:])
    assert joined.data_ptr() == whole.data_ptr() and joined.stride() == whole.stride()
    assert torch.equal(joined, whole)
    apart = fi._joined("q", whole[..., :8].clone(), whole[..., 8:].clone())
    assert apart.data_ptr() != whole.data_ptr() and torch.equal(apart, whole)
    assert fi._joined("q_out", whole[..., :8].clone(), whole[..., 8:], copy=False) is None
    assert fi._joined("q", whole[..., 8:], whole[..., :8]) is not None  # wrong order: a copy


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_dual_tensors_of_forward_mode_ad_get_the_quantized_tangents(attention):
    """With a forward-mode AD level open (``torch.autograd.forward_ad``) every output carries
    its input's tangent as the door maps the value: rotated (rope parts) and quantized. The
    nope part's quantization was torch's division with ``out=``, which refuses a dual tensor
    (a NotImplementedError naming ``div_out``; on a GPU the quantizing launch dropped it)."""
    import torch.autograd.forward_ad as fwad

    gen = torch.Generator().manual_seed(21)
    args = small(attention)
    names = ("q_rope", "k_rope", "q_nope", "k_nope")
    tangents = {n: torch.randn(args[n].shape, generator=gen).to(args[n].dtype) for n in names}
    scale_q, scale_kv = 0.75, 1.5
    with fwad.dual_level():
        duals = {n: fwad.make_dual(args[n], tangents[n]) for n in names}
        got = rope_quantize_fp8(**{**args, **duals}, quant_scale_q=scale_q,
                                quant_scale_kv=scale_kv)
        got = [fwad.unpack_dual(g) for g in got]
    cache, pos_ids, fp8 = args["cos_sin_cache"], args["pos_ids"], torch.float8_e4m3fn
    want = [(rotated64(args[n], cache, pos_ids, True), rotated64(tangents[n], cache, pos_ids, True))
            for n in names[:2]]
    want += [(plain64(args[n]), plain64(tangents[n])) for n in names[2:]]
    for name, (value, tangent), (value64, tangent64), scale in zip(
            ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), got, want,
            (scale_q, scale_kv, scale_q, scale_kv)):
        assert_fp8(value, *value64, scale, fp8, name)
        assert tangent is not None, f"{name}: no tangent"
        assert_fp8(tangent, *tangent64, scale, fp8, f"{name}'s tangent")


# ---------------------------------------------------------------------------- bad input


def small(attention="gqa"):
    gen = torch.Generator().manual_seed(5)
    q_rope, q_nope, k_rope, k_nope = parts(attention, 4, 1 if attention == "mla" else 2, 8, 4, 5,
                                           torch.bfloat16, gen, apart=False)
    return dict(q_rope=q_rope, k_rope=k_rope, q_nope=q_nope, k_nope=k_nope,
                cos_sin_cache=engine_cache(8, gen), pos_ids=torch.arange(5))


def small_append(attention="gqa", dtype=torch.float8_e4m3fn, **changes):
    args = small(attention)
    if attention == "mla":
        args.update(v=None, paged_kv_cache=(torch.zeros(4, 4, 4, dtype=dtype),
                                            torch.zeros(4, 4, 8, dtype=dtype)))
    else:
        args.update(v=torch.zeros(5, 2, 12, dtype=torch.bfloat16),
                    paged_kv_cache=(torch.zeros(4, 4, 2, 12, dtype=dtype),
                                    torch.zeros(4, 4, 2, 12, dtype=dtype)))
    index = dict(dtype=torch.int32)
    args.update(kv_indices=torch.tensor([2, 0, 1, 3], **index),
                kv_indptr=torch.tensor([0, 2, 4], **index),
                batch_indices=torch.tensor([0, 0, 1, 1, -1], **index),
                positions=torch.tensor([0, 5, 2, 3, 0], **index), page_size=4)
    args.update(changes)
    return rope_quantize_fp8_append_paged_kv_cache(**args)


def quant(**changes):
    args = small("mla" if changes.pop("mla", False) else "gqa")
    args.update(changes)
    return rope_quantize_fp8(**args)


BAD = [
    (lambda: quant(q_rope=torch.zeros(5, 8, dtype=torch.bfloat16)),
     r"q_rope must be a tensor \[nnz, num_qo_heads, rope_dim\], got \(5, 8\) bfloat16"),
    (lambda: quant(k_rope=torch.zeros(5, 2, 16, dtype=torch.bfloat16)),
     r"k_rope must be .* with q_rope's nnz 5 and rope_dim 8, got \(5, 2, 16\)"),
    (lambda: quant(k_rope=[1, 2]), "k_rope must be a tensor .* got list"),
    (lambda: quant(q_nope=torch.zeros(5, 3, 4, dtype=torch.bfloat16)),
     r"q_nope must be None or a tensor \[nnz, heads, no_rope_dim\] with the rope part's leading "
     r"dims \(5, 4\), got \(5, 3, 4\)"),
    # q_nope is quantized beside the core's call: of another dtype it was taken as numbers
    # (int, bool) or failed after the cache was written (FP8: torch's promotion)
    (lambda: quant(q_nope=torch.zeros(5, 4, 4, dtype=torch.int64)),
     r"q_nope must have q_rope's dtype and device \(bfloat16 on cpu\), got \(5, 4, 4\) int64"),
    (lambda: small_append("mla", q_nope=torch.zeros(5, 4, 4, dtype=torch.float8_e4m3fn)),
     r"q_nope must have q_rope's dtype and device \(bfloat16 on cpu\), got .* float8_e4m3fn"),
    (lambda: quant(mla=True, k_nope=torch.zeros(5, 4, dtype=torch.float16)),
     r"k_nope must have k_rope's dtype and device \(bfloat16 on cpu\), got \(5, 4\) float16"),
    (lambda: quant(mla=True, k_nope=torch.zeros(5, 1, 4, dtype=torch.bfloat16)),
     r"k_nope must be None or a tensor \[nnz, no_rope_dim\] .* \(5,\), got \(5, 1, 4\)"),
    (lambda: quant(cos_sin_cache=torch.zeros(64, 16)),
     r"cos_sin_cache must be \[max_pos, rope_dim\] with rope_dim = q_rope.shape\[-1\] = 8, "
     r"got \(64, 16\)"),
    (lambda: quant(cos_sin_cache=torch.zeros(64, 8, dtype=torch.float16)),
     "cos_sin_cache must be a float32 tensor"),
    (lambda: quant(quantize_dtype=torch.bfloat16),
     "quantize_dtype must be torch.float8_e4m3fn, torch.float8_e5m2 or None, got torch.bfloat16"),
    (lambda: quant(q_rope_out=torch.zeros(5, 4, 8, dtype=torch.bfloat16)),
     "q_rope_out must be float8_e4m3fn or float8_e5m2 .*, got bfloat16"),
    (lambda: quant(k_rope_out=torch.zeros(5, 2, 4, dtype=torch.float8_e4m3fn)),
     r"k_rope_out must be None or a tensor \(5, 2, 8\) float8_e4m3fn on cpu .* got \(5, 2, 4\)"),
    (lambda: quant(quantize_dtype=torch.float8_e5m2,
                   q_nope_out=torch.zeros(5, 4, 4, dtype=torch.float8_e4m3fn)),
     r"q_nope_out must be None or a tensor \(5, 4, 4\) float8_e5m2"),
    # an output of one element broadcast: q_nope_out's (and the apart outputs' copies) failed
    # in torch after the caches were written
    (lambda: quant(q_nope_out=torch.zeros(1, 1, 4, dtype=torch.float8_e4m3fn).expand(5, 4, 4)),
     r"^q_nope_out is an expanded tensor \(a dim of stride 0\); it cannot be written$"),
    (lambda: small_append(
        q_rope_out=torch.zeros(1, 4, 8, dtype=torch.float8_e4m3fn).expand(5, 4, 8)),
     r"^q_rope_out is an expanded tensor"),
    (lambda: small_append(
        "mla", q_nope_out=torch.zeros(5, 1, 4, dtype=torch.float8_e4m3fn).expand(5, 4, 4)),
     r"^q_nope_out is an expanded tensor"),
    # written beside the core's call, whose no-backward check never sees it: torch's division
    # into it failed after the caches were written
    (lambda: quant(q_nope_out=torch.zeros(5, 4, 4, dtype=torch.float8_e4m3fn,
                                          requires_grad=True)),
     r"^q_nope_out requires grad, but the FP8 prologue writes it and has no backward"),
    (lambda: small_append("mla", q_nope_out=torch.zeros(5, 4, 4, dtype=torch.float8_e4m3fn,
                                                        requires_grad=True)),
     r"^q_nope_out requires grad"),
    (lambda: quant(quant_scale_q=0.0), r"quant_scale_q must be a positive finite number .* got 0.0"),
    (lambda: quant(quant_scale_kv=float("inf")), "quant_scale_kv must be a positive finite number"),
    (lambda: quant(quant_scale_kv="2"), "quant_scale_kv must be a positive finite number .* got '2'"),
    (lambda: quant(is_neox=1), "is_neox must be a bool, got 1"),
    (lambda: quant(enable_pdl=None), "enable_pdl must be a bool, got None"),
    (lambda: quant(backend="cuitle"), "backend must be 'cuda' or 'cutile'"),
    (lambda: quant(pos_ids=torch.arange(5) + MAX_POS - 2),
     r"positions must lie in \[0, 512\).* got values from 510 to 514 .*positions=pos_ids"),
    (lambda: quant(pos_ids=torch.arange(6)),
     r"positions must have shape \[T\] = \[5\].*positions=pos_ids"),
    (lambda: small_append(v=None), "v must be a tensor .* for GQA/MHA"),
    (lambda: small_append("mla", v=torch.zeros(5, 1, 12)),
     r"v must be None for MLA .* got \(5, 1, 12\)"),
    (lambda: small_append(dtype=torch.float8_e5m2),
     "paged_kv_cache holds float8_e5m2 and float8_e5m2 but quantize_dtype is float8_e4m3fn"),
    (lambda: small_append(paged_kv_cache=torch.zeros(4, 2, 4, 2, 12, dtype=torch.float8_e4m3fn)),
     r"paged_kv_cache must be \(k_cache, v_cache\), 4-D each"),
    (lambda: small_append("mla", paged_kv_cache=(torch.zeros(4, 4, 1, 4, dtype=torch.float8_e4m3fn),
                                                 torch.zeros(4, 4, 1, 8, dtype=torch.float8_e4m3fn))),
     r"paged_kv_cache must be \(ckv_cache, kpe_cache\), \[max_pages, page_size, dim\] each"),
    (lambda: small_append("mla", paged_kv_cache=(torch.zeros(4, 4, 8, dtype=torch.float8_e4m3fn),
                                                 torch.zeros(4, 4, 4, dtype=torch.float8_e4m3fn))),
     r"holds .* head dim .* v_cache=ckv_cache"),
    (lambda: small_append(kv_layout="nhd"), "kv_layout must be 'NHD' or 'HND', got 'nhd'"),
    (lambda: small_append("mla", kv_layout="HDN"), "kv_layout must be 'NHD' or 'HND', got 'HDN'"),
    (lambda: small_append(page_size=16),
     r"page_size=16 but the NHD cache \(4, 4, 2, 12\) has pages of 4"),
    (lambda: small_append(positions=torch.tensor([0, 8, 2, 3, 0], dtype=torch.int32)),
     r"FlashInferPagedKVCache.positions\[1\]=8 but request 0 owns 2 pages of 4"),
    (lambda: small_append(batch_indices=torch.tensor([0, 0, 2, 1, -1], dtype=torch.int32)),
     r"batch_indices\[2\]=2 but kv_indptr describes 2 requests"),
    (lambda: small_append(v=torch.zeros(5, 2, 12, dtype=torch.float16)), r"v must be .*v=v"),
    (lambda: small_append(q_rope_out=torch.zeros(5, 4, 8, dtype=torch.float8_e5m2)),
     "paged_kv_cache holds float8_e4m3fn and float8_e4m3fn but quantize_dtype is float8_e5m2"),
    # q_rope's dtype makes the spec's: refused under q_rope's name, not the spec field's
    (lambda: quant(q_rope=torch.zeros(5, 4, 8, dtype=torch.float64),
                   k_rope=torch.zeros(5, 2, 8, dtype=torch.float64)),
     "^q_rope must be float32, float16 or bfloat16, got float64$"),
    (lambda: small_append("mla", q_rope=torch.zeros(5, 4, 8, dtype=torch.float64),
                          k_rope=torch.zeros(5, 8, dtype=torch.float64)),
     "^q_rope must be float32, float16 or bfloat16, got float64$"),
]


@pytest.mark.parametrize("make,message", BAD, ids=range(len(BAD)))
def test_bad_input_names_the_argument(make, message):
    with pytest.raises(rd.RoPEError, match=message):
        make()


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "mla_append"])
@pytest.mark.parametrize("part", ["q_nope", "k_nope"])
def test_a_nope_part_that_requires_grad_is_refused_before_anything_is_written(door, part):
    """The doors have no backward: a nope part that requires grad (grad mode on) is refused by
    name, as the rope parts are, before any output or cache is written. q_nope is quantized
    beside the core's call, whose checks never see it: it used to fail in torch's division
    (out= takes no gradient) after the cache had been written."""
    args = small("mla")
    args[part] = args[part].clone().requires_grad_()
    if door == "mla_append":
        caches = (torch.zeros(4, 4, 4, dtype=torch.float8_e4m3fn),
                  torch.zeros(4, 4, 8, dtype=torch.float8_e4m3fn))
        index = dict(dtype=torch.int32)
        args.update(v=None, paged_kv_cache=caches, kv_indices=torch.tensor([2, 0, 1, 3], **index),
                    kv_indptr=torch.tensor([0, 2, 4], **index),
                    batch_indices=torch.tensor([0, 0, 1, 1, -1], **index),
                    positions=torch.tensor([0, 5, 2, 3, 0], **index), page_size=4)
        written = caches
        call = rope_quantize_fp8_append_paged_kv_cache
    else:
        written = (torch.zeros(5, 8, dtype=torch.float8_e4m3fn),
                   torch.zeros(5, 4, dtype=torch.float8_e4m3fn))
        args.update(k_rope_out=written[0], k_nope_out=written[1])
        call = rope_quantize_fp8
    with pytest.raises(rd.RoPEError, match=f"^{part} requires grad, .* no backward"):
        call(**args)
    for x in written:
        assert not x.view(torch.uint8).any(), "written before the refusal"
    with torch.no_grad():
        call(**args)
    assert any(x.view(torch.uint8).any() for x in written)


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "mla_append", "gqa_append"])
def test_an_inference_q_nope_out_outside_inference_mode_is_refused_before_any_write(door):
    """An output made under inference mode cannot be written outside it (torch forbids it, and
    so does its dispatcher for FlashInfer's own ops): q_nope_out, which the doors write beside
    the core's call, is refused by name before any cache is written (it failed in torch's
    division after k and v were in the cache); under inference mode it is served."""
    with torch.inference_mode():
        out = torch.zeros(5, 4, 4, dtype=torch.float8_e4m3fn)
    run, caches = _door_with_outputs(door, None, out)
    with pytest.raises(rd.RoPEError, match="^q_nope_out is an inference tensor and inference "
                                           "mode is off"):
        run()
    assert not any(c.view(torch.uint8).any() for c in caches), "written before the refusal"
    with torch.inference_mode():
        run()
    assert all(c.view(torch.uint8).any() for c in caches)


def test_the_paged_door_keeps_one_descriptor_for_the_same_tensors():
    """A serving step calls the door once per layer with the same index buffers: the descriptor
    (checked, its plan parts worked out) is made once for the same tensors and settings, and
    anew when any of them differs."""
    from rope_dispatch.compat import flashinfer as doors

    gen = torch.Generator().manual_seed(11)
    fp8 = torch.float8_e4m3fn
    q, k, v = (torch.randn(3, h, 16, generator=gen).bfloat16() for h in (4, 2, 2))
    cos_sin = torch.rand(32, 16, generator=gen)
    pages = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(2)]
    index = (torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32),
             torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32))
    made = []
    real = doors.FlashInferPagedKVCache
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(doors, "FlashInferPagedKVCache",
                      lambda *a, **k: made.append(1) or real(*a, **k))
        for scale in (2.0, 2.0, 4.0):
            doors.rope_quantize_fp8_append_paged_kv_cache(
                q, k, None, None, v, cos_sin, torch.tensor([1, 2, 3]), tuple(pages), *index,
                quant_scale_kv=scale, page_size=4)
        assert len(made) == 2  # the second call reused the first's; another scale, another
        other = torch.zeros(4, 4, 2, 16, dtype=fp8)
        doors.rope_quantize_fp8_append_paged_kv_cache(
            q, k, None, None, v, cos_sin, torch.tensor([1, 2, 3]), (other, pages[1]), *index,
            quant_scale_kv=4.0, page_size=4)
        assert len(made) == 3
    assert other.view(torch.uint8).any(), "the new cache was written"


def test_the_mla_door_keeps_one_descriptor_and_writes_each_cache_given():
    """MLA's ``(ckv_cache, kpe_cache)``: one descriptor for the same tensors, call after call;
    other caches get their own, and each call writes the caches it was given."""
    from rope_dispatch.compat import flashinfer as doors

    gen = torch.Generator().manual_seed(12)
    fp8 = torch.float8_e4m3fn
    q_rope, k_rope, q_nope, k_nope = (torch.randn(*shape, generator=gen).bfloat16()
                                      for shape in ((3, 4, 16), (3, 16), (3, 4, 24), (3, 24)))
    cos_sin = torch.rand(32, 16, generator=gen)
    index = tuple(torch.tensor(x, dtype=torch.int32)
                  for x in ([0, 1, 2, 3], [0, 2, 4], [0, 0, 1], [0, 1, 5]))
    made, real = [], doors.FlashInferPagedKVCache
    layers = [(torch.zeros(4, 4, 24, dtype=fp8), torch.zeros(4, 4, 16, dtype=fp8))
              for _ in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(doors, "FlashInferPagedKVCache",
                      lambda *a, **k: made.append(1) or real(*a, **k))
        for caches in (layers[0], layers[0], layers[1]):
            doors.rope_quantize_fp8_append_paged_kv_cache(
                q_rope, k_rope, q_nope, k_nope, None, cos_sin, torch.tensor([1, 2, 3]), caches,
                *index, page_size=4)
    assert len(made) == 2
    for ckv, kpe in layers:  # token 0 at page 0 entry 0: its compressed kv as it is, in FP8
        assert torch.equal(ckv[0, 0].view(torch.uint8), k_nope[0].to(fp8).view(torch.uint8))
        assert kpe[0, 0].view(torch.uint8).any()


CORE_ERRORS = [
    (lambda: quant(pos_ids=torch.arange(6)), "rope_quantize_fp8",
     "q=q_rope, k=k_rope, v=k_nope, freqs=cos_sin_cache, positions=pos_ids, a FlatKVCache of "
     "k_cache=k_rope_out, v_cache=k_nope_out, q_out=q_rope_out"),
    (lambda: small_append("mla", pos_ids=torch.arange(6)), "rope_quantize_fp8_append_paged_kv_cache",
     "q=q_rope, k=k_rope, v=k_nope, freqs=cos_sin_cache, positions=pos_ids, a "
     "FlashInferPagedKVCache of k_cache=kpe_cache, v_cache=ckv_cache, positions=positions, "
     "q_out=q_rope_out"),
    (lambda: small_append(pos_ids=torch.arange(6)), "rope_quantize_fp8_append_paged_kv_cache",
     "q=q_rope joined with q_nope, k=k_rope joined with k_nope, v=v, freqs=cos_sin_cache, "
     "positions=pos_ids, a FlashInferPagedKVCache of paged_kv_cache, positions=positions, "
     "q_out=q_rope_out joined with q_nope_out"),
]


@pytest.mark.parametrize("make,door,mapping", CORE_ERRORS, ids=["flat", "paged-mla", "paged"])
def test_core_errors_say_how_the_door_mapped_its_arguments(make, door, mapping):
    """The core's error comes back as its own type, raised from it, its message followed by the
    door's mapping."""
    with pytest.raises(rd.RoPEError) as info:
        make()
    cause = info.value.__cause__
    assert isinstance(cause, rd.RoPEError) and type(info.value) is type(cause)
    assert str(info.value) == f"{cause} ({door} calls rope_dispatch.rope_to_cache with {mapping})"


def _like_flashinfer_allocates(rope, dtype):
    """A None nope part's output as FlashInfer allocates it: ``empty_like`` of a part of the
    rope part's leading dims and no channels."""
    return torch.empty_like(rope.new_empty((*rope.shape[:-1], 0)), dtype=dtype)


def _same_tensor_form(got, want, what):
    for name in ("shape", "dtype", "device", "requires_grad", "layout"):
        assert getattr(got, name) == getattr(want, name), (what, name)
    assert type(got) is type(want), what
    assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset(), what
    assert got.is_inference() == want.is_inference(), what


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("nnz", [0, 5])
@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("door", ["quant", "append"])
def test_none_nope_parts_give_new_outputs_of_no_channels(door, attention, nnz, inference):
    """None nope parts: the nope outputs returned are new tensors of the rope part's leading dims
    and no channels, as FlashInfer allocates them, a new one each call; a given one is
    returned itself, and one of another shape refused naming the shape it must have."""
    mode = torch.inference_mode() if inference else torch.inference_mode(False)
    fp8 = torch.float8_e5m2

    def call(**changes):
        changes = dict(q_nope=None, k_nope=None, quantize_dtype=fp8, **changes)
        if door == "quant":
            args = small(attention)
            args.update(changes)
            args.update({n: args[n][:nnz] for n in ("q_rope", "k_rope", "pos_ids")})
            return rope_quantize_fp8(**args)
        cut = dict(batch_indices=torch.tensor([0, 0, 1, 1, -1], dtype=torch.int32)[:nnz],
                   positions=torch.tensor([0, 5, 2, 3, 0], dtype=torch.int32)[:nnz])
        args = small(attention)
        cut.update({n: args[n][:nnz] for n in ("q_rope", "k_rope", "pos_ids")})
        if attention == "gqa":
            cut["v"] = torch.zeros(nnz, 2, 8, dtype=torch.bfloat16)
            cut["paged_kv_cache"] = tuple(torch.zeros(4, 4, 2, 8, dtype=fp8) for _ in range(2))
        else:
            cut["paged_kv_cache"] = (torch.zeros(4, 4, 0, dtype=fp8), torch.zeros(4, 4, 8, dtype=fp8))
        return small_append(attention, dtype=fp8, **cut, **changes)

    with mode:
        q_rope = small(attention)["q_rope"][:nnz]
        k_rope = small(attention)["k_rope"][:nnz]
        first, second = call(), call()
        if door == "quant":
            nope_outs = [(first[2], second[2], q_rope), (first[3], second[3], k_rope)]
        else:
            nope_outs = [(first[1], second[1], q_rope)]
        for got, again, rope in nope_outs:
            _same_tensor_form(got, _like_flashinfer_allocates(rope, fp8), (door, attention))
            assert got is not again
        given = torch.empty(nnz, 4, 0, dtype=fp8)
        assert call(q_nope_out=given)[2 if door == "quant" else 1] is given
        with pytest.raises(rd.RoPEError) as info:
            call(q_nope_out=torch.empty(nnz, 4, 1, dtype=fp8))
    assert str(info.value) == (
        f"q_nope_out must be None or a tensor ({nnz}, 4, 0) float8_e5m2 on cpu (its input's shape "
        f"and device, quantize_dtype), got ({nnz}, 4, 1) float8_e5m2 on cpu")


def test_scales_and_cache_pairs_of_other_types():
    """Float scales and a tuple of caches are the common case; other types are taken as they
    were: int, Fraction and NumPy scales are numbers like a float, bools, NaN, negatives and
    non-numbers refused (a TypeError for a non-number); a list of two caches is a pair."""
    from fractions import Fraction

    import numpy as np

    for scale, same in ((2, 2.0), (Fraction(1, 2), 0.5), (np.float64(4.0), 4.0), (np.float32(8), 8.0)):
        got = quant(quant_scale_q=scale, quant_scale_kv=scale)
        want = quant(quant_scale_q=same, quant_scale_kv=same)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), scale
    for scale, error in ((True, rd.RoPEError), (float("nan"), rd.RoPEError), (-1.0, rd.RoPEError),
                         (-2, rd.RoPEError), (None, rd.RoPETypeError), (2j, rd.RoPETypeError)):
        with pytest.raises(error) as info:
            quant(quant_scale_q=scale)
        assert str(info.value) == (
            f"quant_scale_q must be a positive finite number (the FP8 value is x * quant_scale_q), "
            f"got {scale!r}")
        assert type(info.value) is error
    with pytest.raises(rd.RoPEError, match=r"quant_scale_kv must be .* got True"):
        small_append(quant_scale_kv=True)
    for attention in ("gqa", "mla"):
        pairs = []
        for kind in (tuple, list):
            caches = small_append_caches(attention)
            q_out = small_append(attention, paged_kv_cache=kind(caches))
            pairs.append((q_out, caches))
        (q1, c1), (q2, c2) = pairs
        for a, b in zip((*q1, *c1), (*q2, *c2)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), attention
        assert c1[0].view(torch.uint8).any() or c1[1].view(torch.uint8).any()


def small_append_caches(attention):
    fp8 = dict(dtype=torch.float8_e4m3fn)
    if attention == "mla":
        return (torch.zeros(4, 4, 4, **fp8), torch.zeros(4, 4, 8, **fp8))
    return (torch.zeros(4, 4, 2, 12, **fp8), torch.zeros(4, 4, 2, 12, **fp8))


def test_parity_plugin_paging_helpers_follow_flashinfers_definition():
    """scripts/flashinfer_parity.py (FlashInfer's own tests against our doors on the GPU
    machine) builds their inputs with its own ``get_seq_lens`` and
    ``get_batch_indices_positions``: FlashInfer's documented example, and a padded batch whose
    entries past the appended tokens get request -1 and keep their positions."""
    plugin = parity_plugin()
    indptr = torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32)
    batch, positions = plugin.get_batch_indices_positions(indptr, torch.tensor([5, 5, 5, 5]), 10)
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert positions.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    kept_batch = torch.zeros(12, dtype=torch.int32)
    kept_positions = torch.full((12,), 7, dtype=torch.int32)
    plugin.get_batch_indices_positions(indptr, torch.tensor([5, 5, 5, 5]), 12, kept_batch,
                                       kept_positions)
    assert kept_batch.tolist() == batch.tolist() + [-1, -1]
    assert kept_positions.tolist() == positions.tolist() + [7, 7]
    # pages of 4: 3 pages with 2 in the last, no pages, 1 page with 4 in it
    seq_lens = plugin.get_seq_lens(torch.tensor([0, 3, 3, 4]), torch.tensor([2, 0, 4]), 4)
    assert seq_lens.tolist() == [10, 0, 4]


def parity_plugin():
    """scripts/flashinfer_parity.py, loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "flashinfer_parity.py"
    spec = importlib.util.spec_from_file_location("flashinfer_parity", path)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return plugin


def test_parity_plugin_stands_our_doors_in_and_says_there_is_no_cutile(monkeypatch):
    """The plugin's ``flashinfer`` serves our doors, and its ``flashinfer.cutile`` answers the
    file's availability check with False, so the file's cuTile cases skip (they failed on the
    import before)."""
    import sys

    names = ("flashinfer", "flashinfer.rope", "flashinfer.cutile",
             "flashinfer.cutile.cutile_common")
    for name in names:  # put back as they were after the test
        monkeypatch.setitem(sys.modules, name, None)
    parity_plugin().pytest_configure(None)
    from flashinfer.cutile.cutile_common import is_cuda_tile_available
    from flashinfer.rope import rope_quantize_fp8_append_paged_kv_cache

    assert is_cuda_tile_available() is False
    assert rope_quantize_fp8_append_paged_kv_cache is fi.rope_quantize_fp8_append_paged_kv_cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; runs on the GPU "
                    "machine (scripts/device_check.sh)")
def test_the_mla_door_replays_in_a_cuda_graph_and_after_it():
    """FlashInfer's MLA append captured in a CUDA graph while the door holds no q_nope divisor:
    the replay, and an eager call after it, write what a call outside any graph writes (a
    divisor made during capture is filled only by the graph's replay, so the door keeps
    none)."""
    from rope_dispatch.compat import flashinfer as doors

    gen = torch.Generator().manual_seed(13)
    fp8, dev = torch.float8_e4m3fn, "cuda"
    q_rope = torch.randn(5, 16, 64, generator=gen).bfloat16().to(dev)
    q_nope = torch.randn(5, 16, 512, generator=gen).bfloat16().to(dev)
    k_rope = torch.randn(5, 64, generator=gen).bfloat16().to(dev)
    k_nope = torch.randn(5, 512, generator=gen).bfloat16().to(dev)
    cos_sin = torch.rand(64, 64, generator=gen).to(dev)
    index = [torch.tensor(x, dtype=torch.int32, device=dev)
             for x in ([0, 1, 2, 3], [0, 2, 4], [0, 0, 1, 1, -1], [0, 1, 2, 9, 0])]
    pos = torch.tensor([3, 1, 4, 1, 5], device=dev)

    def step(caches, outs):
        return doors.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, None, cos_sin, pos, caches, *index,
            quant_scale_q=0.37, quant_scale_kv=0.73, page_size=16, q_rope_out=outs[0],
            q_nope_out=outs[1])

    def fresh():
        return ((torch.zeros(4, 16, 512, dtype=fp8, device=dev),
                 torch.zeros(4, 16, 64, dtype=fp8, device=dev)),
                (torch.empty(5, 16, 64, dtype=fp8, device=dev),
                 torch.empty(5, 16, 512, dtype=fp8, device=dev)))

    step(*fresh())  # the first call's checks, outside the graph
    torch.cuda.synchronize()
    doors._DIVISORS.clear()  # q_nope's divisor is made under capture
    captured, graph = fresh(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*captured)
    graph.replay()
    after = fresh()
    step(*after)
    torch.cuda.synchronize()
    want = fresh()
    doors._DIVISORS.clear()
    step(*want)
    torch.cuda.synchronize()
    for got in (captured, after):
        for g, w in zip((*got[0], *got[1]), (*want[0], *want[1])):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; runs on the GPU "
                    "machine (scripts/device_check.sh)")
@pytest.mark.parametrize("quant_scale_q", [1.0, 0.37])
def test_the_mla_door_quantizes_q_nope_in_a_triton_launch_unless_another_backend_is_forced(
        monkeypatch, quant_scale_q):
    """On a GPU the MLA door stores q_nope (here a slice of q's projection, into a slice of one
    q output) by the Triton backend's quantizing copy, bound after its first call: the bytes
    torch's division stores, which serves where another backend is forced."""
    triton = rd.get_backend("triton")
    if not triton.available:
        pytest.skip(f"the triton backend is unavailable: {triton.availability}")
    served = []
    quantize = type(triton).quantize
    monkeypatch.setattr(type(triton), "quantize",
                        lambda self, x, out, scale: served.append(scale) or quantize(self, x, out,
                                                                                     scale))
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(7, 128, 576, generator=gen).bfloat16().cuda() * 8
    k = torch.randn(7, 576, generator=gen).bfloat16().cuda()
    cos_sin = engine_cache(64, gen).cuda()

    def door(backend):
        q_out = torch.zeros(7, 128, 576, dtype=torch.float8_e4m3fn, device="cuda")
        k_out = torch.zeros(7, 576, dtype=torch.float8_e4m3fn, device="cuda")
        with rd.use_backend(backend):
            mla_rope_quantize_fp8(
                q[..., 512:], k[..., 512:], q[..., :512], k[..., :512], cos_sin,
                torch.arange(7, device="cuda"), is_neox=False, quant_scale_q=quant_scale_q,
                q_rope_out=q_out[..., 512:], k_rope_out=k_out[..., 512:],
                q_nope_out=q_out[..., :512], k_nope_out=k_out[..., :512])
        return q_out.view(torch.uint8), k_out.view(torch.uint8)

    fused, again = door(None), door(None)  # the second by the launch bound at the first
    assert served == [1 / quant_scale_q] * 2
    eager = door("eager")
    assert served == [1 / quant_scale_q] * 2  # torch's division, not the Triton launch
    assert torch.equal(fused[0], again[0])
    assert torch.equal(fused[0][..., :512], eager[0][..., :512])
    assert torch.equal(fused[1][..., :512], eager[1][..., :512])
    assert fused[0][..., :512].any()


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "gqa_append"])
@pytest.mark.parametrize("name", ["q_rope_out", "q_nope_out"])
def test_an_output_that_overlaps_itself_is_refused_before_any_write(door, name):
    """An output whose places share elements (an as_strided view with overlapping rows: token
    i's head 1 is token i + 1's head 0) would take one value over another's: refused by name
    before anything is written (q_nope_out, quantized beside the core's call, was written so)."""
    channels = 8 if name == "q_rope_out" else 4
    out = torch.zeros(100, dtype=torch.float8_e4m3fn).as_strided((5, 4, channels),
                                                                 (channels, channels, 1))
    if door == "gqa_append":
        caches = (torch.zeros(4, 4, 2, 12, dtype=torch.float8_e4m3fn),
                  torch.zeros(4, 4, 2, 12, dtype=torch.float8_e4m3fn))
        call = functools.partial(small_append, paged_kv_cache=caches)
    else:
        caches = (torch.zeros(5, 2, 8, dtype=torch.float8_e4m3fn),
                  torch.zeros(5, 2, 4, dtype=torch.float8_e4m3fn))
        call = functools.partial(quant, k_rope_out=caches[0], k_nope_out=caches[1])
    with pytest.raises(rd.RoPEError, match=rf"^the FP8 prologue cannot write {name}: {name} "
                       rf"\(5, 4, {channels}\) with strides \({channels}, {channels}, 1\) "
                       "overlaps itself"):
        call(**{name: out})
    assert not any(x.view(torch.uint8).any() for x in (*caches, out)), "written before"
    call(**{name: torch.zeros(5, 4, channels, dtype=torch.float8_e4m3fn)})
    assert caches[0].view(torch.uint8).any()


def _compiled_door(door, q_rope_out, q_nope_out):
    """``door`` (:func:`_door_with_outputs`) compiled whole (``fullgraph=True``), on its own
    copies of the caches; ``(run, caches)``."""
    import torch._dynamo

    call, caches = _door_with_outputs(door, q_rope_out, q_nope_out)
    torch._dynamo.reset()
    return torch.compile(call, fullgraph=True, backend="aot_eager"), caches


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "mla_append", "gqa_append"])
@pytest.mark.parametrize("case", ["q_rope_out overlaps itself", "q_nope_out overlaps itself",
                                  "q outputs share memory"])
def test_compiled_doors_refuse_outputs_that_overlap(door, case):
    """Under ``torch.compile`` the door's tensors are fake while it traces, so its output checks
    (each output apart from itself, q_nope_out apart from what the call writes and reads) run
    in the graph on its real tensors, refused as in eager (they ran, and wrote over each
    other); outputs that are disjoint slices of one buffer (q_nope_out not contiguous: torch's
    ``out=`` division did not trace) give the eager call's bytes."""
    fp8 = dict(dtype=torch.float8_e4m3fn)
    with torch.no_grad():
        buf = torch.zeros(5, 4, 12, **fp8)
        run, caches = _compiled_door(door, buf[..., 4:], buf[..., :4])
        run()
        apart = tuple(torch.zeros(5, 4, n, **fp8) for n in (8, 4))
        eager, caches_eager = _door_with_outputs(door, *apart)
        eager()
        assert torch.equal(buf[..., 4:].view(torch.uint8), apart[0].view(torch.uint8))
        assert torch.equal(buf[..., :4].view(torch.uint8), apart[1].view(torch.uint8))
        assert buf.view(torch.uint8).any()
        for c, c_eager in zip(caches, caches_eager):
            assert torch.equal(c.view(torch.uint8), c_eager.view(torch.uint8))
        if case == "q outputs share memory":
            outs = (buf[..., :8], buf[..., 4:8])
            refusal = r"^q_nope_out shares memory with q_rope_out \(q_nope_out \(5, 4, 4\)"
        else:
            name, n = ("q_rope_out", 8) if case.startswith("q_rope") else ("q_nope_out", 4)
            bad = torch.zeros(100, **fp8).as_strided((5, 4, n), (n, n, 1))
            outs = (bad, apart[1]) if n == 8 else (apart[0], bad)
            refusal = (rf"^the FP8 prologue cannot write {name}: {name} \(5, 4, {n}\) with "
                       rf"strides \({n}, {n}, 1\) overlaps itself")
        run, _ = _compiled_door(door, *outs)
        with pytest.raises(rd.RoPEError, match=refusal):
            run()



def _refused_by_the_core(case):
    """A door's call (no q_nope: q's outputs not checked by the door's own in-graph op) that the
    core's cache checks refuse, its arguments made outside (a compiled call takes them)."""
    fp8 = dict(dtype=torch.float8_e4m3fn)
    if not case.startswith(("mla", "gqa")):
        args = small("gqa")
        args.update(q_nope=None, k_nope=None)
        if case == "k_rope_out overlaps itself":
            args.update(k_rope_out=torch.zeros(100, **fp8).as_strided((5, 2, 8), (8, 8, 1)))
        elif case == "k_rope_out inside q_rope_out":
            q_out = torch.zeros(5, 4, 8, **fp8)
            args.update(q_rope_out=q_out, k_rope_out=q_out[:, :2])
        else:
            args.update(q_rope_out=torch.zeros(200, **fp8).as_strided((5, 4, 8), (8, 8, 1)))
        return lambda: rope_quantize_fp8(**args)
    args = small(case[:3])
    index = dict(dtype=torch.int32)
    args.update(q_nope=None, kv_indices=torch.tensor([2, 0, 1, 3], **index),
                kv_indptr=torch.tensor([0, 2, 4], **index),
                batch_indices=torch.tensor([0, 0, 1, 1, -1], **index),
                positions=torch.tensor([0, 5, 2, 3, 0], **index), page_size=4)
    if case.startswith("mla"):
        memory = torch.zeros(256, **fp8)  # q_rope_out inside kpe_cache
        args.update(v=None, q_rope_out=memory[64:224].view(5, 4, 8),
                    paged_kv_cache=(torch.zeros(4, 4, 4, **fp8), memory[:128].view(4, 4, 8)))
    else:
        memory = torch.zeros(384, **fp8)  # the k and v caches overlap
        args.update(k_nope=None, v=torch.zeros(5, 2, 8, dtype=torch.bfloat16),
                    paged_kv_cache=(memory[:256].view(4, 4, 2, 8),
                                    memory[128:].view(4, 4, 2, 8)))
    return lambda: rope_quantize_fp8_append_paged_kv_cache(**args)


@pytest.mark.parametrize("case, name", [
    ("k_rope_out overlaps itself", "k_rope_out"), ("k_rope_out inside q_rope_out", "k_rope_out"),
    ("q_rope_out overlaps itself", "q_rope_out"),
    ("mla q_rope_out inside kpe_cache", "kpe_cache"), ("gqa caches overlap", "paged_kv_cache")])
def test_compiled_doors_word_the_cores_refusals_as_eager(case, name):
    """A compiled door's memory the core refuses in the graph (on its real tensors) was refused
    in the core's words (``FlatKVCache k_cache``, ``q_out``), not naming the door's argument as
    the eager door does (its own check, or the core's refusal with how it maps its arguments):
    the same message now."""
    import torch._dynamo

    call = _refused_by_the_core(case)
    with torch.no_grad():
        with pytest.raises(rd.RoPEError) as eager:
            call()
        torch._dynamo.reset()
        with pytest.raises(rd.RoPEError) as compiled:
            torch.compile(call, fullgraph=True, backend="aot_eager")()
    assert name in str(eager.value)
    assert str(compiled.value) == str(eager.value)
