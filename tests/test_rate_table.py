"""``RateTable`` (rotation rates ``inv_freq`` and a row count) as the table of any call: every
backend that serves it against the float64 reference on angles written from the definition
(pair ``k`` at position ``p`` turns by the float32 product ``float32(p) * inv_freq[k]``),
forward and backward, in every layout and position kind; bit for bit the same outputs as the
equivalent angle table; its errors; and ``RotaryFrequencies.rate_table``.

Without CUDA the Triton kernels run on the CPU interpreter (small shapes); the TE backend is
checked with a stand-in for TransformerEngine here and with the real one on the GPU machine.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import QKVCase, build, build_qkv, cases, fixed_case, positions_for
from kernel_spy import spy_kernels
from reference import (
    assert_matches, reference_for, reference_forward_backward, reference_qkv_forward_backward,
    reference_rope,
)
from rope_dispatch import call as call_module
from rope_dispatch import tables
from te_fake import recording_te

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the compiled triton backend runs on CUDA, else the interpreter

per_token_cases = cases(cp_sizes=(1,), starts=(False,))


def _use(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "triton":
        request.getfixturevalue("triton_backend")


def random_rates(seed: int, pairs: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 rates in [0, 3): angles reach a hundred radians over the tests' tables."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(pairs, generator=gen, dtype=torch.float64) * 3).float().to(device)


def definition_angles(inv_freq: torch.Tensor, rows: int, interleaved: bool) -> torch.Tensor:
    """float32 ``[rows, d2]`` from the definition: channel ``c`` belongs to pair ``c // 2``
    (interleaved) or ``c mod d2/2`` (two halves), whose angle at position ``p`` is the float32
    product ``float32(p) * inv_freq[pair]``."""
    rates = inv_freq.detach().cpu()
    pairs = rates.shape[0]
    channel = torch.arange(2 * pairs)
    pair = channel // 2 if interleaved else channel % pairs
    positions = torch.arange(rows, dtype=torch.float32)
    return positions[:, None] * rates[pair][None, :]


def rates_case(case, device: str, per_token: bool = False, requires_grad: bool = True):
    """``(t, rate_table, spec, start_positions, positions, angles)`` for a case: its table
    length and rotary dim, random rates; ``angles`` from the definition."""
    t, _, spec, starts, table_angles = build(dataclasses.replace(case, use_cache=False), device,
                                             requires_grad)
    rows = table_angles.shape[0]
    inv_freq = random_rates(case.seed + 3, case.rotary_dim // 2, device)
    positions = positions_for(case, t, rows).to(device) if per_token else None
    return (t, rd.RateTable(inv_freq, rows), spec, starts, positions,
            definition_angles(inv_freq, rows, spec.interleaved))


def check_rates(case, backend: str, device: str, per_token: bool = False) -> None:
    t, table, spec, starts, positions, angles = rates_case(case, device, per_token)
    out = rd.apply(t, table, spec, start_positions=starts, positions=positions, backend=backend)
    assert out.dtype == t.dtype and out.device == t.device and out.is_contiguous()
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts, positions)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


# --- every backend against the reference ----------------------------------------------------

@given(cases())
def test_eager_matches_reference(case):
    check_rates(case, "eager", "cpu")


@given(per_token_cases)
def test_eager_per_token_positions(case):
    check_rates(case, "eager", "cpu", per_token=True)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=20, deadline=None)
@given(cases())
def test_triton_matches_reference(case):
    check_rates(case, "triton", DEVICE)


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=12, deadline=None)
@given(per_token_cases)
def test_triton_per_token_positions(case):
    check_rates(case, "triton", DEVICE, per_token=True)


COMPILE_CASES = {
    "sbhd-interleaved-partial-starts-scaled": (fixed_case(
        layout="sbhd", interleaved=True, rotary_dim=10, head_dim=16, with_starts=True, scale=1.25,
    ), False),
    "thd-cp2-rank1": (fixed_case(
        layout="thd", cp_size=2, cp_rank=1, seqlens=(4, 8), rotary_dim=8, head_dim=12,
    ), False),
    "bshd-per-token": (fixed_case(layout="bshd", rotary_dim=12, head_dim=12), True),
}


@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compile_matches_reference(name):
    if not rd.get_backend("compile").available:
        pytest.skip("compile backend unavailable: " + "; ".join(rd.get_backend("compile").availability))
    case, per_token = COMPILE_CASES[name]
    check_rates(case, "compile", "cpu", per_token)
    t, table, spec, starts, positions, _ = rates_case(case, "cpu", per_token)
    call = rd.check_call(t, table, spec, starts, positions=positions)
    assert rd.get_backend("compile").is_compiled(call)  # forward and transpose, not the fallback


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_q_and_k_pair(backend, layout, request):
    _use(backend, request)
    case = fixed_case(layout=layout, rotary_dim=10, head_dim=12, interleaved=layout == "bshd",
                      with_starts=True, heads=4)
    q, table, spec, starts, _, angles = rates_case(case, DEVICE)
    k_case = dataclasses.replace(case, heads=1, seed=case.seed + 1)
    k = build(dataclasses.replace(k_case, use_cache=False), DEVICE)[0]
    q_out, k_out = rd.apply_qk(q, k, table, spec, start_positions=starts, backend=backend)
    grads = [torch.randn_like(q_out), torch.randn_like(k_out)]
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), grads)
    for name, x, out, g, grad in (("q", q, q_out, grads[0], gq), ("k", k, k_out, grads[1], gk)):
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, g, starts)
        assert_matches(out, ref_out, x.dtype, f"{name} forward")
        assert_matches(grad, ref_grad, x.dtype, f"{name} backward")


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_packed_qkv_with_its_own_k_rates(backend, layout, request):
    _use(backend, request)
    base = fixed_case(layout=layout, heads=2, head_dim=8, rotary_dim=6, interleaved=True,
                      with_starts=True, seqlens=(3, 5), strides="permuted")
    case = QKVCase(base, q_heads=2, v_heads=1, own_k_table=False)
    qkv, _, _, spec, starts, table_angles, _ = build_qkv(case, DEVICE)
    rows = table_angles.shape[0]
    q_rates, k_rates = random_rates(1, 3, DEVICE), random_rates(2, 3, DEVICE)
    outs = rd.apply_qkv(qkv, rd.RateTable(q_rates, rows), spec, case.split,
                        k_freqs=rd.RateTable(k_rates, rows), start_positions=starts, backend=backend)
    grads = [torch.randn_like(o) for o in outs]
    (grad,) = torch.autograd.grad(outs, qkv, grads)
    ref_outs, ref_grad = reference_qkv_forward_backward(
        qkv, definition_angles(q_rates, rows, True), definition_angles(k_rates, rows, True), spec,
        case.split, grads, starts,
    )
    for name, out, ref in zip("qkv", outs, ref_outs):
        assert_matches(out, ref, qkv.dtype, name)
    assert_matches(grad, ref_grad, qkv.dtype, "packed gradient")


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("per_token", [False, True])
def test_in_place(backend, per_token, request):
    _use(backend, request)
    case = fixed_case(layout="bshd", rotary_dim=10, head_dim=16, strides="qkv-slice",
                      with_starts=not per_token, cp_size=1 if per_token else 2,
                      cp_rank=0 if per_token else 1, seq=6)
    t, table, spec, starts, positions, angles = rates_case(case, DEVICE, per_token,
                                                          requires_grad=False)
    expected = reference_for(t.cpu(), angles, spec, None if starts is None else starts.cpu(),
                             None if positions is None else positions.cpu())
    same = rd.apply_(t, table, spec, start_positions=starts, positions=positions, backend=backend)
    assert same is t
    assert_matches(t, expected, t.dtype, "in place")
    q, k = t.clone(), t[..., :2, :].clone()
    expected_k = reference_for(k.cpu(), angles, spec, None if starts is None else starts.cpu(),
                               None if positions is None else positions.cpu())
    rd.apply_qk_(q, k, table, spec, start_positions=starts, positions=positions, backend=backend)
    assert_matches(k, expected_k, k.dtype, "k in place")


def test_multimodal_rows_are_those_of_the_angle_table():
    """Multimodal RoPE gathers each token's row from the rate table's angles: the same as
    from the equivalent angle table (the call is lowered to a per-token angle table)."""
    gen = torch.Generator().manual_seed(5)
    inv_freq = random_rates(9, 8)
    t = torch.randn(5, 2, 3, 20, generator=gen)
    streams = torch.randint(0, 30, (3, 5, 2), generator=gen)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", mrope_section=(2, 3, 3))
    out = rd.apply(t, rd.RateTable(inv_freq, 30), spec, positions=streams, backend="eager")
    angles = tables.angle_table(inv_freq, 30)
    assert torch.equal(out, rd.apply(t, angles, spec, positions=streams, backend="eager"))
    call = rd.check_call(t, rd.RateTable(inv_freq, 30), spec, positions=streams)
    assert call.table_kind == "angles"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_multimodal_rows_of_a_long_table(backend, request):
    """A multimodal call on a rate table of 2^40 rows (precise: 2^24) computes each token's
    angles from the rates, against the definition: it made the whole angle table to gather
    them (4 TiB of floats, refused by the allocator). Float32 angles are read below 2^18 (the
    GPU kernels reduce float32 angles exactly enough to about 1e6 rad, backends/triton_trig.py;
    rates here reach 3), exact ones to the end."""
    _use(backend, request)
    inv_freq = random_rates(10, 4)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", mrope_section=(2, 1, 1))
    t = torch.randn(1, 3, 2, 10, generator=torch.Generator().manual_seed(11))
    for precise, rows in ((False, 1 << 40), (True, 1 << 24)):
        top = rows if precise else 1 << 18  # the rows read
        streams = torch.tensor([[[top - 1, 5, top // 3]], [[7, top - 2, 0]],
                                [[top // 2, 1, top - 3]]])
        out = rd.apply(t.to(DEVICE), rd.RateTable(inv_freq.to(DEVICE), rows, precise=precise),
                       spec, positions=streams.to(DEVICE), backend=backend)
        stream_of = [0, 0, 1, 2] * 2  # each channel's section: halves of t 2, h 1, w 1
        per_token = torch.empty(3, 8, dtype=torch.float64)
        for token in range(3):
            for c in range(8):
                p, rate = int(streams[stream_of[c], 0, token]), inv_freq[c % 4]
                exact = p * float(rate)  # exact: 24-bit position times a float32 rate
                per_token[token, c] = exact if precise else float(torch.tensor(float(p)) * rate)
        expected = reference_rope(t, per_token, torch.arange(3).view(1, 3), False)
        assert_matches(out, expected, torch.float32, f"precise={precise}")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_compile_fullgraph(backend, request):
    """``apply`` with a rate table inside torch.compile(fullgraph=True): no graph break (the
    rate table's angle table is made while tracing for eager), forward and backward."""
    _use(backend, request)
    torch._dynamo.reset()
    inv_freq = random_rates(4, 4, DEVICE)
    table = rd.RateTable(inv_freq, 16)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")

    def attention_input(q):
        return rd.apply(q * 2, table, spec, backend=backend) + 1

    compiled = torch.compile(attention_input, fullgraph=True, backend="aot_eager")
    q = torch.randn(2, 8, 3, 12, device=DEVICE, requires_grad=True)
    out = compiled(q)
    # what tracing computed stays in the graph: the table keeps no traced tensor, and eager
    # calls after the compiled one make (and keep) a real one
    assert all(type(a) is torch.Tensor for a in table._angles.values())
    eager = rd.apply(q.detach() * 2, table, spec, backend=backend) + 1
    assert torch.equal(eager, out.detach())
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, q, grad_out)
    ref_out, ref_grad = reference_forward_backward(q.detach() * 2, definition_angles(inv_freq, 16, False),
                                                   spec, grad_out)
    assert_matches(out, ref_out + 1, torch.float32)
    assert_matches(grad, 2 * ref_grad, torch.float32, "backward")


