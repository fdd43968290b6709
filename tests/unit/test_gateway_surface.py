"""The parameter table of docs/gateway.md, walked: every parameter of every endpoint is sent to the gateway
app (in-process, fake pods); honoured and informational ones answer 200 (the sampler's reach the pod's
sampling params), refused ones and refused values answer 400 in the wire's shape naming the parameter."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from services.gateway import surface
from services.gateway.chat import ChatModel
from tests.gateway_testlib import scripted_gateway

ROOT = Path(__file__).resolve().parents[2]
PODS = ["http://pod-a:1"]
PATHS = {"chat/completions": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}
WIRES = {"chat/completions": "chat", "completions": "completions", "messages": "messages"}
BASE = {
    "chat/completions": {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "completions": {"model": "policy", "prompt": "hi", "max_tokens": 4},
    "messages": {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SAMPLER = {
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "seed": 3,
    "presence_penalty": 0.25,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "min_tokens": 1,
    "stop_token_ids": [5],
    "ignore_eos": True,
    "max_tokens": 3,
}
# (value the gateway honours or takes as information, value it refuses); None: no such value.
SAMPLES: dict[str, dict[str, tuple]] = {
    "chat/completions": {
        **{k: (v, None) for k, v in SAMPLER.items()},
        "stop": (["zz"], None),
        "n": (1, None),
        "stream": (False, None),
        "messages": (BASE["chat/completions"]["messages"], None),
        "tools": ([FN], None),
        "max_completion_tokens": (3, None),
        "logprobs": (True, None),
        "stream_options": ({"include_usage": True}, None),
        "tool_choice": ("none", "any"),
        "parallel_tool_calls": (False, "no"),
        "top_logprobs": (0, 21),
        "response_format": ({"type": "json_object"}, {"type": "xml"}),
        "model": ("policy", None),
        "user": ("u", None),
        "metadata": ({"a": "b"}, None),
        "store": (False, None),
        "service_tier": ("auto", None),
        "prompt_cache_key": ("k", None),
        "safety_identifier": ("s", None),
        "logit_bias": ({"5": 1}, {"5": 101}),
        "structured_outputs": ({"choice": ["ok"]}, {"choice": ["ok"], "regex": "o+"}),
        "chat_template_kwargs": ({}, {"enable_thinking": False}),  # the tiny template reads no extra variable
        "reasoning_effort": ("none", "low"),  # the tiny template never thinks
        "add_generation_prompt": (False, "yes"),  # session-less: rendered without it, as vLLM does
        "continue_final_message": (False, True),  # the base request's final message is the user's
        "audio": (None, {"voice": "x", "format": "wav"}),
        "modalities": (["text"], ["text", "audio"]),
        "prediction": (None, {"type": "content", "content": "x"}),
        "web_search_options": (None, {}),
        "functions": (None, [FN["function"]]),
        "function_call": (None, "auto"),
        "verbosity": (None, "low"),
    },
    "completions": {
        **{k: (v, None) for k, v in SAMPLER.items()},
        "stop": (["zz"], None),
        "n": (1, None),
        "stream": (False, None),
        "prompt": ("hello", None),
        "echo": (True, None),
        "stream_options": ({"include_usage": True}, None),
        "logprobs": (3, 21),
        "best_of": (1, 2),
        "model": ("policy", None),
        "user": ("u", None),
        "logit_bias": ({"5": 1}, {"5": 101}),
        "structured_outputs": ({"choice": ["ok"]}, {"grammar": 'root ::= "ok"', "regex": "o+"}),
        "suffix": (None, "end"),
    },
    "messages": {
        "messages": (BASE["messages"]["messages"], None),
        "system": ("Be brief.", None),
        "max_tokens": (3, None),
        "stop_sequences": (["zz"], None),
        "stream": (False, None),
        "temperature": (0.5, None),
        "top_p": (0.9, None),
        "top_k": (5, None),
        "tools": ([{"name": "f", "input_schema": {"type": "object"}}], None),
        "tool_choice": ({"type": "none"}, {"type": "maybe"}),
        "thinking": ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}),  # a template that never thinks
        "output_config": ({"format": {"type": "json_schema", "schema": {"type": "object"}}}, {"effort": "low"}),
        "output_format": ({"type": "json_schema", "schema": {"type": "object"}}, {"type": "json_object"}),
        "model": ("policy", None),
        "metadata": ({"user_id": "u"}, None),
        "service_tier": ("auto", None),
        "container": (None, "c"),
        "mcp_servers": (None, []),
        "context_management": (None, {}),
    },
}


def _doc_table() -> dict[str, dict[str, str]]:
    text = (ROOT / "docs" / "gateway.md").read_text()
    rows: dict[str, dict[str, str]] = {}
    for endpoint, key, what in re.findall(
        r"^\| (chat/completions|completions|messages) \| `([a-z_]+)` \| (.+?) \|$", text, re.MULTILINE
    ):
        rows.setdefault(endpoint, {})[key] = what
    return rows


def test_the_docs_table_is_the_gateways_table():
    assert _doc_table() == {e: surface.TABLES[w] for e, w in WIRES.items()}
    assert {e: set(s) for e, s in SAMPLES.items()} == {e: set(surface.TABLES[w]) for e, w in WIRES.items()}


@pytest.fixture(scope="module")
def app(tiny_qwen3):
    model = ChatModel(tiny_qwen3)
    gw, pods, _ = scripted_gateway(model, lambda prompt, sp: model.encode("ok<|im_end|>"), PODS)
    return gw, pods


ROWS = [(e, k) for e, table in _doc_table().items() for k in sorted(table)]


@pytest.mark.parametrize("endpoint, key", ROWS, ids=[f"{e}:{k}" for e, k in ROWS])
async def test_each_parameter_is_honoured_or_refused_by_name(app, endpoint, key):
    gw, pods = app
    what = surface.TABLES[WIRES[endpoint]][key]
    good, bad = SAMPLES[endpoint][key]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as http:
        if what != surface.REFUSED:
            pods.pods[PODS[0]].calls.clear()
            r = await http.post(PATHS[endpoint], json={**BASE[endpoint], key: good})
            assert r.status_code == 200, r.text
            reaches = key in SAMPLER or key == "structured_outputs"
            if reaches and key != "max_tokens" or (key == "max_tokens" and endpoint != "messages"):
                [(_, sp)] = pods.pods[PODS[0]].calls
                assert sp[key] == good  # it reached the pod's sampler
        if bad is not None:
            r = await http.post(PATHS[endpoint], json={**BASE[endpoint], key: bad})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err.get("param") == key if endpoint != "messages" else key in err["message"]
        else:
            assert what != surface.REFUSED and "only" not in what


async def test_an_unknown_parameter_is_refused_by_name(app):
    gw, _ = app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as http:
        for endpoint, path in PATHS.items():
            r = await http.post(path, json={**BASE[endpoint], "guided_json": {"type": "object"}})
            assert r.status_code == 400 and "guided_json" in r.text, r.text
            # the list of what it takes names only what it honours or reads, never what it refuses
            refused = [k for k, v in surface.TABLES[WIRES[endpoint]].items() if v == surface.REFUSED]
            assert refused and not [k for k in refused if f"'{k}'" in r.text], r.text
