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
