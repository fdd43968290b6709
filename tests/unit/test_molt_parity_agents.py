"""Parity with Molt 0.1.6's agent contract: what a Molt agent module (or one of Molt's example modules, vendored
unchanged under tests/fixtures/molt_examples) can observe when it runs here.

Each test names the Molt behaviour it pins. The behaviours come from Molt's unit tests of its agents, chat
server, example agents, python tool and math grader; the assertions are written against our code (the
in-process engine form, the fake gateway, the gateway's wire encoders).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Env, Episode, Result, StepEnvRunner
from molt.agents.base import _extract_generation_logprobs, load_agent_runner
from molt.agents.gateway import GatewayClient
from molt.agents.testing import FakeGateway

MOLT_EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "molt_examples"


def _gateway(fake: FakeGateway) -> GatewayClient:
    return GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, MOLT_EXAMPLES / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the in-process StepEnvRunner form: execute(prompt, label, sampling_params, max_length, tokenizer, engine)


class _CharTokenizer:
    """One token per character (token id = code point), as a stand-in for an HF tokenizer."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) for c in text]], dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _ScriptedEngine:
    """Answers each generate with the next scripted text; logprobs in vLLM's per-position dict shape."""

    def __init__(self, answers: list[str], logprob: float = -0.25, drop_logprobs: bool = False) -> None:
        self.answers = list(answers)
        self.logprob = logprob
        self.drop_logprobs = drop_logprobs
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None, session_id=None):
        self.prompts.append(list(prompt_token_ids))
        ids = [ord(c) for c in self.answers.pop(0)]
        logprobs = None if self.drop_logprobs else [{t: SimpleNamespace(logprob=self.logprob)} for t in ids]
        out = SimpleNamespace(token_ids=ids, text="", finish_reason="stop", logprobs=logprobs)
        return SimpleNamespace(outputs=[out]), 0


class _TwoTurnEnv(Env):
    def __init__(self):
        super().__init__()
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        return Result(reward=1.0, observation=f"[fb{self.turn}]", terminated=self.turn == 2)


def test_in_process_trajectory_holds_tokens_text_ranges_and_logprobs():
    """Molt's in-process step runner returns one token-exact Trajectory: the prompt, each action and each
    feedback (the terminal one too) as tokens and as text, an action range per turn, and (with
    sampling_params.logprobs set) a rollout logprob per token, 0.0 on the masked ones."""
    engine = _ScriptedEngine(["ab", "cd"])
    params = SimpleNamespace(max_tokens=8, logprobs=1, temperature=1.0)
    traj = asyncio.run(StepEnvRunner(_TwoTurnEnv).execute("P:", "lab", params, 64, _CharTokenizer(), engine))
    text = "P:ab[fb1]cd[fb2]"
    assert traj.observation_tokens == [ord(c) for c in text]
    assert traj.observation_text == text
    assert traj.action_ranges == [(2, 4), (9, 11)]
    assert [traj.observation_tokens[a:b] for a, b in traj.action_ranges] == [[ord("a"), ord("b")], [99, 100]]
    lp = [0.0] * len(text)
    for a, b in traj.action_ranges:
        lp[a:b] = [-0.25] * (b - a)
    assert traj.rollout_log_probs == lp
    assert engine.prompts[1] == [ord(c) for c in "P:ab[fb1]"]  # turn 2 generates over the exact tokens
    assert (traj.reward, traj.prompt, traj.label, traj.truncated) == (2.0, "P:", "lab", False)


def test_in_process_a_grammar_an_env_hands_back_reaches_the_engine_as_vllms_own_object():
    """An Env's vLLM SamplingParams with a StructuredOutputsParams travels as its one constraint; the in-process
    engine gets vLLM's object back (its request checks read the object's own fields)."""
    vllm_sampling = pytest.importorskip("vllm.sampling_params")
    seen = []

    class Recording(_ScriptedEngine):
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None, session_id=None):
            seen.append(sampling_params.structured_outputs)
            return await super().generate(prompt_token_ids, sampling_params, multi_modal_data, session_id)

    class Constraining(Env):
        async def step(self, state):
            if seen[-1] is not None:
                return Result(reward=1.0, terminated=True)
            grammar = vllm_sampling.StructuredOutputsParams(choice=["ab", "cd"])
            sp = vllm_sampling.SamplingParams(max_tokens=4, structured_outputs=grammar)
            return Result(reward=0.0, observation=".", terminated=False, sampling_params=sp)

    params = vllm_sampling.SamplingParams(max_tokens=8)
    engine = Recording(["ab", "cd"])
    asyncio.run(StepEnvRunner(Constraining).execute("P:", "", params, 64, _CharTokenizer(), engine))
    assert seen[0] is None
    assert isinstance(seen[1], vllm_sampling.StructuredOutputsParams) and seen[1].choice == ["ab", "cd"]


