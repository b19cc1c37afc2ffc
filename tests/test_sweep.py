"""The sweep benchmark's CPU side: its points, byte counts, table and JSON, and its refusal
without a CUDA device (the measurements themselves run on the GPU machine)."""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch

from benchmarks import bench, sweep
from reference import max_error, reference_forward_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the triton backend: CUDA, else its interpreter

EVERY_DTYPE = [torch.bfloat16, torch.float16, torch.float32]


def test_points_cover_every_layout_and_dtype():
    points = sweep.sweep_points(sweep.LAYOUTS, EVERY_DTYPE)
    assert {(p.layout, p.dtype) for p in points} == {
        (layout, dtype) for layout in sweep.LAYOUTS for dtype in EVERY_DTYPE
    }


def test_default_points_are_bf16_only():
    assert {p.dtype for p in sweep.sweep_points()} == {torch.bfloat16}


@pytest.mark.parametrize("layout", sweep.LAYOUTS)
def test_each_layout_has_one_to_eight_heads_and_the_whole_length_range(layout):
    points = [p for p in sweep.sweep_points() if p.layout == layout]
    assert {1, 8} <= {p.heads for p in points}
    assert min(p.seq for p in points) == 128
    assert max(p.seq for p in points) == 131072
    assert {64, 128, 256} <= {p.head_dim for p in points}


def test_partial_rotary_point_is_present():
    points = sweep.sweep_points()
    partial = [p for p in points if p.rotary_dim < p.head_dim]
    assert partial and all(p.rotary_dim * 2 == p.head_dim for p in partial)
    assert {p.layout for p in partial} == set(sweep.LAYOUTS)


def test_size_cap_is_respected_and_leaves_out_the_largest_fp32_points():
    kept = sweep.sweep_points(sweep.LAYOUTS, EVERY_DTYPE)
    assert all(p.tensor_bytes() <= sweep.MAX_TENSOR_BYTES for p in kept)
    every = [
        sweep.make_point(layout, dtype, series, seq)
        for layout in sweep.LAYOUTS for dtype in EVERY_DTYPE
        for series in sweep.SERIES for seq in series.seq_lens
    ]
    dropped = [p for p in every if p.name not in {k.name for k in kept}]
    assert dropped and all(p.tensor_bytes() > sweep.MAX_TENSOR_BYTES for p in dropped)


def test_point_names_are_unique():
    names = [p.name for p in sweep.sweep_points(sweep.LAYOUTS, EVERY_DTYPE)]
    assert len(names) == len(set(names))


def test_qkv_points_are_packed_calls_in_sbhd_and_bshd_within_the_cap():
    points = sweep.sweep_points(sweep.LAYOUTS, EVERY_DTYPE, qkv=True)
    assert {p.layout for p in points} == set(sweep.QKV_LAYOUTS)
    assert all(p.qkv == (512, 128, 128) and p.name.startswith("qkv ") for p in points)
    assert all(p.tensor_bytes() <= sweep.MAX_TENSOR_BYTES for p in points)
    assert min(p.seq for p in points) == 128
    # 12 KiB a token in bf16: 32,768 tokens are 384 MiB, 131,072 over the cap
    assert max(p.seq for p in points if p.dtype == torch.bfloat16) == 32768
    assert len({p.name for p in points}) == len(points)
    assert not any(p.qkv for p in sweep.sweep_points(sweep.LAYOUTS, EVERY_DTYPE))
    with pytest.raises(ValueError, match="thd"):
        sweep.make_point("thd", torch.bfloat16, sweep.QKV_SERIES[0], 512)


def test_qkv_point_measures_ours_and_says_why_liger_is_absent(triton_backend, monkeypatch):
    """A packed qkv point on the measuring path (the clock and profiler replaced, each callable
    run once): ours with every table kind, no in-place figures (a packed call has no in-place
    form), Liger absent with the reason, its own line in the plots' grouping."""
    def once(fn, *args, **kwargs):
        fn()
        return 0.002

    monkeypatch.setattr(sweep, "bench_ms", once)
    monkeypatch.setattr(sweep, "count_launches", lambda fn: 1)
    monkeypatch.setattr(sweep, "host_rounds", lambda fns, calls, rounds: (
        {n: [1.0] for n in fns}, {n: (fn(), [3.0])[1] for n, fn in fns.items()}))
    monkeypatch.setattr(sweep, "graph_replay_us", lambda fn: (fn(), 1.5)[1])
    monkeypatch.setattr(sweep, "cold_kernel_us",
                        lambda fns, calls, copies=False: {n: (fn(), 1.2)[1] for n, fn in fns.items()})
    monkeypatch.setattr(sweep, "cold_kernel_samples",
                        lambda fns, calls: {n: (fn(), [1.2])[1] for n, fn in fns.items()})
    monkeypatch.setattr(sweep, "_te_peer", lambda shape, inp: None)
    series = sweep.Series(1, 2, 16, 16, (), "", qkv=(32, 16, 16))
    shape = sweep.make_point("sbhd", torch.float32, series, 8)
    record = sweep.run_point(shape, peers=True, device=DEVICE)
    for name in ("triton", "triton-rows", "triton-cache"):
        ours = record["implementations"][name]
        assert ours["fwd_us"] == ours["bwd_kernel_us"] == pytest.approx(2.0)
        assert "fwd_in_place_us" not in ours
    assert "packed qkv" in record["implementations"]["liger"]["absent"]
    assert record["qkv"] == [32, 16, 16]
    plain = sweep.describe(sweep.make_point("sbhd", torch.float32, sweep.Series(1, 2, 16, 16, (), ""), 8))
    assert sweep.series_key(record) != sweep.series_key(plain)


def test_thd_points_pack_several_sequences_summing_to_the_token_count():
    thd = [p for p in sweep.sweep_points() if p.layout == "thd"]
    assert thd
    for p in thd:
        assert p.seqlens is not None and len(p.seqlens) == p.n_seqs >= 2
        assert sum(p.seqlens) == p.seq
        assert min(p.seqlens) > 0
        assert p.dims() == (p.seq, p.heads, p.head_dim)


def test_thd_lengths_reach_make_inputs():
    shape = sweep.make_point("thd", torch.float32, sweep.SERIES[0], 128)
    inp = bench.make_inputs(shape, device="cpu")
    assert inp.cu_seqlens.tolist() == [0, *torch.tensor(shape.seqlens).cumsum(0).tolist()]


def test_quick_is_a_handful_of_points_per_layout():
    quick = sweep.sweep_points(quick=True)
    assert {p.layout for p in quick} == set(sweep.LAYOUTS)
    assert len(quick) <= 5 * len(sweep.LAYOUTS)


def test_bytes_moved_counts_one_read_and_one_write():
    sbhd = sweep.make_point("sbhd", torch.bfloat16, sweep.Series(4, 8, 128, 128, (), ""), 2048)
    assert sbhd.dims() == (2048, 4, 8, 128)
    assert sweep.bytes_moved(sbhd) == 2 * (2048 * 4 * 8 * 128) * 2  # 32 MiB
    fp32 = sweep.make_point("bshd", torch.float32, sweep.Series(1, 1, 256, 128, (), ""), 512)
    assert sweep.bytes_moved(fp32) == 2 * (512 * 256) * 4
    thd = sweep.make_point("thd", torch.bfloat16, sweep.Series(1, 32, 128, 64, (), ""), 8192)
    assert sweep.bytes_moved(thd) == 2 * (8192 * 32 * 128) * 2  # the pass-through half moves too


