"""Session leases (``lease_s`` at open, renewed by ``POST /v1/sessions/{id}/renew``), in process: memory queue,
fake pods, the reaper called with a chosen clock."""

from __future__ import annotations

import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

POD = "http://pod-a:1"


@pytest.fixture
def gateway(tiny_qwen3):
    model = ChatModel(tiny_qwen3)
    reply = model.encode("Hi.<|im_end|>")
    app, _, http = scripted_gateway(model, lambda p, sp: reply, [POD], session={"idle_ttl_s": 600})
    return app.gateway, http


async def test_a_leased_session_lapses_after_its_lease_unless_renewed(gateway):
    gw, http = gateway
    leased = (await http.post("/v1/sessions", json={"lease_s": 10})).json()["session_id"]
    plain = (await http.post("/v1/sessions", json={})).json()["session_id"]
    t0 = gw.sessions[leased].last_used
    r = await http.post(f"/v1/sessions/{leased}/renew")
    assert r.status_code == 200 and r.json() == {"session_id": leased, "lease_s": 10.0}
    renewed = gw.sessions[leased].last_used
    assert renewed >= t0
    assert gw.reap(now=renewed + 9) == 0  # within its lease
    assert gw.reap(now=renewed + 11) == 1  # lapsed: expired, nothing written; the plain one waits its idle TTL
    assert leased not in gw.sessions and gw.sessions[plain].state == "open"
    r = await http.post(f"/v1/sessions/{leased}/renew")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize("lease", [0.5, 601, "10", True])
async def test_a_lease_outside_one_second_to_the_idle_ttl_is_refused(gateway, lease):
    _, http = gateway
    r = await http.post("/v1/sessions", json={"lease_s": lease})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lease_s", r.text
