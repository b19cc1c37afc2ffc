"""Calls on a second GPU of one process (Hugging Face's ``device_map="auto"``, pipeline stages,
an engine's second model): tensors on ``cuda:1`` while ``cuda:0`` is current, repeated so the
plans' device checks run, alternating devices with one spec, on a side stream, in a CUDA graph,
with norm and cache stages, and a patched model whose layers sit on both GPUs. Every result is
held to the float64 reference. Runs where two or more CUDA devices are visible."""

from __future__ import annotations

import pytest
import torch

import rope_dispatch as rd
from reference import assert_forward_backward, assert_matches, reference_for, reference_head_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

SPEC = rd.RoPESpec(layout="sbhd", dtype="bf16")
BACKENDS = ["triton", "eager", "compile", "te"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if not rd.get_backend(request.param).available:
        pytest.skip(f"{request.param} is not available here")
    return request.param


def _angles(rows: int, d2: int) -> torch.Tensor:
    rates = 1e4 ** -(torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    pairs = torch.outer(torch.arange(rows, dtype=torch.float64), rates)
    return torch.cat((pairs, pairs), -1).float().reshape(rows, 1, 1, d2)


def _data(shape, seed: int, device: str, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.fixture(autouse=True)
def _first_device_current():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


def test_apply_on_the_second_gpu_repeated_and_alternating(backend):
    """Forward and backward on ``cuda:1`` with ``cuda:0`` current, three times (the third
    call is planned), then the same spec on ``cuda:0`` and back: each device's own table."""
    tables = {dev: _angles(16, 64).to(dev) for dev in ("cuda:0", "cuda:1")}
    for call, dev in enumerate(["cuda:1"] * 3 + ["cuda:0", "cuda:1", "cuda:0"]):
        t = _data((16, 2, 4, 64), call, dev).requires_grad_(True)
        out = rd.apply(t, tables[dev], SPEC, backend=backend)
        assert out.device == torch.device(dev)
        grad_out = _data(out.shape, 100 + call, dev)
        assert_forward_backward(out, t, grad_out,
                                lambda x: reference_for(x, tables[dev].cpu(), SPEC),
                                torch.bfloat16)
        assert torch.cuda.current_device() == 0


def test_in_place_decode_with_positions_on_the_second_gpu(backend):
    """``apply_qk_`` at decode (bshd, one token, positions on the GPU) under ``no_grad``,
    repeated with new positions: the planned launch runs on the tensors' device."""
    if backend in ("compile", "te"):
        pytest.skip(f"{backend} does not rotate q and k in place")
    spec = rd.RoPESpec(layout="bshd", dtype="bf16")
    table = _angles(64, 64).to("cuda:1")
    for step in range(4):
        q0, k0 = _data((3, 1, 8, 64), step, "cuda:1"), _data((3, 1, 2, 64), 50 + step, "cuda:1")
        positions = torch.tensor([[step], [7 + step], [40 - step]], device="cuda:1")
        q, k = q0.clone(), k0.clone()
        with torch.no_grad():
            rd.apply_qk_(q, k, table, spec, positions=positions, backend=backend)
        assert_matches(q, reference_for(q0, table.cpu(), spec, positions=positions),
                       torch.bfloat16, f"q, step {step}")
        assert_matches(k, reference_for(k0, table.cpu(), spec, positions=positions),
                       torch.bfloat16, f"k, step {step}")


def test_a_side_stream_of_the_second_gpu(backend):
    """A call made on a side stream of ``cuda:1`` runs on that stream, after the work queued
    there before it: the input is written on that stream behind a long sleep, so a launch on
    any other stream would read it unwritten."""
    table = _angles(512, 128).to("cuda:1")
    src = _data((512, 4, 16, 128), 3, "cuda:1")
    want = reference_for(src, table.cpu(), SPEC)
    side = torch.cuda.Stream(device="cuda:1")
    for _ in range(3):
        t = torch.zeros_like(src)
        side.wait_stream(torch.cuda.current_stream("cuda:1"))
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            t.copy_(src)
            out = rd.apply(t, table, SPEC, backend=backend)
        side.synchronize()
        assert_matches(out, want, torch.bfloat16)


def test_norm_stage_gradients_on_the_second_gpu(backend):
    """``apply_qk`` with both norms on ``cuda:1`` (``apply`` of each on the compile backend),
    forward and backward, twice: q, k and both weights' gradients."""
    if backend == "te":
        pytest.skip("TransformerEngine has no norm stage (refused by name elsewhere)")
    dev = "cuda:1"
    table = _angles(8, 64).to(dev)
    for call in range(2):
        q = _data((8, 2, 4, 64), call, dev, torch.float32).requires_grad_(True)
        k = _data((8, 2, 2, 64), 10 + call, dev, torch.float32).requires_grad_(True)
        wq = (1 + 0.1 * _data(64, 20, dev, torch.float32)).requires_grad_(True)
        wk = (1 + 0.1 * _data(64, 21, dev, torch.float32)).requires_grad_(True)
        spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
        if backend == "compile":  # single tensors only
            q_out, k_out = (rd.apply(x, table, spec, norm=rd.HeadNorm(w), backend=backend)
                            for x, w in ((q, wq), (k, wk)))
        else:
            q_out, k_out = rd.apply_qk(q, k, table, spec, q_norm=rd.HeadNorm(wq),
                                       k_norm=rd.HeadNorm(wk), backend=backend)
        gq, gk = _data(q_out.shape, 30, dev, torch.float32), _data(k_out.shape, 31, dev,
                                                                   torch.float32)
        got = torch.autograd.grad((q_out, k_out), (q, k, wq, wk), (gq, gk))
        leaves = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, wq, wk)]
        want_q = reference_for(reference_head_norm(leaves[0], leaves[2], 1e-6, 0.0, "head"),
                               table.cpu(), spec)
        want_k = reference_for(reference_head_norm(leaves[1], leaves[3], 1e-6, 0.0, "head"),
                               table.cpu(), spec)
        want = torch.autograd.grad((want_q, want_k), leaves, (gq.cpu().double(),
                                                              gk.cpu().double()))
        assert_matches(q_out, want_q, torch.float32, "q")
        assert_matches(k_out, want_k, torch.float32, "k")
        for name, g, w in zip(("dq", "dk", "dwq", "dwk"), got, want):
            assert g.device == torch.device(dev), name
            assert torch.allclose(g.double().cpu(), w, rtol=1e-4, atol=1e-4), name


def test_cache_stage_on_the_second_gpu_in_a_cuda_graph():
    """``rope_to_cache`` into a vLLM paged cache on ``cuda:1``, eagerly twice and then replayed
    from a CUDA graph captured there with new positions and slots: q and the written slots
    against the float64 reference, every other slot untouched."""
    if not rd.get_backend("triton").available:
        pytest.skip("the triton backend is not available")
    dev = "cuda:1"
    tokens, d = 4, 64
    spec = rd.RoPESpec(layout="thd", dtype="bf16")
    table = _angles(32, d).to(dev)
    q, k, v = (_data((tokens, h, d), s, dev) for s, h in ((1, 4), (2, 2), (3, 2)))
    k_cache = torch.zeros(8, 4, 2, d, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
    slots = torch.zeros(tokens, dtype=torch.int64, device=dev)
    cache = rd.PagedKVCache(k_cache, v_cache, slots)

    def step():
        return rd.rope_to_cache(q, k, v, table, spec, positions=positions, cache=cache,
                                backend="triton")

    def check(out, seed):
        flat_k, flat_v = k_cache.view(-1, 2, d), v_cache.view(-1, 2, d)
        at = positions.cpu()
        assert_matches(out, reference_for(q, table.cpu(), spec, positions=at), torch.bfloat16,
                       f"q {seed}")
        assert_matches(flat_k[slots], reference_for(k, table.cpu(), spec, positions=at),
                       torch.bfloat16, f"k {seed}")
        assert torch.equal(flat_v[slots], v), f"v {seed}"
        others = torch.ones(flat_k.shape[0], dtype=torch.bool)
        others[slots.cpu()] = False
        assert not flat_k[others.to(dev)].any() and not flat_v[others.to(dev)].any()

    def new_step(seed):
        gen = torch.Generator().manual_seed(seed)
        positions.copy_(torch.randint(0, 32, (tokens,), generator=gen))
        slots.copy_(torch.randperm(32, generator=gen)[:tokens])
        k_cache.zero_()
        v_cache.zero_()

    for seed in (1, 2):
        new_step(seed)
        check(step(), seed)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(dev), torch.cuda.graph(graph):
        out = step()
    for seed in (3, 4):
        new_step(seed)
        graph.replay()
        torch.cuda.synchronize(dev)
        check(out, seed)


def test_a_patched_model_split_over_two_gpus():
    """A tiny Llama with its second half of layers on ``cuda:1`` (as ``device_map="auto"``
    places them; hooks move the hidden states and the rotary embedding's cos and sin): the
    patched model's logits and every gradient equal the unpatched model's."""
    transformers = pytest.importorskip("transformers")
    from rope_dispatch.integrations import hf

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda:0", torch.float32)
    for layer in model.model.layers[2:]:
        layer.to("cuda:1")

        def to_layer(module, args, kwargs, dev=torch.device("cuda:1")):
            moved = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
            kwargs = {name: (tuple(moved(y) for y in x) if isinstance(x, tuple) else moved(x))
                      for name, x in kwargs.items()}
            return tuple(moved(x) for x in args), kwargs

        layer.register_forward_pre_hook(to_layer, with_kwargs=True)
    model.model.norm.register_forward_pre_hook(lambda m, args: tuple(x.to("cuda:0")
                                                                     for x in args))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()

    def run():
        model.zero_grad()
        logits = model(ids).logits
        logits.float().pow(2).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logits, want_grads = run()
    hf.patch(model)
    try:
        for _ in range(2):
            logits, grads = run()
            assert torch.allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
            for name, grad in grads.items():
                assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name
    finally:
        hf.unpatch(model)
