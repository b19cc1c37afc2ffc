"""Linear angle tables on the Triton backend: an angle table whose every row ``p`` is, bit for
bit, ``float32(p) * row 1`` (a model's ``outer(arange, inv_freq)``) is read as rates, from a
flag the backend keeps on the device. Checked here: which tables earn the flag; results bit for
bit those of reading the rows, and right against the float64 reference, in every layout and
position kind, forward and backward, q+k and packed qkv; that the kernels really take the
flag's branch; that writes into a table are seen (between calls, and between a forward and
its backward); and the calls that never look for a flag.

Without CUDA the kernels run on the CPU interpreter; the threshold of rows read from which a
call looks for its flag is lowered to 0 here so that small shapes exercise it.
"""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings

import rope_dispatch as rd
from cases import build, cases, positions_for
from reference import assert_matches, reference_for, reference_forward_backward
from rope_dispatch import call as call_module
from rope_dispatch import tables
from rope_dispatch.backends import triton_tables
from test_rate_table import definition_angles, random_rates

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALVES, PAIRS = 1, 2  # the flag's bits (triton_kernels.LINEAR_HALVES, LINEAR_PAIRS)
SHIPPED_MIN_ROWS_READ = triton_tables.LINEAR_MIN_ROWS_READ

pytestmark = pytest.mark.usefixtures("triton_backend")


@pytest.fixture(autouse=True)
def every_call_looks(monkeypatch):
    """Calls of any size look for their table's flag; no flag or first sight carries over."""
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 0)
    monkeypatch.setattr(triton_tables, "_flags", {})
    monkeypatch.setattr(triton_tables, "_flags_met", {})
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES", raising=False)


def flag_value(table: torch.Tensor) -> int | None:
    """The flag the backend holds for ``table`` (as the kernels see it: ``[s2, d2]``), after
    looking twice (a table's first sight gets none); ``None`` when it keeps none."""
    table = tables.angles_2d(table)
    triton_tables.linear_flag(table)
    flag = triton_tables.linear_flag(table)
    return None if flag is None else int(flag.item())


def held_flags() -> list[int]:
    return [int(flag.item()) for flag in triton_tables._flags.values()]


def linear_table(rows: int, pairs: int, interleaved: bool, seed: int = 5) -> torch.Tensor:
    """``[rows, 1, 1, 2 * pairs]``: each entry the float32 product of its row and its pair's
    random rate (written from the definition, not by the library)."""
    angles = definition_angles(random_rates(seed, pairs), rows, interleaved)
    return angles.view(rows, 1, 1, 2 * pairs).to(DEVICE)


# --- which tables earn the flag -------------------------------------------------------------

def test_model_tables_earn_their_pairing_bit():
    inv_freq = tables.inverse_frequencies(16, 10000.0)
    assert flag_value(tables.angle_table(inv_freq, 50).to(DEVICE)) == HALVES
    assert flag_value(tables.angle_table(inv_freq, 50, interleaved=True).to(DEVICE)) == PAIRS
    same_rate = torch.full((4,), 0.3)  # every pair turns alike: both pairings
    assert flag_value(tables.angle_table(same_rate, 9).to(DEVICE)) == HALVES | PAIRS
    f = tables.from_te_options(16, 64, device=DEVICE)
    assert flag_value(f.angle_table(64)) == HALVES  # TransformerEngine's own table


