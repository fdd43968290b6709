"""Bad input at every gateway surface is a 400 in the wire's error shape, before any pod sees it; a pod's 4xx
never marks the pod unhealthy. In-process gateway over fake pods; property tests with bounded examples."""

from __future__ import annotations

import asyncio
import json
import math
import os

import httpx
import pytest
from http_fuzz import (
    FUZZ,
    RAW_BODIES,
    SAMPLING_FIELDS,
    SURROGATE,
    assert_anthropic_error,
    assert_openai_error,
    encode,
    fields,
    json_values,
    sampling_params,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.app import build_app
from services.gateway.chat import ChatModel
from services.gateway.config import GatewaySettings
from services.gateway.errors import GatewayError
from services.gateway.metrics import gateway_metrics
from services.gateway.pods import PodPool
from tests.gateway_testlib import FakePods

PODS = ["http://pod-a:1"]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


def _run(model: ChatModel, requests) -> list[tuple[str, int, bytes]]:
    """Open a session on a fresh in-process gateway, then send ``requests(sid)``: [(method, path, body)]."""

    async def go():
        settings = GatewaySettings.model_validate(
            {
                "model": {"path": str(model.path)},
                "rollout": {"urls": PODS},
                "redis": {"url": "memory://", "stream": "t"},
            }
        )
        pods = FakePods(PODS, lambda prompt, sp: model.encode("ok<|im_end|>"))
        app = build_app(settings, transport=pods, model=model)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            sid = (await http.post("/v1/sessions", json={})).json()["session_id"]
            out = []
            for method, path, body in requests(sid):
                r = await asyncio.wait_for(http.request(method, path, content=body), 30)  # no hang
                out.append((path, r.status_code, r.content))
        assert all(pod.healthy for pod in app.gateway.pool.pods.values())  # a client's mistake is not the pod's
        return out

    return asyncio.run(go())


def _check(path: str, status: int, body: bytes) -> None:
    if status < 300:
        return
    if path.endswith("/messages") or path.endswith("/count_tokens"):
        assert_anthropic_error(status, body)
    else:
        assert_openai_error(status, body)


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", 2**64),
        ("temperature", math.nan),
        ("temperature", 1e308),
        ("top_p", 0),
        ("top_k", -5),
        ("presence_penalty", 3),
        ("frequency_penalty", math.inf),
        ("max_tokens", 0),
        ("n", 0),
        ("stop", [""]),
        ("stop", 5),
        ("top_logprobs", 21),
        ("seed", 1.5),
    ],
)
def test_a_bad_sampling_field_is_a_400_naming_it_on_the_openai_wire(model, field, value):
    body = encode({"messages": MESSAGES, field: value})
    for _path, status, raw in _run(
        model, lambda sid: [("POST", f"/s/{sid}/v1/chat/completions", body), ("POST", "/v1/chat/completions", body)]
    ):
        err = assert_openai_error(status, raw, {400})
        assert err["param"] == field, err


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", math.nan),
        ("temperature", 9),
        ("top_p", 1.5),
        ("top_k", -2),
        ("max_tokens", 0),
        ("stop_sequences", [""]),
        ("stop_sequences", "x"),
        ("stream", "yes"),
    ],
)
def test_a_bad_sampling_field_is_a_400_on_the_anthropic_wire(model, field, value):
    body = encode({"messages": MESSAGES, "max_tokens": 4, **{field: value}})
    [(_, status, raw)] = _run(model, lambda sid: [("POST", f"/s/{sid}/v1/messages", body)])
    assert status == 400
    assert field.split("_")[0] in assert_anthropic_error(status, raw)["message"]


