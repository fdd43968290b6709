"""``Env`` + ``StepEnvRunner``: the framework owns the LLM loop (Molt's step path).

Each turn is one call to the gateway's token-level ``/v1/sessions/{id}/generate``: the previous
turn's feedback goes in as ``append_text`` (recorded as masked tokens), the model's answer comes back
as an action span with its logprobs and policy version. The worker needs no tokenizer; the trajectory
is token-exact because the gateway holds the tokens.

``state`` passed to ``Env.step`` holds exactly (as in Molt):
- ``observation_text``: the initial observation + all previous actions and feedback texts;
- ``action_text``: this turn's generation, decoded with special tokens kept;
- ``label``: the dataset label, as given;
- ``sampling_params``: a ``SamplingParams`` (vLLM attribute names), a copy of this turn's params with
  max_tokens held to the room the turn had (mutating it has no effect).

Rewards of all turns are summed; score and info come from the last turn (no score: that turn's reward).
Feedback is appended even on the terminal turn. The loop stops when the env says terminated / truncated
or when the total ``max_length`` budget is spent. A turn cut by its per-turn cap (finish_reason "length") marks the
episode truncated but does not end it, as in Molt. There is no turn limit of the framework's own:
the env decides. A first observation that leaves no room to generate keeps its last
max(1, max_length - reserve) tokens (reserve: the turn's max_tokens, else 32), as in Molt. However the episode
ends, the runner then awaits ``env.close()`` (Molt's hook: what the env started for the episode is released).
"""

from __future__ import annotations

import abc
import asyncio
import copy
import inspect
import logging
from typing import Any

from molt.agents.base import Episode, EpisodeResult, Result, Runner, check_result, first_scalar, numeric_info
from molt.agents.gateway import GatewayClient
from molt.agents.params import SamplingParams
from molt.images import count_markers, inline_images, to_data_url

log = logging.getLogger(__name__)


class Env(abc.ABC):
    """A reward environment. Built with no arguments, one fresh instance per episode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - Molt's constructor, arguments ignored
        pass

    async def reset(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` = {"observation": prompt, "label": label}; the returned "observation" is the first input."""
        return state

    @abc.abstractmethod
    async def step(self, state: dict[str, Any]) -> Result:
        """Grade this turn's ``state["action_text"]``; return reward, feedback and whether to stop."""

    async def close(self) -> None:  # noqa: B027 - Molt's hook, a no-op unless an env holds something
        """Release what the episode holds (a game process, a sandbox, a connection). Called once after every
        episode, however it ended (done, out of context, failed, cancelled), as Molt's StepEnvRunner does; an
        env that closes itself on its last step must accept a second call."""


def _messages_text(messages: list[dict[str, Any]]) -> str:
    """Plain text of a message list (the worker has no chat template; the gateway renders it)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content or ""))
    return "\n".join(parts)


def turn_params(params: SamplingParams, per_turn_cap: int | None) -> SamplingParams:
    """This turn's sampling params: the per-turn cap as max_tokens, min_tokens clamped down to it."""
    sp = copy.deepcopy(params)
    if sp.max_tokens is None and per_turn_cap is not None:
        sp.max_tokens = per_turn_cap
    if sp.max_tokens is not None and sp.min_tokens:
        sp.min_tokens = min(sp.min_tokens, sp.max_tokens)
    return sp


def clamped_params(sp: SamplingParams, out: dict[str, Any]) -> SamplingParams:
    """A copy of this turn's params as the turn ran them: max_tokens held to the room the prompt left (the room
    before the turn = the answer's remaining_tokens + the tokens it generated), min_tokens to that, as Molt's
    state shows them."""
    sp = copy.deepcopy(sp)
    if out.get("remaining_tokens") is not None:
        room = max(0, int(out["remaining_tokens"]) + len(out.get("token_ids") or []))
        sp.max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        if sp.min_tokens:
            sp.min_tokens = min(sp.min_tokens, sp.max_tokens)
    return sp


IMAGES_ON_TOKEN_PATH = (
    "{name} is an Env: its episode's images go in its first observation's <image> markers, so the observation "
    "must be a message list (--data.apply_chat_template) with one <image> per image in its user strings; {why}"
)


