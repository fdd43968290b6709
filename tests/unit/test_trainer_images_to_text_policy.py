"""A trajectory that shows images, read by a trainer whose policy is text-only, is logged, counted
``molt_trainer_trajectories_total{outcome="invalid"}`` and acked without being trained (docs/multimodal.md,
"A trajectory with images for a text-only policy is logged, counted invalid and acked untrained").

The trainer's batch planning (``Trainer._plan``) runs on a bare Trainer over the real Controller and the in-memory
bus; no model loads (the learner is a stand-in whose ``vision`` is None, as a text-only policy's is).
"""

from __future__ import annotations

import hashlib
import logging
import types

import numpy as np
import pytest

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import SchemaError, Segment, Trajectory, decode
from services.trainer.batch import samples_from_trajectory
from services.trainer.config import TrainerSettings
from services.trainer.controller import Controller, LoopThread
from services.trainer.metrics import trainer_metrics
from services.trainer.trainer import Trainer

PNG = b"\x89PNG\r\n\x1a\n not decoded here"
SHA = hashlib.sha256(PNG).hexdigest()


def _traj(tid: str, group: str, sample: int, image: bool) -> Trajectory:
    seg = Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], np.zeros(2), images=[SHA] if image else [])
    return Trajectory(tid, group, sample, [seg], float(sample), images={SHA: PNG} if image else {})


def _trainer(queue, *flags: str, vocab_size: int | None = None) -> Trainer:
    """A Trainer of a text-only policy over ``queue``, without a model: only its batch planning runs."""
    s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", "m", "--train.dispatch", "false", *flags),
            *("--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "1", "--train.read_block_s", "0.01"),
        ],
        environ={},
    )
    t = object.__new__(Trainer)
    t.s = s
    t.metrics = trainer_metrics()
    t._controller = Controller(s, queue, t.metrics)
    t._io = LoopThread()
    t._batch = None
    t.publishing = False
    t.vocab_size = vocab_size
    t.learner = types.SimpleNamespace(global_step=0, vision=None)  # a text-only policy
    return t


def _count(t: Trainer, outcome: str) -> float:
    text = t.metrics.render()[0].decode()
    prefix = f'molt_trainer_trajectories_total{{outcome="{outcome}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


def test_images_for_a_text_only_policy_are_logged_counted_invalid_and_acked_untrained(caplog):
    # Group A shows an image, group B is text: with one group a step, the step's plan skips A (nothing of it
    # reaches the learner) and trains B; the commit after that step acks A's entries with B's, so the bus does
    # not redeliver them to a restarted trainer.
    q = MemoryTrajectoryQueue()
    t = _trainer(q)
    try:
        t._io.run(q.put_many([_traj("a0", "A", 0, True), _traj("a1", "A", 1, True)]))
        t._io.run(q.put_many([_traj("b0", "B", 0, False), _traj("b1", "B", 1, False)]))
        t._io.run(t.controller.resume(None))
        with caplog.at_level(logging.ERROR, logger="molt.trainer"):
            plan = t._plan()
        assert not plan["stop"]
        assert sorted(decode(b).trajectory_id for b in plan["trajs"]) == ["b0", "b1"]
        assert _count(t, "invalid") == 2
        logged = [r.getMessage() for r in caplog.records if "text-only" in r.getMessage()]
        assert len(logged) == 2 and any("a0" in m for m in logged)
        assert t._io.run(q.consumed(["a0", "a1"])) == [False, False]  # acked with the step's commit, not before
        t._io.run(t.controller.commit())
        assert t._io.run(q.consumed(["a0", "a1", "b0", "b1"])) == [True, True, True, True]
    finally:
        t._io.stop()


def test_the_batch_builder_refuses_images_for_a_text_only_policy_as_a_schema_error():
    # The last line of defence if such a trajectory reached the learner: a SchemaError naming the segment, not a
    # crash inside the model's forward.
    with pytest.raises(SchemaError, match="text-only policy"):
        samples_from_trajectory(_traj("a0", "A", 0, True), 64, vision=None)
