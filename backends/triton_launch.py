"""The Triton backend's launcher: one launch descriptor, one cache of compiled launches.

A call becomes a :class:`Launch` (what the launch does) and its :class:`Tables` (what it reads
besides the data). :func:`launch` picks kernel, tile and constants from them, keeps what Triton
compiled under a :class:`LaunchKey` and launches it again from addresses alone.
:func:`bind_compiled` binds a compiled launch to a call's form for plans: one call into C
(``direct_launch``) that allocates the outputs and launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from rope_dispatch.call import RoPECall, position_index
from rope_dispatch.kv_cache import cache_index
from rope_dispatch.tables import kernel_tables

from . import direct_launch
from . import triton_tables as tt
from . import triton_tiles as tiles
from .triton_tables import FLAG, current_stream

LAYOUT_CODES = {"sbhd": 0, "bshd": 1, "thd": 2}

_kernels: ModuleType | None = None


def _load_kernels() -> ModuleType:
    """Import the kernel module once (imports triton)."""
    global _kernels
    if _kernels is None:
        from . import triton_kernels

        _kernels = triton_kernels
    return _kernels


class Launch(NamedTuple):
    """What one launch does. Every path (eager, autograd, the custom op, plans) describes its
    launch so; the launcher picks kernel, tile and arguments from it and the tensors."""

    tensors: str  # "t" one tensor, "qk" q and k, "qkv" a packed qkv tensor (TENSOR_KINDS)
    layout: str
    interleaved: bool
    scale: float
    cp_size: int
    cp_rank: int
    table: str = "angles"  # the user's table kind
    positions: int = 0  # 0 by index, 1 start positions (one per sequence), 2 per token
    split: tuple[int, int, int] | None = None  # a packed qkv's (q, k, v) channels a group
    backward: bool = False  # gradients in (a packed qkv: three in, one packed out)
    in_place: bool = False  # rotary channels rewritten, pass-through channels untouched
    grad_in_place: bool = False  # the backward may rotate its incoming gradients in place
    norm: tuple | None = None  # the stage before the rotation: q's (t's) and k's NormForm
    store: StoreForm | None = None  # the stage after it: k and v into a KV cache
    inverse: bool = False  # rotate by minus the angle: the forward applies the transpose
    offset: int = 0  # the spec's rotary_offset: where the rotary channels start
    deinterleave: bool = False  # pairs read, halves written (backends/triton_channels.py)

    @property
    def transposes(self) -> bool:
        """Whether the kernels apply the transpose: a backward or an inverse forward."""
        return self.backward != self.inverse

    def transposed(self, in_place: bool = False) -> Launch:
        return self._replace(backward=not self.backward, in_place=in_place, grad_in_place=False)


class Tables(NamedTuple):
    """The tensors a launch reads besides its data, in their kernel form."""

    table: torch.Tensor
    sin: torch.Tensor | None
    cu: torch.Tensor | None  # thd: cu_seqlens; sbhd and bshd: a cos/sin cache's halves flag
    index: torch.Tensor | None  # start positions (1-D) or per-token positions (2-D)
    k_table: torch.Tensor | None = None  # a packed qkv's own k table (None: table rotates k)
    k_sin: torch.Tensor | None = None
    norm: NormTensors | None = None
    store: CacheTensors | None = None


class StoreForm(NamedTuple):
    """What a cache stage compiles into the kernel; the launch's outputs are q's and the
    cache's k and v pages ``[pages, page_size, kv_heads, head_dim]``."""

    cache: int  # a token's slot: 1 its own (vLLM's paged, SGLang's flat), 2 FlashInfer's pages
    page_size: int
    quant: tuple[int, int, int]  # q's, k's, v's store: 0 cast, 1 / a number, 2 / a device scalar
    dtypes: tuple[torch.dtype, torch.dtype]  # q's output dtype, the cache's


class CacheTensors(NamedTuple):
    """What a cache stage reads besides the data."""

    index: tuple[torch.Tensor, ...]  # slots; or request, place, kv_indptr, kv_indices
    scales: tuple  # q's, k's and v's FP8 scales (None: not quantized)


class NormTensors(NamedTuple):
    """What a norm stage reads and writes besides the data."""

    weights: tuple[torch.Tensor | None, torch.Tensor | None]  # q's (t's), k's; None: no norm
    sources: tuple[torch.Tensor, ...] | None = None  # backward: the forward's inputs
    partials: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    """Backward: float32 ``[programs, width]`` per side (:func:`norm_partials`), whose column
    sums are the weights' gradients."""


class LaunchKey(NamedTuple):
    """Everything a compiled launch depends on besides addresses."""

    launch: Launch
    layouts: tuple  # each input's and output's shape and strides
    dtypes: tuple  # the data's dtype and each table's dtype, shape class and form
    aligned: int  # bit i: pointer argument i lies on a 16-byte boundary
    device: int


class KernelKey(NamedTuple):
    """What a kernel's launch (the weight-gradient sum, the FP8 quantizing copy) depends on."""

    kernel: str
    args: tuple  # its integer and float arguments
    dtypes: tuple  # its tensors' dtypes
    aligned: int
    device: int


class Compiled(NamedTuple):
    """A compiled launch, run as ``run(*grid, stream, *prefix, *pointers, *tail)``."""

    run: Any
    prefix: tuple
    grid: tuple[int, int, int]
    tail: tuple  # the integer arguments, then the constants in the kernel's order


class Arguments(NamedTuple):
    """What a launch passes its kernel: the kernel, grid, integer arguments, constants, warps."""

    kernel: Any
    grid: tuple[int, int, int]
    ints: tuple
    consts: dict[str, Any]
    warps: int


_compiled: dict[LaunchKey | KernelKey, Compiled] = {}
_partial_shapes: dict[tuple, tuple] = {}  # norm_partials' shapes by the launch's form
_quantize_launches: dict[tuple, Any] = {}  # quantize's bound launches by its tensors' form
kernel_types: dict[int, tuple[str, ...]] = {}  # each kernel's Triton signature by CUfunction


