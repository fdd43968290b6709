"""Per-key open-session limits counted across gateway replicas in real Redis (services/gateway/limits.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway.limits import RedisOpenSessions


@pytest.fixture
def replicas(replica_group, chat_model, redis_url):
    def make(url: str = redis_url, lease_s: float = 60.0):
        app, http, _ = replica_group.add(
            lambda prompt, sp: chat_model.encode("Hi.<|im_end|>"),
            redis={"url": url},
            auth={"api_keys": ["k1", "k2"], "max_open_sessions_per_key": 2, "session_lease_s": lease_s},
        )
        return app, http

    return make


def _key(k: str) -> dict:
    return {"authorization": f"Bearer {k}"}


async def _open(http: httpx.AsyncClient, key: str) -> httpx.Response:
    return await http.post("/v1/sessions", json={}, headers=_key(key))


async def test_a_keys_limit_holds_across_replicas(replicas):
    (a, http_a), (_, http_b) = replicas(), replicas()
    assert isinstance(a.gateway.limits, RedisOpenSessions)
    first = (await _open(http_a, "k1")).json()["session_id"]
    second = (await _open(http_b, "k1")).json()["session_id"]
    for http in (http_a, http_b):  # each replica holds one: the key's limit of 2 is reached on both
        r = await _open(http, "k1")
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "too_many_sessions"
    assert (await _open(http_b, "k2")).status_code == 201  # another key counts on its own
    # Deleting a session on one replica frees the slot on the other.
    assert (await http_b.delete(f"/v1/sessions/{second}", headers=_key("k1"))).status_code == 200
    third = (await _open(http_a, "k1")).json()["session_id"]
    assert (await _open(http_b, "k1")).status_code == 429
    # So does finishing one (a turn first: a session with tokens writes its trajectory).
    r = await http_a.post(
        f"/s/{first}/v1/chat/completions", headers=_key("k1"), json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200, r.text
    r = await http_a.post(f"/v1/sessions/{first}/finish", json={"reward": 1.0}, headers=_key("k1"))
    assert r.status_code == 200 and r.json()["written"]
    assert (await _open(http_b, "k1")).status_code == 201
    # And an idle session expiring.
    a.gateway.reap(now=a.gateway.sessions[third].last_used + a.gateway.settings.session.idle_ttl_s + 1)
    await a.gateway.release_closed()  # what the reap loop does after each pass
    assert (await _open(http_b, "k1")).status_code == 201
    assert (await _open(http_a, "k1")).status_code == 429


async def test_a_dead_replicas_sessions_lapse_and_live_ones_are_renewed(replicas):
    (a, http_a), (_, http_b) = replicas(lease_s=0.6), replicas(lease_s=0.6)
    for http in (http_a, http_b):
        assert (await _open(http, "k1")).status_code == 201
    assert (await _open(http_a, "k1")).status_code == 429
    # Replica b stops (a crash: nothing closed, nothing renewed); a keeps renewing what it holds.
    for _ in range(4):
        await asyncio.sleep(0.3)
        await a.gateway.limits.renew(a.gateway.held_by_owner())
    assert (await _open(http_a, "k1")).status_code == 201  # b's slot lapsed, a's did not
    assert (await _open(http_a, "k1")).status_code == 429
    # A renewal on its way while a session closes does not bring the closed one back.
    limits = a.gateway.limits
    held = a.gateway.held_by_owner()
    sid = held["k1"][0]
    assert (await http_a.delete(f"/v1/sessions/{sid}", headers=_key("k1"))).status_code == 200
    await limits.renew(held)
    assert await limits.redis.zscore(limits.key("k1"), sid) is None
    assert (await _open(http_a, "k1")).status_code == 201


async def test_without_redis_no_session_opens_uncounted(replicas):
    _, http = replicas(url="redis://127.0.0.1:1/0")
    r = await _open(http, "k1")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "limits_unavailable"
