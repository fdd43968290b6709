"""OpenAI wire: decode chat/completions requests, encode answers and synthesized SSE streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway import sampling, surface, tool_choice
from services.gateway.chat import ChatModel, bad_request, canonical_messages, canonical_tools, new_id
from services.gateway.core import TurnResult
from services.gateway.errors import GatewayError, error_body
from services.gateway.streaming import TextFeed

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


def sampling_overrides(body: dict) -> dict:
    """The sampling fields of a chat or completions body, each checked against vLLM's range (a 400 naming it)."""
    out: dict[str, Any] = {}
    max_tokens = sampling.number(body, "max_completion_tokens", "max_tokens")
    out["max_tokens"] = max_tokens if max_tokens is not None else sampling.number(body, "max_tokens")
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        out[key] = sampling.number(body, key)
    out["stop"] = sampling.stop(body)
    out["min_tokens"] = sampling.number(body, "min_tokens")
    out["ignore_eos"] = sampling.flag(body, "ignore_eos") if body.get("ignore_eos") is not None else None
    if body.get("logit_bias") is not None:
        out["logit_bias"] = sampling.logit_bias(body)
    if body.get("structured_outputs") is not None:  # vLLM's own field (an SDK's extra_body), as its server takes it
        out["structured_outputs"] = sampling.structured(body)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        out["stop_token_ids"] = ids
    return {k: v for k, v in out.items() if v is not None}


def parse_chat(body: dict) -> ChatRequest:
    surface.check(body, "chat")
    include_usage = stream_usage(body)
    logprobs, top = sampling.flag(body, "logprobs"), sampling.top_logprobs(body)
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    overrides = sampling_overrides(body)
    if top:
        overrides["top_logprobs"] = top
    structured = response_format(body.get("response_format"))
    if structured is not None:
        if overrides.get("structured_outputs") is not None:
            raise bad_request(
                "'response_format' and 'structured_outputs' both constrain the reply: send one", "structured_outputs"
            )
        overrides["structured_outputs"] = structured
    overrides["tool_choice"] = tool_choice.from_openai(body.get("tool_choice"), body.get("parallel_tool_calls"))
    if body.get("chat_template_kwargs") is not None:
        overrides["chat_template_kwargs"] = body["chat_template_kwargs"]  # checked against the template's variables
    if body.get("reasoning_effort") is not None:
        overrides["reasoning_effort"] = body["reasoning_effort"]  # reasoning_model resolves it against the template
    stream = sampling.flag(body, "stream")
    if stream and overrides.get("n", 1) > 1:
        raise bad_request("'n' > 1 is not streamed: drop 'stream', or ask for one choice per request", "n")
    messages, tools = canonical_messages(body.get("messages")), canonical_tools(body.get("tools"))
    continued = sampling.flag(body, "continue_final_message")
    generation_prompt = body.get("add_generation_prompt") is None or sampling.flag(body, "add_generation_prompt")
    if continued:
        if generation_prompt:  # as vLLM (and HF's template call) refuse both; add_generation_prompt defaults on
            raise bad_request(
                "'continue_final_message' continues the final message and 'add_generation_prompt' opens a new "
                'one: send "add_generation_prompt": false with it (it defaults to true)',
                "continue_final_message",
            )
        fmt = "response_format" if body.get("response_format") is not None else "structured_outputs"
        check_prefill(messages, tools, overrides, "continue_final_message", fmt)
        overrides["continue_final_message"] = True
    if not generation_prompt:
        overrides["add_generation_prompt"] = False
    return ChatRequest(
        messages=messages,
        tools=tools,
        overrides=overrides,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top,
    )


