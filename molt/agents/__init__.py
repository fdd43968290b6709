"""Agent SDK, compatible with Molt's agent contract (``from molt.agents import Env, Result, StepEnvRunner``).

- ``base``: ``Result``, ``Runner``, ``Episode`` and agent-module loading (``load_agent_runner``).
- ``env``: ``Env`` + ``StepEnvRunner`` (the framework drives the model through the gateway's token API).
- ``chat_agent``: ``ChatAgent`` + ``ChatAgentRunner`` + ``ChatContext`` (the user's own openai/anthropic loop).
- ``params``: ``SamplingParams`` (vLLM's attribute names: ``ctx.sampling_params.max_tokens``).
- ``local``: Molt's in-process form of ``StepEnvRunner.execute`` (a local engine and tokenizer) and its
  ``Trajectory``.
- ``gateway``: the session-API client both runners use; ``sandbox``: sandboxed Python for tool envs;
  ``testing``: ``FakeGateway``, an in-memory session API for testing an agent without a model.
"""

from molt.agents.base import Episode, EpisodeResult, Result, Runner, Trajectory, load_agent_runner
from molt.agents.chat_agent import ChatAgent, ChatAgentRunner, ChatContext
from molt.agents.env import Env, StepEnvRunner
from molt.agents.params import SamplingParams

__all__ = [
    "ChatAgent",
    "ChatAgentRunner",
    "ChatContext",
    "Env",
    "Episode",
    "EpisodeResult",
    "Result",
    "Runner",
    "SamplingParams",
    "StepEnvRunner",
    "Trajectory",
    "load_agent_runner",
]
