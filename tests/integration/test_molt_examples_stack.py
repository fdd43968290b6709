"""Molt's example agent modules, unchanged (tests/fixtures/molt_examples), through services.envs on the
real stack: a rollout pod (vLLM, tiny Qwen3), the gateway, Redis. One trajectory each, read back from the
stream with the numeric info Molt's modules put in Result.info as torch tensors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path

import httpx
import pytest
from envs_testlib import Served, StreamReader

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.timeout(300)]

MOLT_EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "molt_examples" / "agents"
TEXTWORLD_STAND_IN = Path(__file__).resolve().parents[1] / "fixtures" / "textworld_stub"
# Random tiny weights rarely stop on their own: stop ids end each turn after a few tokens.
SP = {"temperature": 1.0, "max_tokens": 12, "stop_token_ids": list(range(300, 1024)), "seed": 5}
INFO_KEYS = {
    "math": {"math_exact", "missing_answer"},
    "chat_minimal": {"math_exact"},
    "geo3k": {"geo3k_tool_call_total", "geo3k_correct", "turn_index"},
    "chat_geo3k": {"geo3k_tool_call_total", "geo3k_correct", "turn_index"},
}


@contextlib.asynccontextmanager
async def molt_stack(model, redis_url: str, agents: list[str], monkeypatch, extra: dict[str, Path] | None = None):
    """A rollout pod (1024-token context), the gateway and an env worker serving Molt's example ``agents`` (and
    the ``extra`` modules by name), in this process; yields (the worker's URL, a reader of the trajectory
    stream)."""
    from rollout_testlib import tiny_settings

    from services.envs.app import build_app as build_worker
    from services.envs.config import EnvsSettings
    from services.gateway.app import build_app as build_gateway
    from services.gateway.config import GatewaySettings
    from services.rollout.app import build_app as build_rollout

    monkeypatch.setenv("MODEL_PATH", str(model))  # the geo3k modules' tool parser reads the tokenizer
    stream = f"molt:test:molt-examples:{uuid.uuid4().hex[:8]}"
    served: list[Served] = []
    reader = StreamReader(redis_url, stream)
    try:
        pod = tiny_settings(model)
        pod.vllm.max_model_len = 1024  # chat_geo3k sends its tool schema: the rendered prompt is ~360 tokens
        served.append(Served(build_rollout(pod), "rollout-pod"))
        gateway = {
            "model": {"path": str(model)},
            "rollout": {"urls": [served[0].url]},
            "redis": {"url": redis_url, "stream": stream},
            "session": {"max_length": 1024, "max_tokens": 12},
        }
        served.append(Served(build_gateway(GatewaySettings.model_validate(gateway)), "gateway"))
        modules = [f"{name}={MOLT_EXAMPLES / name}.py" for name in agents]
        modules += [f"{name}={path}" for name, path in (extra or {}).items()]
        served.append(Served(build_worker(EnvsSettings(agent=modules, gateway={"url": served[1].url})), "env-worker"))
        yield served[2].url, reader
    finally:
        await reader.close()
        for s in reversed(served):
            s.stop()


async def run_episodes(worker: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(*(client.post(f"{worker}/v1/episodes:run", json=b) for b in bodies))
    out = [a.json() for a in answers]
    for body in out:
        assert body["status"] == "ok" and body["written"], body
    return out


async def test_molts_example_modules_write_one_trajectory_each(tiny_qwen3, redis_url, monkeypatch):
    async with molt_stack(tiny_qwen3, redis_url, list(INFO_KEYS), monkeypatch) as (worker, reader):
        episode = {"prompt": "What is 6*7?", "label": {"ground_truth": "42"}, "sampling_params": SP}
        bodies = await run_episodes(worker, [{**episode, "agent": n, "group_id": f"g-{n}"} for n in INFO_KEYS])
        trajs = await reader.get({b["trajectory_id"] for b in bodies}, timeout_s=30)
        for name, body in zip(INFO_KEYS, bodies):
            traj = trajs[body["trajectory_id"]]
            assert traj.provenance.env_name == name and traj.reward == body["reward"] == 0.0  # random weights
            assert set(traj.info) == INFO_KEYS[name], (name, traj.info)  # tensors reduced to floats
            assert sum(seg.num_action_tokens for seg in traj.segments) >= 1


async def test_molts_geo3k_modules_get_a_rows_image_and_the_trajectories_keep_it(
    tiny_idefics3, redis_url, monkeypatch
):
    """The dataset row's image (as the trainer sends it: a data URL) reaches Molt's geo3k.py and chat_geo3k.py,
    unchanged, inlined at the prompt's <image> marker (the Env's first observation, the ChatAgent's
    ctx.messages); the tiny VLM sees it and each trajectory records it."""
    from vl_testlib import data_url, image_bytes

    from molt.models.tiny_vl import IMAGE_SEQ_LEN

    png = image_bytes(3)
    agents = ["geo3k", "chat_geo3k"]
    async with molt_stack(tiny_idefics3, redis_url, agents, monkeypatch) as (worker, reader):
        episode = {
            "prompt": [{"role": "user", "content": "<image>Find x in the triangle."}],
            "label": {"ground_truth": "3"},
            "sampling_params": SP,
            "images": [data_url(png)],
        }
        bodies = await run_episodes(worker, [{**episode, "agent": n, "group_id": f"g-{n}-image"} for n in agents])
        trajs = await reader.get({b["trajectory_id"] for b in bodies}, timeout_s=30)
    digest = hashlib.sha256(png).hexdigest()
    image_token = json.loads((tiny_idefics3 / "config.json").read_text())["image_token_id"]
    for traj in trajs.values():
        assert traj.images == {digest: png}  # the file itself, as the row held it
        first = traj.segments[0]
        assert first.images == [digest]
        assert list(first.token_ids).count(image_token) == IMAGE_SEQ_LEN  # expanded as the model saw it
        assert set(traj.info) == INFO_KEYS["geo3k"]


LOOKER = """
from PIL import Image

