"""--optim muon: Molt's grouping of the parameters, one optimizer object over torch's Muon and AdamW, and the
flags from Molt's launchers reaching it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from molt.config import parse_settings
from molt.stack import train_rl as tr
from services.trainer.config import TrainerSettings
from services.trainer.learner import build_optimizer
from services.trainer.muon import MuonAdamW, orthogonalize, param_groups
from services.trainer.sft_config import SftSettings


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        return self.lm_head(self.norm(h + self.down(torch.relu(self.up(h)))))


def _actor(*flags: str):
    argv = ["--actor.model_name_or_path", "m", "--train.dispatch", "false", "--actor.optim", "muon", *flags]
    return parse_settings(TrainerSettings, argv, environ={}).actor


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def test_groups_are_molts_matrices_to_muon_the_rest_to_adamw():
    cfg = _actor("--actor.adam.lr", "1e-3", "--actor.adam.weight_decay", "0.1", "--actor.muon.lr", "0.02")
    model = TinyLM()
    muon, adamw = param_groups(model, cfg)
    assert [p for g in muon for p in g["params"]] == [model.up.weight, model.down.weight]
    assert muon[0]["lr"] == 0.02 and muon[0]["weight_decay"] == 0.1  # unset muon weight decay: the AdamW one
    vector, embed, head = adamw
    assert vector["params"] == [model.up.bias, model.norm.weight, model.norm.bias]
    assert (vector["lr"], vector["weight_decay"]) == (1e-3, 0.1)
    assert embed["params"] == [model.embed_tokens.weight] and (embed["lr"], embed["weight_decay"]) == (1e-3, 0.0)
    assert head["params"] == [model.lm_head.weight] and head["weight_decay"] == 0.0
    assert head["lr"] == pytest.approx(0.02 / math.sqrt(6))  # muon lr / sqrt(fan_in)


class TinyExperts(nn.Module):
    """Grouped experts stored as transformers and NeMo store them: one [experts, out, in] tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.down_proj = nn.Parameter(torch.randn(3, 6, 8))


def test_grouped_experts_go_to_muon_and_other_3d_tensors_to_adamw():
    model = TinyLM()
    model.experts = TinyExperts()
    model.conv = nn.Conv1d(1, 6, 4)  # a 3-D kernel that is not experts
    muon, adamw = param_groups(model, _actor())
    matrices = [p for g in muon for p in g["params"]]
    assert any(p is model.experts.down_proj for p in matrices)
    assert all(p is not model.conv.weight for p in matrices)
    assert any(p is model.conv.weight for g in adamw for p in g["params"])


def test_a_stack_of_expert_matrices_is_orthogonalized_matrix_by_matrix():
    g = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    stacked = orthogonalize(g, 5)
    # Batched and single matmuls may take different BLAS kernels: the same math, rounded differently, and five
    # Newton-Schulz steps (coefficients up to ~4.7) grow fp32's 1e-7 to about 1e-6.
    for e in range(3):
        torch.testing.assert_close(stacked[e], orthogonalize(g[e], 5), rtol=0, atol=1e-5)
    torch.testing.assert_close(orthogonalize(g.mT, 5), stacked.mT, rtol=0, atol=1e-5)


def test_orthogonalize_brings_every_singular_value_near_one():
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-2, 2, 128))
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 100
    for x in (g, g.T):
        s = torch.linalg.svdvals(orthogonalize(x, 8))
        assert 0.5 < s.min() and s.max() < 1.5


def test_a_step_is_torchs_muon_in_full_precision_and_torchs_adamw():
    cfg = _actor("--actor.muon.weight_decay", "0.01", "--actor.muon.ns_steps", "3", "--actor.muon.no_nesterov")
    model = TinyLM()
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model)
    opt = MuonAdamW(model, cfg)
    muon_groups, adamw_groups = param_groups(ref, cfg)
    ref_opts = [
        torch.optim.Muon(muon_groups, momentum=0.95, nesterov=False, ns_steps=3),
        torch.optim.AdamW(adamw_groups, betas=(0.9, 0.95), eps=1e-8),
    ]
    for seed in range(1):  # one step: a second one's gradients would carry the first one's bf16 rounding
        _loss(model, seed).backward()
        _loss(ref, seed).backward()
        opt.step()
        opt.zero_grad()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    matrices = {id(p) for g in param_groups(model, cfg)[0] for p in g["params"]}
    for (name, a), b, b0 in zip(model.named_parameters(), ref.parameters(), before.parameters(), strict=True):
        if id(a) in matrices:  # torch orthogonalizes in bf16: the moves agree to its precision
            torch.testing.assert_close(a - b0, b - b0, rtol=0, atol=0.03 * (b - b0).abs().max().item(), msg=name)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_state_dict_roundtrip_continues_the_same_run():
    cfg = _actor()
    model = TinyLM()
    opt = MuonAdamW(model, cfg)
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _loss(model, 1).backward()
    opt.step()

    other = TinyLM()
    other.load_state_dict(saved_model)
    resumed = MuonAdamW(other, cfg)
    resumed.load_state_dict(saved_opt)
    assert "momentum_buffer" in resumed.state[other.up.weight] and "exp_avg" in resumed.state[other.up.bias]
    _loss(other, 1).backward()
    resumed.step()
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_lr_schedule_scales_every_group():
    cfg = _actor("--actor.lr_scheduler", "linear", "--actor.lr_warmup_ratio", "0")
    model = TinyLM()
    opt, sched = build_optimizer(model, cfg, total_steps=4)
    assert isinstance(opt, MuonAdamW)
    peak = [g["lr"] for g in opt.param_groups]
    _loss(model, 0).backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr * 0.75 for lr in peak])


def test_molts_muon_flags_route_to_the_trainer_and_sft_takes_them_too():
    base = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py"]
    r = tr.route([*base, "--actor.optim", "muon", "--actor.muon.lr", "0.01", "--actor.muon.ns_steps", "4"])
    actor = parse_settings(TrainerSettings, r.trainer + ["--train.dispatch", "false"], environ={}).actor
    assert (actor.optim, actor.muon.lr, actor.muon.ns_steps) == ("muon", 0.01, 4)
    # with AdamW, Molt's scripts still pass --actor.muon.*: noted, not applied
    r = tr.route([*base, "--actor.optim", "adam", "--actor.muon.lr", "0.01"])
    assert "--actor.muon.lr: only read with --actor.optim muon; AdamW runs" in r.notes
    sft = parse_settings(SftSettings, ["--optim", "muon", "--muon.momentum", "0.9"], environ={})
    assert (sft.optim, sft.muon.momentum) == ("muon", 0.9)