def test_large_flag_follows_the_input_tensor_size():
    series = sweep.Series(1, 8, 128, 128, (), "")
    below = sweep.describe(sweep.make_point("sbhd", torch.bfloat16, series, 16384))  # 32 MiB
    at = sweep.describe(sweep.make_point("sbhd", torch.bfloat16, series, 32768))  # 64 MiB
    assert (below["points_at_least_64MB"], at["points_at_least_64MB"]) == (False, True)
    assert at["tensor_bytes"] == 64 * 2**20 and at["bytes_moved"] == 128 * 2**20


def _synthetic_point(layout: str, seq: int) -> dict:
    """A measured point as run_point records it, with made-up times."""
    shape = sweep.make_point(layout, torch.bfloat16, sweep.SERIES[1], seq)
    record = sweep.describe(shape)
    record["copy_us"] = 50.0
    record["implementations"] = {
        "triton": {
            "label": "triton", "fwd_us": 52.5, "fwd_pct_of_copy": 95.238, "bwd_kernel_us": 55.0,
            "bwd_kernel_pct_of_copy": 90.909, "fwd_bwd_us": 120.0, "fwd_bwd_pct_of_copy": 83.333,
            "fwd_bwd_host_us": 97.25, "launches_fwd": 1, "launches_fwd_bwd": 2,
        },
        "te": {
            "label": "TE fused (peer)", "fwd_us": 100.0, "fwd_pct_of_copy": 50.0,
            "bwd_kernel_us": None, "bwd_kernel_pct_of_copy": None, "fwd_bwd_us": 200.0, "fwd_bwd_pct_of_copy": 50.0,
            "launches_fwd": 1, "launches_fwd_bwd": None,
        },
        "liger": {"label": "Liger (peer)", "absent": "Liger's API takes no packed (thd) batch"},
    }
    return record


def test_table_has_one_line_per_point_and_implementation():
    points = [_synthetic_point("sbhd", 32768), _synthetic_point("thd", 2048)]
    lines = sweep.format_table(points).splitlines()
    assert len(lines) == 2 + 2 * 3
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert "points_at_least_64MB" in header and "copy us" in header
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    triton = [c.strip() for c in lines[2].strip("|").split("|")]
    row = dict(zip(header, triton))
    assert row["layout"] == "sbhd" and row["seq (tokens for thd)"] == "32768"
    assert row["MiB moved"] == "128.0" and row["points_at_least_64MB"] == "yes"
    assert row["fwd us (% copy; ours in place too)"] == "52.5 (95%)"
    assert row["bwd kernel us (% copy; ours in place too)"] == "55.0 (91%)"
    assert row["fwd+bwd us (% of 2 copies)"] == "120.0 (83%)"
    assert row["fwd+bwd host clock us (in turn)"] == "97.2"
    assert row["launches fwd/fwd+bwd"] == "1/2"
    te = dict(zip(header, [c.strip() for c in lines[3].strip("|").split("|")]))
    assert te["bwd kernel us (% copy; ours in place too)"] == "-" and te["launches fwd/fwd+bwd"] == "1/-"
    assert te["fwd+bwd host clock us (in turn)"] == "-"  # not measured (a point of 64 MiB and up)
    liger = dict(zip(header, [c.strip() for c in lines[-1].strip("|").split("|")]))
    assert liger["points_at_least_64MB"] == "no" and liger["batch (sequences for thd)"] == "4"
    assert liger["fwd us (% copy; ours in place too)"].startswith("absent: Liger's API")


def test_write_produces_json_and_markdown(tmp_path):
    report = sweep.SweepReport("a GPU", "2026-11-23", {"torch": "2.x"},
                               [_synthetic_point("bshd", 512)])
    sweep.write(report, tmp_path)
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["device"] == "a GPU" and len(data["points"]) == 1
    point = data["points"][0]
    assert point["bytes_moved"] == 2 * 512 * 8 * 128 * 2
    assert point["implementations"]["triton"]["launches_fwd_bwd"] == 2
    text = (tmp_path / "sweep.md").read_text()
    assert text.startswith("a GPU, 2026-11-23") and "| bshd | bf16 | 512 |" in text


def test_plots_are_skipped_with_one_line_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "pyplot", lambda: None)
    report = sweep.SweepReport("a GPU", "2026-11-23", {}, [_synthetic_point("sbhd", 512)])
    assert sweep.write_plots(report, tmp_path) == []
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_plots_show_ours_in_place_on_the_bytes_it_moves():
    """Ours in place (Liger's like for like) is plotted as % of the copy's share of the rotary
    channels: below 64 MiB from the profiler's times (a 2 us copy, half the channels rotated
    in 1.25 us: 80%), else do_bench's recorded %; nothing where it was not timed."""
    point = _synthetic_point("sbhd", 512)
    point.update(head_dim=128, rotary_dim=64, copy_profiled_us=2.0)
    ours = point["implementations"]["triton"]
    ours.update(fwd_in_place_profiled_us=1.25, bwd_in_place_profiled_us=1.0,
                fwd_in_place_pct_of_copy=60.0, bwd_in_place_pct_of_copy=70.0)
    assert sweep.plotted_in_place_pct(point, "fwd") == pytest.approx(80.0)
    assert sweep.plotted_in_place_pct(point, "bwd kernel") == pytest.approx(100.0)
    point["copy_profiled_us"] = None  # from 64 MiB: no profiled copy
    assert sweep.plotted_in_place_pct(point, "fwd") == 60.0
    assert sweep.plotted_in_place_pct(point, "bwd kernel") == 70.0
    for key in list(ours):
        if "in_place" in key:
            del ours[key]
    assert sweep.plotted_in_place_pct(point, "fwd") is None


def test_plot_draws_a_line_per_implementation_and_ours_in_place(tmp_path, monkeypatch):
    """Without matplotlib's drawing (a recording stand-in): each panel gets a forward and a
    backward line per implementation measured, and ours in place's two lines beside them."""
    drawn = {}

    def axes_stub():
        ax = mock.MagicMock()
        ax.get_legend_handles_labels.return_value = ([], [])
        ax.plot.side_effect = lambda x, y, style, **kw: drawn.setdefault(kw["label"], list(y))
        return ax

    plt = mock.MagicMock()
    plt.subplots.side_effect = lambda rows, cols, **kw: (
        mock.MagicMock(), mock.NonCallableMock(flat=[axes_stub() for _ in range(rows * cols)]))
    monkeypatch.setattr(sweep, "pyplot", lambda: plt)
    points = [_synthetic_point("sbhd", seq) for seq in (512, 2048)]
    for point in points:
        point.update(copy_profiled_us=2.0)
        point["implementations"]["triton"].update(fwd_in_place_profiled_us=2.5,
                                                  bwd_in_place_profiled_us=2.0)
    report = sweep.SweepReport("a GPU", "2026-11-28", {}, points)
    assert sweep.plot_layout(report, "sbhd", tmp_path / "p.png")
    assert drawn["triton fwd"] == pytest.approx([95.238, 95.238])
    assert drawn["triton in place fwd"] == pytest.approx([80.0, 80.0])
    assert drawn["triton in place bwd kernel"] == pytest.approx([100.0, 100.0])
    assert "TE fused (peer) fwd" in drawn and "Liger (peer) fwd" not in drawn  # absent there


