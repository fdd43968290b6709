"""A `molt up` killed by SIGKILL (or the OOM killer) cannot stop its services, which run in their own sessions:
its reaper does, with the shutdown `molt up` would have run. Real processes, killed by pid: a supervisor in a
child process starts redis-server and two Python services, then is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SERVICE = """
import signal, sys, time
def on_term(*_):
    if sys.argv[2] == "saves":
        time.sleep(0.5)  # a trainer finishing its step
        open(sys.argv[1], "w").write("saved")
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(1)
"""

SUPERVISOR = """
import json, sys, time
from pathlib import Path
from molt.bus.embedded import find_redis_server
from molt.net import free_port
from molt.stack.procs import ManagedProcess, Supervisor

tmp = Path(sys.argv[1])
sup = Supervisor()
redis = ManagedProcess("redis", [find_redis_server(), "--port", str(free_port()), "--save", ""], tmp / "redis.log")
stubborn = ManagedProcess(
    "stubborn", [sys.executable, "-c", sys.argv[2], str(tmp / "x"), "ignores"], tmp / "stubborn.log",
    stop_grace_s=1.0,
)
trainer = ManagedProcess(
    "trainer", [sys.executable, "-c", sys.argv[2], str(tmp / "saved"), "saves"], tmp / "trainer.log",
    stop_grace_s=30.0,
)
for p in (redis, stubborn, trainer):
    sup.start(p)
while not all("up" in p.output() or "Ready" in p.output() for p in (redis, stubborn, trainer)):
    time.sleep(0.05)
print(json.dumps([p.proc.pid for p in sup.procs]), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by init
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_killed_supervisor_leaves_no_service_running_and_the_trainer_still_saves(tmp_path):
    sup = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SUPERVISOR), str(tmp_path), textwrap.dedent(SERVICE)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert sup.stdout is not None
        pids = json.loads(sup.stdout.readline())
        assert len(pids) == 3 and not any(_gone(p) for p in pids)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
        deadline = time.monotonic() + 20
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
        assert (tmp_path / "saved").read_text() == "saved"  # SIGTERM first, then its grace
    finally:
        for pid in pids:  # what the reaper failed to stop: by pid, as started here
            if not _gone(pid):
                os.killpg(pid, signal.SIGKILL)


def test_a_supervisor_that_stops_its_services_ends_its_reaper(tmp_path):
    from molt.stack.procs import ManagedProcess, Supervisor

    sup = Supervisor()
    svc = ManagedProcess("svc", [sys.executable, "-c", textwrap.dedent(SERVICE), "-", "ignores"], tmp_path / "s.log")
    sup.start(svc)
    reaper = sup._reaper
    assert reaper is not None and reaper.poll() is None
    while "up" not in svc.output():
        time.sleep(0.05)
    assert sup.stop_all(grace_s=1) == {"svc": -signal.SIGKILL}
    assert reaper.poll() == 0 and sup._reaper is None


def test_a_closed_terminal_stops_the_run_as_ctrl_c_does_unless_started_with_nohup():
    from molt.stack import watch

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        watch.stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        old = watch.stop_on_signals()
        assert old[signal.SIGHUP] == signal.SIG_DFL
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
