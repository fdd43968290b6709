"""requirements/gpu.lock is what GPU installs use, and it still resolves.

The lock is re-resolved for linux x86_64 + CUDA (scripts/lock-gpu.sh: uv pip compile from the registry's
metadata, nothing installed) into a temporary file: any difference from the committed lock (pyproject or
the overrides changed without re-locking) or a resolver conflict fails. Needs the package registry; skipped
with the reason when it cannot be reached. Also: bootstrap's GPU branch and both GPU images install from the
lock on CUDA base images pinned by version and digest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "gpu.lock"
OFFLINE = re.compile(
    r"(dns error|failed to lookup|Connection refused|timed out|Network is unreachable|"
    r"error sending request|tcp connect error|failed to connect)",
    re.IGNORECASE,
)


def _uv() -> str:
    uv = shutil.which("uv") or str(ROOT / ".venv" / "bin" / "uv")
    if not Path(uv).exists():
        pytest.fail("uv is missing: it is in the dev extra (pip install -e '.[dev]')")
    return uv


def _pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", text, re.MULTILINE))


def _run(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=170, check=False, env={**os.environ, "UV": _uv()}
    )
    if out.returncode and OFFLINE.search(out.stderr):
        pytest.skip(f"package registry unreachable, lock not re-resolved: {out.stderr.strip()[-300:]}")
    return out


def test_gpu_lock_re_resolves_without_drift(tmp_path):
    fresh = tmp_path / "gpu.lock"
    shutil.copy(LOCK, fresh)  # the committed pins are the resolver's preferences, as when re-locking
    out = _run(["bash", "scripts/lock-gpu.sh", "-o", str(fresh)])
    assert out.returncode == 0, f"the GPU lock no longer resolves:\n{out.stderr[-3000:]}"
    want, got = _pins(LOCK.read_text()), _pins(fresh.read_text())
    drift = {k: (want.get(k), got.get(k)) for k in want.keys() | got.keys() if want.get(k) != got.get(k)}
    assert not drift, f"requirements/gpu.lock is stale (committed, resolved): {drift}; run bash scripts/lock-gpu.sh"
    assert fresh.read_text() == LOCK.read_text()
    for name, version in {
        "vllm": "0.32.0",
        "torch": "2.13.0",
        "nemo-automodel": "0.7.0",
        "transformers": "5.18.0",
        "quack-kernels": "0.6.5",
    }.items():
        assert want[name] == version, name


def test_the_override_is_what_makes_vllm_and_nemo_automodel_fit(tmp_path):
    """Without requirements/gpu-overrides.txt the two quack-kernels pins conflict: the resolver says so."""
    out = _run(
        [
            _uv(),
            "pip",
            "compile",
            "pyproject.toml",
            "--extra",
            "gpu",
            "--python-version",
            "3.11",
            "--python-platform",
            "x86_64-manylinux_2_28",
            "--no-header",
            "-o",
            str(tmp_path / "x.lock"),
        ]
    )
    assert out.returncode != 0 and "quack-kernels" in out.stderr, out.stderr[-2000:]


def test_bootstrap_and_gpu_images_install_from_the_lock_on_pinned_cuda_images():
    boot = (ROOT / "scripts" / "bootstrap.sh").read_text()
    gpu_branch = boot[
        boot.index('if [ "$flavour" = cpu ]') : boot.index("fi\n", boot.index('if [ "$flavour" = cpu ]'))
    ]
    assert "requirements/gpu.lock" in gpu_branch and ".[gpu" not in gpu_branch
    assert "requirements/*.lock" in boot or "gpu.lock" in boot.split("want=")[1].split("\n")[0]  # re-runs on change
    for name in ("rollout.Dockerfile", "trainer.Dockerfile"):
        text = (ROOT / "deploy" / "docker" / name).read_text()
        froms = re.findall(r"^(?:ARG \w+=|FROM )(\S*(?:cuda|uv)\S*)", text, re.MULTILINE)
        cuda = [f for f in froms if "nvidia/cuda:" in f]
        assert cuda and all(re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-\S+@sha256:[0-9a-f]{64}", f) for f in cuda), froms
        assert re.search(r"cuda:13\.0", cuda[0])  # the CUDA major of the locked torch wheels (cu13)
        assert "requirements/gpu.lock" in text and re.search(r"pip install[^\n]*-r requirements/gpu\.lock", text)
        assert "--no-deps" in text  # the project itself adds nothing beyond the lock
        assert not re.search(r"pip install[^\n]*(vllm|nemo-automodel)[=\"]", text), name  # no unpinned side installs
        ignore = (ROOT / "deploy" / "docker" / f"{name}.dockerignore").read_text().split()
        assert "!requirements/gpu.lock" in ignore, f"{name}: the build context must carry the lock"
