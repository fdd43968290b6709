"""Rollout-side rules Molt's own unit tests pin down, checked on our services (unit level, no vLLM engine).

Covered: how a pod builds vLLM sampling params from the wire (defaults, seeds, logprobs, limits), how
generation and prompt log-probs are read off vLLM's outputs, that a session's turns stay on one pod,
routed-expert capture and replay by global layer id, the tied lm_head in weight sync, and the trainer's
next-token log-probs (shift by one, temperature on both log-probs and entropy).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from torch import nn

from services.rollout.params import Limits, RolloutInputError, check_sampling, to_vllm

LIMITS = Limits(vocab_size=1000, max_model_len=64, max_n=8)


# ---- sampling params: wire -> vLLM SamplingParams


def test_unset_knobs_are_sent_as_neutral_values_never_left_to_the_checkpoint():
    # An omitted knob must not fall back to the checkpoint's generation_config (e.g. top_k=20), or the
    # rollout would sample, and renormalize its logprobs, differently from the training config.
    sp = to_vllm(check_sampling({}, 4, LIMITS), 0)
    assert sp.top_k in (-1, 0)  # both mean "off" in vLLM
    assert (sp.top_p, sp.min_p, sp.temperature) == (1.0, 0.0, 1.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert sp.skip_special_tokens is False  # raw action tokens, specials included


def test_every_knob_set_reaches_vllm():
    wire = {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_tokens": 5, "stop_token_ids": [7]}
    sp = to_vllm(check_sampling(wire, 4, LIMITS), 0)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_tokens) == (8, 0.7, 0.9, 20, 5)
    assert sp.stop_token_ids == [7]


def test_the_sampled_tokens_logprob_is_asked_for_by_default():
    # logprobs=0 in vLLM returns the sampled token's own logprob (what importance correction needs).
    assert to_vllm(check_sampling({}, 4, LIMITS), 0).logprobs == 0
    assert to_vllm(check_sampling({"logprobs": False}, 4, LIMITS), 0).logprobs is None
    assert to_vllm(check_sampling({"top_logprobs": 3}, 4, LIMITS), 0).logprobs == 3


def test_sample_i_is_seeded_with_seed_plus_i_and_minus_one_means_unseeded():
    checked = check_sampling({"n": 3, "seed": 7}, 4, LIMITS)
    assert [to_vllm(checked, i).seed for i in range(3)] == [7, 8, 9]
    unseeded = check_sampling({"n": 2, "seed": -1}, 4, LIMITS)
    assert [to_vllm(unseeded, i).seed for i in range(2)] == [None, None]


def test_max_tokens_past_the_context_left_is_refused_naming_the_room():
    with pytest.raises(RolloutInputError, match="lower max_tokens to <= 4") as err:
        check_sampling({"max_tokens": 5}, 60, LIMITS)
    assert err.value.code == "context_length_exceeded" and err.value.param == "sampling_params.max_tokens"
    assert check_sampling({"max_tokens": 4}, 60, LIMITS)["max_tokens"] == 4


def test_min_tokens_above_max_tokens_is_refused_by_the_pod():
    with pytest.raises(RolloutInputError) as err:
        check_sampling({"max_tokens": 4, "min_tokens": 5}, 4, LIMITS)
    assert err.value.param == "sampling_params.min_tokens"


def _gateway_sampling(session_params: dict, remaining: int) -> dict:
    from services.gateway.generation import turn_sampling

    return turn_sampling(session_params, {}, remaining)


def test_gateway_caps_max_tokens_at_the_context_left():
    assert _gateway_sampling({"max_tokens": 100}, 20)["max_tokens"] == 20
    assert _gateway_sampling({}, 20)["max_tokens"] == 20  # unset: all the room left
    assert _gateway_sampling({"max_tokens": 8}, 20)["max_tokens"] == 8


def test_gateway_clamps_min_tokens_down_with_max_tokens():
    sp = _gateway_sampling({"max_tokens": 100, "min_tokens": 50}, 20)
    assert sp["max_tokens"] == 20 and sp["min_tokens"] <= sp["max_tokens"]
    check_sampling(sp, 44, LIMITS)  # the pod accepts what the gateway sends


# ---- log-probs read off vLLM's outputs


def _lp(value: float) -> NS:
    return NS(logprob=value, rank=1)


def test_generation_and_prompt_logprobs_are_those_of_the_actual_tokens():
    from services.rollout.engine_thread import EngineThread, _Group, _Job

    job = _Job(group=_Group(future=None, version=0, remaining=1))  # type: ignore[arg-type]
    finished: list = []
    me = NS(_progress=[], routing=None, _finish=lambda j, reason, stop: finished.append((j, reason)))
    comp = NS(
        token_ids=[5, 6],
        logprobs=[{9: _lp(-0.1), 5: _lp(-0.5)}, {6: _lp(-0.7)}],
        finish_reason="length",
        stop_reason=None,
        routed_experts=None,
    )
    out = NS(
        request_id="r",
        outputs=[comp],
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=[None, {2: _lp(-1.0), 8: _lp(-0.2)}, {3: _lp(-2.0)}],
        finished=True,
    )
    EngineThread._dispatch(me, [out], {"r": job})  # type: ignore[arg-type]
    assert job.token_ids == [5, 6] and job.logprobs == [-0.5, -0.7]  # the sampled token's, not the best
    assert job.prompt_logprobs == [-1.0, -2.0]  # the first prompt token has none
    assert finished == [(job, "length")]


# ---- a session's turns go to one pod


def test_a_sessions_turns_stay_on_its_pod_even_when_another_is_less_loaded():
    from services.gateway.generation import generate_with_failover
    from services.gateway.pods import Generation, Pod

    busy, idle = Pod("http://a", inflight=9, sessions=9), Pod("http://b")
    calls: list[str] = []

    async def generate(pod, prompt_ids, sp, on_tokens=None, images=None):
        calls.append(pod.url)
        return [Generation([1], [-0.1], "stop", 0, pod.url)]

    pool = NS(
        pods={p.url: p for p in (busy, idle)}, pick=lambda exclude=(): idle, generate=generate, get=lambda u: None
    )
    session = NS(id="s", pod="http://a", capture=NS(segments=[]), turns=1)
    for _ in range(3):
        asyncio.run(generate_with_failover(pool, None, session, [1, 2], {}))  # type: ignore[arg-type]
    assert calls == ["http://a"] * 3 and session.pod == "http://a"


# ---- routed experts: capture on the pod, replay by global layer id


class _FakeLLM:
    """Just enough of vLLM's LLMEngine for a routing pass: one prefill whose gates record every fed token."""

    def __init__(self) -> None:
        self.fed: list[int] = []
        self._busy = False

    def has_unfinished_requests(self) -> bool:
        return self._busy

    def collective_rpc(self, method: str):
        if method == "rollout_routing_take":
            rows = np.arange(len(self.fed) * 2 * 2, dtype=np.int16).reshape(len(self.fed), 2, 2)
            return [rows]
        return [None]

    def add_request(self, request_id, prompt, params) -> None:
        assert params.skip_reading_prefix_cache  # every token computed, none read back from the cache
        self.fed = list(prompt["prompt_token_ids"])
        self._busy = True

    def step(self) -> None:
        self._busy = False


