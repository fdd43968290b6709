"""The smallest ChatAgent: one call with the stock ``openai`` SDK, graded by substring match.

The agent owns its loop; pointing the SDK at ``ctx.base_url`` is all it takes for the gateway to
record the exchange token-exactly. Reward 1.0 when the label appears in the answer (case-insensitive).

    python -m services.envs --agent chat=examples/agents/chat_minimal.py --gateway.url http://127.0.0.1:8000
"""

from __future__ import annotations

import openai

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


def grade(answer: str, label) -> float:
    truth = label.get("ground_truth") if isinstance(label, dict) else label
    if truth is None or str(truth).strip() == "":
        return 0.0
    return float(str(truth).strip().lower() in answer.lower())


class MinimalAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            resp = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        answer = resp.choices[0].message.content or ""
        return Result(reward=grade(answer, ctx.label), info={"answer_chars": len(answer)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MinimalAgent)
