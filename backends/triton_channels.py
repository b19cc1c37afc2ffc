"""Where a head's channels lie for the rotation stage (backends/triton_kernels.py): the
rotary channels from ``ROT_OFFSET`` on (``RoPESpec.rotary_offset``), the pass-through channels
around them, and the pairing that reads interleaved pairs and writes halves
(``RoPESpec.deinterleave``): its forward reads pair ``k`` at ``(2k, 2k+1)`` and writes it at
``(k, k + d2/2)``; the transpose reads halves and writes pairs, so it re-interleaves.
"""

from __future__ import annotations

import triton
import triton.language as tl

PAIRS_IN: tl.constexpr = tl.constexpr(1)  # DEINTERLEAVE: pairs read, halves written (forward)
PAIRS_OUT: tl.constexpr = tl.constexpr(2)  # DEINTERLEAVE: halves read, pairs written (transpose)


@triton.jit
def rotary_channels(BLOCK_R: tl.constexpr, ROT_DIM: tl.constexpr, ROT_OFFSET: tl.constexpr):
    """Channel numbers (int64) of a rotate-half tile's two halves ``(a, b)``: ``c`` and ``c +
    d2/2`` past ``ROT_OFFSET``. An interleaved tile uses ``a`` alone (its whole ``d2``
    channels)."""
    a = tl.arange(0, BLOCK_R).to(tl.int64) + ROT_OFFSET
    return a, a + ROT_DIM // 2


@triton.jit
def pair_channels(BLOCK_R: tl.constexpr, ROT_OFFSET: tl.constexpr):
    """Channel numbers (int64) of ``BLOCK_R`` interleaved pairs, ``ROT_OFFSET`` on, as one run:
    a pair stage reads or writes them whole and splits them into (or joins them from) each
    pair's members, so its accesses stay contiguous (docs/tuning.md)."""
    return tl.arange(0, 2 * BLOCK_R).to(tl.int64) + ROT_OFFSET


@triton.jit
def pass_channels(BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, ROT_OFFSET: tl.constexpr):
    """Channel numbers (int64) of the pass-through channels: the ``ROT_OFFSET`` before the
    rotary ones, then those after them."""
    p = tl.arange(0, BLOCK_P).to(tl.int64)
    if ROT_OFFSET > 0:
        p = tl.where(p < ROT_OFFSET, p, p + ROT_DIM)
    else:
        p = p + ROT_DIM
    return p
