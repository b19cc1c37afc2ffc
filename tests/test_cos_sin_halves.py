"""Rotate-half cos/sin caches on the Triton backend: a cache whose rows' second halves repeat
their first, bit for bit (``cat((angles, angles))``, as transformers' rotary embeddings build
them), is read by its first halves alone, from a flag the backend keeps on the device. Checked
here: which caches earn the flag; results against the float64 formula on the cache's own values
for every entry, with and without a gradient; that the kernels take the flag's branch; that
writes into cos or sin are seen (between calls, and between a forward and its backward); and
the calls that never look for a flag.

Without CUDA the kernels run on the CPU interpreter; the threshold of entries read from which
a call looks for its flag is lowered to 0 here so that small shapes exercise it.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import rope_dispatch as rd
from reference import assert_matches, reference_cache_rope, reference_positions
from rope_dispatch.backends import triton_tables, triton_tiles

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ROWS, D = 12, 16
SHIPPED_MIN_ROWS_READ = triton_tables.HALVES_MIN_ROWS_READ
gpu = pytest.mark.gpu

pytestmark = pytest.mark.usefixtures("triton_backend")


@pytest.fixture(autouse=True)
def every_call_looks(monkeypatch):
    """Calls of any size look for their cache's flag; no flag or first sight carries over."""
    monkeypatch.setattr(triton_tables, "HALVES_MIN_ROWS_READ", 0)
    monkeypatch.setattr(triton_tables, "_halves", weakref.WeakKeyDictionary())
    monkeypatch.setattr(triton_tables, "_halves_met", weakref.WeakSet())
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES", raising=False)


