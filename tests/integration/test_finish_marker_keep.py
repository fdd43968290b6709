"""A finished session's write marker lives ``--session.finished_keep_s`` on real Redis: the gateway's write of a
finished trajectory (``finish.write_payloads``, through ``put_once``) sets the marker key's TTL to the flag's
value, and a retried finish inside that window writes nothing twice (docs/gateway.md, Outages)."""

from __future__ import annotations

import uuid

import pytest

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.config import parse_settings
from services.gateway.config import GatewaySettings
from services.gateway.finish import write_payloads
from services.gateway.metrics import gateway_metrics

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def queue(redis_url, stream_name):
    q = RedisTrajectoryQueue(redis_url, stream_name)
    yield q
    markers = [key async for key in q.redis.scan_iter(match=q.written_key("*"))]
    if markers:
        await q.redis.delete(*markers)
    await q.delete()
    await q.close()


def _settings(*flags: str) -> GatewaySettings:
    return parse_settings(
        GatewaySettings, ["--model.path", "/m", "--rollout.urls", "http://127.0.0.1:1", *flags], environ={}
    )


async def test_the_write_marker_lives_session_finished_keep_s(queue):
    cfg, metrics = _settings("--session.finished_keep_s", "123").session, gateway_metrics()
    tid = uuid.uuid4().hex
    (entry,) = await write_payloads(queue, metrics, cfg, [b"trajectory"], [tid])
    assert entry
    ttl_ms = await queue.redis.pttl(queue.written_key(tid))
    assert 120_000 < ttl_ms <= 123_000
    # Inside that window the same finish, retried after a lost answer, finds the marker and writes nothing.
    assert await write_payloads(queue, metrics, cfg, [b"trajectory"], [tid]) == [""]
    assert await queue.redis.xlen(queue.stream) == 1


async def test_the_marker_keeps_the_default_600_s_without_the_flag(queue):
    cfg = _settings().session
    assert cfg.finished_keep_s == 600.0
    tid = uuid.uuid4().hex
    await write_payloads(queue, gateway_metrics(), cfg, [b"trajectory"], [tid])
    assert 597_000 < await queue.redis.pttl(queue.written_key(tid)) <= 600_000
