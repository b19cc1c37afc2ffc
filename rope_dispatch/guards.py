"""Metadata guards for planned calls: whether a call's tensors are laid out as the ones a plan
was made for (dtype, device, shape, strides, ``requires_grad``), checked in one call.

At decode size the host path sets a call's pace, and reading tensor metadata in Python (about
0.1 us per attribute, six or more per tensor) was the largest part of a planned call's front
in dispatch. torch's own C++ tensor guards
(``torch._C._dynamo.guards.TensorGuards``, the check a compiled graph runs on its inputs) do the
same comparison in one C call, and compare the tensors' dispatch keys too (so a functorch
wrapper or an inference tensor is never mistaken for the tensor a plan was made for). That
class is private, and misused it crashes the process (constructed without its size and stride
lists, torch 2.13 segfaults): :func:`tensor_guard` uses it only on the torch releases it was
verified with (``VERIFIED_TORCH``), after a probe of what it must accept and refuse, and
compares the metadata in Python on any other release or when the probe fails.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .overlap import byte_span
from .tables import table_requires_grad

Guard = Callable[..., bool]
"""``guard(*tensors) -> bool``: whether ``tensors`` match, one for one, the tensors the guard
was made from (called with as many tensors as it was made from)."""


def _metadata(x: torch.Tensor) -> tuple:
    return x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.is_inference()


def metadata_guard(*tensors: torch.Tensor) -> Guard:
    """A guard comparing each tensor's metadata in Python (the fallback)."""
    expected = tuple(_metadata(x) for x in tensors)

    def check(*given: torch.Tensor) -> bool:
        return tuple(_metadata(x) for x in given) == expected

    return check


def _torch_guard(*tensors: torch.Tensor) -> Guard:
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(x.shape) for x in tensors],
        dynamic_dims_strides=[list(x.stride()) for x in tensors],
    ).check


def _accepts_and_refuses_as_expected(make: Callable[..., Guard]) -> bool:
    """Whether guards from ``make`` accept same-metadata tensors with other data and refuse each
    kind of difference a plan depends on."""
    # dtypes and device spelled out: the probe must not follow torch's defaults
    f32 = {"dtype": torch.float32, "device": "cpu"}
    i64 = {"dtype": torch.int64, "device": "cpu"}
    base, index = torch.zeros(2, 3, 4, **f32), torch.zeros(2, **i64)
    guard = make(base, index)
    different = (
        (torch.zeros(2, 3, 5, **f32), index),
        (torch.zeros(4, 3, 2, **f32).transpose(0, 2), index),  # same shape, other strides
        (torch.zeros(2, 3, 4, dtype=torch.float64, device="cpu"), index),
        (torch.zeros(2, 3, 4, requires_grad=True, **f32), index),
        (base, index.to(torch.int32)),
        (base, torch.zeros(3, **i64)),
    )
    return guard(torch.ones(2, 3, 4, **f32), torch.ones(2, **i64)) and not any(
        guard(*tensors) for tensors in different
    )


VERIFIED_TORCH = ((2, 6), (2, 13))
"""The torch releases (first, last) whose ``TensorGuards`` our use was checked against: CI's
2.13 and the GPU machine's 2.11 run the tests; the class and its arguments are unchanged
since 2.6."""


def _verified_torch() -> bool:
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    first, last = VERIFIED_TORCH
    return first <= release <= last


@functools.cache
def _guard_maker() -> Callable[..., Guard]:
    try:  # the probe's tensors are its own: no dispatch mode sees them made (a selective
        # checkpoint's recomputation refuses ops its forward did not record)
        with _disable_current_modes():
            if _verified_torch() and _accepts_and_refuses_as_expected(_torch_guard):
                return _torch_guard
    except Exception:  # noqa: BLE001  (a private class: any change in it means the fallback)
        pass
    return metadata_guard


