"""Kernel time of explicit launch tiles against a device copy: a developer's probe for
choose_config, one line per shape and tile. ``python scripts/tile_probe.py [mode]``: no mode,
forward and backward on few-head shapes; ``small``, launch-bound shapes against Liger;
``small-warm``, the sweep points where Liger led with the L2 warm, timed warm; ``small-rules``,
candidate tile rules for calls the L2 can hold, at the sweep's points below 64 MiB;
``small-programs``, how many programs such calls should have (kernel time and warm);
``prefill`` and ``decode``, the serving q+k launches (decode also against Liger, cold and
warm); ``decode-compare``, that comparison alone; ``decode-processes [n]``, it in n processes
in a row (default 6); ``tables``, each table kind read per token (angle rows, cos/sin cache,
pair cache); ``large-rates``, tiles for the few-head points from 64 MiB with a model's angle
table read as rates; ``large-rule``, the tile rule for those calls against the previous one,
for each table kind; ``thd-tiles``, tiles for thd's 8-head points from 64 MiB (``thd-tiles
32``: its 32-head points); ``partial-rotary``, partial rotary in place against contiguous and
strided copies; ``small-kinds``, each table kind, Liger's cut and in place where Liger's
kernel led; ``in-place-tiles``, ours in place at explicit tiles against Liger's;
``in-place-warm``, the same with the L2 warm where Liger's kernel led warm;
``wide-tokens``, 8, 16 or 4 tokens per 8 KiB tile for tokens of 8 KiB; ``resident-rows``, wide
heads the L2 holds with and without ``RESIDENT_ROWS``, warm and flushed; ``sine-tiles``, two-token
tiles against one-token tiles, and 1 program per SM, for calls the L2 holds; ``one-head-tiles``,
``in-place-tiles`` at one-head calls and a decode-sized one; ``row-tiles``, the fewest rows a
small call's program keeps; ``lean-kernel``, an instruction-lean prototype kernel against ours
and Liger's where Liger's led in place; ``kernel-copies`` and ``input-copies``, whether where a
kernel's code or its data lies moves a small call's time after an L2 flush; ``lean-shipped``,
the shipped lean kernel against the general one and Liger's at small calls, and its tiles;
``lean-warps``, the lean kernel on fewer warps and through a linearity flag, against Liger's;
``sweep-orders``, the sweep's kernel timing at 128 tokens of 8 heads in four call orders;
``shared-sines``, the lean kernel with a row's sines computed once for a tile's heads or once
per head, against Liger's; ``table-bytes``, ours in place on tables of 256 to 1,024 bytes a
token against Liger's; ``one-head-rule``, tokens a program for one-head calls the L2 holds;
``ties``, ours in place against Liger's where it led by a tenth of a microsecond, with the
paired differences' interval; ``lean-one-warp``, the lean kernel there on 4, 2 and 1 warps;
``lean-vector``, two channels a thread at 1 x 8 tiles; ``lean-out-tiles``, the lean kernel
out of place at tiles of fewer heads and warps, against Liger's in place;
``lean-warps-paired``, the lean kernel on 4 warps against 2, in place and out of place;
``float32-resident``, tiles for float32 calls of 32 MiB, warm and flushed;
``in-place-resident``, the same for calls of 16-32 MiB in place, float32 and bf16;
``resident-rules``, candidate rules for them at the sweep's points of 1-32 MiB;
``mqa-tiles``, the q+k launch's tiles where k has one head;
``hf-tiles``, the Hugging Face integration's q+k launch (a bf16 cos/sin cache) at explicit
tiles against Liger's; ``hf-halves``, that launch reading half rows (a halves flag) at
explicit tiles, forward and backward, and the flag's branch as a masked load;
``hf-halves-wide``, the same at MHA shapes and more tiles; ``hf-halves-door``, at the
integration's own call form (one cos and sin row per token, read by position);
``door-rows``, that launch with rows shared by the batch, a row per token by per-token
positions, and by start positions; ``door-placement``, the integration's forward against the
same launch writing into outputs placed at several offsets past a 2 MiB boundary;
``qwen-warps`` and ``gqa-warps``, the integration's GQA q+k launches at tiles of 1-8 warps;
``qkv-bwd-tiles``, the packed-qkv transposed launch at the sweep's ``--qkv`` points from 64
MiB, at explicit tiles against a copy (profiler)."""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

import rope_dispatch as rd
from rope_dispatch import bench, dispatch
from rope_dispatch.backends import triton_rope

SHAPES = [  # (layout, seq, batch, heads, head_dim)
    ("sbhd", 32768, 1, 8, 128), ("bshd", 32768, 4, 8, 128), ("sbhd", 131072, 1, 8, 128),
    ("sbhd", 32768, 1, 8, 256), ("sbhd", 8192, 1, 32, 128), ("sbhd", 4096, 4, 32, 128),
]
TILES = [(8, 4, 4), (4, 8, 4), (2, 8, 4), (8, 8, 4), (16, 4, 4), (4, 8, 8), (8, 8, 8), (16, 8, 8),
         (2, 16, 4), (4, 16, 8), (1, 32, 4)]


