"""MoE: routing replay on HF Qwen3-MoE routers, and --actor.freeze_moe_router."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.trainer.routing_replay import RoutingReplay, find_routers, router_param_names


@pytest.fixture(scope="module")
def moe(tiny_qwen3_moe):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()


def _live_routing(model, ids):
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, layer=layer: seen.__setitem__(layer, out[2].clone()))
        for layer, _, m in find_routers(model)
    ]
    logits = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    routed = torch.stack([seen[i] for i in sorted(seen)], dim=1)  # [B*T, L, K]
    return logits, routed.reshape(ids.shape[0], ids.shape[1], *routed.shape[1:])


def test_replaying_live_routing_is_exact_and_other_routing_changes_logits(moe):
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    live_logits, routed = _live_routing(moe, ids)
    replay = RoutingReplay(moe)
    try:
        with replay.active(routed):
            same = moe(input_ids=ids).logits
        assert torch.allclose(same, live_logits, atol=1e-6)
        other = (routed + 1) % moe.config.num_experts
        with replay.active(other):
            changed = moe(input_ids=ids).logits
        assert (changed - live_logits).abs().max() > 1e-3
        unknown = torch.full_like(routed, -1)  # -1 rows keep the live selection
        with replay.active(unknown):
            assert torch.allclose(moe(input_ids=ids).logits, live_logits, atol=1e-6)
        # gradients still reach the router weights under replay
        moe.zero_grad()
        with replay.active(other):
            moe(input_ids=ids).logits.sum().backward()
        gate = find_routers(moe)[0][2]
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    finally:
        replay.remove()
        moe.zero_grad()


def test_replay_rejects_routing_of_another_model(moe):
    replay = RoutingReplay(moe)
    try:
        with pytest.raises(ValueError, match="layers"):
            with replay.active(torch.zeros(1, 4, 1, 2, dtype=torch.int16)):
                pass
    finally:
        replay.remove()


def test_router_params_found_and_frozen(moe):
    from services.trainer.model import freeze_router

    names = router_param_names(moe)
    assert names == [f"model.layers.{i}.mlp.gate.weight" for i in range(moe.config.num_hidden_layers)]
    frozen = freeze_router(moe)
    assert frozen == names
    params = dict(moe.named_parameters())
    assert not any(params[n].requires_grad for n in frozen)
    assert params["model.layers.0.mlp.experts.gate_up_proj"].requires_grad
    for n in frozen:
        params[n].requires_grad_(True)


def test_dense_model_has_no_router(tiny_qwen3):
    dense = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    assert router_param_names(dense) == []
    with pytest.raises(ValueError, match="routing_replay"):
        RoutingReplay(dense)
