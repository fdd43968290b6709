"""Controller over the in-memory bus: resume settles pending entries, dynamic filtering, commits."""

from __future__ import annotations

import asyncio

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
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            "m",
            "--train.dispatch",
            "false",
            "--rollout.n_samples_per_prompt",
            "2",
            "--train.read_block_s",
            "0.01",
            *flags,
        ],
        environ={},
    )
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
    # the step's rollout metrics, as Molt logs them: 1 of 2 groups kept, A's 2 samples dropped as uniform
    from molt.algorithms import filtering_metrics

    metrics = filtering_metrics(c.take_verdicts())
    assert metrics["dynamic_filtering_pass_rate"] == 50.0 and metrics["rollout/group_all_pass_rate"] == 50.0
    assert metrics["rollout/dropped/dynamic_filter"] == 2 and metrics["rollout/pre_filter_mean_score"] == 0.75
    assert c.take_verdicts() == []  # taken once per step


async def test_stop_request_ends_collection():
    q = MemoryTrajectoryQueue()
    c = _controller(q)
    await c.resume(None)
    c.stop_requested = True
    assert await c.next_batch(1) is None


class _Prompts:
    def __len__(self):
        return 6

    def get(self, position):
        return f"prompt {position}"


class _Dispatcher:
    """Writes one rollout per requested sample straight to the queue (stands in for env workers)."""

    def __init__(self, queue):
        self.queue, self.calls = queue, []

    async def run_group(self, prompt, group_id, samples):
        self.calls.append((group_id, list(samples)))
        await self.queue.put_many([_sample(f"{group_id}/{k}-new", group_id, k) for k in samples])
        return list(samples)

    async def close(self):
        pass


def _sample(tid, group, k):
    return Trajectory(tid, group, k, [Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2))], float(k))


