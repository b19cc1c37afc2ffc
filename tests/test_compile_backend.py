"""The compile backend against the float64 reference, its no-recompile promise, and availability.

Compiling is slow on a 2-core CPU (seconds per spec), so the CPU tests use a handful of fixed
specs that together cover every layout and feature, instead of random ones.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings

import pytest
import torch

import rope_dispatch as rd
from cases import Case, build
from reference import assert_matches, reference_for, reference_forward_backward
from rope_dispatch.backends import compiled
from rope_dispatch.backends.compiled import CompileBackend, compile_key


def case(**changes) -> Case:
    base = Case(
        layout="sbhd", dtype=torch.float32, seq=6, batch=2, heads=3, head_dim=16, rotary_dim=16,
        interleaved=False, cp_size=1, cp_rank=0, seqlens=(), with_starts=False,
        strides="contiguous", use_cache=False, table_margin=2, seed=0,
    )
    return dataclasses.replace(base, **changes)


def check(c: Case, backend: str = "compile", device: str = "cpu", grad: bool = True) -> None:
    t, table, spec, starts, angles = build(c, device, requires_grad=grad)
    out = rd.apply(t, table, spec, start_positions=starts, backend=backend)
    assert out.dtype == t.dtype and out.device == t.device and out.is_contiguous()
    if not grad:
        assert_matches(out, reference_for(t, angles, spec, starts), t.dtype, "forward")
        return
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to(device)
    (grad_t,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out.cpu(), starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad_t, ref_grad, t.dtype, "backward")


needs_compile = pytest.mark.skipif(
    not rd.get_backend("compile").available, reason="torch.compile cannot run here"
)

# Five specs that between them cover every layout, dtype, feature and stride pattern.
CPU_CASES = {
    "bshd-bf16-partial-interleaved-cache-permuted": (case(
        layout="bshd", dtype=torch.bfloat16, rotary_dim=8, interleaved=True, use_cache=True,
        strides="permuted", seq=7, batch=3,
    ), True),
    "thd-fp16-cp2-rank1-partial-qkv-slice": (case(
        layout="thd", dtype=torch.float16, rotary_dim=12, cp_size=2, cp_rank=1,
        seqlens=(8, 4, 12), strides="qkv-slice",
    ), True),
    "sbhd-fp32-cp3-rank2-interleaved-channel-strided": (case(
        layout="sbhd", interleaved=True, cp_size=3, cp_rank=2, seq=4,
        strides="channel-strided",
    ), True),
    "thd-fp32-start-positions-cache-forward-only": (case(
        layout="thd", seqlens=(5, 0, 3), with_starts=True, use_cache=True, rotary_dim=10,
        seed=3,
    ), False),
}


@needs_compile
@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_matches_reference(name):
    c, grad = CPU_CASES[name]
    check(c, grad=grad)


def _call(s: int, b: int, starts_dtype=torch.int64, grad: bool = True) -> rd.RoPECall:
    gen = torch.Generator().manual_seed(s * 100 + b)
    t = torch.randn(s, b, 2, 8, generator=gen).requires_grad_(grad)
    freqs = torch.rand(s + 8, 8, generator=gen) * 20
    starts = torch.randint(0, 8, (b,), generator=gen).to(starts_dtype)
    return rd.check_call(t, freqs, rd.RoPESpec(layout="sbhd", dtype="fp32"), starts)


def _run_and_check(backend: CompileBackend, call: rd.RoPECall) -> None:
    out = backend.apply(call)
    grad_out = torch.randn(out.shape)
    (grad_t,) = torch.autograd.grad(out, call.t, grad_out)
    ref_out, ref_grad = reference_forward_backward(
        call.t, call.table, call.spec, grad_out, call.start_positions
    )
    assert_matches(out, ref_out, torch.float32, "forward")
    assert_matches(grad_t, ref_grad, torch.float32, "backward")


@pytest.fixture
def recompile_log(caplog):
    """The ``TORCH_LOGS=recompiles`` records, captured in-process."""
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        torch._logging.set_logs()


@needs_compile
def test_new_sequence_length_and_batch_do_not_recompile(recompile_log):
    backend = CompileBackend()  # own compiled functions: independent of other tests
    first = _call(6, 2)
    _run_and_check(backend, first)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    recompile_log.clear()
    for s, b in ((11, 2), (11, 3), (4, 5)):
        _run_and_check(backend, _call(s, b))
    assert "Recompiling" not in recompile_log.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # The capture does see a recompile: start_positions' dtype is guarded, not part of the key.
    _run_and_check(backend, _call(5, 2, starts_dtype=torch.int32))
    assert "Recompiling" in recompile_log.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs


@needs_compile
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_new_lengths_and_batches_with_per_token_positions_do_not_recompile(layout,
                                                                          recompile_log):
    """Per-token positions (``[s, b]`` or ``[b, s]``): only their first dim was marked dynamic,
    so the second, shared with ``t``'s, stayed static, and a new batch (sbhd) or sequence
    length (bshd) compiled the forward and the transpose again."""
    backend = CompileBackend()
    spec = rd.RoPESpec(layout=layout, dtype="fp32")
    freqs = torch.rand(24, 8, generator=torch.Generator().manual_seed(1)) * 20

    def run(lead: tuple[int, int]) -> None:
        gen = torch.Generator().manual_seed(lead[0] * 100 + lead[1])
        t = torch.randn(*lead, 2, 8, generator=gen).requires_grad_(True)
        positions = torch.randint(0, 24, lead, generator=gen)
        call = rd.check_call(t, freqs, spec, positions=positions)
        out = backend.apply(call)
        grad_out = torch.randn(out.shape, generator=gen)
        (grad_t,) = torch.autograd.grad(out, t, grad_out)
        ref_out, ref_grad = reference_forward_backward(t, freqs, spec, grad_out,
                                                       positions=positions)
        assert_matches(out, ref_out, torch.float32, f"forward {lead}")
        assert_matches(grad_t, ref_grad, torch.float32, f"backward {lead}")

    run((6, 2))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    recompile_log.clear()
    for lead in ((6, 3), (9, 4), (5, 3)):
        run(lead)
    assert "Recompiling" not in recompile_log.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_compile
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward-backward"])
def test_warm_up_compiles_so_later_calls_do_not(grad):
    backend = CompileBackend()
    call = _call(6, 3, grad=grad)
    assert "first call" in backend.explain_note(call)
    assert not backend.is_compiled(call)
    backend.warm_up(call)
    assert backend.is_compiled(call)
    assert "already compiled" in backend.explain_note(call)
    other = _call(9, 2, grad=not grad)
    # Training compiles the forward and its transpose; inference shares that forward.
    assert backend.is_compiled(other) == grad
    # a training call after inference ones still compiles its backward: explain says so
    assert ("already compiled" in backend.explain_note(other)) == grad
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    later = _call(9, 2, grad=grad)
    if grad:
        _run_and_check(backend, later)  # forward and backward: nothing left to compile
    else:
        out = backend.apply(later)
        assert_matches(
            out, reference_for(later.t, later.table, later.spec, later.start_positions),
            torch.float32,
        )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_compile
def test_inside_an_outer_compile_it_runs_the_eager_math():
    backend = CompileBackend()
    t = torch.randn(2, 5, 3, 8)
    freqs = torch.rand(7, 1, 1, 8) * 10
    spec = rd.RoPESpec(layout="bshd", dtype="fp32", interleaved=True)

    def outer(x):
        return backend.apply(rd.check_call(x, freqs, spec)) * 2

    out = torch.compile(outer)(t)
    assert_matches(out, 2 * reference_for(t, freqs, spec), torch.float32)
    assert not backend._compiled  # no compiled function of its own: the outer graph has the math


def test_explain_note_is_empty_when_unavailable(monkeypatch):
    backend = CompileBackend()
    monkeypatch.setattr(compiled, "dynamo_problem", lambda: "torch.compile is not supported here")
    assert backend.explain_note(_call(4, 2)) == ""
    assert backend.availability == ("torch.compile is not supported here",)


def test_unavailable_without_a_cpu_compiler_or_cuda(monkeypatch):
    import torch._inductor.config as inductor_config
    from torch._inductor import cpp_builder

    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/rope-dispatch-g++")}):
            problem = compiled.cpu_compiler_problem()
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()
    assert problem is not None and "C++ compiler" in problem and "rope-dispatch-g++" in problem

    monkeypatch.setattr(compiled, "cpu_compiler_problem", lambda: problem)
    monkeypatch.setattr(compiled, "cuda_problem", lambda index=None: "no CUDA device")
    backend = CompileBackend()
    assert not backend.available
    assert backend.availability == (f"CPU: {problem}", "CUDA: no CUDA device")
    reasons = backend.not_supported_reasons(_call(4, 2))
    assert any("C++ compiler" in r for r in reasons)


def test_the_quick_compiler_probe_looks_for_what_inductor_runs(monkeypatch, tmp_path):
    """The probe of a first call (no Inductor import) took any of $CXX, g++, c++ or clang++,
    but Inductor runs $CXX when set, else g++: with CXX naming a missing compiler (or only c++
    installed) the selftest listed the backend as available and its check was then refused."""
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/rope-dispatch-g++")
    problem = compiled.cpu_compiler_problem(full=False)
    assert problem is not None and "CXX='/nonexistent/rope-dispatch-g++'" in problem
    other = tmp_path / "c++"  # a C++ compiler Inductor does not look for
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX")
    problem = compiled.cpu_compiler_problem(full=False)
    assert problem is not None and "g++ is not on PATH" in problem
    monkeypatch.setenv("CXX", str(other))
    assert compiled.cpu_compiler_problem(full=False) is None


def test_cpu_call_refused_without_compiler_when_cuda_works(monkeypatch):
    monkeypatch.setattr(compiled, "cpu_compiler_problem", lambda: "no C++ compiler (test)")
    monkeypatch.setattr(compiled, "cuda_problem", lambda index=None: None)
    backend = CompileBackend()
    assert backend.available
    assert backend.not_supported_reasons(_call(4, 2)) == ["no C++ compiler (test)"]


def test_a_problem_found_before_the_first_compile_makes_it_unavailable(monkeypatch):
    """The probe at a first call is cheap (no Dynamo import); the full check before the first
    compile (confirm) that finds a problem refuses later calls with it, and a forced call runs
    the eager math with one warning rather than failing."""
    backend = CompileBackend()
    assert backend.available
    monkeypatch.setattr(compiled, "dynamo_problem", lambda full=None: (
        "torch.compile is not supported here: test" if full else None))
    t, freqs = torch.randn(4, 2, 2, 8), torch.rand(4, 1, 1, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    with pytest.warns(RuntimeWarning, match="not supported here: test"):
        out = backend.apply(rd.check_call(t, freqs, spec))
    assert_matches(out, reference_for(t, freqs, spec), torch.float32)
    assert backend.availability == ("torch.compile is not supported here: test",)
    assert not backend._compiled


def test_a_compiler_found_missing_at_the_first_compile_is_given_once(monkeypatch):
    """The full compiler lookup before the first compile (confirm) failing refused later calls
    with its problem and again as this spec's compile failure, the same sentence twice (the
    selftest's check row showed both)."""
    backend = CompileBackend()
    monkeypatch.setattr(compiled, "cpu_compiler_problem", lambda full=None: (
        "no C++ compiler (test)" if full else None))
    assert backend.available
    t, freqs = torch.randn(4, 2, 2, 8), torch.rand(4, 1, 1, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    call = rd.check_call(t, freqs, spec)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler \\(test\\)"):
        out = backend.apply(call)
    assert_matches(out, reference_for(t, freqs, spec), torch.float32)
    assert backend.not_supported_reasons(call) == ["no C++ compiler (test)"]


def test_cuda_needs_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails
    problem = compiled.cuda_problem()
    assert problem is not None and "triton is not importable" in problem


def raising(error: Exception):
    """A stand-in for ``compiled._build``/``_math``: every function it builds raises ``error``."""
    def build(key, transpose):
        def fn(*args):
            raise error
        return fn
    return build


def test_compile_failure_falls_back_with_a_warning_and_is_then_refused(monkeypatch):
    monkeypatch.setattr(compiled, "_build", raising(RuntimeError("inductor exploded\nsecond line")))
    backend = CompileBackend()
    call = _call(5, 2)
    with pytest.warns(RuntimeWarning, match="inductor exploded") as caught:
        out = backend.apply(call)
    assert caught[0].filename == __file__  # the caller's line, not the library's
    assert_matches(
        out, reference_for(call.t, call.table, call.spec, call.start_positions), torch.float32
    )
    assert backend.extra_reasons(call) == [
        "compiling this spec failed earlier in this process: RuntimeError: inductor exploded"
    ]
    with pytest.raises(RuntimeError, match="inductor exploded"):
        backend.warm_up(call)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.apply(call)  # later calls run eager without warning again


@needs_compile
def test_a_layout_past_the_recompile_limit_runs_the_eager_math():
    """Dynamo specialises sizes of 0 and 1 and strides: an expanded or empty input each adds a
    graph to the spec's function, and past its recompile limit (8) fullgraph=True made the
    next new layout fail with FailOnRecompileLimitHit. It runs the eager math (one warning);
    the layouts compiled before still run compiled. The limit is lowered to 1 here."""
    dynamo = pytest.importorskip("torch._dynamo")
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.375)  # a function of its own
    angles = torch.rand(6, 1, 1, 16) * 6 - 3
    contiguous = torch.randn(4, 2, 3, 16)
    expanded = torch.randn(4, 1, 3, 16).expand(4, 2, 3, 16)
    with dynamo.config.patch(recompile_limit=1):
        out = rd.apply(contiguous, angles, spec, backend="compile")
        assert_matches(out, reference_for(contiguous, angles, spec), torch.float32)
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            out = rd.apply(expanded, angles, spec, backend="compile")
        assert_matches(out, reference_for(expanded, angles, spec), torch.float32)
        x = expanded.clone().requires_grad_(True)  # the backward's graph is a function too
        out = rd.apply(x, angles, spec, backend="compile")
        grad_out = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, x, grad_out)
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out)
        assert_matches(out, ref_out, torch.float32, "forward")
        assert_matches(grad, ref_grad, torch.float32, "backward")


