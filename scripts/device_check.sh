#!/usr/bin/env bash
# The one script the GPU machine runs: install, GPU and CPU tests, selftest, benchmark.
#
#   source .device-carry/base/setup.sh is done here; run from the repository root:
#   TE=1 bash scripts/device_check.sh        # with TransformerEngine staged (see ../shared/device)
#
# Environment: OUT (results folder, default /tmp/rope-out), TE (non-empty: load TransformerEngine),
# TESTS (pytest targets, default tests), PYTEST_ARGS, BENCH_ARGS (extra benchmark arguments),
# SKIP_TESTS / SKIP_SELFTEST / SKIP_BENCH (non-empty: skip that part), TEST_WORKERS (pytest-xdist
# workers for the tests, default 8, 0 for one process), TEST_TIMEOUT /
# SELFTEST_TIMEOUT / BENCH_TIMEOUT (seconds; the defaults keep one call under the device's
# 10-minute limit).
# TE_TESTS: path of TransformerEngine's tests/pytorch/test_fused_rope.py (not in this repository;
# carried with the call): it runs unchanged, beside our tests, with its fused calls served by
# rope_dispatch.compat.te on the triton backend (scripts/te_parity.py); TE_WORKERS pytest-xdist
# workers (default 3: each gets 0.95/N of the GPU; with 5, beside our own tests, hundreds of the
# largest fused-QKV cases ran out of memory and the file did not finish in 9 minutes, while 3
# workers alone ran all of it in 128 s on an H200), TE_TIMEOUT seconds, TE_K a pytest -k
# expression. Run it without our tests beside it (SKIP_TESTS=1).
# FI_TESTS: a directory holding FlashInfer's tests/attention/test_rope.py and
# tests/test_helpers/rope_reference.py (with their __init__.py files; not in this repository):
# the file's tests of the functions rope_dispatch.compat.flashinfer serves run against our doors
# (scripts/flashinfer_parity.py; no FlashInfer needed), after our tests, with FI_WORKERS
# pytest-xdist workers (default 4), FI_TIMEOUT seconds and FI_K a pytest -k expression, or
# FI_IDS a file (its path from the repository root) of node ids, one a line, relative to
# FI_TESTS, to run instead of the whole file; a failure is one line of its log (thousands of
# long tracebacks made it too large to bring back), and flashinfer_parity.xml names every case
# that ran (so a cut run's remainder is known).
# The benchmark (python3 -m benchmarks.bench; benchmarks/ is not installed, so the repository
# root is the working directory) runs with --serving (decode q+k with GPU positions, prefill
# q+k) unless BENCH_ARGS says otherwise.
# SWEEP (non-empty): after the benchmark, the sweep (python3 -m benchmarks.sweep; about
# 7 minutes for its default points, so skip the tests and the benchmark beside it) into
# SWEEP_OUT (default OUT), with SWEEP_ARGS (e.g. --quick) and SWEEP_TIMEOUT seconds (default
# 540; the sweep writes its results after every point, so a cut run keeps what it measured).
# Ends with the benchmark's table (then the sweep's summary), so the last lines of the output
# are the figures.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rope-out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .device-carry/base/setup.sh ${TE:+--te}
# python3 -m pip: the pip on PATH may belong to another interpreter than python3
python3 -m pip install -q --no-deps --no-build-isolation --root-user-action=ignore -e . >"$OUT/pip.log" 2>&1 \
  || { echo "pip install -e . failed:"; tail -20 "$OUT/pip.log"; }
