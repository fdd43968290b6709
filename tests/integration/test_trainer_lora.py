"""RL with LoRA adapters (``--actor.lora.*``) on the real trainer, in-process, with a tiny Qwen3.

Only the adapters train and only they are in the optimizer; the base weights stay bit-identical. The pods get
the merged weights under base names: every weight on the first (forced) push, then only the adapted ones. A
checkpoint resumes the adapters and their optimizer state exactly, records lora.json for `molt export`, and the
final HF export is the merged plain model plus ``adapter/`` in PEFT's layout. The policy learns the toy task of
test_trainer_learns.py through partial syncs. Refused combinations fail with one line naming the flag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer import checkpoint, lora
from services.trainer.batch import samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.export import export_checkpoint
from services.trainer.learner import Learner
from services.trainer.model import full_state_dict, init_distributed
from services.trainer.publish import CallbackPublisher
from services.trainer.trainer import Trainer

LORA = ("--actor.lora.rank", "4", "--actor.lora.alpha", "8")


@pytest.fixture(scope="module")
def world():
    info = init_distributed()
    yield info
    dist.destroy_process_group()


def _settings(model, *flags: str) -> TrainerSettings:
    s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", str(model), "--train.dispatch", "false", "--fsdp.strategy", "torch"),
            *("--algo.advantage.estimator", "rloo", "--algo.kl.init_coef", "0"),
            *("--rollout.n_samples_per_prompt", "2", "--train.batch_size", "2", "--actor.adam.lr", "1e-2"),
            *LORA,
            *flags,
        ],
        environ={},
    )
    validate_settings(s)
    return s


def _trajectories(num: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        n = 5 + i % 3
        tokens = rng.integers(3, 1000, 4 + n)
        seg = Segment(tokens, [[4, 4 + n]], -rng.uniform(0.5, 3, n), np.zeros(n, int))
        out.append(Trajectory(f"t{seed}-{i}", f"g{seed}-{i // 2}", i % 2, [seg], float(i % 2)))
    return out


def _samples(seed: int = 0):
    return [x for t in _trajectories(4, seed) for x in samples_from_trajectory(t, 100)]


def test_lora_run_trains_adapters_publishes_merged_targets_and_exports_merged(world, tiny_qwen3, tmp_path, caplog):
    base = load_file(str(tiny_qwen3 / "model.safetensors"))
    published: list[tuple[int, dict[str, torch.Tensor]]] = []
    queue = MemoryTrajectoryQueue()
    asyncio.run(queue.put_many(_trajectories(4, seed=1) + _trajectories(4, seed=2)))
    out = tmp_path / "final"
    s = _settings(
        tiny_qwen3,
        *("--rollout.batch_size", "2", "--train.num_steps", "2", "--ckpt.save_steps", "2"),
        *("--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(out)),
    )
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        trainer = Trainer(
            s,
            world,
            queue=queue,
            publisher=CallbackPublisher(lambda v, t: published.append((v, {k: x.clone() for k, x in t.items()}))),
        )
        try:
            assert trainer.run()["steps"] == 2
            state = full_state_dict(trainer.learner.actor)
            learner = trainer.learner
        finally:
            trainer.close()

    # Only the adapters train, and only they are in the optimizer; the start-up line counts them.
    adapters = {n for n, p in learner.actor.named_parameters() if p.requires_grad}
    modules = lora.adapted(state)
    assert modules and all(m.endswith("_proj") for m in modules)
    assert adapters == {f"{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    optimized = {id(p) for g in learner.optim.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in learner.actor.named_parameters() if n in adapters}
    n_train = sum(p.numel() for n, p in learner.actor.named_parameters() if n in adapters)
    n_total = sum(p.numel() for p in learner.actor.parameters())
    assert f"actor: {n_train} of {n_total} parameters train (--actor.lora.rank 4 adapters)" in caplog.text

    # (a) base weights bit-identical, adapters moved (B starts at zero)
    for name, value in base.items():
        assert torch.equal(state[name], value), name
    assert all(state[f"{m}.lora_B.weight"].abs().sum() > 0 for m in modules)

    # (b) the first, forced push: every weight (B = 0, so the base's); later ones: the merged adapted weights only
    assert [v for v, _ in published] == [0, 1, 2]
    first = published[0][1]
    assert first.keys() == state.keys() - {k for k in state if lora.is_adapter(k)}
    assert all(torch.equal(first[k], state[k]) for k in first if k in base)
    merged = lora.merge(state, 2.0)
    for _, tensors in published[1:]:
        assert set(tensors) == {f"{m}.weight" for m in modules}
    assert all(torch.equal(published[-1][1][k], merged[k]) for k in published[-1][1])
    assert any(not torch.equal(merged[f"{m}.weight"], base[f"{m}.weight"]) for m in modules)

    # (e) final export: a plain model equal to the merge, plus the adapters in PEFT's layout
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, value in plain.items():
        assert torch.equal(value, merged[name]), name
    assert not any(lora.is_adapter(k) for k in load_file(str(out / "model.safetensors")))
    config = json.loads((out / lora.ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    peft = load_file(str(out / lora.ADAPTER_DIR / "adapter_model.safetensors"))
    assert len(peft) == 2 * len(modules)

    # (d, part) the checkpoint records lora.json, so `molt export` merges offline to the same weights
    step_dir = tmp_path / "ckpt" / "global_step2"
    assert json.loads((step_dir / "hf_files" / lora.CONFIG_FILE).read_text()) == {"rank": 4, "alpha": 8.0}
    offline = load_file(str(export_checkpoint(step_dir, tmp_path / "offline") / "model.safetensors"))
    assert all(torch.equal(v, merged[k]) for k, v in offline.items())


def test_lora_resume_continues_exactly(world, tiny_qwen3, tmp_path):
    flags = ("--actor.lr_scheduler", "cosine_with_min_lr", "--train.num_steps", "10", "--train.seed", "5")
    a = Learner(_settings(tiny_qwen3, *flags), world)
    a.train_step(_samples(0))
    checkpoint.save(str(tmp_path), a, {"version": 1})
    stats_a = a.train_step(_samples(1))
    weights_a = full_state_dict(a.actor)
    optim_a = a.optim.state_dict()

    b = Learner(_settings(tiny_qwen3, *flags), world)
    assert checkpoint.load(str(tmp_path), b) == {"version": 1}
    stats_b = b.train_step(_samples(1))
    weights_b = full_state_dict(b.actor)
    for k in ("policy_loss", "actor_grad_norm", "actor_lr"):
        assert stats_a[k] == stats_b[k], k
    assert weights_a.keys() == weights_b.keys() and any(lora.is_adapter(k) for k in weights_a)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    optim_b = b.optim.state_dict()
    for key, sa in optim_a["state"].items():
        sb = optim_b["state"][key]
        assert all(torch.equal(sa[f], sb[f]) for f in ("exp_avg", "exp_avg_sq", "step")), key


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--actor.optim", "muon"],
            "--actor.optim muon with --actor.lora.rank 4: Muon's update is defined on whole weight matrices",
        ),
        (["--actor.lora.dropout", "0.1"], "--actor.lora.dropout 0.1: RL's importance ratios"),
    ],
)
def test_refused_combinations_name_the_flag(flags, needle, capsys):
    base = ["--actor.model_name_or_path", "m", "--train.dispatch", "false", *LORA]
    with pytest.raises(ValueError) as err:
        validate_settings(parse_settings(TrainerSettings, [*base, *flags], environ={}))
    assert needle in str(err.value) and "\n" not in str(err.value)
    # --dry-run validates as start-up does, and shows the block when it passes
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, [*base, "--dry-run"], environ={}, validate=validate_settings)
    shown = json.loads(capsys.readouterr().out)["actor"]["lora"]
    assert exc.value.code == 0 and shown == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["*_proj"]}


def test_target_modules_matching_nothing_name_the_actor_flag(world, tiny_qwen3):
    with pytest.raises(ValueError, match=r"^--actor.lora.target_modules q_proj: no linear layer"):
        Learner(_settings(tiny_qwen3, "--actor.lora.target_modules", "q_proj"), world)


def test_lora_policy_learns_through_partial_syncs(world, tiny_qwen3, redis_url, stream_name, tmp_path):
    """The toy task of test_trainer_learns.py: the sampler starts from the base model and only ever receives the
    merged adapted weights after the first push, so a rising reward shows the partial sync carries the policy.
    LoRA's default scale (alpha 32 at rank 4) and 40 steps: at alpha 8 or 16 steps the rise was within the noise
    of 16 samples a step, and passed or not by the machine's rounding."""
    from tests.integration.test_trainer_learns import GROUPS, N, Producer, _delete

    steps = 40

    s = _settings(
        tiny_qwen3,
        *("--algo.advantage.estimator", "grpo", "--rollout.n_samples_per_prompt", str(N)),
        *("--rollout.batch_size", str(GROUPS), "--train.batch_size", str(GROUPS * N)),
        *("--train.micro_batch_size", str(GROUPS * N), "--actor.adam.lr", "1e-1", "--train.force_sync_mode"),
        *(
            "--actor.lora.alpha",
            "32",
            "--train.num_steps",
            str(steps),
            "--redis.url",
            redis_url,
            "--redis.stream",
            stream_name,
        ),
        *("--ckpt.path", str(tmp_path / "ckpt" / "checkpoints"), "--ckpt.disable_final_save"),
        *("--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "trunc"),
    )
    producer = Producer(tiny_qwen3, redis_url, stream_name, steps)
    sizes: list[int] = []

    def publish(version, tensors):
        sizes.append(len(tensors))
        producer.publish(version, tensors)

    trainer = Trainer(s, world, publisher=CallbackPublisher(publish))
    try:
        producer.start()
        start = time.monotonic()
        assert trainer.run()["steps"] == steps
        text = trainer.metrics.render()[0].decode()
    finally:
        trainer.close()
        asyncio.run(_delete(redis_url, stream_name))
    producer.join(timeout=30)
    assert producer.error is None, producer.error
    assert sizes[0] > sizes[1] == sizes[-1]  # a full push, then the adapted weights only
    per_batch = np.array(producer.rewards).reshape(steps, GROUPS * N).mean(axis=1)
    first, last = per_batch[:5].mean(), per_batch[-5:].mean()
    print(f"reward per batch {np.round(per_batch, 3)} in {time.monotonic() - start:.1f}s")
    assert last > first + 0.25, per_batch
    # The sampler's model (base + merged adapted weights) is the trainer's policy: their log-probs agree.
    fresh = float(text.split("\nmolt_trainer_mismatch_kl_fresh ")[1].split()[0])
    assert abs(fresh) < 1e-4
