"""The cache stage's kernel pieces (``rope_to_cache``): where each token's k and v go in a KV
cache, found on the device from the cache's index tensors, and the FP8 stores' scales. Used by
the v copy (backends/triton_kernels.py) and the norm kernel (backends/triton_norm_kernels.py);
:func:`quantize_kernel` stores a tensor into FP8 by the same formula.
"""

from __future__ import annotations

import triton
import triton.language as tl

SLOTS: tl.constexpr = tl.constexpr(1)  # cache stage: a slot per token (vLLM paged, flat)
PAGES: tl.constexpr = tl.constexpr(2)  # cache stage: FlashInfer's pages of each request
SCALE_VALUE: tl.constexpr = tl.constexpr(1)  # FP8 store: divided by a number (an argument)
SCALE_POINTER: tl.constexpr = tl.constexpr(2)  # FP8 store: by a float32 scalar in memory
# :func:`_divided`: the scales it multiplies by their reciprocal lie between _RECIPROCAL_MIN
# (2^-79) and _RECIPROCAL_MAX (2^126); the x it corrects are at least _EXACT_MIN (2^-99)
_RECIPROCAL_MIN: tl.constexpr = tl.constexpr(1.6543612251060553e-24)
_RECIPROCAL_MAX: tl.constexpr = tl.constexpr(8.507059173023462e37)
_EXACT_MIN: tl.constexpr = tl.constexpr(1.5777218104420236e-30)


@triton.jit
def _cache_rows(
    tok, tok_mask, o_row, out_ptr, so0, so1, slot_ptr, place_ptr, indptr_ptr, indices_ptr,
    n_pages, n_requests, n_indices, CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """Where the tokens' heads are written, and which tokens are: ``(row pointers, mask)``.

    ``CACHE == 0``: ``o_row`` and ``tok_mask`` as they are. Otherwise ``out_ptr`` is a KV
    cache of ``n_pages`` pages of ``PAGE_SIZE`` entries (strides ``so0`` and ``so1``), and a
    token goes to entry ``e`` of page ``p``: ``SLOTS`` (``slot_ptr`` one slot per token),
    ``p = slot // PAGE_SIZE``, ``e = slot % PAGE_SIZE``; ``PAGES`` (FlashInfer: ``slot_ptr``
    each token's request ``b``, ``place_ptr`` its place ``i`` in the request's cache),
    ``p = indices_ptr[indptr_ptr[b] + i // PAGE_SIZE]``, ``e = i % PAGE_SIZE``. A token is
    written only where every index lies inside what it indexes (a negative slot or request:
    padding); the host never reads them, and no memory outside them is read."""
    if CACHE == 0:
        row = o_row
        write = tok_mask
    else:
        if CACHE == SLOTS:
            slot = tl.load(slot_ptr + tok, mask=tok_mask, other=-1).to(tl.int64)
            write = tok_mask & (slot >= 0) & (slot < n_pages.to(tl.int64) * PAGE_SIZE)
            slot = tl.where(write, slot, 0)
            page = slot // PAGE_SIZE
            entry = slot - page * PAGE_SIZE
        else:
            request = tl.load(slot_ptr + tok, mask=tok_mask, other=-1).to(tl.int64)
            place = tl.load(place_ptr + tok, mask=tok_mask, other=-1).to(tl.int64)
            write = tok_mask & (request >= 0) & (request < n_requests) & (place >= 0)
            request = tl.where(write, request, 0)
            place = tl.where(write, place, 0)
            first = tl.load(indptr_ptr + request, mask=write, other=0).to(tl.int64)
            end = tl.load(indptr_ptr + request + 1, mask=write, other=0).to(tl.int64)
            at = first + place // PAGE_SIZE
            write = write & (at >= 0) & (at < end) & (at < n_indices)
            page = tl.load(indices_ptr + tl.where(write, at, 0), mask=write, other=0).to(tl.int64)
            write = write & (page >= 0) & (page < n_pages)
            page = tl.where(write, page, 0)
            entry = place - (place // PAGE_SIZE) * PAGE_SIZE
        row = out_ptr + (page * so0 + entry * so1)
    return row, write


@triton.jit
def _quant_scale(scale_ptr, value, QUANT: tl.constexpr):
    """An FP8 store's float32 scale: loaded (``SCALE_POINTER``, a device scalar the host never
    reads) or the number ``value``."""
    if QUANT == SCALE_POINTER:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = value
    return scale


@triton.jit
def _divided(x, scale):
    """``x / scale`` in float32 for an FP8 store, as the cast after it sees IEEE division's
    quotient, without the division's slow path (zeros, subnormals: up to three times the
    store, docs/tuning.md). For a scale in (2^-79, 2^126) whose significand is not all ones:
    ``q = x r`` with ``r = 1 / scale`` rounded, and for ``|x| >= 2^-99`` one correction
    ``q + (x - q scale) r`` (two fused multiply-adds), which is the correctly rounded quotient
    wherever that is a normal number (Markstein's theorem: from 2^-99 the remainder
    ``x - q scale`` is exact, and ``r`` is within the error the theorem needs; an all-ones
    significand is its one exception). Every other quotient is below 2^-20 or 2^-126, where
    both store zero of ``x``'s sign, as ``q`` does; ``q`` also keeps inf and NaN, and where it
    overflows the quotient's cast saturates too. Other scales take the division. Every float32
    ``x`` at 69 scales stored the FP8 bytes the division gives (e4m3 and e5m2, H200,
    2026-11-29); tests/test_rope_to_cache.py checks the values next to each rounding boundary."""
    x = x.to(tl.float32)
    bits = scale.to(tl.uint32, bitcast=True)
    if scale == 1.0:  # the quotient is x (every float32: zeros, subnormals, inf and NaN)
        out = x
    elif ((tl.abs(scale) > _RECIPROCAL_MIN) & (tl.abs(scale) < _RECIPROCAL_MAX)
            & ((bits & 0x7FFFFF) != 0x7FFFFF)):
        r = tl.math.div_rn(1.0, scale)
        q = x * r
        corrected = tl.fma(tl.fma(-q, scale, x), r, q)
        out = tl.where((tl.abs(x) >= _EXACT_MIN) & (tl.abs(corrected) < float("inf")),
                       corrected, q)
    else:
        out = tl.math.div_rn(x, scale)
    return out


@triton.jit(do_not_specialize=["rows"])
def quantize_kernel(x_ptr, out_ptr, rows, cols, sx, so, scale, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """Rows of ``x`` (``sx`` apart, channels contiguous) divided by ``scale`` (:func:`_divided`)
    and cast to ``out``'s FP8 dtype (rows ``so`` apart): the FP8 stores' formula for a tensor
    the cache stage does not read (FlashInfer's ``q_nope``). Program ``(i, j)`` takes rows
    ``i * BLOCK_R`` on, channels ``j * BLOCK_C`` on."""
    scale = tl.cast(scale, tl.float32)  # the interpreter passes a number as it is
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask)
    tl.store(out_ptr + r[:, None] * so + c[None, :],
             _divided(x, scale).to(out_ptr.dtype.element_ty), mask=mask)
