"""An in-place call's memory checks on a compiled graph's real tensors.

While ``torch.compile`` traces, a call's tensors are fake: the checks that refuse an in-place
call whose memory overlaps (q and k sharing elements, a norm weight or a table inside what is
written, a view overlapping itself) read addresses, so :func:`~rope_dispatch.check_call` skips
them there. The graph runs them instead: :func:`written_apart` puts the custom op
``rope_dispatch::written_apart`` in it, whose implementation runs the same checks
(:func:`~rope_dispatch.overlap.refuse_written_overlaps`) on the tensors the graph passes at
run time and returns ``-0.0``, which the call's write-back adds (exactly: ``x + -0.0`` is
``x``, signed zeros and NaN included), so no compiler drops the op as unused.
"""

from __future__ import annotations

from typing import Any

import torch

from rope_dispatch.overlap import refuse_written_overlaps
from rope_dispatch.table_kinds import table_tensors
from rope_dispatch.tracing import exact_size, transformed


@torch.library.custom_op("rope_dispatch::written_apart", mutates_args=())
def written_apart_op(
    t: torch.Tensor, k: torch.Tensor | None, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, tables: list[torch.Tensor], d2: int, offset: int,
) -> torch.Tensor:
    """Refuse what :func:`~rope_dispatch.overlap.refuse_written_overlaps` refuses; else a
    float32 ``-0.0`` on ``t``'s device."""
    refuse_written_overlaps(t, k, q_weight, k_weight, tuple(tables), d2, offset)
    return torch.full((), -0.0, dtype=torch.float32, device=t.device)


@written_apart_op.register_fake
def _written_apart_fake(t, k, q_weight, k_weight, tables, d2, offset):
    return t.new_empty((), dtype=torch.float32)


def written_apart(call: Any) -> torch.Tensor | None:
    """While ``torch.compile`` traces an in-place call: the op's ``-0.0``, for the call's
    write-back to add (every tensor the call writes, so each depends on the checks); else
    ``None`` (eager calls were checked by :func:`~rope_dispatch.check_call`)."""
    if not call.in_place or not torch.compiler.is_compiling() or transformed():
        return None
    weights = tuple(None if n is None else n.weight.detach() for n in (call.norm, call.k_norm))
    return written_apart_op(
        call.t.detach(), None if call.k is None else call.k.detach(), *weights,
        [x.detach() for x in table_tensors(call.table)], exact_size(call.rotary_dim),
        exact_size(call.spec.rotary_offset))


def add_written(out: torch.Tensor, apart: torch.Tensor | None) -> torch.Tensor:
    """``out`` to write back, depending on :func:`written_apart`'s ``apart`` where given."""
    return out if apart is None else out + apart
