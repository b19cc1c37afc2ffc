"""The metadata guards that let a repeated call reuse a plan: both kinds (torch's C++ tensor
guards and the Python fallback) accept tensors laid out as the ones they were made from, whatever
their data, and refuse every difference a plan depends on."""

from __future__ import annotations

import pytest
import torch

from rope_dispatch import guards

KINDS = {"torch": guards._torch_guard, "python": guards.metadata_guard}


def test_the_installed_torch_gets_the_c_guards():
    """The fast kind is the one in use with the torch CI installs; if a torch release changes
    the private class, this names the fallback instead of hiding it."""
    assert guards.guard_kind() == "torch"


@pytest.mark.parametrize("kind", KINDS)
def test_a_guard_accepts_other_data_of_the_same_layout(kind):
    make = KINDS[kind]
    q, k, positions = torch.zeros(4, 2, 3, 8), torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, dtype=torch.int64)
    guard = make(q, k, positions)
    assert guard(torch.randn(4, 2, 3, 8), torch.randn(4, 2, 1, 8), torch.ones(4, 2, dtype=torch.int64))
    fused = torch.randn(4, 2, 4, 8)  # slices of one projection: strides of the whole
    sliced = make(fused[:, :, :3], fused[:, :, 3:])
    other = torch.randn(4, 2, 4, 8)
    assert sliced(other[:, :, :3], other[:, :, 3:])


