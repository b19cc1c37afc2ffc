"""``rope_dispatch.apply``, ``apply_`` and ``apply_qk_`` inside ``torch.compile(fullgraph=True)``,
with static and dynamic shapes: dispatch itself never breaks the graph (the backends' own
kernels are tested in their files)."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

import rope_dispatch as rd
from reference import (
    assert_matches, reference_for, reference_forward_backward, reference_head_norm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_fullgraph_forward_backward(layout):
    torch._dynamo.reset()
    if layout == "thd":
        shape, extra = (9, 3, 16), {"cu_seqlens": torch.tensor([0, 4, 9])}
    else:
        shape, extra = (9, 2, 3, 16), {}
    spec = rd.RoPESpec(layout=layout, dtype="fp32", **extra)
    freqs = torch.rand(12, 1, 1, 16) * 10
    starts = torch.tensor([1, 2])

    def step(x):
        return rd.apply(x, freqs, spec, start_positions=starts, backend="eager") * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    t = torch.randn(*shape, requires_grad=True)
    out = compiled(t)
    grad_out = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, freqs.view(12, 16), spec, 2 * grad_out, starts)
    assert_matches(out, 2 * ref_out, torch.float32)
    assert_matches(grad, ref_grad, torch.float32)


def test_fullgraph_in_place_forward_backward():
    """apply_ traces too: the in-place rotation of an intermediate, and its gradient."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    freqs = torch.rand(12, 1, 1, 8) * 10

    def step(x):
        y = x * 2
        return rd.apply_(y, freqs, spec, backend="eager") + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    t = torch.randn(9, 2, 3, 16, requires_grad=True)
    out = compiled(t)
    grad_out = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(2 * t.detach(), freqs.view(12, 8), spec, grad_out)
    assert_matches(out, ref_out + 1, torch.float32)
    assert_matches(grad, 2 * ref_grad, torch.float32)


def test_fullgraph_pair_in_place_on_views_of_one_projection():
    """apply_qk_ traces: q and k rotated in place as disjoint views of one projection (their
    overlap check reads no address while tracing), and the projection's gradient."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    freqs = torch.rand(12, 1, 1, 16) * 10

    def step(proj):
        y = proj * 2
        q, k = y[..., :32].unflatten(-1, (2, 16)), y[..., 32:48].unflatten(-1, (1, 16))
        q, k = rd.apply_qk_(q, k, freqs, spec, backend="eager")
        return torch.cat((q, k), -2)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    proj = torch.randn(9, 2, 64, requires_grad=True)
    out = compiled(proj)
    grad_out = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, proj, grad_out)
    heads = (2 * proj.detach()[..., :48]).unflatten(-1, (3, 16))
    ref_out, ref_grad = reference_forward_backward(heads, freqs.view(12, 16), spec, grad_out)
    assert_matches(out, ref_out, torch.float32)
    assert_matches(grad[..., :48], 2 * ref_grad.flatten(-2), torch.float32, "q's and k's gradient")
    assert torch.equal(grad[..., 48:], torch.zeros(9, 2, 16))


def test_fullgraph_cache_write_with_the_descriptor_made_in_the_step():
    """rope_to_cache with its cache descriptor rebuilt inside the compiled step (as a serving
    step may make it): the descriptor's checks compare no addresses while tracing."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    angles = torch.rand(32, 8) * 6
    k_cache, v_cache = torch.zeros(40, 1, 8), torch.zeros(40, 1, 8)

    def step(q, k, v, positions, slots):
        cache = rd.FlatKVCache(k_cache, v_cache, slots)
        return rd.rope_to_cache(q, k, v, angles, spec, positions=positions, cache=cache,
                                backend="eager")

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(4, h, 8, generator=gen) for h in (2, 1, 1))
    positions, slots = torch.tensor([3, 0, 31, 7]), torch.tensor([5, 9, 0, 39])
    q_out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, positions, slots)
    thd = rd.RoPESpec(layout="thd", dtype="fp32")
    assert_matches(q_out, reference_for(q, angles, thd, positions=positions), torch.float32, "q")
    assert_matches(k_cache[slots], reference_for(k, angles, thd, positions=positions),
                   torch.float32, "k in the cache")
    assert torch.equal(v_cache[slots], v)


