"""Sines caches on the Triton backend: a call that reads few rows of an angle table reads, from
the table's second sight, each pair's cos and sin from a cache the backend derived from the
table once, while the cache's flag on the device says each pair's two angles are equal.
Checked here: which tables' caches earn the flag; results bit for bit those of computing the
rows' sines, and right against the float64 reference, in every layout and position kind,
forward and backward, q+k and packed qkv; that the kernels really read the cache; that writes
into a table are seen; and the calls that never use a cache.

Without CUDA the kernels run on the CPU interpreter; the threshold of rows read from which a
call uses a cache is lowered to 0 here so that small shapes exercise it, and the linear
tables' threshold raised, so that no call reads a table as rates instead.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import build, cases, positions_for
from reference import assert_matches, reference_for, reference_forward_backward
from rope_dispatch import tables
from rope_dispatch.backends import triton_rope

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OFFSET = 4  # where the pairs start in a cache's int32 words (triton_kernels.SINES_OFFSET)
gpu = pytest.mark.skipif(not CUDA, reason="plans bind launches on a CUDA device only")

pytestmark = pytest.mark.usefixtures("triton_backend")


@pytest.fixture(autouse=True)
def small_calls_use_caches(monkeypatch):
    """Calls of any size use their table's sines cache; none carries over between tests."""
    monkeypatch.setattr(triton_rope, "SINES_MIN_ROWS_READ", 0)
    monkeypatch.setattr(triton_rope, "LINEAR_MIN_ROWS_READ", 1 << 40)
    monkeypatch.setattr(triton_rope, "_sines", {})
    monkeypatch.setattr(triton_rope, "_sines_met", {})
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES", raising=False)


def held_flags() -> list[int]:
    return [int(cache[0].item()) for cache in triton_rope._sines.values()]


def paired_table(rows: int, pairs: int, interleaved: bool, seed: int = 5) -> torch.Tensor:
    """``[rows, 1, 1, 2 * pairs]`` of random angles (up to 300 radians), each pair's two
    channels equal in the pairing given: halves ``[a, a]`` or neighbours."""
    gen = torch.Generator().manual_seed(seed)
    angles = (torch.rand(rows, pairs, generator=gen) - 0.5) * 600
    laid = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)
    return laid.view(rows, 1, 1, 2 * pairs).to(DEVICE)


