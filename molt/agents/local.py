"""Molt's in-process calling convention for ``StepEnvRunner``: a local engine and tokenizer instead of a gateway.

Molt calls ``runner.execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)`` with
``llm_engine.generate(token_ids, sampling_params, multi_modal_data=None, session_id=None)`` returning
``(request_output, off_policy_len)``, and gets a ``Trajectory`` back (Molt's own unit tests and
notebooks do this). ``execute_on_engine`` runs the same ``StepEnvRunner`` loop as the services do, with
``EngineGateway`` standing in for the gateway's session API: it tokenizes appended text, clamps each
turn's ``max_tokens`` to the remaining ``max_length`` budget, generates on the engine, and records the
tokens, action ranges and (when ``sampling_params.logprobs`` is set, as Molt does with IS correction)
the rollout logprobs into Molt's ``Trajectory`` (``molt.agents.base``).
"""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any

from molt.agents.base import Episode, Trajectory
from molt.agents.base import _extract_generation_logprobs as extract_generation_logprobs
from molt.agents.params import SamplingParams
from molt.images import from_data_url


class EngineSession:
    def __init__(self, gw: EngineGateway, traj: Trajectory) -> None:
        self.gw, self.traj = gw, traj
        self.id = uuid.uuid4().hex
        self.finished: dict | None = None
        self.images: list[Any] = []
        """Every image shown so far (PIL), which Molt hands the engine with each turn."""

    def _tokens(self, text: str) -> list[int]:
        return self.gw.tokenizer(text=text, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()

    async def generate(
        self,
        *,
        messages=None,
        append_text=None,
        append_token_ids=None,
        sampling_params=None,
        images=None,
        truncate_prompt=None,
    ):
        t = self.traj
        if messages is not None:
            append_text = self.gw.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        new = (self._tokens(append_text) if append_text else []) + list(append_token_ids or [])
        kept_text = None
        if truncate_prompt and not t.observation_tokens and not images:  # the gateway's rule, see token_turn
            reserve = (sampling_params or {}).get("max_tokens") or 32
            keep = max(1, self.gw.max_length - reserve)
            if len(new) > keep:
                new = new[-keep:]
                append_text = kept_text = self.gw.tokenizer.decode(new, skip_special_tokens=False)
        remaining = self.gw.max_length - len(t.observation_tokens) - len(new)
        if remaining <= 0:
            t.truncated = True
            return {"token_ids": [], "finish_reason": "length", "num_tokens": len(t.observation_tokens)}
        t.observation_tokens += new
        # Molt's Trajectory carries the episode as text too: every appended observation and every action.
        t.observation_text += append_text or ""
        if t.rollout_log_probs is not None:
            t.rollout_log_probs += [0.0] * len(new)
        if (sampling_params or {}).get("max_tokens") == 0:  # append only (the terminal turn's feedback)
            return {"token_ids": [], "finish_reason": "stop", "num_tokens": len(t.observation_tokens)}
        self.images += [from_data_url(url, f"images[{i}]") for i, url in enumerate(images or [])]
        sp = copy.deepcopy(self.gw.params)  # the caller's object, with this turn's values
        for k, v in (sampling_params or {}).items():
            if k == "structured_outputs":  # the wire's dict of its one constraint; vLLM reads its own object
                from vllm.sampling_params import StructuredOutputsParams

                v = StructuredOutputsParams(**v)
            setattr(sp, k, v)
        sp.max_tokens = min(sp.max_tokens or remaining, remaining)
        output, _off_policy = await self.gw.engine.generate(
            t.observation_tokens,
            sp,
            multi_modal_data={"image": list(self.images)} if self.images else None,
            session_id=self.id,
        )
        gen = output.outputs[0]
        ids = list(gen.token_ids)
        text = gen.text or (self.gw.tokenizer.decode(ids, skip_special_tokens=False) if ids else "")
        if t.rollout_log_probs is not None:
            t.rollout_log_probs += extract_generation_logprobs(ids, gen.logprobs)
        t.action_ranges.append((len(t.observation_tokens), len(t.observation_tokens) + len(ids)))
        t.observation_tokens += ids
        t.observation_text += text
        out = {
            "token_ids": ids,
            "text": text,
            "finish_reason": gen.finish_reason or "stop",
            "num_tokens": len(t.observation_tokens),
            "remaining_tokens": self.gw.max_length - len(t.observation_tokens),
        }
        if kept_text is not None:
            out["prompt_text"] = kept_text
        return out

    async def render(self, messages, tools=None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.gw.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    async def append(self, text: str, images: list[str] | None = None) -> dict:
        """The terminal feedback, appended without a generation; its images are not shown (as the gateway)."""
        return await self.generate(append_text=text, sampling_params={"max_tokens": 0})

    async def finish(self, reward, score=None, info=None, truncated=False) -> dict:
        self.traj.reward, self.traj.scores = reward, score
        self.traj.truncated = self.traj.truncated or truncated
        self.finished = {"written": True}
        return self.finished


class EngineGateway:
    """The subset of ``GatewayClient`` the step loop uses, over a local engine and tokenizer."""

    url = ""

    def __init__(self, params: Any, max_length: int, tokenizer, engine, traj: Trajectory) -> None:
        self.params, self.max_length, self.tokenizer = params, max_length, tokenizer
        self.engine, self.traj = engine, traj

    @contextlib.asynccontextmanager
    async def session(self, **fields) -> AsyncIterator[EngineSession]:
        yield EngineSession(self, self.traj)

    async def can_append(self) -> bool:
        return True


async def execute_on_engine(
    run, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None, tools=None
) -> Trajectory:
    """Molt's ``StepEnvRunner.execute`` signature: ``run`` is the runner's gateway loop."""
    params = copy.deepcopy(sampling_params)
    traj = Trajectory(
        prompt=prompt, label=label, rollout_log_probs=[] if getattr(params, "logprobs", None) is not None else None
    )
    gw = EngineGateway(params, max_length, hf_tokenizer, llm_engine, traj)
    episode = Episode(
        prompt=prompt,
        group_id=uuid.uuid4().hex,
        label=label,
        max_length=max_length,
        tools=tools,
        sampling_params=SamplingParams.from_any(params).wire(),
        images=images,
    )
    out = await run(episode, gw)
    traj.truncated = traj.truncated or out.truncated
    traj.extra_logs = dict(out.info)
    return traj
