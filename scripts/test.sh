#!/usr/bin/env bash
# The test suite, as CI runs it: lint and format checks, then pytest with the type check beside it. Each
# check that fails fails the run, but pytest still runs so one CI pass reports everything. Redis: tests use
# MOLT_TEST_REDIS_URL, else 127.0.0.1:6379 when it answers, else they start an embedded server themselves
# (tests/conftest.py).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${MOLT_VENV:-$root/.venv}/bin/python
export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# Byte-code may be cached in this checkout even where the machine asks for none (as CI machines do): else
# every pytest process re-rewrites the asserts of every test module, and every service a test starts
# recompiles the project's modules.
unset PYTHONDONTWRITEBYTECODE
lint_paths=(molt services tests bench deploy examples)
failed=()
check() {  # check NAME FIX-HINT CMD...: run CMD, remember NAME if it fails
  local name=$1 hint=$2
  shift 2
  echo "[test] $name: $*"
  if ! "$@"; then
    echo "[test] FAILED: $name ($hint)" >&2
    failed+=("$name")
  fi
}
check "ruff check" "fix the findings above; many fix themselves with: ruff check --fix" \
  "$py" -m ruff check "${lint_paths[@]}"
check "ruff format" "reformat with: ruff format ${lint_paths[*]}" \
  "$py" -m ruff format --check "${lint_paths[@]}"
# Settings in pyproject.toml ([tool.mypy]); the gRPC stubs it reads come from python -m molt.proto_build.
# It runs beside pytest's first part (a cold run takes minutes of one core); its verdict is read after.
mypy_log=$(mktemp)
"$py" -m mypy molt services >"$mypy_log" 2>&1 &
mypy_pid=$!
# Three pytest workers on CI's two cores, each taking whole modules so module-scoped pods start once: many
# tests wait on a child process (a pod starting, an outage timed out), and a third worker fills that idle
# core time. Modules are handed out in collection order (e2e, integration, unit): xdist's default, most
# tests first, would leave the few-test modules that start whole stacks for last, one worker running each
# while the others idle. Then the tests marked `serial` alone, because they judge timing (slow clients, a
# soak's fault schedule) that other workers' load would skew; only the files that hold them are collected.
# MOLT_TEST_WORKERS=0 runs everything in one process.
workers=${MOLT_TEST_WORKERS:-3}
start=$(date +%s)
if [ "$workers" = 0 ]; then
  "$py" -m pytest -ra --durations=25 --timeout=900 "$@" tests
  rc=$?
else
  "$py" -m pytest -ra --durations=25 --timeout=900 -n "$workers" --dist loadfile --no-loadscope-reorder \
    -m "not serial" "$@" tests
  rc=$?
  echo "[test] parallel part: pytest exit $rc after $(( $(date +%s) - start ))s"
  mapfile -t serial_files < <(grep -rlE --include='test_*.py' 'mark\.serial\b' tests)
  "$py" -m pytest -ra --durations=10 --timeout=900 -m serial "$@" "${serial_files[@]}"
  rc_serial=$?
  # 5: no serial test among those selected, which is fine when a subset was asked for.
  [ "$rc" -eq 0 ] && [ "$rc_serial" -ne 5 ] && rc=$rc_serial
fi
echo "[test] pytest exit $rc after $(( $(date +%s) - start ))s"
echo "[test] mypy: $py -m mypy molt services"
wait "$mypy_pid"
mypy_rc=$?
cat "$mypy_log"
rm -f "$mypy_log"
if [ "$mypy_rc" -ne 0 ]; then
  echo "[test] FAILED: mypy (fix the type errors above)" >&2
  failed+=("mypy")
fi
# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
if [ ${#failed[@]} -gt 0 ]; then
  echo "[test] FAILED checks: ${failed[*]} (pytest exit $rc)" >&2
  [ "$rc" -eq 0 ] && rc=1
fi
exit $rc
