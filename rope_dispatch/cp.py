"""Context-parallel helpers: cut full batches into TransformerEngine's zigzag order and put the
ranks' results back together.

Under context parallelism (TransformerEngine, Megatron-LM) each sequence of global length ``L``
is cut into ``2 * cp_size`` chunks of ``L / (2 * cp_size)`` tokens, and rank ``r`` holds chunks
``r`` and ``2 * cp_size - 1 - r``, in that order. That is the order in which
:func:`rope_dispatch.apply` with ``RoPESpec(cp_size=..., cp_rank=...)`` expects a rank's tokens.

The sequence dimension is 0 for ``sbhd``, 1 for ``bshd`` and 0 for ``thd`` (packed sequences,
``[T, ...]``). For ``thd``, ``cu_seqlens`` are the *global padded* offsets ``[0, end_0, ...,
total]`` of the full tensor, every sequence length a multiple of ``2 * cp_size``
(:func:`pad_cu_seqlens`); a rank holds the two chunks of sequence ``k`` at local tokens
``cu[k] / cp_size .. cu[k + 1] / cp_size``. Only the sequence dimension is indexed, so the same
calls shard inputs, labels, position ids and gradients. See docs/context-parallel.md.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .errors import RoPEError
from .spec import check_cu_seqlens_tensor

__all__ = ["gather", "pad_cu_seqlens", "shard", "unshard", "zigzag_index"]

_SEQ_DIM = {"sbhd": 0, "bshd": 1, "thd": 0}


def _integer(value: object) -> object:
    """``value`` as a Python int where it is a NumPy (or other ``numbers.Integral``) integer,
    as RoPESpec takes sizes; anything else (bools too) as it is, for the checks to refuse."""
    if isinstance(value, (bool, int)) or not isinstance(value, numbers.Integral):
        return value
    return int(value)


def _check_cp(cp_size: object, cp_rank: object = 0) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise RoPEError(f"cp_size must be an integer >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise RoPEError(
            f"cp_rank must be an integer with 0 <= cp_rank < cp_size={cp_size}, got {cp_rank!r}"
        )


def _seq_dim(layout: object, cu_seqlens: object) -> int:
    if not isinstance(layout, str) or layout not in _SEQ_DIM:  # (a list is unhashable)
        raise RoPEError(f"layout must be one of {list(_SEQ_DIM)}, got {layout!r}")
    if layout == "thd" and cu_seqlens is None:
        raise RoPEError(
            "layout 'thd' needs cu_seqlens (the global padded offsets [0, end_0, ..., total])"
        )
    if layout != "thd" and cu_seqlens is not None:
        raise RoPEError(f"cu_seqlens is only for layout 'thd', got it with layout {layout!r}")
    return _SEQ_DIM[layout]


def _check_tensor(x: object, name: str, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise RoPEError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dim = _SEQ_DIM[layout]
    if x.dim() <= dim:
        raise RoPEError(
            f"{name} must have at least {dim + 1} dims for layout {layout!r} (sequence dim {dim}), "
            f"got shape {tuple(x.shape)}"
        )
    return x


def _offsets(cu_seqlens: torch.Tensor, cp_size: int) -> list[int]:
    """The values of ``cu_seqlens`` (read on the host), checked as global padded offsets."""
    check_cu_seqlens_tensor(cu_seqlens)
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise RoPEError(f"cu_seqlens must start at 0, got cu_seqlens[0]={offsets[0]}")
    for k, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b < a:
            raise RoPEError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{k + 1}]={b} < "
                f"cu_seqlens[{k}]={a}"
            )
        if cp_size > 1 and (b - a) % (2 * cp_size):
            raise RoPEError(
                f"cu_seqlens: sequence {k} has length {b - a}, not divisible by 2*cp_size="
                f"{2 * cp_size}; pad every sequence (rope_dispatch.cp.pad_cu_seqlens)"
            )
    return offsets


def _rank_positions(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global indices of rank ``cp_rank``'s tokens of one sequence of ``length`` (unchecked)."""
    if cp_size == 1:
        return torch.arange(length, device=device)
    chunk = length // (2 * cp_size)
    second = 2 * cp_size - 1 - cp_rank
    return torch.cat((
        torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
        torch.arange(second * chunk, (second + 1) * chunk, device=device),
    ))


