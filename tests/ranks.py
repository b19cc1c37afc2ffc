"""Run a test's worker on several spawned ranks and wait for them, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp


def join_ranks(worker: Callable[..., None], world: int, args: tuple, what: str,
               deadline_s: float) -> None:
    """``worker(rank, *args)`` on ``world`` spawned processes; a rank's failure raises here,
    naming it, and a job still running after ``deadline_s`` is killed and fails the test
    (``what`` names the job in that message)."""
    context = mp.spawn(worker, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):  # raises when a rank failed, naming it
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{what} with {world} ranks still running after {deadline_s} s")
