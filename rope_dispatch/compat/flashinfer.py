"""The serving engines' RoPE calls in FlashInfer's forms, running on rope-dispatch:
``apply_rope_with_cos_sin_cache_inplace`` (the form vLLM and SGLang use too) and the FP8
serving prologue's ``rope_quantize_fp8``, ``mla_rope_quantize_fp8`` and
``rope_quantize_fp8_append_paged_kv_cache``.

One changed import moves such code over::

    from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

``apply_rope_with_cos_sin_cache_inplace`` is an adapter: it maps arguments and checks only that
they can be mapped (``query`` and ``key`` 2-D with ``head_size`` dividing their width, already
3-D with ``head_size`` last, or of more dims as FlashInfer's own ``view(nnz, -1, head_size)``
views them); the core checks the rest. ``query`` ``[nnz, heads * head_size]`` and ``key``
``[nnz, kv_heads * head_size]`` become ``[nnz, heads, head_size]`` views (no copy,
any row stride: slices of a fused qkv projection work), ``positions`` the per-token
positions of a thd call without offsets, ``cos_sin_cache`` a
:class:`~rope_dispatch.PairCosSinCache` (no copy), ``is_neox`` the spec's ``interleaved``
(negated); then :func:`rope_dispatch.apply_qk_` rotates q and k in place in one launch.

The three FP8 doors are adapters too, composed from one :func:`rope_dispatch.rope_to_cache`
call each (signatures, defaults and return values: ``flashinfer/rope.py`` of FlashInfer
0.6.17 / 0.6.18; semantics: its CUDA kernels, ``include/flashinfer/pos_enc.cuh``). The rope
parts (``q_rope``, ``k_rope``) are rotated over their whole width by the core; the nope parts
are only quantized. ``quant_scale_q`` and ``quant_scale_kv`` multiply (FlashInfer stores
``x * quant_scale``); rope-dispatch's FP8 stores ``x / scale``, so they map to
``q_scale = 1 / quant_scale_q`` and ``k_scale = v_scale = 1 / quant_scale_kv``. How each maps:

- ``rope_quantize_fp8`` / ``mla_rope_quantize_fp8``: ``q_rope`` is q, ``k_rope`` k and
  ``k_nope`` v of a :class:`~rope_dispatch.FlatKVCache` whose k and v caches are ``k_rope_out``
  and ``k_nope_out`` (token ``i`` at slot ``i``); ``q_rope_out`` is ``q_out``. ``q_nope`` is
  quantized into ``q_nope_out`` beside that call, by the same formula (on a GPU one launch of
  the Triton backend's quantizing copy, unless another backend is forced). MLA's 2-D
  ``k_rope``/``k_nope`` are one kv head (``[nnz, 1, dim]`` views).
- ``rope_quantize_fp8_append_paged_kv_cache``, MLA (2-D ``k_rope``): a
  :class:`~rope_dispatch.FlashInferPagedKVCache` whose k cache is ``kpe_cache`` and v cache
  ``ckv_cache`` (``[max_pages, page_size, 1, dim]`` views), ``k_rope`` its k and ``k_nope``
  its v; ``q_nope`` as above.
- The same, GQA/MHA (3-D ``k_rope``): the cache's k entry is ``k_rope`` rotated followed by
  ``k_nope``, so k is the two joined (``[nnz, kv_heads, rope_dim + no_rope_dim]``, rotary dim
  ``rope_dim``: partial rotary), and so is q (the core takes q and k of one head dim). The
  join is a view where the nope part follows the rope part in memory (slices of one
  projection output), else a copy; the same holds for ``q_rope_out``/``q_nope_out``.

What the core checks names its own arguments (``positions`` for ``pos_ids``, ``freqs`` for
``cos_sin_cache``, ``v`` for ``k_nope``, ...); such an error says how the door mapped them.

Where FlashInfer's kernels and these doors differ:

- Scales: ``x / (1 / s)`` in float32 equals FlashInfer's ``x * s`` bit for bit when ``s`` is
  a power of two (the default 1.0 too); for other scales a value may land on the neighbouring
  FP8 value where float32 rounding of ``1 / s`` moves it across a rounding boundary.
- Overflow: FlashInfer's cast saturates (``__NV_SATFINITE``: past the largest finite FP8 value
  it stores that value), and so do the Triton backend's stores (``q_nope``'s too); the eager
  composition casts as torch casts, which (torch 2.13) saturates ``float8_e4m3fn`` at 448 too
  but rounds ``float8_e5m2`` values from 61440 up to inf (FlashInfer: 57344). A scale that
  keeps values in range gives the same bytes.
- Padding (``batch_indices`` negative): FlashInfer's kernel skips the whole token, its q rows
  too; here only the cache write is skipped and its q rows are written (rotated).
- Wider than FlashInfer: float32 inputs, any strides (FlashInfer: the last dim contiguous),
  k and v caches of different strides (FlashInfer addresses v with k's); ``enable_pdl`` (a
  launch option) is accepted and ignored, and so is ``backend`` (``"cuda"`` or ``"cutile"``,
  FlashInfer 0.6.18's: one formula either way).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

from ..backends.written import add_written, door, outs_apart
from ..overlap import expanded_dim, refuse_self_overlap, refuse_shared
from ..dispatch import _scoped_or_env_backend, apply_qk_, rope_to_cache
from ..errors import RoPEError, RoPETypeError
from ..kv_cache import FP8_DTYPES, FlashInferPagedKVCache, FlatKVCache
from ..registry import get_backend
from ..spec import SUPPORTED_DTYPES, RoPESpec, _boolean, constant_spec, dtype_name
from ..tables import PairCosSinCache
from ..tracing import forward_ad, memoryless

__all__ = ["apply_rope_with_cos_sin_cache_inplace", "mla_rope_quantize_fp8", "rope_quantize_fp8",
           "rope_quantize_fp8_append_paged_kv_cache"]

_specs: dict[tuple, RoPESpec] = {
    (dtype, interleaved): RoPESpec(layout="thd", dtype=dtype, interleaved=interleaved)
    for dtype in SUPPORTED_DTYPES for interleaved in (False, True)
}
"""Each spec a door call can take, made at import: a compiled step reads this dict (pydantic is
not traced), and an eager call adding to it later would fail that read's guard (a new graph)."""
_caches: dict[int, tuple[torch.Tensor, PairCosSinCache, Optional[tuple]]] = {}
_MAX_CACHES = 4
_paged: dict[tuple, tuple[FlashInferPagedKVCache, tuple]] = {}
_MAX_PAGED = 64
_DIVISORS: dict[tuple[float, torch.device], torch.Tensor] = {}
"""q_nope's float32 divisors by scale and device (a launch each call otherwise); never
written, the last few kept."""


