"""Tool choice as a constraint on what the pod samples, written in the model's own tool-call format.

OpenAI's ``tool_choice`` (``"none"``, ``"auto"``, ``"required"``, ``{"type": "function", "function": {"name"}}``)
with ``parallel_tool_calls``, and Anthropic's (``{"type": "auto" | "any" | "tool" | "none", "name"?,
"disable_parallel_tool_use"?}``) both become a ``ToolChoice``. Every choice but "auto with parallel calls" is a
structured-output constraint (an xgrammar structural tag, which vLLM applies while it samples):

- *required* / *named*: the reply is exactly one call (of any tool / of the named one) whose arguments match
  that tool's JSON schema, then the end of the turn. One call is what "one or more" always allows.
- *auto* without parallel calls: free text, at most one call, then the end of the turn.
- *none*: the tools stay in the prompt (the template shows them, as the spec says), and the reply cannot
  contain the call opener, so no call is parsed out of it.
- *auto* with parallel calls where a tool is ``strict`` (OpenAI's ``function.strict``, Anthropic's ``strict``):
  text and calls as the model likes, a strict tool's arguments matching its schema, others' any JSON object, as
  vLLM applies ``strict``. Where the template's calls cannot be constrained, nothing is (as vLLM, for a tool
  parser without a structural tag).

The call format is the template's own: it renders an assistant message holding one call with a sentinel name
and sentinel arguments, and the text around the sentinels is the format. The tokens sampled under the
constraint are therefore the ones the template renders back for that call, and capture stays token-exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.gateway.chat import ChatModel, bad_request
from services.gateway.errors import GatewayError

_NAME = "molt_sentinel_tool"
_ARGS = '{"molt_sentinel_arg": 0}'
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what renders the same with or without JSON quoting
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"
    """auto | none | required | named."""
    name: str | None = None
    parallel: bool = True
    strict: frozenset[str] = frozenset()
    """Tools marked strict where the wire keeps the mark outside the tool (Anthropic's); OpenAI's
    ``function.strict`` is read off the tools themselves."""

    def constrains(self, tools: list[dict] | None) -> bool:
        """Whether this choice becomes a constraint on what the pod samples (``constraint``)."""
        return not (self.mode == "auto" and self.parallel or (self.mode in ("auto", "none") and not tools))


def from_openai(tool_choice: Any, parallel: Any) -> ToolChoice:
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(
            f"'parallel_tool_calls' must be true or false, got {str(parallel)[:80]!a}", "parallel_tool_calls"
        )
    par = parallel is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolChoice(tool_choice or "auto", parallel=par)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            '\'tool_choice\' must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {str(tool_choice)[:120]!a}',
            "tool_choice",
        )
    return ToolChoice("named", name, par)


def from_anthropic(tool_choice: Any) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice()
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (
        kind == "tool" and not isinstance(tool_choice.get("name"), str)
    ):
        raise bad_request(
            '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}, '
            f"got {str(tool_choice)[:120]!a}",
            "tool_choice",
        )
    off = tool_choice.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise bad_request("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice")
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    return ToolChoice(mode, tool_choice.get("name") if kind == "tool" else None, not off)


@dataclass(frozen=True)
class CallFormat:
    """One call renders as ``begin + name + middle + arguments JSON + end``."""

    begin: str
    middle: str
    end: str

    @property
    def opener(self) -> str:
        """The text that opens a call (``<tool_call>``): what a reply under "none" may not hold."""
        head = self.begin.strip()
        return head[: head.index(">") + 1] if head.startswith("<") and ">" in head else head


def call_format(model: ChatModel, messages: list[dict], tools: list[dict]) -> CallFormat:
    """How the template renders one call after ``messages`` (see the module docstring); a 400 when it does not
    render the name and the arguments verbatim, as a constraint needs."""
    reply = {"role": "assistant", "content": model._SENTINEL}
    call = {"id": "call_0", "type": "function", "function": {"name": _NAME, "arguments": _ARGS}}
    closing = model.assistant_closing(messages, tools)
    text = model.render([*messages, {**reply, "tool_calls": [call]}], tools, generation_prompt=False)
    at = text.rfind(model._SENTINEL)
    block = text[at + len(model._SENTINEL) :] if at >= 0 else ""
    if closing is not None and closing and block.endswith(closing):
        block = block[: -len(closing)]
    block = block.lstrip()
    i, j = block.find(_NAME), block.find(_ARGS)
    if at < 0 or closing is None or i <= 0 or j < i + len(_NAME):
        raise bad_request(
            "this model's chat template does not render a tool call's name and arguments verbatim, so the "
            'gateway cannot constrain a reply to its call format: use tool_choice "auto" with parallel calls',
            "tool_choice",
        )
    return CallFormat(block[:i], block[i + len(_NAME) : j], block[j + len(_ARGS) :])


def constraint(model: ChatModel, messages: list[dict], tools: list[dict] | None, choice: ToolChoice) -> dict | None:
    """The pod's ``structured_outputs`` for ``choice`` (None: nothing to constrain)."""
    if not choice.constrains(tools):
        return None
    if not tools:
        raise bad_request(f"tool_choice {choice.mode!r} needs 'tools'", "tool_choice")
    fns = [t["function"] for t in tools]
    if choice.mode == "named":
        fns = [f for f in fns if f.get("name") == choice.name]
        if not fns:
            raise bad_request(f"tool_choice names {choice.name!r}, which is not one of 'tools'", "tool_choice")
    fmt = call_format(model, messages, tools)
    if choice.mode == "none":
        return {"structural_tag": {"type": "structural_tag", "format": {"type": "any_text", "excludes": [fmt.opener]}}}
    tags = _call_tags(fmt, fns)
    if choice.mode == "auto":  # no parallel calls: text, then at most one call, then the end of the turn
        fmt_tag: dict = {"type": "triggered_tags", "triggers": [fmt.opener], "tags": tags, "stop_after_first": True}
    else:
        fmt_tag = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    return {"structural_tag": {"type": "structural_tag", "format": fmt_tag}}


def _call_tags(fmt: CallFormat, fns: list[dict], loose: frozenset[str] = frozenset()) -> list[dict]:
    """One structural tag per function: its call in the template's format, arguments matching its schema (any
    JSON object for the tools named in ``loose``)."""
    tags = []
    for f in fns:
        if not _TOOL_NAME.match(f["name"]):
            raise bad_request(
                f"tool name {str(f['name'])[:80]!a}: a constrained tool choice takes names of letters, digits, "
                "'_', '-' and '.'",
                "tools",
            )
        schema = f.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict):
            raise bad_request(f"tool {f['name']!r}: 'parameters' must be a JSON schema object", "tools")
        tags.append(
            {
                "type": "tag",
                "begin": fmt.begin + f["name"] + fmt.middle,
                "content": {"type": "json_schema", "json_schema": _ANY_OBJECT if f["name"] in loose else schema},
                "end": fmt.end,
            }
        )
    return tags