def _thd_index(offsets: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices (on the CPU) of rank ``cp_rank``'s local tokens of a packed batch."""
    if cp_size == 1:
        return torch.arange(offsets[-1])
    cu = torch.tensor(offsets, dtype=torch.int64)
    local_len = (cu[1:] - cu[:-1]) // cp_size
    seq = torch.repeat_interleave(torch.arange(local_len.numel()), local_len)
    i = torch.arange(seq.numel()) - (cu[:-1] // cp_size)[seq]  # index within the local sequence
    chunk = (local_len // 2)[seq]
    second = 2 * cp_size - 1 - cp_rank
    within = torch.where(i < chunk, cp_rank * chunk + i, second * chunk + i - chunk)
    return cu[:-1][seq] + within


def zigzag_index(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 global indices (``0 .. seq_len-1``) of the tokens rank ``cp_rank`` holds, in local
    order: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``. ``seq_len`` must be
    divisible by ``2*cp_size`` (any length when ``cp_size == 1``: the identity)."""
    seq_len, cp_size, cp_rank = _integer(seq_len), _integer(cp_size), _integer(cp_rank)
    _check_cp(cp_size, cp_rank)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise RoPEError(f"seq_len must be an integer >= 0, got {seq_len!r}")
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise RoPEError(
            f"seq_len={seq_len} must be divisible by 2*cp_size={2 * cp_size} (two chunks per rank)"
        )
    return _rank_positions(seq_len, cp_size, cp_rank, device)


def pad_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Offsets with every sequence length rounded up to a multiple of ``2*cp_size`` (what
    TransformerEngine calls ``cu_seqlens_padded``), same dtype and device.

    Computed with tensor ops (no host sync); the values are checked (start at 0,
    non-decreasing) only when ``cu_seqlens`` is on the CPU.
    """
    check_cu_seqlens_tensor(cu_seqlens)
    cp_size = _integer(cp_size)
    _check_cp(cp_size)
    if cu_seqlens.device.type == "cpu":
        _offsets(cu_seqlens, 1)
    multiple = 2 * cp_size
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    padded = torch.zeros_like(cu_seqlens)
    padded[1:] = ((lengths + multiple - 1) // multiple * multiple).cumsum(0)
    return padded


def shard(
    x: torch.Tensor, layout: str, cp_size: int, cp_rank: int, *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The part of the full tensor ``x`` that rank ``cp_rank`` holds, in local order.

    Only the sequence dimension is indexed (``index_select``, so it is differentiable), and any
    trailing dims are kept. ``sbhd``/``bshd`` build the index on ``x``'s device and make no host
    sync. ``thd`` needs ``cu_seqlens``, the global padded offsets of ``x``, and reads them on the
    host (one small copy when they live on a GPU): a data-loader step.
    """
    dim = _seq_dim(layout, cu_seqlens)
    cp_size, cp_rank = _integer(cp_size), _integer(cp_rank)
    _check_cp(cp_size, cp_rank)
    x = _check_tensor(x, "x", layout)
    if layout == "thd":
        offsets = _offsets(cu_seqlens, cp_size)  # type: ignore[arg-type]
        if x.shape[0] != offsets[-1]:
            raise RoPEError(
                f"x has {x.shape[0]} tokens (dim 0) but cu_seqlens[-1]={offsets[-1]}; expected "
                "equal (cu_seqlens are the global padded offsets of the full tensor)"
            )
        index = _thd_index(offsets, cp_size, cp_rank).to(x.device)
    else:
        seq_len = x.shape[dim]
        if cp_size > 1 and seq_len % (2 * cp_size):
            raise RoPEError(
                f"x has sequence length {seq_len} (dim {dim} of shape {tuple(x.shape)}), not "
                f"divisible by 2*cp_size={2 * cp_size}"
            )
        index = _rank_positions(seq_len, cp_size, cp_rank, x.device)
    return x.index_select(dim, index)


def unshard(
    parts: Sequence[torch.Tensor], layout: str, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """The full tensor from every rank's local part, ``parts[r]`` from rank ``r``
    (``cp_size = len(parts)``): the inverse of :func:`shard`, differentiable too.

    ``thd`` reads ``cu_seqlens`` (global padded offsets) on the host, as :func:`shard` does.
    """
    dim = _seq_dim(layout, cu_seqlens)
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) or not parts:
        got = "an empty sequence" if isinstance(parts, Sequence) else type(parts).__name__
        raise RoPEError(
            f"parts must be a non-empty sequence of tensors, one per rank in rank order, got {got}"
        )
    first = _check_tensor(parts[0], "parts[0]", layout)
    for r, part in enumerate(parts):
        _check_tensor(part, f"parts[{r}]", layout)
        if part.shape != first.shape or part.dtype != first.dtype or part.device != first.device:
            raise RoPEError(
                f"parts[{r}] is {tuple(part.shape)} {part.dtype} on {part.device} but parts[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; every rank's part must "
                "match"
            )
    cp_size = len(parts)
    local = first.shape[dim]
    if layout == "thd":
        offsets = _offsets(cu_seqlens, cp_size)  # type: ignore[arg-type]
        if local * cp_size != offsets[-1]:
            raise RoPEError(
                f"parts hold {local} tokens each (dim 0), {local * cp_size} for cp_size={cp_size}, "
                f"but cu_seqlens[-1]={offsets[-1]}; expected equal"
            )
        index = torch.cat([_thd_index(offsets, cp_size, r) for r in range(cp_size)])
        index = index.to(first.device)
    else:
        if cp_size > 1 and local % 2:
            raise RoPEError(
                f"parts have local sequence length {local} (dim {dim}), expected an even length "
                f"(two chunks per rank) with cp_size={cp_size}"
            )
        index = torch.cat([
            _rank_positions(local * cp_size, cp_size, r, first.device) for r in range(cp_size)
        ])
    # torch.cat(parts) holds global token index[j] at position j; argsort inverts that.
    return torch.cat(list(parts), dim).index_select(dim, index.argsort())


def gather(
    local: torch.Tensor, layout: str, *, group=None, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """The full tensor on every rank: ``torch.distributed.all_gather`` of each rank's ``local``
    part over ``group`` (default: the world), then :func:`unshard`. Group rank ``r`` must hold
    ``cp_rank = r``. Not differentiable (the result has no autograd history); meant for checks,
    logging and evaluation.
    """
    import torch.distributed as dist

    _seq_dim(layout, cu_seqlens)
    if not isinstance(local, torch.Tensor):
        raise RoPEError(f"local must be a torch.Tensor, got {type(local).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RoPEError(
            "gather needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return unshard(parts, layout, cu_seqlens=cu_seqlens)