def test_fullgraph_cache_write_with_scale_tensors_on_the_cpu():
    """An FP8 cache descriptor with float32 scale tensors (vLLM's ``layer._k_scale``) made in
    the compiled step on the CPU: the scales' values are not read while tracing (their check
    raised Dynamo's data-dependent guard error). The cache stores k rotated and v, divided."""
    torch._dynamo.reset()
    fp8 = torch.float8_e4m3fn
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    angles = torch.rand(32, 8) * 6
    k_cache, v_cache = (torch.zeros(40, 1, 8, dtype=fp8) for _ in range(2))
    k_scale, v_scale = torch.tensor(0.5), torch.tensor([0.25])

    def step(q, k, v, positions, slots):
        cache = rd.FlatKVCache(k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
        return rd.rope_to_cache(q, k, v, angles, spec, positions=positions, cache=cache,
                                q_scale=k_scale, backend="eager")

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(4, h, 8, generator=gen) for h in (2, 1, 1))
    positions, slots = torch.tensor([3, 0, 31, 7]), torch.tensor([5, 9, 0, 39])
    q_out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, positions, slots)
    for got, x, scale, name in ((q_out, q, 0.5, "q"), (k_cache[slots], k, 0.5, "k")):
        expected = (reference_for(x, angles, spec, positions=positions).float() / scale).to(fp8)
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.13, atol=2e-3, msg=name)
    assert torch.equal(v_cache[slots].float(), (v / 0.25).to(fp8).float())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_writes_a_half_precision_cache_by_value(dtype, cache_dtype, device):
    """rope_to_cache compiled by Inductor, the default torch.compile backend, into a bfloat16
    or float16 vLLM cache (a padded token skipped), or an FP8 one (written through its bytes):
    the cache holds k rotated and v as they are (cast to FP8). Inductor stored a write through
    an int16 view of the cache as the integers' values (1.5 came out 16320.0)."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="thd", dtype=dtype)
    angles = torch.rand(32, 8, device=device) * 6
    stored = cache_dtype or dtype
    k_cache, v_cache = (torch.zeros(5, 4, 1, 8, dtype=stored, device=device) for _ in range(2))

    def step(q, k, v, positions, slots):
        cache = rd.PagedKVCache(k_cache, v_cache, slots)
        return rd.rope_to_cache(q, k, v, angles, spec, positions=positions, cache=cache,
                                backend="eager")

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(4, h, 8, generator=gen).to(dtype).to(device) for h in (2, 1, 1))
    positions = torch.tensor([3, 0, 31, 7], device=device)
    slots = torch.tensor([5, 19, -1, 0], device=device)
    q_out = torch.compile(step, fullgraph=True, backend="inductor")(q, k, v, positions, slots)
    thd = rd.RoPESpec(layout="thd", dtype="fp32")
    kept = torch.tensor([0, 1, 3])
    angles, positions = angles.cpu(), positions.cpu()
    k_ref = reference_for(k.float().cpu(), angles, thd, positions=positions)[kept]
    assert_matches(q_out.cpu(), reference_for(q.float().cpu(), angles, thd, positions=positions),
                   dtype, "q")
    written = k_cache.cpu().flatten(0, 1)[slots.cpu()[kept]]
    v_written = v_cache.cpu().flatten(0, 1)[slots.cpu()[kept]]
    if cache_dtype is None:
        assert_matches(written, k_ref, dtype, "k in the cache")
        assert torch.equal(v_written, v.cpu()[kept])
    else:  # within FP8's rounding of the float64 value (3 mantissa bits), v cast as it is
        err = (written.double() - k_ref).abs() / k_ref.abs().clamp_min(1)
        assert float(err.max()) <= 2 ** -3, float(err.max())
        assert torch.equal(v_written.float(), v.cpu()[kept].float().to(cache_dtype).float())
    assert int(k_cache.float().count_nonzero()) == int(written.float().count_nonzero())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_writes_an_fp8_cache_beside_a_v_of_no_channels(device):
    """An FP8 cache whose v has no channels (FlashInfer's MLA door without a nope part) under
    Inductor: k rotated and cast at its slots, a padded token skipped, nothing else written.
    Inductor failed to lower the write of v's no bytes through a byte view of its cache."""
    torch._dynamo.reset()
    fp8 = torch.float8_e4m3fn
    spec = rd.RoPESpec(layout="thd", dtype=torch.bfloat16)
    angles = torch.rand(16, 8, device=device) * 6
    k_cache = torch.zeros(4, 1, 8, dtype=fp8, device=device)
    v_cache = torch.zeros(4, 1, 0, dtype=fp8, device=device)

    def step(q, k, v, positions, slots):
        cache = rd.FlatKVCache(k_cache, v_cache, slots)
        return rd.rope_to_cache(q, k, v, angles, spec, positions=positions, cache=cache,
                                backend="eager")

    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(3, h, 8, generator=gen).bfloat16().to(device) for h in (2, 1))
    v = torch.empty(3, 1, 0, dtype=torch.bfloat16, device=device)
    positions, slots = torch.tensor([0, 3, 7]), torch.tensor([2, -1, 0])
    q_out = torch.compile(step, fullgraph=True, backend="inductor")(
        q, k, v, positions.to(device), slots.to(device))
    thd = rd.RoPESpec(layout="thd", dtype="fp32")
    assert_matches(q_out.cpu(), reference_for(q.float().cpu(), angles.cpu(), thd,
                                              positions=positions), torch.bfloat16, "q")
    k_ref = reference_for(k.float().cpu(), angles.cpu(), thd, positions=positions)[[0, 2]]
    written = k_cache.cpu()[[2, 0]]
    err = (written.double() - k_ref).abs() / k_ref.abs().clamp_min(1)
    assert float(err.max()) <= 2 ** -3, float(err.max())
    assert not k_cache.cpu()[[1, 3]].float().any()


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("dynamic", ["mark_dynamic", "new lengths", "dynamic=True"])
def test_fullgraph_default_choice_with_a_dynamic_sequence_length(dynamic, positions):
    """The default backend choice under dynamic shapes (a dimension marked dynamic, the
    recompile Dynamo makes dynamic after a second length, or ``dynamic=True``, where every
    size, the table's too, and the spec's float are symbols), by index or with per-token
    positions: the key it decides from and the kernel launch it traces hold no symbolic
    size, flag or float, and no sequence length is specialised to one value."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=0.75)
    freqs = torch.rand(64, 1, 1, 16) * 10

    def step(x, index):
        return rd.apply(x * 2, freqs, spec, positions=index)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager",
                             dynamic=True if dynamic == "dynamic=True" else None)
    for length in (8, 12, 20):
        t = torch.randn(length, 2, 3, 16)
        index = torch.randint(0, 64, (length, 2)) if positions else None
        if dynamic == "mark_dynamic":
            torch._dynamo.mark_dynamic(t, 0)
            if positions:
                torch._dynamo.mark_dynamic(index, 0)
        expected = reference_forward_backward(2 * t, freqs.view(64, 16), spec,
                                              torch.ones(t.shape), positions=index)[0]
        assert_matches(compiled(t, index), expected, torch.float32, f"s {length}")


@pytest.mark.parametrize("fields, rotary_dim", [
    (dict(cos_sin_scale=0.75), 8), (dict(cp_size=2, cp_rank=1), 8), (dict(rotary_offset=2), 4),
])
@pytest.mark.usefixtures("triton_backend")
def test_triton_launch_traced_with_dynamic_true(fields, rotary_dim):
    """``torch.compile(dynamic=True)`` of Triton calls with a spec scale other than 1, context
    parallelism or an offset: Dynamo reads the numbers the spec holds (and the table's last
    dim) as symbols, which the launch's constant argument and the decision's key cannot hold
    (it failed to trace); q and k, forward and backward, match the reference."""
    torch._dynamo.reset()
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", **fields)
    freqs = torch.rand(32, rotary_dim, device=DEVICE) * 10

    def step(q, k):
        return rd.apply_qk(q, k, freqs, spec, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for length in (8, 12):
        q = torch.randn(2, length, 4, 8, device=DEVICE, requires_grad=True)
        k = torch.randn(2, length, 2, 8, device=DEVICE, requires_grad=True)
        outs = compiled(q, k)
        grads = [torch.randn(o.shape, device=DEVICE) for o in outs]
        got = torch.autograd.grad(outs, (q, k), grads)
        for x, out, grad_out, grad in zip((q, k), outs, grads, got):
            ref_out, ref_grad = reference_forward_backward(x.detach(), freqs, spec, grad_out)
            assert_matches(out, ref_out, torch.float32)
            assert_matches(grad, ref_grad, torch.float32)


@pytest.mark.parametrize("dynamic", [None, True])
def test_with_cu_seqlens_inside_the_compiled_step(dynamic):
    """A thd step that makes its spec for the batch's offsets inside the compiled function
    (``spec.with_cu_seqlens(cu)``, as the README's loop does): pydantic's copy cannot be traced
    (Dynamo raised Unsupported on dict.copy), and with ``dynamic=True`` the spec's float is a
    symbol the traced copy's key text may not repr, nor may the longest sequence passed in (a
    symbol too). Output and gradient match the reference."""
    torch._dynamo.reset()
    base = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=torch.tensor([0, 1]),
                       max_seqlen=1, cos_sin_scale=0.5)
    freqs = torch.rand(32, 1, 1, 8) * 10

    def step(x, cu, longest):
        return rd.apply(x, freqs, base.with_cu_seqlens(cu, longest))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for offsets in ([0, 5, 12], [0, 10, 16]):
        cu = torch.tensor(offsets)
        t = torch.randn(offsets[-1], 3, 8, requires_grad=True)
        out = compiled(t, cu, 16)
        grad_out = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, t, grad_out)
        spec = base.with_cu_seqlens(cu, 16)
        ref_out, ref_grad = reference_forward_backward(t, freqs, spec, grad_out)
        assert_matches(out, ref_out, torch.float32, f"cu {offsets}")
        assert_matches(grad, ref_grad, torch.float32, f"cu {offsets}")


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_spec_made_inside_the_compiled_step(layout, dynamic):
    """``RoPESpec(...)`` written in the step itself (its dtype the input's, its rotary dim a
    size of the input: a symbol with ``dynamic=True``; thd with the batch's ``cu_seqlens``):
    pydantic's validation cannot be traced (Dynamo raised Unsupported on ``validate_python``).
    Outputs and gradients match the reference at two sizes, and a bad field still raises its
    message."""
    torch._dynamo.reset()
    freqs = torch.rand(24, 1, 1, 8) * 10

    def step(x, cu):
        extra = {} if cu is None else {"cu_seqlens": cu, "max_seqlen": 16}
        spec = rd.RoPESpec(layout=layout, dtype=x.dtype, rotary_dim=x.shape[-1] // 2,
                           cos_sin_scale=0.5, **extra)
        return rd.apply(x, freqs, spec)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for n in (12, 16):
        cu = torch.tensor([0, 5, n]) if layout == "thd" else None
        shape = (n, 3, 16) if layout == "thd" else (2, n, 3, 16)
        t = torch.randn(*shape, requires_grad=True)
        out = compiled(t, cu)
        grad_out = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, t, grad_out)
        spec = rd.RoPESpec(layout=layout, dtype=torch.float32, rotary_dim=8, cos_sin_scale=0.5,
                           **({} if cu is None else {"cu_seqlens": cu}))
        ref_out, ref_grad = reference_forward_backward(t, freqs, spec, grad_out)
        assert_matches(out, ref_out, torch.float32, f"{n} tokens")
        assert_matches(grad, ref_grad, torch.float32, f"{n} tokens")

    def bad(x):
        return rd.apply(x, freqs, rd.RoPESpec(layout="bhsd", dtype=x.dtype))

    torch._dynamo.reset()
    with pytest.raises(Exception, match="layout: Input should be 'sbhd', 'bshd' or 'thd'"):
        torch.compile(bad, fullgraph=True, backend="aot_eager")(torch.randn(2, 4, 3, 16))


@pytest.mark.parametrize("door", ["te sbhd", "te thd", "vllm", "flashinfer"])
def test_compat_doors_traced_with_no_spec_made_yet(door, monkeypatch):
    """A compat door's first call in a process inside ``torch.compile(fullgraph=True)``: the
    door makes its spec there (its cache is empty), and pydantic's validation cannot be traced
    (Dynamo raised Unsupported on SchemaValidator.validate_python, so every compiled model on
    a door failed unless an eager call had come first). Matches the reference."""
    from rope_dispatch.compat import flashinfer, te, vllm

    torch._dynamo.reset()
    for module in (te, vllm, flashinfer):
        monkeypatch.setattr(module, "_specs", {})
    freqs = torch.rand(32, 1, 1, 8) * 10
    if door.startswith("te"):
        thd = door == "te thd"
        cu = torch.tensor([0, 5, 12]) if thd else None
        t = torch.randn(12, 3, 8) if thd else torch.randn(8, 2, 3, 8)

        def step(x, cu):
            return te.apply_rotary_pos_emb(x, freqs, "thd" if thd else "sbhd", cu_seqlens=cu,
                                           cp_size=1, cp_rank=0)

        out = torch.compile(step, fullgraph=True, backend="aot_eager")(t, cu)
        spec = rd.RoPESpec(layout="thd" if thd else "sbhd", dtype="fp32", cu_seqlens=cu)
        assert_matches(out, reference_for(t, freqs, spec), torch.float32)
        return
    angles = (torch.rand(32, 4) * 6).double()
    cache = torch.cat((angles.cos(), angles.sin()), -1).float()
    positions = torch.tensor([3, 0, 31, 7])
    q, k = torch.randn(4, 2 * 8), torch.randn(4, 8)

    def step(q, k, positions):
        q, k = q.clone(), k.clone()
        if door == "vllm":
            vllm.rotary_embedding(positions, q, k, 8, cache, True)
        else:
            flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, q, k, 8, cache, True)
        return q, k

    q_out, k_out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, positions)
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    table = torch.cat((angles, angles), -1).float()
    for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
        heads = x.unflatten(-1, (-1, 8))
        expected = reference_for(heads, table, spec, positions=positions)
        assert_matches(out.unflatten(-1, (-1, 8)), expected, torch.float32, name)


@pytest.mark.parametrize("door", ["rope_quantize_fp8", "paged append"])
def test_flashinfer_fp8_doors_traced_with_no_spec_made_yet(door, monkeypatch):
    """FlashInfer's FP8 doors on a first call inside ``torch.compile(fullgraph=True)``: their
    spec is made at trace time, and rope_to_cache's layout check read it by ``getattr`` with a
    default, which Dynamo cannot guard on such a spec (InternalTorchDynamoError). q and the
    cache's k hold the rotation times the scale in FP8."""
    from rope_dispatch.compat import flashinfer

    torch._dynamo.reset()
    monkeypatch.setattr(flashinfer, "_specs", {})
    fp8 = torch.float8_e4m3fn
    angles = (torch.rand(32, 4) * 6).double()
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).float()
    positions = torch.tensor([3, 0, 31, 7])
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    k_cache, v_cache = (torch.zeros(2, 4, 1, 8, dtype=fp8) for _ in range(2))
    index = dict(dtype=torch.int32)

    def step(q, k, positions):
        if door == "rope_quantize_fp8":
            q_out, k_out, _, _ = flashinfer.rope_quantize_fp8(
                q, k, None, None, cos_sin, positions, quant_scale_q=0.5, quant_scale_kv=0.5)
            return q_out, k_out
        q_out, _ = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q, k, None, None, k.clone(), cos_sin, positions, (k_cache, v_cache),
            torch.tensor([0, 1], **index), torch.tensor([0, 2], **index),
            torch.zeros(4, **index), torch.tensor([4, 0, 1, 7], **index), page_size=4,
            quant_scale_q=0.5, quant_scale_kv=0.5)
        return q_out, k_cache.flatten(0, 1)[torch.tensor([4, 0, 1, 7])]

    q_out, k_out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, positions)
    spec = rd.RoPESpec(layout="thd", dtype="fp32")
    table = torch.cat((angles, angles), -1).float()
    for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
        expected = (reference_for(x, table, spec, positions=positions).float() * 0.5).to(fp8)
        assert out.dtype == fp8, name
        torch.testing.assert_close(out.float(), expected.float(), rtol=0.13, atol=2e-3, msg=name)