def main() -> None:
    for layout, seq, batch, heads, d in SHAPES:
        dims = (seq, batch, heads, d) if layout == "sbhd" else (batch, seq, heads, d)
        x = torch.randn(dims, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        table = torch.rand(seq, d, device="cuda") * 100
        src = x.flatten()
        dst = torch.empty_like(src)
        copy = bench.bench_ms(lambda: dst.copy_(src))
        default = triton_rope.choose_config(seq * batch, heads, d, d, 2, False,
                                            triton_rope._sm_count(0))
        results = []
        for bt, bh, warps in TILES:
            if bh > heads:
                continue
            config = (bt, bh, 1, d // 2, 1, warps)
            fwd = bench.bench_ms(lambda: triton_rope.launch(x, out, table, None, None, None, layout,
                                                            False, 1.0, 1, 0, False, config=config))
            bwd = bench.bench_ms(lambda: triton_rope.launch(x, out, table, None, None, None, layout,
                                                            False, 1.0, 1, 0, True, config=config))
            results.append((copy / fwd, copy / bwd, config))
        results.sort(key=lambda r: -(r[0] + r[1]))
        print(f"{layout} s{seq} b{batch} h{heads} d{d}: copy {1e3 * copy:.1f} us; default {default}")
        for f, b, c in results:
            mark = " <- default" if c[:3] == default[:3] and c[5] == default[5] else ""
            print(f"   tile {c[0]:>2} tok x {c[1]:>2} heads, {c[5]} warps: fwd {100 * f:5.1f}%  bwd {100 * b:5.1f}%{mark}")
        del x, out


def prefill_qk() -> None:
    """The serving prefill q+k launch (16,384 tokens, q 32 heads, k 8, per-token positions,
    angle table and pair cache) at explicit tiles, as % of a copy of the same bytes."""
    p = bench.serving_inputs(bench.SERVING_TOKENS["prefill"])
    q, k, positions = p["q"], p["k"], p["positions"]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    src = torch.cat((q.flatten(), k.flatten()))
    dst = torch.empty_like(src)
    copy = bench.bench_ms(lambda: dst.copy_(src))
    index = positions.unsqueeze(-1)
    choose = triton_rope.choose_config
    segments = ((triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1)),
                (triton_rope.head_segment(qo, 1), triton_rope.head_segment(ko, 1)))
    for label, table in (("angles", p["freqs"]), ("pair cache", p["pair_cache"])):
        tab, sin = triton_rope.kernel_tables(table)
        default = triton_rope.choose_config(q.shape[0], (32, 8, 8), 128, 128, 2, False,
                                            triton_rope._sm_count(0))
        print(f"prefill q+k {label}: copy {1e3 * copy:.1f} us; default {default}")
        for bt, bh, iters, warps in ((8, 4, 1, 4), (8, 4, 2, 4), (8, 8, 1, 4), (4, 8, 1, 4),
                                     (16, 4, 1, 4), (8, 4, 1, 8), (4, 8, 2, 4), (16, 2, 1, 4),
                                     (8, 2, 1, 4), (8, 8, 1, 8)):
            config = (bt, bh, iters, 64, 1, warps)
            # the launch's own config choice answers with this tile, so the timed calls take
            # the C launcher as real calls do
            triton_rope.choose_config = lambda *args, config=config, **kwargs: config
            triton_rope._fast_qkv.clear()
            ms = bench.bench_ms(lambda: triton_rope.launch_qkv(
                *segments, (tab, sin, tab, sin), None, index, "thd", False, 1.0, 1, 0, False))
            triton_rope.choose_config = choose
            print(f"   tile {bt:>2} tok x {bh} heads x {iters} iters, {warps} warps: "
                  f"{100 * copy / ms:5.1f}%")


SMALL_SHAPES = [  # (layout, seq, batch, heads, head_dim): launch- and latency-bound sweep points
    ("sbhd", 128, 1, 1, 128), ("sbhd", 512, 1, 1, 128), ("sbhd", 2048, 1, 1, 128),
    ("sbhd", 128, 1, 8, 128), ("bshd", 512, 4, 8, 128), ("sbhd", 2048, 4, 8, 128),
    ("sbhd", 512, 1, 32, 128), ("sbhd", 2048, 1, 32, 128), ("bshd", 2048, 1, 8, 64),
    ("sbhd", 1, 64, 32, 128),
]


WARM_SHAPES = [  # sweep points where Liger's forward led with the L2 warm (runs R and S)
    ("sbhd", 128, 1, 8, 128), ("sbhd", 512, 1, 32, 128), ("sbhd", 2048, 1, 8, 128),
    ("sbhd", 2048, 1, 32, 128), ("sbhd", 2048, 1, 8, 256),
]


def small(warm: bool = False) -> None:
    """Forward kernel time of small shapes at tiles of 1 to 32 tokens and 1 to 32 heads, with 4
    warps and with warps scaled to the tile, against a copy and Liger's q+k (one k head) in the
    same run; cold (``do_bench`` flushes the L2) or, with ``warm``, replayed from a CUDA graph
    of 20 calls (the L2 holding what they share, as a model's layers run). The kernel reads the
    angle table's rows, as a captured call does: each program of a token block loads them
    again, so fewer, wider programs per token load less."""
    choose = triton_rope.choose_config
    ms_of = (lambda fn: bench.graph_replay_us(fn) / 1e3) if warm else bench.bench_ms
    for layout, seq, batch, heads, d in WARM_SHAPES if warm else SMALL_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, d)
        inp = bench.make_inputs(shape)
        x = inp.t
        out = torch.empty_like(x)
        table = inp.freqs.view(inp.freqs.shape[0], -1)
        src = x.flatten()
        dst = torch.empty_like(src)
        copy = ms_of(lambda: dst.copy_(src))
        liger = bench._liger_peer(shape, inp)
        liger_ms = ms_of(liger.fwd) if liger is not None else float("nan")
        tokens = seq * batch
        default = choose(tokens, heads, d, d, 2, False, triton_rope._sm_count(0))
        results = []
        for bt in (1, 2, 4, 8, 16, 32):
            for bh in (1, 2, 4, 8, 16, 32):  # 16 and 32: one table row load per token
                tile = bt * bh * d * 2
                if bh > heads or bt > triton_rope._next_pow2(tokens) or tile > 16384:
                    continue
                for warps in sorted({4, max(1, min(4, tile // 2048))}):
                    config = (bt, bh, 1, d // 2, 1, warps)
                    triton_rope.choose_config = lambda *args, config=config, **kwargs: config
                    triton_rope._configs.clear()
                    triton_rope._fast.clear()
                    ms = ms_of(lambda: triton_rope.launch(
                        x, out, table, None, None, None, layout, False, 1.0, 1, 0, False))
                    results.append((ms, config))
        triton_rope.choose_config = choose
        triton_rope._configs.clear()
        triton_rope._fast.clear()
        results.sort()
        print(f"{layout} s{seq} b{batch} h{heads} d{d}: copy {1e3 * copy:.2f} us, Liger "
              f"{1e3 * liger_ms:.2f} us; default {default}")
        for ms, c in results[:6] + [r for r in results[6:] if r[1] == default]:
            mark = " <- default" if c == default else ""
            print(f"   tile {c[0]:>2} tok x {c[1]} heads, {c[5]} warps: {1e3 * ms:6.2f} us "
                  f"({100 * copy / ms:5.1f}% of copy){mark}")


CANDIDATE_RESIDENT_BYTES = 24 << 20  # small-rules: tensors within half an H200's L2


def _heads_first(choose, tile_bytes: int, warps_by_tile: bool):
    """A candidate ``choose_config``: for calls of at most ``CANDIDATE_RESIDENT_BYTES``, a
    token's heads first (up to ``tile_bytes`` per tile), then tokens, halved as ``choose``
    halves them until every SM has two programs; 4 warps, or one per 2 KB of tile with
    ``warps_by_tile``; larger calls as ``choose``."""

    def rule(n_tokens, heads, head_dim, rotary_dim, element_size, interleaved, sms, *rest):
        config = choose(n_tokens, heads, head_dim, rotary_dim, element_size, interleaved, sms,
                        *rest)
        counts = heads if isinstance(heads, tuple) else (heads,)
        if n_tokens * sum(counts) * head_dim * element_size > CANDIDATE_RESIDENT_BYTES:
            return config
        rows = triton_rope.tile_rows(tile_bytes, head_dim * element_size)
        block_h = min(triton_rope._next_pow2(min(counts)), rows)
        block_t = min(rows // block_h, triton_rope._next_pow2(n_tokens))
        block_t, block_h = triton_rope.shrink_to_programs(
            n_tokens, counts, block_t, block_h, triton_rope.MIN_PROGRAMS_PER_SM * sms)
        warps = 4
        if warps_by_tile:
            warps = max(1, min(4, block_t * block_h * head_dim * element_size // 2048))
        return (block_t, block_h, 1, config[3], config[4], warps)

    return rule


def small_rules(rounds: int = 3) -> None:
    """The sweep's points below 64 MiB (sbhd and thd, bf16) through ``apply(backend="triton")``
    under the current tile rule and candidates that put a token's heads first in calls that fit
    in the L2: forward cold (``do_bench``) and warm (a CUDA graph of 20 calls), the rules in
    turn, medians of ``rounds``; then per rule the geometric mean of its times over the
    current rule's and how many points it leads or trails by more than 2%."""
    from rope_dispatch import sweep

    choose = triton_rope.choose_config
    rules = {"current": choose, "heads 8K": _heads_first(choose, 8192, False),
             "heads 16K": _heads_first(choose, 16384, False),
             "heads 8K, warps by tile": _heads_first(choose, 8192, True),
             "heads 4K, warps by tile": _heads_first(choose, 4096, True)}
    ratios = {name: ([], []) for name in rules}
    points = [p for p in sweep.sweep_points(layouts=("sbhd", "thd"))
              if p.tensor_bytes() < sweep.LARGE_TENSOR_BYTES]
    for shape in points:
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        dst = torch.empty_like(inp.t)
        copy = 1e3 * bench.bench_ms(lambda: dst.copy_(inp.t))
        times = {name: ([], []) for name in rules}
        configs = {}
        for _ in range(rounds):
            for name, rule in rules.items():
                triton_rope.choose_config = rule
                triton_rope._configs.clear()
                triton_rope._fast.clear()
                dispatch.forget_plans()
                try:
                    impl = bench._ours("triton", "triton", inp, inp.freqs)
                    times[name][0].append(1e3 * bench.bench_ms(impl.fwd))
                    times[name][1].append(bench.graph_replay_us(impl.fwd))
                    configs[name] = next(iter(triton_rope._configs.values()), None)
                finally:
                    triton_rope.choose_config = choose
        cells = []
        for name in rules:
            cold, warm = (statistics.median(v) for v in times[name])
            base_cold, base_warm = (statistics.median(v) for v in times["current"])
            ratios[name][0].append(cold / base_cold)
            ratios[name][1].append(warm / base_warm)
            c = configs[name]
            cells.append(f"{name} {c[0]}x{c[1]}/{c[5]}w {cold:6.2f} {warm:6.2f}")
        print(f"{shape.name}: copy {copy:.2f} us | " + " | ".join(cells), flush=True)
        del inp, dst
    triton_rope._configs.clear()
    triton_rope._fast.clear()
    dispatch.forget_plans()
    print(f"over {len(points)} points, time / current rule's (geometric mean; points ahead / "
          "behind by more than 2%):")
    _print_rule_ratios(ratios, 24)


def _print_rule_ratios(ratios: dict, width: int) -> None:
    """One line per rule: the geometric means of its cold and warm times over the current
    rule's (``ratios[name] = (cold ratios, warm ratios)``, a ratio per point), and at how many
    points it leads or trails by more than 2%."""
    from statistics import geometric_mean as mean

    for name, (cold, warm) in ratios.items():
        print(f"  {name:>{width}}: cold {mean(cold):.3f} ({sum(r < 0.98 for r in cold)} / "
              f"{sum(r > 1.02 for r in cold)}), warm {mean(warm):.3f} "
              f"({sum(r < 0.98 for r in warm)} / {sum(r > 1.02 for r in warm)})")


def _warps_by_tile(config: tuple, element_size: int) -> tuple:
    """``config`` with as many warps (1 to 4) as give each thread 16 bytes of a half-tile load."""
    bt, bh, iters, block_r, block_p, _ = config
    warps = max(1, min(4, bt * bh * block_r * element_size // (32 * 16)))
    return bt, bh, iters, block_r, block_p, warps


def small_programs() -> None:
    """How many programs a call the L2 can hold should have: the sweep's points up to
    ``RESIDENT_BYTES`` (every layout, bf16, full rotary), forward launched with the tiles of
    ``choose_config`` for 2 programs per SM (the current rule), 1 and 1/2, one token of all
    heads per program (Liger's cut), and the current rule with warps by tile
    (:func:`_warps_by_tile`), by kernel time after an L2 flush (the profiler) and warm
    (a CUDA graph), with Liger's forward beside them; then per rule the geometric mean over the
    current rule's and how many points it leads or trails by more than 2%."""
    from rope_dispatch import sweep

    sms = triton_rope._sm_count(0)
    choose = triton_rope.choose_config
    rules = {
        "2 per SM": lambda *a: choose(*a, sms),
        "1 per SM": lambda *a: choose(*a, max(1, sms // 2)),
        "1/2 per SM": lambda *a: choose(*a, max(1, sms // 4)),
        "token x all heads": lambda n, h, d, r, size, il: (
            1, triton_rope._next_pow2(h), 1, *choose(n, h, d, r, size, il, sms)[3:]),
        "2 per SM, warps by tile": lambda n, h, d, r, size, il: _warps_by_tile(
            choose(n, h, d, r, size, il, sms), size),
    }
    ratios = {name: ([], []) for name in rules}
    peer = {"cold": 0, "warm": 0, "points": 0}
    points = [p for p in sweep.sweep_points() if p.tensor_bytes() <= triton_rope.RESIDENT_BYTES
              and p.rotary_dim == p.head_dim]
    for shape in points:
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        table = inp.freqs.view(inp.freqs.shape[0], -1)
        out = torch.empty_like(inp.t)
        tokens = shape.seq * (1 if shape.layout == "thd" else shape.batch)
        fns, configs = {}, {}
        for name, rule in rules.items():
            config = rule(tokens, shape.heads, shape.head_dim, shape.rotary_dim,
                          inp.t.element_size(), False)
            configs[name] = config
            fns[name] = lambda config=config: triton_rope.launch(
                inp.t, out, table, None, inp.cu_seqlens, None, shape.layout, False, 1.0, 1, 0,
                False, config=config)
        if len(set(configs.values())) == 1:  # every rule cuts it alike
            continue
        liger = bench._liger_peer(shape, inp)
        if liger is not None:
            fns["liger"] = liger.fwd
        cold = bench.cold_kernel_us(fns, calls=30)
        warm = {name: bench.graph_replay_us(fn) for name, fn in fns.items()}
        cells = []
        for name in rules:
            ratios[name][0].append(cold[name] / cold["2 per SM"])
            ratios[name][1].append(warm[name] / warm["2 per SM"])
            c = configs[name]
            cells.append(f"{name} {c[0]}x{c[1]} {cold[name]:5.2f} {warm[name]:5.2f}")
        if liger is not None:
            cells.append(f"liger {cold['liger']:5.2f} {warm['liger']:5.2f}")
            peer["points"] += 1
            peer["cold"] += cold["liger"] < cold["2 per SM"]
            peer["warm"] += warm["liger"] < warm["2 per SM"]
        print(f"{shape.name}: " + " | ".join(cells), flush=True)
        del inp, out
    print(f"over {len(ratios['2 per SM'][0])} points whose tiles differ, kernel time after an "
          "L2 flush / warm, over the current "
          "rule's (geometric mean; points ahead / behind by more than 2%):")
    _print_rule_ratios(ratios, 18)
    print(f"  Liger faster than the current rule at {peer['cold']} (cold) and {peer['warm']} "
          f"(warm) of {peer['points']} points")


def sine_tiles(rounds: int = 2) -> None:
    """Tiles for calls the L2 holds: the rule in use (a one-token tile of several heads, or of
    one narrow head, cut as two tokens where sines are computed), the one-token tiles it
    replaced (``sines=False``), and each at 1 program per SM (:func:`compare_rules`). In run AE
    (AE1, H200, before the one-head cut) the two-token tiles took 0.985 / 0.995 / 0.996 / 0.995
    / 0.993 of the one-token tiles' times."""
    sms = triton_rope._sm_count(0)
    choose = triton_rope.choose_config
    compare_rules({
        "in use": lambda *a: choose(*a, sms),
        "one token": lambda *a: choose(*a, sms, sines=False),
        "1/SM": lambda *a: choose(*a, max(1, sms // 2)),
        "one token 1/SM": lambda *a: choose(*a, max(1, sms // 2), sines=False),
    }, rounds)


ROW_TILE_SHAPES = [  # decode-sized single tensors beside the sweep's points
    bench.Shape("decode q sbhd s1 b64 h32", "sbhd", torch.bfloat16, 1, 64, 32, 128, 128),
    bench.Shape("one token sbhd s1 b1 h40", "sbhd", torch.bfloat16, 1, 1, 40, 128, 128),
]


def row_tiles(rounds: int = 3) -> None:
    """The fewest rows a small call's program keeps (``choose_config``'s ``min_rows``: 1, the
    rule in use, against 4, 8 and 16) at the sweep's points the L2 holds and two decode-sized
    tensors (:func:`compare_rules`). Run AE6 saw 8 x 1 ahead of 2 x 1 at 512 tokens of one
    head and run AD9 2 x 4 ahead of 1 x 2 at 128 tokens of 8 heads."""
    sms = triton_rope._sm_count(0)
    choose = triton_rope.choose_config
    compare_rules({"in use": lambda *a: choose(*a, sms)} | {
        f"min {rows}": lambda *a, rows=rows: choose(*a, sms, min_rows=rows) for rows in (4, 8, 16)
    }, rounds, ROW_TILE_SHAPES)


def _rule_calls(
    configs: dict[str, tuple[tuple, tuple]], shape: bench.Shape, inp: bench.Inputs,
    table: torch.Tensor, sin: torch.Tensor | None, out: torch.Tensor, x: torch.Tensor,
    g: torch.Tensor,
) -> tuple[dict, Any]:
    """For each rule (``name: (tile out of place, tile in place)``) a forward and a backward
    out of place (``inp``'s tensors into ``out``) and in place (on ``x`` and ``g``), named
    ``"<rule> fwd"``, ``"bwd"``, ``"ip fwd"`` and ``"ip bwd"``; with Liger's in-place kernels
    as ``"liger ip fwd"`` and ``"liger ip bwd"`` where it takes the point. Returns them and
    Liger's peer (or None)."""
    fns = {}
    for name, (config, ip_config) in configs.items():
        for mode, src, dst, back, c in (
                ("fwd", inp.t, out, False, config), ("bwd", inp.grad, out, True, config),
                ("ip fwd", x, x, False, ip_config), ("ip bwd", g, g, True, ip_config)):
            fns[f"{name} {mode}"] = (
                lambda src=src, dst=dst, back=back, c=c: triton_rope.launch(
                    src, dst, table, sin, inp.cu_seqlens, None, shape.layout, False, 1.0, 1, 0,
                    back, config=c, copy_pass=False))
    liger = bench._liger_peer(shape, inp)
    if liger is not None:
        fns["liger ip fwd"], fns["liger ip bwd"] = liger.fwd, liger.bwd
    return fns, liger


def compare_rules(rules: dict, rounds: int = 2, extra: list | None = None,
                  rates: bool = False) -> None:
    """Tile rules (``name: rule(n_tokens, heads, head_dim, rotary_dim, element_size,
    interleaved)``, the first the one in use) at the sweep's points up to ``RESIDENT_BYTES``
    (every layout, bf16, full rotary) and ``extra`` shapes, where their tiles differ, the
    table's rows read (``rates``: read as rates through its linearity flag, as a model's
    table is once seen twice): forward
    and backward kernel time out of place and in place by the profiler after an L2 flush
    (``rounds`` traces), and forward warm (a CUDA graph), with Liger's in-place kernels beside
    them; then each rule's geometric mean over the first's, and where Liger was faster."""
    from rope_dispatch import sweep

    first = next(iter(rules))
    modes = ("fwd", "bwd", "ip fwd", "ip bwd")
    ratios = {(name, mode): [] for name in rules for mode in modes + ("warm",)}
    behind = {(name, mode): 0 for name in rules for mode in ("ip fwd", "ip bwd")}
    points = [p for p in sweep.sweep_points() if p.tensor_bytes() <= triton_rope.RESIDENT_BYTES
              and p.rotary_dim == p.head_dim] + (extra or [])
    for shape in points:
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        table, sin = inp.freqs.view(inp.freqs.shape[0], -1), None
        if rates:
            table, sin = _flagged(table)
        x, g = inp.t.clone(), inp.grad.clone()
        out = torch.empty_like(inp.t)
        tokens = shape.seq * (1 if shape.layout == "thd" else shape.batch)
        configs = {name: rule(tokens, shape.heads, shape.head_dim, shape.rotary_dim,
                              inp.t.element_size(), False) for name, rule in rules.items()}
        if len(set(configs.values())) == 1:
            continue
        fns, liger = _rule_calls({name: (c, c) for name, c in configs.items()}, shape, inp,
                                 table, sin, out, x, g)
        traces = [bench.cold_kernel_us(fns, calls=30) for _ in range(rounds)]
        cold = {key: statistics.median(t[key] for t in traces) for key in fns}
        warm = {name: bench.graph_replay_us(fns[f"{name} fwd"]) for name in rules}
        cells = []
        for name, c in configs.items():
            for mode in modes:
                ratios[name, mode].append(cold[f"{name} {mode}"] / cold[f"{first} {mode}"])
            ratios[name, "warm"].append(warm[name] / warm[first])
            if liger is not None:
                for mode in ("ip fwd", "ip bwd"):
                    behind[name, mode] += cold[f"liger {mode}"] < cold[f"{name} {mode}"]
            cells.append(f"{name} {c[0]}x{c[1]} " + "/".join(
                f"{cold[f'{name} {m}']:.2f}" for m in modes) + f" w{warm[name]:.2f}")
        if liger is not None:
            cells.append(f"liger {cold['liger ip fwd']:.2f}/{cold['liger ip bwd']:.2f}")
        spread = "/".join(f"{min(t[f'{first} {m}'] for t in traces):.2f}-"
                          f"{max(t[f'{first} {m}'] for t in traces):.2f}" for m in modes)
        print(f"{shape.name}: " + " | ".join(cells) + f" | {first}, traces {spread}", flush=True)
        del inp, x, g, out
    print(f"kernel us: fwd/bwd/in-place fwd/in-place bwd after an L2 flush, w: fwd warm. Over "
          f"'{first}' (geometric mean over the points whose tiles differ):")
    for name in rules:
        means = ", ".join(
            f"{m} {statistics.geometric_mean(ratios[name, m]):.3f}"
            for m in modes + ("warm",))
        print(f"  {name:>16}: {means}; Liger faster in place at {behind[name, 'ip fwd']} fwd, "
              f"{behind[name, 'ip bwd']} bwd")


LIGER_LEAD_SHAPES = [  # (layout, seq, batch, heads, head_dim): where Liger's kernel led (run Y)
    ("sbhd", 128, 1, 1, 128), ("sbhd", 512, 1, 1, 128), ("sbhd", 128, 1, 8, 128),
    ("sbhd", 512, 1, 8, 128), ("sbhd", 128, 4, 8, 128), ("sbhd", 2048, 1, 32, 128),
    ("sbhd", 2048, 1, 8, 64), ("bshd", 128, 1, 8, 128), ("bshd", 512, 1, 8, 128),
    ("bshd", 128, 4, 8, 128), ("bshd", 512, 4, 8, 128),
]


def _print_cold_traces(fns: dict, rounds: int, calls: int) -> None:
    """``rounds`` profiler traces of ``fns`` (named ``"<what> fwd"`` or ``"<what> bwd"``), each
    call after an L2 flush (:func:`~rope_dispatch.bench.cold_kernel_us`): per trace a forward
    line and a backward line of kernel us."""
    for _ in range(rounds):
        us = bench.cold_kernel_us(fns, calls=calls)
        for mode in ("fwd", "bwd"):
            cells = [f"{name[: -4]} {t:.2f}" for name, t in us.items() if name.endswith(mode)]
            print(f"   {mode}: " + " | ".join(cells), flush=True)


def _print_warm_forwards(fns: dict, skip: str | None = None) -> None:
    """One line of the forwards of ``fns`` (named as :func:`_print_cold_traces` takes them;
    none whose name holds ``skip``) with the L2 warm: us per call replayed from a CUDA graph
    (:func:`~rope_dispatch.bench.graph_replay_us`)."""
    warm = {name[:-4]: bench.graph_replay_us(fn) for name, fn in fns.items()
            if name.endswith("fwd") and (skip is None or skip not in name)}
    print("   warm fwd: " + " | ".join(f"{name} {us:.2f}" for name, us in warm.items()),
          flush=True)


def _in_place(src: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None, layout: str,
              backward: bool = False):
    """Ours in place on ``src`` (as ``apply_``) at its default tile, as a call of no argument;
    ``table`` and ``sin`` as the kernels take them (a flag, a cache's sin, or None)."""
    return lambda: triton_rope.launch(src, src, table, sin, None, None, layout, False, 1.0, 1,
                                      0, backward, copy_pass=False)


def small_kinds(rounds: int = 2) -> None:
    """Where Liger's kernel led by the profiler (run Y): forward and backward kernel time after
    an L2 flush, in turn in one trace, of each table kind at its default tile (angle rows, a
    model's angle table read as rates by its flag, a rate table, a pair cache, a cos/sin cache
    in t's dtype as Liger reads it), angle rows and flagged rates at one token x all heads
    (Liger's cut), ours in place with angle rows, the flag, a cos/sin cache in t's dtype and a
    pair cache, and Liger's kernels; ``rounds`` traces per point."""
    for layout, seq, batch, heads, d in LIGER_LEAD_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, d)
        inp, x, out, angles, _ = _probe_inputs(shape)
        g, g_out = inp.grad, torch.empty_like(inp.grad)
        cos = inp.cache.cos.to(x.dtype).view(angles.shape)
        sin = inp.cache.sin.to(x.dtype).view(angles.shape)
        rates = rd.RateTable(angles[1, : d // 2].clone(), angles.shape[0])
        kinds = {"rows": (angles, None), "flag": _flagged(angles),
                 "rate table": rd.tables.kernel_tables(rates),
                 "pair cache": rd.tables.kernel_tables(_pair_cache(inp, angles)),
                 "cache bf16": (cos, sin)}
        fns: dict = {}
        for name, (tab, sn) in kinds.items():
            for mode, src, dst, back in (("fwd", x, out, False), ("bwd", g, g_out, True)):
                fns[f"{name} {mode}"] = lambda tab=tab, sn=sn, src=src, dst=dst, back=back: (
                    triton_rope.launch(src, dst, tab, sn, None, None, layout, False, 1.0, 1, 0,
                                       back))
        cut = (1, triton_rope._next_pow2(heads), 1, d // 2, 1, 4)
        fns["rows 1 x all fwd"] = lambda: triton_rope.launch(
            x, out, angles, None, None, None, layout, False, 1.0, 1, 0, False, config=cut)
        flag_tab, flag = kinds["flag"]
        fns["flag 1 x all fwd"] = lambda: triton_rope.launch(
            x, out, flag_tab, flag, None, None, layout, False, 1.0, 1, 0, False, config=cut)
        x_ip, g_ip = x.clone(), g.clone()
        for name in ("rows", "flag", "cache bf16", "pair cache"):  # in place, as Liger runs
            tab, sn = kinds[name]
            for mode, src, back in (("fwd", x_ip, False), ("bwd", g_ip, True)):
                fns[f"{name} in place {mode}"] = _in_place(src, tab, sn, layout, back)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        default = triton_rope.choose_config(seq * batch, heads, d, d, 2, False,
                                            triton_rope._sm_count(0))
        print(f"{layout} s{seq} b{batch} h{heads} d{d} (default tile {default[0]}x{default[1]}):",
              flush=True)
        _print_cold_traces(fns, rounds, calls=40)
        del x, out, g, g_out, x_ip, g_ip


IN_PLACE_SHAPES = [  # (layout, seq, batch, heads, head_dim, rotary_dim): where Liger led in place
    ("sbhd", 2048, 1, 32, 128, 64), ("sbhd", 128, 1, 8, 128, 128), ("sbhd", 512, 1, 8, 128, 128),
    ("bshd", 512, 1, 8, 128, 128), ("sbhd", 2048, 1, 8, 256, 256),
]
IN_PLACE_TILES = [  # (BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps)
    (1, 32, 1, 4), (2, 16, 1, 4), (4, 16, 1, 4), (4, 8, 1, 4), (8, 4, 1, 4), (8, 8, 1, 4),
    (1, 8, 1, 4), (1, 8, 1, 2), (1, 8, 1, 1), (2, 8, 1, 4), (1, 4, 1, 4), (1, 2, 1, 4),
    (1, 2, 1, 1), (1, 16, 1, 4), (16, 1, 4, 4), (8, 1, 4, 2),
]


def _in_place_tile_calls(
    tiles: list, x: torch.Tensor, g: torch.Tensor, angles: torch.Tensor, layout: str,
    head_dim: int,
) -> tuple[tuple, dict]:
    """The tile ``apply_`` takes in place on ``x`` (its heads spanning ``head_dim``, the
    ``angles``' rotary channels moved) and, for each of ``tiles`` (BLOCK_T, BLOCK_H,
    HEAD_ITERS, num_warps) that fits the call, a forward on ``x`` and a backward on ``g``, both
    in place, named ``"<tile> fwd"`` and ``"<tile> bwd"``."""
    tokens, heads, rot = x.numel() // (x.shape[-2] * head_dim), x.shape[-2], angles.shape[1]
    default = triton_rope.choose_config(tokens, heads, rot, rot, x.element_size(), False,
                                        triton_rope._sm_count(0), span_dim=head_dim)
    fns: dict = {}
    for bt, bh, iters, warps in tiles:
        if bh * iters > triton_rope._next_pow2(heads) or bt > tokens:
            continue
        config = (bt, bh, iters, rot // 2, 1, warps)
        for mode, src, back in (("fwd", x, False), ("bwd", g, True)):
            fns[f"{bt}x{bh}x{iters}/{warps}w {mode}"] = (
                lambda src=src, back=back, config=config: triton_rope.launch(
                    src, src, angles, None, None, None, layout, False, 1.0, 1, 0, back,
                    config=config, copy_pass=False))
    return default, fns


def in_place_tiles(rounds: int = 2, shapes: list = IN_PLACE_SHAPES,
                   tiles: list = IN_PLACE_TILES) -> None:
    """Ours in place (the rotary channels only, as ``apply_``) at explicit tiles, forward and
    backward by the profiler after an L2 flush, in turn with Liger's in-place kernels."""
    for layout, seq, batch, heads, d, rot in shapes:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, rot)
        inp, x, _, angles, _ = _probe_inputs(shape)
        g = inp.grad
        default, fns = _in_place_tile_calls(tiles, x, g, angles, layout, d)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d{d} rot{rot} in place (default tile "
              f"{default[0]}x{default[1]}x{default[2]}/{default[5]}w):", flush=True)
        _print_cold_traces(fns, rounds, calls=30)
        del x, g


ONE_HEAD_SHAPES = [  # (layout, seq, batch, heads, head_dim, rotary_dim): Liger led in run AE
    ("sbhd", 128, 1, 1, 128, 128), ("sbhd", 512, 1, 1, 128, 128), ("bshd", 128, 1, 1, 128, 128),
    ("bshd", 512, 1, 1, 128, 128), ("sbhd", 2048, 1, 1, 128, 128), ("sbhd", 16, 1, 32, 128, 128),
]
ONE_HEAD_TILES = [  # one-token tiles of d128 give each half of a head 64 threads' work of 128
    (1, 1, 1, 4), (1, 1, 1, 2), (1, 1, 1, 1), (2, 1, 1, 4), (2, 1, 1, 2), (4, 1, 1, 4),
    (8, 1, 1, 4), (1, 2, 1, 4), (2, 2, 1, 4),
]


WARM_IN_PLACE_SHAPES = [  # (layout, seq, batch, heads, head_dim, rotary_dim): Liger led warm
    ("sbhd", 2048, 1, 32, 128, 128), ("sbhd", 2048, 1, 32, 128, 64),
    ("sbhd", 2048, 4, 8, 128, 128), ("sbhd", 2048, 1, 8, 256, 256), ("sbhd", 128, 1, 8, 128, 128),
    ("sbhd", 512, 1, 8, 128, 128), ("sbhd", 128, 4, 8, 128, 128),
]
WARM_IN_PLACE_TILES = [  # (BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps)
    (1, 32, 1, 4), (2, 16, 1, 4), (4, 8, 1, 4), (8, 4, 1, 4), (8, 8, 1, 8), (2, 8, 1, 4),
    (1, 8, 1, 4), (1, 4, 1, 4), (1, 2, 1, 4), (8, 2, 2, 4), (16, 1, 4, 4), (8, 1, 4, 2),
]


def in_place_warm(rounds: int = 2) -> None:
    """Ours in place at explicit tiles with the L2 warm (replayed from a CUDA graph of 20 calls,
    the table's rows read as a captured call reads them), forward and backward, against our
    default tile on a table whose halves differ in their last bit (the same work for a kernel
    that works out both halves' sines; one sharing them where the halves repeat would tell the
    two apart: run AC), our default tile out of place and Liger's in-place kernels: us per
    call, ``rounds`` times."""
    for layout, seq, batch, heads, d, rot in WARM_IN_PLACE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, rot)
        inp, x, out, angles, _ = _probe_inputs(shape)
        g = inp.grad
        default, fns = _in_place_tile_calls(WARM_IN_PLACE_TILES, x, g, angles, layout, d)
        # the same angles but for the last bit of the second halves: their sines worked out too
        apart = angles.clone()
        apart[:, rot // 2:] = torch.nextafter(apart[:, rot // 2:], torch.tensor(1e9).cuda())
        for mode, src, back in (("fwd", x, False), ("bwd", g, True)):
            fns[f"halves apart {mode}"] = lambda src=src, back=back: triton_rope.launch(
                src, src, apart, None, None, None, layout, False, 1.0, 1, 0, back,
                copy_pass=False)
        fns["out of place fwd"] = lambda: triton_rope.launch(
            x, out, angles, None, None, None, layout, False, 1.0, 1, 0, False)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d{d} rot{rot} in place, warm (default tile "
              f"{default[0]}x{default[1]}x{default[2]}/{default[5]}w):", flush=True)
        for _ in range(rounds):
            us = {name: bench.graph_replay_us(fn) for name, fn in fns.items()}
            for mode in ("fwd", "bwd"):
                cells = [f"{name[: -4]} {t:.2f}" for name, t in us.items() if name.endswith(mode)]
                print(f"   {mode}: " + " | ".join(cells), flush=True)
        del x, g, out


RESIDENT_ROW_SHAPES = [(torch.bfloat16, 256), (torch.float32, 256), (torch.float32, 128)]


def resident_rows(rounds: int = 2) -> None:
    """Calls the L2 holds with rows of 512 bytes or more, 2,048 tokens of 8 heads (sbhd, a
    model's angle table read as rates): the tile ``choose_config`` takes and the one it took
    without ``RESIDENT_ROWS``, in place forward and backward and out of place forward, with the
    L2 warm (a CUDA graph of 20 calls) and after an L2 flush (the profiler), against Liger's
    in-place kernels: us per call, ``rounds`` times (run AD)."""
    sms = triton_rope._sm_count(0)
    for dtype, d in RESIDENT_ROW_SHAPES:
        shape = bench.Shape("probe", "sbhd", dtype, 2048, 1, 8, d, d)
        inp, x, out, angles, _ = _probe_inputs(shape)
        g = inp.grad
        table, flag = _flagged(angles)
        now = triton_rope.choose_config(2048, 8, d, d, x.element_size(), False, sms)
        rows = triton_rope.RESIDENT_ROWS
        triton_rope.RESIDENT_ROWS = 0
        try:
            before = triton_rope.choose_config(2048, 8, d, d, x.element_size(), False, sms)
        finally:
            triton_rope.RESIDENT_ROWS = rows
        fns: dict = {}
        for label, config in (("now", now), ("before", before)):
            name = f"{label} {config[0]}x{config[1]}"
            for mode, src, dst, back in (("in place fwd", x, x, False),
                                         ("in place bwd", g, g, True),
                                         ("out of place fwd", x, out, False)):
                fns[f"{name} {mode}"] = lambda src=src, dst=dst, back=back, config=config: (
                    triton_rope.launch(src, dst, table, flag, None, None, "sbhd", False, 1.0, 1, 0,
                                       back, config=config, copy_pass=dst is not src))
        liger = bench._liger_peer(shape, inp)
        fns["liger in place fwd"], fns["liger in place bwd"] = liger.fwd, liger.bwd
        print(f"sbhd s2048 b1 h8 d{d} {dtype}:", flush=True)
        for _ in range(rounds):
            warm = {name: bench.graph_replay_us(fn) for name, fn in fns.items()}
            flushed = bench.cold_kernel_us(fns, calls=20)
            for what, us in (("warm", warm), ("flushed", flushed)):
                print(f"   {what}: " + " | ".join(f"{n} {t:.2f}" for n, t in us.items()),
                      flush=True)
        del x, g, out


TABLE_SHAPES = [  # (layout, seq, batch, heads, head_dim): 64 MB and more
    ("sbhd", 131072, 1, 1, 128), ("sbhd", 32768, 1, 8, 128), ("sbhd", 32768, 4, 8, 128),
    ("sbhd", 8192, 1, 32, 128), ("sbhd", 32768, 1, 32, 128),
]
TABLE_TILES = [  # (BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps)
    (8, 4, 1, 4), (8, 4, 2, 4), (8, 4, 4, 4), (4, 8, 1, 4), (4, 8, 2, 4), (2, 16, 1, 4),
    (1, 32, 1, 4), (8, 8, 1, 8), (16, 4, 1, 4), (16, 2, 1, 4), (32, 1, 1, 4), (16, 1, 1, 4),
    (8, 2, 1, 4), (8, 1, 1, 4), (4, 4, 1, 4), (8, 4, 1, 8),
]


def _probe_inputs(shape: bench.Shape):
    """A probe point's inputs, an output buffer, its angle table as ``[s2, d2]`` and a device
    copy of the tensor's bytes (the ceiling), as the table modes use them."""
    inp = bench.make_inputs(shape, draw_on_device=True)
    x = inp.t
    src = x.flatten()
    dst = torch.empty_like(src)
    angles = inp.freqs.view(inp.freqs.shape[0], -1)
    return inp, x, torch.empty_like(x), angles, lambda: dst.copy_(src)


def _pair_cache(inp: bench.Inputs, angles: torch.Tensor) -> rd.PairCosSinCache:
    """An engine's pair cache (cos and sin once per rotated pair, float32) of ``inp``'s table."""
    half = angles.shape[1] // 2
    cos, sin = (part.view(angles.shape)[:, :half] for part in (inp.cache.cos, inp.cache.sin))
    return rd.PairCosSinCache(torch.cat((cos, sin), -1))


def _flagged(table: torch.Tensor) -> tuple:
    """:func:`triton_rope._kernel_tables` of an angle table at its second sight, where its
    linearity flag is made (the sweep's calls see a model's table many times), for a call
    reading enough rows to look for it (the probes' points all do)."""
    rows = triton_rope.LINEAR_MIN_ROWS_READ
    triton_rope._kernel_tables(table, rows)
    return triton_rope._kernel_tables(table, rows)


def _percent_ranges(got: list[tuple[float, float]]) -> str:
    """Forward and backward % of copy over a probe's rounds, as min-max ranges."""
    fwd, bwd = [f for f, _ in got], [b for _, b in got]
    return f"fwd {min(fwd):5.1f}-{max(fwd):5.1f}%  bwd {min(bwd):5.1f}-{max(bwd):5.1f}%"


def _percent_of_copy(
    x: torch.Tensor, out: torch.Tensor, cu: torch.Tensor | None, layout: str, runs: dict,
    device_copy, rounds: int,
) -> tuple[dict, list[float]]:
    """Forward and backward of each of ``runs`` (``{key: (table, sin, interleaved, config)}``)
    as % of a device copy timed in the same round, ``rounds`` rounds in turn: ``{key: [(fwd %,
    bwd %) per round]}`` and the copy's ms per round."""
    pct: dict = {key: [] for key in runs}
    copies = []
    for _ in range(rounds):
        copy = bench.bench_ms(device_copy)
        copies.append(copy)
        for key, (table, sin, interleaved, config) in runs.items():
            fwd, bwd = (bench.bench_ms(lambda back=back: triton_rope.launch(
                x, out, table, sin, cu, None, layout, interleaved, 1.0, 1, 0, back,
                config=config)) for back in (False, True))
            pct[key].append((100 * copy / fwd, 100 * copy / bwd))
    return pct, copies


def tables() -> None:
    """Forward kernel time of the tables that are read per token (a model's angle table read
    row by row, a cos/sin cache in t's dtype, an engine's pair cache) at explicit tiles, as %
    of a device copy of t's bytes, with Liger on the same cos/sin in the same run."""
    for layout, seq, batch, heads, d in TABLE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, d)
        inp, x, out, angles, device_copy = _probe_inputs(shape)
        cos = inp.cache.cos.to(x.dtype).view(angles.shape)
        sin = inp.cache.sin.to(x.dtype).view(angles.shape)
        kinds = {"angle rows": (angles, None), "cos/sin cache": (cos, sin),
                 "pair cache": rd.tables.kernel_tables(_pair_cache(inp, angles))}
        copy = bench.bench_ms(device_copy)
        liger = bench._liger_peer(shape, inp)
        liger_pct = 100 * copy / bench.bench_ms(liger.fwd) if liger is not None else float("nan")
        default = triton_rope.choose_config(seq * batch, heads, d, d, 2, False,
                                            triton_rope._sm_count(0))
        print(f"{layout} s{seq} b{batch} h{heads} d{d}: copy {1e3 * copy:.1f} us; Liger "
              f"{liger_pct:5.1f}%; default {default}")
        for bt, bh, iters, warps in TABLE_TILES:
            if bh * iters > max(heads, 1) * 2 or bh > heads:
                continue
            config = (bt, bh, iters, d // 2, 1, warps)
            shown = []
            for name, (tab, sn) in kinds.items():
                ms = bench.bench_ms(lambda: triton_rope.launch(
                    x, out, tab, sn, None, None, layout, False, 1.0, 1, 0, False, config=config))
                shown.append(f"{name} {100 * copy / ms:5.1f}%")
            mark = " <- default" if config == default else ""
            print(f"   tile {bt:>2} tok x {bh:>2} heads x {iters} iters, {warps} warps: "
                  + "  ".join(shown) + mark)
        del x, out


def _decode_calls() -> dict:
    """The serving decode q+k calls compared: ours with per-token positions (pair cache, rate
    table), ours on Liger's inputs, and Liger's q+k on rows gathered ahead and with the gather."""
    d = bench.serving_inputs(bench.SERVING_TOKENS["decode"])
    q, k, positions, cache = d["q"], d["k"], d["positions"], d["pair_cache"]
    rows = rd.PairCosSinCache(cache.table[positions])  # row t: token t's cos | sin
    q4, k4 = q.unsqueeze(0), k.unsqueeze(0)  # bshd b1: token t is position t
    bshd = rd.RoPESpec(layout="bshd", dtype=torch.bfloat16)
    half = cache.table.shape[1] // 2
    cos_full = torch.cat((cache.table[:, :half],) * 2, -1)  # Liger's [.., d] cos and sin
    sin_full = torch.cat((cache.table[:, half:],) * 2, -1)
    qb, kb = q.unsqueeze(2).clone(), k.unsqueeze(2).clone()  # Liger's [b, h, s=1, d]
    cos_rows, sin_rows = cos_full[positions][:, None], sin_full[positions][:, None]
    calls = {}
    try:
        from liger_kernel.ops.rope import rope_forward

        calls["liger q+k (rows gathered)"] = lambda: rope_forward(qb, kb, cos_rows, sin_rows)
        calls["liger gather + q+k"] = lambda: rope_forward(
            qb, kb, cos_full[positions][:, None], sin_full[positions][:, None])
    except ImportError:
        print("Liger is not installed")
    return calls | {
        "ours positions (pair cache)": lambda: rd.apply_qk_(q, k, cache, d["thd"], positions=positions),
        "ours positions (rate table)": lambda: rd.apply_qk_(q, k, d["rate_table"], d["thd"],
                                                            positions=positions),
        "ours rows gathered (Liger's inputs)": lambda: rd.apply_qk_(q4, k4, rows, bshd),
    }


def decode_compare() -> dict:
    """The decode q+k calls cold (``do_bench``: launch included) and warm, medians of 11
    rounds in turn, and their kernels' own time after an L2 flush, one line each; returns the
    calls."""
    calls = _decode_calls()
    kernel = bench.cold_kernel_us(calls)
    for name, (cold, warm) in bench.cold_warm_us(calls, rounds=11).items():
        print(f"  {name:>38}: cold {cold:5.2f} us  warm {warm:5.2f} us (medians of 11); "
              f"kernels alone, L2 flushed {kernel[name]:5.2f} us (median of 50)")
    return calls


def decode_processes(processes: int = 6) -> None:
    """:func:`decode_compare` in ``processes`` processes one after another: a cold figure of
    5-6 us moves by up to 0.7 us between processes on the same inputs, so the order of two
    kernels is read from how many processes it holds in, and from the median over them."""
    import re
    import subprocess
    import sys

    line = re.compile(r"^\s*(.+?): cold\s+([\d.]+) us\s+warm\s+([\d.]+) us")
    runs = []
    for n in range(processes):
        out = subprocess.run([sys.executable, __file__, "decode-compare"], capture_output=True,
                             text=True, check=True).stdout
        runs.append({m[1]: (float(m[2]), float(m[3])) for m in map(line.match, out.splitlines()) if m})
        print(f"process {n + 1}: " + "; ".join(f"{name} {c:.2f}/{w:.2f}"
                                                for name, (c, w) in runs[-1].items()), flush=True)
    print(f"decode q+k, cold / warm us, medians over {processes} processes (each a median of 11):")
    peer = "liger q+k (rows gathered)"
    for name in runs[0]:
        cold = statistics.median(r[name][0] for r in runs)
        warm = statistics.median(r[name][1] for r in runs)
        ahead = ""
        if peer in runs[0] and name != peer:
            ahead = (f"; faster than Liger's q+k cold in {sum(r[name][0] < r[peer][0] for r in runs)}"
                     f" of {processes} processes, warm in {sum(r[name][1] < r[peer][1] for r in runs)}")
        print(f"  {name:>38}: cold {cold:5.2f}  warm {warm:5.2f}{ahead}")


def compiled_kernels() -> None:
    """What a cold launch must fetch besides the data: each compiled variant of our kernels and
    of Liger's (code bytes, registers, spills, warps, shared memory), after the calls that
    compiled them."""
    from rope_dispatch.backends import triton_kernels

    fns = {"ours rope_kernel": triton_kernels.rope_kernel,
           "ours rope_qkv_kernel": triton_kernels.rope_qkv_kernel}
    try:
        from liger_kernel.ops import rope as liger_rope

        fns["liger _triton_rope"] = liger_rope._triton_rope
    except ImportError:
        pass
    for name, fn in fns.items():
        for cache in fn.device_caches.values():
            for compiled in cache[0].values():
                compiled._init_handles()
                meta = compiled.metadata
                print(f"  {name}: {len(compiled.asm.get('cubin', b''))} cubin bytes, "
                      f"{compiled.n_regs} registers, {compiled.n_spills} spills, "
                      f"{meta.num_warps} warps, {meta.shared} B shared")


LARGE_SHAPES = [  # (layout, seq, batch, heads, head_dim): 8-head sweep points and a 32-head twin
    ("sbhd", 32768, 1, 8, 128), ("sbhd", 8192, 4, 8, 128), ("bshd", 32768, 1, 8, 128),
    ("sbhd", 131072, 1, 8, 128), ("sbhd", 8192, 1, 32, 128), ("sbhd", 32768, 1, 8, 256),
]
LARGE_TILES = [(8, 4, 1, 4), (4, 8, 1, 4), (8, 8, 1, 4), (8, 8, 1, 8), (16, 4, 1, 4),
               (16, 4, 1, 8), (16, 8, 1, 8), (4, 4, 1, 4), (2, 8, 1, 4), (32, 2, 1, 8),
               (8, 4, 2, 4), (16, 2, 1, 4)]


def large_rates(rounds: int = 2) -> None:
    """Forward and backward kernel time at the sweep's 8-head points from 64 MiB (and a 32-head
    point of the same bytes), with a model's angle table read as rates (its linearity flag, as
    the sweep's triton series reads it), at explicit tiles, as % of a device copy timed in the
    same round; ``rounds`` rounds in turn, min-max shown. The tile rule was tuned when such
    tables were read row by row, where a tile's heads share its rows."""
    for layout, seq, batch, heads, d in LARGE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, d)
        inp, x, out, angles, device_copy = _probe_inputs(shape)
        tab, flag = _flagged(angles)
        default = triton_rope.choose_config(seq * batch, heads, d, d, 2, False,
                                            triton_rope._sm_count(0))
        runs = {(bt, bh, iters, warps): (tab, flag, False, (bt, bh, iters, d // 2, 1, warps))
                for bt, bh, iters, warps in LARGE_TILES if bh * iters <= heads}
        pct, copies = _percent_of_copy(x, out, None, layout, runs, device_copy, rounds)
        print(f"{layout} s{seq} b{batch} h{heads} d{d}: copy {1e3 * min(copies):.1f}-"
              f"{1e3 * max(copies):.1f} us; flag {'on' if flag is not None else 'off'}; "
              f"default {default}")
        for tile, got in sorted(pct.items(), key=lambda kv: -sum(f + b for f, b in kv[1])):
            bt, bh, iters, warps = tile
            mark = " <- default" if (bt, bh, iters, d // 2, 1, warps) == default else ""
            print(f"   tile {bt:>2} tok x {bh:>2} heads x {iters} iters, {warps} warps: "
                  f"{_percent_ranges(got)}{mark}")
        del x, out, inp


RULE_SHAPES = [  # (layout, seq, batch, heads, head_dim, dtype): sizes above RESIDENT_BYTES
    ("sbhd", 32768, 1, 8, 128, torch.bfloat16), ("bshd", 32768, 1, 8, 128, torch.bfloat16),
    ("thd", 32768, 4, 8, 128, torch.bfloat16), ("sbhd", 8192, 4, 8, 128, torch.bfloat16),
    ("sbhd", 131072, 1, 8, 128, torch.bfloat16), ("sbhd", 65536, 1, 8, 64, torch.bfloat16),
    ("sbhd", 32768, 1, 8, 256, torch.bfloat16), ("sbhd", 16384, 1, 8, 128, torch.float32),
    ("sbhd", 131072, 2, 1, 128, torch.bfloat16), ("sbhd", 65536, 1, 4, 128, torch.bfloat16),
    ("sbhd", 16384, 1, 16, 128, torch.bfloat16), ("sbhd", 8192, 1, 32, 128, torch.bfloat16),
    ("thd", 8192, 4, 32, 128, torch.bfloat16),
]


def _rule_config(
    tokens: int, heads: int, d: int, es: int, interleaved: bool, rule: tuple[int, int | None],
) -> tuple:
    """``choose_config``'s tile for a call with ``STREAM_TILE_BYTES`` and ``STREAM_WARPS`` set
    to ``rule`` (``None`` leaves the warps as they are)."""
    kept = triton_rope.STREAM_TILE_BYTES, triton_rope.STREAM_WARPS
    stream, warps = rule
    triton_rope.STREAM_TILE_BYTES = stream
    triton_rope.STREAM_WARPS = kept[1] if warps is None else warps
    try:
        return triton_rope.choose_config(tokens, heads, d, d, es, interleaved,
                                         triton_rope._sm_count(0))
    finally:
        triton_rope.STREAM_TILE_BYTES, triton_rope.STREAM_WARPS = kept


def _kinds_point(layout: str, seq: int, batch: int, heads: int, d: int, dtype: torch.dtype):
    """A probe point of ``seq`` tokens (thd: in ``batch`` sequences) for comparing tiles over
    the table kinds (:func:`_table_kinds`): ``(header, inputs, x, out, device copy, tokens,
    kinds)``, the header naming the point, its size and whether each table is read as rates."""
    thd = layout == "thd"
    where = f"{batch} seqs T{seq}" if thd else f"s{seq} b{batch}"
    name = f"{layout} {where} h{heads} d{d} {str(dtype).removeprefix('torch.')}"
    shape = bench.Shape("probe", layout, dtype, seq, 1 if thd else batch, heads, d, d,
                        batch if thd else 0)
    inp, x, out, angles, device_copy = _probe_inputs(shape)
    tokens = x.numel() // (heads * d)
    kinds, flag, pair_flag = _table_kinds(inp, angles)
    header = (f"{name} ({x.numel() * x.element_size() >> 20} MiB): "
              f"flags {flag is not None}/{pair_flag is not None}")
    return header, inp, x, out, device_copy, tokens, kinds


def _table_kinds(inp: bench.Inputs, angles: torch.Tensor) -> tuple[dict, Any, Any]:
    """The table kinds a tile rule is compared on, ``{name: (table, sin or flag, interleaved)}``:
    a model's angle table read as rates (its flag), the same read row by row, an engine's pair
    cache, and the angle table of interleaved pairs read as rates; then the two flags (None
    where a table is not read as rates)."""
    d = angles.shape[1]
    pairs = rd.tables.angle_table(rd.tables.inverse_frequencies(d, 10000.0), angles.shape[0],
                                  interleaved=True).view(angles.shape).to(angles.device)
    tab, flag = _flagged(angles)
    pair_tab, pair_flag = _flagged(pairs)
    kinds = {"rates": (tab, flag, False), "rows": (tab, None, False),
             "pair cache": (*rd.tables.kernel_tables(_pair_cache(inp, angles)), False),
             "interleaved rates": (pair_tab, pair_flag, True)}
    return kinds, flag, pair_flag


def large_rule(rounds: int = 2) -> None:
    """The tile rule for calls above ``RESIDENT_BYTES`` (``STREAM_TILE_BYTES``, heads first, with
    ``STREAM_WARPS``) against it with 4 warps and against the previous rule (8 tokens per 8 KiB
    tile) for each table kind whose tiles it sets:
    a model's angle table read as rates (its flag), the same read row by row, an engine's pair
    cache, and the angle table of interleaved pairs read as rates. Forward and backward as % of
    a device copy timed in the same round, ``rounds`` rounds in turn (min-max shown)."""
    kept = triton_rope.STREAM_TILE_BYTES
    for layout, seq, batch, heads, d, dtype in RULE_SHAPES:
        header, inp, x, out, device_copy, tokens, kinds = _kinds_point(
            layout, seq, batch, heads, d, dtype)
        es = x.element_size()
        rules = {"rule in use": (kept, None), "4 warps": (kept, 4), "previous rule": (0, None)}
        runs = {(kind, rule): (table, sin, inter,
                               _rule_config(tokens, heads, d, es, inter, values))
                for kind, (table, sin, inter) in kinds.items() for rule, values in rules.items()}
        pct, _ = _percent_of_copy(x, out, inp.cu_seqlens, layout, runs, device_copy, rounds)
        print(header)
        for (kind, rule), got in pct.items():
            config = runs[kind, rule][3]
            print(f"   {kind:>17} {rule:>13} ({config[0]:>2} x {config[1]:>2}, {config[5]} warps): "
                  f"{_percent_ranges(got)}")
        del x, out, inp


WIDE_SHAPES = [  # (layout, seq, batch or sequences, heads, head_dim, dtype): tokens of 8 KiB
    ("sbhd", 8192, 1, 32, 128, torch.bfloat16), ("sbhd", 32768, 1, 32, 128, torch.bfloat16),
    ("bshd", 8192, 1, 32, 128, torch.bfloat16), ("sbhd", 4096, 4, 32, 128, torch.bfloat16),
    ("thd", 8192, 4, 32, 128, torch.bfloat16), ("thd", 32768, 4, 32, 128, torch.bfloat16),
    ("sbhd", 16384, 1, 16, 256, torch.bfloat16), ("sbhd", 16384, 1, 16, 128, torch.float32),
]


def wide_tokens(rounds: int = 3) -> None:
    """Calls above ``RESIDENT_BYTES`` whose tokens are ``TILE_BYTES`` or more (32 heads of d 128
    in bf16, 16 of d 256, 16 of d 128 in float32), which keep the 8 KiB tile of 8 tokens: that
    tile against 16 and 4 tokens of the same bytes (``choose_config``'s ``tile_tokens``), for
    each table kind (rates, rows, pair cache, interleaved rates). Forward and backward as % of
    a device copy timed in the same round, ``rounds`` rounds in turn (min-max shown)."""
    for layout, seq, batch, heads, d, dtype in WIDE_SHAPES:
        header, inp, x, out, device_copy, tokens, kinds = _kinds_point(
            layout, seq, batch, heads, d, dtype)
        es, sms = x.element_size(), triton_rope._sm_count(0)
        runs = {(kind, n): (table, sin, inter, triton_rope.choose_config(
                    tokens, heads, d, d, es, inter, sms, tile_tokens=n))
                for kind, (table, sin, inter) in kinds.items() for n in (8, 16, 4)}
        pct, _ = _percent_of_copy(x, out, inp.cu_seqlens, layout, runs, device_copy, rounds)
        in_use = triton_rope.choose_config(tokens, heads, d, d, es, False, sms)
        print(f"{header}; in use {in_use}")
        for (kind, n), got in pct.items():
            config = runs[kind, n][3]
            print(f"   {kind:>17} {n:>2} tokens ({config[0]:>2} x {config[1]:>2}, {config[5]} "
                  f"warps): {_percent_ranges(got)}")
        del x, out, inp


THD_SHAPES = [  # (layout, tokens, sequences or batch, heads): the sweep's 8-head points from 64 MiB
    ("thd", 32768, 4, 8), ("thd", 32768, 16, 8), ("thd", 131072, 4, 8), ("thd", 131072, 16, 8),
    ("sbhd", 32768, 1, 8),  # the same bytes without cu_seqlens
]
THD_TILES = [(1, 8, 1, 4), (2, 8, 1, 4), (4, 8, 1, 4), (1, 8, 1, 2), (2, 8, 1, 8), (8, 4, 1, 4)]
THD_SHAPES_32 = [  # the sweep's thd point of 32 heads at 64 MiB, a larger one, sbhd alike
    ("thd", 8192, 4, 32), ("thd", 32768, 4, 32), ("sbhd", 8192, 1, 32),
]
THD_TILES_32 = [(8, 4, 1, 4), (4, 8, 1, 4), (2, 16, 1, 4), (16, 2, 1, 4), (8, 4, 1, 2),
                (4, 8, 1, 2), (8, 4, 1, 8)]


def thd_tiles(rounds: int = 3, heads_32: bool = False) -> None:
    """Forward and backward of the sweep's thd points of 8 heads from 64 MiB (each program
    finds its tokens' sequences in cu_seqlens first), beside sbhd of the same bytes, at explicit
    tiles with a model's angle table read as rates, as % of a device copy timed in the same
    round; ``rounds`` rounds in turn, min-max shown. ``heads_32``: the points of 32 heads
    (``thd-tiles 32``)."""
    d = 128
    shapes, tiles = (THD_SHAPES_32, THD_TILES_32) if heads_32 else (THD_SHAPES, THD_TILES)
    for layout, tokens, seqs, heads in shapes:
        thd = layout == "thd"
        shape = bench.Shape("probe", layout, torch.bfloat16, tokens, 1 if thd else seqs, heads,
                            d, d, seqs if thd else 0)
        inp, x, out, angles, device_copy = _probe_inputs(shape)
        tab, flag = _flagged(angles)
        default = triton_rope.choose_config(tokens, heads, d, d, 2, False,
                                            triton_rope._sm_count(0))
        runs = {(bt, bh, iters, warps): (tab, flag, False, (bt, bh, iters, d // 2, 1, warps))
                for bt, bh, iters, warps in tiles}
        pct, _ = _percent_of_copy(x, out, inp.cu_seqlens, layout, runs, device_copy, rounds)
        where = f"{seqs} seqs T{tokens}" if thd else f"s{tokens} b{seqs}"
        print(f"{layout} {where} h{heads} d{d}: default {default[:3]}, {default[5]} warps")
        for (bt, bh, iters, warps), got in pct.items():
            print(f"   tile {bt:>2} tok x {bh:>2} heads, {warps} warps: {_percent_ranges(got)}")
        del x, out, inp


PARTIAL_SHAPES = [  # (layout, seq, batch, heads, head_dim, rotary_dim): 64 MiB and more
    ("sbhd", 32768, 1, 32, 128, 64), ("bshd", 32768, 1, 32, 128, 64),
    ("sbhd", 8192, 4, 32, 128, 64), ("sbhd", 131072, 1, 8, 128, 64),
    ("sbhd", 32768, 1, 8, 256, 128),
]


def partial_rotary(rounds: int = 3) -> None:
    """Partial rotary in place (``apply_`` on the first d2 of d channels) and Liger's kernel
    (in place, q and a one-head k) against two ceilings of the bytes they move: a copy of that
    many contiguous bytes, and a copy of the same strided half rows from one tensor into
    another (read and write d2 of every d channels, as an in-place rotation does). Median of
    ``rounds`` rounds in turn, each call timed by ``do_bench``."""
    for layout, seq, batch, heads, d, rot in PARTIAL_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, d, rot)
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        ours = bench._ours_in_place("triton", inp)
        liger = bench._liger_peer(shape, inp)
        src, dst = inp.t, torch.empty_like(inp.t)
        half = torch.empty(inp.t.numel() * rot // d, dtype=inp.t.dtype, device="cuda")
        half_dst = torch.empty_like(half)
        calls = {
            "contiguous copy": lambda: half_dst.copy_(half),
            "strided half-row copy": lambda: dst[..., :rot].copy_(src[..., :rot]),
            "ours in place": ours.fwd,
        }
        if liger is not None:
            calls["Liger in place (+ 1-head k)"] = liger.fwd
        times = {name: [] for name in calls}
        for _ in range(rounds):
            for name, fn in calls.items():
                times[name].append(1e3 * bench.bench_ms(fn))
        us = {name: statistics.median(v) for name, v in times.items()}
        print(f"{layout} s{seq} b{batch} h{heads} d{d} rot{rot}: "
              f"{inp.t.numel() * rot // d * 2 * inp.t.element_size() / 2**20:.0f} MiB moved")
        for name, t in us.items():
            share = (heads + 1) / heads if name.startswith("Liger") else 1.0
            print(f"  {name:>28}: {t:8.1f} us  {100 * us['contiguous copy'] * share / t:5.1f}% of "
                  f"the contiguous copy, {100 * us['strided half-row copy'] * share / t:5.1f}% of "
                  "the strided one")
        del inp, src, dst, half, half_dst


def decode_qk() -> None:
    """The serving decode q+k launch (64 tokens, q 32 heads, k 8, in place) at explicit tiles:
    per-token positions into the pair cache (two dependent loads: position, then row) and into
    a rate table (sines computed), and the same tokens with their cos/sin rows gathered ahead
    (Liger's inputs: row = token), against Liger's q+k on those rows and Liger with the gather.
    The kernels' own time after an L2 flush (the profiler's, median of 30) and warm (20 calls
    in one CUDA graph, as a model's layers run them)."""
    calls = decode_compare()
    choose = triton_rope.choose_config
    sms = triton_rope._sm_count(0)
    cache, rates = (choose(64, (32, 8), 128, 128, 2, False, sms, sines=sines)[:2]
                    for sines in (False, True))
    print(f"decode q+k tiles (default: pair cache {cache[0]} x {cache[1]}, rate table "
          f"{rates[0]} x {rates[1]}):")
    for bt, bh, iters, warps in ((8, 1, 1, 4), (2, 4, 1, 4), (1, 8, 1, 4), (1, 8, 1, 2),
                                 (1, 32, 1, 4), (1, 32, 1, 8), (1, 16, 1, 4)):
        config = (bt, bh, iters, 64, 1, warps)
        triton_rope.choose_config = lambda *args, config=config, **kwargs: config
        triton_rope._fast_qkv.clear()
        dispatch.forget_plans()
        names = ("ours positions (pair cache)", "ours positions (rate table)",  # Liger's again
                 "ours rows gathered (Liger's inputs)", "liger q+k (rows gathered)")  # each tile
        chosen = {name: calls[name] for name in names if name in calls}
        kernel = bench.cold_kernel_us(chosen, calls=30)
        shown = [f"{name} kernels, L2 flushed {kernel[name]:5.2f} warm "
                 f"{bench.graph_replay_us(fn):5.2f}" for name, fn in chosen.items()]
        triton_rope.choose_config = choose
        print(f"   tile {bt} tok x {bh} heads x {iters} iters, {warps} warps: " + "; ".join(shown))
    triton_rope._fast_qkv.clear()
    compiled_kernels()


LEAN_SHAPES = [  # (layout, seq, batch, heads), d 128: where Liger's in-place kernel led (G1, G2)
    ("sbhd", 128, 1, 8), ("sbhd", 512, 1, 8), ("sbhd", 128, 4, 8), ("bshd", 128, 1, 8),
    ("bshd", 512, 1, 8), ("sbhd", 128, 1, 1), ("sbhd", 512, 1, 1), ("bshd", 128, 1, 1),
]
LEAN_TILES = [(2, 1), (4, 1), (1, 8), (2, 4), (2, 8)]  # (BLOCK_T, BLOCK_H)
COPY_SHAPES = [("sbhd", 128, 1, 1), ("sbhd", 128, 1, 8), ("bshd", 512, 1, 8)]


def _flagged_point(layout: str, seq: int, batch: int, heads: int) -> tuple:
    """A bf16 d 128 point's inputs, its angle table with a linearity flag (forced, as
    :func:`_flagged` forces it: the sweep reads the rows of calls this small) and the tile the
    general kernel takes there (``choose_config``; since run AI these calls run the lean
    kernel, at ``lean_tile``'s)."""
    shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
    inp, x, _, angles, _ = _probe_inputs(shape)
    table, flag = _flagged(angles)
    if flag is None:
        raise RuntimeError("the point's table got no linearity flag")
    default = triton_rope.choose_config(seq * batch, heads, 128, 128, 2, False,
                                        triton_rope._sm_count(0))
    return shape, inp, x, table, flag, default


def lean_kernel(rounds: int = 3) -> None:
    """Ours in place (the shipped launch: the lean kernel since run AI), the instruction-lean
    prototype (``scripts/lean_rope_probe.py``) at ``LEAN_TILES`` and, at the general kernel's
    tile, with each of the general kernel's ways put back (``SWITCHES``, forward) and all of
    them, and Liger's in-place kernels, forward and backward by the profiler after an L2
    flush, in turn in one trace; then the forwards with the L2 warm (a CUDA graph, where ours
    reads the table's rows: a captured call takes no flag). The prototype's results are first
    checked against ours, bit for bit."""
    from lean_rope_probe import SWITCHES, lean_rope_

    for layout, seq, batch, heads in LEAN_SHAPES:
        shape, inp, x, table, flag, default = _flagged_point(layout, seq, batch, heads)
        tiles = [tile for tile in LEAN_TILES if tile[1] <= heads]
        fns: dict = {}
        fns_src = x.clone()
        for mode, src, back in (("fwd", fns_src, False), ("bwd", inp.grad.clone(), True)):
            want = src.clone()
            _in_place(want, table, flag, layout, back)()
            for tile, switches in [(tile, ()) for tile in tiles] + [(default[:2], SWITCHES)]:
                got = src.clone()
                lean_rope_(got, table, flag, layout, tile, back, switches=switches)
                if not torch.equal(got, want):
                    raise RuntimeError(f"lean {tile} {switches} {mode} differs from ours at "
                                       f"{shape}")
            fns[f"ours {mode}"] = _in_place(src, table, flag, layout, back)
            for tile in tiles:
                fns[f"lean {tile[0]}x{tile[1]} {mode}"] = (
                    lambda src=src, tile=tile, back=back: lean_rope_(src, table, flag, layout,
                                                                     tile, back))
        for switch in SWITCHES:  # ours' tile, one of the shipped kernel's ways put back
            fns[f"lean {default[0]}x{default[1]} +{switch} fwd"] = (
                lambda src=fns_src, switch=switch: lean_rope_(src, table, flag, layout,
                                                              default[:2], switches=(switch,)))
        fns[f"lean {default[0]}x{default[1]} +all fwd"] = (
            lambda src=fns_src: lean_rope_(src, table, flag, layout, default[:2],
                                           switches=SWITCHES))
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 in place "
              f"(general {default[0]}x{default[1]}):", flush=True)
        _print_cold_traces(fns, rounds, calls=40)
        _print_warm_forwards(fns)


def kernel_copies(rounds: int = 3, copies: int = 6) -> None:
    """Ours in place, forward, compiled ``copies`` times over (``num_stages`` 1, 2, ... change
    nothing in a kernel without loops: the PTX's hash and the cubin's size are printed), each
    copy timed after an L2 flush, in turn: whether where a copy's code lies moves its time."""
    import hashlib

    kernels = triton_rope._load_kernels()
    for layout, seq, batch, heads in COPY_SHAPES:
        _, _, x, table, flag, default = _flagged_point(layout, seq, batch, heads)
        triton_rope._fast.clear()
        _in_place(x, table, flag, layout)()  # the shipped launch's arguments, from its entry
        ((_, _, grid, ints, ordered),) = triton_rope._fast.values()
        lean = len(ints) == 4  # the lean kernel's integers: tokens, dim1 and its magic
        kernel = kernels.rope_lean_kernel if lean else kernels.rope_kernel
        warps = triton_rope.WARPS if lean else default[5]
        consts = dict(zip(kernel.arg_names[6 + len(ints):], ordered))
        fns, builds = {}, []
        for stages in range(1, copies + 1):
            def run(stages=stages):
                return kernel[grid](x, x, table, flag, table, table, *ints, num_warps=warps,
                                    num_stages=stages, **consts)
            compiled = run()
            builds.append(f"{hashlib.sha1(compiled.asm['ptx'].encode()).hexdigest()[:8]}/"
                          f"{len(compiled.asm['cubin'])}")
            fns[f"copy {stages} fwd"] = run
        print(f"{layout} s{seq} b{batch} h{heads} d128 (tile {default[0]}x{default[1]}), "
              f"PTX hash / cubin bytes: {', '.join(builds)}", flush=True)
        _print_cold_traces(fns, rounds, calls=40)


def input_copies(rounds: int = 3, copies: int = 6) -> None:
    """Ours in place, forward, on ``copies`` copies of the input at different addresses (64 KiB
    to 4 MiB apart), and Liger's on four sets of its own inputs, each timed after an L2 flush,
    in turn: whether where the data lies moves the time."""
    gaps = torch.Generator().manual_seed(0)
    for layout, seq, batch, heads in COPY_SHAPES:
        shape, inp, x, table, flag, default = _flagged_point(layout, seq, batch, heads)
        held, fns = [], {}
        for i in range(copies + 4):
            held.append(torch.empty(int(torch.randint(1, 64, (), generator=gaps)) << 16,
                                    dtype=torch.int8, device="cuda"))
            if i < copies:
                held.append(x.clone())
                fns[f"ours @{held[-1].data_ptr() >> 10 & 0x3FFF:5d}K fwd"] = _in_place(
                    held[-1], table, flag, layout)
            else:
                held.append(bench._liger_peer(shape, inp))
                fns[f"liger {i - copies} fwd"] = held[-1].fwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 (general {default[0]}x{default[1]}; address "
              "mod 16 MiB):", flush=True)
        _print_cold_traces(fns, rounds, calls=40)


LEAN_SHIPPED_SHAPES = [  # (layout, seq, batch, heads, head_dim, dtype)
    ("sbhd", 128, 1, 8, 128, torch.bfloat16), ("sbhd", 512, 1, 8, 128, torch.bfloat16),
    ("sbhd", 128, 4, 8, 128, torch.bfloat16), ("bshd", 128, 1, 8, 128, torch.bfloat16),
    ("bshd", 512, 1, 8, 128, torch.bfloat16), ("sbhd", 128, 1, 1, 128, torch.bfloat16),
    ("sbhd", 512, 1, 1, 128, torch.bfloat16), ("bshd", 128, 1, 2, 128, torch.bfloat16),
    ("bshd", 512, 1, 4, 128, torch.bfloat16), ("sbhd", 128, 1, 32, 128, torch.bfloat16),
    ("sbhd", 512, 1, 8, 64, torch.bfloat16), ("sbhd", 128, 1, 8, 256, torch.bfloat16),
    ("sbhd", 128, 1, 8, 128, torch.float32), ("sbhd", 2048, 1, 8, 128, torch.bfloat16),
]
LEAN_SHIPPED_TILES = [(1, 8), (2, 8), (1, 4), (2, 4), (2, 2), (4, 1), (2, 1), (8, 1)]


def _lean_at(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, layout: str,
             backward: bool, tile: tuple[int, int], warps: int = triton_rope.WARPS,
             flag: torch.Tensor | None = None, shared: bool | None = None,
             vector: int | None = None, kernels: ModuleType | None = None,
             one_sequence: bool | None = None):
    """The lean kernel at ``tile`` on ``warps`` warps on ``src`` into ``dst`` (``src``
    itself: in place), the table's rows read (through its linearity ``flag`` where given), as
    a call of no argument (Triton's own launch: the profiler times the kernel alone); a row's
    sines ``shared`` across the tile's heads or not, at most ``vector`` adjacent channels a
    thread, a batch of one's positions taken as the token's index or not (``one_sequence``;
    None for each: as the launcher decides); from the kernel module ``kernels`` (None: the
    shipped one)."""
    n0, dim1, heads, d = src.shape
    kernels = kernels or triton_rope._load_kernels()
    grid, ints, consts = triton_rope._lean_arguments(
        n0 * dim1, dim1, heads, d, d, d, src.element_size(), 0 if layout == "sbhd" else 1, False,
        (False, False, False, flag is not None), backward, 1.0, kernels.INTERPRETED,
    )
    consts.update(BLOCK_T=tile[0], BLOCK_H=tile[1])
    if shared is not None:
        consts.update(SHARED_ROWS=shared)
    if vector is not None:
        consts.update(VECTOR=vector)
    if one_sequence is not None:
        consts.update(ONE_SEQUENCE=one_sequence)
    grid = (-(-n0 * dim1 // tile[0]) * -(-heads // tile[1]), 1, 1)
    kernel = kernels.rope_lean_kernel
    sin = table if flag is None else flag
    return lambda: kernel[grid](src, dst, table, sin, table, table, *ints, num_warps=warps,
                                **consts)


def lean_shipped(rounds: int = 3) -> None:
    """The shipped lean kernel against the general kernel (at choose_config's tile), at the
    sweep's small points and a few more (``LEAN_SHIPPED_SHAPES``, table rows read as the sweep
    reads them): in place and into a fresh output, forward and backward, by the profiler after
    an L2 flush, in turn in one trace with Liger's in-place kernels and the lean kernel at the
    other tiles of ``LEAN_SHIPPED_TILES``; then the forwards with the L2 warm. Each lean launch
    is first checked bit for bit against the general kernel."""
    for layout, seq, batch, heads, d, dtype in LEAN_SHIPPED_SHAPES:
        shape = bench.Shape("probe", layout, dtype, seq, batch, heads, d, d)
        inp, x, out, angles, _ = _probe_inputs(shape)
        g, g_out = inp.grad, torch.empty_like(inp.grad)
        default = triton_rope.choose_config(seq * batch, heads, d, d, x.element_size(), False,
                                            triton_rope._sm_count(0))
        shipped = triton_rope.lean_tile(seq * batch, heads, d, x.element_size())
        fits = x.numel() * x.element_size() <= triton_rope.LEAN_MAX_BYTES

        def general(src, dst, back, copy_pass=True):
            return lambda: triton_rope.launch(src, dst, angles, None, None, None, layout, False,
                                              1.0, 1, 0, back, config=default,
                                              copy_pass=copy_pass)

        others = [tile for tile in LEAN_SHIPPED_TILES
                  if fits and tile != shipped and tile[1] <= heads]
        fns: dict = {}
        x_ip, g_ip = x.clone(), g.clone()
        for mode, src, dst, ip, back in (("fwd", x, out, x_ip, False),
                                         ("bwd", g, g_out, g_ip, True)):
            want, got = torch.empty_like(dst), torch.empty_like(dst)
            general(src, want, back)()
            for tile in [shipped, *others]:
                _lean_at(src, got, angles, layout, back, tile)()
                if not torch.equal(got, want):
                    raise RuntimeError(f"lean {tile} {mode} differs at {shape}")
            name = f"lean {shipped[0]}x{shipped[1]}"
            fns[f"general out {mode}"] = general(src, dst, back)
            fns[f"{name} out {mode}"] = _lean_at(src, dst, angles, layout, back, shipped)
            fns[f"general in place {mode}"] = general(ip, ip, back, copy_pass=False)
            fns[f"{name} in place {mode}"] = _lean_at(ip, ip, angles, layout, back, shipped)
            for tile in others:
                fns[f"lean {tile[0]}x{tile[1]} in place {mode}"] = _lean_at(
                    ip, ip, angles, layout, back, tile)
        if dtype is not torch.float32:
            liger = bench._liger_peer(shape, inp)
            fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d{d} {str(dtype)[6:]} (general "
              f"{default[0]}x{default[1]}, lean {shipped[0]}x{shipped[1]}"
              f"{'' if fits else ', above LEAN_MAX_BYTES'}):", flush=True)
        _print_cold_traces(fns, rounds, calls=40)
        _print_warm_forwards(fns)
        del x, out, g, g_out, x_ip, g_ip


LEAN_WARPS_SHAPES = [  # (layout, seq, batch, heads): the sweep's points of d 128 at most 1 MiB
    ("sbhd", 128, 1, 8), ("sbhd", 512, 1, 8), ("sbhd", 128, 4, 8), ("bshd", 128, 1, 8),
    ("bshd", 512, 1, 8), ("bshd", 128, 4, 8), ("sbhd", 128, 1, 1), ("sbhd", 512, 1, 1),
    ("bshd", 128, 1, 1), ("sbhd", 128, 1, 32),
]


def lean_warps(rounds: int = 3) -> None:
    """The shipped lean kernel in place at its tile on 4, 2 and 1 warps, and through a forced
    linearity flag (rates from row 1: two sine and cosine instructions a pair where the rows'
    two halves take four), against Liger's in-place kernels, forward and backward by the
    profiler after an L2 flush, in turn in one trace, at the sweep's small bf16 points; then
    the forwards with the L2 warm. Each variant is first checked bit for bit against the
    shipped launch (the flag's against the shipped launch through the flag)."""
    for layout, seq, batch, heads in LEAN_WARPS_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        inp, x, _, angles, _ = _probe_inputs(shape)
        flag_table, flag = _flagged(angles.clone())
        if flag is None:
            raise RuntimeError("the point's table got no linearity flag")
        tile = triton_rope.lean_tile(seq * batch, heads, 128, x.element_size())
        fns: dict = {}
        for mode, src, back in (("fwd", x.clone(), False), ("bwd", inp.grad.clone(), True)):
            want = src.clone()
            _in_place(want, angles, None, layout, back)()
            for warps in (4, 2, 1):
                got = src.clone()
                _lean_at(got, got, angles, layout, back, tile, warps)()
                if not torch.equal(got, want):
                    raise RuntimeError(f"lean w{warps} {mode} differs at {shape}")
                fns[f"lean w{warps} {mode}"] = _lean_at(src, src, angles, layout, back, tile,
                                                        warps)
            got, want = src.clone(), src.clone()
            _lean_at(got, got, flag_table, layout, back, tile, flag=flag)()
            _in_place(want, flag_table, flag, layout, back)()
            if not torch.equal(got, want):
                raise RuntimeError(f"lean flag {mode} differs at {shape}")
            fns[f"lean flag {mode}"] = _lean_at(src, src, flag_table, layout, back, tile,
                                                flag=flag)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 in place (lean {tile[0]}x{tile[1]}):",
              flush=True)
        _print_cold_traces(fns, rounds, calls=40)
        _print_warm_forwards(fns, skip="flag")  # a captured call takes no flag


SHARED_SINES_SHAPES = [  # (layout, seq, batch, heads, head_dim, dtype)
    *((layout, seq, batch, heads, 128, torch.bfloat16) for layout, seq, batch, heads in
      LEAN_WARPS_SHAPES),
    ("bshd", 512, 1, 4, 128, torch.bfloat16), ("sbhd", 512, 1, 8, 64, torch.bfloat16),
    ("sbhd", 128, 1, 8, 256, torch.bfloat16), ("sbhd", 128, 1, 8, 128, torch.float32),
]


def shared_sines(rounds: int = 3) -> None:
    """The lean kernel at its tile with a row's sines computed once for the tile's heads
    (``SHARED_ROWS``) and once per head, in place and into a fresh output, forward and
    backward, against Liger's in-place kernels, by the profiler after an L2 flush, in turn in
    one trace; then the forwards with the L2 warm. The two forms are first checked bit for
    bit against each other."""
    for layout, seq, batch, heads, d, dtype in SHARED_SINES_SHAPES:
        shape = bench.Shape("probe", layout, dtype, seq, batch, heads, d, d)
        inp, x, out, angles, _ = _probe_inputs(shape)
        g, g_out = inp.grad, torch.empty_like(inp.grad)
        tile = triton_rope.lean_tile(seq * batch, heads, d, x.element_size())
        fns: dict = {}
        for mode, src, dst, back in (("fwd", x, out, False), ("bwd", g, g_out, True)):
            once, per_head = torch.empty_like(dst), torch.empty_like(dst)
            _lean_at(src, once, angles, layout, back, tile, shared=True)()
            _lean_at(src, per_head, angles, layout, back, tile, shared=False)()
            if not torch.equal(once, per_head):
                raise RuntimeError(f"shared sines {mode} differ at {shape}")
            ip = src.clone()
            for label, shared in (("once", True), ("per head", False)):
                fns[f"{label} in place {mode}"] = _lean_at(ip, ip, angles, layout, back, tile,
                                                           shared=shared)
                fns[f"{label} out {mode}"] = _lean_at(src, dst, angles, layout, back, tile,
                                                      shared=shared)
        if dtype is not torch.float32:
            liger = bench._liger_peer(shape, inp)
            fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d{d} {str(dtype)[6:]} (lean "
              f"{tile[0]}x{tile[1]}, shipped sines "
              f"{'once' if triton_rope.shared_rows(*tile, False) else 'per head'}):",
              flush=True)
        _print_cold_traces(fns, rounds, calls=40)
        _print_warm_forwards(fns)


TABLE_BYTES_SHAPES = [  # (layout, seq, batch, heads): where Liger's in-place kernel led ours
    ("sbhd", 128, 1, 8), ("bshd", 128, 1, 8), ("sbhd", 512, 1, 8), ("bshd", 512, 1, 8),
    ("sbhd", 128, 1, 1),
]


def table_bytes(rounds: int = 3) -> None:
    """Ours in place (the shipped launch) on tables of different bytes a token: the angle rows
    (float32, both halves: 512 bytes a token at d 128), a pair cache in float32 (512) and in
    bf16 (256, the bytes and lines Liger's kernel reads: the first half of its cos and sin
    rows), a cos/sin cache in bf16 (512) and in float32 (1,024), against Liger's in-place
    kernels, by the profiler after an L2 flush, in turn in one trace: whether the table's bytes
    a token account for Liger's lead at 128 tokens of 8 heads. Each kind is first checked
    against the angle rows' result (within bf16 rounding of the table)."""
    for layout, seq, batch, heads in TABLE_BYTES_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        inp, x, _, angles, _ = _probe_inputs(shape)
        pair = _pair_cache(inp, angles).table
        pair16 = pair.to(torch.bfloat16)
        cos16, sin16 = (part.view(angles.shape).to(torch.bfloat16)
                        for part in (inp.cache.cos, inp.cache.sin))
        cos32, sin32 = (part.view(angles.shape) for part in (inp.cache.cos, inp.cache.sin))
        kinds = {"angles f32": (angles, None), "pair f32": (pair, pair[:, 64:]),
                 "pair bf16": (pair16, pair16[:, 64:]), "cos/sin bf16": (cos16, sin16),
                 "cos/sin f32": (cos32, sin32)}
        fns: dict = {}
        for mode, src, back in (("fwd", x, False), ("bwd", inp.grad, True)):
            want = src.clone()
            _in_place(want, angles, None, layout, back)()
            for name, (table, sin) in kinds.items():
                got = src.clone()
                _in_place(got, table, sin, layout, back)()
                err = (got.float() - want.float()).abs().max().item()
                if not err < 0.05:
                    raise RuntimeError(f"{name} {mode} off by {err} at {shape}")
                ip = src.clone()
                fns[f"{name} {mode}"] = _in_place(ip, table, sin, layout, back)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 bf16 in place:", flush=True)
        _print_cold_traces(fns, rounds, calls=40)


def sweep_orders(rounds: int = 3) -> None:
    """The sweep's own kernel timing (``sweep.profiled_kernel_times``) at 128 tokens of 8 heads
    (d 128, bf16), ``rounds`` traces in each of four orders: the sweep's (its implementations,
    then ours in place), ours in place first, ours in place and Liger's alone, and those two
    reversed: whether the order of the calls in the trace moves ours in place against Liger's
    (run AI)."""
    from rope_dispatch import sweep

    for layout in ("bshd", "sbhd"):
        shape = bench.Shape("probe", layout, torch.bfloat16, 128, 1, 8, 128, 128)
        inp = bench.make_inputs(shape, draw_on_device=True)
        impls = {}
        for name in sweep.IMPLEMENTATIONS:
            impl, _ = sweep._build(name, shape, inp)
            if impl is not None:
                impls[name] = impl
        ours = bench._ours_in_place("triton", inp)
        orders = {
            "sweep order": {**impls, "in place": ours},
            "in place first": {"in place": ours, **impls},
            "pair": {"in place": ours, "liger": impls["liger"]},
            "pair reversed": {"liger": impls["liger"], "in place": ours},
        }
        for label, fns in orders.items():
            for _ in range(rounds):
                got = sweep.profiled_kernel_times(fns)
                cells = [f"{name} {us.get('fwd_profiled_us', 0):.2f}/"
                         f"{us.get('bwd_kernel_profiled_us', 0):.2f}"
                         for name, us in got.items() if name in ("in place", "liger", "triton")]
                print(f"{layout} {label}: " + " | ".join(cells), flush=True)


def _capped_tokens(cap: int):
    """``choose_config`` in use, but a one-head tile of a one-head call takes at most ``cap``
    tokens."""
    sms = triton_rope._sm_count(0)

    def rule(n_tokens, heads, *rest):
        config = triton_rope.choose_config(n_tokens, heads, *rest, sms)
        if heads == 1 and config[1] == 1 and config[0] > cap:
            return (cap, *config[1:])
        return config
    return rule


def one_head_rule(rounds: int = 3) -> None:
    """Tiles of one-head calls the L2 can hold (2-16 MiB: 8,192 and 32,768 tokens, where the
    resident rule gives 16 and 32 tokens a program and run AK2 had 71-77% of copy after an L2
    flush), capped at 4, 8 and 16 tokens, with the table's rows and read as rates
    (:func:`compare_rules`)."""
    sms = triton_rope._sm_count(0)
    rules = {"in use": lambda *a: triton_rope.choose_config(*a, sms)} | {
        f"cap {cap}": _capped_tokens(cap) for cap in (4, 8, 16)}
    for rates in (True, False):
        print(f"table read {'as rates' if rates else 'as rows'}:", flush=True)
        compare_rules(rules, rounds, rates=rates)


TIE_SHAPES = [  # (layout, seq, batch, heads): where Liger's in-place kernel led by <= 0.11 us
    ("sbhd", 128, 1, 8), ("bshd", 128, 1, 8), ("sbhd", 512, 1, 8), ("bshd", 512, 1, 8),
    ("sbhd", 128, 4, 8), ("bshd", 128, 1, 1), ("sbhd", 512, 1, 1),
]


def _print_paired(fns: dict | Callable[[], dict], rounds: int, calls: int,
                  peers: tuple[str, ...] = ("liger",), dirty: bool = True) -> None:
    """``rounds`` profiler traces of ``fns`` (named ``"<what> fwd"`` / ``"<what> bwd"``, Liger's
    as ``"liger fwd"`` / ``"liger bwd"``; or a function making them anew for each trace),
    at least ``calls`` calls each, in rounds of balanced orders, each after an L2 flush
    (:func:`~rope_dispatch.bench.cold_kernel_samples`; one that leaves clean lines where not
    ``dirty``). Per peer (a ``<what>`` of ``fns``) and
    mode a line: the pooled medians, and each other's median of its paired differences to the
    peer's (neighbouring calls) with its 95% interval
    (:func:`~rope_dispatch.bench.paired_difference`)."""
    samples: dict = {}
    for _ in range(rounds):  # each trace balances the names' places itself (trace_order)
        made = fns() if callable(fns) else fns
        for name, us in bench.cold_kernel_samples(made, calls=calls, dirty=dirty).items():
            samples.setdefault(name, []).extend(us)
    for peer in peers:
        for mode in ("fwd", "bwd"):
            theirs = samples[f"{peer} {mode}"]
            cells = [f"{peer} {statistics.median(theirs):.3f}"]
            for name, ours in samples.items():
                if name.endswith(mode) and name != f"{peer} {mode}":
                    low, mid, high = bench.paired_difference(ours, theirs)
                    cells.append(f"{name[:-4]} {statistics.median(ours):.3f} ({1e3 * mid:+.0f} "
                                 f"ns, 95% {1e3 * low:+.0f} to {1e3 * high:+.0f})")
            print(f"   {mode}: " + " | ".join(cells), flush=True)


def _spacer(gen: random.Random) -> torch.Tensor:
    """A GPU buffer of 0-1 MiB (in 512-byte steps) allocated before a trace's buffers, so that
    no one placement in memory weighs on every trace."""
    return torch.empty(512 * gen.randrange(2048), dtype=torch.int8, device="cuda")


def _placed_anew(shape: bench.Shape, gen: random.Random, kept: list,
                 launches: Callable[..., dict]) -> tuple[dict, bench.Inputs]:
    """Inputs of ``shape`` made anew after a :func:`_spacer`, and per mode (``"fwd"`` on the
    input, ``"bwd"`` on its gradient) the calls ``launches(src, angles, backward, mode, want)``
    names, ``want`` the shipped in-place launch's result on ``src``; with Liger's in-place
    kernels as ``"liger fwd"`` and ``"liger bwd"``. Everything is held in ``kept`` (the
    buffers ``launches`` appends too) until the next call; returns the calls and the inputs."""
    kept[:] = [_spacer(gen)]
    inp = bench.make_inputs(shape, draw_on_device=True)
    angles = inp.freqs.view(inp.freqs.shape[0], -1)
    fns: dict = {}
    for mode, src, back in (("fwd", inp.t, False), ("bwd", inp.grad, True)):
        want = src.clone()
        _in_place(want, angles, None, shape.layout, back)()
        fns.update(launches(src, angles, back, mode, want))
    liger = bench._liger_peer(shape, inp)
    fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
    kept.append(inp)
    return fns, inp


def _out_of_place_checked(src: torch.Tensor, want: torch.Tensor, label: str, kept: list,
                          *args: Any, **options: Any) -> tuple[Callable[[], Any], Any]:
    """:func:`_lean_at` on ``src`` into a buffer of its own (NaN first, held in ``kept``), as
    ``apply`` writes, launched once and checked bit for bit against ``want``: the call, and
    what the launch returned (Triton's compiled kernel). ``args`` and ``options`` follow
    ``_lean_at``'s ``dst``."""
    dst = torch.full_like(src, float("nan"))
    call = _lean_at(src, dst, *args, **options)
    compiled = call()
    if not torch.equal(dst, want):
        raise RuntimeError(f"{label} differs from the shipped in-place result")
    kept.append(dst)
    return call, compiled


def ties(rounds: int = 12, calls: int = 40) -> None:
    """Ours in place (``apply_`` and its backward, as the sweep times them) and the lean kernel
    at its shipped tile with a batch of one's positions divided out of the token index (before
    run AW; ``ONE_SEQUENCE`` off) against Liger's in-place kernels where they led by at most
    0.11 us (:func:`_print_paired`: medians, and ours minus Liger's with its 95% interval),
    every implementation's buffers placed anew for each trace, so that no one placement in
    memory weighs on all its samples."""
    gen = random.Random(0)
    for layout, seq, batch, heads in TIE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        kept: list = []

        def fresh() -> dict:
            """Every implementation's buffers anew, after a spacer of 0-1 MiB (in 512-byte
            steps), so that no one of them keeps one placement in memory for all traces."""
            kept[:] = [_spacer(gen)]
            inp = bench.make_inputs(shape, draw_on_device=True)
            ours, liger = bench._ours_in_place("triton", inp), bench._liger_peer(shape, inp)
            fns = {"ours fwd": ours.fwd, "ours bwd": ours.bwd}
            x, angles = inp.t.clone(), inp.freqs.view(inp.freqs.shape[0], -1)
            tile = triton_rope.lean_tile(seq * batch, heads, 128, x.element_size())
            for mode, src, back in (("fwd", x, False), ("bwd", inp.grad.clone(), True)):
                fns[f"divided index {mode}"] = _lean_at(src, src, angles, layout, back, tile,
                                                        one_sequence=False)
            fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
            kept.append(fns)
            return fns

        print(f"{layout} s{seq} b{batch} h{heads} d128 bf16:", flush=True)
        _print_paired(fresh, rounds, calls)


LEAN_OUT_TILES = [(1, 8, 4), (1, 8, 2), (1, 4, 4), (1, 4, 2), (1, 2, 2), (1, 2, 1), (1, 1, 1)]
"""(tokens, heads, warps) of :func:`lean_out_tiles`, the shipped tile first."""


def lean_out_tiles(rounds: int = 8, calls: int = 40) -> None:
    """The lean kernel out of place (into a buffer of its own, as ``apply`` writes) at tiles of
    fewer heads and warps, so more programs free at once the L2 lines its stores need after a
    flush, and ``apply`` itself, against Liger's in-place kernels at the 8-head points where
    those led ours out of place (run BA); every buffer placed anew for each trace
    (:func:`_print_paired`), each tile first checked bit for bit against the shipped in-place
    launch."""
    gen = random.Random(0)
    for layout, seq, batch, heads in TIE_SHAPES[:5]:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        kept: list = []

        def tiles(src, angles, back, mode, want) -> dict:
            """Each of ``LEAN_OUT_TILES`` out of place, checked against ``want``."""
            launched = {}
            for tokens, tile_heads, warps in LEAN_OUT_TILES:
                label = f"{tokens}x{tile_heads} w{warps} {mode}"
                launched[label] = _out_of_place_checked(src, want, label, kept, angles, layout,
                                                        back, (tokens, tile_heads), warps)[0]
            return launched

        def fresh() -> dict:
            fns, inp = _placed_anew(shape, gen, kept, tiles)
            ours = bench._ours("triton", "apply", inp, inp.freqs)
            fns["apply fwd"], fns["apply bwd"] = ours.fwd, ours.bwd
            return fns

        print(f"{layout} s{seq} b{batch} h{heads} d128 bf16, out of place against Liger's in "
              f"place:", flush=True)
        _print_paired(fresh, rounds, calls)


def lean_warps_paired(rounds: int = 8, calls: int = 40) -> None:
    """The shipped lean kernel on 4 warps against 2, out of place (into a buffer of its own, as
    ``apply`` writes) and in place (as ``apply_``), each pair told apart by its paired samples
    (:func:`_print_paired` against the 4-warp launch, and against Liger's in-place kernels), at
    the points of ``TIE_SHAPES``, every buffer placed anew for each trace; each launch first
    checked bit for bit against the shipped in-place one. Run BB3 read 2 warps level or ahead
    out of place against Liger's; run AL3 read it 32 ns behind in place at bshd 512 tokens."""
    gen = random.Random(0)
    for layout, seq, batch, heads in TIE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        tile = triton_rope.lean_tile(seq * batch, heads, 128, 2)
        kept: list = []

        def warp_counts(src, angles, back, mode, want) -> dict:
            """4 and 2 warps, out of place (checked against ``want``) and in place."""
            launched = {}
            for warps in (4, 2):
                label = f"out w{warps} {mode}"
                launched[label] = _out_of_place_checked(src, want, label, kept, angles, layout,
                                                        back, tile, warps)[0]
                buffer = src.clone()
                launched[f"in w{warps} {mode}"] = _lean_at(buffer, buffer, angles, layout, back,
                                                           tile, warps)
                kept.append(buffer)
            return launched

        def fresh() -> dict:
            return _placed_anew(shape, gen, kept, warp_counts)[0]

        print(f"{layout} s{seq} b{batch} h{heads} d128 bf16, lean tile {tile[0]}x{tile[1]}:",
              flush=True)
        _print_paired(fresh, rounds, calls, peers=("out w4", "in w4", "liger"))


def _lean_variants_in_place(variants: dict[str, dict], rounds: int, calls: int) -> None:
    """Each of ``variants`` (a name: :func:`_lean_at`'s keyword arguments, ``flag=True`` for
    the table read through its linearity flag) in place at the lean tile of each of
    ``TIE_SHAPES``, first checked bit for bit against the shipped launch, then against Liger's
    in-place kernels (:func:`_print_paired`) and the forwards warm."""
    for layout, seq, batch, heads in TIE_SHAPES:
        shape = bench.Shape("probe", layout, torch.bfloat16, seq, batch, heads, 128, 128)
        inp, x, _, angles, _ = _probe_inputs(shape)
        tile = triton_rope.lean_tile(seq * batch, heads, 128, x.element_size())
        flagged = any(kwargs.get("flag") for kwargs in variants.values())
        table, flag = _flagged(angles) if flagged else (angles, None)
        fns: dict = {}
        for mode, src, back in (("fwd", x.clone(), False), ("bwd", inp.grad.clone(), True)):
            want = src.clone()
            _in_place(want, angles, None, layout, back)()
            for name, kwargs in variants.items():
                tab, sin = (table, flag) if kwargs.get("flag") else (angles, None)
                at = {**kwargs, "flag": sin}
                got = src.clone()
                _lean_at(got, got, tab, layout, back, tile, **at)()
                if not torch.equal(got, want):
                    raise RuntimeError(f"lean {name} {mode} differs at {shape}")
                fns[f"{name} {mode}"] = _lean_at(src, src, tab, layout, back, tile, **at)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d128 in place (lean {tile[0]}x{tile[1]}):",
              flush=True)
        _print_paired(fns, rounds, calls)
        _print_warm_forwards(fns)


LEAN_WARP_VARIANTS = [(4, True), (2, True), (2, False), (1, False), (1, True)]
"""(warps, rows shared) of :func:`lean_one_warp`, the one shipped before run AM first."""


def lean_one_warp(rounds: int = 4, calls: int = 50) -> None:
    """The lean kernel in place at its tile on 4, 2 and 1 warps, a row's sines shared through
    shared memory or computed where its heads use them (on one warp a thread holds all eight
    heads of its channels: no exchange, no barrier, 8 sine and cosine instructions a thread),
    against Liger's in-place kernels where it led (:func:`_lean_variants_in_place`), all at
    the compiler's own layout (four channels a thread at 1 x 8, as run AL3 timed them)."""
    _lean_variants_in_place(
        {f"w{warps} {'shared' if shared else 'own'}": dict(warps=warps, shared=shared, vector=64)
         for warps, shared in LEAN_WARP_VARIANTS}, rounds, calls)


VECTOR_VARIANTS = [("rows v2", False, False, 2), ("rows", False, True, 64),
                   ("flag v2", True, False, 2), ("flag", True, True, 64)]
"""(name, flag, rows shared, vector) of :func:`lean_vector`, the shipped one first."""


def lean_vector(rounds: int = 6, calls: int = 50) -> None:
    """The lean kernel in place at its tile with at most two adjacent channels a thread (a
    thread holds two channels of two heads at 1 x 8 of d 128, and computes their sines itself:
    8 sine and cosine instructions, no exchange through shared memory; shipped in run AM) and
    the layout before it (four channels of one head, a row's sines computed once and
    exchanged), on angle rows and through the table's linearity flag, against Liger's
    in-place kernels (:func:`_lean_variants_in_place`)."""
    _lean_variants_in_place(
        {name: dict(flag=flagged, shared=shared, vector=vector)
         for name, flagged, shared, vector in VECTOR_VARIANTS}, rounds, calls)


FLOAT32_RESIDENT_SHAPES = [  # (layout, seq, batch, heads, head_dim, dtype): 32 MiB (run AN)
    ("sbhd", 2048, 1, 32, 128, torch.float32), ("sbhd", 8192, 1, 8, 128, torch.float32),
    ("sbhd", 2048, 4, 8, 128, torch.float32),
]
IN_PLACE_RESIDENT_SHAPES = [  # 16-32 MiB in place, float32 and bf16 (run AO)
    *FLOAT32_RESIDENT_SHAPES,
    ("bshd", 1536, 1, 32, 128, torch.float32), ("sbhd", 4096, 1, 16, 128, torch.float32),
    ("sbhd", 1024, 1, 32, 128, torch.float32), ("sbhd", 4096, 1, 8, 256, torch.float32),
    ("sbhd", 4096, 1, 32, 128, torch.bfloat16), ("sbhd", 16384, 1, 8, 128, torch.bfloat16),
    ("bshd", 3072, 1, 32, 128, torch.bfloat16), ("sbhd", 4096, 2, 16, 128, torch.bfloat16),
    ("sbhd", 4096, 1, 16, 256, torch.bfloat16),
]
RESIDENT_TILES = [  # (BLOCK_T, BLOCK_H, HEAD_ITERS, num_warps)
    (8, 2, 1, 4), (8, 4, 1, 4), (4, 4, 1, 4), (1, 4, 1, 4), (1, 8, 1, 4), (2, 8, 1, 4),
    (4, 8, 1, 4), (8, 8, 1, 4), (1, 16, 1, 4), (2, 16, 1, 4), (4, 16, 1, 4), (1, 32, 1, 4),
]


def in_place_resident(shapes: list, rounds: int = 2) -> None:
    """Calls the L2 holds in place but ``choose_config`` tiles as streamed from DRAM (above
    ``RESIDENT_BYTES``), with smaller ones as controls: ours in place at explicit tiles (the
    table's rows read, as a captured call reads them) against Liger's in-place kernels, warm
    (replayed from a CUDA graph, on its own output and with the input written by a copy before
    each call) and after an L2 flush (the profiler), forward and backward, ``rounds`` times.
    Tiles of more than 16 KiB are left out."""
    for layout, seq, batch, heads, d, dtype in shapes:
        shape = bench.Shape("probe", layout, dtype, seq, batch, heads, d, d)
        inp, x, _, angles, _ = _probe_inputs(shape)
        g, source = inp.grad, x.clone()
        tiles = [t for t in RESIDENT_TILES if t[0] * t[1] * d * x.element_size() <= 16384]
        default, fns = _in_place_tile_calls(tiles, x, g, angles, layout, d)
        liger = bench._liger_peer(shape, inp)
        fns["liger fwd"], fns["liger bwd"] = liger.fwd, liger.bwd
        print(f"{layout} s{seq} b{batch} h{heads} d{d} {str(dtype)[6:]} in place, "
              f"{x.numel() * x.element_size() >> 20} MiB (default tile "
              f"{default[0]}x{default[1]}x{default[2]}/{default[5]}w):", flush=True)
        for _ in range(rounds):
            forwards = {name[:-4]: fn for name, fn in fns.items() if name.endswith("fwd")}
            warm = {name: bench.graph_replay_us(fn) for name, fn in forwards.items()}
            written = {name: bench.written_replay_us(
                fn, liger.rewrite if name == "liger" else lambda: x.copy_(source))
                for name, fn in forwards.items()}
            for what, us in (("warm fwd", warm), ("written fwd", written)):
                print(f"   {what}: " + " | ".join(f"{n} {t:.2f}" for n, t in us.items()),
                      flush=True)
        _print_cold_traces(fns, rounds, calls=30)
        del x, g, source


RESIDENT_RULE_EXTRA = [  # in place, 24-32 MiB of 16-32 heads (run AO1)
    ("bshd", 3072, 1, 32, 128), ("sbhd", 4096, 1, 32, 128), ("sbhd", 4096, 2, 16, 128),
    ("sbhd", 4096, 1, 16, 256),
]


def _patched_rule(rows_f32: int | None = None, heads_f32: int | None = None,
                  in_place_bytes: int | None = None):
    """A candidate ``choose_config(..., in_place)``: the rule in use with, for float32 tiles of
    the resident rule, at least ``rows_f32`` rows and at most ``heads_f32`` heads, and calls
    in place counted resident up to ``in_place_bytes``; None keeps what is in use."""

    def rule(n_tokens, heads, head_dim, rotary_dim, element_size, interleaved, in_place):
        saved = (triton_rope.RESIDENT_ROWS, triton_rope.RESIDENT_HEADS,
                 triton_rope.RESIDENT_BYTES)
        try:
            if element_size == 4 and rows_f32:
                triton_rope.RESIDENT_ROWS = rows_f32 * element_size // 2
            if element_size == 4 and heads_f32:
                triton_rope.RESIDENT_HEADS = heads_f32
            if in_place and in_place_bytes:
                triton_rope.RESIDENT_BYTES = in_place_bytes
            return triton_rope.choose_config(n_tokens, heads, head_dim, rotary_dim,
                                             element_size, interleaved,
                                             triton_rope._sm_count(0))
        finally:
            (triton_rope.RESIDENT_ROWS, triton_rope.RESIDENT_HEADS,
             triton_rope.RESIDENT_BYTES) = saved

    return rule


def resident_rules(rounds: int = 2) -> None:
    """Candidate rules for calls the L2 holds, at the sweep's full-rotary points of 1-32 MiB
    (sbhd and thd, bf16 and float32) and ``RESIDENT_RULE_EXTRA``, the table's rows read, where
    the rules' tiles differ: kernel us after an L2 flush (profiler, ``rounds`` traces, median)
    out of place and in place, forward and backward; forward warm out of place (a CUDA graph)
    and in place with the input written before each call; Liger's in-place kernels beside
    them. Then each rule's geometric means over the first's, and where Liger was faster in
    place (flushed forward, and written)."""
    from rope_dispatch import sweep

    rules = {"current": _patched_rule(),
             "f32 4x8": _patched_rule(rows_f32=32, heads_f32=8),
             "ip 32M": _patched_rule(in_place_bytes=32 << 20),
             "f32 4x8 + ip 32M": _patched_rule(rows_f32=32, heads_f32=8,
                                               in_place_bytes=32 << 20)}
    first = next(iter(rules))
    modes = ("fwd", "bwd", "ip fwd", "ip bwd", "warm", "written")
    ratios = {(name, mode): [] for name in rules for mode in modes}
    behind = {(name, mode): 0 for name in rules for mode in ("ip fwd", "written")}
    points = [p for p in sweep.sweep_points(("sbhd", "thd"), (torch.bfloat16, torch.float32))
              if 1 << 20 < p.tensor_bytes() <= 32 << 20 and p.rotary_dim == p.head_dim]
    points += [bench.Shape(f"{lay} s{s} b{b} h{h} d{d} bf16 (extra)", lay, torch.bfloat16,
                           s, b, h, d, d) for lay, s, b, h, d in RESIDENT_RULE_EXTRA]
    for shape in points:
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        table = inp.freqs.view(inp.freqs.shape[0], -1)
        x, g, source = inp.t.clone(), inp.grad.clone(), inp.t.clone()
        out = torch.empty_like(inp.t)
        tokens = shape.seq * (1 if shape.layout == "thd" else shape.batch)
        size = inp.t.element_size()
        configs = {name: tuple(rule(tokens, shape.heads, shape.head_dim, shape.rotary_dim,
                                    size, False, in_place) for in_place in (False, True))
                   for name, rule in rules.items()}
        if len(set(configs.values())) == 1:
            continue
        fns, liger = _rule_calls(configs, shape, inp, table, None, out, x, g)
        traces = [bench.cold_kernel_us(fns, calls=30) for _ in range(rounds)]
        us = {key: statistics.median(t[key] for t in traces) for key in fns}
        for name in rules:
            us[f"{name} warm"] = bench.graph_replay_us(fns[f"{name} fwd"])
            us[f"{name} written"] = bench.written_replay_us(fns[f"{name} ip fwd"],
                                                            lambda: x.copy_(source))
        if liger is not None:
            us["liger written"] = bench.written_replay_us(liger.fwd, liger.rewrite)
        cells = []
        for name, (config, ip_config) in configs.items():
            for mode in modes:
                ratios[name, mode].append(us[f"{name} {mode}"] / us[f"{first} {mode}"])
            if liger is not None:
                for mode in ("ip fwd", "written"):
                    behind[name, mode] += us[f"liger {mode}"] < us[f"{name} {mode}"]
            cells.append(f"{name} {config[0]}x{config[1]}/{ip_config[0]}x{ip_config[1]} "
                         + "/".join(f"{us[f'{name} {m}']:.2f}" for m in modes))
        if liger is not None:
            cells.append(f"liger {us['liger ip fwd']:.2f}/{us['liger ip bwd']:.2f}/"
                         f"{us['liger written']:.2f}")
        print(f"{shape.name}: " + " | ".join(cells), flush=True)
        del inp, x, g, out, source
    print("us: fwd/bwd out of place, fwd/bwd in place after an L2 flush; fwd warm out of "
          f"place; fwd in place written before. Over '{first}' (geometric mean over the "
          "points whose tiles differ):")
    for name in rules:
        means = ", ".join(f"{m} {statistics.geometric_mean(ratios[name, m]):.3f}"
                          for m in modes)
        print(f"  {name:>16}: {means}; Liger faster in place at {behind[name, 'ip fwd']} "
              f"flushed, {behind[name, 'written']} written")


MQA_SHAPES = [  # (seq, q heads, k heads): bshd, batch 1, d 128, bf16; the last GQA for scale
    (512, 32, 1), (2048, 32, 1), (8192, 32, 1), (32768, 32, 1), (2048, 8, 1), (8192, 8, 1),
    (32768, 8, 1), (8192, 32, 8),
]
MQA_TILES = [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (8, 1), (4, 2)]  # 4 warps


def mqa_tiles(rounds: int = 2) -> None:
    """The q+k launch where k has fewer heads than q (MQA: one): ``choose_config`` fits its
    tile to the tensor with the fewest heads, so q's heads run one a program. Forward and
    backward out of place at explicit tiles (k's programs mask the heads it lacks) with the
    table's rows read and read as rates (its linearity flag), kernel us after an L2 flush
    (profiler, ``rounds`` traces) as % of a device copy of q's and k's bytes timed in the same
    traces, and the forward warm (a CUDA graph); Liger's in-place q+k kernels beside them."""
    from liger_kernel.ops.rope import rope_backward, rope_forward

    for seq, hq, hk in MQA_SHAPES:
        shape = bench.Shape("probe", "bshd", torch.bfloat16, seq, 1, hq, 128, 128)
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        q = inp.t
        k = torch.randn(1, seq, hk, 128, device=q.device, dtype=q.dtype)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        src = torch.cat((q.flatten(), k.flatten()))
        dst = torch.empty_like(src)
        segments = ((triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1)),
                    (triton_rope.head_segment(qo, 1), triton_rope.head_segment(ko, 1)))
        angles = inp.freqs.view(inp.freqs.shape[0], -1)
        default = triton_rope.choose_config(seq, (hq, hk, hk), 128, 128, 2, False,
                                            triton_rope._sm_count(0))
        tiles = {f"in use {default[0]}x{default[1]}": default}
        for bt, bh in MQA_TILES:
            if bh <= triton_rope._next_pow2(hq) and (bt, bh) != default[:2]:
                tiles[f"{bt}x{bh}"] = (bt, bh, 1, 64, 1, 4)
        lq, lk = q.clone(), k.clone()
        cos = inp.cache.cos[:seq, :64].repeat(1, 2)[None].to(q.dtype).contiguous()
        sin = inp.cache.sin[:seq, :64].repeat(1, 2)[None].to(q.dtype).contiguous()
        liger = {False: rope_forward, True: rope_backward}
        print(f"bshd s{seq} q {hq} heads, k {hk}, d128 bf16, {src.numel() * 2 >> 20} MiB:",
              flush=True)
        for kind, (tab, tsin) in (("rows", (angles, None)), ("rates", _flagged(angles))):
            for backward in (False, True):
                fns = {name: (lambda c=c: triton_rope.launch_qkv(
                    *segments, (tab, tsin, tab, tsin), None, None, "bshd", False, 1.0, 1, 0,
                    backward, config=c)) for name, c in tiles.items()}
                fns["liger (in place)"] = lambda: liger[backward](
                    lq.transpose(1, 2), lk.transpose(1, 2), cos, sin, rotary_dim=128)
                fns["copy"] = lambda: dst.copy_(src)
                mode = "bwd" if backward else "fwd"
                for _ in range(rounds):
                    us = bench.cold_kernel_us(fns, calls=30, copies=True)
                    print(f"   {kind} {mode} flushed: " + " | ".join(
                        f"{n} {t:.2f} ({100 * us['copy'] / t:.0f}%)" for n, t in us.items()
                        if n != "copy") + f" | copy {us['copy']:.2f}", flush=True)
            warm = {n: bench.graph_replay_us(fn) for n, fn in fns.items()}
            print(f"   {kind} bwd warm: " + " | ".join(f"{n} {t:.2f}" for n, t in warm.items()),
                  flush=True)
        del inp, q, k, qo, ko, src, dst, lq, lk


HF_SHAPES = [  # (batch, seq, q heads, k heads, head dim): the HF path's q+k launch, bshd bf16
    (1, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (4, 2048, 32, 8, 128), (4, 4096, 28, 4, 128),
    (1, 2048, 8, 1, 256), (4, 8192, 8, 1, 256), (1, 2048, 71, 1, 64), (4, 2048, 71, 1, 64),
    (4, 4096, 32, 32, 96),
]
HF_TILES = [(16, 2, 4), (32, 1, 4), (8, 4, 4), (1, 8, 4), (2, 8, 4), (4, 8, 4), (4, 8, 8),
            (2, 16, 4), (1, 16, 4), (1, 32, 4), (2, 32, 8)]  # (BLOCK_T, BLOCK_H, warps)


def _door_inputs(batch: int, seq: int, hq: int, hk: int,
                 d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k ``[b, s, heads, d]`` in bf16 on the GPU and bf16 cos and sin ``[s, d]`` of
    doubled angles: the integration's q+k launch as a model's layer hands it over."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch, seq, hq, d, device=dev, dtype=dt)
    k = torch.randn(batch, seq, hk, d, device=dev, dtype=dt)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev) / d))
    freqs = torch.arange(seq, device=dev, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(dt), emb.sin().to(dt)


def _door_config(q: torch.Tensor, hk: int, cos: torch.Tensor, sin: torch.Tensor,
                 sms: int) -> tuple:
    """``choose_config``'s tile for the q+k launch of ``q`` (bshd) and ``hk`` key heads on
    this cos and sin, as ``launch_qkv`` asks for it."""
    batch, seq, hq, d = q.shape
    flags = triton_rope._table_flags(cos, sin)
    return triton_rope.choose_config(
        batch * seq, (hq, hk), d, d, 2, False, sms, triton_rope.tile_tokens(flags, cos, d, False),
        triton_rope.reads_cache_rows(flags), span_dim=d, sines=False)


def _explicit_tiles(default: tuple, tiles: list, hq: int, d: int, in_use: str) -> dict:
    """The tile in use (named ``in_use`` and its size) and each of ``tiles`` (``(BLOCK_T,
    BLOCK_H, warps)``) that differs from it and takes no more heads than q has, by name."""
    block_r = triton_rope._next_pow2(d // 2)
    found = {f"{in_use}{default[0]}x{default[1]}": default}
    for bt, bh, warps in tiles:
        if bh <= triton_rope._next_pow2(hq) and (bt, bh, warps) != (
                default[0], default[1], default[5]):
            found[f"{bt}x{bh}" + (f"w{warps}" if warps != 4 else "")] = (
                bt, bh, 1, block_r, 1, warps)
    return found


def _checked_halves_flag(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A halves flag checked against ``cos`` and ``sin`` (whose halves must be equal)."""
    flag = torch.zeros(1, dtype=torch.int32, device=cos.device)
    flag._rope_version = -1
    assert triton_rope.current_halves(cos, sin, flag).item() == 1
    return flag


def _print_fwd_bwd(fns: dict[str, Callable[[], Any]], rounds: int) -> None:
    """``rounds`` traces of ``fns`` (names ``"fwd ..."``, ``"bwd ..."`` and ``"copy"``), each
    call after an L2 flush: a line per mode of kernel us and % of the copy's time."""
    for _ in range(rounds):
        us = bench.cold_kernel_us(fns, calls=30, copies=True)
        for mode in ("fwd", "bwd"):
            print(f"   {mode}: " + " | ".join(
                f"{n[4:]} {t:.2f} ({100 * us['copy'] / t:.1f}%)" for n, t in us.items()
                if n.startswith(mode)) + f" | copy {us['copy']:.2f}", flush=True)


def hf_tiles(rounds: int = 2) -> None:
    """The Hugging Face integration's q+k launch (``integrations.hf``: a cos/sin cache of the
    model's bf16 ``[s, d]`` rows, shared by the batch) at explicit tiles, forward out of place,
    kernel us after an L2 flush (profiler, ``rounds`` traces) as % of a device copy of q's and
    k's bytes timed in the same traces; Liger's in-place q+k kernel (which reads half of each
    cos and sin row) beside them. ``choose_config`` gives a cos/sin cache tiles of many tokens
    and few heads (run Q, single tensors), each program reading its tokens' rows again. "half"
    reads the same cos and sin as a pair cache (the first half of each row, as Liger does: right
    where the halves are equal, as transformers' rotary embeddings make them)."""
    from liger_kernel.ops.rope import rope_forward

    sms = triton_rope._sm_count(0)
    for batch, seq, hq, hk, d in HF_SHAPES:
        q, k, cos, sin = _door_inputs(batch, seq, hq, hk, d)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        src = torch.cat((q.flatten(), k.flatten()))
        dst = torch.empty_like(src)
        segments = ((triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1)),
                    (triton_rope.head_segment(qo, 1), triton_rope.head_segment(ko, 1)))
        fns = {}
        for kind, tables in (("full", (cos, sin)), ("half", (cos, sin[:, : d // 2]))):
            default = _door_config(q, hk, *tables, sms)
            for name, c in _explicit_tiles(default, HF_TILES, hq, d, "in use ").items():
                fns[f"{kind} {name}"] = lambda c=c, tables=tables: triton_rope.launch_qkv(
                    *segments, (*tables, *tables), None, None, "bshd", False, 1.0, 1, 0, False,
                    config=c)
        lq, lk = q.clone(), k.clone()
        fns["liger (in place)"] = lambda: rope_forward(
            lq.transpose(1, 2), lk.transpose(1, 2), cos[None], sin[None])
        fns["copy"] = lambda: dst.copy_(src)
        print(f"bshd b{batch} s{seq} q {hq} heads, k {hk}, d{d} bf16, "
              f"{src.numel() * 2 / 2**20:.0f} MiB:", flush=True)
        for _ in range(rounds):
            us = bench.cold_kernel_us(fns, calls=30, copies=True)
            print("   fwd flushed: " + " | ".join(
                f"{n} {t:.2f} ({100 * us['copy'] / t:.0f}%)" for n, t in us.items()
                if n != "copy") + f" | copy {us['copy']:.2f}", flush=True)
        del q, k, qo, ko, src, dst, lq, lk

HALVES_TILES = [(1, 16, 4), (1, 8, 4), (2, 8, 4), (4, 8, 4), (8, 4, 4), (4, 4, 4), (2, 16, 4),
                (1, 32, 4), (1, 16, 8)]  # (BLOCK_T, BLOCK_H, warps)


def _masked_halves_kernels() -> ModuleType:
    """The kernel module with ``_row_cos_sin``'s halves branch made a masked second-half load
    and a select, from a copy of its source (Triton reads a kernel's source from its file)."""
    import importlib.util
    import pathlib
    import tempfile

    from rope_dispatch.backends import triton_kernels

    source = pathlib.Path(triton_kernels.__file__).read_text()
    branch = """        if flag == 0:  # the halves differ somewhere: the second halves too
            cos_b, sin_b = _table(
                tab_ptr, sin_ptr, tab_off + ROT_DIM // 2, tab_mask, USE_CACHE, FAST_TRIG
            )
"""
    masked = """        cos_m, sin_m = _table(
            tab_ptr, sin_ptr, tab_off + ROT_DIM // 2, tab_mask & (flag == 0), USE_CACHE,
            FAST_TRIG,
        )
        cos_b = tl.where(flag == 0, cos_m, cos_a)
        sin_b = tl.where(flag == 0, sin_m, sin_a)
"""
    assert source.count(branch) == 1, "the halves branch moved"
    path = pathlib.Path(tempfile.mkdtemp()) / "masked_halves_kernels.py"
    path.write_text(source.replace(branch, masked))
    spec = importlib.util.spec_from_file_location("masked_halves_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HALVES_WIDE_SHAPES = [  # MHA shapes (Llama-2 7B, Phi-3 mini, 16 heads), Gemma's and Falcon's
    (1, 1024, 32, 32, 128), (1, 4096, 32, 32, 128), (4, 4096, 32, 32, 128),
    (1, 4096, 32, 32, 96), (4, 4096, 32, 32, 96), (4, 4096, 16, 16, 128), (4, 4096, 16, 16, 64),
    (1, 2048, 8, 1, 256), (4, 8192, 8, 1, 256), (1, 2048, 71, 1, 64), (4, 2048, 71, 1, 64),
]
HALVES_WIDE_TILES = [(8, 4, 4), (4, 8, 4), (2, 16, 4), (1, 32, 4), (1, 16, 4), (1, 32, 8),
                     (2, 32, 8), (16, 4, 8), (8, 4, 8), (2, 8, 4), (1, 64, 8)]


QWEN_TILES = [(16, 2, 2), (8, 2, 2), (32, 2, 2), (16, 2, 8), (32, 2, 4), (8, 4, 2), (32, 1, 4),
              (16, 1, 4), (64, 1, 4)]  # (BLOCK_T, BLOCK_H, warps): Qwen2.5's 28 / 4 heads

GQA_SHAPES = [(1, 8192, 32, 8, 128), (4, 2048, 32, 8, 128), (4, 8192, 32, 8, 128),
              (4, 4096, 28, 4, 128), (1, 4096, 28, 4, 128), (4, 4096, 32, 4, 128)]
GQA_TILES = [(8, 2, 2), (4, 2, 2), (4, 2, 1), (8, 1, 2), (4, 4, 2), (8, 4, 2), (16, 2, 2)]


HALVES_DOOR_SHAPES = [
    (1, 8192, 32, 8, 128), (4, 8192, 32, 8, 128), (4, 4096, 28, 4, 128), (1, 2048, 8, 1, 256),
    (4, 8192, 8, 1, 256), (1, 2048, 71, 1, 64), (4, 2048, 71, 1, 64), (1, 4096, 32, 32, 96),
    (4, 4096, 32, 32, 96), (4, 4096, 16, 16, 128), (4, 4096, 32, 32, 128), (4, 4096, 16, 16, 64),
]
HALVES_DOOR_TILES = [(16, 2, 4), (1, 16, 4), (1, 32, 4), (8, 4, 4), (4, 8, 4), (2, 16, 4),
                     (32, 2, 4), (2, 8, 4), (8, 2, 4)]


def hf_halves(rounds: int = 2, shapes: list | None = None, extra: list | None = None,
              variants: bool = True, per_token: bool = False) -> None:
    """The Hugging Face integration's q+k launch reading half rows (a halves flag set,
    ``HALVES``) at explicit tiles, forward and backward (the transposed launch), kernel us
    after an L2 flush (profiler, ``rounds`` traces) as % of a device copy of q's and k's bytes;
    at the tile in use also whole rows (no flag) and the halves read as a masked load instead
    of a branch on the flag (``variants``); Liger's in-place q+k kernels beside them.
    ``shapes`` and ``extra`` (tiles) default to ``HF_SHAPES`` and ``HALVES_TILES``.
    ``per_token``: as the integration calls it, cos and sin ``[b * s, d]`` (a model's
    ``[b, s, d]``, one row per token) read through ``[b, s]`` positions; else ``[s, d]``
    shared by the batch."""
    from liger_kernel.ops.rope import rope_backward, rope_forward

    sms = triton_rope._sm_count(0)
    masked = _masked_halves_kernels()
    shipped = triton_rope._load_kernels()

    def with_kernels(module: ModuleType, fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            triton_rope._kernels = module
            try:
                return fn()
            finally:
                triton_rope._kernels = shipped
        return call

    for batch, seq, hq, hk, d in shapes or HF_SHAPES:
        q, k, cos, sin = _door_inputs(batch, seq, hq, hk, d)
        outs = (torch.empty_like(q), torch.empty_like(k))
        rows = None
        if per_token:
            cos, sin = cos.repeat(batch, 1), sin.repeat(batch, 1)
            rows = torch.arange(batch * seq, device=q.device).view(batch, seq)
        flag = _checked_halves_flag(cos, sin)
        src = torch.cat((q.flatten(), k.flatten()))
        dst = torch.empty_like(src)
        xs = (triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1))
        ys = (triton_rope.head_segment(outs[0], 1), triton_rope.head_segment(outs[1], 1))
        default = _door_config(q, hk, cos, sin, sms)
        block_r = triton_rope._next_pow2(d // 2)
        tiles = _explicit_tiles(default, extra or HALVES_TILES, hq, d, "")
        fns: dict[str, Callable[[], Any]] = {}
        for mode, backward in (("fwd", False), ("bwd", True)):
            def launch(c: tuple, cu: torch.Tensor | None, backward: bool = backward) -> Any:
                return triton_rope.launch_qkv(xs, ys, (cos, sin, cos, sin), cu, rows, "bshd",
                                              False, 1.0, 1, 0, backward, config=c)
            if per_token:
                for bt, bh in ((default[0], default[1]), (16, 2)):
                    fns[f"{mode} whole {bt}x{bh}"] = lambda l=launch, c=(
                        bt, bh, 1, block_r, 1, 4): l(c, None)
            if variants:
                fns[f"{mode} whole {default[0]}x{default[1]}"] = lambda l=launch: l(default, None)
                fns[f"{mode} masked {default[0]}x{default[1]}"] = with_kernels(
                    masked, lambda l=launch: l(default, flag))
            for name, c in tiles.items():
                fns[f"{mode} halves {name}"] = lambda l=launch, c=c: l(c, flag)
        lq, lk = q.clone(), k.clone()
        lcos, lsin = cos.view(-1, seq, d), sin.view(-1, seq, d)
        fns["fwd liger"] = lambda: rope_forward(
            lq.transpose(1, 2), lk.transpose(1, 2), lcos, lsin)
        fns["bwd liger"] = lambda: rope_backward(
            lq.transpose(1, 2), lk.transpose(1, 2), lcos, lsin)
        fns["copy"] = lambda: dst.copy_(src)
        print(f"bshd b{batch} s{seq} q {hq} heads, k {hk}, d{d} bf16, "
              f"{src.numel() * 2 / 2**20:.0f} MiB:", flush=True)
        _print_fwd_bwd(fns, rounds)
        del q, k, outs, src, dst, lq, lk

DOOR_ROWS_SHAPES = [
    (4, 8192, 32, 8, 128), (4, 4096, 28, 4, 128), (1, 2048, 8, 1, 256), (4, 8192, 8, 1, 256),
    (4, 2048, 71, 1, 64), (1, 4096, 32, 32, 96), (4, 4096, 32, 32, 96), (4, 4096, 16, 16, 128),
]


def door_rows(rounds: int = 2) -> None:
    """How the integration's q+k launch finds a token's cos and sin row: ``[s, d]`` rows shared
    by the batch (cos ``[1, s, d]``: by index), or a row per token (cos ``[b, s, d]`` as
    ``[b * s, d]``) read through ``[b, s]`` per-token positions or through ``[b]`` start
    positions ``i * s`` (row ``i * s + j``, the same rows, one index value per sequence); each
    with half rows (a halves flag) and whole rows, at the tile in use, forward and backward,
    kernel us after an L2 flush (profiler) as % of a device copy; Liger's kernels on the
    per-token cos and sin beside them."""
    from liger_kernel.ops.rope import rope_backward, rope_forward

    sms = triton_rope._sm_count(0)
    for batch, seq, hq, hk, d in DOOR_ROWS_SHAPES:
        q, k, *shared = _door_inputs(batch, seq, hq, hk, d)
        dev = q.device
        outs = (torch.empty_like(q), torch.empty_like(k))
        token = (shared[0].repeat(batch, 1), shared[1].repeat(batch, 1))
        kinds = {"shared": (shared, None),
                 "per-token": (token, torch.arange(batch * seq, device=dev).view(batch, seq)),
                 "starts": (token, torch.arange(batch, device=dev) * seq)}
        flags = {name: _checked_halves_flag(*tables) for name, (tables, _) in kinds.items()}
        xs = (triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1))
        ys = (triton_rope.head_segment(outs[0], 1), triton_rope.head_segment(outs[1], 1))
        config = _door_config(q, hk, *shared, sms)
        fns: dict[str, Callable[[], Any]] = {}
        for mode, backward in (("fwd", False), ("bwd", True)):
            for name, (tables, index) in kinds.items():
                for rows, cu in (("halves", flags[name]), ("whole", None)):
                    fns[f"{mode} {name} {rows}"] = lambda t=tables, i=index, cu=cu, b=backward: (
                        triton_rope.launch_qkv(xs, ys, (*t, *t), cu, i, "bshd", False, 1.0, 1,
                                               0, b, config=config))
        lq, lk = q.clone(), k.clone()
        lcos, lsin = token[0].view(batch, seq, d), token[1].view(batch, seq, d)
        fns["fwd liger"] = lambda: rope_forward(lq.transpose(1, 2), lk.transpose(1, 2), lcos, lsin)
        fns["bwd liger"] = lambda: rope_backward(lq.transpose(1, 2), lk.transpose(1, 2), lcos,
                                                 lsin)
        src = torch.cat((q.flatten(), k.flatten()))
        dst = torch.empty_like(src)
        fns["copy"] = lambda: dst.copy_(src)
        print(f"bshd b{batch} s{seq} q {hq} heads, k {hk}, d{d} bf16, tile "
              f"{config[0]}x{config[1]}, {src.numel() * 2 / 2**20:.0f} MiB:", flush=True)
        _print_fwd_bwd(fns, rounds)
        del q, k, outs, src, dst, lq, lk

PLACEMENT_SHAPES = [(4, 4096, 16, 16, 128), (4, 4096, 32, 32, 96), (4, 8192, 32, 8, 128)]
PLACEMENT_OFFSETS = [0, 512, 1024, 2048, 4096, 1 << 16, (1 << 20) + 512, (2 << 20) - 512]


def door_placement(rounds: int = 2) -> None:
    """Whether where q+k's outputs lie moves the integration's forward launch: the door's own
    call (``hf.apply_rotary_pos_emb``, outputs allocated per call) against the same launch at
    the tile in use writing into fixed outputs placed at ``PLACEMENT_OFFSETS`` bytes past a 2
    MiB boundary, forward kernel us after an L2 flush (profiler) as % of a device copy; the
    door's planned launch (grid, constants) and its outputs' offsets printed beside."""
    from rope_dispatch.integrations import hf

    sms = triton_rope._sm_count(0)
    for batch, seq, hq, hk, d in PLACEMENT_SHAPES:
        q, k, cos, sin = _door_inputs(batch, seq, hq, hk, d)
        cos3, sin3 = cos[None], sin[None]
        qv, kv = q.transpose(1, 2), k.transpose(1, 2)
        triton_rope._fast_qkv.clear()
        for _ in range(4):
            outs = hf.apply_rotary_pos_emb(qv, kv, cos3, sin3)
        torch.cuda.synchronize()
        for key, entry in triton_rope._fast_qkv.items():
            print(f"   door's launch: grid {entry[2]}, constants {entry[4]}, aligned {key[1]}")
        print("   door's outputs at " + ", ".join(
            f"{o.data_ptr() % (2 << 20)} B past 2 MiB" for o in outs)
            + "; inputs at " + ", ".join(f"{t.data_ptr() % (2 << 20)}" for t in (q, k)))
        del outs
        flag = _checked_halves_flag(cos, sin)
        xs = (triton_rope.head_segment(q, 1), triton_rope.head_segment(k, 1))
        config = _door_config(q, hk, cos, sin, sms)
        n_q, n_k = q.numel(), k.numel()
        pool = torch.empty(n_q + n_k + (8 << 20), dtype=q.dtype, device=q.device)
        base = (-pool.data_ptr()) % (2 << 20) // 2
        fns: dict[str, Callable[[], Any]] = {
            "fwd door": lambda: hf.apply_rotary_pos_emb(qv, kv, cos3, sin3)}
        for offset in PLACEMENT_OFFSETS:
            start = base + offset // 2
            qo = pool[start:start + n_q].view_as(q)
            ko = pool[start + n_q:start + n_q + n_k].view_as(k)
            ys = (triton_rope.head_segment(qo, 1), triton_rope.head_segment(ko, 1))
            fns[f"fwd +{offset}"] = lambda ys=ys: triton_rope.launch_qkv(
                xs, ys, (cos, sin, cos, sin), flag, None, "bshd", False, 1.0, 1, 0, False,
                config=config)
        src = torch.cat((q.flatten(), k.flatten()))
        dst = torch.empty_like(src)
        fns["copy"] = lambda: dst.copy_(src)
        print(f"bshd b{batch} s{seq} q {hq} heads, k {hk}, d{d} bf16, tile "
              f"{config[0]}x{config[1]}w{config[5]}, {src.numel() * 2 / 2**20:.0f} MiB:",
              flush=True)
        for _ in range(rounds):
            us = bench.cold_kernel_us(fns, calls=30, copies=True)
            print("   fwd: " + " | ".join(f"{n[4:]} {t:.2f} ({100 * us['copy'] / t:.1f}%)"
                                         for n, t in us.items() if n != "copy")
                  + f" | copy {us['copy']:.2f}", flush=True)
        del q, k, qv, kv, pool, src, dst


QKV_BWD_TILES = [(8, 4, 4), (4, 8, 4), (16, 2, 4), (2, 16, 4), (1, 32, 4), (8, 8, 4), (8, 8, 8),
                 (16, 4, 8), (4, 4, 4), (8, 2, 4)]  # (BLOCK_T, BLOCK_H, warps)


def qkv_bwd_tiles(rounds: int = 3) -> None:
    """The packed-qkv transposed launch (q's, k's and v's gradients into one packed gradient)
    of the sweep's ``--qkv`` points from 64 MiB at explicit tiles: kernel us by the profiler
    after an L2 flush, in turn with a device copy of the packed tensor timed the same way
    (``rounds`` traces), as % of copy. A launch with an explicit tile takes the generic host
    path (tens of us), which ``do_bench`` would time at 96 MiB."""
    from rope_dispatch import sweep

    sms = triton_rope._sm_count(0)
    for layout, seq in (("sbhd", 8192), ("bshd", 8192), ("sbhd", 32768)):
        shape = sweep.make_point(layout, torch.bfloat16, sweep.QKV_SERIES[0], seq)
        inp = bench.make_inputs(shape, "cuda", draw_on_device=True)
        split = inp.split
        d = split[1]
        gq, gk, gv = inp.grad
        grad = torch.empty_like(inp.t)
        dst = torch.empty_like(inp.t)
        angles = inp.freqs.view(inp.freqs.shape[0], -1)
        tables = (*_flagged(angles), *_flagged(angles))
        xs = (triton_rope.head_segment(gq, split[0] // d), triton_rope.width_segment(gk, d),
              triton_rope.width_segment(gv, d))
        heads = tuple(x[2][-3] * x[2][-2] for x in xs)
        default = triton_rope.choose_config(gq.shape[0] * gq.shape[1], heads, d, d, 2, False, sms)
        tiles = {f"in use {default[0]}x{default[1]}w{default[5]}": default}
        for bt, bh, warps in QKV_BWD_TILES:
            if (bt, bh, warps) != (default[0], default[1], default[5]):
                tiles[f"{bt}x{bh}w{warps}"] = (bt, bh, 1, default[3], 1, warps)
        fns = {name: (lambda c=config: triton_rope.launch_qkv(
            xs, triton_rope.packed_segments(grad, split), tables, None, None, layout, False, 1.0,
            1, 0, True, config=c)) for name, config in tiles.items()}
        fns["copy"] = lambda: dst.copy_(inp.t)
        print(f"{shape.name}, {inp.t.numel() * 2 >> 20} MiB:", flush=True)
        for _ in range(rounds):
            us = bench.cold_kernel_us(fns, calls=20, copies=True)
            print("   " + " | ".join(f"{n} {t:.1f} ({100 * us['copy'] / t:.1f}%)"
                                     for n, t in us.items() if n != "copy")
                  + f" | copy {us['copy']:.1f}", flush=True)
        del inp, grad, dst

if __name__ == "__main__":
    import sys

    modes = {"prefill": prefill_qk, "small": small, "decode": decode_qk, "tables": tables,
             "decode-compare": decode_compare, "small-warm": lambda: small(warm=True),
             "small-rules": small_rules, "small-programs": small_programs,
             "large-rates": large_rates, "large-rule": large_rule, "thd-tiles": thd_tiles,
             "partial-rotary": partial_rotary, "wide-tokens": wide_tokens,
             "small-kinds": small_kinds, "in-place-tiles": in_place_tiles,
             "in-place-warm": in_place_warm, "resident-rows": resident_rows,
             "sine-tiles": sine_tiles, "row-tiles": row_tiles,
             "one-head-tiles": lambda: in_place_tiles(3, ONE_HEAD_SHAPES, ONE_HEAD_TILES),
             "lean-kernel": lean_kernel, "kernel-copies": kernel_copies,
             "input-copies": input_copies, "lean-shipped": lean_shipped,
             "lean-warps": lean_warps, "sweep-orders": sweep_orders,
             "shared-sines": shared_sines, "table-bytes": table_bytes,
             "one-head-rule": one_head_rule, "ties": ties, "lean-one-warp": lean_one_warp,
             "lean-vector": lean_vector, "lean-out-tiles": lean_out_tiles,
             "lean-warps-paired": lean_warps_paired,
             "float32-resident": lambda: in_place_resident(FLOAT32_RESIDENT_SHAPES),
             "in-place-resident": lambda: in_place_resident(IN_PLACE_RESIDENT_SHAPES),
             "resident-rules": resident_rules, "mqa-tiles": mqa_tiles,
             "hf-tiles": hf_tiles, "hf-halves": hf_halves,
             "hf-halves-wide": lambda: hf_halves(2, HALVES_WIDE_SHAPES, HALVES_WIDE_TILES, False),
             "hf-halves-door": lambda: hf_halves(2, HALVES_DOOR_SHAPES, HALVES_DOOR_TILES, False,
                                                 per_token=True),
             "door-rows": door_rows, "qkv-bwd-tiles": qkv_bwd_tiles,
             "door-placement": door_placement,
             "qwen-warps": lambda: hf_halves(2, [(4, 4096, 28, 4, 128)], QWEN_TILES, False),
             "gqa-warps": lambda: hf_halves(2, GQA_SHAPES, GQA_TILES, False)}
    if sys.argv[1:2] == ["decode-processes"]:
        decode_processes(*(int(n) for n in sys.argv[2:3]))
    elif sys.argv[1:3] == ["thd-tiles", "32"]:
        thd_tiles(rounds=5, heads_32=True)
    else:
        modes.get(sys.argv[1] if len(sys.argv) > 1 else "", main)()
