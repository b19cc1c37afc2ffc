"""Autotune's on-disk cache: where a measurement lives, and reading, writing and clearing it.

Split from :mod:`.autotune`, which measures and chooses, so each stays readable; the public
names here are re-exported there.

The key (see :func:`key_fields`) is the spec's static fields, power-of-two shape buckets, the
stride class, the table kind, whether ``start_positions`` is given, whether the call needs a
backward, the sorted candidate names, and the environment: device name and capability, versions
of rope-dispatch, torch, triton and TransformerEngine, a sha256 of the backends' source files and
a schema version. It is hashed with sha256 over sorted JSON (Python's ``hash()`` differs between
processes).

Storage: one JSON file per key in ``<cache_dir()>/<device>-<environment hash>/``. Each file is
written to a temporary file in the same directory and moved into place with ``os.replace``, so
readers see a whole file or none, and processes tuning different keys never touch each other's
files: no lock is needed and no entry is lost. A corrupt, truncated or foreign file is ignored
with one warning and rewritten; an unwritable directory leaves the choices in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import registry
from .call import RoPECall
from .call_keys import CallKey, call_key
from .errors import RoPETypeError, user_stacklevel
from .registry import Backend

SCHEMA_VERSION = 2
"""Bumped whenever the key or the entry format changes; old entries then stop matching (it is
part of the environment, so they live in another directory and are never read). 2: entries
may be pending (``deferred``: candidates not measured yet)."""

_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_ENVIRONMENT_FILE = "environment.json"
_ENVIRONMENT_DIR = re.compile(r"^[a-z0-9_]+-.+-[0-9a-f]{16}$")  # <device type>-<name>-<env hash>

lock = threading.RLock()
"""Held while the cache changes, in memory or on disk: autotune's choosing and
:func:`clear_cache` alike, so a clear never interleaves with a measurement being stored."""
if hasattr(os, "register_at_fork"):
    # a child forked while another thread held it (measuring a key) has no thread to release
    # it: its first call of a new key would wait forever
    os.register_at_fork(after_in_child=lock._at_fork_reinit)
_warned: set[str] = set()  # files and directories already warned about
_unwritable: set[str] = set()  # directories where writing failed: memory only from then on
_on_clear: list[Callable[[], None]] = []  # what clear_cache also empties (on_clear)


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Where one call's measurement lives: the key digest and the file that holds it."""

    digest: str
    path: Path
    fields: dict[str, Any]


def cache_dir() -> Path:
    """The cache root: ``ROPE_DISPATCH_CACHE_DIR``, else the user cache directory. Spaces
    around the value are ignored (a blank one is unset): `` /shared/cache`` must not make a
    directory named " " in the working directory."""
    env = os.environ.get("ROPE_DISPATCH_CACHE_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rope-dispatch"))


# ---------------------------------------------------------------------------------------------
# The key


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def dist_version(*names: str) -> str | None:
    """The version of the first installed distribution among ``names``, else ``None``."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def installed_versions() -> dict[str, str | None]:
    """Versions a result depends on, from package metadata (``None``: not installed).
    TransformerEngine is not imported; its distributions go by several names."""
    return {
        "rope-dispatch": dist_version("rope-dispatch"),
        "torch": torch.__version__,
        "triton": dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "transformer-engine": dist_version(
            "transformer-engine", "transformer_engine", "transformer-engine-cu12",
            "transformer-engine-cu13",
        ),
        "transformer-engine-torch": dist_version("transformer-engine-torch", "transformer_engine_torch"),
    }


@functools.lru_cache(maxsize=1)
def _kernel_sources_sha() -> str:
    """sha256 over the backends' source files of the installed package (name and bytes): the
    Python modules and the direct launcher's C source (``direct_launch.c``), built at first use,
    whose host path the timings of planned launches include."""
    from . import backends

    digest = hashlib.sha256()
    for folder in backends.__path__:
        for path in sorted(p for p in Path(folder).iterdir() if p.suffix in (".py", ".c")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_id(device: torch.device) -> tuple[str, int | None, int]:
    """What identifies a device's environment: type, index, and the CPU thread count."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "cuda", index, 0
    if device.type == "cpu":
        # CPU timings depend on the thread count, so it is part of the device.
        return "cpu", None, torch.get_num_threads()
    return device.type, device.index, 0