def describe(call: RoPECall) -> Launch:
    """The forward launch of a checked call."""
    spec = call.spec
    positions = (0 if call.start_positions is None and call.positions is None
                 else 1 if call.positions is None else 2)
    return Launch(call.tensors, spec.layout, spec.interleaved, float(spec.cos_sin_scale),
                  spec.cp_size, spec.cp_rank, call.table_kind, positions, call.split, False,
                  call.in_place, call.grad_in_place, call.norms,
                  None if call.cache_write is None else store_form(call.cache_write),
                  spec.inverse, spec.rotary_offset, spec.deinterleave)


def _store_scales(write: Any) -> tuple:
    """q's, k's and v's FP8 scales of a cache stage (``None`` where not quantized)."""
    cache = write.cache
    return (write.q_scale, *((cache.k_scale, cache.v_scale) if cache.quantized else (None,) * 2))


def store_form(write: Any) -> StoreForm:
    """The :class:`StoreForm` of a checked call's :class:`~rope_dispatch.kv_cache.CacheWrite`."""
    cache = write.cache
    quant = tuple(0 if s is None else 2 if isinstance(s, torch.Tensor) else 1
                  for s in _store_scales(write))
    return StoreForm(2 if cache.kind == "flashinfer_paged" else 1, cache.pages()[0].shape[1],
                     quant, (write.q_dtype, cache.dtype))


def call_tables(call: RoPECall) -> Tables:
    """A checked call's tables with their flags (:mod:`backends.triton_tables`), its norm
    weights and its cache's index tensors and scales; q and k of a packed call with a table
    each read both alike, flagged or not."""
    spec, index = call.spec, position_index(call)
    rows = tt.rows_read(call.t, spec.layout, index)
    # the kernels read a weight as one dense row: a strided (or expanded) one is copied
    norm = None if call.norm is None and call.k_norm is None else NormTensors(
        tuple(None if n is None else n.weight.contiguous() for n in (call.norm, call.k_norm)))
    if call.k_table is None:
        tab, sin, cu = tt.launch_tables(call.table, rows, spec.cu_seqlens, spec.layout,
                                        spec.interleaved)
        write = call.cache_write
        store = None if write is None else CacheTensors(cache_index(write.cache),
                                                        _store_scales(write))
        return Tables(tab, sin, cu, index, norm=norm, store=store)
    q_tables = tt.flagged_tables(call.table, rows)
    k_tables = tt.flagged_tables(call.k_table, rows)
    if (q_tables[1] is None) != (k_tables[1] is None):
        q_tables, k_tables = kernel_tables(call.table), kernel_tables(call.k_table)
    return Tables(*q_tables, spec.cu_seqlens, index, *k_tables, norm=norm)


def current_tables(tabs: Tables, layout: str) -> Tables:
    """``tabs`` with their flags checked again (a written table, CUDA graph capture or the
    switch turned off since: ``None``, the rows read) and index tensors made contiguous."""
    table, sin, cu, index, k_table, k_sin = tabs[:6]
    if sin is not None and sin.dtype is FLAG:
        shared = k_sin is sin
        sin = tt.current_flag(table, sin)
        if k_sin is not None:
            k_sin = sin if shared or sin is None else tt.current_flag(k_table, k_sin)
            if k_sin is None:
                sin = None
    if cu is not None and layout != "thd":
        cu = tt.current_halves(table, sin, cu)
    elif cu is not None and not cu.is_contiguous():
        cu = cu.contiguous()
    if index is not None and not index.is_contiguous():
        index = index.contiguous()
    store = tabs.store
    if store is not None and not all(x.is_contiguous() for x in store.index):
        store = store._replace(index=tuple(x.contiguous() for x in store.index))
    return Tables(table, sin, cu, index, k_table, k_sin, tabs.norm, store)


