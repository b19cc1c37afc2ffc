"""An in-place or cache call's memory checks on a compiled graph's real tensors.

While ``torch.compile`` traces, a call's tensors are fake: the checks that refuse an in-place
call whose memory overlaps (q and k sharing elements, a norm weight or a table inside what is
written, a view overlapping itself) read addresses, so :func:`~rope_dispatch.check_call` skips
them there. The graph runs them instead: :func:`written_apart` puts the custom op
``rope_dispatch::written_apart`` in it, whose implementation runs the same checks
(:func:`~rope_dispatch.overlap.refuse_written_overlaps`) on the tensors the graph passes at
run time and returns ``-0.0``, which the call's write-back adds (exactly: ``x + -0.0`` is
``x``, signed zeros and NaN included), so no compiler drops the op as unused. A
:func:`~rope_dispatch.rope_to_cache` call's checks (q, k, v, q's output, the norm weights
and the table apart from the caches and q's output) run so, by :func:`cache_apart`, and
an output-taking door's (its outputs apart from themselves and from what it reads and writes,
e.g. FlashInfer's FP8 prologue) by :func:`outs_apart`. The triton backend's traced call runs
them in its own op (:func:`refuse_written_once`), with no second op to dispatch. A verdict is
kept by the tensors' addresses and layouts, which alone decide it, so a graph run again on the
same memory (a decode or training step) checks once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rope_dispatch.errors import RoPEError
from rope_dispatch.kv_cache import refuse_cache_overlaps, refuse_caches_overlap
from rope_dispatch.overlap import refuse_self_overlap, refuse_written_overlaps
from rope_dispatch.table_kinds import table_tensors
from rope_dispatch.tracing import exact_size, transformed


_verdicts: set[tuple] = set()  # the forms of the calls found apart


def _form(x: torch.Tensor | None) -> tuple | None:
    """What of ``x`` an overlap verdict depends on."""
    return None if x is None else (x.data_ptr(), x.shape, x.stride(), x.dtype)


def _kept(key: tuple) -> bool:
    """Whether ``key``'s call was found apart before (the caller then keeps it once its
    checks pass)."""
    if key in _verdicts:
        return True
    if len(_verdicts) >= 4096:
        _verdicts.clear()
    return False


def refuse_written_once(t: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, tables: Sequence[torch.Tensor], d2: int,
                        offset: int) -> None:
    """:func:`~rope_dispatch.overlap.refuse_written_overlaps`, once per form of the memory."""
    key = (_form(t), _form(k), _form(q_weight), _form(k_weight), *map(_form, tables), d2, offset)
    if not _kept(key):
        refuse_written_overlaps(t, k, q_weight, k_weight, tuple(tables), d2, offset)
        _verdicts.add(key)


library = torch.library.Library("rope_dispatch", "FRAGMENT")  # the backends' own ops


def _first(args: tuple) -> torch.Tensor:
    """A check op's first tensor (its first argument, or that list's first), whose device the
    op's result takes."""
    return args[0][0] if isinstance(args[0], (list, tuple)) else args[0]


def _check_op(name: str, schema: str,
              filled: bool = True) -> Callable[[Callable[..., None]], Any]:
    """``check`` (which refuses, by raising) as the op ``rope_dispatch::<name><schema> ->
    Tensor``, which runs it on a graph's real tensors and returns a float32 ``-0.0`` (not
    ``filled``: a scalar never written, for an op that takes it only to run after the checks;
    no fill kernel in a CUDA graph's replays). Defined on the dispatcher directly, not by
    ``custom_op``, whose autograd wrapper it does not need (its tensors come detached): a call
    costs 5 us against 13 (development CPU)."""
    def define(check: Callable[..., None]) -> Any:
        if not hasattr(torch.ops.rope_dispatch, name):  # (the module imported under two names)
            library.define(name + schema + " -> Tensor")

            def run(*args: Any) -> torch.Tensor:
                check(*args)
                if not filled:
                    return _first(args).new_empty((), dtype=torch.float32)
                return torch.full((), -0.0, dtype=torch.float32, device=_first(args).device)

            library.impl(name, run, "CompositeExplicitAutograd")
            torch.library.register_fake(
                f"rope_dispatch::{name}",
                lambda *args: _first(args).new_empty((), dtype=torch.float32), lib=library)
        return getattr(torch.ops.rope_dispatch, name).default

    return define


