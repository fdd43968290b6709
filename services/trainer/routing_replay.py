"""MoE routing replay (R3, ``--train.routing_replay``) for HF transformers routers.

The rollout engine records, per token and MoE layer, the top-k experts it routed to
(``Segment.routed_experts`` [T, L, K], -1 = unknown). Training forwards replay that discrete choice so
the trainer computes log-probs through the same experts the sampler used; router logits and their
gradients still come from the live weights (the router keeps learning).

Supported: routers that return ``(router_logits, routing_weights, selected_experts)`` after softmax ->
top-k -> optional renormalisation (``norm_topk_prob``), i.e. transformers' ``Qwen3MoeTopKRouter`` and
the other ``*TopKRouter`` classes built the same way (Qwen2-MoE, OLMoE-style). A forward hook on each
router replaces the indices row by row (rows holding any -1 keep the live selection) and recomputes
the weights as the renormalised softmax probabilities of the replayed experts. The router's *global*
decoder-layer id is parsed from its module path (``layers.<n>``), because engines index routing by
global layer. Not supported: NeMo AutoModel's own MoE kernels (their ``RouterReplay`` is the GPU path)
and routers with grouped / sigmoid scoring (DeepSeek-V3 style), which are rejected at install time.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import Tensor, nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(global layer id, module path, module) of every top-k router, by layer id."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            m = _LAYER.search(name + ".")
            if m is None:
                raise ValueError(f"routing replay: cannot find the decoder layer id of router {name!r}")
            found.append((int(m.group(1)), name, module))
    return sorted(found, key=lambda x: x[0])


class RoutingReplay:
    """Installs hooks once; ``with replay.active(routed_experts):`` replays inside the block."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(
                "--train.routing_replay needs an MoE model with top-k routers (e.g. Qwen3-MoE); "
                f"{type(model).__name__} has none"
            )
        for _, name, module in self.routers:
            if not hasattr(module, "top_k"):
                raise ValueError(
                    f"routing replay: router {name} ({type(module).__name__}) is not a softmax top-k router"
                )
        self._targets: Tensor | None = None  # [B*T, L, K] int64
        self.replayed_rows = 0
        self._handles = [m.register_forward_hook(self._hook(layer)) for layer, _, m in self.routers]

    @contextlib.contextmanager
    def active(self, routed_experts: Tensor | None):
        """``routed_experts`` [B, T, L, K] (token axis, -1 = live); None replays nothing."""
        if routed_experts is None:
            yield
            return
        need = max(layer for layer, _, _ in self.routers) + 1
        if routed_experts.shape[2] < need:
            raise ValueError(
                f"routed_experts hold {routed_experts.shape[2]} layers but the model routes in layer "
                f"{need - 1}; the rollout engine and the trainer disagree on the model"
            )
        self._targets = routed_experts.reshape(-1, *routed_experts.shape[2:]).long()
        try:
            yield
        finally:
            self._targets = None

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output):
            if self._targets is None:
                return output
            logits, _, live = output
            target = self._targets[:, layer, :]
            if target.shape != live.shape:
                raise ValueError(
                    f"routing replay: layer {layer} routes {tuple(live.shape)} tokens x top-k, "
                    f"the trajectory holds {tuple(target.shape)}"
                )
            use = (target >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(use, target.to(live.device), live)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, indices)
            if getattr(module, "norm_topk_prob", True):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            self.replayed_rows += int(use.sum())
            return logits, weights.to(logits.dtype), indices

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def router_param_names(model: nn.Module) -> list[str]:
    """Names of the parameters of every MoE router (``*TopKRouter`` / ``*Router`` / nemo ``Gate`` modules)."""
    names = []
    for mod_name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("TopKRouter") or kind.endswith("Router") or kind == "Gate":
            for p_name, _ in module.named_parameters(recurse=False):
                names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names
