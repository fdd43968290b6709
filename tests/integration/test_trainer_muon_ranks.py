"""Muon under FSDP2 on two real gloo processes: the ranks split the Newton-Schulz work (each weight matrix is
orthogonalized on one rank and its shards scattered) and the step equals one process's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from molt.config import parse_settings
from molt.net import free_port

pytestmark = pytest.mark.timeout(300)
STEPS = 2


class TinyLM(nn.Module):
    """Two Muon matrices (up, down) between an embedding and a head that AdamW steps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 8, bias=False)
        self.down = nn.Linear(8, 6, bias=False)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        return self.lm_head(h + self.down(torch.relu(self.up(h))))


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _optimizer(model: nn.Module):
    from services.trainer.config import TrainerSettings
    from services.trainer.muon import MuonAdamW

    argv = ["--actor.model_name_or_path", "m", "--train.dispatch", "false", "--actor.optim", "muon"]
    actor = parse_settings(TrainerSettings, [*argv, "--actor.muon.ns_steps", "3"], environ={}).actor
    return MuonAdamW(model, actor)


def _train(model: nn.Module) -> None:
    opt = _optimizer(model)
    for seed in range(STEPS):
        ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(seed))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from services.trainer import muon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls: list[tuple[int, ...]] = []
    plain = muon.orthogonalize

    def counted(x: torch.Tensor, steps: int) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return plain(x, steps)

    muon.orthogonalize = counted
    model = _model()
    for layer in (model.up, model.down, model.lm_head):
        fully_shard(layer)
    fully_shard(model)
    _train(model)
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    out[rank] = (calls, weights)
    dist.destroy_process_group()


def test_two_ranks_split_the_orthogonalization_and_step_as_one_process():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
        results = dict(out)
    one = _model()
    _train(one)
    # up (8x6) and down (6x8) are the Muon matrices: one each per rank and step, none twice
    assert sorted(results[0][0] + results[1][0]) == sorted([(8, 6), (6, 8)] * STEPS)
    assert len(results[0][0]) == len(results[1][0]) == STEPS
    for rank in (0, 1):
        for name, p in one.named_parameters():
            torch.testing.assert_close(results[rank][1][name], p.detach(), rtol=0, atol=1e-5, msg=name)
