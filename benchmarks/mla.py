"""DeepSeek's decoupled RoPE (MLA): the rope part of 128 query heads (the last 64 of 192
channels, a view of the projection) and one shared key head, rotated in one launch, forward
and backward, against a device copy of the bytes moved and the eager composition (the unfused
path Megatron takes for MLA).

    python -m benchmarks.mla [--tokens 1 1024 4096 16384]

GPU time (``do_bench``, L2 flushed), bf16, sbhd with one sequence of T tokens. Bytes: read the
rope channels of q and k_rot and write them (the forward's outputs, the backward's gradients).
"""

from __future__ import annotations

import argparse

import torch

import rope_dispatch as rd
from benchmarks.bench import bench_ms, device_copy_ms

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
    copy = device_copy_ms(2 * (q_rot.numel() + k_rot.numel()) * 2)
    label = f"T{tokens:<6} {'deinterleave' if deinterleave else 'halves':>12}"
    for backend in ("triton", "eager"):
        def forward(backend=backend):
            return rd.apply_qk(q_rot, k_rot, freqs, spec, backend=backend)

        outs = forward()
        fwd = bench_ms(lambda: forward())
        both = bench_ms(lambda: torch.autograd.grad(forward(), (q_rot, k_rot), grads))
        bwd = both - fwd
        with torch.no_grad():
            in_place = bench_ms(lambda: rd.apply_qk_(q[..., NOPE:], k, freqs, spec, backend=backend))
        del outs
        print(f"  {label} {backend:>6}: fwd {fwd * 1e3:8.1f} us ({100 * copy / fwd:5.1f}% of copy), "
              f"bwd {bwd * 1e3:8.1f} us ({100 * copy / bwd:5.1f}%), in place {in_place * 1e3:8.1f} us "
              f"({100 * copy / in_place:5.1f}%); copy {copy * 1e3:.1f} us")


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
