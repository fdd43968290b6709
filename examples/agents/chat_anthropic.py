"""A ChatAgent on the stock ``anthropic`` SDK: the same episode as chat_minimal.py over the Messages API.

``ctx.session_url`` is the session's Anthropic base URL (the SDK appends ``/v1/messages``). System
messages move to the ``system`` parameter, as the Messages API wants. Reward 1.0 when the label
appears in the answer (case-insensitive).

    python -m services.envs --agent claude=examples/agents/chat_anthropic.py --gateway.url http://127.0.0.1:8000
"""

from __future__ import annotations

import anthropic

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

DEFAULT_MAX_TOKENS = 256


def grade(answer: str, label) -> float:
    truth = label.get("ground_truth") if isinstance(label, dict) else label
    if truth is None or str(truth).strip() == "":
        return 0.0
    return float(str(truth).strip().lower() in answer.lower())


class AnthropicAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        system = "\n".join(str(m["content"]) for m in ctx.messages if m["role"] == "system")
        messages = [m for m in ctx.messages if m["role"] != "system"]
        kwargs = {"system": system} if system else {}
        max_tokens = ctx.sampling_params.max_tokens or DEFAULT_MAX_TOKENS
        async with anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key) as client:
            resp = await client.messages.create(
                model=ctx.model_name, max_tokens=max_tokens, messages=messages, **kwargs
            )
        answer = "".join(block.text for block in resp.content if block.type == "text")
        return Result(reward=grade(answer, ctx.label), info={"answer_chars": len(answer)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AnthropicAgent)