def _different(base: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        inference = torch.zeros(base.shape)
    return {
        "shape": torch.zeros(2, 3, 5),
        "strides": torch.zeros(4, 3, 2).transpose(0, 2),
        "dtype": torch.zeros(2, 3, 4, dtype=torch.float16),
        "requires_grad": torch.zeros(2, 3, 4, requires_grad=True),
        "device": torch.zeros(2, 3, 4, device="meta"),
        "inference tensor": inference,
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("difference", list(_different(torch.zeros(2, 3, 4))))
def test_a_guard_refuses_each_difference(kind, difference):
    base = torch.zeros(2, 3, 4)
    guard = KINDS[kind](base)
    assert guard(torch.ones(2, 3, 4))
    assert not guard(_different(base)[difference])


@pytest.mark.parametrize("kind", KINDS)
def test_a_guard_checks_every_tensor_not_only_the_first(kind):
    t, index = torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64)
    guard = KINDS[kind](t, index)
    assert guard(t, index)
    assert not guard(t, index.to(torch.int32))
    assert not guard(t, torch.zeros(3, dtype=torch.int64))
    assert not guard(t, torch.zeros(4, dtype=torch.int64)[::2])


def test_the_fallback_is_used_when_the_c_guards_misbehave(monkeypatch):
    """A torch whose private guard class is missing or accepts what it should refuse gets the
    Python guards, never a guard that lets a wrong plan through."""
    guards._guard_maker.cache_clear()
    monkeypatch.setattr(guards, "_torch_guard", lambda *tensors: (lambda *given: True))
    try:
        assert guards.guard_kind() == "python"
        assert not guards.tensor_guard(torch.zeros(2))(torch.zeros(3))
    finally:
        guards._guard_maker.cache_clear()


@pytest.mark.parametrize("kind", KINDS)
def test_a_guard_keeps_no_tensor_alive(kind):
    """Plans are made from a call's tensors (activations); their guards keep only metadata."""
    import gc
    import weakref

    tensors = (torch.randn(4, 2, 3, 8), torch.zeros(4, 2, dtype=torch.int64))
    refs = [weakref.ref(x) for x in tensors]
    guard = KINDS[kind](*tensors)
    del tensors
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert guard(torch.randn(4, 2, 3, 8), torch.ones(4, 2, dtype=torch.int64))


@pytest.mark.parametrize("version", ["2.14.0", "3.0.0", "2.5.1"])
def test_an_unverified_torch_release_gets_the_python_guards(monkeypatch, version):
    """The C++ class is private; a release it was not checked with never gets to crash."""
    guards._guard_maker.cache_clear()
    monkeypatch.setattr(torch, "__version__", version)
    try:
        assert guards.guard_kind() == "python"
    finally:
        guards._guard_maker.cache_clear()


def test_the_probe_does_not_follow_torch_defaults(monkeypatch):
    """A model that sets float64 as torch's default dtype still gets the C++ guards."""
    guards._guard_maker.cache_clear()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert guards.guard_kind() == "torch"
    finally:
        torch.set_default_dtype(previous)
        guards._guard_maker.cache_clear()


def test_a_tensor_given_twice_is_guarded_at_each_place():
    """One weight for q's and k's norm (or q as its own output): a call that passes one tensor
    at both places, laid out as the planned one, passes; a different layout, or two different
    tensors at those places (even alike), fails."""
    q, w = torch.randn(4, 4, 16), torch.ones(16, dtype=torch.bfloat16)
    guard = guards.tensor_guard(q, w, w)
    assert guard(q, w, w)
    other = torch.zeros(16, dtype=torch.bfloat16)
    assert guard(torch.randn(4, 4, 16), other, other)
    assert not guard(q, w, other)
    assert not guard(q, w, torch.ones(8, dtype=torch.bfloat16))
    assert not guard(q, torch.ones(16), torch.ones(16))
    alone = guards.tensor_guard(w, w)  # one tensor kept: its guard takes one argument
    assert alone(other, other) and not alone(w, other) and not alone(q, q)


def test_one_norm_for_q_and_k_is_planned(monkeypatch):
    """A repeated in-place call whose q and k share one HeadNorm runs its plan."""
    import rope_dispatch as rd
    from rope_dispatch import call as call_module
    from rope_dispatch import dispatch

    monkeypatch.setattr(call_module, "_reads", lambda index: False)  # as device positions
    checked = []
    check = dispatch.check_call
    monkeypatch.setattr(dispatch, "check_call", lambda *a, **k: checked.append(1) or check(*a, **k))
    q, k = torch.randn(4, 4, 16, dtype=torch.bfloat16), torch.randn(4, 2, 16, dtype=torch.bfloat16)
    norm = rd.HeadNorm(torch.ones(16, dtype=torch.bfloat16))
    spec, table, positions = rd.RoPESpec(layout="thd", dtype="bf16"), torch.rand(64, 8), torch.arange(4)
    with torch.no_grad():
        for _ in range(6):
            rd.apply_qk_(q, k, table, spec, positions=positions, q_norm=norm, k_norm=norm,
                         backend="eager")
    assert len(checked) == 2


@pytest.mark.parametrize("save", [False, True])
def test_the_probe_is_made_out_of_sight_of_a_selective_checkpoint(save):
    """The first plan of a process made inside ``checkpoint(use_reentrant=False)`` with a
    selective policy: made at the recomputation (a key's second call), the probe's tensors
    met the checkpoint's dispatch mode, which refuses ops its forward did not record, and the
    process fell back to the Python guards for good (made in a forward, they would be recorded
    as the region's). The C++ guards are kept and the gradient is the reference's."""
    import functools

    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    import rope_dispatch as rd
    from reference import assert_matches, reference_for

    policy = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    freqs = torch.rand(6, 1, 1, 8) * 6
    t = torch.randn(6, 2, 3, 8, requires_grad=True)
    g = torch.randn(6, 2, 3, 8)
    guards._guard_maker.cache_clear()
    try:
        for _ in range(2):
            out = checkpoint(
                lambda x: rd.apply(x * 2.0, freqs, spec, backend="eager") * x, t,
                use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: policy))
            (grad,) = torch.autograd.grad(out, t, g)
        assert guards.guard_kind() == "torch"
    finally:
        guards._guard_maker.cache_clear()
    x = t.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(reference_for(2 * x, freqs, spec) * x, x, g.double())
    assert_matches(grad, want, torch.float32, "gradient")
