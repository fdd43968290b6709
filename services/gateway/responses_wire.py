"""OpenAI Responses wire (``POST /v1/responses``): input items <-> canonical messages, answers and SSE events.

A Responses request is a chat turn written as items: ``instructions`` is the system message, ``message``
items are messages, a ``function_call`` item is a tool call of the assistant message before it (the calls of
one reply follow its text), a ``function_call_output`` item is a tool result. The turn then goes through the
same captured chat turn as ``/chat/completions``, so a client that sends back the previous output items (as
openai-agents does) extends the session's segment token-exactly. State lives in the session, not in the
response: ``previous_response_id`` is refused (send the items). With a template that thinks, the reply's think
block is a ``reasoning`` item before the message (vLLM's and OpenAI's shape); one sent back is not rendered (the
template decides what earlier turns show), as the chat wire drops ``reasoning_content``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from services.gateway import openai_wire as oa
from services.gateway import sampling, tool_choice
from services.gateway.chat import ChatModel, bad_request, canonical_messages, canonical_tools, new_id
from services.gateway.errors import GatewayError
from services.gateway.session import TurnResult
from services.gateway.streaming import TextFeed

HONOURED = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
    }
)
INFORMATIONAL = frozenset(
    {"model", "store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "truncation"}
)
PARTLY = {
    "top_logprobs": (0, None),
    "include": ([], None),
}
"""Parameters honoured for these values only (anything else is refused by name)."""
REASONING = {
    "effort": None,
    "summary": (None,),
    "generate_summary": (None,),
    "context": (None, "auto"),
    "mode": (None,),
}
"""``reasoning``'s fields: ``effort`` as chat's ``reasoning_effort``; the others for these values only (a summary
would need a second generation; ``context`` "auto" is the template's own way)."""


@dataclass
class ResponsesRequest:
    messages: list[dict]
    tools: list[dict] | None
    overrides: dict
    stream: bool
    echo: dict  # request fields the response repeats


def _items(raw: Any) -> tuple[list[dict], list[tuple[str, str]]]:
    """Chat messages (content as sent: ``canonical_messages`` reads the parts) and where each came from."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], [("input", "input")]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    wheres: list[tuple[str, str]] = []
    turn = 0  # a reasoning item opens an assistant turn: its function calls are not the message's before it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = (item.get("type") or "message") if isinstance(item, dict) else None  # null: absent
        if kind == "reasoning":
            turn = len(out)
        elif kind == "message":
            out.append({"role": item.get("role"), "content": item.get("content")})
            wheres.append((where, where + ".content"))
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = out[-1] if len(out) > turn else None
            if last is not None and last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                wheres.append((where, where))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": item.get("output")})
            wheres.append((where, where + ".output"))
        else:
            raise bad_request(
                f"{where}: unsupported item type {kind!r} (message, reasoning, function_call and "
                "function_call_output are supported)",
                where,
            )
    if not out:
        raise bad_request("'input' holds no message, function_call or function_call_output item", "input")
    return out, wheres


def _fields(value: Any, name: str, allowed: dict) -> dict:
    """An object parameter whose fields are honoured for some values only: the others refused by name."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object", name)
    for key, v in value.items():
        param = f"{name}.{str(key)[:40]}"
        if v is None:  # null is absent, as OpenAI reads it: it asks for nothing
            continue
        if key not in allowed:
            raise GatewayError(
                400,
                f"'{param}' is not supported on /v1/responses by this gateway: remove it",
                code="unsupported_parameter",
                param=param,
            )
        if allowed[key] is not None and v not in allowed[key]:
            raise GatewayError(
                400,
                f"'{param}' is not supported by this gateway (it would be ignored), got {str(v)[:80]!a}: remove it",
                code="unsupported_parameter",
                param=param,
            )
    return value


def reasoning_model(model: ChatModel, overrides: dict) -> ChatModel:
    """``reasoning.effort`` rendered as chat's ``reasoning_effort`` is (openai_wire.reasoning_model), its
    errors naming the Responses parameter."""
    try:
        return oa.reasoning_model(model, overrides)
    except GatewayError as exc:
        if exc.param != "reasoning_effort":
            raise
        raise bad_request(exc.message.replace("reasoning_effort", "reasoning.effort", 1), "reasoning.effort") from None


