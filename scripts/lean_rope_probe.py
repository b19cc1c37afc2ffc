"""A prototype kernel for ``scripts/tile_probe.py lean-kernel``, not shipped.

RoPE in place of a contiguous sbhd or bshd tensor, full rotary, rotate-half, with a model's
angle table read through its linearity flag (rates from row 1, the rows where the flag is
clear), as the shipped kernel does at the sweep's flagged points. Everything else is left out:
heads and head dim are compile-time, offsets int32, the grid one axis, no position range check
(each can be put back: ``SWITCHES``). It asks how far an instruction-lean kernel gets against Liger's at the small calls where
Liger's kernel leads ours (run AH).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rope_dispatch.backends.triton_kernels import _cos_sin
from rope_dispatch.backends.triton_rope import division_magic


@triton.jit(do_not_specialize=["n_tokens", "dim1", "dim1_magic", "dim1_shift", "heads",
                               "s_row", "s_head", "table_len"])
def lean_rope_kernel(
    x_ptr, tab_ptr, flag_ptr, n_tokens, dim1, dim1_magic, dim1_shift, heads, s_row, s_head,
    table_len, LAYOUT: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, WIDE: tl.constexpr,
    STRIDED: tl.constexpr, GRID3: tl.constexpr, CHECKED: tl.constexpr,
):
    """``BLOCK_T`` tokens x ``BLOCK_H`` heads per program, programs numbered heads first.

    Each switch puts back one thing the shipped kernel does: ``WIDE`` int64 offsets,
    ``STRIDED`` heads and strides as runtime arguments, ``GRID3`` the shipped grid (head group
    on axis 0, token blocks on axes 1 and 2), ``CHECKED`` the positions' range check (NaN rows
    outside the table)."""
    HALF: tl.constexpr = D // 2
    if GRID3:
        block = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
        group = tl.program_id(0)
    else:
        GROUPS: tl.constexpr = (HEADS + BLOCK_H - 1) // BLOCK_H
        block = tl.program_id(0) // GROUPS
        group = tl.program_id(0) - block * GROUPS
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = group * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, HALF)
    tok_mask = tok < n_tokens
    if WIDE:
        tok_off = tok.to(tl.int64)
        hh_off = hh.to(tl.int64)
    else:
        tok_off = tok
        hh_off = hh
    if STRIDED:
        mask = tok_mask[:, None, None] & (hh < heads)[None, :, None]
        off = (tok_off * s_row)[:, None, None] + (hh_off * s_head)[None, :, None] + c[None, None, :]
    else:
        mask = tok_mask[:, None, None] & (hh < HEADS)[None, :, None]
        off = (tok_off * (HEADS * D))[:, None, None] + (hh_off * D)[None, :, None] + c[None, None, :]
    x_a = tl.load(x_ptr + off, mask=mask)
    x_b = tl.load(x_ptr + off + HALF, mask=mask)
    u = tok.to(tl.uint32, bitcast=True)
    i0 = ((tl.umulhi(u, dim1_magic.to(tl.uint32, bitcast=True)) + u)
          >> dim1_shift.to(tl.uint32)).to(tl.int32, bitcast=True)
    pos = i0 if LAYOUT == 0 else tok - i0 * dim1
    if CHECKED:
        inside = tok_mask & (pos >= 0) & (pos < table_len)
    else:
        inside = tok_mask
    flag = tl.load(flag_ptr)
    rate = tl.load(tab_ptr + D + c)
    angle = pos.to(tl.float32)[:, None] * rate[None, :]
    if CHECKED:
        angle = tl.where(inside[:, None], angle, float("nan"))
    cos, sin = _cos_sin(angle, True)
    if (flag & 1) == 0:
        rows = pos[:, None] * D + c[None, :]
        cos, sin = _cos_sin(tl.load(tab_ptr + rows, mask=inside[:, None], other=float("nan")),
                            True)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    if BACKWARD:
        sin = -sin
    a = x_a.to(tl.float32)
    b = x_b.to(tl.float32)
    tl.store(x_ptr + off, tl.fma(a, cos, -(b * sin)).to(x_a.dtype), mask=mask)
    tl.store(x_ptr + off + HALF, tl.fma(b, cos, a * sin).to(x_a.dtype), mask=mask)


SWITCHES = ("WIDE", "STRIDED", "GRID3", "CHECKED")


def lean_rope_(x: torch.Tensor, table: torch.Tensor, flag: torch.Tensor, layout: str,
               tile: tuple[int, int], backward: bool = False, warps: int = 4,
               switches: tuple[str, ...] = ()) -> None:
    """Rotate the contiguous ``x`` ([n0, n1, h, d]) in place by the flagged angle table, with
    the shipped kernel's ``switches`` (of ``SWITCHES``) put back."""
    n0, dim1, heads, d = x.shape
    n_tokens = n0 * dim1
    block_t, block_h = tile
    blocks, groups = -(-n_tokens // block_t), -(-heads // block_h)
    grid = (groups, blocks, 1) if "GRID3" in switches else (blocks * groups,)
    lean_rope_kernel[grid](
        x, table, flag, n_tokens, dim1, *division_magic(dim1), heads, heads * d, d,
        table.shape[0], LAYOUT=0 if layout == "sbhd" else 1, HEADS=heads, D=d, BLOCK_T=block_t,
        BLOCK_H=block_h, BACKWARD=backward, num_warps=warps,
        **{name: name in switches for name in SWITCHES},
    )
