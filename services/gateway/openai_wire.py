"""OpenAI wire: decode chat/completions requests, encode answers and synthesized SSE streams."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from services.gateway.chat import ChatModel, bad_request, canonical_messages, canonical_tools, new_id
from services.gateway.core import TurnResult
from services.gateway.errors import GatewayError, error_body

FINISH = {"stop", "length", "tool_calls", "content_filter", "function_call"}
CHUNK_CHARS = 32


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    overrides: dict
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    options: dict = field(default_factory=dict)


def _number(body: dict, key: str, kind: type = float, lo: float | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise bad_request(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    if lo is not None and v < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {v!r}", key)
    return v


def sampling_overrides(body: dict) -> dict:
    out: dict[str, Any] = {}
    max_tokens = _number(body, "max_completion_tokens", int, 1)
    out["max_tokens"] = max_tokens if max_tokens is not None else _number(body, "max_tokens", int, 1)
    out["temperature"] = _number(body, "temperature", float, 0)
    out["top_p"] = _number(body, "top_p", float, 0)
    out["top_k"] = _number(body, "top_k", int)
    out["seed"] = _number(body, "seed", int)
    out["n"] = _number(body, "n", int, 1)
    out["presence_penalty"] = _number(body, "presence_penalty")
    out["frequency_penalty"] = _number(body, "frequency_penalty")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be a string or a list of strings", "stop")
        out["stop"] = stop or None
    return {k: v for k, v in out.items() if v is not None}


def parse_chat(body: dict) -> ChatRequest:
    stream_opts = body.get("stream_options") or {}
    top = _number(body, "top_logprobs", int, 0) or 0
    return ChatRequest(
        messages=canonical_messages(body.get("messages")),
        tools=canonical_tools(body.get("tools")),
        overrides=sampling_overrides(body),
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(stream_opts, dict) and stream_opts.get("include_usage")),
        logprobs=bool(body.get("logprobs")),
        top_logprobs=top,
    )


def parse_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad_request("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _finish(r: TurnResult) -> str:
    return r.finish_reason if r.finish_reason in FINISH else "stop"


def _logprobs(model: ChatModel, r: TurnResult, top: int) -> dict:
    content = []
    for tok, lp in zip(r.token_ids, r.logprobs):
        s = model.decode([tok], skip_special=False)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode())}
        entry["top_logprobs"] = [dict(entry)] if top else []
        content.append(entry)
    return {"content": content}


def _usage(results: list[TurnResult]) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    prompt = results[0].prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(results: list[TurnResult], req: ChatRequest, model: ChatModel, model_name: str) -> dict:
    choices = []
    for i, r in enumerate(results):
        msg: dict[str, Any] = {"role": "assistant", "content": r.content if (r.content or not r.tool_calls) else None}
        if r.tool_calls:
            msg["tool_calls"] = r.tool_calls
        choices.append({"index": i, "message": msg, "finish_reason": _finish(r),
                        "logprobs": _logprobs(model, r, req.top_logprobs) if req.logprobs else None})
    return {"id": "chatcmpl-" + new_id(), "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(results),
            "system_fingerprint": f"molt-v{results[0].policy_version}", "policy_version": results[0].policy_version}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _error_event(exc: BaseException) -> bytes:
    err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}", "internal_error")
    return _sse(error_body(err, "openai")) + b"data: [DONE]\n\n"


async def chat_stream(task: asyncio.Future, req: ChatRequest, model: ChatModel, model_name: str,
                      state: Any) -> AsyncIterator[bytes]:
    """SSE synthesized from the completed turn: a role chunk at once, content once the pod answered."""
    base = {"id": "chatcmpl-" + new_id(), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model_name}
    yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]})
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # the stream has started: end it with an error event, never hang
        yield _error_event(exc)
        return
    state.pod_wait_s = r.pod_wait_s
    base["system_fingerprint"] = f"molt-v{r.policy_version}"
    lp = _logprobs(model, r, req.top_logprobs)["content"] if req.logprobs else None
    text = r.content
    for i in range(0, len(text), CHUNK_CHARS):
        yield _sse({**base, "choices": [{"index": 0, "delta": {"content": text[i:i + CHUNK_CHARS]},
                                         "logprobs": {"content": lp} if (lp is not None and i == 0) else None,
                                         "finish_reason": None}]})
    if r.tool_calls:
        calls = [{"index": j, **c} for j, c in enumerate(r.tool_calls)]
        yield _sse({**base, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})
    yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(r)}],
                "policy_version": r.policy_version})
    if req.include_usage:
        yield _sse({**base, "choices": [], "usage": _usage([r])})
    yield b"data: [DONE]\n\n"


def completion_response(results: list[TurnResult], model: ChatModel, model_name: str, want_logprobs: bool) -> dict:
    choices = []
    for i, r in enumerate(results):
        lp = None
        if want_logprobs:
            toks = [model.decode([t], skip_special=False) for t in r.token_ids]
            lp = {"tokens": toks, "token_logprobs": r.logprobs,
                  "top_logprobs": [{t: x} for t, x in zip(toks, r.logprobs)], "text_offset": []}
        choices.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": _finish(r)})
    return {"id": "cmpl-" + new_id(), "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(results),
            "policy_version": results[0].policy_version}


async def completion_stream(results: list[TurnResult], model_name: str) -> AsyncIterator[bytes]:
    base = {"id": "cmpl-" + new_id(), "object": "text_completion", "created": int(time.time()),
            "model": model_name}
    for i, r in enumerate(results):
        for j in range(0, len(r.text), CHUNK_CHARS):
            yield _sse({**base, "choices": [{"index": i, "text": r.text[j:j + CHUNK_CHARS], "logprobs": None,
                                             "finish_reason": None}]})
        yield _sse({**base, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": _finish(r)}]})
    yield b"data: [DONE]\n\n"


def models_response(model_name: str) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "molt"}]}
