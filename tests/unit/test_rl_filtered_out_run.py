"""A run whose dynamic filtering drops every prompt group (a small model that fails every sample) ends with no
step trained; the trainer says so, naming the flags, instead of finishing as a silent 0-step "done"."""

from __future__ import annotations

import logging

import numpy as np

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.config import TrainerSettings
from services.trainer.controller import Controller
from services.trainer.metrics import trainer_metrics


class _Prompts:
    def __len__(self):
        return 2

    def get(self, position):
        return f"prompt {position}"


class _ZeroRewardDispatcher:
    """Every episode is written, every reward is 0: each group is uniform."""

    def __init__(self, queue):
        self.queue, self.failed, self.last_failure = queue, 0, None

    async def run_group(self, prompt, group_id, samples):
        trajs = [
            Trajectory(f"{group_id}-{k}", group_id, k, [Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2))], 0.0)
            for k in samples
        ]
        await self.queue.put_many(trajs)
        return trajs

    async def close(self):
        pass


def _settings(*flags):
    return parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", "m", "--rollout.n_samples_per_prompt", "2"),
            *("--rollout.batch_size", "1", "--train.read_block_s", "0.01", *flags),
        ],
        environ={},
    )


async def _run(settings, caplog):
    q = MemoryTrajectoryQueue()
    c = Controller(settings, q, trainer_metrics(), dataset=_Prompts(), dispatcher=_ZeroRewardDispatcher(q))
    await c.resume(None)
    c.start_dispatch()
    try:
        with caplog.at_level(logging.WARNING, logger="molt.trainer"):
            batch = await c.next_batch(1)
    finally:
        await c.close()
    return c, batch


async def test_a_run_whose_every_group_is_filtered_out_says_why(caplog):
    c, batch = await _run(
        _settings("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.01", "0.99"), caplog
    )
    assert batch is None and c.dropped["dynamic_filter"] == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no step trained" in m and "--algo.dynamic_filtering_range" in m for m in lines), lines


async def test_without_filtering_the_same_groups_train(caplog):
    c, batch = await _run(_settings(), caplog)
    assert batch is not None and len(batch) == 1
    assert not [r for r in caplog.records if "no step trained" in r.getMessage()]
