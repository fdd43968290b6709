"""Redis at its ``maxmemory`` (``noeviction``, as the chart runs it and managed Redis services do) refuses
writes: a producer waits for the trainer to drain the stream, then reports the stream full; nothing written is
lost or written twice, and once the trainer has acked the backlog, writes go in again (acked entries hold memory
until trimmed, so a drained stream must not stay full). Through the gateway, a finish that cannot be written is
a 503 that keeps the session for the retry.

A redis-server of the test's own (``molt.bus.embedded``) with a few MB of ``maxmemory``.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis

from molt.bus import QueueFull
from molt.bus.embedded import EmbeddedRedis
from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.schema import Segment, Trajectory, encode_many
from tests.gateway_testlib import scripted_gateway

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
MAXMEMORY = "4mb"


def _traj(tokens: int = 4000) -> Trajectory:
    seg = Segment(np.arange(tokens), [[tokens - 8, tokens]], -np.ones(8), np.zeros(8))
    return Trajectory(Trajectory.new_id(), "g", 0, [seg], 1.0)


@pytest.fixture
def server(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path / "redis") as srv:
        r = redis.Redis.from_url(srv.url)
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", MAXMEMORY)
        r.close()
        yield srv


async def _fill(q: RedisTrajectoryQueue) -> list[str]:
    """Write trajectories until Redis refuses; the ids written."""
    written: list[str] = []
    while True:
        t = _traj()
        try:
            await q.put_once(encode_many([t]), [t.trajectory_id], keep_s=60, timeout_s=0.2)
        except QueueFull as exc:
            assert "maxmemory" in str(exc) and "nothing was written" in str(exc)
            return written
        written.append(t.trajectory_id)


async def _drain(q: RedisTrajectoryQueue) -> list[str]:
    got: list[str] = []
    while deliveries := await q.read("trainer-0", 50, block_s=0):
        await q.ack(deliveries)
        got += [d.trajectory.trajectory_id for d in deliveries]
    return got


async def test_a_full_redis_is_waited_out_and_writes_resume_once_the_trainer_drains_it(server):
    producer = RedisTrajectoryQueue(server.url, "molt:test:oom")
    consumer = RedisTrajectoryQueue(server.url, "molt:test:oom", trim_every=10_000)
    try:
        await consumer.ensure_group()
        first = await _fill(producer)
        assert len(first) > 10
        assert await _drain(consumer) == first  # acks go through while Redis is full

        # Far fewer acks than the consumer's trim interval: the producer's own trim frees the room.
        t = _traj()
        await producer.put_once(encode_many([t]), [t.trajectory_id], keep_s=60, timeout_s=5)
        more = await _fill(producer)
        assert await _drain(consumer) == [t.trajectory_id, *more]
    finally:
        await producer.close()
        await consumer.close()


async def test_an_undecodable_entry_read_while_redis_is_full_is_acked_and_logged_not_read_forever(server, caplog):
    """Its dead-letter copy is refused at maxmemory; left pending it would hold back the trim that frees memory."""
    producer = RedisTrajectoryQueue(server.url, "molt:test:oom-dead")
    consumer = RedisTrajectoryQueue(server.url, "molt:test:oom-dead")
    try:
        await consumer.ensure_group()
        await producer.redis.xadd("molt:test:oom-dead", {"d": b"not a trajectory"})
        written = await _fill(producer)
        with caplog.at_level("ERROR", logger="molt.bus"):
            assert await _drain(consumer) == written
        assert "without a dead-letter copy" in caplog.text
        assert (await consumer.lag()).pending == 0
        t = _traj()
        await producer.put_once(encode_many([t]), [t.trajectory_id], keep_s=60, timeout_s=5)
    finally:
        await producer.close()
        await consumer.close()


async def test_a_finish_that_redis_refuses_is_a_503_and_the_session_is_written_once_after(server, tiny_qwen3):
    from services.gateway.chat import ChatModel

    model = ChatModel(tiny_qwen3)
    stream = "molt:test:oom-gw"
    app, _pods, http = scripted_gateway(
        model,
        lambda prompt, sp: model.encode("Hi.<|im_end|>"),
        ["http://pod-a:1"],
        redis={"url": server.url, "stream": stream},
        session={"finish_wait_s": 0.3},
    )
    consumer = RedisTrajectoryQueue(server.url, stream)
    filler = RedisTrajectoryQueue(server.url, stream)
    try:
        await consumer.ensure_group()
        sid = (await http.post("/v1/sessions", json={})).json()["session_id"]
        turn = {"messages": [{"role": "user", "content": "hello"}], "sampling_params": {"max_tokens": 4}}
        assert (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).status_code == 200
        backlog = await _fill(filler)

        refused = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "queue_unavailable"
        assert "maxmemory" in refused.json()["error"]["message"]

        assert await _drain(consumer) == backlog
        done = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
        assert done.status_code == 200 and done.json()["written"] is True, done.text
        assert await _drain(consumer) == [sid]
    finally:
        await http.aclose()
        await app.gateway.queue.close()
        await consumer.close()
        await filler.close()
