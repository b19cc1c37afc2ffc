"""Random RoPE calls for property tests: every layout, dtype, stride pattern and feature.

A :class:`Case` is plain data; :func:`build` turns it into tensors (``t`` possibly a strided view
of a bigger buffer, as a qkv split makes), an angle table with unequal halves, a spec and
``start_positions``. Backends' tests share it so they all face the same inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import rope_dispatch as rd

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STRIDES = ("contiguous", "qkv-slice", "permuted", "channel-strided")


@dataclass(frozen=True)
class Case:
    layout: str
    dtype: torch.dtype
    seq: int  # local sequence length (sbhd/bshd) or unused for thd
    batch: int
    heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    cp_size: int
    cp_rank: int
    seqlens: tuple[int, ...]  # global sequence lengths (thd)
    with_starts: bool
    strides: str
    use_cache: bool
    table_margin: int
    seed: int
    per_token: bool = False  # positions given per token (random rows), no start_positions or CP
    scale: float = 1.0  # the spec's cos_sin_scale


_FIXED = Case(
    layout="sbhd", dtype=torch.float32, seq=5, batch=2, heads=3, head_dim=16, rotary_dim=16,
    interleaved=False, cp_size=1, cp_rank=0, seqlens=(3, 6, 4), with_starts=False,
    strides="contiguous", use_cache=False, table_margin=2, seed=0,
)


def fixed_case(**changes) -> Case:
    """A small fixed case (sbhd fp32 s5 b2 h3 d16, full rotary, contiguous) with ``changes``."""
    return dataclasses.replace(_FIXED, **changes)


@st.composite
def cases(
    draw, layouts=("sbhd", "bshd", "thd"), dtypes=DTYPES, max_seq: int = 12,
    cp_sizes=(1, 1, 2, 3), starts=(False, True), scales=(1.0, 1.0, 1.0, 1.25, 0.5),
) -> Case:
    layout = draw(st.sampled_from(layouts))
    cp_size = draw(st.sampled_from(cp_sizes))
    cp_rank = draw(st.integers(0, cp_size - 1))
    head_dim = draw(st.sampled_from((4, 8, 12, 16, 32)))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    if cp_size > 1:
        seq = 2 * draw(st.integers(1, max_seq // 2))
        seqlens = tuple(2 * cp_size * n for n in draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)))
    else:
        seq = draw(st.integers(1, max_seq))
        seqlens = tuple(draw(st.lists(st.integers(0, max_seq), min_size=1, max_size=4)))
    if layout == "thd" and sum(seqlens) == 0:
        seqlens = seqlens[:-1] + (2 * cp_size,)
    return Case(
        layout=layout,
        dtype=draw(st.sampled_from(dtypes)),
        seq=seq,
        batch=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 4)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=draw(st.booleans()),
        cp_size=cp_size,
        cp_rank=cp_rank,
        seqlens=seqlens,
        with_starts=draw(st.sampled_from(starts)),
        strides=draw(st.sampled_from(STRIDES)),
        use_cache=draw(st.booleans()),
        table_margin=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**16)),
        scale=draw(st.sampled_from(scales)),
    )


def _strided(shape: tuple[int, ...], kind: str, dtype, gen, device) -> torch.Tensor:
    """A tensor of ``shape`` laid out as ``kind`` describes, filled with unit normals."""
    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32).to(dtype).to(device)

    if kind == "contiguous":
        return randn(*shape)
    if kind == "qkv-slice":  # heads of q out of a fused qkv projection
        *lead, h, d = shape
        return randn(*lead, 3 * h, d)[..., h : 2 * h, :]
    if kind == "permuted":  # the two leading dims swapped in memory
        if len(shape) == 4:
            return randn(shape[1], shape[0], *shape[2:]).transpose(0, 1)
        return randn(shape[1], shape[0], shape[2]).transpose(0, 1)
    # channel-strided: every other channel of a wider buffer (stride on d is 2)
    return randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def positions_for(case: Case, t: torch.Tensor, table_rows: int) -> torch.Tensor:
    """Random per-token rows ``t.shape[:-2]`` of a table of ``table_rows`` (a case's
    ``per_token`` calls), int64 for even seeds, int32 for odd ones."""
    gen = torch.Generator().manual_seed(case.seed + 7)
    dtype = torch.int64 if case.seed % 2 == 0 else torch.int32
    return torch.randint(0, table_rows, tuple(t.shape[:-2]), generator=gen).to(dtype)


def build(case: Case, device: str | torch.device = "cpu", requires_grad: bool = True):
    """``(t, freqs_or_cache, spec, start_positions, angles)`` for a case; ``angles`` is ``[s2, d2]``."""
    gen = torch.Generator().manual_seed(case.seed)
    cp = case.cp_size
    if case.layout == "thd":
        local = [n // cp for n in case.seqlens]
        shape = (sum(local), case.heads, case.head_dim)
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(case.seqlens)
        batch = len(case.seqlens)
    else:
        s, b = case.seq, case.batch
        shape = (s, b, case.heads, case.head_dim) if case.layout == "sbhd" else (b, s, case.heads, case.head_dim)
        cu = None
        longest = s * cp
        batch = b
    starts = None
    if case.with_starts:
        starts = torch.randint(0, 6, (batch,), generator=gen, dtype=torch.int64)
        longest += int(starts.max())
    s2 = longest + case.table_margin + 1
    # Unequal halves on purpose: a kernel that assumes TE's duplicated layout fails here.
    angles = torch.rand(s2, case.rotary_dim, generator=gen, dtype=torch.float64) * 40 - 20
    angles = angles.float()
    t = _strided(shape, case.strides, case.dtype, gen, device)
    if requires_grad:
        t.requires_grad_(True)
    spec = rd.RoPESpec(
        layout=case.layout, dtype=case.dtype, rotary_dim=case.rotary_dim, interleaved=case.interleaved,
        cu_seqlens=None if cu is None else cu.to(device), cp_size=cp, cp_rank=case.cp_rank,
        cos_sin_scale=case.scale,
    )
    table_4d = angles.view(s2, 1, 1, case.rotary_dim).to(device)
    table = rd.cos_sin_cache(table_4d) if case.use_cache else table_4d
    return t, table, spec, None if starts is None else starts.to(device), angles


@dataclass(frozen=True)
class QKVCase:
    """A packed qkv call: ``base`` gives everything but the packing (its ``heads`` are head
    groups, its ``head_dim`` the k/head dim); a group holds ``q_heads`` query heads and
    ``v_heads`` value heads; ``own_k_table``: k gets a table of its own."""

    base: Case
    q_heads: int
    v_heads: int
    own_k_table: bool

    @property
    def split(self) -> tuple[int, int, int]:
        d = self.base.head_dim
        return self.q_heads * d, d, self.v_heads * d


@st.composite
def qkv_cases(draw, layouts=("sbhd", "bshd", "thd"), dtypes=DTYPES) -> QKVCase:
    base = draw(cases(layouts=layouts, dtypes=dtypes))
    base = dataclasses.replace(base, heads=min(base.heads, 3), head_dim=draw(st.sampled_from((4, 8, 16))))
    base = dataclasses.replace(base, rotary_dim=2 * draw(st.integers(1, base.head_dim // 2)))
    return QKVCase(base, draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2))), draw(st.booleans()))


def build_qkv(case: QKVCase, device: str | torch.device = "cpu", requires_grad: bool = True):
    """``(qkv, q_table, k_table_or_None, spec, start_positions, q_angles, k_angles)``."""
    base = dataclasses.replace(case.base, head_dim=sum(case.split))
    qkv, table, spec, starts, angles = build(base, device, requires_grad)
    if not case.own_k_table:
        return qkv, table, None, spec, starts, angles, angles
    gen = torch.Generator().manual_seed(case.base.seed + 1)
    k_angles = (torch.rand(angles.shape, generator=gen, dtype=torch.float64) * 40 - 20).float()
    k_4d = k_angles.view(k_angles.shape[0], 1, 1, -1).to(device)
    k_table = rd.cos_sin_cache(k_4d) if case.base.use_cache else k_4d
    return qkv, table, k_table, spec, starts, angles, k_angles


def mrope_qk_inputs(gen: torch.Generator, table_len: int, d2: int, device: str):
    """Multimodal q+k inputs drawn from ``gen``: q ``[7, 4, 16]`` and k ``[7, 1, 16]`` (thd,
    GQA) on ``device``, a float32 angle table ``[table_len, d2]`` of large angles of both
    signs, and three position streams ``[3, 7]`` (temporal, height, width)."""
    q = torch.randn(7, 4, 16, generator=gen).to(device)
    k = torch.randn(7, 1, 16, generator=gen).to(device)
    angles = torch.rand(table_len, d2, generator=gen) * 40 - 20
    streams = torch.randint(0, table_len, (3, 7), generator=gen)
    return q, k, angles, streams
