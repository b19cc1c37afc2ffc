"""``rope_dispatch.compat.te``: TransformerEngine 2.20.2's RoPE API on rope-dispatch.

On the CPU (what CI runs) the three public names are checked against TE's semantics written out
here independently, in float64 (positions, zigzag context parallelism, rotate-half and
interleaved rotation, pass-through channels), and against TE's signatures written out
literally. The calls run through rope-dispatch's dispatch with the eager backend forced
(``ROPE_BACKEND``): the compile backend, which priority picks on a CPU, would compile once per
spec. Tests marked ``gpu`` compare with the installed TransformerEngine itself where it is
importable (the GPU machine stages 2.20.2).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import rope_dispatch as rd
from reference import assert_matches
from rope_dispatch.compat import te as compat
from rope_dispatch.compat.te import (
    RotaryPositionEmbedding,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _eager_on_cpu(request, monkeypatch):
    """The CPU tests run on the eager backend; ``gpu`` tests let dispatch choose as it would
    for a user."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("ROPE_BACKEND", "eager")


# --- TE's semantics, written from its definition ----------------------------------------------

def te_local_positions(n: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global position of each of the ``n`` local tokens of a sequence under TE's context
    parallelism: the first half sits at ``i + rank * n/2``, the second half counts back from
    the end of the global sequence (``n * cp_size - (rank + 1) * n/2``)."""
    if cp_size == 1:
        return list(range(n))
    half = n // 2
    return [
        i + cp_rank * half if i < half else n * cp_size - (cp_rank + 1) * half + (i - half)
        for i in range(n)
    ]


def te_rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """TE's partner tensor: ``[-x2, x1]`` of the halves, or ``(-x_odd, x_even)`` per pair."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def te_formula(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
               cu_seqlens=None, cp_size=1, cp_rank=0) -> torch.Tensor:
    """float64 TE RoPE of ``t`` (differentiable): each token's table row is its sequence's
    start position plus its (zigzag) position; channels past ``d2`` are copied."""
    x = t.double()
    angles = freqs.double().reshape(freqs.shape[0], freqs.shape[-1])
    d2 = angles.shape[-1]
    if tensor_format == "thd":
        bounds = [int(c) // cp_size for c in cu_seqlens]
        starts = [0] * (len(bounds) - 1) if start_positions is None else start_positions.tolist()
        rows = []
        for seq, (a, b) in enumerate(zip(bounds, bounds[1:])):
            rows += [starts[seq] + p for p in te_local_positions(b - a, cp_size, cp_rank)]
        row_angles = angles[torch.tensor(rows, dtype=torch.long)].unsqueeze(1)  # [T, 1, d2]
    else:
        s, b = x.shape[:2] if tensor_format == "sbhd" else (x.shape[1], x.shape[0])
        starts = [0] * b if start_positions is None else start_positions.tolist()
        rows = [[starts[j] + p for j in range(b)] for p in te_local_positions(s, cp_size, cp_rank)]
        row_angles = angles[torch.tensor(rows, dtype=torch.long)]  # [s, b, d2]
        if tensor_format == "bshd":
            row_angles = row_angles.transpose(0, 1)
        row_angles = row_angles.unsqueeze(2)  # [.., 1, d2]: one angle row for all heads
    rotated, rest = x[..., :d2], x[..., d2:]
    out = rotated * torch.cos(row_angles) + te_rotate(rotated, interleaved) * torch.sin(row_angles)
    return torch.cat((out, rest), dim=-1)


def te_forward_backward(t, freqs, grad_out, **kwargs):
    """float64 TE output and input gradient for ``L = sum(out * grad_out)``."""
    x = t.detach().double().requires_grad_(True)
    out = te_formula(x, freqs, **kwargs)
    (grad,) = torch.autograd.grad(out, x, grad_out.double())
    return out.detach(), grad


# --- inputs ------------------------------------------------------------------------------------

SEQ, BATCH, HEADS, HEAD_DIM = 4, 2, 2, 12
THD_LENGTHS = (8, 4, 12)  # global lengths, divisible by 2 * cp_size for cp_size 1 and 2
MARGIN = 3  # table rows beyond the longest sequence: room for start positions


def make_input(tensor_format, dtype, cp_size, seed=0, requires_grad=True):
    """``t`` for the format (sbhd/bshd ``[4, 2]`` local tokens, thd three packed sequences),
    ``cu_seqlens`` for thd, and the table length the call needs plus ``MARGIN``."""
    g = torch.Generator().manual_seed(seed)
    if tensor_format == "thd":
        cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        shape, cu_seqlens, needed = (int(cu[-1]) // cp_size, HEADS, HEAD_DIM), cu, max(THD_LENGTHS)
    else:
        s_b = (SEQ, BATCH) if tensor_format == "sbhd" else (BATCH, SEQ)
        shape, cu_seqlens, needed = (*s_b, HEADS, HEAD_DIM), None, SEQ * cp_size
    t = torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad)
    return t, cu_seqlens, needed + MARGIN


def random_angles(rows, d2, seed=1, dtype=torch.float32):
    """An angle table ``[rows, 1, 1, d2]`` with unequal halves (TE reads every entry)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, 1, 1, d2, generator=g) * 6 - 3).to(dtype)


def starts_for(tensor_format, seed=2):
    n = len(THD_LENGTHS) if tensor_format == "thd" else BATCH
    return torch.randint(0, MARGIN + 1, (n,), generator=torch.Generator().manual_seed(seed))


# --- signatures --------------------------------------------------------------------------------

EMPTY = inspect.Parameter.empty

# TransformerEngine 2.20.2, transformer_engine/pytorch/attention/rope.py: (name, default).
TE_SIGNATURES = {
    "apply_rotary_pos_emb": [
        ("t", EMPTY), ("freqs", EMPTY), ("tensor_format", "sbhd"), ("start_positions", None),
        ("interleaved", False), ("fused", False), ("cu_seqlens", None), ("cp_size", 1),
        ("cp_rank", 0),
    ],
    "apply_fused_qkv_rotary_pos_emb": [
        ("qkv", EMPTY), ("q_freqs", EMPTY), ("k_freqs", EMPTY), ("qkv_split_arg_list", EMPTY),
        ("tensor_format", "sbhd"), ("start_positions", None), ("interleaved", False),
        ("cu_seqlens", None), ("cp_size", 1), ("cp_rank", 0),
    ],
    "RotaryPositionEmbedding.__init__": [
        ("self", EMPTY), ("dim", EMPTY), ("rotary_percent", 1.0),
        ("seq_len_interpolation_factor", None), ("pretrained_max_position_embeddings", None),
        ("rotary_base", 10000.0), ("interleaved", False),
    ],
    "RotaryPositionEmbedding.forward": [("self", EMPTY), ("max_seq_len", EMPTY), ("offset", 0)],
}


def parameters_of(module, name: str):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    params = inspect.signature(obj).parameters.values()
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), name
    return [(p.name, p.default) for p in params]


@pytest.mark.parametrize("name", sorted(TE_SIGNATURES))
def test_signature_is_te_2_20_2(name):
    params = parameters_of(compat, name)
    assert params == TE_SIGNATURES[name]
    # defaults of the same type too (1.0 is not 1, "sbhd" is not a layout object)
    assert [type(d) for _, d in params] == [type(d) for _, d in TE_SIGNATURES[name]]


def test_public_names():
    assert set(compat.__all__) == {
        "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb", "RotaryPositionEmbedding"
    }


# --- apply_rotary_pos_emb against TE's formula -------------------------------------------------

@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("with_starts", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 8])
def test_apply_matches_te_formula(tensor_format, cp_size, with_starts, interleaved, rotary_dim):
    """Forward and backward, every context-parallel rank, fp32 and bf16 inputs."""
    for dtype in (torch.float32, torch.bfloat16):
        t, cu, rows = make_input(tensor_format, dtype, cp_size)
        freqs = random_angles(rows, rotary_dim)
        starts = starts_for(tensor_format) if with_starts else None
        for cp_rank in range(cp_size):
            kwargs = dict(tensor_format=tensor_format, start_positions=starts,
                          interleaved=interleaved, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
            out = apply_rotary_pos_emb(t, freqs, fused=True, **kwargs)
            assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
            grad_out = torch.randn(t.shape).to(dtype)
            (grad,) = torch.autograd.grad(out, t, grad_out)
            ref_out, ref_grad = te_forward_backward(t, freqs, grad_out, **kwargs)
            what = f"{dtype} cp_rank {cp_rank}"
            assert_matches(out, ref_out, dtype, f"output, {what}")
            assert_matches(grad, ref_grad, dtype, f"gradient, {what}")


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_bf16_freqs_are_converted_to_float32(tensor_format):
    """TE's fused path runs ``freqs.float()``: a bf16 table gives the result of its float32
    copy, and that result is the formula's on the bf16 values."""
    t, cu, rows = make_input(tensor_format, torch.float32, 1, requires_grad=False)
    freqs = random_angles(rows, 8, dtype=torch.bfloat16)
    out = apply_rotary_pos_emb(t, freqs, tensor_format, cu_seqlens=cu)
    assert torch.equal(out, apply_rotary_pos_emb(t, freqs.float(), tensor_format, cu_seqlens=cu))
    assert_matches(out, te_formula(t, freqs, tensor_format, cu_seqlens=cu), torch.float32)
    assert freqs.dtype == torch.bfloat16, "the caller's table is left as it was"


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_cu_seqlens_is_ignored_outside_thd(tensor_format):
    """TE's own tests pass cu_seqlens with bshd and sbhd; offsets that could never describe
    ``t`` change nothing and raise nothing."""
    t, _, rows = make_input(tensor_format, torch.float32, 2, requires_grad=False)
    freqs = random_angles(rows, HEAD_DIM)
    nonsense = torch.tensor([3, 1], dtype=torch.int64)
    for fused in (False, True):
        out = apply_rotary_pos_emb(t, freqs, tensor_format, fused=fused, cu_seqlens=nonsense,
                                   cp_size=2, cp_rank=1)
        assert torch.equal(out, apply_rotary_pos_emb(t, freqs, tensor_format, cp_size=2, cp_rank=1))


def test_fused_flag_changes_nothing():
    """``fused=False`` gives the fused kernel's values (float32 math, one rounding), not those
    of TE's unfused path, which rounds cos and sin to bf16 before multiplying."""
    t, _, rows = make_input("sbhd", torch.bfloat16, 1, requires_grad=False)
    t = t * 40  # large values, so rounding cos/sin first would show
    freqs = random_angles(rows, HEAD_DIM)
    fused = apply_rotary_pos_emb(t, freqs, fused=True)
    unfused = apply_rotary_pos_emb(t, freqs, fused=False)
    assert torch.equal(fused, unfused)
    exact = te_formula(t, freqs)
    rounded_first = (
        t[..., :HEAD_DIM] * torch.cos(freqs[:SEQ]).to(t.dtype)
        + te_rotate(t, False) * torch.sin(freqs[:SEQ]).to(t.dtype)
    )
    err = lambda a: float((a.double() - exact).abs().max())  # noqa: E731
    assert err(unfused) < err(rounded_first), "the fused kernel's values, not the unfused path's"


def test_strided_input_and_expanded_gradient():
    """TE's tests transpose inputs in storage and use ``sum() * 2`` losses, whose gradient is
    an expanded (stride 0) tensor."""
    base = torch.randn(SEQ, BATCH, HEAD_DIM, HEADS)
    t = base.transpose(2, 3).requires_grad_(True)  # [s, b, h, d] with a stride on d
    freqs = random_angles(SEQ + MARGIN, 8)
    out = apply_rotary_pos_emb(t, freqs, interleaved=True)
    (grad,) = torch.autograd.grad(out.sum() * 2, t)
    ref_out, ref_grad = te_forward_backward(t, freqs, torch.full(t.shape, 2.0), interleaved=True)
    assert out.is_contiguous()
    assert_matches(out, ref_out, torch.float32)
    assert_matches(grad, ref_grad, torch.float32, "gradient")


# --- what the adapter hands to dispatch --------------------------------------------------------

def test_arguments_map_onto_spec_and_dispatch(monkeypatch):
    """Each TE argument lands in the spec field it names; the call goes to
    ``rope_dispatch.apply`` with no backend forced; the spec is reused, not rebuilt."""
    seen = []
    monkeypatch.setattr(
        compat, "apply", lambda t, freqs, spec, **kw: seen.append((t, freqs, spec, kw)) or t
    )
    t = torch.randn(2, 4, 2, 8, dtype=torch.float16)
    freqs = random_angles(16, 8, dtype=torch.bfloat16)
    starts = torch.tensor([0, 1])
    for _ in range(2):
        apply_rotary_pos_emb(t, freqs, "bshd", starts, True, True, torch.tensor([0, 4]), 2, 1)
    (_, got_freqs, spec, kw), (_, _, again, _) = seen
    assert spec.static_fields() == {
        "layout": "bshd", "dtype": "float16", "rotary_dim": None, "interleaved": True,
        "max_seqlen": None, "cp_size": 2, "cp_rank": 1, "cos_sin_scale": 1.0,
        "mrope_section": None,
    }
    assert spec.cu_seqlens is None
    assert again is spec, "the spec comes from the cache"
    assert got_freqs.dtype == torch.float32 and torch.equal(got_freqs, freqs.float())
    assert kw == {"start_positions": starts}

    seen.clear()
    cu_a, cu_b = torch.tensor([0, 4, 8]), torch.tensor([0, 2, 8])
    x = torch.randn(8, 2, 8)
    for cu in (cu_a, cu_b, cu_b):  # a step's layers pass the same offsets: one spec
        apply_rotary_pos_emb(x, freqs.float(), "thd", cu_seqlens=cu)
    (_, same_freqs, spec_a, _), (_, _, spec_b, _), (_, _, spec_b_again, _) = seen
    assert same_freqs.dtype == torch.float32
    assert spec_a.layout == "thd" and spec_a.cu_seqlens is cu_a and spec_b.cu_seqlens is cu_b
    assert spec_a.static_key == spec_b.static_key
    assert spec_b_again is spec_b


def test_qkv_arguments_map_onto_apply_qkv(monkeypatch):
    seen = []
    monkeypatch.setattr(compat, "apply_qkv", lambda *a, **kw: seen.append((a, kw)) or (1, 2, 3))
    qkv = torch.randn(4, 2, 2, 24, dtype=torch.bfloat16)
    q_freqs, k_freqs = random_angles(8, 8, dtype=torch.bfloat16), random_angles(8, 8, seed=5)
    out = apply_fused_qkv_rotary_pos_emb(
        qkv, q_freqs, k_freqs, [16, 4, 4], "sbhd", None, True, torch.tensor([0, 4]), 2, 1
    )
    assert out == (1, 2, 3)
    [((got_qkv, got_q, spec, split), kw)] = seen
    assert got_qkv is qkv and split == (16, 4, 4)
    assert got_q.dtype == torch.float32 and torch.equal(got_q, q_freqs.float())
    assert kw == {"k_freqs": k_freqs, "start_positions": None}
    assert (spec.layout, spec.dtype, spec.interleaved, spec.cp_size, spec.cp_rank) == (
        "sbhd", torch.bfloat16, True, 2, 1
    )


# --- apply_fused_qkv_rotary_pos_emb ------------------------------------------------------------

QKV_D = 8  # head dim; TE's test packs q = 4 heads, k = 1, v = 1 per group: hidden_size * 6


def te_qkv_reference(qkv, q_freqs, k_freqs, split, grad_outs, **kwargs):
    """TE's own check of the fused qkv call: split the last dim, view q as ``4h`` heads of
    ``d``, rotate q and k as two ``apply_rotary_pos_emb`` calls would, copy v (float64)."""
    x = qkv.detach().double().requires_grad_(True)
    q, k, v = torch.split(x, list(split), dim=3)
    q = q.reshape(q.shape[0], q.shape[1], -1, split[1])
    outs = (te_formula(q, q_freqs, **kwargs), te_formula(k, k_freqs, **kwargs), v)
    grad = torch.autograd.grad(outs, x, [g.double() for g in grad_outs])[0] if grad_outs else None
    return [o.detach() for o in outs], grad


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [QKV_D, QKV_D // 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_matches_te(tensor_format, cp_size, interleaved, rotary_dim, dtype):
    """q and k with different tables, every rank; gradient into one packed tensor; output
    shapes TE's: q ``[.., 4h, d]``, k and v ``[.., h, d]``."""
    s_b = (SEQ, BATCH) if tensor_format == "sbhd" else (BATCH, SEQ)
    split = (4 * QKV_D, QKV_D, QKV_D)
    qkv = torch.randn(*s_b, HEADS, 6 * QKV_D).to(dtype).requires_grad_(True)
    q_freqs = random_angles(SEQ * cp_size, rotary_dim, seed=3)
    k_freqs = random_angles(SEQ * cp_size + 2, rotary_dim, seed=4)
    for cp_rank in range(cp_size):
        kwargs = dict(tensor_format=tensor_format, interleaved=interleaved, cp_size=cp_size,
                      cp_rank=cp_rank)
        outs = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, list(split), **kwargs)
        assert isinstance(outs, tuple) and len(outs) == 3
        assert [tuple(o.shape) for o in outs] == [
            (*s_b, 4 * HEADS, QKV_D), (*s_b, HEADS, QKV_D), (*s_b, HEADS, QKV_D)
        ]
        assert all(o.dtype == dtype and o.is_contiguous() for o in outs)
        grad_outs = [torch.randn(o.shape).to(dtype) for o in outs]
        (grad,) = torch.autograd.grad(outs, qkv, grad_outs)
        refs, ref_grad = te_qkv_reference(qkv, q_freqs, k_freqs, split, grad_outs, **kwargs)
        for name, out, ref in zip("qkv", outs, refs):
            assert_matches(out, ref, dtype, f"{name}, cp_rank {cp_rank}")
        assert grad.shape == qkv.shape
        assert_matches(grad, ref_grad, dtype, f"packed gradient, cp_rank {cp_rank}")


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_qkv_start_positions_forward(tensor_format):
    s_b = (SEQ, BATCH) if tensor_format == "sbhd" else (BATCH, SEQ)
    split = [4 * QKV_D, QKV_D, QKV_D]
    qkv = torch.randn(*s_b, HEADS, 6 * QKV_D)
    q_freqs, k_freqs = random_angles(SEQ + MARGIN, QKV_D, 6), random_angles(SEQ + MARGIN, QKV_D, 7)
    starts = torch.tensor([3, 1], dtype=torch.int32)
    outs = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, tensor_format, starts)
    refs, _ = te_qkv_reference(qkv, q_freqs, k_freqs, split, None, tensor_format=tensor_format,
                               start_positions=starts)
    for name, out, ref in zip("qkv", outs, refs):
        assert_matches(out, ref, torch.float32, name)