def tensor_guard(*tensors: torch.Tensor) -> Guard:
    """A guard for ``tensors``' metadata: torch's C++ tensor guards where they pass the probe,
    else :func:`metadata_guard`. A tensor given twice (one weight for q's and k's norm, q as
    its own output) is checked once by torch's guards, which refuse such a list at every
    check; its later places must hold that same tensor again."""
    firsts: dict[int, int] = {}
    unique = [i for i, x in enumerate(tensors) if firsts.setdefault(id(x), i) == i]
    if len(unique) == len(tensors):
        return _guard_maker()(*tensors)
    main = _guard_maker()(*(tensors[i] for i in unique))
    pick = operator.itemgetter(*unique)
    repeats = tuple((i, firsts[id(x)]) for i, x in enumerate(tensors) if firsts[id(x)] != i)

    def check(*given: torch.Tensor) -> bool:
        kept = pick(given)
        return (main(*kept) if len(unique) > 1 else main(kept)) and all(
            given[i] is given[j] for i, j in repeats)

    return check


def guard_kind() -> str:
    """``"torch"`` (one C call per check) or ``"python"`` (the fallback), for reports."""
    return "torch" if _guard_maker() is _torch_guard else "python"


def apart_as_planned(guard: Guard, q: torch.Tensor, k: torch.Tensor | None,
                     weights: tuple[torch.Tensor, ...],
                     tables: tuple[torch.Tensor, ...] = ()) -> Guard:
    """``guard`` for an in-place call, whose checks found what it writes apart from what it
    reads: k (of a pair) placed as far from q as in the planned call or so far that their bytes
    cannot meet (with the same shapes and strides, that settles that they share no element),
    the norm ``weights`` (at most two, the last tensors guarded) with bytes that meet neither
    q's nor k's, and the table's ``tables`` (a plan runs only while they hold the memory they
    held) with bytes that meet neither either. Elsewhere the call is checked again (check_call
    refuses q and k that share an element, and a weight or a table that shares one with
    either). A few address reads and comparisons: this runs on every planned call (decode)."""
    planned = None if k is None else k.data_ptr() - q.data_ptr()
    q_end, k_end = byte_span(q), None if k is None else byte_span(k)
    count = len(weights)
    last_end = byte_span(weights[-1]) if count else 0
    first_end = byte_span(weights[0]) if count == 2 else 0
    spans = tuple((x.data_ptr(), x.data_ptr() + byte_span(x)) for x in tables if x.numel())

    def check(*tensors: torch.Tensor) -> bool:
        if not guard(*tensors):
            return False
        q_at = tensors[0].data_ptr()
        if planned is not None:
            k_at = tensors[1].data_ptr()
            distance = k_at - q_at
            if not (distance == planned or distance >= q_end or distance <= -k_end):
                return False
        for low, high in spans:  # the table's bytes apart from q's and k's
            if q_at < high and low < q_at + q_end or planned is not None and (
                    k_at < high and low < k_at + k_end):
                return False
        if count:  # each weight's bytes apart from q's and from k's (not their span: q and k
            # may be two allocations, with other tensors, the weights too, between them)
            at = tensors[-1].data_ptr()
            if not (at + last_end <= q_at or at >= q_at + q_end) or planned is not None and not (
                    at + last_end <= k_at or at >= k_at + k_end):
                return False
            if count == 2:
                at = tensors[-2].data_ptr()
                if not (at + first_end <= q_at or at >= q_at + q_end) or not (
                        at + first_end <= k_at or at >= k_at + k_end):
                    return False
        return True

    return check


_grad_enabled = torch.is_grad_enabled


def constant_table(guard: Guard, table: weakref.ref) -> Guard:
    """``guard`` for a plan made for tensors that need no grad, and its table (by weak
    reference) still wanting no gradient where grad is enabled: such a plan runs no autograd
    node, so a table set to require grad since (``requires_grad_()``: a frozen table made
    learnable) is checked again and goes to a backend that differentiates it. Under
    ``no_grad`` and inference mode (decode) it costs one C call more."""

    def check(*tensors: torch.Tensor) -> bool:
        return guard(*tensors) and not (_grad_enabled() and table_requires_grad(table()))

    return check
