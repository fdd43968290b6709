"""OpenAI Responses wire (``POST /v1/responses``): input items <-> canonical messages, answers and SSE events.

A Responses request is a chat turn written as items: ``instructions`` is the system message, ``message``
items are messages, a ``function_call`` item is a tool call of the assistant message before it (the calls of
one reply follow its text), a ``function_call_output`` item is a tool result. The turn then goes through the
same captured chat turn as ``/chat/completions``, so a client that sends back the previous output items (as
openai-agents does) extends the session's segment token-exactly. State lives in the session, not in the
response: ``previous_response_id`` is refused (send the items).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.gateway import sampling, tool_choice
from services.gateway.chat import bad_request, canonical_messages, canonical_tools, new_id
from services.gateway.errors import GatewayError
from services.gateway.openai_wire import response_format
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
    }
)
INFORMATIONAL = frozenset(
    {"model", "store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "truncation"}
)
PARTLY = {
    "top_logprobs": (0, None),
    "include": ([], None),
    "reasoning": ({"effort": "none"}, {}, None),
}
"""Parameters honoured for these values only (anything else is refused by name)."""


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
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"), "content": item.get("content")})
            wheres.append((where, where + ".content"))
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = out[-1] if out else None
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
                f"{where}: unsupported item type {kind!r} (message, function_call and "
                "function_call_output are supported)",
                where,
            )
    return out, wheres


def parse_responses(body: dict) -> ResponsesRequest:
    for key, value in body.items():
        if key in HONOURED or key in INFORMATIONAL:
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
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise bad_request("'tools' must be a list of function tools {type: 'function', name, parameters}", "tools")
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
    fmt = (text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # flat here too
        fmt = {"type": "json_schema", "json_schema": fmt}
    overrides = {
        "max_tokens": sampling.number(body, "max_output_tokens", "max_tokens"),
        "temperature": sampling.number(body, "temperature"),
        "top_p": sampling.number(body, "top_p"),
        "structured_outputs": response_format(fmt, "text.format"),
        "tool_choice": tool_choice.from_openai(choice, body.get("parallel_tool_calls")),
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
    return ResponsesRequest(
        canonical_messages(messages, wheres),
        tools,
        {k: v for k, v in overrides.items() if v is not None},
        sampling.flag(body, "stream"),
        echo,
    )


def _output(r: TurnResult, text: str | None = None) -> list[dict]:
    items: list[dict] = []
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


def response_body(rid: str, req: ResponsesRequest, model_name: str, r: TurnResult | None) -> dict:
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
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        out["policy_version"] = r.policy_version
    return out


def _event(seq: list[int], name: str, data: dict) -> bytes:
    seq[0] += 1
    payload = {"type": name, "sequence_number": seq[0], **data}
    return f"event: {name}\ndata: ".encode() + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def responses_stream(
    task: asyncio.Future, req: ResponsesRequest, model_name: str, state: Any, feed: TextFeed | None
) -> AsyncIterator[bytes]:
    """response.created at once; the text as the pod generates it (``feed``); function calls and
    response.completed (the whole response, usage included) when the turn is done."""
    seq = [-1]
    rid = "resp_" + new_id()
    head = response_body(rid, req, model_name, None)
    yield _event(seq, "response.created", {"response": head})
    yield _event(seq, "response.in_progress", {"response": head})
    msg_id, sent, started = "msg_" + new_id(), "", False

    def start() -> list[bytes]:
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        return [
            _event(seq, "response.output_item.added", {"output_index": 0, "item": item}),
            _event(
                seq,
                "response.content_part.added",
                {
                    "item_id": msg_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                },
            ),
        ]

    def delta(text: str) -> bytes:
        return _event(
            seq,
            "response.output_text.delta",
            {"item_id": msg_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []},
        )

    if feed is not None:
        async for piece in feed.pieces():
            if not started:
                for ev in start():
                    yield ev
                started = True
            sent += piece
            yield delta(piece)
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event, never hang
        err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}")
        yield _event(seq, "error", {"code": err.code, "message": err.message, "param": err.param})
        return
    state.pod_wait_s = r.pod_wait_s
    final = response_body(rid, req, model_name, r)
    items = _output(r, r.content if not started else sent + (feed.rest(r.content) if feed is not None else ""))
    index = 0
    if items and items[0]["type"] == "message" or started:
        if items and items[0]["type"] == "message":
            text = items[0]["content"][0]["text"]
        else:
            text = sent
            items.insert(
                0,
                {
                    "type": "message",
                    "id": msg_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                },
            )
        items[0]["id"] = msg_id
        if not started:
            for ev in start():
                yield ev
        if text[len(sent) :]:
            yield delta(text[len(sent) :])
        yield _event(
            seq,
            "response.output_text.done",
            {"item_id": msg_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []},
        )
        yield _event(
            seq,
            "response.content_part.done",
            {"item_id": msg_id, "output_index": 0, "content_index": 0, "part": items[0]["content"][0]},
        )
        yield _event(seq, "response.output_item.done", {"output_index": 0, "item": items[0]})
        index = 1
    for i, item in enumerate(items[index:], start=index):
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
    final["output"] = items
    yield _event(
        seq, "response.completed" if final["status"] == "completed" else "response.incomplete", {"response": final}
    )