def halves_cache(
    rows: int = ROWS, d2: int = D, dtype=torch.bfloat16, seed: int = 3
) -> rd.CosSinCache:
    """cos and sin ``[rows, d2]`` of random angles laid out twice (``cat((a, a))``)."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, d2 // 2, generator=gen, dtype=torch.float64) * 40
    doubled = torch.cat((angles, angles), dim=-1)
    return rd.CosSinCache(doubled.cos().to(dtype).to(DEVICE), doubled.sin().to(dtype).to(DEVICE))


def flag_value(cache: rd.CosSinCache) -> int | None:
    """The flag the backend holds for ``cache`` after looking twice (a first sight gets none);
    ``None`` when it keeps none."""
    triton_tables.halves_flag(cache)
    flag = triton_tables.halves_flag(cache)
    return None if flag is None else int(flag.item())


def held_flags() -> list[int]:
    return [int(flag.item()) for flag in triton_tables._halves.values()]


def expected(t: torch.Tensor, cache: rd.CosSinCache, spec: rd.RoPESpec) -> torch.Tensor:
    rows = reference_positions(spec.layout, tuple(t.shape))
    return reference_cache_rope(t.cpu(), cache.cos, cache.sin, rows, spec.interleaved)


def grad_expected(t, cache, spec, grad_out) -> torch.Tensor:
    x = t.detach().cpu().double().requires_grad_(True)
    (grad,) = torch.autograd.grad(expected(x, cache, spec), x, grad_out.cpu().double())
    return grad


def inputs(layout: str, heads: int = 2, seed: int = 4, batch: int = 2) -> torch.Tensor:
    shape = (ROWS, batch, heads, D) if layout == "sbhd" else (batch, ROWS, heads, D)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEVICE)


# --- which caches earn the flag -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_caches_of_doubled_angles_earn_the_flag(dtype):
    assert flag_value(halves_cache(dtype=dtype)) == 1


@pytest.mark.parametrize("change", ["cos second half", "sin first half", "last row",
                                    "signed zero"])
def test_one_differing_bit_anywhere_clears_it(change):
    cache = halves_cache(rows=37)  # rows not a multiple of a program's
    cos, sin = cache.cos, cache.sin
    if change == "cos second half":
        cos[5, D // 2 + 3] += 0.125
    elif change == "sin first half":
        sin[20, 1] -= 0.125
    elif change == "last row":
        cos[36, D - 1] = -cos[36, D - 1]
    else:  # equal as numbers, not as bits: -0.0 * x differs from 0.0 * x in sign
        sin[7, 2], sin[7, D // 2 + 2] = 0.0, -0.0
    assert flag_value(cache) == 0


def test_the_kernels_take_the_flags_branch():
    """A flag forced on for a cache whose halves differ: the kernels then read each row's first
    halves for both, so they read the flag (and no second half). ``apply`` gets a strided q:
    small contiguous calls run the lean kernel, which reads whole rows."""
    cache = halves_cache()
    cache.cos[:, D // 2:] *= 0.5
    cache.sin[:, D // 2:] += 0.25
    assert flag_value(cache) == 0
    (flag,) = triton_tables._halves.values()
    flag.fill_(1)  # as if the check had passed at this version of the cache
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    q, k = inputs("bshd"), inputs("bshd", heads=1, seed=5)
    strided = inputs("bshd", heads=4)[:, :, ::2]
    forced = rd.apply(strided, cache, spec, backend="triton")
    q_forced, k_forced = rd.apply_qk(q, k, cache, spec, backend="triton")
    first = rd.CosSinCache(*(torch.cat((h[:, : D // 2],) * 2, -1) for h in (cache.cos, cache.sin)))
    assert_matches(forced, expected(strided, first, spec), torch.bfloat16, "apply")
    assert_matches(q_forced, expected(q, first, spec), torch.bfloat16, "q")
    assert_matches(k_forced, expected(k, first, spec), torch.bfloat16, "k")
    assert not torch.allclose(forced.cpu().double(), expected(strided, cache, spec), atol=0.05)


# --- results ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("entry", ["apply", "apply_", "qk", "qk_", "qkv"])
def test_results_are_the_formulas(layout, entry):
    """Each entry, three calls (the flag is made at the second), forward and backward."""
    cache = halves_cache()
    spec = rd.RoPESpec(layout=layout, dtype="bf16")
    x, k = inputs(layout), inputs(layout, heads=1, seed=6)
    grad_out = inputs(layout, seed=7)
    for _ in range(3):
        if entry == "qkv":
            qkv = torch.cat((x, k, k), dim=-2).reshape(*x.shape[:2], 1, 4 * D)
            leaf = qkv.clone().requires_grad_(True)
            q_out, k_out, v_out = rd.apply_qkv(leaf, cache, spec, (2 * D, D, D), backend="triton")
            assert_matches(q_out, expected(x, cache, spec), torch.bfloat16, "q")
            assert_matches(k_out, expected(k, cache, spec), torch.bfloat16, "k")
            assert torch.equal(v_out, k)
            (grad,) = torch.autograd.grad(q_out, leaf, grad_out)
            q_grad = grad[..., : 2 * D].reshape(x.shape)
            assert_matches(q_grad, grad_expected(x, cache, spec, grad_out), torch.bfloat16,
                           "q's gradient")
            continue
        leaf = x.clone().requires_grad_(True)
        source = leaf.clone() if entry.endswith("_") else leaf  # in place: not on a leaf
        if entry.startswith("qk"):
            run = rd.apply_qk_ if entry == "qk_" else rd.apply_qk
            out, k_out = run(source, k.clone(), cache, spec, backend="triton")
            assert_matches(k_out, expected(k, cache, spec), torch.bfloat16, "k")
        else:
            run = rd.apply_ if entry == "apply_" else rd.apply
            out = run(source, cache, spec, backend="triton")
        assert_matches(out, expected(x, cache, spec), torch.bfloat16, "forward")
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
        assert_matches(grad, grad_expected(x, cache, spec, grad_out), torch.bfloat16, "backward")
    assert held_flags() == [1]


@pytest.mark.parametrize("heads, head_dim, tile", [((4, 4), D, (1, 4)), ((3, 1), 256, (8, 4))])
def test_q_and_k_at_the_cache_row_tiles_of_model_shapes(monkeypatch, heads, head_dim, tile):
    """q and k at ``qk_cache_row_tile``'s tiles (one token x all heads for one head count, as
    if streamed; ``WIDE_HEAD_CACHE_TILE`` for heads of d 256), rows read whole at the first
    call and by halves from the second, forward and backward. One SM, so that these few tokens
    give every SM its programs at those tiles."""
    monkeypatch.setattr(triton_tiles, "RESIDENT_BYTES", 0)
    monkeypatch.setattr(triton_tiles, "sm_count", lambda device_index: 1)  # programs enough
    tiles = []
    choose = triton_tiles.choose_config
    monkeypatch.setattr(triton_tiles, "choose_config",
                        lambda *a, **kw: tiles.append(choose(*a, **kw)[:2]) or choose(*a, **kw))
    cache = halves_cache(d2=head_dim)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    gen = torch.Generator().manual_seed(9)
    q, k, grad_q = (torch.randn(2, ROWS, h, head_dim, generator=gen).bfloat16().to(DEVICE)
                    for h in (*heads, heads[0]))
    for _ in range(3):
        leaf = q.clone().requires_grad_(True)
        q_out, k_out = rd.apply_qk(leaf, k, cache, spec, backend="triton")
        assert_matches(q_out, expected(q, cache, spec), torch.bfloat16, "q")
        assert_matches(k_out, expected(k, cache, spec), torch.bfloat16, "k")
        (grad,) = torch.autograd.grad(q_out, leaf, grad_q)
        assert_matches(grad, grad_expected(q, cache, spec, grad_q), torch.bfloat16, "q's grad")
    assert held_flags() == [1]
    assert tiles and set(tiles) == {tile}


def test_per_token_rows_as_the_hugging_face_door_reads_them():
    """``[b, s]`` rows of a ``[b * s, d2]`` cache (a model's batched cos and sin), q and k."""
    cache = halves_cache(rows=2 * ROWS)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    q, k = inputs("bshd", heads=3), inputs("bshd", heads=1, seed=8)
    rows = torch.arange(2 * ROWS).view(2, ROWS).to(DEVICE)
    for _ in range(3):
        q_out, k_out = rd.apply_qk(q, k, cache, spec, positions=rows, backend="triton")
    assert held_flags() == [1]
    assert_matches(q_out, reference_cache_rope(q.cpu(), cache.cos, cache.sin, rows.cpu()),
                   torch.bfloat16, "q")
    assert_matches(k_out, reference_cache_rope(k.cpu(), cache.cos, cache.sin, rows.cpu()),
                   torch.bfloat16, "k")


# --- writes into cos or sin ------------------------------------------------------------------

@pytest.mark.parametrize("written", ["cos", "sin"])
def test_a_write_is_seen_by_the_next_call(written):
    cache = halves_cache()
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x, k = inputs("sbhd"), inputs("sbhd", heads=1, seed=9)
    for _ in range(2):
        rd.apply_qk(x, k, cache, spec, backend="triton")
    assert held_flags() == [1]
    target = getattr(cache, written)
    kept = target[4].clone()
    target[4, D - 2] += 0.5  # halves no longer equal
    q_out, _ = rd.apply_qk(x, k, cache, spec, backend="triton")
    assert held_flags() == [0]
    assert_matches(q_out, expected(x, cache, spec), torch.bfloat16, "after the write")
    target[4] = kept  # equal again: checked again, flagged again
    q_out, _ = rd.apply_qk(x, k, cache, spec, backend="triton")
    assert held_flags() == [1]
    assert_matches(q_out, expected(x, cache, spec), torch.bfloat16, "after the second write")


@pytest.mark.parametrize("replaced", ["cos", "sin"])
def test_new_memory_given_with_data_is_seen_by_the_next_call(replaced):
    """``cache.cos.data = ...`` moves no version counter; the flag is checked again for the
    new memory (it was kept, and the kernels read only the halves of rows that differ)."""
    cache = halves_cache()
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = inputs("sbhd")
    for _ in range(2):
        rd.apply(x, cache, spec, backend="triton")
    assert held_flags() == [1]
    other = getattr(halves_cache(seed=8), replaced).clone()
    other[:, D // 2:] = other[:, : D // 2].flip(-1)  # halves that differ
    getattr(cache, replaced).data = other
    out = rd.apply(x, cache, spec, backend="triton")
    assert held_flags() == [0]
    assert_matches(out, expected(x, cache, spec), torch.bfloat16, "after .data")


@pytest.mark.parametrize("entry", ["apply", "qk"])
def test_a_write_between_forward_and_backward_makes_the_backward_raise(entry):
    """The backward reads the cache again: after a write that breaks its halves (or any write)
    it raises rather than differentiate a rotation the forward never made; before, and after
    a write the next forward saw, its gradient is the reference's on the cache as written."""
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    x, k = inputs("bshd"), inputs("bshd", heads=1, seed=10)
    grad_out = inputs("bshd", seed=11)
    cache = halves_cache()
    for step in range(4):
        if step == 3:  # written before the forward: read by both passes
            cache.cos[4, D // 2] += 0.25
        leaf = x.clone().requires_grad_(True)
        if entry == "qk":
            out, _ = rd.apply_qk(leaf, k, cache, spec, backend="triton")
        else:
            out = rd.apply(leaf, cache, spec, backend="triton")
        if step == 2:
            cache.cos[3, D // 2] += 0.5
            with pytest.raises(rd.RoPEError, match="modified in place between the forward"):
                torch.autograd.grad(out, leaf, grad_out)
            continue
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
        assert_matches(grad, grad_expected(x, cache, spec, grad_out), torch.bfloat16,
                       f"step {step}")


# --- calls that read whole rows ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["interleaved", "thd", "inference", "switched off",
                                  "a cache per call", "below the threshold"])
def test_calls_that_never_look_for_a_flag(kind, monkeypatch):
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16", interleaved=kind == "interleaved")
    x = inputs("sbhd")
    cache = halves_cache()
    if kind == "thd":
        x = x.reshape(ROWS * 2, 2, D)
        cu_seqlens = torch.tensor([0, ROWS, 2 * ROWS], dtype=torch.int32, device=DEVICE)
        spec = rd.RoPESpec(layout="thd", dtype="bf16", cu_seqlens=cu_seqlens)
    if kind == "inference":
        with torch.inference_mode():
            cache = halves_cache()
    if kind == "switched off":
        monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
    if kind == "below the threshold":
        monkeypatch.setattr(triton_tables, "HALVES_MIN_ROWS_READ", ROWS * D + 1)
    # each cache kept alive: a freed cache's id, taken by the next, would have dispatch plan
    # that next call at once, and the plan looks for the flag a second time
    kept = []
    for _ in range(3):
        if kind == "a cache per call":
            cache = halves_cache()
            kept.append(cache)
        out = rd.apply(x, cache, spec, backend="triton")
    assert held_flags() == []
    if kind == "thd":
        rows = torch.arange(ROWS).repeat(2)
    else:
        rows = reference_positions("sbhd", tuple(x.shape))
    assert_matches(out, reference_cache_rope(x.cpu(), cache.cos, cache.sin, rows, spec.interleaved),
                   torch.bfloat16)


def test_the_shipped_threshold_takes_prefills_and_leaves_decode_alone(monkeypatch):
    """With the shipped threshold a call reading ``rows x d2`` entries at the threshold looks
    for the flag, a decode step (one row a sequence) does not."""
    monkeypatch.setattr(triton_tables, "HALVES_MIN_ROWS_READ", SHIPPED_MIN_ROWS_READ)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    rows = SHIPPED_MIN_ROWS_READ // D
    cache = halves_cache(rows=rows)
    step = torch.randn(4, 1, 1, D).bfloat16().to(DEVICE)
    for _ in range(3):
        rd.apply(step, cache, spec, start_positions=torch.tensor([0, 5, 9, 70]).to(DEVICE),
                 backend="triton")
    assert held_flags() == []
    prefill = torch.randn(1, rows, 1, D).bfloat16().to(DEVICE)
    for _ in range(2):
        out = rd.apply(prefill, cache, spec, backend="triton")
    assert held_flags() == [1]
    assert_matches(out, expected(prefill, cache, spec), torch.bfloat16)


# --- the GPU: planned calls and graph capture ---------------------------------------------------

def planned_pair() -> tuple[rd.CosSinCache, rd.RoPESpec, torch.Tensor, torch.Tensor]:
    """A q and k pair of model-like shapes on a cache of doubled angles, called until planned
    (from the second call on) with the flag held."""
    cache = halves_cache(rows=64, d2=128)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    q = torch.randn(2, 64, 4, 128, device="cuda").bfloat16()
    k = torch.randn(2, 64, 1, 128, device="cuda").bfloat16()
    for _ in range(4):
        rd.apply_qk(q, k, cache, spec, backend="triton")
    assert held_flags() == [1]
    return cache, spec, q, k


@gpu
def test_planned_calls_see_writes_into_the_cache():
    cache, spec, q, k = planned_pair()
    cache.sin[10, 100] += 1.0
    q_out, _ = rd.apply_qk(q, k, cache, spec, backend="triton")
    assert_matches(q_out, expected(q, cache, spec), q.dtype, "no grad")
    leaf = q.clone().requires_grad_(True)
    for call in range(3):
        if call == 2:  # after planned calls: the plan's forward and backward read the write
            cache.cos[11, 99] += 1.0
        q_out, _ = rd.apply_qk(leaf, k, cache, spec, backend="triton")
    grad_out = torch.randn_like(q)
    (grad,) = torch.autograd.grad(q_out, leaf, grad_out, retain_graph=True)
    assert_matches(grad, grad_expected(q, cache, spec, grad_out), q.dtype, "backward")
    cache.sin[12, 98] += 1.0  # between the forward and the backward
    with pytest.raises(rd.RoPEError, match="modified in place between the forward"):
        torch.autograd.grad(q_out, leaf, grad_out)


@gpu
def test_a_graph_replay_reads_the_rows_of_the_cache_as_it_is():
    """Captured calls never use the flag: a cache written between replays is read anew."""
    cache, spec, q, k = planned_pair()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rd.apply_qk(q, k, cache, spec, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, _ = rd.apply_qk(q, k, cache, spec, backend="triton")
    cache.cos[20, 70] += 1.0
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(q_out, expected(q, cache, spec), q.dtype, "replay")
