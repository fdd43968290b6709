"""Anthropic Messages wire: content blocks <-> canonical messages, answers and SSE event streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from services.gateway import sampling, surface, tool_choice
from services.gateway.chat import ChatModel, bad_request, canonical_tools, image_part, joined_parts, new_id
from services.gateway.core import TurnResult
from services.gateway.errors import GatewayError, error_body
from services.gateway.openai_wire import CHUNK_CHARS, check_prefill, response_format
from services.gateway.streaming import TextFeed

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""``output_config.effort``'s values; "high" is Anthropic's default, the same as leaving it out."""


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
        out.append(str(b.get("text") or ""))  # null: no text, never the word "None"
    return "".join(out)


def thinking_model(model: ChatModel, overrides: dict) -> ChatModel:
    """The model as ``thinking`` asks it to render, through the template's ``enable_thinking`` switch (Qwen3's)
    where it has one; without one, the template's own way is the only one: asking for the other is a 400.
    ``budget_tokens`` is checked as Anthropic checks it (>= 1024) and taken as the target it is there: the pod
    cannot cut a think block at it (vLLM does only with a reasoning parser), ``max_tokens`` bounds reasoning
    and answer together. ``adaptive`` (the model decides how much to think) is ``enabled`` without a budget.
    ``output_config.effort`` goes through ``_effort``."""
    spec = overrides.pop("thinking", None)
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None:
        return _effort(model, overrides)
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request(
            f'\'thinking\' must be {{"type": "enabled" | "adaptive" | "disabled"}}, got {str(spec)[:100]!a}'
        )
    if kind == "enabled":
        budget = spec.get("budget_tokens")
        if type(budget) is not int or budget < 1024:
            raise bad_request("'thinking.budget_tokens' must be an integer >= 1024", "thinking")
    on = kind != "disabled"
    if "enable_thinking" in model.template_variables:
        overrides["chat_template_kwargs"] = {**(overrides.get("chat_template_kwargs") or {}), "enable_thinking": on}
    elif on != model.thinks:
        raise bad_request(
            f"thinking {kind}: this model's chat template has no enable_thinking switch and "
            f"{'never' if on else 'always'} renders think blocks",
            "thinking",
        )
    return _effort(model, overrides)


def _effort(model: ChatModel, overrides: dict) -> ChatModel:
    """``output_config.effort`` through the template's ``reasoning_effort`` variable where it reads one, as vLLM
    takes OpenAI's ``reasoning_effort``. Effort is not thinking (``thinking`` switches that), so the template's
    ``enable_thinking`` is left alone. A template without the variable has one way, Anthropic's default: "high"
    is honoured as that default, any other value is a 400 naming it (it would be ignored)."""
    effort = overrides.pop("effort", None)
    if effort is not None and "reasoning_effort" in model.template_variables:
        overrides["chat_template_kwargs"] = {
            **(overrides.get("chat_template_kwargs") or {}),
            "reasoning_effort": effort,
        }
    elif effort not in (None, "high"):
        raise bad_request(
            f"output_config.effort {effort}: this model's chat template reads no reasoning_effort variable, so only "
            '"high" (the default, the same as leaving it out) is honoured',
            "output_config.effort",
        )
    return model.with_kwargs(overrides.get("chat_template_kwargs"))


def output_config(body: dict) -> tuple[dict | None, str | None, str]:
    """Structured outputs and effort: (the pod's ``structured_outputs`` or None, ``output_config.effort`` or None,
    the request's name for the format). The format is ``output_config.format`` or the beta's top-level
    ``output_format``, ``{"type": "json_schema", "schema": {...}}``, mapped as the OpenAI wire maps a
    ``json_schema`` response_format. Other ``output_config`` fields would be ignored: a 400 naming them."""
    config = body.get("output_config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise bad_request("'output_config' must be an object {format, effort}", "output_config")
    for key, value in config.items():
        if value is not None and key not in ("format", "effort"):
            param = f"output_config.{str(key)[:40]}"
            raise GatewayError(
                400,
                f"'{param}' is not supported by this gateway (it would be ignored): remove it",
                code="unsupported_parameter",
                param=param,
            )
    fmt, param = config.get("format"), "output_config.format"
    if body.get("output_format") is not None:
        if fmt is not None:
            raise bad_request(
                "'output_format' (the beta's name) and 'output_config.format' are one setting: send one of them",
                "output_format",
            )
        fmt, param = body["output_format"], "output_format"
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(
            f"'output_config.effort' must be one of {list(EFFORTS)}, got {str(effort)[:40]!a}", "output_config.effort"
        )
    if fmt is None:
        return None, effort, param
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            f'\'{param}\' must be {{"type": "json_schema", "schema": {{...}}}}, got {str(fmt)[:120]!a}', param
        )
    return response_format({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}, param), effort, param