# --- bit for bit the angle table's results ----------------------------------------------------

def _same_results(backend: str, table: rd.RateTable, angles: torch.Tensor, run) -> None:
    """``run(freqs, backend)`` returns outputs whose sum over random weights is differentiated:
    with the rate table and with the angle table, outputs and gradients are equal."""
    a_outs, a_grads = run(table, backend)
    b_outs, b_grads = run(angles, backend)
    for a, b in zip(a_outs + a_grads, b_outs + b_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["apply", "per-token", "in-place", "qk", "qkv"])
def test_bit_identical_to_the_angle_table(backend, interleaved, kind, request):
    _use(backend, request)
    gen = torch.Generator().manual_seed(17)
    rows, d2 = 40, 8
    inv_freq = tables.inverse_frequencies(d2, 500.0)  # real rates: from 1 down to ~1/100
    table = rd.RateTable(inv_freq.to(DEVICE), rows)
    angles = tables.angle_table(inv_freq, rows, interleaved=interleaved).to(DEVICE)
    spec = rd.RoPESpec(layout="bshd", dtype="bf16", interleaved=interleaved, cos_sin_scale=1.1)
    x = torch.randn(2, 7, 3, 32, generator=gen).bfloat16().to(DEVICE)  # partial rotary
    starts = torch.tensor([3, 33], device=DEVICE)
    positions = torch.randint(0, rows, (2, 7), generator=gen).to(DEVICE)
    weights = torch.randn(2, 7, 6, 32, generator=gen).to(DEVICE)

    def run(freqs, backend):
        leaf = x.clone().requires_grad_(True)
        if kind == "apply":
            outs = (rd.apply(leaf, freqs, spec, start_positions=starts, backend=backend),)
        elif kind == "per-token":
            outs = (rd.apply(leaf, freqs, spec, positions=positions, backend=backend),)
        elif kind == "in-place":
            with torch.no_grad():
                outs = (rd.apply_(leaf.detach().clone(), freqs, spec, start_positions=starts,
                                  backend=backend),)
            outs += (rd.apply_(leaf * 1, freqs, spec, start_positions=starts, backend=backend),)
        elif kind == "qk":
            outs = rd.apply_qk(leaf, leaf[..., :1, :] * 2, freqs, spec, start_positions=starts,
                               backend=backend)
        else:
            outs = rd.apply_qkv(leaf, freqs, spec, (16, 8, 8), k_freqs=freqs,
                                start_positions=starts, backend=backend)
        loss = sum((o.float() * weights[..., : o.shape[-2], : o.shape[-1]]).sum() for o in outs)
        return tuple(o.detach() for o in outs), torch.autograd.grad(loss, leaf)

    _same_results(backend, table, angles, run)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("kind", ["rates", "angles"])