def _device_fields(kind: str, index: int | None, threads: int) -> dict[str, Any]:
    if kind == "cuda":
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "runtime": torch.version.hip or torch.version.cuda,
        }
    if kind == "cpu":
        return {"type": "cpu", "name": _cpu_name(), "machine": platform.machine(), "threads": threads}
    return {"type": kind, "name": kind if index is None else f"{kind}:{index}"}


@functools.lru_cache(maxsize=64)
def _environment_for(kind: str, index: int | None, threads: int) -> tuple[dict[str, Any], str, str]:
    """The environment of a device, its sha256 and its directory name (computed once)."""
    env = {
        "schema": SCHEMA_VERSION,
        "device": _device_fields(kind, index, threads),
        "versions": installed_versions(),
        "kernel_sources_sha256": _kernel_sources_sha(),
    }
    digest = _sha256_json(env)
    dev = env["device"]
    label = dev["name"]
    if "capability" in dev:
        label += "-sm" + "".join(str(c) for c in dev["capability"])
    return env, digest, f"{kind}-{_slug(label)}-{digest[:16]}"


def _environment(device: torch.device) -> dict[str, Any]:
    """Everything outside the call that a measurement depends on."""
    return _environment_for(*_device_id(device))[0]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-")[:60] or "device"


def environment_dir(device: torch.device | str) -> Path:
    """The cache subdirectory for ``device`` and the installed versions."""
    return cache_dir() / _environment_for(*_device_id(torch.device(device)))[2]


def call_signature(call: RoPECall, candidates: list[Backend]) -> tuple[CallKey, tuple[str, ...]]:
    """The call-dependent part of the key: the call's :class:`~rope_dispatch.call_keys.CallKey`
    (dispatch's key too) and the candidates' names (traceable by Dynamo)."""
    return call_key(call), tuple(sorted(b.name for b in candidates))


def key_fields(signature: tuple[CallKey, tuple[str, ...]]) -> dict[str, Any]:
    """:func:`call_signature` as the named JSON fields stored in each entry."""
    key, names = signature
    return {**key.fields(), "candidates": list(names)}


def cache_key(device: torch.device, signature: tuple) -> CacheKey:
    """The sha256 key of a call signature on ``device`` and the file storing its measurement."""
    fields = key_fields(signature)
    _, environment, folder = _environment_for(*_device_id(device))
    digest = _sha256_json({"environment": environment, "call": fields})
    return CacheKey(digest, cache_dir() / folder / f"{digest}.json", fields)


# ---------------------------------------------------------------------------------------------
# Files


def _warn_once(what: str, message: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"rope-dispatch autotune: {message}", RuntimeWarning,
                  stacklevel=user_stacklevel())


_MAX_TIME_US = 1e15
"""Above any real time of one call, in microseconds (and no NaN is below it): a stored time
past it marks a corrupt entry."""


