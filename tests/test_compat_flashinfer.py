"""``rope_dispatch.compat.flashinfer``: FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``
against its documented semantics, written out here in float64, on every backend that serves it
(Triton on its interpreter without CUDA)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_dispatch as rd
from rope_dispatch.compat.flashinfer import apply_rope_with_cos_sin_cache_inplace

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def flashinfer_reference(positions, x, head_size, cache, is_neox):
    """FlashInfer's definition: rotary dim = the cache's last dim; cos = cache[p, :r/2],
    sin = cache[p, r/2:]; NeoX pairs (i, i + r/2), else (2i, 2i+1); the rest untouched."""
    r = cache.shape[-1]
    x = x.detach().double().cpu().unflatten(-1, (-1, head_size)).clone()
    c = cache.double().cpu()[positions.cpu().long()]
    cos, sin = c[:, None, : r // 2], c[:, None, r // 2 :]
    if is_neox:
        a, b = x[..., : r // 2].clone(), x[..., r // 2 : r].clone()
        x[..., : r // 2], x[..., r // 2 : r] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., 0:r:2].clone(), x[..., 1:r:2].clone()
        x[..., 0:r:2], x[..., 1:r:2] = a * cos - b * sin, b * cos + a * sin
    return x.flatten(-2)


def engine_cache(max_pos: int, rotary_dim: int, gen: torch.Generator) -> torch.Tensor:
    """A vLLM-style cache: [cos(angles) | sin(angles)] of random (unequal) pair angles."""
    angles = torch.rand(max_pos, rotary_dim // 2, generator=gen, dtype=torch.float64) * 50
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def check(backend, nnz, heads, kv_heads, head_size, rotary_dim, is_neox, dtype, int32, seed, device):
    gen = torch.Generator().manual_seed(seed)
    # q and k: slices of one fused [nnz, (heads + 2 kv_heads) * head_size] projection output
    qkv = torch.randn(nnz, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype).to(device)
    query, key = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    value = qkv[:, (heads + kv_heads) * head_size :].clone()
    cache = engine_cache(64, rotary_dim, gen).to(device)
    positions = torch.randint(0, 64, (nnz,), generator=gen).to(torch.int32 if int32 else torch.int64).to(device)
    want_q = flashinfer_reference(positions, query, head_size, cache, is_neox)
    want_k = flashinfer_reference(positions, key, head_size, cache, is_neox)
    with rd.use_backend(backend):
        assert apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cache, is_neox) is None
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for name, got, want in (("query", query, want_q), ("key", key, want_k)):
        err = ((got.double().cpu() - want).abs() / (1 + want.abs())).max()
        assert err <= tol, f"{name}: {float(err):.3g}"
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], value), "v untouched"


args = st.tuples(
    st.integers(1, 9), st.integers(1, 4), st.integers(1, 2), st.sampled_from((8, 16, 32)),
    st.booleans(), st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    st.booleans(), st.integers(0, 2**16),
)


@given(args, st.booleans())
def test_eager_matches_flashinfer_semantics(a, partial):
    nnz, heads, kv, head_size, is_neox, dtype, int32, seed = a
    check("eager", nnz, heads, kv, head_size, head_size // 2 if partial else head_size, is_neox,
          dtype, int32, seed, "cpu")


@pytest.mark.usefixtures("triton_backend")
@settings(max_examples=25, deadline=None)
@given(args, st.booleans())
def test_triton_matches_flashinfer_semantics(a, partial):
    nnz, heads, kv, head_size, is_neox, dtype, int32, seed = a
    check("triton", nnz, heads, kv, head_size, head_size // 2 if partial else head_size, is_neox,
          dtype, int32, seed, DEVICE)


def test_signature_is_flashinfers():
    params = inspect.signature(apply_rope_with_cos_sin_cache_inplace).parameters
    assert list(params) == ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"]
    assert params["is_neox"].default is True


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(head_size=12), ["query must be [nnz, heads * head_size] or [nnz, heads, head_size]",
                              "head_size=12", "(4, 32)"]),
        (dict(head_size=0), ["head_size must be a positive int", "0"]),
        (dict(head_size=True), ["head_size must be a positive int, got True"]),
        (dict(head_size=np.True_), ["head_size must be a positive int, got"]),
        (dict(head_size=np.int64(12)), ["query must be [nnz, heads * head_size]", "=12"]),
        (dict(head_size=16.0), ["head_size must be a positive int, got 16.0"]),
        (dict(head_size=-16), ["head_size must be a positive int, got -16"]),
        (dict(query=[[0.0] * 32] * 4), ["query must be [nnz, heads * head_size]", "got list"]),
        (dict(query=torch.randn(128)), ["query must be [nnz, heads * head_size]", "(128,)"]),
        (dict(key=torch.randn(4, 1, 8)), ["key must be [nnz, heads * head_size]", "(4, 1, 8)"]),
        (dict(key=torch.randn(4, 1, 1, 24)), ["key must be", "head_size=16", "(4, 1, 1, 24)"]),
        (dict(key=torch.randn(4, 2, 3, 16)[:, :, :2]),
         ["key (4, 2, 2, 16) with strides (96, 48, 16, 1) cannot be viewed as [nnz, heads, "
          "head_size=16] without a copy"]),
        (dict(query=torch.randn(4, 2, 8)), ["query must be [nnz, heads * head_size]", "(4, 2, 8)"]),
        (dict(is_neox=None), ["is_neox must be a bool, got None"]),
        (dict(query=torch.randn(4, 32, requires_grad=True)),
         ["apply_qk_ rotates q in place, but q is a view of a leaf tensor that requires grad"]),
        (dict(cos_sin_cache=torch.rand(8, 16).double()), ["cos_sin_cache", "float64"]),
        (dict(cos_sin_cache=torch.rand(8, 15)), ["cos_sin_cache", "even d2", "(8, 15)"]),
        (dict(cos_sin_cache=torch.rand(16, 8).t()), ["cos_sin_cache", "strides"]),
        (dict(positions=torch.tensor([0, 1, 2, 8])), ["positions must lie in [0, 8)", "0 to 8"]),
        (dict(positions=torch.tensor([0, 1, 2])), ["positions must have shape [T] = [4]", "(3,)"]),
        (dict(cos_sin_cache=torch.rand(8, 20)), ["rotary dim d2=20", "head dim d=16"]),
        (dict(query=torch.randn(4, 32).double(), key=torch.randn(4, 16).double()),
         ["query must be float32, float16 or bfloat16, got float64"]),
        (dict(positions=None), ["positions must be an int32 or int64 tensor [nnz], got None"]),
    ],
)
def test_bad_arguments(kwargs, words):
    args = dict(positions=torch.tensor([0, 1, 2, 3]), query=torch.randn(4, 32), key=torch.randn(4, 16),
                head_size=16, cos_sin_cache=torch.rand(8, 16))
    args.update(kwargs)
    with pytest.raises(rd.RoPEError) as info:
        apply_rope_with_cos_sin_cache_inplace(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_three_dim_query_and_key_as_flashinfer_views_them():
    """[nnz, heads, head_size] query and key (SGLang passes some so) are rotated like their
    2-D form: FlashInfer views both as [nnz, -1, head_size]."""
    gen = torch.Generator().manual_seed(5)
    cache = engine_cache(16, 8, gen)
    positions = torch.tensor([3, 0, 15])
    query, key = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    want_q = flashinfer_reference(positions, query.flatten(1), 8, cache, True)
    want_k = flashinfer_reference(positions, key.flatten(1), 8, cache, True)
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache)
    torch.testing.assert_close(query.flatten(1).double(), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(key.flatten(1).double(), want_k, rtol=0, atol=2e-6)


def test_repeated_calls_reuse_one_plan_and_caches_are_not_hoarded(monkeypatch):
    """Every layer's call passes the same cache tensor: the adapter hands dispatch the same
    table object, so the call's plan (kept at the second call) serves the rest; caches it no
    longer sees are released."""
    import gc
    import weakref

    from rope_dispatch import call as call_module
    from rope_dispatch import dispatch

    monkeypatch.setattr(call_module, "_reads", lambda index: False)  # as for device positions
    checks = []
    real = dispatch.check_call
    monkeypatch.setattr(dispatch, "check_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    angles = torch.rand(32, 8, generator=torch.Generator().manual_seed(5)) * 4
    cache = torch.cat((angles.cos(), angles.sin()), -1)
    positions = torch.tensor([3, 0, 31, 7])
    for layer in range(3):
        q, k = torch.randn(4, 2 * 16), torch.randn(4, 16)
        expected = (flashinfer_reference(positions, q, 16, cache, True),
                    flashinfer_reference(positions, k, 16, cache, True))
        apply_rope_with_cos_sin_cache_inplace(positions, q, k, 16, cache)
        torch.testing.assert_close(q.double(), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k.double(), expected[1], rtol=1e-5, atol=1e-5)
    assert len(checks) == 2
    dropped = weakref.ref(cache)
    del cache
    for _ in range(4):  # later caches push the dropped one out of the adapter's few
        other = torch.cat((angles.cos(), angles.sin()), -1)
        apply_rope_with_cos_sin_cache_inplace(positions, torch.randn(4, 16), torch.randn(4, 16), 16, other)
    gc.collect()
    assert dropped() is None


def test_an_fp8_door_on_fake_tensors_leaves_no_divisor_for_later_calls(monkeypatch):
    """``rope_quantize_fp8`` on fake tensors (shape propagation, memory estimation) makes
    q_nope's divisor as a fake tensor too: it is not kept, so the next real call with the same
    scale stores ``q_nope * quant_scale_q`` (the kept fake divisor gave values off by up to 5)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rope_dispatch.compat import flashinfer
    from rope_dispatch.compat.flashinfer import rope_quantize_fp8

    monkeypatch.setattr(flashinfer, "_DIVISORS", {})
    gen = torch.Generator().manual_seed(19)
    cache = engine_cache(64, 16, gen)

    def parts():
        return [torch.randn(4, heads, dim, generator=gen).bfloat16()
                for heads, dim in ((2, 16), (1, 16), (2, 8), (1, 8))]

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        rope_quantize_fp8(*map(mode.from_tensor, parts()), cache, torch.arange(4),
                          quant_scale_q=2.0)
    q_rope, k_rope, q_nope, k_nope = parts()
    out = rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, torch.arange(4),
                            quant_scale_q=2.0)
    expected = (q_nope.float() * 2.0).to(torch.float8_e4m3fn)  # a power of two: exact
    assert torch.equal(out[2].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; runs on the GPU machine "
                    "(scripts/device_check.sh)")
