"""The norm stage's kernel: QK-norm (RMSNorm over each head, or over a token's heads) and RoPE
in one pass, forward and backward, from the rotation's building blocks (backends/triton_kernels.py).

Forward, a program reads its tokens' heads once, normalizes them in float32 and writes them
rotated, rounded once. Backward, it reads the output's gradient and the forward's input, writes
the input's gradient and its share of the weight's gradient (one row per program, summed on the
host). A norm over a token's heads (OLMo 2) gives one program all of them: it reads them once
for the statistics and again (from L1/L2) to write.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_cache_kernels import _cache_rows, _quant_scale
from .triton_kernels import (
    _add, _coefficients, _copy_program, _load_chunk, _nth_token_block, _positions, _rotate_store,
    _rotated, _rounded, _store_chunk, _token_block, _token_rows,
)


@triton.jit
def _total(x, axis: tl.constexpr):
    """``x`` summed over ``axis`` (see :func:`_add`)."""
    return tl.reduce(x, axis, _add)


@triton.jit
def _channel_squares(a, b, p, INTERLEAVED: tl.constexpr, PASS_DIM: tl.constexpr):
    """Per head row, the sum of its channels' squares, the chunk given as its rotary halves (or
    interleaved tile, ``b`` unused) and pass-through channels; the halves' squares added before
    one reduction (a forward's statistics; a backward's are :func:`_squares_and_dots`)."""
    if INTERLEAVED:
        total = _total(a * a, 2)
    else:
        total = _total(a * a + b * b, 2)
    if PASS_DIM > 0:
        total += _total(p * p, 2)
    return total


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _squares_and_dots(s_a, s_b, s_p, u_a, u_b, u_p, INTERLEAVED: tl.constexpr,
                      PASS_DIM: tl.constexpr):
    """Per head row, ``sum(s * s)`` and ``sum(u * s)`` over its channels (chunks as
    :func:`_channel_squares` takes them) in one reduction of pairs: a backward's statistics, whose
    two reductions' shuffles then interleave instead of running one after the other."""
    squares = s_a * s_a
    dots = u_a * s_a
    if not INTERLEAVED:
        squares += s_b * s_b
        dots += u_b * s_b
    squares, dots = tl.reduce((squares, dots), 2, _add_pairs)
    if PASS_DIM > 0:
        p_squares, p_dots = tl.reduce((s_p * s_p, u_p * s_p), 2, _add_pairs)
        squares += p_squares
        dots += p_dots
    return squares, dots