@needs_compile
def test_a_table_made_in_inference_mode_serves_a_training_call():
    """A table (and start positions) made under torch.inference_mode, then used by a call
    that requires grad: the backward's saved tables are inference tensors, which autograd
    refuses to save ("Inference tensors cannot be saved for backward"); eager and Triton take
    them."""
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.25)  # a function of its own
    with torch.inference_mode():
        angles = torch.rand(8, 1, 1, 16) * 6 - 3
        starts = torch.tensor([1, 3])
    for kw in ({}, {"start_positions": starts}):
        x = torch.randn(4, 2, 3, 16, requires_grad=True)
        out = rd.apply(x, angles, spec, backend="compile", **kw)
        grad_out = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, x, grad_out)
        ref_out, ref_grad = reference_forward_backward(x, angles, spec, grad_out,
                                                       kw.get("start_positions"))
        assert_matches(out, ref_out, torch.float32, "forward")
        assert_matches(grad, ref_grad, torch.float32, "backward")


def test_bad_inputs_are_not_blamed_on_the_compiler(monkeypatch):
    broken = raising(IndexError("index 40 is out of bounds"))
    monkeypatch.setattr(compiled, "_build", broken)
    monkeypatch.setattr(compiled, "_math", broken)  # the eager math fails on these inputs too
    backend = CompileBackend()
    call = _call(5, 2)
    with pytest.raises(IndexError, match="index 40"):
        backend.apply(call)
    assert backend.extra_reasons(call) == []


