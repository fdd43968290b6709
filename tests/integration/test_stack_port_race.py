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


def test_services_launched_together_are_each_settled_and_one_that_lost_a_port_starts_again(tmp_path):
    """The pods and the trainer are launched together and then waited for (``launch``, ``settle``): the one
    whose port was taken alone starts again on a new one; the other keeps its own."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    lost = taken.getsockname()[1]

    def maker(name: str):
        def redis_proc(port: int) -> ManagedProcess:
            cmd = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
            return ManagedProcess(name, cmd, tmp_path / f"{name}.log")

        return redis_proc

    sup = Supervisor()
    ready = watch.wait_output("Ready to accept", 10.0)
    try:
        ports = {"a": [watch.free_port()], "b": [lost]}
        procs = {name: watch.launch(sup, maker(name), ports[name]) for name in ("a", "b")}
        a, (port_a,) = watch.settle(sup, procs["a"], ports["a"], maker("a"), ready)
        b, (port_b,) = watch.settle(sup, procs["b"], ports["b"], maker("b"), ready)
        assert a is procs["a"] and port_a == ports["a"][0]
        assert b is not procs["b"] and port_b != lost and [p.name for p in sup.procs] == ["a", "b"]
        assert redis.Redis(port=port_a).ping() and redis.Redis(port=port_b).ping()
        assert "already in use" in (tmp_path / "b.log").read_text()
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