def test_the_mla_door_on_fake_or_traced_gpu_tensors_quantizes_q_nope_by_division(monkeypatch):
    """On a GPU, q_nope's Triton quantizing copy reads its tensors' addresses: on fake tensors
    (shape propagation) it must not launch, and inside torch.compile(fullgraph=True) it cannot be
    traced, so both take torch's division: compiled, every output within one FP8 step of the
    eager call's (Inductor's float32 math may round differently)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rope_dispatch.compat.flashinfer import mla_rope_quantize_fp8

    triton = rd.get_backend("triton")
    if not triton.available:
        pytest.skip(f"the triton backend is unavailable: {triton.availability}")
    gen = torch.Generator().manual_seed(23)
    parts = [torch.randn(5, *shape, generator=gen).bfloat16().cuda()
             for shape in ((16, 64), (64,), (16, 512), (512,))]
    cache, pos = engine_cache(32, 64, gen).cuda(), torch.arange(5, device="cuda")

    def door(*parts):
        return mla_rope_quantize_fp8(*parts, cache, pos, is_neox=False, quant_scale_q=0.37)

    eager = door(*parts)
    compiled = torch.compile(door, fullgraph=True)(*parts)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=2e-3)
    monkeypatch.setattr(type(triton), "quantize", lambda *args: pytest.fail("launched on fakes"))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        shapes = [tuple(x.shape) for x in door(*map(mode.from_tensor, parts))]
    assert shapes == [tuple(x.shape) for x in eager]


def test_core_errors_say_how_the_door_mapped_its_arguments():
    """A cache wider than the head is refused by the core, in its own names (t, freqs): the
    error says which of FlashInfer's arguments those are."""
    with pytest.raises(rd.RoPEError, match=r"exceeds the head dim .*"
                       r"apply_rope_with_cos_sin_cache_inplace calls rope_dispatch\.apply_qk_ "
                       r"with q=query, k=key.*freqs=cos_sin_cache"):
        apply_rope_with_cos_sin_cache_inplace(torch.arange(3), torch.randn(3, 32),
                                              torch.randn(3, 16), 16, torch.randn(16, 32))