def test_series_key_joins_only_points_differing_in_length():
    a, b = _synthetic_point("sbhd", 512), _synthetic_point("sbhd", 8192)
    other = sweep.describe(sweep.make_point("sbhd", torch.bfloat16, sweep.SERIES[0], 512))
    assert sweep.series_key(a) == sweep.series_key(b) != sweep.series_key(other)


def test_main_returns_2_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--out", str(tmp_path / "out"), "--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--layouts", "--dtypes", "--quick", "--qkv", "--no-peers"):
        assert option in text


def test_unknown_layout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--out", "x", "--layouts", "sbhd,hbsd"])
    assert exit_info.value.code == 2
    assert "hbsd" in capsys.readouterr().err


@pytest.mark.parametrize("layout, large", [("sbhd", False), ("thd", False), ("sbhd", True)])
def test_run_point_records_every_implementation(triton_backend, monkeypatch, layout, large):
    """The measuring path end to end (on Triton's CPU interpreter without CUDA), with the clock and the
    profiler replaced (each callable still runs once): peers absent here say why. A point of
    64 MiB and more (here by a lowered threshold) times our forward and backward kernel in turn
    with the copy, gets fewer host-clock calls and no warm forward."""
    if large:
        monkeypatch.setattr(sweep, "LARGE_TENSOR_BYTES", 0)
    ran, copies = [], []

    def one_call_ms(fn, rep=100):  # 2 us a call; the copy timed in turn 1.9 us
        fn()
        ran.append(fn)
        if fn.__name__ == "copy":
            copies.append(rep)
            return 0.002 if len(copies) == 1 else 0.0019
        return 0.002

    monkeypatch.setattr(sweep, "bench_ms", one_call_ms)
    monkeypatch.setattr(sweep, "count_launches", lambda fn: 1)
    in_turn = []

    def host_clock(fns, calls, rounds):  # each fwd+bwd runs once; 3 us end to end each
        assert (calls, rounds) == ((sweep.LARGE_HOST_CALLS, sweep.LARGE_HOST_ROUNDS) if large
                                   else (sweep.HOST_CALLS, sweep.HOST_ROUNDS))
        for name, fn in fns.items():
            fn()
            in_turn.append(name)
        return {name: [1.0] * rounds for name in fns}, {name: [3.0] * rounds for name in fns}

    monkeypatch.setattr(sweep, "host_rounds", host_clock)
    warm = []

    def replayed_us(fn):  # a CUDA graph's replay: each forward runs once here
        fn()
        warm.append(fn)
        return 1.5

    monkeypatch.setattr(sweep, "graph_replay_us", replayed_us)
    written = []

    def written_us(fn, write):  # the graph of a copy into fn's input, then fn, less the copy's
        write()
        fn()
        written.append(fn)
        return 0.5

    monkeypatch.setattr(sweep, "written_replay_us", written_us)
    profiled = []

    def kernel_us(fns, calls, copies=False):  # a profiler's trace of the copy (memcpy rows
        assert calls == sweep.PROFILED_CALLS  # kept): it runs once here, 0.9 us
        assert copies and list(fns) == ["copy"]
        fns["copy"]()
        profiled.append(sorted(fns))
        return {"copy": 0.9}

    def kernel_samples(fns, calls):  # the kernels' trace: each call runs once here, 1.2 us
        assert calls == sweep.PROFILED_CALLS  # in each of `calls` rounds
        for fn in fns.values():
            fn()
        profiled.append(sorted(fns))
        return {key: [1.2] * calls for key in fns}

    monkeypatch.setattr(sweep, "cold_kernel_us", kernel_us)
    monkeypatch.setattr(sweep, "cold_kernel_samples", kernel_samples)
    # the peers as absent (a module already imported by another test cannot be hidden)
    monkeypatch.setattr(sweep, "_te_peer", lambda shape, inp: None)
    monkeypatch.setattr(sweep, "_liger_peer", lambda shape, inp: None)
    shape = sweep.make_point(layout, torch.float32, sweep.Series(1, 2, 16, 8, (), ""), 32)
    record = sweep.run_point(shape, peers=True, device=DEVICE)
    # the copy, then fwd, bwd kernel, fwd+bwd of triton with the angle table, with its rows
    # read, and with the cos/sin cache in t's dtype, then ours in place forward and backward;
    # from 64 MiB our fwd and bwd kernel each in IN_TURN_ROUNDS rounds after a copy, over
    # IN_TURN_REP_MS
    rounds = sweep.IN_TURN_ROUNDS
    assert len(ran) == (1 + 4 * rounds + 1 + 6 + 2 if large else 12)
    assert copies == [100] + ([sweep.IN_TURN_REP_MS] * 2 * rounds if large else [])
    for name in ("triton", "triton-rows", "triton-cache"):
        triton = record["implementations"][name]
        assert triton["fwd_us"] == triton["bwd_kernel_us"] == pytest.approx(2.0)
        assert triton["fwd_bwd_pct_of_copy"] == pytest.approx(200.0)  # two copies' bytes
        assert triton["launches_fwd"] == triton["launches_fwd_bwd"] == 1
        # ours from 64 MiB as % of the copy timed in turn, the rest of the one at the start
        in_turn_copy = large and name == "triton"
        for mode in ("fwd", "bwd_kernel"):
            assert triton[f"{mode}_pct_of_copy"] == pytest.approx(95.0 if in_turn_copy else 100.0)
            assert triton.get(f"{mode}_copy_us") == (pytest.approx(1.9) if in_turn_copy else None)
    assert record["implementations"]["triton-rows"]["label"] == "triton (table rows read)"
    assert record["implementations"]["triton-cache"]["label"] == "triton (cos/sin cache, t's dtype)"
    # forward + backward on the host clock, ours measured in turn: 3 us for two copies of 2 us
    assert record["points_at_least_64MB"] is large
    assert in_turn == ["triton", "triton-rows", "triton-cache"]
    assert record["implementations"]["triton"]["fwd_bwd_host_us"] == 3.0
    assert record["implementations"]["triton"]["fwd_bwd_host_pct_of_copy"] == pytest.approx(
        100 * 2 * 2.0 / 3.0)
    # ours in place (apply_, its backward in place) at every point: 2 us for the rotary half
    # of a 2 us copy's bytes
    ours = record["implementations"]["triton"]
    for mode in ("fwd", "bwd"):
        assert ours[f"{mode}_in_place_us"] == pytest.approx(2.0)
        assert ours[f"{mode}_in_place_pct_of_copy"] == pytest.approx(50.0)
    table = sweep.format_table([record])
    assert f"| 2.0 ({95 if large else 100}%); in place 2.0 (50%) " * 2 in table
    # below 64 MiB each forward also from a graph, the L2 warm, and ours in place
    assert len(warm) == (0 if large else 4)
    assert [record["implementations"][n].get("fwd_warm_us") for n in in_turn] == (
        [None] * 3 if large else [1.5] * 3)
    assert ours.get("fwd_in_place_warm_us") == (None if large else 1.5)
    # and ours in place with its input written by a copy before each call, as in a model
    assert len(written) == (0 if large else 1)
    assert ours.get("fwd_in_place_written_warm_us") == (None if large else 0.5)
    # below 64 MiB every forward and backward kernel by the profiler too, in one trace, ours
    # in place among them (its backward through the engine, in place on the gradient)
    # (after the copy's own trace: their ceiling, timed as they are)
    assert profiled == ([] if large else [["copy"], sorted(
        f"{name}\0{mode}" for name in (*in_turn, sweep.IN_PLACE, sweep.IN_PLACE_AGAIN)
        for mode in ("fwd", "bwd_kernel")
    )])
    assert record.get("copy_profiled_us") == (None if large else 0.9)
    for name in in_turn:
        times = record["implementations"][name]
        assert times.get("fwd_profiled_us") == times.get("bwd_kernel_profiled_us") == (
            None if large else 1.2)
        for mode in ("fwd", "bwd_kernel"):  # what the plots show below 64 MiB: 0.9 / 1.2 us
            assert times.get(f"{mode}_profiled_pct_of_copy") == (
                None if large else pytest.approx(75.0))
            assert sweep.plotted_pct(times, mode.replace("_", " ")) == pytest.approx(
                times[f"{mode}_pct_of_copy"] if large else 75.0)
    assert ours.get("fwd_in_place_profiled_us") == ours.get("bwd_in_place_profiled_us") == (
        None if large else 1.2)
    # and again under a second name in the same trace: how far two medians of one kernel land
    assert ours.get("fwd_in_place_again_profiled_us") == ours.get(
        "bwd_in_place_again_profiled_us") == (None if large else 1.2)
    assert sweep.IN_PLACE not in record["implementations"]
    assert sweep.IN_PLACE_AGAIN not in record["implementations"]
    # the paired samples' intervals: ours in place against itself (no peer here to pair with)
    for mode in ("fwd", "bwd"):
        assert ours.get(f"{mode}_in_place_profiled_minus_again_us") == (
            None if large else [0.0, 0.0, 0.0])
        assert f"{mode}_in_place_profiled_minus_liger_us" not in ours
    assert not any("_minus_te_" in key for key in ours)
    if not large:
        table = sweep.format_table([record])
        assert ("1.50 (in place 1.50; written before: 0.50) | 1.20 / 1.20 (in place 1.20 / 1.20) |"
                in table)
        assert "| 1.20 / 1.20 | 1/1 |" in table  # the rows-read series: no in-place figures
    assert record["implementations"]["te"]["absent"] == "TransformerEngine is not importable"
    liger = record["implementations"]["liger"]["absent"]
    assert "thd" in liger if layout == "thd" else "not importable" in liger
    assert sweep.format_table([record]).count("\n") == 2 + 4


