"""Choice of backend: overrides, reasons in sentences, cached decisions, explain."""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import rope_dispatch as rd
from rope_dispatch import dispatch, registry
from rope_dispatch.backends.eager import rope_eager
from reference import assert_matches, reference_for


class Picky(rd.Backend):
    """A test backend that only takes bshd and counts its checks."""

    name = "picky"
    priority = 1000
    layouts = frozenset({"bshd"})
    devices = frozenset({"cpu"})
    checks = 0
    runs = 0

    def extra_reasons(self, call):
        type(self).checks += 1
        return []

    def apply(self, call):
        type(self).runs += 1
        return rope_eager(call)


@pytest.fixture
def picky(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "picky", Picky())
    monkeypatch.setattr(Picky, "checks", 0)
    monkeypatch.setattr(Picky, "runs", 0)
    monkeypatch.setenv("ROPE_AUTOTUNE", "0")
    monkeypatch.delenv("ROPE_BACKEND", raising=False)
    dispatch.clear_decisions()
    yield Picky
    dispatch.clear_decisions()


def inputs(layout="bshd"):
    t = torch.randn(2, 6, 3, 8) if layout == "bshd" else torch.randn(6, 2, 3, 8)
    return t, torch.rand(6, 1, 1, 8), rd.RoPESpec(layout=layout, dtype="fp32")


def test_list_backends_reports_every_backend():
    infos = {b.name: b for b in rd.list_backends()}
    assert {"eager", "triton", "te", "compile"} <= set(infos)
    assert infos["eager"].available and infos["eager"].reasons == ()
    for info in infos.values():
        assert info.available or info.reasons, info  # unavailable always says why


class ProbeCounted(rd.Backend):
    """Counts its availability probes."""

    name = "probe-counted"
    probes = 0

    def unavailable_reasons(self):
        type(self).probes += 1
        return ["never available: a test backend"]


def test_list_backends_of_some_names_probes_only_those(monkeypatch):
    """The selftest lists the backends it checks itself, and leaves the others (TE's import,
    Dynamo's) to the processes that check them."""
    monkeypatch.setitem(registry._REGISTRY, "probe-counted", ProbeCounted())
    monkeypatch.setattr(ProbeCounted, "probes", 0)
    assert [info.name for info in rd.list_backends(["eager"])] == ["eager"]
    assert ProbeCounted.probes == 0
    (info,) = rd.list_backends({"probe-counted"})
    assert not info.available and info.reasons == ("never available: a test backend",)
    assert ProbeCounted.probes == 1
    assert [b.name for b in registry.backends()] == [i.name for i in rd.list_backends()]
    assert [i.name for i in rd.list_backends("eager")] == ["eager"]  # one name, not letters
    with pytest.raises(rd.UnknownBackendError, match="unknown backend 'eagerte'"):
        rd.list_backends("eagerte")  # one name, not a substring test
    with pytest.raises(rd.UnknownBackendError, match=r"unknown backend 'eagr'; known backends: "
                       r"[^;]*\beager\b"):
        rd.list_backends(["eagr"])  # a misspelt name raises, listing the known ones
    with pytest.raises(rd.UnknownBackendError, match="unknown backend 'no-such-name'"):
        rd.list_backends(["eager", "no-such-name"])
    for bad in (5, b"eager"):  # crashed inside the filter ("argument of type 'int' ...")
        with pytest.raises(rd.RoPETypeError, match="takes a backend name or a collection"):
            rd.list_backends(bad)


def test_priority_then_capability(picky):
    t, f, spec = inputs("bshd")
    rd.apply(t, f, spec)
    assert picky.runs == 1
    t, f, spec = inputs("sbhd")
    rd.apply(t, f, spec)
    assert picky.runs == 1  # picky refuses sbhd; another backend served it


def test_decision_is_cached_per_static_key(picky):
    t, f, spec = inputs("bshd")
    for _ in range(5):
        rd.apply(t, f, spec)
    assert picky.runs == 5 and picky.checks == 1
    rd.apply(torch.randn(2, 5, 3, 8), f, spec)  # same power-of-two bucket
    assert picky.checks == 1
    rd.apply(torch.randn(2, 6, 3, 8).half(), f, rd.RoPESpec(layout="bshd", dtype="fp16"))
    assert picky.checks == 2