def test_a_numpy_integer_head_size_as_flashinfer_takes_it():
    gen = torch.Generator().manual_seed(3)
    cache, positions = engine_cache(16, 8, gen), torch.tensor([9, 0, 15])
    query, key = torch.randn(3, 32, generator=gen), torch.randn(3, 16, generator=gen)
    want_q = flashinfer_reference(positions, query, 16, cache, True)
    want_k = flashinfer_reference(positions, key, 16, cache, True)
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, np.int64(16), cache)
    torch.testing.assert_close(query.double(), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(key.double(), want_k, rtol=0, atol=2e-6)


@pytest.mark.parametrize("is_neox", [np.True_, np.False_])
def test_a_numpy_bool_is_neox_as_flashinfer_takes_it(is_neox):
    """A NumPy bool (a flag read from an array or config) is the bool it holds, as the spec
    takes flags; FlashInfer reads it with ``not is_neox``. Other types stay refused."""
    from rope_dispatch.compat.flashinfer import rope_quantize_fp8

    gen = torch.Generator().manual_seed(13)
    cache, positions = engine_cache(16, 8, gen), torch.tensor([9, 0, 15])
    query, key = torch.randn(3, 16, generator=gen), torch.randn(3, 8, generator=gen)
    want_q = flashinfer_reference(positions, query, 8, cache, bool(is_neox))
    want_k = flashinfer_reference(positions, key, 8, cache, bool(is_neox))
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache, is_neox)
    torch.testing.assert_close(query.double(), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(key.double(), want_k, rtol=0, atol=2e-6)
    parts = [torch.randn(3, heads, 8, generator=gen) for heads in (2, 1)]
    got = rope_quantize_fp8(*parts, None, None, cache, positions, is_neox, enable_pdl=np.False_)
    want = flashinfer_reference(positions, parts[0].flatten(1), 8, cache, bool(is_neox))
    torch.testing.assert_close(got[0].float().flatten(1).double(),
                               want.to(torch.float8_e4m3fn).double(), rtol=0.07, atol=0.02)
    with pytest.raises(rd.RoPEError, match="is_neox must be a bool, got 1"):
        apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache, 1)


