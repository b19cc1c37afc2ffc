"""rope-dispatch: one call for rotary position embedding, on the fastest correct backend.

>>> spec = rope_dispatch.RoPESpec(layout="sbhd", dtype="bf16")
>>> out = rope_dispatch.apply(q, freqs, spec)

Semantics are TransformerEngine 2.20.2 ``apply_rotary_pos_emb``; see docs/semantics.md.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import autotune
from . import cp
from .autotune import cache_dir, cache_entries, clear_cache
from .call import RoPECall, check_call
from .dispatch import (
    Explanation, apply, apply_, apply_qk, apply_qk_, apply_qkv, explain, use_backend,
)
from .errors import BackendNotSupportedError, NoBackendError, RoPEError, UnknownBackendError
from .registry import Backend, BackendInfo, get_backend, list_backends, register
from .spec import RoPESpec
from .tables import CosSinCache, PairCosSinCache, RateTable, cos_sin_cache

try:
    __version__ = version("rope-dispatch")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

from . import backends as _backends  # noqa: E402,F401  (registers the built-in backends)

__all__ = [
    "Backend", "BackendInfo", "BackendNotSupportedError", "CosSinCache", "Explanation",
    "NoBackendError", "PairCosSinCache", "RateTable", "RoPECall", "RoPEError", "RoPESpec",
    "UnknownBackendError", "apply", "apply_",
    "apply_qk", "apply_qk_", "apply_qkv",
    "check_call", "cos_sin_cache", "explain", "get_backend", "list_backends", "register",
    "use_backend",
    "autotune", "cache_dir", "cache_entries", "clear_cache",
    "cp",
]