class _RewardEveryTurnEnv(Env):
    last_score = None

    def __init__(self):
        super().__init__()
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        done = self.turn == 2
        return Result(reward=0.25 * self.turn, observation=".", terminated=done, score=self.last_score if done else 9)


@pytest.mark.parametrize(("last_score", "expected"), [(None, 0.5), (0.1, 0.1)])
def test_an_episodes_score_is_the_last_turns_score_or_reward(last_score, expected):
    """Rewards add up over turns; the score (what dynamic filtering and the scoreboard read) is the last
    turn's, and without one that turn's reward, not the summed reward."""
    params = SimpleNamespace(max_tokens=8, logprobs=None, temperature=1.0)
    engine = _ScriptedEngine(["ab", "cd"])
    env = type("ScoredEnv", (_RewardEveryTurnEnv,), {"last_score": last_score})
    traj = asyncio.run(StepEnvRunner(env).execute("P:", "", params, 64, _CharTokenizer(), engine))
    assert traj.reward == 0.75 and traj.scores == pytest.approx(expected)


def test_in_process_trajectory_has_no_logprobs_without_importance_correction():
    params = SimpleNamespace(max_tokens=8, logprobs=None)
    traj = asyncio.run(
        StepEnvRunner(_TwoTurnEnv).execute("P", "l", params, 64, _CharTokenizer(), _ScriptedEngine(["a", "b"]))
    )
    assert traj.rollout_log_probs is None and len(traj.action_ranges) == 2


def test_in_process_engine_that_omits_logprobs_fails_the_rollout():
    """With logprobs requested, a generation without them is an error (Molt fails fast), not silent zeros."""
    params = SimpleNamespace(max_tokens=8, logprobs=1)
    engine = _ScriptedEngine(["a"], drop_logprobs=True)
    with pytest.raises(RuntimeError, match="did not return token logprobs"):
        asyncio.run(StepEnvRunner(_TwoTurnEnv).execute("P", "l", params, 64, _CharTokenizer(), engine))


class _SeeingEnv(Env):
    """Ends after one turn, keeping the observation text it was shown."""

    seen: list[str] = []

    async def step(self, state):
        _SeeingEnv.seen.append(state["observation_text"])
        return Result(reward=1.0, terminated=True)


@pytest.mark.parametrize(("max_tokens", "kept"), [(8, 32), (None, 8)])
def test_a_first_prompt_too_long_to_generate_keeps_its_last_tokens_in_process(max_tokens, kept):
    """Molt's initial truncation: a prompt leaving no room to generate keeps its last max(1, max_length - reserve)
    tokens (reserve: max_tokens, else 32), and the env's observation text is that kept part re-decoded."""
    prompt = "".join(chr(65 + i % 26) for i in range(100))
    _SeeingEnv.seen = []
    engine = _ScriptedEngine(["ok"])
    params = SimpleNamespace(max_tokens=max_tokens, logprobs=None)
    traj = asyncio.run(StepEnvRunner(_SeeingEnv).execute(prompt, "", params, 40, _CharTokenizer(), engine))
    assert engine.prompts[0] == [ord(c) for c in prompt[-kept:]]
    assert _SeeingEnv.seen == [prompt[-kept:]]
    assert traj.observation_text == prompt[-kept:] + "ok" and traj.action_ranges == [(kept, kept + 2)]


def test_a_first_prompt_too_long_to_generate_keeps_its_last_tokens_through_the_gateway():
    """The same rule through the gateway's session API (the fake implements the gateway's truncate_prompt)."""
    prompt = "".join(chr(65 + i % 26) for i in range(100))
    _SeeingEnv.seen = []
    fake = FakeGateway(policy=lambda text, turn: "ok")
    episode = Episode(prompt=prompt, group_id="g", max_length=40, sampling_params={"max_tokens": 8})
    result = asyncio.run(StepEnvRunner(_SeeingEnv).execute(episode, _gateway(fake)))
    [session] = fake.sessions.values()
    assert result.turns == 1 and session.text() == prompt[-32:] + "ok"
    assert _SeeingEnv.seen == [prompt[-32:]] and session.requests[0]["truncate_prompt"] == "left"


