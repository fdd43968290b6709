"""Molt's own entry-point modules run here: a launch script's ``python3 -u -m molt.cli.train_rl_ray FLAGS`` and
``torchrun ... -m molt.cli.train_sft FLAGS`` need no edit (``molt train-rl`` / ``molt train-sft`` are the same
commands). The runs themselves: tests/e2e/test_train_rl_tiny.py and tests/integration/test_sft_train.py start
them by these names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molt.cli import main as molt_main
from tests.unit.test_train_rl_flags import quick_start_argv

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_molts_quick_start_command_line_writes_the_same_values_as_molt_train_rl(tmp_path, monkeypatch):
    flags = quick_start_argv("quick_start_rl_qwen3_4b.sh")
    theirs, ours = tmp_path / "theirs.yaml", tmp_path / "ours.yaml"
    molt = _run("-u", "-m", "molt.cli.train_rl_ray", "--emit", "helm-values", str(theirs), *flags)
    assert molt.returncode == 0, molt.stderr
    # `molt train-rl` in this process: its routing is what is compared here, and `python -m molt.cli
    # train-rl --emit` as a real process is test_molt_parity_cli's (it imports torch, a process apiece).
    monkeypatch.chdir(ROOT)  # where _run runs theirs
    assert molt_main(["train-rl", "--emit", "helm-values", str(ours), *flags]) == 0
    assert theirs.read_text() == ours.read_text()


def test_the_molt_module_names_answer_help_and_refuse_by_their_own_name(capsys):
    rl = _run("-m", "molt.cli.train_rl_ray", "--help")
    assert rl.returncode == 0 and rl.stdout.startswith("usage: python -m molt.cli.train_rl_ray ")
    sft = _run("-m", "molt.cli.train_sft", "--help")
    assert sft.returncode == 0 and sft.stdout.startswith("usage: python -m molt.cli.train_sft ")
    assert "--data.dataset" in sft.stdout
    bad = _run("-m", "molt.cli.train_rl_ray", "--emit", "yaml")
    assert bad.returncode == 2 and "python -m molt.cli.train_rl_ray: --emit takes 'helm-values FILE'" in bad.stderr
    # `molt train-sft` routes to SFT's parser under its own prog; run here, as the parser imports torch.
    with pytest.raises(SystemExit) as done:
        molt_main(["train-sft", "--help"])
    assert done.value.code in (0, None) and capsys.readouterr().out.startswith("usage: molt train-sft ")
