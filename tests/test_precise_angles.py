"""Precise rate tables (``RateTable(..., precise=True)``): every angle the exact product of the
position and the rate, reduced modulo 2*pi before its sine and cosine, on every backend that
runs here (eager, compile, Triton on the CPU interpreter, TransformerEngine through a stand-in),
forward and backward, at positions near 2^20 and 2^24 - 1 where float32 products are off by
hundredths to tenths of a radian; the default's float32 products unchanged; the flag in the
table kind (so in every key); the errors.

The expectation is written here from the formula: the product ``p * rate`` of a whole number
below 2^24 and a float32 rate is exact in a Python float, and Python's ``math.cos`` and
``math.sin`` (the C library's, which reduce large arguments exactly) give its cosine and sine.
"""

from __future__ import annotations

import math

import pytest
import torch

import rope_dispatch as rd
from reference import reference_cache_rope
from rope_dispatch import tables
from te_fake import recording_te
from rope_dispatch.call_keys import call_key
from rope_dispatch.errors import RoPEError, RoPETypeError

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the Triton backend's kernels: CUDA, else the interpreter

TOP = 1 << 24
# the fastest pairs of a head dim of 128 at base 10000, where the float32 product errs most
FAST_RATES = [1.0 / 10000.0 ** (2 * k / 128) for k in range(2)]
# start positions of a batch of 2 sequences of 3 tokens: up to 2^20 and up to 2^24 - 1
STARTS = [(1 << 20) - 2, TOP - 3]
SEQ = 3


def float32_rates(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def exact_cos_sin(positions: list[int], rates: torch.Tensor, interleaved: bool):
    """float64 ``(cos, sin)`` ``[len(positions), d2]`` from the definition: channel ``c``
    belongs to pair ``c // 2`` (interleaved) or ``c mod d2/2`` (halves), which turns by
    ``p * rate`` at position ``p``, computed exactly (24 bits times 24 bits fit a float64)."""
    pairs = rates.numel()
    values = [float(r) for r in rates.tolist()]
    pair = [c // 2 if interleaved else c % pairs for c in range(2 * pairs)]
    cos = [[math.cos(p * values[k]) for k in pair] for p in positions]
    sin = [[math.sin(p * values[k]) for k in pair] for p in positions]
    return torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)


def basis_input(pairs: int, extra: int = 2) -> torch.Tensor:
    """bshd float32 ``[2, SEQ, 2 * d2, d2 + extra]``: head ``h`` holds 1 in channel ``h`` and 0
    elsewhere, so its rotated channels are the cosines and sines themselves (the pass-through
    channels, ``extra`` of them, are ones)."""
    d2 = 2 * pairs
    t = torch.zeros(2, SEQ, d2, d2 + extra)
    for h in range(d2):
        t[:, :, h, h] = 1.0
    t[..., d2:] = 1.0
    return t


def expected(t: torch.Tensor, grad_out: torch.Tensor, rates: torch.Tensor, interleaved: bool):
    """float64 output and input gradient at the batch's positions (``STARTS`` + 0..SEQ-1)."""
    positions = [start + i for start in STARTS for i in range(SEQ)]
    cos, sin = exact_cos_sin(positions, rates, interleaved)
    rows = torch.arange(len(positions)).view(2, SEQ)  # bshd token (b, s) -> its row above
    x = t.detach().double().requires_grad_(True)
    out = reference_cache_rope(x, cos, sin, rows, interleaved)
    (grad,) = torch.autograd.grad(out, x, grad_out.double())
    return out.detach(), grad


def check_precise(backend: str, rates: torch.Tensor, interleaved: bool, device: str = "cpu"):
    """A precise table of 2^24 rows through ``backend``: output and input gradient within 1e-6
    of the exact ones (inputs and output gradients of ones and zeros, so every error is a
    cosine's or a sine's)."""
    table = rd.RateTable(rates.to(device), TOP, precise=True)
    t = basis_input(rates.numel()).to(device).requires_grad_(True)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", interleaved=interleaved)
    starts = torch.tensor(STARTS, device=device)
    out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
    grad_out = basis_input(rates.numel()).flip(2).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = expected(t.cpu(), grad_out.cpu(), rates, interleaved)
    assert (out.detach().cpu().double() - ref_out).abs().max().item() < 1e-6, "forward"
    assert (grad.cpu().double() - ref_grad).abs().max().item() < 1e-6, "backward"


# --- every backend against the exact angles ---------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
def test_eager_is_exact(interleaved):
    check_precise("eager", float32_rates(FAST_RATES), interleaved)


@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_eager_never_makes_a_long_tables_angles(precise, interleaved, monkeypatch):
    """Eager computes a rate table's angles at the positions a call reads: a precise table of
    2^24 rows and d 128 would otherwise make 8 GiB of angles (and float64 products twice that)."""
    def whole_table(*args, **kwargs):
        raise AssertionError("eager made the rate table's whole angle table")

    monkeypatch.setattr(rd.RateTable, "angle_table", whole_table)
    rates = float32_rates([1.0 / 10000.0 ** (2 * k / 128) for k in range(64)])
    table = rd.RateTable(rates, TOP, precise=precise)
    t = torch.randn(2, SEQ, 3, 128, dtype=torch.float64).float()
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", interleaved=interleaved)
    out = rd.apply(t, table, spec, start_positions=torch.tensor(STARTS), backend="eager")
    positions = [start + i for start in STARTS for i in range(SEQ)]
    if precise:
        cos, sin = exact_cos_sin(positions, rates, interleaved)
    else:  # each angle the float32 product of the position and the rate
        angles = torch.tensor(positions, dtype=torch.float32)[:, None] * rates[None, :]
        angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles,) * 2, -1)
        cos, sin = torch.cos(angles.double()), torch.sin(angles.double())
    rows = torch.arange(len(positions)).view(2, SEQ)
    want = reference_cache_rope(t, cos, sin, rows, interleaved)
    assert (out.double() - want).abs().max().item() < 1e-5


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_is_exact(interleaved):
    check_precise("triton", float32_rates(FAST_RATES), interleaved, DEVICE)


