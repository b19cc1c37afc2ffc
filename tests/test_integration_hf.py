"""``rope_dispatch.integrations.hf``: transformers' ``apply_rotary_pos_emb`` and
``apply_multimodal_rotary_pos_emb`` against float64 references written from their formulas and
against transformers' own functions, and ``patch`` on tiny random Llama, Mistral, Qwen2, Qwen3,
Gemma, Qwen2-VL and Qwen2.5-VL models (same logits and gradients, and ``unpatch`` binds the
original objects back)."""

from __future__ import annotations

import importlib
import re
import types

import pytest
import torch
import transformers

import rope_dispatch as rd
from rope_dispatch.integrations import hf, hf_shared

TOKENS = 12
MODEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the tiny models run: on the GPU machine the patched model takes the Triton kernels."""
SAME = dict(rtol=1e-4, atol=1e-5) if MODEL_DEVICE == "cuda" else {}
"""Patched against unpatched: bit-close on the CPU (the same eager math); on CUDA our kernel
and transformers' ops round differently (fused multiply-adds), well inside float32 error."""
BATCH = 2
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM"),
    "Mistral": ("MistralConfig", "MistralForCausalLM"),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM"),
}


VL_FAMILIES = {
    "Qwen2-VL": (
        "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
        dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
    ),
    "Qwen2.5-VL": (
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
        dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
             fullatt_block_indexes=[0]),
    ),
}
"""Family -> (config class, model class, a tiny vision tower's config: built, never run)."""
MROPE_NAME = "apply_multimodal_rotary_pos_emb"


def modeling(family: str):
    """The modeling module whose globals the family's attention calls."""
    return importlib.import_module(hf.SUPPORTED_MODELS[family][0])


pytestmark = pytest.mark.usefixtures("hf_modules_restored")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim's two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin, unsqueeze_dim):
    """``x * cos + rotate_half(x) * sin`` in float64 on the first ``d2`` channels (``d2`` =
    cos's last dim), the rest copied; differentiable."""
    cos = cos.double().unsqueeze(unsqueeze_dim)
    sin = sin.double().unsqueeze(unsqueeze_dim)
    d2 = cos.shape[-1]

    def one(x):
        x = x.double()
        rotated = x[..., :d2] * cos + rotate_half(x[..., :d2]) * sin
        return torch.cat((rotated, x[..., d2:]), dim=-1)

    return one(q), one(k)


