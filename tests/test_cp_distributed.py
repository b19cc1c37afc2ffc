"""Context parallelism across real processes: every rank shards the same full batch with
``cp.shard``, rotates its part (forward and backward) with ``cp_size=N, cp_rank=rank``, and
``cp.gather`` reassembles outputs and gradients, which must equal the single-process call on the
full sequence (``cp_size=1``) and the float64 reference of tests/reference.py.

gloo on the CPU always; NCCL (one GPU per rank, rope on the triton backend) on a machine with
enough GPUs. One spawned job per (process-group backend, N) covers sbhd, bshd and thd. Every
rank checks the gathered result, so a wrong gather on any rank fails too; an exception on any
rank fails the test through ``spawn``, and a deadline kills a job that hangs.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import rope_dispatch as rd
from ranks import join_ranks
from reference import assert_matches, reference_forward_backward
from rope_dispatch import cp

JOB_DEADLINE_S = 180  # the whole spawned job; a CPU job takes a few seconds per rank
COLLECTIVE_TIMEOUT = timedelta(seconds=60)

# (layout, global sequence lengths, batch, heads, head dim, rotary dim, interleaved); thd lengths
# are raw and get padded to multiples of 2*N with cp.pad_cu_seqlens, one of them empty.
CASES = [
    ("sbhd", None, 2, 2, 16, 12, False),
    ("bshd", None, 3, 2, 8, 8, True),
    ("thd", [5, 0, 13, 2, 8], None, 2, 16, 16, False),
]


def _run_case(case, world: int, rank: int, device: torch.device, rope_backend: str) -> None:
    layout, raw_lengths, batch, heads, head_dim, rotary_dim, interleaved = case
    gen = torch.Generator().manual_seed(1234)  # the same full batch on every rank
    cu = None
    if layout == "thd":
        raw = torch.tensor([0, *torch.tensor(raw_lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cp.pad_cu_seqlens(raw, world)
        lengths = (cu[1:] - cu[:-1]).tolist()
        assert all(n % (2 * world) == 0 for n in lengths) and 0 in lengths
        batch = len(lengths)
        shape = (int(cu[-1]), heads, head_dim)
        longest = max(lengths)
        cu = cu.to(device)
    else:
        longest = 2 * world * 3
        dims = (longest, batch) if layout == "sbhd" else (batch, longest)
        shape = (*dims, heads, head_dim)
    starts = torch.randint(0, 7, (batch,), generator=gen)
    rows = longest + int(starts.max()) + 3
    angles = torch.rand(rows, rotary_dim, generator=gen) * 40 - 20  # unequal halves
    x = torch.randn(shape, generator=gen)
    grad_out = torch.randn(shape, generator=gen)
    freqs = angles.view(rows, 1, 1, rotary_dim).to(device)
    x, grad_out, starts = x.to(device), grad_out.to(device), starts.to(device)

    fields = dict(layout=layout, dtype=torch.float32, interleaved=interleaved, cu_seqlens=cu)
    local = cp.shard(x, layout, world, rank, cu_seqlens=cu).requires_grad_(True)
    spec = rd.RoPESpec(**fields, cp_size=world, cp_rank=rank)
    out = rd.apply(local, freqs, spec, start_positions=starts, backend=rope_backend)
    grad_local = cp.shard(grad_out, layout, world, rank, cu_seqlens=cu)
    (grad,) = torch.autograd.grad(out, local, grad_local)
    out_full = cp.gather(out, layout, cu_seqlens=cu)
    grad_full = cp.gather(grad, layout, cu_seqlens=cu)

    what = f"{layout} N={world} rank {rank} ({rope_backend})"
    # the single-process call on the full sequence: the same formula per element
    whole = rd.RoPESpec(**fields)
    x_full = x.clone().requires_grad_(True)
    expected = rd.apply(x_full, freqs, whole, start_positions=starts, backend=rope_backend)
    (expected_grad,) = torch.autograd.grad(expected, x_full, grad_out)
    tight = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        out_full, expected.detach(), **tight, msg=lambda m: f"{what} forward: {m}"
    )
    torch.testing.assert_close(
        grad_full, expected_grad, **tight, msg=lambda m: f"{what} backward: {m}"
    )
    # the float64 reference (its own position arithmetic, no cp)
    ref_out, ref_grad = reference_forward_backward(x, angles, whole, grad_out, starts.cpu())
    assert_matches(out_full, ref_out, torch.float32, f"{what} forward vs float64")
    assert_matches(grad_full, ref_grad, torch.float32, f"{what} backward vs float64")


def _worker(rank: int, world: int, pg_backend: str, init_file: str) -> None:
    torch.set_num_threads(1)
    if pg_backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        rope_backend = "triton" if rd.get_backend("triton").available else "eager"
    else:
        device, rope_backend = torch.device("cpu"), "eager"
    dist.init_process_group(
        pg_backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=COLLECTIVE_TIMEOUT, **({"device_id": device} if pg_backend == "nccl" else {}),
    )
    try:
        for case in CASES:
            _run_case(case, world, rank, device, rope_backend)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "pg_backend, world",
    [
        ("gloo", 2), ("gloo", 4),
        pytest.param("nccl", 2, marks=pytest.mark.gpu),
        pytest.param("nccl", 4, marks=pytest.mark.gpu),
    ],
)
def test_cp_across_processes(pg_backend, world, tmp_path, monkeypatch):
    if pg_backend == "nccl":
        if torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} CUDA devices for NCCL, found {torch.cuda.device_count()}")
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (inherited by the ranks)
        monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    join_ranks(_worker, world, (world, pg_backend, str(tmp_path / "store")), f"{pg_backend} job",
               JOB_DEADLINE_S)
