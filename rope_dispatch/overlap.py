"""Whether tensors a call writes address common elements: two tensors (q and k of an in-place
pair, a norm weight and what it normalizes, an output and an input), or one tensor with itself
(an expanded or overlapping view written in place). Exact for any strides where a bounded search
can tell, from metadata and addresses only; nothing here is read on a planned call's path but
:func:`byte_span` (its guard's spans, worked out when the plan is made)."""

from __future__ import annotations

import torch

from .errors import RoPEError
from .tracing import memoryless

def expanded_dim(t: torch.Tensor) -> int | None:
    """The first dimension of ``t`` whose elements share memory (stride 0, size > 1), if any:
    such a tensor cannot be written in place. An empty tensor has none to share."""
    strides = t.stride()
    if 0 not in strides or t.numel() == 0:  # the common case, in one C call
        return None
    return next((i for i, (n, s) in enumerate(zip(t.shape, strides)) if s == 0 and n > 1), None)


_OVERLAP_SEARCH_LIMIT = 10_000


def shared_element(a: torch.Tensor, b: torch.Tensor, width: int,
                   b_width: int | None = None) -> bool | None:
    """Whether ``a[..., :width]`` and ``b[..., :b_width]`` (same dtype; ``b_width`` defaults to
    ``width``) address a common element: True or False, or None where the search for one gives
    up (strides that do not nest), which torch's own in-place checks call too hard to tell, or
    where the tensors have no memory to compare (:func:`~rope_dispatch.tracing.memoryless`).
    Exact for any strides: it looks for index offsets, within both tensors' bounds, whose
    strided sum is the distance between the two starts, from the largest stride down, keeping
    only offsets the smaller strides can still complete."""
    b_width = width if b_width is None else b_width
    if a.numel() == 0 or b.numel() == 0 or width == 0 or b_width == 0:
        return False
    if memoryless():
        return None
    if a.is_meta and not torch._C._overlaps(a, b):  # meta storages all start at address 0
        return False
    start_a, start_b = a.data_ptr(), b.data_ptr()
    if start_a + byte_span(a) <= start_b or start_b + byte_span(b) <= start_a:
        return False  # bytes apart (q's heads, then k's, of one projection): no search
    distance, rest = divmod(start_b - start_a, a.element_size())
    if rest:
        return None
    if _apart_in_rows(a, b, distance, width, b_width):
        return False
    ranges: dict[int, list[int]] = {}  # stride -> [lowest, highest] summed index offset
    for shape, strides, sign, w in ((a.shape, a.stride(), 1, width),
                                    (b.shape, b.stride(), -1, b_width)):
        sizes = (*shape[:-1], w)
        for n, s in zip(sizes, strides):
            if n > 1:
                span = ranges.setdefault(s, [0, 0])
                span[0 if sign < 0 else 1] += sign * (n - 1)
    return _offsets_reach([(s, lo, hi) for s, (lo, hi) in ranges.items()], distance)


