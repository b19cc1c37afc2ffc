"""The selftest reports every backend and fails when a backend is wrong."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import rope_dispatch as rd
from rope_dispatch import registry, selftest
from rope_dispatch.backends.eager import rope_eager


class WrongSign(rd.Backend):
    """Negates every output: the selftest must catch it."""

    name = "wrong-sign"
    devices = frozenset({"cpu"})

    def apply(self, call):
        return -rope_eager(call)


class InPlaceNoOp(rd.Backend):
    """Right out of place, but its apply_ leaves t as it was: the selftest must catch it."""

    name = "in-place-no-op"
    devices = frozenset({"cpu"})
    supports_in_place = True

    def apply(self, call):
        return call.t if call.in_place else rope_eager(call)


def test_selftest_cli_json():
    proc = subprocess.run(
        [sys.executable, "-m", "rope_dispatch.selftest", "--json", "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["versions"]["torch"] == torch.__version__
    assert report["plan_guards"] == "torch"  # CI's torch gets the C++ guards (rope_dispatch.guards)
    names = {b["name"] for b in report["backends"]}
    assert {"eager", "triton", "te", "compile"} <= names
    eager = [c for c in report["checks"] if c["backend"] == "eager"]
    assert len(eager) == len(selftest.QUICK) and all(c["status"] == "ok" for c in eager)
    compiled = [c for c in report["checks"] if c["backend"] == "compile"]
    assert len(compiled) <= 1  # a backend that compiles each spec checks one case by default
    assert "[1/" in proc.stderr  # progress goes to stderr
    assert "Warning" not in proc.stderr  # no third-party warning on a plain run
    assert 0 < report["startup_s"] < 600 and report["checks_s"] > 0
    # the cache as a path and a count; its entries only when asked (--cache-entries)
    assert "cache_entries" not in report["cache"]
    assert isinstance(report["cache"]["cache_entry_count"], int) and report["cache"]["cache_dir"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("off", False), ("No", False)])
def test_the_report_says_whether_autotune_is_on(monkeypatch, value, on):
    """Every spelling ``ROPE_AUTOTUNE`` takes for off reads as off, as the library reads it."""
    monkeypatch.setenv("ROPE_AUTOTUNE", value)
    assert selftest._cache_report()["autotune"] is on


def test_a_rope_autotune_value_neither_on_nor_off_fails_the_selftest(monkeypatch, capsys):
    """``ROPE_AUTOTUNE=disabled`` makes every call that measures raise: the selftest says so
    and fails, as for an override no call could use (it crashed with the library's error)."""
    monkeypatch.setenv("ROPE_AUTOTUNE", "disabled")
    report = selftest._cache_report()
    assert report["autotune"] is False and "'disabled'" in report["autotune_problem"]
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""}])
    full = selftest.run(["cpu"], lambda line: None, False)
    assert not full["ok"]
    selftest._print_report(full)
    assert "autotune: FAIL (ROPE_AUTOTUNE must be" in capsys.readouterr().out


def test_a_hot_calls_value_not_a_positive_integer_fails_the_selftest(monkeypatch, capsys):
    """``ROPE_AUTOTUNE_HOT_CALLS=abc`` makes every call of a key whose compiling candidate is
    pending raise (every first CPU call with measuring on): the selftest says so and fails,
    where it passed."""
    monkeypatch.setenv("ROPE_AUTOTUNE", "1")
    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", "abc")
    report = selftest._cache_report()
    assert "ROPE_AUTOTUNE_HOT_CALLS must be a positive integer" in report["autotune_problem"]
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""}])
    full = selftest.run(["cpu"], lambda line: None, False)
    assert not full["ok"]
    selftest._print_report(full)
    assert "autotune: FAIL (ROPE_AUTOTUNE_HOT_CALLS must be" in capsys.readouterr().out
    monkeypatch.setenv("ROPE_AUTOTUNE", "0")  # measuring off: the count is never read
    assert "autotune_problem" not in selftest._cache_report()


