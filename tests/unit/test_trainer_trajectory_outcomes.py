"""The trainer's ``molt_trainer_trajectories_total{outcome}`` counter beyond trained/invalid: a pending entry the
checkpoint already trained, or a repeat of one trained in a step not durable yet, is counted ``already_trained``,
a rollout of another run ``not_this_run``, and a group dropped by dynamic filtering ``filtered`` (docs/trainer.md,
Observability)."""

from __future__ import annotations

import asyncio

import numpy as np

from molt.bus.memory import MemoryTrajectoryQueue
from molt.schema import Segment, Trajectory
from services.trainer.controller import Controller
from tests.unit.test_trainer_controller import _controller


def _traj(tid: str, group: str, sample: int, reward: float) -> Trajectory:
    return Trajectory(tid, group, sample, [Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2))], reward)


def _count(c: Controller, outcome: str) -> float:
    text = c.metrics.render()[0].decode()
    prefix = f'molt_trainer_trajectories_total{{outcome="{outcome}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


async def test_pending_entries_the_checkpoint_already_trained_are_counted_already_trained():
    # A trainer died after its checkpoint was durable but before it acked: the restarted consumer gets those
    # entries redelivered as pending, acks them untrained, and the counter must say why they vanished.
    q = MemoryTrajectoryQueue()
    await q.put_many([_traj("a1", "A", 0, 0), _traj("a2", "A", 1, 1), _traj("b1", "B", 0, 0)])
    await q.read("trainer-0", 10, block_s=0)
    c = _controller(q)
    await c.resume({"version": 3, "position": 0, "refills": 0, "unacked_ids": ["a1", "a2"]})
    assert await q.consumed(["a1", "a2", "b1"]) == [True, True, False]
    assert _count(c, "already_trained") == 2
    assert _count(c, "not_this_run") == 0


async def test_rollouts_of_another_run_are_counted_not_this_run():
    # Dispatch mode trains only its own run tag's prompt groups; a leftover rollout of an earlier run (tag "x")
    # is acked at once and counted, while this run's own rollout is kept for its group.
    q = MemoryTrajectoryQueue()
    await q.put_many([_traj("old1", "x-0", 0, 1), _traj("old2", "x-1", 0, 0), _traj("mine", "r-0", 0, 1)])
    c = _controller(q, "--train.dispatch", "true", "--rollout.batch_size", "1")
    c.own_groups = True
    c.assembler = type(c.assembler)(2, by_sample=True)
    c.dataset = _Prompts()
    await c.resume({"version": 0, "position": 1, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": [0]})
    assert await q.consumed(["old1", "old2", "mine"]) == [True, True, False]
    assert _count(c, "not_this_run") == 2
    assert _count(c, "already_trained") == 0


async def test_groups_dropped_by_dynamic_filtering_are_counted_filtered_per_trajectory():
    # Group A is uniform (both rewards 1) and dropped; B is kept. The counter counts A's trajectories, not groups.
    q = MemoryTrajectoryQueue()
    await q.put_many([_traj("a1", "A", 0, 1), _traj("a2", "A", 1, 1), _traj("b1", "B", 0, 0), _traj("b2", "B", 1, 1)])
    c = _controller(q, "--algo.dynamic_filtering_enable")
    await c.resume(None)
    assert [g.group_id for g in await c.next_batch(1)] == ["B"]
    assert _count(c, "filtered") == 2


async def test_a_redelivered_repeat_of_a_trajectory_trained_already_is_counted_already_trained():
    # A producer's retried write lands after the first copy was trained; the repeat is consumed (acked at the
    # commit) without training, so "Trajectories consumed, by outcome" must count it, as already_trained.
    q = MemoryTrajectoryQueue()
    c = _controller(q, "--rollout.n_samples_per_prompt", "1")
    await c.resume(None)
    await q.put_many([_traj("a1", "A", 0, 1)])
    assert [g.group_id for g in await c.next_batch(1)] == ["A"]
    await q.put_many([_traj("a1", "A", 0, 1)])
    try:
        await asyncio.wait_for(c.next_batch(1), 0.5)
    except TimeoutError:
        pass
    assert await c.commit() == 2
    assert _count(c, "already_trained") == 1


class _Prompts:
    def __len__(self):
        return 6

    def get(self, position):
        return f"prompt {position}"
