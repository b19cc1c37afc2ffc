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
def _token_index(tok, dim1, LAYOUT: tl.constexpr):
    """The two leading indices of int32 tokens numbered ``i0 * dim1 + i1`` (``i1 = 0`` for thd).

    Token counts and positions fit in int32 (the grid's axis 0 caps programs at 2**31 - 1);
    memory offsets are formed in int64 by the caller.
    """
    if LAYOUT == 2:
        i0 = tok
        i1 = tok * 0
    else:
        i0 = tok // dim1
        i1 = tok - i0 * dim1
    return i0, i1


# Reduction combiners of our own (tl.max/tl.min/tl.sum are library jit functions, which the
# interpreter cannot call from our kernels when triton was imported before TRITON_INTERPRET=1).
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _positions(
    tok, tok_mask, i0, i1, seq_len, table_len, cu_ptr, starts_ptr, n_seqs, cp_size, cp_rank,
    LAYOUT: tl.constexpr, HAS_STARTS: tl.constexpr, CONTEXT_PARALLEL: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
):
    """The table row of each token: its sequence's start position plus its position in the
    sequence (the zigzag position under context parallelism), as TransformerEngine 2.10+ adds them.

    For thd the sequence comes from cu_seqlens: with ``SEQ_BLOCK`` > 0 (at most that many
    offsets) from one load of all offsets, compared with every token at once (no chain of
    dependent loads; a sequence's first offset is the largest one not above the token), else by
    binary search.
    """
    if LAYOUT == 2:
        if SEQ_BLOCK > 0:
            j = tl.arange(0, SEQ_BLOCK)
            j_mask = j <= n_seqs
            bound = tl.load(cu_ptr + j, mask=j_mask, other=0).to(tl.int32) // cp_size
            bound = tl.where(j_mask, bound, 2147483647)
            before = bound[None, :] <= tok[:, None]
            first = tl.reduce(tl.where(before, bound[None, :], 0), 1, _maximum)
            if CONTEXT_PARALLEL:
                last = tl.reduce(tl.where(before, 2147483647, bound[None, :]), 1, _minimum)
                length = last - first
            else:
                length = first  # unused without context parallelism
            if HAS_STARTS:
                seq = tl.minimum(tl.reduce(before.to(tl.int32), 1, _add) - 1, n_seqs - 1)
            else:
                seq = first
        else:
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
            length = last - first
        local = tok - first
    else:
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
    return tl.minimum(tl.maximum(pos, 0), table_len - 1)  # never read outside the table