def test_triton_long_positions_match_reference(kind):
    """Angles near 1e6 rad (positions near 2^20, rate 1): the Triton kernels' float32 angle
    reduction needs a true fused multiply-add, which the interpreter's tl.fma is not (it gave
    errors of 0.04); the interpreter takes NumPy's reducing cos/sin instead."""
    rows, d2 = (1 << 20) + 8, 4
    inv_freq = tables.inverse_frequencies(d2, 10000.0)  # rates 1 and 1/100
    rates = rd.RateTable(inv_freq.to(DEVICE), rows)
    table = rates if kind == "rates" else rates.angle_table()
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(4, 2, 2, 8, generator=gen).to(DEVICE).requires_grad_(True)
    starts = torch.tensor([1_000_003, 999_000], device=DEVICE)
    out = rd.apply(t, table, spec, start_positions=starts, backend="triton")
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    angles = definition_angles(inv_freq, rows, False)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out, starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_int32_starts_past_2_31_inside_a_longer_table(layout):
    """A rate table of more than 2^31 rows takes int32 start positions whose sum with a
    token's place passes 2^31: the row is that sum, inside the table (eager's), not an int32
    sum wrapped negative, which the kernels took for a row outside it (NaN)."""
    inv_freq = torch.tensor([1.0, 1e-6], device=DEVICE)
    rates = rd.RateTable(inv_freq, 1 << 40)
    starts = torch.tensor([2**31 - 2, 2**31 - 3], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
    spec = rd.RoPESpec(layout=layout, dtype=torch.float32,
                       **({"cu_seqlens": cu, "max_seqlen": 3} if layout == "thd" else {}))
    t = torch.randn(6, 1, 4, device=DEVICE).view(*((6, 1) if layout == "thd" else (3, 2, 1)), 4)
    out = rd.apply(t, rates, spec, start_positions=starts, backend="triton")
    # the definition: a token's row is its start plus its place, its angle that row times the
    # rate as a float32 product (a default RateTable), rotate-half, in float64
    tokens = t.reshape(6, 4).double()
    if layout == "thd":
        rows = torch.cat([starts[i].long() + torch.arange(3, device=DEVICE) for i in range(2)])
    else:  # sbhd [3, 2]: token (s, b) at row starts[b] + s
        rows = (torch.arange(3, device=DEVICE)[:, None] + starts.long()[None, :]).reshape(6)
    angles = (rows.float()[:, None] * inv_freq[None, :]).double()
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    partner = torch.cat((-tokens[:, 2:], tokens[:, :2]), dim=-1)
    want = tokens * cos + partner * sin
    assert not out.isnan().any()
    torch.testing.assert_close(out.reshape(6, 4).double(), want, rtol=0, atol=2e-6)


@pytest.mark.usefixtures("triton_backend")
def test_triton_runs_the_rates_branch_of_its_kernels(monkeypatch):
    """The launcher hands the kernels ``RATES=True`` (and no cache flag) for a rate table, and
    ``RATES=False`` for the angle table and a cos/sin cache of the same shape: the lean kernel
    for these small contiguous calls, the general one with the lean kernel turned off."""
    from rope_dispatch.backends import triton_launch, triton_tiles

    seen: list[tuple[str, bool, bool, bool]] = []
    spy_kernels(monkeypatch, ("rope_kernel", "rope_lean_kernel", "rope_qkv_kernel"),
                lambda name, kw: seen.append((name, kw["RATES"], kw["USE_CACHE"], kw["PAIRED"])))
    monkeypatch.setattr(triton_launch, "_compiled", {})
    inv_freq = random_rates(3, 4, DEVICE)
    rate_table = rd.RateTable(inv_freq, 12)
    angles = tables.angle_table(inv_freq, 12)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(6, 2, 2, 8, device=DEVICE)
    for lean_max_bytes, name in ((triton_tiles.LEAN_MAX_BYTES, "rope_lean_kernel"),
                                 (0, "rope_kernel")):
        monkeypatch.setattr(triton_tiles, "LEAN_MAX_BYTES", lean_max_bytes)
        monkeypatch.setattr(triton_launch, "_compiled", {})  # compiled launches are kept by key
        rd.dispatch.forget_plans()  # and plans bind them
        seen.clear()
        rd.apply(x, rate_table, spec, backend="triton")
        rd.apply_qk(x, x[..., :1, :], rate_table, spec, backend="triton")
        rd.apply(x, angles, spec, backend="triton")
        rd.apply(x, rd.cos_sin_cache(angles), spec, backend="triton")
        assert seen == [
            (name, True, False, False), ("rope_qkv_kernel", True, False, False),
            (name, False, False, False), (name, False, True, False),
        ]


def test_kernel_tables_and_address():
    """The kernels' view: ``[rows, d2]`` with a row stride of 0 over the doubled rates, given
    as both table and sin; a planned call checks the address of those rates."""
    from rope_dispatch.backends.triton_launch import Launch, Tables, launch_key
    from rope_dispatch.backends.triton_tables import table_flags as _table_flags

    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    table = rd.RateTable(inv_freq, 9)
    view, sin = tables.kernel_tables(table)
    assert sin is view and view.shape == (9, 6) and view.stride() == (0, 1)
    assert torch.equal(view[4], torch.tensor([1.0, 0.5, 0.25, 1.0, 0.5, 0.25]))
    assert tables.table_address(table) == view.data_ptr()
    assert _table_flags(view, sin) == (False, False, True, False)
    # two views of the one buffer (as a traced graph may hand them over) still say rates
    assert _table_flags(view, table._kernel_rates.as_strided((9, 6), (0, 1))) == (False, False, True, False)
    cos = torch.rand(9, 6)
    assert _table_flags(cos, torch.rand(9, 6)) == (True, False, False, False)
    assert _table_flags(cos, cos) == (True, False, False, False)  # one contiguous tensor as cos and sin
    assert _table_flags(cos, None) == (False, False, False, False)
    x = torch.randn(4, 1, 1, 8)
    described = Launch("t", "sbhd", False, 1.0, 1, 0)
    rates_key = launch_key(described, (x,), (x,), Tables(view, sin, None, None), (0,) * 6)
    other = torch.rand(9, 6)
    cache_key = launch_key(described, (x,), (x,), Tables(view, other, None, None), (0,) * 6)
    assert rates_key != cache_key


# --- positions outside the table --------------------------------------------------------------

def test_positions_outside_the_rows_are_errors_on_the_cpu():
    table = rd.RateTable(torch.tensor([1.0, 0.1]), 10)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    with pytest.raises(rd.RoPEError, match="freqs has 10 positions but the sequence needs 12"):
        rd.apply(torch.randn(12, 1, 1, 4), table, spec)
    with pytest.raises(rd.RoPEError,
                       match="freqs has 10 positions but start_positions max 7 \\+ sequence length 6 needs 13"):
        rd.apply(torch.randn(6, 2, 1, 4), table, spec, start_positions=torch.tensor([0, 7]))
    with pytest.raises(rd.RoPEError, match="positions must lie in \\[0, 10\\) \\(freqs has 10 rows\\), "
                                           "got values from 0 to 10"):
        rd.apply(torch.randn(3, 2, 1, 4), table, spec, positions=torch.tensor([[0, 1], [2, 3], [4, 10]]))
    thd = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 4, 15]))
    with pytest.raises(rd.RoPEError, match="freqs has 10 positions but a sequence needs positions up to 10"):
        rd.apply(torch.randn(15, 1, 4), table, thd)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_unread_positions_past_the_rows_give_nan_rows(backend, monkeypatch, request):
    """Values the host does not read (a GPU outside strict mode): rows past the table are NaN in
    their rotated channels, every other row is right."""
    _use(backend, request)
    monkeypatch.setattr(call_module, "_reads", lambda index: False)
    inv_freq = random_rates(6, 3)
    t = torch.randn(6, 3, 2, 8)  # sbhd: s 6, b 3
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=6)
    starts = torch.tensor([0, 7, 4])  # batch 1 needs rows 7..12 of 10
    table = rd.RateTable(inv_freq.to(DEVICE), 10)
    out = rd.apply(t.to(DEVICE), table, spec, start_positions=starts.to(DEVICE),
                   backend=backend).cpu()
    bad = torch.zeros(6, 3, dtype=torch.bool)
    bad[3:, 1] = True
    assert torch.isnan(out[bad][..., :6]).all()
    assert torch.equal(out[bad][..., 6:], t[bad][..., 6:])
    ref = reference_for(t, definition_angles(inv_freq, 16, False), spec, starts)
    assert not torch.isnan(out[~bad]).any()
    torch.testing.assert_close(out[~bad].double(), ref[~bad], rtol=1e-5, atol=1e-5)