def parse_responses(body: dict) -> ResponsesRequest:
    for key, value in body.items():
        if value is None or key in HONOURED or key in INFORMATIONAL:  # null is absent, as OpenAI reads it
            continue
        if key not in PARTLY:
            raise GatewayError(
                400,
                f"'{str(key)[:80]}' is not supported on /v1/responses by this gateway: remove it",
                code="unsupported_parameter",
                param=str(key)[:80],
            )
        if value is not None and value not in PARTLY[key]:
            raise GatewayError(
                400,
                f"'{key}' is honoured for {PARTLY[key][0]!r} only, got {str(value)[:120]}",
                code="unsupported_parameter",
                param=key,
            )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    messages, wheres = _items(body.get("input"))
    if instructions:
        messages, wheres = (
            [{"role": "system", "content": instructions}, *messages],
            [("instructions", "instructions"), *wheres],
        )
    tools = body.get("tools")
    strict: frozenset[str] = frozenset()
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise bad_request("'tools' must be a list of function tools {type: 'function', name, parameters}", "tools")
        strict = frozenset(t["name"] for t in tools if t.get("strict") is True and isinstance(t.get("name"), str))
        tools = canonical_tools(
            [
                {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in tools
            ]
        )
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # the Responses wire names it flat
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("'text' must be an object {format: ...}", "text")
    _fields(text, "text", {"format": None, "verbosity": (None,)})  # verbosity: no template reads it
    reasoning = _fields(body.get("reasoning"), "reasoning", REASONING)
    fmt = (text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # flat here too
        fmt = {"type": "json_schema", "json_schema": fmt}
    overrides = {
        "max_tokens": sampling.number(body, "max_output_tokens", "max_tokens"),
        "temperature": sampling.number(body, "temperature"),
        "top_p": sampling.number(body, "top_p"),
        "structured_outputs": oa.response_format(fmt, "text.format"),
        "tool_choice": replace(tool_choice.from_openai(choice, body.get("parallel_tool_calls")), strict=strict),
        "reasoning_effort": reasoning.get("effort"),  # reasoning_model resolves it against the template
    }
    echo = {
        k: body.get(k)
        for k in ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "text")
        if k != "text" or text is not None
    }
    for k in ("tool_choice", "parallel_tool_calls"):
        if body.get(k) is not None:
            echo[k] = body[k]
    echo["tools"] = body.get("tools") or []
    if reasoning.get("effort") is not None:
        echo["reasoning"] = {"effort": reasoning["effort"], "summary": None}
    return ResponsesRequest(
        canonical_messages(messages, wheres),
        tools,
        {k: v for k, v in overrides.items() if v is not None},
        sampling.flag(body, "stream"),
        echo,
    )


def _reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": rid or "rs_" + new_id(),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _output(r: TurnResult, text: str | None = None) -> list[dict]:
    items: list[dict] = [_reasoning_item(r.reasoning)] if r.reasoning else []
    content = r.content if text is None else text
    if content or not r.tool_calls:
        items.append(
            {
                "type": "message",
                "id": "msg_" + new_id(),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
    for c in r.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + new_id(),
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def reasoning_tokens(model: ChatModel, r: TurnResult) -> int:
    """The reply's tokens up to its think block's end tag (all of them for a block a length stop left open)."""
    if not r.reasoning:
        return 0
    ids = r.token_ids
    if "</think>" not in r.raw_text:
        return len(ids)
    end = model.encode("</think>")
    if len(end) == 1 and end[0] in ids:
        return ids.index(end[0]) + 1
    lo, hi = 1, len(ids)  # the tag spans tokens: the shortest prefix whose text holds it
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if "</think>" in model.decode(ids[:mid], skip_special=False) else (mid + 1, hi)
    return lo


def response_body(rid: str, req: ResponsesRequest, model: ChatModel, model_name: str, r: TurnResult | None) -> dict:
    """The response object; ``r`` None: still in progress (the first streamed event)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model_name,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        **req.echo,
        "usage": None,
    }
    if r is not None:
        out["output"] = _output(r)
        out["status"] = "incomplete" if r.finish_reason == "length" else "completed"
        if r.finish_reason == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = {
            "input_tokens": r.prompt_tokens,
            "output_tokens": len(r.token_ids),
            "total_tokens": r.prompt_tokens + len(r.token_ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(model, r)},
        }
        out["policy_version"] = r.policy_version
    return out


def _event(seq: list[int], name: str, data: dict) -> bytes:
    seq[0] += 1
    payload = {"type": name, "sequence_number": seq[0], **data}
    return f"event: {name}\ndata: ".encode() + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _reasoning_done(seq: list[int], index: int, item: dict) -> list[bytes]:
    """A reasoning item's closing events, once its deltas are out."""
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        _event(seq, "response.reasoning_text.done", {**where, "text": item["content"][0]["text"]}),
        _event(seq, "response.content_part.done", {**where, "part": item["content"][0]}),
        _event(seq, "response.output_item.done", {"output_index": index, "item": item}),
    ]


async def responses_stream(
    task: asyncio.Future,
    req: ResponsesRequest,
    model: ChatModel,
    model_name: str,
    state: Any,
    feed: TextFeed | None,
) -> AsyncIterator[bytes]:
    """response.created at once; the reasoning item's text, then the message's, as the pod generates them
    (``feed``), the reasoning item done before the message opens (OpenAI's order); function calls and
    response.completed (the whole response, usage included) when the turn is done."""
    seq = [-1]
    rid = "resp_" + new_id()
    head = response_body(rid, req, model, model_name, None)
    yield _event(seq, "response.created", {"response": head})
    yield _event(seq, "response.in_progress", {"response": head})
    sent_items: list[dict] = []  # the items whose events are out, in output_index order
    msg_id, sent, at = "msg_" + new_id(), "", -1  # at: the message's output index once its item is open
    think_id, thought, think_at, thinking = "rs_" + new_id(), "", -1, False  # the reasoning item's, likewise

    def start() -> list[bytes]:
        nonlocal at
        at = len(sent_items)
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        sent_items.append(item)
        return [
            _event(seq, "response.output_item.added", {"output_index": at, "item": item}),
            _event(
                seq,
                "response.content_part.added",
                {
                    "item_id": msg_id,
                    "output_index": at,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                },
            ),
        ]

    def delta(text: str) -> bytes:
        return _event(
            seq,
            "response.output_text.delta",
            {"item_id": msg_id, "output_index": at, "content_index": 0, "delta": text, "logprobs": []},
        )

    def think(piece: str) -> list[bytes]:
        """The reasoning item's next delta (opening the item first)."""
        nonlocal think_at, thought, thinking
        opens = think_at < 0
        if opens:
            think_at, thinking = len(sent_items), True
            sent_items.append({**_reasoning_item("", think_id, "in_progress"), "content": []})
        where = {"item_id": think_id, "output_index": think_at, "content_index": 0}
        out = []
        if opens:  # the item, and its one content part
            out.append(_event(seq, "response.output_item.added", {"output_index": think_at, "item": sent_items[-1]}))
            part = {"type": "reasoning_text", "text": ""}
            out.append(_event(seq, "response.content_part.added", {**where, "part": part}))
        thought += piece
        out.append(_event(seq, "response.reasoning_text.delta", {**where, "delta": piece}))
        return out

    def thought_done() -> list[bytes]:
        nonlocal thinking
        thinking = False
        sent_items[think_at] = _reasoning_item(thought, think_id)
        return _reasoning_done(seq, think_at, sent_items[think_at])

    if feed is not None:
        async for kind, piece in feed.parts():
            if kind == "reasoning":
                if at < 0 and piece:  # the feed sends the whole block before any text
                    for ev in think(piece):
                        yield ev
                if at < 0 and thinking and feed.reasoning:  # the block has closed
                    for ev in thought_done():
                        yield ev
                continue
            if thinking:
                for ev in thought_done():
                    yield ev
            if at < 0:
                for ev in start():
                    yield ev
            sent += piece
            yield delta(piece)
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event, never hang
        err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}")
        yield _event(seq, "error", {"code": err.code, "message": err.message, "param": err.param})
        return
    state.pod_wait_s = r.pod_wait_s
    final = response_body(rid, req, model, model_name, r)
    items = _output(r, r.content if at < 0 else sent + (feed.rest(r.content) if feed is not None else ""))
    reasoning = [i["content"][0]["text"] for i in items if i["type"] == "reasoning"]
    message = [i for i in items if i["type"] == "message"]
    # The rest of the reasoning: all of it where none streamed, the end of a block a length stop left open.
    rest = reasoning[0][len(thought) :] if reasoning and reasoning[0].startswith(thought) else ""
    if rest and (thinking or think_at < 0):
        for ev in think(rest):
            yield ev
    if thinking:
        for ev in thought_done():
            yield ev
    if message or at >= 0:
        text = message[0]["content"][0]["text"] if message else sent
        if at < 0:
            for ev in start():
                yield ev
        if text[len(sent) :]:
            yield delta(text[len(sent) :])
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        where = {"item_id": msg_id, "output_index": at, "content_index": 0}
        yield _event(seq, "response.output_text.done", {**where, "text": text, "logprobs": []})
        yield _event(seq, "response.content_part.done", {**where, "part": part})
        sent_items[at] = {**sent_items[at], "status": "completed", "content": [part]}
        yield _event(seq, "response.output_item.done", {"output_index": at, "item": sent_items[at]})
    for item in (i for i in items if i["type"] == "function_call"):
        i = len(sent_items)
        sent_items.append(item)
        yield _event(
            seq,
            "response.output_item.added",
            {"output_index": i, "item": {**item, "arguments": "", "status": "in_progress"}},
        )
        yield _event(
            seq,
            "response.function_call_arguments.delta",
            {"item_id": item["id"], "output_index": i, "delta": item["arguments"]},
        )
        yield _event(
            seq,
            "response.function_call_arguments.done",
            {"item_id": item["id"], "output_index": i, "arguments": item["arguments"]},
        )
        yield _event(seq, "response.output_item.done", {"output_index": i, "item": item})
    final["output"] = sent_items
    yield _event(
        seq, "response.completed" if final["status"] == "completed" else "response.incomplete", {"response": final}
    )