def test_ours_in_place_rewrites_the_tensor_its_forward_reads(triton_backend):
    """The warm figure after a write (``written_replay_us``) copies the input back into the
    buffer that ours in place rotates, so each forward reads freshly written input."""
    shape = bench.Shape("w", "sbhd", torch.float32, 8, 1, 2, 16, 16)
    inp = bench.make_inputs(shape, DEVICE)
    impl = bench._ours_in_place("triton", inp)
    rotated = impl.fwd()
    assert not torch.equal(rotated, inp.t)
    impl.rewrite()
    assert torch.equal(rotated, inp.t)


def test_ours_in_place_backward_launch_rotates_a_gradient_buffer_in_place(triton_backend):
    """The in-place backward's bare launch (what the sweep times as ours in place's backward,
    like for like with Liger's ``rope_backward``) rotates a buffer holding the incoming
    gradient by the transpose, in place, and leaves its pass-through channels alone."""
    shape = bench.Shape("g", "sbhd", torch.float32, 8, 2, 2, 16, 8)
    inp = bench.make_inputs(shape, DEVICE)
    launch = bench._ours_in_place("triton", inp).bwd_kernel
    grad = launch()
    _, want = reference_forward_backward(inp.t, inp.freqs, inp.spec, inp.grad, inp.starts)
    assert grad.data_ptr() != inp.grad.data_ptr()
    assert max_error(grad, want) < 1e-5
    assert torch.equal(grad[..., 8:], inp.grad[..., 8:])
    assert launch().data_ptr() == grad.data_ptr()  # the same buffer, rotated again


def test_no_peers_marks_them_absent(triton_backend, monkeypatch):
    monkeypatch.setattr(sweep, "bench_ms", lambda fn, rep=100: 0.001)
    monkeypatch.setattr(sweep, "host_rounds", lambda fns, calls, rounds: (
        {n: [1.0] for n in fns}, {n: [2.0] for n in fns}))
    monkeypatch.setattr(sweep, "count_launches", lambda fn: None)
    monkeypatch.setattr(sweep, "graph_replay_us", lambda fn: 1.0)
    shape = sweep.make_point("bshd", torch.float32, sweep.Series(2, 1, 8, 8, (), ""), 16)
    record = sweep.run_point(shape, peers=False, device=DEVICE)
    if not torch.cuda.is_available():  # no profiler's copy here: no plotted % by it either
        assert record["copy_profiled_us"] is None
        assert "fwd_profiled_pct_of_copy" not in record["implementations"]["triton"]
    assert record["implementations"]["te"]["absent"] == "--no-peers"
    assert record["implementations"]["liger"]["absent"] == "--no-peers"
    assert record["implementations"]["triton"]["launches_fwd"] is None


def test_points_have_model_tables_and_the_rows_series_reads_them(triton_backend, monkeypatch):
    """A point's angle table is a model's (row p is float32(p) x row 1, bit for bit), so ours
    reads it as rates (its flag is found); the "rows read" series, the same numbers, never
    looks for a flag, and leaves the threshold as it found it."""
    from rope_dispatch.backends import triton_tables
    from benchmarks.bench import _ours

    monkeypatch.setattr(triton_tables, "LINEAR_MIN_ROWS_READ", 0)  # tiny shapes look too
    monkeypatch.setattr(triton_tables, "_flags", {})
    monkeypatch.setattr(triton_tables, "_flags_met", {})
    inp = sweep.make_inputs(sweep.make_point("sbhd", torch.float32, sweep.Series(1, 2, 16, 16, (), ""), 32), DEVICE)
    angles = inp.freqs.view(inp.freqs.shape[0], -1).cpu()
    positions = torch.arange(angles.shape[0], dtype=torch.float32)
    assert torch.equal(angles, positions[:, None] * angles[1][None, :])
    rows = sweep.rows_read_impl(inp, "rows")
    rows_out = [rows.fwd() for _ in range(2)][-1]
    rows.bwd(), rows.fwd_bwd(), rows.bwd_kernel()
    assert triton_tables._flags == {} and triton_tables.LINEAR_MIN_ROWS_READ == 0
    ours = _ours("triton", "triton", inp, inp.freqs)
    ours_out = ours.fwd()
    ours.bwd_kernel()
    assert [int(flag.item()) for flag in triton_tables._flags.values()] == [1]
    assert torch.equal(ours_out, rows_out)


