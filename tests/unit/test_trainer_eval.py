"""The evaluator's dispatch: every eval prompt's group of episodes, --eval.batch_size groups at a time."""

from __future__ import annotations

import asyncio
import json

import pytest

from molt.config import parse_settings
from services.trainer.config import TrainerSettings
from services.trainer.evaluate import Evaluator


class CountingDispatcher:
    """Answers every episode after a short wait and records how many prompt groups were in flight at once."""

    def __init__(self) -> None:
        self.active: dict[str, int] = {}
        self.most_groups = 0

    async def run_episode(self, body: dict) -> dict:
        group = body["group_id"]
        self.active[group] = self.active.get(group, 0) + 1
        self.most_groups = max(self.most_groups, len(self.active))
        await asyncio.sleep(0.01)
        self.active[group] -= 1
        if not self.active[group]:
            del self.active[group]
        return {"status": "ok", "reward": float(body["sample_index"] == 0), "response_tokens": 3}


@pytest.mark.parametrize(("flags", "most"), [(["--eval.batch_size", "2"], 2), ([], 3)])
def test_eval_runs_at_most_batch_size_prompt_groups_at_once(tmp_path, flags, most):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(7)))
    s = parse_settings(
        TrainerSettings,
        ["--actor.model_name_or_path", "m", "--eval.dataset", str(data), "--eval.n_samples_per_prompt", "2"]
        + ["--rollout.batch_size", "3", *flags],
        environ={},
    )
    dispatcher = CountingDispatcher()
    metrics = asyncio.run(Evaluator(s, dispatcher).run(step=4))  # type: ignore[arg-type]
    assert dispatcher.most_groups == most  # --eval.batch_size, else --rollout.batch_size
    assert metrics["eval_num_samples"] == 14 and metrics["eval_default_pass1"] == 0.5
    assert metrics["eval_default_pass2"] == 1.0


class StuckDispatcher:
    """Episodes that would take minutes; records how many were cancelled."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def run_episode(self, body: dict) -> dict:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return {}


def test_a_stop_request_cuts_a_running_evaluation_short(tmp_path):
    """SIGTERM during a long evaluation: the trainer must save within its grace period, so the evaluation
    is abandoned (its episodes cancelled, nothing recorded) within a poll of the request."""
    import time

    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(3)))
    s = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", "--eval.dataset", str(data)], environ={})
    dispatcher = StuckDispatcher()
    t0 = time.monotonic()
    stop_at = t0 + 0.3
    result = asyncio.run(Evaluator(s, dispatcher).run(4, lambda: time.monotonic() > stop_at))  # type: ignore[arg-type]
    assert result is None and time.monotonic() - t0 < 5 and dispatcher.cancelled > 0