# --- errors: TE's asserts mirrored, the core's checks ------------------------------------------

def _qkv_inputs(tensor_format="sbhd"):
    split = (4 * QKV_D, QKV_D, QKV_D)
    if tensor_format == "thd":
        qkv = torch.randn(12, HEADS, 6 * QKV_D)
        cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    else:
        qkv, cu = torch.randn(SEQ, BATCH, HEADS, 6 * QKV_D), None
    return qkv, random_angles(16, QKV_D, 8), random_angles(16, QKV_D, 9), split, cu


def _strided(freqs):
    """The same float32 angles, not contiguous (every other column of a wider table)."""
    wide = freqs.new_zeros(*freqs.shape[:-1], 2 * freqs.shape[-1])
    wide[..., ::2] = freqs
    view = wide[..., ::2]
    assert not view.is_contiguous() and torch.equal(view, freqs)
    return view


MIRRORED = {
    # name: (adapter arguments as a function of the inputs, what apply_qkv gets, message parts)
    "thd": (
        lambda qkv, q, k, split, cu: (qkv, q, k, list(split), "thd", None, False, cu),
        lambda qkv, q, k, split, cu: (qkv, q, rd.RoPESpec(layout="thd", dtype=qkv.dtype,
                                                          cu_seqlens=cu), split, dict(k_freqs=k)),
        ["tensor_format='thd'"],
    ),
    "start_positions with cp_size 2": (
        lambda qkv, q, k, split, cu: (qkv, q, k, list(split), "sbhd", torch.tensor([1, 0]),
                                      False, None, 2, 1),
        lambda qkv, q, k, split, cu: (qkv, q, rd.RoPESpec(layout="sbhd", dtype=qkv.dtype,
                                                          cp_size=2, cp_rank=1), split,
                                      dict(k_freqs=k, start_positions=torch.tensor([1, 0]))),
        ["start_positions", "cp_size=2"],
    ),
    "non-contiguous qkv": (
        lambda qkv, q, k, split, cu: (_transposed(qkv), q, k, list(split)),
        lambda qkv, q, k, split, cu: (_transposed(qkv), q, rd.RoPESpec(layout="sbhd",
                                      dtype=qkv.dtype), split, dict(k_freqs=k)),
        ["qkv is not contiguous", "strides"],
    ),
    "non-contiguous q_freqs": (
        lambda qkv, q, k, split, cu: (qkv, _strided(q), k, list(split)),
        lambda qkv, q, k, split, cu: (qkv, _strided(q), rd.RoPESpec(layout="sbhd",
                                      dtype=qkv.dtype), split, dict(k_freqs=k)),
        ["q_freqs is not contiguous"],
    ),
    "non-contiguous k_freqs": (
        lambda qkv, q, k, split, cu: (qkv, q, _strided(k), list(split)),
        lambda qkv, q, k, split, cu: (qkv, q, rd.RoPESpec(layout="sbhd", dtype=qkv.dtype),
                                      split, dict(k_freqs=_strided(k))),
        ["k_freqs is not contiguous"],
    ),
}


