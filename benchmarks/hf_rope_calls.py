"""The Hugging Face integration's RoPE call at model shapes, against Liger-Kernel's and
transformers' own math: what ``rope_dispatch.integrations.hf.patch`` gives a model's layers.

Each shape is a model's q and k as its attention hands them over (``[b, heads, s, d]`` views
of ``[b, s, heads, d]`` projections, bf16) with the ``[1, s, d]`` cos and sin its rotary
embedding returns (``cat(freqs, freqs)``, rounded to bf16). For each call:

- forward and backward (``torch.autograd.grad`` on the forward's outputs) kernel time by the
  profiler, each call after an L2 flush (``bench.cold_kernel_us``), as % of a device copy of
  q's and k's bytes timed in the same traces: the kernels a layer's RoPE costs on the GPU,
  every launch of the call included;
- forward + backward through autograd end to end on the host clock, the calls in turn
  (``bench.host_us_interleaved``);
- each forward's largest error against a float64 rotation written from the formula.

"ours, whole rows" is the door's call on a copy of cos and sin whose kernels read each row
whole (no halves flag): what reading the first halves alone saves. Liger's call is
``liger_rotary_pos_emb`` (in place on q and k; it reads the first half of cos
and sin only, as transformers' halves are equal). "eager" is transformers' formula
``q * cos + rotate_half(q) * sin`` in torch ops. Needs a CUDA device; Liger is optional.

With ``--per-token-cos`` cos and sin are ``[b, s, d]``, as a model given ``[b, s]`` position
ids makes them: one row per token, which the door reads through start positions.

    python -m benchmarks.hf_rope_calls [--rounds 2] [--shapes all|small] [--per-token-cos]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

if __package__ in (None, ""):  # run by path: the repository root holds benchmarks/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rope_dispatch as rd  # noqa: E402
from benchmarks import bench  # noqa: E402
from rope_dispatch.backends import triton_tables  # noqa: E402
from rope_dispatch.integrations import hf  # noqa: E402

SHAPES = [  # (model, batch, seq, q heads, kv heads, head dim)
    ("Llama-3 8B", 1, 1024, 32, 8, 128),
    ("Llama-3 8B", 1, 8192, 32, 8, 128),
    ("Llama-3 8B", 4, 2048, 32, 8, 128),
    ("Llama-3 8B", 4, 8192, 32, 8, 128),
    ("Qwen2.5 7B", 4, 4096, 28, 4, 128),
    ("Gemma 2B (MQA)", 1, 2048, 8, 1, 256),
    ("Gemma 2B (MQA)", 4, 8192, 8, 1, 256),
    ("Falcon 7B (MQA)", 1, 2048, 71, 1, 64),
    ("Falcon 7B (MQA)", 4, 2048, 71, 1, 64),
    ("Phi-3 mini", 1, 4096, 32, 32, 96),
    ("Phi-3 mini", 4, 4096, 32, 32, 96),
    ("OLMo 1B", 4, 4096, 16, 16, 128),
]
SMALL = [s for s in SHAPES if s[1] * s[2] <= 2048]
SWITCH = "ROPE_DISPATCH_LINEAR_TABLES"
BSHD = rd.RoPESpec(layout="bshd", dtype=torch.bfloat16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' formula, in torch ops (its ``apply_rotary_pos_emb``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


PER_TOKEN_COS = False
"""``--per-token-cos``: cos and sin ``[b, s, d]``, as a model given ``[b, s]`` position ids
makes them (the door then reads one row per token through start positions)."""


def inputs(batch: int, seq: int, hq: int, hk: int, d: int) -> dict[str, torch.Tensor]:
    """q, k (``[b, s, h, d]`` storage), their gradients and bf16 cos/sin ``[1, s, d]``
    (``[b, s, d]`` with ``PER_TOKEN_COS``)."""
    dev, dt = "cuda", torch.bfloat16
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    freqs = torch.arange(seq, device=dev, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    if PER_TOKEN_COS:
        emb = emb.repeat(batch, 1, 1)
    return {
        "q": torch.randn(batch, seq, hq, d, device=dev, dtype=dt),
        "k": torch.randn(batch, seq, hk, d, device=dev, dtype=dt),
        "gq": torch.randn(batch, seq, hq, d, device=dev, dtype=dt),
        "gk": torch.randn(batch, seq, hk, d, device=dev, dtype=dt),
        "cos": emb.cos().to(dt), "sin": emb.sin().to(dt),
    }


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 rotation of ``[b, s, h, d]`` x by per-token ``[1, s, d]`` cos and sin."""
    x, c, s = x.double(), cos.double()[:, :, None], sin.double()[:, :, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c[..., :half] - x2 * s[..., :half],
                      x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)


_copies: dict[int, tuple[torch.Tensor, rd.CosSinCache]] = {}


