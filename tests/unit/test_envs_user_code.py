"""User code misbehaving through the env worker (over the in-memory fake gateway): what it returns never reaches
the trainer as something it is not, the error names the user's class, and the worker's answer agrees with what
the gateway wrote."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import pytest

from molt.agents import ChatAgent, ChatAgentRunner, Result
from molt.agents.base import first_scalar, numeric_info
from molt.agents.testing import FakeGateway
from services.envs.app import build_app
from services.envs.config import EnvsSettings

AGENT = textwrap.dedent("""
    import asyncio
    import time

    import numpy as np
    import torch

    from molt.agents import Env, Result, StepEnvRunner

    REWARDS = {
        "text": "0.5",
        "bytes": b"1",
        "np_text": np.str_("1"),
        "nested_empty": [torch.tensor([])],
        "huge_int": 10**400,
        "np_bool": np.bool_(True),
        "torch_bf16": torch.tensor([0.5], dtype=torch.bfloat16),
    }

    class UserEnv(Env):
        async def reset(self, state):
            if state["label"] == "reset_forgets_return":
                state["observation"] = "Answer: " + state["observation"]  # and no `return state`
                return None
            if state["label"] == "reset_wrong_key":
                return {"obs": state["observation"]}
            return state

        async def step(self, state):
            label = state["label"]
            if label in REWARDS:
                return Result(reward=REWARDS[label])
            if label == "info_list":
                return Result(reward=1.0, info=[1.0])
            if label == "info_huge_int":
                return Result(reward=1.0, info={"count": 10**400, "ok": 2})
            if label == "observation_dict":
                return Result(reward=1.0, observation={"feedback": "no"}, terminated=False)
            if label == "blocks_the_loop":
                time.sleep(0.6)  # user code that blocks instead of awaiting, past the deadline
                return Result(reward=1.0)
            if label == "slow":
                await asyncio.sleep(0.2)
            if label == "swallows_the_timeout":
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:  # user code that catches the deadline's cancellation
                    return Result(reward=1.0)
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(UserEnv)
""")

NO_CALL_AGENT = textwrap.dedent("""
    from molt.agents import ChatAgent, ChatAgentRunner, Result

    class Lazy(ChatAgent):
        async def run(self, ctx):
            return Result(reward=1.0)  # graded without asking the model anything

    class AgentRunner(ChatAgentRunner):
        def __init__(self):
            super().__init__(Lazy)
""")


def _slow_finish(app, delay_s: float):
    """``app`` answering each finish ``delay_s`` after it handled it (the real gateway waits so while the stream is
    full or Redis is slow): the trajectory is written before the worker hears so."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/finish"):

            async def late_send(message):
                if message["type"] == "http.response.start":
                    await asyncio.sleep(delay_s)
                await send(message)

            return await app(scope, receive, late_send)
        return await app(scope, receive, send)

    return wrapped


@pytest.fixture
def worker(tmp_path):
    (tmp_path / "user.py").write_text(AGENT)
    (tmp_path / "lazy.py").write_text(NO_CALL_AGENT)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")

    def build(episode_timeout_s: float = 5.0, finish_delay_s: float = 0.0):
        gateway_app = _slow_finish(fake.app, finish_delay_s) if finish_delay_s else fake.app
        settings = EnvsSettings(
            agent=[f"user={tmp_path / 'user.py'}", f"lazy={tmp_path / 'lazy.py'}"],
            gateway={"url": "http://fake"},
            envs={"max_concurrency": 8, "episode_timeout_s": episode_timeout_s},
        )
        app = build_app(settings, gateway_transport=httpx.ASGITransport(app=gateway_app))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=30)

    return fake, build


async def _run(client, label, agent="user") -> dict:
    r = await client.post(
        "/v1/episodes:run", json={"agent": agent, "prompt": "say yes", "label": label, "group_id": "g"}
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "label, error",
    [
        ("text", "UserEnv.step: Result.reward must be a number, got text str: '0.5'"),
        ("bytes", "UserEnv.step: Result.reward must be a number, got text bytes"),
        ("np_text", "UserEnv.step: Result.reward must be a number, got text str"),
        ("nested_empty", "UserEnv.step: Result.reward is empty"),
        ("huge_int", "UserEnv.step: Result.reward must be finite"),
        ("info_list", "UserEnv.step: Result.info must be a dict"),
        ("observation_dict", "UserEnv.step: Result.observation must be text"),
        ("reset_forgets_return", "UserEnv.reset must return the state dict (e.g. `return state`)"),
        ("reset_wrong_key", 'UserEnv.reset must return the state dict with an "observation" key'),
    ],
)
async def test_what_user_code_returns_wrong_fails_its_episode_naming_the_code_and_writes_nothing(worker, label, error):
    fake, build = worker
    async with build() as client:
        body = await _run(client, label)
    assert body["status"] == "failed" and error in body["error"], body
    session = fake.sessions[body["trajectory_id"]]
    assert session.status == "aborted" and session.finish is None
    if label.startswith("reset"):  # the text "None" never went to the model as the prompt
        assert not any("append_text" in r for r in session.requests)


@pytest.mark.parametrize("label, reward", [("np_bool", 1.0), ("torch_bf16", 0.5)])
async def test_numpy_and_torch_scalars_are_rewards(worker, label, reward):
    fake, build = worker
    async with build() as client:
        body = await _run(client, label)
    assert body["status"] == "ok" and body["reward"] == reward
    assert fake.sessions[body["trajectory_id"]].finish["reward"] == reward


async def test_an_info_int_past_floats_range_is_skipped_as_a_non_finite_one(worker):
    fake, build = worker
    async with build() as client:
        body = await _run(client, "info_huge_int")
    assert body["status"] == "ok"
    assert fake.sessions[body["trajectory_id"]].finish["info"] == {"ok": 2.0}


