"""--actor.aux_loss_coef on tiny Qwen3-MoE, normalised as Molt: each micro-batch adds coef * aux / (micro-batches in
its optimizer window). With equal rewards the policy gradient is zero, so the router moves only through the
MoE load-balancing term."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import services.trainer.learner as learner_mod
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.batch import samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.model import full_state_dict, init_distributed


def _settings(model, coef: str):
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            str(model),
            "--train.dispatch",
            "false",
            "--fsdp.strategy",
            "torch",
            "--algo.kl.init_coef",
            "0",
            "--algo.advantage.estimator",
            "grpo",
            "--rollout.n_samples_per_prompt",
            "2",
            "--train.batch_size",
            "4",
            "--train.micro_batch_size",
            "2",
            "--actor.adam.lr",
            "1e-2",
            "--actor.aux_loss_coef",
            coef,
        ],
        environ={},
    )
    validate_settings(s)
    return s


def test_aux_loss_alone_moves_the_router_divided_by_the_windows_micro_batches(tiny_qwen3_moe, monkeypatch):
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(4):
        ids = rng.integers(3, 1000, 12)
        seg = Segment(ids, [[4, 12]], np.full(8, -1.0), np.zeros(8, dtype=int))
        trajs.append(Trajectory(f"t{i}", f"g{i // 2}", i % 2, [seg], 1.0))  # equal rewards: advantages 0
    calls = []
    real = learner_mod.moe_aux_term

    def spy(aux, coef, num_micro):
        calls.append((coef, num_micro))
        return real(aux, coef, num_micro)

    monkeypatch.setattr(learner_mod, "moe_aux_term", spy)
    info = init_distributed()
    try:
        results = {}
        for coef in ("0", "0.5"):
            learner = learner_mod.Learner(_settings(tiny_qwen3_moe, coef), info)
            before = {k: v.clone() for k, v in full_state_dict(learner.actor).items()}
            stats = learner.train_step([x for t in trajs for x in samples_from_trajectory(t, 100)])
            results[coef] = (stats["actor_grad_norm"], before, full_state_dict(learner.actor))
    finally:
        dist.destroy_process_group()
    assert results["0"][0] == 0.0 and calls[:1] == [(0.5, 2)] and len(calls) == 2  # 4 samples / micro 2 = 2
    grad_norm, before, after = results["0.5"]
    router = "model.layers.0.mlp.gate.weight"
    assert grad_norm > 0 and not torch.equal(before[router], after[router])