@pytest.mark.usefixtures("triton_backend")
def test_triton_is_exact_at_every_rate_of_a_head():
    """All 32 rates of a rotary dim of 64 (base 10000), fast and slow, in one kernel."""
    check_precise("triton", tables.inverse_frequencies(64), False, DEVICE)


@pytest.mark.usefixtures("triton_backend")
def test_triton_is_exact_at_rates_of_any_sign_and_size():
    """Rates past one turn a position and negative ones: the kernels reduce a rate modulo a
    turn before the position multiplies it, which is exact for whole positions."""
    check_precise("triton", float32_rates([-3.0, 64.0, 1000.0 / 3.0, -0.1]), False, DEVICE)


def test_compile_is_exact():
    backend = rd.get_backend("compile")
    if not backend.available:
        pytest.skip("compile backend unavailable: " + "; ".join(backend.availability))
    rates = float32_rates(FAST_RATES)
    check_precise("compile", rates, False)
    call = rd.check_call(basis_input(2).requires_grad_(True), rd.RateTable(rates, TOP, precise=True),
                         rd.RoPESpec(layout="bshd", dtype="fp32"),
                         torch.tensor(STARTS))
    assert backend.is_compiled(call)  # forward and transpose, not the fallback


@pytest.mark.parametrize("interleaved", [False, True])
def test_te_gets_reduced_angles(interleaved):
    """TransformerEngine reads float32 angles: a precise table hands it angles reduced modulo
    2*pi from the exact products, in [-pi, pi], whose cosines and sines are the exact ones."""
    seen: dict = {}
    backend = recording_te(seen)
    rates = float32_rates(FAST_RATES)
    rows = (1 << 20) + 2
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", interleaved=interleaved)
    call = rd.check_call(torch.randn(4, 1, 1, 4), rd.RateTable(rates, rows, precise=True), spec)
    assert [r for r in backend.not_supported_reasons(call) if "table" in r] == []
    backend.apply(call)
    freqs = seen["freqs"]
    assert freqs.shape == (rows, 1, 1, 4) and freqs.dtype == torch.float32
    assert freqs.abs().max().item() <= math.pi + 1e-6
    near = list(range(rows - 5, rows))
    cos, sin = exact_cos_sin(near, rates, interleaved)
    angles = freqs.view(rows, 4)[near].double()
    assert (torch.cos(angles) - cos).abs().max().item() < 1e-6
    assert (torch.sin(angles) - sin).abs().max().item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "te"])
