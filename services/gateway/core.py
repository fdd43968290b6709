"""The transport-agnostic gateway core: a session's turns (chat, tokens, completions) and session-less requests.
One generation (the pod call with failover, stop strings, the reply parsed) is generation.py's; sessions
themselves (open, finish, drain, hand off) are the base class in lifecycle.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from molt.images import expanded_prompt_length
from services.gateway import sampling
from services.gateway.capture import ChatState, TurnPlan
from services.gateway.chat import (
    ChatModel,
    bad_request,
    canonical_messages,
    canonical_tools,
    data_url_part,
    message_images,
    request_key,
)
from services.gateway.errors import ContextLengthExceeded, GatewayError
from services.gateway.generation import apply_stop, generate_with_failover, turn_result, turn_sampling
from services.gateway.lifecycle import SessionLifecycle
from services.gateway.pods import Generation, PodFailed
from services.gateway.rescore import plain_sampling
from services.gateway.session import Session, TurnResult
from services.gateway.thinking import think_opened

log = logging.getLogger("molt.gateway")


class Gateway(SessionLifecycle):
    """A gateway replica: the session lifecycle it inherits, and the turns that run inside a session."""

    async def chat_turn(
        self,
        s: Session,
        messages: list[dict],
        tools: list[dict] | None,
        overrides: dict,
        ready: asyncio.Future | None = None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
        fresh: bool = False,
        on_opened: Callable[[bool], None] | None = None,
    ) -> TurnResult:
        """One captured chat turn; ``ready`` resolves once the request is accepted (before generation);
        ``on_tokens`` gets the tokens as the pod generates them (a streamed turn), ``on_opened`` before them
        whether the prompt opened a think block. ``fresh``: the client says this is its first attempt, so a
        request identical to the last one is a new sample, not a retry."""
        try:
            async with s.lock:
                if s.state != "open":
                    raise GatewayError(409, f"session {s.id} is {s.state}", code="session_closed")
                if int(overrides.get("n") or 1) != 1:
                    raise bad_request("n must be 1 on a session (each sample is its own session)", "n")
                if overrides.get("add_generation_prompt") is False and not overrides.get("continue_final_message"):
                    raise bad_request(
                        "'add_generation_prompt': false without 'continue_final_message' leaves no assistant turn "
                        "open, so the model would write the turn's header itself: a captured turn's reply is the "
                        "assistant's message (send continue_final_message: true to continue a final assistant "
                        "message, or drop add_generation_prompt)",
                        "add_generation_prompt",
                    )
                prefill = bool(overrides.get("continue_final_message"))
                model = self.model.with_kwargs(overrides.get("chat_template_kwargs"))
                key = request_key(messages, tools, model.template_kwargs or None)
                # A retry repeats the whole request: the same messages asked with other sampling, stops or
                # constraints are a new turn, not the last answer again (that would ignore what they ask).
                retry = f"{key}:{request_key([], None, overrides)}"
                if not fresh and retry == s.last_key and s.last_result is not None:
                    resolve_future(ready, value=s.last_result.prompt_tokens)
                    return _cached(s.last_result)
                plan = s.capture.plan_chat(model, messages, tools, key, prefill=prefill)
                hard = s.context_full == "error"
                opened = think_opened(plan.full_render, messages[-1]["content"] if prefill else None)
                if on_opened is not None:
                    on_opened(opened)

                def replan() -> TurnPlan:
                    return s.capture.plan_chat(model, messages, tools, key, drop_new_images=True, prefill=prefill)

                stop = overrides.get("stop") or s.sampling_params.get("stop")
                plan, fitted, events = await self._generate_fitting(
                    s, model, plan, overrides, hard, None if hard else replan, on_tokens, stop, ready
                )
                if fitted is None:
                    return self._context_full(s, plan)
                seg = s.capture.commit(plan, fitted, events, self.settings.rollout.top_logprobs)
                n = len(seg.token_ids)
                raw = s.replies == "raw"
                result = turn_result(
                    self.model,
                    fitted,
                    plan.num_tokens,
                    n,
                    s.capture.remaining(n),
                    stop,
                    tools=bool(tools),
                    as_generated=raw,
                    opened=opened,
                )
                history, reply = messages, result.reply
                if prefill:  # what the client sends back: prefill + continuation, one assistant message
                    history, reply = messages[:-1], {**reply, "content": messages[-1]["content"] + result.content}
                s.capture.chat = ChatState(history, tools, plan.full_render, reply, result.raw_text)
                self._after_turn(s, plan, retry, result)
                return result
        except BaseException as exc:
            resolve_future(ready, exc)
            raise

    async def _generate_fitting(
        self,
        s: Session,
        model: ChatModel,
        plan: TurnPlan,
        overrides: dict,
        hard: bool,
        replan: Callable[[], TurnPlan] | None = None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
        stop: list[str] | None = None,
        ready: asyncio.Future | None = None,
    ) -> tuple[TurnPlan, Generation | None, list[dict]]:
        """Generate ``plan`` within the session's max_length: the plan generated, the pod's answer held to
        max_length (``Capture.fit``; None: the turn does not fit, which with ``hard`` is a 400 instead) and the
        pod's events. ``replan``: the same turn without its new images (feedback whose images do not fit: Molt
        drops them with their image tokens and keeps the text), used when the room check, the pod's answer or
        its refusal (images that expanded further than estimated) says they do not fit.

        ``ready`` resolves before the pod call, or for a streamed turn with its first token: the pod refuses a
        request it cannot serve (a schema it cannot compile, a token id past the vocabulary) before generating,
        and a streamed client then gets that refusal as the HTTP status, as from vLLM, not a 200 and an error
        event."""
        events: list[dict] = []
        top_k = self.settings.rollout.top_logprobs
        push = on_tokens
        if on_tokens is not None and ready is not None:
            client_tokens = on_tokens

            def push(ids: list[int], logprobs: list[float]) -> None:
                resolve_future(ready, value=plan.num_tokens)
                client_tokens(ids, logprobs)

        async def attempt(plan: TurnPlan) -> Generation | None:
            remaining = s.capture.check_room(plan, hard)
            if remaining <= 0:
                return None
            sp = turn_sampling(s.sampling_params, overrides, remaining)
            if top_k:  # the capture records the top-k; the client's answer keeps only what it asked for
                sp["top_logprobs"] = max(int(sp.get("top_logprobs") or 0), top_k)
            try:
                gen, more = await generate_with_failover(
                    self.pool, self.metrics, s, plan.prompt_ids, sp, push, plan.image_files
                )
            except GatewayError as exc:
                length = expanded_prompt_length(str(exc)) if exc.code == "context_length_exceeded" else None
                if not plan.images or length is None:
                    raise
                s.capture.expanded(model, plan, length, hard)  # the pod's context is full: a 400 when hard
                return None
            if self.settings.rollout.rescore_logprobs:  # the capture records it per segment (rescore.py)
                gen.extra["plain"] = plain_sampling(sp)
            events.extend(more)
            stopped = apply_stop(self.model, gen, stop)
            fitted = s.capture.fit(model, plan, stopped, hard)
            if on_tokens is not None and fitted is not stopped:
                # The client saw tokens past what fits (its images expanded further than estimated): nothing is
                # recorded and the turn is sent again, now planned with the run the pod just showed.
                raise GatewayError(
                    502,
                    "the images of this turn expanded past the session's max_length while it was streamed; "
                    "nothing was recorded: send the turn again",
                    code="pod_error",
                )
            return fitted

        droppable = replan is not None and plan.new_images > 0 and not plan.new_segment
        remaining = s.capture.check_room(plan, hard)  # a 400 when hard, before the request counts as accepted
        if droppable and remaining <= 0:
            assert replan is not None
            plan, droppable = replan(), False
            remaining = s.capture.check_room(plan, hard)
        if on_tokens is None:
            resolve_future(ready, value=plan.num_tokens)
        fitted = await attempt(plan) if remaining > 0 else None
        if fitted is None and droppable:
            assert replan is not None
            plan = replan()
            fitted = await attempt(plan)
        resolve_future(ready, value=plan.num_tokens)
        return plan, fitted, events

    def _context_full(self, s: Session, plan: TurnPlan) -> TurnResult:
        """The answer to a turn that does not fit (token-level turns; chat and completion turns of a session opened
        with ``context_full="length"``): no tokens, finish "length", nothing committed, the session's last segment
        marked truncated (the episode ran out of context)."""
        if s.capture.current is not None:
            s.capture.current.truncated = True
        return TurnResult([], [], "length", self.policy_version, "", "", "", [], plan.num_tokens, plan.num_tokens, 0)

    def _after_turn(self, s: Session, plan: TurnPlan, key: str | None, result: TurnResult) -> None:
        if plan.new_segment:
            self.metrics.child("molt_gateway_segments_total", plan.reason).inc()
        s.turns += 1
        s.last_used = time.monotonic()
        s.last_key, s.last_result = key, result

    def render_prompt(self, s: Session, body: dict) -> dict:
        """A first prompt as the token-level path would render it (chat template + generation prompt, with the
        row's tools), without generating: an Env sees its prompt as Molt's dataset hands it, as text, and may edit
        it before the first turn sends it back as ``append_text``."""
        messages = canonical_messages(body.get("messages"))
        tools = canonical_tools(body.get("tools"))
        if s.state != "open":
            raise GatewayError(409, f"session {s.id} is {s.state}", code="session_closed")
        # The samples of a group render the same row: the first-turn cache renders it once.
        key = request_key(messages, tools, self.model.template_kwargs or None)
        text, ids = self.model.prompt(key, messages, tools)
        return {"text": text, "num_tokens": len(ids)}

    async def token_turn(self, s: Session, body: dict) -> TurnResult:
        messages = body.get("messages")
        if messages is not None:
            messages = canonical_messages(messages)
        text = body.get("append_text")
        if text is not None and not isinstance(text, str):
            raise bad_request("'append_text' must be a string", "append_text")
        ids = body.get("append_token_ids")
        vocab = len(self.model.tokenizer)
        if ids is not None and (
            not isinstance(ids, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
        ):
            raise bad_request(f"'append_token_ids' must be a list of token ids in [0, {vocab})", "append_token_ids")
        images = body.get("images")
        if images is not None and not isinstance(images, list):
            raise bad_request("'images' must be a list of image data URLs (data:image/png;base64,...)", "images")
        parts = [data_url_part(url, f"images[{i}]") for i, url in enumerate(images or [])]
        overrides = sampling.session_params(body.get("sampling_params"), vocab, turn=True)
        truncate = body.get("truncate_prompt")
        if truncate not in (None, "left"):
            raise bad_request("'truncate_prompt' must be \"left\" (or absent)", "truncate_prompt")
        async with s.lock:
            if s.state != "open":
                raise GatewayError(409, f"session {s.id} is {s.state}", code="session_closed")
            if truncate and s.capture.current is not None:
                raise bad_request("'truncate_prompt' is for the first turn only", "truncate_prompt")
            append_only = overrides.get("max_tokens") == 0

            def planned(drop_images: bool = False) -> TurnPlan:
                return s.capture.plan_tokens(self.model, messages, text, ids, parts, append_only, drop_images)

            plan = planned()
            dropped = self._truncate_left(s, plan, overrides) if truncate else 0
            if append_only and s.capture.check_room(plan, hard=False) <= 0:
                return self._context_full(s, plan)
            if append_only:
                # Append-only: Molt appends the env's feedback even after the terminal turn (masked, so it
                # never reaches the loss but the trajectory holds the whole episode). Nothing is generated.
                seg = s.capture.commit(plan, Generation([], [], "stop", self.policy_version, s.pod or ""), [])
                return TurnResult(
                    [],
                    [],
                    "stop",
                    self.policy_version,
                    "",
                    "",
                    "",
                    [],
                    plan.num_tokens,
                    len(seg.token_ids),
                    s.capture.remaining(len(seg.token_ids)),
                )
            # Molt's rule for an Env's feedback: images that do not fit the context (expanded) are dropped with
            # their image tokens, the feedback's text is kept.
            stop = overrides.get("stop") or s.sampling_params.get("stop")
            plan, fitted, events = await self._generate_fitting(
                s, self.model, plan, overrides, False, lambda: planned(drop_images=True), stop=stop
            )
            if fitted is None:  # contract: no room left -> finish "length" with no tokens; nothing is committed
                return self._context_full(s, plan)
            gen = fitted
            seg = s.capture.commit(plan, gen, events, self.settings.rollout.top_logprobs)
            raw = self.model.decode(gen.token_ids, skip_special=False)
            # As vLLM: the tokens keep the one that completed the stop string, the text ends before it.
            cuts = [raw.find(x) for x in stop or [] if x and x in raw] if gen.extra.get("stop_string") else []
            answer = raw[: min(cuts)] if cuts else raw
            result = TurnResult(
                gen.token_ids,
                gen.logprobs,
                gen.finish_reason,
                gen.policy_version,
                answer,
                answer,
                answer,
                [],
                plan.num_tokens,
                len(seg.token_ids),
                s.capture.remaining(len(seg.token_ids)),
                gen.wait_s,
            )
            if dropped:
                result.prompt_text = self.model.decode(plan.prompt_ids, skip_special=False)
                result.prompt_tokens_dropped = dropped
            self._after_turn(s, plan, None, result)
            return result

    def _truncate_left(self, s: Session, plan: TurnPlan, overrides: dict) -> int:
        """Molt's rule for an Env's first observation that leaves no room to generate: keep its last
        max(1, max_length - reserve) tokens, reserve = the request's own max_tokens or 32 (not the gateway's
        default). A prompt with images is left whole (a cut could split an image's tokens from its pixels): it
        ends the episode as before. Returns how many tokens were dropped."""
        reserve = overrides.get("max_tokens") or 32
        keep = max(1, s.capture.max_length - reserve)
        drop = len(plan.prompt_ids) - keep
        if drop <= 0 or plan.images:
            return 0
        plan.prompt_ids = plan.delta_ids = plan.prompt_ids[drop:]
        log.warning(
            "session %s: the first observation has %d tokens, over max_length %d less %d reserved to generate; "
            "kept its last %d",
            s.id,
            keep + drop,
            s.capture.max_length,
            reserve,
            keep,
        )
        self.metrics["molt_gateway_prompts_truncated_total"].inc()
        return drop

    async def completion_turn(self, s: Session, prompt: str | list[int], overrides: dict) -> TurnResult:
        async with s.lock:
            if s.state != "open":
                raise GatewayError(409, f"session {s.id} is {s.state}", code="session_closed")
            if int(overrides.get("n") or 1) != 1:
                raise bad_request("n must be 1 on a session (each sample is its own session)", "n")
            plan = s.capture.plan_completion(self.model, prompt)
            stop = overrides.get("stop") or s.sampling_params.get("stop")
            hard = s.context_full == "error"
            plan, fitted, events = await self._generate_fitting(s, self.model, plan, overrides, hard, stop=stop)
            if fitted is None:
                return self._context_full(s, plan)
            gen = fitted
            seg = s.capture.commit(plan, gen, events, self.settings.rollout.top_logprobs)
            n = len(seg.token_ids)
            result = turn_result(self.model, gen, plan.num_tokens, n, s.capture.remaining(n), stop, as_generated=True)
            if isinstance(prompt, str):
                s.capture.completion_text = prompt + result.text
            self._after_turn(s, plan, None, result)
            return result

    async def plain_chat(
        self, model: ChatModel, messages: list[dict], tools: list[dict] | None, overrides: dict
    ) -> list[TurnResult]:
        """Session-less chat request on any wire: ``messages`` rendered with ``model`` (the gateway's, or one
        with the request's template kwargs) and generated with their images, which are refused first on a
        text-only model (its template cannot render them)."""
        images = message_images(messages)
        self._refuse_images(images)
        prompt = render_request(model, messages, tools, overrides)
        opened = think_opened(prompt, messages[-1]["content"] if overrides.get("continue_final_message") else None)
        return await self.plain_generate(model.encode(prompt), overrides, images, tools=bool(tools), opened=opened)

    def _refuse_images(self, images: list[dict] | None) -> None:
        if images and self.model.image_token_id is None:
            raise GatewayError(
                400,
                "this model takes no images (it is a text-only model); send text only",
                code="images_unsupported",
                param="messages",
            )

    async def plain_generate(
        self,
        prompt_ids: list[int],
        overrides: dict,
        images: list[dict] | None = None,
        tools: bool = False,
        opened: bool = False,
    ) -> list[TurnResult]:
        """Session-less request: nothing captured; any healthy pod, failing over between pods. ``images``: the
        request's image parts in order (chat.message_images); ``opened``: as ``turn_result``'s."""
        self._refuse_images(images)
        files = [p["data"] for p in images or []]
        limit = self.default_max_length - len(prompt_ids)
        if limit <= 0:
            raise ContextLengthExceeded(
                len(prompt_ids), self.default_max_length, "the gateway's --session.max_length", "shorten the prompt"
            )
        sp = turn_sampling(self.default_sampling, overrides, limit)
        tried: set[str] = set()
        while True:
            pod = self.pool.pick(exclude=tried)
            try:
                gens = await self.pool.generate(pod, prompt_ids, sp, images=files)
                break
            except PodFailed:
                tried.add(pod.url)
        stop = overrides.get("stop")
        gens = [apply_stop(self.model, g, stop) for g in gens]
        n = len(prompt_ids)
        return [
            turn_result(
                self.model, g, n, n + len(g.token_ids), limit - len(g.token_ids), stop, tools=tools, opened=opened
            )
            for g in gens
        ]


def render_request(model: ChatModel, messages: list[dict], tools: list[dict] | None, overrides: dict) -> str:
    """A session-less request's prompt, as vLLM renders it: ``add_generation_prompt`` (default on) or the final
    message continued (``continue_final_message``, the wires' prefill)."""
    prefill = bool(overrides.get("continue_final_message"))
    return model.render(messages, tools, overrides.get("add_generation_prompt") is not False, prefill)


def resolve_future(fut: asyncio.Future | None, exc: BaseException | None = None, value: Any = None) -> None:
    """Settle ``fut`` once (a later call, or one on a future its waiter cancelled, does nothing)."""
    if fut is None or fut.done():
        return
    if exc is None:
        fut.set_result(value)
    elif isinstance(exc, Exception):
        fut.set_exception(exc)
    else:
        fut.cancel()


def _cached(r: TurnResult) -> TurnResult:
    from dataclasses import replace

    return replace(r, cached=True, pod_wait_s=0.0)