def test_overrides_are_read_at_trace_time(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("ROPE_AUTOTUNE", "0")
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    freqs = torch.rand(8, 16)
    compiled = torch.compile(lambda x: rd.apply(x, freqs, spec), fullgraph=True, backend="aot_eager")
    with rd.use_backend("eager"):
        out = compiled(torch.randn(2, 8, 3, 16))
    assert out.shape == (2, 8, 3, 16)
    with pytest.raises(Exception, match="unknown backend 'nope'"):
        with monkeypatch.context() as m:
            m.setenv("ROPE_BACKEND", "nope")
            torch._dynamo.reset()
            compiled(torch.randn(2, 8, 3, 16))


def test_constant_while_tracing_marks_as_torch_does():
    """rope-dispatch marks its trace-time helpers without importing Dynamo; the mark must be the
    one torch's own decorator makes (the overrides test above shows Dynamo honours it)."""
    from rope_dispatch.tracing import constant_while_tracing

    def ours():
        return 1

    def torchs():
        return 1

    assert constant_while_tracing(ours) is ours
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) != {}


def test_import_leaves_dynamo_unimported():
    """``import rope_dispatch``, a call and the compile backend's probe do not import Dynamo:
    1-4.5 s a program that never compiles need not pay (the probe runs at a first call). The
    backend's first compile asks Dynamo in full (``confirm``), quietly."""
    code = (
        "import sys, warnings, torch, rope_dispatch as rd\n"
        "spec = rd.RoPESpec(layout='sbhd', dtype='fp32')\n"
        "rd.apply(torch.randn(4, 1, 2, 8), torch.rand(4, 1, 1, 8), spec, backend='eager')\n"
        "print('torch._dynamo' in sys.modules)\n"
        "warnings.simplefilter('error')\n"
        "backend = rd.get_backend('compile')\n"
        "backend.availability\n"
        "print('torch._dynamo' in sys.modules)\n"
        "print(backend.confirm(torch.device('cpu')))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "None", "True"]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("backend", [None, "eager"])
def test_export_with_a_dynamic_sequence_length(strict, backend):
    """``torch.export`` of a module calling ``apply`` with a dynamic sequence length (a
    bounded ``Dim``), the default choice or a forced one: the program serves every length
    in the range, as the reference says."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")

    class Rotate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freqs", torch.rand(64, 1, 1, 8) * 6)

        def forward(self, x):
            return rd.apply(x * 2, self.freqs, spec, backend=backend)

    module = Rotate()
    seq = torch.export.Dim("seq", min=2, max=48)
    program = torch.export.export(module, (torch.randn(6, 2, 2, 8),),
                                  dynamic_shapes={"x": {0: seq}}, strict=strict)
    for length in (3, 6, 20, 48):
        x = torch.randn(length, 2, 2, 8)
        assert_matches(program.module()(x), reference_for(2 * x, module.freqs, spec),
                       torch.float32, f"s {length}")


@pytest.mark.parametrize("backend", [None, "eager", "triton"])
def test_torch_jit_trace_is_refused_by_name(backend, request):
    """TorchScript's tracer sees no kernel launch: refused with the tracers that work, also
    after eager calls made plans for the same call (on a GPU the triton backend's bound
    launches)."""
    if backend == "triton":
        request.getfixturevalue("triton_backend")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    freqs = torch.rand(16, 1, 1, 8, device=device) * 6

    def rotate(x):
        return rd.apply(x * 2, freqs, spec, backend=backend)

    x = torch.randn(6, 2, 2, 8, device=device)
    for _ in range(3):
        rotate(x)
    with pytest.raises(rd.RoPEError, match="torch.jit.trace cannot record.*torch.export"):
        torch.jit.trace(rotate, (x,))


FAKE_MODE_CALLS = """
import torch, rope_dispatch as rd
from torch._subclasses.fake_tensor import FakeTensorMode
spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
gpu = ["cuda"] if torch.cuda.is_available() else []
for device, backends in [("cpu", ("compile", "eager", None))] + [(d, ("triton", "compile", None))
                                                                 for d in gpu]:
    with FakeTensorMode():
        x, freqs = torch.randn(4, 2, 2, 8, device=device), torch.rand(8, 1, 1, 8, device=device)
        for backend in backends:
            for _ in range(2):
                assert rd.apply(x, freqs, spec, backend=backend).shape == x.shape
                starts = torch.tensor([1, 2], device=device)
                out = rd.apply(x, freqs, spec, backend=backend, start_positions=starts)
                assert out.shape == x.shape
print("ok")
"""


@pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")
def test_fake_tensor_mode_runs_no_kernel_and_reads_no_value(request):
    """Under a ``FakeTensorMode`` (shape propagation, memory estimation) the tensors have no
    memory: the compile backend ran its compiled C++ kernel on them (a segmentation fault: in
    a process of its own here) and the checks read start_positions' values
    (DataDependentOutputException), also of fake tensors used outside their mode (the Triton
    backend's op takes those); on a GPU machine CUDA's fake tensors too. No fake tensor's
    address is read (torch warns that it will raise). After them a real call still gives the
    reference's numbers."""
    proc = subprocess.run([sys.executable, "-c", FAKE_MODE_CALLS], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-2000:]
    from torch._subclasses.fake_tensor import FakeTensorMode

    request.getfixturevalue("triton_backend")
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x, freqs, starts = (torch.randn(4, 2, 2, 8, device=DEVICE),
                        torch.rand(8, 1, 1, 8, device=DEVICE) * 6,
                        torch.tensor([1, 3], device=DEVICE))
    mode = FakeTensorMode()
    fake_x, fake_freqs, fake_starts = (mode.from_tensor(a) for a in (x, freqs, starts))
    for backend in ("eager", "triton"):
        with mode:
            out = rd.apply(fake_x, fake_freqs, spec, backend=backend, start_positions=fake_starts)
        assert out.shape == x.shape
    out = rd.apply(fake_x, fake_freqs, spec, backend="triton", start_positions=fake_starts)
    assert out.shape == x.shape
    for backend in ("eager", "triton"):
        out = rd.apply(x, freqs, spec, backend=backend, start_positions=starts)
        assert_matches(out, reference_for(x, freqs, spec, starts), torch.float32)


@pytest.mark.parametrize("layout,norm", [("sbhd", False), ("sbhd", True), ("thd", False)])
@pytest.mark.parametrize("save", ["everything", "rope", "nothing"])
@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
def test_selective_activation_checkpointing(backend, save, layout, norm, request):
    """``checkpoint(use_reentrant=False)`` with a selective policy (torchtitan's): every op saved,
    ours saved and the rest recomputed, or all recomputed. The gradients of the input, the
    norm weight and a factor used before and after the call equal the float64 formula's; the
    policy sees the triton backend's call as its op ``rope_dispatch::triton_rope``, not the
    launch's allocations (whose outputs the interpreter's copies then wrote: a cached tensor
    "mutated" at the recomputation). thd: no op of the call writes in place into another's
    output (a cached one would be found mutated)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    if backend == "triton":
        request.getfixturevalue("triton_backend")
    cu = {"cu_seqlens": torch.tensor([0, 5, 12], device=DEVICE)} if layout == "thd" else {}
    spec = rd.RoPESpec(layout=layout, dtype="fp32", **cu)
    shape = (12, 3, 8) if layout == "thd" else (6, 2, 3, 8)
    gen = torch.Generator().manual_seed(3)
    t, z = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    freqs = torch.rand(7, 1, 1, 8, generator=gen) * 6
    weight = torch.randn(8, generator=gen) * 0.5 + 1.0
    grad_out = torch.randn(shape, generator=gen)
    table = freqs.to(DEVICE)
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        if save == "everything" or (save == "rope" and op.namespace == "rope_dispatch"):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def region(x, w, factor):  # x * factor keeps both: the backward recomputes the region
        head_norm = rd.HeadNorm(w, 1e-6) if norm else None
        return rd.apply(x * factor, table, spec, backend=backend, norm=head_norm) * factor

    inputs = [x.to(DEVICE).requires_grad_(True) for x in (t, weight, z)]
    out = checkpoint(region, *inputs, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    grads = torch.autograd.grad(out, inputs, grad_out.to(DEVICE), allow_unused=True)
    x64, w64, z64 = (x.double().requires_grad_(True) for x in (t, weight, z))
    y = x64 * z64
    if norm:
        y = reference_head_norm(y, w64, 1e-6, 0.0, "head")
    expected = reference_for(y, freqs, spec) * z64
    wanted = torch.autograd.grad(expected, (x64, w64, z64), grad_out.double(), allow_unused=True)
    assert_matches(out, expected, torch.float32, "forward")
    for name, got, want in zip(("x", "weight", "factor"), grads, wanted):
        if want is None:
            assert got is None, name
        else:
            assert_matches(got, want, torch.float32, f"{name}'s gradient")
    if backend == "triton" and not norm:  # (a norm stage's call is then the eager composition)
        assert torch.ops.rope_dispatch.triton_rope.default in seen


@pytest.mark.parametrize("made", ["RoPESpec", "with_cu_seqlens"])
@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_new_max_seqlen_every_step_is_no_recompile(made, backend, request):
    """A thd training loop passes each batch's longest sequence as ``max_seqlen``: the traced
    spec kept it as a number (a guard on its value), so every step compiled a new graph (and
    past Dynamo's cache limit ran uncompiled). Two graphs (the first step's static int, then a
    symbol), outputs and gradients match the reference, and a max_seqlen the table cannot cover
    is still refused."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if backend == "triton":
        request.getfixturevalue("triton_backend")
    torch._dynamo.reset()
    device = DEVICE if backend == "triton" else "cpu"
    freqs = (torch.rand(24, 1, 1, 8) * 10).to(device)
    base = rd.RoPESpec(layout="thd", dtype="fp32")

    def step(x, cu, longest):
        spec = (rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, max_seqlen=longest)
                if made == "RoPESpec" else base.with_cu_seqlens(cu, longest))
        return rd.apply(x, freqs, spec, backend=backend)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for longest in range(3, 9):
        cu = torch.tensor([0, longest, longest + 2])
        t = torch.randn(longest + 2, 3, 8, device=device, requires_grad=True)
        out = compiled(t, cu.to(device), longest)
        grad_out = torch.randn(out.shape, device=device)
        (grad,) = torch.autograd.grad(out, t, grad_out)
        ref_out, ref_grad = reference_forward_backward(t, freqs, base.with_cu_seqlens(cu),
                                                       grad_out)
        assert_matches(out, ref_out, torch.float32, f"max_seqlen {longest}")
        assert_matches(grad, ref_grad, torch.float32, f"max_seqlen {longest}")
    assert counter.frame_count == 2
    with pytest.raises(Exception, match="max_seqlen=30 needs 30"):
        compiled(torch.randn(8, 3, 8, device=device), torch.tensor([0, 4, 8], device=device), 30)


@pytest.mark.parametrize("made", ["RoPESpec", "with_cu_seqlens"])
def test_a_spec_passed_in_with_a_new_max_seqlen_every_step_is_no_recompile(made):
    """The thd spec made outside the compiled step for each batch (its longest sequence as
    ``max_seqlen``) and passed in, the default backend choosing: the choice's key held the
    spec's key text with max_seqlen's value, a constant Dynamo guards on, so every step compiled
    a new graph. Two graphs (the first step's static int, then a symbol), and the outputs and
    gradients match the reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    freqs = torch.rand(24, 1, 1, 8) * 10
    base = rd.RoPESpec(layout="thd", dtype="fp32")

    def step(x, spec):
        return rd.apply(x, freqs, spec)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for longest in range(3, 9):
        cu = torch.tensor([0, longest, longest + 2])
        spec = (rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, max_seqlen=longest)
                if made == "RoPESpec" else base.with_cu_seqlens(cu, longest))
        t = torch.randn(longest + 2, 3, 8, requires_grad=True)
        out = compiled(t, spec)
        grad_out = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, t, grad_out)
        ref_out, ref_grad = reference_forward_backward(t, freqs, spec, grad_out)
        assert_matches(out, ref_out, torch.float32, f"max_seqlen {longest}")
        assert_matches(grad, ref_grad, torch.float32, f"max_seqlen {longest}")
    assert counter.frame_count == 2


def test_a_symbolic_max_seqlen_of_a_spec_without_offsets_is_checked_by_name():
    """A thd spec made in the step with per-token positions, no cu_seqlens, and a max_seqlen
    that changes every step (a symbol from the second step): one more graph, the reference's
    output, and a negative one refused by name (Dynamo could not format the symbol into the
    message and raised its own error)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    freqs = torch.rand(24, 8) * 10

    def step(x, positions, longest):
        spec = rd.RoPESpec(layout="thd", dtype="fp32", max_seqlen=longest)
        return rd.apply(x, freqs, spec, positions=positions)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    positions = torch.tensor([3, 0, 23, 7])
    for longest in range(4, 8):
        t = torch.randn(4, 2, 8)
        expected = reference_for(t, freqs, rd.RoPESpec(layout="thd", dtype="fp32"),
                                 positions=positions)
        assert_matches(compiled(t, positions, longest), expected, torch.float32)
    assert counter.frame_count == 2
    with pytest.raises(Exception, match="max_seqlen must be >= 0, got -1"):
        compiled(torch.randn(4, 2, 8), positions, -1)


def test_a_traced_spec_names_the_max_seqlen_it_refuses():
    """A spec made while tracing with a symbolic max_seqlen (dynamic=True) was validated with
    0 in its place, so a layout that takes none was refused with "got 0": the message now
    names the value passed."""
    def step(x, longest):
        rd.RoPESpec(layout="sbhd", dtype="fp32", max_seqlen=longest)
        return x + 1

    compiled = torch.compile(step, dynamic=True, backend="eager")
    with pytest.raises(Exception, match="max_seqlen is only for layout 'thd', got 7 with "
                       "layout 'sbhd'"):
        compiled(torch.ones(3, device=DEVICE), 7)


@pytest.mark.parametrize("field, value, words", [
    ("layout", "bhsd", "layout: Input should be 'sbhd', 'bshd' or 'thd'"),
    ("interleaved", "yes", r"interleaved: expected True or False, got 'yes' \(str\)"),
])
def test_a_bad_spec_made_in_the_step_is_refused_as_other_calls_are(field, value, words):
    """A spec with a bad field made in a compiled step was validated inside Dynamo (its
    constant's call), whose ``InternalTorchDynamoError`` wrapped our error: it is refused in
    the traced code now, as a bad call is, so without ``fullgraph`` the step raises
    ``RoPEError`` itself, and with it Dynamo's error for an exception raised in a graph names
    ours and its message."""
    freqs = torch.rand(8, 1, 1, 8, device=DEVICE)

    def step(x):
        return rd.apply(x, freqs, rd.RoPESpec(**{"layout": "sbhd", "dtype": "fp32",
                                                   field: value}))

    torch._dynamo.reset()
    with pytest.raises(rd.RoPEError, match=f"invalid RoPESpec: {words}"):
        torch.compile(step, backend="aot_eager")(torch.randn(8, 1, 2, 8, device=DEVICE))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=f"RoPEError.*{words}"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(
            torch.randn(8, 1, 2, 8, device=DEVICE))
