"""``ChatAgent`` + ``ChatAgentRunner``: the user owns the loop (Molt's chat path).

The runner opens a gateway session and hands the agent its URLs: point the stock ``openai`` SDK at
``ctx.base_url`` or the ``anthropic`` SDK at ``ctx.session_url`` with model ``ctx.model_name`` and
``ctx.api_key``, and every call is captured token-exactly by the gateway. The episode's reward is
the one ``Result`` that ``run`` returns. Any failure (exception, timeout, a non-``Result``) aborts the
session, so nothing reaches the trainer.
"""

from __future__ import annotations

import abc
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

from molt.agents.base import Episode, EpisodeResult, Result, Runner, check_result, first_scalar, numeric_info
from molt.agents.env import turn_params
from molt.agents.gateway import GatewayClient
from molt.agents.params import SamplingParams
from molt.images import from_data_url, inline_images, to_data_url


@dataclass
class ChatContext:
    """What a ChatAgent gets for one episode."""

    messages: list[dict[str, Any]]
    """The dataset row as OpenAI wire messages (a string prompt becomes one user message), each ``<image>`` of a
    user string replaced by the next image as an ``image_url`` part."""
    prompt: str
    """Text of the row's last user turn, ``<image>`` markers kept (images skipped)."""
    label: Any
    base_url: str
    """OpenAI SDK base URL of this episode's session (…/s/{id}/v1)."""
    session_url: str
    """Anthropic SDK base URL of this episode's session (…/s/{id}; the SDK appends /v1/messages)."""
    session_id: str
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    """This episode's sampling params, vLLM attribute names (``ctx.sampling_params.max_tokens``)."""
    max_length: int | None = None
    tools: list[dict[str, Any]] | None = None
    images: list[Any] | None = None
    """The row's images (PIL); those its ``<image>`` markers name are also inlined in ``messages``."""
    model_name: str = "policy"
    api_key: str = field(default="EMPTY", repr=False)  # an agent that logs its ctx must not log the key
    gateway_url: str = ""
    """The gateway's root URL, for calls that must not be captured (e.g. an LLM judge: {gateway_url}/v1)."""


def _extract_prompt_text(prompt: Any) -> str:
    """Text of the last user turn (text parts joined, images skipped); a plain prompt is its own text."""
    if not isinstance(prompt, list):
        return str(prompt)
    last_user = next((m for m in reversed(prompt) if m.get("role") == "user"), None)
    content = last_user.get("content") if last_user else ""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


class ChatAgent(abc.ABC):
    """An agent that runs its own loop against ``ctx.base_url`` / ``ctx.session_url``; fresh per episode."""

    REPLIES = "raw"
    """How the gateway answers this agent's turns. "raw", as Molt's chat server does: the generated text as it
    is, think and ``<tool_call>`` blocks inline (Molt's agents parse them from the content). "parsed", as
    vLLM's server does: the think block apart and, when a request offers tools, structured tool calls (what an
    SDK's or framework's own tool loop expects)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - Molt's constructor, arguments ignored
        pass

    @abc.abstractmethod
    async def run(self, ctx: ChatContext) -> Result:
        """Talk to the policy through the session URLs, then return the episode's Result."""


class ChatAgentRunner(Runner):
    """Runs ``agent_cls`` episodes, each in its own gateway session."""

    PRERENDER_PROMPT = False

    def __init__(self, agent_cls: type[ChatAgent]) -> None:
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, ChatAgent)):
            raise TypeError(f"ChatAgentRunner needs a ChatAgent subclass, got {agent_cls!r}")
        if agent_cls.REPLIES not in ("raw", "parsed"):
            raise ValueError(f'{agent_cls.__name__}.REPLIES must be "raw" or "parsed", got {agent_cls.REPLIES!r}')
        # As an Env's reset/step: the runner awaits run, so a plain def would fail every episode with "can't be
        # used in 'await' expression"; it is refused when the worker loads the module instead.
        if not inspect.iscoroutinefunction(inspect.unwrap(agent_cls.run)):
            raise ValueError(f"{agent_cls.__name__}.run must be async def (Molt's ChatAgent API awaits it)")
        self.agent_cls = agent_cls

    async def execute(self, episode: Episode, gateway: GatewayClient, *molt_args: Any) -> EpisodeResult:
        if molt_args or not isinstance(episode, Episode):
            # Molt's in-process form, execute(prompt, label, sampling_params, max_length, tokenizer, engine): a
            # ChatAgent's SDK needs the gateway's HTTP session URLs, which a bare engine does not serve.
            raise TypeError(
                f"{type(self).__name__}.execute(episode, gateway) runs through a gateway; Molt's in-process form "
                "(prompt, label, sampling_params, max_length, tokenizer, engine) is supported for StepEnvRunner "
                "only. Run a ChatAgent against molt.agents.testing.FakeGateway (no model) or a running gateway "
                "(molt up / molt train-rl)"
            )
        agent = self.agent_cls()
        if isinstance(episode.prompt, str):
            messages = [{"role": "user", "content": episode.prompt}]
        else:
            messages = copy.deepcopy(episode.prompt)
        urls = [to_data_url(image, f"images[{i}]") for i, image in enumerate(episode.images or [])]
        messages = inline_images(messages, urls)
        images = [from_data_url(url, f"images[{i}]") for i, url in enumerate(urls)] or None
        sp = turn_params(SamplingParams.from_any(episode.sampling_params), episode.max_new_tokens)
        # As under Molt, a turn that does not fit the context answers "" with finish_reason "length" (not an
        # error the agent's SDK would raise), so an episode that runs out of context is trained as truncated.
        fields = episode.session_fields(sp.wire())
        async with gateway.session(**fields, context_full="length", replies=self.agent_cls.REPLIES) as session:
            episode.trajectory_id = session.id
            ctx = ChatContext(
                messages=messages,
                # From the row as the dataset gave it, as Molt's ChatAgentRunner does: after inlining, a user
                # string's "<image>" markers are image parts and would drop out of the text an agent grades on.
                prompt=_extract_prompt_text(episode.prompt),
                label=episode.label,
                base_url=session.openai_base_url,
                session_url=session.anthropic_base_url,
                session_id=session.id,
                sampling_params=copy.deepcopy(sp),
                max_length=episode.max_length,
                tools=episode.tools,
                images=images,
                gateway_url=gateway.url,
                api_key=gateway.api_key or "EMPTY",
            )
            where = f"{self.agent_cls.__name__}.run"
            result = check_result(await agent.run(ctx), where)
            reward = first_scalar(result.reward, where=where)
            score = reward if result.score is None else first_scalar(result.score, "score", where)
            info = numeric_info(result.info, where)
            summary = await session.summary()
            done = await episode.finish(session, reward, score, info, truncated=bool(result.truncated))
        return EpisodeResult(
            reward=reward,
            score=score,
            turns=int(summary.get("turns", 0) or 0),
            tokens=int(summary.get("num_tokens", summary.get("tokens", 0)) or 0),
            trajectory_id=session.id,
            written=bool(done.get("written")),
            truncated=bool(result.truncated or summary.get("truncated")),
            info=info,
            response_tokens=int(summary.get("action_tokens", 0) or 0),
        )