def _transposed(qkv):
    """``qkv`` with the same values, stored with s and b swapped (not contiguous)."""
    view = qkv.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("name", sorted(MIRRORED))
def test_mirrored_te_assert_raises_rope_error(name):
    """Each of TE's own asserts in apply_fused_qkv_rotary_pos_emb raises RoPEError naming the
    argument and value, TE and apply_qkv; apply_qkv takes the same input, so the adapter is
    what refuses it."""
    adapter_args, core_args, parts = MIRRORED[name]
    layout = "thd" if name == "thd" else "sbhd"
    inputs = _qkv_inputs(layout)
    with pytest.raises(rd.RoPEError) as info:
        apply_fused_qkv_rotary_pos_emb(*adapter_args(*inputs))
    message = str(info.value)
    for part in [*parts, "TransformerEngine", "rope_dispatch.apply_qkv"]:
        assert part in message, (part, message)
    *args, kwargs = core_args(*inputs)
    q, k, v = rd.apply_qkv(*args, **kwargs)
    assert q.shape[-2] == 4 * HEADS and k.shape[-1] == QKV_D


def test_numpy_cp_size_with_start_positions_is_refused_as_te_refuses_it():
    """A NumPy integer cp_size (which the spec takes as the int) meets TE's assert on
    start_positions with cp_size > 1 as a Python int does; cp_size 1 of either kind passes."""
    qkv, q, k, split, _ = _qkv_inputs()
    starts = torch.tensor([1, 0])
    for cp_size in (np.int64(2), np.int32(2)):
        with pytest.raises(rd.RoPEError, match="start_positions given with cp_size=2"):
            apply_fused_qkv_rotary_pos_emb(qkv, q, k, list(split), "sbhd", starts, False, None,
                                           cp_size, 1)
    expected = apply_fused_qkv_rotary_pos_emb(qkv, q, k, list(split), start_positions=starts)
    got = apply_fused_qkv_rotary_pos_emb(qkv, q, k, list(split), start_positions=starts,
                                         cp_size=np.int64(1))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_bf16_freqs_converted_before_contiguity_assert():
    """TE converts to float32 first and checks contiguity after: a strided bf16 slice becomes
    a contiguous copy and is accepted; a float32 one is refused."""
    qkv, q, k, split, _ = _qkv_inputs()
    sliced = random_angles(16, 2 * QKV_D, 8, dtype=torch.bfloat16)[..., :QKV_D]
    assert not sliced.is_contiguous()
    q_out, _, _ = apply_fused_qkv_rotary_pos_emb(qkv, sliced, k, list(split))
    copied = apply_fused_qkv_rotary_pos_emb(qkv, sliced.float(), k, list(split))[0]
    assert torch.equal(q_out, copied)
    with pytest.raises(rd.RoPEError, match="q_freqs is not contiguous"):
        apply_fused_qkv_rotary_pos_emb(qkv, sliced.float().transpose(0, 3).contiguous()
                                       .transpose(0, 3), k, list(split))