@pytest.mark.parametrize("name", ["ROPE_DISPATCH_CHECK_VALUES", "ROPE_DISPATCH_LINEAR_TABLES"])
def test_an_on_off_switch_neither_on_nor_off_fails_the_selftest(monkeypatch, capsys, name):
    """A switch the library refuses (its calls that read it raise: device index values, large
    Triton calls, which the selftest's CPU checks never make) fails the selftest by name."""
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""}])
    monkeypatch.setenv(name, "Off")  # a spelling it takes
    assert selftest.run(["cpu"], lambda line: None, False)["ok"]
    monkeypatch.setenv(name, "maybe")
    full = selftest.run(["cpu"], lambda line: None, False)
    assert not full["ok"]
    selftest._print_report(full)
    assert f"FAIL: {name} must be" in capsys.readouterr().out


def test_a_misspelt_variable_is_named_with_the_one_meant(monkeypatch, capsys, tmp_path):
    """``ROPE_DISPATCH_AUTOTUNE=0`` (for ROPE_AUTOTUNE) or a lower-case ``rope_backend`` is read
    by nothing: the selftest said nothing of it, and measuring stayed on. It is named with the
    variable meant, as a note (``ROPE_`` may be another program's), and the known ones not."""
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""}])
    for name in list(os.environ):
        if name.upper().startswith("ROPE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ROPE_DISPATCH_AUTOTUNE", "0")
    monkeypatch.setenv("rope_backend", "eager")
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", str(tmp_path))  # a known one: no note
    full = selftest.run(["cpu"], lambda line: None, False)
    assert full["ok"]
    selftest._print_report(full)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NOTE")]
    assert len(notes) == 2, notes
    assert notes[0].startswith("NOTE: ROPE_DISPATCH_AUTOTUNE is not a variable rope-dispatch "
                               "reads; did you mean ROPE_AUTOTUNE?")
    assert notes[1].startswith("NOTE: rope_backend is not a variable rope-dispatch reads; did "
                               "you mean ROPE_BACKEND?")


def test_a_check_the_backend_refused_is_not_counted_as_passed(monkeypatch, capsys):
    """A backend listed as available whose check it then refused ("not supported": a compile
    that found no C++ compiler) was counted among the checks passed: "7 checks passed" where
    six had run."""
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""},
        {"backend": "compile", "device": "cpu", "case": "c", "status": "not supported",
         "detail": "no C++ compiler"}])
    report = selftest.run(["cpu"], lambda line: None, False)
    selftest._print_report(report)
    assert "PASS: 1 checks passed, 0 failed, 1 not supported in" in capsys.readouterr().out


