"""Index values the host does not read (device tensors outside strict mode): no sync, never
silently wrong. A token whose position falls outside the table gets NaN in its rotated channels
from every backend that guards its reads; the TE backend, which cannot, refuses such calls.

On the CPU values are always read, so these tests make ``call._reads`` answer as it does for a
device tensor outside strict mode.
"""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from reference import reference_for
from rope_dispatch import call as call_module
from rope_dispatch.backends.te import TEBackend, TEInfo, te_reasons

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the compiled triton backend runs on CUDA, else the interpreter


@pytest.fixture
def unread(monkeypatch):
    """Index tensors' values stay unread, as on a GPU by default."""
    monkeypatch.setattr(call_module, "_reads", lambda index: False)


def _expect_nan_rows(out, t, freqs, spec, starts, bad):
    """Rows flagged in ``bad`` are NaN in the rotated channels (pass-through kept); every other
    row equals the reference computed with the table extended by rows no valid token reads."""
    d2 = freqs.shape[-1]
    assert torch.isnan(out[bad][..., :d2]).all()
    assert torch.equal(out[bad][..., d2:], t[bad][..., d2:])
    extended = torch.cat((freqs, torch.rand(16, d2) * 10))
    ref = reference_for(t, extended, spec, starts)
    good = ~bad
    assert not torch.isnan(out[good]).any()
    torch.testing.assert_close(out[good].double(), ref[good], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_start_past_the_table_gives_nan_rows(unread, backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    t = torch.randn(6, 3, 2, 8)  # sbhd: s 6, b 3
    freqs = torch.rand(10, 8) * 10
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", rotary_dim=6 if backend == "eager" else None)
    freqs = (freqs[:, : spec.rotary_dim] if spec.rotary_dim else freqs).contiguous()
    starts = torch.tensor([0, 7, 4])  # batch 1 needs rows 7..12 of 10; batch 2 fits (4..9)
    on = dict(device=DEVICE)
    call = rd.check_call(t.to(**on), freqs.to(**on), spec, starts.to(**on))
    assert not call.positions_bounded
    out = rd.apply(t.to(**on), freqs.to(**on), spec, start_positions=starts.to(**on),
                   backend=backend).cpu()
    bad = torch.zeros(6, 3, dtype=torch.bool)
    bad[3:, 1] = True  # positions 10, 11, 12 of batch 1
    _expect_nan_rows(out, t, freqs, spec, starts, bad)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_thd_sequence_longer_than_the_table_gives_nan_rows(unread, backend, request):
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    t = torch.randn(9, 2, 8)
    freqs = torch.rand(5, 8) * 10
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE))
    # sequence 1 has 7 tokens, the table 5 rows
    out = rd.apply(t.to(DEVICE), freqs.to(DEVICE), spec, backend=backend).cpu()
    d2 = 8
    assert torch.isnan(out[7:]).all() and not torch.isnan(out[:7]).any()
    full = torch.cat((freqs, torch.rand(2, 8)))
    ref = reference_for(t, full, spec.with_cu_seqlens(torch.tensor([0, 2, 9])))
    torch.testing.assert_close(out[:7].double(), ref[:7], rtol=1e-5, atol=1e-5)
    assert out.shape[-1] == d2


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_thd_tokens_past_the_last_offset_give_nan_rows(unread, backend, request):
    """Padding after the last sequence belongs to no sequence: its rows are NaN, not rotated
    as if the last sequence went on."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    t = torch.randn(10, 2, 8)
    freqs = torch.rand(16, 8) * 10
    cu = torch.tensor([0, 3, 7])
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu.to(DEVICE))
    out = rd.apply(t.to(DEVICE), freqs.to(DEVICE), spec, backend=backend).cpu()
    assert torch.isnan(out[7:]).all() and not torch.isnan(out[:7]).any()
    ref = reference_for(t[:7], freqs, spec.with_cu_seqlens(cu))
    torch.testing.assert_close(out[:7].double(), ref, rtol=1e-5, atol=1e-5)


def test_te_refuses_positions_it_cannot_bound(unread):
    def fake(t, freqs, **kwargs):
        return t

    info = TEInfo("2.20.2", (2, 20, 2), "fake", fake, frozenset(
        ["t", "freqs", "tensor_format", "start_positions", "interleaved", "fused", "cu_seqlens",
         "cp_size", "cp_rank"]))
    starts = rd.check_call(torch.randn(4, 2, 1, 8), torch.rand(8, 8),
                           rd.RoPESpec(layout="sbhd", dtype="fp32"), torch.tensor([0, 1]))
    (reason,) = te_reasons(starts, info)
    assert "start_positions on the GPU are not read" in reason and "ROPE_DISPATCH_CHECK_VALUES=1" in reason
    cu = torch.tensor([0, 3, 8])
    thd = rd.check_call(torch.randn(8, 1, 8), torch.rand(8, 8),
                        rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu))
    (reason,) = te_reasons(thd, info)
    assert "cu_seqlens on the GPU" in reason and "max_seqlen" in reason
    promised = rd.check_call(torch.randn(8, 1, 8), torch.rand(8, 8),
                             rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, max_seqlen=5))
    assert promised.positions_bounded and te_reasons(promised, info) == []
    assert TEBackend(load=lambda: info).available


def test_decisions_follow_whether_positions_are_bounded(monkeypatch):
    """A decision taken for a call whose values were read is not reused once they are not:
    a backend that cannot guard its reads must not be picked from the memo."""
    from rope_dispatch.registry import Backend, register, unregister

    class Unguarded(Backend):
        name = "unguarded"
        priority = 100

        def extra_reasons(self, call):
            return [] if call.positions_bounded else ["positions unbounded"]

        def apply(self, call):
            return call.t.clone()

    register(Unguarded())
    try:
        t, freqs = torch.randn(4, 2, 1, 8), torch.rand(12, 8)
        spec, starts = rd.RoPESpec(layout="sbhd", dtype="fp32"), torch.tensor([0, 3])
        assert rd.explain(t, freqs, spec, start_positions=starts).chosen == "unguarded"
        rd.apply(t, freqs, spec, start_positions=starts)  # decided and remembered
        monkeypatch.setattr(call_module, "_reads", lambda index: False)
        call = rd.check_call(t, freqs, spec, starts)
        assert rd.dispatch.choose(call).name != "unguarded"
    finally:
        unregister("unguarded")


def test_strict_mode_reads_device_values(monkeypatch):
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")
    assert call_module._strict_values()
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "0")
    assert not call_module._strict_values()
    monkeypatch.delenv("ROPE_DISPATCH_CHECK_VALUES")
    assert not call_module._strict_values()  # the default: no sync
    for on in ("true", " ON ", "yes", "True"):  # the spellings ROPE_AUTOTUNE takes
        monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", on)
        assert call_module._strict_values(), on
    for off in ("false", "Off", "no", "", " 0"):
        monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", off)
        assert not call_module._strict_values(), off
    for bad in ("2", "enabled", "strict"):  # neither on nor off: refused, not read as off
        monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", bad)
        with pytest.raises(rd.RoPEError, match=f"ROPE_DISPATCH_CHECK_VALUES must be .*'{bad}'"):
            call_module._strict_values()


@pytest.mark.gpu
def test_no_host_sync_with_device_index_tensors():
    """Every apply path with device index tensors runs under sync-debug mode 'error' once
    warmed up: no device-to-host copy per call."""
    t = torch.randn(16, 4, 2, 64, device="cuda")
    freqs = torch.rand(64, 64, device="cuda")
    starts = torch.tensor([0, 3, 9, 1], device="cuda")
    cu = torch.tensor([0, 10, 24, 64], device="cuda", dtype=torch.int32)
    packed = torch.randn(32, 2, 64, device="cuda")
    sbhd = rd.RoPESpec(layout="sbhd", dtype="fp32", cp_size=2, cp_rank=1)
    thd = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, cp_size=2, cp_rank=0)
    from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

    tokens = torch.randint(0, 64, (32,), device="cuda")
    q, k = torch.randn(32, 4, 64, device="cuda"), torch.randn(32, 2, 64, device="cuda")
    cache = torch.rand(64, 64, device="cuda")
    plain_thd = rd.RoPESpec(layout="thd", dtype="fp32")
    calls = [
        lambda: rd.apply(t, freqs, sbhd, start_positions=starts),
        lambda: rd.apply(packed, freqs, thd, start_positions=starts[:3]),
        lambda: rd.apply_(t.clone(), freqs, sbhd, start_positions=starts),
        lambda: rd.apply_qkv(torch.randn(16, 4, 2, 192, device="cuda"), freqs, sbhd, (64, 64, 64),
                             start_positions=starts),
        lambda: rd.apply(q, freqs, plain_thd, positions=tokens),
        lambda: rd.apply_qk(q, k, freqs, plain_thd, positions=tokens),
        lambda: rd.apply_qk_(q, k, rd.PairCosSinCache(cache), plain_thd, positions=tokens),
        lambda: apply_rope_with_cos_sin_cache_inplace(tokens, q.flatten(1), k.flatten(1), 64, cache),
    ]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in calls:
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_start_positions():
    t = torch.randn(8, 4, 2, 64, device="cuda")
    freqs = torch.rand(64, 64, device="cuda")
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    starts = torch.zeros(4, dtype=torch.int64, device="cuda")
    rd.apply(t, freqs, spec, start_positions=starts, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rd.apply(t, freqs, spec, start_positions=starts, backend="triton")
    for values in ([0, 1, 2, 3], [50, 7, 0, 56]):
        starts.copy_(torch.tensor(values))
        graph.replay()
        torch.testing.assert_close(out.cpu().double(), reference_for(t.cpu(), freqs.cpu(), spec, starts.cpu()),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_replays_q_and_k_with_new_positions():
    """A serving step captured once: q and k rotated in place from a pair cache at per-token
    positions; replays with new positions (and new q, k contents) give the reference's numbers."""
    from reference import reference_for

    q, k = torch.randn(16, 4, 64, device="cuda"), torch.randn(16, 2, 64, device="cuda")
    pair = torch.rand(128, 32, dtype=torch.float64) * 30
    cache = rd.PairCosSinCache(torch.cat((pair.cos(), pair.sin()), -1).float().cuda())
    angles = torch.cat((pair, pair), -1).float()
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    positions = torch.zeros(16, dtype=torch.int64, device="cuda")
    rd.apply_qk_(q, k, cache, spec, positions=positions, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rd.apply_qk_(q, k, cache, spec, positions=positions, backend="triton")
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        q0, k0 = torch.randn(16, 4, 64, generator=gen), torch.randn(16, 2, 64, generator=gen)
        new = torch.randint(0, 128, (16,), generator=gen)
        q.copy_(q0)
        k.copy_(k0)
        positions.copy_(new)
        graph.replay()
        torch.testing.assert_close(q.cpu().double(), reference_for(q0, angles, spec, positions=new),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k.cpu().double(), reference_for(k0, angles, spec, positions=new),
                                   rtol=1e-5, atol=1e-5)
