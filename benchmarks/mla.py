"""DeepSeek's decoupled RoPE (MLA): the rope part of 128 query heads (the last 64 of 192
channels, a view of the projection) and one shared key head, rotated in one launch, forward
and backward, against a device copy of the bytes moved and the eager composition (the unfused
path Megatron takes for MLA).

    python -m benchmarks.mla [--tokens 1 1024 4096 16384]

bf16, sbhd with one sequence of T tokens. Bytes: read the rope channels of q and k_rot and
write them (the forward's outputs, the backward's gradients). Kernel time: the kernels' own
GPU time after an L2 flush (``benchmarks.bench.cold_kernel_us``, every call of a row in turn in
one trace), against a device copy of those bytes timed the same way. End to end: ``do_bench``
of the call (host included), and of ``torch.autograd.grad`` of it for forward+backward.
"""

from __future__ import annotations

import argparse

import torch

import rope_dispatch as rd
from benchmarks.bench import bench_ms, cold_kernel_us

HEADS, NOPE, ROPE = 128, 128, 64


def run(tokens: int, deinterleave: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, 1, HEADS, NOPE + ROPE, generator=gen).bfloat16().cuda()
    k = torch.randn(tokens, 1, 1, ROPE, generator=gen).bfloat16().cuda()
    q_rot = q[..., NOPE:].detach().requires_grad_(True)  # a strided view, as the model slices it
    k_rot = k.requires_grad_(True)
    inv = rd.tables.inverse_frequencies(ROPE, 10000.0)
    freqs = rd.tables.angle_table(inv, tokens).cuda()
    spec = rd.RoPESpec(layout="sbhd", dtype=torch.bfloat16, deinterleave=deinterleave)
    grads = (torch.randn(q_rot.shape, generator=gen).bfloat16().cuda(),
             torch.randn(k_rot.shape, generator=gen).bfloat16().cuda())
    src = torch.empty((q_rot.numel() + k_rot.numel()) * 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def forward(backend: str = "triton"):
        return rd.apply_qk(q_rot, k_rot, freqs, spec, backend=backend)

    held = forward()  # the backward alone: its graph kept between calls

    def backward():
        return torch.autograd.grad(held, (q_rot, k_rot), grads, retain_graph=True)

    def in_place():
        with torch.no_grad():
            return rd.apply_qk_(q[..., NOPE:], k, freqs, spec, backend="triton")

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    kernel = cold_kernel_us({"copy": lambda: dst.copy_(src), "fwd": no_grad(forward),
                             "bwd": backward, "in place": in_place,
                             "eager fwd": no_grad(lambda: forward("eager"))}, 50, copies=True)
    copy = kernel.pop("copy")
    fwd_e2e = 1e3 * bench_ms(no_grad(forward))
    both_e2e = 1e3 * bench_ms(lambda: torch.autograd.grad(forward(), (q_rot, k_rot), grads))
    label = f"T{tokens:<6} {'deinterleave' if deinterleave else 'halves':>12}"
    print(f"  {label}: kernel time, % of copy ({copy:.1f} us): "
          + ", ".join(f"{name} {us:.1f} us ({100 * copy / us:.0f}%)" for name, us in kernel.items())
          + f"; end to end fwd {fwd_e2e:.1f} us, fwd+bwd {both_e2e:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 1024, 4096, 16384])
    args = parser.parse_args()
    print(f"MLA rope part: q {HEADS} heads x {ROPE} of {NOPE + ROPE} channels, k_rot 1 head, bf16, "
          f"{torch.cuda.get_device_name()}")
    for tokens in args.tokens:
        for deinterleave in (False, True):
            run(tokens, deinterleave)


if __name__ == "__main__":
    main()