def _separator(model: ChatModel, messages: list[dict], tools: list[dict], fmt: CallFormat) -> str | None:
    """What the template renders between two calls of one reply (None: not found, or the template renders one call
    only, as Llama 3's)."""
    call = {"type": "function", "function": {"name": _NAME, "arguments": _ARGS}}
    calls = [{"id": "call_0", **call}, {"id": "call_1", **call}]
    try:
        text = model.render([*messages, {"role": "assistant", "content": "", "tool_calls": calls}], tools, False)
    except GatewayError:
        return None
    one = fmt.begin + _NAME + fmt.middle + _ARGS + fmt.end
    first = text.rfind(one, 0, text.rfind(one))
    return None if first < 0 else text[first + len(one) : text.rfind(one)]


def json_or_calls(
    model: ChatModel, messages: list[dict], tools: list[dict], structured: dict, parallel: bool
) -> dict | None:
    """A JSON response format on a request whose tools the model may call (tool choice *auto*): the reply is the
    JSON, or calls in the template's format (one without parallel calls), as OpenAI answers such a request. A
    constraint to the JSON alone (vLLM's answer) would leave the tools uncallable: openai-agents' ``output_type``,
    pydantic-ai's ``NativeOutput`` / ``PromptedOutput`` and LangChain's provider strategy send JSON formats with
    the agent's tools on every turn. None where the template's calls cannot be constrained (the JSON alone)."""
    schema = structured["json"] if "json" in structured else {"type": "object"}
    try:
        fmt = call_format(model, messages, tools)
        tags = _call_tags(fmt, [t["function"] for t in tools])
    except GatewayError:
        return None
    sep = _separator(model, messages, tools, fmt) if parallel else None
    calls: dict = (
        {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True}
        if sep is not None
        else (tags[0] if len(tags) == 1 else {"type": "or", "elements": tags})
    )
    json_reply = {"type": "json_schema", "json_schema": schema}
    return {"structural_tag": {"type": "structural_tag", "format": {"type": "or", "elements": [json_reply, calls]}}}


