"""The operators' push CLI (``python -m services.trainer.push``): exit 2 with one error line and no JSON report when
a pod cannot be reached, exit 1 with the report when a pod failed the push, and the ``--check``, ``--frozen NAME
...`` and ``--bucket_bytes N`` flags of its usage line (docs/weightsync.md, "Operators: push a checkpoint to a
running fleet").

The unreachable pod is a closed loopback port; the failed push is a stand-in pusher (no pod is started here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from molt.config import parse_settings
from molt.net import free_port
from molt.weightsync.pusher import PushReport, WeightPushError
from services.trainer import push
from services.trainer.push import PushSettings


def test_an_unreachable_pod_exits_2_with_one_error_line_and_no_report(tiny_qwen3):
    # Nothing listens on the port: the CLI must stop before pushing anything, and a script reading stdout as
    # JSON must find nothing there rather than a half report.
    target = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "services.trainer.push", "--model", str(tiny_qwen3), "--pods", target],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("python -m services.trainer.push: error: ") and target in line


class _FailingPusher:
    """Reachable pods at version 4; the push fails on one of them."""

    def __init__(self, pods, **kwargs) -> None:
        self.pods = pods
        self.kwargs = kwargs

    def status(self):
        return {p: type("S", (), {"version": 4})() for p in self.pods}

    def push(self, tensors, version, force=False, check=None):
        report = PushReport(version, "grpc", pods={self.pods[0]: {"ok": True}}, failed={self.pods[1]: "checksum"})
        raise WeightPushError(report)

    def close(self) -> None:
        pass


def test_a_pod_that_failed_the_push_exits_1_with_the_json_report(tiny_qwen3, monkeypatch, capsys):
    # Unlike an unreachable pod, a failed push happened: the report (which pod failed and why) is what the
    # operator needs, so it is printed, and the status says not every pod committed.
    import molt.weightsync.pusher as pusher_module

    monkeypatch.setattr(pusher_module, "WeightPusher", _FailingPusher)
    code = push.main(["--model", str(tiny_qwen3), "--pods", "a:1,b:2"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["version"] == 5 and report["failed"] == {"b:2": "checksum"}


def test_check_frozen_and_bucket_bytes_parse():
    # The usage line's optional flags: --frozen takes several names, --bucket_bytes a byte count.
    s = parse_settings(
        PushSettings,
        [
            "--model",
            "m",
            "--pods",
            "p:1",
            "--check",
            "--frozen",
            "mlp.gate.weight",
            "mlp.router",
            "--bucket_bytes",
            "4096",
        ],
        prog=push.PROG,
    )
    assert s.check is True and s.frozen == ["mlp.gate.weight", "mlp.router"] and s.bucket_bytes == 4096


def test_help_lists_the_documented_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        push.main(["--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--check", "--frozen", "--bucket_bytes", "--version", "--transport"):
        assert flag in out, flag
