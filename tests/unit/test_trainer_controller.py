"""Controller over the in-memory bus: resume settles pending entries, dynamic filtering, commits."""

from __future__ import annotations

import numpy as np

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.config import TrainerSettings
from services.trainer.controller import Controller
from services.trainer.metrics import trainer_metrics


def _traj(tid: str, group: str, reward: float) -> Trajectory:
    return Trajectory(tid, group, 0, [Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2))], reward)


def _controller(queue, *flags) -> Controller:
    s = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", "--train.dispatch", "false",
                                         "--rollout.n_samples_per_prompt", "2", "--train.read_block_s", "0.01",
                                         *flags], environ={})
    return Controller(s, queue, trainer_metrics())


async def test_resume_acks_checkpointed_ids_and_keeps_the_rest():
    q = MemoryTrajectoryQueue()
    await q.put_many([_traj("a1", "A", 0), _traj("a2", "A", 1), _traj("b1", "B", 0), _traj("b2", "B", 1)])
    await q.read("trainer-0", 10, block_s=0)  # the previous run consumed all four and died before acking
    c = _controller(q)
    await c.resume({"version": 3, "position": 0, "refills": 0, "unacked_ids": ["a1", "a2"]})
    assert c.version == 3
    assert await q.consumed(["a1", "a2", "b1", "b2"]) == [True, True, False, False]
    groups = await c.next_batch(1)
    assert [g.group_id for g in groups] == ["B"]
    assert c.client_state()["unacked_ids"] == ["b1", "b2"]
    assert await c.commit() == 2
    assert await q.consumed(["b1", "b2"]) == [True, True]
    assert (await q.lag()).pending == 0


async def test_dynamic_filtering_drops_uniform_groups_but_acks_them_at_commit():
    q = MemoryTrajectoryQueue()
    await q.put_many([_traj("a1", "A", 1), _traj("a2", "A", 1), _traj("b1", "B", 0), _traj("b2", "B", 1)])
    c = _controller(q, "--algo.dynamic_filtering_enable")
    await c.resume(None)
    groups = await c.next_batch(1)
    assert [g.group_id for g in groups] == ["B"]
    assert c.dropped["dynamic_filter"] == 1 and c.gate.refills == 1
    assert sorted(c.client_state()["unacked_ids"]) == ["a1", "a2", "b1", "b2"]
    await c.commit()
    assert all(await q.consumed(["a1", "a2", "b1", "b2"]))


async def test_stop_request_ends_collection():
    q = MemoryTrajectoryQueue()
    c = _controller(q)
    await c.resume(None)
    c.stop_requested = True
    assert await c.next_batch(1) is None
