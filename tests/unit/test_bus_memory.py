"""In-memory bus keeps the Redis semantics: pending, reclaim, exactly-once by id, dead letter, backpressure."""

import asyncio

import numpy as np
import pytest

from molt.bus.base import QueueFull
from molt.bus.memory import MemoryTrajectoryQueue
from molt.schema import Segment, Trajectory


def traj(tid: str) -> Trajectory:
    seg = Segment(
        token_ids=np.arange(6), action_spans=np.array([[2, 6]]), logprobs=np.full(4, -1.0), versions=np.zeros(4)
    )
    return Trajectory(trajectory_id=tid, group_id="g", sample_index=0, segments=[seg], reward=1.0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


async def test_read_ack_reclaim_exactly_once():
    clock = Clock()
    q = MemoryTrajectoryQueue(clock=clock)
    await q.put_many([traj(f"t{i}") for i in range(10)])
    a = await q.read("a", 4, block_s=0)
    b = await q.read("b", 10, block_s=0)
    assert [d.trajectory.trajectory_id for d in a + b] == [f"t{i}" for i in range(10)]
    await q.ack(b)
    assert (await q.lag()).pending == 4
    clock.t = 5.0
    assert await q.reclaim("b", min_idle_s=10, count=10) == []
    taken = await q.reclaim("b", min_idle_s=1, count=10)
    assert [d.trajectory.trajectory_id for d in taken] == ["t0", "t1", "t2", "t3"]
    assert all(d.delivery_count == 2 for d in taken)
    await q.ack(taken)
    lag = await q.lag()
    assert (lag.length, lag.pending, lag.undelivered) == (0, 0, 0)


async def test_duplicate_trajectory_id_consumed_once():
    q = MemoryTrajectoryQueue()
    await q.put_many([traj("x"), traj("x")])
    got = await q.read("a", 10, block_s=0)
    assert len(got) == 1
    await q.ack(got)
    await q.put(traj("x"))  # a producer retry after the commit
    assert await q.read("a", 10, block_s=0) == []
    assert await q.consumed(["x", "y"]) == [True, False]


async def test_corrupt_record_goes_to_dead_letter():
    q = MemoryTrajectoryQueue()
    q.put_raw(b"garbage")
    await q.put(traj("ok"))
    got = await q.read("a", 10, block_s=0)
    assert [d.trajectory.trajectory_id for d in got] == ["ok"]
    assert len(q.dead) == 1 and "record" in q.dead[0]["error"]


async def test_backpressure_waits_then_raises():
    q = MemoryTrajectoryQueue(max_len=3)
    await q.put_many([traj(f"t{i}") for i in range(3)])
    with pytest.raises(QueueFull):
        await q.put(traj("t3"), timeout_s=0.05)

    async def drain():
        await asyncio.sleep(0.05)
        await q.ack(await q.read("a", 1, block_s=0))

    asyncio.get_running_loop().create_task(drain())
    await q.put(traj("t3"), timeout_s=2)
    assert (await q.lag()).length == 3


async def test_lag_age_of_oldest_unacked():
    clock = Clock()
    q = MemoryTrajectoryQueue(clock=clock)
    await q.put(traj("a"))
    clock.t = 2.0
    await q.put(traj("b"))
    clock.t = 5.0
    assert (await q.lag()).oldest_unacked_age_s == 5.0
    await q.ack(await q.read("c", 1, block_s=0))
    assert (await q.lag()).oldest_unacked_age_s == 3.0
