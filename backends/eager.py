"""The eager backend: plain PyTorch, every feature, CPU and CUDA; the semantic baseline.

It favours readability over speed: positions are computed as an index tensor, the table rows
gathered, and the rotation written as the formula. Autograd supplies the backward, which is the
exact transpose (each channel's gradient uses its partner's sine).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from rope_dispatch.call import RoPECall, k_call, position_index, qkv_parts
from rope_dispatch.norm import normalized
from rope_dispatch.registry import Backend
from rope_dispatch.table_kinds import pair_channels
from rope_dispatch.tables import PairCosSinCache, RateTable, table_cos_sin
from rope_dispatch.tracing import forward_ad

from .written import add_written, cache_apart, written_apart


def zigzag_positions(local: torch.Tensor, local_len: torch.Tensor | int, cp_size: int, cp_rank: int):
    """Global positions of local indices under TransformerEngine's context-parallel split.

    A rank holds chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of a sequence cut into
    ``2*cp_size`` chunks of ``local_len/2`` tokens each.
    """
    half = local_len // 2
    first = local + cp_rank * half
    second = local_len * cp_size - (cp_rank + 1) * half + local - half
    return torch.where(local < half, first, second)


def positions(
    shape: torch.Size, layout: str, cu_seqlens: torch.Tensor | None,
    index: torch.Tensor | None, cp_size: int, cp_rank: int, device: torch.device,
) -> torch.Tensor:
    """The table row of every token of a ``t`` of ``shape``: ``[s, b]``, ``[b, s]`` or ``[T]``.

    ``index`` is :func:`~rope_dispatch.call.position_index`'s: start positions (1-D) or the
    rows themselves (2-D, per token). A function of tensors and plain settings only (no
    :class:`RoPECall`), so that torch.compile can trace it with symbolic sizes.
    """
    if index is not None and index.dim() == 2:  # given per token
        return index.reshape(shape[:-2]).long()
    starts = None if index is None else index.long()
    if layout == "thd":
        cu = cu_seqlens.long() // cp_size
        token = torch.arange(shape[0], device=device)
        seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=cu.numel() - 2)
        local = token - cu[seq]
        if cp_size > 1:
            local = zigzag_positions(local, cu[seq + 1] - cu[seq], cp_size, cp_rank)
        pos = local if starts is None else local + starts[seq]
        return torch.where(token < cu[-1], pos, -1)  # past the last offset: in no sequence
    seq_len = shape[0] if layout == "sbhd" else shape[1]
    local = torch.arange(seq_len, device=device)
    pos = zigzag_positions(local, seq_len, cp_size, cp_rank) if cp_size > 1 else local
    pos = pos[:, None] if layout == "sbhd" else pos[None, :]
    if starts is not None:
        pos = pos + (starts[None, :] if layout == "sbhd" else starts[:, None])
    return pos.expand(*shape[:-2])


def table_rows(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos`` of a ``[s2, d2]`` table, NaN where ``pos`` falls outside it (index values
    the host did not read): never an out-of-bounds read, never a plausible wrong angle."""
    inside = (pos >= 0) & (pos < table.shape[0])
    rows = table[pos.clamp(0, table.shape[0] - 1)]
    return torch.where(inside.unsqueeze(-1), rows, float("nan"))