def test_process_age_counts_from_the_process_start():
    code = (
        "import time; time.sleep(0.6); from rope_dispatch.selftest import process_age_s; "
        "print(process_age_s())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    age = float(proc.stdout)
    assert 0.6 <= age < 300  # the sleep and the imports after it, not the machine's uptime


def test_quick_grid_covers_every_feature_and_thorough_runs_the_grid(monkeypatch):
    quick = selftest.QUICK
    assert any(c.cp_size > 1 and c.starts for c in quick) and any(c.layout == "thd" for c in quick)
    assert any(c.interleaved for c in quick) and any(c.rotary_dim < c.head_dim for c in quick)
    assert any(c.cache for c in quick) and any(c.qkv for c in quick) and any(c.qk for c in quick)
    assert any(c.model_table for c in quick)
    assert selftest.cases_for("eager", thorough=True) == selftest.GRID
    assert selftest.cases_for("compile", thorough=False) == quick[:1]
    eager_only = [info for info in rd.list_backends() if info.name == "eager"]
    monkeypatch.setattr(rd, "list_backends", lambda names=None: eager_only)
    report = selftest.run(["cpu"], lambda line: None, thorough=True)
    assert len(report["checks"]) == len(selftest.GRID) and report["ok"]


def test_compiling_backends_are_checked_by_a_worker_process_meanwhile(monkeypatch):
    """With isolation (the default where CUDA is checked) the compile and te backends are probed
    and checked in worker processes: their results join the report in the backends' order,
    their progress lines are numbered with the others, and this process neither probes nor
    checks them."""
    compile_backend = rd.get_backend("compile")
    if not compile_backend.available:
        pytest.skip(f"the compile backend is unavailable: {compile_backend.availability}")
    checked_here = []
    check = selftest.check
    monkeypatch.setattr(selftest, "check",
                        lambda name, *args: checked_here.append(name) or check(name, *args))
    probed_here = []
    list_backends = rd.list_backends
    monkeypatch.setattr(rd, "list_backends",
                        lambda names=None: probed_here.append(names) or list_backends(names))
    lines = []
    started = {name: selftest.start_worker([name], "cpu", False) for name in ("compile", "eager")}
    report = selftest.run(["cpu"], lines.append, isolate=True, started=started)
    assert report["ok"], report["checks"]
    assert started["eager"].returncode == -signal.SIGKILL  # started, not isolated: killed
    assert [b["name"] for b in report["backends"]] == [b.name for b in registry.backends()]
    assert [(b["name"], b["available"]) for b in report["backends"]] == [
        (b.name, b.available) for b in registry.backends()]  # the workers probe as this one
    backends = [c["backend"] for c in report["checks"]]
    available = [b["name"] for b in report["backends"] if b["available"]]
    assert backends == sorted(backends, key=available.index) and backends.count("compile") == 1
    total = len(report["checks"])
    assert sorted(int(line[1:line.index("/")]) for line in lines if line.startswith("[")) == list(
        range(1, total + 1))
    assert any("] compile on cpu" in line for line in lines)
    assert "compile" not in checked_here and "te" not in checked_here and "eager" in checked_here
    (names,) = probed_here
    assert "eager" in names and "compile" not in names and "te" not in names
    assert [w["backends"] for w in report["workers"]] == [["te"], ["compile"]]
    assert [w["prestarted"] for w in report["workers"]] == [False, True]
    assert all(w["startup_s"] > 0 for w in report["workers"])


class CompilesPerSpec(rd.Backend):
    """A third-party backend that compiles per spec: a worker process would not know it."""

    name = "compiles-per-spec"
    devices = frozenset({"cpu"})
    compiles_per_spec = True

    def apply(self, call):
        return rope_eager(call)


def test_the_prestarted_backends_are_those_checked_apart(monkeypatch):
    """Only built-in backends get a worker: a new interpreter registers no other. A program's
    own backend that compiles per spec is checked in the program's process."""
    assert selftest.PRESTARTED == tuple(b.name for b in registry.backends()
                                        if selftest.checked_apart(b))
    assert not selftest.checked_apart(CompilesPerSpec())
    monkeypatch.setitem(registry._REGISTRY, CompilesPerSpec.name, CompilesPerSpec())
    workers = []

    class NoWorker:
        def __init__(self, names, *args):
            workers.append(names)
            self.names, self.prestarted = names, False

        def report(self):
            return {"backends": [], "checks": [], "startup_s": None, "checks_s": None}

    monkeypatch.setattr(selftest, "Worker", NoWorker)
    report = selftest.run(["cpu"], lambda line: None, isolate=True)
    assert workers == [[name] for name in selftest.PRESTARTED]
    checks = [c for c in report["checks"] if c["backend"] == CompilesPerSpec.name]
    assert [c["status"] for c in checks] == ["ok"]


@pytest.mark.parametrize("nodes, visible, likely", [
    ((), None, False), (("/dev/nvidiactl",), None, True), (("/dev/kfd",), "0,1", True),
    (("/dev/nvidiactl",), "", False), (("/dev/nvidiactl",), "-1", False),
])
def test_cuda_is_likely_where_a_driver_is_and_a_device_is_visible(monkeypatch, nodes, visible,
                                                                   likely):
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: path in nodes or (
        exists(path) and not path.startswith("/dev/")))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert selftest.cuda_likely() is likely


@pytest.mark.parametrize("argv, likely, started", [
    ([], True, ["te", "compile"]), (["--device", "all", "--thorough"], True, ["te", "compile"]),
    ([], False, []), (["--device", "cpu"], True, []), (["--worker", "te"], True, []),
])
def test_prestart_starts_the_workers_where_cuda_is_likely_checked(monkeypatch, argv, likely,
                                                                  started):
    """They start where CUDA is likely checked, and are killed at the interpreter's exit if
    still running then."""
    calls, at_exit = [], []
    monkeypatch.setattr(selftest, "cuda_likely", lambda: likely)
    monkeypatch.setattr(selftest, "start_worker",
                        lambda names, device, thorough: calls.append((names, device, thorough)))
    monkeypatch.setattr(selftest.atexit, "register", lambda fn, *args: at_exit.append((fn, args)))
    args = selftest.command_line().parse_args(argv)
    workers = selftest.prestart(args)
    assert list(workers) == started
    assert calls == [([name], args.device, args.thorough) for name in started]
    assert at_exit == ([(selftest.kill_unreaped, (workers,))] if started else [])