def inputs(dtype, unsqueeze_dim, heads=4, kv_heads=2, head_dim=16, rotary_dim=None, batch_cos=BATCH, seed=0,
           device="cpu"):
    """q and k as a model makes them: views of one projection output (non-contiguous), in
    ``[b, heads, s, d]`` for ``unsqueeze_dim=1`` and ``[b, s, heads, d]`` for 2; per-token cos
    and sin ``[batch_cos, s, d2]`` of random angles (the two halves equal), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = rotary_dim or head_dim
    width = (heads + 2 * kv_heads) * head_dim
    projected = torch.randn(BATCH, TOKENS, width, generator=gen).to(dtype).to(device)
    q = projected[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = projected[..., heads * head_dim : (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.rand(batch_cos, TOKENS, rotary_dim // 2, generator=gen, dtype=torch.float64) * 40
    angles = torch.cat((angles, angles), dim=-1)
    return (
        q.detach().requires_grad_(), k.detach().requires_grad_(),
        angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device),
    )


def tolerance(dtype):
    """Our result is float32 math rounded once to ``dtype``."""
    return dict(rtol=2**-8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_matches_the_formula_and_transformers(dtype, unsqueeze_dim, batch_cos):
    q, k, cos, sin = inputs(dtype, unsqueeze_dim, batch_cos=batch_cos)
    assert not q.is_contiguous() and q.shape[1 if unsqueeze_dim == 1 else 2] == 4
    out_q, out_k = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    ref_q, ref_k = reference(q, k, cos, sin, unsqueeze_dim)
    hf_q, hf_k = modeling("Llama").apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    check_outputs((out_q, out_k), (ref_q, ref_k), (hf_q, hf_k))


def check_outputs(ours, exact, theirs) -> None:
    """Our q and k against the float64 reference (within the dtype's tolerance) and against
    transformers' (close in float32; in bf16 theirs rounds three times and ours once, so ours
    is never further from the reference)."""
    for out, ref, their in zip(ours, exact, theirs):
        assert out.shape == their.shape and out.dtype == their.dtype
        torch.testing.assert_close(out.double(), ref.detach(), **tolerance(out.dtype))
        if out.dtype == torch.float32:
            torch.testing.assert_close(out, their, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(out, their, rtol=2**-7, atol=2**-5)
            assert (out.double() - ref).abs().max() <= (their.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_gradients_flow_to_q_and_k_as_in_transformers(dtype, unsqueeze_dim):
    q, k, cos, sin = inputs(dtype, unsqueeze_dim, seed=1)
    check_gradients(q, k, (cos, sin, unsqueeze_dim), hf.apply_rotary_pos_emb, reference,
                    modeling("Llama").apply_rotary_pos_emb)


def test_gradients_flow_to_cos_and_sin_made_from_inputs():
    """cos and sin computed from something that requires grad (ESMFold 2 makes them from its
    reference positions): its gradient through our call equals the float64 formula's."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)
    grad_q, grad_k = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    base = torch.rand(2, 6, 8, generator=gen, dtype=torch.float64) * 4

    def angle_grad(fn, dtype):
        angles = base.to(dtype).requires_grad_(True)
        doubled = torch.cat((angles, angles), -1)
        out_q, out_k = fn(q.to(dtype), k.to(dtype), doubled.cos(), doubled.sin())
        torch.autograd.backward((out_q, out_k), (grad_q.to(dtype), grad_k.to(dtype)))
        return angles.grad

    def formula(q, k, cos, sin):
        def turn(x):
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
            return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
        return turn(q), turn(k)

    got = angle_grad(hf.apply_rotary_pos_emb, torch.float32)
    assert got is not None and got.abs().max() > 0
    torch.testing.assert_close(got.double(), angle_grad(formula, torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_cos_and_sin_gradients_survive_reentrant_checkpointing():
    """A layer under ``checkpoint(use_reentrant=True)`` with cos and sin passed in by keyword
    (as transformers' layers take ``position_embeddings``): its forward runs without grad and
    its recomputation with grad, on the same cos and sin; the gradient of the angles they are
    made from equals the float64 formula's, as without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)
    base = torch.rand(2, 6, 8, generator=gen, dtype=torch.float64) * 4

    def angle_grad(dtype, layer):
        angles = base.to(dtype).requires_grad_(True)
        doubled = torch.cat((angles, angles), -1)
        cos, sin = doubled.cos(), doubled.sin()
        x = q.to(dtype).requires_grad_(True)
        out_q, out_k = layer(x, cos=cos, sin=sin)
        (out_q.square().sum() + out_k.square().sum()).backward()
        return angles.grad

    def ours(x, cos, sin):
        return checkpoint(lambda x: hf.apply_rotary_pos_emb(x, k, cos, sin), x,
                          use_reentrant=True)

    def formula(x, cos, sin):
        def turn(t):
            half = t.shape[-1] // 2
            return t * cos.unsqueeze(1) + torch.cat((-t[..., half:], t[..., :half]), -1) * (
                sin.unsqueeze(1))
        return turn(x), turn(k.double())

    got = angle_grad(torch.float32, ours)
    assert got is not None
    torch.testing.assert_close(got.double(), angle_grad(torch.float64, formula),
                               rtol=1e-5, atol=1e-5)


def check_gradients(q, k, args: tuple, ours, exact, theirs) -> None:
    """q's and k's gradients through ``ours(q, k, *args)`` match the float64 ``exact`` within
    the dtype's tolerance, and transformers' ``theirs`` closely in float32."""
    dtype = q.dtype
    gen = torch.Generator().manual_seed(2)
    grad_q, grad_k = (torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k))

    def grads(fn):
        q.grad = k.grad = None
        out_q, out_k = fn(q, k, *args)
        torch.autograd.backward((out_q, out_k), (grad_q.to(out_q.dtype), grad_k.to(out_k.dtype)))
        return q.grad.clone(), k.grad.clone()

    for g, ref, their in zip(grads(ours), grads(exact), grads(theirs)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), ref.double(), **tolerance(dtype))
        if dtype == torch.float32:
            torch.testing.assert_close(g, their, rtol=1e-6, atol=1e-6)


def test_partial_rotary_passes_the_rest_through():
    """cos narrower than the head dim: the first d2 channels rotate, the rest are copied
    (transformers' own function would fail to broadcast)."""
    q, k, cos, sin = inputs(torch.float32, 1, head_dim=16, rotary_dim=8, seed=3)
    out_q, out_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    ref_q, ref_k = reference(q, k, cos, sin, 1)
    torch.testing.assert_close(out_q.double(), ref_q.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k.double(), ref_k.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(out_q[..., 8:], q[..., 8:])


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_cos_of_no_channels_passes_q_and_k_through(unsqueeze_dim):
    """``d2 = 0`` (GPT-NeoX or StableLM with a ``partial_rotary_factor`` under ``2 / d``, whose
    transformers function passes every channel through): q and k come back unchanged, with
    their gradients."""
    q, k, cos, sin = inputs(torch.float32, unsqueeze_dim, seed=3)
    cos, sin = cos[..., :0], sin[..., :0]
    got = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    for out, x, want in zip(got, (q, k), reference(q, k, cos, sin, unsqueeze_dim)):
        assert out.shape == x.shape
        torch.testing.assert_close(out.double(), want.detach(), rtol=0, atol=0)
    grads = torch.autograd.grad(got, (q, k), (torch.ones_like(q), torch.ones_like(k)))
    assert all(torch.equal(g, torch.ones_like(g)) for g in grads)


@pytest.mark.parametrize("empty", ["batch", "seq"])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_no_tokens_give_empty_outputs(empty, batch_cos):
    """An empty batch or sequence (cos and sin of no rows, as the rotary embedding makes them
    for no tokens): empty q and k come back, as from transformers' function."""
    q, k, cos, sin = inputs(torch.float32, 1, batch_cos=batch_cos)
    if empty == "batch":
        q, k = q[:0], k[:0]
        cos, sin = (cos, sin) if batch_cos == 1 else (cos[:0], sin[:0])
    else:
        q, k, cos, sin = q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0]
    got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for out, x, want in zip(got, (q, k), reference(q, k, cos, sin, 1)):
        assert out.shape == x.shape == want.shape and out.dtype == x.dtype


def test_other_unsqueeze_dims_are_refused():
    q, k, cos, sin = inputs(torch.float32, 1)
    with pytest.raises(rd.RoPEError, match="unsqueeze_dim must be 1"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    for not_an_int in (1.0, True, "1", None):  # transformers' torch.unsqueeze refuses these
        with pytest.raises(rd.RoPEError, match=rf"unsqueeze_dim must be 1 .*got {not_an_int!r}"):
            hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=not_an_int)
    with pytest.raises(rd.RoPEError, match=r"or \[seq, rotary_dim\] with unsqueeze_dim=0"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)  # a [b, s, d2] cos
    with pytest.raises(rd.RoPEError, match=r"or \[seq, rotary_dim\] with unsqueeze_dim=0"):
        hf.apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("drop", ["q", "k"])
def test_q_or_k_without_four_dims_is_refused_by_name(unsqueeze_dim, drop):
    """q or k without its batch dim (``[heads, s, d]``): an error naming q and k, their shapes
    and the layout expected, not one blaming cos with a batch read off the heads."""
    q, k, cos, sin = inputs(torch.float32, unsqueeze_dim)
    q, k = (q[0], k) if drop == "q" else (q, k[0])
    layout = r"\[b, heads, s, d\]" if unsqueeze_dim == 1 else r"\[b, s, heads, d\]"
    with pytest.raises(rd.RoPEError, match=rf"q and k must be 4-D, {layout}.*got q "
                       rf"{re.escape(str(tuple(q.shape)))}, k {re.escape(str(tuple(k.shape)))}"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def test_a_dtype_rope_dispatch_does_not_compute_in_is_refused_by_name():
    q, k, cos, sin = (x.double() for x in inputs(torch.float32, 1))
    with pytest.raises(rd.RoPEError, match="q is torch.float64: .* hf.unpatch the model"):
        hf.apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsqueeze_dim_0_takes_a_cos_shared_by_batch_and_heads(dtype):
    """Pixtral's call: q and k ``[b, heads, s, d]`` with cos and sin ``[s, d2]``
    (``unsqueeze_dim=0``); outputs and gradients as the formula and as transformers'."""
    q, k, cos, sin = inputs(dtype, 1, batch_cos=1, seed=5)
    cos, sin = cos[0], sin[0]
    args = (cos, sin, 0)
    check_outputs(hf.apply_rotary_pos_emb(q, k, *args), reference(q, k, *args),
                  modeling("Llama").apply_rotary_pos_emb(q, k, *args))
    check_gradients(q, k, args, hf.apply_rotary_pos_emb, reference,
                    modeling("Llama").apply_rotary_pos_emb)


def _cos_sin_pairs(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` contiguous cos/sin pairs ``[1, 3, 4]`` of distinct values."""
    return [(torch.full((1, 3, 4), 1.0 + i), torch.full((1, 3, 4), -1.0 - i))
            for i in range(count)]


def _holds(table: rd.CosSinCache, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return torch.equal(table.cos, cos.reshape(-1, 4)) and torch.equal(table.sin, sin.reshape(-1, 4))


def test_the_kept_token_table_is_never_another_calls():
    """A call interrupted between any two of its instructions by another call (a thread
    switch) gets the table of its own cos and sin: the kept table, its cos and sin were read
    one by one, so a call that read the table kept for other tensors, then found its own
    tensors kept by the interrupting call, returned that other table."""
    from interleave import interrupted_at_every_instruction

    (cos, sin), (other_cos, other_sin) = _cos_sin_pairs(2)
    hf._forget()
    try:
        for before, between in (((other_cos, other_sin), (cos, sin)),
                                ((cos, sin), (other_cos, other_sin)), (None, (cos, sin))):
            def prepare(before=before):
                hf._forget()
                if before is not None:
                    hf._token_table(*before)

            results = interrupted_at_every_instruction(
                hf._token_table.__code__, prepare, lambda: hf._token_table(cos, sin),
                lambda between=between: hf._token_table(*between))
            assert len(results) > 10
            for k, table in results:
                assert _holds(table, cos, sin), f"another call's table (interrupted at {k})"
    finally:
        hf._forget()


def test_the_kept_stream_pick_is_never_another_calls():
    """As the token table: a multimodal call interrupted between any two instructions of
    ``_select_streams`` by another call (a thread switch; any instruction on a free-threaded
    Python) gets the pick of its own cos and sin, channel ``c`` from the stream whose section
    holds ``c`` modulo half the channels; the kept pick was read one slot at a time."""
    from interleave import hammered, interrupted_at_every_instruction

    sections, d2 = (1, 2, 1), 8
    streams = [(torch.randn(3, 1, 2, d2, generator=torch.Generator().manual_seed(i)),
                torch.randn(3, 1, 2, d2, generator=torch.Generator().manual_seed(10 + i)))
               for i in range(3)]
    owner = torch.tensor([0, 1, 1, 2] * 2)  # each channel's stream, from the sections

    def holds(picked, cos, sin) -> bool:
        return all(torch.equal(p, t[owner, ..., torch.arange(d2)].permute(1, 2, 0))
                   for p, t in zip(picked, (cos, sin)))

    ours, other = streams[0], streams[1]
    try:
        for before, between in ((other, ours), (ours, other), (None, ours)):
            def prepare(before=before):
                hf._forget()
                if before is not None:
                    hf._select_streams(*before, sections, 1)

            results = interrupted_at_every_instruction(
                hf._select_streams.__code__, prepare,
                lambda: hf._select_streams(*ours, sections, 1),
                lambda between=between: hf._select_streams(*between, sections, 1))
            assert len(results) > 10
            for k, picked in results:
                assert holds(picked, *ours), f"another call's pick (interrupted at {k})"

        def work(i: int) -> None:
            for n in range(1000):
                cos, sin = streams[(n // (i + 1)) % 3]
                assert holds(hf._select_streams(cos, sin, sections, 1), cos, sin), f"{i}, {n}"

        hammered(work)
    finally:
        hf._forget()


def test_the_kept_token_table_hammered_from_threads():
    """Threads calling at once, each over shared cos/sin pairs: every call gets its own."""
    from interleave import hammered

    pairs = _cos_sin_pairs(3)

    def work(i: int) -> None:
        for n in range(2000):
            cos, sin = pairs[(n // (i + 1)) % 3]
            assert _holds(hf._token_table(cos, sin), cos, sin), f"thread {i}, call {n}"

    try:
        hammered(work)
    finally:
        hf._forget()


COMPILED_FIRST = """
import sys, torch
from rope_dispatch.integrations import hf
q, k, cos, sin = torch.load(sys.argv[1])
compiled = torch.compile(hf.apply_rotary_pos_emb, fullgraph=True, backend="aot_eager")
torch.save(compiled(q, k, cos, sin), sys.argv[2])
"""


def test_first_call_of_a_process_compiles_with_fullgraph(tmp_path):
    """A model's first RoPE call inside ``torch.compile(fullgraph=True)``, in a new process:
    nothing the door makes on first use (its spec) breaks the graph."""
    import subprocess
    import sys

    q, k, cos, sin = inputs(torch.float32, 1)
    torch.save([t.detach() for t in (q, k, cos, sin)], tmp_path / "inputs.pt")
    done = subprocess.run(
        [sys.executable, "-c", COMPILED_FIRST, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out_q, out_k = torch.load(tmp_path / "out.pt")
    for out, ref in zip((out_q, out_k), reference(q, k, cos, sin, 1)):
        torch.testing.assert_close(out.double(), ref.detach(), **tolerance(torch.float32))


def test_start_positions_cache_stays_small():
    q, k, cos, sin = inputs(torch.float32, 2)
    hf_shared._starts.clear()
    for _ in range(3):
        hf.apply_rotary_pos_emb(q, k, cos, sin, 2)
    assert len(hf_shared._starts) == 1
    for tokens in range(1, hf_shared._MAX_STARTS + 10):
        hf_shared._sequence_starts(cos[:, :tokens], q[:, :tokens])
    assert len(hf_shared._starts) <= hf_shared._MAX_STARTS


def test_per_token_cos_reaches_the_kernels_as_start_positions(monkeypatch):
    """``[b, s, d2]`` cos and sin reach apply_qk as a ``[b * s, d2]`` table and start
    positions ``i * s`` (one per sequence), ``[1, s, d2]`` ones by index."""
    seen = []
    real = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    q, k, cos, sin = inputs(torch.float32, 2)
    hf.apply_rotary_pos_emb(q, k, cos, sin, 2)
    hf.apply_rotary_pos_emb(q, k, cos[:1], sin[:1], 2)
    assert seen[0]["start_positions"].tolist() == [i * TOKENS for i in range(BATCH)]
    assert seen[1]["start_positions"] is None


@pytest.mark.parametrize("shape", [(BATCH, TOKENS - 1, 16), (1, TOKENS + 1, 16), (BATCH, 16)])
def test_cos_of_another_sequence_length_is_refused(shape):
    """transformers' formula would not broadcast these against q's tokens; a table
    whose rows run on past q's tokens would put one sequence's rows on the next one's tokens."""
    q, k, cos, sin = inputs(torch.float32, 2)
    bad = torch.zeros(shape)
    with pytest.raises(rd.RoPEError, match="cos must be"):
        hf.apply_rotary_pos_emb(q, k, bad, bad, 2)


@pytest.mark.parametrize("rows, width", [(1, 16), (BATCH, 8)])
def test_sin_of_another_shape_than_cos_is_refused_by_name(rows, width):
    """The model's sin always has its cos's shape; another one is named as the caller passed
    it, not as the flattened table it would have become."""
    q, k, cos, sin = inputs(torch.float32, 1)
    bad = sin[:rows, :, :width]
    expected = (rf"sin must have cos's shape \({BATCH}, {TOKENS}, 16\), "
                rf"got \({rows}, {TOKENS}, {width}\)")
    with pytest.raises(rd.RoPEError, match=expected):
        hf.apply_rotary_pos_emb(q, k, cos, bad)


def stream_of_channels(d2: int, mrope_section) -> list[int]:
    """The stream (0 temporal, 1 height, 2 width) each of the ``d2`` rotary channels reads: in
    both halves, the first ``t`` channels temporal, then ``h`` height, then ``w`` width."""
    per_half = [stream for stream, size in enumerate(mrope_section) for _ in range(size)]
    assert len(per_half) == d2 // 2
    return per_half + per_half


def multimodal_reference(q, k, cos, sin, mrope_section, unsqueeze_dim):
    """The float64 reference on per-token cos and sin picked channel by channel from the three
    streams of ``[3, b, s, d2]`` ones."""
    streams = stream_of_channels(cos.shape[-1], mrope_section)

    def pick(table):
        return torch.stack([table[stream, ..., c] for c, stream in enumerate(streams)], dim=-1)

    return reference(q, k, pick(cos), pick(sin), unsqueeze_dim)


def transformers_multimodal(q, k, cos, sin, mrope_section, unsqueeze_dim):
    """transformers 5.23's own path for the same call: its Qwen2-VL rotary embedding picks the
    streams (``recomposition_frequencies``, which reads only ``mrope_section``, on the first
    half) and its ``apply_rotary_pos_emb`` rotates."""
    module = modeling("Qwen2-VL")
    rotary = types.SimpleNamespace(mrope_section=list(mrope_section))
    half = cos.shape[-1] // 2
    recompose = module.Qwen2VLRotaryEmbedding.recomposition_frequencies
    cos, sin = recompose(rotary, cos[..., :half]), recompose(rotary, sin[..., :half])
    return module.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


SECTIONS = [(2, 3, 3), (8, 0, 0), (1, 1, 6), (0, 5, 3)]


def multimodal_inputs(dtype, unsqueeze_dim, batch_cos=BATCH, seed=0, equal_halves=True):
    """q and k as :func:`inputs` makes them (head dim 16), and cos and sin ``[3, batch_cos, s,
    16]`` of three streams of different random angles (the two halves equal, as the models make
    them, unless ``equal_halves`` is false)."""
    q, k, _, _ = inputs(dtype, unsqueeze_dim, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    angles = torch.rand(3, batch_cos, TOKENS, 16 if not equal_halves else 8, generator=gen,
                        dtype=torch.float64) * 40
    if equal_halves:
        angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
@pytest.mark.parametrize("mrope_section", SECTIONS)
def test_multimodal_matches_the_formula_and_transformers(dtype, unsqueeze_dim, batch_cos,
                                                         mrope_section):
    q, k, cos, sin = multimodal_inputs(dtype, unsqueeze_dim, batch_cos)
    out_q, out_k = hf.apply_multimodal_rotary_pos_emb(
        q, k, cos, sin, list(mrope_section), unsqueeze_dim
    )
    ref_q, ref_k = multimodal_reference(q, k, cos, sin, mrope_section, unsqueeze_dim)
    hf_q, hf_k = transformers_multimodal(q, k, cos, sin, mrope_section, unsqueeze_dim)
    check_outputs((out_q, out_k), (ref_q, ref_k), (hf_q, hf_k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("mrope_section", SECTIONS[:3])
def test_multimodal_gradients_flow_to_q_and_k_as_in_transformers(dtype, unsqueeze_dim,
                                                                 mrope_section):
    q, k, cos, sin = multimodal_inputs(dtype, unsqueeze_dim, seed=1)
    check_gradients(q, k, (cos, sin, mrope_section, unsqueeze_dim),
                    hf.apply_multimodal_rotary_pos_emb, multimodal_reference,
                    transformers_multimodal)


def test_multimodal_cos_and_sin_gradients_survive_reentrant_checkpointing():
    """``[3, b, s, d2]`` cos and sin made from angles that require grad, the call under
    ``checkpoint(use_reentrant=True)`` (forward without grad, recomputation with grad, the
    same cos and sin): the angles' gradient equals the float64 reference's."""
    from torch.utils.checkpoint import checkpoint

    q, k, _, _ = inputs(torch.float32, 1, seed=9)
    base = torch.rand(3, BATCH, TOKENS, 8, generator=torch.Generator().manual_seed(9),
                      dtype=torch.float64) * 4

    def angle_grad(dtype, call):
        angles = base.to(dtype).requires_grad_(True)
        doubled = torch.cat((angles, angles), -1)
        out_q, out_k = call(q.detach().to(dtype).requires_grad_(True), doubled.cos(),
                            doubled.sin())
        (out_q.square().sum() + out_k.square().sum()).backward()
        return angles.grad

    got = angle_grad(torch.float32, lambda x, cos, sin: checkpoint(
        lambda x: hf.apply_multimodal_rotary_pos_emb(x, k, cos, sin, (2, 3, 3)), x,
        use_reentrant=True))
    want = angle_grad(torch.float64, lambda x, cos, sin: multimodal_reference(
        x, k, cos, sin, (2, 3, 3), 1))
    assert got is not None
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_multimodal_sections_apply_to_each_half_of_any_table():
    """Streams whose two halves differ: each half takes its own channels of the picked stream
    (transformers' function splits the whole rotary dim by the doubled list)."""
    q, k, cos, sin = multimodal_inputs(torch.float32, 1, seed=7, equal_halves=False)
    got = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, (3, 1, 4))
    for out, want in zip(got, multimodal_reference(q, k, cos, sin, (3, 1, 4), 1)):
        torch.testing.assert_close(out.double(), want.detach(), **tolerance(torch.float32))


@pytest.mark.parametrize(
    "mrope_section, expected",
    [
        ([2, 3, 2], r"summing to 8, half of cos's last dim 16; got \[2, 3, 2\] \(sum 7\)"),
        ([4, 4], r"must be 3 non-negative integers .* got \[4, 4\]$"),
        ([2, 2, 2, 2], r"must be 3 non-negative integers .* got \[2, 2, 2, 2\]$"),
        ([10, -1, -1], r"got \[10, -1, -1\]"),
        ([2.0, 3, 3], r"got \[2.0, 3, 3\]"),
        ([True, 3, 4], r"must be 3 non-negative integers .* got \[True, 3, 4\]$"),
        ([2, 3, 3, False], r"must be 3 non-negative integers .* got \[2, 3, 3, False\]$"),
        (8, r"got 8$"),
    ],
)
def test_bad_mrope_section_is_refused_by_name(mrope_section, expected):
    q, k, cos, sin = multimodal_inputs(torch.float32, 1)
    with pytest.raises(rd.RoPEError, match=r"^mrope_section must be ") as err:
        hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)
    assert err.match(expected)


def test_bad_multimodal_cos_and_sin_are_refused_by_name():
    q, k, cos, sin = multimodal_inputs(torch.float32, 1)
    bad = {
        "cos": [(cos[0], sin[0]), (cos[:2], sin[:2]), (torch.cat((cos, cos), 1),) * 2],
        "sin": [(cos, sin[..., :8])],
    }
    for name, pairs in bad.items():
        for bad_cos, bad_sin in pairs:
            with pytest.raises(rd.RoPEError, match=rf"^{name} must ") as err:
                hf.apply_multimodal_rotary_pos_emb(q, k, bad_cos, bad_sin, [2, 3, 3])
            assert str(tuple(bad_sin.shape if name == "sin" else bad_cos.shape)) in str(err.value)
    expected = r"\[3, batch, seq, rotary_dim\] .* batch 1 or q's batch 2"
    with pytest.raises(rd.RoPEError, match=expected):
        hf.apply_multimodal_rotary_pos_emb(q, k, cos[0], sin[0], [2, 3, 3])


def tiny_model(family: str, attention: str = "sdpa") -> torch.nn.Module:
    """A two-layer model of ``family`` with random weights (no download), float32."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().train().to(MODEL_DEVICE)


def step(model, ids, position_ids):
    """Logits and the gradient of every parameter the loss reaches, of one language-model loss
    (a text-only input leaves a multimodal model's vision tower out)."""
    model.zero_grad(set_to_none=True)
    ids = ids.to(MODEL_DEVICE)
    position_ids = None if position_ids is None else position_ids.to(MODEL_DEVICE)
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def patch_counting(model, module, monkeypatch) -> list:
    """Patch ``model`` (twice: a second patch is a no-op) with every call into rope-dispatch's
    q and k entry counted; the list of counts, filled as the patched model runs."""
    calls = []
    apply_qk = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: calls.append(1) or apply_qk(*a, **kw))
    assert hf.patch(model) is model
    hf.patch(model)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    return calls


@pytest.mark.parametrize(
    "family, attention", [(f, "sdpa") for f in FAMILIES] + [("Llama", "eager")]
)
def test_patched_model_gives_the_same_logits_and_gradients(family, attention, monkeypatch):
    model = tiny_model(family, attention)
    module = modeling(family)
    original = module.apply_rotary_pos_emb
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    # per-row offsets: cos and sin differ per sequence, so each token reads its own row
    position_ids = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
    expected = [step(model, ids, p) for p in (None, position_ids)]

    calls = patch_counting(model, module, monkeypatch)
    for p, (logits, grads) in zip((None, position_ids), expected):
        got_logits, got_grads = step(model, ids, p)
        torch.testing.assert_close(got_logits, logits, **SAME)
        assert got_grads.keys() == grads.keys() == {n for n, _ in model.named_parameters()}
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, msg=name, **SAME)
    assert len(calls) == 2 * model.config.num_hidden_layers

    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_selective_checkpointing_that_saves_every_op(family):
    """Gradient checkpointing with a selective policy (``context_fn`` in
    ``gradient_checkpointing_kwargs``) that saves every op: the recomputation is handed the
    forward's saved outputs in the forward's order, so the first layer's recomputation must
    make what its forward made (no cos/sin table or start positions kept from the forward,
    nothing made and then written in place). Logits and gradients are the unpatched model's
    without checkpointing, with cos shared by the batch and per row."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    model = tiny_model(family)
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    position_ids = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
    expected = [step(model, ids, p) for p in (None, position_ids)]

    def save_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, save_all)})
    hf.patch(model)
    try:
        for p, (logits, grads) in zip((None, position_ids), expected):
            got_logits, got_grads = step(model, ids, p)
            torch.testing.assert_close(got_logits, logits, **SAME)
            assert got_grads.keys() == grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(got_grads[name], grad, msg=name, **SAME)
    finally:
        hf.unpatch(model)


def test_patched_generation_is_unchanged():
    """Greedy decoding with a KV cache and a left-padded batch (per-row positions at every
    step): the same tokens and step logits patched and unpatched."""
    model = tiny_model("Qwen3").eval()
    ids = torch.randint(1, 128, (BATCH, 6), generator=torch.Generator().manual_seed(5))
    ids = ids.to(MODEL_DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    settings = dict(
        attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )

    def generate():
        with torch.no_grad():
            return model.generate(ids, **settings)

    expected = generate()
    hf.patch(model)
    got = generate()
    hf.unpatch(model)
    assert torch.equal(got.sequences, expected.sequences)
    for step_logits, expected_logits in zip(got.logits, expected.logits):
        torch.testing.assert_close(step_logits, expected_logits, **SAME)


def test_unpatch_leaves_a_later_patch_alone():
    model = tiny_model("Llama")
    module = modeling("Llama")

    def later(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    hf.patch(model)
    module.apply_rotary_pos_emb = later
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is later


def test_unpatching_one_model_leaves_another_patched_model_patched(monkeypatch):
    """Two Qwen3 models patched (their q and k norms fused), one unpatched: the other keeps our
    call and its fused norms (one apply_qk call per layer, with the norms), its logits still
    the unpatched ones; the module's own function comes back with the last unpatch. A model
    dropped while patched holds nothing back."""
    import gc

    module = modeling("Qwen3")
    original = module.apply_rotary_pos_emb
    first, second = tiny_model("Qwen3").eval(), tiny_model("Qwen3").eval()
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    ids = ids.to(MODEL_DEVICE)

    def logits():
        with torch.no_grad():
            return second(input_ids=ids).logits

    expected = logits()
    hf.patch(tiny_model("Qwen3"))  # dropped at once, never unpatched
    gc.collect()
    hf.patch(first)
    hf.patch(second)
    hf.unpatch(first)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    assert not [name for name, m in first.named_modules() if "forward" in vars(m)]
    norms = []
    apply_qk = hf.apply_qk
    monkeypatch.setattr(hf, "apply_qk", lambda *a, **kw: norms.append(
        (kw.get("q_norm"), kw.get("k_norm"))) or apply_qk(*a, **kw))
    torch.testing.assert_close(logits(), expected, **SAME)
    assert len(norms) == second.config.num_hidden_layers
    assert all(q is not None and k is not None for q, k in norms)
    hf.unpatch(second)
    assert module.apply_rotary_pos_emb is original
    # a model is given back through a wrapper of it, and a wrapper through the model inside
    for patched, unpatched in ((second, torch.nn.ModuleList([second])),
                               (torch.nn.ModuleList([second]), second)):
        hf.patch(patched)
        hf.unpatch(unpatched)
        assert module.apply_rotary_pos_emb is original


def test_a_deep_copy_of_a_patched_model_holds_the_family_until_unpatched():
    """A ``copy.deepcopy`` of a patched Llama (no instance forwards to copy) is patched as the
    model is: unpatching the original leaves the name ours for the copy; unpatching the copy
    then gives the module's own function back. A pickled patched model loads unpatched."""
    import copy
    import pickle

    module = modeling("Llama")
    original = module.apply_rotary_pos_emb
    model = tiny_model("Llama")
    hf.patch(model)
    twin = copy.deepcopy(model)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    hf.unpatch(twin)
    assert module.apply_rotary_pos_emb is original
    hf.patch(model)
    loaded = pickle.loads(pickle.dumps(model))
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    copy.deepcopy(loaded)
    hf.patch(model)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


@pytest.mark.parametrize("whole", [False, True], ids=["of-the-model", "of-its-deep-copy"])
def test_a_deep_copy_of_a_part_of_a_patched_model_holds_the_family_until_unpatched(whole):
    """A ``copy.deepcopy`` of a layer of a patched Llama (of the model, or of the model's own
    deep copy) runs our apply_rotary_pos_emb as the model's layer does, and was not held:
    unpatching the model gave the name back and the copy ran unfused. It is held, as a whole
    model's copy is, until ``unpatch(copy)``; a part copied within a model's copy is held by
    that copy alone."""
    import copy

    module = modeling("Llama")
    original = module.apply_rotary_pos_emb
    model = tiny_model("Llama")
    hf.patch(model)
    source = model
    if whole:
        source = copy.deepcopy(model)
        held = len(hf._holders)
        hf.unpatch(model)
        assert len(hf._holders) == held - 1  # the model's copy alone, not its parts too
    layer = copy.deepcopy(source.model.layers[0])
    hf.unpatch(source)
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    hf.unpatch(layer)
    assert module.apply_rotary_pos_emb is original
    copy.deepcopy(model.model.layers[1])  # unpatched: a copy holds nothing
    hf.patch(model)
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_unpatch_releases_the_last_forwards_cos_and_sin(family):
    """After ``unpatch`` no call of ours comes to release what the last one kept for the next
    layer (its cos/sin table), so ``unpatch`` lets go of it: once the model and its outputs
    are gone, so are its cos and sin, whatever device memory they hold."""
    import gc
    import weakref

    model = tiny_model(family).eval()
    made = []
    model.model.rotary_emb.register_forward_hook(
        lambda module, args, out: made.extend(weakref.ref(t) for t in out))
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    hf.patch(model)
    with torch.no_grad():
        model(input_ids=ids.to(MODEL_DEVICE))
    hf.unpatch(model)
    del model
    gc.collect()
    assert len(made) == 2 and all(ref() is None for ref in made)


def test_unsupported_model_is_refused_by_name():
    # GPT-J rotates one tensor at a time, (tensor, sin, cos): left alone (docs/hf.md)
    config = transformers.GPTJConfig(
        n_embd=64, n_layer=1, n_head=4, rotary_dim=8, vocab_size=128, n_positions=64,
    )
    gptj = transformers.GPTJForCausalLM(config)
    for model in (gptj, torch.nn.Linear(2, 2)):
        with pytest.raises(rd.RoPEError) as err:
            hf.patch(model)
        message = str(err.value)
        assert type(model).__name__ in message
        # the families counted and pointed to, not listed: the whole list ran to 3,000 characters
        assert f"{len(hf.SUPPORTED_MODELS)} families" in message
        assert "hf.SUPPORTED_MODELS" in message
        assert len(message) < 400


def tiny_vl_model(family: str, mrope_section=(2, 3, 3)) -> torch.nn.Module:
    """A Qwen2-VL or Qwen2.5-VL model with a two-layer language model (head dim 16, so
    ``mrope_section`` sums to 8) and a one-block vision tower, random weights, float32."""
    config_name, model_name, vision = VL_FAMILIES[family]
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=list(mrope_section)
        ),
    )
    config = getattr(transformers, config_name)(
        text_config=text, vision_config=vision, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().train().to(MODEL_DEVICE)


@pytest.mark.parametrize("family", list(VL_FAMILIES))
def test_patched_multimodal_model_gives_the_same_logits_and_gradients(family, monkeypatch):
    """``position_ids`` ``[3, b, s]`` with three different streams per row (so the sections
    matter): the same logits and parameter gradients patched and unpatched."""
    model = tiny_vl_model(family)
    module = modeling(family)
    original = module.apply_rotary_pos_emb
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(9))
    tokens = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
    position_ids = torch.stack((tokens, tokens // 3 + 1, tokens % 4))
    logits, grads = step(model, ids, position_ids)
    assert {n for n, _ in model.named_parameters() if ".visual." not in f".{n}"} == grads.keys()
    same_streams, _ = step(model, ids, position_ids[:1].expand(3, -1, -1))
    assert not torch.allclose(logits, same_streams)  # the height and width streams count

    calls = patch_counting(model, module, monkeypatch)
    assert not hasattr(module, MROPE_NAME)  # transformers 5.23 picks the streams before the call
    got_logits, got_grads = step(model, ids, position_ids)
    torch.testing.assert_close(got_logits, logits, **SAME)
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name, **SAME)
    assert len(calls) == model.config.text_config.num_hidden_layers

    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original
    hf.unpatch(model)
    assert module.apply_rotary_pos_emb is original


def deinterleaved_reference(q, k, cos, sin, unsqueeze_dim):
    """DeepSeek's rotation from its definition, in float64: each head's channels read as pairs
    ``(x[2j], x[2j+1])``, laid out as halves ``[x[0], x[2], .., x[1], x[3], ..]``, then
    ``x * cos + rotate_half(x) * sin``; differentiable."""
    cos = cos.double().unsqueeze(unsqueeze_dim)
    sin = sin.double().unsqueeze(unsqueeze_dim)

    def one(x):
        x = x.double()
        halves = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return halves * cos + rotate_half(halves) * sin

    return one(q), one(k)


def deepseek_inputs(dtype, unsqueeze_dim, heads=8, rope_dim=8, seed=0):
    """q_rot and k_rot as DeepSeek's attention makes them: the last ``rope_dim`` channels of
    each query head of a projection, and one key head sliced off a latent projection (both
    non-contiguous views); per-token cos and sin ``[b, s, rope_dim]`` with equal halves."""
    gen = torch.Generator().manual_seed(seed)
    q_states = torch.randn(BATCH, TOKENS, heads, 4 + rope_dim, generator=gen).to(dtype)
    latent = torch.randn(BATCH, TOKENS, 12 + rope_dim, generator=gen).to(dtype)
    q_states.requires_grad_(True)
    latent.requires_grad_(True)
    q = q_states[..., 4:]
    k = latent[..., 12:].view(BATCH, TOKENS, 1, rope_dim)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.rand(BATCH, TOKENS, rope_dim // 2, generator=gen, dtype=torch.float64) * 40
    angles = torch.cat((angles, angles), dim=-1)
    return q_states, latent, q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_interleave_matches_the_formula_and_transformers(dtype, unsqueeze_dim):
    """DeepSeek-V3's ``apply_rotary_pos_emb_interleave``: 8 query heads and one key head, as
    slices of their projections; outputs against the definition and transformers' function,
    gradients into the projections as transformers' reach them."""
    q_states, latent, q, k, cos, sin = deepseek_inputs(dtype, unsqueeze_dim)
    ours = hf.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    theirs = modeling("DeepSeek-V3").apply_rotary_pos_emb_interleave(
        q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    check_outputs(ours, deinterleaved_reference(q, k, cos, sin, unsqueeze_dim), theirs)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(x.shape, generator=gen).to(dtype) for x in ours]
    ours_grads = torch.autograd.grad(ours, (q_states, latent), grads)
    theirs_grads = torch.autograd.grad(theirs, (q_states, latent), grads)
    for got, expected in zip(ours_grads, theirs_grads):
        torch.testing.assert_close(got, expected, **(
            dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-5)))


def tiny_deepseek_v3(rope_interleave: bool) -> torch.nn.Module:
    """A two-layer DeepSeek-V3 (MLA with 8 rotary channels of 16 per query head, one shared
    rotary key head; the second layer a small MoE), random weights, float32."""
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        vocab_size=128, max_position_embeddings=64, rope_interleave=rope_interleave,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).float().train().to(MODEL_DEVICE)


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_patched_deepseek_v3_gives_the_same_logits_and_gradients(rope_interleave, monkeypatch):
    model = tiny_deepseek_v3(rope_interleave)
    module = modeling("DeepSeek-V3")
    originals = module.apply_rotary_pos_emb, module.apply_rotary_pos_emb_interleave
    ids = torch.randint(0, 128, (BATCH, TOKENS), generator=torch.Generator().manual_seed(4))
    position_ids = torch.arange(TOKENS)[None, :] + torch.tensor([[0], [5]])
    expected = [step(model, ids, p) for p in (None, position_ids)]

    calls = patch_counting(model, module, monkeypatch)
    assert module.apply_rotary_pos_emb_interleave is hf.apply_rotary_pos_emb_interleave
    for p, (logits, grads) in zip((None, position_ids), expected):
        got_logits, got_grads = step(model, ids, p)
        torch.testing.assert_close(got_logits, logits, **SAME)
        assert got_grads.keys() == grads.keys()
        # q_rot and k_rot are slices of these projections: their gradients pass through RoPE
        assert {f"model.layers.{i}.self_attn.{name}.weight" for i in range(2)
                for name in ("q_proj", "kv_a_proj_with_mqa")} <= grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, msg=name, **SAME)
    assert len(calls) == 2 * model.config.num_hidden_layers

    hf.unpatch(model)
    assert (module.apply_rotary_pos_emb, module.apply_rotary_pos_emb_interleave) == originals


def test_multimodal_name_is_rebound_where_the_module_defines_it(monkeypatch):
    """transformers 4.x's layout: Qwen2-VL's attention called ``apply_multimodal_rotary_pos_emb``.
    Where the modeling module defines it, ``patch`` rebinds it next to ``apply_rotary_pos_emb``
    and ``unpatch`` binds both original objects back; where it defines neither, ``patch`` refuses
    and rebinds nothing."""
    model = tiny_vl_model("Qwen2-VL")
    module = modeling("Qwen2-VL")
    plain = module.apply_rotary_pos_emb

    def legacy(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        return q, k

    monkeypatch.setattr(module, MROPE_NAME, legacy, raising=False)
    hf.patch(model)
    assert getattr(module, MROPE_NAME) is hf.apply_multimodal_rotary_pos_emb
    assert module.apply_rotary_pos_emb is hf.apply_rotary_pos_emb
    assert modeling("Qwen2.5-VL").apply_rotary_pos_emb is not hf.apply_rotary_pos_emb
    hf.unpatch(model)
    assert getattr(module, MROPE_NAME) is legacy
    assert module.apply_rotary_pos_emb is plain

    monkeypatch.delattr(module, MROPE_NAME)
    monkeypatch.delattr(module, "apply_rotary_pos_emb")
    expected = r"modeling_qwen2_vl defines none of apply_rotary_pos_emb, apply_multimodal_rotary"
    with pytest.raises(rd.RoPEError, match=expected):
        hf.patch(model)
    assert not hasattr(module, "apply_rotary_pos_emb") and not hasattr(module, MROPE_NAME)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_triton_backend_serves_the_call(triton_backend, unsqueeze_dim, batch_cos):
    """The GPU path (Triton's interpreter without CUDA): q and k of a model's shapes, per-token
    cos and sin, forward and gradients against the float64 reference, within one bf16 ulp."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin = inputs(torch.bfloat16, unsqueeze_dim, batch_cos=batch_cos, seed=6, device=device)
    grad_q = torch.randn(q.shape).bfloat16().to(device)
    grad_k = torch.randn(k.shape).bfloat16().to(device)
    with rd.use_backend("triton"):
        out = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        torch.autograd.backward(out, (grad_q, grad_k))
    ours = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    ref = reference(q, k, cos, sin, unsqueeze_dim)
    torch.autograd.backward(ref, (grad_q.double(), grad_k.double()))
    for got, exact in zip((*out, *ours), (*ref, q.grad, k.grad)):
        torch.testing.assert_close(got.double(), exact.detach().double(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_triton_backend_serves_the_multimodal_call(triton_backend, batch_cos):
    """As above, for the three-stream call: forward and gradients within one bf16 ulp."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin = multimodal_inputs(torch.bfloat16, 1, batch_cos, seed=12)
    q, k = (t.detach().to(device).requires_grad_() for t in (q, k))
    cos, sin = cos.to(device), sin.to(device)
    grad_q, grad_k = (torch.randn(t.shape).bfloat16().to(device) for t in (q, k))
    with rd.use_backend("triton"):
        out = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3])
        torch.autograd.backward(out, (grad_q, grad_k))
    ours = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    ref = multimodal_reference(q, k, cos, sin, (2, 3, 3), 1)
    torch.autograd.backward(ref, (grad_q.double(), grad_k.double()))
    for got, exact in zip((*out, *ours), (*ref, q.grad, k.grad)):
        torch.testing.assert_close(got.double(), exact.detach().double(), rtol=2**-7, atol=1e-5)

@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_layers_read_half_of_each_cos_and_sin_row_while_the_halves_are_equal(
    triton_backend, monkeypatch, batch_cos
):
    """transformers' cos and sin repeat each row's first half: from the second layer on, the
    Triton kernels read the first halves alone (the cache's halves flag holds), with forward and
    gradients still the formula's; a write that makes the halves differ is seen by the next
    layer's call."""
    import weakref

    from rope_dispatch.backends import triton_tables

    monkeypatch.setattr(triton_tables, "HALVES_MIN_ROWS_READ", 0)
    monkeypatch.setattr(triton_tables, "_halves", weakref.WeakKeyDictionary())
    monkeypatch.setattr(triton_tables, "_halves_met", weakref.WeakSet())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin = inputs(torch.bfloat16, 1, batch_cos=batch_cos, seed=13, device=device)
    grads = (torch.randn(q.shape).bfloat16().to(device), torch.randn(k.shape).bfloat16().to(device))

    def layer():
        q.grad = k.grad = None
        with rd.use_backend("triton"):
            out = hf.apply_rotary_pos_emb(q, k, cos, sin)
            torch.autograd.backward(out, grads)
        ours = (*out, q.grad.clone(), k.grad.clone())
        q.grad = k.grad = None
        ref = reference(q, k, cos, sin, 1)
        torch.autograd.backward(ref, tuple(g.double() for g in grads))
        for got, exact in zip(ours, (*ref, q.grad, k.grad)):
            torch.testing.assert_close(got.double(), exact.detach().double(), rtol=2**-7, atol=1e-5)

    for _ in range(3):
        layer()
    assert [int(flag.item()) for flag in triton_tables._halves.values()] == [1]
    cos[0, 3, -1] += 0.5
    layer()
    assert [int(flag.item()) for flag in triton_tables._halves.values()] == [0]


@pytest.mark.parametrize("batch_cos", [BATCH, 1])
def test_layers_sharing_cos_and_sin_reuse_one_plan(monkeypatch, batch_cos):
    """A model hands the same cos and sin to every layer: after the first two layers' calls
    (a key is planned at its second call) the others skip the checks, and values rewritten in
    place are still read."""
    from rope_dispatch import call as call_module
    from rope_dispatch import dispatch

    monkeypatch.setattr(call_module, "_reads", lambda index: False)  # the token index, as on a GPU
    checks = []
    real = dispatch.check_call
    monkeypatch.setattr(dispatch, "check_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    q, k, cos, sin = inputs(torch.float32, 1, seed=11, batch_cos=batch_cos)
    with torch.no_grad():
        for layer in range(3):
            got = hf.apply_rotary_pos_emb(q, k, cos, sin)
            for out, want in zip(got, reference(q, k, cos, sin, 1)):
                torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
        assert len(checks) == 2
        cos.mul_(-1)  # same tensor, new values
        got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for out, want in zip(got, reference(q, k, cos, sin, 1)):
        torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))


def test_layers_sharing_multimodal_cos_and_sin_reuse_one_pick(monkeypatch):
    """The same ``[3, b, s, d2]`` cos and sin for every layer: one pick of the streams and the
    call checked only until it is planned (two calls); values rewritten in place are seen;
    inference-mode tensors work."""
    from rope_dispatch import call as call_module
    from rope_dispatch import dispatch

    monkeypatch.setattr(call_module, "_reads", lambda index: False)
    checks = []
    real = dispatch.check_call
    monkeypatch.setattr(dispatch, "check_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    q, k, cos, sin = multimodal_inputs(torch.float32, 1, seed=8)
    section = [2, 3, 3]
    with torch.no_grad():
        first = hf._select_streams(cos, sin, section, BATCH)
        for layer in range(3):
            got = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
            assert hf._select_streams(cos, sin, section, BATCH)[0] is first[0]
        assert len(checks) == 2
        cos[1].mul_(-1)  # a view of the same tensor, new values
        assert hf._select_streams(cos, sin, section, BATCH)[0] is not first[0]
        got = hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    for out, want in zip(got, multimodal_reference(q, k, cos, sin, section, 1)):
        torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
    with torch.inference_mode():
        cos, sin = cos.clone(), sin.clone()
        got = hf.apply_multimodal_rotary_pos_emb(q.detach(), k.detach(), cos, sin, section)
    for out, want in zip(got, multimodal_reference(q, k, cos, sin, section, 1)):
        torch.testing.assert_close(out.double(), want.detach(), **tolerance(torch.float32))


def pairs_reference(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """float64 rotation of interleaved pairs: channels ``(2j, 2j+1)`` of each ``[b, s, heads,
    d]`` head turn by ``angles[b, s, j]``, the channels past ``2 * angles.shape[-1]`` copied."""
    x = x.double()
    n = angles.shape[-1]
    c, s = angles.double().cos()[:, :, None], angles.double().sin()[:, :, None]
    even, odd = x[..., 0:2 * n:2], x[..., 1:2 * n:2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), -1).flatten(-2)
    return torch.cat((rotated, x[..., 2 * n:]), -1)


@pytest.mark.parametrize("halves", [False, True])
def test_pair_functions_rotate_interleaved_pairs(halves):
    """Both pair functions against the formula, q and k ``[b, heads, s, d]`` with 6 of 8
    channels rotated; the halves form sees cos and sin rewritten in place between calls (it
    keeps the latest pair's conversion while they are unchanged), and takes inference-mode
    cos and sin (no version counter: a GLM, GLM-4, Helium or ERNIE 4.5 model run under
    ``torch.inference_mode``)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, 8, generator=gen).to(MODEL_DEVICE)
    k = torch.randn(2, 2, 5, 8, generator=gen).to(MODEL_DEVICE)
    angles = (torch.rand(2, 5, 3, generator=gen) * 6).to(MODEL_DEVICE)
    function = (hf.apply_rotary_pos_emb_pairs_of_halves if halves
                else hf.apply_rotary_pos_emb_pairs)
    per_channel = (torch.cat((angles, angles), -1) if halves
                   else angles.repeat_interleave(2, -1))
    cos, sin = per_channel.cos(), per_channel.sin()
    for turn in range(2):
        if turn:  # new angles in the same tensors
            angles = angles * 0.5
            per_channel = (torch.cat((angles, angles), -1) if halves
                           else angles.repeat_interleave(2, -1))
            cos.copy_(per_channel.cos())
            sin.copy_(per_channel.sin())
        got = function(q, k, cos, sin)
        for x, out in zip((q, k), got):
            want = pairs_reference(x.transpose(1, 2), angles).transpose(1, 2)
            torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
    with torch.inference_mode():
        angles = angles * 0.5
        per_channel = (torch.cat((angles, angles), -1) if halves
                       else angles.repeat_interleave(2, -1))
        cos, sin = per_channel.cos(), per_channel.sin()
        for _ in range(2):  # a model's layers: the same cos and sin again
            got = function(q, k, cos, sin)
            for x, out in zip((q, k), got):
                want = pairs_reference(x.transpose(1, 2), angles).transpose(1, 2)
                torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
