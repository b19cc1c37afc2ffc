"""Another thread's call run between any two instructions of a function, deterministically:
the races of a cache kept between calls (a call reading it while another replaces it)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType


def interrupted_at_every_instruction(code: CodeType, prepare: Callable[[], object],
                                     call: Callable[[], object],
                                     interrupt: Callable[[], object]) -> list:
    """``(k, call())`` for each instruction ``k`` of ``call``'s first frame of ``code``: run
    ``prepare()`` then ``call()`` again and again, the ``k``-th time with ``interrupt()`` run
    just before the frame's ``k``-th instruction, as a thread switch there would (the frames
    it runs are not counted); ends once ``k`` is past the instructions the frame runs."""
    results = []
    k = 0
    while True:
        seen, fired = [0], [False]

        def before(k=k, seen=seen, fired=fired) -> None:
            if fired[0]:
                return
            if seen[0] == k:
                fired[0] = True
                interrupt()
            seen[0] += 1

        prepare()
        with _each_instruction(code, before):
            result = call()
        if not fired[0]:
            return results
        results.append((k, result))
        k += 1


@contextmanager
def _each_instruction(code: CodeType, before: Callable[[], None]) -> Iterator[None]:
    """``before()`` called before each instruction a frame of ``code`` runs: by
    ``sys.monitoring`` (Python 3.12 on, where opcode tracing of a frame called from an untraced
    one gives no events), else by opcode tracing."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        def local(frame, event, arg):
            if event == "opcode":
                before()
            return local

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code is code:
                frame.f_trace_opcodes = True
                return local
            return None

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            yield
        finally:
            sys.settrace(previous)
        return
    tool = next(i for i in range(6) if monitoring.get_tool(i) is None)
    event = monitoring.events.INSTRUCTION
    monitoring.use_tool_id(tool, "interleave")
    monitoring.register_callback(tool, event, lambda c, offset: before() if c is code else None)
    monitoring.set_local_events(tool, code, event)
    try:
        yield
    finally:
        monitoring.set_local_events(tool, code, 0)
        monitoring.register_callback(tool, event, None)
        monitoring.free_tool_id(tool)


def hammered(work: Callable[[int], object], threads: int = 4) -> None:
    """``work(i)`` in ``threads`` threads started at once, with thread switches as often as
    Python makes them; re-raises the first error a thread met."""
    start, errors = threading.Barrier(threads), []

    def run(i: int) -> None:
        start.wait()
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