def outputs(launch: Launch, inputs: Sequence[torch.Tensor],
            strides: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, ...]:
    """New outputs of an out-of-place launch: like each input (in ``strides`` where given,
    else contiguous); a packed qkv's q ``[.., h * q/d, d]``, k and v, or its packed gradient."""
    strides = strides or (None,) * len(inputs)
    if launch.tensors == "qkv":
        q_len, d, v_len = launch.split
        if launch.backward:
            shape = (*inputs[1].shape[:-1], q_len + d + v_len)
            return (inputs[1].new_empty(shape) if strides[0] is None
                    else inputs[1].new_empty_strided(shape, strides[0]),)
        qkv = inputs[0]
        lead, heads = qkv.shape[:-2], qkv.shape[-2]
        return (qkv.new_empty(*lead, heads * (q_len // d), d), qkv.new_empty(*lead, heads, d),
                qkv.new_empty(*lead, heads, v_len))
    return tuple(x.new_empty(x.shape) if s is None else x.new_empty_strided(x.shape, s)
                 for x, s in zip(inputs, strides))


def dense_strides(x: torch.Tensor) -> list[int] | None:
    """``x``'s strides when it is dense but not contiguous (so a gradient can share its layout);
    ``None`` for contiguous or non-dense tensors (the gradient is then contiguous)."""
    if x.is_contiguous():
        return None
    expected = 1
    for dim in sorted(range(x.dim()), key=lambda i: x.stride(i)):
        if x.shape[dim] == 1:
            continue
        if x.stride(dim) != expected:
            return None
        expected *= x.shape[dim]
    return list(x.stride())


Segment = tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]
"""q, k or v as the segment kernels see it: ``(base tensor, element offset, shape, strides)``
of a grouped view ``[n0, n1, groups, group, d]`` (``[T, groups, group, d]`` for thd), where
head ``g * group + j`` lies at ``g * s_group + j * s_head``."""


def head_segment(t: torch.Tensor, group: int) -> Segment:
    """A ``[.., H, d]`` tensor as ``H / group`` groups of ``group`` heads."""
    *lead, heads, d = t.shape
    *lead_strides, s_head, s_chan = t.stride()
    return (t, 0, (*lead, heads // group, group, d), (*lead_strides, group * s_head, s_head, s_chan))


def width_segment(t: torch.Tensor, d: int, offset: int = 0, width: int | None = None) -> Segment:
    """Channels ``offset`` to ``offset + width`` of a ``[.., h, channels]`` tensor as ``h``
    groups of ``width / d`` heads (a packed qkv's q, k or v)."""
    *lead, heads, channels = t.shape
    *lead_strides, s_head, s_chan = t.stride()
    width = channels if width is None else width
    return (t, offset * s_chan, (*lead, heads, width // d, d), (*lead_strides, s_head, d * s_chan, s_chan))


def page_segment(pages: torch.Tensor, d: int | None = None) -> Segment:
    """A cache's ``[pages, page_size, kv_heads, width]`` k or v as a cache stage writes it, each
    head as ``width / d`` heads of ``d`` channels (default: ``d = width``): its leading strides
    (a page, an entry) stand where a thd segment's are a token's and 0."""
    n_pages, page_size, heads, width = pages.shape
    s_page, s_entry, s_head, s_chan = pages.stride()
    d = d or width
    return (pages, 0, (n_pages, page_size, heads, width // d if d else 1, d),
            (s_page, s_entry, s_head, d * s_chan, s_chan))


def packed_segments(qkv: torch.Tensor, split: Sequence[int]) -> tuple[Segment, ...]:
    """q, k and v of a packed ``[.., h, q + k + v]`` tensor (``d = k``)."""
    q_len, d, v_len = split
    return (width_segment(qkv, d, 0, q_len), width_segment(qkv, d, q_len, d),
            width_segment(qkv, d, q_len + d, v_len))


def _segments(launch: Launch, inputs: Sequence[torch.Tensor],
              outs: Sequence[torch.Tensor]) -> tuple[tuple[Segment, Segment], ...]:
    """(input, output) segment pairs of a segment launch: q, k and v (k again where there is
    no v: the kernel's v programs then do nothing)."""
    if launch.store is not None:  # k and v into the cache's pages
        # a v a whole number of q's heads wide (MLA's compressed kv) as heads of q's width, so
        # the tile that suits q's heads suits v's (docs/tuning.md)
        d, v_width = inputs[0].shape[-1], inputs[2].shape[-1]
        v = ((width_segment(inputs[2], d), page_segment(outs[2], d))
             if v_width > d and v_width % d == 0 else
             (head_segment(inputs[2], 1), page_segment(outs[2])))
        return ((head_segment(inputs[0], 1), head_segment(outs[0], 1)),
                (head_segment(inputs[1], 1), page_segment(outs[1])), v)
    if launch.tensors != "qkv":  # a single tensor (norm launches) is q with no k heads
        q, k = (head_segment(x, 1) for x in (inputs[0], inputs[-1]))
        q_out, k_out = (head_segment(x, 1) for x in (outs[0], outs[-1]))
        return (q, q_out), (k, k_out), (k, k_out)
    q_len, d, _ = launch.split
    if launch.backward:
        grads = (head_segment(inputs[0], q_len // d), width_segment(inputs[1], d),
                 width_segment(inputs[2], d))
        return tuple(zip(grads, packed_segments(outs[0], launch.split)))
    made = (head_segment(outs[0], q_len // d), width_segment(outs[1], d),
            width_segment(outs[2], d))
    return tuple(zip(packed_segments(inputs[0], launch.split), made))


def _source_segments(launch: Launch, sources: Sequence[torch.Tensor]) -> tuple[Segment, ...]:
    """q's and k's segments of a norm backward's forward inputs."""
    if launch.tensors == "qkv":
        return packed_segments(sources[0], launch.split)[:2]
    return head_segment(sources[0], 1), head_segment(sources[-1], 1)


def pointers(launch: Launch, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
             tabs: Tables) -> tuple[tuple[torch.Tensor, int], ...]:
    """The kernel's pointer arguments as ``(tensor, byte offset)``: the data's (one tensor: in,
    out; segments: q, k, v in and out), the tables', cu_seqlens' and index's, and a norm or
    cache stage's (absent ones point at the table)."""
    table = tabs.table
    k_table, k_sin = (table, tabs.sin) if tabs.k_table is None else (tabs.k_table, tabs.k_sin)
    segmented = launch.tensors != "t" or launch.norm is not None
    tail = (table, table if tabs.sin is None else tabs.sin,
            *((k_table, k_table if k_sin is None else k_sin) if segmented else ()),
            table if tabs.cu is None else tabs.cu, table if tabs.index is None else tabs.index)
    tail = tuple((t, 0) for t in tail)
    if launch.norm is not None or launch.store is not None:  # rope_norm_kernel's stages
        norm, store = tabs.norm or NormTensors((None, None)), tabs.store
        tail += tuple((table if w is None else w, 0) for w in norm.weights)
        if norm.sources is None:
            tail += ((table, 0),) * 4
        else:
            size = norm.sources[0].element_size()
            tail += tuple((s[0], s[1] * size) for s in _source_segments(launch, norm.sources))
            tail += tuple((table if p is None else p, 0) for p in norm.partials)
        stage = () if store is None else (*store.index, *(table,) * (4 - len(store.index)),
                                          *(s if isinstance(s, torch.Tensor) else table
                                            for s in store.scales))
        tail += tuple((t, 0) for t in stage or (table,) * 7)
    elif launch.tensors == "t":
        return ((inputs[0], 0), (outs[0], 0), *tail)
    size = inputs[0].element_size()
    data = tuple((seg[0], seg[1] * size) for pair in _segments(launch, inputs, outs) for seg in pair)
    return (*data, *tail)


def _store_ints(store: CacheTensors | None, pages: Segment) -> tuple:
    """``rope_norm_kernel``'s cache-stage integers and numbers: the cache's page count, the
    request count and ``kv_indices``' length (FlashInfer's), q's, k's and v's scale (1.0 where
    none is a number)."""
    if store is None:
        return (0, 0, 0, 1.0, 1.0, 1.0)
    requests, indices = ((store.index[2].shape[0] - 1, store.index[3].shape[0])
                         if len(store.index) == 4 else (0, 0))
    numbers = tuple(float(s) if isinstance(s, (int, float)) else 1.0 for s in store.scales)
    return (pages[2][0], requests, indices, *numbers)


def _table_form(table: torch.Tensor, sin: torch.Tensor | None) -> tuple:
    """What of a table pair a compiled launch depends on."""
    if sin is None:
        return table.dtype, table.shape[1]
    return table.dtype, table.shape[1], sin.dtype, sin.shape[-1], tt.is_rates(table, sin)


def _aligned(addresses: Sequence[int]) -> int:  # a key's: bit i for a 16-byte aligned pointer i
    return sum(1 << i for i, a in enumerate(addresses) if not a & 15)


def launch_key(launch: Launch, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
               tabs: Tables, addresses: Sequence[int]) -> LaunchKey:
    """The key of a launch's compiled kernel (``addresses``: its pointers', for alignment):
    besides the tensors' layouts, the tables' forms, a norm's weight dtypes (and backward its
    sources' layouts and partials' shapes), a cache's index dtypes and lengths and the scales
    given as numbers."""
    norm, store = tabs.norm, tabs.store
    forms = (
        inputs[0].dtype, tabs.table.shape[0], _table_form(tabs.table, tabs.sin),
        None if tabs.k_table is None else (tabs.k_table.shape[0],
                                           _table_form(tabs.k_table, tabs.k_sin)),
        None if tabs.cu is None else (tabs.cu.dtype, tabs.cu.shape),
        None if tabs.index is None else (tabs.index.dtype, tabs.index.dim()),
        None if norm is None else (
            tuple(None if w is None else w.dtype for w in norm.weights),
            None if norm.sources is None else tuple((x.shape, x.stride()) for x in norm.sources),
            None if norm.partials is None else tuple(None if p is None else p.shape
                                                     for p in norm.partials)),
        None if store is None else (tuple((x.dtype, x.shape[0]) for x in store.index),
                                    tuple("tensor" if isinstance(s, torch.Tensor) else s
                                          for s in store.scales)),
    )
    layouts = tuple((x.shape, x.stride()) for x in (*inputs, *outs))
    return LaunchKey(launch, layouts, forms, _aligned(addresses), inputs[0].get_device())


def _tokens(layout: str, shape: Sequence[int], cu_seqlens: torch.Tensor | None
            ) -> tuple[int, int, int, int]:
    """``(tokens, dim 1, sequence length, sequences)`` of data of ``shape``; thd counts its
    sequences from ``cu_seqlens`` (none: per-token positions)."""
    if layout == "thd":
        return shape[0], 1, shape[0], 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return shape[0] * shape[1], shape[1], shape[0] if layout == "sbhd" else shape[1], 0


def _consts(launch: Launch, config: tiles.Config, rotary_dim: int, width: int, flags: tuple,
            positions: torch.Tensor | None, n_seqs: int, halves: bool) -> dict[str, Any]:
    """The constants the general and the segment kernels share (``width``: the channels a
    head moves)."""
    block_t, block_h, head_iters, block_r, block_p, _ = config
    use_cache, paired, rates, linear = flags
    return dict(
        LAYOUT=LAYOUT_CODES[launch.layout], ROT_DIM=rotary_dim, PASS_DIM=width - rotary_dim,
        INTERLEAVED=launch.interleaved, USE_CACHE=use_cache, PAIRED=paired, RATES=rates,
        LINEAR=linear, POSITIONS=tt.position_kind(positions),
        CONTEXT_PARALLEL=launch.cp_size > 1, BACKWARD=launch.transposes, BLOCK_T=block_t,
        BLOCK_H=block_h, HEAD_ITERS=head_iters, BLOCK_R=block_r, BLOCK_P=block_p,
        FAST_TRIG=not _kernels.INTERPRETED, SCALE=launch.scale, HALVES=halves,
        SEQ_BLOCK=tiles.next_pow2(n_seqs + 1) if 0 < n_seqs < tiles.SEQ_SCAN_LIMIT else 0,
    )


def _channel_stage(launch: Launch) -> dict[str, int]:
    """Where the rotary channels start, and 0, or 1 (pairs read, halves written) or 2 (the
    transpose: halves read, pairs written) for a deinterleaving spec."""
    return dict(ROT_OFFSET=launch.offset,
                DEINTERLEAVE=0 if not launch.deinterleave else 2 if launch.transposes else 1)


def _single_arguments(
    launch: Launch, x: torch.Tensor, out: torch.Tensor, tabs: Tables, config: tiles.Config | None,
) -> Arguments | None:
    """The :class:`Arguments` of a one-tensor launch: the lean kernel where it fits
    (``LEAN_MAX_BYTES``), else the general one."""
    kernels = _load_kernels()
    table, sin, cu_seqlens, positions = tabs[:4]
    heads, head_dim = x.shape[-2], x.shape[-1]
    n_tokens, dim1, seq_len, n_seqs = _tokens(launch.layout, x.shape, cu_seqlens)
    if n_tokens == 0 or heads == 0:
        return None
    thd = launch.layout == "thd"
    rotary_dim = table.shape[1]
    width = rotary_dim if launch.in_place else head_dim  # the channels a token moves
    flags = tt.table_flags(table, sin)
    if config is None and (
        not thd and positions is None and launch.cp_size == 1 and seq_len <= table.shape[0]
        and not launch.offset and not launch.deinterleave
        and x.numel() * x.element_size() <= tiles.LEAN_MAX_BYTES
        and x.is_contiguous() and (out is x or out.is_contiguous())
    ):
        grid, ints, consts = _lean_arguments(
            n_tokens, dim1, heads, head_dim, width, rotary_dim, x.element_size(),
            LAYOUT_CODES[launch.layout], launch.interleaved, flags, launch.transposes,
            launch.scale, kernels.INTERPRETED)
        return Arguments(kernels.rope_lean_kernel, grid, ints, consts, tiles.WARPS)
    if config is None:
        sms = 1 if kernels.INTERPRETED else tiles.sm_count(x.device.index)
        config = tiles.choose_config(
            n_tokens, heads, width, rotary_dim, x.element_size(), launch.interleaved, sms,
            tiles.tile_tokens(flags, table, rotary_dim, launch.interleaved),
            tiles.reads_cache_rows(flags), span_dim=head_dim, sines=not flags[0],
            gathered=tt.position_kind(positions) == 2)
    block_t, block_h, head_iters = config.block_t, config.block_h, config.head_iters
    halves = not thd and cu_seqlens is not None  # the halves flag (the lean kernel reads rows)
    grid = tiles.launch_grid(-(-heads // (block_h * head_iters)), -(-n_tokens // block_t))
    strides = tuple(s for t in (x, out)
                    for s in ((t.stride(0), 0, *t.stride()[1:]) if thd else t.stride()))
    ints = (n_tokens, dim1, seq_len, table.shape[0], heads, n_seqs, launch.cp_size,
            launch.cp_rank, *strides)
    consts = _consts(launch, config, rotary_dim, width, flags, positions, n_seqs, halves)
    consts.update(_channel_stage(launch), SHARED_ROWS=not halves and tiles.shared_rows(
        block_t, block_h, flags[0], lean=False))
    return Arguments(kernels.rope_kernel, grid, ints, consts, config.warps)


def _lean_arguments(
    n_tokens: int, dim1: int, heads: int, head_dim: int, width: int, rotary_dim: int,
    element_size: int, code: int, interleaved: bool, flags: tuple[bool, bool, bool, bool],
    backward: bool, scale: float, interpreted: bool,
) -> tuple[tuple[int, int, int], tuple[int, ...], dict[str, Any]]:
    """The lean kernel's grid, integer arguments and constants at :func:`tiles.lean_tile`'s
    tile (``width``: the channels a head moves, ``head_dim`` its stride)."""
    block_t, block_h = tiles.lean_tile(n_tokens, heads, width, element_size)
    use_cache, paired, rates, linear = flags
    block_r = tiles.next_pow2(rotary_dim if interleaved else rotary_dim // 2)
    vector = tiles.lean_vector(block_t, block_h, block_r, interleaved, use_cache)
    grid = (-(-n_tokens // block_t) * -(-heads // block_h), 1, 1)
    consts = dict(
        LAYOUT=code, HEADS=heads, HEAD_DIM=head_dim, ROT_DIM=rotary_dim,
        PASS_DIM=width - rotary_dim, INTERLEAVED=interleaved, USE_CACHE=use_cache, PAIRED=paired,
        RATES=rates, LINEAR=linear, BACKWARD=backward, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_R=block_r, BLOCK_P=tiles.next_pow2(width - rotary_dim), FAST_TRIG=not interpreted,
        SCALE=float(scale),
        # a thread's own channels' sines need no exchange
        SHARED_ROWS=tiles.shared_rows(block_t, block_h, use_cache) and vector == block_r,
        VECTOR=vector, ONE_SEQUENCE=dim1 == (1 if code == 0 else n_tokens),
    )
    return grid, (n_tokens, dim1), consts


def _segment_arguments(
    launch: Launch, pairs: tuple[tuple[Segment, Segment], ...], tabs: Tables,
    config: tiles.Config | None,
) -> Arguments | None:
    """:func:`_single_arguments` of a q and k or packed qkv launch (``rope_qkv_kernel``), or of
    any launch with a norm or cache stage (``rope_norm_kernel``)."""
    kernels = _load_kernels()
    # v's heads have their own width: a packed qkv's are k's, a cache stage's v may be wider
    # (where not split into q's heads: :func:`_segments`), or of no channels at all (then no v
    # programs)
    v_width = pairs[2][0][2][-1]
    has_v = (launch.tensors == "qkv" or launch.store is not None) and v_width > 0
    norm = launch.norm
    table, sin, cu_seqlens, positions = tabs[:4]
    shape = pairs[0][0][2]
    thd = launch.layout == "thd"
    n_tokens, dim1, seq_len, n_seqs = _tokens(launch.layout, shape, cu_seqlens)
    heads = tuple(x[2][-3] * x[2][-2] for x, _ in pairs)
    if launch.tensors == "t":
        heads = (heads[0], 0, 0)
    counts = heads if has_v else heads[:1] if launch.tensors == "t" else heads[:2]
    if n_tokens == 0 or min(counts) == 0:
        return None
    strides = tuple(  # a cache's pages (page_segment) come with both leading strides
        stride for x, out in pairs for seg in (x, out)
        for stride in ((seg[3][0], 0, *seg[3][1:]) if thd and len(seg[3]) == 4 else seg[3])
    )
    rotary_dim = table.shape[1]
    # the channels a token moves: a norm reads and writes every channel
    head_dim = rotary_dim if launch.in_place and norm is None else shape[-1]
    flags = tt.table_flags(table, sin)  # k's table is of q's kind
    sms = 1 if kernels.INTERPRETED else tiles.sm_count(pairs[0][0][0].device.index)
    whole = [] if norm is None else [
        n for n, form in zip(heads, norm) if form is not None and form.scope == "heads"]
    if config is None and norm is not None and launch.backward and not whole:
        config = tiles.norm_backward_config(counts, rotary_dim, head_dim, launch.interleaved)
    if config is None:
        config = tiles.choose_config(
            n_tokens, counts, head_dim, rotary_dim, pairs[0][0][0].element_size(),
            launch.interleaved, sms, tiles.tile_tokens(flags, table, rotary_dim, launch.interleaved),
            tiles.reads_cache_rows(flags), span_dim=shape[-1], sines=not flags[0],
            wide_v=launch.store is not None and pairs[2][0][2][-2] > 1,  # v split
            gathered=tt.position_kind(positions) == 2)
    block_t, block_h, head_iters = config.block_t, config.block_h, config.head_iters
    if whole:  # a norm over a token's heads: one program holds them all
        head_iters = max(head_iters, -(-max(whole) // block_h))
        config = config._replace(head_iters=head_iters)
    groups = [-(-n // (block_h * head_iters)) for n in heads]
    head_groups = sum(groups) if has_v else groups[0] + groups[1]
    token_iters, stages = (tiles.norm_token_loop(-(-n_tokens // block_t), head_groups, sms)
                           if norm is not None and launch.backward and not whole else (1, 1))
    grid = tiles.launch_grid(head_groups, -(-n_tokens // (block_t * token_iters)))
    k_rows = table.shape[0] if tabs.k_table is None else tabs.k_table.shape[0]
    ints = (n_tokens, dim1, seq_len, table.shape[0], k_rows, n_seqs,
            launch.cp_size, launch.cp_rank,
            *(n for (x, _), count in zip(pairs, heads) for n in (count, x[2][-2])), *strides)
    consts = _consts(launch, config, rotary_dim, head_dim, flags, positions, n_seqs,
                     not thd and cu_seqlens is not None)
    # a v wider than q's heads is copied a q head's width at a time (docs/tuning.md)
    consts.update(HAS_V=has_v, V_WIDTH=v_width,
                  BLOCK_W=min(tiles.next_pow2(v_width), tiles.next_pow2(head_dim)))
    if norm is None and launch.store is None:
        consts.update(_channel_stage(launch))
        return Arguments(kernels.rope_qkv_kernel, grid, ints, consts, config.warps)
    if launch.backward:
        sources = _source_segments(launch, tabs.norm.sources)
        ints += tuple(stride for seg in sources
                      for stride in ((seg[3][0], 0, *seg[3][1:]) if thd else seg[3]))
    else:
        ints += (0,) * 10
    ints += _store_ints(tabs.store, pairs[1][1])
    for side, form in zip("QK", norm or (None, None)):
        consts.update({f"{side}_NORM": 0 if form is None else 1 if form.scope == "head" else 2,
                       f"{side}_EPS": 0.0 if form is None else form.eps,
                       f"{side}_OFFSET": 0.0 if form is None else form.offset})
    store = launch.store
    consts.update(TOKEN_ITERS=token_iters, TOKEN_STAGES=stages,
                  CACHE=0 if store is None else store.cache,
                  PAGE_SIZE=1 if store is None else store.page_size,
                  **{f"{side}_QUANT": code
                     for side, code in zip("QKV", store.quant if store else (0, 0, 0))})
    from .triton_norm_kernels import rope_norm_kernel

    return Arguments(rope_norm_kernel, grid, ints, consts, config.warps)


def norm_partials(described: Launch, inputs: Sequence[torch.Tensor],
                  outs: Sequence[torch.Tensor], tabs: Tables
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """New float32 buffers for a norm backward's partial weight gradients, q's and k's: one
    row per program of that side (as :func:`_segment_arguments` tiles the launch), as wide as
    the weight. Their shapes are worked out once for each form of the launch: the tile follows
    from the launch, the tensors' shapes and dtype, the table's form and the SM count."""
    tabs = current_tables(tabs, described.layout)
    x = inputs[0]
    sms = 1 if _load_kernels().INTERPRETED else tiles.sm_count(x.device.index)
    key = (described, x.dtype, tuple(t.shape for t in (*inputs, *outs)), tabs.table.shape,
           tabs.table.dtype, tt.table_flags(tabs.table, tabs.sin), x.device, sms)
    shapes = _partial_shapes.get(key)
    if shapes is None:
        pairs = _segments(described, inputs, outs)
        chosen = _segment_arguments(described, pairs, tabs, None)
        found = []
        for (segment, _), form in zip(pairs, described.norm):
            if form is None or chosen is None:
                found.append(None)
                continue
            consts = chosen.consts
            heads, d = segment[2][-3] * segment[2][-2], segment[2][-1]
            per = consts["BLOCK_H"] * consts["HEAD_ITERS"]
            tokens = chosen.ints[0]
            rows = -(-heads // per) * -(-tokens // (consts["BLOCK_T"] * consts["TOKEN_ITERS"]))
            found.append((rows, d if form.scope == "head" else heads * d))
        if len(_partial_shapes) > 4096:
            _partial_shapes.clear()
        shapes = _partial_shapes[key] = tuple(found)
    return tuple(None if shape is None else x.new_empty(shape, dtype=torch.float32)
                 for shape in shapes)


def weight_grads(partials: tuple[torch.Tensor | None, torch.Tensor | None],
                 weights: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple:
    """The norm weights' gradients (each weight's dtype) from a backward's partial rows
    (:func:`norm_partials`), q's and k's in one launch; zeros for a weight whose call moved
    no data. One entry per weight given."""
    grads = [None if w is None else torch.empty_like(w) if p is not None and p.shape[0]
             else torch.zeros_like(w) for p, w in zip(partials, weights)]
    live = [(p, g) if p is not None and p.shape[0] and g is not None else None
            for p, g in zip(partials, grads)]
    if any(live):
        from .triton_norm_kernels import weight_grad_kernel

        shared = live[0] or live[1]  # a side without rows passes the other's, with no columns
        (q_part, q_grad), (k_part, k_grad) = (x or shared for x in live)
        q_width = q_part.shape[1] if live[0] else 0
        k_width = k_part.shape[1] if live[1] else 0
        tensors = (q_part, q_grad, k_part, k_grad)
        ints = (q_part.shape[0], k_part.shape[0], q_width, k_width)
        addresses = tuple(t.data_ptr() for t in tensors)
        key = KernelKey("weight_grad", ints, (q_grad.dtype, k_grad.dtype),
                        _aligned(addresses), q_part.get_device())
        if not _run_kept(key, addresses):
            grid = (-(-q_width // tiles.WEIGHT_GRAD_COLS) + -(-k_width // tiles.WEIGHT_GRAD_COLS),)
            rows = max(ints[:2])
            consts = dict(BLOCK_ROWS=tiles.WEIGHT_GRAD_ROWS, BLOCK_COLS=tiles.WEIGHT_GRAD_COLS,
                          ROW_ITERS=tiles.next_pow2(-(-rows // tiles.WEIGHT_GRAD_ROWS)))
            compiled = weight_grad_kernel[grid](*tensors, *ints,
                                                num_warps=tiles.WEIGHT_GRAD_WARPS, **consts)
            if not _load_kernels().INTERPRETED:
                _keep(key, weight_grad_kernel, compiled, grid, 4, ints, consts)
    return tuple(g for g in grads if g is not None)


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, channels]``, a view with contiguous channels; ``None`` where none is."""
    try:
        rows = t.view(-1, t.shape[-1]) if t.dim() > 1 else None
    except RuntimeError:  # rows not evenly spaced
        return None
    return rows if rows is not None and (rows.stride(1) == 1 or rows.shape[1] < 2) else None


def quantize(x: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """``out[...] = x / scale`` cast to ``out``'s FP8 dtype in one launch (``quantize_kernel``),
    as the cache stage's stores divide and cast; ``False``, doing nothing, where ``x`` or
    ``out`` is not rows with contiguous channels. A form seen before (shapes, strides, dtypes,
    scale, devices) launches bound, one call into C."""
    form = (x.shape, x.stride(), out.shape, out.stride(), x.dtype, out.dtype, scale, x.device,
            out.device)
    run = _quantize_launches.get(form)
    if run is not None and run(current_stream(x.get_device()), x, out) is not NotImplemented:
        return True
    x_rows, out_rows = _rows(x), _rows(out)
    if x_rows is None or out_rows is None or x.shape != out.shape or x.device != out.device:
        return False
    rows, cols = x_rows.shape
    if not rows:
        return True
    block_c = min(tiles.next_pow2(cols), tiles.QUANTIZE_TILE)
    block_r = tiles.QUANTIZE_TILE // block_c
    args = (rows, cols, x_rows.stride(0), out_rows.stride(0), float(scale))
    addresses = (x.data_ptr(), out.data_ptr())
    key = KernelKey("quantize", args, (x.dtype, out.dtype), _aligned(addresses), x.get_device())
    with tt.on_device(x):
        if not _run_kept(key, addresses):
            from .triton_cache_kernels import quantize_kernel

            grid = (-(-rows // block_r), -(-cols // block_c))
            consts = dict(BLOCK_R=block_r, BLOCK_C=block_c)
            compiled = quantize_kernel[grid](x, out, *args, num_warps=tiles.WARPS, **consts)
            if not _load_kernels().INTERPRETED:
                _keep(key, quantize_kernel, compiled, grid, 2, args, consts)
        entry = _compiled.get(key)
        if entry is not None and key.aligned == 3 and form not in _quantize_launches:
            if len(_quantize_launches) > 256:
                _quantize_launches.clear()
            _quantize_launches[form] = bound(entry, slots(((x, 0), (out, 0)), (x, out)))
    return True


def _at(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A one-element view of ``t``'s storage ``offset`` bytes past ``t``'s first element: what
    the kernel reads as a pointer."""
    return t.as_strided((1,), (1,), t.storage_offset() + offset // t.element_size())


def _view(segment: Segment) -> torch.Tensor:
    base, offset, shape, strides = segment
    return base.as_strided(shape, strides, base.storage_offset() + offset)


def launch(
    described: Launch, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], tabs: Tables,
    config: tiles.Config | None = None,
) -> LaunchKey | None:
    """Run ``described`` from ``inputs`` into ``outs`` (``outs`` is ``inputs`` in place); returns
    its key in the compiled-launch cache (``None`` where it is not kept: the interpreter, a
    ``config`` given, an empty call). No host sync, no allocation but index copies of
    non-contiguous index tensors. The current CUDA device must be the inputs'."""
    kernels = _load_kernels()
    tabs = current_tables(tabs, described.layout)
    sources = pointers(described, inputs, outs, tabs)
    addresses = tuple(t.data_ptr() + offset for t, offset in sources)
    key = None
    if config is None and not kernels.INTERPRETED:
        key = launch_key(described, inputs, outs, tabs, addresses)
        if _run_kept(key, addresses):
            return key
    if described.tensors == "t" and described.norm is None:
        chosen = _single_arguments(described, inputs[0], outs[0], tabs, config)
        tensors = tuple(t for t, _ in sources)
    else:
        pairs = _segments(described, inputs, outs)
        chosen = _segment_arguments(described, pairs, tabs, config)
        if chosen is None:  # nothing to launch (and an empty tensor has no element to point at)
            return None
        tensors = (*(_view(seg) for pair in pairs for seg in pair),
                   *(t if not offset else _at(t, offset) for t, offset in sources[6:]))
    if chosen is None:
        return None
    kernel, grid, ints, consts, num_warps = chosen
    compiled = kernel[grid](*tensors, *ints, num_warps=num_warps, **consts)
    if key is not None:
        _keep(key, kernel, compiled, grid, len(tensors), ints, consts)
    return key


def _run_kept(key: LaunchKey | KernelKey, addresses: Sequence[int]) -> bool:
    """Launch the compiled launch kept under ``key`` on ``addresses``; ``False`` where none is
    kept."""
    entry = _compiled.get(key)
    if entry is None:
        return False
    entry.run(*entry.grid, current_stream(key.device), *entry.prefix, *addresses, *entry.tail)
    return True


def _keep(key: LaunchKey | KernelKey, kernel: Any, compiled: Any, grid: tuple, pointers: int,
          ints: tuple, consts: dict[str, Any]) -> None:
    """Keep what Triton compiled for ``kernel``'s launch (``pointers`` pointer arguments, then
    ``ints``, then ``consts``) under ``key``, to launch it again from addresses alone; not
    while a profiler's launch hooks are set."""
    if compiled is None or _hooks_active():
        return
    ordered = tuple(consts[name] for name in kernel.arg_names[pointers + len(ints):])
    if len(_compiled) > 4096:
        _compiled.clear()
    grid = (*grid, 1, 1)[:3]  # the C launcher takes all three axes
    _compiled[key] = Compiled(*_direct_launcher(compiled), grid, ints + ordered)


def run(described: Launch, inputs: Sequence[torch.Tensor], tabs: Tables,
        strides: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, ...]:
    """``described`` on ``inputs``, in place or into new outputs (:func:`outputs`), with the
    inputs' device current; returns the outputs."""
    outs = inputs if described.in_place else outputs(described, inputs, strides)
    with tt.on_device(inputs[0]):
        launch(described, inputs, outs, tabs)
    return outs


def _hooks_active() -> bool:
    """Whether a profiler registered Triton launch hooks (then launch the documented way)."""
    from triton import knobs

    runtime = knobs.runtime
    return bool(getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)) or bool(
        getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook)
    )


def _direct_launcher(compiled: Any) -> tuple[Any, tuple]:
    """``(fn, prefix)`` such that ``fn(gx, gy, gz, stream, *prefix, *kernel_args)`` launches
    ``compiled`` as Triton's own launch does, minus its per-call Python bookkeeping: Triton's
    C ``launch`` (which also takes the cooperative-grid and PDL flags and two scratch buffers,
    none of which our kernels use), or where that layout is not found the launcher object."""
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


class Slots(NamedTuple):
    """Where a bound launch's pointers come from: fixed addresses (``pointers``; 0 where they
    vary), ``takes`` ``(tensor, argument, byte offset)`` from the tensors a call passes (its
    inputs, then its index or an address standing for none), ``makes`` ``(tensor, shape)``
    outputs to allocate like a tensor, ``fills`` ``(output, argument, byte offset)``."""

    pointers: tuple[int, ...]
    takes: tuple[tuple[int, int, int], ...]
    makes: tuple[tuple[int, tuple[int, ...]], ...]
    fills: tuple[tuple[int, int, int], ...]
    tensors: int


def slots(sources: Sequence[tuple[torch.Tensor, int]], given: Sequence[torch.Tensor | None],
          made: Sequence[torch.Tensor] = (), like: Sequence[int] | None = None) -> Slots:
    """The :class:`Slots` of a launch's pointer ``sources`` (:func:`pointers`) for calls that
    pass tensors like ``given`` (the objects the sources name, or tensors of their addresses;
    ``None`` where a call passes an address standing for none) and get new outputs like
    ``made``, each allocated like given tensor ``like[i]`` (its dtype and device; default 0)."""
    pointers, takes, fills = [], [], []
    for slot, (t, offset) in enumerate(sources):
        at = next((i for i, x in enumerate(given) if t is x), None)
        out = next((i for i, x in enumerate(made) if t is x), None)
        if at is not None:
            takes.append((at, slot, offset))
        elif out is not None:
            fills.append((out, slot, offset))
        pointers.append(0 if at is not None or out is not None else t.data_ptr() + offset)
    like = like or (0,) * len(made)
    makes = tuple((i, tuple(o.shape)) for i, o in zip(like, made))
    return Slots(tuple(pointers), tuple(takes), makes, tuple(fills), len(given))


def bind_compiled(described: Launch, inputs: Sequence[torch.Tensor],
                  outs: Sequence[torch.Tensor], tabs: Tables,
                  given: Sequence[torch.Tensor | None], made: Sequence[torch.Tensor] = (),
                  like: Sequence[int] | None = None) -> tuple[Any, LaunchKey] | None:
    """The compiled launch that ran ``described`` from ``inputs`` into ``outs`` with ``tabs``,
    bound (:func:`bound`) to take the addresses of tensors passed like ``given`` and make new
    ones like ``made`` each call (:func:`slots`): ``(the bound launch, its key)``, or ``None``
    where no such launch is compiled, one of its pointers is not 16-byte aligned or the C
    launcher cannot bind it."""
    sources = pointers(described, inputs, outs, tabs)
    key = launch_key(described, inputs, outs, tabs,
                     tuple(t.data_ptr() + offset for t, offset in sources))
    entry = _compiled.get(key)
    if entry is None or key.aligned != (1 << len(sources)) - 1:
        return None
    made_launch = bound(entry, slots(sources, given, made, like))
    return None if made_launch is None else (made_launch, key)


def bound(entry: Compiled, where: Slots) -> Any | None:
    """``entry`` bound to ``where`` by the C launcher (:func:`direct_launch.bind`):
    ``run(stream, *tensors)`` allocates the outputs, fills their addresses and launches; it
    returns the one output, a tuple, or ``None`` in place, or ``NotImplemented`` (launching
    nothing) where a tensor is not 16-byte aligned. ``None`` where it cannot be bound (the C
    build is where Triton builds its own launchers)."""
    return direct_launch.bind(entry.prefix, entry.grid, kernel_types.get(entry.prefix[0]),
                              where.pointers + entry.tail, where.tensors, where.takes,
                              where.makes, where.fills)