class _DoorWords:
    """What a door (a compat function) sets around its call of the core: :attr:`words`."""

    words: tuple[str, str, str] | None = None
    """For the in-graph checks to word a refusal as its eager checks do: ``(words, refusal,
    outs)``, ``words`` added to the core's refusal (how the door mapped its arguments),
    ``outs`` the door's names of q's output and the caches where they are its own outputs
    (``"q_name,k_name,v_name"``, an empty name where not), each refused as ``"{refusal}
    {name}"`` when it overlaps itself. ``None``: the core called directly."""


class _Door(threading.local):
    """One :class:`_DoorWords` per thread, :attr:`state`: a compiled region's guard reads it
    (another thread's door must not make it recompile). A plain object, as Dynamo replays a
    traced door's writes on it where it reads them: written to a thread-local itself, they
    landed where the guards did not look, and every compiled in-place call after a traced door
    failed its own guards."""

    def __init__(self) -> None:
        self.state = _DoorWords()


door = _Door()


def door_words() -> str:
    """What the calling door adds to a refusal (:attr:`_DoorWords.words`' first); "" where the
    core was called directly."""
    words = door.state.words
    return words[0] if words else ""


@contextmanager
def worded(words: str) -> Iterator[None]:
    """A refusal raised inside, with a door's ``words`` (how it mapped its arguments) added."""
    try:
        yield
    except RoPEError as error:
        if not words:
            raise
        raise type(error)(f"{error} {words}") from error


def _refuse_written(t, k, q_weight, k_weight, tables, d2, offset, words) -> None:
    """Refuse what :func:`~rope_dispatch.overlap.refuse_written_overlaps` refuses, ``words``
    (a door's, :data:`door`) added to the refusal."""
    with worded(words):
        refuse_written_once(t, k, q_weight, k_weight, tables, d2, offset)


_WRITTEN_SCHEMA = ("(Tensor t, Tensor? k, Tensor? q_weight, Tensor? k_weight, Tensor[] tables, "
                   "SymInt d2, SymInt offset, str words)")
written_apart_op = _check_op("written_apart", _WRITTEN_SCHEMA)(_refuse_written)
written_apart_first_op = _check_op("written_apart_first", _WRITTEN_SCHEMA, filled=False)(
    _refuse_written)


def written_apart(call: Any, filled: bool = True) -> torch.Tensor | None:
    """While ``torch.compile`` traces an in-place call: the op's ``-0.0``, for the call's
    write-back to add (every tensor the call writes, so each depends on the checks), or (not
    ``filled``) a scalar never written, for an op that writes in place to take; else ``None``
    (eager calls were checked by :func:`~rope_dispatch.check_call`)."""
    if not call.in_place or not torch.compiler.is_compiling() or transformed():
        return None
    weights = tuple(None if n is None else n.weight.detach() for n in (call.norm, call.k_norm))
    return (written_apart_op if filled else written_apart_first_op)(
        call.t.detach(), None if call.k is None else call.k.detach(), *weights,
        [x.detach() for x in table_tensors(call.table)], exact_size(call.rotary_dim),
        exact_size(call.spec.rotary_offset), door_words())


@_check_op("cache_apart", "(Tensor q, Tensor k, Tensor v, Tensor? q_out, Tensor k_cache, "
           "Tensor v_cache, Tensor? q_weight, Tensor? k_weight, Tensor[] tables, str kind, "
           "str words, str refusal, str outs)")
