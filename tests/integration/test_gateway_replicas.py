"""Two gateway replicas (one shared real rollout pod, real Redis) as behind one Service.

Each request goes to the "wrong" replica on purpose, the way a load-balancing Service would send it: the
OpenAI (plain and streaming) and Anthropic SDKs, the session calls of GatewayClient and a mixed
``/v1/episodes`` batch must all reach the replica that holds the session, and the stream must hold each
episode once, token-exact with what the clients were told. Forged ids are not followed; a replica that is
gone is a clean 502 in the wire's shape.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import anthropic
import httpx
import openai
import pytest
import redis

from molt.agents.gateway import GatewayClient
from molt.net import free_port
from services.gateway.limits import count_key
from services.gateway.replicas import Replicas
from tests.gateway_testlib import read_trajectories, start_gateway, start_rollout_pod, stop

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
KEYS = ["key-a", "key-b"]
AUTH = {"authorization": f"Bearer {KEYS[0]}"}


def _gateway_args(tiny_qwen3, pod_url: str, redis_url: str, stream: str, port: int) -> list[str]:
    return [
        "--model",
        str(tiny_qwen3),
        "--rollout.urls",
        pod_url,
        "--redis.url",
        redis_url,
        "--redis.stream",
        stream,
        "--session.max_length",
        "1024",
        "--server.port",
        str(port),
        "--replica.public_url",
        f"http://127.0.0.1:{port}",
        "--auth.api_keys",
        *KEYS,
    ]


@pytest.fixture(scope="module")
def pair(tiny_qwen3, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gwr")
    stream = f"molt:test:gateway-replicas:{uuid.uuid4().hex[:8]}"
    pod, pod_url = start_rollout_pod(tiny_qwen3, logs / "pod.log")
    gateways = []
    try:
        for name in ("a", "b"):
            port = free_port()
            proc, _ = start_gateway(
                _gateway_args(tiny_qwen3, pod_url, redis_url, stream, port), logs / f"gateway-{name}.log"
            )
            gateways.append((proc, f"http://127.0.0.1:{port}"))
        yield {
            "a": gateways[0][1],
            "b": gateways[1][1],
            "redis": redis_url,
            "stream": stream,
            "pod": pod_url,
            "model": tiny_qwen3,
            "logs": logs,
        }
    finally:
        for proc, _ in gateways:
            stop(proc)
        stop(pod)
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{stream}*"))  # the stream, its groups' keys, parked and moved sessions
        if keys:
            r.delete(*keys)
        r.close()


def _open(url: str) -> dict:
    r = httpx.post(url + "/v1/sessions", json={"sampling_params": {"seed": 3}}, headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()


def _read(pair) -> dict:
    return {t.trajectory_id: t for t in read_trajectories(pair["redis"], pair["stream"])}


def test_every_wire_reaches_the_replica_that_holds_the_session(pair):
    a, b = pair["a"], pair["b"]
    s1, s2, s3 = _open(a), _open(a), _open(b)
    assert s1["openai_base_url"] == f"{a}/s/{s1['session_id']}/v1" and s3["anthropic_base_url"].startswith(b)
    via_b = openai.OpenAI(base_url=f"{b}/s/{s1['session_id']}/v1", api_key=KEYS[0])
    messages = [{"role": "user", "content": "Count to three."}]
    r1 = via_b.chat.completions.with_raw_response.create(
        model="policy", messages=messages, max_tokens=6, logprobs=True
    )
    assert r1.headers["x-molt-policy-version"] == "0" and "gateway;dur=" in r1.headers["server-timing"]
    first = r1.parse()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    chunks = list(
        via_b.chat.completions.create(
            model="policy", messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens > 0
    claude = anthropic.Anthropic(base_url=f"{a}/s/{s3['session_id']}", api_key=KEYS[0])  # s3 lives on b
    m = claude.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert m.usage.output_tokens > 0

    async def sdk_calls():
        client = GatewayClient(b, api_key=KEYS[0])  # s2 lives on a
        try:
            out = await client.request(
                "POST",
                f"/v1/sessions/{s2['session_id']}/generate",
                {"messages": [{"role": "user", "content": "Go"}], "sampling_params": {"max_tokens": 3}},
            )
            return out, await client.request("GET", f"/v1/sessions/{s2['session_id']}")
        finally:
            await client.aclose()

    out, summary = asyncio.run(sdk_calls())
    assert out["num_tokens"] == summary["num_tokens"] and 0 < len(out["token_ids"]) <= 3

    # one batch through b: s1 and s2 (on a), s3 (on b), an unknown id
    r = httpx.post(
        b + "/v1/episodes",
        headers=AUTH,
        json={
            "episodes": [
                {"session_id": s1["session_id"], "reward": 1.0},
                {"session_id": s3["session_id"], "reward": 0.5},
                {"session_id": "nope", "reward": 0.0},
                {"session_id": s2["session_id"], "reward": 0.0},
            ]
        },
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] if "status" in x else 200 for x in results] == [200, 200, 404, 200]
    assert [x.get("trajectory_id") for x in results] == [s1["session_id"], s3["session_id"], None, s2["session_id"]]
    assert r.json()["written"] == 3
    # finishing again through the other replica is idempotent: the same stream entry, nothing rewritten
    again = httpx.post(f"{a}/v1/sessions/{s3['session_id']}/finish", headers=AUTH, json={"reward": 0.5}).json()
    assert again["entry_id"] == results[1]["entry_id"]

    written = _read(pair)
    assert set(written) == {s1["session_id"], s2["session_id"], s3["session_id"]}
    [seg] = written[s1["session_id"]].segments
    lp = [c.logprob for c in first.choices[0].logprobs.content]
    start, end = seg.action_spans.tolist()[0]
    assert seg.logprobs[: end - start].tolist() == pytest.approx(lp, abs=1e-6)  # what the client was told
    assert len(seg.action_spans) == 2 and written[s1["session_id"]].reward == 1.0
    assert written[s2["session_id"]].segments[0].token_ids.tolist()[-3:] == out["token_ids"]


def test_forged_and_unreachable_owners(pair):
    a, b = pair["a"], pair["b"]
    # a well-formed id signed with keys the replicas do not share: answered where it lands, never followed
    forged = Replicas(b, ["not-our-key"]).new_session_id()
    r = httpx.post(
        f"{a}/s/{forged}/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # a replica that is gone (signed with the shared keys, pointing at a closed port)
    gone = Replicas(f"http://127.0.0.1:{free_port()}", KEYS).new_session_id()
    r = httpx.post(
        f"{a}/s/{gone}/v1/messages",
        headers=AUTH,
        json={"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 502 and r.json()["error"]["type"] == "api_error" and r.headers["retry-after"] == "1"
    assert "did not answer" in r.json()["error"]["message"]
    r = httpx.post(a + "/v1/episodes", headers=AUTH, json={"episodes": [{"session_id": gone, "reward": 1}]})
    assert r.json()["results"][0]["error"]["code"] == "replica_unreachable"
    # a client that asks for "100 Continue" (curl does, for bodies over 1 KB) still gets the owner's real answer
    s = _open(b)
    r = httpx.post(
        f"{a}/s/{s['session_id']}/v1/chat/completions",
        headers={**AUTH, "expect": "100-continue"},
        json={"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    # HEAD is not relayed (its answer would announce a body that never comes): answered where it lands
    r = httpx.head(f"{a}/v1/sessions/{_open(b)['session_id']}", headers=AUTH, timeout=5)
    assert r.status_code == 404
    # a bad key is refused where it lands, before anything is forwarded
    s = _open(b)
    r = httpx.get(f"{a}/v1/sessions/{s['session_id']}", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_sigterm_drains_open_sessions_then_exits(pair):
    """A replica told to stop (rolling update, scale-down) with --session.drain_s serves its open episodes to
    the end, directly and forwarded from its peers, takes no new ones, and exits once none is open."""
    port = free_port()
    c_url = f"http://127.0.0.1:{port}"
    proc, _ = start_gateway(
        [*_gateway_args(pair["model"], pair["pod"], pair["redis"], pair["stream"], port), "--session.drain_s", "60"],
        pair["logs"] / "gateway-c.log",
    )
    try:
        s1, s2 = _open(c_url), _open(c_url)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(c_url + "/readyz").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(c_url + "/v1/sessions", json={}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"] == "1"
        turn = {"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": "Still there?"}]}
        for url, s in ((c_url, s1), (pair["a"], s2)):  # directly, and forwarded by a peer
            r = httpx.post(f"{url}/s/{s['session_id']}/v1/chat/completions", json=turn, headers=AUTH)
            assert r.status_code == 200, r.text
        assert proc.poll() is None  # two sessions still open
        r = httpx.post(
            pair["b"] + "/v1/episodes",
            headers=AUTH,
            json={
                "episodes": [
                    {"session_id": s1["session_id"], "reward": 1.0},
                    {"session_id": s2["session_id"], "reward": 0.0},
                ]
            },
        )
        assert r.json()["written"] == 2, r.text
        assert proc.wait(15) == 0  # none open: it shut down on its own, long before the 60 s drain
        written = _read(pair)
        assert {s1["session_id"], s2["session_id"]} <= set(written)
    finally:
        stop(proc)


def test_a_replica_that_exits_hands_its_open_sessions_to_the_others(pair):
    """A rolling update: replica e exits while an episode is open on it (its drain ran out). The next turn,
    sent to replica a under e's id, finds e gone: a adopts the session and answers it. A turn sent to b
    follows the session to a, and so does one sent to e once it is back at its old address; the episode is
    finished through b's /v1/episodes; the stream holds one segment with every turn, each turn's tokens and
    logprobs those its client was told."""
    port = free_port()
    e = f"http://127.0.0.1:{port}"
    log = pair["logs"] / "gateway-e.log"
    proc, _ = start_gateway(
        [*_gateway_args(pair["model"], pair["pod"], pair["redis"], pair["stream"], port), "--session.drain_s", "1"],
        log,
    )
    r = redis.Redis.from_url(pair["redis"])
    try:
        s, other = _open(e), _open(e)
        sid = s["session_id"]
        httpx.post(
            f"{e}/s/{other['session_id']}/v1/completions",
            headers=AUTH,
            json={"model": "policy", "prompt": "Hello", "max_tokens": 2},
        ).raise_for_status()
        messages = [{"role": "user", "content": "Count to three."}]
        told = []  # (token ids, logprobs) of each turn, as its client got them

        def turn(client: openai.OpenAI) -> None:
            out = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
            told.append([c.logprob for c in out.choices[0].logprobs.content])
            messages.extend(
                [
                    {"role": "assistant", "content": out.choices[0].message.content},
                    {"role": "user", "content": "Again."},
                ]
            )

        turn(openai.OpenAI(base_url=s["openai_base_url"], api_key=KEYS[0], max_retries=0))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert r.exists(f"{pair['stream']}:gateway:handoff:{sid}")
        assert r.zscore(count_key(pair["stream"], KEYS[0]), sid) is not None  # still open: still counted
        turn(openai.OpenAI(base_url=f"{pair['a']}/s/{sid}/v1", api_key=KEYS[0], max_retries=0))  # a adopts it
        assert r.get(f"{pair['stream']}:gateway:moved:{sid}") == pair["a"].encode()
        turn(openai.OpenAI(base_url=f"{pair['b']}/s/{sid}/v1", api_key=KEYS[0], max_retries=0))  # b relays to a
        # e comes back at the same address (a fixed hostname, a StatefulSet): the id names it, a holds the session.
        proc, _ = start_gateway(
            [*_gateway_args(pair["model"], pair["pod"], pair["redis"], pair["stream"], port)],
            pair["logs"] / "gateway-e2.log",
        )
        turn(openai.OpenAI(base_url=f"{e}/s/{sid}/v1", api_key=KEYS[0], max_retries=0))  # e relays to a
        # One batch through b: sid (b knows it moved to a) and the other session, still parked (b finds e gone,
        # adopts it and finishes it itself).
        res = httpx.post(
            pair["b"] + "/v1/episodes",
            headers=AUTH,
            json={"episodes": [{"session_id": sid, "reward": 1}, {"session_id": other["session_id"], "reward": 0}]},
        )
        assert res.json()["written"] == 2, res.text
        assert not r.exists(f"{pair['stream']}:gateway:handoff:{other['session_id']}")
        assert r.zscore(count_key(pair["stream"], KEYS[0]), sid) is None
        [seg] = _read(pair)[sid].segments
        spans = seg.action_spans.tolist()
        assert len(spans) == 4
        offset = 0  # the segment's logprobs are its action tokens', span after span
        for (start, end), lp in zip(spans, told):
            assert seg.logprobs[offset : offset + end - start].tolist() == pytest.approx(lp, abs=1e-6)
            offset += end - start
        assert "parked in Redis" in log.read_text()
    finally:
        stop(proc)
        r.close()


def test_sessions_still_open_when_the_drain_runs_out_are_lost_and_free_their_slots(pair):
    """With --session.handoff false, a session its agent never finishes cannot hold a replica up past
    --session.drain_s: the replica exits, says how many episodes it lost, and takes them off its key's
    open-session count in Redis (which every replica shares), so they do not hold the key's slots until their
    lease lapses."""
    port = free_port()
    log = pair["logs"] / "gateway-d.log"
    proc, _ = start_gateway(
        [
            *_gateway_args(pair["model"], pair["pod"], pair["redis"], pair["stream"], port),
            "--session.drain_s",
            "1",
            "--session.handoff",
            "false",
        ],
        log,
    )
    r = redis.Redis.from_url(pair["redis"])
    try:
        sid = _open(f"http://127.0.0.1:{port}")["session_id"]
        counted = count_key(pair["stream"], KEYS[0])
        assert r.zscore(counted, sid) is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert r.zscore(counted, sid) is None
        deadline = time.monotonic() + 5  # the log is copied from the process's output by a thread
        while "shutting down with 1 open sessions: their episodes are lost" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
    finally:
        stop(proc)
        r.close()