def check_prefill(
    messages: list[dict], tools: list[dict] | None, overrides: dict, param: str, format_param: str = "response_format"
) -> None:
    """A request that continues its final message (a prefill; ``param`` names the request's field for it): that
    message must be the assistant's text. A grammar (a JSON response format, named ``format_param`` in the
    request; a tool choice that constrains the reply) would constrain the continuation alone, not prefill +
    continuation: a 400 naming it."""
    last = messages[-1]
    if last["role"] != "assistant":
        raise bad_request(
            f"'{param}': the final message is continued, so it must be the assistant's; it is the {last['role']}'s",
            param,
        )
    if last.get("tool_calls") or not isinstance(last["content"], str):
        raise bad_request(
            f"'{param}': the final assistant message is continued (a prefill), so it must be text only, without "
            "tool calls",
            param,
        )
    choice = overrides.get("tool_choice")
    if choice is not None and choice.constrains(tools):
        raise bad_request(
            "a 'tool_choice' that constrains the reply (required, a named tool, none, or auto without parallel "
            "calls) cannot continue a final assistant message (a prefill): it would constrain the continuation "
            "alone",
            "tool_choice",
        )
    if overrides.get("structured_outputs") is not None:
        raise bad_request(
            f"a structured '{format_param}' cannot continue a final assistant message (a prefill): it would "
            "constrain the continuation alone",
            format_param,
        )


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_model(model: ChatModel, overrides: dict) -> ChatModel:
    """The model as the request's ``reasoning_effort`` asks it to render, as vLLM's server takes it: the template's
    ``reasoning_effort`` variable where it reads one, and its ``enable_thinking`` switch (off for "none" only)
    where it has one and ``chat_template_kwargs`` leave it unset. A template with neither renders one way:
    asking for the other is a 400 naming the parameter (OpenAI refuses it for a model that does not reason)."""
    effort = overrides.pop("reasoning_effort", None)
    kwargs = overrides.get("chat_template_kwargs")
    if effort is None:
        return model.with_kwargs(kwargs)
    if effort not in EFFORTS:
        raise bad_request(
            f"'reasoning_effort' must be one of {list(EFFORTS)}, got {str(effort)[:40]!a}", "reasoning_effort"
        )
    reads = model.template_variables
    on = effort != "none"
    if not {"reasoning_effort", "enable_thinking"} & reads and on != model.thinks:
        raise bad_request(
            f"reasoning_effort {effort}: this model's chat template reads neither reasoning_effort nor "
            f"enable_thinking and {'never' if on else 'always'} renders think blocks",
            "reasoning_effort",
        )
    added: dict[str, Any] = {}
    if "reasoning_effort" in reads:
        added["reasoning_effort"] = effort
    if "enable_thinking" in reads and not (isinstance(kwargs, dict) and "enable_thinking" in kwargs):
        added["enable_thinking"] = on
    if added:
        overrides["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), **added}
    return model.with_kwargs(overrides.get("chat_template_kwargs"))


def response_format(fmt: Any, param: str = "response_format") -> dict | None:
    """``response_format`` as the pod's ``structured_outputs`` (None: plain text). A JSON schema is the pod's to
    compile: one it cannot is a 400 from there."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    # a null schema is an absent one (SDK models serialise unset fields as null): any object
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema") or {}, dict):
        return {"json": spec.get("schema") or {"type": "object"}}
    raise bad_request(
        f'\'{param}\' must be {{"type": "text" | "json_object"}} or {{"type": "json_schema", '
        f'"json_schema": {{"name", "schema"}}}}, got {str(fmt)[:120]!a}',
        param,
    )


def completion_logprobs(body: dict) -> int | None:
    """A completions body's ``logprobs``: how many top alternatives per token, 0..20 (None: no logprobs; a bool
    is read as none or 1)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return 1
    return sampling.number(body, "logprobs", sampling.Rule(True, 0, sampling.MAX_TOP_LOGPROBS))


def parse_echo(body: dict) -> bool:
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request(f"'echo' must be a boolean, got {echo!r}", "echo")
    if echo and body.get("logprobs") not in (None, False):
        raise bad_request(
            "'echo' with 'logprobs' is not supported (the prompt's logprobs are not computed): drop one of them",
            "echo",
        )
    return bool(echo)


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


def _entry(model: ChatModel, tok: int, lp: float) -> dict:
    s = model.decode([tok], skip_special=False)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def _logprobs(model: ChatModel, r: TurnResult, top: int) -> dict:
    """Each token's logprob, and its ``top`` most likely alternatives as the pod ranked them."""
    content = []
    alternatives = r.top_logprobs or []
    for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        entry = _entry(model, tok, lp)
        best = alternatives[i] if top and i < len(alternatives) else []
        entry["top_logprobs"] = [_entry(model, t, x) for t, x in best[:top]]
        content.append(entry)
    return {"content": content}


