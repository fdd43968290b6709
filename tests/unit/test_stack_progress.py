"""`molt up`'s line per step: a metric the step did not have reads "-", never "nan"."""

import json

from molt.stack.report import Progress


def test_a_step_without_fresh_tokens_prints_a_dash(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    rows = [
        {"step": 1, "reward_mean": 0.2, "mismatch_kl": 1e-4, "mismatch_kl_fresh": 7.7e-5, "samples": 64},
        {"step": 2, "reward_mean": 0.3, "mismatch_kl": 0.3, "mismatch_kl_fresh": float("nan"), "samples": 64},
        {"step": 3, "reward_mean": 0.4, "mismatch_kl": 0.2, "samples": 64},
    ]
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    Progress(steps, total_steps=3).poll()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "(fresh 7.7e-05)" in lines[0]
    assert "(fresh -)" in lines[1] and "(fresh -)" in lines[2]
    assert not any("nan" in line for line in lines)


def test_queue_lag_is_what_the_trainer_has_not_read(tmp_path, capsys):
    """Pending entries are read already: with checkpoints they hold every trained rollout until its step's
    checkpoint acks it, which is no lag."""
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"step": 1, "reward_mean": 0.2, "samples": 64}) + "\n")
    progress = Progress(steps, total_steps=3)
    progress.last_metrics = {"molt_queue_undelivered_entries": 12.0, "molt_queue_pending_entries": 600.0}
    progress.poll()
    assert "| queue lag 12 |" in capsys.readouterr().out


def test_a_resumed_run_reads_its_earlier_steps_quietly_and_a_step_trained_again_counts_once(tmp_path, capsys):
    from molt.stack.report import finish_report

    steps = tmp_path / "steps.jsonl"
    rows = [{"step": s, "reward_mean": s / 10, "samples": 8, "trajectories": 8} for s in (1, 2, 3, 2, 3, 4)]
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    progress = Progress(steps, total_steps=4)
    progress.poll(quiet=True)  # the first start's steps, before the resumed trainer logs any
    assert capsys.readouterr().out == ""
    with open(steps, "a") as f:  # killed after step 3, resumed from the checkpoint of step 1
        f.write("".join(json.dumps(r) + "\n" for r in rows[3:]))
    progress.poll()
    assert len(capsys.readouterr().out.splitlines()) == 3
    summary = finish_report(tmp_path, progress, {}, 10.0, "tiny")
    assert summary["steps"] == 4 and summary["trajectories_trained"] == 32
