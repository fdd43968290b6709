"""Stops what `molt up` started when `molt up` itself dies without stopping it (SIGKILL, the OOM killer, a crash).

Services run in their own sessions so that Ctrl-C reaches only `molt up`, which then stops them in order; a
`molt up` that cannot run its own shutdown would leave them running for good. This process (own session too)
reads ``PID GRACE_S`` lines from its stdin, one per started service. Its stdin is a pipe whose only writer is
`molt up`, so end of file means `molt up` has exited, whichever way. It then does what ``Supervisor.stop_all``
does for every service still alive: in reverse start order, SIGTERM to its process group (a trainer finishes
its step and saves), SIGKILL after its grace. Standard library only, so it starts in milliseconds.

Each pid is pinned by a pidfd as soon as it is read (Linux): a service that already exited, and whose pid the
kernel has handed to another process, is never signalled. Without pidfds a pid is checked with signal 0.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

POLL_S = 0.1


def _pin(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here, or it exited before we read its line
        return None


def _alive(pid: int, fd: int | None) -> bool:
    if fd is not None:
        return not select.select([fd], [], [], 0)[0]  # a pidfd reads ready once its process has exited
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group its start_new_session made, with anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _stop(pid: int, fd: int | None, grace_s: float) -> None:
    if not _alive(pid, fd):
        return
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pid, fd) and time.monotonic() < deadline:
        if fd is not None:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        else:
            time.sleep(POLL_S)
    _signal_group(pid, signal.SIGKILL)  # what is left: the leader after its grace, or children it left behind


def main() -> None:
    watched: list[tuple[int, int | None, float]] = []
    for line in sys.stdin:
        pid, grace_s = line.split()
        watched.append((int(pid), _pin(int(pid)), float(grace_s)))
    for pid, fd, grace_s in reversed(watched):
        _stop(pid, fd, grace_s)


if __name__ == "__main__":
    main()
