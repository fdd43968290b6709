"""``chat_template_kwargs`` and Anthropic ``thinking``: variables of every render of a request, through a
template with Qwen3's ``enable_thinking`` switch (in-process app, fake pods, the real openai SDK)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from services.gateway.app import build_app
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from tests.gateway_testlib import FakePods, thinking_switch_model

PODS = ["http://pod-a:1"]
EMPTY_THINK = "<think>\n\n</think>\n\n"
ASK = [{"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def model(tiny_qwen3, tmp_path_factory) -> ChatModel:
    """tiny_qwen3 whose generation prompt holds an empty think block when enable_thinking is false (Qwen3's)."""
    m = thinking_switch_model(tiny_qwen3, tmp_path_factory.mktemp("switch") / "model")
    assert m.template_variables == {"enable_thinking"}
    return m


@pytest.fixture
def gw(model):
    settings = GatewaySettings.model_validate(
        {"model": {"path": str(model.path)}, "rollout": {"urls": PODS}, "redis": {"url": "memory://", "stream": "t"}}
    )
    pods = FakePods(PODS, lambda prompt, sp: model.encode("Four.<|im_end|>"))
    app = build_app(settings, transport=pods, model=model)
    return app, pods, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def _prompts(model: ChatModel, pods: FakePods) -> list[str]:
    return [model.decode(prompt, skip_special=False) for prompt, _ in pods.pods[PODS[0]].calls]


async def test_chat_template_kwargs_reach_the_render_and_key_the_prompt_cache(gw, model):
    _app, pods, http = gw
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="EMPTY", http_client=http)
    for kwargs in (None, {"enable_thinking": False}, None):  # the same messages: the cache must not mix them up
        s = (await http.post("/v1/sessions", json={})).json()
        session = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        await session.chat.completions.create(model="policy", messages=ASK, extra_body=extra)
    await client.chat.completions.create(
        model="policy", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    tails = [p.endswith("<|im_start|>assistant\n" + EMPTY_THINK) for p in _prompts(model, pods)]
    assert tails == [False, True, False, True]


async def test_a_variable_the_template_does_not_read_is_a_400_naming_it(gw):
    _app, _pods, http = gw
    body = {"model": "policy", "messages": ASK, "chat_template_kwargs": {"reasoning_mode": "high"}}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "reasoning_mode" in r.json()["error"]["message"] and "enable_thinking" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "thinking, max_tokens, status, empty_think",
    [
        ({"type": "disabled"}, 64, 200, True),
        ({"type": "enabled", "budget_tokens": 1024}, 1024, 200, False),
        ({"type": "enabled", "budget_tokens": 1024}, 2048, 200, False),  # Anthropic's own rule: budget < max
        ({"type": "adaptive"}, 64, 200, False),
        ({"type": "enabled", "budget_tokens": 10}, 10, 400, None),
        ({"type": "sometimes"}, 64, 400, None),
    ],
)
async def test_anthropic_thinking_goes_through_the_templates_switch(
    gw, model, thinking, max_tokens, status, empty_think
):
    _app, pods, http = gw
    body = {"model": "policy", "max_tokens": max_tokens, "messages": ASK, "thinking": thinking}
    r = await http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    if status == 200:
        [prompt] = _prompts(model, pods)
        assert prompt.endswith(EMPTY_THINK) == empty_think
    else:
        assert "thinking" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "effort, kwargs, status, empty_think",
    [
        ("none", None, 200, True),
        ("low", None, 200, False),
        ("max", None, 200, False),
        ("none", {"enable_thinking": True}, 200, False),  # as vLLM: the request's own switch wins
        ("high", {"enable_thinking": False}, 200, True),
        ("extreme", None, 400, None),
    ],
)
async def test_openai_reasoning_effort_goes_through_the_templates_switch(
    gw, model, effort, kwargs, status, empty_think
):
    _app, pods, http = gw
    s = (await http.post("/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=s["openai_base_url"], api_key="EMPTY", http_client=http)
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    call = client.chat.completions.create(model="policy", messages=ASK, reasoning_effort=effort, extra_body=extra)
    if status == 400:
        with pytest.raises(openai.BadRequestError) as err:
            await call
        assert err.value.body["param"] == "reasoning_effort" and "'none'" in err.value.body["message"]
        return
    await call
    [prompt] = _prompts(model, pods)
    assert prompt.endswith(EMPTY_THINK) == empty_think


async def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_where_nothing_would(
    tiny_qwen3, tmp_path
):
    """A template reading ``reasoning_effort`` (gpt-oss's way) renders it; one with neither the variable nor a
    switch honours "none" (it never thinks) and refuses the rest by name, where vLLM would drop them silently."""
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3, path)
    tpl = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").write_text(
        "{%- if reasoning_effort is defined -%}{{ 'Effort: ' + reasoning_effort + '\n' }}{%- endif -%}" + tpl
    )
    for m, effort, status, head in [
        (ChatModel(path), "medium", 200, "Effort: medium\n"),
        (ChatModel(tiny_qwen3), "none", 200, "<|im_start|>"),
        (ChatModel(tiny_qwen3), "low", 400, None),
    ]:
        settings = GatewaySettings.model_validate(
            {"model": {"path": str(m.path)}, "rollout": {"urls": PODS}, "redis": {"url": "memory://", "stream": "t"}}
        )
        pods = FakePods(PODS, lambda prompt, sp, m=m: m.encode("Four.<|im_end|>"))
        app = build_app(settings, transport=pods, model=m)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            body = {"model": "policy", "messages": ASK, "reasoning_effort": effort}
            r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == status, r.text
        if status == 200:
            assert _prompts(m, pods)[0].startswith(head)
        else:
            assert r.json()["error"]["param"] == "reasoning_effort" and "never renders think blocks" in r.text
