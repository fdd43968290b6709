#!/usr/bin/env bash
# The test suite, as CI runs it. Redis: tests use MOLT_TEST_REDIS_URL, else 127.0.0.1:6379 when it
# answers, else they start an embedded server themselves (tests/conftest.py).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${MOLT_VENV:-$root/.venv}/bin/python
export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
start=$(date +%s)
"$py" -m pytest -ra --durations=25 --timeout=900 "$@" tests
rc=$?
echo "[test] pytest exit $rc after $(( $(date +%s) - start ))s"
# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
exit $rc