def test_a_non_tensor_input_is_named():
    """A list where a tensor belongs gets apply's TypeError naming the argument, not an
    AttributeError from inside the adapter."""
    freqs = random_angles(SEQ, 8)
    with pytest.raises(TypeError, match="t must be a torch.Tensor, got list"):
        apply_rotary_pos_emb([1.0, 2.0], freqs)
    _, q, k, split, _ = _qkv_inputs()
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        apply_fused_qkv_rotary_pos_emb([1.0, 2.0], q, k, list(split))
    # k's table is TE's required argument: None is refused, not replaced by q's table
    with pytest.raises(TypeError, match=r"k_freqs must be a tensor .*got None"):
        apply_fused_qkv_rotary_pos_emb(torch.randn(SEQ, BATCH, HEADS, 6 * QKV_D), q, None,
                                       list(split))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_an_input_of_an_unsupported_dtype_is_named(dtype):
    """t and qkv of a dtype no backend takes are refused under TE's names, not as the spec's
    field dtype, which a caller of TE's API never passed."""
    x, freqs = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM).to(dtype), random_angles(SEQ, 8)
    with pytest.raises(rd.RoPEError, match=f"^t must be .*got {rd.spec.dtype_name(dtype)}"):
        apply_rotary_pos_emb(x, freqs)
    qkv, q, k, split, _ = _qkv_inputs()
    with pytest.raises(rd.RoPEError, match=f"^qkv must be .*got {rd.spec.dtype_name(dtype)}"):
        apply_fused_qkv_rotary_pos_emb(qkv.to(dtype), q, k, list(split))