def _point(name, layout, large, **impls):
    """A measured point for summarize: ``impls`` maps names to (fwd us, fwd %, bwd us, bwd %,
    fwd+bwd us, host us) or to None (absent); the fwd+bwd % of two copies (do_bench's and the
    host clock's) follows from the forward's bytes per us."""
    implementations = {}
    for impl, values in impls.items():
        if values is None:
            implementations[impl] = {"label": impl, "absent": "not importable"}
            continue
        fwd, fwd_pct, bwd, bwd_pct, fwd_bwd, host = values
        implementations[impl] = {
            "label": impl, "fwd_us": fwd, "fwd_pct_of_copy": fwd_pct, "bwd_kernel_us": bwd,
            "bwd_kernel_pct_of_copy": bwd_pct, "fwd_bwd_us": fwd_bwd, "fwd_bwd_host_us": host,
            "fwd_bwd_pct_of_copy": 2 * fwd_pct * fwd / fwd_bwd,
            "fwd_bwd_host_pct_of_copy": None if host is None else 2 * fwd_pct * fwd / host,
        }
    return {"name": name, "layout": layout, "points_at_least_64MB": large,
            "implementations": implementations}


def test_summarize_states_the_targets():
    points = [
        # do_bench's fwd+bwd (here 200.0: a host path racing the GPU) is not compared
        _point("big a", "sbhd", True, triton=(40.0, 96.0, 41.0, 94.0, 200.0, 90.0),
               **{"triton-rows": (44.0, 87.0, 45.0, 86.0, 99.0, 99.0)},
               te=(80.0, 48.0, 60.0, 60.0, 85.0, 85.0), liger=None),
        _point("big b", "sbhd", True, triton=(38.0, 97.5, 39.0, 96.0, 80.0, 80.0),
               **{"triton-rows": (41.8, 88.0, 40.0, 93.0, 82.0, 82.0)},
               te=(90.0, 40.0, 70.0, 55.0, 95.0, 95.0), liger=(37.0, 99.0, 50.0, 70.0, 70.0, 70.0)),
        _point("small", "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 110.0),
               te=(9.0, 44.5, 6.0, 66.0, 100.0, 100.0), liger=(3.9, 200.0, 3.9, 200.0, 50.0, None)),
        _point("small thd", "thd", False, triton=(4.0, 95.0, 4.0, 95.0, 90.0, 90.0),
               te=(9.0, 40.0, 6.0, 66.0, 100.0, 100.0), liger=None),
        # Liger in place on partial rotary: less time for half the bytes, a lower share
        _point("big rot64", "sbhd", True, triton=(130.0, 98.0, 131.0, 97.0, 262.0, 262.0),
               te=(260.0, 48.0, 270.0, 48.0, 520.0, 520.0),
               liger=(82.0, 80.0, 82.0, 80.0, 163.0, 163.0)),
    ]
    warm = {"small": {"triton": 2.1, "te": 3.0, "liger": 1.9},
            "small thd": {"triton": 2.0, "te": 2.5}}
    for p in points:
        for name, us in warm.get(p["name"], {}).items():
            p["implementations"][name]["fwd_warm_us"] = us
    points[2]["implementations"]["triton"]["fwd_in_place_warm_us"] = 1.8  # ahead of liger's 1.9
    # Liger's kernels are set against ours in place, where it was timed: behind Liger's 3.9 us
    # forward on the small point, ahead of its 82 us at rot64 (both on the rotary half there)
    points[2]["implementations"]["triton"].update(fwd_in_place_us=4.0, fwd_in_place_pct_of_copy=89.0)
    points[4]["implementations"]["triton"].update(
        fwd_in_place_us=66.0, fwd_in_place_pct_of_copy=99.0, bwd_in_place_us=70.0,
        bwd_in_place_pct_of_copy=93.0)
    # the host clock's paired rounds: TE's lead at "big a" told apart, at "small" not
    points[0]["implementations"]["triton"]["fwd_bwd_host_minus_te_us"] = [3.0, 5.0, 7.0]
    points[2]["implementations"]["triton"]["fwd_bwd_host_minus_te_us"] = [-2.0, 10.0, 20.0]
    lines = sweep.summarize(points).splitlines()
    assert lines[0] == ("triton fwd at >= 64 MiB: 3 of 3 points at 95% of copy or more; lowest "
                        "96.0% (big a)")
    assert lines[1] == ("triton bwd kernel at >= 64 MiB: 2 of 3 points at 95% of copy or more; "
                        "lowest 94.0% (big a)")
    # kernel time and forward+backward on the host clock, at every point
    assert lines[2:9] == [
        "triton slower than a peer at 6 point-modes (like for like: ours in place against "
        "Liger's in-place kernels; kernel time by do_bench from 64 MiB, by the profiler below); "
        "a lead the paired samples tell apart, or with none kept, at 5",
        "  big a fwd_bwd_host: 90.0 us > te 85.0 us; ours - te +3.000 to +7.000 us (95%): a lead",
        "  big b fwd: 38.0 us > liger 37.0 us",  # ours in place not timed: out of place
        "  big b fwd_bwd_host: 80.0 us > liger 70.0 us",
        "  small fwd_in_place: 4.0 us > liger 3.9 us",
        "  small bwd_kernel: 4.4 us > liger 3.9 us",
        "  small fwd_bwd_host: 110.0 us > te 100.0 us; ours - te -2.000 to +20.000 us (95%): "
        "level within the samples",
    ]
    assert lines[-7:-4] == [
        "triton forward below 64 MiB with the L2 warm (a CUDA graph of 20 calls): te faster at 0 "
        "of 2 points",
        "triton forward below 64 MiB with the L2 warm (a CUDA graph of 20 calls): liger faster "
        "at 1 of 1 points, by 0.20 us at most",
        "triton in place (apply_) forward below 64 MiB with the L2 warm: liger faster at 0 of 1 "
        "points",
    ]
    # ratios of time at every point (the partial-rotary point's Liger moves half the bytes)
    assert lines[-4:-1] == [
        "sbhd fwd+bwd end to end (host clock, in turn), triton / te: median 0.950, highest "
        "1.100, triton faster at 2 of 4 points",
        "thd fwd+bwd end to end (host clock, in turn), triton / te: median 0.900, highest "
        "0.900, triton faster at 1 of 1 points",
        "sbhd fwd+bwd end to end (host clock, in turn), triton / liger: median 1.375, highest "
        "1.607, triton faster at 0 of 2 points",
    ]
    assert lines[-1] == ("triton forward at >= 64 MiB, table rows read / read as rates: 1.10x "
                         "median, 1.10-1.10x")


