"""``python -m benchmarks.qk_norm``: QK-norm + RoPE (Qwen3's attention prologue) against a
device copy of the same bytes and against the ways users run it today, in one run.

For each shape (Qwen3-8B heads by default: 32 query heads, 8 key heads, head dim 128, bf16,
bshd), forward and forward+backward (``torch.autograd.grad`` of q, k and both weights), medians
of ``triton.testing.do_bench`` (an L2 flush before each call):

- ``copy``: a device copy of q's and k's bytes (the forward's one read and one write); the
  backward's ceiling is a copy of 1.5 times them (it reads the input and the output's gradient
  and writes the input's gradient);
- ``fused``: ``rope_dispatch.apply_qk(q, k, ..., q_norm=HeadNorm, k_norm=HeadNorm)``;
- ``hf+ours``: Hugging Face's ``Qwen3RMSNorm`` on q and k, then ``rope_dispatch.apply_qk``;
- ``liger``: Liger-Kernel's ``LigerRMSNorm`` and ``liger_rotary_pos_emb`` (when installed);
- ``compiled``: ``torch.compile`` of the same torch math (norm in float32, rotation, one
  rounding), Inductor fusing norm and rotation.

Each is reported twice: GPU time (its kernels' own time in a profile, L2 flushed before each
call; the percentage of copy is on this) and end to end (``do_bench``, host included: where the
host path is longer than the kernels, it sets the pace).

Then decode: ``apply_qk_`` in place with per-token positions on the GPU, with and without the
norms, under ``no_grad`` and under ``inference_mode`` (how serving code runs a decode step),
and without norms under ``torch.compile`` (no CUDA graphs), end to end on the host clock;
then eager and compiled without norms captured 100 times in one CUDA graph, GPU time a call.
Prints a markdown table; ``--out`` also writes JSON.

    python -m benchmarks.qk_norm                      # b1 s4096, b4 s4096, b1 s32768; decode
    python -m benchmarks.qk_norm --shapes '' --decode-batches 1,64   # decode only

Needs a CUDA device (the timings are ``triton.testing.do_bench``'s and CUDA graphs').
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rope_dispatch as rd
from benchmarks.bench import _versions, bench_ms, graph_replay_us, host_us_interleaved

EPS = 1e-6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x4096,4x4096,1x32768", help="batch x seq, comma-separated")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--k-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode-batches", default="1,8,64,256")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (medians reported)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def angles(rows: int, d: int, device: str) -> torch.Tensor:
    """The ``[rows, d]`` float32 angle table of base 10000, rotate-half (halves repeated)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    half = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
    return torch.cat((half, half), dim=-1).to(device)


def torch_math(q, k, wq, wk, cos, sin):
    """Norm in float32, rotation, one rounding: what ``compiled`` compiles (q ``[b, s, h, d]``,
    cos and sin ``[s, d]`` float32)."""
    def norm(x, w):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    c, s = cos[None, :, None, :], sin[None, :, None, :]
    qn, kn = norm(q, wq), norm(k, wk)
    return (qn * c + rotate(qn) * s).to(q.dtype), (kn * c + rotate(kn) * s).to(k.dtype)


def implementations(q, k, wq, wk, table, spec) -> dict[str, Callable[..., Any]]:
    """Each way of running norm + RoPE, as ``f(q, k, wq, wk) -> (q_out, k_out)``."""
    cos, sin = table.cos(), table.sin()
    impls: dict[str, Callable[..., Any]] = {
        "fused": lambda q, k, wq, wk: rd.apply_qk(
            q, k, table, spec, q_norm=rd.HeadNorm(wq, EPS), k_norm=rd.HeadNorm(wk, EPS)),
    }
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    except Exception:  # noqa: BLE001
        Qwen3RMSNorm = None
    if Qwen3RMSNorm is not None:
        norms = [Qwen3RMSNorm(q.shape[-1], EPS).to(q.device, q.dtype) for _ in range(2)]

        def hf_then_ours(q, k, wq, wk):
            norms[0].weight, norms[1].weight = wq, wk  # the same parameters as the others
            return rd.apply_qk(norms[0](q), norms[1](k), table, spec)

        impls["hf+ours"] = hf_then_ours
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:  # noqa: BLE001
        LigerRMSNorm = None
    if LigerRMSNorm is not None and q.is_cuda:
        liger_norms = [LigerRMSNorm(q.shape[-1], EPS).to(q.device, q.dtype) for _ in range(2)]
        lcos, lsin = cos[None].to(q.dtype), sin[None].to(q.dtype)

        def liger(q, k, wq, wk):
            liger_norms[0].weight, liger_norms[1].weight = wq, wk
            qn = liger_norms[0](q).transpose(1, 2)  # Liger's RoPE takes [b, h, s, d]
            kn = liger_norms[1](k).transpose(1, 2)
            q_out, k_out = liger_rotary_pos_emb(qn, kn, lcos, lsin)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)

        impls["liger"] = liger
    compiled = torch.compile(torch_math, dynamic=False)
    impls["compiled"] = lambda q, k, wq, wk: compiled(q, k, wq, wk, cos, sin)
    return impls


