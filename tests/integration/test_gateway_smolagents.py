"""smolagents as its users run it: a ``ToolCallingAgent`` on ``OpenAIServerModel`` (its own sync OpenAI client),
pointed at a captured session over loopback (the gateway app in this process, scripted fake pods). The agent
finishes its tool loop. It sends the model's tool call back as text ("Calling tools: [...]") and the tool's
answer as a user "Observation:" message, which the model never saw: its next step is a new segment
(``history_rewrite``), the request as the agent sent it, so the trajectory holds what the model saw each step."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from envs_testlib import Served

from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

PODS = ["http://pod-a:1"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
FINAL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "Sunny in Paris."}}</tool_call><|im_end|>'


@pytest.fixture
def model(tiny_qwen3, tmp_path) -> ChatModel:
    """tiny_qwen3 with a longer context: smolagents' system prompt alone is about 2000 tokens."""
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    return ChatModel(path)


def test_a_smolagents_tool_calling_agent_runs_in_a_session_each_step_its_own_segment(model):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        return f"{city}: sunny"

    replies = [CALL, FINAL]
    app, pods, _ = scripted_gateway(model, lambda prompt, sp: model.encode(replies.pop(0)), PODS)
    served = Served(app, "gateway")
    try:
        s = httpx.post(f"{served.url}/v1/sessions", json={}).json()
        policy = OpenAIServerModel(model_id="policy", api_base=s["openai_base_url"], api_key="EMPTY")
        agent = ToolCallingAgent(tools=[get_weather], model=policy, max_steps=4, verbosity_level=0)
        assert agent.run("What is the weather in Paris?") == "Sunny in Paris."
        finished = httpx.post(f"{served.url}/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0}).json()
        metrics = httpx.get(f"{served.url}/metrics").text
    finally:
        served.stop()
    assert finished["written"] and finished["segments"] == 2
    assert 'molt_gateway_segments_total{reason="history_rewrite"} 1' in metrics
    first, second = (model.decode(prompt, skip_special=False) for prompt, _ in pods.pods[PODS[0]].calls)
    assert second.startswith(first[: first.index("What is the weather in Paris?")])  # the same system prompt
    assert "Calling tools:" in second and "Observation:\nParis: sunny" in second
    assert CALL.split("<|im_end|>")[0] not in second  # the model's own call came back as smolagents' text
