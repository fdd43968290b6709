"""The model's own chat template and tokenizer, canonical messages, and tool-call parsing.

Canonical message (both wires decode to it; the template sees exactly this):
``{"role", "content": str, "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}],
"tool_call_id"?, "name"?}``. Two messages are "the same" when their canonical forms are equal, with tool
call arguments compared as parsed JSON (so key order or spacing chosen by a client does not fork a session).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec

from services.gateway.errors import GatewayError

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, code="invalid_request", param=param)


class ChatModel:
    """Tokenizer + chat template of one model dir; every render goes through the model's own template."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        if not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir}: the tokenizer has no chat_template; the gateway needs the model's own")
        self.template = self.tokenizer.chat_template
        self.chat_template_hash = hashlib.sha256(self.template.encode()).hexdigest()[:16]
        self.tokenizer_hash = _files_hash(self.path, ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        self.eos_token_ids = sorted({i for i in [self.tokenizer.eos_token_id] if i is not None})
        self.max_model_len = _max_positions(self.path)
        self._fast = getattr(self.tokenizer, "backend_tokenizer", None)
        self._compiled = {has_tools: _compiled_template(self.tokenizer, has_tools) for has_tools in (False, True)}
        self._template_vars = dict(self.tokenizer.special_tokens_map)
        self._prompts: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        compiled = self._compiled[bool(tools)]
        try:
            if compiled is not None:
                # What apply_chat_template(tokenize=False) renders, without its per-call set-up (~25% of a render).
                return compiled.render(messages=messages, tools=tools or None, documents=None,
                                       add_generation_prompt=generation_prompt, **self._template_vars)
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja raises TemplateError, TypeError, ... on messages it cannot render
            raise bad_request(f"the model's chat template cannot render these messages: {exc}") from None

    PROMPT_CACHE_ENTRIES = 512
    """First-turn prompts kept: the samples of a group (GRPO's n) open with the same messages."""

    def prompt(self, key: str, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        """Render (generation prompt on) and tokenize a conversation, cached by its ``request_key``."""
        hit = self._prompts.get(key)
        if hit is not None:
            self._prompts.move_to_end(key)
            return hit[0], list(hit[1])
        text = self.render(messages, tools, generation_prompt=True)
        ids = self.encode(text)
        self._prompts[key] = (text, tuple(ids))
        if len(self._prompts) > self.PROMPT_CACHE_ENTRIES:
            self._prompts.popitem(last=False)
        return text, ids

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._fast is not None:
            # The Rust tokenizer directly (4x less overhead than the HF wrapper); the batch call without
            # offsets is another 25% faster than encode(), short prompts and long ones alike.
            return self._fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)


def _compiled_template(tokenizer: Any, has_tools: bool) -> Any:
    """The jinja template apply_chat_template would use (it picks a "tool_use" variant when there are
    tools), compiled once by transformers itself; None where that helper is missing (then the slow path)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        template = _compile_jinja_template(tokenizer.get_chat_template(None, [{}] if has_tools else None))
    except Exception:  # e.g. several named templates and no default: apply_chat_template says why per request
        return None
    # jinja keeps a template's globals as a ChainMap over the environment's and copies it into a dict on every
    # render (and again into a set of its keys): a third of a short render. The same names, flattened once.
    template.globals = dict(template.globals)
    return template


def _files_hash(path: Path, names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in names:
        f = path / name
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _max_positions(path: Path) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("max_position_embeddings")


# ---- canonical messages


def text_of(content: Any, where: str) -> str:
    """OpenAI content (str | None | list of parts) -> text; text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_audio", "file"):
                raise bad_request(f"{where}: {part['type']} parts are not supported by this text-only gateway", where)
            else:
                got = repr(part)[:200]
                raise bad_request(f"{where}: content parts must be {{'type': 'text', 'text': ...}}, got {got}", where)
        return "".join(out)
    raise bad_request(f"{where}: content must be a string, a list of text parts or null", where)


def canonical_tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(f"{where}: a tool call needs {{'id', 'type': 'function', 'function': {{'name', "
                          "'arguments'}}}", where)
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name: must be a non-empty string", where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": str(call.get("id") or new_call_id()), "type": "function",
            "function": {"name": name, "arguments": args}}


def canonical_message(msg: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(f"{where}: each message must be an object with 'role' and 'content'", where)
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise bad_request(f"{where}.role: must be one of {list(ROLES)} (or 'developer'), got {role!r}", where)
    out: dict[str, Any] = {"role": role, "content": text_of(msg.get("content"), f"{where}.content")}
    if role == "assistant" and msg.get("tool_calls"):
        calls = msg["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls: must be a list", where)
        out["tool_calls"] = [canonical_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        out["tool_call_id"] = str(msg.get("tool_call_id") or "")
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def canonical_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    return [canonical_message(m, i) for i, m in enumerate(messages)]


def canonical_tools(tools: Any) -> list[dict] | None:
    """OpenAI function tools (Anthropic tools are converted by its wire before this)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    for j, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise bad_request(f"tools[{j}]: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                              "tools")
    return tools


def _args_key(args: str) -> Any:
    try:
        return json.loads(args)
    except ValueError:
        return args


def same_message(a: dict, b: dict) -> bool:
    """Canonical equality with tool-call arguments compared as JSON values."""
    if a.get("role") != b.get("role") or (a.get("content") or "") != (b.get("content") or ""):
        return False
    ca, cb = a.get("tool_calls") or [], b.get("tool_calls") or []
    if len(ca) != len(cb):
        return False
    for x, y in zip(ca, cb):
        if x["function"]["name"] != y["function"]["name"]:
            return False
        if _args_key(x["function"]["arguments"]) != _args_key(y["function"]["arguments"]):
            return False
    return a.get("tool_call_id", "") == b.get("tool_call_id", "")


_KEY_ENCODER = msgspec.json.Encoder(enc_hook=str, order="sorted")


def request_key(messages: list[dict], tools: list[dict] | None, extra: Any = None) -> str:
    """Digest of a request for idempotent-retry detection (and the first-turn prompt cache's key).

    msgspec with sorted keys, 5x faster than json.dumps(sort_keys=True); it writes NaN and infinities as null, so
    a request holding one (only a tool schema can: messages are canonical text) is keyed by json, which keeps them
    apart from null."""
    try:
        raw = _KEY_ENCODER.encode([messages, tools, extra])
        if b"null" in raw and _non_finite([messages, tools, extra]):
            raise ValueError("NaN")
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):
        raw = json.dumps([messages, tools, extra], sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def _non_finite(x: Any) -> bool:
    if isinstance(x, float):
        return x != x or x in (float("inf"), float("-inf"))
    if isinstance(x, dict):
        return any(_non_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_non_finite(v) for v in x)
    return False


# ---- tool calls in model output


_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """24 hex characters, unique per process (a random prefix, then a counter): the ids of responses and tool
    calls. uuid4 cost a system call and a UUID object per id, twice per turn."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


def new_call_id() -> str:
    return "call_" + new_id()


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split model text into (content without tool-call blocks, structured tool calls).

    A block whose body is not ``{"name": str, "arguments": object|str}`` JSON stays in the content as text.
    """
    if "<tool_call>" not in text:  # most turns: the scan alone cost more than the rest of this function
        return text, []
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            body = json.loads(m.group(1))
            name, args = body["name"], body.get("arguments", {})
            if not isinstance(name, str) or not name:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        args_s = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args_s}})
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip(), calls