def test_four_dim_query_and_key_as_flashinfer_views_them():
    """FlashInfer views query and key as ``view(nnz, -1, head_size)``: a 4-D
    [nnz, groups, heads, head_size] query (and a [nnz, 1, 2 * head_size] key) are its heads."""
    gen = torch.Generator().manual_seed(7)
    cache = engine_cache(16, 8, gen)
    positions = torch.tensor([3, 0, 15])
    query, key = torch.randn(3, 2, 2, 8, generator=gen), torch.randn(3, 1, 16, generator=gen)
    want_q = flashinfer_reference(positions, query.flatten(1), 8, cache, False)
    want_k = flashinfer_reference(positions, key.flatten(1), 8, cache, False)
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache, False)
    torch.testing.assert_close(query.flatten(1).double(), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(key.flatten(1).double(), want_k, rtol=0, atol=2e-6)


def test_a_cache_that_requires_grad_is_read_as_a_constant():
    """FlashInfer's in-place op does not differentiate its cache and takes one that requires
    grad (an engine's nn.Parameter): so does the door, in grad mode too, call after call from
    one wrapper; a query that requires grad (not a leaf) gets the rotation's gradient."""
    gen = torch.Generator().manual_seed(11)
    cache = engine_cache(16, 8, gen).requires_grad_()
    positions = torch.tensor([4, 15, 0])
    base = torch.randn(3, 16, generator=gen, requires_grad=True)
    for _ in range(2):
        query, key = base * 1.0, torch.randn(3, 8, generator=gen)
        want_q = flashinfer_reference(positions, base, 8, cache, True)
        want_k = flashinfer_reference(positions, key, 8, cache, True)
        apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache)
        torch.testing.assert_close(query.detach().double(), want_q, rtol=0, atol=2e-6)
        torch.testing.assert_close(key.double(), want_k, rtol=0, atol=2e-6)
    grad = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    query.backward(grad.float())
    # the gradient of a rotation is the inverse rotation: the reference's with sines negated
    inverse = torch.cat((cache[:, :4], -cache[:, 4:]), -1).detach()
    want_grad = flashinfer_reference(positions, grad, 8, inverse, True)
    torch.testing.assert_close(base.grad.double(), want_grad, rtol=0, atol=2e-6)
    assert cache.grad is None