def test_override_order(picky, monkeypatch):
    t, f, spec = inputs("bshd")
    monkeypatch.setenv("ROPE_BACKEND", "eager")
    rd.apply(t, f, spec)
    assert picky.runs == 0
    with rd.use_backend("picky"):
        rd.apply(t, f, spec)
        assert picky.runs == 1
        rd.apply(t, f, spec, backend="eager")
        assert picky.runs == 1
        with rd.use_backend(None):  # no backend forced in this scope: ROPE_BACKEND's neither
            for _ in range(3):  # planned from the second call on
                rd.apply(t, f, spec)
            assert picky.runs == 4
            explained = rd.explain(t, f, spec)
            assert explained.chosen == "picky" and "forced" not in explained.why, explained
            rd.apply(t, f, spec, backend="eager")
            assert picky.runs == 4
        rd.apply(t, f, spec)  # the outer scope's again
        assert picky.runs == 5
    rd.apply(t, f, spec)  # ROPE_BACKEND=eager applies again
    assert picky.runs == 5
    assert rd.explain(t, f, spec).chosen == "eager"
    assert "ROPE_BACKEND" in rd.explain(t, f, spec).why


def test_forced_backend_never_falls_back(picky):
    t, f, spec = inputs("sbhd")
    with pytest.raises(rd.BackendNotSupportedError) as info:
        rd.apply(t, f, spec, backend="picky")
    message = str(info.value)
    assert "'picky'" in message and "backend= argument" in message
    assert "layout 'sbhd' is not supported; supports bshd" in message


def test_unknown_backend_lists_known(picky):
    with pytest.raises(rd.UnknownBackendError, match="known backends: .*eager.*picky"):
        with rd.use_backend("fastest"):
            pass
    assert isinstance(rd.UnknownBackendError("x"), rd.RoPEError)


@pytest.mark.parametrize("entry", ["apply", "apply_"])
def test_a_backend_name_in_bytes_is_refused_after_calls_forced_by_rope_backend(
        picky, monkeypatch, entry):
    """ROPE_BACKEND's value is kept as the environment stores it (bytes on POSIX) in a plan's
    key: backend=b"eager" matched the plans of calls forced by ROPE_BACKEND=eager and ran them,
    where a first call refuses it as no backend's name."""
    monkeypatch.setenv("ROPE_BACKEND", "eager")
    t, f, spec = inputs("bshd")
    run = functools.partial(getattr(rd, entry), t, f, spec)
    for _ in range(3):  # planned
        run()
    with pytest.raises(rd.UnknownBackendError, match="unknown backend b'eager'"):
        run(backend=b"eager")


def test_no_backend_lists_every_reason(picky, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {"picky": registry._REGISTRY["picky"]})
    t, f, spec = inputs("sbhd")
    with pytest.raises(rd.NoBackendError) as info:
        rd.apply(t, f, spec)
    assert "picky: layout 'sbhd' is not supported" in str(info.value)
    assert "(6, 2, 3, 8)" in str(info.value)


def test_explain_names_choice_and_rejections(picky):
    t, f, spec = inputs("sbhd")
    text = str(rd.explain(t, f, spec))
    assert "backend: " in text
    assert "picky: layout 'sbhd' is not supported; supports bshd" in text
    for info in rd.list_backends():
        assert info.name in text
    forced = rd.explain(t, f, spec, backend="picky")
    assert forced.chosen is None and "forced" in forced.why


def test_size_limits_are_not_hidden_by_cache(picky, monkeypatch):
    monkeypatch.setattr(Picky, "max_numel", 300)
    dispatch.clear_decisions()  # the registry's size limits changed
    f = torch.rand(8, 1, 1, 8)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    rd.apply(torch.randn(2, 6, 3, 8), f, spec)  # 288 elements: picky serves it
    assert picky.runs == 1
    rd.apply(torch.randn(2, 7, 3, 8), f, spec)  # same bucket, but 336 > 300: refused
    assert picky.runs == 1
    reasons = rd.explain(torch.randn(2, 7, 3, 8), f, spec).rejected["picky"]
    assert reasons == ["t has 336 elements; at most 300 supported"]