def test_flags_of_the_wrong_type_are_refused_after_valid_calls():
    """``interleaved=1``, ``cp_size=True`` and ``cp_rank=0.0`` are refused as the spec refuses
    them, also after valid calls whose equal values (``1 == True``) made the door's specs; a
    ``cp_size`` that is no number is named, not compared."""
    x, freqs = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM), random_angles(SEQ, 8)
    bad = (dict(interleaved=1), dict(cp_size=True), dict(cp_rank=0.0))
    for valid in (None, dict(interleaved=True), dict()):
        if valid is not None:
            apply_rotary_pos_emb(x, freqs, **valid)
        for kwargs in bad:
            with pytest.raises(rd.RoPEError, match=next(iter(kwargs))):
                apply_rotary_pos_emb(x, freqs, **kwargs)
    qkv, q, k, split, _ = _qkv_inputs()
    with pytest.raises(rd.RoPEError, match="cp_size"):
        apply_fused_qkv_rotary_pos_emb(qkv, q, k, list(split), cp_size="2",
                                       start_positions=torch.zeros(qkv.shape[1], dtype=torch.long))


def test_core_errors_are_rope_errors():
    t, cu, rows = make_input("thd", torch.float32, 1, requires_grad=False)
    freqs = random_angles(rows, 8)
    # TE's names (tensor_format, cu_seqlens), not the spec's (layout, per-token positions),
    # which TE's API has not
    thd_without = r"^tensor_format='thd' needs cu_seqlens \(.*\), got None$"
    with pytest.raises(rd.RoPEError, match=thd_without):
        apply_rotary_pos_emb(t, freqs, "thd")
    apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)  # the spec is cached now
    with pytest.raises(rd.RoPEError, match=thd_without):
        apply_rotary_pos_emb(t, freqs, "thd")
    x = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM)
    bad_format = "tensor_format must be 'sbhd', 'bshd' or 'thd', got 'sbdh'"  # TE's name
    with pytest.raises(rd.RoPEError, match=bad_format):
        apply_rotary_pos_emb(x, freqs, "sbdh")
    with pytest.raises(rd.RoPEError, match="needs 8"):
        apply_rotary_pos_emb(x, freqs[:SEQ], cp_size=2)
    with pytest.raises(rd.RoPEError, match="start_positions max 2"):
        apply_rotary_pos_emb(x, freqs[: SEQ + 1], start_positions=torch.tensor([0, 2]))
    with pytest.raises(rd.RoPEError, match="exceeds the head dim"):
        apply_rotary_pos_emb(x, random_angles(rows, HEAD_DIM + 2))
    with pytest.raises(rd.RoPEError, match="cp_rank"):
        apply_rotary_pos_emb(x, freqs, cp_size=2, cp_rank=2)
    qkv, q, k, split, _ = _qkv_inputs()
    with pytest.raises(rd.RoPEError, match=bad_format):
        apply_fused_qkv_rotary_pos_emb(qkv, q, k, list(split), "sbdh")
    with pytest.raises(rd.RoPEError, match="split"):
        apply_fused_qkv_rotary_pos_emb(qkv, q, k, [4 * QKV_D, QKV_D, QKV_D + 1])
    with pytest.raises(rd.RoPEError, match=r"^split must be three ints .*got None.* "
                                           r"split=qkv_split_arg_list"):
        apply_fused_qkv_rotary_pos_emb(qkv, q, k, None)
    with pytest.raises(rd.RoPEError, match="k_freqs has"):
        apply_fused_qkv_rotary_pos_emb(qkv, q, k[:SEQ - 1], list(split))


