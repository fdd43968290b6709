"""Parity with the rules Molt's own unit tests pin down for its RL and SFT entry points: start-up refusals of
`molt train-rl`, the W&B settings every service process sees, how W&B steps train and eval metrics, how a
rollout becomes a training sample (step axis, --data.max_len cut, refused layouts) and what the weight-sync
probe carries. Dynamic filtering's rules are in test_algorithms_filtering.py.

Each case is stated as the rule, on our API; where the services split what Molt does in one process, the
test sits on the service that owns the rule.
"""

from __future__ import annotations

import subprocess
import sys
import types
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from molt.config import parse_settings
from molt.schema import SchemaError, Segment, Trajectory
from molt.stack import train_rl as tr
from services.trainer.batch import samples_from_trajectory
from services.trainer.config import LoggerConfig, TrainerSettings

BASE = ["--actor.model_name_or_path", "/models/policy", "--train.agent_path", "agent.py"]


def _refusal(*flags: str) -> str:
    with pytest.raises(ValueError) as info:
        tr.route([*BASE, *flags], "helm")
    return str(info.value)


# ---------------------------------------------------------------- molt train-rl start-up refusals


@pytest.mark.parametrize(
    ("flag", "what"), [("vllm.num_engines", "rollout pods"), ("rollout.num_runners", "env workers")]
)
def test_a_run_without_rollout_pods_or_env_workers_is_refused(flag, what):
    """Molt refuses --vllm.num_engines 0: RL generation needs engines; the services also need env workers."""
    assert f"--{flag} 0: RL rollouts need at least one ({what})" in _refusal(f"--{flag}", "0")
    assert tr.route([*BASE, f"--{flag}", "1"], "helm")  # one is enough


def test_the_cli_exits_2_with_the_reason_before_writing_anything(tmp_path):
    out = tmp_path / "values.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "molt.cli", "train-rl", "--emit", "helm-values", str(out), *BASE]
        + ["--vllm.num_engines", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--vllm.num_engines 0: RL rollouts need at least one" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--train.routing_replay"], "incompatible with --train.routing_replay"),
        (["--vllm.enable_prefix_caching"], "incompatible with --vllm.enable_prefix_caching"),
    ],
)
def test_speculative_decoding_with_routing_replay_or_prefix_caching_is_refused(flags, needle):
    """Molt refuses both pairs at start-up: the rollout log-probs (or routing) they produce are corrupted."""
    assert needle in _refusal("--vllm.mtp_num_speculative_tokens", "1", *flags)


@pytest.mark.parametrize(
    "flags",
    [
        ["--vllm.mtp_num_speculative_tokens", "0", "--train.routing_replay", "--vllm.enable_prefix_caching"],
        ["--vllm.mtp_num_speculative_tokens", "2", "--no-vllm.enable_prefix_caching"],
        ["--vllm.mtp_num_speculative_tokens", "2", "--train.routing_replay", "false"],
        ["--vllm.mtp_num_speculative_tokens", "2"],
    ],
)
def test_speculative_decoding_alone_or_with_the_other_feature_off_is_accepted(flags):
    r = tr.route([*BASE, *flags], "helm")
    assert "--vllm.mtp_num_speculative_tokens" in r.rollout


def test_a_non_positive_eval_batch_size_is_refused_with_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", "--eval.batch_size", "0"], environ={})
    assert exc.value.code == 2 and "--eval.batch_size" in capsys.readouterr().err


# ---------------------------------------------------------------- W&B settings and steps


def test_wandb_settings_in_the_environment_reach_every_service_process(tmp_path, monkeypatch):
    """Molt forwards WANDB_API_KEY / WANDB_ENTITY / WANDB_MODE to its Ray workers; the local stack's processes
    inherit the launching environment (plus their own additions)."""
    from molt.stack.procs import ManagedProcess

    wanted = {"WANDB_API_KEY": "test-api-key", "WANDB_ENTITY": "test-entity", "WANDB_MODE": "offline"}
    for name, value in wanted.items():
        monkeypatch.setenv(name, value)
    code = "import os; print([os.environ.get(n) for n in ('WANDB_API_KEY', 'WANDB_ENTITY', 'WANDB_MODE', 'X')])"
    proc = ManagedProcess("trainer", [sys.executable, "-c", code], tmp_path / "trainer.log", env={"X": "own"})
    proc.start()
    assert proc.proc is not None and proc.proc.wait(timeout=60) == 0
    assert "['test-api-key', 'test-entity', 'offline', 'own']" in proc.output()


def _fake_wandb(monkeypatch) -> MagicMock:
    run = MagicMock()
    fake = types.SimpleNamespace(login=MagicMock(), init=MagicMock(return_value=run))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return run