def test_unavailable_backend_says_why():
    class Missing(rd.Backend):
        name = "missing"

        def unavailable_reasons(self):
            return ["package 'nothing' is not installed (pip install nothing)"]

    class Broken(rd.Backend):
        name = "broken"

        def unavailable_reasons(self):
            raise OSError("libfoo.so: cannot open shared object file")

    assert Missing().availability == ("package 'nothing' is not installed (pip install nothing)",)
    assert "OSError: libfoo.so" in Broken().availability[0]


def test_rotary_dim_from_the_table_is_part_of_the_decision(picky, monkeypatch):
    """spec.rotary_dim defaults to the table's d2; a cached choice for d2=8 must not serve d2=4."""
    monkeypatch.setattr(Picky, "extra_reasons", lambda self, call: ["d2 must be 8"] if call.rotary_dim != 8 else [])
    t, _, spec = inputs("bshd")
    rd.apply(t, torch.rand(6, 8), spec)
    assert picky.runs == 1
    rd.apply(t, torch.rand(6, 4), spec)
    assert picky.runs == 1


# ---------------------------------------------------------------- plans: repeated calls


def test_repeated_calls_reuse_checks_but_compute_on_new_data(picky):
    f = torch.rand(6, 1, 1, 8)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    for _ in range(3):
        t = torch.randn(2, 6, 3, 8)
        assert_matches(rd.apply(t, f, spec), reference_for(t, f, spec), torch.float32)
    assert picky.runs == 3 and picky.checks == 1


def test_repeated_call_follows_a_table_rewritten_or_replaced(picky):
    t = torch.randn(2, 6, 3, 8)
    f = torch.rand(6, 1, 1, 8)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    rd.apply(t, f, spec)
    f.mul_(3)  # same memory, new values
    assert_matches(rd.apply(t, f, spec), reference_for(t, f, spec), torch.float32)
    f.data = torch.rand(6, 1, 1, 8)  # new memory under the same object
    assert_matches(rd.apply(t, f, spec), reference_for(t, f, spec), torch.float32)
    f.data = torch.rand(4, 1, 1, 8)  # now too short for s=6: the checks run again
    with pytest.raises(rd.RoPEError, match="freqs has 4 positions but the sequence needs 6"):
        rd.apply(t, f, spec)


def test_repeated_call_rechecks_what_the_plan_does_not_cover(picky):
    t, f, spec = inputs("bshd")
    rd.apply(t, f, spec)
    with pytest.raises(rd.RoPEError, match="t has dtype float64 but spec.dtype is float32"):
        rd.apply(t.double(), f, spec)
    with pytest.raises(rd.RoPEError, match="freqs is on cpu but t is on meta"):
        rd.apply(t.to("meta"), f, spec)
    # a new spec object never inherits a plan, whatever its id
    for interleaved in (True, False, True):
        other = rd.RoPESpec(layout="bshd", dtype="fp32", interleaved=interleaved)
        assert_matches(rd.apply(t, f, other), reference_for(t, f, other), torch.float32)


def test_repeated_thd_call_rechecks_offsets_rewritten_in_place(picky):
    cu = torch.tensor([0, 2, 6])
    spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu)
    t, f = torch.randn(6, 3, 8), torch.rand(6, 8)
    assert_matches(rd.apply(t, f, spec), reference_for(t, f, spec), torch.float32)
    cu[2] = 7
    with pytest.raises(rd.RoPEError, match=r"cu_seqlens\[-1\]=7 must equal the total tokens"):
        rd.apply(t, f, spec)


def test_registering_a_backend_replaces_planned_choices(monkeypatch):
    monkeypatch.setenv("ROPE_AUTOTUNE", "0")
    monkeypatch.delenv("ROPE_BACKEND", raising=False)
    monkeypatch.setattr(Picky, "runs", 0)
    t, f, spec = inputs("bshd")
    rd.apply(t, f, spec)
    rd.register(Picky())
    try:
        rd.apply(t, f, spec)
        assert Picky.runs == 1
    finally:
        registry.unregister("picky")
    rd.apply(t, f, spec)
    assert Picky.runs == 1