def cache_apart_op(q, k, v, q_out, k_cache, v_cache, q_weight, k_weight, tables, kind, words,
                   refusal, outs) -> None:
    """Refuse what :func:`~rope_dispatch.kv_cache.refuse_cache_overlaps` refuses, a q_out that
    overlaps itself, and caches that overlap (the descriptor's checks, skipped where it is made
    while tracing); worded as the door's eager checks (:data:`door`) where a door called."""
    key = (kind, *map(_form, (q, k, v, q_out, k_cache, v_cache, q_weight, k_weight, *tables)))
    if _kept(key):
        return
    if outs:  # the door's own outputs: its own check first, as eagerly
        for name, x in zip(outs.split(","), (q_out, k_cache, v_cache)):
            if name and x is not None:
                refuse_self_overlap(x, name, f"{refusal} {name}",
                                    f"give {name} memory of its own")
    with worded(words):
        if q_out is not None:  # (_check_q_out's, skipped while traced)
            refuse_self_overlap(q_out, "q_out", "rope_to_cache cannot write q's output",
                                "give q_out memory of its own")
        refuse_caches_overlap(k_cache, v_cache, (f"{kind} k_cache", f"{kind} v_cache"))
        refuse_cache_overlaps(kind, k_cache, v_cache, q, k, v, q_out, q_weight, k_weight,
                              tuple(tables))
    _verdicts.add(key)


def cache_apart(call: Any) -> torch.Tensor | None:
    """While ``torch.compile`` traces a :func:`~rope_dispatch.rope_to_cache` call: the op's
    ``-0.0``, for what the call writes (k, v and q's output) to add; else ``None``."""
    if not torch.compiler.is_compiling() or transformed():
        return None
    write = call.cache_write
    cache, q_out = write.cache, write.q_out
    weights = tuple(None if n is None else n.weight.detach() for n in (call.norm, call.k_norm))
    return cache_apart_op(
        call.t.detach(), call.k.detach(), write.v.detach(),
        None if q_out is None else q_out.detach(), cache.k_cache.detach(),
        cache.v_cache.detach(), *weights, [x.detach() for x in table_tensors(call.table)],
        type(cache).__name__, *(door.state.words or ("", "", "")))


@_check_op("outs_apart", "(Tensor[] tensors, str names, str refusal, SymInt selves, "
           "SymInt[] pairs)")
def outs_apart_op(tensors, names, refusal, selves, pairs) -> None:
    """A door's output checks: the first ``selves`` of ``tensors`` (``names``, joined by commas)
    must not overlap themselves (``refusal``: who cannot write them), and each ``(i, j)`` of
    ``pairs`` (flat) names ``tensors[i]``, written apart, that must share no element with
    ``tensors[j]``."""
    key = (names, refusal, selves, *pairs, *map(_form, tensors))
    if not _kept(key):
        from rope_dispatch.overlap import refuse_shared

        names = names.split(",")
        for name, x in zip(names[:selves], tensors):
            refuse_self_overlap(x, name, f"{refusal} {name}", f"give {name} memory of its own")
        for i, j in zip(pairs[::2], pairs[1::2]):  # (one tensor given twice: not "apart")
            if _form(tensors[i]) != _form(tensors[j]):
                refuse_shared(names[i], tensors[i], names[j], tensors[j])
        _verdicts.add(key)


def outs_apart(named: Sequence[tuple[str, torch.Tensor | None]], refusal: str, selves: int,
               pairs: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """While ``torch.compile`` traces a door that writes given outputs: :func:`outs_apart_op`'s
    ``-0.0`` (on ``named``'s tensors, a ``None`` left out with its pairs) for each write the door
    makes itself to add; else ``None`` (eagerly the door checked them)."""
    if not torch.compiler.is_compiling() or transformed():
        return None
    index = {i: n for n, i in enumerate(i for i, (_, x) in enumerate(named) if x is not None)}
    kept = [(name, x.detach()) for name, x in named if x is not None]
    flat = [index[k] for i, j in pairs if i in index and j in index for k in (i, j)]
    return outs_apart_op([x for _, x in kept], ",".join(name for name, _ in kept), refusal,
                         sum(1 for i in range(selves) if i in index), flat)


def add_written(out: torch.Tensor, apart: torch.Tensor | None) -> torch.Tensor:
    """``out`` to write back, depending on :func:`written_apart`'s ``apart`` where given."""
    if apart is None:
        return out
    if out.dtype.itemsize == 1 and out.dtype.is_floating_point:  # FP8: + 0 to its bytes
        return (out.view(torch.uint8) + apart.to(torch.uint8)).view(out.dtype)
    return out + apart
