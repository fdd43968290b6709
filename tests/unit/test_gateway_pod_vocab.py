"""A rollout pod started on another model than the gateway's is never routed to: the ids the gateway sends would
mean other tokens there, and every trajectory would train on text nobody wrote. Pods report the fingerprint of
their vocabulary on /readyz (molt.vocab); the gateway's health probe compares it with its own."""

from __future__ import annotations

import logging

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1", "http://pod-b:2"]


async def test_a_pod_with_another_vocabulary_is_unhealthy_and_never_routed_to(tiny_qwen3, caplog):
    model = ChatModel(tiny_qwen3)
    app, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("Hi.<|im_end|>"), PODS)
    pool = app.gateway.pool
    pods.pods[PODS[0]].vocab = model.vocab
    pods.pods[PODS[1]].vocab = "ffffffffffffffff"
    with caplog.at_level(logging.WARNING, logger="molt.gateway"):
        for pod in pool.pods.values():
            await pool.probe(pod)
    assert [p.url for p in pool.pods.values() if p.healthy] == [PODS[0]]
    assert "another vocabulary" in pool.pods[PODS[1]].last_error and "--model.path" in caplog.text
    ready = (await http.get("/readyz")).json()
    assert (ready["healthy_pods"], ready["pods"]) == (1, 2) and "pod-a" not in str(ready)  # no internal map
    for _ in range(8):
        sid = (await http.post("/v1/sessions", json={})).json()["session_id"]
        turn = {"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 2}}
        assert (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).status_code == 200
    assert pods.pods[PODS[1]].calls == [] and len(pods.pods[PODS[0]].calls) == 8

    pods.pods[PODS[0]].vocab = "eeeeeeeeeeeeeeee"  # no pod left that agrees: the gateway is not ready
    await pool.probe(pool.pods[PODS[0]])
    assert (await http.get("/readyz")).status_code == 503


async def test_a_pod_that_reports_no_vocabulary_is_routed_to(tiny_qwen3):
    """Pods of other servers (or test doubles) that say nothing about their vocabulary are not refused for it."""
    model = ChatModel(tiny_qwen3)
    app, pods, http = scripted_gateway(model, lambda prompt, sp: [], PODS[:1])
    await app.gateway.pool.probe(app.gateway.pool.pods[PODS[0]])
    assert app.gateway.pool.pods[PODS[0]].healthy


async def test_the_gateway_probes_every_pod_before_it_serves(tiny_qwen3):
    """The first turns after start-up never reach a pod nobody has probed yet: one that serves another
    vocabulary, or one that is down, is known as such before the server accepts its first request."""
    model = ChatModel(tiny_qwen3)
    pods_up = [*PODS, "http://pod-c:3"]
    app, pods, http = scripted_gateway(model, lambda prompt, sp: model.encode("Hi.<|im_end|>"), pods_up)
    pods.pods[PODS[1]].vocab = "ffffffffffffffff"
    pods.pods["http://pod-c:3"].down = True
    async with app.router.lifespan_context(app):
        healthy = {p.url: p.healthy for p in app.gateway.pool.pods.values()}
        assert healthy == {PODS[0]: True, PODS[1]: False, "http://pod-c:3": False}
        for _ in range(4):
            sid = (await http.post("/v1/sessions", json={})).json()["session_id"]
            turn = {"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 2}}
            assert (await http.post(f"/v1/sessions/{sid}/generate", json=turn)).status_code == 200
    assert len(pods.pods[PODS[0]].calls) == 4 and pods.pods[PODS[1]].calls == []