@pytest.mark.parametrize("change", [
    "offset", "one ulp in the last row", "negative zero in row 0", "halves differ in row 1",
    "a nan", "scaled positions",
])
def test_tables_that_are_not_linear_earn_nothing(change):
    rows, d2 = 33, 8
    inv_freq = random_rates(2, d2 // 2)
    angles = tables.angle_table(inv_freq, rows)
    if change == "offset":  # rows start at position 1
        angles = tables.angle_table(inv_freq, rows + 1)[1:].contiguous()
    elif change == "one ulp in the last row":
        angles[-1, 0, 0, 3] = torch.nextafter(angles[-1, 0, 0, 3], torch.tensor(1e9))
    elif change == "negative zero in row 0":
        angles[0, 0, 0, 1] = -0.0
    elif change == "halves differ in row 1":  # rows still p x row 1, but not rotate-half pairs
        angles = definition_angles(random_rates(3, d2), rows, False)[:, :d2].reshape(rows, 1, 1, d2)
    elif change == "a nan":
        angles[7, 0, 0, 0] = float("nan")
    else:  # TransformerEngine's interpolation: (p * 0.37) * rate, not p * (0.37 * rate)
        positions = torch.arange(rows, dtype=torch.float32) * 0.37
        angles = (positions[:, None] * torch.cat([inv_freq, inv_freq])[None, :]).view(rows, 1, 1, d2)
    assert flag_value(angles.to(DEVICE)) == 0


# --- results --------------------------------------------------------------------------------

def rows_read(run):
    """``run()`` with the flag switched off: the kernels read every row."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
        return run()


def check_linear(case, per_token: bool) -> None:
    t, _, spec, starts, case_angles = build(dataclasses.replace(case, use_cache=False), DEVICE)
    rows = max(2, case_angles.shape[0])  # the case's table length (a flag needs two rows)
    freqs = linear_table(rows, case.rotary_dim // 2, spec.interleaved, case.seed)
    angles = freqs.view(rows, -1).cpu()
    positions = positions_for(case, t, rows).to(DEVICE) if per_token else None
    grad_out = torch.randn(t.shape, dtype=torch.float32).to(t.dtype).to(DEVICE)

    def run():
        out = rd.apply(t, freqs, spec, start_positions=starts, positions=positions,
                       backend="triton")
        (grad,) = torch.autograd.grad(out, t, grad_out)
        return out.detach(), grad

    triton_tables._flags.clear()
    run()  # the table's first sight: its rows are read, and the next call looks for its flag
    out, grad = run()
    (held,) = held_flags()
    assert held & (PAIRS if spec.interleaved else HALVES)  # (one pair earns both bits)
    expected_out, expected_grad = rows_read(run)
    assert torch.equal(out, expected_out) and torch.equal(grad, expected_grad)
    ref_out, ref_grad = reference_forward_backward(
        t.detach().cpu(), angles, spec, grad_out.cpu(), None if starts is None else starts.cpu(),
        None if positions is None else positions.cpu(),
    )
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad, ref_grad, t.dtype, "backward")


@settings(max_examples=15, deadline=None)
@given(cases())
def test_results_are_those_of_the_rows(case):
    check_linear(case, per_token=False)


@settings(max_examples=8, deadline=None)
@given(cases(cp_sizes=(1,), starts=(False,)))
def test_per_token_positions(case):
    check_linear(case, per_token=True)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", ["in-place", "qk", "qk in place", "qkv"])
def test_other_entries_are_those_of_the_rows(interleaved, kind):
    gen = torch.Generator().manual_seed(4)
    freqs = linear_table(40, 4, interleaved)
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
    assert held_flags() == [PAIRS if interleaved else HALVES]
    for a, b in zip(got, rows_read(run)):
        assert torch.equal(a, b)
    if kind != "qkv":  # (packed qkv's q is split out of x's heads)
        angles = freqs.view(40, -1).cpu()
        assert_matches(got[0], reference_for(x.cpu(), angles, spec, starts.cpu()), x.dtype, "q")


def test_unread_positions_past_the_table_give_nan_rows(monkeypatch):
    monkeypatch.setattr(call_module, "_reads", lambda index: False)
    t = torch.randn(6, 3, 2, 8).to(DEVICE)  # sbhd: s 6, b 3
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=6)
    starts = torch.tensor([0, 7, 4], device=DEVICE)  # batch 1 needs rows 7..12 of 10
    freqs = linear_table(10, 3, False)
    rd.apply(t, freqs, spec, start_positions=starts, backend="triton")
    out = rd.apply(t, freqs, spec, start_positions=starts, backend="triton").cpu()
    assert held_flags() == [HALVES]
    bad = torch.zeros(6, 3, dtype=torch.bool)
    bad[3:, 1] = True
    assert torch.isnan(out[bad][..., :6]).all()
    assert torch.equal(out[bad][..., 6:], t.cpu()[bad][..., 6:])
    ref = reference_for(t.cpu(), linear_table(16, 3, False).view(16, -1).cpu(), spec, starts.cpu())
    torch.testing.assert_close(out[~bad].double(), ref[~bad], rtol=1e-5, atol=1e-5)


def test_the_kernels_take_the_flags_branch():
    """A flag forced on for a table that is not linear: both kernels then turn every token by
    its position times row 1, so they read the flag (and no other row)."""
    rows, d2 = 24, 8
    gen = torch.Generator().manual_seed(8)
    noise = (torch.rand(rows, 1, 1, d2, generator=gen) * 5).to(DEVICE)
    linear = linear_table(rows, d2 // 2, False)
    freqs = linear + noise
    freqs[1] = linear[1]  # row 1 as the linear table's, every other row off it
    assert flag_value(freqs) == 0
    (flag,) = triton_tables._flags.values()
    flag.fill_(HALVES)  # as if the check had passed at this version of the table
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(rows, 2, 3, d2, generator=gen).to(DEVICE)
    forced = rd.apply(x, freqs, spec, backend="triton")
    q_forced, k_forced = rd.apply_qk(x, x[..., :1, :], freqs, spec, backend="triton")
    expected = reference_for(x.cpu(), linear.view(rows, -1).cpu(), spec)
    assert_matches(forced, expected, x.dtype, "apply")
    assert_matches(q_forced, expected, x.dtype, "q")
    assert not torch.allclose(forced.cpu().double(), reference_for(x.cpu(), freqs.view(rows, -1).cpu(), spec))


# --- writes into the table ------------------------------------------------------------------

def test_a_write_into_the_table_is_seen_by_the_next_call():
    freqs = linear_table(30, 4, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(30, 2, 2, 8).to(DEVICE)
    rd.apply(x, freqs, spec, backend="triton")
    rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
    kept = freqs[9].clone()
    freqs[9, 0, 0, 2] += 0.5  # no longer linear
    out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [0]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype, "after")
    freqs[9] = kept  # linear again: checked again, flagged again
    out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype, "back")


def test_a_flag_being_checked_shows_no_guess(monkeypatch):
    """While a written table's flag is checked again, the flag the kernels read holds its last
    checked value: a launch another thread queues then (on the same stream) read the check's
    starting guess, 'linear', of a table no longer linear."""
    from rope_dispatch.backends import triton_kernels

    freqs = linear_table(30, 4, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(30, 2, 2, 8).to(DEVICE)
    rd.apply(x, freqs, spec, backend="triton")
    rd.apply(x, freqs, spec, backend="triton")
    freqs[9, 0, 0, 2] += 0.5  # no longer linear: its flag is checked at the next call
    seen = []
    kernel = triton_kernels.linear_table_kernel

    class Watched:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(held_flags())  # what a launch queued now would read
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "linear_table_kernel", Watched())
    out = rd.apply(x, freqs, spec, backend="triton")
    assert seen == [[HALVES]] and held_flags() == [0]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype)


@pytest.mark.parametrize("kind", ["apply", "qk"])
def test_a_write_that_breaks_linearity_is_read_by_both_passes(kind):
    """A write after the table's first sight that makes it no longer linear: the next forward
    checks the flag again and both passes read the rows, as with the flag switched off; a
    write between that forward and its backward makes the backward raise (it reads the table
    again and would differentiate a rotation that never ran)."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, 2, 2, 8, generator=gen).to(DEVICE)
    grad_out = torch.randn(30, 2, 2, 8, generator=gen).to(DEVICE)

    def run(write_between: bool = False):
        freqs = linear_table(30, 4, False)
        leaf = x.clone().requires_grad_(True)

        def call():
            if kind == "apply":
                return rd.apply(leaf, freqs, spec, backend="triton")
            return rd.apply_qk(leaf, leaf * 2, freqs, spec, backend="triton")[0]

        call()  # first sight
        if not write_between:
            freqs[4, 0, 0, 1] += 0.25
        out = call()
        if write_between:
            freqs[4, 0, 0, 1] += 0.25
            with pytest.raises(rd.RoPEError, match="modified in place between the forward"):
                torch.autograd.grad(out, leaf, grad_out)
            return None, freqs
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
        return grad, freqs

    run(write_between=True)
    grad, freqs = run()
    assert 0 in held_flags()  # checked again by the forward after the write
    expected, _ = rows_read(run)
    assert torch.equal(grad, expected)
    if kind == "apply":
        _, ref_grad = reference_forward_backward(x.cpu(), freqs.view(30, -1).cpu(), spec, grad_out.cpu())
        assert_matches(grad, ref_grad, x.dtype, "backward")


# --- calls that never look for a flag -------------------------------------------------------

def test_calls_that_read_their_rows(monkeypatch):
    x = torch.randn(12, 1, 2, 8).to(DEVICE)

    def held_after_two_calls(freqs) -> list[int]:
        # a spec of its own: on a GPU, plans kept under another phase's spec would answer
        spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
        triton_tables._flags.clear()
        triton_tables._flags_met.clear()
        rd.apply(x, freqs, spec, backend="triton")
        out = rd.apply(x, freqs, spec, backend="triton")
        assert_matches(out, reference_for(x.cpu(), tables.angles_2d(freqs).cpu(), spec), x.dtype)
        return held_flags()

    freqs = linear_table(12, 4, False)
    assert held_after_two_calls(freqs) == [HALVES]
    with torch.inference_mode():  # no version counter would tell a later write
        frozen = linear_table(12, 4, False)
    assert held_after_two_calls(frozen) == []
    wide = torch.empty(12, 1, 1, 16, device=DEVICE)[..., ::2]  # strided: copied per call
    wide.copy_(freqs)
    assert held_after_two_calls(wide) == []
    monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
    assert held_after_two_calls(freqs) == []
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES")
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 12 * 8 + 1)  # tokens x d2 = 96
    assert held_after_two_calls(freqs) == []
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 12 * 8)
    assert held_after_two_calls(freqs) == [HALVES]
    assert triton_tables.linear_flag(tables.angles_2d(linear_table(1, 4, False))) is None


