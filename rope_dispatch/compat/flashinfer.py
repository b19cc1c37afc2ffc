"""The serving engines' RoPE call (FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``, the
form vLLM and SGLang use too), running on rope-dispatch.

One changed import moves such code over::

    from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

An adapter: it maps arguments and checks only that they can be mapped (``query`` and ``key``
2-D with ``head_size`` dividing their width, or already 3-D with ``head_size`` last, as
FlashInfer's own view accepts them); the core checks the rest. ``query``
``[nnz, heads * head_size]``
and ``key`` ``[nnz, kv_heads * head_size]`` become ``[nnz, heads, head_size]`` views (no copy,
any row stride: slices of a fused qkv projection work), ``positions`` the per-token
positions of a thd call without offsets, ``cos_sin_cache`` a
:class:`~rope_dispatch.PairCosSinCache` (no copy), ``is_neox`` the spec's ``interleaved``
(negated); then :func:`rope_dispatch.apply_qk_` rotates q and k in place in one launch.
"""

from __future__ import annotations

import torch

from ..dispatch import apply_qk_
from ..errors import RoPEError
from ..spec import RoPESpec
from ..tables import PairCosSinCache

__all__ = ["apply_rope_with_cos_sin_cache_inplace"]

_specs: dict[tuple, RoPESpec] = {}
_caches: dict[int, PairCosSinCache] = {}
_MAX_CACHES = 4


def _pair_cache(cos_sin_cache: torch.Tensor) -> PairCosSinCache:
    """The same wrapper for the same cache tensor, call after call, so rope-dispatch's plan for
    the call (kept per table object) serves every layer and step. The last few caches seen stay
    referenced here (an engine keeps one per model for its lifetime anyway)."""
    wrapper = _caches.get(id(cos_sin_cache))
    if wrapper is None or wrapper.table is not cos_sin_cache:
        if len(_caches) >= _MAX_CACHES:
            _caches.clear()
        wrapper = _caches[id(cos_sin_cache)] = PairCosSinCache(cos_sin_cache)
    return wrapper


def _spec(dtype: torch.dtype, interleaved: bool) -> RoPESpec:
    """A thd spec without offsets (a batch of tokens), from a small cache: pydantic validation
    costs microseconds, and a serving step calls this once per layer."""
    key = (dtype, interleaved)
    spec = _specs.get(key)
    if spec is None:
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
    sines. The rotary dim is the cache's last dim; channels past it are left untouched.
    ``is_neox=True`` rotates the two halves of the rotary channels (pairs ``i``, ``i +
    rotary_dim/2``), ``False`` adjacent pairs (``2i``, ``2i + 1``). Returns ``None``.

    Positions outside the cache give NaN rows on a GPU, and a clear error on the CPU (values
    on a GPU are not read: no host sync, CUDA-graph safe; see docs/semantics.md).
    """
    if type(is_neox) is not bool:
        raise RoPEError(f"is_neox must be a bool, got {is_neox!r}")
    q, k = _heads("query", query, head_size), _heads("key", key, head_size)
    apply_qk_(q, k, _pair_cache(cos_sin_cache), _spec(query.dtype, not is_neox),
              positions=positions)


def _heads(name: str, x: object, head_size: object) -> torch.Tensor:
    """``x`` ``[nnz, heads * head_size]`` as a ``[nnz, heads, head_size]`` view, or ``x``
    itself when it is already ``[nnz, heads, head_size]`` (SGLang passes some so)."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise RoPEError(f"head_size must be a positive int, got {head_size!r}")
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[2] == head_size:
        return x
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % head_size:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise RoPEError(
            f"{name} must be [nnz, heads * head_size] or [nnz, heads, head_size] with "
            f"head_size={head_size}, got {got}"
        )
    return x.view(x.shape[0], x.shape[1] // head_size, head_size)  # Tensor.unflatten costs more
