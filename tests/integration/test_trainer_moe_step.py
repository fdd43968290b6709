"""A real FSDP2 train step on tiny Qwen3-MoE with --train.routing_replay and --actor.freeze_moe_router:
the router stays frozen (excluded from the optimizer and from the published weights), experts move,
and replaying the rollout's own routing keeps the trainer's old log-probs equal to a live forward; with AdamW and
with Muon, which steps each grouped expert tensor expert by expert."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.batch import samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner
from services.trainer.model import full_state_dict, init_distributed
from services.trainer.routing_replay import find_routers


@pytest.mark.parametrize("optim", ["adam", "muon"])
def test_moe_step_with_replay_and_frozen_router(tiny_qwen3_moe, optim):
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            str(tiny_qwen3_moe),
            "--train.dispatch",
            "false",
            "--fsdp.strategy",
            "torch",
            "--algo.kl.init_coef",
            "0",
            "--algo.advantage.estimator",
            "rloo",
            "--rollout.n_samples_per_prompt",
            "2",
            "--train.batch_size",
            "4",
            "--train.micro_batch_size",
            "2",
            "--actor.adam.lr",
            "1e-2",
            "--train.routing_replay",
            "--actor.freeze_moe_router",
            "--actor.optim",
            optim,
        ],
        environ={},
    )
    validate_settings(s)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(4):
        ids = torch.tensor(rng.integers(3, 1000, 10 + i))
        seen = {}
        hooks = [
            m.register_forward_hook(
                lambda mod, a, out, layer=layer, seen=seen: seen.__setitem__(layer, out[2].clone())
            )
            for layer, _, m in find_routers(ref)
        ]
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
        for h in hooks:
            h.remove()
        routed = torch.stack([seen[k] for k in sorted(seen)], dim=1).numpy()  # [T, L, K]
        seg = Segment(
            ids.numpy(), [[4, len(ids)]], logp[3:].numpy(), np.zeros(len(ids) - 4, dtype=int), routed_experts=routed
        )
        trajs.append(Trajectory(f"t{i}", f"g{i // 2}", i % 2, [seg], float(i % 2)))
    info = init_distributed()
    try:
        learner = Learner(s, info)
        assert learner.frozen_names == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
        optimized = {id(p) for g in learner.optim.param_groups for p in g["params"]}
        named = dict(learner.actor.named_parameters())
        assert not any(id(named[n]) in optimized for n in learner.frozen_names)
        samples = [x for t in trajs for x in samples_from_trajectory(t, 100)]
        stats = learner.train_step(samples)
        # old log-probs were computed with the replayed (= the sampler's own) routing: no mismatch
        assert abs(stats["mismatch_kl"]["unknown"]) < 1e-5
        assert learner.replay.replayed_rows > 0
        experts_param = named["model.layers.0.mlp.experts.gate_up_proj"]
        assert ("momentum_buffer" in learner.optim.state[experts_param]) == (optim == "muon")
        after = full_state_dict(learner.actor)
    finally:
        dist.destroy_process_group()
    before = ref.state_dict()
    for name in learner.frozen_names:
        assert torch.equal(after[name], before[name]), name
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert (after[experts] - before[experts]).abs().max() > 1e-4