@triton.jit
def _norm_weights(
    w_ptr, hh, heads, c, c_mask, p_mask, NORM: tl.constexpr, OFFSET: tl.constexpr,
    ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """A norm's ``offset + weight`` in float32 for the chunk's channels, ``[1, 1, C]`` (one
    weight per channel, ``NORM == 1``) or ``[1, BLOCK_H, C]`` (per head too, ``NORM == 2``)."""
    HEAD_DIM: tl.constexpr = ROT_DIM + PASS_DIM
    p = tl.arange(0, BLOCK_P)
    if NORM == 2:
        base = (hh.to(tl.int64) * HEAD_DIM)[None, :, None]
        h_mask = (hh < heads)[None, :, None]
        a_mask = h_mask & c_mask[None, None, :]
        p_full = h_mask & p_mask[None, None, :]
    else:
        base = 0
        a_mask = c_mask[None, None, :]
        p_full = p_mask[None, None, :]
    w_a = tl.load(w_ptr + base + c[None, None, :], mask=a_mask, other=0.0).to(tl.float32) + OFFSET
    if INTERLEAVED:
        w_b = w_a
    else:
        w_b = tl.load(w_ptr + base + (c + ROT_DIM // 2)[None, None, :], mask=a_mask,
                      other=0.0).to(tl.float32) + OFFSET
    if PASS_DIM > 0:
        w_p = tl.load(w_ptr + base + (p + ROT_DIM)[None, None, :], mask=p_full,
                      other=0.0).to(tl.float32) + OFFSET
    else:
        w_p = w_a
    return w_a, w_b, w_p


@triton.jit
def _gradient_and_source(
    g_a, g_b, g_p, s_row, tok_mask, head_lo, it, heads, group, ssg, ssh, ssd, c_mask, p_mask,
    cos_a, cos_b, coef_a, coef_b, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, GROUPED: tl.constexpr,
):
    """A backward chunk's ``z = rotate^T(g)`` (the output gradient ``g`` rotated back) and the
    forward input's chunk ``s`` at the same heads, all float32: ``(z_a, z_b, z_p, s_a, s_b,
    s_p)``. Tokens past the end and channels past the rotary ones have NaN angles: their ``z``
    is zero, so they stay out of the sums."""
    s_a, s_b, s_p = _load_chunk(
        s_row, s_row, tok_mask, head_lo, it, heads, group, ssg, ssh, ssg, ssh, ssd, c_mask, p_mask,
        ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED,
    )
    z_a, z_b = _rotated(g_a, g_b, cos_a, cos_b, coef_a, coef_b, INTERLEAVED, BLOCK_T, BLOCK_H,
                        BLOCK_R)
    inside = tok_mask[:, None, None] & c_mask[None, None, :]
    return (tl.where(inside, z_a, 0.0), tl.where(inside, z_b, 0.0), g_p.to(tl.float32),
            s_a.to(tl.float32), s_b.to(tl.float32), s_p.to(tl.float32))


@triton.jit
def _norm_rope_program(
    super_block, head_group, x_ptr, out_ptr, src_ptr, w_ptr, part_ptr, tab_ptr, sin_ptr, cu_ptr,
    pos_ptr, n_tokens, dim1, seq_len, table_len, heads, group, n_seqs,
    cp_size, cp_rank, sx0, sx1, sxg, sxh, sxd, so0, so1, sog, soh, sod, ss0, ss1, ssg, ssh, ssd,
    part_row,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, GROUPED: tl.constexpr, SCALE: tl.constexpr, HALVES: tl.constexpr,
    NORM: tl.constexpr, EPS: tl.constexpr, OFFSET: tl.constexpr, TOKEN_ITERS: tl.constexpr,
    TOKEN_STAGES: tl.constexpr,
    slot_ptr, place_ptr, indptr_ptr, indices_ptr, n_pages, n_requests, n_indices, scale,
    CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr,
):
    """:func:`_rope_program` with a norm stage before the rotation: ``y = rotate(x * r * w)``,
    ``r = 1 / sqrt(mean(x**2) + EPS)`` over each head (``NORM == 1``) or over the token's
    heads together (``NORM == 2``: the program holds them all), ``w = OFFSET + weight``
    (``w_ptr``), float32 throughout and rounded once; ``NORM == 0`` rotates only.

    ``BACKWARD``: ``x_ptr`` is the output's gradient ``g`` and ``src_ptr`` (strides ``ss*``)
    the forward's input ``x``. With ``z = rotate^T(g)``, it writes
    ``dx = r w z - x r^3 sum(w z x) / n`` and, at row ``part_row`` of ``part_ptr`` (float32),
    this program's share of the weight's gradient ``sum(z x r)`` over its tokens (and its
    heads, for ``NORM == 1``); the host sums the rows. Every head's channels are read and
    written, the pass-through ones too. A program takes ``TOKEN_ITERS`` token blocks in turn
    (:func:`_nth_token_block` of ``super_block``), summing the weight's gradient elementwise
    over all of them and reducing it once: a reduction across the tile per block cost a third
    of the backward's time; with
    ``TOKEN_STAGES`` above 1 the loop is software-pipelined (Triton copies the next blocks' data
    into shared memory while this one is worked on). A norm over a token's heads keeps one token
    block a program.

    The cache stage after the rotation (forward): ``CACHE`` writes each token's heads at its
    slot of the cache ``out_ptr`` instead (:func:`_cache_rows`; skipped tokens write nothing),
    and ``QUANT`` divides what is stored by ``scale`` before the cast to the output's FP8 dtype.
    """
    HEAD_DIM: tl.constexpr = ROT_DIM + PASS_DIM
    # a tile of one head group loads its data before the table: the loads' latencies overlap
    # where the table's rows wait on the positions (docs/tuning.md, the norm kernel's rows)
    EARLY: tl.constexpr = HEAD_ITERS == 1 and NORM != 2
    # a tile of several tokens and heads reads each table row once for all its heads
    SHARED: tl.constexpr = BLOCK_T > 1 and BLOCK_H > 1
    c = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        c_mask = c < ROT_DIM
    else:
        c_mask = c < ROT_DIM // 2
    p_mask = tl.arange(0, BLOCK_P) < PASS_DIM
    if BACKWARD and NORM == 1:  # zeros in the data tiles' shapes
        rows = (tl.arange(0, BLOCK_T)[:, None, None] + tl.arange(0, BLOCK_H)[None, :, None]) * 0
        acc_a = (rows + c[None, None, :] * 0).to(tl.float32)
        acc_b = (rows + c[None, None, :] * 0).to(tl.float32)
        acc_p = (rows + tl.arange(0, BLOCK_P)[None, None, :] * 0).to(tl.float32)
    for tb in tl.range(TOKEN_ITERS, num_stages=TOKEN_STAGES):
        tok, tok_mask, i0, i1, x_row, o_row, head_lo = _token_rows(
            _nth_token_block(super_block, tb), head_group, x_ptr, out_ptr, n_tokens, dim1,
            sx0, sx1, so0, so1, LAYOUT, BLOCK_T, BLOCK_H, HEAD_ITERS,
        )
        o_row, write = _cache_rows(tok, tok_mask, o_row, out_ptr, so0, so1, slot_ptr, place_ptr,
                                   indptr_ptr, indices_ptr, n_pages, n_requests, n_indices, CACHE,
                                   PAGE_SIZE)
        s_row = src_ptr + (i0.to(tl.int64) * ss0 + i1.to(tl.int64) * ss1)
        if EARLY:
            x_a0, x_b0, kept0 = _load_chunk(
                x_row, o_row, tok_mask, head_lo, 0, heads, group, sxg, sxh, sog, soh, sxd, c_mask,
                p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED,
            )
        pos = _positions(
            tok, tok_mask, i0, i1, seq_len, table_len, cu_ptr, pos_ptr, n_seqs, cp_size, cp_rank,
            LAYOUT, POSITIONS, CONTEXT_PARALLEL, SEQ_BLOCK,
        )
        inside = tok_mask & (pos >= 0) & (pos < table_len)
        cos_a, cos_b, coef_a, coef_b = _coefficients(
            tab_ptr, sin_ptr, pos, pos.to(tl.int64), inside, c, c_mask, ROT_DIM, INTERLEAVED,
            USE_CACHE, PAIRED, RATES, LINEAR, BACKWARD, BLOCK_T, BLOCK_R, FAST_TRIG, SCALE,
            SHARED, cu_ptr, HALVES,
        )
        width = heads * HEAD_DIM
        if NORM == 2:  # the token's statistics over all its heads, before any head is written
            squares = (tok * 0).to(tl.float32)[:, None]
            dots = (tok * 0).to(tl.float32)[:, None]
            for it in range(HEAD_ITERS):
                x_a, x_b, kept = _load_chunk(
                    x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, sxd,
                    c_mask, p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P,
                    GROUPED,
                )
                if BACKWARD:
                    z_a, z_b, z_p, s_a, s_b, s_p = _gradient_and_source(
                        x_a, x_b, kept, s_row, tok_mask, head_lo, it, heads, group, ssg, ssh, ssd,
                        c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM, PASS_DIM,
                        INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED,
                    )
                    hh = head_lo + it * BLOCK_H + tl.arange(0, BLOCK_H)
                    w_a, w_b, w_p = _norm_weights(w_ptr, hh, heads, c, c_mask, p_mask, NORM, OFFSET,
                                                  ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_P)
                    row_squares, row_dots = _squares_and_dots(
                        s_a, s_b, s_p, z_a * w_a, z_b * w_b, z_p * w_p, INTERLEAVED, PASS_DIM)
                    squares += _total(row_squares, 1)[:, None]
                    dots += _total(row_dots, 1)[:, None]
                else:
                    x_a = x_a.to(tl.float32)
                    x_b = x_b.to(tl.float32)
                    kept = kept.to(tl.float32)
                    squares += _total(_channel_squares(x_a, x_b, kept, INTERLEAVED, PASS_DIM),
                                      1)[:, None]
            token_r = tl.rsqrt(squares / width + EPS)[:, :, None]
            # r * (r * r * mean): r cubed overflows float32 where eps is tiny (r up to 2**63)
            token_k = token_r * (token_r * token_r * (dots / width)[:, :, None])
        for it in range(HEAD_ITERS):
            if EARLY:
                x_a, x_b, kept = x_a0, x_b0, kept0
            else:
                x_a, x_b, kept = _load_chunk(
                    x_row, o_row, tok_mask, head_lo, it, heads, group, sxg, sxh, sog, soh, sxd,
                    c_mask, p_mask, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P,
                    GROUPED,
                )
            hh = head_lo + it * BLOCK_H + tl.arange(0, BLOCK_H)
            if NORM == 0:  # (the transpose too: an inverse rotation's cache stage, a backward)
                _rotate_store(x_a, x_b, kept, x_row, o_row, write, head_lo, it, heads, group,
                              sxg, sxh, sog, soh, sod, c_mask, p_mask, cos_a, cos_b, coef_a,
                              coef_b, ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R,
                              BLOCK_P, GROUPED, scale, QUANT)
            else:
                w_a, w_b, w_p = _norm_weights(w_ptr, hh, heads, c, c_mask, p_mask, NORM, OFFSET,
                                              ROT_DIM, PASS_DIM, INTERLEAVED, BLOCK_P)
                if BACKWARD:
                    z_a, z_b, z_p, s_a, s_b, s_p = _gradient_and_source(
                        x_a, x_b, kept, s_row, tok_mask, head_lo, it, heads, group, ssg, ssh, ssd,
                        c_mask, p_mask, cos_a, cos_b, coef_a, coef_b, ROT_DIM, PASS_DIM,
                        INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED,
                    )
                    if NORM == 1:
                        row_squares, row_dots = _squares_and_dots(
                            s_a, s_b, s_p, z_a * w_a, z_b * w_b, z_p * w_p, INTERLEAVED, PASS_DIM)
                        r = tl.rsqrt(row_squares / HEAD_DIM + EPS)[:, :, None]
                        k = r * (r * r * (row_dots / HEAD_DIM)[:, :, None])
                    else:
                        r = token_r
                        k = token_k
                    _store_chunk(r * w_a * z_a - k * s_a, r * w_b * z_b - k * s_b,
                                 r * w_p * z_p - k * s_p, x_row, o_row, tok_mask, head_lo, it, heads,
                                 group, sxg, sxh, sog, soh, sod, c_mask, p_mask, ROT_DIM, PASS_DIM,
                                 INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED)
                    # the weight's gradient: z times the normalized input, summed elementwise over
                    # the program's tiles (one reduction at its end) or, per head, over its tokens
                    if NORM == 1:
                        acc_a += z_a * s_a * r
                        acc_b += z_b * s_b * r
                        if PASS_DIM > 0:
                            acc_p += z_p * s_p * r
                    else:
                        d_a = _total(z_a * s_a * r, 0)
                        d_b = _total(z_b * s_b * r, 0)
                        d_p = _total(z_p * s_p * r, 0)
                        row = part_ptr + part_row.to(tl.int64) * width + (hh.to(tl.int64) * HEAD_DIM)[:, None]
                        h_mask = (hh < heads)[:, None]
                        tl.store(row + c[None, :], d_a, mask=h_mask & c_mask[None, :])
                        if not INTERLEAVED:
                            tl.store(row + (c + ROT_DIM // 2)[None, :], d_b, mask=h_mask & c_mask[None, :])
                        if PASS_DIM > 0:
                            p = tl.arange(0, BLOCK_P)
                            tl.store(row + (p + ROT_DIM)[None, :], d_p, mask=h_mask & p_mask[None, :])
                else:
                    x_a = x_a.to(tl.float32)
                    x_b = x_b.to(tl.float32)
                    kept = kept.to(tl.float32)
                    if NORM == 1:
                        r = tl.rsqrt(_channel_squares(x_a, x_b, kept, INTERLEAVED, PASS_DIM)
                                     / HEAD_DIM + EPS)[:, :, None]
                    else:
                        r = token_r
                    _rotate_store(x_a * r * w_a, x_b * r * w_b, kept * r * w_p, x_row, o_row, write,
                                  head_lo, it, heads, group, sxg, sxh, sog, soh, sod, c_mask, p_mask,
                                  cos_a, cos_b, coef_a, coef_b, ROT_DIM, PASS_DIM, INTERLEAVED,
                                  BLOCK_T, BLOCK_H, BLOCK_R, BLOCK_P, GROUPED, scale, QUANT)
    if BACKWARD and NORM == 1:
        row = part_ptr + part_row.to(tl.int64) * HEAD_DIM
        tl.store(row + c, _total(_total(acc_a, 0), 0), mask=c_mask)
        if not INTERLEAVED:
            tl.store(row + ROT_DIM // 2 + c, _total(_total(acc_b, 0), 0), mask=c_mask)
        if PASS_DIM > 0:
            p = tl.arange(0, BLOCK_P)
            tl.store(row + ROT_DIM + p, _total(_total(acc_p, 0), 0), mask=p_mask)


@triton.jit(do_not_specialize=[
    "n_tokens", "dim1", "seq_len", "q_table_len", "k_table_len",
    "n_seqs", "q_heads", "k_heads", "v_heads", "n_pages", "n_requests", "n_indices",
])
def rope_norm_kernel(
    q_x, q_out, k_x, k_out, v_x, v_out, q_tab, q_sin, k_tab, k_sin, cu_ptr, pos_ptr,
    q_w, k_w, q_src, k_src, q_part, k_part,
    slot_ptr, place_ptr, indptr_ptr, indices_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    n_tokens, dim1, seq_len, q_table_len, k_table_len, n_seqs, cp_size,
    cp_rank,
    q_heads, q_group, k_heads, k_group, v_heads, v_group,
    qx0, qx1, qxg, qxh, qxd, qo0, qo1, qog, qoh, qod,
    kx0, kx1, kxg, kxh, kxd, ko0, ko1, kog, koh, kod,
    vx0, vx1, vxg, vxh, vxd, vo0, vo1, vog, voh, vod,
    qs0, qs1, qsg, qsh, qsd, ks0, ks1, ksg, ksh, ksd,
    n_pages, n_requests, n_indices, q_scale, k_scale, v_scale,
    LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, PASS_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_CACHE: tl.constexpr, PAIRED: tl.constexpr,
    RATES: tl.constexpr, LINEAR: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_PARALLEL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FAST_TRIG: tl.constexpr,
    SEQ_BLOCK: tl.constexpr, HAS_V: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
    SCALE: tl.constexpr, HALVES: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, Q_EPS: tl.constexpr, K_EPS: tl.constexpr,
    Q_OFFSET: tl.constexpr, K_OFFSET: tl.constexpr, TOKEN_ITERS: tl.constexpr,
    TOKEN_STAGES: tl.constexpr,
    CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, Q_QUANT: tl.constexpr, K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
):
    """:func:`rope_qkv_kernel` with the norm stage (:func:`_norm_rope_program`) on q and k:
    each side's ``?_NORM`` (0 none, 1 per head, 2 over its heads), ``?_EPS``, ``?_OFFSET``
    and weight ``?_w``. Backward: ``?_x`` are the outputs' gradients, ``?_src`` (strides
    ``?s*``) the forward's inputs, and ``?_part`` get the weights' partial gradients, one row
    per program of that side (token block major); each program takes ``TOKEN_ITERS`` token
    blocks. A single tensor is q with ``k_heads = 0``.

    The cache stage (forward, :func:`~rope_dispatch.rope_to_cache`): ``CACHE`` (1 a slot per
    token, ``slot_ptr``; 2 FlashInfer's pages, ``slot_ptr`` the requests, ``place_ptr`` the
    places, ``indptr_ptr`` and ``indices_ptr`` the pages of each request) makes ``k_out`` and
    ``v_out`` a KV cache of ``n_pages`` pages of ``PAGE_SIZE`` (strides ``ko0``/``vo0`` a page,
    ``ko1``/``vo1`` an entry), written at each token's slot, v copied; ``?_QUANT`` (0 none, 1
    the number ``?_scale``, 2 the float32 scalar at ``?_scale_ptr``) stores q, k or v divided
    by its scale, cast to the output's FP8 dtype."""
    per_program = HEAD_ITERS * BLOCK_H
    q_per = (q_heads + per_program - 1) // per_program
    k_per = (k_heads + per_program - 1) // per_program
    block = _token_block()
    r = tl.program_id(0)
    if r < q_per:
        _norm_rope_program(
            block, r, q_x, q_out, q_src, q_w, q_part, q_tab, q_sin, cu_ptr, pos_ptr,
            n_tokens, dim1, seq_len, q_table_len, q_heads, q_group, n_seqs,
            cp_size, cp_rank,
            qx0, qx1, qxg, qxh, qxd, qo0, qo1, qog, qoh, qod, qs0, qs1, qsg, qsh, qsd,
            block * q_per + r,
            LAYOUT, ROT_DIM, PASS_DIM, INTERLEAVED, USE_CACHE, PAIRED, RATES, LINEAR, POSITIONS,
            CONTEXT_PARALLEL, BACKWARD, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, FAST_TRIG,
            SEQ_BLOCK, True, SCALE, HALVES, Q_NORM, Q_EPS, Q_OFFSET, TOKEN_ITERS, TOKEN_STAGES,
            slot_ptr, place_ptr, indptr_ptr, indices_ptr, n_pages, n_requests, n_indices,
            _quant_scale(q_scale_ptr, q_scale, Q_QUANT), 0, PAGE_SIZE, Q_QUANT != 0,
        )
    elif r < q_per + k_per:
        _norm_rope_program(
            block, r - q_per, k_x, k_out, k_src, k_w, k_part, k_tab, k_sin, cu_ptr, pos_ptr,
            n_tokens, dim1, seq_len, k_table_len, k_heads, k_group, n_seqs,
            cp_size, cp_rank,
            kx0, kx1, kxg, kxh, kxd, ko0, ko1, kog, koh, kod, ks0, ks1, ksg, ksh, ksd,
            block * k_per + r - q_per,
            LAYOUT, ROT_DIM, PASS_DIM, INTERLEAVED, USE_CACHE, PAIRED, RATES, LINEAR, POSITIONS,
            CONTEXT_PARALLEL, BACKWARD, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, FAST_TRIG,
            SEQ_BLOCK, True, SCALE, HALVES, K_NORM, K_EPS, K_OFFSET, TOKEN_ITERS, TOKEN_STAGES,
            slot_ptr, place_ptr, indptr_ptr, indices_ptr, n_pages, n_requests, n_indices,
            _quant_scale(k_scale_ptr, k_scale, K_QUANT), CACHE, PAGE_SIZE, K_QUANT != 0,
        )
    elif HAS_V:
        v_scale_value = _quant_scale(v_scale_ptr, v_scale, V_QUANT)
        for tb in range(TOKEN_ITERS):
            _copy_program(
                _nth_token_block(block, tb), r - q_per - k_per, v_x, v_out, n_tokens, dim1,
                v_heads, v_group,
                vx0, vx1, vxg, vxh, vxd, vo0, vo1, vog, voh, vod,
                LAYOUT, V_WIDTH, BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_W,
                slot_ptr, place_ptr, indptr_ptr, indices_ptr, n_pages, n_requests, n_indices,
                v_scale_value, CACHE, PAGE_SIZE, V_QUANT != 0,
            )


@triton.jit
def _column_sums(part_ptr, grad_ptr, rows, width, block, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLS: tl.constexpr, ROW_ITERS: tl.constexpr):
    """Columns ``block * BLOCK_COLS ...`` of float32 ``[rows, width]`` summed in row order into
    ``grad_ptr`` (rounded once to its dtype); ``rows`` is at most ``ROW_ITERS *
    BLOCK_ROWS``."""
    cols = block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < width
    r = tl.arange(0, BLOCK_ROWS)
    acc = (r[:, None] + cols[None, :] * 0).to(tl.float32) * 0.0
    for i in range(ROW_ITERS):
        start = i * BLOCK_ROWS
        mask = ((start + r) < rows)[:, None] & col_mask[None, :]
        acc += tl.load(part_ptr + (start + r).to(tl.int64)[:, None] * width + cols[None, :],
                       mask=mask, other=0.0)
    tl.store(grad_ptr + cols, _rounded(_total(acc, 0), grad_ptr.dtype.element_ty), mask=col_mask)


@triton.jit(do_not_specialize=["q_rows", "k_rows"])
def weight_grad_kernel(q_part, q_grad, k_part, k_grad, q_rows, k_rows, q_width, k_width,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       ROW_ITERS: tl.constexpr):
    """The norm weights' gradients from a backward's partial rows (``rope_norm_kernel``'s
    ``?_part``), q's and k's in one launch: a program sums ``BLOCK_COLS`` columns of one side
    over all its rows, always in the same order (deterministic); ``ROW_ITERS`` row tiles, a
    power of two (a kernel for every few sizes, not every size)."""
    q_blocks = (q_width + BLOCK_COLS - 1) // BLOCK_COLS
    block = tl.program_id(0)
    if block < q_blocks:
        _column_sums(q_part, q_grad, q_rows, q_width, block, BLOCK_ROWS, BLOCK_COLS, ROW_ITERS)
    else:
        _column_sums(k_part, k_grad, k_rows, k_width, block - q_blocks, BLOCK_ROWS, BLOCK_COLS,
                     ROW_ITERS)