def _offsets_reach(dims: list[tuple[int, int, int]], target: int,
                   nonzero: bool = False) -> bool | None:
    """Whether index offsets ``c_i`` in ``lo_i .. hi_i`` (``dims``: ``(stride, lo, hi)``) make
    ``sum(c_i * stride_i) == target``; with ``nonzero``, offsets not all 0, the first nonzero
    one positive (``lo_i == -hi_i``: each solution or its negation). True or False, or None
    where the search gives up after ``_OVERLAP_SEARCH_LIMIT`` steps. It runs from the largest
    stride down, keeping only offsets the smaller strides can still complete."""
    dims = sorted(dims, key=lambda d: (d[0], d[2]), reverse=True)  # by stride, then size
    lows = [0] * (len(dims) + 1)  # the least and greatest sum the dims from i on can make
    highs = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        s, lo, hi = dims[i]
        lows[i], highs[i] = lows[i + 1] + lo * s, highs[i + 1] + hi * s
    budget = [_OVERLAP_SEARCH_LIMIT]

    def reach(i: int, target: int, started: bool) -> bool | None:
        if not lows[i] <= target <= highs[i]:
            return False
        if i == len(dims):
            return started or not nonzero  # lows == highs == 0 there, so target is 0
        s, lo, hi = dims[i]
        first = max(0 if nonzero and not started else lo, -((highs[i + 1] - target) // s))
        last = min(hi, (target - lows[i + 1]) // s)
        unknown = False
        for c in range(first, last + 1):
            budget[0] -= 1
            if budget[0] < 0:
                return None
            found = reach(i + 1, target - c * s, started or c != 0)
            if found:
                return True
            unknown = unknown or found is None
        return None if unknown else False

    return reach(0, target, False)


def _apart_in_rows(a: torch.Tensor, b: torch.Tensor, distance: int, width: int,
                   b_width: int) -> bool:
    """Whether ``a[..., :width]`` and ``b[..., :b_width]``, ``distance`` elements apart, are
    told apart by their channels: with the same strides, the channels' 1 and every leading one
    a multiple of the least, ``period``, an element's offset modulo ``period`` is its channel
    (plus ``distance`` for ``b``), so windows in different places of the period share nothing
    (slices of one projection's heads, the common case, told without the search)."""
    strides = a.stride()
    if strides != b.stride() or len(strides) < 2 or strides[-1] != 1:
        return False
    lead = strides[:-1]
    period = min(lead)
    if period < max(width, b_width) or any(s % period for s in lead):
        return False
    start = distance % period
    return start >= width and start + b_width <= period


def _refuse_read_in(name: str, read: torch.Tensor, what: str, own: str,
                    written: tuple[tuple[str, torch.Tensor | None], ...], writer: str,
                    remedy: str) -> None:
    """Refuse ``read`` (the call's ``what``, argument ``name``; ``own``: how to give it memory
    of its own) where it shares an element with a tensor of ``written``."""
    for target, x in written:
        if x is not None and _shares(read, x):
            raise RoPEError(
                f"{name} shares memory with {target} {tuple(x.shape)}, which {writer} while it "
                f"reads the {what}; pass a {what} of its own ({own}){remedy}"
            )


def _shares(a: torch.Tensor, b: torch.Tensor, real: bool = False) -> bool:
    """Whether ``a`` and ``b`` address a common element (of different element sizes: whether
    their byte ranges meet). False where that cannot be told (traced tensors, unless the
    caller knows them ``real``; strides that do not nest). Tensors whose byte ranges lie apart
    (views of one ``[2, ...]`` cache, say) are told so from their addresses alone."""
    # torch's test: False for two storages, True for any two views of one
    if (not real and memoryless()) or not torch._C._overlaps(a, b) or a.numel() == 0 or (
            b.numel() == 0):
        return False
    start_a, start_b = a.data_ptr(), b.data_ptr()
    if start_a + byte_span(a) <= start_b or start_b + byte_span(b) <= start_a:
        return False
    if a.element_size() == b.element_size():
        return bool(shared_element(a, b, a.shape[-1], b.shape[-1]))
    return True  # bytes of other sizes whose ranges meet


def byte_span(x: torch.Tensor) -> int:
    """Bytes from ``x``'s first element to past its last (strides >= 0; 0 for an empty
    ``x`` that is contiguous)."""
    if x.is_contiguous():
        return x.numel() * x.element_size()
    return (sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size()


def _check_apart(q: torch.Tensor, k: torch.Tensor, d2: int, offset: int = 0) -> None:
    """q and k rotated in place must not share a rotary element (``d2`` channels from
    ``offset`` on): each would be rotated twice, or read after the other's write."""
    if shared_element(q[..., offset:], k[..., offset:], d2):
        where = (f"their first {d2} channels" if not offset
                 else f"their {d2} rotary channels from channel {offset}")
        raise RoPEError(
            f"apply_qk_ cannot rotate q and k in place: they share memory (q {tuple(q.shape)} "
            f"strides {q.stride()} and k {tuple(k.shape)} strides {k.stride()}, k starting "
            f"{(k.data_ptr() - q.data_ptr()) // q.element_size()} elements after q, overlap in "
            f"{where}), so some elements would be rotated twice; pass views "
            "of disjoint channels, or use rope_dispatch.apply_qk"
        )


def self_overlap(t: torch.Tensor, start: int = 0, stop: int | None = None) -> bool | None:
    """Whether two places of ``t[..., start:stop]`` address one element (an ``as_strided`` view
    whose rows overlap, a stride 0): written in place, one write would land on another's
    result. True or False, or None where the search gives up, as :func:`shared_element`'s
    (and for tensors without memory). Strides that nest (each dim's stride past the span of
    the smaller ones: every dense or sliced layout) are told without a search."""
    if t.is_contiguous():  # the common case first: an output door's check on every call
        return False
    if memoryless():
        return None
    stop = t.shape[-1] if stop is None else stop
    if t.numel() == 0 or stop <= start:
        return False
    dims = sorted((s, n) for n, s in zip((*t.shape[:-1], stop - start), t.stride()) if n > 1)
    span = 0  # the largest offset the smaller strides reach
    for s, n in dims:  # ascending strides
        if s <= span:
            break
        span += (n - 1) * s
    else:
        return False
    if dims[0][0] == 0:
        return True
    # a nonzero index difference c (|c_i| < n_i) whose strided sum is 0
    return _offsets_reach([(s, 1 - n, n - 1) for s, n in dims], 0, nonzero=True)


def refuse_self_overlap(t: torch.Tensor, name: str, refusal: str, remedy: str,
                        start: int = 0, stop: int | None = None) -> None:
    """Refuse ``t`` (the argument ``name``; ``refusal`` says who cannot do what) where the
    channels ``start:stop`` the call writes address one element twice (:func:`self_overlap`;
    a search that gives up lets the call run, as torch's in-place checks do)."""
    if self_overlap(t, start, stop):
        whole = start == 0 and stop in (None, t.shape[-1])
        where = "" if whole else f" in channels {start}..{stop}"
        raise RoPEError(
            f"{refusal}: {name} {tuple(t.shape)} with strides {t.stride()} overlaps itself (two "
            f"of its places{where} are one element in memory, as an as_strided view can make "
            f"them), so one write would land on another's result; {remedy}"
        )


def refuse_shared(name: str, out: torch.Tensor, other: str, x: torch.Tensor) -> None:
    """``out`` (the argument ``name``), written apart from ``other`` (``x``), must share no
    element with it: else one write lands on the other's result, silently. Real tensors only
    (the caller asked :func:`~rope_dispatch.tracing.memoryless`)."""
    if _shares(out, x, real=True):
        raise RoPEError(
            f"{name} shares memory with {other} ({name} {tuple(out.shape)} strides "
            f"{out.stride()}, {other} {tuple(x.shape)} strides {x.stride()}): the prologue "
            f"writes {name} apart from {other}, so one would overwrite the other; give "
            f"{name} memory of its own"
        )


def refuse_written_overlaps(t: torch.Tensor, k: torch.Tensor | None,
                            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                            tables: tuple[torch.Tensor, ...], d2: int, offset: int) -> None:
    """An in-place call's memory checks (:func:`~rope_dispatch.check_call`'s): ``t`` (q of a
    pair with ``k``) must not overlap itself, nor k, in the channels written (the rotary ones,
    ``d2`` from ``offset``; a normalized side's whole heads), and no norm weight (q's, k's)
    nor table tensor may share an element with them. Also run on a compiled graph's real
    tensors (:func:`~rope_dispatch.backends.written.written_apart`)."""
    entry = "apply_" if k is None else "apply_qk_"
    for name, x, weight in (("t" if k is None else "q", t, q_weight), ("k", k, k_weight)):
        if x is not None:  # the channels written: the whole head where normalized
            refuse_self_overlap(x, name, f"{entry} cannot rotate {name} in place",
                                f"use rope_dispatch.{entry[:-1]}", 0 if weight is not None
                                else offset, None if weight is not None else offset + d2)
    normed = q_weight is not None or k_weight is not None
    if k is not None and normed:
        _check_apart(t, k, t.shape[-1])
    elif k is not None:  # without a norm, the channels written are the rotary ones
        _check_apart(t, k, d2, offset)
    rot = slice(offset, offset + d2)  # a side without a norm writes only these
    remedy = f", or use rope_dispatch.{'apply' if k is None else 'apply_qk'}"
    writer = "the call rotates in place"
    q_written = t if q_weight is not None else t[..., rot]
    k_written = None if k is None else k if k_weight is not None else k[..., rot]
    if normed:  # (a side without a norm, beside one with one, writes its rotary channels)
        written = (("t", t),) if k is None else (
            ("q", t if q_weight is not None or k_weight is None else t[..., rot]),
            ("k", k if k_weight is not None or q_weight is None else k[..., rot]))
        for name, weight in (("norm" if k is None else "q_norm", q_weight),
                             ("k_norm", k_weight)):
            if weight is not None:
                _refuse_read_in(f"{name}.weight", weight, "weight", "a clone", written, writer,
                                remedy)
    for tensor in tables:  # (no k_freqs: a packed qkv call is never in place)
        _refuse_read_in("freqs", tensor, "table", "freqs.clone()",
                        (("t" if k is None else "q", q_written), ("k", k_written)),
                        writer, remedy)
