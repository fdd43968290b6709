"""The agent contract: ``Result``, the abstract ``Runner``, and module loading.

It follows Molt's agent contract so a module written for Molt runs unchanged: a module exports
``AgentRunner``, a ``Runner`` subclass built with no arguments, usually one of the two bindings

    class AgentRunner(StepEnvRunner):      # framework owns the LLM loop (molt.agents.env)
        def __init__(self): super().__init__(MyEnv)

    class AgentRunner(ChatAgentRunner):    # user owns the loop with its own SDK (molt.agents.chat_agent)
        def __init__(self): super().__init__(MyAgent)

What differs from Molt is only where the model lives: instead of a local vLLM client and tokenizer,
a runner gets an ``Episode`` (one dataset row plus its ids) and a ``GatewayClient``, opens one gateway
session per episode, and finishes it with the reward. The gateway records the token-exact trajectory
and writes it to the stream; the runner never sees tokens.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.agents.gateway import GatewayClient


@dataclass
class Result:
    """What ``Env.step`` and ``ChatAgent.run`` return."""

    reward: Any = 0.0
    """Scalar reward. A tensor / list is reduced to its first element; None is an error."""
    observation: str = ""
    """Step path: feedback text appended after this turn's action (masked out of the loss)."""
    terminated: bool = True
    """Natural end of the episode (the default makes an Env single-turn)."""
    truncated: bool = False
    """External cut-off (the episode stops and is marked truncated)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Diagnostics; numeric scalars travel with the trajectory, anything else is skipped."""
    score: Any = None
    """Dynamic-filtering / dashboard score; defaults to the episode's reward."""
    images: list[Any] | None = None
    """Step path: images shown with ``observation``, which holds the model's image token where each goes (a
    terminal result's are dropped with their tokens: no later turn shows them)."""
    sampling_params: Any = None
    """Step path: replaces the sampling params (and the per-turn cap: its max_tokens) for the following turns.
    A ``SamplingParams``, a vLLM ``SamplingParams`` or a dict of the same names."""


def first_scalar(value: Any, what: str = "reward", where: str = "") -> float:
    """Molt's reduction: a number stays, a tensor / array / list gives its first element. ``where`` names the user
    code that returned it (``MyEnv.step``), for the error."""
    at = f"{where}: " if where else ""
    if value is None:
        raise ValueError(f"{at}Result.{what} is None: return a number (e.g. Result(reward=0.0))")
    while True:
        if hasattr(value, "reshape") and hasattr(value, "tolist"):  # torch / numpy, without importing them
            value = value.reshape(-1).tolist()
        if not isinstance(value, (list, tuple)):
            break
        if not value:
            raise ValueError(f"{at}Result.{what} is empty: return a number")
        value = value[0]
    # float() would parse text: Result(reward=answer_text) would train "42" as a reward of 42. Molt's step runner
    # fails on text too (it adds the reward to a float).
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"{at}Result.{what} must be a number, got text {type(value).__name__}: {value[:100]!r}")
    try:
        out = float(value)
    except OverflowError:  # an int past float's range
        out = math.inf
    except (TypeError, ValueError):
        raise ValueError(f"{at}Result.{what} must be a number, got {type(value).__name__}: {value!r:.200}") from None
    if not math.isfinite(out):
        raise ValueError(f"{at}Result.{what} must be finite, got {out}")
    return out


def numeric_info(info: Any, where: str = "") -> dict[str, float]:
    """The numeric scalars of ``Result.info``, as Molt logs them: a tensor / numpy array / list gives its first
    element, booleans count as 0/1, and anything else (text, empty or non-finite values) is skipped."""
    if info is not None and not isinstance(info, dict):
        at = f"{where}: " if where else ""
        raise TypeError(f"{at}Result.info must be a dict of name -> value, got {type(info).__name__}")
    out: dict[str, float] = {}
    for key, value in (info or {}).items():
        while True:
            if hasattr(value, "reshape") and hasattr(value, "tolist"):  # torch / numpy, without importing them
                value = value.reshape(-1).tolist()
            elif isinstance(value, (list, tuple)) and value:
                value = value[0]
            else:
                break
        if isinstance(value, (bool, int, float)):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range: skipped as a non-finite value is
                continue
            if math.isfinite(number):
                out[str(key)] = number
    return out


def check_result(result: Any, where: str) -> Result:
    if not isinstance(result, Result):
        raise TypeError(f"{where} must return molt.agents.Result, got {type(result).__name__}")
    return result