def test_key_ignores_sizes_and_max_seqlen():
    a, b = _call(5, 2), _call(9, 4)
    assert compile_key(a) == compile_key(b)
    recorded = compile_key(a)
    with torch.no_grad():
        assert compile_key(a) == recorded  # training and inference share the forward graph
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    t = torch.randn(9, 2, 8)
    one = rd.check_call(t, torch.rand(9, 8), rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, max_seqlen=5))
    two = rd.check_call(t, torch.rand(9, 8), rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu, max_seqlen=9))
    assert compile_key(one) == compile_key(two)


GPU_CASES = [
    case(layout="sbhd", dtype=torch.bfloat16, seq=64, batch=2, heads=4, head_dim=64, rotary_dim=32,
         strides="qkv-slice"),
    case(layout="bshd", dtype=torch.float16, seq=34, batch=3, heads=2, head_dim=32,
         rotary_dim=32, interleaved=True, use_cache=True, cp_size=2, cp_rank=1),
    case(layout="thd", dtype=torch.float32, seqlens=(17, 1, 40), heads=4, head_dim=64,
         rotary_dim=64, with_starts=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_matches_reference_on_cuda(index):
    if not rd.get_backend("compile").available:
        pytest.skip("torch.compile cannot run here: " + "; ".join(rd.get_backend("compile").availability))
    check(GPU_CASES[index], device="cuda")


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_second_backward_through_the_same_graph(layout):
    """retain_graph=True (two losses) must work: Inductor's donated buffers would refuse it."""
    cu = {"cu_seqlens": torch.tensor([0, 20, 64])} if layout == "thd" else {}
    shape = (64, 4, 32) if layout == "thd" else (64, 2, 4, 32)
    spec = rd.RoPESpec(layout=layout, dtype="bf16", **cu)
    t = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.rand(64, 1, 1, 32) * 10
    out = rd.apply(t, freqs, spec, backend="compile")
    grad_out = torch.randn(out.shape, dtype=torch.bfloat16)
    (first,) = torch.autograd.grad(out, t, grad_out, retain_graph=True)
    (second,) = torch.autograd.grad(out, t, grad_out)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    _, ref_grad = reference_forward_backward(t, freqs.view(64, 32), spec, grad_out)
    assert_matches(second, ref_grad, torch.bfloat16, "backward")
