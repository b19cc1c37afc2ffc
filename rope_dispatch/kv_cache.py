"""KV-cache descriptors: where :func:`~rope_dispatch.rope_to_cache` writes each token's rotated
k and its v, in the layouts serving engines keep.

- :class:`PagedKVCache`: vLLM's paged cache, ``[num_blocks, block_size, kv_heads, head_dim]``
  for k and for v, a slot per token (``slot_mapping``; negative: CUDA-graph padding, skipped).
- :class:`FlashInferPagedKVCache`: FlashInfer's paged cache (NHD or HND pages), a token's page
  found from its request (``batch_indices``), its place in it (``positions``) and the request's
  pages (``kv_indptr``, ``kv_indices``), as ``rope_quantize_fp8_append_paged_kv_cache`` does.
- :class:`FlatKVCache`: SGLang's token cache, ``[num_slots, kv_heads, head_dim]``, a slot per
  token (``cache_loc``).

The cache holds the model's dtype, or FP8 (``float8_e4m3fn``, ``float8_e5m2``), which stores
``(x / scale).to(dtype)`` with the division in float32 (vLLM's ``k_scale``/``v_scale``
convention; FlashInfer's ``quant_scale_kv`` multiplies instead, so it is ``1 / k_scale``). The
scales are used only by FP8 caches. The v cache may have a head dim of its own (v's: MLA's
compressed kv beside the rotated key part); every other dim is k's. Backends see every
descriptor in one form: k and v views ``[pages, page_size, kv_heads, head_dim]``
(:meth:`KVCache.pages`) and, per token, its page,
its entry in the page and whether it is written (:meth:`KVCache.locate`), computed on the device
with no host read. A token whose slot lies outside the cache is skipped there; on the CPU (and
in strict mode, ``ROPE_DISPATCH_CHECK_VALUES=1``) it is an error naming the value
(:meth:`KVCache.check_values`).
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar, NamedTuple

import torch

from .call import (
    RoPECall, _host_reads_allowed, _reads, check_call, table_grad_wanted, wants_grad,
)
from .errors import RoPEError, RoPETypeError
from .overlap import _refuse_read_in, _shares, expanded_dim, refuse_self_overlap
from .spec import RoPESpec, dtype_name
from .table_kinds import table_tensors
from .tracing import memoryless

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The quantized cache (and q output) dtypes: values stored as ``x / scale``."""
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
INDEX_DTYPES = (torch.int32, torch.int64)

Scale = float | torch.Tensor
"""A quantization scale: a positive number, or a float32 tensor of one element (0-d or
``[1]``) on the cache's device, whose value is never read on the host."""


def check_scale(value: object, name: str, device: torch.device) -> Scale:
    """``value`` as a scale (:data:`Scale`), or an error naming ``name``."""
    if type(value) is float and 0 < value < math.inf:  # the common case, checked first
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32 or value.numel() != 1 or value.dim() > 1:
            raise RoPEError(
                f"{name} must be a number or a float32 tensor of one element (shape () or (1,)), "
                f"got {dtype_name(value.dtype)} {tuple(value.shape)}"
            )
        if value.device != device:
            raise RoPEError(
                f"{name} is on {value.device} but the cache is on {device}; expected the same "
                "device"
            )
        value = value.detach()  # a constant of the cache write, which has no backward
        if value.is_cpu and not memoryless() and not 0 < float(value) < math.inf:
            raise RoPEError(f"{name} must be positive and finite, got {float(value)}")
        return value.reshape(())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise RoPEError(f"{name} must be a positive finite number, got {value!r}")
        return float(value)
    raise RoPETypeError(
        f"{name} must be a number or a float32 tensor of one element, got {type(value).__name__}"
    )