def _usage(results: list[TurnResult]) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    prompt = results[0].prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(
    results: list[TurnResult],
    req: ChatRequest,
    model: ChatModel,
    model_name: str,
    reasoning_field: str = "reasoning_content",
) -> dict:
    """``reasoning_field``: the message's field for the think block (``--gateway.reasoning_field``)."""
    choices = []
    for i, r in enumerate(results):
        msg: dict[str, Any] = {"role": "assistant", "content": r.content if (r.content or not r.tool_calls) else None}
        if r.reasoning:
            msg[reasoning_field] = r.reasoning
        if r.tool_calls:
            msg["tool_calls"] = r.tool_calls
        choices.append(
            {
                "index": i,
                "message": msg,
                "finish_reason": _finish(r),
                "logprobs": _logprobs(model, r, req.top_logprobs) if req.logprobs else None,
            }
        )
    return {
        "id": "chatcmpl-" + new_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(results),
        "system_fingerprint": f"molt-v{results[0].policy_version}",
        "policy_version": results[0].policy_version,
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _error_event(exc: BaseException) -> bytes:
    err = exc if isinstance(exc, GatewayError) else GatewayError(502, f"generation failed: {exc}", "internal_error")
    return _sse(error_body(err, "openai")) + b"data: [DONE]\n\n"


async def chat_stream(
    task: asyncio.Future,
    req: ChatRequest,
    model: ChatModel,
    model_name: str,
    state: Any,
    feed: TextFeed | None = None,
    reasoning_field: str = "reasoning_content",
) -> AsyncIterator[bytes]:
    """SSE: a role chunk at once, then the reasoning (deltas in ``reasoning_field``, the non-streamed message's
    field) and the content as the pod generates them (``feed``; without one, once the pod answered), the rest
    (held-back text and reasoning, tool calls, logprobs) and the finish when the turn is done."""
    base = {
        "id": "chatcmpl-" + new_id(),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model_name,
    }
    yield _sse(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    )
    thought = ""  # the reasoning sent so far
    if feed is not None:
        async for kind, piece in feed.parts():
            if not piece:
                continue
            if kind == "reasoning":
                thought += piece
            name = reasoning_field if kind == "reasoning" else "content"
            yield _sse({**base, "choices": [{"index": 0, "delta": {name: piece}, "finish_reason": None}]})
    try:
        r: TurnResult = await asyncio.shield(task)
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event, never hang
        yield _error_event(exc)
        return
    state.pod_wait_s = r.pod_wait_s
    base["system_fingerprint"] = f"molt-v{r.policy_version}"
    lp = _logprobs(model, r, req.top_logprobs)["content"] if req.logprobs else None
    text = feed.rest(r.content) if feed is not None else r.content
    # What of the reasoning the feed held back: all of it without a feed, the end of a block a length stop left
    # open (the feed holds a tag's possible start). The feed sends the whole block before any text.
    rest = r.reasoning[len(thought) :] if r.reasoning.startswith(thought) else ""
    if rest:
        yield _sse({**base, "choices": [{"index": 0, "delta": {reasoning_field: rest}, "finish_reason": None}]})
    if lp is not None and not text:
        yield _sse(
            {**base, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": lp}, "finish_reason": None}]}
        )
    for i in range(0, len(text), CHUNK_CHARS):
        yield _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": text[i : i + CHUNK_CHARS]},
                        "logprobs": {"content": lp} if (lp is not None and i == 0) else None,
                        "finish_reason": None,
                    }
                ],
            }
        )
    # One call per chunk, as OpenAI and vLLM stream them: some clients (llama-index) read only the first entry
    # of a chunk's tool_calls.
    for j, c in enumerate(r.tool_calls):
        delta = {"tool_calls": [{"index": j, **c}]}
        yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    yield _sse(
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(r)}],
            "policy_version": r.policy_version,
        }
    )
    if req.include_usage:
        yield _sse({**base, "choices": [], "usage": _usage([r])})
    yield b"data: [DONE]\n\n"


def completion_response(
    results: list[TurnResult], model: ChatModel, model_name: str, want_logprobs: int | None, echo: str = ""
) -> dict:
    """``echo``: the prompt's text, put before each choice's text (``echo: true``). ``want_logprobs``: how many
    alternatives each token's ``top_logprobs`` holds besides the token itself (None: no logprobs)."""
    choices = [
        {
            "index": i,
            "text": echo + r.text,
            "logprobs": _completion_lp(model, r, want_logprobs),
            "finish_reason": _finish(r),
        }
        for i, r in enumerate(results)
    ]
    return {
        "id": "cmpl-" + new_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(results),
        "policy_version": results[0].policy_version,
    }


def _completion_lp(model: ChatModel, r: TurnResult, want_logprobs: int | None) -> dict | None:
    """A completions choice's ``logprobs`` object: each token with its own and up to ``want_logprobs`` others."""
    if want_logprobs is None:
        return None
    toks = [model.decode([t], skip_special=False) for t in r.token_ids]
    alts = r.top_logprobs or [[] for _ in toks]
    top = [
        {**{model.decode([t], skip_special=False): x for t, x in best[:want_logprobs]}, tok: own}
        for tok, own, best in zip(toks, r.logprobs, alts)
    ]
    return {"tokens": toks, "token_logprobs": r.logprobs, "top_logprobs": top, "text_offset": []}


async def completion_stream(
    results: list[TurnResult],
    model: ChatModel,
    model_name: str,
    want_logprobs: int | None = None,
    echo: str = "",
    include_usage: bool = False,
) -> AsyncIterator[bytes]:
    """SSE of answers already generated: each choice's text in chunks, its logprobs with the first one, its
    finish; then the usage when ``stream_options.include_usage`` asked for it."""
    base = {"id": "cmpl-" + new_id(), "object": "text_completion", "created": int(time.time()), "model": model_name}
    for i, r in enumerate(results):
        text, lp = echo + r.text, _completion_lp(model, r, want_logprobs)
        for j in range(0, max(len(text), 1), CHUNK_CHARS):
            piece = {"index": i, "text": text[j : j + CHUNK_CHARS], "logprobs": lp if j == 0 else None}
            yield _sse({**base, "choices": [{**piece, "finish_reason": None}]})
        yield _sse({**base, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": _finish(r)}]})
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _usage(results)})
    yield b"data: [DONE]\n\n"


def stream_usage(body: dict) -> bool:
    """``stream_options.include_usage`` (a 400 when ``stream_options`` is not an object or the flag not a bool)."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return sampling.flag(opts or {}, "include_usage")


def models_response(model_name: str) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "molt"}]}
