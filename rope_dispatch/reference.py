"""A float64 reference shipped with the package, so ``selftest`` can check backends anywhere.

Written from the formula in docs/semantics.md, independently of the backends: positions from
the chunk definition of context parallelism, the rotation from an explicit partner index and
sign per channel. The test suite checks it against its own loop-based reference.
"""

from __future__ import annotations

import torch

from .call import RoPECall
from .tables import CosSinCache, PairCosSinCache, RateTable


def reference_positions(call: RoPECall) -> torch.Tensor:
    """int64 table row of every token, shaped like ``t.shape[:-2]`` (on the CPU)."""
    if call.positions is not None:  # given per token
        return call.positions.cpu().long()
    spec = call.spec
    cp, rank = spec.cp_size, spec.cp_rank

    def global_pos(i: torch.Tensor, local_len: torch.Tensor) -> torch.Tensor:
        if cp == 1:
            return i
        chunk = local_len // 2
        second = i >= chunk
        held = torch.where(second, 2 * cp - 1 - rank, rank)
        return held * chunk + torch.where(second, i - chunk, i)

    starts = None if call.start_positions is None else call.start_positions.cpu().long()
    if spec.layout == "thd":
        lengths = (spec.cu_seqlens.cpu().long() // cp).diff()
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        first = torch.cumsum(lengths, 0) - lengths
        i = torch.arange(int(lengths.sum())) - first[seq]
        pos = global_pos(i, lengths[seq])
        return pos if starts is None else pos + starts[seq]
    s = call.seq_len
    pos = global_pos(torch.arange(s), torch.tensor(s))[:, None].expand(s, call.batch)
    if starts is not None:
        pos = pos + starts[None, :]
    return pos if spec.layout == "sbhd" else pos.t()


def reference_cos_sin(call: RoPECall) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos and sin ``[s2, d2]``, one per channel (from the angles, or a cache's float32
    values: a pair cache's pair value for both channels of the pair; a rate table's angles are
    the float32 products ``position * rate`` (a precise one's the float64 products), the pair's
    for both of its channels), times the
    spec's ``cos_sin_scale``."""
    scale = call.spec.cos_sin_scale
    if isinstance(call.table, CosSinCache):
        cos, sin = call.table.cos.double().cpu(), call.table.sin.double().cpu()
    elif isinstance(call.table, PairCosSinCache):
        half = call.rotary_dim // 2
        cache = call.table.table.double().cpu()
        pair = torch.arange(call.rotary_dim)
        pair = pair // 2 if call.spec.interleaved else pair % half
        cos, sin = cache[:, pair], cache[:, half + pair]
    elif isinstance(call.table, RateTable):
        rates = call.table.inv_freq.cpu()
        if call.table.precise:  # the exact products, in float64
            products = torch.arange(call.table.rows, dtype=torch.float64)[:, None] * rates.double()
        else:
            products = torch.arange(call.table.rows, dtype=torch.float32)[:, None] * rates[None, :]
        pair = torch.arange(call.rotary_dim)
        pair = pair // 2 if call.spec.interleaved else pair % (call.rotary_dim // 2)
        angles = products.double()[:, pair]
        cos, sin = torch.cos(angles), torch.sin(angles)
    else:
        angles = call.table.double().cpu()
        cos, sin = torch.cos(angles), torch.sin(angles)
    return cos * scale, sin * scale


def reference_apply(call: RoPECall, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """float64 RoPE of ``x`` (``call.t``'s values, any float dtype), computed on ``x``'s device
    (positions and table rows are gathered on the CPU); differentiable. For a packed qkv call,
    ``(q, k, v)``: q's heads rotated by ``call.table``, k's by ``call.k_table``, v copied; for
    a q and k pair, ``(q, k)`` (``x`` is q's values, k's are ``call.k``'s). An inverse spec
    turns by minus the angle: the transpose of the rotation."""
    if call.k is not None:  # a q and k pair: each at the same positions
        single = dict(tensors="t", k=None, k_norm=None)
        return (
            reference_apply(call._replace(**single), x),
            reference_apply(call._replace(t=call.k, heads=call.k.shape[-2], norm=call.k_norm,
                                          **single), call.k),
        )
    if call.split is not None:
        q_len, d, _ = call.split
        q = x[..., :q_len].unflatten(-1, (q_len // d, d)).flatten(-3, -2)
        k, v = x[..., q_len : q_len + d], x[..., q_len + d :]
        k_table = call.table if call.k_table is None else call.k_table
        single = dict(split=None, k_table=None, heads=q.shape[-2], head_dim=d, k_norm=None)
        return (
            reference_apply(call._replace(**single), q),
            reference_apply(call._replace(table=k_table, norm=call.k_norm, **single), k),
            v.double(),
        )
    d2 = call.rotary_dim
    cos, sin = reference_cos_sin(call)
    pos = reference_positions(call)
    cos, sin = cos[pos].unsqueeze(-2).to(x.device), sin[pos].unsqueeze(-2).to(x.device)
    i = torch.arange(d2, device=x.device)
    if call.spec.interleaved:
        partner, sign = i ^ 1, torch.where(i % 2 == 0, -1.0, 1.0)
    else:
        half = d2 // 2
        partner, sign = (i + half) % d2, torch.where(i < half, -1.0, 1.0)
    x = x.double()
    if call.norm is not None:
        x = reference_norm(x, call.norm.weight, call.norm.eps, call.norm.offset, call.norm.scope)
    start, spec = call.spec.rotary_offset, call.spec
    head = x[..., start:start + d2]
    # deinterleave: place j of the halves layout holds pair j's first member 2j (j < d2/2), or
    # pair (j - d2/2)'s second member
    halves = torch.where(i < d2 // 2, 2 * i, 2 * (i - d2 // 2) + 1)
    if spec.deinterleave and not spec.inverse:
        head = head[..., halves]
    if spec.inverse:  # the transpose: each channel meets its partner's sine, sign flipped
        out = head * cos - sign.double() * head[..., partner] * sin[..., partner]
    else:
        out = head * cos + sign.double() * head[..., partner] * sin
    if spec.deinterleave and spec.inverse:  # written back to the pairs
        out = out[..., torch.argsort(halves)]
    return torch.cat((x[..., :start], out, x[..., start + d2:]), dim=-1)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                   scope: str) -> torch.Tensor:
    """float64 ``x / sqrt(mean(x**2) + eps) * (offset + weight)`` over each head's channels
    (``scope="head"``) or a token's heads together (``"heads"``, ``weight`` ``[heads * d]``)."""
    x = x.double()
    group = x.flatten(-2) if scope == "heads" else x
    mean_square = (group * group).sum(-1, keepdim=True) / group.shape[-1]
    y = group / torch.sqrt(mean_square + eps) * (offset + weight.double().to(x.device))
    return y.reshape(x.shape)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise ``|a - e| / (1 + |e|)`` (unit-scale data); ``inf`` for a non-finite
    output, so NaN never passes."""
    a, e = actual.detach().double(), expected.detach().to(actual.device, torch.float64)
    if not torch.isfinite(a).all():
        return float("inf")
    return float(((a - e).abs() / (1 + e.abs())).max()) if a.numel() else 0.0