def device_us(fn: Callable[[], Any], iters: int = 10) -> float:
    """GPU time per call of ``fn``: the kernels' own time in a profile (host gaps left out), each
    call after an L2 flush that is not counted."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages()
                if e.self_device_time_total and "FillFunctor" not in e.key)
    return total / iters


def reference(q, k, wq, wk, table) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 normalize-then-rotate, from the formula."""
    def one(x, w):
        x = x.double()
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()
        c, s = table.double().cos()[None, :, None, :], table.double().sin()[None, :, None, :]
        y1, y2 = y.chunk(2, dim=-1)
        return y * c + torch.cat((-y2, y1), dim=-1) * s

    return one(q, wq), one(k, wk)


def run_shape(batch: int, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + seq)
    d = args.head_dim
    q = torch.randn(batch, seq, args.q_heads, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, seq, args.k_heads, d, device=device, dtype=dtype, generator=gen)
    # parameters, as in a model (the HF and Liger modules take them as their weights)
    wq, wk = (torch.nn.Parameter((torch.rand(d, device=device, generator=gen) + 0.5).to(dtype))
              for _ in range(2))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    table = angles(seq, d, device)
    spec = rd.RoPESpec(layout="bshd", dtype=dtype)
    nbytes = (q.numel() + k.numel()) * q.element_size()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, dst_back = torch.empty_like(src), torch.empty(nbytes * 3 // 2, dtype=torch.uint8,
                                                       device=device)
    src_back = torch.empty_like(dst_back)
    ref = reference(q, k, wq, wk, table)
    row: dict[str, Any] = {"shape": f"b{batch} s{seq}", "bytes": nbytes, "impls": {}}
    timings: dict[str, list[list[float]]] = {}
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    impls = implementations(q, k, wq, wk, table, spec)
    for name, f in impls.items():
        with torch.no_grad():
            out = f(q, k, wq, wk)
            ref = tuple(r.detach() for r in ref)
        err = max(float(((o.double() - r).abs() / (1 + r.abs())).max()) for o, r in zip(out, ref))
        row["impls"][name] = {"error": err}
    for _ in range(args.rounds):
        timings.setdefault("copy", []).append([
            bench_ms(lambda: dst.copy_(src)) * 1e3, bench_ms(lambda: dst_back.copy_(src_back)) * 1e3,
            device_us(lambda: dst.copy_(src)), device_us(lambda: dst_back.copy_(src_back))])
        for name, f in impls.items():
            def forward(f=f):
                with torch.no_grad():
                    return f(q, k, wq, wk)

            def forward_backward(f=f):
                out = f(qg, kg, wq, wk)
                return torch.autograd.grad(out, (qg, kg, wq, wk), (gq, gk))

            held = f(qg, kg, wq, wk)

            def backward(held=held):
                return torch.autograd.grad(held, (qg, kg, wq, wk), (gq, gk), retain_graph=True)

            timings.setdefault(name, []).append(
                [bench_ms(forward) * 1e3, bench_ms(backward) * 1e3, bench_ms(forward_backward) * 1e3,
                 device_us(forward), device_us(backward)])
            del held
    copy_fwd, copy_bwd, copy_fwd_gpu, copy_bwd_gpu = (
        statistics.median(t[i] for t in timings["copy"]) for i in range(4))
    row["copy_us"] = {"forward": copy_fwd, "backward": copy_bwd, "forward_gpu": copy_fwd_gpu,
                      "backward_gpu": copy_bwd_gpu}
    for name in impls:
        fwd, bwd, both, fwd_gpu, bwd_gpu = (
            statistics.median(t[i] for t in timings[name]) for i in range(5))
        row["impls"][name].update(
            forward_us=fwd, backward_us=bwd, fwd_bwd_us=both, forward_gpu_us=fwd_gpu,
            backward_gpu_us=bwd_gpu, forward_of_copy=copy_fwd_gpu / fwd_gpu,
            backward_of_copy=copy_bwd_gpu / bwd_gpu)
    return row