def _pair_cache(cos_sin_cache: torch.Tensor) -> PairCosSinCache:
    """The same wrapper for the same cache tensor, call after call, so rope-dispatch's plan for
    the call (kept per table object) serves every layer and step. The last few caches seen stay
    referenced here (an engine keeps one per model for its lifetime anyway). A cache that
    requires grad is read as a constant (``detach()``, the same memory): the engines' ops
    never differentiate it, and take it as it is. That constant is kept while it is the cache's
    memory (``cache.data = ...`` gives the cache new memory), and never from a call with no
    memory to read (traced, fake tensors, torch.func), whose constant is its own. A call
    Dynamo traces makes its own wrapper and leaves the memo alone: a lookup there is a guard on
    the memo's contents, which the trace's own store made fail at the next step (one more
    graph), and an intermediate's id() cannot be stored (fullgraph refused it)."""
    traced = torch.compiler.is_compiling()
    entry = None if traced else _caches.get(id(cos_sin_cache))
    if entry is not None and entry[0] is cos_sin_cache and (
            entry[1].table is cos_sin_cache
            or (not memoryless() and entry[2] == _memory(cos_sin_cache))):
        return entry[1]
    detached = isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.requires_grad
    constant = cos_sin_cache.detach() if detached else cos_sin_cache
    try:
        made = PairCosSinCache(constant)
    except RoPEError as error:  # the wrapper's complaint, told of the door's argument
        raise type(error)(str(error).replace("PairCosSinCache's table", "cos_sin_cache")
                          ) from error
    if traced or (detached and memoryless()):
        return made
    if len(_caches) >= _MAX_CACHES:
        _caches.clear()
    _caches[id(cos_sin_cache)] = (cos_sin_cache, made,
                                  _memory(cos_sin_cache) if detached else None)
    return made


