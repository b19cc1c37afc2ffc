"""rope_dispatch.cp: zigzag indices, shard/unshard, pad_cu_seqlens and their errors, checked
against tests/reference.py's independent ``global_position`` and Python arithmetic; and the tie
to the library: RoPE of a rank's shard with ``cp_size``/``cp_rank`` is the shard of RoPE of the
full sequence, forward and backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rope_dispatch as rd
from reference import global_position
from rope_dispatch import cp

cp_sizes = st.integers(1, 4)


def expected_index(seq_len: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global index of each local token, from the reference's definition of the split."""
    local = seq_len // cp_size
    return [global_position(i, local, cp_size, cp_rank) for i in range(local)]


def expected_thd_index(lengths: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Global token of each local token of a packed batch: sequence by sequence."""
    out, start = [], 0
    for n in lengths:
        out += [start + p for p in expected_index(n, cp_size, cp_rank)]
        start += n
    return out


def offsets(lengths: list[int], dtype=torch.int32) -> torch.Tensor:
    total, cu = 0, [0]
    for n in lengths:
        total += n
        cu.append(total)
    return torch.tensor(cu, dtype=dtype)


@st.composite
def padded_lengths(draw, cp_size: int) -> list[int]:
    """Ragged global sequence lengths, each a multiple of 2*cp_size; zero-length ones included."""
    return [2 * cp_size * n for n in draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))]


# --- zigzag_index ---------------------------------------------------------------------------


def test_zigzag_index_literal():
    """Written out by hand: 8 tokens over 2 ranks, 12 over 3."""
    assert [cp.zigzag_index(8, 2, r).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [cp.zigzag_index(12, 3, r).tolist() for r in range(3)] == [
        [0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7],
    ]
    assert cp.zigzag_index(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_sizes_take_numpy_integers():
    """Sizes and ranks as NumPy integers, as RoPESpec takes them; bools are still refused."""
    np = pytest.importorskip("numpy")
    assert cp.zigzag_index(np.int64(8), np.int32(2), np.int64(1)).tolist() == [2, 3, 4, 5]
    x = torch.arange(8.0).reshape(8, 1, 1, 1)
    assert cp.shard(x, "sbhd", np.int64(2), np.int64(0)).flatten().tolist() == [0, 1, 6, 7]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cp.pad_cu_seqlens(cu, np.int64(2)).tolist() == cp.pad_cu_seqlens(cu, 2).tolist()
    with pytest.raises(rd.RoPEError, match="cp_size must be an integer"):
        cp.zigzag_index(8, True, 0)


@given(cp_size=cp_sizes, chunk=st.integers(0, 6), data=st.data())
def test_zigzag_index_matches_reference(cp_size, chunk, data):
    cp_rank = data.draw(st.integers(0, cp_size - 1))
    seq_len = 2 * cp_size * chunk
    index = cp.zigzag_index(seq_len, cp_size, cp_rank)
    assert index.dtype == torch.int64 and index.device.type == "cpu"
    assert index.tolist() == expected_index(seq_len, cp_size, cp_rank)


@given(cp_size=cp_sizes, chunk=st.integers(0, 6))
def test_ranks_tile_the_sequence_once(cp_size, chunk):
    seq_len = 2 * cp_size * chunk
    held = [i for r in range(cp_size) for i in cp.zigzag_index(seq_len, cp_size, r).tolist()]
    assert sorted(held) == list(range(seq_len))


def test_zigzag_index_device_argument():
    assert cp.zigzag_index(8, 2, 1, device="meta").device.type == "meta"


# --- shard / unshard ------------------------------------------------------------------------


@given(
    layout=st.sampled_from(["sbhd", "bshd"]), cp_size=cp_sizes, chunk=st.integers(0, 4),
    trailing=st.lists(st.integers(1, 3), max_size=2), seed=st.integers(0, 2**16),
)
def test_shard_unshard_dense(layout, cp_size, chunk, trailing, seed):
    seq_len = 2 * cp_size * chunk
    shape = (seq_len, 2, *trailing) if layout == "sbhd" else (2, seq_len, *trailing)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    dim = 0 if layout == "sbhd" else 1
    parts = [cp.shard(x, layout, cp_size, r) for r in range(cp_size)]
    for r, part in enumerate(parts):
        want = torch.stack(
            [x.select(dim, g) for g in expected_index(seq_len, cp_size, r)], dim
        ) if seq_len else x.narrow(dim, 0, 0)
        assert torch.equal(part, want), r
    assert torch.equal(cp.unshard(parts, layout), x)


@given(cp_size=cp_sizes, data=st.data(), trailing=st.lists(st.integers(1, 3), max_size=2),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_shard_unshard_thd(cp_size, data, trailing, dtype):
    lengths = data.draw(padded_lengths(cp_size))
    total = sum(lengths)
    # token k holds the value k in every trailing position
    x = torch.arange(total, dtype=torch.float64).reshape(total, *[1] * len(trailing))
    x = x.expand(total, *trailing)
    cu = offsets(lengths, dtype)
    parts = [cp.shard(x, "thd", cp_size, r, cu_seqlens=cu) for r in range(cp_size)]
    for r, part in enumerate(parts):
        want = torch.tensor(expected_thd_index(lengths, cp_size, r), dtype=torch.float64)
        assert torch.equal(part, want.reshape(-1, *[1] * len(trailing)).expand_as(part)), r
        assert part.shape == (total // cp_size, *trailing)
    assert torch.equal(cp.unshard(parts, "thd", cu_seqlens=cu), x)


def test_shard_thd_with_an_empty_sequence():
    """Lengths 4, 0, 8 over 2 ranks (chunks of 1, -, 2); the empty sequence holds no token."""
    cu = torch.tensor([0, 4, 4, 12])
    x = torch.arange(12)
    assert cp.shard(x, "thd", 2, 0, cu_seqlens=cu).tolist() == [0, 3, 4, 5, 10, 11]
    assert cp.shard(x, "thd", 2, 1, cu_seqlens=cu).tolist() == [1, 2, 6, 7, 8, 9]


def test_shard_is_differentiable():
    """The gradient of a shard lands on the held tokens only, each exactly once."""
    x = torch.randn(12, 3, requires_grad=True)
    w = torch.randn(4, 3)
    (grad,) = torch.autograd.grad((cp.shard(x, "sbhd", 3, 1) * w).sum(), x)
    want = torch.zeros(12, 3)
    for i, g in enumerate(expected_index(12, 3, 1)):
        want[g] = w[i]
    assert torch.equal(grad, want)


def test_unshard_is_differentiable():
    parts = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
    w = torch.randn(2, 8)
    grads = torch.autograd.grad((cp.unshard(parts, "bshd") * w).sum(), parts)
    for r in range(2):
        assert torch.equal(grads[r], w[:, expected_index(8, 2, r)])


def test_shard_keeps_device_and_strides_of_a_view():
    base = torch.randn(8, 2, 6, 4)
    q = base[:, :, 2:4]  # a non-contiguous view, as a qkv split makes
    assert torch.equal(cp.shard(q, "sbhd", 2, 1), q[[2, 3, 4, 5]])


# --- pad_cu_seqlens -------------------------------------------------------------------------


def test_pad_cu_seqlens_literal():
    cu = torch.tensor([0, 3, 8, 8, 9], dtype=torch.int32)
    padded = cp.pad_cu_seqlens(cu, 2)
    assert padded.dtype == torch.int32 and padded.tolist() == [0, 4, 12, 12, 16]
    assert cp.pad_cu_seqlens(cu.long(), 1).dtype == torch.int64
    assert cp.pad_cu_seqlens(cu.long(), 1).tolist() == [0, 4, 10, 10, 12]  # 3,5,0,1 -> 4,6,0,2


@given(cp_size=cp_sizes, lengths=st.lists(st.integers(0, 20), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_pad_cu_seqlens_rounds_each_length_up(cp_size, lengths, dtype):
    m = 2 * cp_size
    padded = cp.pad_cu_seqlens(offsets(lengths, dtype), cp_size)
    assert padded.dtype == dtype
    assert padded.tolist() == offsets([-(-n // m) * m for n in lengths]).tolist()


# --- errors ---------------------------------------------------------------------------------

X = torch.zeros(8, 2, 1, 4)
CU = torch.tensor([0, 4, 12])


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: cp.zigzag_index(10, 2, 0), ["seq_len=10", "2*cp_size=4"]),
        (lambda: cp.zigzag_index(-2, 1, 0), ["seq_len", "-2"]),
        (lambda: cp.zigzag_index(8, 2, 2), ["cp_rank", "cp_size=2", "got 2"]),
        (lambda: cp.zigzag_index(8, 2, -1), ["cp_rank", "-1"]),
        (lambda: cp.zigzag_index(8, 0, 0), ["cp_size", ">= 1", "got 0"]),
        (lambda: cp.zigzag_index(8, 2.0, 0), ["cp_size", "2.0"]),
        (lambda: cp.shard(X, "hsbd", 2, 0), ["layout", "'hsbd'", "sbhd"]),
        (lambda: cp.shard(X, "sbhd", 2, 5), ["cp_rank", "5"]),
        (lambda: cp.shard(X, "sbhd", 0, 0), ["cp_size", "0"]),
        (lambda: cp.shard(X, "bshd", 2, 0), ["sequence length 2", "dim 1", "2*cp_size=4"]),
        (lambda: cp.shard(X, "sbhd", 2, 0, cu_seqlens=CU), ["cu_seqlens", "only", "thd"]),
        (lambda: cp.shard([1, 2], "sbhd", 1, 0), ["x", "torch.Tensor", "list"]),
        (lambda: cp.shard(torch.zeros(4), "bshd", 1, 0), ["x", "2 dims", "(4,)"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0), ["thd", "cu_seqlens"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0, cu_seqlens=torch.tensor([0, 6, 12])),
         ["sequence 0", "length 6", "2*cp_size=4"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0, cu_seqlens=torch.tensor([0, 4, 10, 14])),
         ["sequence 1", "length 6"]),
        (lambda: cp.shard(torch.zeros(10), "thd", 2, 0, cu_seqlens=CU),
         ["x has 10 tokens", "cu_seqlens[-1]=12"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0, cu_seqlens=torch.tensor([4, 8, 12])),
         ["cu_seqlens", "start at 0", "4"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0, cu_seqlens=torch.tensor([0, 8, 4, 12])),
         ["non-decreasing", "cu_seqlens[2]=4"]),
        (lambda: cp.shard(torch.zeros(12), "thd", 2, 0, cu_seqlens=torch.tensor([0.0, 12.0])),
         ["cu_seqlens", "int32", "float32"]),
        (lambda: cp.unshard([], "sbhd"), ["parts", "non-empty", "empty sequence"]),
        (lambda: cp.unshard(X, "sbhd"), ["parts", "Tensor"]),
        (lambda: cp.unshard([X, X[:4]], "sbhd"), ["parts[1]", "(4, 2, 1, 4)", "(8, 2, 1, 4)"]),
        (lambda: cp.unshard([X, X.double()], "sbhd"), ["parts[1]", "float64", "float32"]),
        (lambda: cp.unshard([X[:3], X[:3]], "sbhd"), ["length 3", "even", "cp_size=2"]),
        (lambda: cp.unshard([X, X], "thd"), ["thd", "cu_seqlens"]),
        (lambda: cp.unshard([X[:4], X[:4]], "thd", cu_seqlens=CU),
         ["4 tokens each", "cu_seqlens[-1]=12"]),
        (lambda: cp.unshard([X, X], "bhsd"), ["layout", "'bhsd'"]),
        (lambda: cp.shard(X, ["sbhd"], 2, 0), ["layout", "['sbhd']"]),
        (lambda: cp.unshard([X, X], {"sbhd": 0}), ["layout", "{'sbhd': 0}"]),
        (lambda: cp.pad_cu_seqlens(CU, 0), ["cp_size", "0"]),
        (lambda: cp.pad_cu_seqlens(CU.float(), 2), ["cu_seqlens", "float32"]),
        (lambda: cp.pad_cu_seqlens(torch.tensor([0, 5, 3]), 2), ["non-decreasing", "3"]),
        (lambda: cp.pad_cu_seqlens(torch.tensor([[0, 5]]), 2), ["cu_seqlens", "1-D", "(1, 2)"]),
        (lambda: cp.gather(X, "sbhd"), ["gather", "torch.distributed", "init_process_group"]),
        (lambda: cp.gather(X, "zzz"), ["layout", "'zzz'"]),
    ],
)
def test_errors_name_the_argument(make, words):
    with pytest.raises(rd.RoPEError) as info:
        make()
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --- the tie to rd.apply's context-parallel semantics ---------------------------------------


@st.composite
def cp_calls(draw):
    layout = draw(st.sampled_from(["sbhd", "bshd", "thd"]))
    cp_size = draw(cp_sizes)
    if layout == "thd":
        lengths = draw(padded_lengths(cp_size))
        if sum(lengths) == 0:
            lengths[-1] = 2 * cp_size
        batch = len(lengths)
    else:
        lengths = [2 * cp_size * draw(st.integers(1, 3))]
        batch = draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 12]))
    return dict(
        layout=layout, cp_size=cp_size, lengths=lengths, batch=batch, heads=draw(st.integers(1, 2)),
        head_dim=d, rotary_dim=2 * draw(st.integers(1, d // 2)), interleaved=draw(st.booleans()),
        starts=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(cp_calls())
def test_rope_of_a_shard_is_the_shard_of_rope(call):
    """For every rank: apply(shard(x), cp spec) == shard(apply(x, no-cp spec)), and the input
    gradient for upstream shard(g) is shard of the full input gradient for g."""
    layout, cp_size, dtype = call["layout"], call["cp_size"], call["dtype"]
    gen = torch.Generator().manual_seed(call["seed"])
    h, d, b = call["heads"], call["head_dim"], call["batch"]
    cu = None
    if layout == "thd":
        cu = offsets(call["lengths"])
        shape = (int(cu[-1]), h, d)
    else:
        s = call["lengths"][0]
        shape = (s, b, h, d) if layout == "sbhd" else (b, s, h, d)
    starts = torch.randint(0, 5, (b,), generator=gen) if call["starts"] else None
    rows = max(call["lengths"]) + (int(starts.max()) if starts is not None else 0) + 2
    freqs = (torch.rand(rows, 1, 1, call["rotary_dim"], generator=gen) * 40 - 20)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(shape, generator=gen).to(dtype)
    fields = dict(layout=layout, dtype=dtype, interleaved=call["interleaved"], cu_seqlens=cu)
    full = rd.apply(x, freqs, rd.RoPESpec(**fields), start_positions=starts, backend="eager")
    (full_grad,) = torch.autograd.grad(full, x, g)

    def part(t, r):
        return cp.shard(t, layout, cp_size, r, cu_seqlens=cu)

    for r in range(cp_size):
        spec = rd.RoPESpec(**fields, cp_size=cp_size, cp_rank=r)
        local = part(x.detach(), r).requires_grad_(True)
        out = rd.apply(local, freqs, spec, start_positions=starts, backend="eager")
        (grad,) = torch.autograd.grad(out, local, part(g, r))
        torch.testing.assert_close(out, part(full.detach(), r), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, part(full_grad, r), rtol=1e-6, atol=1e-6)
