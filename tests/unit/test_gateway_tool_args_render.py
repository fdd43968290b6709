"""Tool-call arguments reach the chat template as objects, as vLLM's server gives them to it.

Real tokenizer (the tiny model's) with real templates: the tiny model's own (Qwen3-style, ``is string``) and the
original Qwen2.5, Qwen3, Llama 3.1/3.2, LFM2 and DeepSeek-V3 templates that TRL ships for identity comparison.
vLLM's rendering is its own ``_postprocess_messages`` followed by the tokenizer's template, as its server does.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from services.gateway.capture import Capture, ChatState
from services.gateway.chat import ChatModel, canonical_messages, canonical_tool_call, parse_tool_calls
from services.gateway.pods import Generation

pytest.importorskip("vllm")

from vllm.renderers.chat_utils import _postprocess_messages

# trl's package ships real models' chat templates. Found, not imported: importing trl sets VLLM_LOGGING_LEVEL=ERROR
# in os.environ, which every vLLM pod a later test starts from this process would inherit.
_TRL = importlib.util.find_spec("trl")
if _TRL is None or not _TRL.submodule_search_locations:
    pytest.skip("trl is not installed (its package ships the chat templates)", allow_module_level=True)
TEMPLATES = Path(list(_TRL.submodule_search_locations)[0]) / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    }
]


def _call(call_id: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _history(*argument_texts) -> list[dict]:
    """A user question, then one assistant call and its tool result per argument text (one call per message:
    Llama 3's templates take no parallel calls)."""
    out: list[dict] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}]
    for i, args in enumerate(argument_texts):
        out.append({"role": "assistant", "content": "", "tool_calls": [_call(f"call_{i}", args)]})
        out.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"sunny {i}"})
    return out


@pytest.fixture(scope="module")
def models(tiny_qwen3, tmp_path_factory) -> dict[str, ChatModel]:
    """The tiny model's tokenizer under each template (``tiny``: its own)."""
    from transformers import AutoTokenizer

    out = {"tiny": ChatModel(tiny_qwen3)}
    for name in ("qwen2_5", "qwen3", "llama3_1", "llama3_2", "lfm2_v2", "deepseekv3"):
        path = tmp_path_factory.mktemp(name)
        tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
        tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        tok.save_pretrained(str(path))
        shutil.copy(Path(tiny_qwen3) / "config.json", path / "config.json")
        out[name] = ChatModel(path)
    return out


def vllm_render(model: ChatModel, messages: list[dict], tools, generation_prompt: bool = True) -> str:
    """What vLLM's chat endpoint renders for these (canonical) messages."""
    conversation = copy.deepcopy(messages)
    _postprocess_messages(conversation)
    return model.tokenizer.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


# How clients send arguments back: as the gateway returned them, compact (pydantic-ai), ASCII-escaped
# (json.dumps' default), keys reordered, empty (a call without arguments), a dict (not the spec's string).
ECHOES = ['{"city": "Zürich"}', '{"city":"Zürich"}', '{"city": "Z\\u00fcrich"}', '{"unit": "C", "city": "Paris"}', ""]


@pytest.mark.parametrize("template", ["tiny", "qwen2_5", "qwen3", "llama3_1", "llama3_2", "lfm2_v2"])
@pytest.mark.parametrize("arguments", [*ECHOES, {"city": "Paris"}])
def test_a_tool_call_history_renders_as_vllm_renders_it(models, template, arguments):
    model = models[template]
    messages = canonical_messages(_history(arguments, '{"city": "Rome"}'))
    assert model.render(messages, TOOLS, True) == vllm_render(model, messages, TOOLS)


