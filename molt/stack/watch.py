"""How `molt up` keeps its services: each started on ports the kernel reports free and waited for; one that dies
mid-run started again on the same ports (as Kubernetes restarts a pod); a gateway's count carried over its
restarts; SIGINT, SIGTERM and SIGHUP turned into the Ctrl-C path that stops the stack in order."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from molt.net import free_port
from molt.stack.procs import ManagedProcess, ServiceFailed, Supervisor
from molt.stack.report import scrape

MAX_RESTARTS = 3
"""Restarts of one service within one `molt up`: one that keeps dying has a cause a restart will not fix."""


def revive(
    sup: Supervisor, p: ManagedProcess, trainer: ManagedProcess, restarts: dict, checkpointed: Callable[[], bool]
) -> None:
    """Start ``p`` again after it died while the trainer trains, as Kubernetes restarts a pod: on its own ports
    (the others know it by them); a rollout pod out of routing until the trainer pushes it the current weights;
    the trainer from its newest checkpoint, and only after a signal (the OOM killer, a kill), since its named
    errors and tracebacks would come back. Never after exit 2 (a flag or port problem), nor past MAX_RESTARTS."""
    code = p.returncode
    assert code is not None
    if code == 2 or restarts.get(p.name, 0) >= MAX_RESTARTS or (p is trainer and code >= 0):
        more = f" ({MAX_RESTARTS} restarts)" if restarts.get(p.name) else ""
        raise ServiceFailed(f"{p.name} exited with code {code}{more}; log {p.log_path}:\n{p.tail()}")
    if p.name.startswith("rollout-"):
        _set_last(p.cmd, "--weights.await_push", "true")
    if p is trainer and checkpointed():
        _set_last(p.cmd, "--ckpt.load_enable", "true")
    restarts[p.name] = restarts.get(p.name, 0) + 1
    print(
        f"[molt up] {p.name} exited with code {code}; starting it again ({restarts[p.name]} of {MAX_RESTARTS}); "
        f"log {p.log_path}",
        flush=True,
    )
    sup.restart(p)


def _set_last(cmd: list[str], flag: str, value: str) -> None:
    """``flag value`` last on ``cmd`` (the last of a repeated flag wins over a user's earlier one), once."""
    if cmd[-2:] != [flag, value]:
        cmd += [flag, value]


class GatewayCount:
    """Trajectories the gateway wrote, over its restarts: each start counts from zero, so the count of one that
    died is the last one read from it (read once a second while it runs: what it wrote in its last second is
    not counted)."""

    def __init__(self, url: str) -> None:
        self.url, self.earlier, self.seen = f"{url}/metrics", 0, 0

    def poll(self) -> None:
        self.seen = int(scrape(self.url).get("molt_gateway_trajectories_written_total", self.seen))

    def lost(self) -> None:
        self.earlier, self.seen = self.earlier + self.seen, 0


def interrupt(signum, _frame):
    raise KeyboardInterrupt


def stop_on_signals() -> dict[int, Any]:
    """SIGINT, SIGTERM and SIGHUP (its terminal closed) stop the run as Ctrl-C does: the trainer saves its step
    and the services stop. A SIGHUP already ignored (``nohup molt up``) stays ignored. The old handlers."""
    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        old[sig] = signal.signal(sig, interrupt)
    return old


def start_on_free_ports(
    sup: Supervisor,
    count: int,
    make: Callable[..., ManagedProcess],
    ready: float | Callable[[ManagedProcess], None],
    tries: int = 3,
) -> tuple[ManagedProcess, list[int]]:
    """Start ``make(*ports)`` on ``count`` ports the kernel reports free, and wait until it is ready (``ready``:
    a /readyz timeout, or a function that waits). A free port can be taken by another process between the pick
    and the service's bind (parallel runs on one machine); a service that exits on that is started again on
    new ports, so the stack never fails, or talks to someone else's server, on a port it lost."""
    for attempt in range(1, tries + 1):
        ports = [free_port() for _ in range(count)]
        proc = make(*ports)
        try:
            sup.start(proc)
            _wait(proc, ready)
            return proc, ports
        except ServiceFailed:
            if attempt == tries or not proc.lost_port_race():
                raise
            _drop_for_new_ports(sup, proc)
    raise AssertionError("unreachable")


def launch(sup: Supervisor, make: Callable[..., ManagedProcess], ports: list[int]) -> ManagedProcess:
    """Start ``make(*ports)`` as one of the stack's without waiting for it: services that do not need each other
    (the pods, the trainer) load their models at the same time; ``settle`` then waits for each."""
    proc = make(*ports)
    sup.start(proc)
    return proc


def settle(
    sup: Supervisor,
    proc: ManagedProcess,
    ports: list[int],
    make: Callable[..., ManagedProcess],
    ready: float | Callable[[ManagedProcess], None],
    tries: int = 3,
) -> tuple[ManagedProcess, list[int]]:
    """Wait until ``launch``'s ``proc`` is ready; one that lost a port is started again on new ones
    (``start_on_free_ports``), so its caller must hand the new ports on."""
    try:
        _wait(proc, ready)
        return proc, ports
    except ServiceFailed:
        if tries == 1 or not proc.lost_port_race():
            raise
        _drop_for_new_ports(sup, proc)
        return start_on_free_ports(sup, len(ports), make, ready, tries - 1)


def _wait(proc: ManagedProcess, ready: float | Callable[[ManagedProcess], None]) -> None:
    if callable(ready):
        ready(proc)
    else:  # its own "listening" line first: /readyz alone could be another server's on a lost port
        wait_output("listening on http://", ready)(proc)
        proc.wait_ready(ready)


def _drop_for_new_ports(sup: Supervisor, proc: ManagedProcess) -> None:
    proc.kill_group()  # what it started (a vLLM engine process) goes with it
    sup.procs.remove(proc)
    print(f"[molt up] {proc.name}: a port it was given was taken first; starting it on new ports", flush=True)


def wait_output(marker: str, timeout_s: float | None) -> Callable[[ManagedProcess], None]:
    """A wait until the process writes ``marker`` to its log (redis-server's "ready", the trainer's "listening"
    line). Its own line, not a TCP connect: a connect would also succeed against another server that took the
    port first."""

    def wait(proc: ManagedProcess) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        while time.monotonic() < deadline:
            if marker in proc.output():
                return
            if not proc.alive():
                raise ServiceFailed(f"{proc.name} exited before it was ready; log {proc.log_path}:\n{proc.tail()}")
            time.sleep(0.05)
        raise ServiceFailed(f"{proc.name} did not write {marker!r} within {timeout_s:.0f} s; log {proc.log_path}")

    return wait
