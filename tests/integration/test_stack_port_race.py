"""`molt up` picks free ports and then starts a service on them; another process can take a port in between
(parallel runs on one machine). The stack starts the service again on new ports instead of failing, and never
mistakes someone else's server on the lost port for its own."""

from __future__ import annotations

import socket

import pytest
import redis

from molt.bus.embedded import find_redis_server
from molt.stack import watch
from molt.stack.procs import ManagedProcess, Supervisor


def test_a_service_that_loses_its_port_starts_again_on_a_new_one(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # someone else's server, on the port the first pick returns
    lost = taken.getsockname()[1]
    picks = iter([lost])
    real_free_port = watch.free_port
    monkeypatch.setattr(watch, "free_port", lambda: next(picks, None) or real_free_port())

    def redis_proc(port: int) -> ManagedProcess:
        cmd = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        return ManagedProcess("redis", cmd, tmp_path / "redis.log")

    sup = Supervisor()
    try:
        proc, (port,) = watch.start_on_free_ports(sup, 1, redis_proc, watch.wait_output("Ready to accept", 10.0))
        assert port != lost and proc.alive() and sup.procs == [proc]
        assert redis.Redis(port=port).ping()
        log = (tmp_path / "redis.log").read_text()
        assert "already in use" in log  # the first start did lose the race
    finally:
        sup.stop_all(grace_s=5)
        taken.close()


def test_a_service_that_fails_for_another_reason_is_not_restarted(tmp_path):
    def bad_proc(port: int) -> ManagedProcess:
        cmd = [find_redis_server(), "--port", str(port), "--no-such-option", "x"]
        return ManagedProcess("redis", cmd, tmp_path / "redis.log")

    sup = Supervisor()
    try:
        with pytest.raises(watch.ServiceFailed, match="exited before it was ready"):
            watch.start_on_free_ports(sup, 1, bad_proc, watch.wait_output("Ready to accept", 10.0))
        assert (tmp_path / "redis.log").read_text().count("$ ") == 1  # one start, no retry
    finally:
        sup.stop_all(grace_s=5)
