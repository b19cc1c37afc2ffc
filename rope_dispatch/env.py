"""Environment variables read on the hot path: one C call a read, no Python frame."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Callable

from .errors import RoPEError

SWITCH_ON = ("1", "true", "on", "yes")
SWITCH_OFF = ("0", "false", "off", "no")

VARIABLES = (
    "ROPE_BACKEND", "ROPE_AUTOTUNE", "ROPE_AUTOTUNE_HOT_CALLS", "ROPE_DISPATCH_CACHE_DIR",
    "ROPE_DISPATCH_CHECK_VALUES", "ROPE_DISPATCH_LINEAR_TABLES",
)
"""Every environment variable rope-dispatch reads (names are case-sensitive)."""


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """A line for each variable of ``environ`` (default ``os.environ``) named like ours (``ROPE_``
    in any case) that rope-dispatch does not read, with the name meant where one is close: a
    misspelt ``ROPE_DISPATCH_AUTOTUNE=0`` is otherwise ignored without a word."""
    lines = []
    for name in sorted(os.environ if environ is None else environ):
        if not name.upper().startswith("ROPE_") or name in VARIABLES:
            continue
        close = difflib.get_close_matches(name.upper(), VARIABLES, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"{name} is not a variable rope-dispatch reads{hint} "
                     f"(it reads {', '.join(VARIABLES)})")
    return lines


def env_raw_reader(name: str) -> tuple[Callable[[], object], Callable[[str], object]]:
    """``(get, encode)``: ``get()`` is environment variable ``name`` as the mapping stores it
    (``None`` when unset), one C call with no Python frame, and ``encode(value)`` a value in
    that form, so a check compares without decoding. ``os.environ.get`` re-encodes the key on
    every call (about 0.5-1 us, a tenth of a decode-size call)."""
    raw = getattr(os.environ, "_data", None)
    encode_key = getattr(os.environ, "encodekey", None)
    encode_value = getattr(os.environ, "encodevalue", None)
    if isinstance(raw, dict) and encode_key is not None and encode_value is not None:
        return functools.partial(raw.get, encode_key(name)), encode_value
    return functools.partial(os.environ.get, name), str


def env_reader(name: str) -> Callable[[], str | None]:
    """A function returning ``os.environ.get(name)`` from :func:`env_raw_reader`'s read."""
    get, _ = env_raw_reader(name)
    decode = getattr(os.environ, "decodevalue", None)
    if get.func is os.environ.get or decode is None:
        return get

    def read() -> str | None:
        value = get()
        return None if value is None else decode(value)

    return read


def switch_value(name: str, raw: str | None, default: bool) -> bool:
    """The value of on/off environment variable ``name`` read as ``raw``: :data:`SWITCH_ON` or
    :data:`SWITCH_OFF`, any case, spaces around ignored; ``default`` when unset or empty. Any
    other value is refused by name: a misspelt switch must not act as if it were unset."""
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return default
    if value in SWITCH_ON or value in SWITCH_OFF:
        return value in SWITCH_ON
    raise RoPEError(
        f"{name} must be {', '.join(SWITCH_ON[:-1])} or {SWITCH_ON[-1]} (on) or "
        f"{', '.join(SWITCH_OFF[:-1])} or {SWITCH_OFF[-1]} (off), any case; got {raw!r}"
    )