# --- construction and call errors -------------------------------------------------------------

@pytest.mark.parametrize(("inv_freq", "rows", "words"), [
    (torch.tensor([1.0, 0.5], dtype=torch.float64), 4, "must be float32 rates .* got dtype float64"),
    (torch.tensor([1.0, 0.5]).bfloat16(), 4, "got dtype bfloat16"),
    (torch.ones(2, 3), 4, "must be 1-D \\[d2 / 2\\] .* got shape \\(2, 3\\)"),
    (torch.ones(0), 4, "at least one rate, got an empty tensor"),
    (torch.ones(6)[::2], 4, "must be contiguous, got stride \\(2,\\)"),
    ([1.0, 0.5], 4, "must be a float32 tensor \\[d2 / 2\\], got list"),
    (torch.ones(2), 0, "rows must be a positive int .* got 0"),
    (torch.ones(2), -3, "got -3"),
    (torch.ones(2), 4.0, "got 4.0"),
    (torch.ones(2), True, "got True"),
    # past an int64 size: as_strided's TypeError (a C++ trace) before
    (torch.ones(2), 1 << 63,
     "rows must be a positive int with rows x d2 below 2\\*\\*63 .* got 9223372036854775808"),
    # rows below 2**63 whose [rows, d2] view has more elements: numel's overflow before
    (torch.ones(4), 1 << 62, "rows x d2 below 2\\*\\*63 .* at most 1152921504606846975 for d2 8, "
     "got 4611686018427387904"),
])
def test_construction_errors(inv_freq, rows, words):
    with pytest.raises(rd.RoPEError, match=words):
        rd.RateTable(inv_freq, rows)


