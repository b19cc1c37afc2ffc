"""Exceptions raised by rope-dispatch.

Every error names the argument, the value it got and what was expected, so that a user can fix
the call without reading our source.
"""

from __future__ import annotations


class RoPEError(ValueError):
    """Base class of every rope-dispatch error about a call's arguments or backends."""


class RoPETypeError(RoPEError, TypeError):
    """An argument of the wrong type (a list where a tensor was expected, a NumPy array, a
    string for a spec); a ``TypeError`` too, as such errors were before they were ours."""


class NoBackendError(RoPEError):
    """No registered backend can serve a call; the message lists every backend's reasons."""


class BackendNotSupportedError(RoPEError):
    """A forced backend (``backend=``, ``use_backend`` or ``ROPE_BACKEND``) cannot serve the call."""


class UnknownBackendError(RoPEError, KeyError):
    """A backend name that is not registered; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names the
    user's line: the first frame outside rope-dispatch (and torch, whose module and autograd
    machinery may sit between), however deep the call that warns."""
    import sys

    internal = _internal_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _internal_dirs() -> tuple[str, ...]:
    """The folders of rope-dispatch's modules, its backends' and torch's (as given and
    resolved)."""
    import os

    import torch

    from . import backends  # its own folder: backends/ in a checkout (setuptools' package-dir)

    dirs = []
    for file in (__file__, backends.__file__, torch.__file__):
        d = os.path.dirname(file)
        for path in (d, os.path.realpath(d)):
            dirs.append(os.path.join(path, ""))
    return tuple(dirs)
