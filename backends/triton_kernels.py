"""Triton kernels for RoPE: forward and its exact transpose, any layout, strides and features.

One kernel (``rope_kernel``) serves every case; the features are ``tl.constexpr`` so each
combination compiles to straight-line code. Small calls on contiguous sbhd/bshd tensors take
``rope_lean_kernel``, the same arithmetic with fewer instructions ahead of its loads (see
there); packed qkv takes ``rope_qkv_kernel``; a launch with a norm stage takes
``rope_norm_kernel`` (backends/triton_norm_kernels.py, from the building blocks here). A program owns ``BLOCK_T`` tokens (its token
block, on grid axes 1 and 2, so no axis limit applies) and ``HEAD_ITERS * BLOCK_H`` heads of
them (its head group, grid axis 0).
No division by a runtime value comes before a program's first load (see :func:`_token_block`,
:func:`_token_index`): at decode size a kernel's time is its chain of dependent steps. It
computes the table rows of its tokens once (sin/cos from angles, or loads of a cos/sin cache),
then loops over its heads, reading each ``[BLOCK_T, BLOCK_H, d]`` tile once and writing it
once: the rotated channels and the pass-through channels of partial rotary in the same pass.
Sin/cos live in the same 2-D layout as the data tiles, so they are neither recomputed per head
nor per thread.

A rate table (``RATES``) gives the rates instead of a table: pair ``k``'s angle is the float32
product ``position * rate[k]``, as an angle table's entry is, so no table row is read per
token. A precise rate table gives each rate as its fraction of a turn (int64 fixed point): its
angle is the exact product modulo 2*pi, from integer products (``triton_trig.py``).
An angle table whose every row ``p`` is ``float32(p) * row 1`` bit for bit (``LINEAR``:
what a model's ``outer(arange, inv_freq)`` makes, found by ``linear_table_kernel`` and kept in
an int32 flag on the device) is read the same way, from row 1, while its flag says so.

Positions come from the token index alone: ``s`` (+ ``start_positions[b]``) for sbhd/bshd, the
context-parallel zigzag map when ``cp_size > 1``, and for thd a binary search of the token in
``cu_seqlens`` inside the kernel (no host sync, no ``max_seqlen x batch`` grid). A position
outside the table (index values the host never read) reads no memory and makes the token's
rotated channels NaN. Offsets are int64. Math is float32 with one rounding to the output dtype.

The transpose (``BACKWARD``) uses each channel's partner sine: for rotate-half
``g1 c1 + g2 s2`` and ``g2 c2 - g1 s1``; for pairs ``ge ce + go so`` and ``go co - ge se``.

Imported only when triton is importable; with ``TRITON_INTERPRET=1`` set before the import, the
kernels run on the CPU interpreter (``INTERPRETED``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_cache_kernels import _cache_rows, _divided
from .triton_channels import PAIRS_IN, PAIRS_OUT, pair_channels, pass_channels, rotary_channels
from .triton_trig import _cos_sin, _rate_cos_sin
from triton.runtime.interpreter import InterpretedFunction

SBHD: int = 0
BSHD: int = 1
THD: int = 2

FP8_RUN: tl.constexpr = tl.constexpr(8)
"""Channels an FP8 store is told run together (``tl.max_contiguous``): its stores then take 8
channels a thread, as the 16-bit loads and stores beside them in the kernel do. Left to itself
the compiler gave every tile of the kernel 16 a thread for the FP8 stores and turned each
16-bit store's tile around in shared memory."""

@triton.jit
def _table(tab_ptr, sin_ptr, offsets, mask, USE_CACHE: tl.constexpr, FAST_TRIG: tl.constexpr):
    """cos and sin of the table entries at ``offsets``: cache loads or sin/cos of angles. Where
    ``mask`` is off (a position outside the table, or padding) both are NaN, so a row whose
    position is out of range comes out NaN rather than rotated by a plausible angle."""
    if USE_CACHE:  # float32, or a model dtype widened here
        cos = tl.load(tab_ptr + offsets, mask=mask, other=float("nan")).to(tl.float32)
        sin = tl.load(sin_ptr + offsets, mask=mask, other=float("nan")).to(tl.float32)
    else:
        cos, sin = _cos_sin(tl.load(tab_ptr + offsets, mask=mask, other=float("nan")), FAST_TRIG)
    return cos, sin