def test_numpy_rows_are_a_size_like_any_other():
    """Sizes take Python or NumPy integers (as RoPESpec's, f.rate_table's and angle_table's
    do): a NumPy row count is the same table, kept as a Python int."""
    np = pytest.importorskip("numpy")
    inv_freq = torch.tensor([1.0, 0.25])
    for precise in (False, True):
        table = rd.RateTable(inv_freq, np.int64(9), precise=precise)
        assert type(table.rows) is int and table.rows == 9 and table.seq_len == 9
        same = rd.RateTable(inv_freq, 9, precise=precise)
        assert torch.equal(table.angle_table(), same.angle_table())
    t = torch.randn(1, 9, 2, 4)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    assert torch.equal(rd.apply(t, rd.RateTable(inv_freq, np.int32(9)), spec),
                       rd.apply(t, tables.angle_table(inv_freq, 9), spec))


def test_properties_and_kept_angle_tables():
    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    table = rd.RateTable(inv_freq, 7)
    assert (table.seq_len, table.rotary_dim, table.device) == (7, 6, torch.device("cpu"))
    assert tables.table_kind(table) == "rates" and tables.table_shape(table) == (7, 6)
    halves = table.angle_table()
    assert halves.shape == (7, 1, 1, 6) and halves.dtype == torch.float32
    assert torch.equal(halves, tables.angle_table(inv_freq, 7))
    assert torch.equal(halves.view(7, 6), definition_angles(inv_freq, 7, False))
    assert table.angle_table() is halves  # made once, kept
    pairs = table.angle_table(interleaved=True)
    assert torch.equal(pairs, tables.angle_table(inv_freq, 7, interleaved=True))
    assert table.angle_table(True) is pairs
    inv_freq.mul_(2)  # the rates were copied when the table was made
    assert torch.equal(tables.kernel_tables(table)[0][0], torch.tensor([1.0, 0.5, 0.25] * 2))


