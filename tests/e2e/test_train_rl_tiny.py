"""`molt train-rl` with a Molt-shaped flag list on the tiny model, end to end, and what the run leaves.

Molt's own agent module (tests/fixtures/molt_examples/agents/math.py, unchanged), a `datasets.save_to_disk`
prompt directory, Molt's data / estimator / IS / checkpoint / logger flags. Checked from the run:
- the trainer's step log carries Molt's metric names and the agent's tensor-valued info (math_exact);
- --eval.* evaluates the eval set at step 2 without training on it (eval.jsonl, eval_<datasource>_pass<n>);
- TensorBoard event files under --logger.tensorboard_dir;
- --train.check_weight_update_equal: both pods (started together) accepted every push after their probe checks;
- a checkpoint every --ckpt.save_steps, the best one by eval_default_pass1 (Molt's --ckpt.best_metric_key), and the
  final policy in --ckpt.output_dir as an HF model directory
  that transformers and a rollout pod load, equal to `molt export` of the last checkpoint (the pod: the eval-only
  run's, which serves that policy).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
MATH = ROOT / "tests" / "fixtures" / "molt_examples" / "agents" / "math.py"


def _sums(path: Path, n: int) -> Path:
    """n "a + a" prompts with Molt's reward_model label, as a datasets.save_to_disk directory."""
    import datasets

    rows = [
        {"prompt": f"What is {a} + {a}? Put the answer in \\boxed{{}}.", "reward_model": {"ground_truth": str(2 * a)}}
        for a in range(n)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _train_rl(run: Path, flags: list[str], timeout: float = 800, command: tuple[str, ...] = ("molt.cli", "train-rl")):
    proc = subprocess.run(
        [sys.executable, "-m", *command, "--run-dir", str(run), "--no-progress", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"molt train-rl failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def molt_flags_run(tiny_qwen3, tmp_path_factory) -> Path:
    """The run folder of Molt's data / estimator / IS / checkpoint / logger flags on the tiny model (2 steps). Its
    final policy (hf/) is also the model the eval-only test evaluates: that stack's pod is the one that loads it."""
    tmp_path = tmp_path_factory.mktemp("molt_flags")
    _sums(tmp_path / "data", 8)
    run = tmp_path / "run"
    flags = [
        "--actor.model_name_or_path",
        str(tiny_qwen3),
        "--train.agent_path",
        str(MATH),
        "--data.prompt_dataset",
        str(tmp_path / "data"),
        "--data.input_key",
        "prompt",
        "--data.label_key",
        "reward_model",
        "--data.apply_chat_template",
        "--data.max_samples",
        "4",
        "--data.max_len",
        "128",
        "--rollout.batch_size",
        "2",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.max_new_tokens",
        "12",
        "--rollout.vllm_generate_batch_size",
        "2",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--actor.adam.lr",
        "1e-3",
        "--actor.entropy_coef",
        "0.01",  # random weights earn no reward: entropy still moves the policy
        "--algo.advantage.estimator",
        "grpo",
        "--algo.kl.init_coef",
        "0",
        "--algo.advantage.is_correction_level",
        "geo",
        "--algo.advantage.is_correction_threshold",
        "0.5",
        "2.0",
        "--vllm.num_engines",
        "2",  # two pods, started together; each takes every push
        "--vllm.enforce_eager",
        "--train.colocate_fsdp_models",
        "--ckpt.path",
        str(run / "ckpt"),
        "--ckpt.save_steps",
        "1",
        "--ckpt.output_dir",
        str(run / "hf"),
        "--logger.tensorboard_dir",
        str(run / "tb"),
        "--logger.wandb.run_name",
        "tiny",
        "--eval.dataset",
        str(tmp_path / "data"),
        "--eval.steps",
        "2",
        "--eval.n_samples_per_prompt",
        "2",
        "--eval.temperature",
        "0.5",
        "--train.check_weight_update_equal",
        # Molt's length penalties: past 8 of the 128 tokens every rollout (prompt + answer) pays some
        "--reward.overlong_buffer_len",
        "120",
        "--reward.stop_properly_penalty_coef",
        "0.5",
    ]
    _train_rl(run, flags, command=("molt.cli.train_rl_ray",))  # started as Molt's launch scripts start it
    return run


def test_molt_flags_train_the_tiny_model_and_leave_a_loadable_policy(molt_flags_run, tiny_qwen3, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt.cli import main as molt_cli

    run = molt_flags_run
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]  # 4 prompts / 2 per step: the dataset ends the run
    for s in steps:
        assert {"policy_loss", "actor_grad_norm", "vllm_kl", "is_filter_ratio", "math_exact"} <= set(s), sorted(s)
        assert s["samples"] == 8 and 0.0 <= s["math_exact"] <= 1.0
        # Molt's rollout statistics: 2 prompts x 4 samples, one segment each, the reward per rollout
        assert (s["rollout/num_rollouts"], s["rollout/num_prompt_groups"], s["rollout/num_samples"]) == (8, 2, 8)
        assert s["rollout/reward_mean"] == s["reward_mean"] and 0 <= s["rollout/pass1"] <= 1, s
        assert s["timing/step_total"] == s["seconds"] and s["timing/policy_train"] == s["train_seconds"] > 0
        assert s["rollout/overlong_frac"] == 1.0 and -1.0 <= s["overlong_penalty"] < 0, s
        # reward 0 (random weights) - overlong, then x0.5 for the truncated ones: the parts add up
        assert s["length_penalty"] == pytest.approx(s["overlong_penalty"] + s["stop_properly_penalty"], abs=1e-6)
    assert list((run / "tb" / "tiny").glob("events.out.tfevents.*"))
    # every push passed each pod's probe check (--train.check_weight_update_equal): both pods are at version 2
    assert json.loads((run / "summary.json").read_text())["pod_policy_versions"] == [2, 2]
    (ev,) = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]  # --eval.steps 2: at step 2
    # the whole eval set, 8 prompts x 2 (--data.max_samples 4 caps the training prompts only, as in Molt)
    assert ev["step"] == 2 and ev["eval_num_samples"] + ev["eval_failed"] == 8 * 2
    assert {"eval_default_pass1", "eval_default_pass2", "eval_truncated_rate"} <= set(ev)
    assert ev["eval_response_length_mean"] == ev["eval_default_response_length_mean"] > 0
    assert sorted(p.name for p in (run / "ckpt").glob("global_step*")) == ["global_step1", "global_step2"]
    # Molt's best checkpoint (--ckpt.best_metric_key unset: the first eval_*_pass1 metric) after the one evaluation
    best = torch.load(run / "ckpt" / "best_global_step2" / "extra_state.pt", weights_only=False)["client_state"]
    assert best["best"] == {"key": "eval_default_pass1", "value": ev["eval_default_pass1"], "step": 2}

    hf = run / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.chat_template and (hf / "config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trained, initial = load_file(str(hf / "model.safetensors")), load_file(str(tiny_qwen3 / "model.safetensors"))
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # the policy moved
    assert model.config.vocab_size >= len(tok)

    # `molt export` in this process: the same command, without a second interpreter importing torch again
    out = tmp_path / "exported"
    assert molt_cli(["export", str(run / "ckpt"), str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)


def test_molts_flash_reinforce_flags_admit_on_policy_rollouts(tiny_qwen3, tmp_path):
    """The algorithm flags of Molt's rl_flash_reinforce_r1d_1p5b.sh, unchanged, with its async queue and partial
    rollouts, at tiny sizes: one rollout per prompt, reward minus the batch mean, the binary-KL trust region
    (delta 5e-3) against vLLM's own log-probs. Rollouts of the weights being trained (step 1) are all admitted."""
    run = tmp_path / "run"
    flags = [
        *("--actor.model_name_or_path", str(tiny_qwen3), "--train.agent_path", str(MATH)),
        *("--data.prompt_dataset", str(_sums(tmp_path / "data", 8)), "--data.input_key", "prompt"),
        *("--data.label_key", "reward_model", "--data.apply_chat_template", "--data.max_samples", "8"),
        *("--data.max_len", "128", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "1"),
        *("--rollout.max_new_tokens", "12", "--rollout.temperature", "1.0", "--rollout.top_p", "1.0"),
        *("--train.batch_size", "4", "--train.micro_batch_size", "2", "--train.max_epochs", "1"),
        *("--train.async_queue_size", "8", "--train.partial_rollout_enable", "--train.force_on_policy"),
        *("--vllm.num_engines", "1", "--vllm.enforce_eager", "--actor.adam.lr", "1e-6"),
        *("--actor.adam.weight_decay", "0.1", "--actor.lr_scheduler", "cosine_with_min_lr"),
        *("--actor.loss_agg_mode", "seq-mean-token-mean", "--algo.advantage.estimator", "flash_reinforce"),
        *("--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating", "binary_kl"),
        *("--algo.advantage.is_correction_threshold", "5e-3", "--algo.kl.init_coef", "0"),
        *("--reward.clip_range", "-10", "10", "--ckpt.output_dir", str(run / "hf"), "--ckpt.save_steps", "-1"),
    ]
    _train_rl(run, flags, command=("molt.cli.train_rl_ray",))  # started as Molt's launch scripts start it
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    first = steps[0]
    assert first["samples"] == 4 and first["is_filter_ratio"] == 0.0, first
    assert abs(first["vllm_kl"]) < 1e-3, first
    assert (run / "hf" / "config.json").exists()


def test_molts_distillation_runs_without_an_agent_path(tiny_qwen3, tmp_path):
    """As Molt's distillation script: on_policy_distill with a teacher and no --train.agent_path runs the
    built-in one-completion agent; the signal is the reverse KL to the teacher, so rewards are all 0.
    One step (2 prompts, 2 per step) shows all of it: a second would add no check."""
    run = tmp_path / "run"
    flags = [
        *("--actor.model_name_or_path", str(tiny_qwen3), "--ref.model_name_or_path", str(tiny_qwen3)),
        *("--data.prompt_dataset", str(_sums(tmp_path / "data", 2)), "--data.input_key", "prompt"),
        *("--data.apply_chat_template", "--data.max_len", "128", "--rollout.batch_size", "2"),
        *("--rollout.n_samples_per_prompt", "1", "--rollout.max_new_tokens", "8", "--train.batch_size", "2"),
        *("--train.micro_batch_size", "2", "--vllm.num_engines", "1", "--vllm.enforce_eager"),
        *("--algo.advantage.estimator", "on_policy_distill", "--ckpt.save_steps", "-1"),
        *("--ckpt.disable_final_save",),
    ]
    _train_rl(run, flags, command=("molt.cli.train_rl_ray",))  # started as Molt's launch scripts start it
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and steps[0]["reward_mean"] == 0.0


def test_eval_only_scores_the_eval_set_once_and_trains_nothing(molt_flags_run, tmp_path):
    """Molt's `--eval.eval_only --eval.dataset`: one evaluation of the model, no training, no prompt dataset. The
    model is the final policy the first test's run left in its --ckpt.output_dir, as a user evaluates a trained
    one: this stack's rollout pod loads that directory and serves the eval episodes."""
    run = tmp_path / "run"
    flags = [
        *("--actor.model_name_or_path", str(molt_flags_run / "hf"), "--train.agent_path", str(MATH)),
        *("--data.input_key", "prompt", "--data.label_key", "reward_model", "--data.apply_chat_template"),
        *("--rollout.max_new_tokens", "8", "--vllm.num_engines", "1", "--vllm.enforce_eager"),
        *("--eval.eval_only", "--eval.dataset", str(_sums(tmp_path / "eval", 4)), "--eval.n_samples_per_prompt", "2"),
        *("--ckpt.path", str(run / "ckpt"), "--ckpt.output_dir", str(run / "hf")),
    ]
    _train_rl(run, flags, timeout=600)
    (ev,) = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert ev["step"] == 0 and ev["eval_num_samples"] + ev["eval_failed"] == 4 * 2
    # the pod served the trained policy: episodes came back with tokens it generated
    assert ev["eval_num_samples"] > 0 and ev["eval_response_length_mean"] > 0, ev
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["trajectories_trained"] == 0 and summary["last_eval"] == ev
    assert not (run / "ckpt").exists() and not (run / "hf").exists()