def test_wandb_steps_train_and_eval_metrics_by_their_own_global_step(monkeypatch):
    from services.trainer.steplog import StepLog

    run = _fake_wandb(monkeypatch)
    log = StepLog(LoggerConfig(wandb={"key": "k", "run_name": "test"}))
    run.define_metric.assert_any_call("train/global_step")
    run.define_metric.assert_any_call("train/*", step_metric="train/global_step", step_sync=True)
    run.define_metric.assert_any_call("eval/global_step")
    run.define_metric.assert_any_call("eval/*", step_metric="eval/global_step", step_sync=True)
    log.log(3, {"step": 3, "policy_loss": 0.5, "skipped": None})
    log.log_eval(3, {"eval_default_pass1": 0.25})
    train, evaluation = (c.args[0] for c in run.log.call_args_list)
    assert train == {"train/global_step": 3, "train/policy_loss": 0.5}  # None values are not logged
    assert evaluation == {"eval/global_step": 3, "eval/eval_default_pass1": 0.25}


# ---------------------------------------------------------------- rollout -> training sample


def _multi_turn(max_len: int):
    # 8 tokens, the policy generated tokens 2-3 and 6 (two turns); rollout logprob of token i is -i
    seg = Segment(np.arange(8), [[2, 4], [6, 7]], [-2.0, -3.0, -6.0], [0, 0, 0])
    traj = Trajectory("t", "g", 0, [seg], reward=1.0, score=1.0)
    traj.validate()
    (sample,) = samples_from_trajectory(traj, max_len)
    return sample


def test_only_action_tokens_count_and_the_step_axis_is_shifted_by_one():
    s = _multi_turn(max_len=8)
    assert s.action_mask.tolist() == [False, True, True, False, False, True, False]
    assert s.num_actions == 3
    on = s.action_mask
    torch.testing.assert_close(s.rollout_logp[on], torch.tensor([-2.0, -3.0, -6.0]))  # step k: token k + 1


def test_a_sample_is_cut_to_max_len_tokens_and_its_steps_with_it():
    s = _multi_turn(max_len=6)
    assert s.num_tokens == 6 and s.action_mask.tolist() == [False, True, True, False, False]
    assert s.num_actions == 2  # token 6 was cut


@pytest.mark.parametrize(
    ("spans", "logprobs", "field"),
    [
        ([[1, 4]], [0.0, 0.0, 0.0], "action_spans"),  # an action range past the trajectory's 3 tokens
        ([[1, 3]], [0.0], "logprobs"),  # rollout logprobs that do not align with the action tokens
    ],
)
def test_rollouts_with_bad_action_ranges_or_misaligned_logprobs_are_not_trained(spans, logprobs, field):
    seg = Segment([0, 1, 2], spans, logprobs, [0] * len(logprobs))
    with pytest.raises(SchemaError, match=field):
        Trajectory("t", "g", 0, [seg], reward=1.0).validate()


# ---------------------------------------------------------------- weight-sync probe


def test_the_probe_carries_the_trainers_prompt_logprobs_of_vocab_clipped_ids():
    from transformers import LlamaConfig, LlamaForCausalLM

    from molt.weightsync.check import DEFAULT_PROBE, probe_check

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    check = probe_check(model, max_abs_diff=1e-3)
    ids = list(check.token_ids)
    assert ids == [t % 64 for t in DEFAULT_PROBE] and check.max_abs_diff == pytest.approx(1e-3)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(list(check.expected_logprobs)), want, atol=1e-5, rtol=0)


def test_wandb_mode_offline_in_the_environment_keeps_the_run_offline(monkeypatch):
    """As with Molt, which passes wandb no mode: WANDB_MODE=offline is honoured (no login, an offline run)."""
    from services.trainer.steplog import StepLog

    _fake_wandb(monkeypatch)
    import sys

    fake = sys.modules["wandb"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    StepLog(LoggerConfig(wandb={"key": "k", "run_name": "test"}))
    assert not fake.login.called and fake.init.call_args.kwargs["mode"] == "offline"


def test_a_segment_with_no_action_token_within_max_len_is_dropped_before_the_advantages():
    """As Molt (no_action_tokens): its reward must not weigh in its group's baseline."""
    from services.trainer.batch import with_actions

    long = Segment(np.arange(10), [[8, 10]], [-1.0, -1.0], [0, 0])  # its actions lie past max_len 6
    short = Segment(np.arange(6), [[3, 5]], [-1.0, -1.0], [0, 0])
    trajs = [Trajectory("a", "g", 0, [long], reward=1.0), Trajectory("b", "g", 1, [short], reward=0.0)]
    samples = [x for t in trajs for x in samples_from_trajectory(t, 6)]
    kept, dropped = with_actions(samples)
    assert [x.trajectory_id for x in kept] == ["b"] and dropped == 1
    assert with_actions(samples[:1]) == (samples[:1], 0)  # nothing to train either way: the step still runs
