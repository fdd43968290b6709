"""Open sessions outlive their gateway replica (services/gateway/handoff.py), in process on real Redis.

A replica that exits parks its open sessions; the next replica asked for one adopts it and goes on. The
episode read back from the stream must be the one an uninterrupted replica writes: same segments, tokens,
logprobs, spans and events. The real openai SDK drives the turns (over ASGI, with a fake pod).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from molt.bus.redis_stream import RedisTrajectoryQueue
from services.gateway.handoff import SessionHandoff
from services.gateway.limits import count_key
from tests.gateway_testlib import scripted_gateway

pytestmark = pytest.mark.redis

POD = "http://pod-a:1"
KEY = "k1"
AUTH = {"authorization": f"Bearer {KEY}"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
]
REPLIES = [
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "rome"}}</tool_call><|im_end|>'
    ),
    "Paris is sunny, Rome rainy.<|im_end|>",
    "You are welcome.<|im_end|>",
]


@pytest.fixture
def replicas(replica_group, chat_model):
    """``make(**session)``: a gateway replica on the shared stream (the pod answers REPLIES by turn number)."""

    def script(prompt: list[int], sp: dict) -> list[int]:
        marker = chat_model.encode("<|im_start|>assistant")
        turn = sum(1 for i in range(len(prompt)) if prompt[i : i + 2] == marker)
        return chat_model.encode(REPLIES[min(turn, len(REPLIES)) - 1])

    return lambda **session: replica_group.add(
        script, session=session, auth={"api_keys": [KEY, "k2"], "max_open_sessions_per_key": 4}
    )


def _client(http: httpx.AsyncClient, sid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://gw/s/{sid}/v1", api_key=KEY, http_client=http, max_retries=0)


async def _turn(http: httpx.AsyncClient, sid: str, messages: list, retry: bool = False) -> dict:
    """One turn; ``retry``: sent as the SDK sends its own retry of a request whose answer it did not get."""
    headers = {"x-stainless-retry-count": "1"} if retry else None
    r = await _client(http, sid).chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, seed=1, extra_headers=headers
    )
    return r.choices[0].message.model_dump(exclude_none=True)


async def _episode(start: httpx.AsyncClient, then: httpx.AsyncClient, between=None) -> tuple[str, list[dict]]:
    """Three turns (a tool call, two tool results at once, a user follow-up) and a finish: the first two turns
    on ``start``, the rest on ``then``; ``between(sid, messages, replies)`` runs after the second turn, with the
    messages that produced it. The session id and the three replies."""
    r = await start.post(
        "/v1/sessions",
        json={
            "group_id": "g1",
            "label": {"answer": 42},
            "env_name": "weather",
            "sampling_params": {"temperature": 0.7},
        },
        headers=AUTH,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    messages: list[dict] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
    ]
    replies = [await _turn(start, sid, messages)]
    calls = replies[0]["tool_calls"]
    messages += [
        replies[0],
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "rainy"},
    ]
    replies.append(await _turn(start, sid, messages))
    if between is not None:
        await between(sid, list(messages), replies)
    messages += [replies[1], {"role": "user", "content": "Thanks!"}]
    replies.append(await _turn(then, sid, messages))
    r = await then.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0, "info": {"turns": 3}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["written"], r.text
    return sid, replies


def _without_call_ids(replies: list[dict]) -> list[dict]:
    """Tool-call ids are unique per gateway process; everything else of a reply must match."""
    return [
        dict(r, tool_calls=[{k: v for k, v in c.items() if k != "id"} for c in r.get("tool_calls", [])])
        for r in replies
    ]


async def _written(redis_url: str, stream: str) -> dict:
    q = RedisTrajectoryQueue(redis_url, stream, group="check")
    try:
        return {d.trajectory.trajectory_id: d.trajectory for d in await q.read("c", 100, block_s=0.2)}
    finally:
        await q.close()


def _comparable(t) -> dict:
    return {
        "group_id": t.group_id,
        "reward": t.reward,
        "info": t.info,
        "events": [{k: v for k, v in e.items() if k != "time"} for e in t.events],
        "segments": [
            (
                s.token_ids.tolist(),
                [tuple(x) for x in s.action_spans.tolist()],
                s.logprobs.tolist(),
                s.versions.tolist(),
            )
            for s in t.segments
        ],
        "env_name": t.provenance.env_name,
        "sampling_params": t.provenance.sampling_params,
    }


async def test_an_episode_goes_on_token_exact_on_the_replica_that_adopts_it(replicas, redis_url, stream_name):
    _, http_a, _ = replicas()
    control, control_replies = await _episode(http_a, http_a)

    (c, http_c, _), (d, http_d, d_pods) = replicas(), replicas()
    counted = count_key(stream_name, KEY)
    rds = aioredis.from_url(redis_url)

    async def replica_exits(sid: str, messages: list, replies: list) -> None:
        assert await c.gateway.shut_down() == 0  # nothing lost: parked
        assert c.gateway.num_open == 0 and c.gateway.sessions[sid].state == "handed_off"
        assert await rds.zscore(counted, sid) is not None  # still open: its key's slot stays taken
        assert await rds.exists(f"{stream_name}:gateway:handoff:{sid}")
        # An agent whose SDK never got the second answer (its replica went mid-response) retries that request:
        # the replica that adopts the session answers it from the cache and generates nothing twice.
        assert await _turn(http_d, sid, messages, retry=True) == replies[1]
        assert not d_pods.pods[POD].calls

    moved, moved_replies = await _episode(http_c, http_d, replica_exits)
    assert _without_call_ids(moved_replies) == _without_call_ids(control_replies)
    assert "molt_gateway_sessions_adopted_total 1.0" in d.gateway.metrics.render()[0].decode()
    assert 'molt_gateway_sessions_total{outcome="handed_off"} 1.0' in c.gateway.metrics.render()[0].decode()
    assert await rds.zscore(counted, moved) is None  # finished on d: its slot is free
    assert not [k async for k in rds.scan_iter(match=f"{stream_name}:gateway:handoff:*")]
    await rds.aclose()

    written = await _written(redis_url, stream_name)
    assert len(written[moved].segments) == 1  # every turn extended the first segment, across the handoff
    assert _comparable(written[moved]) == _comparable(written[control])


async def _open_with_a_turn(http: httpx.AsyncClient, key: str = KEY) -> str:
    r = await http.post("/v1/sessions", json={}, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    r = await http.post(
        f"/s/{sid}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200, r.text
    return sid


async def test_only_the_sessions_key_adopts_it_and_only_one_replica_does(replicas, redis_url, stream_name):
    (c, http_c, _), (d, http_d, _), (e, http_e, _) = replicas(idle_ttl_s=100), replicas(), replicas()
    sids = [await _open_with_a_turn(http_c) for _ in range(3)]
    # A turn still running when the replica exits is waited for, so what is parked holds it.
    lock = c.gateway.sessions[sids[2]].lock
    await lock.acquire()
    asyncio.get_running_loop().call_later(0.3, lock.release)
    assert await c.gateway.shut_down() == 0
    rds = aioredis.from_url(redis_url)
    try:
        ttl = await rds.ttl(f"{stream_name}:gateway:handoff:{sids[0]}")
        assert 90 <= ttl <= 100  # parked no longer than the session could have stayed idle
        # Another key gets the same 404 as for an id that never existed, and the parked session stays parked.
        r = await http_d.get(f"/v1/sessions/{sids[0]}", headers={"authorization": "Bearer k2"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert await rds.exists(f"{stream_name}:gateway:handoff:{sids[0]}")
        # Two replicas asked at once (and twice on one of them): one adopts, the other finds nothing parked.
        got = await asyncio.gather(
            d.gateway.adopt(sids[0], KEY), e.gateway.adopt(sids[0], KEY), e.gateway.adopt(sids[0], KEY)
        )
        assert sorted(got) == [False, True, True] or sorted(got) == [False, False, True]
        holder = d if got[0] else e
        assert sum(sids[0] in g.gateway.sessions for g in (d, e)) == 1
        assert holder.gateway.num_open == 1
        # Deleting and finishing work on a parked session too (adopted on the way).
        r = await http_d.delete(f"/v1/sessions/{sids[1]}", headers=AUTH)
        assert r.status_code == 200 and r.json()["aborted"]
        r = await http_e.post(
            "/v1/episodes", headers=AUTH, json={"episodes": [{"session_id": sids[2], "reward": 0.5}]}
        )
        assert r.json()["written"] == 1, r.text
        assert await rds.zcard(count_key(stream_name, KEY)) == 1  # only sids[0] is still open
    finally:
        await rds.aclose()


async def test_without_handoff_or_redis_open_sessions_are_lost_and_counted(replicas, chat_model):
    c, http_c, _ = replicas(handoff=False)
    await _open_with_a_turn(http_c)
    assert await c.gateway.shut_down() == 1
    assert 'molt_gateway_sessions_total{outcome="lost"} 1.0' in c.gateway.metrics.render()[0].decode()
    # Redis gone by the time the replica exits: parking fails, the sessions are lost and said to be, not hidden.
    reply = chat_model.encode("Hi.<|im_end|>")
    gone = {"url": "redis://127.0.0.1:1/0", "stream": "gone"}
    app, _, http = scripted_gateway(chat_model, lambda p, sp: reply, [POD], redis=gone)
    assert isinstance(app.gateway.handoff, SessionHandoff)
    r = await http.post("/v1/sessions", json={})
    await http.post(
        f"/s/{r.json()['session_id']}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert await app.gateway.shut_down() == 1
    # A request for a session this replica does not hold, with Redis down: 503, not a 404 that says it is gone.
    r = await http.get("/v1/sessions/0123456789abcdef")
    assert r.status_code == 503 and r.json()["error"]["code"] == "sessions_unavailable"
    assert r.headers["retry-after"] == "1"
    await app.gateway.queue.close()


async def test_a_parked_state_this_replica_cannot_read_is_a_500_and_counted_lost(replicas, redis_url, stream_name):
    from services.gateway.handoff import owner_tag

    d, http_d, _ = replicas()
    rds = aioredis.from_url(redis_url)
    try:
        parked = {"owner": owner_tag(KEY), "state": b'{"format": 99}', "segments": b"[]"}
        await rds.hset(f"{stream_name}:gateway:handoff:s-new", mapping=parked)
        r = await http_d.post(
            "/s/s-new/v1/chat/completions",
            headers=AUTH,
            json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 500 and r.json()["error"]["code"] == "handoff_unreadable"
        assert "format 99" in r.json()["error"]["message"]
        assert 'molt_gateway_sessions_total{outcome="lost"} 1.0' in d.gateway.metrics.render()[0].decode()
    finally:
        await rds.aclose()


async def test_a_turn_that_never_ends_is_lost_alone_and_the_others_are_parked(replicas, redis_url, stream_name):
    c, http_c, _ = replicas()
    stuck, free = await _open_with_a_turn(http_c), await _open_with_a_turn(http_c)
    await c.gateway.sessions[stuck].lock.acquire()  # a turn still running at exit, past the wait
    left = await c.gateway._park([c.gateway.sessions[stuck], c.gateway.sessions[free]], wait_s=0.2)
    assert [s.id for s in left] == [stuck]  # the free one was parked although the wait was used up before it
    assert c.gateway.sessions[free].state == "handed_off"
    rds = aioredis.from_url(redis_url)
    try:
        assert await rds.exists(f"{stream_name}:gateway:handoff:{free}")
        assert not await rds.exists(f"{stream_name}:gateway:handoff:{stuck}")
    finally:
        await rds.aclose()


async def test_the_adopters_moved_marker_is_renewed_while_the_session_lasts(replicas, redis_url, stream_name):
    """With several replicas the adopter names itself in a moved marker, so a request reaching a third replica
    can follow the session there; the marker is renewed as long as the session is open, then left to lapse."""
    c, http_c, _ = replicas()
    sid = await _open_with_a_turn(http_c)
    await c.gateway.shut_down()
    d, http_d, _ = replicas()
    d.gateway.handoff.public_url = "http://10.0.0.9:8080"  # as --replica.public_url would set it
    d.gateway.handoff.moved_ttl_s = 100
    assert await d.gateway.adopt(sid, KEY)
    rds = aioredis.from_url(redis_url)
    marker = f"{stream_name}:gateway:moved:{sid}"
    try:
        assert await rds.get(marker) == b"http://10.0.0.9:8080" and 90 <= await rds.ttl(marker) <= 100
        await rds.expire(marker, 10)
        assert await d.gateway.renew_moved() == 0  # not due yet: renewed once half the TTL has passed
        assert await d.gateway.renew_moved(now=time.monotonic() + 60) == 1
        assert 90 <= await rds.ttl(marker) <= 100
        r = await http_d.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=AUTH)
        assert r.status_code == 200
        assert await d.gateway.renew_moved(now=time.monotonic() + 120) == 0 and not d.gateway._moved_marks
    finally:
        await rds.aclose()
