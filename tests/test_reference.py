"""The float64 reference itself, checked against other formulations of RoPE."""

from __future__ import annotations

import math

import torch

from reference import global_position, reference_positions, reference_rope


def test_quarter_turn_by_hand():
    x = torch.tensor([[[1.0, 0.0, 5.0]]])  # [T=1, H=1, D=3]; channel 2 passes through
    angles = torch.tensor([[math.pi / 2, math.pi / 2]])
    out = reference_rope(x, angles, torch.tensor([0]), interleaved=False)
    torch.testing.assert_close(out, torch.tensor([[[0.0, 1.0, 5.0]]], dtype=torch.float64))


def test_duplicated_table_is_complex_multiplication():
    """With TE's duplicated halves, NeoX RoPE multiplies (x_k + i x_{k+h}) by e^{i theta_k};
    interleaved multiplies (x_{2k} + i x_{2k+1})."""
    torch.manual_seed(0)
    T, H, D = 5, 2, 8
    x = torch.randn(T, H, D, dtype=torch.float64)
    theta = torch.rand(T, D // 2, dtype=torch.float64) * 10
    pos = torch.arange(T)
    rot = torch.polar(torch.ones_like(theta), theta)[:, None, :]
    neox = reference_rope(x, torch.cat((theta, theta), -1), pos, interleaved=False)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * rot
    torch.testing.assert_close(neox, torch.cat((z.real, z.imag), -1))
    inter = reference_rope(x, theta.repeat_interleave(2, -1), pos, interleaved=True)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * rot
    torch.testing.assert_close(inter, torch.stack((z.real, z.imag), -1).flatten(-2))


def test_context_parallel_ranks_tile_the_sequence():
    """Across all ranks, the local positions cover 0..L*cp-1 exactly once (zigzag)."""
    for cp in (1, 2, 4):
        L = 6
        seen = sorted(global_position(i, L, cp, r) for r in range(cp) for i in range(L))
        assert seen == list(range(L * cp))
    assert [global_position(i, 4, 2, 0) for i in range(4)] == [0, 1, 6, 7]
    assert [global_position(i, 4, 2, 1) for i in range(4)] == [2, 3, 4, 5]


def test_thd_positions_restart_per_sequence():
    pos = reference_positions("thd", (7, 1, 2), cu_seqlens=[0, 3, 3, 7], start_positions=[10, 0, 2])
    assert pos.tolist() == [10, 11, 12, 2, 3, 4, 5]


def test_packaged_reference_agrees_with_test_reference():
    """rope_dispatch.reference (used by the selftest) against this directory's reference."""
    from hypothesis import given

    import rope_dispatch as rd
    from cases import build, cases
    from reference import reference_for
    from rope_dispatch.reference import reference_apply

    @given(cases())
    def check(case):
        t, table, spec, starts, angles = build(case, requires_grad=False)
        call = rd.check_call(t, table, spec, starts)
        packaged = reference_apply(call, t)
        if case.use_cache:
            assert (packaged - reference_for(t, angles, spec, starts)).abs().max() < 1e-6
        else:
            torch.testing.assert_close(packaged, reference_for(t, angles, spec, starts), rtol=0, atol=1e-12)

    check()