@pytest.mark.parametrize("value", ["False", 1, None])
def test_interleaved_must_be_a_bool(value):
    """The angle tables' layout flag is refused unless a bool, as RotaryFrequencies and the
    spec refuse it: ``"False"`` was read as True (pairs), and 1 found True's kept table."""
    inv_freq = torch.tensor([1.0, 0.25])
    for precise in (False, True):
        table = rd.RateTable(inv_freq, 5, precise=precise)
        table.angle_table(True)  # kept: a lookup by 1 would find it
        words = f"interleaved must be a bool, got {value!r}"
        for make in (table.angle_table, table.angle_rows,
                     lambda flag: table.angles_at(torch.tensor([2]), flag)):
            with pytest.raises(rd.RoPEError, match=words):
                make(value)
    for make in (tables.angle_table, tables.reduced_angle_table):
        with pytest.raises(rd.RoPEError, match=words):
            make(inv_freq, 5, interleaved=value)


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_rates_are_constants_and_kept_tables_normal_tensors(backend):
    """No gradient reaches ``inv_freq`` (and a second backward through the kept angle table
    works); a first call under inference mode keeps no inference tensor for later training
    calls, which save the table for their backward."""
    if not rd.get_backend(backend).available:
        pytest.skip(f"{backend} backend unavailable")
    inv_freq = random_rates(12, 4).requires_grad_(True)
    table = rd.RateTable(inv_freq, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    with torch.inference_mode():
        rd.apply(torch.randn(4, 2, 1, 8), table, spec, backend=backend)
    assert not table.angle_table().is_inference() and not table.angle_table().requires_grad
    for _ in range(2):
        t = torch.randn(4, 2, 1, 8, requires_grad=True)
        rd.apply(t, table, spec, backend=backend).sum().backward()
        ref = reference_forward_backward(t, definition_angles(inv_freq, 8, False), spec,
                                         torch.ones(4, 2, 1, 8))[1]
        assert_matches(t.grad, ref, torch.float32, "backward")
    assert inv_freq.grad is None


@pytest.mark.parametrize("backend", ["compile", "eager"])
def test_a_table_kept_at_a_first_call_inside_a_selective_checkpoint(backend):
    """A first call inside ``checkpoint(use_reentrant=False)`` with a selective policy saving
    every op makes the kept angle table (the compile backend's, multimodal rows' on eager):
    the checkpoint's dispatch mode does not see it made, since the recomputation finds it kept
    and makes nothing, and would otherwise be handed the table's ops' outputs in place of its
    own (the compile backend fed a wrong shape, multimodal positions made float). The
    gradients are the reference's."""
    import functools

    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    if not rd.get_backend(backend).available:
        pytest.skip(f"{backend} backend unavailable")
    gen = torch.Generator().manual_seed(3)
    inv_freq = random_rates(13, 4)
    sections = (1, 1, 2) if backend == "eager" else None
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", mrope_section=sections)
    t, z = torch.randn(5, 2, 3, 8, generator=gen), torch.randn(5, 2, 3, 8, generator=gen)
    streams = torch.randint(0, 9, (3, 5, 2), generator=gen)
    positions = streams if sections else None

    def save_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    table = rd.RateTable(inv_freq, 9)

    def region(x, factor):  # (a slice after the call: one was made with the kept table)
        out = rd.apply(x * factor, table, spec, positions=positions, backend=backend)
        return (out * factor)[..., :6].square()

    leaves = [v.clone().requires_grad_(True) for v in (t, z)]
    out = checkpoint(region, *leaves, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, save_all))
    grads = torch.autograd.grad(out.sum(), leaves)
    x64, z64 = (v.double().requires_grad_(True) for v in (t, z))
    angles = definition_angles(inv_freq, 9, False)
    if sections:  # channel c of token (i, j) at the position of its section's stream
        stream = torch.tensor([0, 1, 2, 2] * 2)
        rows = streams[stream][:, :, :, None]  # [d2, s, b, 1]
        per_token = angles.double()[rows, torch.arange(8)[:, None, None, None]]
        per_token = per_token[..., 0].permute(1, 2, 0).reshape(10, 8)
        own = torch.arange(10).view(5, 2)
        rotated = reference_rope(x64 * z64, per_token, own, False)
    else:
        rotated = reference_for(x64 * z64, angles, spec)
    expected = (rotated * z64)[..., :6].square()
    wanted = torch.autograd.grad(expected.sum(), (x64, z64))
    assert_matches(out, expected, torch.float32, "forward")
    for name, got, want in zip(("x", "factor"), grads, wanted):
        assert_matches(got, want, torch.float32, f"{name}'s gradient")


