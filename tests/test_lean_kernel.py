"""The lean kernel (``triton_kernels.rope_lean_kernel``), which serves small calls on contiguous
sbhd and bshd tensors: which calls it takes, its tiles, and its results against the float64
reference and bit for bit against the general kernel, for every table kind, both pairings,
partial rotary, in place and out of place, forward and backward.

Without CUDA the kernels run on the CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from cases import build, fixed_case
from kernel_spy import spy_kernels
from reference import assert_matches, reference_forward_backward
from rope_dispatch import tables
from rope_dispatch.backends import triton_launch, triton_rope, triton_tables, triton_tiles
from test_rate_table import definition_angles, random_rates

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TABLE_KINDS = ("angles", "linear angles", "cos/sin cache", "pair cache", "rates")

pytestmark = pytest.mark.usefixtures("triton_backend")


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The names of the kernels each launch ran, in order, with " linear" where it read its
    table through the linearity flag (compiled launches forgotten first, so every call goes
    through the launcher's choice)."""
    names: list[str] = []
    spy_kernels(monkeypatch, ("rope_kernel", "rope_lean_kernel"),
                lambda name, kw: names.append(name + (" linear" if kw["LINEAR"] else "")))
    monkeypatch.setattr(triton_launch, "_compiled", {})
    rd.dispatch.forget_plans()
    monkeypatch.setattr(triton_tables, "_flags", {})
    monkeypatch.setattr(triton_tables, "_flags_met", {})
    return names


