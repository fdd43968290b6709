"""When the trainer evaluates between steps: --eval.steps multiples, and at start only a fresh run's
--eval.eval_at_start. A run resumed at an --eval.steps multiple does not evaluate that step again (Molt
neither): the run that trained it did, and a second evaluation would log the step twice and rewrite its
checkpoint's retention metric and the best checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.trainer.trainer import Trainer


class FakeEvaluator:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def due(self, step: int) -> bool:
        return step > 0 and step % self.steps == 0


def _evaluations(step: int, *, at_start: bool, eval_at_start: bool) -> list[int]:
    ran: list[int] = []
    fake = SimpleNamespace(
        evaluator=FakeEvaluator(steps=5),
        learner=SimpleNamespace(global_step=step),
        s=SimpleNamespace(eval=SimpleNamespace(eval_at_start=eval_at_start)),
        _evaluate=lambda: ran.append(step),
    )
    Trainer._maybe_evaluate(fake, at_start=at_start)  # type: ignore[arg-type]
    return ran


@pytest.mark.parametrize("eval_at_start", [False, True])
def test_a_run_resumed_at_an_eval_step_does_not_evaluate_it_again(eval_at_start):
    assert _evaluations(10, at_start=True, eval_at_start=eval_at_start) == []


def test_a_fresh_run_evaluates_at_start_only_with_eval_at_start():
    assert _evaluations(0, at_start=True, eval_at_start=True) == [0]
    assert _evaluations(0, at_start=True, eval_at_start=False) == []


def test_steps_evaluate_on_eval_steps_multiples():
    assert _evaluations(10, at_start=False, eval_at_start=False) == [10]
    assert _evaluations(11, at_start=False, eval_at_start=True) == []


def _checkpoint(root, step: int, key: str | None, value: float | None) -> None:
    from services.trainer import checkpoint

    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    (d / "extra_state.pt").write_bytes(b"")
    checkpoint.record_metric(str(root), d.name, key, value)
    (root / "latest").write_text(d.name)


def test_a_resumed_run_records_the_latest_evaluation_in_its_next_checkpoints(tmp_path, monkeypatch):
    """As it does not evaluate again, the metric the next checkpoints record (until the next evaluation) is the
    resumed checkpoint's, as in a run that never stopped, not none (which retention would prune first)."""
    from services.trainer import checkpoint

    _checkpoint(tmp_path, 10, "eval_math_pass1", 0.25)
    monkeypatch.setattr(checkpoint, "load", lambda root, learner: {"position": 0})
    monkeypatch.setattr(checkpoint, "best_state", lambda root: None)
    fake = SimpleNamespace(
        s=SimpleNamespace(
            ckpt=SimpleNamespace(path=str(tmp_path), load_enable=True), eval=SimpleNamespace(eval_only=True)
        ),
        learner=SimpleNamespace(global_step=10),
        info=SimpleNamespace(is_main=False),
        publisher=None,
        last_metric=(None, None),
        _publish=lambda version: None,
    )
    Trainer.run(fake)  # type: ignore[arg-type]
    assert fake.last_metric == ("eval_math_pass1", 0.25)


def test_the_resumed_metric_of_a_checkpoint_without_one_is_none(tmp_path):
    from services.trainer import checkpoint

    assert checkpoint.resumed_metric(str(tmp_path / "absent")) == (None, None)
    _checkpoint(tmp_path, 5, None, None)
    assert checkpoint.resumed_metric(str(tmp_path)) == (None, None)