def test_registering_what_is_no_backend_instance_is_refused_by_name(monkeypatch):
    """A backend class (not an instance), a nameless backend or a priority of the wrong type
    is refused at register(): accepted, it failed every later call of the process with an
    internal TypeError (an unbound method, or the registry's sort by name or priority)."""
    monkeypatch.delenv("ROPE_BACKEND", raising=False)

    class Nameless(rd.Backend):
        pass

    class Named(Picky):
        name = "named"

    for bad, match in ((Picky, r"register an instance: register\(Picky\(\)\)"),
                       (Nameless(), "name must be a non-empty string, got None"),
                       (object(), "takes an instance of rope_dispatch.Backend")):
        with pytest.raises(rd.RoPETypeError, match=match):
            rd.register(bad)
    monkeypatch.setattr(Named, "priority", "100")
    with pytest.raises(rd.RoPETypeError, match="'named': priority must be a number"):
        rd.register(Named())
    monkeypatch.setattr(Named, "priority", float("nan"))  # unordered: would misplace others
    with pytest.raises(rd.RoPEError, match="'named': priority must be a number .*got nan"):
        rd.register(Named())
    monkeypatch.setattr(Named, "name", 5)
    with pytest.raises(rd.RoPETypeError, match="non-empty string, got 5"):
        rd.register(Named())
    assert {"picky", "named", 5, None} & {b.name for b in registry.backends()} == set()
    t, f, spec = inputs("bshd")
    rd.apply(t, f, spec)


@pytest.mark.parametrize("attr, value, named", [
    ("dtypes", frozenset({"bf16"}), "dtypes must be a set of torch dtypes"),
    ("layouts", frozenset({"SBHD"}), "layouts must be a set of layout names"),
    ("tensors", frozenset({"T"}), "tensors must be a set of call kinds"),
    ("tables", frozenset({"angle"}), "tables must be a set of table kinds"),
    ("devices", frozenset({"CPU"}), "devices must be a set of device types"),
    ("devices", "cpu", "devices must be a set of device types"),
])
def test_a_backend_declaring_what_no_call_has_is_refused_by_name(
        monkeypatch, attr, value, named):
    """A capability no call can have was accepted: a dtype by name refused every call with a
    reason that contradicted itself ("dtype bfloat16 is not supported; supports bf16"), and
    an unknown call kind crashed each call with a KeyError while its reasons were listed."""
    monkeypatch.delenv("ROPE_BACKEND", raising=False)

    class Declared(rd.Backend):
        name = "declared"
        priority = 1000  # first in line: every call lists its reasons

        def apply(self, call):
            return rope_eager(call)

    monkeypatch.setattr(Declared, attr, value)
    with pytest.raises(rd.RoPEError, match=f"'declared': {named}.*got {re.escape(repr(value))}"):
        rd.register(Declared())
    assert "declared" not in {b.name for b in registry.backends()}
    t, f, spec = inputs("bshd")
    assert_matches(rd.apply(t, f, spec), reference_for(t, f, spec), torch.float32)
    monkeypatch.setattr(Declared, attr, getattr(rd.Backend, attr))
    try:
        rd.register(Declared())  # as declared by default: accepted
    finally:
        registry.unregister("declared")
    asked = []

    class Computed(Declared):  # triton's devices: a property that runs the probe
        @property
        def devices(self):
            asked.append(True)
            return frozenset({"cpu"})

    rd.register(Computed())  # not run at register: a probe there would import its packages
    registry.unregister("declared")
    assert asked == []


def test_a_probe_returning_one_sentence_gives_it_as_one_reason(monkeypatch):
    """A plugin's unavailable_reasons() returning a bare string ("no GPU here") was listed
    letter by letter: "unavailable: n; o;  ; G; P; U; ..." in list_backends and the selftest."""
    monkeypatch.delenv("ROPE_BACKEND", raising=False)

    class Bare(rd.Backend):
        name = "bare"

        def unavailable_reasons(self):
            return "no GPU here"

        def apply(self, call):
            return rope_eager(call)

    rd.register(Bare())
    try:
        (info,) = rd.list_backends("bare")
        assert not info.available and info.reasons == ("no GPU here",)
    finally:
        registry.unregister("bare")