@triton.jit
def _packed(cos, sin):
    """``cos`` and ``sin`` (float32) as one uint64 tensor, cos in the high word: moved between
    layouts as one, a row's sines cross shared memory in one store, one barrier and one load.
    Converted apart, each took its own round (three barriers in all at 8 heads of d 128)."""
    high = cos.to(tl.uint32, bitcast=True).to(tl.uint64) << 32
    return high | sin.to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _unpacked(both):
    """:func:`_packed`'s ``(cos, sin)``, the same bits."""
    cos = (both >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return cos, both.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _row_cos_sin(
    tab_ptr, sin_ptr, row, inside, c, c_mask, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    USE_CACHE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    FAST_TRIG: tl.constexpr, SHARED: tl.constexpr, flag_ptr, HALVES: tl.constexpr,
):
    """cos and sin of each channel of the tokens' table rows ``row`` (angles or a cos/sin
    cache), as the two channels of each pair see them: ``(cos_a, sin_a, cos_b, sin_b)``.

    ``SHARED`` (rotate-half): both halves of a row are one tensor of ``BLOCK_T x 2 BLOCK_R``
    while they are read (and their sines computed), so each of the program's threads takes a
    few of them and the halves reach the heads' threads through shared memory, cos and sin
    packed (:func:`_packed`): one store, one barrier, one load. Taken half by half, each
    thread computes the sines of its own channels, once per head of the tile (16 MUFU a thread
    at 8 heads of d 128 on four warps, against 2 this way), and a tile of several tokens and
    heads moves cos and sin of both halves between layouts apart (seven barriers). Interleaved
    rows take the shared form anyway (their pairs are split after the sines).

    ``HALVES`` (a rotate-half cos/sin cache, not ``SHARED``): ``flag_ptr`` is the cache's int32
    halves flag (:func:`halves_table_kernel`); while it is set each row's second halves equal its
    first, which alone are read."""
    tab_off = row[:, None] * ROT_DIM + c[None, :]
    tab_mask = inside[:, None] & c_mask[None, :]
    if SHARED and not INTERLEAVED:
        w = tl.arange(0, 2 * BLOCK_R)  # channel w % BLOCK_R of half w // BLOCK_R
        w_off = row[:, None] * ROT_DIM + (w // BLOCK_R * (ROT_DIM // 2) + w % BLOCK_R)[None, :]
        w_mask = inside[:, None] & ((w % BLOCK_R) < ROT_DIM // 2)[None, :]
        both = _packed(*_table(tab_ptr, sin_ptr, w_off, w_mask, USE_CACHE, FAST_TRIG))
        half_a, half_b = tl.split(tl.permute(tl.reshape(both, [BLOCK_T, 2, BLOCK_R]), [0, 2, 1]))
        cos_a, sin_a = _unpacked(half_a)
        cos_b, sin_b = _unpacked(half_b)
    elif INTERLEAVED:
        both = _packed(*_table(tab_ptr, sin_ptr, tab_off, tab_mask, USE_CACHE, FAST_TRIG))
        pair_a, pair_b = tl.split(tl.reshape(both, [BLOCK_T, BLOCK_R // 2, 2]))
        cos_a, sin_a = _unpacked(pair_a)
        cos_b, sin_b = _unpacked(pair_b)
    elif HALVES:
        flag = tl.load(flag_ptr)
        cos_a, sin_a = _table(tab_ptr, sin_ptr, tab_off, tab_mask, USE_CACHE, FAST_TRIG)
        cos_b = cos_a
        sin_b = sin_a
        if flag == 0:  # the halves differ somewhere: the second halves too
            cos_b, sin_b = _table(
                tab_ptr, sin_ptr, tab_off + ROT_DIM // 2, tab_mask, USE_CACHE, FAST_TRIG
            )
    else:
        cos_a, sin_a = _table(tab_ptr, sin_ptr, tab_off, tab_mask, USE_CACHE, FAST_TRIG)
        cos_b, sin_b = _table(
            tab_ptr, sin_ptr, tab_off + ROT_DIM // 2, tab_mask, USE_CACHE, FAST_TRIG
        )
    return cos_a, sin_a, cos_b, sin_b


@triton.jit
def _token_index(tok, dim1, LAYOUT: tl.constexpr):
    """The two leading indices of int32 tokens numbered ``i0 * dim1 + i1`` (``i1 = 0`` for thd).
    Token counts and positions fit in int32; memory offsets are formed in int64 by the caller."""
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


BY_INDEX: tl.constexpr = tl.constexpr(0)  # a token's place in its sequence (zigzag under CP)
STARTS: tl.constexpr = tl.constexpr(1)  # plus its sequence's start, from pos_ptr [sequences]
PER_TOKEN: tl.constexpr = tl.constexpr(2)  # given per token, pos_ptr [tokens] in token order


@triton.jit
def _per_rank(offsets, cp_size, CONTEXT_PARALLEL: tl.constexpr):
    """cu_seqlens offsets divided by ``cp_size`` under context parallelism (this rank's share),
    unchanged otherwise: a division in the chain of a thd binary search's dependent loads would
    cost every step."""
    if CONTEXT_PARALLEL:
        offsets = offsets // cp_size
    return offsets


@triton.jit
def _positions(
    tok, tok_mask, i0, i1, seq_len, table_len, cu_ptr, pos_ptr, n_seqs, cp_size, cp_rank,
    LAYOUT: tl.constexpr, POSITIONS: tl.constexpr, CONTEXT_PARALLEL: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
):
    """The table row of each token: given per token (``PER_TOKEN``), or its sequence's start
    position (``STARTS``) plus its position in the sequence (the zigzag position under context
    parallelism), as TransformerEngine 2.10+ adds them.

    For thd the sequence comes from cu_seqlens: with ``SEQ_BLOCK`` > 0 (at most that many
    offsets) from one load of all offsets, compared with every token at once (no chain of
    dependent loads; a sequence's first offset is the largest one not above the token), else by
    binary search.
    """
    if POSITIONS == PER_TOKEN:  # tokens are numbered in the positions tensor's order
        pos = tl.load(pos_ptr + tok, mask=tok_mask, other=-1)
    else:
        if LAYOUT == 2:
            if SEQ_BLOCK > 0:
                j = tl.arange(0, SEQ_BLOCK)
                j_mask = j <= n_seqs
                bound = _per_rank(tl.load(cu_ptr + j, mask=j_mask, other=0).to(tl.int32),
                                  cp_size, CONTEXT_PARALLEL)
                bound = tl.where(j_mask, bound, 2147483647)
                before = bound[None, :] <= tok[:, None]
                first = tl.reduce(tl.where(before, bound[None, :], 0), 1, _maximum)
                if CONTEXT_PARALLEL:
                    last = tl.reduce(tl.where(before, 2147483647, bound[None, :]), 1, _minimum)
                    length = last - first
                else:
                    length = first  # unused without context parallelism
                if POSITIONS == STARTS:
                    seq = tl.minimum(tl.reduce(before.to(tl.int32), 1, _add) - 1, n_seqs - 1)
                else:
                    seq = first
            else:
                lo = tok * 0
                hi = lo + n_seqs
                width = n_seqs
                while width > 1:  # invariant: cu[lo]/cp <= tok < cu[hi]/cp
                    mid = (lo + hi) // 2
                    go = _per_rank(tl.load(cu_ptr + mid, mask=tok_mask, other=0).to(tl.int32),
                                   cp_size, CONTEXT_PARALLEL) <= tok
                    lo = tl.where(go, mid, lo)
                    hi = tl.where(go, hi, mid)
                    width = (width + 1) // 2
                seq = lo
                first = _per_rank(tl.load(cu_ptr + seq, mask=tok_mask, other=0).to(tl.int32),
                                  cp_size, CONTEXT_PARALLEL)
                last = _per_rank(tl.load(cu_ptr + seq + 1, mask=tok_mask, other=0).to(tl.int32),
                                 cp_size, CONTEXT_PARALLEL)
                length = last - first
            local = tok - first
            past = tok >= _per_rank(tl.load(cu_ptr + n_seqs).to(tl.int32), cp_size,
                                    CONTEXT_PARALLEL)  # in no sequence
        else:
            if LAYOUT == 0:
                local = i0
                seq = i1
            else:
                local = i1
                seq = i0
            length = local * 0 + seq_len
            past = tok < 0
        if CONTEXT_PARALLEL:
            half = length // 2
            pos = tl.where(
                local < half, local + cp_rank * half, length * cp_size - (cp_rank + 1) * half + local - half
            )
        else:
            pos = local
        if POSITIONS == STARTS:  # in the index tensor's dtype: an int64 start is never narrowed
            start = tl.load(pos_ptr + seq, mask=tok_mask, other=0)
            if table_len.dtype != tl.int32:  # rows past 2^31 (a RateTable): an int32 start plus
                start = start.to(tl.int64)  # the place may pass 2^31, still inside the table
            pos += start
        pos = tl.where(past, -1, pos)  # outside the table: such a token's rows come out NaN
    return pos


@triton.jit
def _head_offsets(hh, group, s_group, s_head, GROUPED: tl.constexpr):
    """Memory offsets (int64) of heads ``hh``. In a packed qkv row heads come in groups: head
    ``g * group + j`` lies at ``g * s_group + j * s_head``; otherwise at ``hh * s_head``."""
    if GROUPED:
        g = hh // group
        offsets = g * s_group + (hh - g * group) * s_head
    else:
        offsets = hh * s_head
    return offsets


@triton.jit
def _chunk_rows(
    x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh,
    BLOCK_H: tl.constexpr, GROUPED: tl.constexpr,
):
    """Row pointers ``[BLOCK_T, BLOCK_H]`` of head chunk ``it`` in x and out, and their mask.

    Recomputed where needed rather than carried through the head loop: loop-carried pointers
    lose the alignment facts that make 16-byte accesses possible.
    """
    hh = (head_lo + it * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    row_mask = tok_mask[:, None] & (hh < heads)[None, :]
    x_h = x_row[:, None] + _head_offsets(hh, group, sxg, sxh, GROUPED)[None, :]
    o_h = o_row[:, None] + _head_offsets(hh, group, sog, soh, GROUPED)[None, :]
    return x_h, o_h, row_mask


@triton.jit
def _load_chunk(
    x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, sxd, c_mask, p_mask,
    ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, GROUPED: tl.constexpr,
    ROT_OFFSET: tl.constexpr = 0, DEINTERLEAVE: tl.constexpr = 0,
):
    """Load head chunk ``it``: the rotated channels (two halves, or the whole interleaved tile
    twice) and the pass-through channels (written back by _rotate_store, not here: a store
    right after its load would stall the program for a full memory latency). Channels where
    backends/triton_channels.py puts them (an offset, pairs read as halves)."""
    x_h, o_h, row_mask = _chunk_rows(
        x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, BLOCK_H, GROUPED
    )
    mask = row_mask[:, :, None] & c_mask[None, None, :]
    if DEINTERLEAVE == PAIRS_IN:  # the pairs read as one run of channels, then split
        w = pair_channels(BLOCK_R, ROT_OFFSET)
        pairs = tl.load(x_h[:, :, None] + (w * sxd)[None, None, :], other=0.0,
                        mask=row_mask[:, :, None] & (w < ROT_OFFSET + ROT_DIM)[None, None, :])
        x_a, x_b = tl.split(tl.reshape(pairs, [x_h.shape[0], BLOCK_H, BLOCK_R, 2]))
    else:
        ch_a, ch_b = rotary_channels(BLOCK_R, ROT_DIM, ROT_OFFSET)
        x_a = tl.load(x_h[:, :, None] + (ch_a * sxd)[None, None, :], mask=mask, other=0.0)
        if INTERLEAVED:
            x_b = x_a
        else:
            x_b = tl.load(x_h[:, :, None] + (ch_b * sxd)[None, None, :], mask=mask, other=0.0)
    if PASS_DIM > 0:
        p = pass_channels(BLOCK_P, ROT_DIM, ROT_OFFSET)
        p_full = row_mask[:, :, None] & p_mask[None, None, :]
        kept = tl.load(x_h[:, :, None] + (p * sxd)[None, None, :], mask=p_full, other=0.0)
    else:
        kept = x_a
    return x_a, x_b, kept


@triton.jit
def _rounded(x, out_ty: tl.constexpr):
    """``x`` rounded once to ``out_ty``, to nearest even as the GPU converts. The CPU
    interpreter's float32 to bfloat16 conversion truncates: there the float32 bits are rounded
    to bfloat16's first (a NaN made the quiet NaN), so its conversion of them is exact (float32
    subnormals aside, which it flushes)."""
    if _INTERPRETER and out_ty == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), float("nan"))
    return x.to(out_ty)


@triton.jit
def _store_chunk(
    out_a, out_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh,
    sod, c_mask, p_mask, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, GROUPED: tl.constexpr, scale=1.0, QUANT: tl.constexpr = False,
    ROT_OFFSET: tl.constexpr = 0, DEINTERLEAVE: tl.constexpr = 0,
):
    """Store head chunk ``it``'s rotary channels (two halves, or the whole interleaved tile as
    ``out_a``) and its pass-through channels, each rounded once to the output's dtype.
    ``QUANT`` (an FP8 output): each value divided by ``scale`` first, as IEEE division rounds
    it for the cast (:func:`_divided`; ``/`` is an approximate division on the GPU), then cast."""
    _, o_h, row_mask = _chunk_rows(
        x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, BLOCK_H, GROUPED
    )
    mask = row_mask[:, :, None] & c_mask[None, None, :]
    out_ty = o_row.dtype.element_ty
    if QUANT:
        out_a = _divided(out_a, scale)
        if not INTERLEAVED:
            out_b = _divided(out_b, scale)
        if PASS_DIM > 0:
            kept = _divided(kept, scale)
    # FP8 (QUANT): each store told its channels run 8 at a time (FP8_RUN, docs/tuning.md),
    # here beside the store: set in a helper that returns the pointers, the hint was lost
    if DEINTERLEAVE == PAIRS_OUT:  # the pairs joined and written as one run of channels
        w = pair_channels(BLOCK_R, ROT_OFFSET)
        pairs = tl.reshape(tl.join(out_a, out_b), [o_h.shape[0], BLOCK_H, 2 * BLOCK_R])
        to_pairs = o_h[:, :, None] + (w * sod)[None, None, :]
        if QUANT and 2 * BLOCK_R > FP8_RUN:
            to_pairs = tl.max_contiguous(to_pairs, [1, 1, FP8_RUN])
        tl.store(to_pairs, _rounded(pairs, out_ty),
                 mask=row_mask[:, :, None] & (w < ROT_OFFSET + ROT_DIM)[None, None, :])
    else:
        ch_a, ch_b = rotary_channels(BLOCK_R, ROT_DIM, ROT_OFFSET)
        to_a = o_h[:, :, None] + (ch_a * sod)[None, None, :]
        if QUANT and BLOCK_R > FP8_RUN:
            to_a = tl.max_contiguous(to_a, [1, 1, FP8_RUN])
        tl.store(to_a, _rounded(out_a, out_ty), mask=mask)
        if not INTERLEAVED:
            to_b = o_h[:, :, None] + (ch_b * sod)[None, None, :]
            if QUANT and BLOCK_R > FP8_RUN:
                to_b = tl.max_contiguous(to_b, [1, 1, FP8_RUN])
            tl.store(to_b, _rounded(out_b, out_ty), mask=mask)
    if PASS_DIM > 0:
        p = pass_channels(BLOCK_P, ROT_DIM, ROT_OFFSET)
        p_full = row_mask[:, :, None] & p_mask[None, None, :]
        to_p = o_h[:, :, None] + (p * sod)[None, None, :]
        if QUANT and BLOCK_P > FP8_RUN:
            to_p = tl.max_contiguous(to_p, [1, 1, FP8_RUN])
        tl.store(to_p, _rounded(kept, out_ty), mask=p_full)


@triton.jit
def _rotate_store(
    x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, sod,
    c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, GROUPED: tl.constexpr, scale=1.0,
    QUANT: tl.constexpr = False, ROT_OFFSET: tl.constexpr = 0, DEINTERLEAVE: tl.constexpr = 0,
):
    """Store the chunk rotated (:func:`_rotated`), then its pass-through channels as they
    were read (``QUANT``: divided by ``scale``, :func:`_store_chunk`)."""
    out_a, out_b = _rotated(x_a, x_b, cos_a, cos_b, coef_a, coef_b, INTERLEAVED, BLOCK_T,
                            BLOCK_H, BLOCK_R)
    _store_chunk(out_a, out_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh,
                 sog, soh, sod, c_mask, p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R,
                 BLOCK_P, GROUPED, scale, QUANT, ROT_OFFSET, DEINTERLEAVE)


@triton.jit
def _token_block():
    """This program's token block, from grid axes 1 and 2 (the launcher spreads the blocks over
    both when they pass axis 1's 65,535). Axis 0 is the token block's head group, so a token
    block's programs are neighbours and no division by a runtime count precedes the first load."""
    return tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)


@triton.jit
def _nth_token_block(block, n):
    """The ``n``-th of the token blocks a program of first block ``block`` takes in turn: every
    ``P``-th (``P`` the programs along the token axes), so the programs of one wave work on
    neighbouring blocks."""
    return n * (tl.num_programs(1) * tl.num_programs(2)) + block


@triton.jit
def _token_rows(
    token_block, head_group, x_ptr, out_ptr, n_tokens, dim1,
    sx0, sx1, so0, so1,
    LAYOUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
):
    """The tokens of ``token_block`` (``BLOCK_T`` of them, numbered ``i0 * dim1 + i1``), their
    row pointers in x and out, and the first of the ``HEAD_ITERS * BLOCK_H`` heads of
    ``head_group``."""
    head_lo = head_group * (HEAD_ITERS * BLOCK_H)
    tok = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    i0, i1 = _token_index(tok, dim1, LAYOUT)
    x_row = x_ptr + (i0.to(tl.int64) * sx0 + i1.to(tl.int64) * sx1)
    o_row = out_ptr + (i0.to(tl.int64) * so0 + i1.to(tl.int64) * so1)
    return tok, tok_mask, i0, i1, x_row, o_row, head_lo


@triton.jit
def _coefficients(
    tab_ptr, sin_ptr, pos, row, inside, c, c_mask, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, FAST_TRIG: tl.constexpr, SCALE: tl.constexpr, SHARED: tl.constexpr,
    flag_ptr, HALVES: tl.constexpr,
):
    """The rotation's ``(cos_a, cos_b, coef_a, coef_b)`` at the tokens' positions ``pos``
    (``row``: the same, in the type the table's offsets are formed in), ``[BLOCK_T, 1,
    BLOCK_R]``, for :func:`_rotated`: from the table kind's cos and sin, each channel's sine
    its own (forward) or its partner's (``BACKWARD``), all times ``SCALE``. Tokens off
    ``inside`` read no table memory and get NaN. ``SHARED``: table rows as
    :func:`_row_cos_sin` shares them; ``HALVES``: a cos/sin cache's halves flag at ``flag_ptr``
    (the same)."""
    if LINEAR:  # an angle table: rated while its flag holds this pairing's bit
        # row 1 is read with the flag, not after it: two DRAM round trips in a row were
        # 0.2-0.4 us of a 2-4 us call after an L2 flush (run AF)
        flag = tl.load(sin_ptr)
        cos_a, sin_a, cos_b, sin_b = _rate_cos_sin(
            tab_ptr + ROT_DIM, 2 if INTERLEAVED else 1, pos, inside, c, ROT_DIM, INTERLEAVED,
            BLOCK_R, FAST_TRIG,
        )
        if (flag & (2 if INTERLEAVED else 1)) == 0:  # not linear: the rows
            cos_a, sin_a, cos_b, sin_b = _row_cos_sin(
                tab_ptr, sin_ptr, row, inside, c, c_mask, ROT_DIM, INTERLEAVED, USE_CACHE,
                BLOCK_T, BLOCK_R, FAST_TRIG, SHARED, sin_ptr, False,
            )
    elif RATES:  # a rate table's rates: pair k's angle is one float32 product, position x rate k
        cos_a, sin_a, cos_b, sin_b = _rate_cos_sin(
            tab_ptr, 1, pos, inside, c, ROT_DIM, INTERLEAVED, BLOCK_R, FAST_TRIG,
        )
    elif PAIRED:  # one cos and one sin per rotated pair, shared by both of its channels
        k = tl.arange(0, BLOCK_R // 2) if INTERLEAVED else c
        k_mask = inside[:, None] & (k < ROT_DIM // 2)[None, :]
        cos_a, sin_a = _table(tab_ptr, sin_ptr, row[:, None] * ROT_DIM + k[None, :], k_mask,
                              USE_CACHE, FAST_TRIG)
        cos_b = cos_a
        sin_b = sin_a
    else:
        cos_a, sin_a, cos_b, sin_b = _row_cos_sin(
            tab_ptr, sin_ptr, row, inside, c, c_mask, ROT_DIM, INTERLEAVED, USE_CACHE, BLOCK_T,
            BLOCK_R, FAST_TRIG, SHARED, flag_ptr, HALVES,
        )
    # negated as a product: Triton's unary minus is ``0 - x``, which makes +0 of a zero sine
    # (angle 0) and so a +0 output where the formula's ``-x sin`` gives -0 (eager's, TE's)
    if BACKWARD:  # the transpose: each channel takes its partner's sine
        coef_a = sin_b
        coef_b = sin_a * -1.0
    else:
        coef_a = sin_a * -1.0
        coef_b = sin_b
    if SCALE != 1.0:  # the spec's cos_sin_scale (an attention factor) on cos and sin alike
        cos_a = cos_a * SCALE
        cos_b = cos_b * SCALE
        coef_a = coef_a * SCALE
        coef_b = coef_b * SCALE
    return cos_a[:, None, :], cos_b[:, None, :], coef_a[:, None, :], coef_b[:, None, :]


@triton.jit
def _rotated(x_a, x_b, cos_a, cos_b, coef_a, coef_b, INTERLEAVED: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """``(out_a, out_b)``: ``x_a cos_a + x_b coef_a`` and ``x_b cos_b + x_a coef_b`` in
    float32, or for interleaved pairs (``x_a`` the whole tile) the tile rotated, as
    ``out_a``. The fused multiply-adds are written out, so every kernel and specialisation
    (in place or not, any tile) rounds alike: left to the compiler, the contraction could
    differ between them and with it the last bit."""
    if INTERLEAVED:
        a, b = tl.split(tl.reshape(x_a.to(tl.float32), [BLOCK_T, BLOCK_H, BLOCK_R // 2, 2]))
        out_a = tl.reshape(
            tl.join(tl.fma(a, cos_a, b * coef_a), tl.fma(b, cos_b, a * coef_b)),
            [BLOCK_T, BLOCK_H, BLOCK_R],
        )
        out_b = out_a
    else:
        a = x_a.to(tl.float32)
        b = x_b.to(tl.float32)
        out_a = tl.fma(a, cos_a, b * coef_a)
        out_b = tl.fma(b, cos_b, a * coef_b)
    return out_a, out_b


@triton.jit
def _rope_program(
    token_block, head_group, x_ptr, out_ptr, tab_ptr, sin_ptr, cu_ptr, pos_ptr,
    n_tokens, dim1, seq_len, table_len, heads, group, n_seqs, cp_size,
    cp_rank, sx0, sx1, sxg, sxh, sxd, so0, so1, sog, soh, sod,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, GROUPED: tl.constexpr, SCALE: tl.constexpr,
    SHARED_ROWS: tl.constexpr, HALVES: tl.constexpr, ROT_OFFSET: tl.constexpr,
    DEINTERLEAVE: tl.constexpr,
):
    """RoPE (or its transpose) of ``token_block``'s ``BLOCK_T`` tokens x ``head_group``'s
    ``HEAD_ITERS * BLOCK_H`` heads: the body of both kernels below. ``SHARED_ROWS``: table
    rows read once for the tile's heads (:func:`_row_cos_sin`'s ``SHARED``). ``HALVES``: on
    sbhd and bshd, ``cu_ptr`` is a rotate-half cos/sin cache's halves flag
    (:func:`_row_cos_sin`).

    The first head chunk's loads are issued before the positions and the table are worked out
    (a thd binary search and a table row are dependent loads), and each later chunk is loaded
    before the previous one is rotated, so memory requests stay in flight.
    """
    tok, tok_mask, i0, i1, x_row, o_row, head_lo = _token_rows(
        token_block, head_group, x_ptr, out_ptr, n_tokens, dim1,
        sx0, sx1, so0, so1, LAYOUT, BLOCK_T, BLOCK_H, HEAD_ITERS,
    )
    c = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        c_mask = c < ROT_DIM
    else:
        c_mask = c < ROT_DIM // 2
    p_mask = tl.arange(0, BLOCK_P) < PASS_DIM

    x_a, x_b, kept = _load_chunk(
        x_row, o_row, tok_mask, head_lo, 0, heads, group, sxg, sxh, sog, soh, sxd, c_mask,
        p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED, ROT_OFFSET,
        DEINTERLEAVE,
    )

    pos = _positions(
        tok, tok_mask, i0, i1, seq_len, table_len, cu_ptr, pos_ptr, n_seqs, cp_size, cp_rank,
        LAYOUT, POSITIONS, CONTEXT_PARALLEL, SEQ_BLOCK,
    )
    inside = tok_mask & (pos >= 0) & (pos < table_len)  # never read outside the table
    cos_a, cos_b, coef_a, coef_b = _coefficients(
        tab_ptr, sin_ptr, pos, pos.to(tl.int64), inside, c, c_mask, ROT_DIM, INTERLEAVED,
        USE_CACHE, PAIRED, RATES, LINEAR, BACKWARD, BLOCK_T, BLOCK_R, FAST_TRIG, SCALE,
        SHARED_ROWS, cu_ptr, HALVES,
    )

    for it in range(HEAD_ITERS - 1):
        a_next, b_next, kept_next = _load_chunk(
            x_row, o_row, tok_mask, head_lo, it + 1, heads, group, sxg, sxh, sog, soh, sxd,
            c_mask, p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED,
            ROT_OFFSET, DEINTERLEAVE,
        )
        _rotate_store(x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, it, heads, group, sxg,
                      sxh, sog, soh, sod, c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM,
                      PASS_DIM, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED, 1.0,
                      False, ROT_OFFSET, DEINTERLEAVE)
        x_a = a_next
        x_b = b_next
        kept = kept_next
    _rotate_store(x_a, x_b, kept, x_row, o_row, tok_mask, head_lo, HEAD_ITERS - 1, heads, group,
                  sxg, sxh, sog, soh, sod, c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM,
                  PASS_DIM, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED, 1.0, False,
                  ROT_OFFSET, DEINTERLEAVE)


@triton.jit
def _copy_program(
    token_block, head_group, x_ptr, out_ptr, n_tokens, dim1, heads,
    group, sx0, sx1, sxg, sxh, sxd, so0, so1, sog, soh, sod,
    LAYOUT: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr, BLOCK_W: tl.constexpr,
    slot_ptr=0, place_ptr=0, indptr_ptr=0, indices_ptr=0, n_pages=0, n_requests=0, n_indices=0,
    scale=1.0, CACHE: tl.constexpr = 0, PAGE_SIZE: tl.constexpr = 1, QUANT: tl.constexpr = False,
):
    """Copy ``token_block``'s tokens x ``head_group``'s heads of ``WIDTH`` channels (v of a
    packed qkv call), ``BLOCK_W`` channels at a time. With a cache stage (``CACHE``,
    :func:`_cache_rows`) each token's heads go to its slot of the cache ``out_ptr`` (strides
    ``so0`` a page, ``so1`` an entry), divided by ``scale`` and cast where ``QUANT`` (an FP8
    cache, :func:`_store_chunk`)."""
    tok, tok_mask, i0, i1, x_row, o_row, head_lo = _token_rows(
        token_block, head_group, x_ptr, out_ptr, n_tokens, dim1,
        sx0, sx1, so0, so1, LAYOUT, BLOCK_T, BLOCK_H, HEAD_ITERS,
    )
    o_row, write = _cache_rows(tok, tok_mask, o_row, out_ptr, so0, so1, slot_ptr, place_ptr,
                               indptr_ptr, indices_ptr, n_pages, n_requests, n_indices, CACHE,
                               PAGE_SIZE)
    chunk = tl.arange(0, BLOCK_W).to(tl.int64)  # made once, outside the loops
    for it in range(HEAD_ITERS):
        x_h, o_h, row_mask = _chunk_rows(
            x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, BLOCK_H, True
        )
        for w0 in tl.static_range(0, WIDTH, BLOCK_W):
            w = w0 + chunk
            mask = row_mask[:, :, None] & (w < WIDTH)[None, None, :]
            values = tl.load(x_h[:, :, None] + (w * sxd)[None, None, :], mask=mask)
            if CACHE != 0:  # skipped tokens (padding, a slot outside the cache) write nothing
                mask = mask & write[:, None, None]
            if QUANT:
                values = _divided(values, scale).to(o_row.dtype.element_ty)
            at = o_h[:, :, None] + (w * sod)[None, None, :]
            if QUANT and BLOCK_W > FP8_RUN:
                at = tl.max_contiguous(at, [1, 1, FP8_RUN])
            tl.store(at, values, mask=mask)


@triton.jit(do_not_specialize=[
    "n_tokens", "dim1", "seq_len", "table_len", "heads", "n_seqs",
])
def rope_kernel(
    x_ptr, out_ptr, tab_ptr, sin_ptr, cu_ptr, pos_ptr,
    n_tokens, dim1, seq_len, table_len, heads, n_seqs, cp_size, cp_rank,
    sx0, sx1, sxh, sxd, so0, so1, soh, sod,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, SCALE: tl.constexpr, SHARED_ROWS: tl.constexpr,
    HALVES: tl.constexpr = False, ROT_OFFSET: tl.constexpr = 0, DEINTERLEAVE: tl.constexpr = 0,
):
    """RoPE (or its transpose) of one tensor, ``BLOCK_T`` tokens x ``HEAD_ITERS * BLOCK_H``
    heads per program: grid ``(head groups, token blocks)`` (see :func:`_token_block`).

    ``x`` is ``[n0, n1, h, d]`` (``[T, h, d]`` for thd, with ``sx1 = 0``) with strides
    ``sx*``; ``out`` has strides ``so*``. Tokens are numbered ``i0 * dim1 + i1``.
    ``BLOCK_R`` covers the rotated channels (half of them for rotate-half), ``BLOCK_P`` the
    ``PASS_DIM`` pass-through channels. ``PAIRED``: the cache holds one cos and one sin per pair
    (a pair cache; ``sin_ptr`` points half a row into it). ``RATES``: ``tab_ptr`` holds the
    rates twice over, ``[ROT_DIM]`` (a rate table), and each angle is ``position * rate``, no
    table row read. ``LINEAR``: ``tab_ptr`` is an angle table and ``sin_ptr`` its int32 flag
    (:func:`linear_table_kernel`); while the flag holds the pairing's bit, each angle is
    ``position * row 1``, no other row read. ``HALVES`` (sbhd and bshd, a rotate-half cos/sin
    cache): ``cu_ptr`` is the cache's int32 halves flag (:func:`halves_table_kernel`), and while
    it is set only each row's first halves are read. ``ROT_OFFSET``, ``DEINTERLEAVE``: where the
    rotary channels lie (backends/triton_channels.py). Its argument list is kept short: at decode
    size the launch's host time is the call's time.
    """
    _rope_program(
        _token_block(), tl.program_id(0), x_ptr, out_ptr, tab_ptr, sin_ptr, cu_ptr, pos_ptr,
        n_tokens, dim1, seq_len, table_len, heads, 1, n_seqs, cp_size,
        cp_rank,
        sx0, sx1, sxh, sxh, sxd, so0, so1, soh, soh, sod,
        LAYOUT, ROT_DIM, PASS_DIM, INTERLEAVED, USE_CACHE, PAIRED, RATES, LINEAR, POSITIONS,
        CONTEXT_PARALLEL, BACKWARD, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, FAST_TRIG,
        SEQ_BLOCK, False,
        SCALE, SHARED_ROWS, HALVES, ROT_OFFSET, DEINTERLEAVE,
    )


@triton.jit(do_not_specialize=["n_tokens", "dim1"])
def rope_lean_kernel(
    x_ptr, out_ptr, tab_ptr, sin_ptr, cu_ptr, pos_ptr, n_tokens, dim1,
    LAYOUT: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    PASS_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr,
    PAIRED: tl.constexpr, RATES: tl.constexpr, LINEAR: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    FAST_TRIG: tl.constexpr, SCALE: tl.constexpr, SHARED_ROWS: tl.constexpr, VECTOR: tl.constexpr,
    ONE_SEQUENCE: tl.constexpr = False,
):
    """:func:`rope_kernel` for a small call on contiguous sbhd or bshd tensors: ``x`` and
    ``out`` both ``[n0, n1, HEADS, HEAD_DIM]`` and contiguous (or ``out`` is ``x``), fewer
    than ``2**31`` elements, positions by index with no context parallelism, every position
    inside the table (the launcher checks its rows). ``PASS_DIM`` pass-through channels are
    copied (0 in place: left alone). ``cu_ptr`` and ``pos_ptr`` are unused (a cos/sin cache's
    rows are read whole): the argument list
    is :func:`rope_kernel`'s up to the integers, so both share one launch path.

    At these sizes a call's time is its chain of dependent steps after an L2 flush, and the
    instructions before the first load count: offsets are int32 multiples of compile-time
    sizes, one grid axis numbers the programs heads first (``BLOCK_H`` of a token block's
    heads each), and no position is checked against the table: 66 SASS instructions at 2
    tokens x 1 head reading angle rows, where :func:`rope_kernel` has 104 (89 and 137 through
    a linear table's flag). Timings: docs/tuning.md (``LEAN_MAX_BYTES``). The table kinds,
    pairings and arithmetic are :func:`rope_kernel`'s own (:func:`_coefficients`,
    :func:`_rotated`), so both give the same bits. ``SHARED_ROWS``: a rotate-half row read
    (and its sines computed) once for all the tile's heads (:func:`_row_cos_sin`'s
    ``SHARED``; ``backends.triton_rope.shared_rows`` says when). ``VECTOR``: at most this many
    adjacent channels a thread (the compiler's layout follows the contiguity it is told), so a
    thread holding fewer channels of more heads computes fewer sines. ``ONE_SEQUENCE``: the
    batch is 1 (``dim1`` is 1 on sbhd, ``n_tokens`` on bshd), so a token's index is its
    position and no division stands between the program's number and the table row's load."""
    GROUPS: tl.constexpr = (HEADS + BLOCK_H - 1) // BLOCK_H
    HALF: tl.constexpr = ROT_DIM // 2
    program = tl.program_id(0)
    block = program // GROUPS
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = (program - block * GROUPS) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_mask = tok < n_tokens
    c = tl.max_contiguous(tl.arange(0, BLOCK_R), VECTOR)
    c_mask = c < (ROT_DIM if INTERLEAVED else HALF)
    rows = (tok * (HEADS * HEAD_DIM))[:, None] + (hh * HEAD_DIM)[None, :]
    row_mask = tok_mask[:, None] & (hh < HEADS)[None, :]
    mask = row_mask[:, :, None] & c_mask[None, None, :]
    offsets = rows[:, :, None] + c[None, None, :]
    x_a = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if INTERLEAVED:
        x_b = x_a
    else:
        x_b = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0)
    if PASS_DIM > 0:
        p = tl.arange(0, BLOCK_P)
        p_offsets = rows[:, :, None] + ROT_DIM + p[None, None, :]
        p_full = row_mask[:, :, None] & (p < PASS_DIM)[None, None, :]
        kept = tl.load(x_ptr + p_offsets, mask=p_full)
    if ONE_SEQUENCE:
        pos = tok
    else:
        i0, i1 = _token_index(tok, dim1, LAYOUT)
        pos = i0 if LAYOUT == 0 else i1
    cos_a, cos_b, coef_a, coef_b = _coefficients(
        tab_ptr, sin_ptr, pos, pos, tok_mask, c, c_mask, ROT_DIM, INTERLEAVED, USE_CACHE, PAIRED,
        RATES, LINEAR, BACKWARD, BLOCK_T, BLOCK_R, FAST_TRIG, SCALE, SHARED_ROWS, sin_ptr, False,
    )
    out_a, out_b = _rotated(x_a, x_b, cos_a, cos_b, coef_a, coef_b, INTERLEAVED, BLOCK_T, BLOCK_H,
                            BLOCK_R)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offsets, _rounded(out_a, out_ty), mask=mask)
    if not INTERLEAVED:
        tl.store(out_ptr + offsets + HALF, _rounded(out_b, out_ty), mask=mask)
    if PASS_DIM > 0:
        tl.store(out_ptr + p_offsets, _rounded(kept, out_ty), mask=p_full)


@triton.jit(do_not_specialize=[
    "n_tokens", "dim1", "seq_len", "q_table_len", "k_table_len",
    "n_seqs", "q_heads", "k_heads", "v_heads",
])
def rope_qkv_kernel(
    q_x, q_out, k_x, k_out, v_x, v_out, q_tab, q_sin, k_tab, k_sin, cu_ptr, pos_ptr,
    n_tokens, dim1, seq_len, q_table_len, k_table_len, n_seqs, cp_size,
    cp_rank,
    q_heads, q_group, k_heads, k_group, v_heads, v_group,
    qx0, qx1, qxg, qxh, qxd, qo0, qo1, qog, qoh, qod,
    kx0, kx1, kxg, kxh, kxd, ko0, ko1, kog, koh, kod,
    vx0, vx1, vxg, vxh, vxd, vo0, vo1, vog, voh, vod,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, HAS_V: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
    SCALE: tl.constexpr, HALVES: tl.constexpr = False, ROT_OFFSET: tl.constexpr = 0,
    DEINTERLEAVE: tl.constexpr = 0,
):
    """q and k rotated (each by its own table) and v copied, in one launch.

    Each of q, k and v is a ``[n0, n1, groups, group, d]`` view (``[T, groups, group, d]`` for
    thd): head ``g * group + j`` at ``g * s?g + j * s?h``, which addresses the heads of a
    packed qkv row (forward input, backward output) and plain ``[.., h, d]`` tensors alike.
    The programs of one token block come together (grid axis 0, :func:`_token_block`): its q
    head groups, then its k head groups, then its v head groups (none without ``HAS_V``). So
    k's programs read the table rows q's programs have just brought into L2, and the rows of a
    packed gradient are written by neighbouring programs. v's heads are ``V_WIDTH`` channels
    wide (``BLOCK_W``, a power of two, covers them). The backward is the same launch with
    ``BACKWARD`` set: q's and k's gradients transposed, v's copied, into one packed gradient.
    ``HALVES``: q and k share one rotate-half cos/sin cache whose halves flag is ``cu_ptr``
    (sbhd and bshd; :func:`rope_kernel`).
    """
    per_program = HEAD_ITERS * BLOCK_H
    q_per = (q_heads + per_program - 1) // per_program  # head groups per token block
    k_per = (k_heads + per_program - 1) // per_program
    block = _token_block()
    r = tl.program_id(0)
    if r < q_per:
        _rope_program(
            block, r, q_x, q_out, q_tab, q_sin, cu_ptr, pos_ptr,
            n_tokens, dim1, seq_len, q_table_len, q_heads, q_group, n_seqs,
            cp_size, cp_rank,
            qx0, qx1, qxg, qxh, qxd, qo0, qo1, qog, qoh, qod,
            LAYOUT, ROT_DIM, PASS_DIM, INTERLEAVED, USE_CACHE, PAIRED, RATES, LINEAR, POSITIONS,
            CONTEXT_PARALLEL, BACKWARD, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, FAST_TRIG,
            SEQ_BLOCK, True,
            SCALE, False, HALVES, ROT_OFFSET, DEINTERLEAVE,
        )
    elif r < q_per + k_per:
        _rope_program(
            block, r - q_per, k_x, k_out, k_tab, k_sin, cu_ptr, pos_ptr,
            n_tokens, dim1, seq_len, k_table_len, k_heads, k_group, n_seqs,
            cp_size, cp_rank,
            kx0, kx1, kxg, kxh, kxd, ko0, ko1, kog, koh, kod,
            LAYOUT, ROT_DIM, PASS_DIM, INTERLEAVED, USE_CACHE, PAIRED, RATES, LINEAR, POSITIONS,
            CONTEXT_PARALLEL, BACKWARD, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, FAST_TRIG,
            SEQ_BLOCK, True,
            SCALE, False, HALVES, ROT_OFFSET, DEINTERLEAVE,
        )
    elif HAS_V:
        _copy_program(
            block, r - q_per - k_per, v_x, v_out, n_tokens, dim1,
            v_heads, v_group,
            vx0, vx1, vxg, vxh, vxd, vo0, vo1, vog, voh, vod,
            LAYOUT, V_WIDTH, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_W,
        )


LINEAR_HALVES: int = 1  # flag bit: rows linear, row 1's halves equal (rotate-half pairs)
LINEAR_PAIRS: int = 2  # flag bit: rows linear, row 1's neighbours equal (interleaved pairs)


@triton.jit
def linear_table_kernel(
    tab_ptr, flag_ptr, rows, ROT_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Clear the bits of ``flag_ptr`` (int32, set to 3 before the launch) that the contiguous
    float32 angle table ``[rows, ROT_DIM]`` (``rows >= 2``) does not earn: both bits unless every
    entry ``[p, c]`` is bit for bit the float32 product ``float32(p) * [1, c]``, bit 1 unless
    row 1's halves are equal, bit 2 unless its neighbouring channels are. With a bit set, the
    angle of either channel of a pair at any position inside the table is one product with
    row 1's entry: what the kernels compute from a rate table. Each program checks
    ``BLOCK_ROWS`` rows."""
    c = tl.arange(0, BLOCK_C)
    c_ok = c < ROT_DIM
    rate = tl.load(tab_ptr + ROT_DIM + c, mask=c_ok, other=0.0)
    rows_at = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = (rows_at < rows)[:, None] & c_ok[None, :]
    got = tl.load(tab_ptr + rows_at.to(tl.int64)[:, None] * ROT_DIM + c[None, :], mask=mask,
                  other=0.0)
    want = rows_at.to(tl.float32)[:, None] * rate[None, :]
    off = (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) & mask
    off_rows = tl.reduce(tl.reduce(off.to(tl.int32), 1, _maximum), 0, _maximum)
    partner = tl.where(c < ROT_DIM // 2, c + ROT_DIM // 2, c - ROT_DIM // 2)
    halves = tl.load(tab_ptr + ROT_DIM + partner, mask=c_ok, other=0.0)
    pairs = tl.load(tab_ptr + ROT_DIM + (c ^ 1), mask=c_ok, other=0.0)
    rate_bits = rate.to(tl.int32, bitcast=True)
    off_halves = tl.reduce(
        ((halves.to(tl.int32, bitcast=True) != rate_bits) & c_ok).to(tl.int32), 0, _maximum
    )
    off_pairs = tl.reduce(
        ((pairs.to(tl.int32, bitcast=True) != rate_bits) & c_ok).to(tl.int32), 0, _maximum
    )
    earned = (1 - off_halves) * 1 + (1 - off_pairs) * 2
    tl.atomic_and(flag_ptr, earned * (1 - off_rows))


@triton.jit
def halves_table_kernel(
    cos_ptr, sin_ptr, flag_ptr, rows, ROT_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Clear ``flag_ptr`` (int32, set to 1 before the launch) unless, in every row of the
    contiguous cos and sin caches ``[rows, ROT_DIM]`` (given as integer views of the same
    width, so the test is bit for bit), the second half repeats the first: the form
    rotate-half models build them in (``cat((angles, angles))``), where reading the first
    halves gives the same result bits. Each program checks ``BLOCK_ROWS`` rows."""
    HALF: tl.constexpr = ROT_DIM // 2
    c = tl.arange(0, BLOCK_C)
    rows_at = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = (rows_at < rows)[:, None] & (c < HALF)[None, :]
    first = rows_at.to(tl.int64)[:, None] * ROT_DIM + c[None, :]
    off = (tl.load(cos_ptr + first, mask=mask) != tl.load(cos_ptr + first + HALF, mask=mask)) | (
        tl.load(sin_ptr + first, mask=mask) != tl.load(sin_ptr + first + HALF, mask=mask)
    )
    differs = tl.reduce(tl.reduce((off & mask).to(tl.int32), 1, _maximum), 0, _maximum)
    if differs != 0:
        tl.store(flag_ptr, 0)


INTERPRETED: bool = isinstance(rope_kernel, InterpretedFunction)
_INTERPRETER: tl.constexpr = tl.constexpr(INTERPRETED)  # (read by _rounded)