def test_qkv_core_errors_say_how_the_door_mapped_its_arguments():
    """The core names its own arguments (qkv, freqs, split); a caller of TE's API passed qkv,
    q_freqs and qkv_split_arg_list, so each such error says how the door mapped them."""
    qkv, q, k, split, _ = _qkv_inputs()
    bad = {
        "split": lambda: apply_fused_qkv_rotary_pos_emb(qkv, q, k, [4 * QKV_D, QKV_D, 1]),
        "freqs": lambda: apply_fused_qkv_rotary_pos_emb(qkv, q[:SEQ - 1], k, list(split)),
        "qkv": lambda: apply_fused_qkv_rotary_pos_emb(qkv[0], q, k, list(split)),
    }
    for core_name, call in bad.items():
        with pytest.raises(rd.RoPEError) as info:
            call()
        message = str(info.value)
        assert message.startswith(core_name), message
        for part in ("rope_dispatch.apply_qkv", "qkv=qkv", "freqs=q_freqs",
                     "split=qkv_split_arg_list"):
            assert part in message, (part, message)


# --- RotaryPositionEmbedding -------------------------------------------------------------------

def te_table(dim, max_seq_len, offset=0, rotary_percent=1.0, seq_len_interpolation_factor=None,
             pretrained_max_position_embeddings=None, rotary_base=10000.0, interleaved=False,
             device="cpu"):
    """TE's angle table, re-derived: the same float32 operations in the same order."""
    if rotary_percent < 1.0:
        dim = int(dim * rotary_percent)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (rotary_base ** exponents)
    seq = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
    factor, pretrained = seq_len_interpolation_factor, pretrained_max_position_embeddings
    if factor is not None and pretrained is not None:
        if max_seq_len > pretrained * factor:
            seq *= 1 / (max_seq_len / pretrained)
        else:
            seq *= 1 / factor
    angles = torch.einsum("i,j->ij", seq, inv_freq)
    if interleaved:
        angles = torch.stack((angles, angles), dim=-1).reshape(max_seq_len, -1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    return angles.reshape(max_seq_len, 1, 1, -1)


RPE_CASES = {
    "plain": (dict(dim=16), dict(max_seq_len=24)),
    "half rotary": (dict(dim=16, rotary_percent=0.5), dict(max_seq_len=24)),
    "odd rotary dim": (dict(dim=10, rotary_percent=0.5), dict(max_seq_len=7)),
    "dim 1": (dict(dim=1), dict(max_seq_len=4)),
    "rotary dim 1": (dict(dim=4, rotary_percent=0.25), dict(max_seq_len=4)),
    "interleaved": (dict(dim=16, interleaved=True), dict(max_seq_len=24)),
    "offset": (dict(dim=16, rotary_base=500000.0), dict(max_seq_len=24, offset=100)),
    "fixed interpolation": (dict(dim=16, seq_len_interpolation_factor=4,
                                 pretrained_max_position_embeddings=8), dict(max_seq_len=32)),
    "dynamic interpolation": (dict(dim=16, seq_len_interpolation_factor=2,
                                   pretrained_max_position_embeddings=7), dict(max_seq_len=29)),
    "float lengths": (dict(dim=16, seq_len_interpolation_factor=2.0,
                           pretrained_max_position_embeddings=7.0), dict(max_seq_len=29)),
    "dynamic, offset, interleaved": (
        dict(dim=16, rotary_percent=0.75, seq_len_interpolation_factor=3,
             pretrained_max_position_embeddings=5, interleaved=True),
        dict(max_seq_len=40, offset=3)),
    "factor only": (dict(dim=16, seq_len_interpolation_factor=4), dict(max_seq_len=24)),
    "pretrained only": (dict(dim=16, pretrained_max_position_embeddings=4), dict(max_seq_len=24)),
}


@pytest.mark.parametrize("name", sorted(RPE_CASES))
def test_rotary_position_embedding_is_te_table(name):
    init, call = RPE_CASES[name]
    module = RotaryPositionEmbedding(**init)
    table = module(**call)
    expected = te_table(**init, **call, device=module.inv_freq.device)
    assert table.dtype == torch.float32 and table.is_contiguous()
    assert table.shape == expected.shape
    assert table.shape[1:3] == (1, 1)
    assert torch.equal(table, expected), f"max difference {(table - expected).abs().max()}"


def test_rotary_position_embedding_interpolation_rules():
    """The cases above exercise what they claim: interpolation only with both settings, the
    fixed factor up to ``pretrained * factor`` positions, the dynamic one beyond."""
    def rate0(module, n):  # angle of the rate-1 channel = the (scaled) position
        return module(n)[:, 0, 0, 0].cpu()

    plain = RotaryPositionEmbedding(16)
    for only in (dict(seq_len_interpolation_factor=4), dict(pretrained_max_position_embeddings=4)):
        assert torch.equal(RotaryPositionEmbedding(16, **only)(24), plain(24))
    both = RotaryPositionEmbedding(16, seq_len_interpolation_factor=4,
                                   pretrained_max_position_embeddings=8)
    assert torch.allclose(rate0(both, 32), torch.arange(32.0) / 4)
    assert torch.allclose(rate0(both, 40), torch.arange(40.0) * 8 / 40)


def test_rotary_position_embedding_layout_and_module():
    module = RotaryPositionEmbedding(16, interleaved=True)
    assert isinstance(module, torch.nn.Module)
    assert dict(module.named_buffers()).keys() == {"inv_freq"}
    assert "inv_freq" in module.state_dict()
    assert module.inv_freq.dtype == torch.float32 and module.inv_freq.shape == (8,)
    table = module(6)
    assert torch.equal(table[..., 0::2], table[..., 1::2]), "interleaved: [a0, a0, a1, a1, ...]"
    halves = RotaryPositionEmbedding(16)(6)
    assert torch.equal(halves[..., :8], halves[..., 8:]), "[a, a]"
    assert torch.equal(halves[..., :8], table[..., 0::2])
    assert (module.seq_len_interpolation_factor, module.pretrained_max_position_embeddings,
            module.rotary_base, module.interleaved) == (None, None, 10000.0, True)


def test_rotary_position_embedding_ignores_autocast():
    module = RotaryPositionEmbedding(64, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=64)
    expected = module(200, offset=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table = module(200, offset=5)
    assert table.dtype == torch.float32
    assert torch.equal(table, expected)


def test_rotary_position_embedding_device(monkeypatch):
    """``inv_freq`` is made on the current CUDA device when CUDA is available (TE's
    placement) and on the CPU otherwise; ``.to`` moves it, and the table follows it."""
    made_on = []
    real = compat.inverse_frequencies

    def spy(dim, base, *, device=None):
        made_on.append(device)
        return real(dim, base)  # on the CPU whatever was asked: this machine may have no CUDA

    monkeypatch.setattr(compat, "inverse_frequencies", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    RotaryPositionEmbedding(16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    RotaryPositionEmbedding(16)
    # an int device is a CUDA index, as torch.cuda.current_device() returns it
    devices = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in made_on]
    assert devices == [torch.device("cuda", 3), torch.device("cpu")]
    monkeypatch.undo()
    module = RotaryPositionEmbedding(16).to("meta")
    assert module.inv_freq.device.type == "meta"
    assert module(5).device.type == "meta" and module(5).shape == (5, 1, 1, 16)


@pytest.mark.parametrize("make, message", [
    (lambda: RotaryPositionEmbedding(16, rotary_base=0.0), "^rotary_base must be .*got 0.0"),
    (lambda: RotaryPositionEmbedding(16, rotary_base=-2), "^rotary_base must be .*got -2"),
    (lambda: RotaryPositionEmbedding(16)(-1), "^max_seq_len must be .*got -1"),
    (lambda: RotaryPositionEmbedding(16)(5.5, offset=2), "^max_seq_len must be .*got 5.5"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=4)("8"),
     "^max_seq_len must be .*got '8'"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=4)(None),
     "^max_seq_len must be .*got None"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=0,
                                     pretrained_max_position_embeddings=4),
     "^seq_len_interpolation_factor must be .*got 0"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=-2,
                                     pretrained_max_position_embeddings=4),
     "^seq_len_interpolation_factor must be .*got -2"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor="2",
                                     pretrained_max_position_embeddings=4),
     "^seq_len_interpolation_factor must be .*got '2'"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=0),
     "^pretrained_max_position_embeddings must be .*got 0"),
    (lambda: RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=-4),
     "^pretrained_max_position_embeddings must be .*got -4"),
    (lambda: RotaryPositionEmbedding(128, rotary_percent=0.0),
     r"^the rotary dim int\(dim \* rotary_percent\) = int\(128 \* 0.0\) must be .*got 0"),
    (lambda: RotaryPositionEmbedding(128, rotary_percent=-0.5),
     r"^the rotary dim int\(dim \* rotary_percent\) = int\(128 \* -0.5\) must be .*got -64"),
])
def test_rotary_position_embedding_errors_name_tes_arguments(make, message):
    """A bad rotary_base or max_seq_len is refused under TE's names, not those of the table
    functions the module calls (base, length)."""
    with pytest.raises(rd.RoPEError, match=message):
        make()