class StepEnvRunner(Runner):
    """Runs ``env_cls`` episodes through the gateway's token-level session API."""

    PRERENDER_PROMPT = True

    def __init__(self, env_cls: type[Env]) -> None:
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError(f"StepEnvRunner needs an Env subclass, got {env_cls!r}")
        # As Molt's, the loop awaits reset and step: a plain def would fail every episode with "can't be used in
        # 'await' expression", so it is refused when the worker loads the module instead.
        for name in ("reset", "step"):
            if not inspect.iscoroutinefunction(inspect.unwrap(getattr(env_cls, name))):
                raise ValueError(f"{env_cls.__name__}.{name} must be async def (Molt's Env API awaits it)")
        self.env_cls = env_cls

    async def execute(self, *args: Any, **kwargs: Any):
        """``execute(episode, gateway)``; Molt's in-process form ``execute(prompt, label, sampling_params, max_length,
        hf_tokenizer, llm_engine)`` runs the same loop on that engine and returns Molt's ``Trajectory``
        (``molt.agents.local``)."""
        if args and isinstance(args[0], Episode) or "episode" in kwargs:
            return await self._execute(*args, **kwargs)
        from molt.agents.local import execute_on_engine

        return await execute_on_engine(self._execute, *args, **kwargs)

    def _check_markers(self, messages: list[dict[str, Any]], urls: list[str]) -> None:
        markers = count_markers(messages)
        if markers < len(urls):  # an image without a marker would never be shown to the model
            why = f"{len(urls) - markers} of its {len(urls)} images have no marker"
            raise ValueError(IMAGES_ON_TOKEN_PATH.format(name=self.env_cls.__name__, why=why))

    async def _execute(self, episode: Episode, gateway: GatewayClient) -> EpisodeResult:
        env = self.env_cls()
        try:
            return await self._run(env, episode, gateway)
        finally:
            await _close(env)

    async def _run(self, env: Env, episode: Episode, gateway: GatewayClient) -> EpisodeResult:
        urls = [to_data_url(image, f"images[{i}]") for i, image in enumerate(episode.images or [])]
        params = SamplingParams.from_any(episode.sampling_params)
        cap = episode.max_new_tokens
        async with gateway.session(**episode.session_fields(turn_params(params, cap).wire())) as session:
            episode.trajectory_id = session.id
            prompt, rendered = episode.prompt, False
            if isinstance(prompt, list) and self.PRERENDER_PROMPT:
                # As Molt's dataset: an Env gets a chat prompt rendered (template, generation prompt, the row's
                # tools; images at the model's placeholders) and may edit the text before it is sent back as is.
                self._check_markers(prompt, urls)
                prompt, rendered = await session.render(inline_images(prompt, urls), episode.tools), True
            first = await env.reset({"observation": prompt, "label": episode.label})
            obs = _first_observation(first, f"{self.env_cls.__name__}.reset")
            if isinstance(obs, list):
                self._check_markers(obs, urls)
                pending: dict[str, Any] = {"messages": inline_images(obs, urls)}
                observation_text = _messages_text(obs)
            elif urls and not rendered:
                why = "it is a string"
                raise ValueError(IMAGES_ON_TOKEN_PATH.format(name=self.env_cls.__name__, why=why))
            else:
                pending = {"append_text": str(obs), "images": urls}
                observation_text = str(obs)
            reward, score, info = 0.0, None, {}
            turns, num_tokens, truncated, response_tokens = 0, 0, False, 0
            # As Molt: a first observation too long to leave room to generate keeps its last tokens, and the env
            # sees that kept text as the observation.
            pending["truncate_prompt"] = "left"
            while True:
                sp = turn_params(params, cap)
                out = await session.generate(**pending, sampling_params=sp.wire())
                if out.get("prompt_text") is not None:
                    observation_text = out["prompt_text"]
                num_tokens = int(out.get("num_tokens", num_tokens))
                length_cut = out.get("finish_reason") == "length"
                if not out.get("token_ids") and length_cut:
                    truncated = True  # the budget ran out before this turn could generate
                    break
                turns += 1
                response_tokens += len(out["token_ids"])
                state = {
                    "observation_text": observation_text,
                    "action_text": out.get("text", ""),
                    "label": episode.label,
                    "sampling_params": clamped_params(sp, out),
                }
                where = f"{self.env_cls.__name__}.step"
                result = check_result(await env.step(state), where)
                if result.observation is not None and not isinstance(result.observation, str):
                    raise TypeError(
                        f"{where}: Result.observation must be text (the feedback appended after the action), "
                        f"got {type(result.observation).__name__}"
                    )
                turn_reward = first_scalar(result.reward, where=where)
                reward += turn_reward
                # As Molt: the score is the last turn's, else that turn's reward (not the summed one).
                score = turn_reward if result.score is None else result.score
                info = result.info
                truncated = truncated or length_cut or bool(result.truncated)
                observation_text += state["action_text"] + (result.observation or "")
                # Each image sits where the model's image token is in the observation (as Molt's envs write it).
                shown = [to_data_url(image, f"Result.images[{i}]") for i, image in enumerate(result.images or [])]
                if shown and not result.observation:
                    raise ValueError(
                        f"{self.env_cls.__name__}.step returned images without an observation to show them in: "
                        "put the model's image token in Result.observation where each image goes"
                    )
                if result.sampling_params is not None:
                    params = SamplingParams.from_any(result.sampling_params, "Result.sampling_params")
                    cap = None
                if result.terminated or result.truncated:
                    # Molt appends feedback even on the terminal turn (masked: it never enters the loss).
                    if result.observation and await gateway.can_append():
                        appended = await session.append(result.observation, shown)  # images dropped: no pod sees it
                        num_tokens = int(appended.get("num_tokens", num_tokens))
                    break
                pending = {"append_text": result.observation, "images": shown} if result.observation else {}
            where = f"{self.env_cls.__name__}.step"
            final_score = reward if score is None else first_scalar(score, "score", where)
            numeric = numeric_info(info, where)
            done = await episode.finish(session, reward, final_score, numeric, truncated=truncated)
        return EpisodeResult(
            reward=reward,
            score=final_score,
            turns=turns,
            tokens=num_tokens,
            trajectory_id=session.id,
            written=bool(done.get("written")),
            truncated=truncated,
            info=numeric,
            response_tokens=response_tokens,
        )


