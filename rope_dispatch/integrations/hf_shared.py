"""What the patched calls of :mod:`.hf` and :mod:`.hf_llama4` share: whether a call may keep
what it made for the next layer, its version checks, a model's sequence starts, a dtype's
refusal and a module's own ``forward``. Both import it; :mod:`.hf` imports :mod:`.hf_llama4`,
which imports nothing of :mod:`.hf`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import RoPEError
from ..tracing import _dispatch_modes, memoryless

_starts: dict[tuple, torch.Tensor] = {}
"""Start positions of :func:`_sequence_starts` by (batch, sequence length, device)."""
_MAX_STARTS = 64


def _unkept() -> bool:
    """Whether nothing made for one layer may be handed to the next: tensors without memory
    (:func:`~rope_dispatch.tracing.memoryless`), or a torch dispatch mode (a selective
    activation checkpoint's records the forward's ops and hands their saved outputs back in
    order at the recomputation, which a kept table, made once in the forward, would shift)."""
    return memoryless() or _dispatch_modes() > 0


def unsupported_dtype(name: str, dtype: torch.dtype) -> RoPEError:
    """The error of a patched call on ``name`` of a dtype rope-dispatch does not compute in."""
    return RoPEError(f"{name} is {dtype}: rope-dispatch computes in float32, bfloat16 and "
                     "float16 only; hf.unpatch the model to run it in another dtype")


def _sequence_starts(cos: torch.Tensor, q: torch.Tensor, name: str = "cos",
                     width: str = "rotary_dim") -> torch.Tensor | None:
    """Where each sequence's rows begin in :func:`.hf._token_table`, as start positions: none for
    ``cos`` ``[1, s, d2]`` (a token's row is its place in its sequence), else ``[b]`` int64
    ``i * s`` (token ``(i, j)`` reads row ``i * s + j``), cached per shape and device.

    Start positions rather than a ``[b, s]`` index of each token's row: a kernel then finds
    the row from one value per sequence, which the L2 holds, instead of first reading the
    token's own index from memory. At model shapes in bf16 on the H200 the q+k launch took
    3-12% less (Phi-3 mini at 4 x 4,096 tokens 101.7 / 98.5 us forward / backward against
    113.2 / 107.8, within 3% of rows shared by the batch; run AS). ``name`` and ``width``: the
    caller's argument and its last dim, for the error (Llama 4's ``freqs_cis``)."""
    batch, seq_len = q.shape[0], q.shape[1]
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise RoPEError(
            f"{name} must be [batch, seq, {width}] with batch 1 or q's batch {batch} and q's "
            f"sequence length {seq_len}, got {tuple(cos.shape)}"
        )
    if cos.shape[0] == 1:
        return None
    if _unkept():  # made each call, out of place (a checkpoint may save arange's output)
        return torch.arange(batch, device=q.device) * seq_len
    key = (batch, seq_len, q.device)
    starts = _starts.get(key)
    if starts is None:
        if len(_starts) >= _MAX_STARTS:
            _starts.clear()
        with torch.inference_mode(False):  # a normal tensor, served in and out of inference mode
            starts = _starts[key] = torch.arange(batch, device=q.device).mul_(seq_len)
    return starts


def _traced_with_grad() -> bool:
    """Whether torch.compile traces a step that may be activation-checkpointed (grad enabled):
    there the norms run unfused (their own forward, the rotation ours), since the
    hand-over mutates ``_window``, which Dynamo refuses inside a checkpointed layer (an error
    under ``fullgraph=True``, else a graph break). Traced without grad (generation) they fuse."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, to catch an in-place write later; ``None`` while torch.compile
    traces or a ``torch.func`` transform runs, and for an inference-mode tensor (none kept)."""
    return None if memoryless() or t.is_inference() else t._version


def _own_forward(module: torch.nn.Module) -> Callable | None:
    """The instance's own ``forward`` attribute, ``None`` without one."""
    return vars(module).get("forward")