def test_gpu_backends_are_exact(backend, monkeypatch):
    """On the GPU machine: the Triton kernels (fast sine and cosine) and TransformerEngine (whose
    angle table of 2^24 rows is kept narrow: 4 channels; it serves start positions on the GPU
    only when their values are checked)."""
    if not rd.get_backend(backend).available:
        pytest.skip(f"{backend} unavailable: " + "; ".join(rd.get_backend(backend).availability))
    if backend == "te":
        monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")
    if backend == "triton":
        check_precise(backend, tables.inverse_frequencies(128), False, "cuda")
    check_precise(backend, float32_rates(FAST_RATES), False, "cuda")
    check_precise(backend, float32_rates(FAST_RATES), True, "cuda")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_traced_calls_are_exact(backend, request):
    """Inside torch.compile(fullgraph=True): eager traces the reduction in float64, Triton's
    custom op gets the float64 rates and launches the precise kernels."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    device = DEVICE if backend == "triton" else "cpu"
    torch._dynamo.reset()
    rates = float32_rates(FAST_RATES)
    table = rd.RateTable(rates.to(device), TOP, precise=True)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    starts = torch.tensor(STARTS, device=device)

    def rotated(x):
        return rd.apply(x, table, spec, start_positions=starts, backend=backend)

    t = basis_input(2).to(device).requires_grad_(True)
    out = torch.compile(rotated, fullgraph=True, backend="aot_eager")(t)
    grad_out = basis_input(2).flip(2).to(device)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = expected(t.cpu(), grad_out.cpu(), rates, False)
    assert (out.detach().cpu().double() - ref_out).abs().max().item() < 1e-6, "forward"
    assert (grad.cpu().double() - ref_grad).abs().max().item() < 1e-6, "backward"


# --- the default is today's float32 products --------------------------------------------------

def float32_product_angles(rates: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows, d2]`` halves: ``float32(p) * rate``, one float32 multiply each."""
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * rates[None, :]
    return torch.cat((angles, angles), dim=-1)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_default_is_the_float32_products(backend, request):
    """Without ``precise`` a rate table gives the angle table of float32 products bit for bit
    (what models were trained with), which is far from exact at 2^20."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    rates = float32_rates(FAST_RATES)
    rows = (1 << 20) + 1
    table = rd.RateTable(rates.to(DEVICE if backend == "triton" else "cpu"), rows)
    assert table.precise is False and tables.table_kind(table) == "rates"
    assert torch.equal(table.angle_rows(), float32_product_angles(rates, rows).to(table.device))
    device = table.device
    t = basis_input(2).to(device)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    starts = torch.tensor([rows - SEQ, 0], device=device)
    out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
    same = rd.apply(t, float32_product_angles(rates, rows).to(device), spec,
                    start_positions=starts, backend=backend)
    assert torch.equal(out, same)
    precise = rd.apply(t, rd.RateTable(table.inv_freq, rows, precise=True), spec,
                       start_positions=starts, backend=backend)
    assert (precise - out).abs().max().item() > 1e-3  # the float32 product's error is real


def test_precise_angle_table_is_reduced_and_kept():
    rates = float32_rates(FAST_RATES)
    table = rd.RateTable(rates, 64, precise=True)
    # what the kernels read: each rate's fraction of a turn, 64-bit fixed point (int64 bits)
    read, _ = tables.kernel_tables(table)
    assert read.dtype == torch.int64 and read.shape == (64, 4) and read.stride() == (0, 1)
    turns = [(x % 2**64) / 2**64 for x in read[0].tolist()]
    for got, rate in zip(turns, [float(r) for r in torch.cat((rates, rates))]):
        assert abs(got - (rate / (2 * math.pi)) % 1.0) < 1e-15
    # a negative rate turns the other way: the two fractions sum to a whole turn, to rounding
    both = tables.turn_fractions(float32_rates([0.7, -0.7])).tolist()
    assert (both[0] + both[1]) % 2**64 in (0, 1, 2**64 - 1)
    for interleaved in (False, True):
        angles = table.angle_table(interleaved)
        assert angles is table.angle_table(interleaved) and angles.dtype == torch.float32
        cos, sin = exact_cos_sin(list(range(64)), rates, interleaved)
        rows = angles.view(64, 4).double()
        assert (torch.cos(rows) - cos).abs().max().item() < 1e-6
        assert (torch.sin(rows) - sin).abs().max().item() < 1e-6


def test_rate_table_of_frequencies():
    f = tables.default_frequencies(8)
    precise = f.rate_table(32, precise=True)
    assert precise.precise and tables.table_kind(precise) == "precise_rates"
    assert not f.rate_table(32).precise


# --- the flag is part of the table's kind ----------------------------------------------------

def test_kind_keys_and_launches_tell_precise_from_default():
    rates = float32_rates(FAST_RATES)
    t = torch.randn(4, 1, 1, 4)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    default = rd.check_call(t, rd.RateTable(rates, 8), spec)
    precise = rd.check_call(t, rd.RateTable(rates, 8, precise=True), spec)
    assert (default.table_kind, precise.table_kind) == ("rates", "precise_rates")
    assert call_key(default) != call_key(precise)
    from rope_dispatch.backends.compiled import compile_key
    assert compile_key(default) != compile_key(precise)
    from rope_dispatch.backends.triton_launch import describe
    assert describe(default).table == "rates" and describe(precise).table == "precise_rates"
    for name in ("eager", "compile", "triton", "te"):
        assert "precise_rates" in rd.get_backend(name).tables


def test_a_backend_that_reads_only_float32_rates_refuses_precise_tables():
    class RatesOnly(rd.Backend):
        name = "rates-only-test"
        tables = frozenset({"angles", "rates"})

        def apply(self, call):
            raise AssertionError("not called")

    backend = RatesOnly()
    rates = float32_rates(FAST_RATES)
    call = rd.check_call(torch.randn(4, 1, 1, 4), rd.RateTable(rates, 8, precise=True),
                         rd.RoPESpec(layout="sbhd", dtype="fp32"))
    assert any("precise_rates table is not supported" in r
               for r in backend.not_supported_reasons(call))


def test_k_freqs_must_match_precision():
    rates = float32_rates(FAST_RATES)
    qkv = torch.randn(4, 1, 1, 12)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    with pytest.raises(RoPEError, match="k_freqs is a RateTable but freqs is a precise RateTable"):
        rd.apply_qkv(qkv, rd.RateTable(rates, 8, precise=True), spec, (4, 4, 4),
                     k_freqs=rd.RateTable(rates, 8))


# --- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)])
def test_precise_must_be_a_bool(value):
    with pytest.raises(RoPETypeError, match=f"precise must be a bool .* got {value!r}".replace(
            "(", "\\(").replace(")", "\\)")):
        rd.RateTable(float32_rates(FAST_RATES), 8, precise=value)
    with pytest.raises(RoPETypeError, match="precise must be a bool"):
        tables.default_frequencies(8).rate_table(8, precise=value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rates_must_be_finite(bad):
    """A NaN or infinite rate gives NaN or infinite angles at every position: refused, precise
    or not (the default table kept it and rotated every token of that pair to NaN)."""
    words = f"RateTable's inv_freq must hold finite rates .*got {bad!r} at pair 1 of 2"
    for precise in (True, False):
        with pytest.raises(RoPEError, match=words):
            rd.RateTable(float32_rates([0.5, bad]), 8, precise=precise)
    turn_fractions = rd.table_kinds.turn_fractions  # the precise kernels' own check, as before
    with pytest.raises(RoPEError, match="a precise RateTable's inv_freq must be finite"):
        turn_fractions(float32_rates([0.5, bad]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_angle_tables_of_rates_on_the_cpu_must_be_finite(bad):
    """angle_table and reduced_angle_table (public) filled a NaN or infinite rate's columns
    with NaN or infinite angles without a word; on the CPU, where reading the rates costs no
    device sync, they refuse it, naming it and its pair, as RateTable and RotaryFrequencies do."""
    rates = torch.tensor([0.5, 0.25, bad], dtype=torch.float64)
    words = f"inv_freq must hold finite rates .*got {bad!r} at pair 2 of 3"
    for build in (tables.reduced_angle_table, tables.angle_table):
        with pytest.raises(RoPEError, match=words):
            build(rates, 4)
        with pytest.raises(RoPEError, match=words):
            build(rates.float(), 4)
    table = tables.angle_table(rates[:2].float(), 3)  # finite rates: position times rate
    expected = torch.arange(3, dtype=torch.float64)[:, None] * rates[:2]
    torch.testing.assert_close(table.reshape(3, 4).double(), torch.cat((expected, expected), -1))


@pytest.mark.parametrize(("rates", "shown"), [
    ([1.0, 0.5], "list"), (torch.ones(2, 3), r"torch.float32 \(2, 3\)"),
    (torch.ones(3, dtype=torch.int64), r"torch.int64 \(3,\)"),
])
def test_reduced_angle_table_names_bad_rates(rates, shown):
    """reduced_angle_table (public, as angle_table) checks its rates as angle_table does."""
    words = f"inv_freq must be a 1-D floating-point tensor of rates, got {shown}"
    for build in (tables.reduced_angle_table, tables.angle_table):
        with pytest.raises(RoPEError, match=words):
            build(rates, 4)


def test_precise_rows_stop_at_2_to_the_24():
    rates = float32_rates(FAST_RATES)
    assert rd.RateTable(rates, TOP, precise=True).rows == TOP
    with pytest.raises(RoPEError, match=r"rows must be at most 16777216 \(2\*\*24\) with "
                                        r"precise=True .* got rows=16777217"):
        rd.RateTable(rates, TOP + 1, precise=True)
    assert rd.RateTable(rates, TOP + 1).rows == TOP + 1  # the default has no such bound


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_rope_to_cache_turns_by_the_exact_angles(backend, request):
    """A serving step at long positions through a precise table: q comes back and k lands in
    the cache rotated by the exact angles (the cache stage reads the table as the rotation
    does), within 1e-6, on the eager composition and the Triton kernels."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    device = DEVICE if backend == "triton" else "cpu"
    rates = float32_rates(FAST_RATES)
    d2 = 2 * rates.numel()
    positions = [(1 << 20) - 1, TOP - 2, TOP - 1]
    q = torch.eye(d2).repeat(3, 1, 1)  # token i, head h: 1 in channel h
    k = q[:, :1].clone() + q[:, 1:2]  # one kv head: channels 0 and 1 at 1
    v = torch.ones(3, 1, d2)
    k_cache, v_cache = torch.zeros(2, 4, 1, d2), torch.zeros(2, 4, 1, d2)
    slots = torch.tensor([5, 0, 3])
    cache = rd.PagedKVCache(k_cache.to(device), v_cache.to(device), slots.to(device))
    table = rd.RateTable(rates.to(device), TOP, precise=True)
    out = rd.rope_to_cache(q.to(device), k.to(device), v.to(device), table,
                           rd.RoPESpec(layout="thd", dtype="fp32"),
                           positions=torch.tensor(positions, device=device), cache=cache,
                           backend=backend)
    cos, sin = exact_cos_sin(positions, rates, False)
    x64 = q.double()
    want_q = reference_cache_rope(x64, cos, sin, torch.arange(3), False)
    want_k = reference_cache_rope(k.double(), cos, sin, torch.arange(3), False)
    assert (out.cpu().double() - want_q).abs().max().item() < 1e-6
    written = cache.k_cache.cpu().view(8, 1, d2)[slots]
    assert (written.double() - want_k).abs().max().item() < 1e-6