@pytest.mark.parametrize("ending", [
    pytest.param("no CUDA", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="needs a machine where --device cuda fails")),
    "torch not importable",
])
def test_the_command_line_starts_workers_before_torch_and_kills_them_on_an_error(ending):
    """Under ``python -m`` the workers start before this process imports torch; when the
    selftest then ends early (``--device cuda`` without CUDA, or its own ``import torch``
    failing), none outlives it."""
    code = textwrap.dedent("""
        import atexit, os, runpy, subprocess, sys

        exists = os.path.exists
        os.path.exists = lambda path: path == "/dev/nvidiactl" or exists(path)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        events = []
        atexit.register(lambda: print(*events))  # runs last: after the selftest's own

        class Recorded:
            def __init__(self, command, **kwargs):
                self.name = command[command.index("--worker") + 1]
                events.append(f"{self.name}:torch={sys.modules.get('torch') is not None}")

            def poll(self):
                return None

            def kill(self):
                events.append(f"{self.name}:killed")

        subprocess.Popen = Recorded
        if ENDING == "no CUDA":
            sys.argv[1:] = ["--device", "cuda"]
        else:
            sys.argv[1:] = []
            sys.modules["torch"] = None  # makes "import torch" raise ImportError
        try:
            runpy.run_module("rope_dispatch.selftest", run_name="__main__", alter_sys=True)
        except (SystemExit, ImportError) as exc:
            events.insert(0, "SystemExit" if isinstance(exc, SystemExit) else "ImportError")
    """).replace("ENDING", repr(ending))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    ended = "SystemExit" if ending == "no CUDA" else "ImportError"
    assert proc.stdout.split() == [ended, "te:torch=False", "compile:torch=False", "te:killed",
                                   "compile:killed"], proc.stderr


def test_a_worker_reports_its_probes_its_checks_and_its_crash():
    finished, passed_on, probed = [], [], []
    worker = selftest.Worker(["eager", "te"], ["cpu"], False, finished.append, passed_on.append,
                             lambda name, available: probed.append((name, available)))
    report = worker.report()
    here = [(b.name, b.available) for b in registry.backends() if b.name in ("eager", "te")]
    assert probed == here == [("te", here[0][1]), ("eager", True)]  # the registry's order
    assert [(b["name"], b["available"]) for b in report["backends"]] == probed
    assert report["backends"][0]["reasons"] == list(rd.get_backend("te").availability)
    checks = [c for c in report["checks"] if c["backend"] == "eager"]
    assert [c["case"] for c in checks] == [case.label for case in selftest.QUICK]
    assert all(c["status"] == "ok" for c in checks)
    te = [c["status"] for c in report["checks"] if c["backend"] == "te"]
    assert te == (["not supported"] * len(selftest.QUICK) if here[0][1] else [])  # CUDA only
    assert [line.split(":")[0] for line in finished] == (
        ["te on cpu"] * len(te) + ["eager on cpu"] * len(selftest.QUICK))
    assert 0 < report["startup_s"] < 600 and report["checks_s"] > 0
    broken = selftest.Worker(["eager", "no-such-backend"], ["cpu"], False, finished.append,
                             passed_on.append)
    failed = broken.report()
    assert [c["backend"] for c in failed["checks"]] == ["eager", "no-such-backend"]
    assert all(c["status"] == "FAIL" for c in failed["checks"])
    detail = failed["checks"][1]["detail"]
    assert "exited with code 1" in detail and "unknown backend" in detail
    assert [(b["name"], b["available"], b["reasons"]) for b in failed["backends"]] == [
        ("eager", False, [detail]), ("no-such-backend", False, [detail])]
    assert any("UnknownBackendError" in line for line in passed_on)  # its stderr shown as well


