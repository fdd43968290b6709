"""A template that renders the empty think block of Qwen3's non-thinking mode on the last assistant message only
(and drops earlier reasoning): every turn renders the history differently from what the pod saw, so each turn
starts a new segment (``template_rewrite``), fully rendered, and no generated token is lost (in-process app,
fake pods, the real openai SDK)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from services.gateway.app import build_app
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from tests.gateway_testlib import FakePods

PODS = ["http://pod-a:1"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
# Qwen3's rule, written small: an assistant turn after the last user query shows a think block when it is the
# last message or has reasoning; the generation prompt opens an empty one when enable_thinking is false.
TEMPLATE = (
    "{%- set nl = '\\n' -%}{%- set ns = namespace(q=messages|length - 1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.q = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}{{ '<|im_start|>system' + nl }}{%- for t in tools -%}{{ t | tojson + nl }}{%- endfor -%}"
    "{{ '<|im_end|>' + nl }}{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{%- set r = m.reasoning_content if m.reasoning_content is string else '' -%}{{ '<|im_start|>assistant' + nl }}"
    "{%- if loop.index0 > ns.q and (loop.last or r) -%}"
    "{{ '<think>' + nl + r + nl + '</think>' + nl + nl }}{%- endif -%}"
    "{{ m.content or '' }}{%- for c in m.tool_calls or [] -%}"
    "{{ '<tool_call>' + nl + '{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments + '}' }}"
    "{{ nl + '</tool_call>' }}{%- endfor -%}{{ '<|im_end|>' + nl }}"
    "{%- elif m.role == 'tool' -%}{{ '<|im_start|>user' + nl + '<tool_response>' + m.content + '</tool_response>' }}"
    "{{ '<|im_end|>' + nl }}{%- else -%}"
    "{{ '<|im_start|>' + m.role + nl + m.content + '<|im_end|>' + nl }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + nl }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>' + nl + nl + '</think>' + nl + nl }}"
    "{%- endif -%}{%- endif -%}"
)


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    path = tmp_path_factory.mktemp("qwen3-think") / "model"
    shutil.copytree(tiny_qwen3, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return ChatModel(path)


async def test_each_turn_of_a_non_thinking_tool_loop_is_its_own_exact_segment(model):
    settings = GatewaySettings.model_validate(
        {"model": {"path": str(model.path)}, "rollout": {"urls": PODS}, "redis": {"url": "memory://", "stream": "t"}}
    )
    replies = [CALL, CALL, "done<|im_end|>"]
    pods = FakePods(PODS, lambda prompt, sp: model.encode(replies[len(pods.pods[PODS[0]].calls) - 1]))
    app = build_app(settings, transport=pods, model=model)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    messages: list[dict] = [{"role": "user", "content": "go"}]
    requests = []
    for _ in replies:
        requests.append(list(messages))
        r = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        msg = r.choices[0].message.model_dump(exclude_none=True)
        messages += [msg] + [
            {"role": "tool", "tool_call_id": c["id"], "content": "R"} for c in msg.get("tool_calls", [])
        ]
    metrics = (await http.get("/metrics")).text
    assert (await http.post(f"/v1/sessions/{s['session_id']}/finish", json={"reward": 1.0})).json()["segments"] == 3
    [d] = [
        x for x in await app.gateway.queue.read("t", 10, block_s=0) if x.trajectory.trajectory_id == s["session_id"]
    ]
    thinking_off = model.with_kwargs({"enable_thinking": False})
    for seg, request, reply in zip(d.trajectory.segments, requests, replies):
        # Each segment is the template's render of its request (empty think block in the prompt only), then the
        # pod's tokens: the history the model is shown is the one the template writes, never an older one.
        ((start, end),) = seg.action_spans.tolist()
        ids = seg.token_ids.tolist()
        assert ids[:start] == thinking_off.encode(thinking_off.render(request, TOOLS, generation_prompt=True))
        assert ids[start:] == model.encode(reply) and end == len(ids)
    assert 'molt_gateway_segments_total{reason="template_rewrite"} 2.0' in metrics