@triton.jit
def _chunk_rows(x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, BLOCK_H: tl.constexpr):
    """Row pointers ``[BLOCK_T, BLOCK_H]`` of head chunk ``it`` in x and out, and their mask.

    Recomputed where needed rather than carried through the head loop: loop-carried pointers
    lose the alignment facts that make 16-byte accesses possible.
    """
    hh = (head_lo + it * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    row_mask = tok_mask[:, None] & (hh < heads)[None, :]
    return x_row[:, None] + hh[None, :] * sxh, o_row[:, None] + hh[None, :] * soh, row_mask


@triton.jit
def _load_chunk(
    x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, sxd, c_mask, p_mask,
    ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Load head chunk ``it``: the rotated channels (two halves, or the whole interleaved tile
    twice) and the pass-through channels (written back by _rotate_store, not here: a store
    right after its load would stall the program for a full memory latency)."""
    x_h, o_h, row_mask = _chunk_rows(x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, BLOCK_H)
    mask = row_mask[:, :, None] & c_mask[None, None, :]
    x_ptrs = x_h[:, :, None] + (tl.arange(0, BLOCK_R).to(tl.int64) * sxd)[None, None, :]
    x_a = tl.load(x_ptrs, mask=mask, other=0.0)
    if INTERLEAVED:
        x_b = x_a
    else:
        x_b = tl.load(x_ptrs + (ROT_DIM // 2) * sxd, mask=mask, other=0.0)
    if PASS_DIM > 0:
        p = (tl.arange(0, BLOCK_P) + ROT_DIM).to(tl.int64)
        p_full = row_mask[:, :, None] & p_mask[None, None, :]
        kept = tl.load(x_h[:, :, None] + (p * sxd)[None, None, :], mask=p_full, other=0.0)
    else:
        kept = x_a
    return x_a, x_b, kept


@triton.jit
def _rotate_store(
    x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, sod, c_mask, p_mask,
    cos_a, cos_b, coef_a, coef_b, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """out_a = x_a cos_a + x_b coef_a, out_b = x_b cos_b + x_a coef_b in float32, stored;
    then the pass-through channels as they were read."""
    _, o_h, row_mask = _chunk_rows(x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, BLOCK_H)
    mask = row_mask[:, :, None] & c_mask[None, None, :]
    out_ty = o_row.dtype.element_ty
    o_ptrs = o_h[:, :, None] + (tl.arange(0, BLOCK_R).to(tl.int64) * sod)[None, None, :]
    if INTERLEAVED:
        a, b = tl.split(tl.reshape(x_a.to(tl.float32), [BLOCK_T, BLOCK_H, BLOCK_R // 2, 2]))
        out_a = a * cos_a + b * coef_a
        out_b = b * cos_b + a * coef_b
        out = tl.reshape(tl.join(out_a, out_b), [BLOCK_T, BLOCK_H, BLOCK_R])
        tl.store(o_ptrs, out.to(out_ty), mask=mask)
    else:
        a = x_a.to(tl.float32)
        b = x_b.to(tl.float32)
        tl.store(o_ptrs, (a * cos_a + b * coef_a).to(out_ty), mask=mask)
        tl.store(o_ptrs + (ROT_DIM // 2) * sod, (b * cos_b + a * coef_b).to(out_ty), mask=mask)
    if PASS_DIM > 0:
        p = (tl.arange(0, BLOCK_P) + ROT_DIM).to(tl.int64)
        p_full = row_mask[:, :, None] & p_mask[None, None, :]
        tl.store(o_h[:, :, None] + (p * sod)[None, None, :], kept.to(out_ty), mask=p_full)


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
    SEQ_BLOCK: tl.constexpr,
):
    """RoPE (or its transpose) of ``BLOCK_T`` tokens x ``HEAD_ITERS * BLOCK_H`` heads.

    ``x`` is ``[n0, n1, h, d]`` (``[T, h, d]`` for thd, with ``sx1 = 0``) with strides
    ``sx*``; ``out`` has strides ``so*``. Tokens are numbered ``i0 * dim1 + i1``.
    ``BLOCK_R`` covers the rotated channels (half of them for rotate-half), ``BLOCK_P`` the
    ``PASS_DIM`` pass-through channels.

    The first head chunk's loads are issued before the positions and the table are worked out
    (a thd binary search and a table row are dependent loads), and each later chunk is loaded
    before the previous one is rotated, so memory requests stay in flight.
    """
    pid = tl.program_id(0)
    head_groups = (heads + HEAD_ITERS * BLOCK_H - 1) // (HEAD_ITERS * BLOCK_H)
    token_block = pid // head_groups
    head_lo = (pid - token_block * head_groups) * (HEAD_ITERS * BLOCK_H)

    tok = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    i0, i1 = _token_index(tok, dim1, LAYOUT)
    x_row = x_ptr + (i0.to(tl.int64) * sx0 + i1.to(tl.int64) * sx1)
    o_row = out_ptr + (i0.to(tl.int64) * so0 + i1.to(tl.int64) * so1)

    c = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        c_mask = c < ROT_DIM
    else:
        c_mask = c < ROT_DIM // 2
    p_mask = tl.arange(0, BLOCK_P) < PASS_DIM

    x_a, x_b, kept = _load_chunk(
        x_row, o_row, tok_mask, head_lo, 0, heads, sxh, soh, sxd, c_mask, p_mask,
        ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P,
    )

    pos = _positions(
        tok, tok_mask, i0, i1, seq_len, table_len, cu_ptr, starts_ptr, n_seqs, cp_size, cp_rank,
        LAYOUT, HAS_STARTS, CONTEXT_PARALLEL, SEQ_BLOCK,
    )
    tab_off = pos.to(tl.int64)[:, None] * ROT_DIM + c[None, :]
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
    if BACKWARD:  # the transpose: each channel takes its partner's sine
        coef_a = sin_b
        coef_b = -sin_a
    else:
        coef_a = -sin_a
        coef_b = sin_b
    cos_a = cos_a[:, None, :]
    cos_b = cos_b[:, None, :]
    coef_a = coef_a[:, None, :]
    coef_b = coef_b[:, None, :]

    for it in range(HEAD_ITERS - 1):
        a_next, b_next, kept_next = _load_chunk(
            x_row, o_row, tok_mask, head_lo, it + 1, heads, sxh, soh, sxd, c_mask, p_mask,
            ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P,
        )
        _rotate_store(x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, sxh, soh, sod,
                      c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM, PASS_DIM,
                      INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P)
        x_a = a_next
        x_b = b_next
        kept = kept_next
    _rotate_store(x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, HEAD_ITERS - 1, heads, sxh, soh,
                  sod, c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM, PASS_DIM,
                  INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P)


INTERPRETED: bool = isinstance(rope_kernel, InterpretedFunction)