def test_table_feeds_apply_rotary_pos_emb():
    """The two halves of the API together, as a TE model uses them."""
    module = RotaryPositionEmbedding(HEAD_DIM, rotary_percent=2 / 3, interleaved=True)
    t = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM)
    freqs = module(SEQ + MARGIN).to(t.device)
    out = apply_rotary_pos_emb(t, freqs, interleaved=True)
    assert_matches(out, te_formula(t, freqs, interleaved=True), torch.float32)
    assert torch.equal(out[..., 8:], t[..., 8:]), "channels past rotary_percent pass through"


# --- against the installed TransformerEngine (GPU machine) ------------------------------------

def _te_rope():
    pytest.importorskip("transformer_engine.pytorch", reason="TransformerEngine is not installed")
    from transformer_engine.pytorch.attention import rope

    return rope


@gpu
@pytest.mark.parametrize("name", sorted(TE_SIGNATURES))
def test_signature_equals_installed_te(name):
    assert parameters_of(compat, name) == parameters_of(_te_rope(), name)


@gpu
@pytest.mark.parametrize("name", sorted(RPE_CASES))
def test_rotary_position_embedding_bitwise_equals_te(name):
    te = _te_rope()
    init, call = RPE_CASES[name]
    ours, theirs = RotaryPositionEmbedding(**init), te.RotaryPositionEmbedding(**init)
    assert ours.inv_freq.device == theirs.inv_freq.device
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    for n, offset in ((call["max_seq_len"], call.get("offset", 0)), (4096, 0), (300, 17)):
        assert torch.equal(ours(n, offset), theirs(n, offset)), (name, n, offset)


