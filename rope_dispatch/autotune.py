"""Choosing among several capable backends. Placeholder: priority order until measurement lands."""

from __future__ import annotations

from .call import RoPECall
from .registry import Backend


def select(call: RoPECall, candidates: list[Backend]) -> tuple[Backend, str]:
    """The backend to run among ``candidates`` (highest priority first), and why."""
    return candidates[0], f"highest priority among {', '.join(b.name for b in candidates)}"


def peek(call: RoPECall, candidates: list[Backend]) -> tuple[Backend, str]:
    """What :func:`select` would choose, without measuring anything."""
    return select(call, candidates)


def decision_is_final(why: str) -> bool:
    """Whether a decision may be cached in memory for the rest of the process."""
    return True
