"""Env workers on the real stack: rollout pod (real vLLM, tiny Qwen3) + gateway + Redis + workers over HTTP.

Every trajectory is read back from the Redis stream and checked against what the agent's own grader
computes from the tokens the policy generated.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import httpx
import pytest
from envs_testlib import Served, StreamReader

from molt.agents.gateway import GatewayClient

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"
# Random tiny weights rarely stop on their own; many stop ids end turns after a few tokens with
# finish_reason "stop" (a "length" finish would end an Env episode after one turn, as in Molt).
STOPS = list(range(300, 1024))
SP = {"temperature": 1.0, "max_tokens": 12, "stop_token_ids": STOPS, "seed": 3}
TOKEN = "it-envs-stack-5ecret-0123456789"  # the service token (MOLT_INTERNAL_TOKEN) of this module's pod

try:
    from services.gateway.app import build_app as build_gateway
    from services.gateway.config import GatewaySettings
    from services.rollout.app import build_app as build_rollout

    MISSING = None
except ImportError as exc:  # the gateway / rollout services are built in parallel
    MISSING = f"gateway or rollout service not importable yet: {exc}"

MOLT_STYLE = textwrap.dedent('''
    import os

    from molt.agents import Env, Result, StepEnvRunner

    MAX_AGENT_TURNS = int(os.environ.get("MAX_AGENT_TURNS", "3"))


    def grade(action_text, label):
        return 1.0 if len(action_text) <= int(label) else 0.25


    class ShortAnswerEnv(Env):
        """Three tries; each short answer earns a point."""

        def __init__(self):
            super().__init__()
            self.turn = 0

        async def reset(self, state):
            return {"observation": "Answer briefly. " + state["observation"], "label": state["label"]}

        async def step(self, state):
            self.turn += 1
            done = self.turn >= MAX_AGENT_TURNS
            return Result(reward=grade(state["action_text"], state["label"]),
                          observation="\\nAgain:" if not done else "\\nDone.", terminated=done,
                          info={"turn": self.turn, "note": "non-numeric info is skipped"})


    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(ShortAnswerEnv)
''')

TOOL_FIXED = textwrap.dedent(f'''
    import importlib.util
    import sys

    from molt.agents import StepEnvRunner

    spec = importlib.util.spec_from_file_location("tool_env_example", {str(EXAMPLES / "tool_env.py")!r})
    example = importlib.util.module_from_spec(spec)
    sys.modules["tool_env_example"] = example
    spec.loader.exec_module(example)


    class FixedToolEnv(example.ToolEnv):
        """The tiny random policy never writes code: run a fixed program every turn."""

        def __init__(self):
            super().__init__()
            self.max_turns = 3

        def extract_code(self, action_text):
            return "print('TOOL-' + str(6 * 7))"


    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(FixedToolEnv)
''')

FAULTY = textwrap.dedent("""
    import asyncio

    from molt.agents import Env, Result, StepEnvRunner
    from molt.agents.sandbox import run_python


    class FaultyEnv(Env):
        async def step(self, state):
            kind = state["label"]["kind"]
            if kind == "raise":
                raise RuntimeError("bug in user code")
            if kind == "hang":
                await asyncio.sleep(3600)
            if kind == "net":  # turn 1 runs the tool, turn 2 ends the episode
                if "<tool>" in state["observation_text"]:
                    return Result(reward=float("connected" in state["observation_text"]))
                port = state["label"]["port"]
                out = await run_python(f"import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\\n"
                                       "print('connected')")
                last_line = (out.stdout + out.stderr).strip().splitlines()[-1]
                return Result(observation="\\n<tool>" + last_line, terminated=False)
            if kind == "slow":
                await asyncio.sleep(1.0)
            return Result(reward=1.0)


    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(FaultyEnv)