def pair_members(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members of the last dim's pairs ``(2k, 2k+1)``. An unbind, not two
    strided slices: autograd adds the +0 gradients of the channels a slice leaves out to the
    others', which turns a -0.0 gradient into +0.0; an unbind's backward stacks them."""
    return x.unflatten(-1, (-1, 2)).unbind(-1)


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every channel with its sign: rotate-half (NeoX) or pairwise (GPT-J)."""
    if interleaved:
        even, odd = pair_members(x)
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_tensors(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None,
    index: torch.Tensor | None, *, layout: str, interleaved: bool, cp_size: int,
    cp_rank: int, scale: float = 1.0, transpose: bool = False, dtype: torch.dtype | None = None,
    offset: int = 0, deinterleave: bool = False,
    angles_at: Callable[[torch.Tensor], torch.Tensor] | None = None, pairs: bool = False,
) -> torch.Tensor:
    """``out = x cos + rotate(x) sin`` on the first d2 channels in float32, the rest copied;
    ``scale`` (the spec's ``cos_sin_scale``) multiplies cos and sin.

    With ``transpose=True`` it applies the transposed map instead, which is the backward:
    ``rotate`` is a quarter turn, so its transpose is ``-rotate`` and the gradient of ``g`` is
    ``g cos - rotate(g sin)`` (each channel meets its partner's sine). ``cos``/``sin`` are
    ``[s2, d2]``, float32 or a cache's 16-bit dtype (widened by the math). Pure in its tensor
    arguments, so the compile backend traces exactly this math. ``dtype``: the output's
    (default ``t``'s; a normalized ``t`` comes in float32). With ``sin`` None, ``cos`` is an
    angle table ``[s2, d2]``: the cosines and sines of the rows read, not of the whole table;
    ``angles_at`` (a rate table's :meth:`~rope_dispatch.tables.RateTable.angles_at`) gives
    those rows' angles from the positions instead. ``pairs``: ``cos`` and ``sin`` are a pair
    cache's halves ``[s2, d2 / 2]``, each row read given to both channels of its pairs.

    ``offset``: the rotary channels are ``[offset, offset + d2)``, every other one is copied.
    ``deinterleave``: their pairs ``(2k, 2k+1)`` are first moved to ``(k, k + d2/2)`` (then
    rotate-half); the transpose rotates back and re-interleaves.
    """
    dtype = t.dtype if dtype is None else dtype
    pos = positions(t.shape, layout, cu_seqlens, index, cp_size, cp_rank, t.device)
    if sin is None:  # angles: only the rows read get a sine and a cosine
        angles = table_rows(cos, pos) if angles_at is None else angles_at(pos)
        cos, sin = torch.cos(angles).unsqueeze(-2), torch.sin(angles).unsqueeze(-2)
    else:
        cos, sin = table_rows(cos, pos), table_rows(sin, pos)
        if pairs:  # the rows read widened, not the whole cache (10^5 rows in engines)
            cos, sin = pair_channels(cos, interleaved), pair_channels(sin, interleaved)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if scale != 1.0:  # in float32: a 16-bit cos/sin cache's product would round to 16 bits
        cos, sin = cos.float() * scale, sin.float() * scale
    d2 = cos.shape[-1]
    # one split, not three slices, for the same reason as pair_members: the backward cats the
    # parts' gradients, so a -0.0 gradient (pass-through or rotated) stays -0.0, as in TE
    before, x, after = t.split((offset, d2, t.shape[-1] - offset - d2), dim=-1)
    x = x.float()
    if deinterleave and not transpose:
        x = to_halves(x)
    if transpose:
        rotated = x * cos - rotate(x * sin, interleaved)
    else:
        rotated = x * cos + rotate(x, interleaved) * sin
    if deinterleave and transpose:
        rotated = to_pairs(rotated)
    rotated = rotated.to(dtype)
    if d2 == t.shape[-1]:
        return rotated.contiguous()
    # cat keeps a permuted input's memory format: the output is contiguous in the layout
    parts = (before.to(dtype), rotated, after.to(dtype))
    return torch.cat(parts if offset else parts[1:], dim=-1).contiguous()


def to_halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(2k, 2k+1)`` of the last dim moved to ``(k, k + d/2)``."""
    return torch.cat(pair_members(x), dim=-1)


def to_pairs(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_halves`: halves ``(k, k + d/2)`` back to pairs ``(2k, 2k+1)``."""
    first, second = x.chunk(2, dim=-1)
    return torch.stack((first, second), dim=-1).flatten(-2)


def rope_eager(
    call: RoPECall, dtype: torch.dtype | None = None, apart: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of a checked call in plain PyTorch (see :func:`rope_tensors`; an inverse spec
    applies the transpose, autograd's backward then the rotation), after its norm
    stage in float32 (rounded once, at the end); in place, the rotated channels (every channel
    with a norm) are computed apart and copied back (autograd sees a ``copy_``). A packed
    qkv call is split into q and k calls and a copy of v, a q and k pair into two calls.
    ``dtype``: a single tensor's output dtype when not in place (default its own; float32 for
    a cache stage that quantizes it). ``apart``: a traced pair's memory checks
    (:func:`~rope_dispatch.backends.written.written_apart`), made once for its two calls."""
    if call.tensors == "qkv":
        q_part, k_part, v = qkv_parts(call)
        return rope_eager(q_part), rope_eager(k_part), v.clone(memory_format=torch.contiguous_format)
    if apart is None:
        apart = written_apart(call)  # (traced in place: the checks of the memory written)
    if call.tensors == "qk":
        return (rope_eager(call._replace(tensors="t", k=None, k_norm=None), apart=apart),
                rope_eager(k_call(call), apart=apart))
    spec = call.spec
    table, angles_at = call.table, None
    if isinstance(table, RateTable):  # a long rate table's angle table is never made here
        cos, sin = None, None
        angles_at = functools.partial(table.angles_at, interleaved=spec.interleaved)
    elif isinstance(table, torch.Tensor):
        cos, sin = table, None
    elif isinstance(table, PairCosSinCache):
        cos, sin = table.table.chunk(2, dim=-1)
    else:
        cos, sin = table_cos_sin(table, spec.interleaved)
    offset = spec.rotary_offset
    sliced = call.in_place and call.norm is None  # only the rotary channels are written
    t = call.t[..., offset:offset + call.rotary_dim] if sliced else call.t
    if call.in_place and call.norm is not None:
        t = t.clone()  # the norm's backward reads the input the copy below overwrites
    out = rope_tensors(
        t if call.norm is None else normalized(t, call.norm), cos, sin, spec.cu_seqlens,
        position_index(call), layout=spec.layout, interleaved=spec.interleaved,
        cp_size=spec.cp_size, cp_rank=spec.cp_rank, scale=spec.cos_sin_scale,
        dtype=t.dtype if dtype is None or call.in_place else dtype, transpose=spec.inverse,
        offset=0 if sliced else offset, deinterleave=spec.deinterleave, angles_at=angles_at,
        pairs=isinstance(table, PairCosSinCache),
    )
    if call.in_place:
        (call.t if call.norm is not None else t).copy_(add_written(out, apart))
        return call.t
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(x / scale).to(dtype)`` with the division in float32. A number becomes a tensor on
    ``x``'s device first: CUDA divides by a host number as a multiplication by its reciprocal,
    which rounds differently."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).to(dtype)


def store(pages: torch.Tensor, page: torch.Tensor, entry: torch.Tensor, valid: torch.Tensor,
          values: torch.Tensor) -> None:
    """``pages[page[i], entry[i]] = values[i]`` for the tokens ``valid`` marks, bit for bit,
    with no host read: a token not written repeats the first written token's write (the same
    bytes to the same place), and when no token is written every write puts back the bytes of
    entry (0, 0). Traced, a cache of a model dtype, and any cache on a GPU, is written in its
    own dtype: Inductor stores a write through an integer view of the cache as a conversion of
    the integer's value (torch 2.13 on the CPU: 1.5's bits, 16320, stored as 16320.0; torch
    2.11 on a GPU: no conversion of uint8 to FP8 compiles). With a forward-mode AD level open
    it is written in its own dtype too: an integer view has no tangent, and the cache takes the
    written values' tangents (zero where the cache had none)."""
    tokens = values.shape[0]
    if values.numel() == 0:  # no token, or no channel (a v of none): no byte to write
        return
    if forward_ad() or torch.compiler.is_compiling() and (
            pages.dtype in _MODEL_DTYPES or pages.is_cuda):
        target = pages
    else:
        bits = _BITS[values.element_size()]
        target, values = pages.view(bits), values.view(bits)
    first = torch.argmax(valid.int())  # the first written token, or 0 when none is
    source = torch.where(valid, torch.arange(tokens, device=valid.device), first)
    written = valid[first.reshape(1)]  # [1]: a 0-d index would be read on the host
    page, entry = torch.where(written, page[source], 0), torch.where(written, entry[source], 0)
    target.index_put_((page, entry), torch.where(written, values[source], target[0, 0]))


