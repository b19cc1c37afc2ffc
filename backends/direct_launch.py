"""One C call that allocates a compiled Triton kernel's outputs and launches it.

On the autograd engine's thread each call into C costs about twice its main-thread time, so a
planned launch is one call: ``direct_launch.c`` holds the launch's constant parameters and,
per call, reads its inputs' addresses, allocates its outputs with ``new_empty`` and launches
through the CUDA driver (docs/tuning.md). It is built at first use by Triton's own C build
and cached by Triton; where it cannot be built or bound, :func:`bind` returns ``None`` and the
call is not planned.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

_SOURCE = Path(__file__).with_name("direct_launch.c")
_module: ModuleType | None = None
_unavailable: str | None = None  # why the module cannot be built, once a build failed

_INTEGER_TYPES = {"i1": "<b", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q",
                  "u1": "<B", "u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q"}
_SCRATCH_SLOTS = 2  # Triton's kernels end with the global and profile scratch pointers


def build() -> ModuleType:
    """``direct_launch.c`` compiled by Triton's C build (cached by Triton), no driver opened."""
    from triton.runtime.build import compile_module_from_src

    return compile_module_from_src(_SOURCE.read_text(), "rope_dispatch_direct_launch")


def module() -> ModuleType | None:
    """The built C module with the CUDA driver opened, or ``None`` (with
    :func:`unavailable_reason` saying why)."""
    global _module, _unavailable
    if _module is None and _unavailable is None:
        try:
            built = build()
            built.open_driver("libcuda.so.1")
            _module = built
        except Exception as exc:  # no compiler, no headers, no driver: keep two calls
            _unavailable = f"the direct launcher is unavailable: {type(exc).__name__}: {exc}"
    return _module


def unavailable_reason() -> str | None:
    return _unavailable


def parameter_slots(types: Sequence[str], args: Sequence[Any]) -> tuple[bytes, list[int]] | None:
    """The kernel's parameter values as ``direct_launch.c`` takes them (8-byte slots in the
    order Triton's launcher passes them: every argument that is not a compile-time constant,
    then the two scratch pointers, null) and, for each argument, its slot (``-1`` for a
    constant). ``args`` are the kernel's arguments in order, addresses as ints; ``None`` when
    a type is one this launcher does not pack."""
    if len(types) != len(args):
        return None
    packed = bytearray()
    slots = []
    for ty, value in zip(types, args):
        if ty == "constexpr":
            slots.append(-1)
            continue
        slots.append(len(packed) // 8)
        if ty.startswith("*"):
            packed += struct.pack("<Q", value)
        elif ty in _INTEGER_TYPES:
            packed += struct.pack(_INTEGER_TYPES[ty], value).ljust(8, b"\0")
        elif ty in ("fp32", "f32"):
            packed += struct.pack("<f", value).ljust(8, b"\0")
        elif ty == "fp64":
            packed += struct.pack("<d", value)
        else:
            return None
    packed += bytes(8 * _SCRATCH_SLOTS)
    return bytes(packed), slots


def bind(
    prefix: tuple, grid: tuple[int, int, int], types: Sequence[str] | None,
    args: Sequence[Any], inputs: int, takes: Sequence[tuple[int, int, int]],
    makes: Sequence[tuple[int, tuple[int, ...]]], fills: Sequence[tuple[int, int, int]],
) -> Any | None:
    """A ``Launch``: ``launch(stream, *inputs)`` allocates ``inputs[i].new_empty(shape)`` for
    each ``(i, shape)`` of ``makes``, writes the addresses that vary per call and launches the
    kernel that ``run(*grid, stream, *prefix, *args)`` launches (``prefix`` as
    ``_direct_launcher`` makes it for Triton's C launch ``run``, ``types`` the kernel's signature);
    it returns the one output, a tuple of several, or ``None``; or ``NotImplemented``, launching
    nothing, when an input tensor is not 16-byte aligned (ints are taken as given).

    ``takes``: ``(input, argument, offset)``, argument ``argument`` is input ``input``'s address
    plus ``offset`` bytes; ``fills``: ``(output, argument, offset)`` likewise for an output.
    ``args`` holds placeholders at those arguments. ``None`` where the launch is not one this
    launcher reproduces exactly (not Triton's C launch without scratch memory, a cooperative,
    PDL or cluster launch, an argument type it does not pack), the module is not built or no
    CUDA context is current. Call it with the kernel's CUDA device current."""
    if types is None or len(prefix) != 9 or prefix[1] or prefix[2] or min(grid) < 1:
        return None  # not Triton's C launch (its layout), a cooperative or PDL launch, no grid
    function, metadata = prefix[0], prefix[5]
    num_warps, num_ctas, shared = metadata
    if num_ctas != 1:
        return None
    packed = parameter_slots(types, args)
    built = module()
    if packed is None or built is None:
        return None
    slots, where = packed
    if any(where[a] < 0 for _, a, _ in (*takes, *fills)):
        return None
    try:
        return built.bind(
            function, tuple(grid), 32 * num_warps, shared, slots, inputs,
            tuple((i, where[a], o) for i, a, o in takes), tuple((i, tuple(s)) for i, s in makes),
            tuple((i, where[a], o) for i, a, o in fills),
        )
    except RuntimeError:  # no CUDA context current on this thread: Triton's launcher serves
        return None
    except ValueError:  # more arguments or addresses than its slots hold: not planned
        return None