async def test_a_finish_in_flight_at_the_deadline_completes_and_the_answer_says_written(worker):
    # The step ends before the deadline; the gateway writes the trajectory and answers after it.
    fake, build = worker
    async with build(episode_timeout_s=0.5, finish_delay_s=0.6) as client:
        body = await _run(client, "slow")
    session = fake.sessions[body["trajectory_id"]]
    assert session.finish is not None  # the gateway got the finish: the trajectory is in the stream
    assert body["status"] == "ok" and body["written"], body  # not "timeout" (which the dispatcher would rerun)
    assert session.status == "finished"


@pytest.mark.parametrize("label", ["blocks_the_loop", "swallows_the_timeout"])
async def test_user_code_that_outlives_the_deadline_times_out_before_its_finish_is_sent(worker, label):
    fake, build = worker
    async with build(episode_timeout_s=0.3) as client:
        body = await _run(client, label)
    assert body["status"] == "timeout" and not body["written"]
    session = fake.sessions[body["trajectory_id"]]
    assert session.finish is None and session.status == "aborted"


async def test_an_agent_that_never_calls_the_model_says_why_nothing_was_written(worker):
    _, build = worker
    async with build() as client:
        body = await _run(client, "x", agent="lazy")
    assert body["status"] == "ok" and not body["written"]
    assert "no model call" in body["error"]


def test_a_plain_def_run_is_refused_when_the_runner_is_built():
    class SyncAgent(ChatAgent):
        def run(self, ctx):  # type: ignore[override]
            return Result(reward=1.0)

    with pytest.raises(ValueError, match=r"SyncAgent\.run must be async def"):
        ChatAgentRunner(SyncAgent)


def test_first_scalar_and_numeric_info_edges():
    assert first_scalar([[2.0, 3.0]]) == 2.0 and first_scalar(False) == 0.0
    with pytest.raises(ValueError, match="MyEnv.step: Result.score must be a number, got text"):
        first_scalar("1", "score", "MyEnv.step")
    assert numeric_info(None) == {} and numeric_info({"big": 10**400, "nan": float("nan"), "x": "y"}) == {}


@pytest.mark.parametrize("how", ["the state's copy, edited", "numpy numbers"])
async def test_result_sampling_params_from_the_state_or_numpy_reach_the_next_turn(how):
    import numpy as np

    from molt.agents import Env, StepEnvRunner
    from molt.agents.base import Episode
    from molt.agents.gateway import GatewayClient

    class Switch(Env):
        def __init__(self):
            self.turn = 0

        async def step(self, state):
            self.turn += 1
            if how == "numpy numbers":
                sp = {"temperature": np.float32(0.5), "max_tokens": np.int64(3)}
            else:
                sp = state["sampling_params"]  # Molt's pattern: edit this turn's copy and hand it back
                sp.temperature, sp.max_tokens = 0.5, 3
            return Result(reward=1.0, observation=".", terminated=self.turn == 2, sampling_params=sp)

    fake = FakeGateway(policy=lambda prompt, turn: "xy")
    gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    out = await StepEnvRunner(Switch).execute(Episode(prompt="q", group_id="g", max_new_tokens=8), gateway)
    sent = [r["sampling_params"] for r in fake.sessions[out.trajectory_id].requests]
    assert sent[0] == {"max_tokens": 8} and sent[1] == {"temperature": 0.5, "max_tokens": 3}
    await gateway.aclose()


def test_a_non_finite_sampling_param_is_refused_naming_it():
    from molt.agents.params import SamplingParams

    with pytest.raises(ValueError, match=r"Result.sampling_params.temperature must be a finite number, got nan"):
        SamplingParams.from_any({"temperature": float("nan")}, "Result.sampling_params")


class _DropsBigBodies(httpx.AsyncBaseTransport):
    """The fake gateway behind a transport that breaks the connection of a request over 1 MB, as the real gateway
    does to a body over its --session.max_body_bytes (it answers 413 and closes while the upload goes on);
    ``down``: its health probe cannot connect either (the gateway died mid-episode)."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down and request.url.path == "/healthz":
            raise httpx.ConnectError("connection refused", request=request)
        if len(request.content) > 1 << 20:
            raise httpx.ReadError("", request=request)
        return await self.inner.handle_async_request(request)


HUGE_FEEDBACK = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class Chatty(Env):
        async def step(self, state):
            if len(state["observation_text"]) > 1000:
                return Result(reward=1.0)
            return Result(reward=0.0, observation="x" * (4 << 20), terminated=False)  # 4 MB of feedback

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(Chatty)
""")


async def test_a_connection_the_gateway_drops_while_up_fails_the_episode_instead_of_waiting_it_out(tmp_path):
    (tmp_path / "chatty.py").write_text(HUGE_FEEDBACK)
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    transport = _DropsBigBodies(fake.app)
    settings = EnvsSettings(agent=[f"chatty={tmp_path / 'chatty.py'}"], gateway={"url": "http://fake"})
    app = build_app(settings, gateway_transport=transport)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        body = {"agent": "chatty", "prompt": "q", "group_id": "g"}
        r = await client.post("/v1/episodes:run", json=body)
        # Rerunning would send the same 4 MB again: a 503 would have the dispatcher do so forever.
        assert r.status_code == 200 and r.json()["status"] == "failed", r.text
        assert "--session.max_body_bytes" in r.json()["error"]
        assert all(s.status == "aborted" for s in fake.sessions.values())
        transport.down = True  # the same error while the gateway is down is an outage to wait out
        r = await client.post("/v1/episodes:run", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
