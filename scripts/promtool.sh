#!/usr/bin/env bash
# Run promtool (Prometheus' rule checker and rule unit-test runner) without installing Prometheus:
# `promtool` from PATH when there is one, else the binary from Debian's `prometheus` package, fetched
# once with apt-get download and unpacked into .cache/tools/ (gitignored; nothing is installed).
# Usage: bash scripts/promtool.sh test rules FILE.yml   (MOLT_PROMTOOL=/path/to/promtool overrides)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${MOLT_PROMTOOL:-}" ]; then exec "$MOLT_PROMTOOL" "$@"; fi
if command -v promtool >/dev/null 2>&1; then exec promtool "$@"; fi
dir="$root/.cache/tools/prometheus"
bin="$dir/promtool"
if [ ! -x "$bin" ]; then
  mkdir -p "$root/.cache"
  tmp=$(mktemp -d "$root/.cache/.promtool.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "[promtool.sh] fetching Debian package prometheus (once)" >&2
  if ! (cd "$tmp" && apt-get download prometheus >&2); then
    # A fresh machine may have no package lists yet; refreshing them needs root.
    [ "$(id -u)" = 0 ] && apt-get update -qq >&2 && (cd "$tmp" && apt-get download prometheus >&2)
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  mkdir -p "$dir"
  mv -f "$tmp/x/usr/bin/promtool" "$bin"  # atomic: concurrent first runs each install a whole binary
  rm -rf "$tmp"
  trap - EXIT
fi
exec "$bin" "$@"