class _ParamsEnv(Env):
    seen: list[tuple] = []

    def __init__(self):
        super().__init__()
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        sp = state["sampling_params"]
        _ParamsEnv.seen.append((sp.max_tokens, sp.min_tokens))
        return Result(reward=0.0, observation="..", terminated=self.turn == 3)


@pytest.mark.parametrize("through", ["engine", "gateway"])
def test_the_params_an_env_sees_hold_max_tokens_to_the_room_the_turn_had(through):
    """Molt's turn max_tokens is min(per-turn cap, room left in max_length), min_tokens clamped to it, and the
    env's state carries that turn's params: here turns 1-2 have room for the cap of 8, turn 3 only 6."""
    _ParamsEnv.seen = []
    if through == "engine":
        params = SimpleNamespace(max_tokens=8, min_tokens=7, logprobs=None)
        engine = _ScriptedEngine(["abcd", "efgh", "ij"])
        asyncio.run(StepEnvRunner(_ParamsEnv).execute("P" * 10, "", params, 28, _CharTokenizer(), engine))
    else:
        fake = FakeGateway(policy=lambda text, turn: ["abcd", "efgh", "ij"][turn - 1])
        sp = {"max_tokens": 8, "min_tokens": 7}
        episode = Episode(prompt="P" * 10, group_id="g", max_length=28, sampling_params=sp)
        asyncio.run(StepEnvRunner(_ParamsEnv).execute(episode, _gateway(fake)))
    assert _ParamsEnv.seen == [(8, 7), (8, 7), (6, 6)]


def test_molts_in_process_form_of_a_chat_agent_runner_is_refused_with_what_to_do_instead():
    """A ChatAgent talks to the gateway's HTTP session URLs, which a bare engine does not serve: Molt's in-process
    call gets an error that names the supported ways, not an argument-count TypeError."""

    class Agent(ChatAgent):
        async def run(self, ctx):
            return Result(reward=1.0)

    params = SimpleNamespace(max_tokens=8, logprobs=None)
    call = ChatAgentRunner(Agent).execute("P", "l", params, 64, _CharTokenizer(), _ScriptedEngine(["a"]))
    with pytest.raises(TypeError, match="StepEnvRunner only.*FakeGateway"):
        asyncio.run(call)


def test_generation_logprobs_must_align_and_missing_entries_are_zero():
    entry = {7: SimpleNamespace(logprob=-1.5)}
    assert _extract_generation_logprobs([7, 8], [entry, {}]) == [-1.5, 0.0]
    assert _extract_generation_logprobs([7], [None]) == [0.0]
    with pytest.raises(RuntimeError, match="must align"):
        _extract_generation_logprobs([7, 8], [entry])


# ---- the agent classes' surface


def test_runner_flags_where_the_prompt_is_rendered():
    """Molt's PRERENDER_PROMPT: the step path takes a rendered prompt, the chat path the raw messages."""
    assert StepEnvRunner.PRERENDER_PROMPT is True and ChatAgentRunner.PRERENDER_PROMPT is False