def test_the_switch_stops_flags_already_made(monkeypatch):
    """``ROPE_DISPATCH_LINEAR_TABLES=0`` set after a flag was made: the backward of a forward
    that used it, and later calls (planned ones on a GPU), read the rows. A flag forced on for a
    table that is not linear tells which path ran."""
    rows, d2 = 24, 8
    gen = torch.Generator().manual_seed(9)
    freqs = linear_table(rows, d2 // 2, False) + (torch.rand(rows, 1, 1, d2, generator=gen) * 5).to(DEVICE)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(rows, 2, 3, d2, generator=gen).to(DEVICE)
    grad_out = torch.randn(rows, 2, 3, d2, generator=gen).to(DEVICE)
    assert flag_value(freqs) == 0
    (flag,) = triton_tables._flags.values()
    flag.fill_(HALVES)  # as if the check had passed at this version of the table
    angles = freqs.view(rows, -1).cpu()
    for _ in range(3):  # planned from the second call on (on a GPU)
        rd.apply(x, freqs, spec, backend="triton")
    leaf = x.clone().requires_grad_(True)
    forced = rd.apply(leaf, freqs, spec, backend="triton")
    assert not torch.allclose(forced.detach().cpu().double(), reference_for(x.cpu(), angles, spec))
    monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
    (grad,) = torch.autograd.grad(forced, leaf, grad_out)
    _, ref_grad = reference_forward_backward(x.cpu(), angles, spec, grad_out.cpu())
    assert_matches(grad, ref_grad, x.dtype, "backward")
    assert_matches(rd.apply(x, freqs, spec, backend="triton"), reference_for(x.cpu(), angles, spec),
                   x.dtype, "next call")


def test_the_switch_takes_the_spellings_of_an_on_off_variable(monkeypatch):
    """``ROPE_DISPATCH_LINEAR_TABLES`` reads as ``ROPE_AUTOTUNE`` does: false, off, no (any
    case) turn the flags off like 0, where they left them on; a value neither on nor off is
    refused by name, on the generic path and on a plan's (which goes to the generic path)."""
    freqs = tables.angle_table(tables.inverse_frequencies(16, 10000.0), 50).to(DEVICE)
    for on in ("1", "true", " Yes ", ""):
        monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", on)
        triton_tables._flags.clear()
        assert flag_value(freqs) == HALVES, on
    (flag,) = triton_tables._flags.values()
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", off)
        assert flag_value(freqs) is None, off
        assert triton_tables.flag_stale(flag, tables.angles_2d(freqs), 0), off
    monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "disabled")
    with pytest.raises(rd.RoPEError, match="ROPE_DISPATCH_LINEAR_TABLES must be .*'disabled'"):
        flag_value(freqs)
    assert triton_tables.flag_stale(flag, tables.angles_2d(freqs), 0)


