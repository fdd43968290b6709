"""``--gateway.default_chat_template_kwargs`` (vLLM's --default-chat-template-kwargs; Molt's
``--data.chat_template_kwargs`` reaches it through ``molt train-rl``): every render sees them, session turns and an
env's rendered prompt included, under what a request sets itself (in-process app, fake pods, a template with
Qwen3's ``enable_thinking`` switch)."""

from __future__ import annotations

import pytest

from molt.config import parse_settings
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings, validate_settings
from services.gateway.templates import template_variables_in
from tests.gateway_testlib import queued_gateway, thinking_switch_model

PODS = ["http://pod-a:1"]
OFF = '{"enable_thinking": false}'
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    return thinking_switch_model(tiny_qwen3, tmp_path_factory.mktemp("switch") / "model")


@pytest.fixture
def gw(model):
    return queued_gateway(model, PODS, gateway={"default_chat_template_kwargs": OFF})


def _prompts(model: ChatModel, pods) -> list[str]:
    return [model.decode(prompt, skip_special=False) for prompt, _ in pods.pods[PODS[0]].calls]


async def test_every_render_takes_the_default_and_a_request_overrides_it(gw, model):
    _app, pods, queue, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    msgs = [{"role": "user", "content": "2 + 2?"}]
    queue.extend(["Four.<|im_end|>"] * 3)
    await http.post(f"{s['openai_base_url']}/chat/completions", json={"model": "policy", "messages": msgs})
    t = (await http.post("/v1/sessions", json={})).json()
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    await http.post(f"{t['openai_base_url']}/chat/completions", json={"model": "policy", "messages": msgs, **on})
    u = (await http.post("/v1/sessions", json={})).json()
    high = {"reasoning_effort": "high"}
    await http.post(f"{u['openai_base_url']}/chat/completions", json={"model": "policy", "messages": msgs, **high})
    default, asked_on, effort_on = _prompts(model, pods)
    assert default.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert asked_on.endswith("<|im_start|>assistant\n") and effort_on == asked_on
    rendered = (await http.post(f"/v1/sessions/{s['session_id']}/render", json={"messages": msgs})).json()["text"]
    assert rendered == default


def test_the_flag_takes_a_json_object_of_variables_the_template_reads(model, capsys):
    settings = parse_settings(
        GatewaySettings, ["--model.path", str(model.path), "--gateway.default_chat_template_kwargs", OFF], prog="gw"
    )
    assert settings.gateway.default_chat_template_kwargs == {"enable_thinking": False}
    validate_settings(settings)
    assert template_variables_in(model.path) == model.template_variables == {"enable_thinking"}
    settings.gateway.default_chat_template_kwargs = {"thinking": False}
    with pytest.raises(ValueError, match=r"default_chat_template_kwargs: .* does not read \['thinking'\]"):
        validate_settings(settings)
    with pytest.raises(SystemExit):
        parse_settings(GatewaySettings, ["--gateway.default_chat_template_kwargs", "[1]"], prog="gw")
    assert "must be a JSON object" in capsys.readouterr().err
