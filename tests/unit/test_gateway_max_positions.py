"""A session's token budget is capped at the model's context: the default ``--session.max_length`` shrinks to it
and a larger ``max_length`` at open is a 400 naming the field. A vision-language model keeps its context in its
language model's section (``text_config``), where vLLM reads it too."""

from __future__ import annotations

import json

import pytest

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

POD = "http://pod-a:1"


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_idefics3"])
async def test_sessions_are_capped_at_the_models_positions(request, fixture):
    path = request.getfixturevalue(fixture)
    cfg = json.loads((path / "config.json").read_text())
    positions = cfg.get("max_position_embeddings") or cfg["text_config"]["max_position_embeddings"]
    model = ChatModel(path)
    assert model.max_model_len == positions == 2048
    app, _, http = scripted_gateway(model, lambda p, sp: [], [POD], session={"max_length": 4096})
    sid = (await http.post("/v1/sessions", json={})).json()["session_id"]
    assert app.gateway.sessions[sid].capture.max_length == positions  # the default, shrunk to the model
    r = await http.post("/v1/sessions", json={"max_length": positions + 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"'max_length' {positions + 1} is over the model's {positions} positions"
