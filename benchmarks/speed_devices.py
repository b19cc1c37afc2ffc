"""Same-run A/B of the Triton backend, on the figures a user sees: its speed devices, or two
source trees (before and after a change).

Each variant runs in a process of its own (compiled launches, flags and plans start empty),
the variants in turn for ``--rounds`` rounds; the table shows each figure's median over rounds:

- ``shipped``: everything on;
- ``no-direct``: the C direct launcher off (then nothing is planned: every call is checked);
- ``no-flags``: ``ROPE_DISPATCH_LINEAR_TABLES=0`` (no linear-table or halves flag: rows read);
- ``no-lean``: the lean kernel off (small contiguous calls take the general kernel);

- ``tree=PATH``: the package imported from the source tree at ``PATH`` (its ``rope_dispatch``
  with ``backends`` copied or linked inside it), e.g. a checkout of the commit before a change.

Figures: decode end to end (host clock, many calls, synchronised once), forward + backward end to
end at three sizes, and kernel times (``triton.testing.do_bench``, its L2 flush) from 64 MiB,
for a model's angle table and a Hugging Face cos/sin cache. Run on a GPU machine:

    python benchmarks/speed_devices.py            # every device variant, then the table
    python benchmarks/speed_devices.py --rounds 3 tree=/tmp/before shipped
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


VARIANTS = ("shipped", "no-direct", "no-flags", "no-lean", "shipped")


def _patch(variant: str) -> None:
    if variant == "no-direct":
        from rope_dispatch.backends import direct_launch

        direct_launch._unavailable = "turned off for the A/B"
    elif variant == "no-lean":
        from rope_dispatch.backends import triton_tiles

        triton_tiles.LEAN_MAX_BYTES = 0


def _host_us(fn, calls: int = 2000, repeats: int = 7) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure() -> dict[str, float]:
    import torch
    import triton.testing

    import rope_dispatch as rd
    from rope_dispatch import tables

    dev = "cuda"
    bf16 = torch.bfloat16
    freqs = tables.default_frequencies(128).angle_table(8192, device=dev)
    results: dict[str, float] = {}

    # decode: 64 sequences of one token, positions on the GPU
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    x = torch.randn(64, 1, 32, 128, device=dev, dtype=bf16)
    pos = torch.randint(0, 8000, (64, 1), device=dev)
    results["decode apply b64 (us)"] = _host_us(lambda: rd.apply(x, freqs, spec, positions=pos))
    for tokens in (1, 256):
        q = torch.randn(tokens, 1, 32, 128, device=dev, dtype=bf16)
        k = torch.randn(tokens, 1, 8, 128, device=dev, dtype=bf16)
        p = torch.randint(0, 8000, (tokens, 1), device=dev)
        results[f"decode apply_qk_ T{tokens} (us)"] = _host_us(
            lambda q=q, k=k, p=p: rd.apply_qk_(q, k, freqs, spec, positions=p))

    # decode as Hugging Face calls it: one token, a cos/sin cache read by index
    hf = rd.RoPESpec(layout="bshd", dtype="bf16")
    x1 = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    rows = freqs.view(8192, 128)[:1]
    one = rd.CosSinCache(rows.cos().to(bf16), rows.sin().to(bf16))
    results["decode apply T1 HF cache (us)"] = _host_us(lambda: rd.apply(x1, one, hf))
    small = torch.randn(128, 1, 8, 128, device=dev, dtype=bf16)  # 256 KiB
    sbhd = rd.RoPESpec(layout="sbhd", dtype="bf16")
    rd.apply(small, freqs, sbhd)  # compiled and planned before do_bench sizes its loop
    results["kernel 256 KiB fwd (us)"] = 1e3 * triton.testing.do_bench(
        lambda: rd.apply(small, freqs, sbhd), warmup=25, rep=200)

    # forward + backward end to end, sbhd
    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    for s, b, h in ((128, 1, 8), (4096, 1, 8), (4096, 4, 32)):
        t = torch.randn(s, b, h, 128, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn(s, b, h, 128, device=dev, dtype=bf16)

        def step(t=t, g=g):
            torch.autograd.grad(rd.apply(t, freqs, spec), t, g)

        results[f"fwd+bwd s{s} b{b} h{h} (us)"] = _host_us(step, calls=200 if s * b * h > 8192 else 2000)

    # kernel time from 64 MiB: a model's angle table and an HF cos/sin cache
    t = torch.randn(4096, 2, 32, 128, device=dev, dtype=bf16)  # 64 MiB
    copy = triton.testing.do_bench(lambda: torch.empty_like(t).copy_(t), warmup=25, rep=200)
    results["copy 64 MiB (us)"] = copy * 1e3
    for _ in range(3):
        rd.apply(t, freqs, spec)
    results["fwd 64 MiB angles % of copy"] = 100 * copy / triton.testing.do_bench(
        lambda: rd.apply(t, freqs, spec), warmup=25, rep=200)
    hf = rd.RoPESpec(layout="bshd", dtype="bf16")
    tq = torch.randn(2, 8192, 16, 128, device=dev, dtype=bf16)  # 64 MiB
    angles = freqs.view(8192, 128)
    cache = rd.CosSinCache(angles.cos().to(bf16), angles.sin().to(bf16))  # as HF builds it
    copy_q = triton.testing.do_bench(lambda: torch.empty_like(tq).copy_(tq), warmup=25, rep=200)
    for _ in range(3):
        rd.apply(tq, cache, hf)
    results["fwd 64 MiB HF cache % of copy"] = 100 * copy_q / triton.testing.do_bench(
        lambda: rd.apply(tq, cache, hf), warmup=25, rep=200)
    return results


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--variant":
        variant = args[1]
        if variant == "no-flags":
            os.environ["ROPE_DISPATCH_LINEAR_TABLES"] = "0"
        _patch(variant)
        print(json.dumps(measure()))
        return
    rounds = 1
    if args[:1] == ["--rounds"]:
        rounds, args = int(args[1]), args[2:]
    variants = args or list(VARIANTS)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            env = dict(os.environ)
            if variant.startswith("tree="):
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (variant[5:], env.get("PYTHONPATH")) if p)
            done = subprocess.run([sys.executable, __file__, "--variant", variant],
                                  capture_output=True, text=True, env=env)
            if done.returncode:
                print(variant, "failed:", done.stderr[-2000:])
                continue
            samples[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = [(v, {name: statistics.median(r[name] for r in runs) for name in runs[0]})
            for v, runs in samples.items() if runs]
    names = list(rows[0][1]) if rows else []
    print(f"{'figure: median (min-max) of rounds':36s}"
          + "".join(f"{v[-22:]:>24s}" for v, _ in rows))
    for name in names:
        cells = []
        for variant, medians in rows:
            values = [run[name] for run in samples[variant]]
            cells.append(f"{medians[name]:.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"{name:36s}" + "".join(f"{c:>24s}" for c in cells))


if __name__ == "__main__":
    main()