@gpu
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("with_starts", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_equals_te_fused(tensor_format, cp_size, with_starts, interleaved, dtype):
    te = _te_rope()
    torch.manual_seed(0)
    module = te.RotaryPositionEmbedding(128, rotary_percent=0.5, interleaved=interleaved)
    if tensor_format == "thd":
        lengths = [400, 140, 172, 16, 24, 520, 156, 24, 504, 88]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        t = torch.rand(int(cu[-1]) // cp_size, 8, 128, dtype=dtype, device="cuda")
        starts = torch.randint(0, 10, (len(lengths),), dtype=torch.int32, device="cuda")
    else:
        cu = None
        shape = (246, 2, 8, 128) if tensor_format == "sbhd" else (2, 246, 8, 128)
        t = torch.rand(shape, dtype=dtype, device="cuda")
        starts = torch.randint(0, 10, (2,), dtype=torch.int32, device="cuda")
    starts = starts if with_starts else None
    freqs = module(1024)
    t.requires_grad_(True)
    for cp_rank in range(cp_size):
        kwargs = dict(tensor_format=tensor_format, start_positions=starts, interleaved=interleaved,
                      cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
        ours = apply_rotary_pos_emb(t, freqs, **kwargs)
        theirs = te.apply_rotary_pos_emb(t, freqs, fused=True, **kwargs)
        grad_out = torch.rand_like(ours)
        (our_grad,) = torch.autograd.grad(ours, t, grad_out)
        (their_grad,) = torch.autograd.grad(theirs, t, grad_out)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(our_grad, their_grad)
        assert ours.is_contiguous()


@gpu
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_equals_te_fused(tensor_format, cp_size, interleaved, dtype):
    """Forward and packed backward against TE's fused qkv, every rank; with start positions
    (cp_size 1) the forward only, as TE's own test (TE's backward ignores them)."""
    te = _te_rope()
    torch.manual_seed(0)
    hidden = 64
    s_b = (128, 2) if tensor_format == "sbhd" else (2, 128)
    qkv = torch.rand(*s_b, 8, hidden * 6, dtype=dtype, device="cuda", requires_grad=True)
    q_freqs = te.RotaryPositionEmbedding(hidden, 0.5, interleaved=interleaved)(128 * cp_size + 10)
    k_freqs = te.RotaryPositionEmbedding(hidden, 0.5, rotary_base=500.0,
                                         interleaved=interleaved)(128 * cp_size + 10)
    split = [hidden * 4, hidden, hidden]
    for cp_rank in range(cp_size):
        kwargs = dict(tensor_format=tensor_format, interleaved=interleaved, cp_size=cp_size,
                      cp_rank=cp_rank)
        ours = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, **kwargs)
        theirs = te.apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, **kwargs)
        assert [o.shape for o in ours] == [o.shape for o in theirs]
        grads = [torch.rand_like(o) for o in ours]
        (our_grad,) = torch.autograd.grad(ours, qkv, grads)
        (their_grad,) = torch.autograd.grad(theirs, qkv, grads)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(our_grad, their_grad)
    if cp_size == 1:
        starts = torch.randint(0, 10, (2,), dtype=torch.int32, device="cuda")
        with torch.no_grad():
            ours = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, tensor_format,
                                                  starts, interleaved)
            theirs = te.apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split,
                                                       tensor_format, starts, interleaved)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)


@gpu
@pytest.mark.parametrize("name", sorted(MIRRORED))
def test_mirrored_asserts_are_te_asserts(name):
    """TE itself refuses exactly what the adapter refuses."""
    te = _te_rope()
    adapter_args, _, _ = MIRRORED[name]
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x
              for x in _qkv_inputs("thd" if name == "thd" else "sbhd")]
    args = [x.cuda() if isinstance(x, torch.Tensor) else x for x in adapter_args(*inputs)]
    with pytest.raises(AssertionError):
        te.apply_fused_qkv_rotary_pos_emb(*args)
    with pytest.raises(rd.RoPEError):
        apply_fused_qkv_rotary_pos_emb(*args)