def test_profiled_kernel_times_fall_back_to_one_implementation_at_a_time(monkeypatch, capsys):
    """A trace that cannot be cut into calls is measured again per implementation: the one that
    fails is left out and said, the others keep their times; modes an implementation lacks
    are not timed."""
    impls = {
        "ours": bench.Impl("ours", lambda: None, None, None, lambda: None, bwd_kernel=lambda: None),
        "odd": bench.Impl("odd", lambda: None, None, None, lambda: None),
    }
    asked = []

    def kernel_us(fns, calls):
        asked.append(sorted(key.split("\0")[0] for key in fns))
        if any(key.startswith("odd") for key in fns):
            raise RuntimeError("a call launched a kernel named as the flush's")
        return {key: 2.5 for key in fns}

    def kernel_samples(fns, calls):
        kernel_us(fns, calls)
        raise AssertionError("not reached")

    monkeypatch.setattr(sweep, "cold_kernel_us", kernel_us)
    monkeypatch.setattr(sweep, "cold_kernel_samples", kernel_samples)
    times, samples = sweep.profiled_kernel_times(impls)
    assert times == {"ours": {"fwd_profiled_us": 2.5, "bwd_kernel_profiled_us": 2.5}}
    assert samples == {}  # traces of one implementation each: no neighbouring calls to pair
    assert asked == [["odd", "ours", "ours"], ["ours", "ours"], ["odd"]]
    assert "odd profiled: RuntimeError" in capsys.readouterr().err


def test_summarize_compares_kernels_by_the_profiler_where_both_have_it():
    """Below 64 MiB the profiler's kernel time decides who is faster: do_bench's 4.5 against
    Liger's 3.9 us is not a lead when the kernels took 2.0 and 2.1 us; the backward, 2.0
    against 1.9 us, is. Its share of the copy scales with the time (the same bytes)."""
    point = _point("small", "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 100.0),
                   te=None, liger=(3.9, 102.7, 3.9, 101.5, 50.0, 100.0))
    for name, fwd, bwd in (("triton", 2.0, 2.0), ("liger", 2.1, 1.9)):
        point["implementations"][name].update(fwd_profiled_us=fwd, bwd_kernel_profiled_us=bwd)
    lines = sweep.summarize([point]).splitlines()
    assert lines[:2] == [  # ours in place not timed: ours out of place against Liger's kernels
        "triton slower than a peer at 1 point-modes (like for like: ours in place against "
        "Liger's in-place kernels; kernel time by do_bench from 64 MiB, by the profiler below); "
        "a lead the paired samples tell apart, or with none kept, at 1",
        "  small bwd_kernel (profiler): 2.0 us > liger 1.9 us",
    ]
    assert ("triton out of place (apply) forward below 64 MiB by the profiler (an L2 flush before each call): liger "
            "faster at 0 of 1 points") in lines
    assert ("triton out of place (apply) backward kernel below 64 MiB by the profiler (an L2 "
            "flush before each call): liger faster at 1 of 1 points, by 0.10 us at most") in lines


def test_summarize_sets_liger_against_ours_in_place_and_lists_ours_out_of_place_apart():
    """Liger's kernels rotate in place, so the headline sets them against ours in place (2.0
    against 2.1 us: no lead), and lists where they beat ours out of place (2.3 us) on a line of
    its own: after the flush an out-of-place call writes back a dirty line for each it writes.
    TE, out of place like ours, is set against ours out of place."""
    point = _point("small", "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 100.0),
                   te=(9.0, 44.5, 6.0, 66.0, 100.0, 100.0),
                   liger=(3.9, 102.7, 3.9, 101.5, 50.0, 101.0))
    point["implementations"]["triton"].update(
        fwd_profiled_us=2.3, bwd_kernel_profiled_us=2.3, fwd_in_place_profiled_us=2.0,
        bwd_in_place_profiled_us=2.0, fwd_in_place_us=4.0, fwd_in_place_pct_of_copy=50.0,
        bwd_in_place_us=4.0, bwd_in_place_pct_of_copy=50.0)
    point["implementations"]["liger"].update(fwd_profiled_us=2.1, bwd_kernel_profiled_us=2.1)
    point["implementations"]["te"].update(fwd_profiled_us=2.2, bwd_kernel_profiled_us=2.4)
    point["implementations"]["triton"]["fwd_profiled_minus_liger_us"] = [0.1, 0.2, 0.3]
    lines = sweep.summarize([point]).splitlines()
    assert lines[:2] == [
        "triton slower than a peer at 1 point-modes (like for like: ours in place against "
        "Liger's in-place kernels; kernel time by do_bench from 64 MiB, by the profiler below); "
        "a lead the paired samples tell apart, or with none kept, at 1",
        "  small fwd (profiler): 2.3 us > te 2.2 us",
    ]
    assert ("triton out of place (apply) forward below 64 MiB by the profiler (an L2 flush "
            "before each call): liger faster at 1 of 1 points, by 0.20 us at most; a lead the "
            "paired samples tell apart (95% interval of ours minus theirs above 0) at 1 of "
            "them") in lines
    assert ("triton backward kernel below 64 MiB by the profiler (an L2 flush before each "
            "call): te faster at 0 of 1 points") in lines
    # ours in place behind: the headline lists it under its own mode
    point["implementations"]["triton"]["bwd_in_place_profiled_us"] = 2.2
    lines = sweep.summarize([point]).splitlines()
    assert lines[0].startswith("triton slower than a peer at 2 point-modes")
    assert "  small bwd_in_place (profiler): 2.2 us > liger 2.1 us" in lines


def test_summarize_compares_ours_in_place_with_liger_by_the_profiler():
    """Liger works in place: its kernels are set against ours in place, forward and backward
    (1.9 against Liger's 2.1 us is no lead; 2.0 against 1.8 us is, by 0.2 us)."""
    point = _point("small", "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 100.0),
                   te=None, liger=(3.9, 102.7, 3.9, 101.5, 50.0, 100.0))
    point["implementations"]["triton"].update(
        fwd_profiled_us=2.2, bwd_kernel_profiled_us=2.2, fwd_in_place_profiled_us=1.9,
        bwd_in_place_profiled_us=2.0)
    point["implementations"]["liger"].update(fwd_profiled_us=2.1, bwd_kernel_profiled_us=1.8)
    point["implementations"]["triton"]["bwd_in_place_profiled_minus_liger_us"] = [0.1, 0.2, 0.3]
    lines = sweep.summarize([point]).splitlines()
    prefix = ("triton in place (apply_) {} below 64 MiB by the profiler, against Liger's "
              "in-place kernel: ")
    assert prefix.format("forward") + "liger faster at 0 of 1 points" in lines
    assert prefix.format("backward") + (
        "liger faster at 1 of 1 points, by 0.20 us at most; a lead the paired samples tell apart "
        "(95% interval of ours minus theirs above 0) at 1 of them") in lines
    # a paired interval holding 0: the lead is counted, and said to be within the samples
    point["implementations"]["triton"]["bwd_in_place_profiled_minus_liger_us"] = [-0.1, 0.2, 0.3]
    assert prefix.format("backward") + (
        "liger faster at 1 of 1 points, by 0.20 us at most; a lead the paired samples tell apart "
        "(95% interval of ours minus theirs above 0) at 0 of them") in sweep.summarize(
            [point]).splitlines()


