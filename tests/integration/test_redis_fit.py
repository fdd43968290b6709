"""A Redis that answers but cannot hold the trajectory stream is refused at start-up with one line naming the
flag, not at the first finish or read: a Redis Cluster node (the stream, its group and the exactly-once sets
meet in one script, so one node must hold them all) and a Redis older than the commands the stream uses."""

from __future__ import annotations

import socket

import pytest

from molt.bus.embedded import EmbeddedRedis
from molt.net import free_port
from molt.serve import redis_problem, redis_unfit
from tests.integration.test_startup_errors import error_line, run, valid_flags


def cluster_port() -> int:
    """A free port a cluster node can take: it also binds port + 10000 (its cluster bus), so no higher than
    55535, whatever the machine's ephemeral range makes ``free_port`` pick."""
    for _ in range(200):
        port = free_port()
        if port <= 55535 and _bus_free(port + 10000):
            return port
    raise OSError("no port <= 55535 with its cluster bus port free")


def _bus_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory):
    conf = tmp_path_factory.mktemp("cluster") / "nodes.conf"
    with EmbeddedRedis(
        port=cluster_port(), args=["--cluster-enabled", "yes", "--cluster-config-file", str(conf)]
    ) as node:
        yield node.url


def test_a_cluster_node_is_refused_naming_the_flag(cluster_node, redis_url):
    assert redis_problem(redis_url) is None  # the suite's own Redis is fit
    problem = redis_problem(cluster_node, "--redis-url")
    assert problem is not None and problem.startswith(f"--redis-url {cluster_node}: this is a Redis Cluster node")
    assert "cluster mode disabled" in problem


@pytest.mark.parametrize("service", ["gateway", "trainer"])
def test_a_service_given_a_cluster_node_stops_with_one_line(service, cluster_node, tiny_qwen3):
    proc = run([f"services.{service}", *valid_flags(service, tiny_qwen3, cluster_node)])
    line = error_line(proc, f"python -m services.{service}")
    assert f"--redis.url {cluster_node}: this is a Redis Cluster node" in line


def test_molt_up_given_a_cluster_node_starts_nothing(cluster_node):
    proc = run(["molt.cli", "up", "--recipe", "tiny", "--redis-url", cluster_node, "--no-progress"])
    assert f"--redis-url {cluster_node}: this is a Redis Cluster node" in error_line(proc, "molt")


@pytest.mark.parametrize(
    ("info", "refused"),
    [
        ({"redis_version": "7.0.15", "redis_mode": "standalone", "cluster_enabled": 0}, None),
        ({"redis_version": "6.2.0", "cluster_enabled": 0}, None),
        ({"redis_version": "6.0.16", "cluster_enabled": 0}, "Redis 6.0.16 is too old: Molt needs 6.2 or newer"),
        ({"redis_version": "5.0.7"}, "Redis 5.0.7 is too old"),
        ({"redis_version": "7.2.4", "cluster_enabled": 1}, "this is a Redis Cluster node"),
        ({}, None),  # a proxy or managed service that refuses INFO is not judged by it
    ],
)
def test_what_info_says_decides_fitness(info, refused):
    got = redis_unfit(info)
    assert got is None if refused is None else refused in (got or "")
