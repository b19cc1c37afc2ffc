"""Tables as the Triton kernels read them, and the device flags that let a launch read less.

A table's kernel form is :func:`rope_dispatch.tables.kernel_tables`'s. Two flags on the device,
checked against the table when it changes, let a launch read fewer bytes with the same bits:
a *linear* angle table (every row ``float32(p) x row 1``, as models build them) is read as
rates, and a rotate-half cos/sin cache whose rows repeat their first halves is read half by
half. A plan reads a flag by address (:func:`flag_stale` keeps it fresh). Nothing here runs
while ``torch.compile`` traces (the launcher sends traced calls to its op first).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch

from rope_dispatch.call import RoPECall
from rope_dispatch.env import env_raw_reader, env_reader, switch_value
from rope_dispatch.tables import CosSinCache, RotaryTable, kernel_tables, table_address

from .triton_tiles import next_pow2


def _raw_stream_getter():
    try:
        from torch._C import _cuda_getCurrentRawStream

        return _cuda_getCurrentRawStream
    except ImportError:  # older torch: the public (slower) way
        return lambda index: torch.cuda.current_stream(index).cuda_stream


current_stream = _raw_stream_getter()


def _paired(table: torch.Tensor, sin: torch.Tensor | None) -> bool:
    """Whether the tables are a pair cache's: one value per rotated pair, its sin view half as
    wide as the table (:func:`rope_dispatch.tables.kernel_tables`)."""
    return sin is not None and sin.shape[-1] != table.shape[-1] and sin.dtype is not FLAG


def is_rates(
    table: torch.Tensor, sin: torch.Tensor | None, tp: int | None = None, sp: int | None = None
) -> bool:
    """Whether the tables are a rate table's: ``sin`` is the table itself, a ``[rows, d2]`` view
    of the doubled rates with a row stride of 0 (:func:`rope_dispatch.tables.kernel_tables`).
    Where a traced graph hands the custom op two views of that one buffer instead of one
    object, the shared address and the zero row strides still say it; a cos/sin cache's tables
    are contiguous ``[s2, d2]`` (even one tensor given as both cos and sin). ``tp``/``sp``: the
    two addresses when already read."""
    if sin is None:
        return False
    if sin is not table and (
        (table.data_ptr() if tp is None else tp) != (sin.data_ptr() if sp is None else sp)
    ):
        return False  # a cos/sin cache (the usual case): no stride read
    return table.stride(0) == 0 and (sin is table or sin.stride(0) == 0)


def table_flags(
    table: torch.Tensor, sin: torch.Tensor | None
) -> tuple[bool, bool, bool, bool]:
    """The kernels' ``(USE_CACHE, PAIRED, RATES, LINEAR)`` for the tables of
    :func:`rope_dispatch.tables.kernel_tables`: angles ``(table, None)``; a cos/sin cache; a
    pair cache (a sin half as wide); a rate table (``sin`` is the table); and of
    :func:`flagged_tables`: angles with their linearity flag (an int32 ``sin``)."""
    if sin is not None and sin.dtype is FLAG:
        return False, False, False, True
    rates = is_rates(table, sin)
    return sin is not None and not rates, _paired(table, sin) and not rates, rates, False


def position_kind(positions: torch.Tensor | None) -> int:
    """The kernels' ``POSITIONS``: 0 by index, 1 start positions (a 1-D index tensor, one per
    sequence), 2 per-token positions (a 2-D one in token order: ``[s, b]``, ``[b, s]`` or
    ``[T, 1]``)."""
    return 0 if positions is None else positions.dim()


FLAG = torch.int32  # the dtype that tells a linear table's flag from a cache's sin


LINEAR_MIN_ROWS_READ = 1 << 18
"""Table rows x rotary channels from which a call with an angle table looks for its flag (1 MiB
of float32 rows read without one): below it rows the L2 serves beat computing the angles. The
rows are those a call can read (:func:`rows_read`), not its tokens."""

# ROPE_DISPATCH_LINEAR_TABLES as the environment stores it (one C call, no Python frame), and
# the values that leave the flags on in that form (unset, "1", ""); any other value is read by
# _linear_tables_off: 0 (or false, off, no) turns both flags off, a value neither on nor off
# is refused
_linear_tables_raw, _encode_env = env_raw_reader("ROPE_DISPATCH_LINEAR_TABLES")
_LINEAR_TABLES_ON = frozenset({None, _encode_env("1"), _encode_env("")})
_linear_tables = env_reader("ROPE_DISPATCH_LINEAR_TABLES")


def _linear_tables_off() -> bool:
    """Whether ``ROPE_DISPATCH_LINEAR_TABLES`` turns the flags off (:func:`switch_value`)."""
    return _linear_tables_raw() not in _LINEAR_TABLES_ON and not switch_value(
        "ROPE_DISPATCH_LINEAR_TABLES", _linear_tables(), True)


# (id of the table's base tensor, address, shape, device index) -> the table's flag: an int32
# [1] tensor on the table's device with attributes _rope_base (a weak reference to the base,
# whose death drops the entry) and _rope_version (the table's version counter when checked)
_flags: dict[tuple, torch.Tensor] = {}


# tables seen once: a table made for one call (a copy of a strided one) is never checked
_flags_met: dict[tuple, weakref.ref] = {}


_MAX_FLAGS = 64


def _forget_flag(key: tuple, ref: weakref.ref) -> None:
    flag = _flags.get(key)
    if flag is not None and flag._rope_base is ref:  # type: ignore[attr-defined]
        del _flags[key]


# torch.cuda.is_current_stream_capturing's C function, without its Python frame
_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def _capturing_on(stream: int) -> bool:
    """Whether a CUDA graph is being captured on ``stream``, the raw address of the current
    stream a launch reads (the driver is asked about the current device's). No graph is ever
    captured on the legacy default stream (address 0: CUDA refuses it, and so does
    ``torch.cuda.graph``), where most training runs, and a backward runs on its forward's
    stream: there the driver is not asked. Asked on every call, the question made planned
    forward + backward calls on a linear table 3-10 us slower than the same calls reading rows
    on the H200 host, where it took 0.3-0.7 us alone (run AB)."""
    return stream != 0 and _stream_capturing()


def _capturing(table: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured where ``table`` is read: a replay would read the
    flag as it was at capture, whatever was written into the table since."""
    return table.is_cuda and _capturing_on(current_stream(table.get_device()))


def linear_flag(table: torch.Tensor) -> torch.Tensor | None:
    """The flag of the contiguous float32 angle table ``[s2, d2]``, checked against its current
    contents (:func:`current_flag`), or ``None`` where the kernels read its rows: at the first
    sight of a table (a table made for one call never pays for a check), for inference tensors
    (no version counter tells a later write), fewer than two rows, under ``torch.compile`` or
    CUDA graph capture, and with ``ROPE_DISPATCH_LINEAR_TABLES=0``."""
    if (
        torch.compiler.is_compiling() or table.shape[0] < 2 or table.is_inference()
        or _linear_tables_off()
    ):
        return None
    base = table._base if table._base is not None else table
    key = (id(base), table.data_ptr(), table.shape, table.get_device())
    flag = _flags.get(key)
    if flag is None or flag._rope_base() is not base:  # type: ignore[attr-defined]
        met = _flags_met.pop(key, None)
        if met is None or met() is not base or _capturing(table):
            if len(_flags_met) >= _MAX_FLAGS:
                _flags_met.clear()
            _flags_met[key] = weakref.ref(base)
            return None
        with torch.inference_mode(False):  # a normal tensor: refilled outside inference mode too
            flag = torch.zeros(1, dtype=FLAG, device=table.device)
        flag._rope_base = weakref.ref(base, functools.partial(_forget_flag, key))  # type: ignore[attr-defined]
        flag._rope_version = -1  # type: ignore[attr-defined]
        if len(_flags) >= _MAX_FLAGS:
            _flags.clear()
        _flags[key] = flag
    return current_flag(table, flag)


def current_flag(table: torch.Tensor, flag: torch.Tensor) -> torch.Tensor | None:
    """``flag``, checked again when ``table`` was written since its last check (its version
    counter moved); ``None`` under CUDA graph capture or with ``ROPE_DISPATCH_LINEAR_TABLES=0``
    (set since the flag was made: a backward, say), where the kernels read the rows."""
    if _capturing(table) or _linear_tables_off():
        return None
    version = table._version
    if flag._rope_version != version:  # type: ignore[attr-defined]
        from . import triton_kernels as kernels
        d2 = table.shape[1]
        block_c = next_pow2(d2)
        block_rows = max(1, 4096 // block_c)
        # checked apart, then copied in: a launch another thread queues meanwhile on the
        # stream reads the flag as it was or as checked, never the check's starting guess
        checked = torch.full_like(flag, kernels.LINEAR_HALVES | kernels.LINEAR_PAIRS)
        with on_device(table):
            kernels.linear_table_kernel[(-(-table.shape[0] // block_rows),)](
                table, checked, table.shape[0], ROT_DIM=d2, BLOCK_ROWS=block_rows,
                BLOCK_C=block_c,
            )
        flag.copy_(checked)
        flag._rope_version = version  # type: ignore[attr-defined]
    return flag


def flagged_tables(
    table: RotaryTable, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rope_dispatch.tables.kernel_tables`, with an angle table's flag as its ``sin``
    (:func:`linear_flag`) when the call's ``rows`` (:func:`rows_read`) hold at least
    ``LINEAR_MIN_ROWS_READ`` entries."""
    tab, sin = kernel_tables(table)
    if sin is None and rows * tab.shape[1] >= LINEAR_MIN_ROWS_READ:
        flag = linear_flag(tab)
        if flag is not None:
            return tab, flag
    return tab, sin


HALVES_MIN_ROWS_READ = 1 << 16
"""Table rows x rotary channels from which a rotate-half call on a cos/sin cache looks for its
halves flag: half the rows' bytes saved on each call against one check of the cache (a launch,
about 5 us of host time) at its second call."""


# cos/sin cache -> its halves flag: an int32 [1] tensor on the cache's device with attribute
# _rope_version (the cache's version, CosSinCache._version, when checked)
_halves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# caches seen once: one made for a single call is never checked
_halves_met: weakref.WeakSet = weakref.WeakSet()


_BITS = {2: torch.int16, 4: torch.int32}  # element size -> the integer view the check compares


def halves_flag(table: CosSinCache) -> torch.Tensor | None:
    """The halves flag of a cos/sin cache, checked against its current contents
    (:func:`current_halves`), or ``None`` where the kernels read whole rows: at the first
    sight of a cache, for inference tensors (no version counter tells a later write), under
    ``torch.compile`` or CUDA graph capture, and with ``ROPE_DISPATCH_LINEAR_TABLES=0``."""
    cos, sin = table.cos, table.sin
    if (
        torch.compiler.is_compiling() or cos.is_inference() or sin.is_inference()
        or _linear_tables_off()
    ):
        return None
    flag = _halves.get(table)
    if flag is not None and flag.device != cos.device:  # moved by ``.data = ...``
        flag = None
    if flag is None:
        if table not in _halves_met or _capturing(cos):
            _halves_met.add(table)
            return None
        _halves_met.discard(table)
        with torch.inference_mode(False):  # a normal tensor: refilled outside inference mode too
            flag = torch.zeros(1, dtype=FLAG, device=cos.device)
        flag._rope_version = -1  # type: ignore[attr-defined]
        _halves[table] = flag
    return current_halves(cos, sin, flag)


def current_halves(cos: torch.Tensor, sin: torch.Tensor, flag: torch.Tensor) -> torch.Tensor | None:
    """``flag``, checked again when ``cos`` or ``sin`` was written since its last check (the
    sum of their version counters moved: each only grows) or given new memory (``.data = ...``,
    which moves no counter); ``None`` under CUDA graph capture or with
    ``ROPE_DISPATCH_LINEAR_TABLES=0``, where the kernels read whole rows."""
    if _capturing(cos) or _linear_tables_off():
        return None
    version, address = cos._version + sin._version, (cos.data_ptr(), sin.data_ptr(), cos.shape)
    if (flag._rope_version != version  # type: ignore[attr-defined]
            or getattr(flag, "_rope_address", None) != address):
        from . import triton_kernels as kernels
        rows, d2 = cos.shape
        bits = _BITS[cos.element_size()]
        block_c = next_pow2(d2 // 2)
        block_rows = max(1, 4096 // block_c)
        checked = torch.ones_like(flag)  # checked apart, then copied in (current_flag)
        with on_device(cos):
            kernels.halves_table_kernel[(-(-rows // block_rows),)](
                cos.view(bits), sin.view(bits), checked, rows, ROT_DIM=d2,
                BLOCK_ROWS=block_rows, BLOCK_C=block_c,
            )
        flag.copy_(checked)
        flag._rope_version = version  # type: ignore[attr-defined]
        flag._rope_address = address  # type: ignore[attr-defined]
    return flag


def launch_tables(
    table: RotaryTable, rows: int, cu_seqlens: torch.Tensor | None, layout: str,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`flagged_tables`, and what the launch's ``cu_seqlens`` argument carries: the
    call's own on thd; on sbhd and bshd, where the kernels read no ``cu_seqlens``, a rotate-half
    cos/sin cache's halves flag (:func:`halves_flag`) when the call's ``rows``
    (:func:`rows_read`) hold at least ``HALVES_MIN_ROWS_READ`` entries, else ``None``."""
    tab, sin = flagged_tables(table, rows)
    if (
        cu_seqlens is None and type(table) is CosSinCache and not interleaved
        and layout != "thd" and rows * tab.shape[1] >= HALVES_MIN_ROWS_READ
    ):
        cu_seqlens = halves_flag(table)
    return tab, sin, cu_seqlens


def plan_flag(
    sin: torch.Tensor | None, cu_seqlens: torch.Tensor | None, layout: str
) -> torch.Tensor | None:
    """The flag a plan's launches read by address (:func:`flag_stale` keeps it fresh): a
    linear angle table's (its ``sin``) or a cos/sin cache's halves flag (its ``cu_seqlens`` on
    sbhd and bshd, :func:`launch_tables`)."""
    if sin is not None and sin.dtype is FLAG:
        return sin
    return cu_seqlens if layout != "thd" else None


def _tokens(t: torch.Tensor) -> int:
    return math.prod(t.shape[:-2])


def rows_read(t: torch.Tensor, layout: str, index: torch.Tensor | None) -> int:
    """At most how many table rows a call on ``t`` reads: its sequence length for sbhd and bshd,
    whose batch entries share rows, and its token count for thd or where an index tensor
    places the tokens."""
    if index is not None or layout == "thd":
        return _tokens(t)
    return t.shape[0] if layout == "sbhd" else t.shape[1]


_NO_GUARD = contextlib.nullcontext()


@functools.lru_cache(maxsize=1)
def several_gpus() -> bool:
    return torch.cuda.device_count() > 1


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for the launch (a no-op in the usual single-device case)."""
    if t.is_cuda and several_gpus() and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def user_table_address(call: RoPECall) -> int:
    """The address of the table (the cos table of a cache) the user passed, which dispatch
    checks with every planned call."""
    address = table_address(call.table)
    return address if isinstance(address, int) else address[0]


def flag_stale(flag: torch.Tensor, freqs: torch.Tensor, stream: int) -> bool:
    """Whether a plan must not launch on ``stream`` (the raw current stream of the current
    device) with the address of ``flag``, the flag of ``freqs``'s angle table: the table was
    written since its check (the generic path checks it again), a CUDA graph is being captured
    (a replay must read the rows; :func:`_capturing_on`), or ``ROPE_DISPATCH_LINEAR_TABLES=0``
    was set since the plan was made. One Python frame (``_capturing_on``'s test written out, the
    switch read raw): it runs twice in each planned forward + backward, once on the autograd
    engine's thread."""
    return (
        flag._rope_version != freqs._version  # type: ignore[attr-defined]
        or (stream != 0 and _stream_capturing())
        or _linear_tables_raw() not in _LINEAR_TABLES_ON
    )