def rope_to_cache_eager(call: RoPECall) -> torch.Tensor:
    """The cache stage composed of eager steps: k rotated (float32 where the cache quantizes
    it), k and v stored at their slots, then q rotated and given out (quantized where FP8)."""
    write = call.cache_write
    cache = write.cache
    wide = torch.float32
    apart = cache_apart(call)  # (traced: the checks of the memory written, which each adds)
    k_rot = rope_eager(k_call(call)._replace(cache_write=None), wide if cache.quantized else None)
    k_rot, v = add_written(k_rot, apart), add_written(write.v, apart)
    if cache.quantized:
        k_rot = quantize(k_rot, cache.k_scale, cache.dtype)
        v = quantize(v, cache.v_scale, cache.dtype)
    k_pages, v_pages = cache.pages()
    page, entry, valid = cache.locate()
    store(k_pages, page, entry, valid, k_rot)
    store(v_pages, page, entry, valid, v)
    q_call = call._replace(tensors="t", k=None, k_norm=None, cache_write=None)
    if write.q_scale is None:
        q_rot = add_written(rope_eager(q_call), apart)
    else:
        q_rot = quantize(add_written(rope_eager(q_call, wide), apart), write.q_scale,
                         write.q_dtype)
    if write.q_out is None:
        return q_rot
    return write.q_out.copy_(q_rot)


class EagerBackend(Backend):
    """Plain PyTorch: always available, every feature; slow but obviously right."""

    name = "eager"
    differentiates_table = True  # torch's autograd through cos and sin of the table
    description = "plain PyTorch ops (reference semantics, CPU and CUDA)"
    priority = 0
    # a meta tensor (a model built on torch.device("meta")) gets its output's shape, dtype and
    # strides from the same ops, as torch's own do; nothing is read
    devices = frozenset({"cpu", "cuda", "meta"})
    supports_in_place = True
    supports_norm = True
    supports_inverse = True
    supports_rotary_offset = True
    supports_deinterleave = True
    supports_cache_write = True
    supports_cache_v_head_dim = True
    supports_positions = True
    tables = frozenset({"angles", "cos_sin_cache", "pair_cos_sin_cache", "rates", "precise_rates"})
    tensors = frozenset({"t", "qk", "qkv"})

    def apply(self, call: RoPECall) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if call.cache_write is not None:
            return rope_to_cache_eager(call)
        return rope_eager(call)