def test_summarize_sets_ours_in_place_against_itself():
    """The same in-place calls timed twice in each trace: the summary says at how many points
    their medians differ and by how much (forward 1.9 against 1.9: level; backward 2.0 against
    2.032 at one point and level at the other: one 32 ns step)."""
    points = []
    for name, again in (("a", (1.9, 2.032)), ("b", (1.9, 2.0))):
        point = _point(name, "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 100.0),
                       te=None, liger=(3.9, 102.7, 3.9, 101.5, 50.0, 100.0))
        point["implementations"]["triton"].update(
            fwd_in_place_profiled_us=1.9, bwd_in_place_profiled_us=2.0,
            fwd_in_place_again_profiled_us=again[0], bwd_in_place_again_profiled_us=again[1])
        points.append(point)
    # the paired test's verdict on the backward: a false alarm at "a" (either sign counts)
    points[0]["implementations"]["triton"]["bwd_in_place_profiled_minus_again_us"] = [
        -0.064, -0.032, -0.001]
    points[1]["implementations"]["triton"]["bwd_in_place_profiled_minus_again_us"] = [
        -0.032, 0.0, 0.032]
    lines = sweep.summarize(points).splitlines()
    prefix = ("triton in place (apply_) {} below 64 MiB by the profiler, against itself (the "
              "same calls twice in each trace): ")
    assert prefix.format("forward") + "apart at 0 of 2 points" in lines
    assert prefix.format("backward") + (
        "apart at 1 of 2 points, by 0.03 us at most; the paired samples tell the two apart (95% "
        "interval of the difference without 0) at 1 of 2") in lines


def test_summarize_compares_in_place_calls_on_freshly_written_input():
    """With the L2 warm, ours in place and Liger's are also set against each other with their
    input written by a copy before each call, as the projection writes q and k in a model (a
    lead of 0.3 us there; replayed on their own output alone, Liger's 1.8 us leads ours' 2.1)."""
    points = [_point(name, "sbhd", False, triton=(4.5, 89.0, 4.4, 90.0, 120.0, 100.0), te=None,
                     liger=(3.9, 102.7, 3.9, 101.5, 50.0, 100.0)) for name in ("a", "b")]
    for point, (ours, theirs) in zip(points, ((1.9, 2.2), (2.4, 2.1))):
        point["implementations"]["triton"].update(fwd_in_place_warm_us=2.1,
                                                  fwd_in_place_written_warm_us=ours)
        point["implementations"]["liger"].update(fwd_warm_us=1.8, fwd_written_warm_us=theirs)
    lines = sweep.summarize(points).splitlines()
    assert ("triton in place (apply_) forward below 64 MiB with the L2 warm: liger faster at 2 "
            "of 2 points, by 0.30 us at most") in lines
    assert ("triton in place (apply_) forward below 64 MiB with the L2 warm, its input written "
            "by a copy before each call: liger faster at 1 of 2 points, by 0.30 us at most") in lines


FLUSH = "fill_kernel"


def test_kernel_time_per_call_sums_the_kernels_between_flushes():
    """bench.cold_kernel_us's cut of a trace: each flush starts a call; kernels before the first
    flush (a warm-up's) are not counted; a call's kernels add up."""
    trace = [("warm_up", 9.0),
             (FLUSH, 60.0), ("rope_q", 1.0), ("rope_k", 0.5),
             (FLUSH, 61.0), ("liger", 2.0),
             (FLUSH, 59.0), ("rope_q", 1.5), ("rope_k", 0.25),
             (FLUSH, 60.0), ("liger", 2.5)]
    per_call = bench.kernel_us_per_call(trace, {FLUSH}, ["ours", "liger", "ours", "liger"])
    assert per_call == {"ours": [1.5, 1.75], "liger": [2.0, 2.5]}


def test_kernel_time_per_call_takes_a_flush_of_several_kernels_as_one():
    """A flush that launches several kernels (a reduction's passes) cuts the trace once: runs of
    ``flush_kernels`` flush kernels, each followed by a call's own kernels."""
    trace = [(FLUSH, 1.0), ("reduce", 60.0), (FLUSH, 1.0), ("rope", 1.25),
             (FLUSH, 1.0), ("reduce", 59.0), (FLUSH, 1.0), ("liger", 2.0)]
    per_call = bench.kernel_us_per_call(trace, {FLUSH, "reduce"}, ["ours", "liger"], 3)
    assert per_call == {"ours": [1.25], "liger": [2.0]}
    with pytest.raises(RuntimeError, match="6 flushes for 2 calls"):
        bench.kernel_us_per_call(trace, {FLUSH, "reduce"}, ["ours", "liger"])


@pytest.mark.parametrize("trace", [
    [(FLUSH, 60.0), ("rope", 1.0), (FLUSH, 60.0)],  # the second call ran no kernel
    [(FLUSH, 60.0), ("rope", 1.0), (FLUSH, 1.0), (FLUSH, 60.0), ("rope", 1.0)],  # a call's fill
])
def test_kernel_time_per_call_refuses_a_trace_it_cannot_cut(trace):
    with pytest.raises(RuntimeError, match="flushes for 2 calls"):
        bench.kernel_us_per_call(trace, {FLUSH}, ["ours", "ours"])


def test_paired_difference_gives_the_sign_tests_interval():
    """The median of paired differences and its distribution-free 95% interval: for 20 pairs
    the 6th and 15th smallest differences (P(Binomial(20, 1/2) <= 5) = 0.0207 <= 0.025 and
    P(<= 6) = 0.0577 > 0.025, worked out here from the binomial law), whatever the pairs' order."""
    tail = sum(math.comb(20, i) for i in range(6)) / 2 ** 20
    assert 0.0206 < tail < 0.0208 and tail + math.comb(20, 6) / 2 ** 20 > 0.025
    theirs = [10.0 + 0.5 * i for i in range(20)]
    diffs = [float(d) for d in (7, 3, 20, 1, 12, 5, 18, 9, 14, 2, 16, 11, 6, 19, 4, 13, 8, 17,
                                10, 15)]
    ours = [t + d for t, d in zip(theirs, diffs)]
    low, median, high = bench.paired_difference(ours, theirs)
    assert (low, high) == pytest.approx((6.0, 15.0)) and median == pytest.approx(10.5)
    # level samples: an interval of zero; a constant lead: exactly it
    assert bench.paired_difference(theirs, theirs) == (0.0, 0.0, 0.0)
    assert bench.paired_difference([t - 0.25 for t in theirs], theirs) == pytest.approx(
        (-0.25, -0.25, -0.25))
    # too few pairs for a 95% interval: it spans them all
    assert bench.paired_difference([3.0, 1.0], [0.0, 0.0]) == (1.0, 2.0, 3.0)


