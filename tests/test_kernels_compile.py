"""The Triton kernels compile for the GPU machine's architecture (sm_90), down to the cubin,
on this machine without a GPU: every table kind (the linear-table flag's branch included),
thd, context parallelism, backward, packed qkv, the channel stage (rotary offset,
deinterleaved pairs both ways), the lean kernel of small contiguous calls,
the norm kernel with its cache stage (FP8 stores included), the weights' gradient sum (bf16),
and the linear-table check. The interpreter runs the kernels' logic on the CPU elsewhere in
the suite; this catches what only the GPU compiler would reject. Runs
``tests/compile_for_gpu.py`` in a process of its own (the kernels must be imported with
``TRITON_INTERPRET`` unset)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed; the triton backend is unavailable")


def test_every_kernel_family_compiles_for_sm_90():
    script = Path(__file__).with_name("compile_for_gpu.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # 13 variants of rope_kernel and rope_qkv_kernel, 9 of rope_lean_kernel (no thd, cp or
    # channel stage), its two layouts of two channels a thread and a batch of one, 7 of
    # rope_norm_kernel (norms, a pipelined backward, cache stages, MLA's wide v), the weight
    # gradients' sum and the two table-check kernels
    assert len(lines) == 48 and all(line.startswith("ok ") for line in lines), proc.stdout
    assert "ok weight_grad_kernel" in lines
    assert "ok rope_kernel precise rate table" in lines
    assert "ok rope_norm_kernel norm, backward, pipelined token loop" in lines
    assert "ok rope_qkv_kernel deinterleave, offset, cos/sin cache" in lines
    assert "ok rope_kernel deinterleave, backward" in lines
    assert "ok rope_kernel linear table, pairs, backward" in lines
    assert "ok rope_lean_kernel linear table, pairs, backward" in lines
    assert "ok rope_lean_kernel two channels a thread, linear flag" in lines
    assert "ok rope_lean_kernel one sequence, bshd" in lines
    assert "ok rope_qkv_kernel cos/sin cache, halves flag" in lines
    assert "ok rope_norm_kernel cache pages e4m3, device scales, q e4m3" in lines
    assert lines[-2:] == ["ok linear_table_kernel", "ok halves_table_kernel"]