from molt.agents import Env, Result, StepEnvRunner


class Looker(Env):
    def __init__(self):
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        image = Image.new("RGB", (40, 30), (60 * self.turn, 0, 0))
        # The model's image token where the image goes, as Molt's envs write their feedback.
        feedback = f"\\nuser: <image>look again ({self.turn})\\nassistant:"
        return Result(reward=float(self.turn), observation=feedback, images=[image], terminated=self.turn == 2)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(Looker)
"""


async def test_an_envs_feedback_images_are_shown_on_its_next_turn_and_dropped_after_the_last(
    tiny_idefics3, redis_url, monkeypatch, tmp_path
):
    """Result.images go to the pod with the feedback that holds their image tokens and into the trajectory; the
    terminal feedback is appended without a generation, so its image and image token are dropped (as Molt drops
    feedback images it cannot show)."""
    from vl_testlib import data_url, image_bytes

    from molt.models.tiny_vl import IMAGE_SEQ_LEN

    (tmp_path / "looker.py").write_text(LOOKER)
    png = image_bytes(4)
    async with molt_stack(tiny_idefics3, redis_url, [], monkeypatch, {"looker": tmp_path / "looker.py"}) as (
        worker,
        reader,
    ):
        episode = {
            "agent": "looker",
            "prompt": [{"role": "user", "content": "<image>What is it?"}],
            "group_id": "g-looker",
            "sampling_params": SP,
            "images": [data_url(png)],
        }
        [body] = await run_episodes(worker, [episode])
        traj = (await reader.get({body["trajectory_id"]}, timeout_s=30))[body["trajectory_id"]]
    assert body["turns"] == 2 and traj.reward == 3.0
    [seg] = traj.segments
    assert len(seg.images) == len(traj.images) == 2  # the row's image, then the first feedback's
    assert seg.images[0] == hashlib.sha256(png).hexdigest()
    image_token = json.loads((tiny_idefics3 / "config.json").read_text())["image_token_id"]
    assert list(seg.token_ids).count(image_token) == 2 * IMAGE_SEQ_LEN


TALKER = """
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class Talker(ChatAgent):
    async def run(self, ctx):
        # Written like Molt's chat_geo3k.py: chat until the model has nothing more to say.
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages, turns = list(ctx.messages), 0
        for _ in range(40):
            resp = await client.chat.completions.create(
                model=ctx.model_name, messages=messages, max_tokens=ctx.sampling_params.max_tokens
            )
            turns += 1
            action = resp.choices[0].message.content or ""
            if resp.choices[0].finish_reason == "length" and not resp.usage.completion_tokens:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": "Go on."}]
        return Result(reward=float(turns))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(Talker)