def test_k_freqs_of_another_kind_is_named():
    qkv = torch.randn(4, 2, 1, 24)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    angles = torch.rand(8, 8)
    with pytest.raises(rd.RoPEError, match="k_freqs is an angle table but freqs is a RateTable"):
        rd.apply_qkv(qkv, rd.RateTable(torch.ones(4), 8), spec, (8, 8, 8), k_freqs=angles)
    with pytest.raises(rd.RoPEError, match="k_freqs is a RateTable but freqs is a CosSinCache"):
        rd.apply_qkv(qkv, rd.cos_sin_cache(angles), spec, (8, 8, 8),
                     k_freqs=rd.RateTable(torch.ones(4), 8))


def test_device_and_rotary_dim_checks():
    table = rd.RateTable(torch.ones(4), 8)
    with pytest.raises(rd.RoPEError, match="spec.rotary_dim=6 but freqs has last dim d2=8"):
        rd.apply(torch.randn(4, 1, 1, 8), table, rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=6))
    with pytest.raises(rd.RoPEError, match="rotary dim d2=8 .* exceeds the head dim d=6"):
        rd.apply(torch.randn(4, 1, 1, 6), table, rd.RoPESpec(layout="sbhd", dtype="fp32"))
    meta = torch.empty(4, 1, 1, 8, device="meta")
    with pytest.raises(rd.RoPEError, match="freqs is on cpu but t is on meta"):
        rd.check_call(meta, table, rd.RoPESpec(layout="sbhd", dtype="fp32"))


