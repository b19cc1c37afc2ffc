"""Triton kernels for RoPE: forward and its exact transpose, any layout, strides and features.

One kernel serves every case; the features are ``tl.constexpr`` so each combination compiles to
straight-line code. A program owns ``BLOCK_T`` tokens (grid axis 0 only, so no axis limit
applies) and ``HEAD_ITERS * BLOCK_H`` heads of them. It computes the table rows of its tokens
once (sin/cos from angles, or loads of a cos/sin cache), then loops over its heads, reading
each ``[BLOCK_T, BLOCK_H, d]`` tile once and writing it once: the rotated channels and the
pass-through channels of partial rotary in the same pass. Sin/cos live in the same 2-D layout as
the data tiles, so they are neither recomputed per head nor per thread.

Positions come from the token index alone: ``s`` (+ ``start_positions[b]``) for sbhd/bshd, the
context-parallel zigzag map when ``cp_size > 1``, and for thd a binary search of the token in
``cu_seqlens`` inside the kernel (no host sync, no ``max_seqlen x batch`` grid). Offsets are
int64. Math is float32 with one rounding to the output dtype.

The transpose (``BACKWARD``) uses each channel's partner sine: for rotate-half
``g1 c1 + g2 s2`` and ``g2 c2 - g1 s1``; for pairs ``ge ce + go so`` and ``go co - ge se``.

Imported only when triton is importable; with ``TRITON_INTERPRET=1`` set before the import, the
kernels run on the CPU interpreter (``INTERPRETED``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SBHD: int = 0
BSHD: int = 1
THD: int = 2

# 2*pi as a sum of three float32 numbers (Cody-Waite): reduces an angle to [-pi, pi] with an
# error near 1e-7 up to |angle| ~ 1e6, so the sin/cos that follow stay accurate for positions
# far beyond 2*pi, where float32 sin/cos hardware approximations lose precision.
_TWO_PI_A: tl.constexpr = tl.constexpr(6.28125)
_TWO_PI_B: tl.constexpr = tl.constexpr(0.0019353071693331003)
_TWO_PI_C: tl.constexpr = tl.constexpr(1.0253376273028358e-11)
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(angle, FAST_TRIG: tl.constexpr):
    """float32 cos and sin of float32 angles.

    The angle is first reduced to [-pi, pi] exactly enough (see _TWO_PI_*); there the GPU's
    ``cos.approx``/``sin.approx`` err by about 1e-6, far below float32 tolerance, and cost a
    fraction of libdevice's sinf/cosf (no call, no stack frame, few registers). The interpreter
    (``FAST_TRIG`` off) uses tl.cos/tl.sin.
    """
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    r = tl.fma(turns, -_TWO_PI_A, angle)
    r = tl.fma(turns, -_TWO_PI_B, r)
    r = tl.fma(turns, -_TWO_PI_C, r)
    if FAST_TRIG:
        cos = tl.inline_asm_elementwise(
            "cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        cos = tl.cos(r)
        sin = tl.sin(r)
    return cos, sin


@triton.jit
def _table(tab_ptr, sin_ptr, offsets, mask, USE_CACHE: tl.constexpr, FAST_TRIG: tl.constexpr):
    """cos and sin of the table entries at ``offsets``: cache loads or sin/cos of angles."""
    if USE_CACHE:
        cos = tl.load(tab_ptr + offsets, mask=mask, other=1.0)
        sin = tl.load(sin_ptr + offsets, mask=mask, other=0.0)
    else:
        cos, sin = _cos_sin(tl.load(tab_ptr + offsets, mask=mask, other=0.0), FAST_TRIG)
    return cos, sin


@triton.jit
def _token_rows(
    tok, tok_mask, dim1, seq_len, table_len, cu_ptr, starts_ptr, n_seqs, cp_size, cp_rank,
    LAYOUT: tl.constexpr, HAS_STARTS: tl.constexpr, CONTEXT_PARALLEL: tl.constexpr,
):
    """For int32 token indices (in output order): the two leading indices and the table row.

    Token counts and positions fit in int32 (the grid's axis 0 caps programs at 2**31 - 1);
    offsets into memory are formed in int64 by the caller.
    """
    if LAYOUT == 2:  # thd: find each token's sequence by binary search in cu_seqlens
        i0 = tok
        i1 = tok * 0
        lo = tok * 0
        hi = lo + n_seqs
        width = n_seqs
        while width > 1:  # invariant: cu[lo]/cp <= tok < cu[hi]/cp
            mid = (lo + hi) // 2
            go = tl.load(cu_ptr + mid, mask=tok_mask, other=0).to(tl.int32) // cp_size <= tok
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
            width = (width + 1) // 2
        seq = lo
        first = tl.load(cu_ptr + seq, mask=tok_mask, other=0).to(tl.int32) // cp_size
        last = tl.load(cu_ptr + seq + 1, mask=tok_mask, other=0).to(tl.int32) // cp_size
        local = tok - first
        length = last - first
    else:
        i0 = tok // dim1
        i1 = tok - i0 * dim1
        if LAYOUT == 0:
            local = i0
            seq = i1
        else:
            local = i1
            seq = i0
        length = local * 0 + seq_len
    if CONTEXT_PARALLEL:
        half = length // 2
        pos = tl.where(
            local < half, local + cp_rank * half, length * cp_size - (cp_rank + 1) * half + local - half
        )
    else:
        pos = local
        if HAS_STARTS:
            pos += tl.load(starts_ptr + seq, mask=tok_mask, other=0).to(tl.int32)
    pos = tl.minimum(tl.maximum(pos, 0), table_len - 1)  # never read outside the table
    return i0, i1, pos


@triton.jit(do_not_specialize=["n_tokens", "dim1", "seq_len", "table_len", "heads", "n_seqs"])
def rope_kernel(
    x_ptr, out_ptr, tab_ptr, sin_ptr, cu_ptr, starts_ptr,
    n_tokens, dim1, seq_len, table_len, heads, n_seqs, cp_size, cp_rank,
    sx0, sx1, sxh, sxd, so0, so1, soh, sod,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, HAS_STARTS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    """RoPE (or its transpose) of ``BLOCK_T`` tokens x ``HEAD_ITERS * BLOCK_H`` heads.

    ``x`` is ``[n0, n1, h, d]`` (``[T, h, d]`` for thd, with ``sx1 = 0``) with strides
    ``sx*``; ``out`` has strides ``so*``. Tokens are numbered ``i0 * dim1 + i1``.
    ``BLOCK_R`` covers the rotated channels (half of them for rotate-half), ``BLOCK_P`` the
    ``PASS_DIM`` pass-through channels.
    """
    pid = tl.program_id(0)
    head_groups = (heads + HEAD_ITERS * BLOCK_H - 1) // (HEAD_ITERS * BLOCK_H)
    token_block = pid // head_groups
    head_lo = (pid - token_block * head_groups) * (HEAD_ITERS * BLOCK_H)

    tok = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    i0, i1, pos = _token_rows(
        tok, tok_mask, dim1, seq_len, table_len, cu_ptr, starts_ptr, n_seqs, cp_size, cp_rank,
        LAYOUT, HAS_STARTS, CONTEXT_PARALLEL,
    )
    x_row = x_ptr + (i0.to(tl.int64) * sx0 + i1.to(tl.int64) * sx1)
    o_row = out_ptr + (i0.to(tl.int64) * so0 + i1.to(tl.int64) * so1)
    out_ty = out_ptr.dtype.element_ty
    t_row = pos.to(tl.int64) * ROT_DIM

    c = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        c_mask = c < ROT_DIM
    else:
        c_mask = c < ROT_DIM // 2
    tab_off = t_row[:, None] + c[None, :]
    tab_mask = tok_mask[:, None] & c_mask[None, :]
    if INTERLEAVED:
        cos, sin = _table(tab_ptr, sin_ptr, tab_off, tab_mask, USE_CACHE, FAST_TRIG)
        cos_a, cos_b = tl.split(tl.reshape(cos, [BLOCK_T, BLOCK_R // 2, 2]))
        sin_a, sin_b = tl.split(tl.reshape(sin, [BLOCK_T, BLOCK_R // 2, 2]))
    else:
        cos_a, sin_a = _table(tab_ptr, sin_ptr, tab_off, tab_mask, USE_CACHE, FAST_TRIG)
        cos_b, sin_b = _table(
            tab_ptr, sin_ptr, tab_off + ROT_DIM // 2, tab_mask, USE_CACHE, FAST_TRIG
        )
    # out_a = x_a cos_a + x_b * coef_a, out_b = x_b cos_b + x_a * coef_b
    if BACKWARD:
        coef_a = sin_b
        coef_b = -sin_a
    else:
        coef_a = -sin_a
        coef_b = sin_b
    cos_a = cos_a[:, None, :]
    cos_b = cos_b[:, None, :]
    coef_a = coef_a[:, None, :]
    coef_b = coef_b[:, None, :]

    cx = c.to(tl.int64) * sxd
    co = c.to(tl.int64) * sod
    if PASS_DIM > 0:
        p = tl.arange(0, BLOCK_P)
        p_mask = p < PASS_DIM
        px = (p + ROT_DIM).to(tl.int64) * sxd
        po = (p + ROT_DIM).to(tl.int64) * sod

    for it in range(HEAD_ITERS):
        hh = (head_lo + it * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        row_mask = tok_mask[:, None] & (hh < heads)[None, :]
        x_h = x_row[:, None] + hh[None, :] * sxh
        o_h = o_row[:, None] + hh[None, :] * soh
        mask = row_mask[:, :, None] & c_mask[None, None, :]
        if INTERLEAVED:
            x = tl.load(x_h[:, :, None] + cx[None, None, :], mask=mask, other=0.0).to(tl.float32)
            x_a, x_b = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_R // 2, 2]))
            out_a = x_a * cos_a + x_b * coef_a
            out_b = x_b * cos_b + x_a * coef_b
            out = tl.reshape(tl.join(out_a, out_b), [BLOCK_T, BLOCK_H, BLOCK_R])
            tl.store(o_h[:, :, None] + co[None, None, :], out.to(out_ty), mask=mask)
        else:
            x_ptrs = x_h[:, :, None] + cx[None, None, :]
            x_a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            x_b = tl.load(x_ptrs + (ROT_DIM // 2) * sxd, mask=mask, other=0.0).to(tl.float32)
            out_a = x_a * cos_a + x_b * coef_a
            out_b = x_b * cos_b + x_a * coef_b
            o_ptrs = o_h[:, :, None] + co[None, None, :]
            tl.store(o_ptrs, out_a.to(out_ty), mask=mask)
            tl.store(o_ptrs + (ROT_DIM // 2) * sod, out_b.to(out_ty), mask=mask)
        if PASS_DIM > 0:
            p_full = row_mask[:, :, None] & p_mask[None, None, :]
            kept = tl.load(x_h[:, :, None] + px[None, None, :], mask=p_full, other=0.0)
            tl.store(o_h[:, :, None] + po[None, None, :], kept.to(out_ty), mask=p_full)


INTERPRETED: bool = isinstance(rope_kernel, InterpretedFunction)