def test_env_and_chat_agent_constructors_take_arguments_as_molts_do():
    """Molt's Env and ChatAgent accept and ignore constructor arguments, so a subclass may forward its own."""

    class Configured(Env):
        def __init__(self, turns=3, **kwargs):
            super().__init__(turns, **kwargs)
            self.turns = turns

        async def step(self, state):
            return Result(reward=0.0)

    class ConfiguredAgent(ChatAgent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

        async def run(self, ctx):
            return Result(reward=0.0)

    assert Configured(5, name="x").turns == 5
    assert isinstance(ConfiguredAgent("a", b=1), ChatAgent)


# ---- ChatAgentRunner: what ctx holds, how the Result is reduced, how failures end the episode


def _png():
    from PIL import Image

    return Image.new("RGB", (4, 4), (200, 10, 10))


async def test_chat_context_prompt_is_the_raw_rows_last_user_text():
    """ctx.prompt is taken from the row as given (Molt grades and logs on it), so a user string's <image>
    marker stays in it even though ctx.messages carries that image inlined as an image_url part."""
    seen: list[ChatContext] = []

    class Capture(ChatAgent):
        async def run(self, ctx):
            seen.append(ctx)
            return Result(reward=0.0)

    row = [{"role": "system", "content": "sys"}, {"role": "user", "content": "<image>Find x."}]
    ep = Episode(prompt=row, group_id="g", label="3", images=[_png()])
    await ChatAgentRunner(Capture).execute(ep, _gateway(FakeGateway()))
    ctx = seen[0]
    assert ctx.prompt == "<image>Find x."
    parts = ctx.messages[1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"] and parts[1]["text"] == "Find x."
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert len(ctx.images) == 1 and ctx.images[0].size == (4, 4)
    assert row[1]["content"] == "<image>Find x."  # the dataset row itself is left as it was


async def test_chat_messages_keep_extra_markers_literal_and_extra_images_only_on_ctx():
    seen: list[ChatContext] = []

    class Capture(ChatAgent):
        async def run(self, ctx):
            seen.append(ctx)
            return Result(reward=0.0)

    runner = ChatAgentRunner(Capture)
    await runner.execute(Episode(prompt="A<image>B<image>C", group_id="g", images=[_png()]), _gateway(FakeGateway()))
    parts = seen[0].messages[0]["content"]
    assert [p["type"] for p in parts].count("image_url") == 1
    assert "".join(p.get("text", "") for p in parts) == "AB<image>C"  # the marker without an image stays text
    await runner.execute(Episode(prompt="no marker", group_id="g", images=[_png()]), _gateway(FakeGateway()))
    assert seen[1].messages == [{"role": "user", "content": "no marker"}] and len(seen[1].images) == 1


async def test_chat_result_reward_and_score_are_reduced_to_scalars():
    """As Molt's trainer reduces them: a tensor / list reward or score gives its first element."""

    class Scored(ChatAgent):
        async def run(self, ctx):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app)) as http:
                await http.post(f"{ctx.base_url}/chat/completions", json={"messages": ctx.messages})
            return Result(reward=torch.tensor([1.0, 0.0]), score=[0.5], info={"hits": torch.tensor(2.0)})

    fake = FakeGateway(policy=lambda prompt, turn: "ok")
    out = await ChatAgentRunner(Scored).execute(Episode(prompt="q", group_id="g"), _gateway(fake))
    assert (out.reward, out.score, out.written) == (1.0, 0.5, True)
    assert fake.sessions[out.trajectory_id].finish == {"reward": 1.0, "score": 0.5, "info": {"hits": 2.0}}


async def test_a_chat_agent_that_raises_after_a_turn_leaves_nothing_to_train():
    """Molt drops a rollout whose agent raised (the rest of its group goes on); here its session is aborted."""

    class Crash(ChatAgent):
        async def run(self, ctx):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app)) as http:
                await http.post(f"{ctx.base_url}/chat/completions", json={"messages": ctx.messages})
            raise RuntimeError("tool crashed")

    fake = FakeGateway(policy=lambda prompt, turn: "partial")
    ep = Episode(prompt="q", group_id="g")
    with pytest.raises(RuntimeError, match="tool crashed"):
        await ChatAgentRunner(Crash).execute(ep, _gateway(fake))
    s = fake.sessions[ep.trajectory_id]
    assert s.status == "aborted" and s.finish is None and s.action_texts() == ["partial"]


async def test_a_chat_agent_that_never_calls_the_model_writes_no_trajectory():
    """Molt stitches an empty list for a session that generated nothing; here the finish writes nothing."""

    class Silent(ChatAgent):
        async def run(self, ctx):
            return Result(reward=1.0)

    out = await ChatAgentRunner(Silent).execute(Episode(prompt="q", group_id="g"), _gateway(FakeGateway()))
    assert out.reward == 1.0 and out.turns == 0 and not out.written


# ---- the chat server's replies, as the stock SDKs parse them (the gateway's wire encoders)


def _turn(finish_reason, stop_sequence=None):
    from services.gateway.session import TurnResult

    return TurnResult([1], [-0.1], finish_reason, 0, "x", "x", "x", [], 1, 2, 10, stop_sequence=stop_sequence)


@pytest.mark.parametrize(
    "raw, openai_reason, anthropic_reason",
    [
        ("stop", "stop", "end_turn"),
        ("length", "length", "max_tokens"),
        ("tool_calls", "tool_calls", "tool_use"),
        ("abort", "stop", "end_turn"),
        ("error", "stop", "end_turn"),
        ("repetition", "stop", "end_turn"),
        (None, "stop", "end_turn"),
    ],
)
def test_finish_reasons_reach_the_sdks_in_their_own_vocabulary(raw, openai_reason, anthropic_reason):
    """Molt maps an engine's finish reason into each wire's vocabulary (the SDKs validate it): anything the
    wire does not know is a plain stop."""
    from services.gateway.anthropic_wire import stop_reason
    from services.gateway.openai_wire import _finish

    assert _finish(_turn(raw)) == openai_reason
    assert stop_reason(_turn(raw)) == anthropic_reason