def test_a_worker_compiles_without_inductors_process_pool_unless_told(monkeypatch):
    """Inductor's pool of one process a core cost the quick selftest's one compile more than it
    saved (run AZ2); there a worker compiles in its own process, unless the user chose
    otherwise."""
    envs = []

    class NoProcess:
        def __init__(self, command, **kwargs):
            envs.append(kwargs["env"])
            self.stdout, self.stderr = io.StringIO(""), io.StringIO("")

    monkeypatch.setattr(selftest.subprocess, "Popen", NoProcess)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setenv("ROPE_DISPATCH_SELFTEST_PROBE", "kept")
    selftest.Worker(["eager"], ["cpu"], False, print, print).relay.join()
    selftest.Worker(["eager"], ["cpu"], True, print, print).relay.join()  # thorough: the pool
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    selftest.Worker(["eager"], ["cpu"], False, print, print).relay.join()
    assert [env.get("TORCHINDUCTOR_COMPILE_THREADS") for env in envs] == ["1", None, "4"]
    assert all(env["ROPE_DISPATCH_SELFTEST_PROBE"] == "kept" for env in envs)


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_the_command_line_gives_the_reports_code_when_its_reader_left(monkeypatch, flags):
    """``python -m rope_dispatch.selftest | head -2``: printing the report raised BrokenPipeError,
    a traceback, and exit status 1 for a selftest that passed."""
    monkeypatch.setattr(selftest, "check_jobs", lambda jobs, finished: [
        {"backend": "eager", "device": "cpu", "case": "c", "status": "ok", "detail": ""}])
    read, write = os.pipe()
    os.close(read)
    out = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert selftest.main(["--device", "cpu", *flags]) == 0
        print("more", flush=True)  # later writes, and the flush at exit, go nowhere
    finally:
        out.close()


def test_the_command_line_exits_with_the_reports_code_and_prints_it_whole():
    """``python -m rope_dispatch.selftest`` ends without the interpreter's teardown: its exit
    code and its whole report must still come out."""
    code = textwrap.dedent("""
        import runpy, sys
        import rope_dispatch as rd
        from rope_dispatch import registry, selftest
        from rope_dispatch.backends.eager import rope_eager

        class WrongSign(rd.Backend):
            name = "wrong-sign"
            devices = frozenset({"cpu"})

            def apply(self, call):
                return -rope_eager(call)

        registry.register(WrongSign())
        sys.argv[1:] = ["--device", "cpu"]
        runpy.run_module("rope_dispatch.selftest", run_name="__main__", alter_sys=True)
    """)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)  # stdout a pipe, so buffered
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "wrong-sign" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("FAIL:")


def test_selftest_fails_on_a_wrong_backend(monkeypatch, capsys):
    monkeypatch.setitem(registry._REGISTRY, "wrong-sign", WrongSign())
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    assert selftest.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "wrong-sign" in out and "FAIL" in out