"""


async def test_a_chat_agent_that_runs_out_of_context_is_trained_as_truncated(
    tiny_qwen3, redis_url, monkeypatch, tmp_path
):
    """As under Molt, a ChatAgent's turn that no longer fits the episode's max_length answers "" with
    finish_reason "length" (its SDK raises nothing), and the episode is written as truncated with every turn
    that fitted, instead of failing and losing the prompt."""
    (tmp_path / "talker.py").write_text(TALKER)
    async with molt_stack(tiny_qwen3, redis_url, [], monkeypatch, {"talker": tmp_path / "talker.py"}) as (
        worker,
        reader,
    ):
        episode = {"agent": "talker", "prompt": "Talk.", "group_id": "g-talker", "sampling_params": SP}
        [body] = await run_episodes(worker, [{**episode, "max_length": 96}])
        traj = (await reader.get({body["trajectory_id"]}, timeout_s=30))[body["trajectory_id"]]
    assert traj.status == "truncated" and body["truncated"], body
    assert 2 <= traj.reward < 40 and sum(len(seg.action_spans) for seg in traj.segments) == traj.reward - 1
    assert all(len(seg.token_ids) <= 96 for seg in traj.segments)


CUTOFF = """
from molt.agents import Env, Result, StepEnvRunner


class StepLimit(Env):
    async def step(self, state):
        # An env that stops the episode at its own step limit, as AlfWorld's does: Molt's truncated.
        return Result(reward=1.0, truncated=state["label"] == "cut", terminated=state["label"] != "cut")


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(StepLimit)
"""


async def test_an_env_that_says_truncated_writes_a_truncated_trajectory(tiny_qwen3, redis_url, monkeypatch, tmp_path):
    """Molt's Result.truncated reaches the trajectory, whose status the trainer's stop-properly penalty reads;
    an env that terminates stays completed."""
    (tmp_path / "cutoff.py").write_text(CUTOFF)
    async with molt_stack(tiny_qwen3, redis_url, [], monkeypatch, {"cutoff": tmp_path / "cutoff.py"}) as (
        worker,
        reader,
    ):
        episode = {"agent": "cutoff", "prompt": "Go.", "group_id": "g-cut", "sampling_params": SP}
        answers = await run_episodes(worker, [{**episode, "label": label} for label in ("cut", "done")])
        trajs = await reader.get({a["trajectory_id"] for a in answers}, timeout_s=30)
    assert [trajs[a["trajectory_id"]].status for a in answers] == ["truncated", "completed"]
    assert [a["truncated"] for a in answers] == [True, False]


async def test_molts_alfworld_env_edits_its_rendered_prompt_and_plays_its_game(
    tiny_qwen3, redis_url, monkeypatch, tmp_path
):
    """Molt's alfworld.py (newer than 0.1.6), unchanged, on chat rows as rl_qwen3_4b_alfworld.sh runs it
    (--data.apply_chat_template): reset gets the prompt rendered, as Molt's dataset renders it for a step runner,
    splices the game's room in before the generation prompt and seeds <think>; that text is the trajectory's
    prompt. Each game runs in a child process the env closes. AlfWorld's games are a download, so the child plays
    a stand-in engine behind TextWorld's API (tests/fixtures/textworld_stub)."""
    from transformers import AutoTokenizer

    game = tmp_path / "kitchen.tw-pddl"
    room = "-= Kitchen =-\nYou are in the middle of a room. You see a drawer 1 and a fridge 1."
    spec = {"room": room, "task": "put a cold apple in the drawer.", "goal": "open drawer 1"}
    game.write_text(json.dumps({**spec, "commands": ["open drawer 1", "look"]}))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TEXTWORLD_STAND_IN), os.getenv("PYTHONPATH")])))
    monkeypatch.setenv("MAX_AGENT_TURNS", "2")  # read when the worker loads the module
    messages = [{"role": "system", "content": "You are a household agent."}, {"role": "user", "content": "Begin."}]
    episode = {"agent": "alfworld", "prompt": messages, "label": str(game), "sampling_params": SP}
    async with molt_stack(tiny_qwen3, redis_url, ["alfworld"], monkeypatch) as (worker, reader):
        answers = await run_episodes(worker, [{**episode, "group_id": "g-alf", "sample_index": i} for i in range(2)])
        trajs = await reader.get({a["trajectory_id"] for a in answers}, timeout_s=30)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marker = "<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.endswith(marker)
    prompt = rendered[: -len(marker)] + "\n" + room + marker + "<think>\n"
    for a in answers:
        traj = trajs[a["trajectory_id"]]
        seg = traj.segments[0]
        first_action = int(seg.action_spans[0][0])
        assert tok.decode(list(seg.token_ids[:first_action]), skip_special_tokens=False) == prompt
        assert traj.status == "truncated" and a["truncated"] and a["turns"] == 2  # MAX_AGENT_TURNS without a win
        assert traj.info == {"alfworld_won": 0.0, "turn_index": 2.0}
        assert "Admissible actions: open drawer 1, look" in tok.decode(list(seg.token_ids), skip_special_tokens=False)
    log = (tmp_path / "kitchen.tw-pddl.log").read_text().splitlines()
    assert log.count("closed") == 2 and sum(line.startswith("step ") for line in log) == 4