def test_qwen25_arguments_are_not_double_encoded(models):
    model = models["qwen2_5"]
    text = model.render(canonical_messages(_history('{"city":"Z\\u00fcrich"}')), TOOLS, True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert '\\"' not in text  # before: "arguments": "{\"city\":\"Z\\u00fcrich\"}"


def test_a_template_that_needs_a_mapping_renders_an_echoed_call(models):
    # LFM2's template refuses a JSON string (a 400 for every echoed call before); it lays the call out itself.
    text = models["lfm2_v2"].render(canonical_messages(_history('{"city": "Paris"}')), TOOLS, True)
    assert "[get_weather(city='Paris')]" in text


def test_a_template_that_concatenates_the_json_text_still_renders_it(models):
    # DeepSeek-V3's template adds the arguments to strings: an object fails there, so it gets the text as before.
    text = models["deepseekv3"].render(canonical_messages(_history('{"city": "Paris"}')), None, True)
    assert '```json\n{"city": "Paris"}\n```' in text


@pytest.mark.parametrize("template", ["tiny", "qwen2_5"])
@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"Paris"'])
def test_arguments_that_are_not_a_json_object_stay_the_text_sent(models, template, arguments):
    # vLLM renders {} for these (and logs a warning): the gateway keeps what was written.
    model = models[template]
    text = model.render(canonical_messages(_history(arguments)), TOOLS, True)
    assert (json.dumps(arguments) if template == "qwen2_5" else arguments) in text


def test_absent_or_null_arguments_are_an_empty_object():
    for fn in ({"name": "f"}, {"name": "f", "arguments": None}):
        assert (
            canonical_tool_call({"id": "c", "type": "function", "function": fn}, "m")["function"]["arguments"] == "{}"
        )


# ---- the model's own call, echoed back, extends the segment token-exactly


def _turn(cap: Capture, model: ChatModel, messages: list[dict], reply_text: str):
    msgs = canonical_messages(messages)
    plan = cap.plan_chat(model, msgs, TOOLS)
    ids = model.encode(reply_text)
    gen = Generation(ids, [-0.5] * len(ids), "stop", 1, "http://pod")
    cap.commit(plan, gen, [])
    content, calls = parse_tool_calls(model.decode(ids, skip_special=True))
    reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    cap.chat = ChatState(msgs, TOOLS, plan.full_render, reply, model.decode(ids, skip_special=False))
    return plan, gen, reply


def _echo(reply: dict, arguments: str) -> dict:
    """``reply`` as a client sends it back with its call's arguments re-serialised as ``arguments``."""
    return {**reply, "tool_calls": [_call(reply["tool_calls"][0]["id"], arguments)]}


CALL_TEXT = {  # the call as each model writes it (its template's own layout)
    "tiny": '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call><|im_end|>',
    "qwen2_5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>',
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>',
}


@pytest.mark.parametrize("template", ["tiny", "qwen2_5"])
@pytest.mark.parametrize("echo", [None, '{"city":"Zürich"}', '{"city": "Z\\u00fcrich"}'])
def test_an_echoed_call_extends_the_segment_with_the_prompt_vllm_renders(models, template, echo):
    model = models[template]
    ask = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"}]
    cap = Capture(max_length=2048)
    p1, g1, r1 = _turn(cap, model, ask, CALL_TEXT[template])
    assert r1["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    sent = r1 if echo is None else _echo(r1, echo)
    m2 = ask + [sent, {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "sunny"}]
    p2, _, _ = _turn(cap, model, m2, "It is sunny.<|im_end|>")
    assert not p2.new_segment and p2.reason == "extend"
    # The pod's tokens are kept, and the whole prompt is the one vLLM renders for this request.
    assert p2.prompt_ids[: len(p1.prompt_ids) + len(g1.token_ids)] == p1.prompt_ids + g1.token_ids
    assert model.decode(p2.prompt_ids, skip_special=False) == vllm_render(model, canonical_messages(m2), TOOLS)
    # The delta is only what the template adds after the generated <|im_end|>.
    tail = vllm_render(model, canonical_messages(m2), TOOLS)[len(model.decode(p1.prompt_ids + g1.token_ids, False)) :]
    assert p2.delta_ids == model.encode(tail)


@pytest.mark.parametrize("template", sorted(CALL_TEXT))
def test_a_new_segment_holding_a_tool_call_is_what_vllm_renders(models, template):
    # A session whose first request already holds a call (an agent resuming, an env's multi-turn prompt).
    model = models[template]
    messages = canonical_messages(_history('{"city":"Z\\u00fcrich"}'))
    plan = Capture(max_length=2048).plan_chat(model, messages, TOOLS)
    assert plan.new_segment
    assert model.decode(plan.prompt_ids, skip_special=False) == vllm_render(model, messages, TOOLS)


def test_qwen3_renders_the_next_turn_as_vllm_does(models):
    # Qwen3's own template shows an empty think block on the last assistant message, so the history the pod saw is
    # rewritten and the turn is a new segment (as before, test_gateway_think_history.py): the one vLLM renders.
    model = models["qwen3"]
    ask = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"}]
    cap = Capture(max_length=2048)
    _, _, r1 = _turn(cap, model, ask, CALL_TEXT["qwen3"])
    result = {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "sunny"}
    m2 = canonical_messages(ask + [_echo(r1, '{"city":"Z\\u00fcrich"}'), result])
    p2 = cap.plan_chat(model, m2, TOOLS)
    assert p2.new_segment and p2.reason == "template_rewrite"
    assert model.decode(p2.prompt_ids, skip_special=False) == vllm_render(model, m2, TOOLS)
