"""Molt's ``--optim muon``: Muon on the hidden weight matrices, AdamW on everything else, as one optimizer.

The parameters are split as Molt splits them (after NeMo AutoModel's grouping): 2-D weight matrices go to
Muon (``--muon.lr``, ``momentum``, ``weight_decay`` (unset: the AdamW one), ``ns_steps``, ``nesterov``);
embeddings to AdamW at the AdamW learning rate without weight decay; the output head (``lm_head``, and a gae
critic's ``value_head``) to AdamW at ``muon.lr / sqrt(fan_in)`` without weight decay; biases, norms and other
tensors to AdamW with ``--adam.*``.

The Muon update is ``torch.optim.Muon``'s (momentum as an EMA, Nesterov, Keller Jordan's quintic Newton-Schulz
coefficients, the step scaled by ``sqrt(max(1, rows / cols))``) with two differences: each matrix is
orthogonalized whole (an FSDP2 shard is gathered first, so every world size computes the same update) and in the
parameters' precision (fp32 master weights), where torch rounds to bf16. Molt runs Dion's Muon, which is not on
PyPI, so updates are not bit-equal to Molt's. Grouped MoE experts (a 3-D tensor in an ``*Experts`` module, as
transformers and NeMo store them) go to Muon expert by expert, as in Molt, or to AdamW with Molt's escape hatch
``MUON_EXPERTS_ADAMW=1``; other 3-D+ tensors (convolutions) stay on AdamW.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def param_groups(model: nn.Module, cfg) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Muon groups, AdamW groups) of ``model``'s trainable parameters under the optimizer block ``cfg``."""
    modules = dict(model.named_modules())
    # Molt's escape hatch MUON_EXPERTS_ADAMW=1 (or true) puts grouped experts back on AdamW, e.g. when
    # orthogonalising expert stacks misbehaves on an expert-parallel layout.
    experts_to_muon = os.environ.get("MUON_EXPERTS_ADAMW", "") not in ("1", "true", "True")
    matrix: list[nn.Parameter] = []
    vector: list[nn.Parameter] = []
    embed: list[nn.Parameter] = []
    head: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(owner, nn.Embedding):
            embed.append(p)
        elif "lm_head" in name or name == "value_head.weight":  # the policy's output head, or the critic's
            head.append(p)
        elif name.endswith("bias") or p.ndim < 2:
            vector.append(p)
        elif p.ndim == 2 or (experts_to_muon and p.ndim == 3 and "Experts" in type(owner).__name__):
            matrix.append(p)  # a grouped experts tensor [experts, out, in]: each expert's matrix on its own
        else:
            vector.append(p)  # convolutions and other 3-D+ tensors
    adam, mu = cfg.adam, cfg.muon
    muon_wd = adam.weight_decay if mu.weight_decay is None else mu.weight_decay
    muon = [{"params": matrix, "lr": mu.lr, "weight_decay": muon_wd}] if matrix else []
    adamw = [
        {"params": vector, "lr": adam.lr, "weight_decay": adam.weight_decay},
        {"params": embed, "lr": adam.lr, "weight_decay": 0.0},
    ]
    if head:
        fan_in = head[0].shape[-1] if head[0].ndim >= 2 else max(1, head[0].numel())
        adamw.append({"params": head, "lr": mu.lr / math.sqrt(float(fan_in)), "weight_decay": 0.0})
    return muon, [g for g in adamw if g["params"]]


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iterations towards the nearest semi-orthogonal matrix of ``update`` (Muon's step), over its
    last two dimensions (a stack of expert matrices is orthogonalized matrix by matrix)."""
    a, b, c = NS_COEFFICIENTS
    tall = update.shape[-2] > update.shape[-1]
    x = update.mT if tall else update
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon groups then AdamW groups in one optimizer: the Muon ones stepped here, the AdamW ones by a fused
    ``torch.optim.AdamW`` that shares this optimizer's ``param_groups`` and ``state``, so the LR scheduler,
    clipping and DCP checkpoints (``get_state_dict`` / ``set_state_dict``) see a single optimizer."""

    def __init__(self, model: nn.Module, cfg) -> None:
        muon_groups, adamw_groups = param_groups(model, cfg)
        mu, adam = cfg.muon, cfg.adam
        for g in muon_groups:
            g.update(momentum=mu.momentum, nesterov=mu.nesterov and not mu.no_nesterov, ns_steps=mu.ns_steps)
        self._adamw = None
        if adamw_groups:
            self._adamw = torch.optim.AdamW(adamw_groups, betas=tuple(adam.betas), eps=adam.eps, fused=True)
        self._n_muon = len(muon_groups)
        groups = muon_groups + (self._adamw.param_groups if self._adamw is not None else [])
        super().__init__(groups, defaults={})
        self._bind()

    def _bind(self) -> None:
        """Point the inner AdamW at this optimizer's groups and state (again after ``load_state_dict``, which
        replaces the group dicts)."""
        if self._adamw is not None:
            self._adamw.param_groups = self.param_groups[self._n_muon :]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        sharded = 0  # DTensor matrices so far: the i-th is orthogonalized by rank i mod the mesh size
        for group in self.param_groups[: self._n_muon]:
            lr, mom = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                o: torch.Tensor
                if isinstance(p, DTensor):
                    o = self._orthogonalize_sharded(update, group["ns_steps"], sharded)
                    sharded += 1
                else:
                    o = orthogonalize(update, group["ns_steps"])
                rows, cols = p.shape[-2:]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(o, alpha=-lr * math.sqrt(max(1.0, rows / cols)))
        if self._adamw is not None:
            self._adamw.step()
        return None

    @staticmethod
    def _orthogonalize_sharded(update: DTensor, steps: int, index: int) -> DTensor:
        """Every rank gathers the whole update. On a 1-D mesh (FSDP alone) one rank runs Newton-Schulz and
        scatters the shards, so the ranks share the matrices' cost instead of each repeating all of it; on more
        dimensions (TP, HSDP) every rank orthogonalizes and keeps its own shard. The result is the same."""
        whole = update.full_tensor()
        mesh = update.device_mesh
        if mesh.ndim > 1:
            return distribute_tensor(orthogonalize(whole, steps), mesh, update.placements, src_data_rank=None)
        owner = index % mesh.size()
        o = orthogonalize(whole, steps).contiguous() if mesh.get_local_rank() == owner else torch.empty_like(whole)
        return distribute_tensor(o, mesh, update.placements, src_data_rank=owner)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._bind()
