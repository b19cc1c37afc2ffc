"""Launch tiles of the Triton kernels: how many tokens and heads a program takes, on how many
warps, and the grid. Pure functions of a call's sizes; the findings behind each constant are
one line each in docs/tuning.md, under the constant's name.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


NORM_TOKEN_ITERS = 32
"""At most this many token blocks a program in a norm backward (backends/triton_norm_kernels.py),
each program's weight gradient summed over them before one reduction."""
NORM_PIPELINE_BLOCKS_PER_SM = 8
"""A norm backward of at least this many (token block, head group) tiles an SM pipelines its
token loop; a smaller one runs it plainly, ``MIN_PROGRAMS_PER_SM`` programs an SM."""
NORM_TOKEN_STAGES = 3
"""Software-pipelining stages of that loop (``tl.range``'s ``num_stages``): its loads go to
shared memory by asynchronous copies, up to this many token blocks in flight."""
NORM_RESIDENT_PROGRAMS = 2
"""Programs of the pipelined backward an SM holds at once (its registers)."""
NORM_PIPELINE_FILL = 2
"""What filling its pipeline costs a program, in token blocks (the loop's length is chosen so
that the launch runs whole waves of resident programs)."""
NORM_BACKWARD_ROWS = 32
"""A norm backward's tile: this many (token, head) rows, heads first, up to 8 heads."""
WEIGHT_GRAD_ROWS = 512
WEIGHT_GRAD_COLS = 16
WEIGHT_GRAD_WARPS = 8
"""The tile of the norm weights' final sum (``weight_grad_kernel``): a program's columns, read
this many partial rows at a time, on this many warps."""
QUANTIZE_TILE = 2048
"""Elements a program of the FP8 quantizing copy (``quantize_kernel``) takes on ``WARPS`` warps:
rows of up to this many channels, as many rows as fit."""


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_rows(tile_bytes: int, row_bytes: int) -> int:
    """How many rows of ``row_bytes`` a tile of about ``tile_bytes`` takes: the most that fit,
    rounded down to a power of two (a block size), and at least one."""
    return next_pow2(max(1, tile_bytes // row_bytes) + 1) // 2


@functools.lru_cache(maxsize=16)
def sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class Config(NamedTuple):
    """A general launch's tile: ``BLOCK_T`` tokens x ``BLOCK_H`` heads, ``HEAD_ITERS`` such head
    blocks a program, ``BLOCK_R`` and ``BLOCK_P`` (the rotary and pass-through widths), warps."""

    block_t: int
    block_h: int
    head_iters: int
    block_r: int
    block_p: int
    warps: int


TILE_BYTES = 8192
"""A program's bytes of input: 16-byte accesses for every thread of 4 warps, many programs an SM."""
TOKENS_PER_TILE = 8
WARPS = 4
"""A program's warps, but for streamed tiles of many heads (``STREAM_WARPS``)."""
TABLE_TILE_BYTES = 2048
"""The least bytes of a cos/sin cache's ``[BLOCK_T, BLOCK_R]`` row tile (16-byte loads)."""
MIN_PROGRAMS_PER_SM = 2
"""Below this many programs an SM a tile gives up tokens, then heads (latency-bound calls)."""
MIN_TILE_ROWS = 1
"""The fewest (token, head) rows that shrinking leaves a program."""
RESIDENT_BYTES = 16 << 20
"""Calls up to this size (the L2 holds them) take a token's heads first, up to RESIDENT_HEADS."""
RESIDENT_HEADS = 16
RESIDENT_ROWS = 32
"""Such a tile holds at least this many 16-bit rows (half as many float32) within 2 x TILE_BYTES."""
STREAM_TILE_BYTES = 2048
"""Larger calls whose tokens are under TILE_BYTES, and one-head tensors, stream 2 KiB tiles."""
STREAM_WARPS = 2
"""Warps of a streamed tile of at least STREAM_WARPS_HEADS heads."""
STREAM_WARPS_HEADS = 8
SPAN_HEAD_ITERS = 4
"""In place on partial rotary, a resident call takes tokens first and this many heads in turn."""
SEQ_SCAN_LIMIT = 256
"""thd below this many sequences compares every token with all offsets at once (no search)."""
LEAN_MAX_BYTES = 1 << 20
"""Contiguous sbhd/bshd calls of at most this size, positions by index and no context
parallelism, run the lean kernel; 0, set before the first call, turns it off."""
LEAN_HEADS = 8
LEAN_TILE_BYTES = 1024
SHARED_SINES_HEADS = 8
"""A lean tile of this many heads computes each row's sines once for all of them."""
LEAN_VECTOR = 2
"""Adjacent channels a thread of a one-token lean tile holds over a rotate-half half row."""
MIN_HEAD_BYTES = 512
"""A launch over tensors of unequal head counts gives the widest at least this many bytes of
one token's heads a tile (MQA)."""
CACHE_ROW_MIN_HEADS = 2
"""A launch reading a cos/sin cache's row tiles gives the widest tensor at least this many heads."""
QK_TOKEN_TILE_BYTES = 6144
"""q and k of one head count, streamed, with at most this many bytes a token (heads counted to a
power of two), take one token x all heads a tile reading a cos/sin cache's rows."""
WIDE_HEAD_CACHE_TILE = (8, 4)
"""The q and k tile on a 16-bit cos/sin cache's rows with heads of 256 channels or more."""
NARROW_HEAD_BYTES = 128
"""A cache stage's launch whose heads are at most this wide beside a v split into heads of their
width (MLA: 128 heads of 64 rope channels, a 512-channel compressed kv as 8 such heads) takes
``WIDE_V_TILE``. A launch of such heads beside a single head (MLA's rope part and its one key
head) takes ``NARROW_TILE``."""
NARROW_TILE = (2, 16)
NARROW_WARP_ROWS = 16
NARROW_MIN_ROWS = 8
NARROW_CACHE_WARP_ROWS = 8
"""Tokens and heads of that tile, and rows a warp: heads first, so a token's table row serves
16 heads; shrunk for latency to ``NARROW_MIN_ROWS`` rows at least. Where a cos/sin cache's
rows are loaded, on ``STREAM_WARPS`` warps at least, and a warp takes
``NARROW_CACHE_WARP_ROWS`` rows unless per-token positions gather them (docs/tuning.md)."""
WIDE_V_TILE = (4, 8)
WIDE_V_WARPS = 2
"""Tokens and heads of that tile, and its warps: with v split, 4 x 8 and 8 x 4 on 2 warps led
nine tiles from 1k tokens; only a split v selects it (GQA heads of 64 channels lost 3-5 points
on the one-head tile before it; docs/tuning.md)."""
GRID_AXIS_MAX = 65535
"""The most blocks a CUDA grid's axes 1 and 2 take: token blocks spread over both past it."""


def shared_rows(block_t: int, block_h: int, use_cache: bool, lean: bool = True) -> bool:
    """Whether a tile of ``block_t`` tokens x ``block_h`` heads reads each table row once for
    all its heads (``SHARED_ROWS``), in the lean kernel or (``lean=False``) the general one.

    A tile of several tokens and several heads always moves the rows' values from the layout
    they are read in to the heads', and the shared form moves cos and sin together in one round
    where read half by half they take four; in the general kernel only a cos/sin cache's rows
    gain from it. A tile of one token, or of one head, reads its rows where its heads use them;
    there only lean tiles of angle rows under at
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
    return next_pow2(max(min(counts), min(max(counts), floor)))


def qk_cache_row_tile(n_tokens: int, counts: tuple[int, ...], head_dim: int,
                      element_size: int, resident: bool) -> tuple[int, int] | None:
    """The tile (tokens, heads) of a rotate-half launch over q and k (``counts``, full rotary)
    reading a cos/sin cache's rows, where a rule for such launches applies, else ``None``: one
    token x all the heads for q and k of one head count that stream from DRAM with at most
    ``QK_TOKEN_TILE_BYTES`` a token, ``WIDE_HEAD_CACHE_TILE`` for 16-bit heads of 256 channels
    or more."""
    heads = next_pow2(max(counts))
    if (len(counts) == 2 and counts[0] == counts[1] and not resident
            and heads * head_dim * element_size <= QK_TOKEN_TILE_BYTES):
        return 1, heads
    if len(counts) == 2 and head_dim >= 256 and element_size == 2:
        block_t, block_h = WIDE_HEAD_CACHE_TILE
        return min(block_t, next_pow2(n_tokens)), min(block_h, heads)
    return None


def norm_backward_config(counts: tuple[int, ...], rotary_dim: int, head_dim: int,
                         interleaved: bool) -> Config:
    """The tile of a norm backward over each head (``rope_norm_kernel``): ``NORM_BACKWARD_ROWS``
    rows of up to 8 heads of the tensor with the fewest, on ``WARPS`` warps."""
    block_h = min(8, next_pow2(min(counts)))
    block_r = next_pow2(rotary_dim) if interleaved else next_pow2(rotary_dim // 2)
    block_p = next_pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 1
    return Config(NORM_BACKWARD_ROWS // block_h, block_h, 1, block_r, block_p, WARPS)


@functools.lru_cache(maxsize=256)
def norm_token_loop(blocks: int, head_groups: int, sms: int) -> tuple[int, int]:
    """A norm backward's ``(TOKEN_ITERS, TOKEN_STAGES)`` over ``blocks`` token blocks of
    ``head_groups`` head groups: each program sums the weights' gradient over several token
    blocks. A call of ``NORM_PIPELINE_BLOCKS_PER_SM`` tiles an SM pipelines the loop and takes
    the length that runs its programs in the fewest whole waves of ``NORM_RESIDENT_PROGRAMS``
    an SM, counting ``NORM_PIPELINE_FILL`` blocks a program for the pipeline's start (at most
    ``NORM_TOKEN_ITERS`` lengths, each compiled once); a smaller call doubles the length while
    every SM keeps ``MIN_PROGRAMS_PER_SM`` programs. Cached: every norm backward asks again
    (:func:`~backends.triton_launch.norm_partials`), and the search takes a few microseconds."""
    if blocks * head_groups >= NORM_PIPELINE_BLOCKS_PER_SM * sms:
        slots = NORM_RESIDENT_PROGRAMS * sms

        def cost(iters: int) -> int:
            waves = -(-head_groups * -(-blocks // iters) // slots)
            return waves * (iters + NORM_PIPELINE_FILL)

        iters = min(range(1, min(blocks, NORM_TOKEN_ITERS) + 1), key=cost)
        return iters, NORM_TOKEN_STAGES if iters > 1 else 1
    iters = 1
    while (2 * iters <= blocks
           and -(-blocks // (2 * iters)) * head_groups >= MIN_PROGRAMS_PER_SM * sms):
        iters *= 2
    return iters, 1


def choose_config(
    n_tokens: int, heads: int | tuple[int, ...], head_dim: int, rotary_dim: int,
    element_size: int, interleaved: bool, sms: int, tile_tokens: int = TOKENS_PER_TILE,
    cache_rows: bool = False, span_dim: int | None = None, sines: bool = True,
    min_rows: int = MIN_TILE_ROWS, wide_v: bool = False, gathered: bool = False,
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
    token's sines again (16 sine and cosine instructions a thread at 1 x 8, 4 at 2 x 4); a
    cache's rows are loads, so a cache keeps 1 x 8. A tile of one token of one head whose half
    (``BLOCK_R``) is narrower than the program's 128 threads takes two tokens, at half the
    programs.

    A cache stage writing a v split into heads of its heads' width (``wide_v``, MLA) takes
    ``WIDE_V_TILE`` for heads of at most ``NARROW_HEAD_BYTES``, where every SM gets its
    programs, else the narrow tile shrunk as below. Heads that narrow beside a single head
    (MLA's rope part) take ``NARROW_TILE``, shrunk for latency to ``NARROW_MIN_ROWS`` rows at
    the least, a warp for ``NARROW_WARP_ROWS`` rows; on a cos/sin cache at least
    ``STREAM_WARPS``, and a warp for ``NARROW_CACHE_WARP_ROWS`` rows where its rows are not
    gathered by per-token positions (``gathered``).

    ``head_dim`` is the channels a head moves; ``span_dim``, where larger, the channels it
    spans in memory (in place on partial rotary: the rotary channels of a wider head). A call
    the L2 holds then takes tokens first, one head at a time and ``SPAN_HEAD_ITERS`` heads a
    program, while that leaves every SM its programs; otherwise its heads-first tile counts
    heads by the span.
    """
    counts = heads if isinstance(heads, tuple) else (heads,)
    fit = tile_heads(counts, head_dim, element_size)
    if cache_rows:
        fit = max(fit, min(CACHE_ROW_MIN_HEADS, next_pow2(max(counts))))
    block_r = next_pow2(rotary_dim) if interleaved else next_pow2(rotary_dim // 2)
    pass_dim = head_dim - rotary_dim
    block_p = next_pow2(pass_dim) if pass_dim else 1
    wanted = MIN_PROGRAMS_PER_SM * sms
    narrow_heads = head_dim * element_size <= NARROW_HEAD_BYTES
    if wide_v and narrow_heads:
        block_t, block_h = min(WIDE_V_TILE[0], next_pow2(n_tokens)), WIDE_V_TILE[1]
        if programs(n_tokens, counts, block_t, block_h) >= wanted:
            return Config(block_t, block_h, 1, block_r, block_p, WIDE_V_WARPS)
    if narrow_heads and min(counts) == 1 < max(counts):
        block_t, block_h = shrink_to_programs(
            n_tokens, counts, min(NARROW_TILE[0], next_pow2(n_tokens)), NARROW_TILE[1], wanted,
            NARROW_MIN_ROWS)
        per_warp = NARROW_WARP_ROWS if sines or gathered else NARROW_CACHE_WARP_ROWS
        return Config(block_t, block_h, 1, block_r, block_p,
                      max(1 if sines else STREAM_WARPS, block_t * block_h // per_warp))
    heads_first = (
        tile_tokens == TOKENS_PER_TILE  # a cos/sin cache's row loads want their tokens
        and rotary_dim == head_dim  # pass-through channels copied: 8 x 4 ran faster warm
    )
    token_bytes = sum(counts) * head_dim * element_size
    resident = n_tokens * token_bytes <= RESIDENT_BYTES
    if cache_rows and not interleaved and rotary_dim == head_dim:
        tile = qk_cache_row_tile(n_tokens, counts, head_dim, element_size, resident)
        if tile is not None and programs(n_tokens, counts, *tile) >= wanted:
            return Config(*tile, 1, block_r, block_p, WARPS)
    streamed = (
        heads_first and (not resident or counts == (1,)) and not cache_rows
        and STREAM_TILE_BYTES and token_bytes < TILE_BYTES
    )
    if heads_first and resident and (span_dim or 0) > head_dim:  # in place on part of a head
        block_t = min(tile_rows(STREAM_TILE_BYTES, head_dim * element_size),
                      next_pow2(n_tokens))
        head_iters = min(SPAN_HEAD_ITERS, next_pow2(min(counts)))
        if programs(n_tokens, counts, block_t, head_iters) >= wanted:
            return Config(block_t, 1, head_iters, block_r, block_p, WARPS)
    counted = max(head_dim, span_dim or 0) if heads_first and resident else head_dim
    rows = tile_rows(STREAM_TILE_BYTES if streamed else TILE_BYTES, counted * element_size)
    if heads_first and resident and not streamed:
        fits = tile_rows(2 * TILE_BYTES, counted * element_size)
        rows = max(rows, min(RESIDENT_ROWS * 2 // element_size, fits))
        block_h = min(fit, rows, RESIDENT_HEADS)
    elif streamed:
        block_h = min(next_pow2(min(counts)), rows)
    else:
        block_h = min(fit, max(1, rows // tile_tokens))
    block_t = min(max(1, rows // block_h), next_pow2(n_tokens))
    if programs(n_tokens, counts, block_t, block_h) < wanted:
        block_h = min(fit, rows)
        block_t = min(rows // block_h, next_pow2(n_tokens))
        block_t, block_h = shrink_to_programs(n_tokens, counts, block_t, block_h, wanted,
                                              min_rows)
        if sines and block_t == 1 and n_tokens > 1:
            if block_h > 1 and programs(n_tokens, counts, 2, block_h // 2) >= programs(
                    n_tokens, counts, 1, block_h):
                block_t, block_h = 2, block_h // 2
            elif block_h == 1 and block_r < 32 * WARPS:  # a half head narrower than the threads
                block_t = 2
    warps = STREAM_WARPS if streamed and block_h >= STREAM_WARPS_HEADS else WARPS
    return Config(block_t, block_h, 1, block_r, block_p, warps)


def launch_grid(head_groups: int, token_blocks: int) -> tuple[int, int, int]:
    """The kernels' grid: a token block's head groups on axis 0 (neighbouring programs), the
    token blocks on axes 1 and 2 (``triton_kernels._token_block``), each within
    ``GRID_AXIS_MAX``. Past ``GRID_AXIS_MAX`` token blocks, the last few of axes 1 x 2 (fewer
    than axis 2's count) lie past the tokens and do nothing."""
    layers = -(-token_blocks // GRID_AXIS_MAX)
    return head_groups, -(-token_blocks // layers), layers


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
    width = next_pow2(rotary_dim if interleaved else rotary_dim // 2)
    return max(TOKENS_PER_TILE, TABLE_TILE_BYTES // (width * table.element_size()))



def lean_tile(n_tokens: int, heads: int, width: int, element_size: int) -> tuple[int, int]:
    """The lean kernel's ``(BLOCK_T, BLOCK_H)`` for tokens of ``heads`` heads moving ``width``
    channels each: a token's heads first, up to ``LEAN_HEADS``, then tokens (a power of two,
    at most the call's) while the tile moves at most ``LEAN_TILE_BYTES``."""
    block_h = min(next_pow2(heads), LEAN_HEADS)
    fit = max(1, LEAN_TILE_BYTES // (block_h * width * element_size))
    return min(1 << (fit.bit_length() - 1), next_pow2(n_tokens)), block_h


