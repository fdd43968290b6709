"""``--critic.optim muon``: the gae critic the learner builds steps with Muon (its backbone's weight matrices in
the Muon group, embeddings, norms and biases with AdamW), while the actor keeps its own ``--actor.optim``
(docs/trainer.md, Muon). A real one-process learner on the tiny model takes one gae step."""

from __future__ import annotations

import pytest
import torch

from molt.config import parse_settings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner
from services.trainer.model import DistInfo
from services.trainer.muon import MuonAdamW
from tests.integration.test_trainer_algos import _samples


@pytest.fixture(scope="module")
def learner(tiny_qwen3):
    import torch.distributed as dist

    s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", str(tiny_qwen3), "--train.dispatch", "false", "--fsdp.strategy", "torch"),
            *("--train.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--actor.gradient_checkpoint", "off"),
            *("--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0", "--critic.optim", "muon"),
        ],
        environ={},
    )
    validate_settings(s)
    # A one-process gloo group, as one_process_group gives, held for the module: the critic is FSDP2-sharded.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Learner(s, DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"))
    finally:
        if owned:
            dist.destroy_process_group()


def test_the_critics_weight_matrices_are_in_the_muon_group_and_the_rest_in_adamw(learner):
    opt = learner.critic_optim
    assert isinstance(opt, MuonAdamW)
    # The actor was left on its default: the flag reaches the critic's optimizer only.
    assert not isinstance(learner.optim, MuonAdamW)
    muon = {id(p) for g in opt.param_groups[: opt._n_muon] for p in g["params"]}
    adamw = {id(p) for g in opt.param_groups[opt._n_muon :] for p in g["params"]}
    embeddings = {id(m.weight) for m in learner.critic.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = {id(p) for n, p in learner.critic.named_parameters() if p.ndim == 2 and n.startswith("model.layers.")}
    assert matrices and matrices <= muon
    assert embeddings and embeddings <= adamw
    vectors = {id(p) for p in learner.critic.parameters() if p.ndim < 2}
    assert vectors and vectors <= adamw and not muon & adamw
    assert {id(p) for p in learner.critic.parameters()} == muon | adamw
    # The value head is the critic's output head: AdamW, as the policy's lm_head (a [1, hidden] matrix has no
    # orthogonal update worth the name).
    assert id(learner.critic.value_head.weight) in adamw


def test_a_gae_step_updates_the_critics_matrices_through_muon(learner):
    layer = next(p for n, p in learner.critic.named_parameters() if n.startswith("model.layers.") and p.ndim == 2)
    before = layer.detach().clone()
    stats = learner.train_step(_samples())
    assert stats["value_loss"] > 0
    # Muon keeps a momentum buffer per matrix (AdamW keeps exp_avg): its presence says which rule stepped it.
    assert "momentum_buffer" in learner.critic_optim.state[layer]
    assert "exp_avg" not in learner.critic_optim.state[layer]
    assert not torch.equal(layer.detach(), before)
    embed = next(m.weight for m in learner.critic.modules() if isinstance(m, torch.nn.Embedding))
    assert "exp_avg" in learner.critic_optim.state[embed]
