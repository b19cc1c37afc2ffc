"""Another thread's call run between any two instructions of a function, deterministically:
the races of a cache kept between calls (a call reading it while another replaces it)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import CodeType


def interrupted_at_every_instruction(code: CodeType, prepare: Callable[[], object],
                                     call: Callable[[], object],
                                     interrupt: Callable[[], object]) -> list:
    """``(k, call())`` for each instruction ``k`` of ``call``'s first frame of ``code``: run
    ``prepare()`` then ``call()`` again and again, the ``k``-th time with ``interrupt()`` run
    (untraced) just before the frame's ``k``-th instruction, as a thread switch there would;
    ends once ``k`` is past the instructions the frame runs."""
    results = []
    k = 0
    while True:
        seen, fired = [0], [False]

        def local(frame, event, arg, k=k, seen=seen, fired=fired):
            if event == "opcode":
                if seen[0] == k and not fired[0]:
                    fired[0] = True
                    interrupt()
                seen[0] += 1
            return local

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code is code and not fired[0] and seen[0] == 0:
                frame.f_trace_opcodes = True
                return local
            return None

        prepare()
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            result = call()
        finally:
            sys.settrace(previous)
        if not fired[0]:
            return results
        results.append((k, result))
        k += 1


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
