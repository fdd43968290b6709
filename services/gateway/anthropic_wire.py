"""Anthropic Messages wire: content blocks <-> canonical messages, answers and SSE event streams."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from services.gateway.chat import bad_request, canonical_tools, new_id
from services.gateway.core import TurnResult
from services.gateway.errors import GatewayError, error_body
from services.gateway.openai_wire import CHUNK_CHARS, _number

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessagesRequest:
    messages: list[dict]
    tools: list[dict] | None
    overrides: dict
    stream: bool = False


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content blocks", where)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad_request(f"{where}[{j}]: expected a text block, got {str(b)[:100]}", where)
        out.append(str(b.get("text", "")))
    return "".join(out)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _message(msg: Any, i: int) -> list[dict]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}: each message needs role 'user' or 'assistant' and content", where)
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of content blocks", where)
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        bw = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{bw}: tool_use needs 'id', 'name' and an object 'input'", bw)
            calls.append({"id": str(b.get("id") or ""), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                                                  ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "content": _text_blocks(b.get("content"), bw + ".content"),
                        "tool_call_id": str(b.get("tool_use_id") or "")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # reasoning is not rendered back (the template decides what earlier turns show)
        else:
            raise bad_request(f"{bw}: unsupported content block {kind!r} for role {role!r} (text, tool_use, "
                              "tool_result are supported)", bw)
    if role == "assistant":
        m: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            m["tool_calls"] = calls
        return [m]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def parse_messages(body: dict) -> MessagesRequest:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages: list[dict] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, m in enumerate(raw):
        messages.extend(_message(m, i))
    max_tokens = _number(body, "max_tokens", int, 1)
    if max_tokens is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        conv = []
        for j, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise bad_request(f"tools[{j}]: expected a custom tool {{name, description, input_schema}}", "tools")
            conv.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema") or {}}})
        tools = canonical_tools(conv)
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
    overrides = {"max_tokens": max_tokens, "temperature": _number(body, "temperature", float, 0),
                 "top_p": _number(body, "top_p", float, 0), "top_k": _number(body, "top_k", int),
                 "stop": stop or None}
    return MessagesRequest(messages, tools, {k: v for k, v in overrides.items() if v is not None},
                           bool(body.get("stream")))


def _blocks(r: TurnResult) -> list[dict]:
    blocks: list[dict] = []
    if r.content or not r.tool_calls:
        blocks.append({"type": "text", "text": r.content})
    for c in r.tool_calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {"_raw": c["function"]["arguments"]}
        if not isinstance(args, dict):
            args = {"value": args}
        blocks.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"], "input": args})
    return blocks


def _head(model_name: str, input_tokens: int) -> dict:
    return {"id": "msg_" + new_id(), "type": "message", "role": "assistant", "model": model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def messages_response(r: TurnResult, model_name: str) -> dict:
    out = _head(model_name, r.prompt_tokens)
    out.update(content=_blocks(r), stop_reason=STOP.get(r.finish_reason, "end_turn"),
               usage={"input_tokens": r.prompt_tokens, "output_tokens": len(r.token_ids)},
               policy_version=r.policy_version)
    return out


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def messages_stream(task: asyncio.Future, input_tokens: int, model_name: str,
                          state: Any) -> AsyncIterator[bytes]:
    yield _event("message_start", {"type": "message_start", "message": _head(model_name, input_tokens)})
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # the stream has started: end it with an error event, never hang
        err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}")
        yield _event("error", error_body(err, "anthropic"))
        return
    state.pod_wait_s = r.pod_wait_s
    for i, b in enumerate(_blocks(r)):
        if b["type"] == "text":
            yield _event("content_block_start", {"type": "content_block_start", "index": i,
                                                 "content_block": {"type": "text", "text": ""}})
            for j in range(0, len(b["text"]), CHUNK_CHARS):
                yield _event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "text_delta", "text": b["text"][j:j + CHUNK_CHARS]}})
        else:
            yield _event("content_block_start", {"type": "content_block_start", "index": i,
                                                 "content_block": {**b, "input": {}}})
            yield _event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield _event("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": STOP.get(r.finish_reason, "end_turn"), "stop_sequence": None},
        "usage": {"output_tokens": len(r.token_ids)}})
    yield _event("message_stop", {"type": "message_stop"})