def _first_observation(first: Any, where: str) -> str | list[dict[str, Any]]:
    """The first observation from what ``Env.reset`` returned: its state dict's "observation" (text or messages),
    or the observation itself. A reset that returns nothing (a forgotten ``return state``) would otherwise send
    the text "None" to the model as the prompt, and train on it."""
    if isinstance(first, dict) and "observation" not in first:
        raise ValueError(f'{where} must return the state dict with an "observation" key, got keys {list(first)[:10]}')
    obs = first["observation"] if isinstance(first, dict) else first
    if not isinstance(obs, (str, list)):
        raise TypeError(
            f"{where} must return the state dict (e.g. `return state`) whose observation is text or a message "
            f"list, got {type(obs).__name__}"
        )
    return obs


CLOSE_WAIT_S = 20.0
"""How long the episode's answer waits for an async ``close()``: past it the close goes on in the background
(what it releases is still released) and the answer leaves, so a slow close never holds the episode past the
worker's bounds, which the trainer waits out."""
_CLOSING: set[asyncio.Future] = set()  # closes let go of, held here until done (the loop keeps tasks weakly)


async def _close(env: Env) -> None:
    """``env.close()``, async or plain def. Its failure is logged, not raised: the episode's own outcome,
    already decided, stands, and an exception the episode raised is not masked."""
    name = type(env).__name__
    try:
        done = env.close()
        if inspect.isawaitable(done):
            closing = asyncio.ensure_future(done)
            try:
                await asyncio.wait_for(asyncio.shield(closing), CLOSE_WAIT_S)
            except TimeoutError:
                log.warning(
                    "%s.close still running after %g s; the episode ends without waiting for it", name, CLOSE_WAIT_S
                )
                _CLOSING.add(closing)
                closing.add_done_callback(lambda task: _close_failed(name, task))
    except Exception:  # any failure of user code while releasing
        log.warning("%s.close failed", name, exc_info=True)


def _close_failed(name: str, task: asyncio.Future) -> None:
    """A close that finished in the background: its failure logged as a waited-for one's is."""
    _CLOSING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s.close failed", name, exc_info=task.exception())