# ---- Molt's example modules, unchanged, on this package


@pytest.fixture
def geo3k(monkeypatch):
    """Molt's geo3k module (its tool parser needs a tokenizer: tests stub the parse instead)."""
    load_agent_runner(MOLT_EXAMPLES / "agents" / "geo3k.py", "parity_geo3k")
    return sys.modules["molt_agent_parity_geo3k"]


async def test_geo3k_stops_at_a_committed_answer_even_with_a_tool_call(geo3k, monkeypatch):
    """A turn that commits <answer> ends the episode graded, without running the tool it also asked for."""
    monkeypatch.setattr(
        geo3k, "_extract_tool_call", lambda text: {"name": "python_executor", "arguments": {"code": "print(2)"}}
    )
    monkeypatch.setattr(geo3k, "_grade_answer", lambda text, label: (1.0, "9"))
    env = geo3k.GeoEnv()
    out = await env.step(
        {"action_text": "<answer>9</answer> <tool_call>x</tool_call>", "label": {"ground_truth": "9"}}
    )
    assert out.terminated is True and float(out.reward) == 1.0 and env.tool_call_count == 0


async def test_geo3k_runs_the_tool_and_continues_without_an_answer(geo3k, monkeypatch):
    monkeypatch.setattr(
        geo3k, "_extract_tool_call", lambda text: {"name": "python_executor", "arguments": {"code": "print(3 * 3)"}}
    )
    env = geo3k.GeoEnv()
    out = await env.step({"action_text": "compute <tool_call>x</tool_call>", "label": {"ground_truth": "9"}})
    assert out.terminated is False and env.tool_call_count == 1
    assert "<tool_response>\n9\n" in out.observation  # the tool's stdout goes back to the model


@pytest.fixture(scope="module")
def python_executor():
    return _load("tools/python_executor.py", "parity_python_executor")


def test_python_executor_returns_stdout_and_reports_errors(python_executor):
    assert python_executor.run_python("print(5 * 9)").strip() == "45"
    err = python_executor.run_python("[][1]")
    assert err.startswith("Exit code 1") and "IndexError" in err
    assert python_executor.run_python("   ") == "Error: empty code argument."


def test_python_executor_writes_land_in_a_throwaway_directory(python_executor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = python_executor.run_python("import os\nopen('leak.txt', 'w').write('1')\nprint(os.getcwd())")
    assert Path(out.strip()) != tmp_path and not Path(out.strip()).exists()  # removed after the call
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def grader():
    return _load("utils/math_grader.py", "parity_math_grader")


@pytest.mark.parametrize(
    "a, b",
    [
        ("45", "45^\\circ"),
        ("45°", "45"),
        ("90 degrees", "90"),
        ("7", "7 cm"),
        ("7 inches", "7"),
        ("0.25", "\\frac{1}{4}"),
        ("\\frac{1}{4}", "0.25"),
        ("0.25", "1/4"),
        ("y=8", "8"),
        ("2.0", "2"),
        ("\\sqrt{8}", "2\\sqrt{2}"),  # symbolic (sympy)
        ("3/4", "0.750"),
    ],
)
def test_math_grader_matches_equivalent_answers(grader, a, b):
    assert grader.answers_match(a, b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("45", "46"),
        ("45", "450"),
        ("0.25", "0.3"),
        ("7 cm", "8 cm"),
        ("2\\sqrt{2}", "2\\sqrt{3}"),
        ("", "7"),
        ("7", ""),
        ("2/4", "1/2"),
    ],
)
def test_math_grader_does_not_overcount(grader, a, b):
    assert not grader.answers_match(a, b)


def test_math_grader_scores_the_last_balanced_boxed_answer(grader):
    assert grader.score_response("so \\boxed{45^\\circ}", "", {"ground_truth": "45"})["reward"] == 1.0
    assert grader.score_response("\\boxed{\\frac{3}{4}}", "", {"ground_truth": "0.75"})["reward"] == 1.0
    missing = grader.score_response("no box here", "", "3")
    assert missing["reward"] == 0.0 and missing["missing_answer"] == 1.0


def test_a_chat_context_printed_by_an_agent_does_not_show_the_gateway_key():
    ctx = ChatContext(
        messages=[], prompt="p", label=None, base_url="u", session_url="s", session_id="i", api_key="sk-9"
    )
    assert "sk-9" not in repr(ctx) and "sk-9" not in str(ctx) and ctx.api_key == "sk-9"