@pytest.mark.parametrize("made", ["passed in", "made in the step"])
def test_compiled_steps_keep_one_graph_over_a_steady_decode_loop(made, monkeypatch):
    """A compiled serving step calling the door, its first in the process: the trace stored
    the cache's wrapper in the door's memo, on which the trace's lookup had put a guard (not
    there), so the next step compiled a second graph that plain torch math does not; a cache
    made inside the step (an intermediate) could not be stored at all (fullgraph refused
    Dynamo's id() of it). One graph over four steps, each matching FlashInfer's definition."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from rope_dispatch.compat import flashinfer

    monkeypatch.setattr(flashinfer, "_caches", {})
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(23)
    angles = torch.rand(32, 4, generator=gen) * 6

    def step(positions, query, key, table):
        cache = torch.cat((table.cos(), table.sin()), -1) if made != "passed in" else table
        query, key = query.clone(), key.clone()
        apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache, True)
        return query, key

    table = angles if made != "passed in" else torch.cat((angles.cos(), angles.sin()), -1)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    cache = torch.cat((angles.double().cos(), angles.double().sin()), -1)
    for _ in range(4):
        positions = torch.randint(0, 32, (3,), generator=gen)
        query, key = torch.randn(3, 16, generator=gen), torch.randn(3, 8, generator=gen)
        got = compiled(positions, query, key, table)
        for name, out, x in (("query", got[0], query), ("key", got[1], key)):
            want = flashinfer_reference(positions, x, 8, cache, True)
            torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5, msg=name)
    assert counter.frame_count == 1


def test_an_eager_call_between_compiled_steps_compiles_nothing_again():
    """The door's specs are made at import: a compiled step reads their dict, and an eager call
    in another dtype that added its spec there later failed that read's guard, so the next
    compiled step compiled a second graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(29)
    angles = torch.rand(32, 4, generator=gen) * 6
    cache = torch.cat((angles.cos(), angles.sin()), -1)
    want_cache = torch.cat((angles.double().cos(), angles.double().sin()), -1)

    def step(positions, query, key):
        query, key = query.clone(), key.clone()
        apply_rope_with_cos_sin_cache_inplace(positions, query, key, 8, cache, False)
        return query, key

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float32):
        positions = torch.randint(0, 32, (3,), generator=gen)
        query, key = torch.randn(3, 16, generator=gen), torch.randn(3, 8, generator=gen)
        got = compiled(positions, query, key)
        step(positions, query.to(dtype), key.to(dtype))  # eager, in a dtype the trace did not see
        for name, out, x in (("query", got[0], query), ("key", got[1], key)):
            want = flashinfer_reference(positions, x, 8, want_cache, False)
            torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5, msg=name)
    assert counter.frame_count == 1
