"""The eager backend: plain PyTorch, every feature, CPU and CUDA; the semantic baseline.

It favours readability over speed: positions are computed as an index tensor, the table rows
gathered, and the rotation written as the formula. Autograd supplies the backward, which is the
exact transpose (each channel's gradient uses its partner's sine).
"""

from __future__ import annotations

import torch

from rope_dispatch.call import RoPECall
from rope_dispatch.registry import Backend
from rope_dispatch.tables import table_cos_sin


def zigzag_positions(local: torch.Tensor, local_len: torch.Tensor | int, cp_size: int, cp_rank: int):
    """Global positions of local indices under TransformerEngine's context-parallel split.

    A rank holds chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of a sequence cut into
    ``2*cp_size`` chunks of ``local_len/2`` tokens each.
    """
    half = local_len // 2
    first = local + cp_rank * half
    second = local_len * cp_size - (cp_rank + 1) * half + local - half
    return torch.where(local < half, first, second)


def token_positions(call: RoPECall) -> torch.Tensor:
    """The table row of every token: ``[s, b]`` (sbhd), ``[b, s]`` (bshd) or ``[T]`` (thd)."""
    spec, device = call.spec, call.t.device
    cp, rank = spec.cp_size, spec.cp_rank
    starts = None if call.start_positions is None else call.start_positions.long()
    if spec.layout == "thd":
        cu = spec.cu_seqlens.long() // cp
        token = torch.arange(call.seq_len, device=device)
        seq = torch.searchsorted(cu[1:], token, right=True).clamp_(max=call.batch - 1)
        local = token - cu[seq]
        if cp > 1:
            return zigzag_positions(local, cu[seq + 1] - cu[seq], cp, rank)
        return local if starts is None else local + starts[seq]
    local = torch.arange(call.seq_len, device=device)
    if cp > 1:
        pos = zigzag_positions(local, call.seq_len, cp, rank)
    else:
        pos = local
    pos = pos[:, None] if spec.layout == "sbhd" else pos[None, :]
    if starts is not None:
        pos = pos + (starts[None, :] if spec.layout == "sbhd" else starts[:, None])
    return pos.expand(*call.t.shape[:-2])


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every channel with its sign: rotate-half (NeoX) or pairwise (GPT-J)."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_eager(call: RoPECall) -> torch.Tensor:
    """``out = x cos + rotate(x) sin`` on the first d2 channels in float32, the rest copied."""
    cos, sin = table_cos_sin(call.table)
    pos = token_positions(call)
    cos, sin = cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)
    t, d2 = call.t, call.rotary_dim
    x = t[..., :d2].float()
    rotated = (x * cos + rotate(x, call.spec.interleaved) * sin).to(t.dtype)
    if d2 == call.head_dim:
        return rotated.contiguous()
    return torch.cat((rotated, t[..., d2:]), dim=-1)


class EagerBackend(Backend):
    """Plain PyTorch: always available, every feature; slow but obviously right."""

    name = "eager"
    description = "plain PyTorch ops (reference semantics, CPU and CUDA)"
    priority = 0

    def apply(self, call: RoPECall) -> torch.Tensor:
        return rope_eager(call)