def test_capture_is_asked_about_only_off_the_legacy_default_stream(monkeypatch):
    """A plan's check of its flag, and the generic path's, ask the driver whether a graph is
    being captured only where one can be: never on the legacy default stream (raw address 0),
    which CUDA and ``torch.cuda.graph`` refuse to capture and where most training runs.
    Elsewhere a capture stops the flag; a write into the table and the switch stop it on every
    stream."""
    freqs = torch.zeros(8, 4)
    flag = torch.zeros(1, dtype=torch.int32)
    flag._rope_version = freqs._version
    asked: list[bool] = []
    answer = {"capturing": False}

    def stream_capturing() -> bool:
        asked.append(answer["capturing"])
        return answer["capturing"]

    monkeypatch.setattr(triton_tables, "_stream_capturing", stream_capturing)
    default, side = 0, 0x7F00  # raw stream addresses
    monkeypatch.setattr(triton_tables, "current_stream", {0: default, 1: side}.__getitem__)
    stale = triton_tables.flag_stale
    assert not stale(flag, freqs, default) and asked == []
    assert not stale(flag, freqs, side) and asked == [False]
    answer["capturing"] = True
    assert stale(flag, freqs, side) and asked == [False, True]
    assert not stale(flag, freqs, default) and len(asked) == 2
    monkeypatch.setenv("ROPE_DISPATCH_LINEAR_TABLES", "0")
    assert stale(flag, freqs, default)
    monkeypatch.delenv("ROPE_DISPATCH_LINEAR_TABLES")
    freqs[3, 1] = 1.0
    assert stale(flag, freqs, default)
    asked.clear()
    on_device = {index: SimpleNamespace(is_cuda=True, get_device=lambda index=index: index)
                 for index in (0, 1)}  # what the generic path reads of a CUDA table
    assert not triton_tables._capturing(on_device[0]) and asked == []
    assert triton_tables._capturing(on_device[1]) and asked == [True]


