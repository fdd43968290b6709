"""LLM-as-judge reward: the policy answers through its session, a judge model scores the answer.

The policy's answer goes through ``ctx.base_url`` (captured, trained on). The judge call goes to the
gateway's session-less endpoint ``{ctx.gateway_url}/v1`` (served by the same pods, NOT captured), or to
``JUDGE_BASE_URL`` if set (e.g. a separate judge server), with model ``JUDGE_MODEL`` (default: the
policy itself), temperature 0 and a fixed seed so a verdict can be reproduced. The reward is the
judge's "Score: N" out of 10, scaled to [0, 1]; no parsable score gives 0.

    python -m services.envs --agent judge=examples/agents/judge.py --gateway.url http://127.0.0.1:8000
"""

from __future__ import annotations

import os
import re

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

JUDGE_TEMPLATE = (
    "You grade answers. Reply with one line 'Score: N' where N is 0 (wrong) to 10 (perfect).\n"
    "Question: {question}\nReference: {reference}\nAnswer: {answer}"
)
JUDGE_MAX_TOKENS = 16
_SCORE = re.compile(r"Score:\s*(\d+(?:\.\d+)?)", re.I)


def judge_messages(question: str, answer: str, reference) -> list[dict]:
    return [{"role": "user", "content": JUDGE_TEMPLATE.format(question=question, reference=reference, answer=answer)}]


def judge_request(question: str, answer: str, reference, model: str) -> dict:
    """The judge's chat.completions arguments (deterministic: greedy, fixed seed)."""
    return {
        "model": model,
        "messages": judge_messages(question, answer, reference),
        "temperature": 0.0,
        "seed": 0,
        "max_tokens": JUDGE_MAX_TOKENS,
    }


def parse_score(verdict: str) -> float:
    """'Score: 7' -> 0.7 (clipped to [0, 1]); no score -> 0.0."""
    m = _SCORE.search(verdict)
    return min(max(float(m.group(1)) / 10.0, 0.0), 1.0) if m else 0.0


class JudgedAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as policy:
            resp = await policy.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        answer = resp.choices[0].message.content or ""
        judge_url = os.environ.get("JUDGE_BASE_URL") or f"{ctx.gateway_url}/v1"
        model = os.environ.get("JUDGE_MODEL") or ctx.model_name
        async with openai.AsyncOpenAI(base_url=judge_url, api_key=ctx.api_key) as judge:
            verdict = await judge.chat.completions.create(**judge_request(ctx.prompt, answer, ctx.label, model))
        text = verdict.choices[0].message.content or ""
        return Result(reward=parse_score(text), info={"judge_parsed": float(_SCORE.search(text) is not None)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(JudgedAgent)