def table_of(kind: str, angles: torch.Tensor, interleaved: bool, seed: int):
    """``(freqs, angles)``: a table of ``kind`` and the float32 angles ``[s2, d2]`` it stands
    for (random, with unequal halves, where the kind allows)."""
    rows, d2 = angles.shape
    if kind in ("angles", "cos/sin cache"):
        table = angles.view(rows, 1, 1, d2).to(DEVICE)
        return (table if kind == "angles" else rd.cos_sin_cache(table)), angles
    if kind == "pair cache":
        gen = torch.Generator().manual_seed(seed)
        pair = torch.rand(rows, d2 // 2, generator=gen, dtype=torch.float64) * 40
        full = pair.repeat_interleave(2, -1) if interleaved else torch.cat((pair, pair), -1)
        cache = torch.cat((pair.cos(), pair.sin()), dim=-1).float()
        return rd.PairCosSinCache(cache.to(DEVICE)), full
    inv_freq = random_rates(seed, d2 // 2, DEVICE)
    exact = definition_angles(inv_freq, rows, interleaved)
    if kind == "rates":
        return rd.RateTable(inv_freq, rows), exact
    # a model's angle table: every row float32(p) x row 1, read through its linearity flag
    return tables.angle_table(inv_freq, rows, interleaved=interleaved).to(DEVICE), exact


def run_both_ways(t, freqs, spec, grad_out, monkeypatch, launched, in_place: bool, suffix: str):
    """``(out, grad, kernels)`` of the lean launch, checked bit for bit against the general
    kernel's (the lean kernel turned off), which reads the table alike (``suffix``)."""
    results = []
    for lean_max_bytes in (triton_tiles.LEAN_MAX_BYTES, 0):
        monkeypatch.setattr(triton_tiles, "LEAN_MAX_BYTES", lean_max_bytes)
        launched.clear()
        # twice: a linear angle table gets its flag at its second sight
        for _ in range(2):
            monkeypatch.setattr(triton_launch, "_compiled", {})  # each call through the launcher,
            rd.dispatch.forget_plans()  # none from a plan bound to an earlier launch
            leaf = t.detach().clone().requires_grad_(True)
            if in_place:
                x = leaf * 1
                out = rd.apply_(x, freqs, spec, backend="triton")
                assert out is x
            else:
                out = rd.apply(leaf, freqs, spec, backend="triton")
            (grad,) = torch.autograd.grad(out, leaf, grad_out)
        results.append((out.detach(), grad, list(launched[-2:])))
    (out, grad, kernels), (general_out, general_grad, general_kernels) = results
    assert general_kernels == ["rope_kernel" + suffix] * 2
    assert torch.equal(out, general_out) and torch.equal(grad, general_grad)
    return out, grad, kernels


def check_lean_launch(t, freqs, exact, spec, monkeypatch, launched, in_place: bool, suffix: str,
                      grad_seed: int) -> None:
    """The lean kernel's forward and transpose of ``t`` (a gradient drawn from ``grad_seed``):
    bit for bit the general kernel's (:func:`run_both_ways`), and the float64 reference's
    values for the angles ``exact``."""
    gen = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(t.shape, generator=gen).to(t.dtype).to(DEVICE)
    out, grad, kernels = run_both_ways(t, freqs, spec, grad_out, monkeypatch, launched, in_place,
                                       suffix)
    assert kernels == ["rope_lean_kernel" + suffix] * 2  # the forward and its transpose
    ref_out, ref_grad = reference_forward_backward(t.cpu(), exact, spec, grad_out.cpu())
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@pytest.mark.parametrize("kind", TABLE_KINDS)
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, in_place", [(16, False), (10, False), (10, True)])
def test_matches_the_reference_and_the_general_kernel(monkeypatch, launched, kind, layout,
                                                      interleaved, rotary_dim, in_place):
    case = fixed_case(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, heads=3,
                      dtype=torch.bfloat16, seed=5, scale=1.25 if kind == "pair cache" else 1.0)
    t, _, spec, _, angles = build(case, DEVICE, requires_grad=False)
    freqs, exact = table_of(kind, angles, interleaved, case.seed)
    suffix = ""
    if kind == "linear angles":  # small calls read rows unless told to look for the flag
        monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 0)
        suffix = " linear"
    check_lean_launch(t, freqs, exact, spec, monkeypatch, launched, in_place, suffix, grad_seed=1)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, in_place", [(16, False), (10, False), (10, True)])
def test_sines_shared_across_a_tiles_heads(monkeypatch, launched, layout, interleaved, rotary_dim,
                                           in_place):
    """Six heads take a tile of 8 (two masked), which computes each angle row's sines once for
    all its heads (``SHARED_ROWS``): the same bits as the general kernel, which computes them
    per head, and the reference's values."""
    case = fixed_case(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, heads=6,
                      dtype=torch.bfloat16, seed=7)
    t, freqs, spec, _, angles = build(case, DEVICE, requires_grad=False)
    assert triton_tiles.lean_tile(case.seq * case.batch, 6, t.shape[-1], 2)[1] >= \
        triton_tiles.SHARED_SINES_HEADS
    check_lean_launch(t, freqs, angles, spec, monkeypatch, launched, in_place, "", grad_seed=4)


@pytest.mark.parametrize("kind", ["angles", "cos/sin cache"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads, head_dim, tile, shared", [
    (3, 16, (8, 4), True),  # tokens x heads: one exchange of the rows, packed
    (4, 128, (1, 4), False),  # one token of 4 heads: rows read where the heads use them
    (1, 16, (16, 1), False),  # tokens of one head: likewise
])
def test_rows_read_once_or_per_head(monkeypatch, launched, kind, interleaved, heads, head_dim,
                                    tile, shared):
    """Both forms of reading a tile's table rows (``triton_tiles.shared_rows``), for angle rows
    and a cos/sin cache: the same bits as the general kernel and the reference's values."""
    case = fixed_case(heads=heads, head_dim=head_dim, rotary_dim=head_dim,
                      interleaved=interleaved, dtype=torch.bfloat16, seed=5)
    t, _, spec, _, angles = build(case, DEVICE, requires_grad=False)
    freqs, exact = table_of(kind, angles, interleaved, seed=5)
    assert triton_tiles.lean_tile(case.seq * case.batch, heads, head_dim, 2) == tile
    assert triton_tiles.shared_rows(*tile, kind != "angles") is shared
    check_lean_launch(t, freqs, exact, spec, monkeypatch, launched, False, "", grad_seed=6)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("batch, one_sequence", [(1, True), (3, False)])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_batch_of_one_reads_its_positions_from_the_token_index(monkeypatch, launched, layout,
                                                                 batch, one_sequence, in_place):
    """A batch of one (sbhd ``[s, 1, h, d]``, bshd ``[1, s, h, d]``) numbers its tokens by
    position, so the launch skips the index division (``ONE_SEQUENCE``); larger batches keep
    it. Both: the reference's values and the general kernel's bits, with a sequence of 7 and
    random angle rows, so a token read at another position's row would show."""
    case = fixed_case(layout=layout, seq=7, batch=batch, heads=3, dtype=torch.bfloat16, seed=9)
    t, freqs, spec, _, angles = build(case, DEVICE, requires_grad=False)
    code = 0 if layout == "sbhd" else 1
    dim1 = t.shape[1]
    _, _, consts = triton_launch._lean_arguments(
        7 * batch, dim1, 3, 16, 16, 16, 2, code, False, (False, False, False, False), False, 1.0,
        False,
    )
    assert consts["ONE_SEQUENCE"] is one_sequence
    check_lean_launch(t, freqs, angles, spec, monkeypatch, launched, in_place, "", grad_seed=8)


@pytest.mark.gpu
@pytest.mark.parametrize("layout, seq, batch, heads, interleaved, in_place", [
    ("sbhd", 512, 1, 8, False, False),  # 1 x 8 tiles, two channels a thread, 1 MiB: the largest
    ("bshd", 128, 1, 8, False, True),  # likewise, in place
    ("bshd", 128, 2, 12, True, False),  # two head groups, the second masked (768 KiB)
    ("sbhd", 128, 1, 1, False, False),  # 4 x 1 tiles
])
def test_gpu_sweep_sizes(monkeypatch, launched, layout, seq, batch, heads, interleaved,
                         in_place):
    """At the sizes the lean kernel was built for (head dim 128, bf16), its compiled tiles
    against the reference and the general kernel, forward and backward."""
    case = fixed_case(layout=layout, seq=seq, batch=batch, heads=heads, head_dim=128,
                      rotary_dim=128, interleaved=interleaved, dtype=torch.bfloat16, seed=3)
    t, freqs, spec, _, angles = build(case, DEVICE, requires_grad=False)
    check_lean_launch(t, freqs, angles, spec, monkeypatch, launched, in_place, "", grad_seed=2)


def test_reads_its_linear_table_through_the_flag(monkeypatch, launched):
    """The lean kernel takes the flag's branch: a flag forced on for a table that is not linear
    turns every token by its position times row 1."""
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 0)
    rows, d2 = 12, 8
    inv_freq = random_rates(2, d2 // 2, DEVICE)
    linear = tables.angle_table(inv_freq, rows).to(DEVICE)
    freqs = linear + 0.5
    freqs[1] = linear[1]
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    x = torch.randn(2, rows, 3, d2).to(DEVICE)
    triton_tables.linear_flag(tables.angles_2d(freqs))
    flag = triton_tables.linear_flag(tables.angles_2d(freqs))
    assert int(flag.item()) == 0
    flag.fill_(1)  # as if the check had passed at this version of the table
    out = rd.apply(x, freqs, spec, backend="triton")
    assert launched == ["rope_lean_kernel linear"]
    expected, _ = reference_forward_backward(x.cpu(), definition_angles(inv_freq, rows, False),
                                             spec, torch.zeros(x.shape))
    assert_matches(out, expected, x.dtype, "forced flag")


@pytest.mark.parametrize("change, why", [
    (dict(layout="thd"), "thd"),
    (dict(with_starts=True), "start positions"),
    (dict(cp_size=2, cp_rank=1, seq=4), "context parallelism"),
    (dict(strides="qkv-slice"), "a strided input"),
    (dict(strides="permuted"), "a permuted input"),
])
def test_other_calls_take_the_general_kernel(launched, change, why):
    t, freqs, spec, starts, _ = build(fixed_case(**change), DEVICE, requires_grad=False)
    rd.apply(t, freqs, spec, start_positions=starts, backend="triton")
    assert launched == ["rope_kernel"], why


def test_per_token_positions_take_the_general_kernel(launched):
    t, freqs, spec, _, _ = build(fixed_case(), DEVICE, requires_grad=False)
    rd.apply(t, freqs, spec, positions=torch.zeros(t.shape[:2], dtype=torch.int64, device=DEVICE),
             backend="triton")
    assert launched == ["rope_kernel"]


def test_calls_past_lean_max_bytes_take_the_general_kernel(monkeypatch, launched):
    t, freqs, spec, _, _ = build(fixed_case(), DEVICE, requires_grad=False)
    nbytes = t.numel() * t.element_size()
    monkeypatch.setattr(triton_tiles, "LEAN_MAX_BYTES", nbytes)
    rd.apply(t, freqs, spec, backend="triton")
    monkeypatch.setattr(triton_tiles, "LEAN_MAX_BYTES", nbytes - 1)
    monkeypatch.setattr(triton_launch, "_compiled", {})  # compiled launches are kept by call key
    rd.dispatch.forget_plans()  # and plans bind them
    rd.apply(t, freqs, spec, backend="triton")
    assert launched == ["rope_lean_kernel", "rope_kernel"]


def test_a_strided_output_takes_the_general_kernel(launched):
    """``launch`` into an output of other strides (a transposed buffer) from a contiguous
    input: the lean kernel addresses both alike, so the general one runs."""
    t, freqs, spec, _, angles = build(fixed_case(), DEVICE, requires_grad=False)
    out = torch.empty(t.shape[1], t.shape[0], *t.shape[2:], device=DEVICE).transpose(0, 1)
    triton_rope.launch(triton_rope.Launch("t", "sbhd", False, 1.0, 1, 0), (t,), (out,),
                       triton_rope.Tables(tables.angles_2d(freqs), None, None, None))
    assert launched == ["rope_kernel"]
    expected, _ = reference_forward_backward(t.cpu(), angles, spec, torch.zeros(t.shape))
    assert_matches(out, expected, t.dtype, "strided output")


@pytest.mark.parametrize("tokens, heads, width, element_size, tile", [
    (128, 8, 128, 2, (1, 8)),  # heads first: 2 KiB already
    (512, 32, 128, 2, (1, 8)),  # at most LEAN_HEADS heads a tile
    (128, 1, 128, 2, (4, 1)),  # one head: tokens up to 1 KiB
    (128, 2, 128, 2, (2, 2)),
    (128, 4, 64, 2, (2, 4)),
    (128, 1, 96, 4, (2, 1)),  # 384-byte rows: two fit, a power of two
    (128, 1, 64, 2, (8, 1)),
    (3, 1, 16, 2, (4, 1)),  # no more tokens than the call's, to a power of two
    (1, 3, 256, 4, (1, 4)),
])
def test_tiles_take_heads_first_then_tokens(tokens, heads, width, element_size, tile):
    assert triton_tiles.lean_tile(tokens, heads, width, element_size) == tile


def test_int32_offsets_hold_every_call_it_takes():
    assert triton_tiles.LEAN_MAX_BYTES < 2**31


@pytest.mark.parametrize("heads, head_dim, interleaved, use_cache, shared, vector", [
    (8, 128, False, False, False, 2),  # 1 x 8, a warp over a half row: each thread its sines
    (32, 128, False, True, False, 64),  # on a cos/sin cache: no sines, rows read per head
    (8, 256, False, False, True, 128),  # 1 x 8 of d 256: a row's sines once for the heads
    (8, 128, True, False, True, 128),  # interleaved pairs: likewise
    (4, 128, False, False, False, 64),  # 1 x 4: the exchange costs about what it saves
    (1, 128, False, False, False, 64),  # 4 x 1: nothing to share
    (2, 128, False, False, True, 64),  # 2 x 2: the rows change layout either way; packed
    (2, 128, False, True, True, 64),
])
def test_how_a_lean_tile_gets_its_rows_sines(heads, head_dim, interleaved, use_cache, shared,
                                             vector):
    _, _, consts = triton_launch._lean_arguments(
        128, 1, heads, head_dim, head_dim, head_dim, 2, 0, interleaved,
        (use_cache, False, False, False), False, 1.0, False,
    )
    assert (consts["SHARED_ROWS"], consts["VECTOR"]) == (shared, vector)


@pytest.mark.parametrize("tile, use_cache, shared", [
    ((16, 2), True, True),  # a cache's rows: one exchange, packed
    ((4, 8), False, False),  # angle rows keep their sines per head in the general kernel
    ((1, 8), False, False),
    ((32, 1), True, False),
])
def test_general_tiles_share_only_a_caches_rows(tile, use_cache, shared):
    assert triton_tiles.shared_rows(*tile, use_cache, lean=False) is shared