def test_paired_difference_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="got 3 and 2 samples"):
        bench.paired_difference([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        bench.paired_difference([], [])


def test_paired_intervals_set_ours_against_each_other_implementation():
    """Ours minus each implementation's paired samples, as the sign test's 95% interval: a
    steady 0.2 us lead of Liger's lies above 0; TE's differences straddle it; a series of
    another length (not paired with ours) and an absent one are left out."""
    n = 20
    ours = [2.0 + 0.01 * (i % 5) for i in range(n)]
    samples = {"triton": ours, "liger": [x - 0.2 for x in ours],
               "te": [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(ours)],
               "other": ours[:-1]}
    intervals = sweep.paired_intervals(samples, "fwd_profiled")
    assert set(intervals) == {"fwd_profiled_minus_te_us", "fwd_profiled_minus_liger_us"}
    assert intervals["fwd_profiled_minus_liger_us"] == pytest.approx([0.2, 0.2, 0.2])
    low, median, high = intervals["fwd_profiled_minus_te_us"]
    assert low == pytest.approx(-0.05) and high == pytest.approx(0.05) and low < median < high
    assert sweep.paired_intervals(samples, "k", others={"other": "o"}) == {}
    assert sweep.paired_intervals(samples, "k", ours="ghost") == {}
    assert sweep.paired_intervals(samples, "k", ours="liger", others={"triton": "t"}) == {
        "k_minus_t_us": pytest.approx([-0.2, -0.2, -0.2])}


def test_run_point_keeps_paired_intervals_against_a_peer(triton_backend, monkeypatch):
    """With a peer present (our eager backend standing in for TE), the point keeps ours minus
    the peer's paired samples: of the profiler's trace (0.1 us a call here, forward and
    backward kernel) and of the host clock's rounds (a lead of 0.2 us in every round)."""
    monkeypatch.setattr(sweep, "bench_ms", lambda fn, rep=100: (fn(), 0.002)[1])
    monkeypatch.setattr(sweep, "count_launches", lambda fn: 1)
    monkeypatch.setattr(sweep, "graph_replay_us", lambda fn: (fn(), 1.5)[1])
    monkeypatch.setattr(sweep, "written_replay_us", lambda fn, write: (write(), fn(), 0.5)[2])
    monkeypatch.setattr(sweep, "cold_kernel_us", lambda fns, calls, copies=False: {"copy": 0.9})
    kernel = {"triton": 1.3, "te": 1.2}

    def kernel_samples(fns, calls):
        for fn in fns.values():
            fn()
        return {key: [kernel.get(key.split("\0")[0], 1.25) + 0.001 * (i % 3)
                      for i in range(calls)] for key in fns}

    monkeypatch.setattr(sweep, "cold_kernel_samples", kernel_samples)
    monkeypatch.setattr(sweep, "host_rounds", lambda fns, calls, rounds: (
        {n: [1.0] * rounds for n in fns},
        {n: [(2.8 if n == "te" else 3.0) + 0.01 * (i % 4) for i in range(rounds)]
         for n in fns}))
    monkeypatch.setattr(sweep, "_te_peer",
                        lambda shape, inp: bench._ours("eager", "TE stand-in", inp, inp.freqs))
    monkeypatch.setattr(sweep, "_liger_peer", lambda shape, inp: None)
    shape = sweep.make_point("sbhd", torch.float32, sweep.Series(1, 2, 16, 8, (), ""), 32)
    record = sweep.run_point(shape, peers=True, device=DEVICE)
    ours = record["implementations"]["triton"]
    assert record["implementations"]["te"]["fwd_profiled_us"] == pytest.approx(1.201)
    assert ours["fwd_profiled_minus_te_us"] == pytest.approx([0.1, 0.1, 0.1])
    assert "bwd_kernel_profiled_minus_te_us" not in ours  # the stand-in has no backward launch
    assert ours["fwd_bwd_host_minus_te_us"] == pytest.approx([0.2, 0.2, 0.2])
    assert ours["fwd_in_place_profiled_minus_again_us"] == pytest.approx([0.0, 0.0, 0.0])
    # and the summary says it: a lead of TE's the samples tell apart, at both
    lines = sweep.summarize([record]).splitlines()
    assert lines[0].startswith("triton slower than a peer at 2 point-modes")
    assert lines[0].endswith("a lead the paired samples tell apart, or with none kept, at 2")
    assert lines[1].endswith("fwd (profiler): 1.3 us > te 1.2 us; ours - te +0.100 to +0.100 us "
                             "(95%): a lead")
    assert lines[2].endswith("fwd_bwd_host: 3.0 us > te 2.8 us; ours - te +0.200 to +0.200 us "
                             "(95%): a lead")


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_give_each_call_every_place_and_every_neighbour_alike(n):
    orders = bench.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    places = {(place, call) for order in orders for place, call in enumerate(order)}
    assert places == {(place, call) for place in range(n) for call in range(n)}
    per_place = len(orders) // n
    for place in range(n):
        assert sorted(order[place] for order in orders) == sorted(list(range(n)) * per_place)
    followed = [(order[i], order[i + 1]) for order in orders for i in range(n - 1)]
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    assert sorted(followed) == sorted(pairs * (len(followed) // max(len(pairs), 1)))


@pytest.mark.parametrize("names, calls, rounds", [
    ("abcd", 30, 32),  # 4 orders: 8 whole cycles
    ("abc", 30, 30),  # 6 orders (odd: each reversed too)
    ("abcdefghijklmn", 30, 42),  # the sweep's 14 profiled series: 3 cycles of 14
    ("a", 5, 5),
])
def test_a_profiler_trace_runs_whole_cycles_of_the_balanced_orders(names, calls, rounds):
    """Each round holds one call of each name; each name takes every place and follows every
    other name equally often over the trace (in one fixed order a name always ran after the
    same neighbour, which moved its time: run AW4)."""
    order = bench.trace_order(list(names), calls)
    n = len(names)
    assert len(order) == rounds * n
    trace_rounds = [order[r * n:(r + 1) * n] for r in range(rounds)]
    assert all(sorted(r) == sorted(names) for r in trace_rounds)
    places = [(i, name) for r in trace_rounds for i, name in enumerate(r)]
    assert all(places.count((i, name)) == rounds // n for i in range(n) for name in names)
    followed = [(r[i], r[i + 1]) for r in trace_rounds for i in range(n - 1)]
    if n > 1:
        each = len(followed) // (n * (n - 1))
        assert all(followed.count((a, b)) == each for a in names for b in names if a != b)


def test_host_rounds_run_the_calls_in_the_balanced_orders(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    ran: list[str] = []
    fns = {name: (lambda name=name: ran.append(name)) for name in "abcde"}
    host, total = bench.host_rounds(fns, calls=2, rounds=12)
    timed = ran[20 * len(fns):]  # after 20 warm-up calls of each
    orders = bench.balanced_orders(len(fns))
    expected = [name for r in range(12) for i in orders[r % len(orders)]
                for name in (list(fns)[i],) * 2]
    assert timed == expected
    assert all(len(times) == 12 for times in (*host.values(), *total.values()))


def test_the_sweeps_host_rounds_are_whole_cycles_of_the_orders():
    for implementations in (len(sweep.IMPLEMENTATIONS), len(sweep.IMPLEMENTATIONS) - 1):
        cycle = len(bench.balanced_orders(implementations))
        assert sweep.HOST_ROUNDS % cycle == 0 and sweep.LARGE_HOST_ROUNDS % cycle == 0