def computed(run):
    """``run()`` with the derived tables switched off: the kernels compute the rows' sines."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
        return run()


# --- which caches earn the flag -------------------------------------------------------------

def cache_flag(freqs: torch.Tensor, interleaved: bool) -> int | None:
    table = tables.angles_2d(freqs)
    triton_rope.sines_table(table, interleaved)  # first sight: none
    cache = triton_rope.sines_table(table, interleaved)
    return None if cache is None else int(cache[0].item())


def test_model_tables_earn_the_flag_of_their_pairing():
    inv_freq = tables.inverse_frequencies(16, 10000.0)
    halves = tables.angle_table(inv_freq, 50).to(DEVICE)
    pairs = tables.angle_table(inv_freq, 50, interleaved=True).to(DEVICE)
    assert cache_flag(halves, False) == 1
    assert cache_flag(pairs, True) == 1
    assert cache_flag(halves, True) == 0  # neighbours differ in a rotate-half table
    assert cache_flag(pairs, False) == 0
    te = tables.from_te_options(16, 64, device=DEVICE).angle_table(64)
    assert cache_flag(te, False) == 1  # TransformerEngine's own table


def test_the_cache_holds_the_pairs_cos_and_sin():
    """Word 0 the flag, then per row the cos of each pair's angle and then its sin, within
    float32 rounding of float64 (the kernels' own reduction and hardware sines)."""
    freqs = paired_table(9, 3, False)
    table = tables.angles_2d(freqs)
    triton_rope.sines_table(table, False)
    cache = triton_rope.sines_table(table, False).cpu()
    values = cache[OFFSET:].view(torch.float32).view(9, 6).double()
    angles = table.cpu().double()[:, :3]
    torch.testing.assert_close(values[:, :3], angles.cos(), rtol=0, atol=2e-6)
    torch.testing.assert_close(values[:, 3:], angles.sin(), rtol=0, atol=2e-6)


# --- results --------------------------------------------------------------------------------

def check_cache(case, per_token: bool) -> None:
    t, _, spec, starts, case_angles = build(dataclasses.replace(case, use_cache=False), DEVICE)
    rows = case_angles.shape[0]
    freqs = paired_table(rows, case.rotary_dim // 2, spec.interleaved, case.seed)
    angles = freqs.view(rows, -1).cpu()
    positions = positions_for(case, t, rows).to(DEVICE) if per_token else None
    grad_out = torch.randn(t.shape, dtype=torch.float32).to(t.dtype).to(DEVICE)

    def run():
        out = rd.apply(t, freqs, spec, start_positions=starts, positions=positions,
                       backend="triton")
        (grad,) = torch.autograd.grad(out, t, grad_out)
        return out.detach(), grad

    run()  # the table's first sight: its sines are computed, and the next call derives a cache
    out, grad = run()
    assert held_flags() == [1]
    expected_out, expected_grad = computed(run)
    assert torch.equal(out, expected_out) and torch.equal(grad, expected_grad)
    ref_out, ref_grad = reference_forward_backward(
        t.detach().cpu(), angles, spec, grad_out.cpu(), None if starts is None else starts.cpu(),
        None if positions is None else positions.cpu(),
    )
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@settings(max_examples=15, deadline=None)
@given(cases())
def test_results_are_those_of_computed_sines(case):
    check_cache(case, per_token=False)


@settings(max_examples=8, deadline=None)
@given(cases(cp_sizes=(1,), starts=(False,)))
def test_per_token_positions(case):
    check_cache(case, per_token=True)


@settings(max_examples=10, deadline=None)
@given(cases())
def test_tables_whose_pairs_differ_compute_their_sines(case):
    """The cases' own tables have unequal halves: their caches hold no flag, and the kernels
    compute the rows' sines."""
    t, freqs, spec, starts, angles = build(dataclasses.replace(case, use_cache=False), DEVICE)
    for _ in range(2):
        out = rd.apply(t, freqs, spec, start_positions=starts, backend="triton")
    assert held_flags() in ([0], [])  # none where the table is a strided view, copied per call
    assert_matches(out, reference_for(t.detach().cpu(), angles.cpu(), spec,
                                      None if starts is None else starts.cpu()), t.dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["in-place", "qk", "qk in place", "qkv"])
def test_other_entries_are_those_of_computed_sines(interleaved, kind):
    gen = torch.Generator().manual_seed(4)
    freqs = paired_table(40, 4, interleaved)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16", interleaved=interleaved, cos_sin_scale=1.1)
    x = torch.randn(2, 7, 3, 32, generator=gen).bfloat16().to(DEVICE)  # partial rotary
    starts = torch.tensor([3, 33], device=DEVICE)
    weights = torch.randn(2, 7, 6, 32, generator=gen).to(DEVICE)

    def run():
        leaf = x.clone().requires_grad_(True)
        if kind == "in-place":
            outs = (rd.apply_(leaf * 1, freqs, spec, start_positions=starts, backend="triton"),)
        elif kind == "qk":
            outs = rd.apply_qk(leaf, leaf[..., :1, :] * 2, freqs, spec, start_positions=starts,
                               backend="triton")
        elif kind == "qk in place":
            outs = rd.apply_qk_(leaf * 1, leaf[..., :1, :] * 2, freqs, spec,
                                start_positions=starts, backend="triton")
        else:
            outs = rd.apply_qkv(leaf, freqs, spec, (16, 8, 8), k_freqs=freqs,
                                start_positions=starts, backend="triton")
        loss = sum((o.float() * weights[..., : o.shape[-2], : o.shape[-1]]).sum() for o in outs)
        return tuple(o.detach() for o in outs) + torch.autograd.grad(loss, leaf)

    run()
    got = run()
    assert held_flags() == [1]
    for a, b in zip(got, computed(run)):
        assert torch.equal(a, b)
    if kind != "qkv":  # (packed qkv's q is split out of x's heads)
        angles = freqs.view(40, -1).cpu()
        assert_matches(got[0], reference_for(x.cpu(), angles, spec, starts.cpu()), x.dtype, "q")


def test_packed_qkv_with_a_cache_for_one_table_only_computes_both():
    """q's and k's tables of one packed-qkv launch are read alike: where only q's has a cache
    (k's is seen for the first time), both compute their sines."""
    gen = torch.Generator().manual_seed(6)
    q_freqs, k_freqs = paired_table(12, 4, False, seed=1), paired_table(12, 4, False, seed=2)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(12, 2, 2, 32, generator=gen).to(DEVICE)
    other = torch.randn(12, 2, 2, 32, generator=gen).to(DEVICE)
    rd.apply_qkv(other, q_freqs, spec, (16, 8, 8), k_freqs=q_freqs, backend="triton")
    q, k, _ = rd.apply_qkv(x, q_freqs, spec, (16, 8, 8), k_freqs=k_freqs, backend="triton")
    assert held_flags() == [1]
    q_ref, k_ref, _ = computed(
        lambda: rd.apply_qkv(x, q_freqs, spec, (16, 8, 8), k_freqs=k_freqs, backend="triton"))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_the_kernels_read_the_cache():
    """A cache whose pairs are made cos 1 and sin 0 (as if derived from zero angles): the
    kernels then leave the rotated channels as they were, so they read the cache."""
    rows, d2 = 24, 8
    freqs = paired_table(rows, d2 // 2, False)
    assert cache_flag(freqs, False) == 1
    (cache,) = triton_rope._sines.values()
    pairs = cache[OFFSET:].view(rows, d2)
    pairs[:, : d2 // 2] = torch.tensor(1.0).view(torch.int32)
    pairs[:, d2 // 2 :] = 0
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(rows, 2, 3, d2).to(DEVICE)
    assert torch.equal(rd.apply(x, freqs, spec, backend="triton"), x)
    q, k = rd.apply_qk(x, x[..., :1, :], freqs, spec, backend="triton")
    assert torch.equal(q, x) and torch.equal(k, x[..., :1, :])
    cache[0] = 0  # the flag cleared: the rows' own sines
    assert_matches(rd.apply(x, freqs, spec, backend="triton"),
                   reference_for(x.cpu(), freqs.view(rows, -1).cpu(), spec), x.dtype)


# --- writes into the table ------------------------------------------------------------------

def test_a_write_into_the_table_is_seen_by_the_next_call():
    freqs = paired_table(30, 4, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(30, 2, 2, 8).to(DEVICE)
    rd.apply(x, freqs, spec, backend="triton")
    rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [1]
    freqs[9] += 0.5  # both halves alike: the pairs stay equal, the sines move
    out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [1]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype, "moved")
    freqs[9, 0, 0, 2] += 0.25  # one half only: the pairs differ
    out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [0]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype, "apart")


def test_a_write_between_forward_and_backward_is_seen_by_the_backward():
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, 2, 2, 8, generator=gen).to(DEVICE)
    grad_out = torch.randn(30, 2, 2, 8, generator=gen).to(DEVICE)
    freqs = paired_table(30, 4, False)
    leaf = x.clone().requires_grad_(True)
    rd.apply(leaf, freqs, spec, backend="triton")  # first sight
    out = rd.apply(leaf, freqs, spec, backend="triton")
    freqs[4, 0, 0, 1] += 0.25
    freqs[4, 0, 0, 5] += 0.25
    (grad,) = torch.autograd.grad(out, leaf, grad_out)
    _, ref_grad = reference_forward_backward(x.cpu(), freqs.view(30, -1).cpu(), spec,
                                             grad_out.cpu())
    assert_matches(grad, ref_grad, x.dtype, "backward")


# --- calls that never use a cache -----------------------------------------------------------

def test_calls_that_compute_their_sines(monkeypatch):
    x = torch.randn(12, 1, 2, 8).to(DEVICE)

    def held_after_two_calls(freqs) -> list[int]:
        spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
        triton_rope._sines.clear()
        triton_rope._sines_met.clear()
        rd.apply(x, freqs, spec, backend="triton")
        out = rd.apply(x, freqs, spec, backend="triton")
        assert_matches(out, reference_for(x.cpu(), tables.angles_2d(freqs).cpu(), spec), x.dtype)
        return held_flags()

    freqs = paired_table(12, 4, False)
    assert held_after_two_calls(freqs) == [1]
    with torch.inference_mode():  # no version counter would tell a later write
        frozen = paired_table(12, 4, False)
    assert held_after_two_calls(frozen) == []
    wide = torch.empty(12, 1, 1, 16, device=DEVICE)[..., ::2]  # strided: copied per call
    wide.copy_(freqs)
    assert held_after_two_calls(wide) == []
    monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
    assert held_after_two_calls(freqs) == []
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES")
    monkeypatch.setattr(triton_rope, "SINES_MAX_TABLE_BYTES", 12 * 8 * 4 - 1)
    assert held_after_two_calls(freqs) == []
    monkeypatch.setattr(triton_rope, "SINES_MAX_TABLE_BYTES", 12 * 8 * 4)
    assert held_after_two_calls(freqs) == [1]
    monkeypatch.setattr(triton_rope, "SINES_MIN_ROWS_READ", 12 * 8 + 1)  # rows x d2 = 96
    assert held_after_two_calls(freqs) == []
    monkeypatch.setattr(triton_rope, "SINES_MIN_ROWS_READ", 12 * 8)
    assert held_after_two_calls(freqs) == [1]


def test_the_shipped_thresholds(monkeypatch):
    """Decode-size calls compute their sines (their host path counts); calls of 128 rows and
    more of d 128 use the cache, up to where a linear table's flag takes over."""
    monkeypatch.setattr(triton_rope, "SINES_MIN_ROWS_READ", 1 << 14)
    monkeypatch.setattr(triton_rope, "LINEAR_MIN_ROWS_READ", 1 << 18)
    freqs = paired_table(2048, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    for seq, held in ((1, []), (127, []), (128, [1]), (2047, [1])):
        triton_rope._sines.clear()
        triton_rope._sines_met.clear()
        x = torch.randn(seq, 1, 1, 128).to(DEVICE)
        for _ in range(2):
            out = rd.apply(x, freqs, spec, backend="triton")
        assert held_flags() == held, seq
        assert_matches(out, reference_for(x.cpu(), freqs.view(2048, -1)[:seq].cpu(), spec), x.dtype)


def test_a_cache_goes_with_its_table():
    freqs = paired_table(20, 4, False)
    assert cache_flag(freqs, False) == 1
    assert len(triton_rope._sines) == 1
    del freqs
    gc.collect()
    assert triton_rope._sines == {}


@gpu
def test_planned_calls_see_writes_into_the_table():
    freqs = paired_table(64, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = torch.randn(64, 2, 4, 128, device="cuda").bfloat16()
    for _ in range(4):  # planned from the second call on
        out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [1]
    freqs[10, 0, 0, 5] += 1.0
    out = rd.apply(x, freqs, spec, backend="triton")
    assert_matches(out, reference_for(x.cpu(), freqs.view(64, -1).cpu(), spec), x.dtype)
    leaf = x.clone().requires_grad_(True)
    for _ in range(3):
        out = rd.apply(leaf, freqs, spec, backend="triton")
    freqs[11, 0, 0, 5] += 1.0
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    _, ref_grad = reference_forward_backward(x.cpu(), freqs.view(64, -1).cpu(), spec,
                                             torch.ones(out.shape, dtype=x.dtype))
    assert_matches(grad, ref_grad, x.dtype, "backward")


@gpu
def test_a_graph_replay_computes_the_sines_of_the_table_as_it_is():
    """Captured calls never read a cache: a table written between replays is read anew."""
    freqs = paired_table(64, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = torch.randn(64, 2, 4, 128, device="cuda").bfloat16()
    for _ in range(3):
        rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rd.apply(x, freqs, spec, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rd.apply(x, freqs, spec, backend="triton")
    freqs[20, 0, 0, 7] += 1.0
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, reference_for(x.cpu(), freqs.view(64, -1).cpu(), spec), x.dtype, "replay")
