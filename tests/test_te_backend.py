"""The TransformerEngine backend: what CI sees (no TE), the version gating and argument
translation (with a fake TE on CPU), and, on the GPU machine, the installed TE (2.20.2 there)
against the float64 reference (``pytest -m gpu tests/test_te_backend.py``)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from hypothesis import given

import rope_dispatch as rd
from cases import Case, build, cases, fixed_case
from reference import assert_matches, reference_for, reference_forward_backward
from rope_dispatch.backends import te as te_module
from rope_dispatch.backends.te import TEBackend, TEInfo, load_te, parse_release, te_arguments, te_reasons


def fake_apply(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
               fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Stands in for TE's function where only the arguments it receives matter."""
    return t


ALL_PARAMS = frozenset(
    ["t", "freqs", "tensor_format", "start_positions", "interleaved", "fused", "cu_seqlens",
     "cp_size", "cp_rank"]
)


def info(version: str, parameters=ALL_PARAMS) -> TEInfo:
    return TEInfo(version, parse_release(version), "fake.rope", fake_apply, frozenset(parameters))


def make_call(layout="sbhd", *, interleaved=False, cp_size=1, cp_rank=0, starts=False,
              grad=False, cache=False) -> rd.RoPECall:
    if layout == "thd":
        t = torch.randn(12 // cp_size, 2, 8)
        cu = torch.tensor([0, 4, 12], dtype=torch.int64)
    else:  # sequence 4, batch 2
        t = torch.randn(4, 2, 2, 8) if layout == "sbhd" else torch.randn(2, 4, 2, 8)
        cu = None
    t.requires_grad_(grad)
    freqs = torch.rand(16, 8)
    table = rd.cos_sin_cache(freqs) if cache else freqs
    spec = rd.RoPESpec(layout=layout, dtype="fp32", interleaved=interleaved, cp_size=cp_size,
                       cp_rank=cp_rank, cu_seqlens=cu)
    start_positions = torch.tensor([1, 3]) if starts else None
    return rd.check_call(t, table, spec, start_positions)


# --- what CI sees: no TransformerEngine -------------------------------------------------------

@pytest.mark.skipif(te_module.te_installed(), reason="transformer_engine is installed here")
def test_unavailable_without_te_says_so():
    backend = rd.get_backend("te")
    assert not backend.available
    assert any("transformer_engine is not installed" in r for r in backend.availability)
    explanation = rd.explain(torch.randn(4, 2, 2, 8), torch.rand(4, 8), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    assert "transformer_engine is not installed" in " ".join(explanation.rejected["te"])


def test_not_installed_reported_from_the_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    assert not te_module.te_installed()
    found = load_te()
    assert found == [f"transformer_engine is not installed ({te_module.INSTALL_HINT})"]
    backend = TEBackend()
    assert backend.availability == tuple(found)


def test_no_cuda_is_a_reason_when_te_is_present(monkeypatch):
    monkeypatch.setattr(te_module, "te_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = TEBackend().availability
    assert len(reasons) == 1 and "no CUDA device" in reasons[0]


# --- finding TE where each version keeps it --------------------------------------------------

def fake_importer(version: str | None, present: dict[str, object], broken: dict[str, Exception] = {}):
    """An import function over a fake TransformerEngine tree."""
    def import_module(path: str):
        if path in broken:
            raise broken[path]
        if path == "transformer_engine":
            return types.SimpleNamespace(__version__=version) if version else types.SimpleNamespace()
        if path in present:
            return present[path]
        raise ModuleNotFoundError(f"No module named {path!r}", name=path)
    return import_module


@pytest.mark.parametrize("path", te_module.MODULE_PATHS)
def test_each_import_path_is_found(path):
    module = types.SimpleNamespace(apply_rotary_pos_emb=fake_apply)
    found = load_te(fake_importer("2.9.0", {path: module}))
    assert isinstance(found, TEInfo)
    assert found.module == path and found.apply is fake_apply
    assert found.release == (2, 9, 0) and found.parameters == ALL_PARAMS


def test_newest_path_wins():
    new = types.SimpleNamespace(apply_rotary_pos_emb=fake_apply)
    old = types.SimpleNamespace(apply_rotary_pos_emb=lambda t, freqs: t)
    found = load_te(fake_importer("2.9.0", {te_module.MODULE_PATHS[0]: new, te_module.MODULE_PATHS[2]: old}))
    assert found.module == te_module.MODULE_PATHS[0]


def test_broken_te_is_a_reason_not_a_crash():
    found = load_te(fake_importer("2.9.0", {}, {"transformer_engine": OSError("libcudart.so.13: cannot open")}))
    assert found == ["transformer_engine is installed but importing it failed: OSError: libcudart.so.13: cannot open"]
    broken_rope = {te_module.MODULE_PATHS[0]: ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")}
    found = load_te(fake_importer("2.9.0", {}, broken_rope))
    assert isinstance(found, list) and len(found) == 1
    assert "2.9.0" in found[0] and "flash_attn" in found[0]
    assert f"{te_module.MODULE_PATHS[1]} does not exist" in found[0]


def test_module_without_the_function():
    found = load_te(fake_importer("2.1.0", {te_module.MODULE_PATHS[2]: types.SimpleNamespace()}))
    assert isinstance(found, list) and "has no apply_rotary_pos_emb" in found[0]


def test_version_from_metadata_when_the_package_has_none(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda dist: "2.4.1")
    found = load_te(fake_importer(None, {te_module.MODULE_PATHS[0]: types.SimpleNamespace(apply_rotary_pos_emb=fake_apply)}))
    assert found.version == "2.4.1" and found.release == (2, 4, 1)


@pytest.mark.parametrize(
    "text, release",
    [("2.9.0", (2, 9, 0)), ("2.3.0.dev0+abc123", (2, 3, 0)), ("2.10", (2, 10, 0)),
     ("1.13.0+cu12", (1, 13, 0)), ("unknown", None), ("", None)],
)
def test_parse_release(text, release):
    assert parse_release(text) == release


# --- capability by version ------------------------------------------------------------------

FEATURES = {
    "interleaved": dict(interleaved=True),
    "start_positions": dict(starts=True),
    "cp-sbhd": dict(cp_size=2, cp_rank=1),
    "cp-bshd": dict(layout="bshd", cp_size=2, cp_rank=0),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features_need_2_3(feature):
    kw = dict(FEATURES[feature])
    layout = kw.pop("layout", "sbhd")
    call = make_call(layout, **kw)
    assert te_reasons(call, info("2.3.0")) == []
    assert te_reasons(call, info("2.9.0")) == []
    (reason,) = te_reasons(call, info("2.2.0"))
    assert "needs TransformerEngine 2.3 or newer; installed 2.2.0" in reason
    (reason,) = te_reasons(call, info("nightly"))
    assert "'nightly' could not be parsed" in reason


def test_old_versions_serve_the_plain_cases():
    for layout in ("sbhd", "bshd", "thd"):
        assert te_reasons(make_call(layout), info("2.2.0")) == []
    assert te_reasons(make_call("thd", cp_size=2, cp_rank=1), info("2.2.0")) == []  # thd CP is older


def test_missing_arguments_are_named():
    old = ALL_PARAMS - {"cp_size", "cp_rank", "start_positions", "interleaved"}
    reasons = te_reasons(make_call("thd", cp_size=2), info("2.1.0", old))
    assert reasons == [
        "TransformerEngine 2.1.0's apply_rotary_pos_emb (fake.rope) has no cp_rank, cp_size arguments"
    ]


def test_start_positions_with_grad_needs_2_10():
    (reason,) = te_reasons(make_call(starts=True, grad=True), info("2.9.0"))
    assert "start_positions while t requires grad" in reason and "fused backward" in reason
    assert "needs TransformerEngine 2.10 or newer; installed 2.9.0" in reason
    with torch.no_grad():
        assert te_reasons(make_call(starts=True, grad=True), info("2.9.0")) == []
    for version in ("2.10.0", "2.20.2"):
        assert te_reasons(make_call(starts=True, grad=True), info(version)) == []


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_start_positions_with_context_parallelism_needs_2_10(layout):
    call = make_call(layout, starts=True, cp_size=2, cp_rank=1)
    (reason,) = te_reasons(call, info("2.9.0"))
    assert "start_positions with context parallelism (cp_size=2)" in reason
    assert "needs TransformerEngine 2.10 or newer; installed 2.9.0" in reason
    assert te_reasons(call, info("2.20.2")) == []


def test_int32_offsets_and_grid_limits():
    # Meta tensors: the sizes of real ones, no memory.
    big = torch.empty(2**20, 2, 64, 16, device="meta")  # bshd: batch 2**20, 2**31 elements
    call = rd.check_call(big, torch.rand(2, 16, device="meta"), rd.RoPESpec(layout="bshd", dtype="fp32"))
    reasons = te_reasons(call, info("2.9.0"))
    assert any("2,147,483,648 elements" in r and "int32" in r for r in reasons)
    assert any("batch size 1,048,576 exceeds 65,535" in r for r in reasons)
    strided = torch.empty_strided((4, 2, 2, 8), (2**30, 8, 64, 1), device="meta")
    call = rd.check_call(strided, torch.rand(4, 8, device="meta"), rd.RoPESpec(layout="sbhd", dtype="fp32"))
    (reason,) = te_reasons(call, info("2.9.0"))
    assert f"reach element offset {3 * 2**30 + 8 + 64 + 7:,}" in reason
    ok = torch.empty(65535, 2, 1, 8, device="meta")
    call = rd.check_call(ok, torch.rand(2, 8, device="meta"), rd.RoPESpec(layout="bshd", dtype="fp32"))
    assert te_reasons(call, info("2.9.0")) == []


def test_cache_and_tracing_reasons(monkeypatch):
    backend = TEBackend(load=lambda: info("2.9.0"))
    assert backend.available
    reasons = backend.not_supported_reasons(make_call(cache=True))
    assert te_module.CACHE_REASON.format(kind="cos_sin_cache") in reasons  # (next to: on the CPU)
    assert any("tensor is on cpu" in r for r in reasons)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert backend.extra_reasons(make_call()) == [te_module.COMPILE_REASON]


def test_arguments_passed_to_te():
    call = make_call("thd", cp_size=2, cp_rank=1)
    kwargs = te_arguments(call)
    assert kwargs.keys() == {"tensor_format", "fused", "cu_seqlens", "cp_size", "cp_rank"}
    assert kwargs["fused"] is True and kwargs["tensor_format"] == "thd"
    assert kwargs["cu_seqlens"].dtype == torch.int32  # TE reads int*: int64 would be misread
    assert kwargs["cu_seqlens"].tolist() == [0, 4, 12]
    assert (kwargs["cp_size"], kwargs["cp_rank"]) == (2, 1)
    call = make_call("bshd", interleaved=True, starts=True)
    kwargs = te_arguments(call)
    assert kwargs.keys() == {"tensor_format", "fused", "interleaved", "start_positions"}
    assert kwargs["start_positions"].dtype == torch.int32
    assert kwargs["start_positions"].tolist() == [1, 3]
    assert te_arguments(make_call()) == {"tensor_format": "sbhd", "fused": True}


def test_apply_hands_te_a_4d_angle_view():
    seen = {}

    def recording(t, freqs, **kwargs):
        seen.update(freqs=freqs, kwargs=kwargs)
        return t

    backend = TEBackend(load=lambda: TEInfo("2.9.0", (2, 9, 0), "fake", recording, ALL_PARAMS))
    assert backend.available
    call = make_call("bshd", starts=True)
    backend.apply(call)
    assert seen["freqs"].shape == (16, 1, 1, 8) and seen["freqs"].dtype == torch.float32
    assert seen["freqs"].data_ptr() == call.table.data_ptr()  # a view: no copy per call
    assert seen["kwargs"]["start_positions"].dtype == torch.int32


@pytest.mark.parametrize("layout, starts", [("sbhd", False), ("bshd", True), ("thd", False)])
def test_a_plan_hands_te_the_users_table_and_this_calls_index_tensors(layout, starts):
    """A repeated call's plan passes the user's ``[s2, 1, 1, d2]`` table object itself (a
    ``[s2, d2]`` table as a view of it) and, per call, the call's own start positions and the
    spec's offsets in int32: a plan made for one call serves the next with that call's values."""
    seen = []

    def recording(t, freqs, **kwargs):
        seen.append((freqs, kwargs))
        return t

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", recording, ALL_PARAMS))
    assert backend.available
    call = make_call(layout, starts=starts)
    table_4d = call.table.view(16, 1, 1, 8)
    rd.check_call(call.t, table_4d, call.spec, call.start_positions)  # the dispatch's check
    run = backend.plan(call)
    new_starts = torch.tensor([5, 0]) if starts else None
    assert run(call.t, table_4d, call.spec, new_starts, None, None, (None, None)) is call.t
    freqs, kwargs = seen[-1]
    assert freqs is table_4d
    expected = {"tensor_format", "fused"} | ({"start_positions"} if starts else set()) | (
        {"cu_seqlens"} if layout == "thd" else set())
    assert kwargs.keys() == expected
    if starts:
        assert kwargs["start_positions"].dtype == torch.int32
        assert kwargs["start_positions"].tolist() == [5, 0]
    if layout == "thd":
        assert kwargs["cu_seqlens"].dtype == torch.int32
        assert kwargs["cu_seqlens"].tolist() == call.spec.cu_seqlens.tolist()
    # a [s2, d2] table: a view
    run(call.t, call.table, call.spec, new_starts, None, None, (None, None))
    freqs, _ = seen[-1]
    assert freqs.shape == (16, 1, 1, 8) and freqs.data_ptr() == call.table.data_ptr()


def test_a_plan_hands_te_a_strided_table_as_a_contiguous_copy():
    """A table sliced from a wider one (not contiguous) reaches TE as the checks' contiguous
    copy, through the plan as through the first call: the same rows, never the wider table's."""
    seen = []

    def recording(t, freqs, **kwargs):
        seen.append(freqs)
        return t

    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", recording, ALL_PARAMS))
    assert backend.available
    wide = torch.randn(16, 12)
    table = wide[:, :8]  # [s2, d2] = [16, 8], rows 12 apart
    call = make_call("sbhd", starts=False)
    call = rd.check_call(call.t, table, call.spec)
    run = backend.plan(call)
    run(call.t, table, call.spec, None, None, None, (None, None))
    (given,) = seen
    assert given.is_contiguous() and given.shape == (16, 1, 1, 8)
    assert torch.equal(given.view(16, 8), table)


def test_a_plan_with_a_cos_sin_scale_scales_tes_output():
    """TE has no factor on cos and sin: a scaled spec's plan multiplies TE's output, as the
    unplanned call does."""
    backend = TEBackend(load=lambda: TEInfo("2.20.2", (2, 20, 2), "fake", fake_apply, ALL_PARAMS))
    t = torch.randn(4, 2, 2, 8)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.5)
    call = rd.check_call(t, torch.rand(16, 8), spec)
    out = backend.plan(call)(t, call.table, spec, None, None, None, (None, None))
    torch.testing.assert_close(out, t * 1.5)


def test_apply_when_unavailable_raises_with_the_reasons():
    backend = TEBackend(load=lambda: ["transformer_engine is not installed (test)"])
    with pytest.raises(RuntimeError, match="not installed \\(test\\)"):
        backend.apply(make_call())


@pytest.mark.parametrize("planned", [False, True])
def test_dual_tensors_of_forward_mode_ad_run_the_eager_math(planned):
    """With a forward-mode AD level open (``torch.autograd.forward_ad``) a call, or a planned
    call, takes the eager math, not TE's function (its autograd.Function has no jvp: the
    tangent would be dropped or refused); the tangent is the rotated one."""
    import torch.autograd.forward_ad as fwad
    from te_fake import recording_te

    seen: dict = {}
    backend = recording_te(seen)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    x, tangent, freqs = torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8), torch.rand(8, 8) * 6
    call = rd.check_call(x, freqs, spec)
    run = backend.plan(call) if planned else None
    with fwad.dual_level():
        dual = fwad.make_dual(x, tangent)
        out = (run(dual, freqs, spec, None, None, None, (None, None)) if planned
               else backend.apply(call._replace(t=dual)))
        got = fwad.unpack_dual(out).tangent
    assert seen == {}
    assert got is not None
    assert_matches(got, reference_for(tangent, freqs, spec), torch.float32, "tangent")


# --- on the GPU machine, with the installed TransformerEngine ---------------------------------

@pytest.fixture(autouse=True)
def _strict_values(monkeypatch):
    """TE's kernel cannot guard positions past its table, so it serves GPU calls with index
    tensors only when their values are read: strict mode (CPU values are read anyway)."""
    monkeypatch.setenv("ROPE_DISPATCH_CHECK_VALUES", "1")


def _te_or_skip() -> TEBackend:
    backend = rd.get_backend("te")
    if not backend.available:
        pytest.skip("TE backend unavailable: " + "; ".join(backend.availability))
    return backend


def check_te(c: Case) -> None:
    """TE through rope_dispatch against the float64 reference; gradients unless the installed
    TE refuses them (start_positions before 2.10)."""
    grad = not c.with_starts or _te_or_skip().info.at_least(te_module.STARTS_EVERYWHERE_SINCE)
    t, table, spec, starts, angles = build(c, "cuda", requires_grad=grad)
    out = rd.apply(t, table, spec, start_positions=starts, backend="te")
    assert out.dtype == t.dtype and out.device == t.device and out.is_contiguous()
    if not grad:
        assert_matches(out, reference_for(t, angles, spec, starts), t.dtype, "forward")
        return
    grad_out = torch.randn(out.shape, dtype=torch.float32).to(t.dtype).to("cuda")
    (grad_t,) = torch.autograd.grad(out, t, grad_out)
    ref_out, ref_grad = reference_forward_backward(t, angles, spec, grad_out.cpu(), starts)
    assert_matches(out, ref_out, t.dtype, "forward")
    assert_matches(grad_t, ref_grad, t.dtype, "backward")


@pytest.mark.gpu
@given(cases().map(lambda c: dataclasses.replace(c, use_cache=False)))
def test_te_matches_reference(c):
    _te_or_skip()
    check_te(c)


def gpu_case(**changes) -> Case:
    """A GPU-sized bf16 case (s128 b2 h8 d128) unless ``changes`` say otherwise."""
    defaults = dict(dtype=torch.bfloat16, seq=128, heads=8, head_dim=128, rotary_dim=128,
                    seqlens=(), table_margin=5, seed=1)
    return fixed_case(**{**defaults, **changes})


GPU_CASES = {
    f"{layout}-{dtype}-{feature}": gpu_case(layout=layout, dtype=getattr(torch, dtype), **kw)
    for layout in ("sbhd", "bshd", "thd")
    for dtype in ("float32", "bfloat16", "float16")
    for feature, kw in {
        "full": {"seqlens": (100, 3, 250, 0, 64)},
        "partial-half": {"rotary_dim": 64, "seqlens": (17, 300)},
        "interleaved-qkv-slice": {"interleaved": True, "strides": "qkv-slice", "seqlens": (40, 41)},
        "permuted": {"strides": "permuted", "rotary_dim": 96, "seqlens": (8, 8, 8)},
        "channel-strided": {"strides": "channel-strided", "rotary_dim": 32, "seqlens": (30,)},
        "start-positions": {"with_starts": True, "seqlens": (9, 33, 2)},
    }.items()
}
CP_CASES = {
    f"{layout}-cp{cp}-rank{rank}{'-interleaved' if inter else '-starts'}": gpu_case(
        layout=layout, cp_size=cp, cp_rank=rank, interleaved=inter, with_starts=not inter, seq=64,
        seqlens=tuple(2 * cp * n for n in (5, 16, 1)),
    )
    for layout in ("sbhd", "bshd", "thd")
    for cp in (2, 4)
    for rank in range(cp)
    for inter in (False, True)
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_te_shapes_and_dtypes(name):
    _te_or_skip()
    check_te(GPU_CASES[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CP_CASES))
def test_te_every_cp_rank(name):
    _te_or_skip()
    check_te(CP_CASES[name])


@pytest.mark.gpu
def test_te_agrees_with_eager_and_reports_its_version():
    backend = _te_or_skip()
    assert backend.info.at_least((2, 3)), backend.info
    c = gpu_case(layout="thd", seqlens=(300, 1, 77, 512), dtype=torch.bfloat16, rotary_dim=64)
    t, table, spec, starts, _ = build(c, "cuda", requires_grad=False)
    te_out = rd.apply(t, table, spec, backend="te")
    eager_out = rd.apply(t, table, spec, backend="eager")
    assert_matches(te_out, eager_out, torch.bfloat16, "te vs eager")


@pytest.mark.gpu
def test_te_refusals_on_cuda():
    backend = _te_or_skip()
    c = gpu_case(with_starts=True, seq=16)
    t, table, spec, starts, angles = build(c, "cuda", requires_grad=True)
    if not backend.info.at_least(te_module.STARTS_EVERYWHERE_SINCE):
        with pytest.raises(rd.BackendNotSupportedError, match="start_positions while t requires grad"):
            rd.apply(t, table, spec, start_positions=starts, backend="te")
    else:
        assert "te" not in rd.explain(t, table, spec, start_positions=starts).rejected
    with pytest.raises(rd.BackendNotSupportedError, match="TE reads angles"):
        rd.apply(t.detach(), rd.cos_sin_cache(table), spec, backend="te")


@pytest.mark.gpu
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("starts_dtype", [torch.int32, torch.int64])
def test_te_index_dtypes(cu_dtype, starts_dtype):
    """int64 cu_seqlens / start_positions reach TE as the int32 its kernel reads."""
    _te_or_skip()
    c = gpu_case(layout="thd", seqlens=(20, 7, 33), with_starts=True, dtype=torch.float32)
    t, table, spec, starts, angles = build(c, "cuda", requires_grad=False)
    spec = spec.with_cu_seqlens(spec.cu_seqlens.to(cu_dtype))
    out = rd.apply(t, table, spec, start_positions=starts.to(starts_dtype), backend="te")
    assert_matches(out, reference_for(t, angles, spec, starts), torch.float32)
