"""The autotune cache on CPU: measured once, read back by later processes, safe to share.

The backends here are the two fakes of ``autotune_fakes`` (eager math; ``slow`` sleeps before
each call and has the higher priority), so a measurement and the priority order disagree and
every test can tell which one decided. Outputs are checked against the float64 reference.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import rope_dispatch as rd
from rope_dispatch import autotune, registry, tune

import autotune_fakes
from reference import assert_matches, reference_for, reference_forward_backward

TESTS = Path(__file__).resolve().parent
SPEC = rd.RoPESpec(layout="sbhd", dtype="fp32")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache directory of this test's own; nothing remembered in memory."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", str(root))
    monkeypatch.delenv("ROPE_AUTOTUNE", raising=False)
    monkeypatch.delenv("ROPE_BACKEND", raising=False)
    autotune.clear_cache(memory_only=True)
    yield root
    autotune.clear_cache(memory_only=True)


@pytest.fixture
def fakes(cache):
    """Only the ``fast`` and ``slow`` fakes registered for the test."""
    removed, installed = autotune_fakes.install()
    try:
        yield installed
    finally:
        autotune_fakes.restore(removed)
        autotune.clear_cache(memory_only=True)


@pytest.fixture
def measurements(caplog):
    """A function returning how many keys this process has measured so far in the test."""
    caplog.set_level(logging.INFO, logger="rope_dispatch.autotune")
    return lambda: sum(r.getMessage().startswith("measured ") for r in caplog.records)


def inputs(seq: int = 8, requires_grad: bool = False, seed: int = 0):
    """An sbhd fp32 input and an angle table whose halves differ."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(seq, 2, 2, 16, generator=g).requires_grad_(requires_grad)
    freqs = torch.rand(seq + 3, 1, 1, 16, generator=g) * 20
    return t, freqs


def calls(fakes) -> dict[str, int]:
    return {name: b.calls for name, b in fakes.items()}


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*.json") if p.name != "environment.json")


SECOND_PROCESS = textwrap.dedent(
    """
    import json, logging, sys
    sys.path.insert(0, {tests!r})
    import torch
    import rope_dispatch as rd
    import autotune_fakes
    from reference import reference_for

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rope_dispatch.autotune").addHandler(handler)
    logging.getLogger("rope_dispatch.autotune").setLevel(logging.INFO)
    _, fakes = autotune_fakes.install(*([autotune_fakes.compiling()] if {compiling} else []))
    g = torch.Generator().manual_seed({seed})
    t = torch.randn({seq}, 2, 2, 16, generator=g).requires_grad_({grad})
    freqs = torch.rand({seq} + 3, 1, 1, 16, generator=g) * 20
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    out = rd.apply(t, freqs, spec)
    error = float((out.double() - reference_for(t.detach(), freqs, spec)).abs().max())
    print(json.dumps({{
        "why": rd.explain(t, freqs, spec).why,
        "calls": {{name: b.calls for name, b in fakes.items()}},
        "measured": sum(r.getMessage().startswith("measured ") for r in records),
        "error": error,
    }}))
    """
)