@pytest.mark.parametrize("value", ["bogus", "te"])
def test_selftest_fails_on_an_override_no_call_could_use(monkeypatch, capsys, value):
    """ROPE_BACKEND naming an unknown backend, or one unavailable here, makes every call
    without ``backend=`` raise: the selftest says so and fails."""
    if value == "te" and rd.get_backend("te").available:
        pytest.skip("TransformerEngine is available here")
    monkeypatch.setenv("ROPE_BACKEND", value)
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    assert selftest.main(["--device", "cpu"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("override:"))
    assert f"ROPE_BACKEND={value} (FAIL: " in line


def test_device_all_says_what_it_did_not_check(monkeypatch, capsys):
    """``--device all`` without a CUDA device checks the CPU and says CUDA was not checked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    selftest.main(["--device", "all"])
    assert "cuda: not checked (no CUDA device is visible to torch)" in capsys.readouterr().out


def test_selftest_checks_apply_in_place(monkeypatch, capsys):
    monkeypatch.setitem(registry._REGISTRY, "in-place-no-op", InPlaceNoOp())
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    assert selftest.main(["--device", "cpu"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("in-place-no-op")]
    assert lines and all("FAIL" in line for line in lines)


def test_autotune_entry_lines_name_what_tells_entries_apart():
    """The report's cache listing: entries whose keys differ only in a spec field, the table
    kind, the positions, the tensors, the norm stages or the KV cache written read as
    different lines naming that difference (norms, cache, rotary_offset, deinterleave,
    mrope_interleaved and max_seqlen were left out: such entries printed alike)."""
    spec = {"layout": "sbhd", "dtype": "bfloat16", "rotary_dim": 128, "interleaved": False,
            "cp_size": 1, "cp_rank": 0, "cos_sin_scale": 1.0, "mrope_section": None,
            "max_seqlen": None}
    base = {"spec": spec, "shape_bucket": [512, 1, 8, 128], "sequences_bucket": 1,
            "stride": "contiguous", "table": "angles", "start_positions": False,
            "requires_grad": False, "candidates": ["triton", "te"]}
    variants = {
        "plain": {},
        "interleaved": {"spec": {**spec, "interleaved": True}},
        "cp 1/2": {"spec": {**spec, "cp_size": 2, "cp_rank": 1}},
        "cos_sin_cache": {"table": "cos_sin_cache"},
        "start positions": {"start_positions": True},
        "positions": {"positions": True},
        "in place": {"in_place": True},
        "grad": {"requires_grad": True},
        "k <= 512x1x2x128": {"k_shape_bucket": [512, 1, 2, 128]},
        "qkv 512+128+128": {"qkv_split": [512, 128, 128]},
        "from channel 64": {"spec": {**spec, "rotary_offset": 64}},
        "deinterleave": {"spec": {**spec, "deinterleave": True}},
        "mrope [16, 24, 24]": {"spec": {**spec, "mrope_section": [16, 24, 24]}},
        "mrope [16, 24, 24] interleaved": {"spec": {**spec, "mrope_section": [16, 24, 24],
                                                     "mrope_interleaved": True}},
        "norms head/-": {"norms": ["head", None]},
        "norms head/head": {"norms": ["head", "head"]},
        "to paged cache float8_e4m3fn, q out bfloat16": {
            "cache": ["paged", "float8_e4m3fn", "bfloat16"]},
        "to flat cache bfloat16, q out bfloat16, v dim 64": {
            "cache": ["flat", "bfloat16", "bfloat16", 64]},
        "<= 1 sequences": {"spec": {**spec, "layout": "thd"}},
        "max_seqlen 4096": {"spec": {**spec, "layout": "thd", "max_seqlen": 4096}},
    }
    lines = {}
    for name, change in variants.items():
        entry = {"fields": {**base, **change}, "choice": "triton", "times_us": {"triton": 4.0}}
        lines[name] = selftest._entry_line(entry)
    assert lines["plain"] == "sbhd bfloat16 <= 512x1x8x128 contiguous rotary 128: triton (triton 4 us)"
    for name, line in lines.items():
        assert name == "plain" or name in line, (name, line)
    assert len(set(lines.values())) == len(lines), lines


def test_the_report_says_how_planned_launches_reach_the_gpu(monkeypatch):
    """Where CUDA is checked with the triton backend, the report says whether planned launches
    allocate and launch in one call into C, or why they go through Triton's launcher; elsewhere
    it says nothing of them."""
    from rope_dispatch.backends import direct_launch

    assert selftest.direct_launch_state(["cpu"], ["triton", "eager"]) is None
    assert selftest.direct_launch_state(["cuda"], ["eager"]) is None
    monkeypatch.setattr(direct_launch, "module", lambda: object())
    assert selftest.direct_launch_state(["cpu", "cuda"], ["triton"]) == "one call into C"
    monkeypatch.setattr(direct_launch, "module", lambda: None)
    monkeypatch.setattr(direct_launch, "_unavailable", "the direct launcher is unavailable: "
                        "RuntimeError: no C compiler")
    state = selftest.direct_launch_state(["cuda"], ["triton"])
    assert state == ("Triton's launcher (the direct launcher is unavailable: RuntimeError: "
                     "no C compiler)")


def test_the_printed_report_names_the_planned_launch_path(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:1])
    monkeypatch.setattr(selftest, "direct_launch_state",
                        lambda devices, available: "Triton's launcher (no C compiler)")
    assert selftest.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "planned launches on the GPU (allocation and launch): Triton's launcher (no C compiler)" in out
    monkeypatch.setattr(selftest, "direct_launch_state", lambda devices, available: None)
    assert selftest.main(["--device", "cpu"]) == 0
    assert "planned launches" not in capsys.readouterr().out


def _fill_cache(tmp_path, monkeypatch, seqs) -> None:
    """An autotune cache in ``tmp_path / "cache"`` with one entry per sequence length in
    ``seqs`` (each its own shape bucket), measured with the fake backends."""
    import autotune_fakes
    from rope_dispatch import autotune

    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ROPE_AUTOTUNE", raising=False)
    autotune.clear_cache(memory_only=True)
    removed, _ = autotune_fakes.install()
    try:
        spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
        for seq in seqs:
            rd.apply(torch.randn(seq, 1, 2, 8), torch.rand(seq, 1, 1, 8), spec)
    finally:
        autotune_fakes.restore(removed)
        autotune.clear_cache(memory_only=True)


def test_help_is_plain_text():
    proc = subprocess.run([sys.executable, "-m", "rope_dispatch.selftest", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--cache-entries" in proc.stdout and "--thorough" in proc.stdout
    for markup in ("``", ":func:", ":class:", ":attr:"):
        assert markup not in proc.stdout, proc.stdout


def test_help_gives_every_exit_status():
    """The report fails (exit status 1) on an environment variable the calls refuse, not only
    on a failed check; the help said only the latter."""
    text = " ".join(selftest.command_line().format_help().split())
    assert "0 when every check passed" in text and "2 for bad arguments" in text
    for name in ("ROPE_BACKEND", "ROPE_AUTOTUNE", "ROPE_AUTOTUNE_HOT_CALLS",
                 "ROPE_DISPATCH_CHECK_VALUES", "ROPE_DISPATCH_LINEAR_TABLES"):
        assert name in text, text


def test_the_cache_is_a_count_and_a_path_unless_its_entries_are_asked_for(
    tmp_path, monkeypatch, capsys
):
    """A cache of many entries (another process filled it) prints as one line; --cache-entries
    lists them, and only then does --json carry them."""
    _fill_cache(tmp_path, monkeypatch, (2, 4, 8))  # three shape buckets: three entries
    assert selftest._cache_report() == {
        "autotune": True, "cache_dir": str(tmp_path / "cache"), "cache_entry_count": 3,
    }
    listed = selftest._cache_report(entries=True)["cache_entries"]
    assert len(listed) == 3 and all(e["choice"] == "fast" for e in listed)

    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:1])
    monkeypatch.setattr(selftest, "GRID", selftest.QUICK[:1])
    assert selftest.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"cache {tmp_path / 'cache'} (3 entries; --cache-entries lists them)" in out
    assert "<= " not in out  # no entry lines
    assert selftest.main(["--device", "cpu", "--cache-entries"]) == 0
    out = capsys.readouterr().out
    assert f"cache {tmp_path / 'cache'} (3 entries)" in out
    assert sum(line.startswith("  sbhd float32 <= ") for line in out.splitlines()) == 3


@pytest.mark.parametrize("change, problem", [
    ({"k_shape_bucket": 512}, "its k_shape_bucket is not a list of sizes"),
    ({"qkv_split": None}, "its qkv_split is not a list of sizes"),
    ({"qkv_split": [512, "128"]}, "its qkv_split is not a list of sizes"),
    ({"shape_bucket": [2, [1], 2, 8]}, "its shape_bucket is not a list of sizes"),
    ({"norms": 5}, "its norms is not a list of norm scopes"),
    ({"cache": ["paged", "bfloat16"]}, "its cache is not a cache form"),
    ({"cache": "paged"}, "its cache is not a cache form"),
])
def test_a_hand_edited_cache_entry_is_reported_invalid_and_the_rest_listed(
    tmp_path, monkeypatch, capsys, change, problem
):
    """--cache-entries crashed (TypeError) on an entry whose k_shape_bucket or qkv_split was
    edited to something not a list of sizes: such an entry is invalid (a warning names its file
    and why), and the other entries are listed."""
    import json

    _fill_cache(tmp_path, monkeypatch, (2, 4))
    edited = next(entry["path"] for entry in selftest._cache_report(entries=True)["cache_entries"])
    with open(edited, encoding="utf-8") as f:
        entry = json.load(f)
    entry["fields"].update(change)
    with open(edited, "w", encoding="utf-8") as f:
        json.dump(entry, f)
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:1])
    with pytest.warns(RuntimeWarning, match=f"ignoring cache file {edited}: {problem}"):
        assert selftest.main(["--device", "cpu", "--cache-entries"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("  sbhd float32 <= ") for line in out.splitlines()) == 1
    # the count said 2 entries above the one line listed
    assert "(2 entries, 1 of them invalid and ignored: the warnings above name them)" in out