def test_routing_covers_prompt_and_completion_from_position_zero():
    from services.rollout.routing import RoutingRecorder

    rows = RoutingRecorder().record(_FakeLLM(), [1, 2, 3, 4, 5], max_model_len=64)
    assert rows.shape == (5, 2, 2) and rows.dtype == np.int16
    assert rows[0].tolist() == [[0, 1], [2, 3]]  # row 0 is the first prompt token's


def test_a_sequence_that_fills_the_context_leaves_its_last_row_to_live_routing():
    from services.rollout.routing import RoutingRecorder

    llm = _FakeLLM()
    rows = RoutingRecorder().record(llm, [1, 2, 3, 4], max_model_len=4)
    assert llm.fed == [1, 2, 3] and rows.shape == (4, 2, 2)
    assert (rows[-1] == -1).all() and (rows[:-1] >= 0).all()


class _FakeTopKRouter(nn.Module):
    """Shaped like transformers' *TopKRouter: returns (router_logits, routing_weights, selected_experts)."""

    def __init__(self, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(experts, 4))

    def forward(self, x):
        logits = x @ self.weight.T
        weights, idx = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        return logits, weights, idx


class _Hybrid(nn.Module):
    """MoE gates at the sparse global layer ids 1 and 3 of a 5-layer backbone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Module() if i not in (1, 3) else _module(mlp=_FakeTopKRouter()) for i in range(5)
        )


def _module(**children: nn.Module) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


def test_replay_picks_each_gates_own_global_layer_row():
    from services.trainer.routing_replay import RoutingReplay

    torch.manual_seed(0)
    model = _Hybrid()
    replay = RoutingReplay(model)
    assert [layer for layer, _, _ in replay.routers] == [1, 3]
    b, t, layers, k = 1, 3, 5, 2
    routed = torch.zeros(b, t, layers, k, dtype=torch.int16)
    for layer in range(layers):
        routed[:, :, layer] = torch.tensor([layer, (layer + 1) % 8], dtype=torch.int16)
    routed[0, 2] = -1  # a token without captured routing keeps the live choice
    x = torch.randn(b * t, 4)
    live = model.layers[3].mlp(x)[2]
    with replay.active(routed):
        _, weights, idx = model.layers[3].mlp(x)
    assert idx[:2].tolist() == [[3, 4], [3, 4]]  # layer 3's rows, not the 2nd gate's row (layer 1)
    assert torch.equal(idx[2], live[2])
    torch.testing.assert_close(weights.sum(-1), torch.ones(t))  # renormalized over the replayed experts


def test_batches_pad_routing_with_the_live_sentinel_seq_aligned():
    from services.trainer.batch import collate

    def sample(n: int, routed: torch.Tensor | None):
        return NS(
            num_tokens=n,
            tokens=torch.arange(n),
            action_mask=torch.ones(n - 1, dtype=torch.bool),
            rollout_logp=torch.zeros(n - 1),
            old_logp=None,
            ref_logp=None,
            values=None,
            advantages=None,
            returns=None,
            routed_experts=routed,
            images=[],
            top_ids=None,
            top_logprobs=None,
        )

    have = sample(2, torch.zeros(2, 3, 2, dtype=torch.int16))
    missing = sample(4, None)  # the longest sample carries no routing
    mb = collate([missing, have])  # type: ignore[list-item]
    assert mb.routed_experts is not None and mb.routed_experts.shape == (2, 4, 3, 2)
    assert (mb.routed_experts[0] == -1).all()  # no routing: live everywhere, never expert 0
    assert (mb.routed_experts[1, :2] == 0).all() and (mb.routed_experts[1, 2:] == -1).all()
    assert collate([sample(2, None), sample(3, None)]).routed_experts is None  # type: ignore[list-item]


# ---- weight sync: the tied lm_head


def test_tied_lm_head_skip_is_an_exact_name_match():
    from molt.weightsync.manifest import select_tensors

    state = {
        "model.embed_tokens.weight": torch.ones(4, 2),
        "_orig_mod.lm_head.weight": torch.ones(4, 2),  # a torch.compile wrapper prefix: still the lm_head
        "mtp.lm_head.weight": torch.ones(4, 2),
        "draft.lm_head.weight": torch.ones(4, 2),
    }
    send, _ = select_tensors(state.items(), tie_word_embeddings=True)
    assert [n for n, _ in send] == ["model.embed_tokens.weight", "mtp.lm_head.weight", "draft.lm_head.weight"]
    send, _ = select_tensors(state.items(), tie_word_embeddings=False)
    assert "lm_head.weight" in [n for n, _ in send]


# ---- trainer: logits -> next-token log-probs


def test_step_k_scores_token_k_plus_one_at_the_rollout_temperature():
    from services.trainer.learner import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    temp = 0.6
    logp, entropy = token_logprobs(logits, ids, temp)
    assert logp.shape == entropy.shape == (2, 4)  # the last position has no next token
    scaled = torch.log_softmax(logits / temp, -1)
    torch.testing.assert_close(logp, scaled[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1))
    # entropy is of the same temperature-scaled distribution the log-probs come from
    torch.testing.assert_close(entropy, -(scaled.exp() * scaled).sum(-1)[:, :-1])


def test_half_precision_logits_are_scored_in_fp32():
    from services.trainer.learner import token_logprobs

    logits = torch.randn(1, 3, 7).to(torch.bfloat16)
    logp, _ = token_logprobs(logits, torch.tensor([[1, 2, 3]]), 0.7)
    assert logp.dtype == torch.float32
    ref = torch.log_softmax(logits.float() / 0.7, -1)[:, :-1].gather(-1, torch.tensor([[[2], [3]]])).squeeze(-1)
    torch.testing.assert_close(logp, ref)


# ---- engine configuration defaults


def test_engine_returns_processed_logprobs_and_starts_without_prefix_caching():
    # processed: post-temperature log-probs, what the trainer recomputes; prefix caching off by default
    # because a weight update invalidates cached prefixes.
    from services.rollout.config import VllmKnobs

    knobs = VllmKnobs()
    assert knobs.logprobs_mode == "processed_logprobs"
    assert knobs.enable_prefix_caching is False
