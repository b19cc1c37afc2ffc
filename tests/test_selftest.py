"""The selftest reports every backend and fails when a backend is wrong."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
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
    monkeypatch.setattr(rd, "list_backends", lambda: eager_only)
    report = selftest.run(["cpu"], lambda line, end="\n": None, thorough=True)
    assert len(report["checks"]) == len(selftest.GRID) and report["ok"]


def test_selftest_fails_on_a_wrong_backend(monkeypatch, capsys):
    monkeypatch.setitem(registry._REGISTRY, "wrong-sign", WrongSign())
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    assert selftest.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "wrong-sign" in out and "FAIL" in out


def test_selftest_checks_apply_in_place(monkeypatch, capsys):
    monkeypatch.setitem(registry._REGISTRY, "in-place-no-op", InPlaceNoOp())
    monkeypatch.setattr(selftest, "QUICK", selftest.QUICK[:2])
    assert selftest.main(["--device", "cpu"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("in-place-no-op")]
    assert lines and all("FAIL" in line for line in lines)