def _entry_problem(entry: Any, digest: str | None) -> str | None:
    """Why ``entry`` is not a valid cache entry (``None`` when it is)."""
    if not isinstance(entry, dict):
        return f"it holds a {type(entry).__name__}, not an entry object"
    if entry.get("schema") != SCHEMA_VERSION:
        return f"schema {entry.get('schema')!r} is not {SCHEMA_VERSION}"
    if digest is not None and entry.get("key") != digest:
        return "its key does not match its file name"
    times = entry.get("times_us")
    choice = entry.get("choice")
    if not isinstance(times, dict) or not all(
        type(v) in (int, float) and 0 <= v < _MAX_TIME_US for v in times.values()
    ):
        return "its times_us is not a mapping of backend names to times"
    if not isinstance(choice, str) or choice not in times:
        return f"its choice {choice!r} has no measured time"
    failed = entry.get("failed")
    if failed is not None and not (
        isinstance(failed, dict) and all(type(v) is str for v in failed.values())
    ):
        return "its failed is not a mapping of backend names to errors"
    pending = entry.get("deferred")
    if pending is not None and not (
        isinstance(pending, list) and all(type(v) is str for v in pending)
    ):
        return "its deferred is not a list of backend names"
    fields = entry.get("fields")
    if not isinstance(fields, dict) or not (
        isinstance(fields.get("spec"), dict) and isinstance(fields.get("shape_bucket"), list)
        and isinstance(fields.get("candidates"), list)
        and all(type(v) is str for v in fields["candidates"])
    ):
        return "it has no key fields"
    for name in ("shape_bucket", "k_shape_bucket", "qkv_split"):  # (the last two only when set)
        sizes = fields.get(name, [])
        if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
            return f"its {name} is not a list of sizes"
    norms, form = fields.get("norms", []), fields.get("cache", [])  # (only when set)
    if not isinstance(norms, list) or not all(n is None or type(n) is str for n in norms):
        return "its norms is not a list of norm scopes"
    if not isinstance(form, list) or form and not (
            len(form) in (3, 4) and all(type(v) is str for v in form[:3])
            and all(type(v) is int for v in form[3:])):
        return "its cache is not a cache form (kind, cache dtype, q's dtype, v's head dim)"
    named = set(fields["candidates"])
    if choice not in named or not set(pending or ()) <= named:
        return "its choice or deferred names a backend that is not one of its candidates"
    return None


_MISSING = object()
"""What :func:`_read_json` returns for a file that does not exist (a file may hold ``null``)."""