def run_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``apply_qk_`` with per-token positions on the GPU, one token per sequence, with and
    without norms, under ``torch.no_grad`` (as transformers' ``generate`` runs) and under
    ``torch.inference_mode`` (as vLLM and SGLang run): host and end-to-end us per call."""
    device, dtype, d = args.device, getattr(torch, args.dtype), args.head_dim
    table = angles(4096, d, device)
    rows = []
    for batch in (int(b) for b in args.decode_batches.split(",")):
        q = torch.randn(batch, 1, args.q_heads, d, device=device, dtype=dtype)
        k = torch.randn(batch, 1, args.k_heads, d, device=device, dtype=dtype)
        pos = torch.randint(0, 4096, (batch, 1), device=device)
        spec = rd.RoPESpec(layout="bshd", dtype=dtype)
        q_norm = rd.HeadNorm(torch.rand(d, device=device, dtype=dtype) + 0.5, EPS)
        k_norm = rd.HeadNorm(torch.rand(d, device=device, dtype=dtype) + 0.5, EPS)
        def rope(mode=torch.no_grad):
            with mode():
                return rd.apply_qk_(q, k, table, spec, positions=pos)

        def norm_rope(mode=torch.no_grad):
            with mode():
                return rd.apply_qk_(q, k, table, spec, positions=pos, q_norm=q_norm,
                                    k_norm=k_norm)

        inference = torch.inference_mode
        compiled = torch.compile(rd.apply_qk_)  # Inductor's graph, no CUDA graphs

        def rope_compiled():
            with torch.inference_mode():
                return compiled(q, k, table, spec, positions=pos)

        fns = {"rope": rope, "norm+rope": norm_rope,
               "rope (inference)": lambda: rope(inference),
               "norm+rope (inference)": lambda: norm_rope(inference),
               "rope (compiled)": rope_compiled}
        for fn in fns.values():
            for _ in range(3):
                fn()
        measured = host_us_interleaved(fns)
        rows.append({"batch": batch, **{name: {"host_us": h, "end_to_end_us": e}
                                        for name, (h, e) in measured.items()},
                     "graph_us": {name: graph_replay_us(fns[name], calls=100)
                                  for name in ("rope (inference)", "rope (compiled)")}})
    return rows


def format_report(rows: list[dict[str, Any]], decode: list[dict[str, Any]]) -> str:
    lines = ["| shape | impl | fwd GPU us (% copy) | bwd GPU us (% copy) | fwd / bwd / fwd+bwd "
             "end to end us | max err |", "|---|---|---|---|---|---|"]
    for row in rows:
        copy = row["copy_us"]
        lines.append(f"| {row['shape']} | copy | {copy['forward_gpu']:.1f} | "
                     f"{copy['backward_gpu']:.1f} | {copy['forward']:.1f} / {copy['backward']:.1f} "
                     f"| |")
        for name, m in row["impls"].items():
            if "forward_us" not in m:
                continue
            lines.append(
                f"| {row['shape']} | {name} | {m['forward_gpu_us']:.1f} ({m['forward_of_copy']:.0%})"
                f" | {m['backward_gpu_us']:.1f} ({m['backward_of_copy']:.0%}) | "
                f"{m['forward_us']:.1f} / {m['backward_us']:.1f} / {m['fwd_bwd_us']:.1f} | "
                f"{m['error']:.1e} |")
    if decode:
        lines += ["", "| decode batch | mode | apply_qk_ us (host / end to end) | with norms | "
                  "norms / none, end to end |", "|---|---|---|---|---|"]
        for row in decode:
            for mode, suffix in (("no_grad", ""), ("inference_mode", " (inference)")):
                a, b = row["rope" + suffix], row["norm+rope" + suffix]
                lines.append(
                    f"| {row['batch']} | {mode} | {a['host_us']:.1f} / {a['end_to_end_us']:.1f} | "
                    f"{b['host_us']:.1f} / {b['end_to_end_us']:.1f} | "
                    f"{b['end_to_end_us'] / a['end_to_end_us']:.2f}x |")
            c = row["rope (compiled)"]
            lines.append(f"| {row['batch']} | torch.compile, inference_mode | "
                         f"{c['host_us']:.1f} / {c['end_to_end_us']:.1f} | | |")
            g = row["graph_us"]
            lines.append(f"| {row['batch']} | CUDA graph, GPU us a call: eager / compiled | "
                         f"{g['rope (inference)']:.2f} / {g['rope (compiled)']:.2f} | | |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    rows = [run_shape(*(int(n) for n in shape.split("x")), args)
            for shape in args.shapes.split(",") if shape]
    decode = [] if args.no_decode or args.device != "cuda" else run_decode(args)
    report = format_report(rows, decode)
    versions = _versions()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "qk_norm.json").write_text(json.dumps(
            {"device": device, "versions": versions, "shapes": rows, "decode": decode}, indent=1))
        (args.out / "qk_norm.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