@dataclass
class Episode:
    """One dataset row and the ids it is trained under: everything a runner needs besides the gateway."""

    prompt: str | list[dict[str, Any]]
    group_id: str
    sample_index: int = 0
    label: Any = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_length: int | None = None
    """Total context budget (prompt + all turns); None lets the gateway use its own."""
    max_new_tokens: int | None = None
    """Per-turn cap (``--rollout.max_new_tokens``) when sampling_params carry no max_tokens."""
    tools: list[dict[str, Any]] | None = None
    images: list[Any] | None = None
    env_name: str = ""
    env_version: str = ""
    trajectory_id: str | None = None
    """Set by the runner once its session is open (the session id is the trajectory id)."""
    eval: bool = False
    """Evaluation: the runner grades the episode and aborts its session instead of finishing it (no trajectory)."""
    before_finish: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    """Awaited by ``finish`` once the reward is decided, before anything is sent (the env worker's episode deadline:
    it raises if the deadline has passed, else lifts it for the finish)."""

    async def finish(
        self, session, reward: float, score: float | None, info: dict[str, float], truncated: bool = False
    ) -> dict[str, Any]:
        """Finish ``session`` with the reward (the gateway writes the trajectory); an eval episode writes nothing:
        leaving the session unfinished makes ``GatewayClient.session`` abort it."""
        if self.before_finish is not None:
            await self.before_finish()
        if self.eval:
            return {"written": False}
        return await session.finish(reward, score, info, truncated=truncated)

    def session_fields(self, sampling_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The POST /v1/sessions body for this episode."""
        body: dict[str, Any] = {
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "label": self.label,
            "env_name": self.env_name,
            "env_version": self.env_version,
            "sampling_params": sampling_params if sampling_params is not None else self.sampling_params,
        }
        if self.max_length is not None:
            body["max_length"] = self.max_length
        return body


@dataclass
class EpisodeResult:
    """What a runner reports once its session is finished."""

    reward: float
    score: float | None
    turns: int
    tokens: int
    trajectory_id: str
    written: bool
    truncated: bool = False
    info: dict[str, float] = field(default_factory=dict)
    response_tokens: int = 0
    """Tokens the policy generated over the episode (its action spans)."""


class Runner(abc.ABC):
    """Runs one episode end to end: open a gateway session, drive it, finish it with the reward.

    A custom runner must abort its session on any failure; ``GatewayClient.session`` does that.
    """

    PRERENDER_PROMPT = True
    """Molt's flag: True if the prompt is expected as text rendered by the dataset."""

    @abc.abstractmethod
    async def execute(self, episode: Episode, gateway: GatewayClient) -> EpisodeResult:
        """Run ``episode`` through ``gateway``; raise on any failure (the session is then aborted)."""


# ---- module loading (Molt's --train.agent_path)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def module_version(path: str | Path) -> str:
    """A short content hash of an agent file, recorded as the trajectories' env_version."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def load_agent_runner(path: str | Path, name: str = "agent_module") -> Runner:
    """Import ``path`` and build its ``AgentRunner`` with no arguments.

    The module is imported under a name of its own (``molt_agent_<name>``) so a worker can serve several.
    """
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"agent path {str(path)!r} must be an existing .py file exporting AgentRunner")
    if not _NAME_RE.match(name):
        raise ValueError(f"agent name {name!r}: use letters, digits, '_', '-' or '.'")
    mod_name = "molt_agent_" + re.sub(r"\W", "_", name)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look classes up by module name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    runner_cls = getattr(module, "AgentRunner", None)
    if runner_cls is None:
        raise ValueError(f"{path} defines no AgentRunner: add `class AgentRunner(StepEnvRunner | ChatAgentRunner)`")
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, Runner)):
        raise ValueError(f"{path}: AgentRunner must subclass molt.agents.Runner (StepEnvRunner or ChatAgentRunner)")
    return runner_cls()


# ---- Molt's in-process form (molt.agents.local): its runner-side trajectory and vLLM logprob extraction


@dataclass
class Trajectory:
    """Molt's runner-side trajectory (the services' wire format is ``molt.schema.Trajectory``)."""

    prompt: Any = None
    label: Any = None
    observation_text: str = ""
    observation_tokens: list[int] = field(default_factory=list)
    action_ranges: list[tuple[int, int]] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    reward: float = 0.0
    scores: float | None = None
    truncated: bool = False
    extra_logs: dict[str, Any] = field(default_factory=dict)


def _extract_generation_logprobs(action_token_ids, generation_logprobs) -> list[float]:
    """The sampled token's logprob per action token from vLLM's per-position top entries (missing: 0.0)."""
    if generation_logprobs is None:
        raise RuntimeError("vLLM did not return token logprobs while rollout importance correction is enabled.")
    if len(generation_logprobs) != len(action_token_ids):
        raise RuntimeError(
            f"vLLM token logprobs must align with generated token ids: got {len(generation_logprobs)} "
            f"logprob entries for {len(action_token_ids)} tokens."
        )
    out = []
    for token_id, entries in zip(action_token_ids, generation_logprobs):
        entry = entries.get(token_id) if entries else None
        out.append(entry.logprob if entry is not None else 0.0)
    return out


# Molt defines Env and StepEnvRunner in molt/agents/base.py; modules that import them from here keep working.
_MOLT_NAMES = {
    "Env": "molt.agents.env",
    "StepEnvRunner": "molt.agents.env",
    "ChatAgent": "molt.agents.chat_agent",
    "ChatAgentRunner": "molt.agents.chat_agent",
    "ChatContext": "molt.agents.chat_agent",
}


def __getattr__(name: str) -> Any:
    if name in _MOLT_NAMES:
        return getattr(importlib.import_module(_MOLT_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