python3 -c "import rope_dispatch.backends" || { echo "rope_dispatch is not importable; see pip.log"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; from rope_dispatch import guards; print('torch', torch.__version__, 'triton', triton.__version__, 'plan guards', guards.guard_kind())" | tee -a "$OUT/device.txt"

status=0
te_pid=
if [[ -n "${TE_TESTS:-}" ]]; then
  (
    ROPE_BACKEND=triton PYTHONPATH="scripts${PYTHONPATH:+:$PYTHONPATH}" timeout "${TE_TIMEOUT:-420}" \
      python3 -m pytest -p te_parity -p no:cacheprovider -q -n "${TE_WORKERS:-3}" \
      ${TE_K:+-k "$TE_K"} "$TE_TESTS" >"$OUT/te_parity.log" 2>&1
    echo "TE test file exit code $?" >>"$OUT/te_parity.log"
  ) &
  te_pid=$!
fi
if [[ -z "${SKIP_TESTS:-}" ]]; then
  # pytest-xdist workers (TEST_WORKERS, default 8; 0: one process): torch.compile's tests take
  # 50-80 s each, and one process did not finish the suite in 270 s (8 workers: 214 s in run Q,
  # about 280 s in run R on a slower host, 346 s in run AW3; run AY1, without the compile
  # backend's tests, stood at 94% after 265 s on a slow host)
  workers=${TEST_WORKERS:-8}
  python3 -c "import xdist" 2>/dev/null || workers=0
  # SIGINT at the time limit: pytest stops as on Ctrl-C and still lists what failed so far (-rfE);
  # killed outright it prints no summary, and which tests failed is lost. pytest.xml names every
  # test that ran, so a cut run's remainder is known (its node ids against a --collect-only list)
  timeout -s INT -k 30 ${TEST_TIMEOUT:-420} python3 -m pytest ${TESTS:-tests} -q -rfE \
    -m "gpu or not slow" -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
    $([[ "$workers" != 0 ]] && echo "-n $workers") ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
  status=$?
  grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/pytest.log" | tail -30
  echo "pytest exit code $status (log: pytest.log)"
fi

if [[ -n "$te_pid" ]]; then
  wait "$te_pid"
  echo "--- TransformerEngine's test_fused_rope.py through rope_dispatch.compat.te (te_parity.log)"
  grep -E "^te_parity:|^(FAILED|ERROR)|passed|failed|exit code" "$OUT/te_parity.log" | tail -15
fi

if [[ -n "${FI_TESTS:-}" ]]; then
  root=$PWD
  fi_cases=(tests/attention/test_rope.py)
  [[ -n "${FI_IDS:-}" ]] && mapfile -t fi_cases <"$FI_IDS"
  (cd "$FI_TESTS" && ROPE_BACKEND=triton PYTHONPATH=".:$root/scripts${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -s INT -k 30 "${FI_TIMEOUT:-420}" python3 -m pytest -p flashinfer_parity --noconftest \
    -p no:cacheprovider -q -rfE --tb=line -n "${FI_WORKERS:-4}" ${FI_K:+-k "$FI_K"} \
    --junitxml="$OUT/flashinfer_parity.xml" \
    "${fi_cases[@]}" \
    >"$OUT/flashinfer_parity.log" 2>&1
  echo "FlashInfer test file exit code $?" >>"$OUT/flashinfer_parity.log")
  echo "--- FlashInfer's test_rope.py through rope_dispatch.compat.flashinfer (flashinfer_parity.log)"
  grep -E "^flashinfer_parity:|^(FAILED|ERROR)|passed|failed|exit code" "$OUT/flashinfer_parity.log" | tail -15
fi

if [[ -z "${SKIP_SELFTEST:-}" ]] && python3 -c "import rope_dispatch.selftest" 2>/dev/null; then
  started=$SECONDS
  timeout ${SELFTEST_TIMEOUT:-90} python3 -m rope_dispatch.selftest >"$OUT/selftest.log" 2>&1
  echo "selftest exit code $? in $((SECONDS - started)) s (log: selftest.log)"
  tail -5 "$OUT/selftest.log"
fi

if [[ -z "${SKIP_BENCH:-}" ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.bench --out "$OUT" ${BENCH_ARGS:---serving} 2>&1 | tee "$OUT/bench.log" | grep -v "^shape " | tail -60
fi

if [[ -n "${SWEEP:-}" ]]; then
  SWEEP_OUT=${SWEEP_OUT:-$OUT}
  mkdir -p "$SWEEP_OUT"
  started=$SECONDS
  timeout ${SWEEP_TIMEOUT:-540} python3 -m benchmarks.sweep --out "$SWEEP_OUT" ${SWEEP_ARGS:-} >"$SWEEP_OUT/sweep.log" 2>&1
  echo "sweep exit code $? in $((SECONDS - started)) s (log: sweep.log; table: sweep.md)"
  grep -E "^[0-9]+ points in|^matplotlib|Error" "$SWEEP_OUT/sweep.log" | tail -5
fi
exit $status