def _memory(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


def _paged_cache(caches: tuple[torch.Tensor, torch.Tensor], kv_indices: torch.Tensor,
                 kv_indptr: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
                 kv_layout: str, page_size: int, scale: float,
                 mla: bool = False, traced: Optional[bool] = None) -> FlashInferPagedKVCache:
    """The same descriptor for the same tensors and settings, call after call: an engine passes
    each layer its own cache and every layer the step's index buffers, and a descriptor is
    checked, and works out what a planned call reads of it, when it is made (several us of
    host time). MLA's ``(ckv_cache, kpe_cache)`` become one kv head each, the key part's cache
    as k. The last few stay referenced here with the tensors given, so the ids in a kept
    descriptor's key name no other tensor while it is kept."""
    given = (*caches, kv_indices, kv_indptr, batch_indices, positions)
    if traced is None:  # (else the caller asked)
        traced = torch.compiler.is_compiling()  # the trace's own (Dynamo may not id() a tensor)
    key = None if traced else (*map(id, given), kv_layout, page_size, scale, mla)
    kept = _paged.get(key) if type(page_size) is int and key else None  # (bad: the checks)
    if kept is not None:
        return kept[0]
    pages = (caches[1].unsqueeze(2), caches[0].unsqueeze(2)) if mla else caches
    cache = FlashInferPagedKVCache(pages, kv_indices, kv_indptr, batch_indices, positions,
                                   kv_layout=kv_layout, page_size=page_size, k_scale=scale,
                                   v_scale=scale)
    if traced:
        return cache
    if len(_paged) >= _MAX_PAGED:
        _paged.clear()
    _paged[key] = (cache, given)
    return cache


def _spec(dtype: torch.dtype, interleaved: bool) -> RoPESpec:
    """A thd spec without offsets (a batch of tokens), from a small cache: pydantic validation
    costs microseconds, and a serving step calls this once per layer."""
    key = (dtype, interleaved)
    spec = _specs.get(key)
    if spec is None:
        if torch.compiler.is_compiling():  # the trace's own (pydantic is not traced)
            return constant_spec(layout="thd", dtype=dtype, interleaved=interleaved)
        spec = _specs[key] = RoPESpec(layout="thd", dtype=dtype, interleaved=interleaved)
    return spec


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotate ``query`` and ``key`` in place, in one launch, FlashInfer's way.

    ``positions`` ``[nnz]`` int32/int64 (one per token); ``query`` ``[nnz, heads * head_size]``;
    ``key`` ``[nnz, kv_heads * head_size]``; ``cos_sin_cache`` float32 ``[max_pos, rotary_dim]``
    holding, per position, the cosines of the ``rotary_dim / 2`` pair angles and then their
    sines (read as a constant where it requires grad: FlashInfer's op does not differentiate
    it). The rotary dim is the cache's last dim; channels past it are left untouched.
    ``is_neox=True`` rotates the two halves of the rotary channels (pairs ``i``, ``i +
    rotary_dim/2``), ``False`` adjacent pairs (``2i``, ``2i + 1``). Returns ``None``.

    Positions outside the cache give NaN rows on a GPU, and a clear error on the CPU (values
    on a GPU are not read: no host sync, CUDA-graph safe; see docs/semantics.md).
    """
    if type(is_neox) is not bool:
        is_neox = _flag("is_neox", is_neox)
    q, k = _heads("query", query, head_size), _heads("key", key, head_size)
    _floating("query", q)
    if positions is None:  # the core would ask for a thd spec's cu_seqlens instead
        raise RoPETypeError("positions must be an int32 or int64 tensor [nnz], got None")
    door.state.words = _INPLACE_DOOR  # (the in-graph checks' words, traced)
    try:
        apply_qk_(q, k, _pair_cache(cos_sin_cache), _spec(query.dtype, not is_neox),
                  positions=positions)
    except RoPEError as error:
        raise _mapped(error, "apply_rope_with_cos_sin_cache_inplace", _INPLACE_MAPPING,
                      "apply_qk_") from error
    finally:
        door.state.words = None


def _floating(name: str, x: torch.Tensor) -> None:
    """A dtype the spec refuses, refused naming the argument (the spec names its field)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise RoPEError(f"{name} must be float32, float16 or bfloat16, got {dtype_name(x.dtype)}")


def _heads(name: str, x: object, head_size: object) -> torch.Tensor:
    """``x`` ``[nnz, heads * head_size]`` as a ``[nnz, heads, head_size]`` view, or ``x``
    itself when it is already ``[nnz, heads, head_size]`` (SGLang passes some so). Any other
    ``x`` of 2 or more dims whose last dim ``head_size`` divides is viewed as FlashInfer views
    it, ``x.view(nnz, -1, head_size)`` (a 4-D ``[nnz, groups, heads, head_size]`` too)."""
    if type(head_size) is int and head_size > 0 and isinstance(x, torch.Tensor):
        shape = x.shape  # once: each .shape and .dim() costs ~0.1 us
        if len(shape) == 3 and shape[2] == head_size:
            return x
        if len(shape) == 2 and not shape[1] % head_size:
            return x.view(shape[0], shape[1] // head_size, head_size)
    if (isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral)
            or head_size <= 0):  # a NumPy integer is taken, as FlashInfer's view takes it
        raise RoPEError(f"head_size must be a positive int, got {head_size!r}")
    head_size = int(head_size)
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[2] == head_size:
        return x
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] % head_size:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise RoPEError(
            f"{name} must be [nnz, heads * head_size] or [nnz, heads, head_size] (or [nnz, ..., "
            f"n * head_size], as FlashInfer views it) with head_size={head_size}, got {got}"
        )
    try:  # FlashInfer's own view: [nnz, -1, head_size]; in place, so never a copy
        return x.view(x.shape[0], math.prod(x.shape[1:]) // head_size, head_size)
    except RuntimeError:
        raise RoPEError(
            f"{name} {tuple(x.shape)} with strides {x.stride()} cannot be viewed as [nnz, heads, "
            f"head_size={head_size}] without a copy (rotated in place, it must be)"
        ) from None


# ---------------------------------------------------------------------------------------------
# The FP8 serving prologue: RoPE, FP8 quantization and (optionally) the paged KV-cache append.


def rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: Optional[torch.Tensor],
    k_nope: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
    backend: str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the rope parts of q and k and quantize all four parts to FP8, FlashInfer's way.

    ``q_rope`` ``[nnz, heads, rope_dim]``, ``q_nope`` ``[nnz, heads, no_rope_dim]``;
    ``k_rope``/``k_nope`` ``[nnz, kv_heads, rope_dim]``/``[nnz, kv_heads, no_rope_dim]``
    (GQA, MHA) or ``[nnz, rope_dim]``/``[nnz, no_rope_dim]`` (MLA); a ``None`` nope part has no
    channels. ``cos_sin_cache`` float32 ``[max_pos, rope_dim]`` (cosines, then sines);
    ``pos_ids`` ``[nnz]`` each token's row. ``is_neox=False`` rotates adjacent pairs.
    Every output is ``(x * quant_scale)`` cast to ``quantize_dtype`` (default: the first given
    output's dtype, else ``float8_e4m3fn``), ``quant_scale_q`` for q's parts and
    ``quant_scale_kv`` for k's; the rope parts are rotated in float32 first. Outputs not given
    are allocated like their inputs. Returns ``(q_rope_out, k_rope_out, q_nope_out,
    k_nope_out)``, the given tensors themselves where given.

    Composed from one :func:`~rope_dispatch.rope_to_cache` into a
    :class:`~rope_dispatch.FlatKVCache` made of ``k_rope_out`` and ``k_nope_out``, and
    ``q_nope``'s quantization (see the module docstring).
    """
    name = "rope_quantize_fp8"
    is_neox = _flag("is_neox", is_neox)
    _flag("enable_pdl", enable_pdl)
    if backend not in ("cuda", "cutile"):
        raise RoPEError(f"backend must be 'cuda' or 'cutile' (FlashInfer's), got {backend!r}")
    q_rope, k_rope, mla = _rope_parts(q_rope, k_rope)
    _floating("q_rope", q_rope)
    # a None q_nope stays None (only q_nope_out is made like it); k_nope is the core's v
    q_nope, k_nope = _nope("q_nope", q_nope, q_rope), _nope("k_nope", k_nope, k_rope, make=True)
    dtype = _quantize_dtype(quantize_dtype, (("q_rope_out", q_rope_out),
                                             ("k_rope_out", k_rope_out),
                                             ("q_nope_out", q_nope_out),
                                             ("k_nope_out", k_nope_out)))
    q_rope_out = _out("q_rope_out", q_rope_out, q_rope, dtype)
    k_rope_out = _out("k_rope_out", k_rope_out, k_rope, dtype)
    q_nope_out = _out("q_nope_out", q_nope_out, q_nope, dtype, q_rope)
    k_nope_out = _out("k_nope_out", k_nope_out, k_nope, dtype)
    q_scale = _reciprocal("quant_scale_q", quant_scale_q)
    kv_scale = _reciprocal("quant_scale_kv", quant_scale_kv)
    table = _rope_table(cos_sin_cache, q_rope)
    others = (("q_rope_out", q_rope_out), ("k_rope_out", k_rope_out),
              ("k_nope_out", k_nope_out), ("q_nope", q_nope))
    apart = _written_apart("q_nope_out", q_nope_out, others)
    if q_rope.shape[0]:
        heads = _one_head if mla else _as_is
        door.state.words = _FLAT_DOOR  # (the in-graph checks' words, traced)
        try:
            slots = torch.arange(q_rope.shape[0], device=k_rope.device)
            cache = FlatKVCache(heads(k_rope_out), heads(k_nope_out), slots,
                                k_scale=kv_scale, v_scale=kv_scale)
            rope_to_cache(q_rope, heads(k_rope), heads(k_nope), table,
                          _spec(q_rope.dtype, not is_neox), positions=pos_ids, cache=cache,
                          q_out=q_rope_out, q_scale=q_scale)
        except RoPEError as error:
            raise _mapped(error, name, _FLAT_MAPPING) from error
        finally:
            door.state.words = None
    _quantize_into(q_nope_out, q_nope, q_scale, apart)
    return q_rope_out, k_rope_out, q_nope_out, k_nope_out


def mla_rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope_quantize_fp8` under FlashInfer's MLA name (``k_rope`` ``[nnz, rope_dim]``,
    ``k_nope`` ``[nnz, kv_lora_rank]``, as FlashInfer's wrapper forwards them); the same
    arguments and return value."""
    return rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
        quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out,
        enable_pdl,
    )


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: Optional[torch.Tensor],
    k_nope: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate, quantize to FP8 and append k (and v) to FlashInfer's paged KV cache; return q.

    Shapes as :func:`rope_quantize_fp8`'s. GQA/MHA (3-D ``k_rope``): ``v`` ``[nnz, kv_heads,
    rope_dim + no_rope_dim]``, ``paged_kv_cache`` ``(k_cache, v_cache)``, each ``[max_pages,
    page_size, kv_heads, head_dim]`` (``kv_layout="NHD"``) or ``[max_pages, kv_heads,
    page_size, head_dim]`` (``"HND"``); a k entry holds ``k_rope`` rotated, then ``k_nope``.
    MLA (2-D ``k_rope``): ``v`` must be ``None``, ``paged_kv_cache`` ``(ckv_cache,
    kpe_cache)``, ``[max_pages, page_size, no_rope_dim]`` and ``[max_pages, page_size,
    rope_dim]``, taking ``k_nope`` and ``k_rope`` rotated (``kv_layout`` is not used). Token
    ``i`` (rotated at row ``pos_ids[i]``) of request ``b = batch_indices[i]`` at place ``p =
    positions[i]`` in it goes to page ``kv_indices[kv_indptr[b] + p // page_size]``, entry ``p
    % page_size``; a negative ``batch_indices[i]`` skips its write (CUDA-graph padding). The
    caches hold ``quantize_dtype`` (default: ``q_rope_out``'s, else ``q_nope_out``'s, else
    ``float8_e4m3fn``), storing ``x * quant_scale_kv``. Returns ``(q_rope_out, q_nope_out)``
    (``x * quant_scale_q``), the given tensors themselves where given.

    Composed from one :func:`~rope_dispatch.rope_to_cache` into a
    :class:`~rope_dispatch.FlashInferPagedKVCache` (see the module docstring).
    """
    name = "rope_quantize_fp8_append_paged_kv_cache"
    is_neox = _flag("is_neox", is_neox)
    _flag("enable_pdl", enable_pdl)
    if kv_layout not in ("NHD", "HND"):
        raise RoPEError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    q_rope, k_rope, mla = _rope_parts(q_rope, k_rope)
    _floating("q_rope", q_rope)
    # None nope parts stay None but MLA's k_nope, the core's v (GQA/MHA: the rope part alone
    # is joined, and q_nope_out is made like a q_nope of no channels)
    q_nope = _nope("q_nope", q_nope, q_rope)
    k_nope = _nope("k_nope", k_nope, k_rope, make=mla)
    dtype = _quantize_dtype(quantize_dtype, (("q_rope_out", q_rope_out),
                                             ("q_nope_out", q_nope_out)))
    q_rope_out = _out("q_rope_out", q_rope_out, q_rope, dtype)
    q_nope_out = _out("q_nope_out", q_nope_out, q_nope, dtype, q_rope)
    caches = _cache_pair(paged_kv_cache, mla, dtype)
    q_scale = _reciprocal("quant_scale_q", quant_scale_q)
    kv_scale = _reciprocal("quant_scale_kv", quant_scale_kv)
    table, spec = _rope_table(cos_sin_cache, q_rope), _spec(q_rope.dtype, not is_neox)
    if mla:
        if v is not None:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise RoPEError(
                f"v must be None for MLA (2-D k_rope: k_nope is the compressed kv), got {got}")
        others = (("q_rope_out", q_rope_out), ("q_nope", q_nope),
                  *zip(("ckv_cache", "kpe_cache"), caches))
        apart = _written_apart("q_nope_out", q_nope_out, others)
        door.state.words = _PAGED_MLA_DOOR
        try:
            cache = _paged_cache(caches, kv_indices, kv_indptr, batch_indices, positions, "NHD",
                                 page_size, kv_scale, mla=True)
            rope_to_cache(q_rope, _one_head(k_rope), _one_head(k_nope), table, spec,
                          positions=pos_ids, cache=cache, q_out=q_rope_out, q_scale=q_scale)
        except RoPEError as error:
            raise _mapped(error, name, _PAGED_MLA_MAPPING) from error
        finally:
            door.state.words = None
        _quantize_into(q_nope_out, q_nope, q_scale, apart)
        return q_rope_out, q_nope_out
    if not isinstance(v, torch.Tensor):
        raise RoPETypeError(
            f"v must be a tensor [nnz, num_kv_heads, head_dim] for GQA/MHA (3-D k_rope), got "
            f"{type(v).__name__}"
        )
    widths = tuple(0 if x is None else x.shape[-1] for x in (q_nope, k_nope))
    if widths[0] != widths[1]:  # q's and k's heads are joined to one head dim
        raise RoPEError(f"q_nope has {widths[0]} channels a head but k_nope {widths[1]} (None: "
                        "0); with GQA/MHA their nope parts must be equally wide")
    traced = torch.compiler.is_compiling()  # (no address to read: the joins are copies)
    q, k = _joined("q", q_rope, q_nope, traced), _joined("k", k_rope, k_nope, traced)
    q_out = _joined("q_out", q_rope_out, q_nope_out, traced, copy=False)
    if q_out is None:  # outputs apart: the core writes one, copied into them below
        named = tuple(zip(("k_cache", "v_cache"), caches))
        aparts = (_written_apart("q_rope_out", q_rope_out, named),
                  _written_apart("q_nope_out", q_nope_out, (("q_rope_out", q_rope_out), *named)))
        q_into = torch.empty_like(q, dtype=dtype)
    else:
        q_into = q_out
    door.state.words = _PAGED_DOOR
    try:
        cache = _paged_cache(caches, kv_indices, kv_indptr, batch_indices, positions, kv_layout,
                             page_size, kv_scale, traced=traced)
        q_rot = rope_to_cache(q, k, v, table, spec, positions=pos_ids, cache=cache,
                              q_out=q_into, q_scale=q_scale)
    except RoPEError as error:
        raise _mapped(error, name, _PAGED_MAPPING) from error
    finally:
        door.state.words = None
    if q_out is None:
        rope_dim = q_rope.shape[-1]
        q_rope_out.copy_(add_written(q_rot[..., :rope_dim], aparts[0]))
        q_nope_out.copy_(add_written(q_rot[..., rope_dim:], aparts[1]))
    return q_rope_out, q_nope_out


def _flag(name: str, value: object) -> bool:
    """``value`` as a bool: ``True``, ``False`` or a NumPy bool (as the spec takes flags)."""
    if type(value) is bool:
        return value
    try:
        return _boolean(value)
    except ValueError:
        raise RoPEError(f"{name} must be a bool, got {value!r}") from None


def _rope_parts(q_rope: object, k_rope: object) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """q_rope ``[nnz, heads, rope_dim]`` and k_rope 3-D (GQA/MHA) or 2-D (MLA) with q's tokens
    and rope dim; and whether it is MLA."""
    if isinstance(q_rope, torch.Tensor) and isinstance(k_rope, torch.Tensor):
        q_shape, k_shape = q_rope.shape, k_rope.shape  # each .shape and .dim() costs ~0.1 us
        if (len(q_shape) == 3 and len(k_shape) in (2, 3) and k_shape[0] == q_shape[0]
                and k_shape[-1] == q_shape[-1]):
            return q_rope, k_rope, len(k_shape) == 2
    if not isinstance(q_rope, torch.Tensor) or q_rope.dim() != 3:
        raise (RoPEError if isinstance(q_rope, torch.Tensor) else RoPETypeError)(
            f"q_rope must be a tensor [nnz, num_qo_heads, rope_dim], got {_described(q_rope)}"
        )
    if (not isinstance(k_rope, torch.Tensor) or k_rope.dim() not in (2, 3)
            or k_rope.shape[0] != q_rope.shape[0] or k_rope.shape[-1] != q_rope.shape[-1]):
        raise (RoPEError if isinstance(k_rope, torch.Tensor) else RoPETypeError)(
            f"k_rope must be a tensor [nnz, num_kv_heads, rope_dim] (GQA/MHA) or [nnz, rope_dim] "
            f"(MLA) with q_rope's nnz {q_rope.shape[0]} and rope_dim {q_rope.shape[-1]}, got "
            f"{_described(k_rope)}"
        )
    return q_rope, k_rope, k_rope.dim() == 2


def _nope(name: str, nope: object, rope: torch.Tensor,
          make: bool = False) -> Optional[torch.Tensor]:
    """A nope part shaped like its rope part but for the last dim; ``None`` stays ``None``, or
    with ``make`` becomes a new tensor of no channels (for a caller that reads one: making it
    costs microseconds)."""
    if nope is None:
        return _no_channels(rope) if make else None
    if not isinstance(nope, torch.Tensor) or nope.shape[:-1] != rope.shape[:-1]:
        form = "[nnz, no_rope_dim]" if rope.dim() == 2 else "[nnz, heads, no_rope_dim]"
        raise (RoPEError if isinstance(nope, torch.Tensor) else RoPETypeError)(
            f"{name} must be None or a tensor {form} with the rope part's leading dims "
            f"{tuple(rope.shape[:-1])}, got {_described(nope)}"
        )
    if nope.dtype != rope.dtype or nope.device != rope.device:  # one kernel dtype, FlashInfer's
        raise RoPEError(
            f"{name} must have {name.replace('nope', 'rope')}'s dtype and device "
            f"({dtype_name(rope.dtype)} on {rope.device}), got {_described(nope)}"
        )
    if nope.requires_grad and torch.is_grad_enabled():  # (q_nope's division would fail late)
        raise RoPEError(
            f"{name} requires grad, but the FP8 prologue writes outputs and caches and has no "
            "backward; call it under torch.no_grad() or torch.inference_mode()"
        )
    return nope


def _quantize_dtype(quantize_dtype: object,
                    outs: Sequence[tuple[str, Optional[torch.Tensor]]]) -> torch.dtype:
    """FlashInfer's rule: ``quantize_dtype``, else the first given output's dtype, else
    ``float8_e4m3fn``; an FP8 dtype."""
    if quantize_dtype is None:
        for name, out in outs:
            if isinstance(out, torch.Tensor):
                if out.dtype not in FP8_DTYPES:
                    raise RoPEError(
                        f"{name} must be float8_e4m3fn or float8_e5m2 (it sets quantize_dtype), "
                        f"got {dtype_name(out.dtype)}"
                    )
                return out.dtype
        return torch.float8_e4m3fn
    if quantize_dtype not in FP8_DTYPES:
        raise RoPEError(
            f"quantize_dtype must be torch.float8_e4m3fn, torch.float8_e5m2 or None, got "
            f"{quantize_dtype!r}"
        )
    return quantize_dtype  # type: ignore[return-value]


def _out(name: str, out: object, like: Optional[torch.Tensor], dtype: torch.dtype,
         rope: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An output as FlashInfer takes it: ``like``'s shape and device, ``dtype``; ``None``: a new
    one, allocated as FlashInfer allocates it (``empty_like``). ``like`` ``None``: a None nope
    part of ``rope`` (its leading dims, no channels), not made unless ``out`` must be checked
    against it."""
    if like is None:
        if out is None:
            return _no_channels(rope, dtype)  # type: ignore[arg-type]
        like = _no_channels(rope)  # type: ignore[arg-type]
    if out is None:
        return torch.empty_like(like, dtype=dtype)
    if (not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != dtype
            or out.device != like.device):
        raise (RoPEError if isinstance(out, torch.Tensor) else RoPETypeError)(
            f"{name} must be None or a tensor {tuple(like.shape)} {dtype_name(dtype)} on "
            f"{like.device} (its input's shape and device, quantize_dtype), got {_described(out)}"
        )
    if expanded_dim(out) is not None:  # (q_nope_out's division would fail after the writes)
        raise RoPEError(f"{name} is an expanded tensor (a dim of stride 0); it cannot be written")
    refuse_self_overlap(out, name, f"the FP8 prologue cannot write {name}",
                        f"give {name} memory of its own")
    if out.requires_grad and torch.is_grad_enabled():
        raise RoPEError(f"{name} requires grad, but the FP8 prologue writes it and has no "
                        "backward; call it under torch.no_grad() or torch.inference_mode()")
    if not memoryless() and out.is_inference() and not torch.is_inference_mode_enabled():
        raise RoPEError(f"{name} is an inference tensor and inference mode is off (torch forbids "
                        "updating it there); call under torch.inference_mode()")
    return out


def _no_channels(rope: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A new tensor of ``rope``'s leading dims and no channels, of ``rope``'s device and dtype (or
    ``dtype``): ``rope.new_empty((*lead, 0))``, and ``empty_like`` of it for another dtype. For a
    plain strided tensor that is ``torch.empty(*lead, 0, ...)`` (the same contiguous tensor) at
    about half the host cost of ``new_empty`` and a third of the pair."""
    if type(rope) is torch.Tensor and rope.layout is torch.strided:
        return torch.empty(*rope.shape[:-1], 0, dtype=rope.dtype if dtype is None else dtype,
                           device=rope.device)
    nope = rope.new_empty((*rope.shape[:-1], 0))
    return nope if dtype is None else torch.empty_like(nope, dtype=dtype)


def _reciprocal(name: str, scale: object) -> float:
    """``1 / scale``: FlashInfer's multiplying scale as rope-dispatch's dividing one."""
    if type(scale) is float and 0.0 < scale < math.inf:  # the common case, without the ABC check
        return 1.0 / scale
    if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
            or not (math.isfinite(scale) and scale > 0)):
        raise (RoPEError if isinstance(scale, numbers.Real) else RoPETypeError)(
            f"{name} must be a positive finite number (the FP8 value is x * {name}), got "
            f"{scale!r}"
        )
    return 1.0 / float(scale)


def _rope_table(cos_sin_cache: object, q_rope: torch.Tensor) -> PairCosSinCache:
    """The engine's cache as the table, one column per rope channel (FlashInfer's rope dim is
    q_rope's last dim: the whole rope part turns, none passes through)."""
    table = _pair_cache(cos_sin_cache)  # checks the tensor itself
    if table.rotary_dim != q_rope.shape[-1]:
        raise RoPEError(
            f"cos_sin_cache must be [max_pos, rope_dim] with rope_dim = q_rope.shape[-1] = "
            f"{q_rope.shape[-1]}, got {tuple(table.table.shape)}"
        )
    return table


def _cache_pair(paged_kv_cache: object, mla: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_kv_cache`` as two tensors of ``dtype``, 3-D for MLA (FlashInfer's rule: the
    caches hold quantize_dtype)."""
    if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2:  # the common case first
        first, second = paged_kv_cache
        if (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
                and first.dim() == (3 if mla else 4) and second.dim() == first.dim()
                and first.dtype == dtype and second.dtype == dtype):
            return first, second
    form = ("(ckv_cache, kpe_cache), [max_pages, page_size, dim] each (MLA: 2-D k_rope)" if mla
            else "(k_cache, v_cache), 4-D each (GQA/MHA: 3-D k_rope)")
    if (not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2
            or not all(isinstance(c, torch.Tensor) for c in paged_kv_cache)):
        raise RoPETypeError(f"paged_kv_cache must be {form}, got {type(paged_kv_cache).__name__}")
    first, second = paged_kv_cache
    if first.dim() != (3 if mla else 4) or second.dim() != first.dim():
        raise RoPEError(
            f"paged_kv_cache must be {form}, got shapes {tuple(first.shape)} and "
            f"{tuple(second.shape)}"
        )
    if first.dtype != dtype or second.dtype != dtype:
        raise RoPEError(
            f"paged_kv_cache holds {dtype_name(first.dtype)} and {dtype_name(second.dtype)} but "
            f"quantize_dtype is {dtype_name(dtype)} (given, or q_rope_out's, else the default "
            "float8_e4m3fn); the caches must hold quantize_dtype"
        )
    return first, second


def _one_head(x: torch.Tensor) -> torch.Tensor:
    """MLA's ``[nnz, dim]`` k part as one kv head, ``[nnz, 1, dim]`` (a view)."""
    return x.unsqueeze(1)


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _joined(name: str, rope: torch.Tensor, nope: Optional[torch.Tensor], traced: bool = False,
            copy: bool = True) -> Optional[torch.Tensor]:
    """``[..., rope_dim + no_rope_dim]``: the rope part followed by the nope part. ``rope``
    itself without nope channels (``nope`` ``None`` too); a view where ``nope`` follows ``rope``
    in memory with its strides (slices of one tensor); else a copy, or ``None`` when ``copy`` is
    False. ``traced`` (while torch.compile traces) no address is read: a copy (``None``)
    always, which gives the same values (the door then checks and writes its q outputs
    apart)."""
    if nope is None or nope.shape[-1] == 0:
        return rope
    if (rope.dtype == nope.dtype and rope.device == nope.device and rope.stride() == nope.stride()
            and rope.stride(-1) == 1 and not traced
            and nope.data_ptr() == rope.data_ptr() + rope.shape[-1] * rope.element_size()
            and rope.untyped_storage().data_ptr() == nope.untyped_storage().data_ptr()):
        shape = (*rope.shape[:-1], rope.shape[-1] + nope.shape[-1])
        return rope.as_strided(shape, rope.stride(), rope.storage_offset())
    if not copy:
        return None
    if nope.dtype != rope.dtype or nope.device != rope.device:
        raise RoPEError(
            f"{name}'s rope and nope parts must share a dtype and device, got "
            f"{_described(rope)} and {_described(nope)}"
        )
    return torch.cat((rope, nope), dim=-1)


def _written_apart(name: str, out: torch.Tensor,
                   others: tuple[tuple[str, Optional[torch.Tensor]], ...]
                   ) -> Optional[torch.Tensor]:
    """``out``, written after the core's call (or read while written, for its input), must
    share no element with what that call wrote or with its own input: else one write lands on
    another's result, silently. Checked before anything is written. Traced (fake tensors), the
    graph's op runs the checks, and :func:`_out`'s of ``out`` and the outputs among ``others``
    (``..._out``), on its real tensors (:func:`~rope_dispatch.backends.written.outs_apart`):
    its ``-0.0`` is returned, for the door's own writes to add; else None."""
    if out.numel() == 0:
        return None
    if memoryless():
        outs = tuple(p for p in others if p[0].endswith("_out"))
        named = ((name, out), *outs, *(p for p in others if not p[0].endswith("_out")))
        return outs_apart(named, "the FP8 prologue cannot write", 1 + len(outs),
                          tuple((0, j) for j in range(1, len(named))))
    for other, x in others:
        if x is not None and x is not out:
            refuse_shared(name, out, other, x)
    return None


def _quantize_into(out: torch.Tensor, x: Optional[torch.Tensor], scale: float,
                   apart: Optional[torch.Tensor] = None) -> None:
    """``out[...] = (x / scale)`` cast to ``out``'s FP8 dtype, the division in float32 (the
    core's formula: ``scale`` is ``1 / quant_scale``). ``x`` ``None``: a None nope part, whose
    ``out`` has no channels. On a GPU the Triton backend's quantizing copy stores it, unless
    another backend is forced (torch's division into FP8 ran at 15-28% of copy; the same bytes),
    or the tensors are fake or traced (the launch reads addresses; the division traces).
    ``apart``: the traced door's output checks (:func:`_written_apart`), which the quotient
    adds."""
    if out.numel() == 0:
        return
    memory, dual = not memoryless(), forward_ad()  # (a launch would drop x's tangent)
    if memory and not dual and x.device.type == "cuda" and _scoped_or_env_backend()[0] in (
            None, "triton"):
        triton = get_backend("triton")
        if triton.available and triton.quantize(x, out, scale):
            return
    key = (scale, x.device)
    divisor = _DIVISORS.get(key)
    if divisor is None:  # a tensor: torch turns a division by a number into a product
        divisor = torch.full((1,), scale, dtype=torch.float32, device=x.device)
        # one made under CUDA graph capture is filled only when the graph replays, and one
        # made on fake tensors (shape propagation, tracing) holds no value: neither is kept
        if memory and (x.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()):
            if len(_DIVISORS) >= _MAX_CACHES:
                _DIVISORS.clear()
            _DIVISORS[key] = divisor
    # one kernel: a 1-element float32 divisor makes the division float32 (a 0-d one would leave
    # it in x's dtype), and the quotient is cast to out's FP8 as it is stored, as .to() casts
    if dual or not memory:  # torch's out= division has no forward AD (it refuses a dual x),
        # nor traces into an out of other strides: the same cast, quotient (tangent) quantized
        out.copy_(add_written(x / divisor, apart).to(out.dtype))
        return
    torch.div(x, divisor, out=out)


# How each door maps its arguments onto rope_to_cache's, for the core's errors (_mapped).
_FLAT_MAPPING = ("q=q_rope, k=k_rope, v=k_nope, freqs=cos_sin_cache, positions=pos_ids, "
                 "a FlatKVCache of k_cache=k_rope_out, v_cache=k_nope_out, q_out=q_rope_out")
_PAGED_MLA_MAPPING = ("q=q_rope, k=k_rope, v=k_nope, freqs=cos_sin_cache, positions=pos_ids, "
                      "a FlashInferPagedKVCache of k_cache=kpe_cache, v_cache=ckv_cache, "
                      "positions=positions, q_out=q_rope_out")
_PAGED_MAPPING = ("q=q_rope joined with q_nope, k=k_rope joined with k_nope, v=v, "
                  "freqs=cos_sin_cache, positions=pos_ids, a FlashInferPagedKVCache of "
                  "paged_kv_cache, positions=positions, q_out=q_rope_out joined with q_nope_out")


_INPLACE_MAPPING = ("q=query, k=key (each as [nnz, heads, head_size]), freqs=cos_sin_cache, "
                    "positions=positions")


def _mapped(error: RoPEError, function: str, mapping: str,
            core: str = "rope_to_cache") -> RoPEError:
    """An error of the core's, about its own argument names, with how ``function`` mapped its
    arguments onto ``core``'s (raised from the core's). A door catches the core's errors with a
    plain ``try`` (free where nothing is raised) rather than a generator context manager, which
    cost about 2 us a call."""
    return type(error)(f"{error} {_words(function, mapping, core)}")


def _words(function: str, mapping: str, core: str = "rope_to_cache") -> str:
    return f"({function} calls rope_dispatch.{core} with {mapping})"


def _door_words(function: str, mapping: str, core: str = "rope_to_cache", refusal: str = "",
               outs: str = "") -> tuple[str, str, str]:
    """What a compiled door's in-graph checks add to the core's refusal (:func:`_mapped`'s
    words), and its own outputs among what they check (``backends.written.door``)."""
    return _words(function, mapping, core), refusal, outs


_FLAT_DOOR = _door_words("rope_quantize_fp8", _FLAT_MAPPING, refusal="the FP8 prologue cannot "
                        "write", outs="q_rope_out,k_rope_out,k_nope_out")
_PAGED_MLA_DOOR = _door_words("rope_quantize_fp8_append_paged_kv_cache", _PAGED_MLA_MAPPING,
                             refusal="the FP8 prologue cannot write", outs="q_rope_out,,")
_PAGED_DOOR = _door_words("rope_quantize_fp8_append_paged_kv_cache", _PAGED_MAPPING)
_INPLACE_DOOR = _door_words("apply_rope_with_cos_sin_cache_inplace", _INPLACE_MAPPING,
                           "apply_qk_")


def _described(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {dtype_name(x.dtype)} on {x.device}"
    return type(x).__name__