def _result_blocks(content: Any, where: str) -> str | list[dict]:
    """A tool_result's content: text, or text and image blocks in their order (a tool that returns a
    screenshot), as the OpenAI wire's tool message carries them."""
    if not isinstance(content, list):
        return _text_blocks(content, where)
    parts: list[str | dict] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append(str(b.get("text") or ""))
        elif kind == "image":
            parts.append(_image_block(b.get("source"), f"{where}[{j}].source"))
        else:
            raise bad_request(f"{where}[{j}]: expected a text or image block, got {str(b)[:100]}", where)
    return joined_parts(parts)


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
    texts: list[str | dict] = []  # text, and image parts in their place
    calls: list[dict] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        bw = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(str(b.get("text") or ""))
        elif kind == "image" and role == "user":
            texts.append(_image_block(b.get("source"), bw + ".source"))
        elif kind == "tool_use" and role == "assistant":
            args = {} if b.get("input") is None else b["input"]  # null: no arguments, as absent
            if not isinstance(b.get("name"), str) or not isinstance(args, dict):
                raise bad_request(f"{bw}: tool_use needs 'id', 'name' and an object 'input'", bw)
            calls.append(
                {
                    "id": str(b.get("id") or ""),
                    "type": "function",
                    "function": {"name": b["name"], "arguments": _arguments(args)},
                }
            )
        elif kind == "tool_result" and role == "user":
            out.append(
                {
                    "role": "tool",
                    "content": _result_blocks(b.get("content"), bw + ".content"),
                    "tool_call_id": str(b.get("tool_use_id") or ""),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # reasoning is not rendered back (the template decides what earlier turns show)
        else:
            raise bad_request(
                f"{bw}: unsupported content block {kind!r} for role {role!r} (text, image, "
                "tool_use, tool_result are supported)",
                bw,
            )
    if role == "assistant":
        # image blocks are refused outside user turns, so every part here is text
        m: dict[str, Any] = {"role": "assistant", "content": "".join(t for t in texts if isinstance(t, str))}
        if calls:
            m["tool_calls"] = calls
        return [m]
    if texts or not out:
        out.append({"role": "user", "content": joined_parts(texts)})
    return out


def _image_block(source: Any, where: str) -> dict:
    """An image block's ``source``: base64 data only (``url`` sources would make the gateway fetch)."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else None
        hint = " (url sources need --gateway.fetch_images)" if kind == "url" else ""
        raise bad_request(
            f"{where}: image source type {kind!r} is not supported{hint}; send "
            "{'type': 'base64', 'media_type': 'image/png', 'data': ...}",
            where,
        )
    return image_part(source.get("data"), source.get("media_type"), where)


def parse_messages(body: dict) -> MessagesRequest:
    surface.check(body, "messages")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages: list[dict] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, m in enumerate(raw):
        messages.extend(_message(m, i))
    max_tokens = sampling.number(body, "max_tokens")
    if max_tokens is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    tools = body.get("tools")
    strict: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        conv = []
        for j, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise bad_request(f"tools[{j}]: expected a custom tool {{name, description, input_schema}}", "tools")
            if t.get("strict") is True:
                strict.add(t["name"])
            conv.append(
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t.get("description") or "",
                        "parameters": t.get("input_schema") or {},
                    },
                }
            )
        tools = canonical_tools(conv)
    if body.get("stop_sequences") is not None and not isinstance(body["stop_sequences"], list):
        raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
    overrides: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": sampling.number(body, "temperature"),
        "top_p": sampling.number(body, "top_p"),
        "top_k": sampling.number(body, "top_k"),
        "stop": sampling.stop(body, "stop_sequences"),
        "tool_choice": replace(tool_choice.from_anthropic(body.get("tool_choice")), strict=frozenset(strict)),
        "thinking": body.get("thinking"),
    }
    # tool_choice.apply combines the format with the tools as on the OpenAI wire (JSON or calls under "auto")
    overrides["structured_outputs"], overrides["effort"], format_param = output_config(body)
    if isinstance(raw[-1], dict) and raw[-1].get("role") == "assistant":
        # Anthropic's prefill: the reply continues the final assistant message (its content is the continuation).
        check_prefill(messages, tools, overrides, "messages", format_param)
        spec = overrides["thinking"]
        if isinstance(spec, dict) and spec.get("type") in ("enabled", "adaptive"):
            raise bad_request(
                "thinking cannot be enabled when the final message is the assistant's (a prefill): the reply "
                "continues that text instead of opening with a think block",
                "thinking",
            )
        overrides["continue_final_message"] = True
    return MessagesRequest(
        messages, tools, {k: v for k, v in overrides.items() if v is not None}, sampling.flag(body, "stream")
    )


# Anthropic's tool input is an object: arguments the model wrote as something else are wrapped in one under
# these keys, and unwrapped when the client sends the call back, so the next turn still extends the segment.
RAW_ARGS, VALUE_ARGS = "_raw", "_value"


def _input(arguments: str) -> dict:
    try:
        args = json.loads(arguments)
    except ValueError:
        return {RAW_ARGS: arguments}
    return args if isinstance(args, dict) else {VALUE_ARGS: args}


def _arguments(value: dict) -> str:
    if len(value) == 1 and isinstance(value.get(RAW_ARGS), str):
        return value[RAW_ARGS]
    if len(value) == 1 and VALUE_ARGS in value:
        return json.dumps(value[VALUE_ARGS], ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _blocks(r: TurnResult) -> list[dict]:
    blocks: list[dict] = [{"type": "thinking", "thinking": r.reasoning, "signature": ""}] if r.reasoning else []
    if r.content or not r.tool_calls:
        blocks.append({"type": "text", "text": r.content})
    for c in r.tool_calls:
        args = _input(c["function"]["arguments"])
        blocks.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"], "input": args})
    return blocks


def _head(model_name: str, input_tokens: int) -> dict:
    return {
        "id": "msg_" + new_id(),
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def stop_reason(r: TurnResult) -> str:
    """end_turn, max_tokens, tool_use, or stop_sequence when one of the request's ``stop_sequences`` ended it."""
    if r.stop_sequence is not None and r.finish_reason != "tool_calls":
        return "stop_sequence"
    return STOP.get(r.finish_reason, "end_turn")


def messages_response(r: TurnResult, model_name: str) -> dict:
    out = _head(model_name, r.prompt_tokens)
    out.update(
        content=_blocks(r),
        stop_reason=stop_reason(r),
        stop_sequence=r.stop_sequence,
        usage={"input_tokens": r.prompt_tokens, "output_tokens": len(r.token_ids)},
        policy_version=r.policy_version,
    )
    return out


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _text_delta(i: int, text: str) -> bytes:
    return _event(
        "content_block_delta",
        {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": text}},
    )


def _text_start(i: int) -> bytes:
    return _event(
        "content_block_start",
        {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
    )


def _thinking_start(i: int) -> bytes:
    block = {"type": "thinking", "thinking": "", "signature": ""}
    return _event("content_block_start", {"type": "content_block_start", "index": i, "content_block": block})


def _thinking_delta(i: int, text: str) -> bytes:
    return _event(
        "content_block_delta",
        {"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": text}},
    )


def _thinking_end(i: int) -> list[bytes]:
    """A thinking block's signature (empty: the gateway signs nothing, as the non-streamed block), then its stop:
    Anthropic ends every thinking block so."""
    return [
        _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": ""}},
        ),
        _event("content_block_stop", {"type": "content_block_stop", "index": i}),
    ]


async def messages_stream(
    task: asyncio.Future, input_tokens: int, model_name: str, state: Any, feed: TextFeed | None = None
) -> AsyncIterator[bytes]:
    """message_start at once, then the thinking block and the text block as the pod generates them (``feed``;
    without one, once the pod answered); what was held back (the rest of the thinking and the text, tool_use
    blocks) and the stop when the turn is done."""
    yield _event("message_start", {"type": "message_start", "message": _head(model_name, input_tokens)})
    first = 0  # the index of the text block: 1 after a thinking block
    thought, thinking, started = "", False, False  # thinking, started: the thinking, the text block is open
    if feed is not None:
        async for kind, piece in feed.parts():
            if kind == "reasoning":
                if piece and not started:  # the feed sends the whole block before any text
                    if not first:
                        yield _thinking_start(0)
                        first, thinking = 1, True
                    thought += piece
                    yield _thinking_delta(0, piece)
                continue
            if thinking:
                for ev in _thinking_end(0):
                    yield ev
                thinking = False
            if not started:
                yield _text_start(first)
                started = True
            yield _text_delta(first, piece)
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event, never hang
        err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}")
        yield _event("error", error_body(err, "anthropic"))
        return
    state.pod_wait_s = r.pod_wait_s
    blocks = _blocks(r)
    if blocks and blocks[0]["type"] == "thinking":
        # What of the block the feed held back: all of it without a feed, the end a length stop left open.
        text = blocks.pop(0)["thinking"]
        if not first:
            yield _thinking_start(0)
            first, thinking = 1, True
        rest = text[len(thought) :] if text.startswith(thought) else ""
        if rest and thinking:
            yield _thinking_delta(0, rest)
    if thinking:
        for ev in _thinking_end(0):
            yield ev
    if started and (not blocks or blocks[0]["type"] != "text"):
        blocks.insert(0, {"type": "text", "text": ""})  # text went out before the tool calls were known
    for i, b in enumerate(blocks, start=first):
        if b["type"] == "text":
            text = b["text"]
            if started:
                text = feed.rest(text) if feed is not None else text
            else:
                yield _text_start(i)
            for j in range(0, len(text), CHUNK_CHARS):
                yield _text_delta(i, text[j : j + CHUNK_CHARS])
        else:
            yield _event(
                "content_block_start", {"type": "content_block_start", "index": i, "content_block": {**b, "input": {}}}
            )
            yield _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)},
                },
            )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(r), "stop_sequence": r.stop_sequence},
            "usage": {"output_tokens": len(r.token_ids)},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})
