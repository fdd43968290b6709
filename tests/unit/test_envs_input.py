"""The env worker's HTTP surface: random bodies are never a 5xx, errors keep the worker's shape (405 and 404
included), sampling params are checked before a session opens, and an unbounded reward never leaves it."""

from __future__ import annotations

import asyncio
import json
import textwrap

import httpx
import pytest
from http_fuzz import FUZZ, RAW_BODIES, encode, fields, json_values, sampling_params
from hypothesis import given
from hypothesis import strategies as st

from molt.agents.testing import FakeGateway
from services.envs.app import build_app
from services.envs.config import EnvsSettings

AGENT = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class MyEnv(Env):
        async def step(self, state):
            return Result(reward=float(state["label"]) if isinstance(state["label"], (int, float)) else 0.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(MyEnv)
""")


PNG_URL = "data:image/png;base64," + (
    "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAEklEQVR4nGP8z4AdMOEQH6QSAM1BAQ/oQeJvAAAAAElFTkSuQmCC"
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "agent.py"
    path.write_text(AGENT)
    return path


def _run(agent, requests: list[tuple[str, str, bytes]]) -> tuple[list[httpx.Response], FakeGateway]:
    async def go():
        fake = FakeGateway(policy=lambda prompt, turn: "ok")
        settings = EnvsSettings(
            agent=[f"echo={agent}"],
            gateway={"url": "http://fake"},
            envs={"max_concurrency": 4, "episode_timeout_s": 5.0},
        )
        app = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
            return [await asyncio.wait_for(client.request(m, p, content=b), 30) for m, p, b in requests], fake

    return asyncio.run(go())


def _shape(r: httpx.Response) -> dict:
    assert r.status_code < 500, r.text[:300]
    err = json.loads(r.content)["error"]
    assert isinstance(err["message"], str) and err["code"] == r.status_code
    return err


def _episode(**over) -> dict:
    return {"agent": "echo", "prompt": "say", "label": 1.0, "group_id": "g", **over}


def test_routing_errors_and_unreadable_bodies_keep_the_workers_error_shape(agent):
    answers, _ = _run(
        agent,
        [("GET", "/v1/episodes:run", b""), ("POST", "/healthz", b""), ("GET", "/nope", b"")]
        + [("POST", "/v1/episodes:run", raw) for raw in RAW_BODIES],
    )
    assert [r.status_code for r in answers[:3]] == [405, 405, 404]
    for r in answers:
        _shape(r)
    assert all(r.status_code == 400 for r in answers[3:])


@pytest.mark.parametrize(
    "sp,param", [({"seed": 2**64}, "seed"), ({"temperature": float("nan")}, "temperature"), ({"top_p": 2}, "top_p")]
)
def test_bad_sampling_params_are_a_400_naming_them_before_any_session_opens(agent, sp, param):
    [r], fake = _run(agent, [("POST", "/v1/episodes:run", encode(_episode(sampling_params=sp)))])
    message = _shape(r)["message"]
    assert r.status_code == 400 and "sampling_params" in message and f"'{param}'" in message
    assert not fake.sessions


@pytest.mark.parametrize(
    "images,status,match",
    [
        (["data:image/png;base64,bm90IGFuIGltYWdl"], 400, "images[0]: not a readable image"),
        (["https://example.com/a.png"], 400, "images[0]: expected a base64 image data URL"),
        ([PNG_URL], 400, "echo is an Env"),  # a good image, but the token path cannot take it
    ],
)
def test_images_an_agent_cannot_take_are_a_400_before_any_session_opens(agent, images, status, match):
    [r], fake = _run(agent, [("POST", "/v1/episodes:run", encode(_episode(images=images)))])
    assert r.status_code == status and match in _shape(r)["message"]
    assert not fake.sessions


@pytest.mark.parametrize("reward", [1e308, -1e308, 1e7])
def test_a_reward_past_the_bound_fails_the_episode_naming_reward_and_writes_nothing(agent, reward):
    [r], fake = _run(agent, [("POST", "/v1/episodes:run", encode(_episode(label=reward)))])
    body = r.json()
    assert r.status_code == 200 and body["status"] == "failed" and "reward" in body["error"]
    assert not any(s.status == "finished" for s in fake.sessions.values())


@FUZZ
@given(
    body=st.one_of(
        json_values,
        fields(
            {
                "agent": st.sampled_from(["echo", "other"]),
                "prompt": st.one_of(st.text(max_size=4), json_values),
                "label": json_values,
                "group_id": st.text(max_size=3),
                "sample_index": json_values,
                "sampling_params": st.one_of(sampling_params(), json_values),
                "max_length": json_values,
                "tools": json_values,
                "images": st.one_of(json_values, st.lists(st.sampled_from([PNG_URL, "data:image/png;base64,"]))),
            }
        ),
    )
)
def test_random_bodies_never_get_a_5xx(agent, body):
    [r], _ = _run(agent, [("POST", "/v1/episodes:run", encode(body))])
    if r.status_code != 200:
        _shape(r)
