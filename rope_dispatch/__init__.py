"""rope-dispatch: one call for rotary position embedding, on the fastest correct backend.

>>> spec = rope_dispatch.RoPESpec(layout="sbhd", dtype="bf16")
>>> out = rope_dispatch.apply(q, freqs, spec)

Semantics are TransformerEngine 2.20.2 ``apply_rotary_pos_emb``; see docs/semantics.md.

``import rope_dispatch`` imports nothing else: the package loads (torch, its modules, the
built-in backends) on the first use of one of its names. So ``python -m rope_dispatch.selftest``,
whose package is imported first, can start its check processes before this one spends seconds
importing torch (run BB, docs/tuning.md).
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the first use loads (_PUBLIC), spelled out for type checkers
    from . import autotune, cp, tune
    from .autotune import cache_dir, cache_entries, clear_cache
    from .call import RoPECall, check_call
    from .dispatch import (
        Explanation, apply, apply_, apply_qk, apply_qk_, apply_qkv, explain, rope_to_cache,
        use_backend,
    )
    from .kv_cache import FlashInferPagedKVCache, FlatKVCache, KVCache, PagedKVCache
    from .norm import HeadNorm
    from .errors import (
        BackendNotSupportedError, NoBackendError, RoPEError, RoPETypeError, UnknownBackendError,
    )
    from .registry import Backend, BackendInfo, get_backend, list_backends, register
    from .spec import RoPESpec
    from .tables import CosSinCache, PairCosSinCache, RateTable, cos_sin_cache

try:
    __version__ = version("rope-dispatch")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

_PUBLIC = {
    "autotune": ("cache_dir", "cache_entries", "clear_cache"),
    "call": ("RoPECall", "check_call"),
    "dispatch": ("Explanation", "apply", "apply_", "apply_qk", "apply_qk_", "apply_qkv", "explain",
                 "rope_to_cache", "use_backend"),
    "errors": ("BackendNotSupportedError", "NoBackendError", "RoPEError", "RoPETypeError",
               "UnknownBackendError"),
    "kv_cache": ("FlashInferPagedKVCache", "FlatKVCache", "KVCache", "PagedKVCache"),
    "norm": ("HeadNorm",),
    "registry": ("Backend", "BackendInfo", "get_backend", "list_backends", "register"),
    "spec": ("RoPESpec",),
    "tables": ("CosSinCache", "PairCosSinCache", "RateTable", "cos_sin_cache"),
}
"""Each module and the names the package re-exports from it."""

__all__ = sorted(
    [name for names in _PUBLIC.values() for name in names] + ["autotune", "cp", "tune"]
)


def _load() -> None:
    """Import the modules of :data:`_PUBLIC`, ``cp`` and the built-in backends, and bind the
    public names here, so later lookups are plain attribute reads."""
    for module_name, names in _PUBLIC.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        globals().update((name, getattr(module, name)) for name in names)
    importlib.import_module(f"{__name__}.cp")
    importlib.import_module(f"{__name__}.tune")  # callable: rope_dispatch.tune(t, freqs, spec)
    importlib.import_module(f"{__name__}.backends")  # registers the built-in backends


_LOAD_LOCK = threading.RLock()
_load_state = {"loaded": False, "loading": False}


def __getattr__(name: str) -> Any:
    """The first lookup of a name not bound yet loads the package (:func:`_load`), once; other
    threads wait for it. A lookup from inside the load (a module importing a sibling with
    ``from rope_dispatch import ...``) finds nothing, so the import system imports the sibling."""
    if not name.startswith("__"):
        with _LOAD_LOCK:
            if not (_load_state["loaded"] or _load_state["loading"]):
                _load_state["loading"] = True
                try:
                    _load()
                    _load_state["loaded"] = True
                finally:
                    _load_state["loading"] = False
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
