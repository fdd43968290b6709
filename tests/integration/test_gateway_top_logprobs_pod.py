"""--rollout.top_logprobs through a real gateway, a real pod (vLLM, tiny model) and Redis: the trajectory's rows are
the sampler's top-k at each action token, consistent with the sampled token's own recorded logprob, on plain,
streamed and token-level turns; a client asking for more gets its own count, the same alternatives first."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.gateway_testlib import pod_and_gateway, read_trajectories

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

K = 4


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gw")
    flags = ["--rollout.top_logprobs", str(K)]
    with pod_and_gateway(tiny_qwen3, logs, redis_url, "gateway-top-logprobs", gateway=flags) as (url, _pod, stream):
        yield {"url": url, "redis": redis_url, "stream": stream}


def _check_rows(seg, k: int = K) -> None:
    a = seg.num_action_tokens
    assert a > 0 and seg.top_ids.shape == seg.top_logprobs.shape == (a, k)
    top = seg.top_logprobs.astype(np.float64)
    assert (top[:, :-1] >= top[:, 1:]).all() and (top <= 0).all()  # best first, logprobs
    sampled = seg.token_ids[seg.action_mask()]
    for row_ids, row_lps, tok, own in zip(seg.top_ids, top, sampled, seg.logprobs):
        hit = np.flatnonzero(row_ids == tok)
        if hit.size:
            assert abs(row_lps[hit[0]] - own) <= 1e-4, (tok, own, row_ids, row_lps)
        else:
            assert own <= row_lps[-1] + 1e-4, (tok, own, row_ids, row_lps)


def test_the_trajectory_holds_the_samplers_top_k_per_action_token(stack):
    url = stack["url"]
    s = httpx.post(url + "/v1/sessions", json={"sampling_params": {"max_tokens": 12}}).json()
    client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
    msgs = [{"role": "user", "content": "Count to three."}]
    r = client.chat.completions.create(model="policy", messages=msgs, seed=1)
    assert r.choices[0].logprobs is None  # the client did not ask
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Again."}]
    asked = client.chat.completions.create(model="policy", messages=msgs, seed=2, logprobs=True, top_logprobs=6)
    shown = asked.choices[0].logprobs.content
    assert shown and all(len(t.top_logprobs) == 6 for t in shown)
    msgs += [{"role": "assistant", "content": asked.choices[0].message.content}, {"role": "user", "content": "More."}]
    list(client.chat.completions.create(model="policy", messages=msgs, seed=3, stream=True))
    done = httpx.post(f"{url}/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0}).json()
    assert done["written"]
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == s["session_id"]]
    for seg in traj.segments:
        _check_rows(seg)
    # The second turn's tokens: the client's six alternatives begin with the trajectory's four.
    seg = traj.segments[0]
    assert len(seg.action_spans) == 3
    start = int(seg.action_spans[0, 1] - seg.action_spans[0, 0])
    for i, tok in enumerate(shown):
        np.testing.assert_allclose(
            [x.logprob for x in tok.top_logprobs[:K]], seg.top_logprobs[start + i], rtol=0, atol=1e-4
        )


def test_token_level_turns_record_rows_too(stack):
    url = stack["url"]
    sid = httpx.post(url + "/v1/sessions", json={}).json()["session_id"]
    msgs = [{"role": "user", "content": "Say a word."}]
    first = httpx.post(
        f"{url}/v1/sessions/{sid}/generate", json={"messages": msgs, "sampling_params": {"max_tokens": 8}}
    )
    assert first.status_code == 200, first.text
    # top_k 2: the pod's logprobs are the ones sampled from (processed), so two per token are finite and the
    # pod's rows are short; the trajectory's are padded with id 0 and -inf.
    more = {"append_text": "\nAnother.", "sampling_params": {"max_tokens": 8, "top_k": 2, "seed": 4}}
    assert httpx.post(f"{url}/v1/sessions/{sid}/generate", json=more).status_code == 200
    assert httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 0.0}).json()["written"]
    [traj] = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    [seg] = traj.segments
    assert len(seg.action_spans) == 2
    _check_rows(seg)
    first_turn = int(seg.action_spans[0, 1] - seg.action_spans[0, 0])
    assert np.isfinite(seg.top_logprobs[:first_turn]).all()
    assert (
        np.isfinite(seg.top_logprobs[first_turn:, :2]).all() and np.isneginf(seg.top_logprobs[first_turn:, 2:]).all()
    )
    assert (seg.top_ids[first_turn:, 2:] == 0).all()


def test_a_head_wider_than_20_with_pods_raised_to_it(tiny_qwen3, redis_url, tmp_path):
    """K = 24 (above OpenAI's 20): pods started with --vllm.max_logprobs 24 return that many rows, and the
    trajectory holds them; a client still gets at most its own 20."""
    flags = ["--rollout.top_logprobs", "24"]
    pod = {"extra": ["--vllm.max_logprobs", "24"]}
    with pod_and_gateway(tiny_qwen3, tmp_path, redis_url, "gateway-wide-head", pod=pod, gateway=flags) as stack:
        url, _pod, stream = stack
        s = httpx.post(url + "/v1/sessions", json={"sampling_params": {"max_tokens": 8}}).json()
        client = openai.OpenAI(base_url=s["openai_base_url"], api_key="EMPTY")
        msgs = [{"role": "user", "content": "Name a color."}]
        r = client.chat.completions.create(model="policy", messages=msgs, seed=5, logprobs=True, top_logprobs=20)
        assert all(len(t.top_logprobs) == 20 for t in r.choices[0].logprobs.content)
        assert httpx.post(f"{url}/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0}).json()["written"]
        [traj] = [t for t in read_trajectories(redis_url, stream) if t.trajectory_id == s["session_id"]]
        [seg] = traj.segments
        _check_rows(seg, 24)
        assert np.isfinite(seg.top_logprobs).all()  # the pod filled every row: nothing padded
