"""--rollout.rescore_logprobs through a real gateway, a real pod (vLLM, tiny model, fp32) and Redis: a finished
segment's action logprobs are exactly the pod's own prefill logprobs of the segment, and close to the decode-time
ones the client was shown; a segment sampled at temperature 0.7 keeps its decode logprobs (vLLM's prompt logprobs
are the raw log-softmax, its decode ones the tempered distribution's)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from services.gateway.rescore import action_positions
from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

# Largest |decode - prefill| logprob allowed on this model. Both passes run fp32 on the CPU and were measured
# equal bit for bit (0 over 2135 action tokens of 3-turn sessions); the bound leaves room for a CPU whose
# kernels split the decode and prefill sums differently, and is far below what temperature 0.7 changes.
DECODE_PREFILL_ATOL = 1e-5


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gw")
    flags = ["--rollout.rescore_logprobs"]
    with pod_and_gateway(tiny_qwen3, logs, redis_url, "gateway-rescore", gateway=flags) as (url, pod, stream):
        yield {"url": url, "pod": pod, "redis": redis_url, "stream": stream}


def _two_turns(url: str, sampling: dict) -> tuple[str, list[float]]:
    """A two-turn chat session through the openai SDK, finished: its id and the decode logprobs the client was
    shown, in action-token order."""
    s = httpx.post(url + "/v1/sessions", json={"sampling_params": {"max_tokens": 12, **sampling}}).json()
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    msgs: list = [{"role": "user", "content": "Count to three."}]
    shown: list[float] = []
    for seed, more in ((1, "Again."), (2, None)):
        r = client.chat.completions.create(model="policy", messages=msgs, seed=seed, logprobs=True)
        shown += [t.logprob for t in r.choices[0].logprobs.content]
        if more:
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": more}]
    done = httpx.post(f"{url}/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0}).json()
    assert done["written"], done
    return s["session_id"], shown


def _segment(stack, sid: str):
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    [seg] = traj.segments
    assert len(seg.action_spans) == 2  # one segment, both turns
    return seg


def test_the_trajectory_holds_the_pods_prefill_logprobs(stack):
    sid, shown = _two_turns(stack["url"], {})
    seg = _segment(stack, sid)
    probe = httpx.post(f"{stack['pod']}/v1/prompt_logprobs", json={"token_ids": seg.token_ids.tolist()}, timeout=60)
    body = probe.json()
    assert body["policy_version"] == 0 and (seg.versions == 0).all()
    prefill = np.asarray(body["logprobs"], np.float32)[action_positions(seg) - 1]
    np.testing.assert_array_equal(seg.logprobs, prefill)
    decode = np.asarray(shown, np.float32)
    assert decode.shape == seg.logprobs.shape
    gap = float(np.abs(decode.astype(np.float64) - prefill).max())
    print(f"max |decode - prefill| = {gap:.3g} over {decode.size} action tokens")
    assert gap <= DECODE_PREFILL_ATOL
    metrics = httpx.get(stack["url"] + "/metrics").text
    assert "molt_gateway_rescored_segments_total 1.0" in metrics
    assert "molt_gateway_rescore_max_abs_diff_count 1.0" in metrics


def test_a_tempered_segment_keeps_its_decode_logprobs(stack):
    sid, shown = _two_turns(stack["url"], {"temperature": 0.7})
    seg = _segment(stack, sid)
    np.testing.assert_array_equal(seg.logprobs, np.asarray(shown, np.float32))
    probe = httpx.post(f"{stack['pod']}/v1/prompt_logprobs", json={"token_ids": seg.token_ids.tolist()}, timeout=60)
    prefill = np.asarray(probe.json()["logprobs"], np.float32)[action_positions(seg) - 1]
    assert np.abs(prefill - seg.logprobs).max() > 1e-3  # the raw distribution's: not what was sampled from
    assert (
        'molt_gateway_rescore_kept_segments_total{reason="sampling"} 1.0' in httpx.get(stack["url"] + "/metrics").text
    )


def test_a_moe_segment_takes_logprobs_and_routing_from_one_prefill_pass(tiny_qwen3_moe, redis_url, tmp_path):
    """With routing replay (--rollout.return_routed_experts) a rescored segment carries the prefill pass's routing
    with its logprobs: the trainer replays the routing its logprobs came from."""
    flags = ["--rollout.return_routed_experts", "--rollout.rescore_logprobs"]
    pod = {"max_model_len": 512}
    with pod_and_gateway(tiny_qwen3_moe, tmp_path, redis_url, "rescore-moe", 511, pod, flags) as (
        url,
        pod_url,
        stream,
    ):
        stack = {"url": url, "pod": pod_url, "redis": redis_url, "stream": stream}
        sid, _ = _two_turns(url, {})
        seg = _segment(stack, sid)
        body = {"token_ids": seg.token_ids.tolist(), "return_routed_experts": True}
        probe = httpx.post(f"{pod_url}/v1/prompt_logprobs", json=body, timeout=60).json()
        prefill = np.asarray(probe["logprobs"], np.float32)[action_positions(seg) - 1]
        np.testing.assert_array_equal(seg.logprobs, prefill)
        rows = probe["routed_experts"]
        assert rows["shape"] == [seg.num_tokens, 2, 2]
        routing = np.frombuffer(base64.b64decode(rows["data"]), "<i2").reshape(rows["shape"])
        np.testing.assert_array_equal(seg.routed_experts, routing)
        assert (seg.routed_experts >= 0).all()
        assert "molt_gateway_rescored_segments_total 1.0" in httpx.get(url + "/metrics").text
