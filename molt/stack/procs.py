"""Local process supervision for `molt up`: start services, wait for /readyz, stop them all cleanly.

Each service runs as its own process group with its log in the run folder. Shutdown goes in reverse
start order: SIGTERM (services drain and flush), then SIGKILL after a grace period. Only processes this
supervisor started are ever signalled, by pid. A reaper process (``molt.stack.reaper``) does the same shutdown
if the supervising process dies without running its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from molt.serve import wait_ready


class ServiceFailed(RuntimeError):
    """A managed service exited or never became ready; the message points at its log."""


@dataclass
class ManagedProcess:
    name: str
    cmd: list[str]
    log_path: Path
    ready_url: str | None = None
    """The service's base URL: ready once its /readyz answers 200 (``molt.serve.wait_ready``)."""
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_offset: int = 0
    """Where this start's output begins in the log (a restart appends to the same file)."""
    stop_grace_s: float = 15.0
    """How long the reaper waits after SIGTERM before SIGKILL (``Supervisor.stop_all`` takes its own)."""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.log_offset = log.tell()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (None while it runs, or before it started)."""
        return self.proc.poll() if self.proc is not None else None

    def output(self) -> str:
        """What this start wrote to its log so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def lost_port_race(self) -> bool:
        """It exited because a port it was given was taken first: the pick-then-bind race of free ports
        (``molt.net.free_port``), the preflight's "already in use", gRPC's "could not bind" or the OS's own."""
        if self.alive():
            return False
        out = self.output()
        return any(s in out for s in ("already in use", "could not bind"))

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() not in (None, 0):
            raise ServiceFailed(
                f"{self.name} exited with code {self.proc.returncode}; log {self.log_path}:\n{self.tail()}"
            )

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready_url:
            return
        try:
            wait_ready(self.ready_url, timeout_s, self.alive, self.name)
        except RuntimeError:
            self.check()
            raise ServiceFailed(
                f"{self.name} exited before it was ready; log {self.log_path}:\n{self.tail()}"
            ) from None
        except TimeoutError:
            raise ServiceFailed(
                f"{self.name} not ready at {self.ready_url} after {timeout_s:.0f}s; log {self.log_path}"
            ) from None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            try:
                os.killpg(self.proc.pid, sig)  # the group we created with start_new_session
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL what is left of its process group once it has exited (children it started)."""
        if self.proc is not None and not self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode


class Supervisor:
    """Owns the stack's processes; stop_all() is idempotent and safe from signal handlers' aftermath."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []
        self._reaper: subprocess.Popen | None = None

    def start(self, proc: ManagedProcess) -> None:
        """Start ``proc`` as one of the stack's, and have the reaper stop it should this process die first."""
        self.procs.append(proc)
        self.restart(proc)

    def restart(self, proc: ManagedProcess) -> None:
        """Start one of the stack's processes (again, after it exited)."""
        proc.start()
        assert proc.proc is not None
        try:
            reaper = self._reaper or self._start_reaper()
            assert reaper.stdin is not None
            reaper.stdin.write(f"{proc.proc.pid} {proc.stop_grace_s}\n")
            reaper.stdin.flush()
        except OSError:  # the reaper is gone: our own shutdown still stops it
            pass

    def _start_reaper(self) -> subprocess.Popen:
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "molt.stack.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).resolve().parents[2],  # where `molt` imports from, whatever the caller's cwd
            start_new_session=True,  # Ctrl-C and a closed terminal reach the supervisor, not its reaper
        )
        return self._reaper

    def stop_all(self, grace_s: float = 15.0) -> dict[str, int | None]:
        codes = {}
        for p in reversed(self.procs):
            codes[p.name] = p.stop(grace_s)
        if self._reaper is not None:  # nothing left for it: end of its input ends it
            if self._reaper.stdin is not None:
                self._reaper.stdin.close()
            self._reaper.wait()
            self._reaper = None
        return codes