def strict_calls(model: ChatModel, messages: list[dict], tools: list[dict], strict: frozenset[str]) -> dict | None:
    """Tool choice *auto* with parallel calls and some tools strict: free text and any calls, each in the
    template's format, a strict tool's arguments matching its schema and the others' any JSON object (vLLM's
    reading of ``strict``: openai-agents marks every function tool strict). None where the template's calls
    cannot be constrained."""
    fns = [t["function"] for t in tools]
    try:
        fmt = call_format(model, messages, tools)
        tags = _call_tags(fmt, fns, loose=frozenset(f["name"] for f in fns) - strict)
    except GatewayError:
        return None
    calls = {"type": "triggered_tags", "triggers": [fmt.opener], "tags": tags}
    return {"structural_tag": {"type": "structural_tag", "format": calls}}


def apply(
    model: ChatModel, messages: list[dict], tools: list[dict] | None, overrides: dict, held: dict | None = None
) -> dict:
    """``overrides`` with its ``tool_choice`` (a ToolChoice, from the wire) turned into the pod's constraint.
    ``held``: the session's own ``structured_outputs`` (set when it was opened), this turn's unless the request
    names one; folded in first, so the prefill and tool-choice rules read it as they read the request's."""
    if held is not None and overrides.get("structured_outputs") is None:
        if overrides.get("continue_final_message"):
            raise bad_request(
                "this session's structured_outputs (set when it was opened) cannot continue a final assistant "
                "message (a prefill): it would constrain the continuation alone",
                "sampling_params.structured_outputs",
            )
        overrides["structured_outputs"] = held
    choice = overrides.pop("tool_choice", None)
    if choice is None:
        return overrides
    structured = overrides.get("structured_outputs")
    # JSON or calls, as OpenAI answers a JSON format beside callable tools; any other grammar (a regex, a choice)
    # constrains the whole reply, as vLLM applies it.
    if structured is not None and tools and choice.mode == "auto" and {"json", "json_object"} & set(structured):
        either = json_or_calls(model, messages, tools, structured, choice.parallel)
        if either is not None:
            overrides["structured_outputs"] = either
            return overrides
    if structured is None and choice.mode == "auto" and choice.parallel and tools:
        strict = choice.strict | {t["function"]["name"] for t in tools if t["function"].get("strict") is True}
        if strict:
            spec = strict_calls(model, messages, tools, strict)
            if spec is not None:
                overrides["structured_outputs"] = spec
            return overrides
    if structured is not None and choice.mode in ("auto", "none"):
        # The reply is the JSON, which holds no call: that is tool choice none, and auto where the template's
        # calls cannot be constrained.
        return overrides
    spec = constraint(model, messages, tools, choice)
    if spec is not None:
        # Required or a named tool beside a response format (an openai-agents Agent with an output type and
        # tool_choice "required" sends both): this reply is a call, and the format shapes a later turn's text
        # reply, as OpenAI and Anthropic take the pair. So the call's constraint replaces the format here.
        overrides["structured_outputs"] = spec
    return overrides
