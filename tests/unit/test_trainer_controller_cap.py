"""--rollout.vllm_generate_batch_size N caps the prompt groups in flight (docs/trainer.md): dispatch never runs more
than N groups at once, and a group that finishes frees its slot for the next prompt."""

from __future__ import annotations

import asyncio

import numpy as np

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.config import TrainerSettings
from services.trainer.controller import Controller
from services.trainer.metrics import trainer_metrics

PROMPTS = 6


class _Prompts:
    def __len__(self):
        return PROMPTS

    def get(self, position):
        return f"prompt {position}"


def _sample(tid, group, k):
    return Trajectory(tid, group, k, [Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2))], float(k))


class _HeldDispatcher:
    """Each group's episodes run until the test releases that group; counts the groups running at once."""

    def __init__(self, queue, lose_first: str | None = None):
        self.queue, self.lose_first = queue, lose_first
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.running = 0
        self.most_running = 0

    async def run_group(self, prompt, group_id, samples):
        self.started.append(group_id)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.release.setdefault(group_id, asyncio.Event()).wait()
            if group_id == self.lose_first and self.started.count(group_id) == 1:
                return list(samples)  # reported written, never on the stream (a Redis crash lost the writes)
            await self.queue.put_many([_sample(f"{group_id}/{k}", group_id, k) for k in samples])
            return list(samples)
        finally:
            self.running -= 1

    def free(self, group_id: str) -> None:
        self.release.setdefault(group_id, asyncio.Event()).set()

    async def close(self):
        pass


def _controller(cap: int, lose_first: str | None = None) -> tuple[Controller, _HeldDispatcher]:
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            "m",
            "--train.dispatch",
            "true",
            "--rollout.n_samples_per_prompt",
            "1",
            # The policy-version gate alone would let every prompt go at once: only the cap holds them back.
            "--rollout.batch_size",
            str(PROMPTS),
            "--rollout.vllm_generate_batch_size",
            str(cap),
            "--train.read_block_s",
            "0.01",
        ],
        environ={},
    )
    q = MemoryTrajectoryQueue()
    dispatcher = _HeldDispatcher(q, lose_first)
    c = Controller(s, q, trainer_metrics(), dataset=_Prompts(), dispatcher=dispatcher)
    return c, dispatcher


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def _free_each(d: _HeldDispatcher, group_ids: list[str]) -> None:
    """Let each group finish as soon as it has started, in order."""
    for group_id in group_ids:
        await _until(lambda g=group_id: g in d.started)
        d.free(group_id)


async def test_vllm_generate_batch_size_caps_groups_in_flight_and_refills_freed_slots():
    c, d = _controller(cap=2)
    await c.resume(None)
    assert c.gate.may_dispatch(c.version)  # the gate would allow more than the cap
    c.start_dispatch()
    try:
        await _until(lambda: len(d.started) == 2)
        await asyncio.sleep(0.3)  # time for dispatch to overrun the cap, if it would
        assert d.started == [c.group_id(0), c.group_id(1)] and c.inflight_groups == 2

        d.free(c.group_id(0))  # one slot frees: exactly one more prompt goes
        await _until(lambda: len(d.started) == 3)
        await asyncio.sleep(0.3)
        assert d.started[2] == c.group_id(2) and len(d.started) == 3 and c.inflight_groups == 2

        await _free_each(d, [c.group_id(p) for p in range(PROMPTS)])  # every prompt runs, never more than 2
        await _until(c.dispatch_exhausted)
    finally:
        await c.close()
    assert d.started == [c.group_id(p) for p in range(PROMPTS)]
    assert d.most_running == 2


async def test_groups_restarted_from_a_checkpoint_respect_the_cap():
    """A checkpoint can hold more open groups than the cap (rollouts written but not trained yet): the ones
    whose samples are missing are dispatched again, still no more than N at once."""
    c, d = _controller(cap=2)
    await c.resume(
        {"version": 0, "position": 4, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": [0, 1, 2, 3]}
    )
    c.start_dispatch()
    try:
        await _until(lambda: len(d.started) == 2)
        await asyncio.sleep(0.3)
        assert d.started == ["r-0", "r-1"] and c.inflight_groups == 2
        await _free_each(d, [f"r-{p}" for p in range(PROMPTS)])
        await _until(c.dispatch_exhausted)
    finally:
        await c.close()
    assert d.started == [f"r-{p}" for p in range(PROMPTS)]
    assert d.most_running == 2


async def test_a_stalled_group_dispatched_again_waits_for_a_free_slot():
    """Group 0's rollouts are reported written but never arrive; while group 1 holds the only slot, group 0's
    missing samples are not dispatched again beside it."""
    c, d = _controller(cap=1, lose_first="r-0")
    c.group_stall_s = 0.05
    await c.resume({"version": 0, "position": 0, "refills": 0, "unacked_ids": [], "run_tag": "r", "open": []})
    d.free("r-0")
    c.start_dispatch()
    batch = asyncio.create_task(c.next_batch(1))
    try:
        await _until(lambda: "r-1" in d.started)
        await asyncio.sleep(0.5)  # group 0 has long stalled: only the cap keeps it from running again now
        assert d.started == ["r-0", "r-1"]
        await _free_each(d, [f"r-{p}" for p in range(1, PROMPTS)])
        (group,) = await asyncio.wait_for(batch, 10)
    finally:
        batch.cancel()
        await c.close()
    assert group.group_id == "r-0" and d.started.count("r-0") == 2
    assert d.most_running == 1