def _index(value: object, name: str) -> torch.Tensor:
    """A 1-D int32/int64 index tensor, or an error naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise RoPETypeError(f"{name} must be a 1-D int32/int64 tensor, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES or value.dim() != 1:
        raise RoPEError(
            f"{name} must be a 1-D int32/int64 tensor, got {dtype_name(value.dtype)} "
            f"{tuple(value.shape)}"
        )
    return value


def _cache_pair(k_cache: object, v_cache: object, names: tuple[str, str], dims: int,
                form: str) -> None:
    """k and v caches: tensors of ``dims`` dims (``form`` names them), writable, apart, of one
    dtype and device and one shape but for the head dim (the last: v may have its own)."""
    for value, name in zip((k_cache, v_cache), names):
        if not isinstance(value, torch.Tensor):
            raise RoPETypeError(f"{name} must be a torch.Tensor {form}, got {type(value).__name__}")
        if value.dim() != dims:
            raise RoPEError(f"{name} must be {form}, got shape {tuple(value.shape)}")
        if value.dtype not in CACHE_DTYPES:
            raise RoPEError(
                f"{name} has dtype {dtype_name(value.dtype)}; a cache holds float32, float16, "
                "bfloat16, float8_e4m3fn or float8_e5m2"
            )
        if expanded_dim(value) is not None:
            raise RoPEError(f"{name} is an expanded tensor (a dim of stride 0); it cannot be written")
    if (k_cache.shape[:-1] != v_cache.shape[:-1] or k_cache.dtype != v_cache.dtype
            or k_cache.device != v_cache.device):
        raise RoPEError(
            f"{names[0]} and {names[1]} must have one dtype, device and shape but for the head "
            f"dim (the last), got "
            f"{tuple(k_cache.shape)} {dtype_name(k_cache.dtype)} on {k_cache.device} and "
            f"{tuple(v_cache.shape)} {dtype_name(v_cache.dtype)} on {v_cache.device}"
        )
    refuse_caches_overlap(k_cache, v_cache, names)


def refuse_caches_overlap(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          names: tuple[str, str]) -> None:
    """Neither cache (``names``: the messages') may overlap itself, nor share an element with
    the other: one write would land on another's."""
    for value, name in zip((k_cache, v_cache), names):
        refuse_self_overlap(value, name, "rope_to_cache cannot write into this cache",
                            "give each slot memory of its own")
    if _shares(k_cache, v_cache):
        shared = ("are the same memory" if k_cache.data_ptr() == v_cache.data_ptr() else
                  f"{tuple(k_cache.shape)} strides {k_cache.stride()} and "
                  f"{tuple(v_cache.shape)} strides {v_cache.stride()} share memory")
        raise RoPEError(f"{names[0]} and {names[1]} {shared}; v would overwrite k")


class KVCache:
    """Base of the cache descriptors: what :func:`~rope_dispatch.rope_to_cache` and the
    backends read of one (see the module docstring). A descriptor's fields are set once, at
    construction (what a planned call reads of it is worked out then), and refuse assignment
    afterwards; make a new one for other tensors."""

    __slots__ = ("k_cache", "v_cache", "k_scale", "v_scale", "plan_parts")
    kind: ClassVar[str]
    index_names: ClassVar[tuple[str, ...]]
    """The per-token index tensors' attribute names (one entry per token each)."""

    def __setattr__(self, name: str, value: object) -> None:
        """Fields are set by the constructor only: ``plan_parts``, set last, holds the tensors
        and scales a planned call passes, so a field replaced afterwards would be read by
        checked calls and not by planned ones (a GPU's repeated calls)."""
        if hasattr(self, "plan_parts"):
            self._refuse(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse(name)

    def _refuse(self, name: str) -> None:
        kind = type(self).__name__
        raise AttributeError(
            f"{kind}.{name} is fixed when the descriptor is made (what a planned call reads of "
            f"it is worked out then); make a new {kind} for other tensors or scales"
        )

    def _scales(self, k_scale: object, v_scale: object) -> None:
        device = self.k_cache.device
        self.k_scale = check_scale(k_scale, f"{type(self).__name__} k_scale", device)
        self.v_scale = check_scale(v_scale, f"{type(self).__name__} v_scale", device)
        self.plan_parts = _plan_parts(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def quantized(self) -> bool:
        """Whether the cache is FP8 (stores ``x / scale``)."""
        return self.k_cache.dtype in FP8_DTYPES

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v cache views ``[pages, page_size, kv_heads, head_dim]`` (no copy)."""
        raise NotImplementedError

    def locate(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: its page and its entry in the page (int64, in range where written) and
        whether it is written (bool: not padding, inside the cache). Device ops only."""
        raise NotImplementedError

    def check_values(self) -> None:
        """Read the index tensors on the host and raise on a slot outside the cache."""
        raise NotImplementedError

    def _name(self, field: str) -> str:
        return f"{type(self).__name__}.{field}"

    def __repr__(self) -> str:
        heads, head_dim = self.pages()[0].shape[-2:]
        return (f"{type(self).__name__}({tuple(self.k_cache.shape)} {dtype_name(self.dtype)}, "
                f"{heads} kv heads of {head_dim} on {self.device})")


def _slots_in(slots: torch.Tensor, count: int) -> torch.Tensor:
    return (slots >= 0) & (slots < count)


def _check_slots(slots: torch.Tensor, count: int, name: str, what: str) -> None:
    """Host check: every slot negative (skipped) or below ``count``."""
    if slots.numel() == 0:
        return
    high = int(slots.max())
    if high >= count:
        token = int(torch.argmax(slots.long()))
        raise RoPEError(
            f"{name} holds slot {high} (token {token}) but the cache has {count} slots ({what}); "
            f"a slot must be below {count}, or negative to skip the token"
        )


class _SlotKVCache(KVCache):
    """A cache with one slot index per token (:attr:`index_names`' one): slot ``s`` is entry
    ``s % page_size`` of page ``s // page_size``; a negative slot skips the token."""

    __slots__ = ()

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                 k_scale: object, v_scale: object, form: str):
        """``form``: the k and v caches' shape, as messages name it."""
        name = type(self).__name__
        _cache_pair(k_cache, v_cache, (f"{name} k_cache", f"{name} v_cache"),
                    form.count(",") + 1, form)
        self.k_cache, self.v_cache = k_cache, v_cache
        if self.slot_count == 0:
            raise RoPEError(f"{name} k_cache has no slots: shape {tuple(k_cache.shape)}")
        field = self.index_names[0]
        setattr(self, field, _index(index, self._name(field)))
        self._scales(k_scale, v_scale)

    @property
    def slot_count(self) -> int:
        pages = self.pages()[0]
        return pages.shape[0] * pages.shape[1]

    def locate(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        page_size = self.pages()[0].shape[1]
        slots = getattr(self, self.index_names[0]).long()
        return (slots.div(page_size, rounding_mode="floor"), slots % page_size,
                _slots_in(slots, self.slot_count))

    def check_values(self) -> None:
        pages, page_size = self.pages()[0].shape[:2]
        field = self.index_names[0]
        what = f"{pages} blocks of {page_size}" if page_size > 1 else "k_cache.shape[0]"
        _check_slots(getattr(self, field), self.slot_count, self._name(field), what)


class PagedKVCache(_SlotKVCache):
    """vLLM's paged KV cache: ``k_cache`` and ``v_cache`` ``[num_blocks, block_size, kv_heads,
    head_dim]`` (any strides: views of one ``[2, num_blocks, ...]`` tensor are fine) and
    ``slot_mapping`` ``[num_tokens]`` int64 (or int32), token ``i`` written at
    ``block = slot // block_size``, ``offset = slot % block_size``; a negative slot skips the
    token (CUDA-graph padding). FP8 caches store ``x / k_scale`` and ``x / v_scale``."""

    __slots__ = ("slot_mapping",)
    kind = "paged"
    index_names = ("slot_mapping",)

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 *, k_scale: Scale = 1.0, v_scale: Scale = 1.0):
        super().__init__(k_cache, v_cache, slot_mapping, k_scale, v_scale,
                         "[num_blocks, block_size, kv_heads, head_dim]")

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache


class FlatKVCache(_SlotKVCache):
    """SGLang's token KV cache: ``k_cache`` and ``v_cache`` ``[num_slots, kv_heads,
    head_dim]``, token ``i`` written at slot ``cache_loc[i]`` (int64 or int32; negative: skipped,
    as :class:`PagedKVCache`'s padding). FP8 caches store ``x / k_scale`` and ``x / v_scale``."""

    __slots__ = ("cache_loc",)
    kind = "flat"
    index_names = ("cache_loc",)

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.unsqueeze(1), self.v_cache.unsqueeze(1)  # pages of one slot

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_loc: torch.Tensor,
                 *, k_scale: Scale = 1.0, v_scale: Scale = 1.0):
        super().__init__(k_cache, v_cache, cache_loc, k_scale, v_scale,
                         "[num_slots, kv_heads, head_dim]")


KV_LAYOUTS = ("NHD", "HND")


class FlashInferPagedKVCache(KVCache):
    """FlashInfer's paged KV cache, as ``rope_quantize_fp8_append_paged_kv_cache`` writes it.

    ``paged_kv_cache``: ``(k_cache, v_cache)``, each ``[max_pages, page_size, kv_heads,
    head_dim]`` (``kv_layout="NHD"``) or ``[max_pages, kv_heads, page_size, head_dim]``
    (``"HND"``), or one tensor with k and v in dim 1 (``[max_pages, 2, ...]``). Request ``r``
    owns pages ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``; token ``i`` of request
    ``b = batch_indices[i]`` at place ``p = positions[i]`` in it (the cache's position, which may
    differ from the rotation's) goes to page ``kv_indices[kv_indptr[b] + p // page_size]``,
    entry ``p % page_size``. A negative ``batch_indices`` entry skips the token (padding).
    ``page_size`` defaults to the cache's. FP8 caches store ``x / k_scale``, ``x / v_scale``.
    """

    __slots__ = ("kv_indices", "kv_indptr", "batch_indices", "positions", "kv_layout")
    kind = "flashinfer_paged"
    index_names = ("batch_indices", "positions")

    def __init__(self, paged_kv_cache: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
                 kv_indices: torch.Tensor, kv_indptr: torch.Tensor, batch_indices: torch.Tensor,
                 positions: torch.Tensor, *, page_size: int | None = None,
                 kv_layout: str = "NHD", k_scale: Scale = 1.0, v_scale: Scale = 1.0):
        if kv_layout not in KV_LAYOUTS:
            raise RoPEError(f"FlashInferPagedKVCache kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if isinstance(paged_kv_cache, torch.Tensor):
            if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
                raise RoPEError(
                    "FlashInferPagedKVCache paged_kv_cache as one tensor must be [max_pages, 2, "
                    f"...] (k and v in dim 1), got shape {tuple(paged_kv_cache.shape)}"
                )
            paged_kv_cache = paged_kv_cache.unbind(1)
        if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
            raise RoPETypeError(
                "FlashInferPagedKVCache paged_kv_cache must be (k_cache, v_cache) or one tensor "
                f"[max_pages, 2, ...], got {type(paged_kv_cache).__name__}"
            )
        k_cache, v_cache = paged_kv_cache
        form = ("[max_pages, page_size, kv_heads, head_dim] (NHD)" if kv_layout == "NHD"
                else "[max_pages, kv_heads, page_size, head_dim] (HND)")
        _cache_pair(k_cache, v_cache, ("FlashInferPagedKVCache k_cache",
                                       "FlashInferPagedKVCache v_cache"), 4, form)
        self.k_cache, self.v_cache, self.kv_layout = k_cache, v_cache, kv_layout
        own = self.pages()[0].shape[1]
        if page_size is not None and (
                not isinstance(page_size, numbers.Integral) or isinstance(page_size, bool)):
            raise RoPETypeError(f"FlashInferPagedKVCache page_size must be an int or None (the "
                                f"cache's: {own}), got {page_size!r}")
        if page_size is not None and page_size != own:
            raise RoPEError(
                f"FlashInferPagedKVCache page_size={page_size!r} but the {kv_layout} cache "
                f"{tuple(k_cache.shape)} has pages of {own}"
            )
        if k_cache.shape[0] * own == 0:
            raise RoPEError(f"FlashInferPagedKVCache k_cache has no slots: shape {tuple(k_cache.shape)}")
        for name, value in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                            ("batch_indices", batch_indices), ("positions", positions)):
            setattr(self, name, _index(value, self._name(name)))
        if kv_indptr.numel() == 0:
            raise RoPEError("FlashInferPagedKVCache.kv_indptr must have batch_size + 1 >= 1 entries, got 0")
        for name in ("kv_indices", "kv_indptr"):
            if getattr(self, name).device != k_cache.device:
                raise RoPEError(
                    f"{self._name(name)} is on {getattr(self, name).device} but the cache is on "
                    f"{k_cache.device}; expected the same device"
                )
        self._scales(k_scale, v_scale)

    @property
    def page_size(self) -> int:
        return self.pages()[0].shape[1]

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_layout == "HND":
            return self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        return self.k_cache, self.v_cache

    def locate(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        page_size, requests = self.page_size, self.kv_indptr.numel() - 1
        indptr, indices = self.kv_indptr.long(), self.kv_indices.long()
        batch, place = self.batch_indices.long(), self.positions.long()
        valid = (batch >= 0) & (batch < requests) & (place >= 0)
        b = batch.clamp(0, max(requests - 1, 0))
        page_iter = indptr[b] + place.div(page_size, rounding_mode="floor")
        valid &= (page_iter >= indptr[b]) & (page_iter < indptr[(b + 1).clamp(max=requests)])
        valid &= (page_iter >= 0) & (page_iter < indices.numel())
        if indices.numel():
            page = indices[page_iter.clamp(0, indices.numel() - 1)]
        else:
            page = torch.zeros_like(page_iter)
        valid &= _slots_in(page, self.k_cache.shape[0])
        return page, place % page_size, valid

    def check_values(self) -> None:
        requests, page_size = self.kv_indptr.numel() - 1, self.page_size
        indptr = self.kv_indptr.tolist()
        if any(b < a for a, b in zip(indptr, indptr[1:])) or (indptr and indptr[0] < 0):
            raise RoPEError(f"{self._name('kv_indptr')} must be non-decreasing from >= 0, got {indptr}")
        if indptr[-1] > self.kv_indices.numel():
            raise RoPEError(
                f"{self._name('kv_indptr')} ends at {indptr[-1]} but kv_indices has "
                f"{self.kv_indices.numel()} entries"
            )
        batch, place = self.batch_indices.tolist(), self.positions.tolist()
        indices, count = self.kv_indices.tolist(), self.k_cache.shape[0]
        for i, (b, p) in enumerate(zip(batch, place)):
            if b < 0:
                continue  # padding
            if b >= requests:
                raise RoPEError(
                    f"{self._name('batch_indices')}[{i}]={b} but kv_indptr describes {requests} "
                    "requests; a request index must be below that, or negative to skip the token"
                )
            pages = indptr[b + 1] - indptr[b]
            if not 0 <= p < pages * page_size:
                raise RoPEError(
                    f"{self._name('positions')}[{i}]={p} but request {b} owns {pages} pages of "
                    f"{page_size} (kv_indptr), so room for positions [0, {pages * page_size})"
                )
            page = indices[indptr[b] + p // page_size]
            if not 0 <= page < count:
                raise RoPEError(
                    f"{self._name('kv_indices')}[{indptr[b] + p // page_size}]={page} (token {i}) "
                    f"but the cache has {count} pages"
                )


def cache_index(cache: KVCache) -> tuple[torch.Tensor, ...]:
    """The index tensors a backend reads to place each token: the per-token ones
    (:attr:`KVCache.index_names`), then FlashInfer's ``kv_indptr`` and ``kv_indices``."""
    names = cache.index_names + (("kv_indptr", "kv_indices") if cache.kind == "flashinfer_paged"
                                 else ())
    return tuple(getattr(cache, name) for name in names)


def _plan_parts(cache: KVCache) -> tuple[tuple[torch.Tensor, ...], tuple] | None:
    """What a planned :func:`~rope_dispatch.rope_to_cache` call reads of ``cache``, worked out
    once: the tensors a planned call passes after q, k, v and positions (the k and v caches,
    :func:`cache_index`, the k and v scales given as tensors; then come q's scale given as a
    tensor and ``q_out`` where given) and its part of the plan's key (its class, layout and
    the scales given as numbers); ``None`` where its calls are checked every time (a tensor
    subclass, a cache on the CPU, whose index values the checks read)."""
    tensor = torch.Tensor
    k_scale, v_scale = cache.k_scale, cache.v_scale
    tensors = (cache.k_cache, cache.v_cache, *cache_index(cache))
    for x in tensors:
        if type(x) is not tensor:
            return None
    if cache.k_cache.is_cpu:
        return None
    if type(k_scale) is tensor:
        tensors += (k_scale,)
    if type(v_scale) is tensor:
        tensors += (v_scale,)
    form = (type(cache), getattr(cache, "kv_layout", None),
            "tensor" if type(k_scale) is tensor else k_scale,
            "tensor" if type(v_scale) is tensor else v_scale)
    return tensors, form


class CacheWrite(NamedTuple):
    """The cache stage of a checked call (:attr:`RoPECall.cache_write`): write rotated k and v
    into ``cache``, and give q out as ``q_dtype`` (``q_out`` when given), FP8 with
    ``q_scale``."""

    cache: KVCache
    v: torch.Tensor
    q_out: torch.Tensor | None
    q_dtype: torch.dtype
    q_scale: Scale | None
    v_head_dim: int | None = None
    """v's head dim where it differs from k's (a backend serves that only where it declares
    :attr:`~rope_dispatch.Backend.supports_cache_v_head_dim`), else ``None``."""

    @property
    def form(self) -> tuple[str, str, str] | tuple[str, str, str, int]:
        """What choosing a backend may depend on: the cache kind, its dtype, q's output dtype,
        and v's head dim where it differs from k's."""
        form = self.cache.kind, dtype_name(self.cache.dtype), dtype_name(self.q_dtype)
        return form if self.v_head_dim is None else (*form, self.v_head_dim)


def _check_v(v: object, k: torch.Tensor) -> torch.Tensor:
    """v ``[T, kv_heads, dv]``: k's tokens, kv heads, dtype and device; its own head dim."""
    if not isinstance(v, torch.Tensor):
        raise RoPETypeError(f"v must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != k.dim() or v.shape[:-1] != k.shape[:-1] or v.dtype != k.dtype or v.device != k.device:
        raise RoPEError(
            f"v must be [T, kv_heads, head_dim] with k's tokens and kv heads {tuple(k.shape[:-1])}, "
            f"dtype and device ({dtype_name(k.dtype)} on {k.device}) and any head dim, got "
            f"{tuple(v.shape)} {dtype_name(v.dtype)} on {v.device}"
        )
    return v


def _check_cache(cache: object, k: torch.Tensor, v: torch.Tensor) -> KVCache:
    """The descriptor against k and v: device, dtype (k's or FP8), kv heads, head dims,
    tokens."""
    if not isinstance(cache, KVCache):
        raise RoPETypeError(
            "cache must be a rope_dispatch.PagedKVCache, FlashInferPagedKVCache or FlatKVCache, "
            f"got {type(cache).__name__}"
        )
    name = type(cache).__name__
    if cache.device != k.device:
        raise RoPEError(f"{name} k_cache is on {cache.device} but k is on {k.device}; expected the same device")
    if cache.dtype != k.dtype and cache.dtype not in FP8_DTYPES:
        raise RoPEError(
            f"{name} k_cache has dtype {dtype_name(cache.dtype)} but k is {dtype_name(k.dtype)}; "
            "a cache holds the model's dtype or FP8 (float8_e4m3fn, float8_e5m2)"
        )
    heads, head_dim = cache.pages()[0].shape[-2:]
    if (heads, head_dim) != tuple(k.shape[-2:]):
        raise RoPEError(
            f"{name} k_cache {tuple(cache.k_cache.shape)} holds {heads} kv heads of head dim "
            f"{head_dim} but k {tuple(k.shape)} has {k.shape[-2]} heads of {k.shape[-1]}"
        )
    v_head_dim = cache.pages()[1].shape[-1]
    if v_head_dim != v.shape[-1]:
        raise RoPEError(
            f"{name} v_cache {tuple(cache.v_cache.shape)} holds a head dim of {v_head_dim} but "
            f"v {tuple(v.shape)} has {v.shape[-1]}"
        )
    for field in cache.index_names:
        index = getattr(cache, field)
        if index.shape[0] != k.shape[0]:
            raise RoPEError(
                f"{name}.{field} must have one entry per token ({k.shape[0]}, k.shape[0]), got "
                f"shape {tuple(index.shape)}"
            )
        if index.device != k.device:
            raise RoPEError(
                f"{name}.{field} is on {index.device} but k is on {k.device}; expected the same "
                "device"
            )
    return cache


def _check_q_out(q: torch.Tensor, q_out: object, q_scale: object) -> tuple[torch.dtype, Scale | None]:
    """q's output dtype and scale (``None`` unless FP8)."""
    if q_out is not None:
        if not isinstance(q_out, torch.Tensor):
            raise RoPETypeError(f"q_out must be a torch.Tensor or None, got {type(q_out).__name__}")
        if q_out.shape != q.shape or q_out.device != q.device or (
                q_out.dtype != q.dtype and q_out.dtype not in FP8_DTYPES):
            raise RoPEError(
                f"q_out must be shaped like q {tuple(q.shape)} on {q.device}, of q's dtype "
                f"({dtype_name(q.dtype)}) or FP8, got {tuple(q_out.shape)} "
                f"{dtype_name(q_out.dtype)} on {q_out.device}"
            )
        if expanded_dim(q_out) is not None:
            raise RoPEError("q_out is an expanded tensor (a dim of stride 0); it cannot be written")
        refuse_self_overlap(q_out, "q_out", "rope_to_cache cannot write q's output",
                            "give q_out memory of its own")
        if not memoryless() and q_out.is_inference() and not torch.is_inference_mode_enabled():
            raise RoPEError(
                "q_out is an inference tensor and inference mode is off (torch forbids updating it "
                "there); call rope_to_cache under torch.inference_mode(), or pass a q_out made "
                "outside it"
            )
        dtype = q_out.dtype
    else:
        dtype = torch.float8_e4m3fn if q_scale is not None else q.dtype
    if dtype not in FP8_DTYPES:
        if q_scale is not None:
            raise RoPEError(
                f"q_scale quantizes q to FP8, but q_out is {dtype_name(dtype)}; pass an FP8 q_out "
                "or no q_scale"
            )
        return dtype, None
    return dtype, check_scale(1.0 if q_scale is None else q_scale, "q_scale", q.device)


def _check_apart_from_kv(q_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q's given output (q itself in place) must share no element with k or v: one launch reads
    k and v while it writes it (:func:`_shares`; not asked of traced tensors)."""
    for name, x in (("k", k), ("v", v)):
        if _shares(q_out, x):
            raise RoPEError(
                f"q_out shares memory with {name} (q_out {tuple(q_out.shape)} strides "
                f"{q_out.stride()}, {name} {tuple(x.shape)} strides {x.stride()}): rope_to_cache "
                f"writes q's output while it reads {name}; give q_out memory of its own"
            )


def _check_apart_from_cache(kind: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            q_out: torch.Tensor | None) -> None:
    """q, k, v and q's output must share no element with the k or v cache (of a ``kind``
    descriptor): the call writes the cache while it reads them (the eager composition first,
    the fused launch at once)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("q_out", q_out)):
        if x is None or (name == "q_out" and x is q):
            continue
        for cache_name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _shares(x, c):
                raise RoPEError(
                    f"{name} {tuple(x.shape)} shares memory with {kind} "
                    f"{cache_name} {tuple(c.shape)}: rope_to_cache writes the cache while it "
                    f"reads q, k and v and writes q's output; give {name} memory of its own"
                )


def refuse_cache_overlaps(kind: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_out: torch.Tensor | None, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None,
                          tables: tuple[torch.Tensor, ...]) -> None:
    """:func:`check_cache_call`'s memory checks: q's given output apart from k, v and q (but
    q itself), q, k, v and q's output apart from the caches (of a ``kind`` descriptor), and the
    norm weights and the table's tensors apart from what is written. Also run on a compiled
    graph's real tensors (:func:`~rope_dispatch.backends.written.cache_apart`)."""
    if q_out is not None:
        _check_apart_from_kv(q_out, k, v)
        if q_out is not q and _shares(q_out, q) and not (  # q itself: a view of its elements
                q_out.data_ptr() == q.data_ptr() and q_out.stride() == q.stride()
                and q_out.dtype == q.dtype):
            raise RoPEError(
                f"q_out shares memory with q but is not q (q_out {tuple(q_out.shape)} strides "
                f"{q_out.stride()}, q strides {q.stride()}): rope_to_cache reads q while it "
                "writes q's output; pass q_out=q to rotate in place, or memory of its own"
            )
    _check_apart_from_cache(kind, k_cache, v_cache, q, k, v, q_out)
    written = (("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache))
    for name, weight in (("q_norm", q_weight), ("k_norm", k_weight)):
        if weight is not None:
            _refuse_read_in(f"{name}.weight", weight, "weight", "a clone", written,
                            "rope_to_cache writes", "")
    for tensor in tables:
        _refuse_read_in("freqs", tensor, "table", "freqs.clone()", written,
                        "rope_to_cache writes", "")


def check_cache_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, freqs: object, spec: object, *,
    positions: torch.Tensor, cache: object, q_norm: object = None, k_norm: object = None,
    q_out: object = None, q_scale: object = None,
) -> RoPECall:
    """The checks of :func:`~rope_dispatch.rope_to_cache`: the call's (q, k, positions, table,
    norms, by :func:`~rope_dispatch.check_call`), then v, the cache and q's output. Returns the
    call with its :class:`CacheWrite` stage."""
    # not getattr with a default: Dynamo cannot guard it on a spec made while tracing (a door's)
    if isinstance(spec, RoPESpec) and spec.layout != "thd":
        raise RoPEError(
            f"rope_to_cache takes a batch of tokens: layout 'thd' (q [T, heads, head_dim]), got "
            f"{spec.layout!r}"
        )
    if positions is None:
        raise RoPEError("rope_to_cache needs positions: one table row per token, [T]")
    if k is None:  # check_call would take the call for one on q alone
        raise RoPETypeError("k must be a torch.Tensor [T, kv_heads, head_dim], got None: "
                            "rope_to_cache writes the rotated k into the cache")
    call = check_call(q, freqs, spec, positions=positions, k=k, q_norm=q_norm, k_norm=k_norm)
    if spec.rotary_offset or spec.deinterleave:
        named = (f"spec.rotary_offset={spec.rotary_offset}" if spec.rotary_offset
                 else "spec.deinterleave=True")
        raise RoPEError(
            f"rope_to_cache does not take {named}: its cache stage writes k's rotary channels "
            "from a head's first channel, pairs in place; rotate with rope_dispatch.apply_qk "
            "and write the cache yourself"
        )
    if wants_grad(call) or table_grad_wanted(call.table, None) or (torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (v, q_out))):
        raise RoPEError(
            "rope_to_cache writes a KV cache and has no backward, but q, k, v, q_out, a norm "
            "weight or the table requires grad; call it under torch.no_grad() or "
            "torch.inference_mode()"
        )
    v = _check_v(v, k)
    cache = _check_cache(cache, k, v)
    if torch.is_grad_enabled() and (cache.k_cache.requires_grad or cache.v_cache.requires_grad):
        raise RoPEError(
            f"{type(cache).__name__}'s k_cache or v_cache requires grad, but rope_to_cache writes "
            "them in place and has no backward; call it under torch.no_grad() or "
            "torch.inference_mode(), or keep the caches out of autograd"
        )
    q_dtype, q_scale = _check_q_out(q, q_out, q_scale)
    refuse_cache_overlaps(type(cache).__name__, cache.k_cache, cache.v_cache, q, k, v, q_out,
                          None if call.norm is None else call.norm.weight,
                          None if call.k_norm is None else call.k_norm.weight,
                          table_tensors(call.table))
    if _host_reads_allowed() and any(_reads(getattr(cache, f)) for f in cache.index_names):
        cache.check_values()
    v_head_dim = v.shape[-1] if v.shape[-1] != k.shape[-1] else None
    return call._replace(cache_write=CacheWrite(cache, v, q_out, q_dtype, q_scale, v_head_dim))
