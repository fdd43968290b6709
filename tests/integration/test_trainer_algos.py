"""Every estimator / loss family runs a real FSDP2 step in the learner, and a checkpoint restores
actor, critic, optimizers, schedulers and the KL controller exactly (the next step is bit-identical)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from molt.algorithms import compute_advantages
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer import checkpoint
from services.trainer.batch import collate, samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner
from services.trainer.model import full_state_dict, init_distributed


@pytest.fixture(scope="module")
def world():
    info = init_distributed()
    yield info
    dist.destroy_process_group()


def _samples(seed=0, truncated=()):
    """Four one-segment trajectories t0..t3 of 9..12 tokens, rewards 0, 1, 0, 1 in groups (t0, t1), (t2, t3)."""
    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory(
            f"t{i}",
            f"g{i // 2}",
            i % 2,
            [Segment(rng.integers(3, 1000, 9 + i), [[4, 9 + i]], -rng.uniform(0.5, 3, 5 + i), np.zeros(5 + i, int))],
            float(i % 2),
            status="truncated" if f"t{i}" in truncated else "completed",
        )
        for i in range(4)
    ]
    return [x for t in trajs for x in samples_from_trajectory(t, 100)]


def _settings(model, *flags):
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            str(model),
            "--train.dispatch",
            "false",
            "--fsdp.strategy",
            "torch",
            "--train.batch_size",
            "2",
            "--actor.adam.lr",
            "1e-3",
            "--rollout.n_samples_per_prompt",
            "2",
            "--actor.gradient_checkpoint",
            "off",
            *flags,
        ],
        environ={},
    )
    validate_settings(s)
    return s


CASES = {
    "gae": (["--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0"], ["value_loss", "critic_grad_norm"]),
    "reinforce_kl_reward": (["--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0.1"], ["kl"]),
    "grpo_kl_loss_entropy": (
        [
            "--algo.advantage.estimator",
            "grpo",
            "--algo.kl.use_loss",
            "--algo.kl.estimator",
            "k3",
            "--actor.entropy_coef",
            "0.01",
        ],
        ["kl_loss", "entropy"],
    ),
    "rloo_gspo_force_on_policy": (
        [
            "--algo.advantage.estimator",
            "rloo",
            "--actor.loss_mode",
            "gspo",
            "--train.force_on_policy",
            "--algo.kl.init_coef",
            "0",
        ],
        ["policy_loss"],
    ),
    "dr_grpo_cispo_geo_is": (
        [
            "--algo.advantage.estimator",
            "dr_grpo",
            "--actor.loss_mode",
            "cispo",
            "--actor.eps_clip_low_high",
            "0.2",
            "5",
            "--algo.kl.init_coef",
            "0",
            "--algo.advantage.is_correction_level",
            "geo",
            "--algo.advantage.is_correction_threshold",
            "0.01",
            "100",
        ],
        ["vllm_kl", "is_filter_ratio"],
    ),
    # FlashREINFORCE as Molt's quick-start composes it (the trust region wide open: these rollout log-probs are
    # random, so a real delta would reject every sequence)
    "flash_reinforce_binary_kl_seq_mean": (
        [
            "--algo.advantage.estimator",
            "flash_reinforce",
            "--train.force_on_policy",
            "--algo.advantage.is_correction_level",
            "seq",
            "--algo.advantage.is_correction_gating",
            "binary_kl",
            "--algo.advantage.is_correction_threshold",
            "inf",
            "--actor.loss_agg_mode",
            "seq-mean-token-mean",
            "--algo.kl.init_coef",
            "0",
        ],
        ["vllm_kl", "is_filter_ratio"],
    ),
    "grpo_tv_token_prompt_mean_kl_loss": (
        [
            "--algo.advantage.estimator",
            "grpo",
            "--algo.advantage.is_correction_level",
            "token",
            "--algo.advantage.is_correction_gating",
            "tv",
            "--algo.advantage.is_correction_threshold",
            "1",
            "--actor.loss_agg_mode",
            "prompt-mean-token-mean",
            "--algo.kl.use_loss",
            "--algo.kl.estimator",
            "k3",
        ],
        ["vllm_kl", "kl_loss"],
    ),
    # Molt's plain REINFORCE surrogate, weighed by a truncated per-token IS coefficient
    "grpo_reinforce_loss_token_is": (
        [
            "--algo.advantage.estimator",
            "grpo",
            "--actor.loss_mode",
            "reinforce",
            "--algo.advantage.is_correction_level",
            "token",
            "--algo.advantage.is_correction_mode",
            "trunc",
            "--algo.kl.init_coef",
            "0",
        ],
        ["vllm_kl", "is_filter_ratio"],
    ),
    "reinforce_baseline_dual_clip_epochs": (
        [
            "--algo.advantage.estimator",
            "reinforce_baseline",
            "--actor.dual_clip",
            "3",
            "--train.max_epochs",
            "2",
            "--algo.kl.init_coef",
            "0",
        ],
        ["policy_clip_ratio"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_algorithm_trains(case, world, tiny_qwen3):
    flags, keys = CASES[case]
    learner = Learner(_settings(tiny_qwen3, *flags), world)
    before = {k: v.clone() for k, v in full_state_dict(learner.actor).items()}
    stats = learner.train_step(_samples())
    for key in keys + ["policy_loss", "actor_grad_norm", "entropy"]:
        assert key in stats and math.isfinite(stats[key]), (key, stats)
    after = full_state_dict(learner.actor)
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-5


def test_length_penalties_shape_the_rewards_before_the_estimator(world, tiny_qwen3):
    """--data.max_len 12 with a 4-token buffer: t0..t3 (9..12 tokens) lose 0.25, 0.5, 0.75 and 1; t3 was
    truncated and -2 replaces its reward. Group (t2, t3) swaps order (-0.75 > -2), so its advantages flip."""
    flags = ["--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0", "--data.max_len", "12"]
    flags += ["--reward.overlong_buffer_len", "4", "--reward.stop_properly_penalty_coef", "-2"]
    learner = Learner(_settings(tiny_qwen3, *flags), world)
    samples = _samples(truncated={"t3"})
    stats = learner.train_step(samples)
    shaped = torch.tensor([-0.25, 0.5, -0.75, -2.0])
    expected, _ = compute_advantages(
        "grpo",
        shaped,
        collate(samples).action_mask,
        group_ids=["g0", "g0", "g1", "g1"],
        rollout_ids=["t0", "t1", "t2", "t3"],
    )
    for i, x in enumerate(samples):
        torch.testing.assert_close(x.advantages, expected[i, : x.num_tokens - 1])
    assert samples[2].advantages.max() > 0 > samples[3].advantages.min()  # unshaped, t3 (reward 1) led its group
    assert [x.reward for x in samples] == [0.0, 1.0, 0.0, 1.0]  # the raw rewards stay
    assert stats["rollout/overlong_frac"] == 1.0 and stats["overlong_penalty"] == pytest.approx(-0.625)
    assert stats["stop_properly_penalty"] == pytest.approx(-0.5) and stats["length_penalty"] == pytest.approx(-1.125)


def test_the_adaptive_kl_horizon_counts_rollouts_not_segments(world, tiny_qwen3):
    """Molt moves beta by n / horizon with n = rollouts in the step: two rollouts of two segments each are n = 2.
    The KL to the reference stays far below a target of 1, so the error clips at -0.2."""
    flags = ["--algo.kl.init_coef", "0.1", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    learner = Learner(_settings(tiny_qwen3, *flags, "--algo.kl.target", "1", "--algo.kl.horizon", "100"), world)
    rng = np.random.default_rng(0)

    def segment(n: int) -> Segment:
        return Segment(rng.integers(3, 1000, n), [[4, n]], -rng.uniform(0.5, 3, n - 4), np.zeros(n - 4, int))

    trajs = [Trajectory(f"t{i}", "g", i, [segment(9), segment(10)], float(i)) for i in range(2)]
    samples = [x for t in trajs for x in samples_from_trajectory(t, 100)]
    assert len(samples) == 4
    stats = learner.train_step(samples)
    assert stats["kl"] < 0.8
    assert learner.kl_ctl.value == pytest.approx(0.1 * (1 - 0.2 * 2 / 100))


def test_distillation_uses_the_teacher(world, tiny_qwen3, tiny_qwen3_b):
    s = _settings(
        tiny_qwen3, "--algo.advantage.estimator", "on_policy_distill", "--ref.model_name_or_path", str(tiny_qwen3_b)
    )
    assert s.algo.kl.init_coef == 1.0 and s.algo.kl.estimator == "k1" and not s.algo.kl.use_loss
    learner = Learner(s, world)
    stats = learner.train_step(_samples())
    assert stats["kl"] != 0.0 and stats["kl_coef"] == 1.0


def test_critic_warmup_freezes_the_actor(world, tiny_qwen3):
    learner = Learner(
        _settings(
            tiny_qwen3, "--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0", "--actor.freezing_steps", "1"
        ),
        world,
    )
    before = {k: v.clone() for k, v in full_state_dict(learner.actor).items()}
    stats = learner.train_step(_samples())
    assert stats["actor_frozen"] == 1.0 and stats["value_loss"] > 0
    after = full_state_dict(learner.actor)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert learner.train_step(_samples(1))["actor_frozen"] == 0.0


@pytest.mark.parametrize("optim", ["adam", "muon"])
def test_checkpoint_roundtrip_is_exact(world, tiny_qwen3, tmp_path, optim):
    flags = (
        "--actor.optim",
        optim,
        "--algo.advantage.estimator",
        "gae",
        "--algo.kl.init_coef",
        "0.05",
        "--algo.kl.target",
        "0.1",
        "--actor.lr_scheduler",
        "cosine_with_min_lr",
        "--train.num_steps",
        "10",
    )
    a = Learner(_settings(tiny_qwen3, *flags), world)
    a.train_step(_samples(0))
    checkpoint.save(str(tmp_path), a, {"version": 1, "note": "x"})
    beta_at_save = a.kl_ctl.value
    stats_a = a.train_step(_samples(1))
    weights_a = full_state_dict(a.actor)

    b = Learner(_settings(tiny_qwen3, *flags), world)
    assert checkpoint.load(str(tmp_path), b) == {"version": 1, "note": "x"}
    assert b.global_step == 1 and b.kl_ctl.value == beta_at_save != 0.05
    stats_b = b.train_step(_samples(1))
    weights_b = full_state_dict(b.actor)
    for k in ("policy_loss", "value_loss", "actor_grad_norm", "critic_grad_norm", "actor_lr", "kl_coef"):
        assert stats_a[k] == stats_b[k], k
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not list(tmp_path.glob(".tmp-*"))


def _one_step(world, model, tmp_path, trajs, *flags) -> tuple[dict, object, object]:
    """Train one step of the in-memory queue holding ``trajs``: (its step-log line, the trainer, the queue)."""
    import asyncio
    import json

    from molt.bus.memory import MemoryTrajectoryQueue
    from services.trainer.trainer import Trainer

    queue = MemoryTrajectoryQueue()
    asyncio.run(queue.put_many(trajs))
    log = tmp_path / "steps.jsonl"
    s = _settings(
        model,
        *("--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0", "--train.num_steps", "1"),
        # its final model goes next to the checkpoints, not into the working directory
        *("--logger.steps_jsonl", str(log), "--ckpt.path", str(tmp_path / "ckpt" / "checkpoints")),
        *flags,
    )
    trainer = Trainer(s, world, queue=queue)
    try:
        assert trainer.run()["steps"] == 1
    finally:
        trainer.close()
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    return line, trainer, queue


def test_trajectories_outside_the_vocabulary_are_acked_untrained(world, tiny_qwen3, tmp_path):
    good = [
        Trajectory(f"ok{i}", "g", i, [Segment([5, 6, 7, 8], [[2, 4]], [-1.0, -1.0], [0, 0])], float(i))
        for i in range(2)
    ]
    bad = [
        Trajectory(f"bad{i}", "h", i, [Segment([5, 6, 99999, 8], [[2, 4]], [-1.0, -1.0], [0, 0])], float(i))
        for i in range(2)
    ]
    line, trainer, queue = _one_step(world, tiny_qwen3, tmp_path, bad + good, "--rollout.batch_size", "1")
    assert sorted(line["trajectory_ids"]) == ["ok0", "ok1"]
    assert queue.consumed_ids == {"ok0", "ok1", "bad0", "bad1"}
    text = trainer.metrics.render()[0].decode()
    assert 'molt_trainer_trajectories_total{outcome="invalid"} 2.0' in text


def test_a_segment_without_actions_in_max_len_is_logged_as_molt_drops_it(world, tiny_qwen3, tmp_path):
    """Molt's ``rollout/dropped/no_action_tokens``: a rollout whose actions all lie past --data.max_len trains
    nothing and is counted in the step log, with dynamic filtering off."""
    ok = Trajectory("ok", "g", 0, [Segment([5, 6, 7, 8], [[2, 4]], [-1.0, -1.0], [0, 0])], 1.0)
    late = Trajectory("late", "g", 1, [Segment(list(range(5, 25)), [[16, 20]], [-1.0] * 4, [0] * 4)], 0.0)
    flags = ("--data.max_len", "12", "--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2")
    line, _, _ = _one_step(world, tiny_qwen3, tmp_path, [ok, late], *flags)
    assert sorted(line["trajectory_ids"]) == ["late", "ok"]
    assert line["rollout/dropped/no_action_tokens"] == 1 and line["rollout/dropped/total"] == 1


def test_checkpoint_retention_and_latest_fallback(world, tiny_qwen3, tmp_path):
    learner = Learner(_settings(tiny_qwen3, "--algo.kl.init_coef", "0"), world)
    for step in range(1, 5):
        learner.global_step = step
        checkpoint.save(str(tmp_path), learner, {"version": step}, max_num=2)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step3", "global_step4"]
    (tmp_path / "latest").write_text("global_step9")  # points at nothing loadable: newest complete step wins
    assert checkpoint.latest_dir(str(tmp_path)).name == "global_step4"
    assert checkpoint.load(str(tmp_path), learner) == {"version": 4}
    assert checkpoint.load(str(tmp_path / "none"), learner) is None
    # --ckpt.best_metric_key: one best checkpoint, replaced by a better one; never what a resume loads
    for step in (3, 4):
        learner.global_step = step
        best = {"key": "eval_default_pass1", "value": step / 10, "step": step}
        checkpoint.save(str(tmp_path), learner, {"best": best}, max_num=2, best=True)
    assert sorted(p.name for p in tmp_path.glob("best_*")) == ["best_global_step4"]
    assert checkpoint.best_state(str(tmp_path)) == {"best": best}
    assert (tmp_path / "latest").read_text() == "global_step9" and checkpoint.latest_dir(
        str(tmp_path)
    ).name == "global_step4"
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step3", "global_step4"]


def test_critic_max_epochs_gives_the_critic_its_own_passes(world, tiny_qwen3):
    flags = ["--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0", "--critic.max_epochs", "3"]
    learner = Learner(_settings(tiny_qwen3, *flags), world)
    stats = learner.train_step(_samples())
    assert math.isfinite(stats["value_loss"]) and learner.sched.last_epoch > 0
    assert learner.critic_sched.last_epoch == 3 * learner.sched.last_epoch  # one optimizer step per window and pass


@pytest.mark.parametrize(("packed", "tokens", "pad_to"), [(False, "12", 1), (False, "12", 16), (True, "50", 1)])
def test_dynamic_batches_by_token_budget_train_the_same_step(world, tiny_qwen3, packed, tokens, pad_to):
    """--train.dynamic_batch_enable cuts micro-batches by --train.max_tokens_per_gpu instead of sample count; the
    loss is the window's either way, so the step (and the weights it leaves) is the same. So it is with
    --train.dynamic_batch_pad_to_multiple, whose micro-batches are padded to a multiple of it."""
    flags = ["--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0", "--train.seed", "3"]
    flags += [] if packed else ["--train.pack_shared_prefix", "false"]  # packed: a group's samples share a row
    fixed = Learner(_settings(tiny_qwen3, *flags, "--train.micro_batch_size", "2"), world)
    # padded: one sample's tokens, so one sample per micro-batch; packed: both groups' tokens, so one micro-batch
    budget = ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", tokens]
    budget += ["--train.dynamic_batch_pad_to_multiple", str(pad_to)]
    dynamic = Learner(_settings(tiny_qwen3, *flags, "--train.micro_batch_size", "2", *budget), world)
    assert dynamic.packing == fixed.packing == packed
    samples = _samples()
    window = list(range(len(samples)))
    assert dynamic._my_chunks(samples, window) != fixed._my_chunks(samples, window)
    assert dynamic.pad_to == pad_to
    assert collate(samples[:1], dynamic.pad_to).input_ids.shape[1] == -(-samples[0].num_tokens // pad_to) * pad_to
    a, b = fixed.train_step(_samples()), dynamic.train_step(samples)
    assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-6)
    assert a["actor_grad_norm"] == pytest.approx(b["actor_grad_norm"], rel=1e-5)
    # The same steps mean the same clipped gradients, which AdamW's two moments hold (the mean and the mean square of
    # every step's gradient, per element). The weights are no fair test: AdamW moves a weight by ~lr * g / (|g| + eps)
    # per step, so a gradient that is ~0 up to summation order can move it by up to lr either way.
    for name in ("exp_avg", "exp_avg_sq"):
        a_moment, b_moment = _adam_moments(fixed.optim, name), _adam_moments(dynamic.optim, name)
        tol = 1e-4 * max(float(m.abs().max()) for m in a_moment)
        assert all(torch.allclose(x, y, rtol=1e-4, atol=tol) for x, y in zip(a_moment, b_moment, strict=True)), name


def _adam_moments(optim, name: str) -> list[torch.Tensor]:
    """AdamW's ``exp_avg`` or ``exp_avg_sq`` of every parameter, as full tensors."""
    moments = [optim.state[p][name] for g in optim.param_groups for p in g["params"]]
    return [m.full_tensor() if hasattr(m, "full_tensor") else m for m in moments]