def test_a_flag_made_in_inference_mode_serves_outside_it():
    """Serving code finds a table's flag under inference mode; a training-style call after a
    write into the table checks it again outside inference mode."""
    freqs = linear_table(30, 4, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x = torch.randn(30, 2, 2, 8).to(DEVICE)
    with torch.inference_mode():
        rd.apply(x, freqs, spec, backend="triton")
        rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
    freqs[3, 0, 0, 0] += 1.0
    leaf = x.clone().requires_grad_(True)
    out = rd.apply(leaf, freqs, spec, backend="triton")
    assert held_flags() == [0]
    assert_matches(out, reference_for(x.cpu(), freqs.view(30, -1).cpu(), spec), x.dtype)


def test_a_flag_goes_with_its_table():
    freqs = linear_table(20, 4, False)
    assert flag_value(freqs) == HALVES
    assert len(triton_tables._flags) == 1
    del freqs
    gc.collect()
    assert triton_tables._flags == {}


def test_the_shipped_threshold_leaves_decode_calls_alone(monkeypatch):
    """With the shipped threshold (2**18 row entries: 1 MiB of float32 rows read), a
    decode-size call never looks for a flag (its host path counts); a prefill-size one does."""
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", SHIPPED_MIN_ROWS_READ)
    assert SHIPPED_MIN_ROWS_READ == 1 << 18
    freqs = linear_table(2048, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    decode = torch.randn(1, 64, 1, 128).to(DEVICE)
    for _ in range(3):
        rd.apply(decode, freqs, spec, backend="triton")
    assert held_flags() == []
    prefill = torch.randn(2048, 1, 1, 128).to(DEVICE)
    for _ in range(2):
        out = rd.apply(prefill, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
    assert_matches(out, reference_for(prefill.cpu(), freqs.view(2048, -1).cpu(), spec), out.dtype)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_the_threshold_counts_the_rows_a_call_reads_not_its_tokens(monkeypatch, layout):
    """Batch entries of sbhd and bshd share their rows: 128 tokens of 32-token sequences read
    32 rows, under a threshold of 64 rows (of 32 channels), and read them (no flag); the same
    tensor with start positions places its tokens on up to 128 rows and looks. Every call is
    right either way."""
    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 64 * 32)
    freqs = linear_table(160, 16, False)
    spec = rd.RoPESpec(layout=layout, dtype="fp32")
    batch = torch.randn(32, 4, 2, 32).to(DEVICE)
    batch = batch if layout == "sbhd" else batch.transpose(0, 1).contiguous()
    for _ in range(3):
        out = rd.apply(batch, freqs, spec, backend="triton")
    assert held_flags() == []
    assert_matches(out, reference_for(batch.cpu(), freqs.view(160, -1).cpu(), spec), out.dtype)
    starts = torch.tensor([0, 32, 64, 96]).to(DEVICE)
    for _ in range(2):
        out = rd.apply(batch, freqs, spec, start_positions=starts, backend="triton")
    assert held_flags() == [HALVES]
    expected = reference_for(batch.cpu(), freqs.view(160, -1).cpu(), spec,
                             start_positions=starts.cpu())
    assert_matches(out, expected, out.dtype)


# --- on the GPU: plans and CUDA graphs ------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_transformer_engines_own_tables_earn_the_flag(interleaved):
    """TE's RotaryPositionEmbedding (no interpolation) makes float32 products on the GPU: its
    table is read as rates, and gives TE's own fused results."""
    pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine is not installed")
    from transformer_engine.pytorch.attention import rope

    module = rope.RotaryPositionEmbedding(128, interleaved=interleaved).cuda()
    freqs = module(4096)
    assert flag_value(freqs) == (PAIRS if interleaved else HALVES)
    x = torch.randn(4096, 2, 4, 128, device="cuda").bfloat16()
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16", interleaved=interleaved)
    ours = rd.apply(x, freqs, spec, backend="triton")
    theirs = rope.apply_rotary_pos_emb(x, freqs, tensor_format="sbhd", interleaved=interleaved,
                                       fused=True)
    assert_matches(ours, theirs.double().cpu(), x.dtype, "against TE")
    assert_matches(ours, reference_for(x.cpu(), freqs.view(4096, -1).cpu(), spec), x.dtype)


@gpu
def test_planned_calls_see_writes_into_the_table():
    freqs = linear_table(64, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = torch.randn(64, 2, 4, 128, device="cuda").bfloat16()
    for _ in range(4):  # planned from the second call on
        out = rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
    freqs[10, 0, 0, 5] += 1.0
    out = rd.apply(x, freqs, spec, backend="triton")
    assert_matches(out, reference_for(x.cpu(), freqs.view(64, -1).cpu(), spec), x.dtype)
    leaf = x.clone().requires_grad_(True)
    for call in range(3):
        if call == 2:  # after planned calls: the plan's forward and backward read the write
            freqs[11, 0, 0, 5] += 1.0
        out = rd.apply(leaf, freqs, spec, backend="triton")
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out), retain_graph=True)
    _, ref_grad = reference_forward_backward(x.cpu(), freqs.view(64, -1).cpu(), spec,
                                             torch.ones(out.shape, dtype=x.dtype))
    assert_matches(grad, ref_grad, x.dtype, "backward")
    freqs[12, 0, 0, 5] += 1.0  # between the forward and the backward
    with pytest.raises(rd.RoPEError, match="modified in place between the forward"):
        torch.autograd.grad(out, leaf, torch.ones_like(out))


@gpu
def test_a_graph_replay_reads_the_rows_of_the_table_as_it_is():
    """Captured calls never use the flag: a table written between replays is read anew."""
    freqs = linear_table(64, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = torch.randn(64, 2, 4, 128, device="cuda").bfloat16()
    for _ in range(3):
        rd.apply(x, freqs, spec, backend="triton")
    assert held_flags() == [HALVES]
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


@gpu
@pytest.mark.parametrize("warm_on", ["default stream", "side stream"])
def test_a_step_captured_whole_reads_the_rows_of_the_table_as_it_is(warm_on):
    """Forward and backward captured in one graph (as whole-step capture and
    ``make_graphed_callables`` do) after planned eager steps that read the flag, on the default
    stream (no capture query) or a side stream: the graph reads the rows, so a table written
    between replays is seen by both."""
    freqs = linear_table(64, 64, False)
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    x = torch.randn(64, 2, 4, 128, device="cuda").bfloat16()
    grad_out = torch.randn_like(x)
    leaf = x.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side if warm_on == "side stream" else None):
        for _ in range(3):  # planned from the second call on
            torch.autograd.grad(rd.apply(leaf, freqs, spec, backend="triton"), leaf, grad_out)
    torch.cuda.current_stream().wait_stream(side)
    assert held_flags() == [HALVES]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rd.apply(leaf, freqs, spec, backend="triton")
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
    freqs[20, 0, 0, 7] += 1.0
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_grad = reference_forward_backward(x.cpu(), freqs.view(64, -1).cpu(), spec,
                                                   grad_out.cpu())
    assert_matches(out, ref_out, x.dtype, "replayed forward")
    assert_matches(grad, ref_grad, x.dtype, "replayed backward")