async def test_restart_adopts_open_groups_dispatches_only_missing_samples_and_acks_the_rest():
    """Checkpoint: run r, 4 prompts dispatched, groups 2 and 3 not trained yet. The stream holds what the dead
    trainer left: a full group 2, half of group 3, half of group 4 (dispatched after the checkpoint), a late
    rollout of group 1 (trained before the checkpoint) and a group of another run."""
    q = MemoryTrajectoryQueue()
    await q.put_many(
        [
            _sample("a", "r-2", 0),
            _sample("b", "r-2", 1),
            _sample("c", "r-3", 0),
            _sample("late", "r-1", 1),
            _sample("old", "x-0", 0),
        ]
    )
    await q.read("trainer-0", 10, block_s=0)  # delivered to the dead trainer, never acked
    await q.put_many([_sample("d", "r-4", 1), _sample("twice", "r-2", 1)])  # undelivered
    c = _controller(q, "--train.dispatch", "true", "--rollout.batch_size", "1")
    c.own_groups = True
    c.assembler = type(c.assembler)(2, by_sample=True)
    c.dataset, c.dispatcher = _Prompts(), _Dispatcher(q)
    await c.resume({"version": 2, "position": 4, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": [2, 3]})
    assert await q.consumed(["late", "old", "a"]) == [True, True, False]  # acked at once, untrained
    c.start_dispatch()
    trained = []
    try:
        for _ in range(3):
            (group,) = await c.next_batch(1)
            trained.append((group.group_id, sorted(group.trajectory_ids)))
            await c.commit()
            c.set_version(c.version + 1)
            await asyncio.sleep(0.05)  # let dispatch run
    finally:
        await c.close()
    assert trained == [("r-2", ["a", "b"]), ("r-3", ["c", "r-3/1-new"]), ("r-4", ["d", "r-4/0-new"])]
    assert c.dispatcher.calls[:2] == [("r-3", [1]), ("r-4", [0])]  # group 2 was complete: not dispatched
    assert c.client_state()["open"] == [5] and c.client_state()["position"] == 6
    assert await q.consumed(["twice"]) == [True]  # a second rollout of sample 1: acked with its group, untrained


async def test_a_stop_while_a_batch_fills_keeps_its_complete_groups_open_for_the_checkpoint():
    """SIGTERM while a batch waits for its second group: the first, complete but never trained, stays in the
    checkpoint's open positions, so a resume dispatches it again (or adopts its rollouts) instead of dropping it."""
    q = MemoryTrajectoryQueue()
    await q.put_many([_sample("a", "r-0", 0), _sample("b", "r-0", 1)])
    c = _controller(q, "--train.dispatch", "true", "--rollout.batch_size", "2")
    c.own_groups = True
    c.assembler = type(c.assembler)(2, by_sample=True)
    c.dataset, c.dispatcher = _Prompts(), _Stuck()
    await c.resume({"version": 0, "position": 2, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": [0, 1]})
    c.start_dispatch()
    try:
        batch = asyncio.ensure_future(c.next_batch(2))
        await asyncio.sleep(0.2)  # group r-0 (on the stream already) is taken into the batch; r-1 never comes
        assert c.assembler.num_complete == 0
        c.stop_requested = True
        assert await asyncio.wait_for(batch, 5) is None
    finally:
        await c.close()
    state = c.client_state()  # 2 and 3 were dispatched meanwhile: open too
    assert state["open"][:2] == [0, 1] and state["unacked_ids"] == []


async def test_groups_lost_from_a_checkpoint_are_replaced_instead_of_waiting_forever(caplog):
    """A checkpoint that missed an untrained group (as a stop mid-batch once did): 6 groups allowed by
    --train.num_steps 3, all dispatched, 2 steps trained, and only group 5 still open. The last batch can never
    fill at the gate; a new prompt takes the lost one's place, with an error in the log."""
    q = MemoryTrajectoryQueue()
    c = _controller(q, "--train.dispatch", "true", "--rollout.batch_size", "2", "--train.num_steps", "3")
    c.own_groups = True
    c.assembler = type(c.assembler)(2, by_sample=True)
    c.dataset, c.dispatcher = _MorePrompts(), _Dispatcher(q)
    await c.resume({"version": 2, "position": 6, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": [5]})
    c.start_dispatch()
    try:
        groups = await asyncio.wait_for(c.next_batch(2), 10)
    finally:
        await c.close()
    assert sorted(g.group_id for g in groups) == ["r-5", "r-6"]
    assert "1 prompt group(s) of run r were lost" in caplog.text


class _MorePrompts(_Prompts):
    def __len__(self):
        return 10


class _Stuck(_Dispatcher):
    """Env workers whose episodes never finish."""

    def __init__(self):
        super().__init__(None)

    async def run_group(self, prompt, group_id, samples):
        self.calls.append((group_id, list(samples)))
        await asyncio.Event().wait()


async def test_reclaim_never_takes_the_consumers_own_entries():
    clock = [0.0]
    q = MemoryTrajectoryQueue(clock=lambda: clock[0])
    await q.put_many([_traj("a1", "A", 0)])
    await q.read("trainer-0", 10, block_s=0)
    clock[0] = 1e6  # held far longer than --train.reclaim_idle_s (a batch waiting for its group)
    assert await q.reclaim("trainer-0", min_idle_s=1, count=10) == []
    assert [d.trajectory.trajectory_id for d in await q.reclaim("trainer-1", min_idle_s=1, count=10)] == ["a1"]


class _LosingDispatcher(_Dispatcher):
    """Reports every sample written, but the first write of sample 1 never reaches the stream (a Redis crash
    that lost its last second of writes)."""

    async def run_group(self, prompt, group_id, samples):
        self.calls.append((group_id, list(samples)))
        lost = len(self.calls) == 1
        await self.queue.put_many(
            [_sample(f"{group_id}/{k}-try{len(self.calls)}", group_id, k) for k in samples if not (lost and k == 1)]
        )
        return list(samples)


async def test_a_group_whose_written_rollouts_never_arrive_is_dispatched_again(caplog):
    """Also: before any batch, the warning names the stream and the likelier cause (a gateway writing to
    another stream or Redis would otherwise stall the run with no hint)."""
    q = MemoryTrajectoryQueue()
    c = _controller(q, "--train.dispatch", "true", "--rollout.batch_size", "1", "--train.num_steps", "1")
    c.own_groups = True
    c.assembler = type(c.assembler)(2, by_sample=True)
    c.dataset, c.dispatcher = _Prompts(), _LosingDispatcher(q)
    c.group_stall_s = 0.1
    await c.resume(None)
    c.start_dispatch()
    try:
        (group,) = await asyncio.wait_for(c.next_batch(1), 10)
    finally:
        await c.close()
    tag = c.run_tag
    assert c.dispatcher.calls == [(f"{tag}-0", [0, 1]), (f"{tag}-0", [1])]
    assert sorted(group.trajectory_ids) == [f"{tag}-0/0-try1", f"{tag}-0/1-try2"]
    assert "never reached stream 'molt:trajectories'" in caplog.text and "--redis.stream" in caplog.text


async def test_a_repeat_of_a_trajectory_trained_but_not_yet_committed_is_acked_with_it_never_trained():
    """A producer's retried write (its first reply lost) can reach the stream after the first copy was trained in
    a step whose checkpoint is not durable yet; with one sample per prompt it would form a complete group again."""
    q = MemoryTrajectoryQueue()
    c = _controller(q, "--rollout.n_samples_per_prompt", "1")
    await c.resume(None)
    await q.put_many([_traj("a1", "A", 1)])
    assert [g.group_id for g in await c.next_batch(1)] == ["A"]
    await q.put_many([_traj("a1", "A", 1)])  # the retry, delivered before the step's commit
    try:
        again = await asyncio.wait_for(c.next_batch(1), 0.5)
    except TimeoutError:
        again = None
    assert again is None
    assert await c.commit() == 2  # the first copy and its repeat, both acked now
    assert (await q.lag()).pending == 0