def run_second_process(
    root: Path, seq: int = 8, grad: bool = True, seed: int = 0, compiling: bool = False
) -> dict:
    env = {**os.environ, "ROPE_DISPATCH_CACHE_DIR": str(root)}
    env.pop("ROPE_AUTOTUNE", None)
    env.pop("ROPE_BACKEND", None)
    code = SECOND_PROCESS.format(tests=str(TESTS), seq=seq, grad=grad, seed=seed, compiling=compiling)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_environment_hash_covers_every_source_file_of_the_backends(tmp_path, monkeypatch):
    """Editing a backend's source invalidates its measurements (docs/autotune.md): the
    direct launcher's C source, whose host path planned launches are timed on, counts too."""
    from rope_dispatch import autotune_cache, backends

    for name, text in (("kernels.py", "x = 1\n"), ("direct_launch.c", "int f(void);\n"),
                       ("notes.txt", "not a source\n")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(backends, "__path__", [str(tmp_path)])
    autotune_cache._kernel_sources_sha.cache_clear()
    try:
        digests = [autotune_cache._kernel_sources_sha()]
        for name, text in (("notes.txt", "edited\n"), ("direct_launch.c", "int g(void);\n"),
                           ("kernels.py", "x = 2\n")):
            (tmp_path / name).write_text(text)
            autotune_cache._kernel_sources_sha.cache_clear()
            digests.append(autotune_cache._kernel_sources_sha())
    finally:
        autotune_cache._kernel_sources_sha.cache_clear()
    assert digests[1] == digests[0]  # not a source file
    assert len(set(digests[1:])) == 3  # the C source and the module each change it


def test_measured_once_then_read_from_disk_by_a_second_process(fakes, cache, measurements):
    t, freqs = inputs(requires_grad=True)
    before = t.detach().clone()
    out = rd.apply(t, freqs, SPEC)
    assert measurements() == 1
    assert torch.equal(t.detach(), before) and t.grad is None  # measuring left t alone
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_grad = reference_forward_backward(t, freqs, SPEC, grad_out)
    assert_matches(out, ref_out, torch.float32)
    assert_matches(t.grad, ref_grad, torch.float32, "grad")

    why = rd.explain(t, freqs, SPEC).why
    assert rd.explain(t, freqs, SPEC).chosen == "fast"  # priority alone would pick slow
    assert why.startswith("autotuned (forward+backward): fast ") and " vs slow " in why
    (entry,) = rd.cache_entries()
    assert entry["choice"] == "fast" and entry["measured"] == "forward+backward"
    assert entry["times_us"]["slow"] > entry["times_us"]["fast"]
    assert entry["times_us"]["slow"] >= autotune_fakes.SLOW_SECONDS * 1e6
    assert Path(entry["path"]).parent.parent == cache

    counted = calls(fakes)
    rd.apply(t, freqs, SPEC)
    assert measurements() == 1
    assert calls(fakes) == {"fast": counted["fast"] + 1, "slow": counted["slow"]}

    other = run_second_process(cache)
    assert other["measured"] == 0
    assert other["calls"] == {"fast": 1, "slow": 0}
    assert other["why"].startswith(f"cached measurement from {entry['path']}: fast ")
    assert other["error"] < 1e-5


def test_key_separates_grad_and_shape_buckets(fakes, measurements):
    t, freqs = inputs(seq=8)
    rd.apply(t, freqs, SPEC)
    t5, freqs5 = inputs(seq=5, seed=1)  # 5 and 8 share the power-of-two bucket 8
    out = rd.apply(t5, freqs5, SPEC)
    assert_matches(out, reference_for(t5, freqs5, SPEC), torch.float32)
    assert measurements() == 1
    rd.apply(*inputs(seq=9), SPEC)  # bucket 16
    rd.apply(*inputs(seq=8, requires_grad=True), SPEC)
    assert measurements() == 3
    with torch.no_grad():  # no backward to pay: the forward-only entry serves
        rd.apply(*inputs(seq=8, requires_grad=True), SPEC)
    assert measurements() == 3
    measured = sorted(e["measured"] for e in rd.cache_entries())
    assert measured == ["forward", "forward", "forward+backward"]
    t, freqs = inputs(seq=8)
    rd.apply(t, freqs[..., : freqs.shape[-1] // 2], SPEC)  # spec leaves rotary_dim to the table
    assert measurements() == 4


def test_a_varlen_loop_measures_once_whatever_its_longest_sequence(fakes, cache, measurements):
    """A thd loop passes each batch's longest sequence as ``max_seqlen``: the key holds it only
    as set, so steps of one bucket measure once, and the same call traced by torch.compile (which
    keys it so) runs the eager call's measured choice. The tune tool's ``--max-seqlen`` writes
    that key. Each step had measured again, and the compiled call had run the priority order."""
    freqs = torch.rand(64, 1, 1, 16)
    for first in (20, 25, 30, 17):  # 32 tokens in two sequences, the longest changing
        cu = torch.tensor([0, first, 32], dtype=torch.int32)
        spec = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu,
                           max_seqlen=max(first, 32 - first))
        t = torch.randn(32, 2, 16)
        assert_matches(rd.apply(t, freqs, spec), reference_for(t, freqs, spec), torch.float32)
    assert measurements() == 1 and len(rd.cache_entries()) == 1
    assert rd.cache_entries()[0]["fields"]["spec"]["max_seqlen"] == "set"
    torch._dynamo.reset()
    try:
        before = calls(fakes)
        out = torch.compile(lambda x: rd.apply(x, freqs, spec), backend="eager",
                            fullgraph=True)(t)
        assert calls(fakes)["slow"] == before["slow"] and calls(fakes)["fast"] > before["fast"]
        assert_matches(out, reference_for(t, freqs, spec), torch.float32)
    finally:
        torch._dynamo.reset()
    autotune.clear_cache()
    shape = ["--layout", "thd", "--dtype", "fp32", "--device", "cpu", "--shape", "32,2,16",
             "--cu-seqlens", "0,20,32"]
    assert tune.main([*shape, "--max-seqlen"]) == 0
    autotune.clear_cache(memory_only=True)
    assert rd.explain(t, freqs, spec).why.startswith("cached measurement from")
    no_max = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=spec.cu_seqlens)
    assert not rd.explain(t, freqs, no_max).why.startswith("cached measurement from")


CORRUPT = {  # name -> the bad file's bytes, made from the good entry
    "truncated": lambda entry: b'{"schema": 1, "key": "',
    "binary": lambda entry: b"\x00\xff garbage",
    "foreign-json": lambda entry: b"[1, 2, 3]",
    "json-null": lambda entry: b"null",
    "other-schema": lambda entry: b'{"schema": 999}',
    "failed-not-a-mapping": lambda entry: json.dumps({**entry, "failed": "boom"}).encode(),
    "time-past-float": lambda entry: json.dumps(
        {**entry, "times_us": {name: 10**400 for name in entry["times_us"]}}).encode(),
    "nested-past-the-parser": lambda entry: b"[" * 100_000,
    "spec-not-a-mapping": lambda entry: json.dumps(
        {**entry, "fields": {**entry["fields"], "spec": "sbhd"}}).encode(),
    "choice-not-a-candidate": lambda entry: json.dumps(
        {**entry, "choice": "other", "times_us": {**entry["times_us"], "other": 1.0}}).encode(),
    "deferred-not-a-candidate": lambda entry: json.dumps(
        {**entry, "deferred": ["other"]}).encode(),
    "candidates-not-names": lambda entry: json.dumps(
        {**entry, "fields": {**entry["fields"], "candidates": [["fast"], "slow"]}}).encode(),
}


@pytest.mark.parametrize("corrupt", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_cache_file_warns_once_and_is_rewritten(fakes, measurements, corrupt):
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    (path,) = entry_files(Path(os.environ["ROPE_DISPATCH_CACHE_DIR"]))
    path.write_bytes(corrupt(json.loads(path.read_text())))
    with pytest.warns(RuntimeWarning, match="ignoring cache file"):
        assert rd.cache_entries() == []  # listed entries skip it too
    autotune.clear_cache(memory_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rd.explain(t, freqs, SPEC).why.startswith("would measure on first call")
        out = rd.apply(t, freqs, SPEC)
    ours = [w for w in caught if "rope-dispatch autotune" in str(w.message)]
    assert len(ours) == 1 and str(path) in str(ours[0].message)
    assert ours[0].filename == __file__  # the user's line (rd.explain), not the library's
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert measurements() == 2
    rewritten = json.loads(path.read_text())
    assert rewritten["choice"] == "fast" and rewritten["key"] == path.stem
    autotune.clear_cache(memory_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rd.explain(t, freqs, SPEC).why.startswith("cached measurement")


def test_unwritable_cache_directory_keeps_choices_in_memory(fakes, tmp_path, monkeypatch, measurements):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", str(blocker / "cache"))
    t, freqs = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rd.apply(t, freqs, SPEC)
        rd.apply(*inputs(seq=16), SPEC)  # a second key: no second warning
        rd.apply(t, freqs, SPEC)
    ours = [w for w in caught if "rope-dispatch autotune" in str(w.message)]
    assert len(ours) == 1 and "cannot write the cache" in str(ours[0].message)
    assert ours[0].filename == __file__  # it names the user's call, not a line of the library
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert measurements() == 2
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    assert rd.cache_entries() == []


@pytest.mark.parametrize("around", ["  ", " \t"])
def test_spaces_around_the_cache_directory_are_ignored(fakes, tmp_path, monkeypatch, around):
    root = tmp_path / "shared"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", f"{around}{root}{around}")
    t, freqs = inputs()
    assert_matches(rd.apply(t, freqs, SPEC), reference_for(t, freqs, SPEC), torch.float32)
    assert autotune.cache_dir() == root
    assert len(entry_files(root)) == 1 and list(work.iterdir()) == []
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", around)  # blank: the default, not cwd/"  "
    assert autotune.cache_dir().is_absolute()


def test_clear_cache_spares_a_write_in_flight_and_the_writer_writes_on(fakes, cache, monkeypatch):
    """Another process's clear_cache during a write: a fresh temporary is left alone, and a
    write whose temporary went anyway is made again, not taken for an unwritable directory."""
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    (path,) = entry_files(Path(os.environ["ROPE_DISPATCH_CACHE_DIR"]))
    live = path.parent / ".tmp-live.json"
    live.write_text("{}")
    stale = path.parent / ".tmp-dead.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() - 3600,) * 2)
    assert rd.clear_cache() == 3  # the entry, the environment file, the dead temporary
    assert live.exists() and not stale.exists()
    real_replace = os.replace
    removed = []

    def replace_after_a_clear(src, dst):
        if not removed:  # the first write loses its temporary to a clear
            removed.append(src)
            os.unlink(src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_a_clear)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rd.apply(t, freqs, SPEC)
        rd.apply(*inputs(seq=16), SPEC)
    assert removed and len(rd.cache_entries()) == 2


def test_an_interrupted_write_leaves_no_temporary_and_the_next_run_writes(
        fakes, cache, monkeypatch):
    """Ctrl-C while an entry is written (the tune tool, a training script) left its
    temporary file behind in the cache directory."""
    real_fsync = os.fsync

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    t, freqs = inputs()
    with pytest.raises(KeyboardInterrupt):
        rd.apply(t, freqs, SPEC)
    assert not list(cache.glob("*/.tmp-*")) and entry_files(cache) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    autotune.clear_cache(memory_only=True)
    rd.apply(t, freqs, SPEC)
    assert len(entry_files(cache)) == 1


def test_unsearchable_cache_directory_keeps_choices_in_memory(fakes, cache, monkeypatch,
                                                              measurements):
    """A cache directory below one this user cannot search (another user's, mode 0700):
    torch's calls run and choose as without a cache, with warnings; listing and clearing find
    nothing. (Permissions do not bind root, so the OS's refusal is raised for them.)"""
    root = Path(os.environ["ROPE_DISPATCH_CACHE_DIR"])

    def refused(method):
        def check(path, *args, **kwargs):
            if Path(path).is_relative_to(root):
                raise PermissionError(13, "Permission denied", str(path))
            return method(path, *args, **kwargs)
        return check

    for name in ("exists", "is_dir", "read_text", "iterdir", "mkdir"):
        monkeypatch.setattr(Path, name, refused(getattr(Path, name)))
    t, freqs = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rd.apply(t, freqs, SPEC)
        rd.apply(t, freqs, SPEC)
    assert any("cannot write the cache" in str(w.message) for w in caught)
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert measurements() == 1  # once, then remembered in memory
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    assert rd.cache_entries() == []
    assert rd.clear_cache() == 0


CONCURRENT_WORKER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    import rope_dispatch as rd
    import autotune_fakes

    autotune_fakes.install()
    ready = os.path.join({barrier!r}, "ready-{rank}")
    open(ready, "w").close()
    deadline = time.time() + 60
    while len(os.listdir({barrier!r})) < {workers} and time.time() < deadline:
        time.sleep(0.01)
    spec = rd.RoPESpec(layout="sbhd", dtype="fp32")
    for seq in ({own_a}, {own_b}, 1):  # two keys of its own, one that every worker tunes
        rd.apply(torch.randn(seq, 2, 2, 16), torch.rand(seq, 1, 1, 16), spec)
    """
)


def test_concurrent_processes_lose_no_entries(fakes, cache, tmp_path):
    workers = 4
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "ROPE_DISPATCH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_WORKER.format(
                tests=str(TESTS), barrier=str(barrier), rank=rank, workers=workers,
                own_a=2 ** (2 * rank + 1), own_b=2 ** (2 * rank + 2),
            )],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(workers)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    entries = rd.cache_entries()
    assert len(entries) == 2 * workers + 1
    assert all(e["choice"] in ("fast", "slow") and e["key"] == Path(e["path"]).stem for e in entries)
    assert sorted(e["fields"]["shape_bucket"][0] for e in entries) == [1] + [2**k for k in range(1, 9)]
    assert not list(cache.glob("*/.tmp-*")), "a temporary file was left behind"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_child_forked_while_another_thread_measures_measures_too(fakes, measurements):
    """A process forked while another of its threads held the cache lock (measuring a key),
    as a DataLoader's workers or a server's may be: the child's first call of a new key runs,
    where it waited forever on a lock no thread of the child could release."""
    import threading

    from rope_dispatch import autotune_cache

    rd.apply(*inputs(), SPEC)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with autotune_cache.lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exits 3 if the call hangs, 0 if it runs
            import signal

            signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
            signal.alarm(20)
            try:
                rd.apply(*inputs(seq=64), SPEC)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0


def test_rope_autotune_0_measures_nothing_and_ignores_the_cache(fakes, cache, monkeypatch, measurements):
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)  # an entry choosing fast now exists
    assert measurements() == 1
    monkeypatch.setenv("ROPE_AUTOTUNE", "0")
    autotune.clear_cache(memory_only=True)
    before = calls(fakes)
    out = rd.apply(t, freqs, SPEC)
    rd.apply(*inputs(seq=32), SPEC)  # a new key: still nothing measured
    assert measurements() == 1
    assert calls(fakes) == {"fast": before["fast"], "slow": before["slow"] + 2}
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert rd.explain(t, freqs, SPEC).why.startswith("autotune off (ROPE_AUTOTUNE='0')")
    assert len(entry_files(cache)) == 1


@pytest.mark.parametrize("value", ["disabled", "O", "2", "nope"])
def test_a_rope_autotune_value_neither_on_nor_off_is_refused_by_name(
        fakes, cache, monkeypatch, measurements, capsys, value):
    """A misspelt off (``disabled``) measured and read the cache as if autotune were on: the
    priority order the user asked for silently did not decide. It is refused, naming the value,
    as ``ROPE_AUTOTUNE_HOT_CALLS`` is; the tool exits 2 with the reason."""
    monkeypatch.setenv("ROPE_AUTOTUNE", value)
    t, freqs = inputs()
    with pytest.raises(rd.RoPEError, match=f"ROPE_AUTOTUNE.*{value!r}"):
        rd.apply(t, freqs, SPEC)
    with pytest.raises(rd.RoPEError, match=f"ROPE_AUTOTUNE.*{value!r}"):
        rd.explain(t, freqs, SPEC)
    assert measurements() == 0 and entry_files(cache) == []
    assert tune.main(["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu",
                      "--shape", "8,2,2,16"]) == 2
    assert repr(value) in capsys.readouterr().err


@pytest.mark.parametrize("value", ["off", "No", " FALSE "])
def test_autotune_off_names_the_value_it_was_set_to(fakes, cache, monkeypatch, capsys, value):
    monkeypatch.setenv("ROPE_AUTOTUNE", value)
    t, freqs = inputs()
    assert rd.explain(t, freqs, SPEC).why.startswith(f"autotune off (ROPE_AUTOTUNE={value!r})")
    assert tune.main(["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu",
                      "--shape", "8,2,2,16"]) == 2
    assert f"ROPE_AUTOTUNE={value!r}" in capsys.readouterr().err
    monkeypatch.setenv("ROPE_AUTOTUNE", " On ")
    autotune.clear_cache(memory_only=True)
    assert rd.explain(t, freqs, SPEC).why.startswith("would measure on first call")


def test_forced_backend_ignores_the_cache(fakes, cache, monkeypatch, measurements):
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    before = calls(fakes)
    out = rd.apply(t, freqs, SPEC, backend="slow")
    with rd.use_backend("slow"):
        rd.apply(t, freqs, SPEC)
    monkeypatch.setenv("ROPE_BACKEND", "slow")
    rd.apply(t, freqs, SPEC)
    rd.apply(*inputs(seq=64), SPEC)  # forced on a key never measured: still no measuring
    assert calls(fakes) == {"fast": before["fast"], "slow": before["slow"] + 4}
    assert measurements() == 1
    assert len(entry_files(cache)) == 1
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)


def test_no_measuring_while_torch_compile_traces(fakes, cache, measurements):
    t, freqs = inputs()

    def step(x, f):
        return rd.apply(x, f, SPEC) * 2

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager")
        out = compiled(t, freqs)
        assert measurements() == 0 and entry_files(cache) == []
        assert calls(fakes)["fast"] == 0  # the provisional choice is the priority order
        assert_matches(out, 2 * reference_for(t, freqs, SPEC), torch.float32)

        rd.apply(t, freqs, SPEC)  # the provisional choice was not kept: this call measures
        assert measurements() == 1 and len(entry_files(cache)) == 1

        torch._dynamo.reset()
        autotune.clear_cache(memory_only=True)
        before = calls(fakes)
        # traced with the cached choice; reading it breaks no graph
        out = torch.compile(step, backend="eager", fullgraph=True)(t, freqs)
        assert measurements() == 1
        assert calls(fakes)["slow"] == before["slow"] and calls(fakes)["fast"] > before["fast"]
        assert_matches(out, 2 * reference_for(t, freqs, SPEC), torch.float32)
    finally:
        torch._dynamo.reset()


def test_calls_that_cannot_measure_read_the_cache_file_once(fakes, cache, measurements,
                                                             monkeypatch):
    """Under vmap no call measures or keeps a decision, so each call read its key's file again
    (disk I/O on every call); the file is read once, and a measurement made by a later plain
    call still reaches the transformed calls."""
    t, freqs = inputs()
    reads = []
    read = autotune.read_entry
    monkeypatch.setattr(autotune, "read_entry", lambda key: reads.append(key) or read(key))
    batched = torch.func.vmap(lambda x: rd.apply(x, freqs, SPEC))
    for _ in range(4):
        out = batched(t[None].expand(3, *t.shape))
    assert len(reads) == 1 and measurements() == 0 and entry_files(cache) == []
    assert_matches(out[1], reference_for(t, freqs, SPEC), torch.float32)
    rd.apply(t, freqs, SPEC)  # a plain call measures
    assert measurements() == 1
    before = calls(fakes)
    batched(t[None].expand(3, *t.shape))
    assert len(reads) == 2  # the plain call read it before measuring
    faster = calls(fakes)["fast"] > before["fast"] and calls(fakes)["slow"] == before["slow"]
    assert faster  # the measured choice, fast, serves the transformed call


def test_no_measuring_while_a_forward_mode_ad_level_is_open(fakes, cache, measurements):
    """With a forward-mode AD level open (``torch.autograd.forward_ad``) the kernels' backends
    run the eager math, so a measurement then timed that math and kept its winner, on disk,
    for every later call of the key. No call measures or keeps a decision there; the result
    still carries the rotated tangent, and a later plain call measures."""
    import torch.autograd.forward_ad as fwad

    t, freqs = inputs()
    tangent = torch.randn(t.shape, generator=torch.Generator().manual_seed(4))
    with fwad.dual_level():
        out = rd.apply(fwad.make_dual(t, tangent), freqs, SPEC)
        value, got = fwad.unpack_dual(out)
    assert measurements() == 0 and entry_files(cache) == []
    assert calls(fakes)["fast"] == 0  # the provisional choice is the priority order
    assert_matches(value, reference_for(t, freqs, SPEC), torch.float32)
    assert_matches(got, reference_for(tangent, freqs, SPEC), torch.float32)  # (linear in t)
    rd.apply(t, freqs, SPEC)  # the provisional choice was not kept: this call measures
    assert measurements() == 1 and len(entry_files(cache)) == 1


def test_a_backend_that_raises_is_skipped_with_one_warning(fakes, measurements):
    registry.register(autotune_fakes.FailingBackend("broken", 100, 0.0))
    t, freqs = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rd.apply(t, freqs, SPEC)
        rd.apply(*inputs(seq=16), SPEC)
    ours = [w for w in caught if "rope-dispatch autotune" in str(w.message)]
    assert len(ours) == 1 and "'broken'" in str(ours[0].message)
    assert ours[0].filename == __file__  # the user's call, not a line of the library
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    entries = rd.cache_entries()
    assert len(entries) == 2
    assert all("RuntimeError" in e["failed"]["broken"] for e in entries)
    assert measurements() == 2


def test_a_recompile_limit_met_while_measured_is_not_stored(fakes, measurements):
    """Dynamo's recompile limit is reached by the layouts this process compiled before, not by
    the key: a later process would compile the candidate, so nothing is written for it."""

    class FailOnRecompileLimitHit(RuntimeError):  # the name Dynamo's error goes by
        pass

    class LimitHit(autotune_fakes.FakeBackend):
        def apply(self, call):
            raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    registry.register(LimitHit("limited", 100, 0.0))
    t, freqs = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = rd.apply(t, freqs, SPEC)
    assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
    assert rd.cache_entries() == []  # kept in memory only
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    autotune.clear_cache(memory_only=True)  # as a later process would start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rd.apply(t, freqs, SPEC)
    assert measurements() == 2  # measured again


def test_clear_cache_removes_only_its_own_files(fakes, cache, measurements):
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    (path,) = entry_files(cache)
    keep = path.parent / "notes.txt"
    keep.write_text("not the cache's")
    foreign = cache / "other-tool" / "environment.json"
    foreign.parent.mkdir()
    foreign.write_text("{}")
    assert rd.clear_cache() == 2  # the entry and environment.json
    assert keep.exists() and foreign.exists() and rd.cache_entries() == []
    why = rd.explain(t, freqs, SPEC).why
    assert why.startswith("would measure on first call") and "runs the fastest" in why, why
    assert "priority order picks" not in why  # the call measures: priority does not decide
    rd.apply(t, freqs, SPEC)
    assert measurements() == 2
    for value in ("false", 0, None):  # "false" kept the files, 0 and None removed them
        named = f"memory_only must be True or False, got {value!r}"
        with pytest.raises(rd.RoPETypeError, match=named):
            rd.clear_cache(memory_only=value)
    assert len(entry_files(cache)) == 1 and rd.explain(t, freqs, SPEC).why.startswith("autotuned")


def test_tune_cli_warms_the_cache(fakes, cache, tmp_path, capsys, monkeypatch):
    shape = ["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu", "--shape", "8,2,2,16"]
    assert tune.main([*shape, "--grad"]) == 0
    first = capsys.readouterr()
    assert "sbhd fp32 8x2x2x16 cpu grad: fast (autotuned (forward+backward): fast " in first.out
    assert "[1/1] tuning" in first.err or "rope-dispatch tune" in first.err

    specs = tmp_path / "shapes.json"
    specs.write_text(json.dumps([
        {"layout": "sbhd", "dtype": "fp32", "shape": [8, 2, 2, 16], "device": "cpu", "grad": True},
        {"layout": "thd", "dtype": "fp32", "shape": [12, 2, 16], "device": "cpu",
         "cu_seqlens": [0, 5, 12]},
    ]))
    autotune.clear_cache(memory_only=True)  # as a later process would start
    assert tune.main(["--specs", str(specs)]) == 0
    out = capsys.readouterr().out
    assert "grad: fast (cached measurement from" in out
    assert "thd fp32 12x2x16 cpu: fast (autotuned (forward)" in out
    assert len(rd.cache_entries()) == 2

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    t = torch.randn(12, 2, 16)
    freqs = torch.rand(7, 1, 1, 16)
    thd = rd.RoPESpec(layout="thd", dtype="fp32", cu_seqlens=cu)
    autotune.clear_cache(memory_only=True)  # the key the CLI stored is the one apply looks up
    assert rd.explain(t, freqs, thd).why.startswith("cached measurement from")

    assert tune.main([*shape, "--qkv-slice"]) == 0
    qkv = torch.randn(8, 2, 6, 16)
    q = qkv[:, :, :2]  # the q heads of a fused projection: stride class unit-last
    autotune.clear_cache(memory_only=True)
    assert rd.explain(q, torch.rand(8, 1, 1, 16), SPEC).why.startswith("cached measurement from")

    monkeypatch.setenv("ROPE_AUTOTUNE", "0")
    assert tune.main(shape) == 2


@pytest.mark.parametrize("bar", [True, False], ids=["tqdm", "no-tqdm"])
def test_tune_cli_tunes_every_shape_after_its_reader_left(fakes, cache, monkeypatch, bar):
    """``python -m rope_dispatch.tune --specs shapes.json | head -1``: the reader gone, the
    second shape's line raised BrokenPipeError out of the loop, so no later shape was tuned
    (with tqdm, whose lines were not flushed, the flush at exit raised it). The lines go
    nowhere; every shape is tuned."""
    if not bar:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    read, write = os.pipe()
    os.close(read)
    out = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    shapes = ["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu"]
    for seq in (8, 16, 32):
        shapes += ["--shape", f"{seq},2,2,16"]
    try:
        assert tune.main(shapes) == 0
    finally:
        out.close()
    assert len(rd.cache_entries()) == 3
    autotune.clear_cache(memory_only=True)
    t, freqs = inputs(seq=32)
    assert rd.explain(t, freqs, SPEC).why.startswith("cached measurement")


def test_tune_cli_says_that_rope_backend_keeps_its_calls_off_the_cache(
        fakes, cache, capsys, monkeypatch):
    """Tuning with ROPE_BACKEND set (exported in the shell that also runs the job) stored
    choices that the job's calls, all forced, never read, and said nothing about it."""
    shape = ["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu", "--shape", "8,2,2,16"]
    monkeypatch.setenv("ROPE_BACKEND", "slow")
    assert tune.main(shape) == 0
    err = capsys.readouterr().err
    assert ("note: ROPE_BACKEND='slow' is set here; the calls it forces neither read nor "
            "write this cache") in err
    assert len(rd.cache_entries()) == 1  # tuned all the same
    monkeypatch.delenv("ROPE_BACKEND")
    assert tune.main(shape) == 0
    assert "ROPE_BACKEND" not in capsys.readouterr().err


def test_tune_cli_interrupted_says_what_it_kept(fakes, cache, capsys, monkeypatch):
    """Ctrl-C during a shape: exit 130 and one line naming the shape, where a traceback of
    whatever was running (Inductor's compile, a kernel) came out."""
    real = tune.tune_job

    def second_interrupted(job, retune=False):
        if job.shape[0] == 16:
            raise KeyboardInterrupt
        return real(job, retune)

    monkeypatch.setattr(tune, "tune_job", second_interrupted)
    code = tune.main(["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu",
                      "--shape", "8,2,2,16", "--shape", "16,2,2,16", "--shape", "32,2,2,16"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted while tuning shape 2 of 3 (sbhd fp32 16x2x2x16" in err
    assert "the shapes tuned before it are kept in the cache" in err
    assert len(entry_files(cache)) == 1


def test_tune_cli_interrupted_before_its_first_shape(fakes, cache, capsys, monkeypatch):
    """Ctrl-C before the first shape starts (its progress line): still exit 130 and one line,
    where the message named a shape not yet taken (a NameError)."""
    def interrupted(jobs):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(tune, "_progress", interrupted)
    code = tune.main(["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu",
                      "--shape", "8,2,2,16"])
    assert code == 130 and "interrupted before the first shape" in capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [
    (["--dtype", "fp64"], "--dtype"), (["--device", "bogus"], "--device"),
    (["--device", "meta"], "--device 'meta' cannot be used here: tuning times calls on cuda"),
    (["--rotary-dim", "0"], "--rotary-dim"), (["--cp-size", "0"], "--cp-size"),
    (["--cp-size", "2", "--cp-rank", "2"], "--cp-rank"), (["--shape=-4,2,2,8"], "--shape"),
    (["--shape=0,2,2,8"], "--shape"), (["--cu-seqlens", "0,8"], "--cu-seqlens"),
    (["--layout", "thd", "--shape", "8,2,8", "--cu-seqlens", "8"], "--cu-seqlens"),
    (["--shape", "8,2,8"], "--shape [8, 2, 8]: layout sbhd needs 4 sizes"),
    (["--shape", "8"], "--shape [8]: layout sbhd needs 4 sizes"),
    (["--rotary-dim", "16"], "rotary dim d2=16 (freqs' last dim) exceeds the head dim d=8"),
    (["--cp-size", "2", "--shape", "7,2,2,8"], "local sequence length must be even"),
    (["--layout", "thd", "--shape", "8,2,8", "--cu-seqlens", "0,4"], "cu_seqlens[-1]=4"),
    (["--layout", "thd", "--shape", "8,2,8", "--cu-seqlens", "0,6,4,8"], "non-decreasing"),
    (["--layout", "thd", "--shape", "8,2,8", "--cu-seqlens", "5,3"], "must start at 0"),
    (["--shape", f"{2**40},{2**40},2,8"], "--shape [1099511627776, 1099511627776, 2, 8] makes"),
    (["--shape", f"{10**20},1,2,8"], f"--shape [{10**20}, 1, 2, 8] makes no valid sbhd call"),
    *([(["--device", "cuda"], "--device 'cuda' cannot be used here")]
      if not torch.cuda.is_available() else []),
    (["--device", f"cuda:{torch.cuda.device_count() + 1}"], "--device 'cuda:"),
])
def test_tune_cli_refuses_bad_options_by_name(fakes, capsys, extra, named):
    """A bad option is a bad argument (exit 2, the option named), found before any shape is
    tuned, not a failed shape (exit 1): the call's own checks (shape against layout, head dim,
    cu_seqlens' values) run on the options too."""
    shape = [] if any(a.startswith("--shape") for a in extra) else ["--shape", "8,2,2,8"]
    with pytest.raises(SystemExit) as info:
        tune.main(["--layout", "sbhd", *extra, *shape])
    assert info.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("entry, named", [
    ({"cp_size": "2"}, "cp_size must be an integer"),
    ({"shape": [8, True, 2, 8]}, "shape must be a list of integers"),
    ({"grad": "false"}, "grad must be true or false"),
    ({"layout": 1}, "layout must be a string"),
    ({"cu_seqlens": [0, 8]}, "cu_seqlens is only for layout thd"),
    ({"shape": []}, "shape must not be empty"),
    ({"device": "meta"}, "device 'meta' cannot be used here: tuning times calls on cuda"),
    ({"layout": "thd", "shape": [8, 2, 8], "cu_seqlens": [8]}, "cu_seqlens [8]: give every"),
    ({"layout": "thd", "shape": [8, 2, 8], "cu_seqlens": []}, "cu_seqlens []: give every"),
    ({"shape": [8, 2]}, "shape [8, 2]: layout sbhd needs 4 sizes"),
    ({"layout": "thd", "shape": [8, 2, 8], "cu_seqlens": [0, 4]}, "cu_seqlens[-1]=4"),
    ({"rotary_dim": 16}, "exceeds the head dim d=8"),
])
def test_tune_specs_are_checked_by_key(fakes, tmp_path, capsys, entry, named):
    """A ``--specs`` entry of the wrong type or value is refused naming its key (exit 2)."""
    specs = tmp_path / "shapes.json"
    specs.write_text(json.dumps([{"layout": "sbhd", "dtype": "fp32", "shape": [8, 2, 2, 8],
                                  "device": "cpu", **entry}]))
    with pytest.raises(SystemExit) as info:
        tune.main(["--specs", str(specs)])
    assert info.value.code == 2 and named in capsys.readouterr().err


def test_tune_specs_file_of_no_shapes_is_refused(fakes, tmp_path, capsys):
    """A ``--specs`` file holding an empty list tunes nothing: a bad argument (exit 2), where
    the tool printed the cache's line and exited 0 as if it had warmed the cache."""
    specs = tmp_path / "shapes.json"
    specs.write_text("[]")
    with pytest.raises(SystemExit) as info:
        tune.main(["--specs", str(specs)])
    assert info.value.code == 2
    assert f"--specs {specs}: the list holds no shapes" in capsys.readouterr().err


def test_tune_cli_fails_where_the_cache_cannot_be_written(fakes, tmp_path, capsys, monkeypatch):
    """Warming the cache is the tool's job: a choice it could not store fails the shape."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ROPE_DISPATCH_CACHE_DIR", str(blocker / "cache"))
    autotune.clear_cache(memory_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = tune.main(["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu",
                          "--shape", "8,2,2,16"])
    assert code == 1 and "was not stored in the cache" in capsys.readouterr().out


@pytest.mark.parametrize("first", ["tool", "apply"])
def test_tune_cli_fails_where_an_earlier_entry_could_not_be_replaced(
        compiling, cache, capsys, monkeypatch, first):
    """A cache that can no longer be written (a shared one, read-only here) holding an earlier
    entry: a --retune's measurement, or the complete one for a first call's pending entry, was
    reported tuned (exit 0), as a file existed, though later processes read the old entry."""
    shape = ["--layout", "sbhd", "--dtype", "fp32", "--device", "cpu", "--shape", "8,2,2,16"]
    if first == "tool":
        assert tune.main(shape) == 0
    else:
        rd.apply(*inputs(), SPEC)  # pending: compiling not measured yet
    capsys.readouterr()
    autotune.clear_cache(memory_only=True)

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", refused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = tune.main([*shape, *(["--retune"] if first == "tool" else [])])
    out = capsys.readouterr().out
    assert code == 1 and "was not stored in the cache" in out and "earlier measurement" in out
    monkeypatch.setattr(os, "replace", real_replace)
    autotune.clear_cache(memory_only=True)
    assert tune.main([*shape, *shape[-2:]]) == 0  # a shape given twice is stored once


def test_real_compile_backend_is_timed_without_its_compile_time(cache, measurements):
    """rd.tune measures the compile backend (a first apply leaves it out), its compile kept out
    of its time."""
    compile_backend = registry.get_backend("compile")
    if not compile_backend.available:
        pytest.skip(f"compile backend unavailable: {'; '.join(compile_backend.availability)}")
    keep = {"compile", "eager"}
    removed = {b.name: registry.unregister(b.name) for b in registry.backends() if b.name not in keep}
    try:
        t, freqs = inputs(seq=4)
        name, why = rd.tune(t, freqs, SPEC)
        assert name in keep and why.startswith("autotuned (forward): ")
        (entry,) = rd.cache_entries()
        assert set(entry["times_us"]) == keep, entry["failed"]
        assert "deferred" not in entry
        # compiling takes seconds on CPU; a call on this tiny shape takes well under 50 ms
        assert entry["times_us"]["compile"] < 50_000
        assert measurements() == 1
        out = rd.apply(t, freqs, SPEC)
        assert_matches(out, reference_for(t, freqs, SPEC), torch.float32)
        assert measurements() == 1  # apply read what tune stored
        assert rd.explain(t, freqs, SPEC).chosen == name
    finally:
        for backend in removed.values():
            registry.register(backend)
        autotune.clear_cache(memory_only=True)


@pytest.fixture
def compiling(fakes):
    """A third fake, ``compiling``: the fastest and of the highest priority, but it declares
    that it compiles per spec, so a first call must leave it out."""
    backend = registry.register(autotune_fakes.compiling())
    fakes["compiling"] = backend
    return backend


@pytest.mark.parametrize("first_outside", [False, True])
def test_checkpointed_calls_measure_apart_and_hold_their_choice(
    compiling, fakes, monkeypatch, measurements, first_outside
):
    """Under ``torch.utils.checkpoint(use_reentrant=False)`` (Hugging Face's gradient
    checkpointing): a first call measures without its runs' saved tensors reaching the
    checkpoint's count, and a key whose compiling candidate is pending holds its choice there
    (measured at a hot call inside the region, the recomputation could choose otherwise than
    the forward did) for the rest of the process; every step's gradient is the reference's."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", "3")
    t, freqs = inputs(requires_grad=True)
    g = torch.randn(t.shape, generator=torch.Generator().manual_seed(5))
    want_out, want_grad = reference_forward_backward(t, freqs, SPEC, g)
    if first_outside:  # measured (compiling pending) before any checkpointed call
        rd.apply(t, freqs, SPEC).backward(g)
        t.grad = None
    for step in range(5):
        out = checkpoint(lambda x: rd.apply(x * 1.0, freqs, SPEC), t, use_reentrant=False)
        out.backward(g)
        assert_matches(out, want_out, torch.float32, f"step {step}")
        assert_matches(t.grad, want_grad, torch.float32, f"gradient, step {step}")
        t.grad = None
    assert compiling.calls == 0 and measurements() == 1
    why = rd.explain(t, freqs, SPEC).why
    assert why.startswith("held (met under saved-tensor hooks") and "pending (compiling" in why
    rd.apply(t, freqs, SPEC).backward(g)  # outside the region too: held, nothing measured
    assert compiling.calls == 0 and measurements() == 1


def test_a_first_call_measured_inside_a_selective_checkpoint_leaves_its_record_alone(
    fakes, measurements
):
    """A key's first call inside ``checkpoint(use_reentrant=False)`` with a selective policy
    saving every op (``create_selective_checkpoint_contexts``): the measured runs are not seen
    by the checkpoint's dispatch mode, which would record their ops as the region's and hand
    their outputs to the recomputation's ops of the same name (a later ``mul``'s saved input
    taken from a measured run: a wrong gradient). The gradients are the reference's."""
    import functools

    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    t, freqs = inputs(requires_grad=True)
    z = torch.randn(t.shape, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
    seen = []

    def save_all(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.MUST_SAVE

    def region(x, factor):
        return (rd.apply(x * factor, freqs, SPEC) * factor).square()

    out = checkpoint(region, t, z, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, save_all))
    grads = torch.autograd.grad(out.sum(), (t, z))
    assert measurements() == 1
    x64, z64 = (v.detach().double().requires_grad_(True) for v in (t, z))
    expected = (reference_for(x64 * z64, freqs, SPEC) * z64).square()
    wanted = torch.autograd.grad(expected.sum(), (x64, z64))
    assert_matches(out, expected, torch.float32, "forward")
    for name, got, want in zip(("x", "factor"), grads, wanted):
        assert_matches(got, want, torch.float32, f"{name}'s gradient")
    assert len(seen) < 100  # the region's own ops, not the measured rounds'


def test_a_first_call_leaves_out_backends_that_compile_until_the_key_is_hot(
    compiling, fakes, cache, monkeypatch, measurements
):
    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", "4")
    t, freqs = inputs()
    expected = reference_for(t, freqs, SPEC)
    assert_matches(rd.apply(t, freqs, SPEC), expected, torch.float32)
    assert compiling.calls == 0 and measurements() == 1
    explanation = rd.explain(t, freqs, SPEC)
    assert explanation.chosen == "fast"  # measured against slow; priority alone picks compiling
    assert explanation.why.startswith("pending (compiling not measured yet")
    assert "call 4" in explanation.why and " vs slow " in explanation.why
    (entry,) = rd.cache_entries()
    assert entry["deferred"] == ["compiling"] and set(entry["times_us"]) == {"fast", "slow"}

    other = run_second_process(cache, grad=False, compiling=True)  # reads the pending entry
    assert other["measured"] == 0 and other["calls"] == {"fast": 1, "slow": 0}
    assert other["why"].startswith("pending (") and "cached measurement from" in other["why"]

    for _ in range(2):  # calls 2 and 3: counted, nothing measured
        assert_matches(rd.apply(t, freqs, SPEC), expected, torch.float32)
    assert compiling.calls == 0 and measurements() == 1
    why = rd.explain(t, freqs, SPEC).why  # the next call measures: explain says so
    assert why.startswith("the next call is this key's call 4") and "pending (" in why, why
    assert compiling.calls == 0 and measurements() == 1
    assert_matches(rd.apply(t, freqs, SPEC), expected, torch.float32)  # call 4: hot
    assert compiling.calls > 0 and measurements() == 2
    (entry,) = rd.cache_entries()
    assert "deferred" not in entry and set(entry["times_us"]) == {"fast", "slow", "compiling"}
    explanation = rd.explain(t, freqs, SPEC)
    assert explanation.why.startswith("autotuned (forward): ")
    assert explanation.chosen == entry["choice"]
    counted = calls(fakes)
    rd.apply(t, freqs, SPEC)
    assert measurements() == 2 and sum(calls(fakes).values()) == sum(counted.values()) + 1


def test_a_hot_call_setting_of_1_measures_backends_that_compile_at_the_first_call(
    compiling, fakes, cache, monkeypatch, measurements
):
    """``ROPE_AUTOTUNE_HOT_CALLS=1``: a key's first call is its hot call, so backends that
    compile are measured there with the others (they waited for call 2)."""
    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", "1")
    t, freqs = inputs()
    assert_matches(rd.apply(t, freqs, SPEC), reference_for(t, freqs, SPEC), torch.float32)
    assert compiling.calls > 0 and measurements() == 1
    (entry,) = rd.cache_entries()
    assert "deferred" not in entry and set(entry["times_us"]) == {"fast", "slow", "compiling"}
    assert rd.explain(t, freqs, SPEC).why.startswith("autotuned (forward): ")


def test_a_key_only_backends_that_compile_can_serve_measures_nothing_at_first(
    compiling, fakes, monkeypatch, measurements
):
    """With one candidate that needs no compilation there is nothing to compare: it runs, and
    nothing is written until the key is hot."""
    registry.unregister("slow")
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    assert measurements() == 0 and compiling.calls == 0 and rd.cache_entries() == []
    why = rd.explain(t, freqs, SPEC).why
    assert why.startswith("pending (compiling") and "fast, the only candidate" in why


def test_memory_of_keys_stays_bounded_in_a_long_process(compiling, fakes, monkeypatch):
    """A process meeting ever new keys (a spec per step, shape buckets) keeps at most
    ``_MAX_KEYS`` of them in memory; a key met again after that still runs its choice."""
    registry.unregister("slow")  # one candidate that needs no compilation: nothing measured
    monkeypatch.setattr(autotune, "_MAX_KEYS", 4)
    t, freqs = inputs()
    for i in range(10):
        spec = rd.RoPESpec(layout="sbhd", dtype="fp32", cos_sin_scale=1.0 + i / 8)
        assert_matches(rd.apply(t, freqs, spec), reference_for(t, freqs, spec), torch.float32)
        assert len(autotune._memory) <= 4 and len(autotune._pending) <= 4
    assert compiling.calls == 0 and fakes["fast"].calls == 10
    assert rd.explain(t, freqs, spec).why.startswith("pending (compiling")


def test_a_retune_replaces_the_choice_calls_run(fakes, measurements):
    """``rd.tune(..., retune=True)`` measures again: the calls of its key run the new choice,
    as explain says, not the decision dispatch kept from the first measurement."""
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    rd.apply(t, freqs, SPEC)  # decided and planned
    assert rd.explain(t, freqs, SPEC).chosen == "fast"
    fakes["slow"].delay, fakes["fast"].delay = 0.0, autotune_fakes.SLOW_SECONDS
    assert rd.tune(t, freqs, SPEC, retune=True)[0] == "slow" and measurements() == 2
    before = calls(fakes)
    assert_matches(rd.apply(t, freqs, SPEC), reference_for(t, freqs, SPEC), torch.float32)
    assert calls(fakes) == {"fast": before["fast"], "slow": before["slow"] + 1}


def test_a_decision_made_while_another_thread_clears_the_cache_is_not_kept(
        fakes, monkeypatch, measurements):
    """clear_cache in another thread while a call is being decided (between autotune's choice
    and dispatch keeping it): the decision is not kept past the clearing, so the key's next call
    is decided again."""
    selected = []
    select = autotune.select

    def select_then_cleared(call, candidates):
        selected.append(call)
        chosen = select(call, candidates)
        if len(selected) == 1:
            rd.clear_cache(memory_only=True)  # what another thread may do at this point
        return chosen

    monkeypatch.setattr(autotune, "select", select_then_cleared)
    t, freqs = inputs()
    for _ in range(3):
        assert_matches(rd.apply(t, freqs, SPEC), reference_for(t, freqs, SPEC), torch.float32)
    assert len(selected) == 2 and measurements() == 1  # decided again: read from its file


def test_tune_measures_backends_that_compile(compiling, fakes, measurements):
    t, freqs = inputs(requires_grad=True)
    rd.apply(t, freqs, SPEC)
    assert compiling.calls == 0
    name, why = rd.tune(t, freqs, SPEC)  # the pending key, measured in full
    assert compiling.calls > 0 and measurements() == 2
    assert why.startswith("autotuned (forward+backward): ") and name == rd.explain(t, freqs, SPEC).chosen
    (entry,) = rd.cache_entries()
    assert "deferred" not in entry and "compiling" in entry["times_us"]
    assert rd.tune(t, freqs, SPEC)[0] == name and measurements() == 2  # read, not measured
    rd.tune(t, freqs, SPEC, retune=True)
    assert measurements() == 3
    t2, freqs2 = inputs(seq=32, seed=3)  # a new key: tune measures everything at once
    rd.tune(t2, freqs2, SPEC)
    assert measurements() == 4
    assert all("deferred" not in e for e in rd.cache_entries())
    for value in ("no", 0, None):  # "no" measured again, 0 and None stood for False
        with pytest.raises(rd.RoPETypeError, match=f"retune must be True or False, got {value!r}"):
            rd.tune(t, freqs, SPEC, retune=value)
    assert measurements() == 4


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5", "1_000", "+5", "\u0663", "2 0"])
def test_a_bad_hot_calls_setting_is_refused_by_name(compiling, monkeypatch, value):
    """Decimal digits only: Python's int() also took 1_000, +5 and other scripts' digits."""
    monkeypatch.setenv("ROPE_AUTOTUNE_HOT_CALLS", value)
    t, freqs = inputs()
    named = re.escape(repr(value))
    with pytest.raises(rd.RoPEError, match=f"ROPE_AUTOTUNE_HOT_CALLS.*positive integer.*{named}"):
        rd.apply(t, freqs, SPEC)


def test_measuring_stops_at_its_time_budget(monkeypatch):
    """Timed rounds stop once they took MEASURE_BUDGET_SECONDS: a slow call is timed in one
    round (its warm estimate counts as a sample), not nine."""
    t, freqs = inputs()
    call = rd.check_call(t, freqs, SPEC)
    slow = autotune_fakes.FakeBackend("slow", 50, 0.01)
    monkeypatch.setattr(autotune, "MEASURE_BUDGET_SECONDS", 0.0)
    times, failed = autotune._time_backends([slow], call, needs_grad=False)
    assert not failed and times["slow"] >= 0.01
    per_round = math.ceil(autotune._ROUND_SECONDS / 0.01)  # calls a round makes of it
    assert slow.calls == 3 + per_round  # first call, first backward, estimate, one round


FIRST_CALL = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import rope_dispatch as rd

    spec = rd.RoPESpec(layout="sbhd", dtype="bf16")
    device = "cpu"
    q = torch.randn(64, 2, 8, 64, dtype=torch.bfloat16, device=device)
    freqs = rd.tables.inverse_frequencies(64, 10000.0)
    freqs = rd.tables.angle_table(freqs, 64).to(device)
    began = time.perf_counter()
    out = rd.apply(q, freqs, spec)
    seconds = time.perf_counter() - began
    print(json.dumps({
        "seconds": seconds,
        "chosen": rd.explain(q, freqs, spec).chosen,
        "why": rd.explain(q, freqs, spec).why,
        "available": [b.name for b in rd.list_backends() if b.available],
        "dynamo": "torch._dynamo" in sys.modules,
    }))
    """
)


def test_a_first_call_of_a_new_key_compiles_nothing(tmp_path):
    """A fresh process's first call (every backend probed, the key measured) with a cold
    Inductor cache and an empty autotune cache takes under a second on a CPU: the compile
    backend is neither compiled nor measured, nor is Dynamo imported for its probe."""
    env = {
        **os.environ, "ROPE_DISPATCH_CACHE_DIR": str(tmp_path / "autotune"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    for name in ("ROPE_AUTOTUNE", "ROPE_BACKEND", "ROPE_AUTOTUNE_HOT_CALLS", "TRITON_INTERPRET"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not torch.cuda.is_available():  # a GPU machine's first call also imports TE to probe it,
        assert report["seconds"] < 1.0, report  # and TE imports Dynamo
        assert not report["dynamo"], report
    assert not (tmp_path / "inductor").exists() or not any((tmp_path / "inductor").iterdir())
    if "compile" in report["available"]:
        assert report["chosen"] != "compile"
        assert report["why"].startswith("pending (compile not measured yet"), report


def test_in_place_calls_have_their_own_key_and_rotate_t_once(fakes, measurements):
    for backend in fakes.values():
        backend.supports_in_place = True  # both fakes run the eager math, which has apply_
    rd.dispatch.clear_decisions()
    t, freqs = inputs()
    rd.apply(t, freqs, SPEC)
    expected = reference_for(t, freqs, SPEC)
    assert rd.apply_(t, freqs, SPEC) is t
    assert measurements() == 2  # in place is a key of its own
    assert_matches(t, expected, torch.float32)  # measuring used copies: t was rotated once
    (entry,) = [e for e in rd.cache_entries() if e["fields"].get("in_place")]
    assert entry["choice"] == "fast" and entry["measured"] == "forward"
    leaf, _ = inputs(requires_grad=True, seed=2)
    x = leaf * 1  # a non-leaf: apply_ with a gradient, timed on a clone per call
    expected = reference_for(x.detach(), freqs, SPEC)
    rd.apply_(x, freqs, SPEC)
    assert measurements() == 3
    assert_matches(x, expected, torch.float32)
    (grad,) = torch.autograd.grad(x.sum(), leaf)
    _, ref_grad = reference_forward_backward(leaf.detach(), freqs, SPEC, torch.ones_like(grad))
    assert_matches(grad, ref_grad, torch.float32, "grad")


def test_pairs_with_gradients_are_timed_with_both_backwards(monkeypatch):
    """A q and k call that needs gradients is measured forward and backward for q and k alike:
    a backend whose k output needs a gradient only when k does (eager) is timed, not skipped."""
    q = torch.randn(3, 2, 4, 8, requires_grad=True)
    k = torch.randn(3, 2, 1, 8, requires_grad=True)
    call = rd.check_call(q, torch.rand(3, 8), rd.RoPESpec(layout="sbhd", dtype="fp32"), k=k)
    eager = rd.get_backend("eager")
    seen = []
    real_apply = eager.apply
    monkeypatch.setattr(eager, "apply", lambda c: seen.append((c.t.requires_grad, c.k.requires_grad))
                        or real_apply(c))
    times, failed = autotune._time_backends([eager], call, needs_grad=True)
    assert not failed and times["eager"] > 0
    assert seen and all(flags == (True, True) for flags in seen)


@pytest.mark.parametrize("second_faster_by, chosen", [(0.03, "eager"), (0.10, "compile")])
def test_a_tie_within_the_margin_goes_to_priority(monkeypatch, cache, second_faster_by, chosen):
    """A lower-priority candidate must beat the first by more than the tie margin (5%): a
    measurement's noise alone never moves a call off the first backend."""
    t, freqs = inputs()
    call = rd.check_call(t, freqs, rd.RoPESpec(layout="sbhd", dtype="fp32"))
    candidates = [rd.get_backend("eager"), rd.get_backend("compile")]
    seconds = {"eager": 1e-4, "compile": 1e-4 / (1 + second_faster_by)}
    monkeypatch.setattr(autotune, "_time_backends", lambda *args: (seconds, {}))
    entry = autotune._measure(call, candidates, autotune._call_key(call, candidates))
    assert entry["choice"] == chosen
    assert entry["times_us"] == {name: round(s * 1e6, 3) for name, s in seconds.items()}


def test_large_calls_are_timed_one_candidate_at_a_time(monkeypatch):
    """At or above the in-turn limit a candidate is prepared only after the previous one was
    timed (one candidate's private copies alive at a time); below it all are prepared first."""
    t, freqs = inputs()
    call = rd.check_call(t, freqs, rd.RoPESpec(layout="sbhd", dtype="fp32"))
    candidates = [rd.get_backend("eager"), rd.get_backend("eager")]
    events = []
    real = autotune._prepared

    def prepared(backend, c, needs_grad):
        events.append("prepare")
        once, estimate = real(backend, c, needs_grad)
        return (lambda: events.append("call") or once()), estimate

    monkeypatch.setattr(autotune, "_prepared", prepared)
    autotune._time_backends(candidates, call, needs_grad=False)
    assert events[:2] == ["prepare", "prepare"]
    events.clear()
    monkeypatch.setattr(autotune, "_TURNS_BYTES", t.numel() * t.element_size())
    autotune._time_backends(candidates, call, needs_grad=False)
    second = events.index("prepare", 1)
    assert "call" in events[:second] and events.count("prepare") == 2


@pytest.mark.gpu
def test_checkpointed_training_steps_with_the_real_backends(cache, monkeypatch):
    """On a GPU, autotune on, the real candidates (triton, eager; compile pending): a
    Qwen3-style q and k norm with RoPE inside ``checkpoint(use_reentrant=False)``, first steps
    from an empty cache; each step's gradients (the weights' too) are the float64 reference's."""
    from torch.utils.checkpoint import checkpoint

    from reference import reference_head_norm

    monkeypatch.setenv("ROPE_AUTOTUNE", "1")
    gen = torch.Generator().manual_seed(3)
    spec = rd.RoPESpec(layout="bshd", dtype="fp32")
    freqs = (torch.rand(16, 1, 1, 32, generator=gen) * 10).cuda()
    q, k = (torch.randn(2, 16, h, 32, generator=gen).cuda().requires_grad_(True) for h in (4, 2))
    wq, wk = (torch.randn(32, generator=gen).cuda().requires_grad_(True) for _ in range(2))
    gq, gk = (torch.randn(x.shape, generator=gen).cuda() for x in (q, k))

    def region(q, k, wq, wk):
        return rd.apply_qk(q * 1.0, k * 1.0, freqs, spec, q_norm=rd.HeadNorm(wq),
                           k_norm=rd.HeadNorm(wk))

    leaves = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, wq, wk)]
    want = [reference_for(reference_head_norm(x, w, 1e-6, 0.0, "head"), freqs.cpu(), spec)
            for x, w in ((leaves[0], leaves[2]), (leaves[1], leaves[3]))]
    want_grads = torch.autograd.grad(want, leaves, (gq.cpu().double(), gk.cpu().double()))
    for step in range(4):
        outs = checkpoint(region, q, k, wq, wk, use_reentrant=False)
        grads = torch.autograd.grad(outs, (q, k, wq, wk), (gq, gk))
        for name, got, ref in zip(("dq", "dk", "dwq", "dwk"), grads, want_grads):
            assert torch.allclose(got.double().cpu(), ref, rtol=1e-4, atol=1e-4), (step, name)
