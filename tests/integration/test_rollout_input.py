"""Input never kills or poisons a rollout pod: every bad value is a 400 in the pod's error shape, on
/v1/generate and /v1/generate_stream alike, and the engine keeps serving (an engine that dies anyway:
test_rollout_engine_death.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from http_fuzz import FUZZ, RAW_BODIES, assert_openai_error, encode, json_values, sampling_params
from hypothesis import given
from hypothesis import strategies as st
from rollout_testlib import PROMPT, ServerThread, tiny_settings

from molt.body_limit import BodyLimit
from services.rollout.app import build_app

pytestmark = [pytest.mark.timeout(300), pytest.mark.vllm]


BODY_LIMIT = 1 << 20  # --server.max_body_bytes of this pod: above every other body sent here


@pytest.fixture(scope="module")
def pod(tiny_qwen3):
    app = build_app(tiny_settings(tiny_qwen3))
    with ServerThread(BodyLimit(app, BODY_LIMIT)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, app


def _still_serves(client: httpx.Client) -> None:
    r = client.post("/v1/generate", json={"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "seed": 1}})
    assert r.status_code == 200, r.text
    assert client.get("/readyz").status_code == 200


def _stream(client: httpx.Client, calls: list[bytes]) -> list[dict]:
    r = client.post("/v1/generate_stream", content=b"".join(line + b"\n" for line in calls))
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()]


@pytest.mark.parametrize(
    "sp,param",
    [
        ({"seed": 2**64}, "seed"),  # used to pass SamplingParams and kill the engine in torch's manual_seed
        ({"seed": 2**63 - 1, "n": 2}, "seed"),  # sample 1 would be seeded with 2**63
        ({"temperature": float("nan")}, "temperature"),  # used to be a plain-text 500
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"stop_token_ids": [1, "a"]}, "stop_token_ids"),
        ({"n": 0}, "n"),
    ],
)
def test_a_bad_sampling_param_is_a_400_naming_it_and_the_engine_keeps_serving(pod, sp, param):
    client, _ = pod
    body = encode({"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2, **sp}})
    r = client.post("/v1/generate", content=body)
    err = assert_openai_error(r.status_code, r.content, {400})
    assert err["param"] == f"sampling_params.{param}", err
    [line] = _stream(
        client, [encode({"id": "c1", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2, **sp}})]
    )
    assert line["id"] == "c1" and line["status"] == 400 and line["error"]["param"] == f"sampling_params.{param}"
    _still_serves(client)


@pytest.mark.parametrize(
    "sp",
    [
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1e-40},
        {"repetition_penalty": 1e308},
        {"repetition_penalty": 1e308, "temperature": 0},
        {"top_p": 1e-300},
        {"min_p": 1.0},
        {"min_p": 1e-300},
        {"top_k": 2**63},
        {"top_k": 0, "temperature": 1e-300},
        {"seed": -(2**63)},
        {"seed": 2**63 - 2, "n": 2},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2, "min_tokens": 4},
        {"temperature": 2, "top_k": 1, "top_p": 1e-3, "min_p": 0.99},
    ],
)
def test_extremes_inside_vllms_bounds_generate_or_400_and_the_engine_keeps_serving(pod, sp):
    client, _ = pod
    r = client.post(
        "/v1/generate", content=encode({"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 4, **sp}})
    )
    if r.status_code != 200:
        assert_openai_error(r.status_code, r.content, {400})
    _still_serves(client)


@pytest.mark.parametrize("raw", RAW_BODIES, ids=lambda b: repr(b[:12]))
def test_unreadable_bodies_are_400s_in_the_pods_shape(pod, raw):
    client, _ = pod
    for path in ("/v1/generate", "/v1/prompt_logprobs", "/v1/weights/reload"):
        r = client.post(path, content=raw)
        assert_openai_error(r.status_code, r.content, {400})
    if raw.strip():
        lines = _stream(client, [raw])
        assert len(lines) == 1 and lines[0]["status"] == 400, lines
    _still_serves(client)


def test_a_body_over_the_limit_is_a_413_in_the_pods_shape_and_the_stream_bounds_only_its_lines(pod):
    client, _ = pod
    big = encode({"prompt_token_ids": [1] * BODY_LIMIT, "sampling_params": {"max_tokens": 2}})
    r = client.post("/v1/generate", content=big)
    assert "--server.max_body_bytes" in assert_openai_error(r.status_code, r.content, {413})["message"]
    r = client.post("/v1/generate", content=(big[i : i + 65536] for i in range(0, len(big), 65536)))  # chunked
    assert_openai_error(r.status_code, r.content, {413})
    # The long-lived stream is one body for as long as a gateway runs: many lines past the limit all go through.
    lines = _stream(
        client,
        [b'{"abort": []}'] * (BODY_LIMIT // 12)
        + [encode({"id": "a", "prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})],
    )
    assert [line["id"] for line in lines] == ["a"] and lines[0]["status"] == 200, lines
    _still_serves(client)


def test_wrong_methods_and_paths_answer_in_the_pods_shape(pod):
    client, _ = pod
    r = client.get("/v1/generate")
    assert assert_openai_error(r.status_code, r.content, {405})["code"] == "method_not_allowed"
    r = client.post("/readyz")
    assert_openai_error(r.status_code, r.content, {405})
    r = client.get("/v1/nothing")
    assert assert_openai_error(r.status_code, r.content, {404})["code"] == "not_found"


@FUZZ
@given(sp=st.one_of(sampling_params(), json_values), prompt=st.one_of(st.just(PROMPT), json_values))
def test_random_generate_bodies_get_200_or_a_400_never_a_5xx(pod, sp, prompt):
    client, _ = pod
    body = encode({"prompt_token_ids": prompt, "sampling_params": sp})
    r = client.post("/v1/generate", content=body)
    if r.status_code != 200:
        assert_openai_error(r.status_code, r.content, {400})
    [line] = _stream(client, [encode({"id": "x", "prompt_token_ids": prompt, "sampling_params": sp})])
    assert line["status"] == r.status_code, (line, r.text)
    assert client.get("/readyz").status_code == 200


@FUZZ
@given(body=json_values, path=st.sampled_from(["/v1/generate", "/v1/prompt_logprobs", "/v1/weights/reload"]))
def test_random_json_on_every_post_route_is_never_a_5xx(pod, body, path):
    client, app = pod
    version = app.state.engine.policy_version
    r = client.post(path, content=encode(body))
    if r.status_code != 200:
        assert_openai_error(r.status_code, r.content, {400})
    assert app.state.engine.policy_version == version
