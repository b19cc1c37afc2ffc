"""Autotune figures for the closing notes: what tuning one key costs, what a cached decision
costs per call, and what the tuner picks for the benchmark shapes and by how much.

    python -m benchmarks.autotune_figures [--device cpu|cuda] [--small]   # from the repository root

Runs with an empty, temporary cache (ROPE_DISPATCH_CACHE_DIR) and measuring on. ``--small``
scales the benchmark shapes down (for a CPU), keeping their layouts and dtypes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

os.environ["ROPE_DISPATCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="rope-autotune-")
os.environ.pop("ROPE_AUTOTUNE", None)
os.environ.pop("ROPE_BACKEND", None)

if __package__ in (None, ""):  # run by path: the repository root holds benchmarks/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import rope_dispatch as rd  # noqa: E402
from rope_dispatch import dispatch  # noqa: E402
from benchmarks.bench import SHAPES, make_inputs  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="shapes scaled down for a CPU")
    args = parser.parse_args()
    print(f"cache {rd.cache_dir()}; device {args.device}")
    print(f"{'shape':38s} {'mode':9s} {'first call':>11s} {'choose':>8s} {'apply':>9s}  choice")
    for shape in SHAPES:
        if args.small:
            scale = 64 if shape.layout == "thd" else 1
            shape = dataclasses.replace(
                shape, seq=max(1, shape.seq // (16 * scale) * scale) if shape.seq > 1 else 1,
                batch=min(shape.batch, 2), heads=min(shape.heads, 4),
            )
            dims = "x".join(str(n) for n in shape.dims())
            shape = dataclasses.replace(shape, name=f"{shape.layout} {dims} {shape.name.split()[-1]}")
        inp = make_inputs(shape, args.device)
        for grad in (False, True):
            if grad and shape.seq == 1:
                continue  # decode is inference
            t = inp.t.detach().requires_grad_(grad)

            def step():
                out = rd.apply(t, inp.freqs, inp.spec)
                if grad:
                    torch.autograd.grad(out, t, inp.grad)
                return out

            _sync(args.device)
            start = time.perf_counter()
            step()
            _sync(args.device)
            first = time.perf_counter() - start
            call = rd.check_call(t, inp.freqs, inp.spec)
            for _ in range(200):
                dispatch.choose(call)
            rounds = []
            for _ in range(11):
                start = time.perf_counter()
                for _ in range(1000):
                    dispatch.choose(call)
                rounds.append((time.perf_counter() - start) / 1000)
            apply_times = []
            for _ in range(21):
                _sync(args.device)
                start = time.perf_counter()
                rd.apply(t.detach(), inp.freqs, inp.spec)
                _sync(args.device)
                apply_times.append(time.perf_counter() - start)
            # The decision the first call made (explain would re-derive it from the candidates
            # available now, which differ when a backend failed while being measured).
            chosen, why = dispatch._decisions[dispatch.decision_key(call, None)]
            print(
                f"{shape.name[:38]:38s} {'training' if grad else 'inference':9s} "
                f"{first * 1e3:9.0f}ms {statistics.median(rounds) * 1e6:6.2f}us "
                f"{statistics.median(apply_times) * 1e6:7.1f}us  {chosen.name}: {why}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
