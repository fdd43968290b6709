"""molt.agents semantics (Molt's agent contract) against the in-memory fake gateway."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import openai
import pytest

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Env, Episode, Result, StepEnvRunner
from molt.agents.base import first_scalar, load_agent_runner
from molt.agents.gateway import GatewayClient, GatewayError
from molt.agents.testing import FakeGateway


def _gateway(fake: FakeGateway) -> GatewayClient:
    return GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))


def _episode(prompt="Q: 1+1?", **kw) -> Episode:
    return Episode(prompt=prompt, group_id="g", label=kw.pop("label", "2"), **kw)


async def test_single_turn_state_reward_and_finish():
    seen = []

    class Grader(Env):
        async def step(self, state):
            seen.append(state)
            return Result(reward=1.0 if state["label"] in state["action_text"] else 0.0, info={"n": 3, "s": "x"})

    fake = FakeGateway(policy=lambda prompt, turn: "it is 2")
    out = await StepEnvRunner(Grader).execute(_episode(sampling_params={"temperature": 0.7}), _gateway(fake))
    assert set(seen[0]) == {"observation_text", "action_text", "label", "sampling_params"}
    assert seen[0]["observation_text"] == "Q: 1+1?" and seen[0]["action_text"] == "it is 2"
    assert seen[0]["sampling_params"].temperature == 0.7  # an object with vLLM's attribute names, as in Molt
    s = fake.sessions[out.trajectory_id]
    assert s.status == "finished" and s.finish == {"reward": 1.0, "score": 1.0, "info": {"n": 3.0}}
    assert (out.reward, out.turns, out.tokens, out.written) == (1.0, 1, len("Q: 1+1?it is 2"), True)
    assert s.fields["group_id"] == "g" and s.fields["label"] == "2"


class Countdown(Env):
    """Three turns; feedback "fb<i>" after each (also the last); reward i/10 per turn."""

    instances = 0

    def __init__(self):
        super().__init__()
        Countdown.instances += 1
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        state["sampling_params"].temperature = 99.0  # a copy: must not leak into the next turn
        return Result(
            reward=[self.turn / 10, 5.0],
            observation=f"|fb{self.turn}|",
            terminated=self.turn == 3,
            score=0.25 if self.turn == 3 else None,
        )


async def test_multi_turn_sums_rewards_and_masks_feedback_even_on_the_last_turn():
    fake = FakeGateway(policy=lambda prompt, turn: f"<a{turn}>")
    Countdown.instances = 0
    gw = _gateway(fake)
    out = await StepEnvRunner(Countdown).execute(_episode(prompt="P", sampling_params={"temperature": 1.0}), gw)
    s = fake.sessions[out.trajectory_id]
    assert out.turns == 3 and out.reward == pytest.approx(0.6) and out.score == 0.25
    assert s.action_texts() == ["<a1>", "<a2>", "<a3>"]
    assert s.masked_texts() == ["P", "|fb1|", "|fb2|", "|fb3|"]  # terminal feedback appended, masked
    assert out.tokens == len(s.token_ids)
    assert all(r["sampling_params"].get("temperature") == 1.0 for r in s.requests[:3])
    await StepEnvRunner(Countdown).execute(_episode(prompt="P"), gw)
    assert Countdown.instances == 2  # a fresh Env per episode


async def test_observation_text_accumulates_actions_and_feedback():
    texts = []

    class Echo(Env):
        async def step(self, state):
            texts.append(state["observation_text"])
            return Result(observation="[f]", terminated=len(texts) == 3)

    fake = FakeGateway(policy=lambda prompt, turn: f"a{turn}")
    await StepEnvRunner(Echo).execute(_episode(prompt="P"), _gateway(fake))
    assert texts == ["P", "Pa1[f]", "Pa1[f]a2[f]"]


async def test_result_sampling_params_replace_params_and_per_turn_cap():
    class Switch(Env):
        def __init__(self):
            self.turn = 0

        async def step(self, state):
            self.turn += 1
            return Result(
                observation=".",
                terminated=self.turn == 3,
                sampling_params={"temperature": 0.1, "max_tokens": 3} if self.turn == 1 else None,
            )

    fake = FakeGateway(policy=lambda prompt, turn: "xy")
    await StepEnvRunner(Switch).execute(
        _episode(max_new_tokens=8, sampling_params={"temperature": 1.0}), _gateway(fake)
    )
    sent = [r["sampling_params"] for r in next(iter(fake.sessions.values())).requests]
    assert sent[0] == {"temperature": 1.0, "max_tokens": 8}
    assert sent[1] == sent[2] == {"temperature": 0.1, "max_tokens": 3}
    assert sent[3] == {"max_tokens": 0}  # terminal feedback: append only


async def test_a_per_turn_length_cut_marks_truncated_but_the_env_decides_when_to_stop():
    class TwoTurns(Env):
        def __init__(self):
            self.turn = 0

        async def step(self, state):
            self.turn += 1
            return Result(reward=1.0, observation="more", terminated=self.turn == 2)

    fake = FakeGateway(policy=lambda prompt, turn: "a long answer")
    out = await StepEnvRunner(TwoTurns).execute(_episode(max_new_tokens=4), _gateway(fake))
    # every turn hits the per-turn cap of 4 tokens; Molt goes on until the env terminates
    assert out.truncated and out.turns == 2 and out.reward == 2.0


async def test_result_sampling_params_accepts_an_object_with_vllm_attribute_names():
    from types import SimpleNamespace

    from molt.agents.params import SamplingParams

    class Switch(Env):
        def __init__(self):
            self.turn = 0

        async def step(self, state):
            self.turn += 1
            sp = state["sampling_params"]
            assert isinstance(sp, SamplingParams) and sp.max_tokens == (8 if self.turn == 1 else 3)
            new = SimpleNamespace(max_tokens=3, temperature=0.2, top_p=1.0, stop=[])  # e.g. a vLLM SamplingParams
            return Result(observation=".", terminated=self.turn == 2, sampling_params=new)

    fake = FakeGateway(policy=lambda prompt, turn: "xy")
    await StepEnvRunner(Switch).execute(_episode(max_new_tokens=8), _gateway(fake))
    sent = [r["sampling_params"] for r in next(iter(fake.sessions.values())).requests]
    assert sent[:2] == [{"max_tokens": 8}, {"max_tokens": 3, "temperature": 0.2, "top_p": 1.0}]
    with pytest.raises(ValueError, match="Result.sampling_params: unknown sampling param"):
        SamplingParams.from_any({"max_new_tokens": 3}, "Result.sampling_params")


async def test_total_budget_stops_the_loop():
    class Forever(Env):
        async def step(self, state):
            return Result(reward=1.0, observation="..", terminated=False)

    fake = FakeGateway(policy=lambda prompt, turn: "ab")
    out = await StepEnvRunner(Forever).execute(_episode(prompt="P", max_length=12), _gateway(fake))
    s = fake.sessions[out.trajectory_id]
    # P ab .. ab .. ab = 11 tokens; the 4th turn appends its feedback (Molt does too) and finds no room
    assert out.truncated and s.status == "finished" and out.reward == out.turns == 3
    assert s.spans[-1][1] <= 12 and s.masked_texts()[-1] == ".." and len(s.token_ids) == 13


async def test_an_envs_chat_prompt_arrives_rendered_with_its_tools_and_goes_back_as_the_env_left_it():
    """As Molt's dataset pre-renders for a step runner: reset gets the chat template's text (tools in it, the
    generation prompt at its end), and the text it returns is the first turn, sent as is."""
    seen = []

    class Edit(Env):
        async def reset(self, state):
            seen.append(state["observation"])
            base = state["observation"]
            at = base.rfind("<|assistant|>")
            state["observation"] = base[:at] + "<|user|>room\n" + base[at:] + "<think>"
            return state

        async def step(self, state):
            seen.append(state["observation_text"])
            return Result(reward=0.5)

    fake = FakeGateway()
    tools = [{"type": "function", "function": {"name": "look", "parameters": {}}}]
    episode = _episode(prompt=[{"role": "user", "content": "hi"}], tools=tools)
    out = await StepEnvRunner(Edit).execute(episode, _gateway(fake))
    s = fake.sessions[out.trajectory_id]
    assert seen[0] == "<|tool|>look\n<|user|>hi\n<|assistant|>"
    assert s.requests[0]["render"]["tools"] == tools
    assert "messages" not in s.requests[1] and s.requests[1]["append_text"] == seen[1]
    assert s.masked_texts()[0] == seen[1] == "<|tool|>look\n<|user|>hi\n<|user|>room\n<|assistant|><think>"


async def test_a_runner_that_does_not_prerender_hands_its_env_the_messages():
    class Reset(Env):
        async def reset(self, state):
            return {"observation": state["observation"] + [{"role": "user", "content": "again"}]}

        async def step(self, state):
            return Result(reward=0.5)

    class Runner(StepEnvRunner):
        PRERENDER_PROMPT = False

    fake = FakeGateway()
    out = await Runner(Reset).execute(_episode(prompt=[{"role": "user", "content": "hi"}]), _gateway(fake))
    s = fake.sessions[out.trajectory_id]
    assert s.requests[0]["messages"][-1]["content"] == "again"
    assert s.masked_texts()[0] == "<|user|>hi\n<|user|>again\n<|assistant|>"


@pytest.mark.parametrize(
    "bad, err",
    [("not a result", TypeError), (Result(reward=None), ValueError), (Result(reward=float("nan")), ValueError)],
)
async def test_bad_results_abort_the_session(bad, err):
    class Bad(Env):
        async def step(self, state):
            return bad

    fake = FakeGateway()
    ep = _episode()
    with pytest.raises(err):
        await StepEnvRunner(Bad).execute(ep, _gateway(fake))
    assert fake.sessions[ep.trajectory_id].status == "aborted"


async def test_cancellation_aborts_the_session():
    class Hang(Env):
        async def step(self, state):
            await asyncio.sleep(3600)

    fake = FakeGateway()
    ep = _episode()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await StepEnvRunner(Hang).execute(ep, _gateway(fake))
    assert fake.sessions[ep.trajectory_id].status == "aborted"


def test_first_scalar():
    import numpy as np

    assert first_scalar(np.array([[0.5, 2.0]])) == 0.5
    assert first_scalar((3, 4)) == 3.0 and first_scalar(True) == 1.0
    with pytest.raises(ValueError):
        first_scalar([])


async def test_chat_agent_with_the_openai_sdk():
    fake = FakeGateway(policy=lambda prompt, turn: "the answer is 2")
    contexts = []

    class Agent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            contexts.append(ctx)
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app))
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=http)
            resp = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=32)
            return Result(reward=float("2" in resp.choices[0].message.content), info={"len": 3})

    ep = _episode(
        prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
        sampling_params={"temperature": 0.5},
        max_length=100,
    )
    out = await ChatAgentRunner(Agent).execute(ep, _gateway(fake))
    ctx = contexts[0]
    assert ctx.prompt == "1+1?" and ctx.model_name == "policy" and ctx.api_key == "EMPTY"
    assert ctx.base_url.endswith(f"/s/{ctx.session_id}/v1") and ctx.session_url.endswith(f"/s/{ctx.session_id}")
    assert ctx.sampling_params.temperature == 0.5 and ctx.sampling_params.max_tokens is None
    assert ctx.max_length == 100 and ctx.gateway_url == "http://fake"
    s = fake.sessions[out.trajectory_id]
    assert s.status == "finished" and s.finish["reward"] == 1.0 and out.turns == 1 and out.written
    assert s.action_texts() == ["the answer is 2"]


@pytest.mark.parametrize("truncated", [True, False])
async def test_a_truncated_result_is_said_at_finish_by_both_runners(truncated):
    class Cut(Env):
        async def step(self, state):
            return Result(reward=1.0, truncated=truncated, terminated=not truncated)

    class Agent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app))
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=http)
            await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, max_tokens=32)
            return Result(reward=1.0, truncated=truncated)

    fake = FakeGateway(policy=lambda prompt, turn: "ok")
    for runner in (StepEnvRunner(Cut), ChatAgentRunner(Agent)):
        out = await runner.execute(_episode(), _gateway(fake))
        assert out.truncated == truncated and fake.sessions[out.trajectory_id].finish.get("truncated") == (
            True if truncated else None
        )


@pytest.mark.parametrize("replies", ["raw", "parsed", None])
async def test_chat_agent_sessions_get_raw_replies_unless_the_agent_asks_for_parsed_ones(replies):
    class Agent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            return Result(reward=0.0)

    if replies is not None:
        Agent.REPLIES = replies
    fake = FakeGateway(policy=lambda prompt, turn: "ok")
    out = await ChatAgentRunner(Agent).execute(_episode(), _gateway(fake))
    assert fake.sessions[out.trajectory_id].fields["replies"] == (replies or "raw")  # Molt's chat server: raw


def test_an_unknown_replies_choice_is_refused_when_the_runner_is_built():
    class Agent(ChatAgent):
        REPLIES = "json"

        async def run(self, ctx: ChatContext) -> Result:
            return Result(reward=0.0)

    with pytest.raises(ValueError, match='Agent.REPLIES must be "raw" or "parsed"'):
        ChatAgentRunner(Agent)


async def test_chat_agent_string_prompt_and_failures_abort():
    class NotResult(ChatAgent):
        async def run(self, ctx):
            assert ctx.messages == [{"role": "user", "content": "hi"}]
            return {"reward": 1.0}

    fake = FakeGateway()
    ep = _episode(prompt="hi")
    with pytest.raises(TypeError, match="must return molt.agents.Result"):
        await ChatAgentRunner(NotResult).execute(ep, _gateway(fake))
    assert fake.sessions[ep.trajectory_id].status == "aborted"


def test_load_agent_runner(tmp_path):
    good = tmp_path / "agent.py"
    good.write_text(
        textwrap.dedent("""
        from molt.agents import Env, Result, StepEnvRunner

        class MyEnv(Env):
            async def step(self, state):
                return Result(reward=1.0)

        class AgentRunner(StepEnvRunner):
            def __init__(self):
                super().__init__(MyEnv)
    """)
    )
    runner = load_agent_runner(good, "mine")
    assert isinstance(runner, StepEnvRunner) and runner.env_cls.__name__ == "MyEnv"
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no AgentRunner"):
        load_agent_runner(tmp_path / "none.py", "none")
    (tmp_path / "wrong.py").write_text("class AgentRunner: pass\n")
    with pytest.raises(ValueError, match="must subclass"):
        load_agent_runner(tmp_path / "wrong.py", "wrong")
    with pytest.raises(ValueError, match=".py file"):
        load_agent_runner(tmp_path / "missing.py", "missing")


async def test_terminal_feedback_is_skipped_when_the_gateway_cannot_append_only():
    fake = FakeGateway(policy=lambda prompt, turn: f"<a{turn}>", zero_max_tokens_appends=False)
    out = await StepEnvRunner(Countdown).execute(_episode(prompt="P"), _gateway(fake))
    s = fake.sessions[out.trajectory_id]
    assert s.action_texts() == ["<a1>", "<a2>", "<a3>"] and s.masked_texts() == ["P", "|fb1|", "|fb2|"]
    probes = [p for p in fake.sessions.values() if p.fields["group_id"] == "molt-append-probe"]
    assert [p.status for p in probes] == ["aborted"]


def test_molt_module_paths_import(tmp_path):
    """Molt modules import from molt.agents.base / molt.agents.chat_agent too."""
    path = tmp_path / "molt_paths.py"
    path.write_text(
        textwrap.dedent("""
        from molt.agents.base import Env, Result, StepEnvRunner
        from molt.agents.chat_agent import ChatAgent, ChatAgentRunner, ChatContext

        class AgentRunner(StepEnvRunner):
            def __init__(self):
                super().__init__(Env)
    """)
    )
    assert isinstance(load_agent_runner(path, "molt_paths"), StepEnvRunner)


async def test_open_session_asks_again_after_a_503():
    """A draining replica (or a gateway without a ready pod yet) answers 503 + Retry-After and opened nothing:
    the client asks again, for up to open_retry_s; other errors and a 503 past that time are raised."""
    fake = FakeGateway()
    answers = [503, 503]

    async def flaky(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/sessions" and answers:
            await send(
                {
                    "type": "http.response.start",
                    "status": answers.pop(0),
                    "headers": [(b"retry-after", b"0.1"), (b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error": {"code": "draining"}}'})
            return
        await fake.app(scope, receive, send)

    client = GatewayClient("http://fake", transport=httpx.ASGITransport(app=flaky), open_retry_s=5.0)
    s = await client.open_session(group_id="g")
    assert s.id in fake.sessions and not answers
    answers[:] = [503] * 100
    quick = GatewayClient("http://fake", transport=httpx.ASGITransport(app=flaky), open_retry_s=0.35)
    with pytest.raises(GatewayError) as err:
        await quick.open_session(group_id="g")
    assert err.value.status == 503 and err.value.retry_after_s == 0.1 and len(answers) < 100
    answers[:] = [400]
    with pytest.raises(GatewayError) as err:
        await client.open_session(group_id="g")
    assert err.value.status == 400 and not answers  # not asked again


async def test_open_session_asks_again_when_the_gateway_refuses_the_connection():
    """A gateway restarting refuses connections: nothing was opened, so the client asks again (after a second),
    within open_retry_s; past it the refusal is raised."""
    fake = FakeGateway()
    inner = httpx.ASGITransport(app=fake.app)
    refusals = [1]

    class Restarting(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            if refusals:
                refusals.pop()
                raise httpx.ConnectError("connection refused", request=request)
            return await inner.handle_async_request(request)

    client = GatewayClient("http://fake", transport=Restarting(), open_retry_s=5.0)
    s = await client.open_session(group_id="g")
    assert s.id in fake.sessions and not refusals
    refusals[:] = [1]
    with pytest.raises(httpx.ConnectError):
        await GatewayClient("http://fake", transport=Restarting(), open_retry_s=0.5).open_session(group_id="g")


async def test_tensor_and_numpy_info_values_reach_the_trajectory_as_scalars():
    import numpy as np
    import torch

    class Tensors(Env):
        async def step(self, state):
            return Result(
                reward=torch.tensor(1.0),
                score=np.float32(0.5),
                info={
                    "exact": torch.tensor(1.0),
                    "turns": torch.tensor([2.0, 9.0]),
                    "np": np.float32(0.25),
                    "flag": True,
                    "name": "text is skipped",
                    "empty": torch.tensor([]),
                },
            )

    fake = FakeGateway(policy=lambda prompt, turn: "x")
    out = await StepEnvRunner(Tensors).execute(_episode(), _gateway(fake))
    expected = {"exact": 1.0, "turns": 2.0, "np": 0.25, "flag": 1.0}  # first element, as Molt's _first_scalar
    assert fake.sessions[out.trajectory_id].finish == {"reward": 1.0, "score": 0.5, "info": expected}
    assert out.info == expected


async def test_an_eval_episode_is_graded_but_writes_nothing():
    fake = FakeGateway(policy=lambda prompt, turn: "it is 2")

    class Grader(Env):
        async def step(self, state):
            return Result(reward=1.0)

    out = await StepEnvRunner(Grader).execute(_episode(eval=True), _gateway(fake))
    assert out.reward == 1.0 and not out.written
    assert fake.sessions[out.trajectory_id].status == "aborted"  # the gateway writes no trajectory
