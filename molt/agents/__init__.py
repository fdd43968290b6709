"""Agent SDK, compatible with Molt's agent contract (``from molt.agents import Env, Result, StepEnvRunner``).

- ``base``: ``Result``, ``Runner``, ``Episode`` and agent-module loading (``load_agent_runner``).
- ``env``: ``Env`` + ``StepEnvRunner`` (the framework drives the model through the gateway's token API).
- ``chat_agent``: ``ChatAgent`` + ``ChatAgentRunner`` + ``ChatContext`` (the user's own openai/anthropic loop).
- ``gateway``: the session-API client both runners use; ``sandbox``: sandboxed Python for tool envs;
  ``client``: a dispatcher-side client that spreads episodes over env-worker replicas.
"""

from molt.agents.base import Episode, EpisodeResult, Result, Runner, load_agent_runner
from molt.agents.chat_agent import ChatAgent, ChatAgentRunner, ChatContext
from molt.agents.env import Env, StepEnvRunner

__all__ = [
    "ChatAgent",
    "ChatAgentRunner",
    "ChatContext",
    "Env",
    "Episode",
    "EpisodeResult",
    "Result",
    "Runner",
    "StepEnvRunner",
    "load_agent_runner",
]