@pytest.mark.parametrize(
    "sp,param",
    [
        ({"seed": 2**64}, "sampling_params.seed"),
        ({"temperature": math.nan}, "sampling_params.temperature"),
        ({"logprobs": False}, "sampling_params.logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "sampling_params.min_tokens"),
        ({"stop_token_ids": [10**9]}, "sampling_params.stop_token_ids"),
        ({"logit_bias": {"10000000": 1}}, "sampling_params.logit_bias"),
        ({"logit_bias": {"5": 101}}, "sampling_params.logit_bias"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "sampling_params.structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "sampling_params.structured_outputs.choice"),
    ],
)
def test_session_sampling_params_are_checked_when_opened_and_per_turn(model, sp, param):
    def requests(sid):
        return [
            ("POST", "/v1/sessions", encode({"sampling_params": sp})),
            ("POST", f"/v1/sessions/{sid}/generate", encode({"append_text": "hi", "sampling_params": sp})),
        ]

    for _, status, raw in _run(model, requests):
        assert assert_openai_error(status, raw, {400})["param"] == param


def test_a_sessions_bias_and_grammar_reach_the_pod_at_open_and_per_turn(model):
    """An Env's token-level turns carry logit_bias and structured_outputs as the OpenAI wire does: set at open
    they hold for every turn, a turn's own replace them for that turn."""

    async def go():
        settings = GatewaySettings.model_validate(
            {"model": {"path": str(model.path)}, "rollout": {"urls": PODS}, "redis": {"url": "memory://"}}
        )
        pods = FakePods(PODS, lambda prompt, sp: model.encode("ok<|im_end|>"))
        app = build_app(settings, transport=pods, model=model)
        opened = {"logit_bias": {5: -100}, "structured_outputs": {"choice": ["ok", "no"]}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            r = await http.post("/v1/sessions", json={"sampling_params": opened})
            sid = r.json()["session_id"]
            for turn_sp in ({}, {"logit_bias": {"7": 3.5}, "structured_outputs": {"regex": "o+"}}):
                body = {"append_text": "hi", "sampling_params": turn_sp}
                r = await http.post(f"/v1/sessions/{sid}/generate", json=body)
                assert r.status_code == 200, r.text
        return [sp for _, sp in pods.pods[PODS[0]].calls]

    first, second = asyncio.run(go())
    assert first["logit_bias"] == {"5": -100.0} and first["structured_outputs"] == {"choice": ["ok", "no"]}
    assert second["logit_bias"] == {"7": 3.5} and second["structured_outputs"] == {"regex": "o+"}


def test_a_grammar_a_session_was_opened_with_holds_for_its_chat_turns_and_refuses_a_prefill(model):
    async def go():
        settings = GatewaySettings.model_validate(
            {"model": {"path": str(model.path)}, "rollout": {"urls": PODS}, "redis": {"url": "memory://"}}
        )
        pods = FakePods(PODS, lambda prompt, sp: model.encode("ok<|im_end|>"))
        app = build_app(settings, transport=pods, model=model)
        held = {"choice": ["ok", "no"]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            sid = (await http.post("/v1/sessions", json={"sampling_params": {"structured_outputs": held}})).json()[
                "session_id"
            ]
            turn = await http.post(f"/s/{sid}/v1/chat/completions", json={"messages": MESSAGES})
            assert turn.status_code == 200, turn.text
            prefill = [*MESSAGES, {"role": "assistant", "content": "o"}]
            body = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
            refused = await http.post(f"/s/{sid}/v1/chat/completions", json=body)
            plain = await http.post("/v1/chat/completions", json={**body, "structured_outputs": {"regex": "k"}})
        [(_, sp)] = pods.pods[PODS[0]].calls
        return sp, refused, plain

    sp, refused, plain = asyncio.run(go())
    assert sp["structured_outputs"] == {"choice": ["ok", "no"]}
    assert assert_openai_error(refused.status_code, refused.content, {400})["param"] == (
        "sampling_params.structured_outputs"
    )
    assert assert_openai_error(plain.status_code, plain.content, {400})["param"] == "structured_outputs"


def test_response_format_and_structured_outputs_together_are_a_400(model):
    body = encode(
        {"messages": MESSAGES, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}
    )
    [(_, status, raw)] = _run(model, lambda sid: [("POST", "/v1/chat/completions", body)])
    assert assert_openai_error(status, raw, {400})["param"] == "structured_outputs"


def test_append_only_turns_still_take_max_tokens_0(model):
    body = encode({"append_text": "feedback", "sampling_params": {"max_tokens": 0}})
    [(_, status, raw)] = _run(model, lambda sid: [("POST", f"/v1/sessions/{sid}/generate", body)])
    assert status == 200 and json.loads(raw)["token_ids"] == []


@pytest.mark.parametrize("reward", [1e308, -1e308, math.nan, math.inf, 1e6 + 1, "1", True])
def test_rewards_must_be_finite_and_within_the_bound(model, reward):
    body = encode({"reward": reward})
    [(_, status, raw)] = _run(model, lambda sid: [("POST", f"/v1/sessions/{sid}/finish", body)])
    assert assert_openai_error(status, raw, {400})["param"] == "reward"


@pytest.mark.parametrize("truncated", ["yes", 1, 0, [True]])
def test_truncated_at_finish_must_be_a_boolean(model, truncated):
    body = encode({"reward": 1.0, "truncated": truncated})
    [(_, status, raw)] = _run(model, lambda sid: [("POST", f"/v1/sessions/{sid}/finish", body)])
    assert assert_openai_error(status, raw, {400})["param"] == "truncated"


def test_raw_bodies_and_wrong_methods_answer_in_each_wires_shape(model):
    paths = ["/v1/sessions", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/episodes"]

    def requests(sid):
        session_paths = [
            f"/s/{sid}/v1/chat/completions",
            f"/s/{sid}/v1/messages",
            f"/v1/sessions/{sid}/generate",
            f"/v1/sessions/{sid}/finish",
        ]
        return (
            [("POST", p, raw) for p in paths + session_paths for raw in RAW_BODIES if raw]
            + [("PUT", p, b"{}") for p in paths]
            + [("GET", "/v1/messages", b"")]
        )

    answers = _run(model, requests)
    for path, status, raw in answers:
        _check(path, status, raw)  # a 201: '{"a": "\\udfff"}' opens a session (unknown keys are ignored there)
    assert [status for _, status, _ in answers[-6:]] == [405] * 6


def _messages(roles: list[str]) -> st.SearchStrategy:
    """Message lists of the right outline with any content: where a wire's parsing meets client text."""
    block = fields(
        {
            "type": st.sampled_from(["text", "tool_use", "tool_result", "image"]),
            "text": json_values,
            "id": json_values,
            "name": json_values,
            "input": json_values,
            "content": json_values,
            "tool_use_id": json_values,
        },
        junk_keys=False,
    )
    message = fields(
        {
            "role": st.sampled_from(roles),
            "content": st.one_of(json_values, st.lists(block, max_size=2)),
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },
        junk_keys=False,
    )
    return st.one_of(st.just(MESSAGES), json_values, st.lists(message, min_size=1, max_size=3))


SURFACES = {
    "chat": (
        "/s/{sid}/v1/chat/completions",
        fields(
            {
                "messages": _messages(["user", "assistant", "system", "tool", "developer"]),
                "tools": json_values,
                "stream": st.booleans(),
                "logprobs": st.booleans(),
                "top_logprobs": st.integers(0, 25),
                "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3))),
                "stream_options": json_values,
                **SAMPLING_FIELDS,
            }
        ),
    ),
    "completions": (
        "/v1/completions",
        fields(
            {
                "prompt": st.one_of(st.just("hi"), st.lists(st.integers(0, 100))),
                "max_tokens": st.integers(1, 4),
                "logprobs": st.integers(0, 25),
                "seed": st.sampled_from([1, 2**64]),
                "stream": st.booleans(),
            }
        ),
    ),
    "messages": (
        "/s/{sid}/v1/messages",
        fields(
            {
                "messages": _messages(["user", "assistant"]),
                "max_tokens": st.integers(1, 4),
                "system": json_values,
                "temperature": st.floats(allow_nan=True),
                "stop_sequences": json_values,
                "tools": json_values,
            }
        ),
    ),
    "open": (
        "/v1/sessions",
        fields(
            {
                "sampling_params": st.one_of(sampling_params(), json_values),
                "max_length": json_values,
                "sample_index": json_values,
                "metadata": json_values,
                "group_id": json_values,
                "label": json_values,
            }
        ),
    ),
    "generate": (
        "/v1/sessions/{sid}/generate",
        fields(
            {
                "append_text": st.one_of(st.text(max_size=5), json_values),
                "append_token_ids": json_values,
                "messages": _messages(["user", "assistant", "system", "tool"]),
                "sampling_params": st.one_of(sampling_params(), json_values),
            }
        ),
    ),
    "render": (
        "/v1/sessions/{sid}/render",
        fields({"messages": _messages(["user", "assistant", "system", "tool"]), "tools": json_values}),
    ),
    "finish": (
        "/v1/sessions/{sid}/finish",
        fields(
            {"reward": st.one_of(st.floats(allow_nan=True), json_values), "score": json_values, "info": json_values}
        ),
    ),
    "episodes": ("/v1/episodes", fields({"episodes": json_values})),
}


@settings(
    FUZZ, max_examples=int(os.environ.get("MOLT_FUZZ_GATEWAY_EXAMPLES", "200"))
)  # ~10 ms an example in-process: more of them for eight surfaces
@given(surface=st.sampled_from(sorted(SURFACES)), data=st.data())
def test_random_bodies_on_every_gateway_surface_never_get_a_5xx(model, surface, data):
    path, strategy = SURFACES[surface]
    body = data.draw(strategy)
    for p, status, raw in _run(model, lambda sid: [("POST", path.format(sid=sid), encode(body))]):
        _check(p, status, raw)


class _Answers(FakePods):
    """A pod that answers each call with the next (status, body)."""

    def __init__(self, answers: list[tuple[int, bytes]]) -> None:
        super().__init__(PODS, lambda prompt, sp: [1])
        self.answers = answers

    async def post_json(self, url, body):
        import time

        status, raw = self.answers.pop(0)
        return status, raw, time.perf_counter()


async def test_a_pods_4xx_is_the_clients_400_and_leaves_the_pod_healthy_a_5xx_does_not():
    refusal = json.dumps({"error": {"message": "seed is out of range", "type": "invalid_request_error"}}).encode()
    pool = PodPool(PODS, _Answers([(400, refusal), (503, b"engine failed")]), gateway_metrics(), stream=False)
    pod = pool.get(PODS[0])
    with pytest.raises(GatewayError) as err:
        await pool.generate(pod, [1, 2], {"max_tokens": 2})
    assert err.value.status == 400 and "seed is out of range" in err.value.message and pod.healthy
    with pytest.raises(Exception, match="HTTP 503"):
        await pool.generate(pod, [1, 2], {"max_tokens": 2})
    assert not pod.healthy


def test_lone_surrogates_in_error_messages_still_encode(model):
    body = encode({"messages": MESSAGES, "stop": [SURROGATE, ""]})
    [(_, status, raw)] = _run(model, lambda sid: [("POST", f"/s/{sid}/v1/chat/completions", body)])
    assert_openai_error(status, raw, {400})


@pytest.mark.parametrize(
    "path,body",
    [
        ("/s/{sid}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi" + SURROGATE}]}),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": SURROGATE}}]},
        ),
        ("/s/{sid}/v1/completions", {"prompt": "a" + SURROGATE}),
        ("/s/{sid}/v1/messages", {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 4}),
        ("/v1/sessions/{sid}/generate", {"append_text": SURROGATE}),
    ],
)
def test_a_lone_surrogate_in_any_text_is_a_400_naming_where(model, path, body):
    [(p, status, raw)] = _run(model, lambda sid: [("POST", path.format(sid=sid), encode(body))])
    assert status == 400 and "lone UTF-16 surrogate" in raw.decode(), raw[:300]
    _check(p, status, raw)
    emoji = json.dumps({**body, **({"append_text": "\U0001f600"} if "append_text" in body else {})}).encode()
    if "append_text" in body:  # a valid pair (an emoji, escaped as two surrogates) is text
        [(_, ok, raw)] = _run(model, lambda sid: [("POST", path.format(sid=sid), emoji)])
        assert ok == 200, raw[:300]
