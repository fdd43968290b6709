"""Thin HTTP handlers of the model-facing wires: OpenAI chat, completions and responses, Anthropic messages and
count_tokens, each served session-bound (``/s/{sid}/v1/...``, captured) and session-less (``/v1/...``).

routes.py keeps the session API, the ops endpoints and the request helpers (key check, body parsing, JSON
answers); ``WireHandlers`` reaches those through its ``Handlers``, and owns what only the wires need: SSE
answers and streamed turns run as their own tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from services.gateway import anthropic_wire as an
from services.gateway import openai_wire as oa
from services.gateway import responses_wire as rw
from services.gateway import sampling, surface, tool_choice
from services.gateway.chat import ChatModel, new_id
from services.gateway.core import TurnResult, render_request, resolve_future
from services.gateway.routes import Handlers, TurnJSON
from services.gateway.session import Session
from services.gateway.streaming import TextFeed

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def held_grammar(s: Session | None) -> dict | None:
    """The ``structured_outputs`` a session was opened with (None: none, or a session-less request)."""
    return s.sampling_params.get("structured_outputs") if s is not None else None


def first_attempt(request: Request) -> bool:
    """Whether the client numbers this request as its first attempt: the OpenAI and Anthropic SDKs send
    ``x-stainless-retry-count`` (0, then 1, 2, ... on their retries). An identical request on a first attempt is
    a new sample (dspy resamples so); a retry, or a client that does not say, gets the last answer again."""
    return request.headers.get("x-stainless-retry-count") == "0"


class WireHandlers:
    """The wire endpoints over ``h``'s gateway; auth, body parsing and plain JSON answers go through ``h``."""

    def __init__(self, h: Handlers) -> None:
        self.h = h
        self.gw = h.gw
        self.model_name = h.model_name
        self.reasoning_field = h.gw.settings.gateway.reasoning_field
        self.turns: set[asyncio.Task] = set()

    def start(self, turn: Callable[[asyncio.Future], Awaitable[TurnResult]]) -> tuple[asyncio.Future, asyncio.Future]:
        """Run a streamed turn as its own task, so a client that disconnects mid-stream (Starlette then cancels
        the stream) cannot abandon a generation whose answer an identical retry would get from the cache.

        Returns plain futures: ``ready`` (the turn was accepted; the stream sends its headers then) and ``done``
        (its result or error); a waiter cancelled on them leaves the task running.
        """
        loop = asyncio.get_running_loop()
        ready, done = loop.create_future(), loop.create_future()

        async def run() -> None:
            try:
                resolve_future(done, value=await turn(ready))
            except BaseException as exc:
                resolve_future(done, exc)
                if not isinstance(exc, Exception):
                    raise

        task = asyncio.ensure_future(run())
        self.turns.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self.turns.discard)
        for fut in (ready, done):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return ready, done

    def start_streamed(
        self, s: Session, messages: list[dict], tools: list[dict] | None, overrides: dict, fresh: bool = False
    ) -> tuple[TextFeed, asyncio.Future, asyncio.Future]:
        """A streamed chat turn (``start``) whose tokens reach its ``TextFeed`` as the pod generates them."""
        stop = overrides.get("stop") or s.sampling_params.get("stop")
        feed = TextFeed(self.gw.model, stop, tools=bool(tools), raw=s.replies == "raw")
        ready, done = self.start(
            lambda rd: self.gw.chat_turn(
                s, messages, tools, overrides, rd, feed.push, fresh=fresh, on_opened=feed.prompt_opened
            )
        )
        done.add_done_callback(feed.close)
        return feed, ready, done

    async def constrained(self, request: Request, owner: str | None, req: Any, model: ChatModel) -> Session | None:
        """The turn's session (None: a session-less request), and the request's tool choice turned into the pod's
        constraint over the grammar that session was opened with (``tool_choice.apply``)."""
        sid = request.path_params.get("sid")
        s = await self.gw.session(sid, owner) if sid is not None else None
        tool_choice.apply(model, req.messages, req.tools, req.overrides, held_grammar(s))
        return s

    # ---- OpenAI wire

    async def chat(self, request: Request) -> Response:
        owner = self.h.owner(request)
        req = oa.parse_chat(await self.h.body(request))
        model = oa.reasoning_model(self.gw.model, req.overrides)
        s = await self.constrained(request, owner, req, model)
        if s is None:
            results = await self.gw.plain_chat(model, req.messages, req.tools, req.overrides)
            request.scope["state"]["pod_wait_s"] = results[0].pod_wait_s
            if req.stream:
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(results[0])
                return StreamingResponse(
                    oa.chat_stream(
                        fut, req, self.gw.model, self.model_name, request.state, reasoning_field=self.reasoning_field
                    ),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                )
            body = oa.chat_response(results, req, self.gw.model, self.model_name, self.reasoning_field)
            return TurnJSON(body, results[0].policy_version)
        if req.stream:
            feed, ready, done = self.start_streamed(s, req.messages, req.tools, req.overrides, first_attempt(request))
            await ready
            return StreamingResponse(
                oa.chat_stream(done, req, self.gw.model, self.model_name, request.state, feed, self.reasoning_field),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        # Not streamed: the turn runs in this request's task (uvicorn does not cancel it when a client goes;
        # a cancellation could only land while waiting for the pod, before anything is committed). A separate
        # task cost a hop back here per turn, queued behind every other ready callback: when a pod answers a
        # batch of 64 at once, the last reply left only after all 64 turns had been committed.
        r = await self.gw.chat_turn(s, req.messages, req.tools, req.overrides, fresh=first_attempt(request))
        request.scope["state"]["pod_wait_s"] = r.pod_wait_s
        body = oa.chat_response([r], req, self.gw.model, self.model_name, self.reasoning_field)
        return TurnJSON(body, r.policy_version)

    async def completions(self, request: Request) -> Response:
        owner = self.h.owner(request)
        body = await self.h.body(request)
        surface.check(body, "completions")
        prompt = oa.parse_prompt(body)
        overrides = oa.sampling_overrides(body)
        stream, want_logprobs = sampling.flag(body, "stream"), oa.completion_logprobs(body)
        include_usage = oa.stream_usage(body)
        if want_logprobs:
            overrides["top_logprobs"] = want_logprobs
        echo = (
            ""
            if not oa.parse_echo(body)
            else prompt
            if isinstance(prompt, str)
            else self.gw.model.decode(prompt, skip_special=False)
        )
        sid = request.path_params.get("sid")
        if sid is None:
            ids = prompt if isinstance(prompt, list) else self.gw.model.encode(prompt)
            results = await self.gw.plain_generate(ids, overrides)
        else:
            s = await self.gw.session(sid, owner)
            results = [await self.gw.completion_turn(s, prompt, overrides)]
        request.scope["state"]["pod_wait_s"] = results[0].pod_wait_s
        if stream:
            return StreamingResponse(
                oa.completion_stream(results, self.gw.model, self.model_name, want_logprobs, echo, include_usage),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        return TurnJSON(
            oa.completion_response(results, self.gw.model, self.model_name, want_logprobs, echo),
            results[0].policy_version,
        )

    async def responses(self, request: Request) -> Response:
        """OpenAI Responses API: a chat turn written as items (responses_wire.py)."""
        owner = self.h.owner(request)
        req = rw.parse_responses(await self.h.body(request))
        model = rw.reasoning_model(self.gw.model, req.overrides)
        s = await self.constrained(request, owner, req, model)
        feed = None
        loop = asyncio.get_running_loop()
        if s is None:
            r = (await self.gw.plain_chat(model, req.messages, req.tools, req.overrides))[0]
            done = loop.create_future()
            done.set_result(r)
        else:
            if not req.stream:
                r = await self.gw.chat_turn(s, req.messages, req.tools, req.overrides, fresh=first_attempt(request))
                request.scope["state"]["pod_wait_s"] = r.pod_wait_s
                body = rw.response_body("resp_" + new_id(), req, model, self.model_name, r)
                return TurnJSON(body, r.policy_version)
            feed, ready, done = self.start_streamed(s, req.messages, req.tools, req.overrides, first_attempt(request))
            await ready
        if req.stream:
            return StreamingResponse(
                rw.responses_stream(done, req, model, self.model_name, request.state, feed),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        r = await done
        request.scope["state"]["pod_wait_s"] = r.pod_wait_s
        return TurnJSON(rw.response_body("resp_" + new_id(), req, model, self.model_name, r), r.policy_version)

    # ---- Anthropic wire

    async def messages(self, request: Request) -> Response:
        owner = self.h.owner(request)
        req = an.parse_messages(await self.h.body(request))
        model = an.thinking_model(self.gw.model, req.overrides)
        s = await self.constrained(request, owner, req, model)
        if s is None:
            r = (await self.gw.plain_chat(model, req.messages, req.tools, req.overrides))[0]
            ready, done = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
            feed = None
            ready.set_result(r.prompt_tokens)
            done.set_result(r)
        else:
            if not req.stream:  # in this task, as in chat()
                r = await self.gw.chat_turn(s, req.messages, req.tools, req.overrides, fresh=first_attempt(request))
                request.scope["state"]["pod_wait_s"] = r.pod_wait_s
                return TurnJSON(an.messages_response(r, self.model_name), r.policy_version)
            feed, ready, done = self.start_streamed(s, req.messages, req.tools, req.overrides, first_attempt(request))
        if req.stream:
            input_tokens = await ready
            return StreamingResponse(
                an.messages_stream(done, input_tokens, self.model_name, request.state, feed),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        r = await done
        request.scope["state"]["pod_wait_s"] = r.pod_wait_s
        return TurnJSON(an.messages_response(r, self.model_name), r.policy_version)

    async def count_tokens(self, request: Request) -> Response:
        self.h.owner(request)
        body = await self.h.body(request)
        # count_tokens takes no max_tokens; parse_messages needs one (a null one is absent, as elsewhere)
        req = an.parse_messages({**body, "max_tokens": 1 if body.get("max_tokens") is None else body["max_tokens"]})
        model = an.thinking_model(self.gw.model, req.overrides)
        ids = model.encode(render_request(model, req.messages, req.tools, req.overrides))
        return self.h.json({"input_tokens": len(ids)})


def wire_routes(w: WireHandlers) -> list[Route]:
    return [
        Route("/s/{sid}/v1/chat/completions", w.chat, methods=["POST"]),
        Route("/s/{sid}/v1/messages", w.messages, methods=["POST"]),
        Route("/s/{sid}/v1/completions", w.completions, methods=["POST"]),
        Route("/s/{sid}/v1/responses", w.responses, methods=["POST"]),
        Route("/v1/responses", w.responses, methods=["POST"]),
        Route("/s/{sid}/v1/messages/count_tokens", w.count_tokens, methods=["POST"]),
        Route("/v1/chat/completions", w.chat, methods=["POST"]),
        Route("/v1/completions", w.completions, methods=["POST"]),
        Route("/v1/messages", w.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", w.count_tokens, methods=["POST"]),
    ]