""")


@pytest.fixture(scope="module")
def stack(tiny_qwen3, redis_url, tmp_path_factory):
    if MISSING:
        pytest.skip(MISSING)
    from rollout_testlib import tiny_settings
    from transformers import AutoTokenizer

    from services.envs.app import build_app as build_worker
    from services.envs.config import EnvsSettings

    stream = f"molt:test:envs:{uuid.uuid4().hex[:8]}"
    served: list[Served] = []
    agents_dir = tmp_path_factory.mktemp("agents")
    for name, text in {"molt_style": MOLT_STYLE, "tool_fixed": TOOL_FIXED, "faulty": FAULTY}.items():
        (agents_dir / f"{name}.py").write_text(text)
    try:
        # The pod requires the service token and the gateway sends it (each reads it as it is built): every
        # episode below passes the pod's guard over the gateway's generate stream.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MOLT_INTERNAL_TOKEN", TOKEN)
            pod = Served(build_rollout(tiny_settings(tiny_qwen3)), "rollout-pod")
            served.append(pod)
            gw_settings = GatewaySettings.model_validate(
                {
                    "model": {"path": str(tiny_qwen3)},
                    "rollout": {"urls": [pod.url]},
                    "redis": {"url": redis_url, "stream": stream},
                    "session": {"max_length": 256, "max_tokens": 12},
                }
            )
            gateway = Served(build_gateway(gw_settings), "gateway")
            served.append(gateway)

        def worker(agents: dict[str, Path], token: str | None = None, **envs) -> Served:
            """A worker; with ``token`` it requires that service token."""
            settings = EnvsSettings(
                agent=[f"{n}={p}" for n, p in agents.items()], gateway={"url": gateway.url}, envs=envs
            )
            with pytest.MonkeyPatch.context() as env:
                env.delenv("MOLT_INTERNAL_TOKEN", raising=False)
                if token is not None:
                    env.setenv("MOLT_INTERNAL_TOKEN", token)
                w = Served(build_worker(settings), "env-worker")
            served.append(w)
            return w

        all_agents = {p.stem: p for p in EXAMPLES.glob("*.py")}
        all_agents.update({p.stem: p for p in agents_dir.glob("*.py")})
        main = worker(all_agents, max_concurrency=16, episode_timeout_s=60)
        tok = AutoTokenizer.from_pretrained(tiny_qwen3)
        yield {
            "pod": pod.url,
            "gateway": gateway.url,
            "worker": main.url,
            "new_worker": worker,
            "agents": all_agents,
            "redis_url": redis_url,
            "stream": stream,
            "tok": tok,
        }
    finally:
        for s in reversed(served):
            s.stop()
        import redis

        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{stream}*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture
async def reader(stack):
    r = StreamReader(stack["redis_url"], stack["stream"])
    yield r
    await r.close()


async def _run(
    url: str, agent: str, prompt, label=None, i: int = 0, sp=SP, timeout_s: float = 120.0
) -> httpx.Response:
    body = {
        "agent": agent,
        "prompt": prompt,
        "label": label,
        "group_id": f"g-{agent}",
        "sample_index": i,
        "sampling_params": sp,
    }
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        return await client.post(f"{url}/v1/episodes:run", json=body)


def _spans_text(tok, seg, skip_special: bool) -> list[str]:
    ids = seg.token_ids.tolist()
    return [tok.decode(ids[a:b], skip_special_tokens=skip_special) for a, b in seg.action_spans.tolist()]


def _masked_between(tok, seg) -> list[str]:
    """Decoded non-action stretches after each action span (feedback), in order."""
    ids, spans = seg.token_ids.tolist(), seg.action_spans.tolist()
    ends = [s[0] for s in spans[1:]] + [len(ids)]
    return [tok.decode(ids[b:e], skip_special_tokens=False) for (_, b), e in zip(spans, ends)]


def _load(path: Path):
    from molt.agents.base import load_agent_runner

    load_agent_runner(path, f"check_{path.stem}")
    return sys.modules[f"molt_agent_check_{path.stem}"]


async def test_molt_style_module_runs_unchanged(stack, reader):
    r = await _run(stack["worker"], "molt_style", "What is 2+2?", label="6", i=3)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok", body
    traj = (await reader.get({body["trajectory_id"]}))[body["trajectory_id"]]
    assert traj.group_id == "g-molt_style" and traj.sample_index == 3
    assert traj.provenance.env_name == "molt_style" and traj.info == {"turn": 3.0}
    (seg,) = traj.segments
    actions = _spans_text(stack["tok"], seg, skip_special=False)
    assert len(actions) == body["turns"] == 3
    grade = _load(stack["agents"]["molt_style"]).grade
    assert traj.reward == pytest.approx(sum(grade(a, "6") for a in actions)) == body["reward"]
    last = "\nDone." if await GatewayClient(stack["gateway"]).can_append() else ""  # see can_append
    assert _masked_between(stack["tok"], seg) == ["\nAgain:", "\nAgain:", last]
    assert stack["tok"].decode(seg.token_ids[: seg.action_spans[0, 0]].tolist()) == "Answer briefly. What is 2+2?"
    assert len(seg.logprobs) == seg.num_action_tokens and (seg.logprobs <= 0).all()


async def test_a_first_observation_over_max_length_keeps_its_last_tokens_and_trains(stack, reader):
    """Molt's initial truncation on the real pod: the first observation keeps its last max_length - max_tokens
    tokens and the episode generates and is written instead of ending with nothing to train."""
    prompt = " ".join(f"item{i}" for i in range(150))
    body = {
        "agent": "molt_style",
        "prompt": prompt,
        "label": "6",
        "group_id": "g-long",
        "max_length": 64,
        "sampling_params": SP,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        r = (await client.post(f"{stack['worker']}/v1/episodes:run", json=body)).json()
    assert r["status"] == "ok" and r["turns"] >= 1, r
    (seg,) = (await reader.get({r["trajectory_id"]}))[r["trajectory_id"]].segments
    ids = stack["tok"]("Answer briefly. " + prompt, add_special_tokens=False)["input_ids"]
    assert seg.token_ids[: seg.action_spans[0, 0]].tolist() == ids[-(64 - SP["max_tokens"]) :]
    assert seg.num_action_tokens > 0 and len(seg.token_ids) <= 64


@pytest.mark.parametrize("agent", ["math", "chat_minimal", "chat_anthropic", "judge"])
async def test_examples_reward_equals_their_grader(stack, reader, agent):
    label = {"math": "4", "chat_minimal": "a", "chat_anthropic": "a", "judge": "4"}[agent]
    prompt = (
        "What is 2+2?"
        if agent == "math"
        else [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    )
    r = await _run(stack["worker"], agent, prompt, label=label)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["written"], body
    traj = (await reader.get({body["trajectory_id"]}))[body["trajectory_id"]]
    (seg,) = traj.segments  # the judge's own call is not captured
    module = _load(stack["agents"][agent])
    if agent == "math":
        (action,) = _spans_text(stack["tok"], seg, skip_special=False)
        expected = module.grade(action, label)
    else:
        (answer,) = _spans_text(stack["tok"], seg, skip_special=True)
        if agent == "judge":
            import openai

            async with openai.AsyncOpenAI(base_url=f"{stack['gateway']}/v1", api_key="EMPTY") as judge:
                verdict = await judge.chat.completions.create(
                    **module.judge_request("What is 2+2?", answer, label, "policy")
                )
            expected = module.parse_score(verdict.choices[0].message.content or "")
        else:
            expected = module.grade(answer, label)
    assert traj.reward == expected == body["reward"]


async def test_tool_outputs_are_masked_out_of_the_loss(stack, reader):
    r = await _run(stack["worker"], "tool_fixed", "Compute 6*7 with Python.", label="42")
    body = r.json()
    assert body["status"] == "ok" and body["turns"] == 3, body
    traj = (await reader.get({body["trajectory_id"]}))[body["trajectory_id"]]
    (seg,) = traj.segments
    tool = _load(stack["agents"]["tool_fixed"])
    feedback = tool.FixedToolEnv().feedback("TOOL-42")
    last = feedback if await GatewayClient(stack["gateway"]).can_append() else ""
    assert _masked_between(stack["tok"], seg) == [feedback, feedback, last]
    mask = seg.action_mask()
    for a, b in seg.action_spans.tolist():  # action spans hold only what the policy generated
        assert mask[a:b].all() and "TOOL-42" not in stack["tok"].decode(seg.token_ids[a:b].tolist())
    assert traj.info == {"tool_calls": 3.0} and traj.reward == 0.0


async def test_failures_fail_only_their_episode(stack, reader):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    w = stack["new_worker"]({"faulty": stack["agents"]["faulty"]}, max_concurrency=8, episode_timeout_s=3)
    kinds = ["raise", "hang", "net", "ok"]
    results = await asyncio.gather(
        *[_run(w.url, "faulty", "go", {"kind": k, "port": port}, i) for i, k in enumerate(kinds)]
    )
    out = {k: r.json() for k, r in zip(kinds, results)}
    assert out["net"]["turns"] == 2, out["net"]
    assert out["raise"]["status"] == "failed" and "bug in user code" in out["raise"]["error"]
    assert out["hang"]["status"] == "timeout"
    assert out["net"]["status"] == out["ok"]["status"] == "ok" and out["net"]["reward"] == 0.0
    with pytest.raises(TimeoutError):
        listener.accept()  # the sandboxed tool never reached the loopback listener
    listener.close()
    seen = await reader.get({out["net"]["trajectory_id"], out["ok"]["trajectory_id"]})
    net_fb = _masked_between(stack["tok"], seen[out["net"]["trajectory_id"]].segments[0])[0]
    assert "Connection refused" in net_fb  # the sandbox's own loopback: nothing of the host listens
    await reader.drain(block_s=0.5)
    async with httpx.AsyncClient() as client:
        for k in ("raise", "hang"):  # aborted: nothing written, the gateway dropped the session
            assert out[k]["trajectory_id"] not in reader.seen and not out[k]["written"]
            gone = await client.get(f"{stack['gateway']}/v1/sessions/{out[k]['trajectory_id']}")
            assert gone.status_code == 404
        metrics = (await client.get(f"{w.url}/metrics")).text
    for status, n in (("failed", 1), ("timeout", 1), ("ok", 2)):
        assert f'molt_envs_episodes_total{{agent="faulty",status="{status}"}} {n}.0' in metrics
    again = await _run(w.url, "faulty", "go", {"kind": "ok"})
    assert again.json()["status"] == "ok"  # the worker kept serving


async def test_saturated_worker_answers_429_and_a_second_replica_takes_the_load(stack):
    from services.trainer.config import EnvsConfig, RolloutConfig
    from services.trainer.dispatch import EpisodeDispatcher

    a = stack["new_worker"]({"faulty": stack["agents"]["faulty"]}, max_concurrency=1, retry_after_s=1)
    b = stack["new_worker"]({"faulty": stack["agents"]["faulty"]}, max_concurrency=1, retry_after_s=1)
    first, second = await asyncio.gather(
        _run(a.url, "faulty", "go", {"kind": "slow"}, 0), _run(a.url, "faulty", "go", {"kind": "slow"}, 1)
    )
    codes = sorted([first.status_code, second.status_code])
    assert codes == [200, 429]
    rejected = first if first.status_code == 429 else second
    assert rejected.headers["retry-after"] == "1"
    dispatcher = EpisodeDispatcher(EnvsConfig(urls=[a.url, b.url]), RolloutConfig(), 256)
    body = {"agent": "faulty", "prompt": "go", "label": {"kind": "slow"}, "group_id": "g", "sampling_params": SP}
    results = await asyncio.gather(*[dispatcher.run_episode(dict(body, sample_index=i)) for i in range(2)])
    await dispatcher.client.aclose()
    assert [r["status"] for r in results] == ["ok", "ok"]
    async with httpx.AsyncClient() as client:
        for w in (a, b):
            metrics = (await client.get(f"{w.url}/metrics")).text
            assert 'molt_envs_episodes_total{agent="faulty",status="ok"}' in metrics


def test_cli_serves_and_stops_on_sigterm(stack):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.envs",
            "--agent",
            f"math={EXAMPLES / 'math.py'}",
            "--gateway.url",
            stack["gateway"],
            "--port",
            "0",
            "--rollout.max_new_tokens",
            "8",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"molt-envs listening on (http://\S+)", line)
        assert m, f"worker did not report its port: {line!r}"
        url = m.group(1)
        r = asyncio.run(_run(url, "math", "1+1=", label="2", sp={"temperature": 1.0}))
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["tokens"] > r.json()["response_tokens"] > 0
        assert httpx.get(f"{url}/readyz").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # a graceful shutdown (molt/serve.py), as every service


async def test_the_service_token_guards_the_pod_and_the_gateway_sends_it(stack):
    """docs/contracts.md: with MOLT_INTERNAL_TOKEN a pod answers a generate call without it 401 (probes stay
    open); the gateway's two pod clients (the generate stream and one POST per call) send it."""
    from services.gateway.metrics import gateway_metrics
    from services.gateway.pods import PodFailed, PodPool
    from services.gateway.transport import HttpTransport

    pod = stack["pod"]
    call = {"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    async with httpx.AsyncClient(timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for path in ("/v1/generate", "/v1/generate_stream"):
                bare = await client.post(pod + path, json=call, headers=headers)
                assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_internal_token", path
        assert (await client.get(pod + "/readyz")).status_code == 200
        assert (await client.get(pod + "/metrics")).status_code == 200
        signed = await client.post(pod + "/v1/generate", json=call, headers={"Authorization": f"Bearer {TOKEN}"})
        assert signed.status_code == 200 and len(signed.json()["outputs"][0]["token_ids"]) == 2
    for stream in (True, False):
        pool = PodPool([pod], HttpTransport(4, 60.0, 5.0, pod_token=TOKEN), gateway_metrics(), stream=stream)
        (gen,) = await pool.generate(pool.get(pod), [1, 2, 3], {"max_tokens": 2})
        assert len(gen.token_ids) == 2, stream
        wrong = PodPool([pod], HttpTransport(4, 60.0, 5.0, pod_token="wrong"), gateway_metrics(), stream=stream)
        with pytest.raises(PodFailed, match="HTTP 401"):
            await wrong.generate(wrong.get(pod), [1, 2, 3], {"max_tokens": 2})
        for p in (pool, wrong):
            p.close()
            await p.client.close()


async def test_a_worker_with_the_service_token_takes_episodes_from_the_trainer_only(stack, monkeypatch):
    """docs/contracts.md: a worker started with MOLT_INTERNAL_TOKEN refuses an episode without it (401, nothing
    run); the trainer's dispatcher sends it, and a wrong one stops training with the variable's name."""
    from services.trainer.config import EnvsConfig, RolloutConfig
    from services.trainer.dispatch import DispatchError, EpisodeDispatcher

    w = stack["new_worker"]({"faulty": stack["agents"]["faulty"]}, token=TOKEN)
    bare = await _run(w.url, "faulty", "go", {"kind": "ok"})
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
    body = {"agent": "faulty", "prompt": "go", "label": {"kind": "ok"}, "group_id": "g-token", "sampling_params": SP}
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", TOKEN)  # the trainer's environment
    dispatcher = EpisodeDispatcher(EnvsConfig(urls=[w.url]), RolloutConfig(), 256)
    result = await dispatcher.run_episode(dict(body, sample_index=0))
    await dispatcher.client.aclose()
    assert result["status"] == "ok" and result["written"]
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", "wrong")
    dispatcher = EpisodeDispatcher(EnvsConfig(urls=[w.url]), RolloutConfig(), 256)
    with pytest.raises(DispatchError, match="HTTP 401.*MOLT_INTERNAL_TOKEN"):
        await dispatcher.run_episode(dict(body, sample_index=1))
    await dispatcher.client.aclose()
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{w.url}/metrics")).text
    assert 'molt_envs_episodes_total{agent="faulty",status="ok"} 1.0' in metrics  # the refused ones never ran
