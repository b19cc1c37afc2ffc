"""``python -m benchmarks.precise_rates``: what exact angles cost on the Triton backend.

For each shape (bshd, d 128, default bf16; prefill sizes and a decode batch), a rate table of
2^24 rows made with ``precise=True`` (each angle the exact float64 product, reduced modulo 2*pi
in the kernel) against the default one (float32 products), at positions near the end of the
table (start positions ``2^24 - seq``): the kernels' GPU time, each call after an L2 flush
(``benchmarks.bench.cold_kernel_samples``: the two in turn in one trace, so each precise call
has a default neighbour), forward and forward+backward through autograd. Prints, per shape and
mode, both medians, precise/default - 1 and the 95% interval of the paired difference (an
interval holding 0: level), and the largest cos/sin error of each table against the exact
angles (through the forward of ones and zeros). ``--out`` also writes JSON.

    python -m benchmarks.precise_rates                            # the H200 figures
    python -m benchmarks.precise_rates --shapes 1x8x1 --device cpu  # smoke (TRITON_INTERPRET=1)

The target (docs/tables.md): at most 2% slower than the default at prefill shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rope_dispatch as rd
from benchmarks.bench import _versions, cold_kernel_samples, paired_difference

ROWS = 1 << 24
SHAPES = "1x8192x1,1x8192x8,4x8192x8,4x8192x32,64x1x8"  # batch x seq x heads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="batch x seq x heads, comma-separated")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=200, help="calls of each table per mode")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def max_cos_sin_error(table: rd.RateTable, rows: list[int], device: str) -> float:
    """The largest error of the cosines and sines ``table`` turns by at positions ``rows``,
    against Python's of the exact products (a float32 forward of unit vectors)."""
    pairs = table.inv_freq.numel()
    d2 = 2 * pairs
    t = torch.zeros(len(rows), 1, 2, d2)
    t[:, :, 0, 0:pairs] = 1.0  # head 0: x_a = 1 -> (cos, sin) in (a, b)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(t.to(device), table, spec, positions=torch.tensor(rows, device=device)[:, None],
                   backend="triton").cpu().double()
    rates = [float(r) for r in table.inv_freq.cpu().tolist()]
    cos = torch.tensor([[math.cos(p * r) for r in rates] for p in rows], dtype=torch.float64)
    sin = torch.tensor([[math.sin(p * r) for r in rates] for p in rows], dtype=torch.float64)
    got = out[:, 0, 0]
    return max((got[:, :pairs] - cos).abs().max().item(), (got[:, pairs:] - sin).abs().max().item())


def calls(batch: int, seq: int, heads: int, args: argparse.Namespace,
          tables: dict[str, rd.RateTable]) -> dict[str, Callable[[], Any]]:
    """``{table name + mode: call}``: forward, and forward+backward through autograd."""
    dtype = getattr(torch, args.dtype)
    t = torch.randn(batch, seq, heads, args.head_dim, device=args.device, dtype=dtype)
    t.requires_grad_(True)
    grad = torch.randn_like(t)
    spec = rd.RoPESpec(layout="bshd", dtype=dtype)
    starts = torch.full((batch,), ROWS - seq, device=args.device, dtype=torch.int32)
    fns: dict[str, Callable[[], Any]] = {}
    for name, table in tables.items():
        def forward(table=table) -> Any:
            with torch.no_grad():
                return rd.apply(t, table, spec, start_positions=starts, backend="triton")

        def both(table=table) -> Any:
            out = rd.apply(t, table, spec, start_positions=starts, backend="triton")
            return torch.autograd.grad(out, t, grad)

        fns[f"{name} fwd"], fns[f"{name} fwd+bwd"] = forward, both
    return fns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = rd.tables.inverse_frequencies(args.head_dim).to(args.device)
    tables = {"default": rd.RateTable(rates, ROWS), "precise": rd.RateTable(rates, ROWS, precise=True)}
    near = [ROWS - 1 - i for i in range(4)] + [(1 << 20) + i for i in range(4)]
    report: dict[str, Any] = {"versions": _versions(), "errors": {
        name: max_cos_sin_error(table, near, args.device) for name, table in tables.items()}}
    print("max cos/sin error near 2^20 and 2^24 - 1: "
          + ", ".join(f"{k} {v:.2e}" for k, v in report["errors"].items()))
    rows = []
    for shape in args.shapes.split(","):
        batch, seq, heads = (int(x) for x in shape.split("x"))
        fns = calls(batch, seq, heads, args, tables)
        if args.device != "cuda":  # a smoke run: each call once
            for fn in fns.values():
                fn()
            print(f"{shape}: ran (timing needs CUDA)")
            continue
        samples = cold_kernel_samples(fns, args.calls)
        for mode in ("fwd", "fwd+bwd"):
            default, precise = samples[f"default {mode}"], samples[f"precise {mode}"]
            low, mid, high = paired_difference(precise, default)
            base = statistics.median(default)
            rows.append(dict(shape=shape, mode=mode, default_us=base,
                             precise_us=statistics.median(precise), slower=mid / base,
                             interval_us=(low, high)))
    if rows:
        print("| b x s x h | mode | default us | precise us | precise / default - 1 | "
              "paired 95% (us) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['mode']} | {r['default_us']:.2f} | {r['precise_us']:.2f} "
                  f"| {100 * r['slower']:+.1f}% | {r['interval_us'][0]:+.3f} .. "
                  f"{r['interval_us'][1]:+.3f} |")
    report["rows"] = rows
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
