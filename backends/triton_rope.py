"""The Triton backend: our own kernels (backends/triton_kernels.py), their launcher and torch op.

Three ways in, one kernel (:func:`rope_triton` picks):

- eager, no gradient needed: allocate the output and launch the kernel directly; a repeated
  call signature reuses the compiled kernel through Triton's C launcher (decode-size calls are
  bound by this host path);
- eager with a gradient: the same launch inside a ``torch.autograd.Function`` (no dispatcher
  round trip), whose backward is the kernel transposed;
- tracing (``torch.compile``) or tensor subclasses: the ``torch.library`` custom op
  ``rope_dispatch::triton_rope``, with a fake implementation and an autograd formula (the same
  op with ``backward=True``), so ``torch.compile(fullgraph=True)`` compiles forward and backward
  without a graph break.

The backward saves only the table (and the index tensors), never activations, and returns the
gradient in the input's memory layout when that layout is dense (as ``empty_like`` would).

Triton is imported lazily. The backend runs on CUDA devices; with ``TRITON_INTERPRET=1`` set
before its first use, it also runs on the CPU through Triton's interpreter (for CI).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.autograd.graph import increment_version

from rope_dispatch.call import RoPECall, env_raw_reader, expanded_dim, position_index
from rope_dispatch.registry import Backend, Plan
from rope_dispatch.spec import RoPESpec
from rope_dispatch.tables import (
    CosSinCache, RotaryTable, angles_2d, kernel_tables, table_address,
)

from . import direct_launch

LAYOUT_CODES = {"sbhd": 0, "bshd": 1, "thd": 2}

_kernels: ModuleType | None = None


def _load_kernels() -> ModuleType:
    """Import the kernel module once (imports triton)."""
    global _kernels
    if _kernels is None:
        from . import triton_kernels

        _kernels = triton_kernels
    return _kernels


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_rows(tile_bytes: int, row_bytes: int) -> int:
    """How many rows of ``row_bytes`` a tile of about ``tile_bytes`` takes: the most that fit,
    rounded down to a power of two (a block size), and at least one."""
    return _next_pow2(max(1, tile_bytes // row_bytes) + 1) // 2


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Launch configuration: (BLOCK_T, BLOCK_H, HEAD_ITERS, BLOCK_R, BLOCK_P, num_warps).
Config = tuple[int, int, int, int, int, int]

# A program moves about this many bytes of input: 16-byte accesses for every thread of 4 warps
# and small programs (many per SM, a short tail). Measured on an H200 (docs/benchmarks.md):
# 8 tokens x 4 heads (bf16, d 128; 8 x 1 for fp32 d 256) was best or within 1% of best on every
# large shape, ahead of one token with all its heads and far ahead of 32-token blocks looping
# over heads, whose cached sin/cos cost registers (4 programs per SM instead of 8+).
TILE_BYTES = 8192
TOKENS_PER_TILE = 8
WARPS = 4  # a program's warps, but for streamed tiles of many heads (STREAM_WARPS)
# A table read channel by channel (a cos/sin cache) is loaded as [BLOCK_T, BLOCK_R] tiles, four
# per program. Its rows need this many bytes per tile for 16-byte loads by each thread of 4
# warps: in bf16 with 8 tokens a thread loaded 8 bytes, and the 8- and 32-head shapes of 64 MB
# and more ran at 69-76% of copy (H200, `scripts/tile_probe.py tables`); with 16 tokens (heads
# halved, the same tile bytes) at 86-95%, as fast as the angle table's rows.
TABLE_TILE_BYTES = 2048
# With fewer programs than this per SM (decode, short sequences), a tile gives up tokens, then
# heads (choose_config). Below a few MB a call is latency-bound: with a 32-token tile, 128 to
# 2,048 tokens of one head ran as 4 to 64 programs, 0.8-1.6 us slower than with one program
# per one or a few tokens (H200, `scripts/tile_probe.py small`).
MIN_PROGRAMS_PER_SM = 2
# The fewest rows (a token's head each) the shrink leaves a program (choose_config). Keeping
# 4, 8 or 16 (fewer programs of more rows) took 0.997-1.004, 0.997-1.000 and 1.06-1.07 of the
# times of 1 after an L2 flush, and 1.012, 1.016 and 1.081 warm, over the 24 sweep and decode
# points below 16 MiB whose tiles change (H200, `scripts/tile_probe.py row-tiles`, run AF).
MIN_TILE_ROWS = 1
# A call whose tensor is at most this size can run with its data in the L2 (50 MB on an H200),
# as a model's layers replayed from a CUDA graph run it. There the table's rows and their sines,
# which every program of a token block works out again, set the pace rather than DRAM: its tile
# takes a token's heads first, up to RESIDENT_HEADS, then tokens. With the L2 warm (H200,
# `scripts/tile_probe.py small-warm` and `small-rules`), 2 tokens x 16 heads ran 4-5% faster
# than 8 x 4 at 512 and 2,048 tokens of 32 heads, and 2 x 8 ran 8-13% faster than 8 x 2 at head
# dim 256; with the L2 flushed the tiles were level within the noise of those 5-15 us calls.
# One token of 32 heads ran slower than 16 heads both ways. A call that also copies
# pass-through channels (partial rotary, out of place) keeps 8 x 4: 2 x 16 ran 7% slower warm
# at 2,048 tokens of 32 heads with rotary dim 64 (run T). The bound counts an out-of-place
# call's input and output; a call in place of up to twice it also fits, but counting those
# resident took 1.6-2% off their time with the input written before each call and put 1.4-2%
# on it after a flush (run AO2, `scripts/tile_probe.py resident-rules`), so it is not done.
RESIDENT_BYTES = 16 << 20
RESIDENT_HEADS = 16
# Such a tile holds at least RESIDENT_ROWS (token, head) rows of 16-bit data, half as many of
# float32, where they fit in twice TILE_BYTES: head dim 256 then gets 4 tokens x 8 heads in
# bf16 and 2 x 8 in float32, where the 8 KiB tile has 2 x 8 and 1 x 8. At 2,048 tokens of 8
# heads (H200, run AD, `scripts/tile_probe.py resident-rows`), in bf16 4 x 8 took 3.80-4.30 us
# forward and backward, in place and out of place, with the L2 warm where 2 x 8 took 4.34-4.60
# and Liger's in-place kernel 4.34-4.45; after an L2 flush it gave back up to 0.2 us
# (5.78-6.05 against 5.68-6.03 us; Liger 6.43-6.70). In float32 2 x 8 took 9.74-10.08 us after
# a flush where 1 x 8 took 10.48-11.41, level warm (7.01-7.37 against 6.95-7.45). Smaller rows
# already number that many; float32 at head dim 128 keeps 2 x 8, 2% faster warm than 4 x 8.
RESIDENT_ROWS = 32
# Above RESIDENT_BYTES a call streams from DRAM. Where a token (all its heads, of every tensor
# of the launch) is smaller than TILE_BYTES, smaller tiles holding a token's heads first ran
# closer to the copy than 8 tokens x 4 heads: with a model's angle table read as rates, 2 KiB
# tiles at 96-100% of copy where the 8 KiB tile ran 91-96% (4-16 heads of d 64, 128 and 256,
# bf16 and float32, 64-256 MiB), 99-101% against 80-84% for one head; with the table's rows or
# an engine's pair cache read, 1-5 points faster (H200, `scripts/tile_probe.py large-rule`).
# Tokens of TILE_BYTES or more (32 heads of d 128, a prefill's q and k) keep the 8 KiB tile:
# there the 2 KiB tile was level with rates and up to 4 points slower with interleaved pairs,
# table rows or a pair cache. So does a call that also copies pass-through channels, or reads
# a cos/sin cache's row tiles (at 8 heads of d 256 in bf16, 68% of copy with 2 KiB tiles
# against 87% with 8 tokens). A tensor of one head takes these tiles at every size, not the
# resident rule's RESIDENT_ROWS tokens (a one-head tile's rows are its tokens, each with its
# own sines): with a model's table read as rates (H200, the profiler after an L2 flush, run
# AL1, `scripts/tile_probe.py one-head-rule`), 8 tokens a program took 6.19-6.40 us forward
# and backward at 32,768 tokens of d 128 in bf16 (sbhd, bshd, thd; copy 5.9) where 32 took
# 7.98-8.48; at 8,192 tokens, against 16 a program, from 0.13 us more to 0.36 us less, and
# 0.09-0.41 us less warm. Over the six points, 0.85 of the times in place and warm, 0.89 out
# of place; with the table's rows read, 0.93-0.95 flushed and 0.84 warm. Caps of 4 and 16
# tokens gained less. 0 turns both rules off (the probe compares both).
STREAM_TILE_BYTES = 2048
# Warps of a streamed tile of STREAM_WARPS_HEADS heads or more. With a model's angle table read
# as rates, 2 warps ran 0-4 points closer to the copy than 4 at 8 and 16 heads of d 64 and 128
# (sbhd, bshd, thd; 64 and 256 MiB; level at 256 MiB), 1-6 points with interleaved pairs, and
# within 1-2 points either way with table rows or a pair cache. Tiles of fewer heads ran 1-5
# points slower on 2 warps (one head: 91% against 96%; d 256, float32, 4 heads) and keep 4
# (H200, `scripts/tile_probe.py large-rule` and `thd-tiles`).
STREAM_WARPS = 2
STREAM_WARPS_HEADS = 8
# In place on partial rotary, a call the L2 can hold takes tokens first: a chunk of
# STREAM_TILE_BYTES' worth of one head's rotary channels, and SPAN_HEAD_ITERS heads in turn per
# program, each thread working out its tokens' sines once for all of them. At 2,048 tokens of
# 32 heads, rotary dim 64 of 128 (bf16, H200, `scripts/tile_probe.py in-place-tiles` and
# `in-place-warm`), 16 tokens x 1 head x 4 took 6.37 / 6.26 us forward / backward after an L2
# flush and 4.24 / 4.20 us with the L2 warm, where 2 tokens x 16 heads took 6.42 / 6.38 and
# 5.35 / 5.48 us and Liger's in-place kernel 6.64 / 6.48 and 4.28 / 4.21 us. Full rotary keeps
# heads first: there 16 x 1 x 4 ran 10% slower warm than 2 x 16.
SPAN_HEAD_ITERS = 4
# thd with fewer sequences than this finds each token's sequence by comparing it with all the
# cu_seqlens offsets, loaded at once (no chain of dependent loads); more sequences use a binary
# search.
SEQ_SCAN_LIMIT = 256
# A call on contiguous sbhd or bshd tensors of at most LEAN_MAX_BYTES, positions by index and
# no context parallelism, runs the lean kernel (triton_kernels.rope_lean_kernel: compile-time
# heads and head dim, int32 offsets, one grid axis). There a call's time is its chain of
# dependent steps after an L2 flush, and the general kernel trailed Liger's in place at 128-512
# tokens of 1-8 heads. In place with the table's rows read (H200, the profiler after an L2
# flush, run AI1, `scripts/tile_probe.py lean-shipped`, forward), the lean kernel took
# 1.74-1.82 us at 128 tokens of 8 heads of d 128 in bf16 (general 1.79-1.92, Liger's
# 1.79-1.86) and 1.89-1.92 us at 512 tokens of 4 heads (2.02-2.08, 2.08-2.14); at 2,048 tokens
# of 8 heads (4 MiB) it took 4.02 against the general kernel's 3.94-4.00. Its tile takes a
# token's heads first, up to LEAN_HEADS, then tokens while it moves at most LEAN_TILE_BYTES:
# 1 x 8 at 512 tokens of 8 heads (2.21 us, 2 x 8 2.27-2.34), 1 x 4 at 4 heads (2 x 4
# 1.99-2.05), 4 x 1 for one head (level with 2 x 1). A batch of one takes each token's index as
# its position (rope_lean_kernel's ONE_SEQUENCE: no index division before the row's load): one
# 32 ns step off at 10 of 12 batch-one point-modes in paired traces (run AW1, `ties`). 0, set
# before the first call (compiled launches are kept by call), turns the lean kernel off.
LEAN_MAX_BYTES = 1 << 20
LEAN_HEADS = 8
LEAN_TILE_BYTES = 1024
# A lean tile of at least this many heads reads each angle row and computes its sines once for
# all of them (rope_lean_kernel's SHARED_ROWS), not once per head: at 1 x 8 (d 128, four warps)
# 2 MUFU a thread instead of 16. With cos and sin crossing shared memory packed in one round
# (one barrier instead of three), that took 0.03-0.07 us off 128 tokens of 8 heads in place
# (H200, after an L2 flush, run AK1: sbhd s128 h8 1.82 against 1.86-1.89 us). At 1 x 4 the
# per-head sines stayed 0.03 us ahead (1.92-1.95 against 1.95-1.98 us), and a cos/sin cache at
# 1 x 8 reads its rows per head with no exchange (1.73-1.76 against 1.79-1.82 us).
SHARED_SINES_HEADS = 8
# ... except where a warp can lay itself over one head's half row at LEAN_VECTOR adjacent
# channels a thread (rotate-half d 128: 64 channels a half, 32 threads): at 1 x 8 on four warps
# a thread then holds two channels of two heads and computes their 8 sines and cosines itself,
# with no exchange and no barrier. In place after an L2 flush (H200, run AM1,
# `scripts/tile_probe.py lean-vector`), at 128-512 tokens of 8 heads of d 128 in bf16, that
# took 0-64 ns off the shared rows forward and 32-64 ns backward, on angle rows and through a
# linear table's flag alike. With every buffer placed anew for each trace (run AM4, `ties`)
# Liger's in-place forward stayed one 32 ns step ahead at 128 tokens of 8 heads (two to three
# with the shared rows), and ours was level or ahead at 512 tokens and at batch 4.
LEAN_VECTOR = 2
# A launch over tensors of different head counts (q and k of MQA, one key head) fits its tile to
# the one with the fewest, but outside streamed tiles (and partial rotary's head loops, not
# measured) gives it at least this many bytes of one token's heads of the widest tensor (the
# others mask the heads they lack): at 32 tokens x 1 head, q's rows are 256-byte pieces 8 KiB
# apart at 32 heads of d 128 in bf16. The q+k forward there (bshd, one key head, out of place;
# H200, the profiler after an L2 flush, `scripts/tile_probe.py mqa-tiles`, runs AO5 and AO6), with
# a model's table read as rates: 32 query heads at 2,048-32,768 tokens, 32 x 1 at 73-78% of a
# copy's time, 16 x 2 at 97-99% (66-67% and 94-96% with the table's rows read); 8 query heads at
# 2,048 tokens, 32 x 1 at 65-68%, 16 x 2 at 92-93%. Streamed 2 KiB tiles keep one head: 8 x 1 ran
# at 92-98% at 8,192 and 32,768 tokens of 8 query heads, where 4 x 2 ran at 85-89%.
MIN_HEAD_BYTES = 512

# A launch reading a cos/sin cache's rows as [BLOCK_T, BLOCK_R] tiles (``reads_cache_rows``)
# gives the widest tensor at least this many heads a tile: each program reads its tokens' whole
# cos and sin rows, twice a head's bytes at one head a tile, again for every head group. Gemma's
# MQA shape (8 query heads, one key head, d 256, bf16; the Hugging Face integration's q+k
# launch on the model's bf16 cos and sin; H200, the profiler after an L2 flush,
# `scripts/tile_probe.py hf-tiles`): 2,048 tokens at 32 x 1 8.74-8.83 us, at 16 x 2
# 7.42-7.62 (a copy of the bytes 6.43-6.50).
CACHE_ROW_MIN_HEADS = 2

# A q and k launch reading a cos/sin cache's rows (the Hugging Face door's, ``apply_qk``'s with
# a ``CosSinCache``) at model shapes, half rows read through the halves flag (H200, bshd bf16,
# the profiler after an L2 flush, forward and backward alike; `scripts/tile_probe.py hf-halves`
# and `hf-halves-wide`, run AS) takes one of these tiles (:func:`qk_cache_row_tile`).
QK_TOKEN_TILE_BYTES = 6144
"""q and k of one head count, streamed from DRAM, whose token's heads (counted to a power of
two) take at most this many bytes, take a tile of one token x all its heads: each program reads
its token's cos and sin rows once, where 16 x 2 reads them again for every two heads. Phi-3
mini (32 heads of d 96) at 4 x 4,096 tokens: 1 x 32 97.3-97.6 us against 100.0-100.1 at 16 x 2
(Liger's kernel 101.1-103.2), at 4,096 tokens 27.3-27.5 against 28.3-28.4; 16 heads of d 128
at 4 x 4,096 tokens 67.7-68.0 against 69.6-70.7. At 32 heads of d 128 (8 KiB) 1 x 32 took 3-5%
longer than 16 x 2, and 1 x 16 the same time."""

WIDE_HEAD_CACHE_TILE = (8, 4)
"""The tile (tokens, heads) of a q and k launch reading a 16-bit cos/sin cache's rows with heads
of 256 channels or more, where the two-head rule gives 16 x 2 or 8 x 2: Gemma 2B (8 query
heads, one key head, d 256) at 2,048 tokens 7.38-7.49 us against 7.55-7.60, at 4 x 8,192
tokens 78.2-78.6 against 78.6-79.3; 4 x 8 took 8.3-8.6 and 100-102."""


def shared_rows(block_t: int, block_h: int, use_cache: bool, lean: bool = True) -> bool:
    """Whether a tile of ``block_t`` tokens x ``block_h`` heads reads each table row once for
    all its heads (``SHARED_ROWS``), in the lean kernel or (``lean=False``) the general one.

    A tile of several tokens and several heads always moves the rows' values from the layout
    they are read in to the heads', and the shared form moves cos and sin together in one round
    where read half by half they take four. Lean tiles (H200, after an L2 flush, in place, run
    AK1): at 2 x 2 (512 tokens of 2 heads, d 128, bf16) 1.81-1.86 us against 2.98-3.07 us on a
    bf16 cos/sin cache, 1.87-1.90 against 1.92-1.95 on angles. In the general kernel only a
    cos/sin cache's rows are read so: over nine sbhd points of 4-128 MiB in bf16 (run AK3,
    the profiler after an L2 flush) its forward moved from 0.2 us more to 0.85 us less (2,048
    tokens of 8 heads of d 256: 6.53 against 7.38 us) and its backward took 0.01-0.8 us less,
    while angle rows at 4 x 8 of d 256 took 0.4-0.5 us more. A tile of one token, or of one
    head, reads its rows where its heads use them; there only lean tiles of angle rows under at
    least ``SHARED_SINES_HEADS`` heads gain, from computing fewer sines."""
    if block_t > 1 and block_h > 1:
        return lean or use_cache
    return lean and not use_cache and block_h >= SHARED_SINES_HEADS


def lean_vector(block_t: int, block_h: int, block_r: int, interleaved: bool,
                use_cache: bool) -> int:
    """At most how many adjacent channels a thread of a lean tile holds (``VECTOR``): a warp
    over one head's half row, ``LEAN_VECTOR`` channels a thread, where a tile of one token and
    ``SHARED_SINES_HEADS`` heads computes rotate-half sines and the half row is that wide;
    elsewhere ``block_r`` (the compiler's own layout)."""
    if (block_t == 1 and block_h >= SHARED_SINES_HEADS and not interleaved and not use_cache
            and block_r == LEAN_VECTOR * 32):
        return LEAN_VECTOR
    return block_r


def tile_heads(counts: tuple[int, ...], head_dim: int, element_size: int) -> int:
    """The most heads a tile of a launch over tensors of ``counts`` heads takes: a power of two
    covering the tensor with the fewest, raised to cover ``MIN_HEAD_BYTES`` of one token's heads
    where the widest tensor has them."""
    floor = -(-MIN_HEAD_BYTES // (head_dim * element_size))
    return _next_pow2(max(min(counts), min(max(counts), floor)))


def qk_cache_row_tile(n_tokens: int, counts: tuple[int, ...], head_dim: int,
                      element_size: int, resident: bool) -> tuple[int, int] | None:
    """The tile (tokens, heads) of a rotate-half launch over q and k (``counts``, full rotary)
    reading a cos/sin cache's rows, where a rule for such launches applies, else ``None``: one
    token x all the heads for q and k of one head count that stream from DRAM with at most
    ``QK_TOKEN_TILE_BYTES`` a token, ``WIDE_HEAD_CACHE_TILE`` for 16-bit heads of 256 channels
    or more."""
    heads = _next_pow2(max(counts))
    if (len(counts) == 2 and counts[0] == counts[1] and not resident
            and heads * head_dim * element_size <= QK_TOKEN_TILE_BYTES):
        return 1, heads
    if len(counts) == 2 and head_dim >= 256 and element_size == 2:
        block_t, block_h = WIDE_HEAD_CACHE_TILE
        return min(block_t, _next_pow2(n_tokens)), min(block_h, heads)
    return None


def choose_config(
    n_tokens: int, heads: int | tuple[int, ...], head_dim: int, rotary_dim: int,
    element_size: int, interleaved: bool, sms: int, tile_tokens: int = TOKENS_PER_TILE,
    cache_rows: bool = False, span_dim: int | None = None, sines: bool = True,
    min_rows: int = MIN_TILE_ROWS,
) -> Config:
    """Tile sizes for a call: tokens per program, heads per tile and per program, widths.

    A tile is ``BLOCK_T`` tokens x ``BLOCK_H`` heads x the head dim, about ``TILE_BYTES``;
    heads go into the tile first (sin/cos are shared by a token's heads) as long as the tile
    keeps ``tile_tokens`` tokens (:func:`tile_tokens`), tokens fill the rest.

    A call of at most ``RESIDENT_BYTES`` (one whose data the L2 can hold) puts heads first, up
    to ``RESIDENT_HEADS``, in a tile of at least ``RESIDENT_ROWS`` rows (half as many in
    float32) where they fit in twice ``TILE_BYTES``; a larger one whose tokens are smaller than
    ``TILE_BYTES`` takes tiles of ``STREAM_TILE_BYTES``, heads first, and so does a tensor of
    one head whatever its size. Neither applies with pass-through channels to copy or a cos/sin
    cache that asks for more tokens, and the streamed tile never to a cos/sin cache read as
    ``[BLOCK_T, BLOCK_R]`` row tiles (``cache_rows``: :func:`reads_cache_rows`). A rotate-half
    q and k launch reading such rows takes :func:`qk_cache_row_tile`'s tile where one applies
    and leaves every SM its programs.

    A call too small for ``MIN_PROGRAMS_PER_SM`` programs per SM at that tile is bound by
    latency, not by load width: its tile starts from as many heads as fit (each program then
    loads one table row for all of them, where a tile of 8 tokens x 1 head loads 8 rows for one
    head), then gives up tokens, down to one, and then heads, until every SM has its programs.
    ``heads`` is a tuple for a launch over several tensors (q, k, v): tiles fit the one with the
    fewest heads, but heads-first and general tiles take at least ``MIN_HEAD_BYTES`` of the
    widest one's (:func:`tile_heads`), and programs are counted over all of them. Where that
    leaves one token of several heads and the kernel computes the sines (``sines``: no cos/sin
    cache), the tile is two tokens of half the heads, as many rows and programs: a one-token
    tile's table row is laid out as a slice of the data tile, so each head's threads compute the
    token's sines again (16 sine and cosine instructions a thread at 1 x 8, 4 at 2 x 4). At 512
    tokens of 8 heads, 2.43 / 2.41 us against 2.56 / 2.42 forward / backward (H200, the profiler
    after an L2 flush, ``scripts/tile_probe.py sine-tiles``). A cache's rows are loads: the
    decode q+k launch keeps 1 x 8 (2.37 us against 2.43 at 2 x 4). A tile of one token of one
    head whose half (``BLOCK_R``) is narrower than the program's 128 threads computes its sines,
    and loads its channels, on twice as many threads as they have: it takes two tokens, at half
    the programs (in place at 128 tokens of one head of d 128, 1.47-1.50 us against 1.57-1.63 at
    1 x 1, 16 tokens of 32 heads 1.78-1.84 against 1.87-1.89: ``one-head-tiles``).

    ``head_dim`` is the channels a head moves; ``span_dim``, where larger, the channels it
    spans in memory (in place on partial rotary: the rotary channels of a wider head). A call
    the L2 holds then takes tokens first, one head at a time and ``SPAN_HEAD_ITERS`` heads a
    program, while that leaves every SM its programs; otherwise its heads-first tile counts
    heads by the span (at rotary dim 64 of head dim 128, 2 tokens x 16 heads ran 6.40 / 6.37 us
    where the 4 x 16 tile of 8 KiB moved took 6.96 / 6.88 us: H200, the profiler after an L2
    flush, ``scripts/tile_probe.py in-place-tiles``).
    """
    counts = heads if isinstance(heads, tuple) else (heads,)
    fit = tile_heads(counts, head_dim, element_size)
    if cache_rows:
        fit = max(fit, min(CACHE_ROW_MIN_HEADS, _next_pow2(max(counts))))
    block_r = _next_pow2(rotary_dim) if interleaved else _next_pow2(rotary_dim // 2)
    pass_dim = head_dim - rotary_dim
    block_p = _next_pow2(pass_dim) if pass_dim else 1
    wanted = MIN_PROGRAMS_PER_SM * sms
    heads_first = (
        tile_tokens == TOKENS_PER_TILE  # a cos/sin cache's row loads want their tokens
        and rotary_dim == head_dim  # pass-through channels copied: 8 x 4 ran faster warm
    )
    token_bytes = sum(counts) * head_dim * element_size
    resident = n_tokens * token_bytes <= RESIDENT_BYTES
    if cache_rows and not interleaved and rotary_dim == head_dim:
        tile = qk_cache_row_tile(n_tokens, counts, head_dim, element_size, resident)
        if tile is not None and programs(n_tokens, counts, *tile) >= wanted:
            return (*tile, 1, block_r, block_p, WARPS)
    streamed = (
        heads_first and (not resident or counts == (1,)) and not cache_rows
        and STREAM_TILE_BYTES and token_bytes < TILE_BYTES
    )
    if heads_first and resident and (span_dim or 0) > head_dim:  # in place on part of a head
        block_t = min(tile_rows(STREAM_TILE_BYTES, head_dim * element_size),
                      _next_pow2(n_tokens))
        head_iters = min(SPAN_HEAD_ITERS, _next_pow2(min(counts)))
        if programs(n_tokens, counts, block_t, head_iters) >= wanted:
            return block_t, 1, head_iters, block_r, block_p, WARPS
    counted = max(head_dim, span_dim or 0) if heads_first and resident else head_dim
    rows = tile_rows(STREAM_TILE_BYTES if streamed else TILE_BYTES, counted * element_size)
    if heads_first and resident and not streamed:
        fits = tile_rows(2 * TILE_BYTES, counted * element_size)
        rows = max(rows, min(RESIDENT_ROWS * 2 // element_size, fits))
        block_h = min(fit, rows, RESIDENT_HEADS)
    elif streamed:
        block_h = min(_next_pow2(min(counts)), rows)
    else:
        block_h = min(fit, max(1, rows // tile_tokens))
    block_t = min(max(1, rows // block_h), _next_pow2(n_tokens))
    if programs(n_tokens, counts, block_t, block_h) < wanted:
        block_h = min(fit, rows)
        block_t = min(rows // block_h, _next_pow2(n_tokens))
        block_t, block_h = shrink_to_programs(n_tokens, counts, block_t, block_h, wanted,
                                              min_rows)
        if sines and block_t == 1 and n_tokens > 1:
            if block_h > 1 and programs(n_tokens, counts, 2, block_h // 2) >= programs(
                    n_tokens, counts, 1, block_h):
                block_t, block_h = 2, block_h // 2
            elif block_h == 1 and block_r < 32 * WARPS:  # a half head narrower than the threads
                block_t = 2
    warps = STREAM_WARPS if streamed and block_h >= STREAM_WARPS_HEADS else WARPS
    return block_t, block_h, 1, block_r, block_p, warps


GRID_AXIS_MAX = 65535
"""The most blocks a CUDA grid's axes 1 and 2 take: a launch's token blocks are spread over
both past it (:func:`launch_grid`)."""


def launch_grid(head_groups: int, token_blocks: int) -> tuple[int, int, int]:
    """The kernels' grid: a token block's head groups on axis 0 (neighbouring programs), the
    token blocks on axes 1 and 2 (``triton_kernels._token_block``), each within
    ``GRID_AXIS_MAX``. Past ``GRID_AXIS_MAX`` token blocks, the last few of axes 1 x 2 (fewer
    than axis 2's count) lie past the tokens and do nothing."""
    layers = -(-token_blocks // GRID_AXIS_MAX)
    return head_groups, -(-token_blocks // layers), layers


def division_magic(divisor: int) -> tuple[int, int]:
    """``(magic, shift)`` such that ``n // divisor == (umulhi(n, magic) + n) >> shift`` in
    unsigned 32-bit arithmetic for every ``0 <= n < 2**31`` (Granlund and Montgomery's
    round-up method), ``magic`` given as the int32 with its bits: how the kernels divide token
    numbers by ``dim1`` without a division instruction sequence."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {divisor}")
    shift = (divisor - 1).bit_length()
    magic = ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1
    return (magic - (1 << 32) if magic >= 1 << 31 else magic), shift


def programs(n_tokens: int, counts: tuple[int, ...], block_t: int, block_h: int) -> int:
    """Programs of a launch over tensors of ``counts`` heads at a ``block_t x block_h`` tile."""
    return -(-n_tokens // block_t) * sum(-(-n // block_h) for n in counts)


def shrink_to_programs(
    n_tokens: int, counts: tuple[int, ...], block_t: int, block_h: int, wanted: int,
    min_rows: int = 1,
) -> tuple[int, int]:
    """The tile halved, tokens first and then heads, until the launch has ``wanted`` programs
    or another halving would leave fewer than ``min_rows`` rows (a token's head each)."""
    while programs(n_tokens, counts, block_t, block_h) < wanted and (
            block_t * block_h >= 2 * min_rows):
        if block_t > 1:
            block_t //= 2
        elif block_h > 1:
            block_h //= 2
        else:
            break
    return block_t, block_h


_configs: dict[tuple, Config] = {}
# Compiled kernels by everything their specialisation depends on (see _fast_key), so a repeated
# call skips Triton's per-launch argument binding (about 15 us of host time per call).
_fast: dict[tuple, tuple] = {}


def _raw_stream_getter():
    try:
        from torch._C import _cuda_getCurrentRawStream

        return _cuda_getCurrentRawStream
    except ImportError:  # older torch: the public (slower) way
        return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_stream = _raw_stream_getter()


def _hooks_active() -> bool:
    """Whether a profiler registered Triton launch hooks (then launch the documented way)."""
    from triton import knobs

    runtime = knobs.runtime
    return bool(getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)) or bool(
        getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook)
    )


def _fast_key(
    x: torch.Tensor, xp: int, op: int, out_strides: tuple[int, ...] | None, table: torch.Tensor,
    tp: int, sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    positions: torch.Tensor | None, layout: str, interleaved: bool, scale: float, cp_size: int,
    cp_rank: int, backward: bool, copy_pass: bool,
) -> tuple[tuple, tuple[int, int, int, int]]:
    """The key of a launch's compiled kernel in ``_fast``, and the addresses of the table, sin,
    cu_seqlens and positions arguments (absent ones point at the table).

    The key holds every input of Triton's specialisation: dtypes, 16-byte alignment of each
    pointer, and the sizes and strides the integer arguments come from (``out_strides`` is
    ``None`` for a fresh contiguous output). It is built from as few tensor reads as possible:
    at decode size this path is a measurable share of the call. Its last two items are the
    device index and the alignment bits (bit 0: ``x``).
    """
    if sin is None and cu_seqlens is None and positions is None:
        sp = cp = stp = tp
        extra = None
    else:
        sp = tp if sin is None else sin.data_ptr()
        cp = tp if cu_seqlens is None else cu_seqlens.data_ptr()
        stp = tp if positions is None else positions.data_ptr()
        extra = (
            # a pair cache's sin is half as wide; a rate table's is the table (-1); a linear
            # angle table's is its int32 flag (-2)
            None if sin is None else (
                -1 if _is_rates(table, sin, tp, sp) else -2 if sin.dtype is _FLAG
                else sin.shape[-1]
            ),
            None if cu_seqlens is None
            else (cu_seqlens.dtype, cu_seqlens.shape, cu_seqlens.stride()),
            None if positions is None
            else (positions.dtype, positions.stride()),
        )
    if (xp | op | tp | sp | cp | stp) & 15 == 0:
        aligned = 63  # the usual case: every pointer on a 16-byte boundary
    else:
        aligned = (
            (xp & 15 == 0) + 2 * (op & 15 == 0) + 4 * (tp & 15 == 0) + 8 * (sp & 15 == 0)
            + 16 * (cp & 15 == 0) + 32 * (stp & 15 == 0)
        )
    key = (
        layout, x.shape, x.stride(), out_strides, x.dtype, table.shape, table.dtype, extra,
        interleaved, scale,
        cp_size, cp_rank, backward, copy_pass, x.get_device(), aligned,
    )
    return key, (tp, sp, cp, stp)


def _paired(table: torch.Tensor, sin: torch.Tensor | None) -> bool:
    """Whether the tables are a pair cache's: one value per rotated pair, its sin view half as
    wide as the table (:func:`rope_dispatch.tables.kernel_tables`)."""
    return sin is not None and sin.shape[-1] != table.shape[-1] and sin.dtype is not _FLAG


def _is_rates(
    table: torch.Tensor, sin: torch.Tensor | None, tp: int | None = None, sp: int | None = None
) -> bool:
    """Whether the tables are a rate table's: ``sin`` is the table itself, a ``[rows, d2]`` view
    of the doubled rates with a row stride of 0 (:func:`rope_dispatch.tables.kernel_tables`).
    Where a traced graph hands the custom op two views of that one buffer instead of one
    object, the shared address and the zero row strides still say it; a cos/sin cache's tables
    are contiguous ``[s2, d2]`` (even one tensor given as both cos and sin). ``tp``/``sp``: the
    two addresses when already read."""
    if sin is None:
        return False
    if sin is not table and (
        (table.data_ptr() if tp is None else tp) != (sin.data_ptr() if sp is None else sp)
    ):
        return False  # a cos/sin cache (the usual case): no stride read
    return table.stride(0) == 0 and (sin is table or sin.stride(0) == 0)


def _table_flags(
    table: torch.Tensor, sin: torch.Tensor | None
) -> tuple[bool, bool, bool, bool]:
    """The kernels' ``(USE_CACHE, PAIRED, RATES, LINEAR)`` for the tables of
    :func:`rope_dispatch.tables.kernel_tables`: angles ``(table, None)``; a cos/sin cache; a
    pair cache (a sin half as wide); a rate table (``sin`` is the table); and of
    :func:`_kernel_tables`: angles with their linearity flag (an int32 ``sin``)."""
    if sin is not None and sin.dtype is _FLAG:
        return False, False, False, True
    rates = _is_rates(table, sin)
    return sin is not None and not rates, _paired(table, sin) and not rates, rates, False


def reads_cache_rows(flags: tuple[bool, bool, bool, bool]) -> bool:
    """Whether a launch with these :func:`_table_flags` reads a cos/sin cache as
    ``[BLOCK_T, BLOCK_R]`` row tiles (a pair cache's rows are read per pair, not so)."""
    use_cache, paired, _, _ = flags
    return use_cache and not paired


def tile_tokens(flags: tuple[bool, bool, bool, bool], table: torch.Tensor, rotary_dim: int,
                interleaved: bool) -> int:
    """Tokens a tile should hold for its table reads: ``TOKENS_PER_TILE``, or more for a cos/sin
    cache (``flags``: :func:`_table_flags`) whose ``[BLOCK_T, BLOCK_R]`` row tiles would be
    below ``TABLE_TILE_BYTES``."""
    if not reads_cache_rows(flags):
        return TOKENS_PER_TILE
    width = _next_pow2(rotary_dim if interleaved else rotary_dim // 2)
    return max(TOKENS_PER_TILE, TABLE_TILE_BYTES // (width * table.element_size()))


def _position_kind(positions: torch.Tensor | None) -> int:
    """The kernels' ``POSITIONS``: 0 by index, 1 start positions (a 1-D index tensor, one per
    sequence), 2 per-token positions (a 2-D one in token order: ``[s, b]``, ``[b, s]`` or
    ``[T, 1]``)."""
    return 0 if positions is None else positions.dim()


# ---------------------------------------------------------------------------------------------
# Linear angle tables: read as rates while their flag on the device says every row is
# float32(position) x row 1

_FLAG = torch.int32  # the dtype that tells a linear table's flag from a cache's sin

LINEAR_MIN_ROWS_READ = 1 << 18
"""Table rows x rotary channels from which a call with an angle table looks for its flag (1 MiB
of float32 rows read without one). Smaller calls read their rows: the saving is small, their
host path counts, and the sines cost more than rows that the L2 serves. The rows are those a
call can read (:func:`_rows_read`), not its tokens: in run Y6 (H200, the profiler's kernel
time after an L2 flush) sbhd and bshd s512 b4 h8 d128, 2,048 tokens of 512 rows, took 3.84
and 3.92 us reading rows against 4.08-4.35 us reading rates, forward and backward."""

# ROPE_DISPATCH_LINEAR_TABLES as the environment stores it (one C call, no Python frame), and
# its "0" in that form
_linear_tables_raw, _encode_env = env_raw_reader("ROPE_DISPATCH_LINEAR_TABLES")
_LINEAR_TABLES_OFF = _encode_env("0")

# (id of the table's base tensor, address, shape, device index) -> the table's flag: an int32
# [1] tensor on the table's device with attributes _rope_base (a weak reference to the base,
# whose death drops the entry) and _rope_version (the table's version counter when checked)
_flags: dict[tuple, torch.Tensor] = {}
# tables seen once: a table made for one call (a copy of a strided one) is never checked
_flags_met: dict[tuple, weakref.ref] = {}
_MAX_FLAGS = 64


def _forget_flag(key: tuple, ref: weakref.ref) -> None:
    flag = _flags.get(key)
    if flag is not None and flag._rope_base is ref:  # type: ignore[attr-defined]
        del _flags[key]


# torch.cuda.is_current_stream_capturing's C function, without its Python frame
_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def _capturing_on(stream: int) -> bool:
    """Whether a CUDA graph is being captured on ``stream``, the raw address of the current
    stream a launch reads (the driver is asked about the current device's). No graph is ever
    captured on the legacy default stream (address 0: CUDA refuses it, and so does
    ``torch.cuda.graph``), where most training runs, and a backward runs on its forward's
    stream: there the driver is not asked. Asked on every call, the question made planned
    forward + backward calls on a linear table 3-10 us slower than the same calls reading rows
    on the H200 host, where it took 0.3-0.7 us alone (run AB)."""
    return stream != 0 and _stream_capturing()


def _capturing(table: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured where ``table`` is read: a replay would read the
    flag as it was at capture, whatever was written into the table since."""
    return table.is_cuda and _capturing_on(_current_stream(table.get_device()))


def linear_flag(table: torch.Tensor) -> torch.Tensor | None:
    """The flag of the contiguous float32 angle table ``[s2, d2]``, checked against its current
    contents (:func:`current_flag`), or ``None`` where the kernels read its rows: at the first
    sight of a table (a table made for one call never pays for a check), for inference tensors
    (no version counter tells a later write), fewer than two rows, under ``torch.compile`` or
    CUDA graph capture, and with ``ROPE_DISPATCH_LINEAR_TABLES=0``."""
    if (
        torch.compiler.is_compiling() or table.shape[0] < 2 or table.is_inference()
        or _linear_tables_raw() == _LINEAR_TABLES_OFF
    ):
        return None
    base = table._base if table._base is not None else table
    key = (id(base), table.data_ptr(), table.shape, table.get_device())
    flag = _flags.get(key)
    if flag is None or flag._rope_base() is not base:  # type: ignore[attr-defined]
        met = _flags_met.pop(key, None)
        if met is None or met() is not base or _capturing(table):
            if len(_flags_met) >= _MAX_FLAGS:
                _flags_met.clear()
            _flags_met[key] = weakref.ref(base)
            return None
        with torch.inference_mode(False):  # a normal tensor: refilled outside inference mode too
            flag = torch.zeros(1, dtype=_FLAG, device=table.device)
        flag._rope_base = weakref.ref(base, functools.partial(_forget_flag, key))  # type: ignore[attr-defined]
        flag._rope_version = -1  # type: ignore[attr-defined]
        if len(_flags) >= _MAX_FLAGS:
            _flags.clear()
        _flags[key] = flag
    return current_flag(table, flag)


def current_flag(table: torch.Tensor, flag: torch.Tensor) -> torch.Tensor | None:
    """``flag``, checked again when ``table`` was written since its last check (its version
    counter moved); ``None`` under CUDA graph capture or with ``ROPE_DISPATCH_LINEAR_TABLES=0``
    (set since the flag was made: a backward, say), where the kernels read the rows."""
    if _capturing(table) or _linear_tables_raw() == _LINEAR_TABLES_OFF:
        return None
    version = table._version
    if flag._rope_version != version:  # type: ignore[attr-defined]
        kernels = _kernels if _kernels is not None else _load_kernels()
        d2 = table.shape[1]
        block_c = _next_pow2(d2)
        block_rows = max(1, 4096 // block_c)
        flag.fill_(kernels.LINEAR_HALVES | kernels.LINEAR_PAIRS)
        with _on_device(table):
            kernels.linear_table_kernel[(-(-table.shape[0] // block_rows),)](
                table, flag, table.shape[0], ROT_DIM=d2, BLOCK_ROWS=block_rows, BLOCK_C=block_c,
            )
        flag._rope_version = version  # type: ignore[attr-defined]
    return flag


def _kernel_tables(
    table: RotaryTable, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rope_dispatch.tables.kernel_tables`, with an angle table's flag as its ``sin``
    (:func:`linear_flag`) when the call's ``rows`` (:func:`_rows_read`) hold at least
    ``LINEAR_MIN_ROWS_READ`` entries."""
    tab, sin = kernel_tables(table)
    if sin is None and rows * tab.shape[1] >= LINEAR_MIN_ROWS_READ:
        flag = linear_flag(tab)
        if flag is not None:
            return tab, flag
    return tab, sin


# ---------------------------------------------------------------------------------------------
# Rotate-half cos/sin caches: only each row's first halves read while a flag on the device says
# every row's second halves repeat them (as transformers' rotary embeddings build them)

HALVES_MIN_ROWS_READ = 1 << 16
"""Table rows x rotary channels from which a rotate-half call on a cos/sin cache looks for its
halves flag: half the rows' bytes saved on each call against one check of the cache (a launch,
about 5 us of host time) at its second call."""

# cos/sin cache -> its halves flag: an int32 [1] tensor on the cache's device with attribute
# _rope_version (the cache's version, CosSinCache._version, when checked)
_halves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# caches seen once: one made for a single call is never checked
_halves_met: weakref.WeakSet = weakref.WeakSet()
_BITS = {2: torch.int16, 4: torch.int32}  # element size -> the integer view the check compares


def halves_flag(table: CosSinCache) -> torch.Tensor | None:
    """The halves flag of a cos/sin cache, checked against its current contents
    (:func:`current_halves`), or ``None`` where the kernels read whole rows: at the first
    sight of a cache, for inference tensors (no version counter tells a later write), under
    ``torch.compile`` or CUDA graph capture, and with ``ROPE_DISPATCH_LINEAR_TABLES=0``."""
    cos, sin = table.cos, table.sin
    if (
        torch.compiler.is_compiling() or cos.is_inference() or sin.is_inference()
        or _linear_tables_raw() == _LINEAR_TABLES_OFF
    ):
        return None
    flag = _halves.get(table)
    if flag is None:
        if table not in _halves_met or _capturing(cos):
            _halves_met.add(table)
            return None
        _halves_met.discard(table)
        with torch.inference_mode(False):  # a normal tensor: refilled outside inference mode too
            flag = torch.zeros(1, dtype=_FLAG, device=cos.device)
        flag._rope_version = -1  # type: ignore[attr-defined]
        _halves[table] = flag
    return current_halves(cos, sin, flag)


def current_halves(cos: torch.Tensor, sin: torch.Tensor, flag: torch.Tensor) -> torch.Tensor | None:
    """``flag``, checked again when ``cos`` or ``sin`` was written since its last check (the
    sum of their version counters moved: each only grows); ``None`` under CUDA graph capture or
    with ``ROPE_DISPATCH_LINEAR_TABLES=0``, where the kernels read whole rows."""
    if _capturing(cos) or _linear_tables_raw() == _LINEAR_TABLES_OFF:
        return None
    version = cos._version + sin._version
    if flag._rope_version != version:  # type: ignore[attr-defined]
        kernels = _kernels if _kernels is not None else _load_kernels()
        rows, d2 = cos.shape
        bits = _BITS[cos.element_size()]
        block_c = _next_pow2(d2 // 2)
        block_rows = max(1, 4096 // block_c)
        flag.fill_(1)
        with _on_device(cos):
            kernels.halves_table_kernel[(-(-rows // block_rows),)](
                cos.view(bits), sin.view(bits), flag, rows, ROT_DIM=d2, BLOCK_ROWS=block_rows,
                BLOCK_C=block_c,
            )
        flag._rope_version = version  # type: ignore[attr-defined]
    return flag


def _launch_tables(
    table: RotaryTable, rows: int, cu_seqlens: torch.Tensor | None, layout: str,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`_kernel_tables`, and what the launch's ``cu_seqlens`` argument carries: the
    call's own on thd; on sbhd and bshd, where the kernels read no ``cu_seqlens``, a rotate-half
    cos/sin cache's halves flag (:func:`halves_flag`) when the call's ``rows``
    (:func:`_rows_read`) hold at least ``HALVES_MIN_ROWS_READ`` entries, else ``None``."""
    tab, sin = _kernel_tables(table, rows)
    if (
        cu_seqlens is None and type(table) is CosSinCache and not interleaved
        and layout != "thd" and rows * tab.shape[1] >= HALVES_MIN_ROWS_READ
    ):
        cu_seqlens = halves_flag(table)
    return tab, sin, cu_seqlens


def _call_tables(
    call: RoPECall, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`_launch_tables` of a checked call's table, for its spec's ``cu_seqlens``,
    layout and pairing."""
    spec = call.spec
    return _launch_tables(call.table, rows, spec.cu_seqlens, spec.layout, spec.interleaved)


def _plan_flag(
    sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None, layout: str
) -> torch.Tensor | None:
    """The flag a plan's launches read by address (:func:`_flag_stale` keeps it fresh): a
    linear angle table's (its ``sin``) or a cos/sin cache's halves flag (its ``cu_seqlens`` on
    sbhd and bshd, :func:`_launch_tables`)."""
    if sin is not None and sin.dtype is _FLAG:
        return sin
    return cu_seqlens if layout != "thd" else None


def _tokens(t: torch.Tensor) -> int:
    return math.prod(t.shape[:-2])


def kernel_settings(spec: RoPESpec) -> tuple[str, bool, float, int, int]:
    """The spec's arguments every launch takes, in the launchers' order: ``(layout,
    interleaved, cos_sin_scale, cp_size, cp_rank)``."""
    return spec.layout, spec.interleaved, spec.cos_sin_scale, spec.cp_size, spec.cp_rank


def _rows_read(t: torch.Tensor, layout: str, index: torch.Tensor | None) -> int:
    """At most how many table rows a call on ``t`` reads: its sequence length for sbhd and bshd,
    whose batch entries share rows, and its token count for thd or where an index tensor
    places the tokens."""
    if index is not None or layout == "thd":
        return _tokens(t)
    return t.shape[0] if layout == "sbhd" else t.shape[1]


def lean_tile(n_tokens: int, heads: int, width: int, element_size: int) -> tuple[int, int]:
    """The lean kernel's ``(BLOCK_T, BLOCK_H)`` for tokens of ``heads`` heads moving ``width``
    channels each: a token's heads first, up to ``LEAN_HEADS``, then tokens (a power of two,
    at most the call's) while the tile moves at most ``LEAN_TILE_BYTES``."""
    block_h = min(_next_pow2(heads), LEAN_HEADS)
    fit = max(1, LEAN_TILE_BYTES // (block_h * width * element_size))
    return min(1 << (fit.bit_length() - 1), _next_pow2(n_tokens)), block_h


def _lean_fits(
    code: int, x: torch.Tensor, out: torch.Tensor, fresh_out: bool,
    positions: torch.Tensor | None, cp_size: int, seq_len: int, table_len: int,
) -> bool:
    """Whether a call runs the lean kernel (``LEAN_MAX_BYTES``): sbhd or bshd, positions by
    index, every one inside the table, no context parallelism, ``x`` contiguous and ``out``
    too (or ``x`` itself), at most ``LEAN_MAX_BYTES``. All of it is in the launch's ``_fast``
    key, so the key's compiled launch is the one this chose."""
    return (
        code != 2 and positions is None and cp_size == 1 and seq_len <= table_len
        and x.numel() * x.element_size() <= LEAN_MAX_BYTES
        and x.is_contiguous() and (fresh_out or out is x or out.is_contiguous())
    )


def _lean_arguments(
    n_tokens: int, dim1: int, heads: int, head_dim: int, width: int, rotary_dim: int,
    element_size: int, code: int, interleaved: bool, flags: tuple[bool, bool, bool, bool],
    backward: bool, scale: float, interpreted: bool,
) -> tuple[tuple[int, int, int], tuple[int, ...], dict[str, Any]]:
    """The lean kernel's grid, integer arguments and compile-time arguments for a call that
    :func:`_lean_fits`, at the tile :func:`lean_tile` gives (``width``: the channels a head
    moves, ``head_dim`` its stride)."""
    block_t, block_h = lean_tile(n_tokens, heads, width, element_size)
    use_cache, paired, rates, linear = flags
    block_r = _next_pow2(rotary_dim if interleaved else rotary_dim // 2)
    vector = lean_vector(block_t, block_h, block_r, interleaved, use_cache)
    grid = (-(-n_tokens // block_t) * -(-heads // block_h), 1, 1)
    consts = dict(
        LAYOUT=code, HEADS=heads, HEAD_DIM=head_dim, ROT_DIM=rotary_dim,
        PASS_DIM=width - rotary_dim, INTERLEAVED=interleaved, USE_CACHE=use_cache, PAIRED=paired,
        RATES=rates, LINEAR=linear, BACKWARD=backward, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_R=block_r, BLOCK_P=_next_pow2(width - rotary_dim), FAST_TRIG=not interpreted,
        SCALE=float(scale),
        # a thread's own channels' sines need no exchange
        SHARED_ROWS=shared_rows(block_t, block_h, use_cache) and vector == block_r,
        VECTOR=vector, ONE_SEQUENCE=dim1 == (1 if code == 0 else n_tokens),
    )
    return grid, (n_tokens, dim1, *division_magic(dim1)), consts


def launch(
    x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int, backward: bool,
    config: Config | None = None, fresh_out: bool = False, copy_pass: bool = True,
) -> torch.Tensor:
    """Run the kernel: ``out`` = RoPE of ``x`` (its transpose when ``backward``); returns ``out``.

    ``table`` is the float32 ``[s2, d2]`` angle table, or the cos table when ``sin`` is given,
    or, with ``sin`` the same tensor, a rate table's ``[rows, d2]`` view of its doubled rates
    (:func:`rope_dispatch.tables.kernel_tables`; :func:`_table_flags` tells them apart).
    ``x`` may have any strides; ``out`` (same shape) too. ``fresh_out`` promises that ``out``
    was allocated with ``torch.contiguous_format`` from ``x.shape`` (so its strides follow from
    that shape and need not be read). ``copy_pass=False`` leaves the pass-through channels
    alone (neither read nor written): with ``out`` being ``x``, an in-place rotation. On sbhd
    and bshd ``cu_seqlens`` is a cos/sin cache's halves flag or ``None``
    (:func:`_launch_tables`). No host sync, no allocation. The current CUDA device must be
    ``x``'s.
    """
    if sin is not None and sin.dtype is _FLAG:
        sin = current_flag(table, sin)
    if cu_seqlens is not None and layout != "thd":  # a cos/sin cache's halves flag
        cu_seqlens = current_halves(table, sin, cu_seqlens)
    if config is None and _kernels is not None and not _kernels.INTERPRETED:
        # Fast path: the same call signature as before -> the same compiled kernel, launched
        # directly.
        xp, op, tp = x.data_ptr(), out.data_ptr(), table.data_ptr()
        key, tail = _fast_key(
            x, xp, op, None if fresh_out else out.stride(), table, tp, sin, cu_seqlens,
            positions, layout, interleaved, scale, cp_size, cp_rank, backward, copy_pass,
        )
        entry = _fast.get(key)
        if entry is not None:
            run, prefix, grid, ints, consts = entry
            # raw addresses: the C launcher takes ints as they are, tensors via data_ptr()
            run(*grid, _current_stream(key[-2]), *prefix, xp, op, *tail, *ints, *consts)
            return out
    else:
        key = None
    kernels = _kernels if _kernels is not None else _load_kernels()
    shape = x.shape
    heads, head_dim = shape[-2], shape[-1]
    code = LAYOUT_CODES[layout]
    if code == 2:
        n_tokens = shape[0]
        sx0, sxh, sxd = x.stride()
        so0, soh, sod = out.stride()
        sx1 = so1 = 0
        dim1 = 1
        seq_len = n_tokens
        if cu_seqlens is not None and not cu_seqlens.is_contiguous():
            cu_seqlens = cu_seqlens.contiguous()
            key = None
        n_seqs = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1  # none: per-token positions
    else:
        n0, dim1 = shape[0], shape[1]
        n_tokens = n0 * dim1
        sx0, sx1, sxh, sxd = x.stride()
        so0, so1, soh, sod = out.stride()
        seq_len = n0 if code == 0 else dim1
        n_seqs = 0
    if n_tokens == 0 or heads == 0:
        return out
    if positions is not None and not positions.is_contiguous():
        positions = positions.contiguous()
        key = None
    rotary_dim = table.shape[1]
    width = head_dim if copy_pass else rotary_dim  # the channels a token moves
    flags = _table_flags(table, sin)
    halves = None if code == 2 else cu_seqlens  # the halves flag (the lean kernel reads rows)
    if config is None and _lean_fits(code, x, out, fresh_out, positions, cp_size, seq_len,
                                     table.shape[0]):
        kernel = kernels.rope_lean_kernel
        grid, ints, consts = _lean_arguments(
            n_tokens, dim1, heads, head_dim, width, rotary_dim, x.element_size(), code,
            interleaved, flags, backward, scale, kernels.INTERPRETED,
        )
        num_warps = WARPS
    else:
        kernel = kernels.rope_kernel
        if config is None:
            tokens_per_tile = tile_tokens(flags, table, rotary_dim, interleaved)
            cache_rows = reads_cache_rows(flags)
            sines = not flags[0]  # no cos/sin cache: the kernel computes sines
            ckey = (_next_pow2(n_tokens), heads, width, head_dim, rotary_dim, x.dtype, interleaved,
                    x.device, tokens_per_tile, cache_rows, sines)
            config = _configs.get(ckey)
            if config is None:
                sms = 1 if kernels.INTERPRETED else _sm_count(x.device.index)
                config = choose_config(
                    n_tokens, heads, width, rotary_dim, x.element_size(), interleaved, sms,
                    tokens_per_tile, cache_rows, span_dim=head_dim, sines=sines,
                )
                if len(_configs) > 1024:
                    _configs.clear()
                _configs[ckey] = config
        block_t, block_h, head_iters, block_r, block_p, num_warps = config
        grid = launch_grid(-(-heads // (block_h * head_iters)), -(-n_tokens // block_t))
        ints = (n_tokens, dim1, *division_magic(dim1), seq_len, table.shape[0], heads, n_seqs,
                cp_size, cp_rank, sx0, sx1, sxh, sxd, so0, so1, soh, sod)
        use_cache, paired, rates, linear = flags
        consts = dict(
            LAYOUT=code, ROT_DIM=rotary_dim, PASS_DIM=width - rotary_dim,
            INTERLEAVED=interleaved, USE_CACHE=use_cache, PAIRED=paired, RATES=rates, LINEAR=linear,
            POSITIONS=_position_kind(positions), CONTEXT_PARALLEL=cp_size > 1,
            BACKWARD=backward, BLOCK_T=block_t, BLOCK_H=block_h, HEAD_ITERS=head_iters,
            BLOCK_R=block_r, BLOCK_P=block_p, FAST_TRIG=not kernels.INTERPRETED,
            SEQ_BLOCK=_next_pow2(n_seqs + 1) if 0 < n_seqs < SEQ_SCAN_LIMIT else 0,
            SCALE=float(scale),
            SHARED_ROWS=shared_rows(block_t, block_h, use_cache, lean=False) and halves is None,
            HALVES=halves is not None,
        )
    compiled = kernel[grid](
        x, out, table, table if sin is None else sin,
        table if cu_seqlens is None else cu_seqlens,
        table if positions is None else positions, *ints,
        num_warps=num_warps, **consts,
    )
    if key is not None and compiled is not None and not _hooks_active():
        ordered = tuple(consts[name] for name in kernel.arg_names[6 + len(ints):])
        if len(_fast) > 4096:
            _fast.clear()
        _fast[key] = _direct_launcher(compiled) + (grid, ints, ordered)
    return out


# each compiled kernel's argument types (Triton's signature) by its CUfunction handle, for
# direct_launch.bind
kernel_types: dict[int, tuple[str, ...]] = {}


def _direct_launcher(compiled: Any) -> tuple[Any, tuple]:
    """``(fn, prefix)`` such that ``fn(gx, gy, gz, stream, *prefix, *kernel_args)`` launches
    ``compiled`` as Triton's own launch does, minus its per-call Python bookkeeping.

    Triton's CUDA launcher object wraps a C ``launch`` that also takes the cooperative-grid and
    PDL flags and two scratch buffers, allocated only when the kernel asks for scratch space (ours
    never does); where that layout is not found, the launcher object itself is used.
    """
    runner = compiled.run
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if isinstance(signature, dict):
        kernel_types[compiled.function] = tuple(signature.values())
    launch_c = getattr(runner, "launch", None)
    if (
        launch_c is not None
        and getattr(runner, "global_scratch_size", 1) == 0
        and getattr(runner, "profile_scratch_size", 1) == 0
        and hasattr(runner, "launch_cooperative_grid")
        and hasattr(runner, "launch_pdl")
    ):
        prefix = (
            compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None,
        )
        return launch_c, prefix
    return runner, (compiled.function, compiled.packed_metadata, None, None, None)


class _RoPEFunction(torch.autograd.Function):
    """Eager autograd around the direct launch (no dispatcher round trip): the backward is the
    same kernel transposed, saving only the tables, and is itself differentiable."""

    @staticmethod
    def forward(ctx, x, table, sin, cu_seqlens, starts, layout, interleaved, scale, cp_size,
                cp_rank, backward, out_strides):
        out = _allocate(x, out_strides)
        launch(x, out, table, sin, cu_seqlens, starts, layout, interleaved, scale, cp_size, cp_rank,
               backward, fresh_out=out_strides is None)
        ctx.tables = (table, sin, cu_seqlens, starts)
        ctx.settings = (layout, interleaved, scale, cp_size, cp_rank, not backward)
        ctx.grad_strides = _dense_strides(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            grad_x = _RoPEFunction.apply(grad, *ctx.tables, *ctx.settings, ctx.grad_strides)
        else:  # the usual backward: launch straight away (an autograd node costs host time)
            grad_x = _allocate(grad, ctx.grad_strides)
            launch(grad, grad_x, *ctx.tables, *ctx.settings, fresh_out=ctx.grad_strides is None)
        return (grad_x,) + (None,) * 11


class _RoPEInPlaceFunction(torch.autograd.Function):
    """Eager autograd for :func:`rope_dispatch.apply_`: the forward rotates ``x``'s rotary
    channels in place (marked dirty, so autograd sees the new version); the backward makes a
    new gradient, or, with ``grad_in_place`` and a writable gradient outside double backward,
    rotates the incoming gradient in place."""

    @staticmethod
    def forward(ctx, x, table, sin, cu_seqlens, starts, layout, interleaved, scale, cp_size,
                cp_rank, grad_in_place):
        launch(x, x, table, sin, cu_seqlens, starts, layout, interleaved, scale, cp_size, cp_rank,
               False, copy_pass=False)
        ctx.mark_dirty(x)
        ctx.tables = (table, sin, cu_seqlens, starts)
        ctx.settings = (layout, interleaved, scale, cp_size, cp_rank)
        ctx.grad_in_place = grad_in_place
        ctx.grad_strides = _dense_strides(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_in_place and not torch.is_grad_enabled() and expanded_dim(grad) is None:
            with _on_device(grad):
                launch(grad, grad, *ctx.tables, *ctx.settings, True, copy_pass=False)
            grad_x = grad
        else:
            grad_x = _RoPEFunction.apply(grad, *ctx.tables, *ctx.settings, True, ctx.grad_strides)
        return (grad_x,) + (None,) * 10


def _dense_strides(x: torch.Tensor) -> list[int] | None:
    """``x``'s strides when it is dense but not contiguous (so a gradient can share its layout);
    ``None`` for contiguous or non-dense tensors (the gradient is then contiguous)."""
    if x.is_contiguous():
        return None
    expected = 1
    for dim in sorted(range(x.dim()), key=lambda i: x.stride(i)):
        size = x.shape[dim]
        if size == 1:
            continue
        if x.stride(dim) != expected:
            return None
        expected *= size
    return list(x.stride())


def _allocate(x: torch.Tensor, out_strides: Sequence[int] | None) -> torch.Tensor:
    if out_strides is None:
        return x.new_empty(x.shape)
    return x.new_empty_strided(x.shape, out_strides)


@torch.library.custom_op("rope_dispatch::triton_rope", mutates_args=())
def triton_rope_op(
    x: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int, backward: bool,
    out_strides: Sequence[int] | None,
) -> torch.Tensor:
    """RoPE (or its transpose) through our Triton kernel, as an opaque op for torch.compile.

    The output has ``out_strides`` when given, else is contiguous.
    """
    out = _allocate(x, out_strides)
    with _on_device(x):
        return launch(
            x, out, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
            cp_rank, backward, fresh_out=out_strides is None,
        )


@triton_rope_op.register_fake
def _triton_rope_fake(
    x, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size, cp_rank, backward,
    out_strides,
):
    return _allocate(x, out_strides)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, table, sin, cu_seqlens, starts, layout, interleaved, scale, cp_size, cp_rank, backward = (
        inputs[:11]
    )
    ctx.save_for_backward(table, sin, cu_seqlens, starts)
    ctx.settings = (layout, interleaved, scale, cp_size, cp_rank, not backward)
    ctx.grad_strides = _dense_strides(x)


def _backward(ctx: Any, grad: torch.Tensor):
    table, sin, cu_seqlens, starts = ctx.saved_tensors
    grad_x = triton_rope_op(grad, table, sin, cu_seqlens, starts, *ctx.settings, ctx.grad_strides)
    return (grad_x,) + (None,) * 11


triton_rope_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Packed qkv: q and k rotated and v copied in one launch, forward and backward


Segment = tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]
"""One of q, k, v as the kernel sees it: ``(base tensor, element offset, shape, strides)`` of a
grouped view ``[n0, n1, groups, group, d]`` (``[T, groups, group, d]`` for thd), where head
``g * group + j`` lies at ``g * s_group + j * s_head``. Described by numbers rather than made
as a view: building nine views per call cost more host time than the rest of the launch."""


def packed_segments(qkv: torch.Tensor, split: Sequence[int]) -> tuple[Segment, Segment, Segment]:
    """q, k and v of a packed ``[.., h, q + k + v]`` tensor (``d = k``)."""
    q_len, d, v_len = split
    *lead, heads, _ = qkv.shape
    *lead_strides, s_head, s_chan = qkv.stride()
    strides = (*lead_strides, s_head, d * s_chan, s_chan)
    return (
        (qkv, 0, (*lead, heads, q_len // d, d), strides),
        (qkv, q_len * s_chan, (*lead, heads, 1, d), strides),
        (qkv, (q_len + d) * s_chan, (*lead, heads, v_len // d, d), strides),
    )


def head_segment(t: torch.Tensor, group: int) -> Segment:
    """A ``[.., H, d]`` tensor as ``H / group`` groups of ``group`` heads."""
    *lead, heads, d = t.shape
    *lead_strides, s_head, s_chan = t.stride()
    return (t, 0, (*lead, heads // group, group, d), (*lead_strides, group * s_head, s_head, s_chan))


def width_segment(t: torch.Tensor, d: int) -> Segment:
    """A ``[.., h, n * d]`` tensor (k or v of a packed call) as ``h`` groups of ``n`` heads."""
    *lead, heads, width = t.shape
    *lead_strides, s_head, s_chan = t.stride()
    return (t, 0, (*lead, heads, width // d, d), (*lead_strides, s_head, d * s_chan, s_chan))


def _view(segment: Segment) -> torch.Tensor:
    base, offset, shape, strides = segment
    return base.as_strided(shape, strides, base.storage_offset() + offset)


_fast_qkv: dict[tuple, tuple] = {}


def launch_qkv(
    xs: Sequence[Segment], outs: Sequence[Segment], tables: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int, backward: bool,
    config: Config | None = None, copy_pass: bool = True, key_only: bool = False,
) -> tuple | None:
    """One launch of ``rope_qkv_kernel``: ``outs[i]`` = RoPE of ``xs[i]`` for q (i = 0) and k
    (i = 1), each by its own table, and a copy for v (i = 2, when given); the transpose when
    ``backward``. ``tables`` are ``(q_table, q_sin, k_table, k_sin)`` (sin ``None`` for angle
    tables); on sbhd and bshd ``cu_seqlens`` is their one cos/sin cache's halves flag or
    ``None`` (:func:`_launch_tables`). ``copy_pass=False`` leaves the pass-through channels
    alone: with ``outs`` being ``xs``, q and k rotated in place. No host sync, no allocation;
    a repeated call signature launches the compiled kernel through Triton's C launcher from
    addresses and integers alone.
    ``key_only``: launch nothing, return the launch's key in ``_fast_qkv`` (``None`` when it
    would not use that cache), for a plan to bind the compiled kernel."""
    kernels = _kernels if _kernels is not None else _load_kernels()
    q_tab, q_sin, k_tab, k_sin = tables
    if q_sin is not None and q_sin.dtype is _FLAG:  # k's table is of q's kind (a flag too)
        shared = k_sin is q_sin
        q_sin = current_flag(q_tab, q_sin)
        k_sin = q_sin if shared or q_sin is None else current_flag(k_tab, k_sin)
        if k_sin is None:
            q_sin = None
    if cu_seqlens is not None and layout != "thd":  # their cos/sin cache's halves flag
        cu_seqlens = current_halves(q_tab, q_sin, cu_seqlens)
    has_v = len(xs) == 3
    pairs = tuple(zip(xs, outs)) if has_v else (*zip(xs, outs), (xs[1], outs[1]))
    shape = xs[0][2]
    thd = layout == "thd"
    if thd:
        n_seqs = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1  # none: per-token positions
        n_tokens, dim1, seq_len = shape[0], 1, shape[0]
    else:
        n_tokens, dim1, n_seqs = shape[0] * shape[1], shape[1], 0
        seq_len = shape[0] if layout == "sbhd" else shape[1]
    heads = tuple(x[2][-3] * x[2][-2] for x, _ in pairs)
    if n_tokens == 0 or min(heads) == 0:
        return None
    copied = (cu_seqlens is not None and not cu_seqlens.is_contiguous()) or (
        positions is not None and not positions.is_contiguous()
    )
    if copied:
        if key_only:
            return None  # the kernel reads a copy made per call: no launch to bind
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.contiguous()
        if positions is not None:
            positions = positions.contiguous()
    strides = tuple(
        stride for x, out in pairs for seg in (x, out)
        for stride in ((seg[3][0], 0, *seg[3][1:]) if thd else seg[3])
    )
    base_ints = (
        n_tokens, dim1, seq_len, q_tab.shape[0], k_tab.shape[0], n_seqs, cp_size, cp_rank,
        *heads, *(x[2][-2] for x, _ in pairs), *strides,
    )
    size = xs[0][0].element_size()
    index = (
        q_tab, q_tab if q_sin is None else q_sin, k_tab, k_tab if k_sin is None else k_sin,
        q_tab if cu_seqlens is None else cu_seqlens,
        q_tab if positions is None else positions,
    )
    addresses = (
        *(seg[0].data_ptr() + seg[1] * size for x, out in pairs for seg in (x, out)),
        *(t.data_ptr() for t in index),
    )
    key = None
    if not kernels.INTERPRETED and config is None:
        key = _qkv_key(base_ints, addresses, xs[0][0], layout, interleaved, scale, q_sin,
                       cu_seqlens, positions, backward, has_v, q_tab, copy_pass)
        if key_only:
            return key
        entry = _fast_qkv.get(key)
        if entry is not None:
            run, prefix, grid, ints, ordered = entry
            run(*grid, _current_stream(key[-1]), *prefix, *addresses, *ints, *ordered)
            return key
    if key_only:
        return None
    rotary_dim = q_tab.shape[1]
    head_dim = shape[-1] if copy_pass else rotary_dim  # the channels a token moves
    flags = _table_flags(q_tab, q_sin)  # k's table is of q's kind
    if config is None:
        sms = 1 if kernels.INTERPRETED else _sm_count(xs[0][0].device.index)
        config = choose_config(n_tokens, heads if has_v else heads[:2], head_dim, rotary_dim,
                               size, interleaved, sms,
                               tile_tokens(flags, q_tab, rotary_dim, interleaved),
                               reads_cache_rows(flags), span_dim=shape[-1],
                               sines=not flags[0])
    block_t, block_h, head_iters, block_r, block_p, num_warps = config
    groups = [-(-n // (block_h * head_iters)) for n in heads]
    grid = launch_grid(sum(groups) if has_v else groups[0] + groups[1], -(-n_tokens // block_t))
    # the kernel's order: the token numbering's division magic, per-segment heads and group
    ints = (*base_ints[:2], *division_magic(dim1), *base_ints[2:8], heads[0], base_ints[11],
            heads[1], base_ints[12], heads[2], base_ints[13], *strides)
    use_cache, paired, rates, linear = flags
    consts = dict(
        LAYOUT=LAYOUT_CODES[layout], ROT_DIM=rotary_dim, PASS_DIM=head_dim - rotary_dim,
        INTERLEAVED=interleaved, USE_CACHE=use_cache, PAIRED=paired, RATES=rates, LINEAR=linear,
        POSITIONS=_position_kind(positions), CONTEXT_PARALLEL=cp_size > 1,
        BACKWARD=backward, BLOCK_T=block_t, BLOCK_H=block_h, HEAD_ITERS=head_iters,
        BLOCK_R=block_r, BLOCK_P=block_p, FAST_TRIG=not kernels.INTERPRETED,
        SEQ_BLOCK=_next_pow2(n_seqs + 1) if 0 < n_seqs < SEQ_SCAN_LIMIT else 0,
        HAS_V=has_v, V_WIDTH=head_dim, BLOCK_W=_next_pow2(head_dim), SCALE=float(scale),
        HALVES=not thd and cu_seqlens is not None,
    )
    views = tuple(_view(seg) for x, out in pairs for seg in (x, out))
    compiled = kernels.rope_qkv_kernel[grid](*views, *index, *ints, num_warps=num_warps, **consts)
    if key is not None and compiled is not None and not _hooks_active():
        names = kernels.rope_qkv_kernel.arg_names
        ordered = tuple(consts[name] for name in names[len(views) + len(index) + len(ints):])
        if len(_fast_qkv) > 1024:
            _fast_qkv.clear()
        _fast_qkv[key] = _direct_launcher(compiled) + (grid, ints, ordered)
    return key


def _qkv_key(
    base_ints: tuple, addresses: tuple[int, ...], x: torch.Tensor, layout: str, interleaved: bool,
    scale: float, q_sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    positions: torch.Tensor | None,
    backward: bool, has_v: bool, q_tab: torch.Tensor, copy_pass: bool,
) -> tuple:
    """The key of a ``rope_qkv_kernel`` launch's compiled kernel in ``_fast_qkv``: every input of
    Triton's specialisation (the integers, each pointer's dtype and 16-byte alignment, the
    constants); its last item is the device index. An int32 and an int64 index tensor compile
    to different kernels: one must never run the other's."""
    aligned = tuple(a & 15 == 0 for a in addresses)
    return (base_ints, aligned, x.dtype, layout, interleaved, scale,
            None if q_sin is None else (q_sin.shape[-1], q_sin.dtype, _is_rates(q_tab, q_sin)),
            q_tab.dtype,
            None if cu_seqlens is None else cu_seqlens.dtype,
            None if positions is None else positions.dtype, _position_kind(positions), backward,
            has_v, q_tab.shape[1], copy_pass, x.get_device())


def _qkv_forward(
    qkv: torch.Tensor, split: Sequence[int], tables: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor | None, starts: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New contiguous q ``[.., h * q/d, d]``, k ``[.., h, k]``, v ``[.., h, v]`` of a packed qkv."""
    q, k, v = _qkv_outputs(qkv, split)
    d = split[1]
    launch_qkv(
        packed_segments(qkv, split),
        (head_segment(q, split[0] // d), width_segment(k, d), width_segment(v, d)),
        tables, cu_seqlens, starts, layout, interleaved, scale, cp_size, cp_rank, False,
    )
    return q, k, v


def _qkv_outputs(qkv: torch.Tensor, split: Sequence[int]) -> tuple[torch.Tensor, ...]:
    q_len, d, v_len = split
    lead, heads = qkv.shape[:-2], qkv.shape[-2]
    return (
        qkv.new_empty(*lead, heads * (q_len // d), d),
        qkv.new_empty(*lead, heads, d),
        qkv.new_empty(*lead, heads, v_len),
    )


def _qkv_transpose(
    gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, split: Sequence[int],
    tables: Sequence[torch.Tensor | None], cu_seqlens: torch.Tensor | None,
    starts: torch.Tensor | None, layout: str, interleaved: bool, scale: float, cp_size: int,
    cp_rank: int,
    grad_strides: Sequence[int] | None,
) -> torch.Tensor:
    """The packed gradient ``[.., h, q + k + v]`` of q's, k's and v's gradients (any strides):
    q and k rotated back, v copied, in one launch (in ``grad_strides`` when given)."""
    d = split[1]
    grad = _allocate_shape(gk, (*gk.shape[:-1], sum(split)), grad_strides)
    launch_qkv(
        (head_segment(gq, split[0] // d), width_segment(gk, d), width_segment(gv, d)),
        packed_segments(grad, split), tables, cu_seqlens, starts, layout, interleaved, scale,
        cp_size, cp_rank, True,
    )
    return grad


def _allocate_shape(
    like: torch.Tensor, shape: Sequence[int], strides: Sequence[int] | None
) -> torch.Tensor:
    if strides is None:
        return like.new_empty(shape)
    return like.new_empty_strided(shape, strides)


class _QKVFunction(torch.autograd.Function):
    """Eager autograd for packed qkv: one launch forward; the backward is
    :class:`_QKVTransposeFunction`, whose own backward is this function again."""

    @staticmethod
    def forward(ctx, qkv, q_tab, q_sin, k_tab, k_sin, cu_seqlens, starts, split, layout,
                interleaved, scale, cp_size, cp_rank):
        with _on_device(qkv):
            out = _qkv_forward(qkv, split, (q_tab, q_sin, k_tab, k_sin), cu_seqlens, starts,
                               layout, interleaved, scale, cp_size, cp_rank)
        ctx.inputs = (q_tab, q_sin, k_tab, k_sin, cu_seqlens, starts, split, layout,
                      interleaved, scale, cp_size, cp_rank)
        ctx.grad_strides = _dense_strides(qkv)
        return out

    @staticmethod
    def backward(ctx, gq, gk, gv):
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            grad = _QKVTransposeFunction.apply(gq, gk, gv, *ctx.inputs, ctx.grad_strides)
        else:  # the usual backward: launch straight away (an autograd node costs host time)
            tables, index, settings = ctx.inputs[:4], ctx.inputs[4:6], ctx.inputs[6:]
            grad = _qkv_transpose(gq, gk, gv, settings[0], tables, *index, *settings[1:],
                                  ctx.grad_strides)
        return (grad,) + (None,) * 12


class _QKVTransposeFunction(torch.autograd.Function):
    """q's, k's and v's gradients into one packed gradient (one launch)."""

    @staticmethod
    def forward(ctx, gq, gk, gv, q_tab, q_sin, k_tab, k_sin, cu_seqlens, starts, split, layout,
                interleaved, scale, cp_size, cp_rank, grad_strides):
        ctx.inputs = (q_tab, q_sin, k_tab, k_sin, cu_seqlens, starts, split, layout,
                      interleaved, scale, cp_size, cp_rank)
        with _on_device(gk):
            return _qkv_transpose(gq, gk, gv, split, (q_tab, q_sin, k_tab, k_sin), cu_seqlens,
                                  starts, layout, interleaved, scale, cp_size, cp_rank,
                                  grad_strides)

    @staticmethod
    def backward(ctx, grad):
        gq, gk, gv = _QKVFunction.apply(grad, *ctx.inputs)
        return (gq, gk, gv) + (None,) * 13


@torch.library.custom_op("rope_dispatch::triton_rope_qkv", mutates_args=())
def triton_rope_qkv_op(
    qkv: torch.Tensor, q_tab: torch.Tensor, q_sin: torch.Tensor | None, k_tab: torch.Tensor,
    k_sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    positions: torch.Tensor | None, split: Sequence[int], layout: str, interleaved: bool,
    scale: float,
    cp_size: int, cp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed qkv RoPE through our Triton kernel, as an opaque op for torch.compile."""
    with _on_device(qkv):
        return _qkv_forward(qkv, split, (q_tab, q_sin, k_tab, k_sin), cu_seqlens,
                            positions, layout, interleaved, scale, cp_size, cp_rank)


@triton_rope_qkv_op.register_fake
def _triton_rope_qkv_fake(qkv, q_tab, q_sin, k_tab, k_sin, cu_seqlens, positions, split,
                          layout, interleaved, scale, cp_size, cp_rank):
    return _qkv_outputs(qkv, split)


@torch.library.custom_op("rope_dispatch::triton_rope_qkv_transpose", mutates_args=())
def triton_rope_qkv_transpose_op(
    gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, q_tab: torch.Tensor,
    q_sin: torch.Tensor | None, k_tab: torch.Tensor, k_sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, split: Sequence[int],
    layout: str, interleaved: bool, scale: float, cp_size: int, cp_rank: int,
    grad_strides: Sequence[int] | None,
) -> torch.Tensor:
    """The packed gradient of q's, k's and v's gradients, as an opaque op for torch.compile."""
    with _on_device(gk):
        return _qkv_transpose(gq, gk, gv, split, (q_tab, q_sin, k_tab, k_sin), cu_seqlens,
                              positions, layout, interleaved, scale, cp_size, cp_rank,
                              grad_strides)


@triton_rope_qkv_transpose_op.register_fake
def _triton_rope_qkv_transpose_fake(gq, gk, gv, q_tab, q_sin, k_tab, k_sin, cu_seqlens,
                                    positions, split, layout, interleaved, scale, cp_size,
                                    cp_rank, grad_strides):
    return _allocate_shape(gk, (*gk.shape[:-1], sum(split)), grad_strides)


def _qkv_setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    qkv, *tables_and_settings = inputs
    ctx.save_for_backward(*tables_and_settings[:6])
    ctx.settings = tuple(tables_and_settings[6:])
    ctx.grad_strides = _dense_strides(qkv)


def _qkv_backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):
    grad = triton_rope_qkv_transpose_op(gq, gk, gv, *ctx.saved_tensors, *ctx.settings,
                                        ctx.grad_strides)
    return (grad,) + (None,) * 12


def _qkv_transpose_setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[3:9])
    ctx.settings = tuple(inputs[9:15])


def _qkv_transpose_backward(ctx: Any, grad: torch.Tensor):
    gq, gk, gv = triton_rope_qkv_op(grad, *ctx.saved_tensors, *ctx.settings)
    return (gq, gk, gv) + (None,) * 13


triton_rope_qkv_op.register_autograd(_qkv_backward, setup_context=_qkv_setup_context)
triton_rope_qkv_transpose_op.register_autograd(
    _qkv_transpose_backward, setup_context=_qkv_transpose_setup_context
)


def rope_triton_qkv(call: RoPECall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed qkv RoPE of a checked call: q ``[.., h * q/d, d]``, k ``[.., h, k]``, v
    ``[.., h, v]``, new and contiguous; eager autograd or, while tracing, the custom ops."""
    spec = call.spec
    cu = spec.cu_seqlens
    settings = (call.split, *kernel_settings(spec))
    if _traced(call.t):
        k_table = call.table if call.k_table is None else call.k_table
        return triton_rope_qkv_op(call.t, *kernel_tables(call.table), *kernel_tables(k_table), cu,
                                  position_index(call), *settings)
    rows = _rows_read(call.t, spec.layout, position_index(call))
    if call.k_table is None:  # one table: its halves flag, if any, serves q and k
        tab, sin, cu = _call_tables(call, rows)
        q_tables = k_tables = (tab, sin)
    else:
        q_tables = _kernel_tables(call.table, rows)
        k_tables = _kernel_tables(call.k_table, rows)
        if (q_tables[1] is None) != (k_tables[1] is None):  # one kernel reads both tables alike
            q_tables, k_tables = kernel_tables(call.table), kernel_tables(call.k_table)
    tables = (*q_tables, *k_tables)
    args = (call.t, *tables, cu, position_index(call), *settings)
    if call.t.requires_grad and torch.is_grad_enabled():
        return _QKVFunction.apply(*args)
    with _on_device(call.t):
        return _qkv_forward(call.t, call.split, tables, *args[5:7], *args[8:])


# ---------------------------------------------------------------------------------------------
# q and k pairs: the same kernel with two segments and no v


def _qk_launch(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
    tables: Sequence[torch.Tensor | None], cu_seqlens: torch.Tensor | None,
    positions: torch.Tensor | None, layout: str, interleaved: bool, scale: float, cp_size: int,
    cp_rank: int,
    backward: bool, copy_pass: bool = True, key_only: bool = False,
) -> tuple | None:
    return launch_qkv(
        (head_segment(q, 1), head_segment(k, 1)), (head_segment(q_out, 1), head_segment(k_out, 1)),
        (*tables, *tables), cu_seqlens, positions, layout, interleaved, scale, cp_size, cp_rank,
        backward, copy_pass=copy_pass, key_only=key_only,
    )


def _qk_outputs(
    q: torch.Tensor, k: torch.Tensor, strides: Sequence[Sequence[int] | None] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q_strides, k_strides = (None, None) if strides is None else strides
    return _allocate(q, q_strides), _allocate(k, k_strides)


def _qk_rope(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int, backward: bool,
    strides: Sequence[Sequence[int] | None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(q_out, k_out)``: RoPE of q and k (the transpose when ``backward``) in one launch,
    in ``strides`` when given, else contiguous."""
    q_out, k_out = _qk_outputs(q, k, strides)
    with _on_device(q):
        _qk_launch(q, k, q_out, k_out, (table, sin), cu_seqlens, positions, layout, interleaved,
                   scale, cp_size, cp_rank, backward)
    return q_out, k_out


class _QKFunction(torch.autograd.Function):
    """Eager autograd for a q and k pair: one launch each way; the backward is this function
    with ``backward`` flipped, so it is twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                cp_rank, backward, strides):
        ctx.tables = (table, sin, cu_seqlens, positions)
        ctx.settings = (layout, interleaved, scale, cp_size, cp_rank, not backward)
        ctx.grad_strides = (_dense_strides(q), _dense_strides(k))
        return _qk_rope(q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale,
                        cp_size, cp_rank, backward, strides)

    @staticmethod
    def backward(ctx, gq, gk):
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            grads = _QKFunction.apply(gq, gk, *ctx.tables, *ctx.settings, ctx.grad_strides)
        else:
            grads = _qk_rope(gq, gk, *ctx.tables, *ctx.settings, ctx.grad_strides)
        return (*grads,) + (None,) * 11


class _QKInPlaceFunction(torch.autograd.Function):
    """Eager autograd for :func:`rope_dispatch.apply_qk_`: q and k rotated in place in one
    launch (marked dirty); the backward makes new gradients or, with ``grad_in_place`` and
    writable gradients outside double backward, rotates the incoming ones in place."""

    @staticmethod
    def forward(ctx, q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                cp_rank, grad_in_place):
        with _on_device(q):
            _qk_launch(q, k, q, k, (table, sin), cu_seqlens, positions, layout, interleaved, scale,
                       cp_size, cp_rank, False, copy_pass=False)
        ctx.mark_dirty(q, k)
        ctx.tables = (table, sin, cu_seqlens, positions)
        ctx.settings = (layout, interleaved, scale, cp_size, cp_rank)
        ctx.grad_in_place = grad_in_place
        ctx.grad_strides = (_dense_strides(q), _dense_strides(k))
        return q, k

    @staticmethod
    def backward(ctx, gq, gk):
        if (
            ctx.grad_in_place and not torch.is_grad_enabled()
            and expanded_dim(gq) is None and expanded_dim(gk) is None
        ):
            table, sin, cu_seqlens, positions = ctx.tables
            with _on_device(gq):
                _qk_launch(gq, gk, gq, gk, (table, sin), cu_seqlens, positions, *ctx.settings,
                           True, copy_pass=False)
            grads = (gq, gk)
        else:
            grads = _QKFunction.apply(gq, gk, *ctx.tables, *ctx.settings, True, ctx.grad_strides)
        return (*grads,) + (None,) * 10


@torch.library.custom_op("rope_dispatch::triton_rope_qk", mutates_args=())
def triton_rope_qk_op(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, positions: torch.Tensor | None, layout: str,
    interleaved: bool, scale: float, cp_size: int, cp_rank: int, backward: bool,
    q_strides: Sequence[int] | None, k_strides: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A q and k pair through our Triton kernel, as an opaque op for torch.compile."""
    return _qk_rope(q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                    cp_rank, backward, (q_strides, k_strides))


@triton_rope_qk_op.register_fake
def _triton_rope_qk_fake(q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale,
                         cp_size, cp_rank, backward, q_strides, k_strides):
    return _qk_outputs(q, k, (q_strides, k_strides))


def _qk_setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, table, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size = inputs[:10]
    cp_rank, backward = inputs[10:12]
    ctx.save_for_backward(table, sin, cu_seqlens, positions)
    ctx.settings = (layout, interleaved, scale, cp_size, cp_rank, not backward)
    ctx.grad_strides = (_dense_strides(q), _dense_strides(k))


def _qk_backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor):
    grads = triton_rope_qk_op(gq, gk, *ctx.saved_tensors, *ctx.settings, *ctx.grad_strides)
    return (*grads,) + (None,) * 12


triton_rope_qk_op.register_autograd(_qk_backward, setup_context=_qk_setup_context)


def rope_triton_qk(call: RoPECall) -> tuple[torch.Tensor, torch.Tensor]:
    """A q and k pair of a checked call: new ``(q_out, k_out)``, or ``(q, k)`` rotated in place
    (``call.in_place``); eager autograd or, while tracing, the custom op."""
    spec, q, k, index = call.spec, call.t, call.k, position_index(call)
    grad = (q.requires_grad or k.requires_grad) and torch.is_grad_enabled()
    if not (q.shape[-2] and k.shape[-2]) or (
        call.in_place and grad and (q._is_view() or k._is_view())
    ):
        return _qk_one_by_one(call, index)
    if _traced(q, k):
        table, sin = kernel_tables(call.table)
        q_out, k_out = triton_rope_qk_op(q, k, table, sin, spec.cu_seqlens, index,
                                         *kernel_settings(spec), False, None, None)
        return (q.copy_(q_out), k.copy_(k_out)) if call.in_place else (q_out, k_out)
    table, sin, cu = _call_tables(call, _rows_read(q, spec.layout, index))
    args = (table, sin, cu, index, *kernel_settings(spec))
    if call.in_place:
        if grad:
            return _QKInPlaceFunction.apply(q, k, *args, call.grad_in_place)
        with _on_device(q):
            _qk_launch(q, k, q, k, (table, sin), *args[2:], False, copy_pass=False)
        increment_version(q)
        increment_version(k)
        return q, k
    if grad:
        return _QKFunction.apply(q, k, *args, False, None)
    return _qk_rope(q, k, *args, False, None)


def _rope_triton_of(call: RoPECall, x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """:func:`rope_triton` of ``x`` (the call's ``t``, or its ``k``) with the checked call's
    table, spec and in-place settings."""
    spec = call.spec
    return rope_triton(
        x, call.table, layout=spec.layout, interleaved=spec.interleaved,
        scale=spec.cos_sin_scale, cu_seqlens=spec.cu_seqlens, positions=index,
        cp_size=spec.cp_size, cp_rank=spec.cp_rank, in_place=call.in_place,
        grad_in_place=call.grad_in_place,
    )


def _qk_one_by_one(call: RoPECall, index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as two single-tensor calls, where one launch cannot serve the pair: a side with
    no heads (the pair's launch tiles both), or an in-place pair with a gradient where either
    is a view (torch lets a Function that rotates a view in place return only that tensor)."""
    return _rope_triton_of(call, call.t, index), _rope_triton_of(call, call.k, index)


_NO_GUARD = contextlib.nullcontext()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _traced(*tensors: torch.Tensor) -> bool:
    """Whether the call goes to the custom ops: while ``torch.compile`` traces, or for tensor
    subclasses. Asked before anything reads a tensor's host-side state (``is_inference``,
    ``data_ptr``, ``_version``, a table's flag), which a trace refuses; the ops then take the
    table's plain kernel form."""
    return torch.compiler.is_compiling() or any(type(t) not in _PLAIN_TENSORS for t in tensors)


@functools.lru_cache(maxsize=1)
def _several_gpus() -> bool:
    return torch.cuda.device_count() > 1


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for the launch (a no-op in the usual single-device case)."""
    if t.is_cuda and _several_gpus() and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def rope_triton(
    t: torch.Tensor, table: RotaryTable, *, layout: str, interleaved: bool = False,
    scale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    cp_size: int = 1, cp_rank: int = 0, in_place: bool = False, grad_in_place: bool = False,
) -> torch.Tensor:
    """RoPE of already-checked tensors: ``table`` is ``[s2, d2]`` float32 angles or a cache of
    either kind.

    In eager mode it launches the kernel directly (through a ``torch.autograd.Function`` when a
    gradient is needed); while tracing, or for tensor subclasses, it calls the
    ``rope_dispatch::triton_rope`` op. ``in_place``: rotate ``t``'s rotary channels in place
    and return ``t`` (while tracing: the op's result copied into ``t``).
    """
    if _traced(t):
        tab, sin = kernel_tables(table)
        out = triton_rope_op(
            t, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size, cp_rank,
            False, None,
        )
        return t.copy_(out) if in_place else out
    tab, sin, cu_seqlens = _launch_tables(
        table, _rows_read(t, layout, positions), cu_seqlens, layout, interleaved
    )
    if in_place:
        with _on_device(t):
            if t.requires_grad and torch.is_grad_enabled():
                return _RoPEInPlaceFunction.apply(
                    t, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                    cp_rank, grad_in_place,
                )
            launch(t, t, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                   cp_rank, False, copy_pass=False)
        increment_version(t)
        return t
    if t.requires_grad and torch.is_grad_enabled():
        with _on_device(t):
            return _RoPEFunction.apply(
                t, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size, cp_rank,
                False, None,
            )
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    if _several_gpus() and t.is_cuda:
        with _on_device(t):
            return launch(
                t, out, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size,
                cp_rank, False, fresh_out=True,
            )
    return launch(  # one GPU (the usual case): no device guard to enter
        t, out, tab, sin, cu_seqlens, positions, layout, interleaved, scale, cp_size, cp_rank,
        False, fresh_out=True,
    )


def _user_table_address(call: RoPECall) -> int:
    """The address of the table (the cos table of a cache) the user passed, which dispatch
    checks with every planned call."""
    address = table_address(call.table)
    return address if isinstance(address, int) else address[0]


def _flag_of(sin: torch.Tensor | None) -> torch.Tensor | None:
    """``sin`` when it is a linear angle table's flag (:func:`_kernel_tables`)."""
    return sin if sin is not None and sin.dtype is _FLAG else None


def _flag_stale(flag: torch.Tensor, freqs: torch.Tensor, stream: int) -> bool:
    """Whether a plan must not launch on ``stream`` (the raw current stream of the current
    device) with the address of ``flag``, the flag of ``freqs``'s angle table: the table was
    written since its check (the generic path checks it again), a CUDA graph is being captured
    (a replay must read the rows; :func:`_capturing_on`), or ``ROPE_DISPATCH_LINEAR_TABLES=0``
    was set since the plan was made. One Python frame (``_capturing_on``'s test written out, the
    switch read raw): it runs twice in each planned forward + backward, once on the autograd
    engine's thread."""
    return (
        flag._rope_version != freqs._version  # type: ignore[attr-defined]
        or (stream != 0 and _stream_capturing())
        or _linear_tables_raw() == _LINEAR_TABLES_OFF
    )


def _forward_entry(call: RoPECall) -> tuple[tuple, tuple, tuple | None, torch.Tensor | None]:
    """The ``_fast`` key of a single-tensor call's forward launch (in place or into a fresh
    output), its table, sin, cu_seqlens and index addresses, the compiled launch stored
    under that key by the call that just ran (``None`` when there is none), and the table's
    linearity flag or its cos/sin cache's halves flag when the launch reads one."""
    t, spec, in_place, index = call.t, call.spec, call.in_place, position_index(call)
    table, sin, cu = _call_tables(call, _rows_read(t, spec.layout, index))
    key, tail = _fast_key(
        t, t.data_ptr(), t.data_ptr() if in_place else 0, t.stride() if in_place else None,
        table, table.data_ptr(), sin, cu, index, *kernel_settings(spec), False,
        not in_place,
    )
    return key, tail, _fast.get(key), _plan_flag(sin, cu, spec.layout)


def _bound_launch(call: RoPECall, generic: Plan) -> Plan:
    """A plan launching ``call``'s compiled kernel (compiled by the call that just ran) on new
    inputs of the same shape, strides, dtype and device: an output allocation (none in place),
    address reads and Triton's C launcher. It holds addresses, never tensors: dispatch checks
    with each call that ``freqs`` still holds the memory it held at plan time, and a call that
    ran on a contiguous copy of a strided table is never bound (``generic`` serves it). Only a
    kernel compiled for 16-byte aligned inputs is bound; ``generic`` also serves unaligned
    inputs and calls made while another device is current. The index tensor (start or
    per-token positions), when the call has one, is read by address too, and so is a linear
    angle table's flag while the table is unchanged since its check (:func:`_flag_stale`)."""
    t, in_place = call.t, call.in_place
    index = position_index(call)
    key, tail, entry, flag = _forward_entry(call)
    # not compiled, for unaligned inputs, or on a contiguous copy of a strided angle table
    # (dispatch checks each call that ``freqs`` holds the memory it held at plan time; the kernel
    # must read that memory): keep it rare
    if (
        entry is None or not key[-1] & 1 or (index is not None and key[-1] != 63)
        or tail[0] != _user_table_address(call)
    ):
        return generic
    run, prefix, head, ints, consts = entry
    bound_table = tail[0]
    bound_tables = tail[:3]
    rest = ints + consts
    device_index = key[-2]
    guard = _several_gpus()
    stream = _current_stream
    current_device = torch.cuda.current_device
    contiguous = t.is_contiguous()
    empty_like = torch.empty_like
    dense = torch.contiguous_format
    # out of place on a contiguous tensor: the allocation and launch as one call
    direct = None if in_place or not contiguous else _direct_call(
        (run, prefix, head, rest), (0, 0, *bound_tables, 0), 2, ((0, 0, 0), (1, 5, 0)),
        ((0, tuple(t.shape)),), ((0, 1, 0),))

    def launch_bound(
        x: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
        positions: torch.Tensor | None, k: None,
    ) -> torch.Tensor:
        xp = x.data_ptr()
        given = positions if start_positions is None else start_positions
        ip = bound_table if given is None else given.data_ptr()
        s = stream(device_index)
        if (xp | ip) & 15 or (guard and current_device() != device_index) or (
            flag is not None and _flag_stale(flag, freqs, s)
        ):
            return generic(x, freqs, spec, start_positions, positions, k)
        if in_place:
            run(*head, s, *prefix, xp, xp, *bound_tables, ip, *rest)
            increment_version(x)
            return x
        if direct is not None:
            return direct(s, x, ip)
        out = empty_like(x) if contiguous else empty_like(x, memory_format=dense)
        run(*head, s, *prefix, xp, out.data_ptr(), *bound_tables, ip, *rest)
        return out

    return launch_bound


def _direct_call(bound: tuple, leading: tuple, inputs: int, takes: tuple, makes: tuple,
                 fills: tuple) -> Any:
    """A bound launch (``(run, prefix, grid, rest)``) as one ``direct_launch`` call that
    allocates its outputs too, or ``None``: ``leading`` are the kernel's arguments before
    ``rest``, with placeholders where ``takes`` and ``fills`` write addresses."""
    _, prefix, grid, rest = bound
    return direct_launch.bind(prefix, grid, kernel_types.get(prefix[0]), leading + rest, inputs,
                              takes, makes, fills)


def _pair_direct_call(bound: tuple, tables: tuple[int, int, int], q_shape: tuple[int, ...],
                      k_shape: tuple[int, ...]) -> Any:
    """A bound launch of a q and k pair, out of place into new contiguous q and k, as one
    ``direct_launch`` call on ``(q, k, index)`` (k fills the kernel's v segment too)."""
    tp, sp, cp = tables
    return _direct_call(bound, (0,) * 6 + (tp, sp, tp, sp, cp, 0), 3,
                        ((0, 0, 0), (1, 2, 0), (1, 4, 0), (2, 11, 0)),
                        ((0, tuple(q_shape)), (1, tuple(k_shape))),
                        ((0, 1, 0), (1, 3, 0), (1, 5, 0)))


def _bound_entry(entry: tuple) -> tuple:
    """A ``_fast`` or ``_fast_qkv`` entry as a plan launches it: ``(run, prefix, grid, rest)``,
    the integer and constant arguments joined once."""
    run, prefix, grid, ints, consts = entry
    return run, prefix, grid, ints + consts


def _back_launch(launches: Any, cache: dict) -> tuple | None:
    """The transposed launch of a planned call with a gradient (``launches.back_key`` in
    ``cache``), bound the first time a backward finds it compiled and kept from then on."""
    if launches.back is None:
        entry = cache.get(launches.back_key)
        if entry is not None:
            launches.back = _bound_entry(entry)
    return launches.back


def _generic_tables(
    freqs: object, rows: int, index: torch.Tensor | None, per_token: bool,
    cu_seqlens: torch.Tensor | None, settings: tuple,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What a planned backward's generic launch reads: the table in its kernel form and the
    launch's ``cu_seqlens`` argument (a linear angle table's or a cos/sin cache's flag checked
    again, :func:`_launch_tables`; ``settings``: :func:`kernel_settings`'s) and the index tensor
    in the kernels' per-token form (:func:`position_index`)."""
    table = angles_2d(freqs) if isinstance(freqs, torch.Tensor) else freqs
    tab, sin, cu_seqlens = _launch_tables(table, rows, cu_seqlens, *settings[:2])
    if index is not None and per_token and index.dim() == 1:
        index = index.unsqueeze(-1)
    return tab, sin, cu_seqlens, index


class _GradLaunch:
    """The launches of a planned call with a gradient (:func:`_bound_grad_launch`): the
    forward bound as :func:`_bound_launch` binds it, the transposed kernel bound at the first
    backward that finds it compiled. Holds addresses and compiled kernels, never tensors."""

    __slots__ = ("run", "prefix", "head", "tables", "rest", "device", "back_key", "back",
                 "settings", "per_token", "flag", "shape", "direct", "back_direct")

    def __init__(
        self, key: tuple, tail: tuple, entry: tuple, settings: tuple, per_token: bool,
        flag: torch.Tensor | None, shape: tuple[int, ...],
    ):
        self.run, self.prefix, self.head, ints, consts = entry
        self.tables = tail[:3]
        self.rest = ints + consts
        self.device = key[-2]
        self.back_key = key[:12] + (True,) + key[13:]  # the transposed launch's _fast key
        self.back: tuple | None = None
        self.settings = settings
        self.per_token = per_token
        self.flag = flag  # a linear angle table's flag, read by address
        self.shape = shape
        # either launch as one call that allocates its output too (direct_launch), or None
        self.direct = self._direct((self.run, self.prefix, self.head, self.rest))
        self.back_direct: Any = None  # bound with ``back``; False when it cannot be

    def _direct(self, bound: tuple) -> Any:
        """``bound`` (the forward or the transposed launch) as one ``direct_launch`` call on
        the tensor and the index (or the table's address standing for none)."""
        return _direct_call(bound, (0, 0, *self.tables, 0), 2, ((0, 0, 0), (1, 5, 0)),
                            ((0, self.shape),), ((0, 1, 0),))

    def forward(self, x: torch.Tensor, index: torch.Tensor | None, stream: int) -> torch.Tensor:
        if self.direct is not None:  # the plan checked x's and the index's alignment
            return self.direct(stream, x, self.tables[0] if index is None else index)
        out = torch.empty_like(x)
        ip = self.tables[0] if index is None else index.data_ptr()
        self.run(*self.head, stream, *self.prefix, x.data_ptr(),
                 out.data_ptr(), *self.tables, ip, *self.rest)
        return out

    def backward(
        self, grad: torch.Tensor, freqs: RotaryTable, index: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The transpose of the forward on ``grad``: the bound launch when ``grad`` is laid
        out as the forward's input was (contiguous, aligned) and no graph of the backward is
        wanted, else the generic launch (any strides) or, for double backward, the
        differentiable function."""
        stream = _current_stream(self.device)
        if (
            not torch.is_grad_enabled() and grad.is_contiguous()
            and (self.flag is None or not _flag_stale(self.flag, freqs, stream))
        ):
            direct = self.back_direct
            if direct is None:
                back = _back_launch(self, _fast)
                if back is not None:
                    direct = self.back_direct = self._direct(back) or False
            if direct:
                ip = self.tables[0] if index is None else index
                grad_x = direct(stream, grad, ip)
                if grad_x is not NotImplemented:  # else unaligned: the generic launch
                    return grad_x
            back = self.back
            gp = grad.data_ptr()
            if back is not None and not gp & 15:
                run, prefix, head, rest = back
                grad_x = torch.empty_like(grad)
                ip = self.tables[0] if index is None else index.data_ptr()
                run(*head, stream, *prefix, gp, grad_x.data_ptr(),
                    *self.tables, ip, *rest)
                return grad_x
        table, sin, cu_seqlens, index = _generic_tables(
            freqs, _rows_read(grad, self.settings[0], index), index, self.per_token, cu_seqlens,
            self.settings)
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            return _RoPEFunction.apply(grad, table, sin, cu_seqlens, index, *self.settings, True,
                                       None)
        grad_x = grad.new_empty(grad.shape)
        with _on_device(grad):
            return launch(grad, grad_x, table, sin, cu_seqlens, index, *self.settings, True,
                          fresh_out=True)


class _PlannedRoPEFunction(torch.autograd.Function):
    """Autograd for a planned call with a gradient: both launches are the plan's
    (:class:`_GradLaunch`), the forward on the stream its flag check read; the context keeps
    the table and index objects they read."""

    @staticmethod
    def forward(ctx, x, launches, freqs, index, cu_seqlens, stream):
        ctx.launches, ctx.freqs, ctx.index, ctx.cu_seqlens = launches, freqs, index, cu_seqlens
        return launches.forward(x, index, stream)

    @staticmethod
    def backward(ctx, grad):
        grad_x = ctx.launches.backward(grad, ctx.freqs, ctx.index, ctx.cu_seqlens)
        return grad_x, None, None, None, None, None


def c_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without torch's Python wrapper: the C entry the wrapper ends in
    (``torch._C._FunctionBase.apply``, bound to ``function``). The wrapper binds default
    arguments (for functions with a ``setup_context``) and unwraps functorch wrappers whose
    transform has ended: about 2 us of a 7 us forward on the development CPU, which TE's API
    pays on every call. For calls outside functorch transforms on tensors a plan's guard found
    plain, where the wrapper would do nothing."""
    return super(torch.autograd.Function, function).apply


def _bound_grad_launch(call: RoPECall, generic: Plan) -> Plan:
    """:func:`_bound_launch` for a single contiguous tensor that requires grad: the forward
    is the bound launch inside a lean ``torch.autograd.Function``, and the backward the bound
    transposed launch, with no call object, table conversion or key built per call (at
    training sizes below a few MB the host path sets the pace of forward + backward).
    ``generic`` serves whatever the binding does not cover."""
    t, spec = call.t, call.spec
    if call.in_place or not t.is_contiguous():
        return generic
    key, tail, entry, flag = _forward_entry(call)
    if entry is None or key[-1] != 63 or tail[0] != _user_table_address(call):
        return generic
    settings = kernel_settings(spec)
    launches = _GradLaunch(key, tail, entry, settings, call.positions is not None, flag,
                           tuple(t.shape))
    device_index = key[-2]
    guard = _several_gpus()
    current_device = torch.cuda.current_device
    apply = c_apply(_PlannedRoPEFunction)
    transforms_active = torch._C._are_functorch_transforms_active
    stream = _current_stream

    def launch_grad(
        x: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
        positions: torch.Tensor | None, k: None,
    ) -> torch.Tensor:
        given = positions if start_positions is None else start_positions
        s = stream(device_index)
        if (x.data_ptr() | (0 if given is None else given.data_ptr())) & 15 or (
            guard and current_device() != device_index
        ) or transforms_active() or (flag is not None and _flag_stale(flag, freqs, s)):
            return generic(x, freqs, spec, start_positions, positions, k)
        return apply(x, launches, freqs, given, spec.cu_seqlens, s)

    return launch_grad


def _bound_qk_launch(call: RoPECall, generic: Plan) -> Plan:
    """:func:`_bound_launch` for a q and k pair: one launch of the compiled two-segment kernel
    from the new q's, k's and index tensor's addresses (two output allocations out of place)."""
    q, k, spec, in_place = call.t, call.k, call.spec, call.in_place
    index = position_index(call)
    table, sin, cu = _call_tables(call, _rows_read(q, spec.layout, index))
    flag = _plan_flag(sin, cu, spec.layout)
    outs = (q, k) if in_place else _qk_outputs(q, k, None)
    key = _qk_launch(q, k, *outs, (table, sin), cu, index, *kernel_settings(spec), False,
                     copy_pass=not in_place, key_only=True)
    entry = None if key is None else _fast_qkv.get(key)
    tp = table.data_ptr()
    if entry is None or not all(key[1]) or tp != _user_table_address(call):
        return generic
    run, prefix, grid, ints, ordered = entry
    sp = tp if sin is None else sin.data_ptr()
    cp = tp if cu is None else cu.data_ptr()
    rest = ints + ordered
    device_index = key[-1]
    guard = _several_gpus()
    stream = _current_stream
    current_device = torch.cuda.current_device
    direct = None if in_place else _pair_direct_call((run, prefix, grid, rest), (tp, sp, cp),
                                                     q.shape, k.shape)

    def launch_bound(
        x: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
        positions: torch.Tensor | None, k: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qp, kp = x.data_ptr(), k.data_ptr()
        given = positions if start_positions is None else start_positions
        ip = tp if given is None else given.data_ptr()
        s = stream(device_index)
        if (qp | kp | ip) & 15 or (guard and current_device() != device_index) or (
            flag is not None and _flag_stale(flag, freqs, s)
        ):
            return generic(x, freqs, spec, start_positions, positions, k)
        if in_place:
            run(*grid, s, *prefix, qp, qp, kp, kp, kp, kp, tp, sp, tp, sp, cp, ip, *rest)
            increment_version(x)
            increment_version(k)
            return x, k
        if direct is not None:
            return direct(s, x, k, ip)
        q_out, k_out = _qk_outputs(x, k, None)
        qo, ko = q_out.data_ptr(), k_out.data_ptr()
        run(*grid, s, *prefix, qp, qo, kp, ko, kp, ko, tp, sp, tp, sp, cp, ip, *rest)
        return q_out, k_out

    return launch_bound


class _QKGradLaunch:
    """The launches of a planned q and k pair with a gradient (:func:`_bound_qk_grad_launch`):
    the forward bound as :func:`_bound_qk_launch` binds it, the transposed launch bound at the
    first backward that finds it compiled. Gradients laid out otherwise than the forward's
    contiguous q and k (or unaligned), a table written since its flag's check, and double
    backward take the generic launch. Holds addresses and compiled kernels, never tensors."""

    __slots__ = ("bound", "tables", "device", "back_key", "back", "settings", "rows", "per_token",
                 "flag", "shapes", "direct", "back_direct")

    def __init__(self, key: tuple, entry: tuple, tables: tuple[int, int, int], settings: tuple,
                 rows: int, per_token: bool, flag: torch.Tensor | None,
                 shapes: tuple[tuple[int, ...], tuple[int, ...]]):
        self.bound = _bound_entry(entry)  # the forward launch
        self.tables = tables  # the addresses of the table, its sin (or flag) and cu_seqlens
        self.device = key[-1]
        self.back_key = key[:11] + (True,) + key[12:]  # the transposed launch's _fast_qkv key
        self.back: tuple | None = None
        self.settings = settings
        self.rows = rows  # the table rows the call can read (_rows_read)
        self.per_token = per_token  # the index holds per-token positions, not start positions
        self.flag = flag  # a linear angle table's flag, read by address
        self.shapes = shapes  # q's and k's
        # either launch as one call that allocates its outputs too (direct_launch), or None
        self.direct = _pair_direct_call(self.bound, tables, *shapes)
        self.back_direct: Any = None  # bound with ``back``; False when it cannot be

    def _launch(self, bound: tuple, q: torch.Tensor, k: torch.Tensor, index: torch.Tensor | None,
                stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        run, prefix, grid, rest = bound
        tp, sp, cp = self.tables
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        kp, ko = k.data_ptr(), k_out.data_ptr()
        run(*grid, stream, *prefix, q.data_ptr(), q_out.data_ptr(), kp, ko, kp, ko, tp, sp, tp,
            sp, cp, tp if index is None else index.data_ptr(), *rest)
        return q_out, k_out

    def forward(self, q: torch.Tensor, k: torch.Tensor, index: torch.Tensor | None,
                stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.direct is not None:  # the plan checked the addresses' alignment
            return self.direct(stream, q, k, self.tables[0] if index is None else index)
        return self._launch(self.bound, q, k, index, stream)

    def backward(
        self, gq: torch.Tensor, gk: torch.Tensor, freqs: object, index: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transpose of the forward on ``(gq, gk)``: the bound launch when both are
        contiguous and aligned, as the forward's q and k were, else the generic launch (any
        strides) or, for double backward, the differentiable function."""
        stream = _current_stream(self.device)
        if (
            not torch.is_grad_enabled() and gq.is_contiguous() and gk.is_contiguous()
            and (self.flag is None or not _flag_stale(self.flag, freqs, stream))
        ):
            direct = self.back_direct
            if direct is None:
                back = _back_launch(self, _fast_qkv)
                if back is not None:
                    direct = self.back_direct = _pair_direct_call(
                        back, self.tables, *self.shapes) or False
            if direct:
                grads = direct(stream, gq, gk, self.tables[0] if index is None else index)
                if grads is not NotImplemented:  # else unaligned: the generic launch
                    return grads
            back = self.back
            if back is not None and not (gq.data_ptr() | gk.data_ptr()) & 15:
                return self._launch(back, gq, gk, index, stream)
        table, sin, cu_seqlens, index = _generic_tables(
            freqs, self.rows, index, self.per_token, cu_seqlens, self.settings)
        args = (table, sin, cu_seqlens, index, *self.settings, True)
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            return _QKFunction.apply(gq, gk, *args, None)
        with _on_device(gq):
            return _qk_rope(gq, gk, *args, None)


class _PlannedQKFunction(torch.autograd.Function):
    """Autograd for a planned q and k pair with a gradient: both launches are the plan's
    (:class:`_QKGradLaunch`); the context keeps the table and index objects they read."""

    @staticmethod
    def forward(ctx, q, k, launches, freqs, index, cu_seqlens, stream):
        ctx.launches, ctx.freqs, ctx.index, ctx.cu_seqlens = launches, freqs, index, cu_seqlens
        return launches.forward(q, k, index, stream)

    @staticmethod
    def backward(ctx, gq, gk):
        grads = ctx.launches.backward(gq, gk, ctx.freqs, ctx.index, ctx.cu_seqlens)
        return (*grads, None, None, None, None, None)


def _bound_qk_grad_launch(call: RoPECall, generic: Plan) -> Plan:
    """:func:`_bound_qk_launch` for contiguous q and k out of place where either requires grad,
    as a model's training step calls them (the Hugging Face integration's path): the forward
    is the bound launch inside a lean ``torch.autograd.Function`` and the backward the bound
    transposed launch, with no call object, table conversion or key built per call. The
    generic plan ran ``_QKFunction`` and the generic launch each way. Calls with start or
    per-token positions are bound too (their index tensor read by address); ``generic`` serves
    whatever the binding does not cover."""
    q, k, spec = call.t, call.k, call.spec
    if call.in_place or not (q.is_contiguous() and k.is_contiguous()):
        return generic
    index = position_index(call)
    rows = _rows_read(q, spec.layout, index)
    table, sin, cu = _call_tables(call, rows)
    key = _qk_launch(q, k, *_qk_outputs(q, k, None), (table, sin), cu, index,
                     *kernel_settings(spec), False, key_only=True)
    entry = None if key is None else _fast_qkv.get(key)
    tp = table.data_ptr()
    if entry is None or not all(key[1]) or tp != _user_table_address(call):
        return generic
    flag = _plan_flag(sin, cu, spec.layout)
    settings = kernel_settings(spec)
    addresses = (tp, tp if sin is None else sin.data_ptr(), tp if cu is None else cu.data_ptr())
    launches = _QKGradLaunch(key, entry, addresses, settings, rows, call.positions is not None,
                             flag, (tuple(q.shape), tuple(k.shape)))
    device_index = key[-1]
    guard = _several_gpus()
    current_device = torch.cuda.current_device
    apply = c_apply(_PlannedQKFunction)
    transforms_active = torch._C._are_functorch_transforms_active
    stream = _current_stream

    def launch_grad(
        x: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
        positions: torch.Tensor | None, k: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        given = positions if start_positions is None else start_positions
        s = stream(device_index)
        if (x.data_ptr() | k.data_ptr() | (0 if given is None else given.data_ptr())) & 15 or (
            guard and current_device() != device_index
        ) or transforms_active() or (flag is not None and _flag_stale(flag, freqs, s)):
            return generic(x, freqs, spec, start_positions, positions, k)
        return apply(x, k, launches, freqs, given, spec.cu_seqlens, s)

    return launch_grad


class _QKVLaunches:
    """The launches of a planned packed-qkv call (:func:`_bound_qkv_launch`): the forward
    (q, k and v out of one packed tensor) bound from the plan's call, the transposed launch
    (q's, k's and v's gradients into one packed gradient) bound at the first backward that
    finds it compiled. Gradients that are not contiguous (or unaligned), a table written since
    its flag's check, and double backward take the generic launch. Holds addresses and compiled
    kernels, never tensors."""

    __slots__ = ("bound", "offsets", "split", "shape", "tables", "device", "back_key", "back",
                 "settings", "rows", "per_token", "flag", "leading", "direct", "back_direct")

    def __init__(self, key: tuple, back_key: tuple | None, entry: tuple, qkv: torch.Tensor,
                 split: tuple[int, int, int], tables: tuple[int, int, int], settings: tuple,
                 rows: int, per_token: bool, flag: torch.Tensor | None):
        self.bound = _bound_entry(entry)  # the forward launch
        size = qkv.element_size()  # byte offsets of q, k and v in a packed row
        self.offsets = tuple(segment[1] * size for segment in packed_segments(qkv, split))
        self.split = split
        self.shape = qkv.shape  # the packed gradient's
        self.tables = tables  # the addresses of the table, its sin (or flag) and cu_seqlens
        self.device = key[-1]
        self.back_key = back_key  # the transposed launch's _fast_qkv key
        self.back: tuple | None = None
        self.settings = settings
        self.rows = rows  # the table rows the call can read (_rows_read)
        self.per_token = per_token  # the index holds per-token positions, not start positions
        self.flag = flag  # a linear angle table's flag, read by address
        # the forward as one call that allocates q, k and v too (direct_launch), or None;
        # arguments 0-5 are the inputs' and outputs' addresses, 11 the index's
        tp, sp, cp = tables
        self.leading = (0,) * 6 + (tp, sp, tp, sp, cp, 0)
        oq, ok, ov = self.offsets
        self.direct = _direct_call(
            self.bound, self.leading, 2, ((0, 0, oq), (0, 2, ok), (0, 4, ov), (1, 11, 0)),
            tuple((0, tuple(o.shape)) for o in _qkv_outputs(qkv, split)),
            ((0, 1, 0), (1, 3, 0), (2, 5, 0)))
        self.back_direct: Any = None  # bound with ``back``; False when it cannot be

    def forward(self, qkv: torch.Tensor, index: torch.Tensor | None,
                stream: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.direct is not None:
            return self.direct(stream, qkv, self.tables[0] if index is None else index)
        q, k, v = _qkv_outputs(qkv, self.split)
        xp = qkv.data_ptr()
        oq, ok, ov = self.offsets
        tp, sp, cp = self.tables
        run, prefix, grid, rest = self.bound
        run(*grid, stream, *prefix, xp + oq, q.data_ptr(), xp + ok, k.data_ptr(), xp + ov,
            v.data_ptr(), tp, sp, tp, sp, cp, tp if index is None else index.data_ptr(), *rest)
        return q, k, v

    def backward(
        self, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, freqs: object,
        index: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The packed gradient of q's, k's and v's: the bound launch when all three are
        contiguous and aligned, as the forward's outputs were, else the generic launch (any
        strides) or, for double backward, the differentiable function."""
        direct = self.back_direct
        if direct is None:
            back = _back_launch(self, _fast_qkv)
            if back is not None:
                oq, ok, ov = self.offsets
                direct = self.back_direct = _direct_call(
                    back, self.leading, 4, ((0, 0, 0), (1, 2, 0), (2, 4, 0), (3, 11, 0)),
                    ((1, tuple(self.shape)),), ((0, 1, oq), (0, 3, ok), (0, 5, ov))) or False
        stream = _current_stream(self.device)
        tp, sp, cp = self.tables
        plain = (  # laid out as the forward's outputs, outside double backward
            not torch.is_grad_enabled()
            and gq.is_contiguous() and gk.is_contiguous() and gv.is_contiguous()
            and (self.flag is None or not _flag_stale(self.flag, freqs, stream))
        )
        if plain and direct:
            grad = direct(stream, gq, gk, gv, tp if index is None else index)
            if grad is not NotImplemented:  # else an unaligned gradient: the generic launch
                return grad
        back = self.back
        if plain and back is not None and not (
            gq.data_ptr() | gk.data_ptr() | gv.data_ptr()
        ) & 15:
            run, prefix, grid, rest = back
            grad = gk.new_empty(self.shape)
            gp = grad.data_ptr()
            oq, ok, ov = self.offsets
            run(*grid, stream, *prefix, gq.data_ptr(), gp + oq, gk.data_ptr(), gp + ok,
                gv.data_ptr(), gp + ov, tp, sp, tp, sp, cp,
                tp if index is None else index.data_ptr(), *rest)
            return grad
        tab, sin, cu_seqlens, index = _generic_tables(
            freqs, self.rows, index, self.per_token, cu_seqlens, self.settings)
        inputs = (tab, sin, tab, sin, cu_seqlens, index, self.split, *self.settings)
        if torch.is_grad_enabled():  # double backward: the transpose must be differentiable
            return _QKVTransposeFunction.apply(gq, gk, gv, *inputs, None)
        with _on_device(gq):
            return _qkv_transpose(gq, gk, gv, self.split, inputs[:4], *inputs[4:6],
                                  *self.settings, None)


class _PlannedQKVFunction(torch.autograd.Function):
    """Autograd for a planned packed-qkv call with a gradient: both launches are the plan's
    (:class:`_QKVLaunches`); the context keeps the table and index objects they read."""

    @staticmethod
    def forward(ctx, qkv, launches, freqs, index, cu_seqlens, stream):
        ctx.launches, ctx.freqs, ctx.index, ctx.cu_seqlens = launches, freqs, index, cu_seqlens
        return launches.forward(qkv, index, stream)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        return (ctx.launches.backward(gq, gk, gv, ctx.freqs, ctx.index, ctx.cu_seqlens),
                None, None, None, None, None)


def _bound_qkv_launch(call: RoPECall, generic: Plan) -> Plan:
    """The plan of a packed-qkv call on a contiguous tensor (TransformerEngine's
    ``apply_fused_qkv_rotary_pos_emb`` through ``compat.te``, or ``apply_qkv``): the forward
    launch bound as :func:`_bound_qk_launch` binds a pair's, inside a lean autograd Function
    with the transposed launch bound too where the tensor requires grad. The generic plan ran
    the call's checks-free path but built each launch's key and, with a gradient,
    ``_QKVFunction`` through torch's Python wrapper. Calls with start or per-token positions are
    bound too (their index tensor read by address); ``generic`` serves whatever the binding
    does not cover."""
    qkv, spec, split = call.t, call.spec, call.split
    if call.k_table is not None or not qkv.is_contiguous():
        return generic
    index = position_index(call)
    rows = _rows_read(qkv, spec.layout, index)
    table, sin, cu = _call_tables(call, rows)
    d = split[1]
    settings = kernel_settings(spec)
    outs = _qkv_outputs(qkv, split)
    tables = (table, sin, table, sin)
    key = launch_qkv(packed_segments(qkv, split),
                     (head_segment(outs[0], split[0] // d), width_segment(outs[1], d),
                      width_segment(outs[2], d)),
                     tables, cu, index, *settings, False, key_only=True)
    entry = None if key is None else _fast_qkv.get(key)
    tp = table.data_ptr()
    if entry is None or not all(key[1]) or tp != _user_table_address(call):
        return generic
    # the transposed launch's key, with qkv standing for its packed gradient (the same shape,
    # strides and alignment as a new one; a key-only launch writes nothing)
    back_key = launch_qkv((head_segment(outs[0], split[0] // d), width_segment(outs[1], d),
                           width_segment(outs[2], d)),
                          packed_segments(qkv, split), tables, cu, index, *settings, True,
                          key_only=True)
    flag = _plan_flag(sin, cu, spec.layout)
    addresses = (tp, tp if sin is None else sin.data_ptr(), tp if cu is None else cu.data_ptr())
    launches = _QKVLaunches(key, back_key, entry, qkv, split, addresses, settings, rows,
                            call.positions is not None, flag)
    device_index = key[-1]
    guard = _several_gpus()
    current_device = torch.cuda.current_device
    apply = c_apply(_PlannedQKVFunction)
    transforms_active = torch._C._are_functorch_transforms_active
    stream = _current_stream
    grad_plan = qkv.requires_grad and torch.is_grad_enabled()

    def launch_bound(
        x: torch.Tensor, freqs: object, spec: RoPESpec, start_positions: torch.Tensor | None,
        positions: torch.Tensor | None, k: None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        given = positions if start_positions is None else start_positions
        s = stream(device_index)
        if (x.data_ptr() | (0 if given is None else given.data_ptr())) & 15 or (
            guard and current_device() != device_index
        ) or (flag is not None and _flag_stale(flag, freqs, s)):
            return generic(x, freqs, spec, start_positions, positions, k)
        if grad_plan:
            if transforms_active():
                return generic(x, freqs, spec, start_positions, positions, k)
            return apply(x, launches, freqs, given, spec.cu_seqlens, s)
        return launches.forward(x, given, s)

    return launch_bound


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(Backend):
    """Our Triton kernels: every layout and feature, every table kind, at memory bandwidth."""

    name = "triton"
    description = (
        "rope-dispatch's own Triton kernels (CUDA; CPU through TRITON_INTERPRET=1): one pass, "
        "fp32 math, any strides, angles, cos/sin caches or rates"
    )
    priority = 40
    supports_in_place = True
    supports_positions = True
    tables = frozenset({"angles", "cos_sin_cache", "pair_cos_sin_cache", "rates"})
    tensors = frozenset({"t", "qk", "qkv"})

    @property
    def devices(self) -> frozenset[str]:  # type: ignore[override]
        if not self.availability and _kernels is not None and _kernels.INTERPRETED:
            return frozenset({"cpu", "cuda"})
        return frozenset({"cuda"})

    def unavailable_reasons(self) -> list[str]:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return [f"triton is not importable ({exc}); install it with pip install 'rope-dispatch[triton]'"]
        interpret = _interpret_requested()
        if not interpret and not torch.cuda.is_available():
            return [
                "no CUDA device (torch.cuda.is_available() is False) and TRITON_INTERPRET is not "
                "set to 1, so the kernels have nowhere to run"
            ]
        kernels = _load_kernels()
        if interpret and not kernels.INTERPRETED:
            return [
                "TRITON_INTERPRET=1 was set after the kernels had been compiled for the GPU; set "
                "it before rope_dispatch's first call"
            ]
        if not interpret and kernels.INTERPRETED and not torch.cuda.is_available():
            return ["the kernels were loaded for the interpreter but TRITON_INTERPRET is unset"]
        return []

    def plan(self, call: RoPECall) -> Plan:
        """Inference calls (single tensors, q and k pairs and packed qkv, by index, start or
        per-token positions, thd with its spec's cu_seqlens read by address) launch the compiled
        kernel straight from the plan, with the call's constant arguments bound; so do single
        contiguous tensors, contiguous q and k pairs and contiguous packed qkv that require
        grad, forward and backward (:func:`_bound_grad_launch`, :func:`_bound_qk_grad_launch`,
        :func:`_bound_qkv_launch`);
        anything else goes through :meth:`apply`. Dispatch plans no call whose cu_seqlens
        values it reads (CPU offsets, strict mode)."""
        generic = super().plan(call)
        t, k = call.t, call.k
        if _kernels is None or _kernels.INTERPRETED:
            return generic
        if call.tensors == "qkv":
            return _bound_qkv_launch(call, generic)
        if (t.requires_grad or (k is not None and k.requires_grad)) and torch.is_grad_enabled():
            if k is not None:
                return _bound_qk_grad_launch(call, generic)
            return _bound_grad_launch(call, generic)
        return _bound_qk_launch(call, generic) if k is not None else _bound_launch(call, generic)

    def apply(self, call: RoPECall) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if call.tensors == "qkv":
            return rope_triton_qkv(call)
        if call.tensors == "qk":
            return rope_triton_qk(call)
        return _rope_triton_of(call, call.t, position_index(call))