def whole_rows(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Our call as the door makes it (``apply_qk`` on bshd views of q and k, one cache row per
    token of ``[1, s, d]`` cos and sin) on a copy of cos and sin made once, every call with
    ``ROPE_DISPATCH_LINEAR_TABLES=0``: the copy's plan is made without a halves flag and keeps
    reading whole rows. The launches are those of "ours (hf.patch)" but for the flag."""
    entry = _copies.get(id(cos))
    if entry is None or entry[0] is not cos:
        d = cos.shape[-1]
        table = rd.CosSinCache(cos.reshape(-1, d).clone(), sin.reshape(-1, d).clone())
        entry = _copies[id(cos)] = (cos, table)
    starts = None
    if cos.shape[0] > 1:  # a row per token: sequence i's rows start at i * s
        starts = torch.arange(cos.shape[0], device=cos.device) * cos.shape[1]
    os.environ[SWITCH] = "0"
    try:
        q_out, k_out = rd.apply_qk(q.transpose(1, 2), k.transpose(1, 2), entry[1], BSHD,
                                   start_positions=starts)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    finally:
        del os.environ[SWITCH]


def calls() -> dict[str, Callable]:
    """name -> ``fn(q, k, cos, sin)`` taking and returning HF's ``[b, h, s, d]`` views."""
    found: dict[str, Callable] = {"ours (hf.patch)": hf.apply_rotary_pos_emb,
                                  "ours, whole rows": whole_rows}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001
        print(f"Liger-Kernel not available ({type(exc).__name__}: {exc}): left out")
    else:
        found["liger"] = liger_rotary_pos_emb
    found["eager"] = eager
    return found


def kernels_of(fn: Callable[[], Any]) -> list[str]:
    """The GPU kernels one call of ``fn`` runs (after a warm call), by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [e.name[:40] for e in prof.events() if e.device_type == cuda]


def measure(shape: tuple, rounds: int) -> None:
    model, batch, seq, hq, hk, d = shape
    t = inputs(batch, seq, hq, hk, d)
    cos, sin = t["cos"], t["sin"]
    moved = 2 * (t["q"].numel() + t["k"].numel()) * 2
    src = torch.cat((t["q"].flatten(), t["k"].flatten()))
    dst = torch.empty_like(src)
    grads = (t["gq"].transpose(1, 2), t["gk"].transpose(1, 2))
    fwd: dict[str, Callable[[], Any]] = {}
    bwd: dict[str, Callable[[], Any]] = {}
    fwd_bwd: dict[str, Callable[[], Any]] = {}
    errors = {}
    ref_q, ref_k = reference(t["q"], cos, sin), reference(t["k"], cos, sin)
    for name, fn in calls().items():
        # each call its own tensors: Liger's rotates q and k in place
        q, k = t["q"].clone(), t["k"].clone()
        oq, ok = fn(q.clone().transpose(1, 2), k.clone().transpose(1, 2), cos, sin)
        errors[name] = max((oq.transpose(1, 2).double() - ref_q).abs().max().item(),
                           (ok.transpose(1, 2).double() - ref_k).abs().max().item())
        fwd[name] = lambda fn=fn, q=q, k=k: fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        outs = fn(ql.transpose(1, 2), kl.transpose(1, 2), cos, sin)
        bwd[name] = lambda outs=outs, ql=ql, kl=kl: torch.autograd.grad(
            outs, (ql, kl), grads, retain_graph=True)
        fwd_bwd[name] = lambda fn=fn, ql=ql, kl=kl: torch.autograd.grad(
            fn(ql.transpose(1, 2), kl.transpose(1, 2), cos, sin), (ql, kl), grads)
    fwd["copy"] = bwd["copy"] = lambda: dst.copy_(src)
    flags = [int(flag.item()) for flag in triton_tables._halves.values()]
    print(f"{model}: b{batch} s{seq} q {hq} heads, k {hk}, d{d} bf16, q+k {moved / 2**21:.1f} "
          f"MiB (moved {moved / 2**20:.1f} MiB); largest error against float64: "
          + ", ".join(f"{n} {e:.2g}" for n, e in errors.items())
          + f"; cos/sin halves flags held: {flags}", flush=True)
    for mode, fns in (("fwd", fwd), ("bwd", bwd)):
        print(f"  {mode} kernels: " + "; ".join(
            f"{n} {kernels_of(fn)}" for n, fn in fns.items() if n not in ("copy", "eager")))
        for _ in range(rounds):
            us = bench.cold_kernel_us(fns, calls=30, copies=True)
            print(f"  {mode} kernels, L2 flushed: " + " | ".join(
                f"{n} {v:.2f} ({100 * us['copy'] / v:.0f}%)" for n, v in us.items()
                if n != "copy") + f" | copy {us['copy']:.2f}", flush=True)
    large = moved >= 128 << 20
    host = bench.host_us_interleaved(fwd_bwd, calls=10 if large else 40,
                                     rounds=10 if large else 20)
    print("  fwd+bwd end to end, host clock: " + " | ".join(
        f"{n} {total:.1f} (host {h:.1f})" for n, (h, total) in host.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="profiler traces per mode")
    p.add_argument("--shapes", choices=("all", "small"), default="all")
    p.add_argument("--per-token-cos", action="store_true",
                   help="cos and sin [b, s, d] (a row per token), as with [b, s] position ids")
    args = p.parse_args()
    global PER_TOKEN_COS
    PER_TOKEN_COS = args.per_token_cos
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(torch.cuda.get_device_name(), torch.__version__)
    for shape in SHAPES if args.shapes == "all" else SMALL:
        measure(shape, args.rounds)


if __name__ == "__main__":
    main()