def test_a_per_call_reason_returned_bare_is_one_reason(monkeypatch):
    """extra_reasons() returning one string refused the call with its letters as reasons
    ("f; p; 1; 6; ..."), in explain and in the error of a forced call."""
    monkeypatch.delenv("ROPE_BACKEND", raising=False)

    class Bare(rd.Backend):
        name = "bare-extra"

        def extra_reasons(self, call):
            return "fp16 only" if call.t.dtype != torch.float16 else ""

        def apply(self, call):
            return rope_eager(call)

    rd.register(Bare())
    try:
        t, f, spec = inputs("bshd")
        with pytest.raises(rd.BackendNotSupportedError, match=r"rotary dim 8\): fp16 only$"):
            rd.apply(t, f, spec, backend="bare-extra")
        assert rd.explain(t, f, spec).rejected["bare-extra"] == ["fp16 only"]
        half = rd.RoPESpec(layout="bshd", dtype="fp16")
        out = rd.apply(t.half(), f, half, backend="bare-extra")
        assert_matches(out, reference_for(t.half(), f, half), torch.float16)
    finally:
        registry.unregister("bare-extra")


def test_plans_and_remembered_tables_keep_no_table_alive(picky):
    t = torch.randn(2, 6, 3, 8)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    for make in (lambda: torch.rand(6, 1, 1, 8), lambda: torch.rand(6, 8),
                 lambda: rd.cos_sin_cache(torch.rand(6, 8))):
        f = make()
        for _ in range(3):
            rd.apply(t, f, spec)
        ref = weakref.ref(f)
        del f
        gc.collect()
        assert ref() is None, "a plan or the table memo kept the table alive"


def test_a_remembered_table_resized_in_place_is_checked_again():
    """``resize_`` to fewer elements keeps a table's address: the table memo, which spares a
    table passed to every layer its checks, must not serve the new shape unchecked."""
    from rope_dispatch import tables

    t = torch.randn(2, 10, 3, 8)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    for new_shape, words in (((10, 1, 1, 5), r"even rotary dim d2 >= 2, got shape \(10, 5\)"),
                             ((10, 1, 2, 4), r"shape \[s2, 1, 1, d2\], got \(10, 1, 2, 4\)")):
        f = torch.rand(10, 1, 1, 8)
        for _ in range(3):
            rd.apply(t, f, spec)
        assert tables.angles_2d(f).shape == (10, 8)
        address = f.data_ptr()
        f.resize_(new_shape)
        assert f.data_ptr() == address
        with pytest.raises(rd.RoPEError, match=words):
            tables.angles_2d(f)
        with pytest.raises(rd.RoPEError, match=words):
            rd.apply(t, f, spec)


def test_a_table_that_requires_grad_gets_its_gradient():
    """A learnable table (freqs.requires_grad): the call goes to a backend that differentiates
    the table (eager), with t's and the table's gradients as the float64 reference's; a backend
    that treats the table as a constant says so when forced; in place is refused before any
    write; a table made learnable after its calls were planned gets its gradient too."""
    from reference import reference_for

    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    angles = torch.rand(6, 1, 1, 8) * 4
    t = torch.randn(6, 2, 3, 8, requires_grad=True)
    g = torch.randn(6, 2, 3, 8)
    x, a = t.detach().double().requires_grad_(), angles.double().requires_grad_()
    want_t, want_a = torch.autograd.grad(reference_for(x, a.view(6, 8), spec, None, None), (x, a), g.double())

    def grads(freqs, **kw):
        return torch.autograd.grad(rd.apply(t, freqs, spec, **kw), (t, freqs), g)

    constant = angles.clone()
    for _ in range(3):  # planned while the table is a constant
        rd.apply(t, constant, spec)
    freqs = constant.requires_grad_()
    assert rd.explain(t, freqs, spec).chosen == "eager"
    for got_t, got_a in (grads(freqs), grads(freqs), grads(freqs, backend="eager")):
        assert_matches(got_t, want_t, torch.float32, "t's gradient")
        assert_matches(got_a, want_a, torch.float32, "the table's gradient")
    with pytest.raises(rd.BackendNotSupportedError, match="the table requires grad, and this backend computes no gradient for it"):
        rd.apply(t, freqs, spec, backend="compile")
    with pytest.raises(rd.RoPEError, match="apply_ cannot rotate in place with a table that requires grad"):
        rd.apply_(t.detach().clone(), freqs, spec)
    with torch.no_grad():  # no gradient asked: any backend, in place too
        out = rd.apply(t, freqs, spec, backend="compile")
        assert_matches(out, want_out := reference_for(t.detach().double(), angles.view(6, 8).double(), spec, None, None), torch.float32, "no grad")
        y = t.detach().clone()
        rd.apply_(y, freqs, spec)
        assert_matches(y, want_out, torch.float32, "in place, no grad")


