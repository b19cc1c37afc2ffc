"""An independent float64 reference for RoPE, written from the formula (docs/semantics.md).

It shares no code with the package: positions come from plain Python loops over the definition
of each layout and of the context-parallel chunking, and the rotation from an explicit partner
index and sign per channel. Its backward is float64 autograd through the same formula.
"""

from __future__ import annotations

import torch

# Elementwise tolerances for unit-scale inputs: the dtype's output rounding plus float32 math.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def global_position(i: int, local_len: int, cp_size: int, cp_rank: int) -> int:
    """Position of local index ``i`` when a sequence of ``local_len * cp_size`` tokens is cut
    into ``2 * cp_size`` equal chunks and a rank holds chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank``, in that order."""
    if cp_size == 1:
        return i
    chunk = local_len // 2
    held = (cp_rank, 2 * cp_size - 1 - cp_rank)
    return held[i // chunk] * chunk + i % chunk


def reference_positions(
    layout: str, shape: tuple[int, ...], *, cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
    start_positions=None,
) -> torch.Tensor:
    """Table row of each token, shaped like ``t.shape[:-2]``."""
    starts = None if start_positions is None else [int(v) for v in start_positions]
    if layout == "thd":
        cu = [int(v) // cp_size for v in cu_seqlens]
        pos = [0] * shape[0]
        for seq, (a, b) in enumerate(zip(cu, cu[1:])):
            for i in range(b - a):
                p = global_position(i, b - a, cp_size, cp_rank)
                pos[a + i] = p + (starts[seq] if starts else 0)
        return torch.tensor(pos, dtype=torch.long)
    s, b = (shape[0], shape[1]) if layout == "sbhd" else (shape[1], shape[0])
    grid = [[0] * b for _ in range(s)]
    for i in range(s):
        for j in range(b):
            grid[i][j] = global_position(i, s, cp_size, cp_rank) + (starts[j] if starts else 0)
    pos = torch.tensor(grid, dtype=torch.long)
    return pos if layout == "sbhd" else pos.t().contiguous()


def partners(d2: int, interleaved: bool) -> tuple[list[int], list[float]]:
    """For each rotated channel, the channel it pairs with and that channel's sign."""
    idx, sign = [], []
    for i in range(d2):
        if interleaved:
            idx.append(i + 1 if i % 2 == 0 else i - 1)
            sign.append(-1.0 if i % 2 == 0 else 1.0)
        else:
            half = d2 // 2
            idx.append(i + half if i < half else i - half)
            sign.append(-1.0 if i < half else 1.0)
    return idx, sign


def halves_order(d2: int) -> list[int]:
    """For deinterleaving: the rotary channel read into place ``j`` of the halves layout, pair
    ``k``'s first member ``2k`` into ``k`` and its second ``2k + 1`` into ``k + d2/2``."""
    order = []
    for j in range(d2):
        if j < d2 // 2:
            order.append(2 * j)
        else:
            order.append(2 * (j - d2 // 2) + 1)
    return order


def reference_rope(
    t: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor, interleaved: bool,
    scale: float = 1.0, inverse: bool = False, offset: int = 0, deinterleave: bool = False,
) -> torch.Tensor:
    """float64 ``out_i = scale (x_i cos(f[p,i]) + sign_i x_partner(i) sin(f[p,i]))``, rest
    copied; ``inverse``: by minus the angle, ``out_i = scale (x_i cos(f[p,i]) - sign_i
    x_partner(i) sin(f[p,partner(i)]))`` (the transpose: a channel meets its partner's angle).

    ``offset``: ``x`` is the head's channels ``offset .. offset + d2``, ``i`` counted from
    there; the others are copied. ``deinterleave``: ``x_j`` is the rotary channel
    :func:`halves_order` puts at ``j`` (pairs in, halves out, rotate-half partners); with
    ``inverse`` (the transpose) ``x`` is read as it lies and ``out_j`` is written back to
    channel ``halves_order[j]``.

    ``angles`` is ``[s2, d2]`` (any float dtype); differentiable with respect to ``t``.
    """
    d2 = angles.shape[-1]
    x = t.double()
    f = angles.double().cpu()[positions.cpu()].to(x.device).unsqueeze(-2)
    idx, sign = partners(d2, interleaved)
    sign_t = torch.tensor(sign, dtype=torch.float64, device=x.device)
    idx_t = torch.tensor(idx, device=x.device)
    rot = x[..., offset:offset + d2]
    order = halves_order(d2)
    if deinterleave and not inverse:
        rot = rot[..., torch.tensor(order, device=x.device)]
    if inverse:
        turn = -sign_t * rot[..., idx_t] * (scale * torch.sin(f[..., idx_t]))
    else:
        turn = sign_t * rot[..., idx_t] * (scale * torch.sin(f))
    out = rot * (scale * torch.cos(f)) + turn
    if deinterleave and inverse:
        back = [order.index(i) for i in range(d2)]  # channel i takes out_j with order[j] = i
        out = out[..., torch.tensor(back, device=x.device)]
    return torch.cat((x[..., :offset], out, x[..., offset + d2:]), dim=-1)


def reference_cache_rope(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    interleaved: bool = False, inverse: bool = False,
) -> torch.Tensor:
    """float64 ``out_i = x_i cos[p, i] + sign_i x_partner(i) sin[p, i]`` for the rows of a
    cos/sin cache ``[s2, d2]`` of any values, rest copied; differentiable with respect to ``t``.
    ``positions``: each token's row, shaped like ``t.shape[:-2]``. ``inverse``: ``out_i = x_i
    cos[p, i] - sign_i x_partner(i) sin[p, partner(i)]``, the transpose."""
    d2 = cos.shape[-1]
    x = t.double()
    rows = positions.cpu()
    c = cos.double().cpu()[rows].to(x.device).unsqueeze(-2)
    s = sin.double().cpu()[rows].to(x.device).unsqueeze(-2)
    idx, sign = partners(d2, interleaved)
    sign_t = torch.tensor(sign, dtype=torch.float64, device=x.device)
    rot = x[..., :d2]
    idx_t = torch.tensor(idx, device=x.device)
    if inverse:
        out = rot * c - sign_t * rot[..., idx_t] * s[..., idx_t]
    else:
        out = rot * c + sign_t * rot[..., idx_t] * s
    return torch.cat((out, x[..., d2:]), dim=-1)


def reference_for(t, angles, spec, start_positions=None, positions=None) -> torch.Tensor:
    """The reference output for a call described by a ``RoPESpec`` (read field by field);
    ``positions``, when given, are every token's table row (``t.shape[:-2]``)."""
    if positions is not None:
        positions = torch.tensor(positions.tolist(), dtype=torch.long).reshape(t.shape[:-2])
    else:
        positions = reference_positions(
            spec.layout, tuple(t.shape),
            cu_seqlens=None if spec.cu_seqlens is None else spec.cu_seqlens.tolist(),
            cp_size=spec.cp_size, cp_rank=spec.cp_rank,
            start_positions=None if start_positions is None else start_positions.tolist(),
        )
    return reference_rope(t, angles.reshape(angles.shape[0], angles.shape[-1]), positions,
                          spec.interleaved, spec.cos_sin_scale, spec.inverse,
                          getattr(spec, "rotary_offset", 0), getattr(spec, "deinterleave", False))


def reference_forward_backward(t, angles, spec, grad_out, start_positions=None, positions=None):
    """float64 output and input gradient ``(out, dL/dt)`` for ``L = sum(out * grad_out)``,
    computed on the CPU whatever the inputs' device."""
    x = t.detach().cpu().double().requires_grad_(True)
    out = reference_for(x, angles.cpu(), spec, start_positions, positions)
    (grad,) = torch.autograd.grad(out, x, grad_out.cpu().double())
    return out.detach(), grad


def split_qkv(qkv: torch.Tensor, split: tuple[int, int, int]):
    """q ``[.., h * q/d, d]``, k ``[.., h, k]`` and v ``[.., h, v]`` of a packed
    ``[.., h, q + k + v]`` tensor, ``d = k``: query head ``g * (q/d) + j`` is channels
    ``j*d .. (j+1)*d`` of head group ``g`` (TransformerEngine's fused QKV layout)."""
    q_len, d, _ = split
    groups = qkv.shape[-2]
    heads = [qkv[..., g, j * d : (j + 1) * d] for g in range(groups) for j in range(q_len // d)]
    return torch.stack(heads, dim=-2), qkv[..., q_len : q_len + d], qkv[..., q_len + d :]


def reference_qkv_forward_backward(
    qkv, q_angles, k_angles, spec, split, grad_outs, start_positions=None, positions=None
):
    """float64 ``((q, k, v), dL/dqkv)`` for ``L = sum(q gq) + sum(k gk) + sum(v gv)``: q rotated
    by ``q_angles``, k by ``k_angles``, v passed through; on the CPU."""
    x = qkv.detach().cpu().double().requires_grad_(True)
    q, k, v = split_qkv(x, split)
    pos = None if positions is None else positions.cpu()
    outs = (
        reference_for(q, q_angles.cpu(), spec, start_positions, pos),
        reference_for(k, k_angles.cpu(), spec, start_positions, pos),
        v,
    )
    (grad,) = torch.autograd.grad(outs, x, [g.cpu().double() for g in grad_outs])
    return tuple(o.detach() for o in outs), grad


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise error scaled as ``|a - e| / (1 + |e|)`` (unit-scale inputs)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float(((a - e).abs() / (1 + e.abs())).max()) if a.numel() else 0.0


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Shape, finiteness, and elementwise error within the dtype's tolerance."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = max_error(actual, expected)
    assert err <= TOLERANCE[dtype], f"{what}: max error {err:.3g} > {TOLERANCE[dtype]:.3g} for {dtype}"


def assert_forward_backward(out: torch.Tensor, t: torch.Tensor, grad_out: torch.Tensor,
                            expected_of, dtype: torch.dtype) -> None:
    """``out`` (made from ``t``, which requires grad) and its gradient for ``grad_out`` against
    ``expected_of(x)``, a float64 function of a float64 copy ``x`` of ``t``, and its gradient."""
    (grad,) = torch.autograd.grad(out, t, grad_out)
    x = t.detach().cpu().double().requires_grad_(True)
    expected = expected_of(x)
    (expected_grad,) = torch.autograd.grad(expected, x, grad_out.cpu().double())
    assert_matches(out, expected, dtype, "forward")
    assert_matches(grad, expected_grad, dtype, "backward")


def reference_head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                        scope: str) -> torch.Tensor:
    """float64 RMSNorm of ``x`` ``[.., heads, d]``, from its definition: each group (a head's
    ``d`` channels, or with ``scope="heads"`` a token's ``heads * d`` channels) divided by the
    square root of its mean square plus ``eps``, channel ``i`` times ``offset + weight[i]``;
    differentiable with respect to ``x`` and ``weight``."""
    x = x.double()
    heads, d = x.shape[-2], x.shape[-1]
    w = weight.double().cpu().to(x.device) + offset
    if scope == "heads":
        flat = x.reshape(*x.shape[:-2], heads * d)
        rms = torch.sqrt((flat * flat).sum(-1, keepdim=True) / (heads * d) + eps)
        return (flat / rms * w).reshape(x.shape)
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / d + eps)
    return x / rms * w
