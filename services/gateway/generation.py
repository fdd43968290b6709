"""One generation of a turn, from the sampling sent to a pod to the reply read back: a turn's sampling params
(the session's, the request's overrides, capped at the room left), the call on the session's pod with failover
to another, stop strings applied to what the pod sampled, and the tokens decoded and parsed into a TurnResult.

The turns themselves (locks, the capture's plan and room, what is committed) are core.py's; these are plain
functions over explicit inputs (the pool, the model, a session), called by every kind of turn and by the
session-less requests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from molt.metrics import Metrics
from services.gateway.chat import ChatModel, parse_tool_calls
from services.gateway.errors import GatewayError
from services.gateway.pods import Generation, Pod, PodFailed, PodPool
from services.gateway.session import Session, TurnResult
from services.gateway.thinking import split_reasoning

log = logging.getLogger("molt.gateway")

# Sampling keys a request may set per turn (anything else in a session's params is passed through too).
TURN_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "top_logprobs",
    "logit_bias",
    "structured_outputs",
)


def turn_sampling(params: dict, overrides: dict, remaining: int) -> dict:
    """The sampling params a pod gets for one turn: ``params`` (the session's, or the gateway's defaults for a
    session-less request) with the request's ``overrides``, ``max_tokens`` held to the ``remaining`` room."""
    sp = dict(params)
    for k in TURN_KEYS:
        if overrides.get(k) is not None:
            sp[k] = overrides[k]
    sp["max_tokens"] = max(1, min(int(sp.get("max_tokens") or remaining), remaining))
    if sp.get("min_tokens"):  # as Molt: a cap on the room left lowers min_tokens too, else the pod refuses
        sp["min_tokens"] = min(int(sp["min_tokens"]), sp["max_tokens"])
    sp["n"] = int(overrides.get("n") or 1)
    sp.pop("stop", None)
    return sp


async def generate_with_failover(
    pool: PodPool,
    metrics: Metrics,
    s: Session,
    prompt_ids: list[int],
    sp: dict,
    on_tokens: Callable[[list[int], list[float]], None] | None = None,
    images: list[str] | None = None,
) -> tuple[Generation, list[dict]]:
    """Generate on the session's pod, moving to another pod (same exact prefix) when it fails. A streamed
    turn (``on_tokens``) whose pod fails after its client saw tokens fails instead: another pod would sample
    other tokens than the ones shown. Nothing is committed; the client sends the turn again."""
    events: list[dict] = []
    tried: set[str] = set()
    shown = [0]
    if on_tokens is not None:
        client_tokens = on_tokens

        def on_tokens(ids: list[int], logprobs: list[float]) -> None:
            shown[0] += len(ids)
            client_tokens(ids, logprobs)

    # The session's pod; None for a first turn, or a pod this replica does not know (the session was adopted
    # from a replica with other pods): the turn then moves, recorded as a pod switch.
    current: Pod | None = pool.pods.get(s.pod) if s.pod else None
    while True:
        pod = current if current is not None and current.healthy and current.url not in tried else None
        if pod is None:
            pod = pool.pick(exclude=tried)
            if s.pod and s.pod != pod.url:
                events.append(
                    {
                        "kind": "pod_switch",
                        "from": s.pod,
                        "to": pod.url,
                        "at_token": len(prompt_ids),
                        "segment": max(len(s.capture.segments) - 1, 0),
                        "turn": s.turns,
                        "reason": current.last_error
                        if current is not None
                        else "the pod is not one of this gateway replica's",
                        "time": time.time(),
                    }
                )
                metrics["molt_gateway_pod_failovers_total"].labels(s.pod).inc()
        try:
            gens = await pool.generate(pod, prompt_ids, sp, on_tokens, images)
        except PodFailed as exc:
            if shown[0]:
                raise GatewayError(
                    502,
                    f"{exc} after streaming {shown[0]} tokens; nothing of this turn was recorded: send it again",
                    code="pod_failed",
                ) from None
            log.warning("session %s: %s; trying another pod", s.id, exc)
            tried.add(pod.url)
            continue
        if s.pod != pod.url:
            if not s.pod:  # the first pod: the trainer labels this trajectory's mismatch KL with it
                events.append({"kind": "pod", "pod": pod.url, "at_token": 0, "segment": 0, "time": time.time()})
            elif s.pod in pool.pods:
                pool.get(s.pod).sessions -= 1
            pod.sessions += 1
            s.pod = pod.url
        return gens[0], events


def apply_stop(model: ChatModel, gen: Generation, stop: list[str] | None) -> Generation:
    """Stop strings, applied here (the pod takes token ids only): keep the tokens up to the one that
    completes the first stop string. What is recorded stays a prefix of what the pod sampled."""
    if not stop or not gen.token_ids:
        return gen
    text = ""
    for i, tok in enumerate(gen.token_ids):
        text += model.decode([tok], skip_special=True)
        if any(s and s in text for s in stop):
            if i + 1 < len(gen.token_ids):
                gen = dataclasses.replace(
                    gen, token_ids=gen.token_ids[: i + 1], logprobs=gen.logprobs[: i + 1], finish_reason="stop"
                )
                gen.extra["stop_string"] = True
            else:
                gen.finish_reason = "stop"
                gen.extra["stop_string"] = True
            break
    return gen


def turn_result(
    model: ChatModel,
    gen: Generation,
    prompt_tokens: int,
    num_tokens: int,
    remaining: int,
    stop: list[str] | None = None,
    *,
    tools: bool = False,
    as_generated: bool = False,
    opened: bool = False,
) -> TurnResult:
    """``tools``: the request offered tools, so ``<tool_call>`` blocks become tool calls (as vLLM parses only
    then); ``as_generated``: a "raw" session's turn, its text as generated (Session.replies); ``opened``: the
    prompt opened a think block (thinking.think_opened), so the reply starts as reasoning."""
    text = model.decode(gen.token_ids, skip_special=True)
    raw = model.decode(gen.token_ids, skip_special=False)
    matched = None
    if gen.extra.get("stop_string") and stop:
        cut, matched = min(((text.find(s), s) for s in stop if s and s in text), default=(-1, None))
        text = text[:cut] if cut >= 0 else text
    split = (model.thinks or opened) and not as_generated
    reasoning, answer = split_reasoning(text, opened) if split else ("", text)
    content, calls = parse_tool_calls(answer) if tools and not as_generated else (answer, [])
    finish = gen.finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    return TurnResult(
        gen.token_ids,
        gen.logprobs,
        finish,
        gen.policy_version,
        text,
        raw,
        content,
        calls,
        prompt_tokens,
        num_tokens,
        remaining,
        gen.wait_s,
        stop_sequence=matched,
        reasoning=reasoning,
        top_logprobs=gen.extra.get("top_logprobs"),
    )