# --- RotaryFrequencies.rate_table --------------------------------------------------------------

def test_rate_table_of_frequencies_is_the_angle_table():
    f = tables.default_frequencies(12, rope_theta=500.0)
    table = f.rate_table(50)
    assert isinstance(table, rd.RateTable) and (table.rows, table.rotary_dim) == (50, 12)
    assert torch.equal(table.inv_freq, f.inv_freq)
    for interleaved in (False, True):
        assert torch.equal(table.angle_table(interleaved),
                           f.angle_table(50, interleaved=interleaved))
    assert f.rate_table(3, device="cpu").device == torch.device("cpu")
    config = types.SimpleNamespace(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 500000.0},
        head_dim=16, max_position_embeddings=512,
    )
    hf = tables.from_hf_config(config, 256)
    assert torch.equal(hf.rate_table(256).angle_table(), hf.angle_table(256))


def test_rate_table_refusals():
    te = tables.from_te_options(16, 100, seq_len_interpolation_factor=2.0,
                                pretrained_max_position_embeddings=50)
    assert te.position_scale != 1.0
    with pytest.raises(rd.RoPEError, match="position_scale=0.5 .* use angle_table\\(\\)"):
        te.rate_table(100)
    yarn = tables.yarn_frequencies(16, factor=4.0, original_max_position_embeddings=64)
    assert yarn.attention_factor != 1.0
    with pytest.raises(rd.RoPEError, match="attention_factor=.* which a RateTable cannot carry"):
        yarn.rate_table(64)
    table = yarn.rate_table(64, without_attention_factor=True)
    assert torch.equal(table.angle_table(), yarn.angle_table(64, without_attention_factor=True))
    dynamic = tables.dynamic_ntk_frequencies(16, factor=2.0, max_position_embeddings=64, seq_len=128)
    with pytest.raises(rd.RoPEError, match="max_positions=129 exceeds the 128 positions"):
        dynamic.rate_table(129)
    with pytest.raises(rd.RoPEError, match="max_positions must be a positive int, got 0"):
        dynamic.rate_table(0)


# --- which backends serve it -------------------------------------------------------------------

def test_explain_lists_the_backends_that_read_rates():
    t = torch.randn(4, 2, 1, 8)
    explanation = rd.explain(t, rd.RateTable(torch.ones(4), 8), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    serving = {explanation.chosen, *explanation.passed_over}
    assert "eager" in serving
    if rd.get_backend("compile").available:
        assert "compile" in serving
    assert not any("rates table is not supported" in r
                   for reasons in explanation.rejected.values() for r in reasons)
    for name in ("eager", "compile", "triton", "te"):
        assert "rates" in rd.get_backend(name).tables


@pytest.mark.parametrize("interleaved", [False, True])
def test_te_gets_the_kept_angle_table_in_the_spec_layout(interleaved):
    """TransformerEngine reads a whole angle table: a rate table hands it its kept angle table
    ``[rows, 1, 1, d2]`` in the spec's layout, the same object every call."""
    seen: dict = {}
    backend = recording_te(seen)
    inv_freq = random_rates(8, 4)
    table = rd.RateTable(inv_freq, 16)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", interleaved=interleaved)
    call = rd.check_call(torch.randn(4, 2, 2, 8), table, spec)
    assert [r for r in backend.not_supported_reasons(call) if "table" in r] == []
    backend.apply(call)
    assert seen["freqs"].shape == (16, 1, 1, 8) and seen["freqs"].dtype == torch.float32
    assert torch.equal(seen["freqs"].view(16, 8), definition_angles(inv_freq, 16, interleaved))
    first = seen["freqs"]
    backend.apply(call)
    assert seen["freqs"] is first


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_te_matches_reference_and_the_angle_table(interleaved):
    """On the GPU machine, TransformerEngine itself serves a rate table: the reference, and bit
    for bit its own results with the equivalent angle table."""
    backend = rd.get_backend("te")
    if not backend.available:
        pytest.skip("TE backend unavailable: " + "; ".join(backend.availability))
    case = fixed_case(layout="bshd", dtype=torch.bfloat16, seq=64, batch=2, heads=4, head_dim=64,
                      rotary_dim=32, interleaved=interleaved)
    t, table, spec, _, _, angles = rates_case(case, "cuda")
    out = rd.apply(t, table, spec, backend="te")
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to("cuda")
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")
    same = rd.apply(t, tables.angle_table(table.inv_freq, table.rows, interleaved=interleaved),
                    spec, backend="te")
    assert torch.equal(out, same)