def _read_json(path: Path) -> Any:
    """Parsed JSON of ``path``, :data:`_MISSING` when it does not exist; raises ValueError when
    unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no entry, or no cache directory yet
        return _MISSING
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"it cannot be read ({exc})") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # nesting past the parser's depth: RecursionError
        raise ValueError(f"it is not valid JSON ({exc}); truncated or corrupt") from exc


def read_entry(key: CacheKey) -> dict[str, Any] | None:
    """The valid entry stored for ``key``; a bad file warns once and reads as missing."""
    try:
        entry = _read_json(key.path)
    except ValueError as exc:
        _warn_once(str(key.path), f"ignoring cache file {key.path}: {exc}; it will be rewritten")
        return None
    if entry is _MISSING:
        return None
    problem = _entry_problem(entry, key.digest)
    if problem is None and entry["fields"].get("candidates") != key.fields["candidates"]:
        problem = "its candidates differ from this call's"
    if problem is not None:
        _warn_once(
            str(key.path), f"ignoring cache file {key.path}: {problem}; it will be rewritten"
        )
        return None
    return entry


def _write_json_atomic(path: Path, value: Any, attempts: int = 2) -> bool:
    """Write ``value`` to ``path`` through a temporary file and ``os.replace``; False on failure
    (one warning per directory, after which that directory is left alone). A temporary or
    folder removed under the write (another process's :func:`clear_cache`) is written again,
    up to ``attempts`` times in all."""
    folder = path.parent
    if str(folder) in _unwritable:
        return False
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return True
    except BaseException as exc:
        if tmp is not None:  # no temporary left, after an interrupt (Ctrl-C) mid-write too
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not isinstance(exc, OSError):
            raise
        if isinstance(exc, FileNotFoundError) and attempts > 1:
            return _write_json_atomic(path, value, attempts - 1)
        _unwritable.add(str(folder))
        _warn_once(
            str(folder),
            f"cannot write the cache in {folder} ({exc}); choices stay in memory for this process",
        )
        return False


def _found(test: Callable[[], bool]) -> bool:
    """A path test (``path.exists``, ``path.is_dir``), False where a directory on the way
    cannot be searched (another user's cache): a write that follows then fails and warns once."""
    try:
        return test()
    except OSError:
        return False


def store_entry(key: CacheKey, entry: dict[str, Any], device: torch.device) -> None:
    """Write ``entry`` to ``key``'s file, and the environment file of its directory first if
    missing (it says what the directory's hash stands for)."""
    env_file = key.path.parent / _ENVIRONMENT_FILE
    if not _found(env_file.exists):
        _write_json_atomic(env_file, _environment(device))
    _write_json_atomic(key.path, entry)


# ---------------------------------------------------------------------------------------------
# Inspecting and clearing


def _environment_dirs(root: Path) -> list[Path]:
    """The subdirectories of ``root`` named like ours; anything else there is left alone."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and _ENVIRONMENT_DIR.match(p.name))
    except OSError:
        return []


def _listing(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def cache_entries() -> list[dict[str, Any]]:
    """Every valid entry under :func:`cache_dir`, across devices and version sets.

    Each dict holds the entry's fields (``choice``, ``times_us``, ``failed``, ``measured``,
    ``fields``, ``created``) plus ``path`` and the ``environment`` of its directory.
    """
    root = cache_dir()
    entries: list[dict[str, Any]] = []
    if not _found(root.is_dir):
        return entries
    for folder in _environment_dirs(root):
        try:
            environment = _read_json(folder / _ENVIRONMENT_FILE)
        except ValueError:
            environment = None
        if environment is _MISSING:
            environment = None
        for path in _listing(folder):
            if not _ENTRY_NAME.match(path.name):
                continue
            try:
                entry = _read_json(path)
            except ValueError as exc:
                _warn_once(str(path), f"ignoring cache file {path}: {exc}; it will be rewritten")
                continue
            if entry is _MISSING:  # removed since it was listed
                continue
            problem = _entry_problem(entry, path.stem)
            if problem is not None:
                _warn_once(str(path), f"ignoring cache file {path}: {problem}; it will be rewritten")
                continue
            entries.append({**entry, "path": str(path), "environment": environment})
    return entries


_STALE_SECONDS = 60.0
"""Age past which a temporary file is a dead writer's: a live one is renamed within a write."""


def _stale(path: Path) -> bool:
    """Whether the temporary ``path`` was last written over ``_STALE_SECONDS`` ago."""
    try:
        return time.time() - path.stat().st_mtime > _STALE_SECONDS
    except OSError:
        return False


def on_clear(callback: Callable[[], None]) -> None:
    """Have :func:`clear_cache` call ``callback`` (under :data:`lock`): autotune forgets its
    choices in memory this way, as this module may not import it."""
    _on_clear.append(callback)


def clear_cache(memory_only: bool = False) -> int:
    """Forget every measurement (and dispatch's cached decisions); returns the files removed.

    With ``memory_only`` the files stay and the next call of each key reads its file again.
    Only this module's files are removed: entries, environment files and stale temporaries
    (written over ``_STALE_SECONDS`` ago; a younger one may be another process's write).
    """
    if type(memory_only) is not bool:  # a truthy "false" would keep every file
        raise RoPETypeError(f"memory_only must be True or False, got {memory_only!r}")
    with lock:
        for forget in _on_clear:
            forget()
        _warned.clear()
        _unwritable.clear()
        registry.invalidate()
        if memory_only:
            return 0
        removed = 0
        root = cache_dir()
        if not _found(root.is_dir):
            return 0
        for folder in _environment_dirs(root):
            for path in _listing(folder):
                name = path.name
                if _ENTRY_NAME.match(name) or name == _ENVIRONMENT_FILE or (
                    name.startswith(".tmp-") and name.endswith(".json") and _stale(path)
                ):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed += 1
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when nothing else is left in it
        return removed