class ConstantTable(Picky):
    """A kernel's view of the table: a constant (no gradient reaches it), as declared."""

    def apply(self, call):
        Picky.runs += 1
        return rope_eager(call._replace(table=call.table.detach()))


def test_a_table_made_learnable_after_calls_without_grad_were_planned_gets_its_gradient(
        monkeypatch):
    """A frozen model whose rotary table alone is then trained: t never requires grad, and the
    table's requires_grad is set in place after calls were planned. The next calls must go to a
    backend that differentiates the table (eager), not run the plan of one that treats it as a
    constant (which gave an output with no autograd node: no gradient, no error)."""
    monkeypatch.setitem(registry._REGISTRY, "picky", ConstantTable())
    monkeypatch.setattr(Picky, "runs", 0)
    monkeypatch.delenv("ROPE_BACKEND", raising=False)
    dispatch.clear_decisions()
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    t, g = torch.randn(2, 6, 3, 8), torch.randn(2, 6, 3, 8)
    freqs = torch.rand(6, 1, 1, 8) * 4
    a = freqs.view(6, 8).double().requires_grad_()
    (want,) = torch.autograd.grad(reference_for(t.double(), a, spec), a, g.double())
    for _ in range(3):  # planned while the table is a constant
        rd.apply(t, freqs, spec)
    with torch.no_grad():  # and without grad
        for _ in range(3):
            rd.apply(t, freqs, spec)
    assert Picky.runs == 6
    freqs.requires_grad_()
    for _ in range(2):
        (got,) = torch.autograd.grad(rd.apply(t, freqs, spec), freqs, g)
        assert_matches(got.view(6, 8), want, torch.float32, "the table's gradient")
    assert Picky.runs == 6
    dispatch.clear_decisions()


FIRST_CALLS_IN_THREADS = textwrap.dedent(
    """
    import json, threading
    import torch
    from rope_dispatch.dispatch import apply  # as the doors import it: no backend loaded yet
    from rope_dispatch.spec import RoPESpec

    spec = RoPESpec(layout="sbhd", dtype="fp32")
    threads, errors, worst = 8, [], [0.0]
    start = threading.Barrier(threads)
    x = torch.randn(6, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    angles = torch.rand(6, 1, 1, 8, generator=torch.Generator().manual_seed(1)) * 6
    # x cos + rotate_half(x) sin, from the formula, in float64
    a, c, s = x.double(), angles.double().cos(), angles.double().sin()
    expected = a * c + torch.cat((-a[..., 4:], a[..., :4]), -1) * s

    def first_call():
        start.wait()  # every thread's first call at once, before any backend is loaded
        try:
            out = apply(x, angles, spec)
            worst[0] = max(worst[0], (out.double() - expected).abs().max().item())
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")

    workers = [threading.Thread(target=first_call) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"errors": errors, "worst": worst[0]}))
    """
)


@pytest.mark.parametrize("forced", [None, "eager"])
def test_first_calls_from_several_threads_find_the_backends(tmp_path, forced):
    """Threads whose first calls come at once (``nn.DataParallel`` replicas, a serving thread
    pool) each get the right result: none finds the registry empty while another imports the
    built-in backends."""
    env = {**os.environ, "ROPE_DISPATCH_CACHE_DIR": str(tmp_path)}
    for name in ("ROPE_BACKEND", "TRITON_INTERPRET"):
        env.pop(name, None)
    if forced:
        env["ROPE_BACKEND"] = forced
    done = subprocess.run([sys.executable, "-c", FIRST_CALLS_IN_THREADS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["errors"] == [], report
    assert report["worst"] < 1e-5, report
