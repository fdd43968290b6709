"""The model's own chat template and tokenizer, canonical messages, and tool-call parsing.

Canonical message (both wires decode to it; the template sees this with tool-call arguments as objects,
``template_messages``):
``{"role", "content": str, "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}],
"tool_call_id"?, "name"?}``; with images, ``content`` is a list of ``{"type": "text", "text"}`` and
``{"type": "image", "sha256", "data": base64 str}`` parts (see ``image_part``). Two messages are "the same"
when their canonical forms are equal, with tool call arguments compared as parsed JSON (so key order or spacing
chosen by a client does not fork a session).
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import itertools
import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec

from molt.vocab import vocab_fingerprint
from services.gateway.errors import GatewayError
from services.gateway.templates import template_variables

ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_JSON_WS = re.compile(r"[ \t\n\r]*")  # the whitespace json.loads allows around a value
_JSON = json.JSONDecoder()


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, code="invalid_request", param=param)


class ImageExpansion:
    """How many tokens beyond its one placeholder an image adds in the pod's prompt, learned from the pods'
    answers (the gateway does not run the model's image processor). The smallest run seen per image: exact for
    processors that give every image the same run; for those whose run grows with the image, a turn is refused
    or its images dropped up front only when they would not fit even at that, and the pod's answer settles the
    rest (``Capture.fit``)."""

    def __init__(self) -> None:
        self.extra_per_image: int | None = None
        """None: no image seen yet (each counts as its one placeholder)."""

    @property
    def estimate(self) -> int:
        return self.extra_per_image or 0

    def note(self, extra_tokens: int, images: int) -> None:
        if images > 0 and extra_tokens >= 0:
            per_image = extra_tokens // images
            self.extra_per_image = per_image if self.extra_per_image is None else min(self.extra_per_image, per_image)


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
        self.vocab = vocab_fingerprint(self.tokenizer)
        self.eos_token_ids = sorted({i for i in [self.tokenizer.eos_token_id] if i is not None})
        self.max_model_len = _max_positions(self.path)
        self.image_token_id = _image_token_id(self.path)
        """The image placeholder token of a vision-language model; None: a text-only model (images are a 400)."""
        self.image_expansion = ImageExpansion()
        """Tokens an image adds once the pod expands it (shared by every view of this model)."""
        self._fast = getattr(self.tokenizer, "backend_tokenizer", None)
        self._template_vars = dict(self.tokenizer.special_tokens_map)
        self._prompts: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()
        self.thinks = "</think>" in self.template
        """The template knows think blocks: a reply's think block is its reasoning, not content (thinking.py)."""
        self.template_kwargs: dict[str, Any] = {}
        """A request's ``chat_template_kwargs`` (``with_kwargs``): extra variables every render of it sees."""
        self.template_variables = template_variables(self.template) - set(self._template_vars)
        """The variables the template reads that the gateway does not set: what ``chat_template_kwargs`` may set."""

    def with_kwargs(self, kwargs: Any, param: str = "chat_template_kwargs") -> ChatModel:
        """This model rendering with a request's ``chat_template_kwargs`` (``enable_thinking``...): a view that
        shares the tokenizer and the prompt cache (whose keys hold the kwargs). A variable the template never
        reads would be ignored, and one the gateway sets itself would change what it captures: both are 400s."""
        if not kwargs:
            return self
        if not isinstance(kwargs, dict):
            raise bad_request(f"'{param}' must be an object of template variables", param)
        unknown = sorted(str(k) for k in kwargs if k not in self.template_variables)
        if unknown:
            raise bad_request(
                f"'{param}': this model's chat template does not read {ascii(unknown)[:200]}; it reads "
                f"{sorted(self.template_variables)}",
                param,
            )
        view = copy.copy(self)
        view.template_kwargs = {**self.template_kwargs, **kwargs}
        return view

    def render(
        self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, prefill: bool = False
    ) -> str:
        """``prefill``: the final (assistant) message is left open, its text the start of the reply (HF's
        ``continue_final_message``; no generation prompt). Tool-call arguments reach the template as objects
        (``template_messages``), as vLLM's server gives them to it."""
        shown = template_messages(messages)
        try:
            text = self._apply(shown, tools, generation_prompt, prefill)
        except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, TypeError, ... on messages it cannot render
            error = bad_request(f"the model's chat template cannot render these messages: {exc}")
            if shown is messages:
                raise error from None
            try:  # a template that takes only the JSON text (DeepSeek's concatenate it) renders it as before
                text = self._apply(messages, tools, generation_prompt, prefill)
            except Exception:  # noqa: BLE001 - as above
                raise error from None
        assert isinstance(text, str)  # tokenize=False renders text
        return text

    def _apply(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, prefill: bool) -> Any:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=generation_prompt and not prefill,
            continue_final_message=prefill,
            **self.template_kwargs,
        )

    _SENTINEL = "\x1fmolt-reply\x1f"

    def assistant_closing(self, messages: list[dict], tools: list[dict] | None) -> str | None:
        """What the template renders after an assistant message's content that ends the conversation (the
        end-of-turn marker and what follows it); None where the template does not render the content verbatim."""
        text = self.render(
            [*messages, {"role": "assistant", "content": self._SENTINEL}], tools, generation_prompt=False
        )
        at = text.rfind(self._SENTINEL)
        return text[at + len(self._SENTINEL) :] if at >= 0 else None

    PROMPT_CACHE_ENTRIES = 512
    """First-turn prompts kept: the samples of a group (GRPO's n) open with the same messages."""

    def prompt(
        self, key: str, messages: list[dict], tools: list[dict] | None, prefill: bool = False
    ) -> tuple[str, list[int]]:
        """Render (generation prompt on, or the final message open: ``prefill``) and tokenize a conversation,
        cached by its ``request_key``."""
        key = "prefill:" + key if prefill else key
        hit = self._prompts.get(key)
        if hit is not None:
            self._prompts.move_to_end(key)
            return hit[0], list(hit[1])
        text = self.render(messages, tools, generation_prompt=True, prefill=prefill)
        ids = self.encode(text)
        self._prompts[key] = (text, tuple(ids))
        if len(self._prompts) > self.PROMPT_CACHE_ENTRIES:
            self._prompts.popitem(last=False)
        return text, ids

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._fast is not None:
            # The Rust tokenizer directly: the HF wrapper's per-call overhead is several times the encoding of
            # a short prompt, and the batch call without offsets skips work encode() does.
            return self._fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        assert isinstance(text, str)  # one sequence in, one string out
        return text


def _files_hash(path: Path, names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in names:
        f = path / name
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _image_token_id(path: Path) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("image_token_id") if "vision_config" in cfg else None


def _max_positions(path: Path) -> int | None:
    """The model's context in positions. A vision-language config keeps it in its language model's section
    (``text_config``, as vLLM reads it), not at the top."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config"), cfg.get("llm_config")):
        if isinstance(section, dict) and isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


# ---- canonical messages


def text_of(content: Any, where: str, assistant: bool = False) -> str | list[dict]:
    """OpenAI content (str | None | list of parts) -> text (text parts joined), or, when it holds images,
    a list of text and image parts in their order. ``assistant``: the content of an assistant message, whose
    ``refusal`` parts are text the model wrote (a 400 on other roles)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[Any] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text") or ""))  # null: no text, never the word "None"
            elif isinstance(part, dict) and part.get("type") == "refusal":
                out.append(refusal_text(part.get("refusal"), f"{where}[{j}].refusal", assistant))
            elif isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                out.append(data_url_part(url, f"{where}[{j}].image_url"))
            elif isinstance(part, dict) and part.get("type") == "input_image":  # the Responses wire's image part
                if part.get("image_url") is None and part.get("file_id") is not None:
                    raise bad_request(
                        f"{where}[{j}].file_id: uploaded files are not supported; send the image as "
                        "image_url (a data URL: data:image/png;base64,...)",
                        f"{where}[{j}].file_id",
                    )
                out.append(data_url_part(part.get("image_url"), f"{where}[{j}].image_url"))
            elif isinstance(part, dict) and part.get("type") in ("image", "input_audio", "file", "input_file"):
                raise bad_request(
                    f"{where}: {part['type']} parts are not supported; send images as "
                    "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}",
                    where,
                )
            else:
                got = repr(part)[:200]
                raise bad_request(f"{where}: content parts must be {{'type': 'text', 'text': ...}}, got {got}", where)
        return joined_parts(out)
    raise bad_request(f"{where}: content must be a string, a list of text parts or null", where)


def refusal_text(refusal: Any, field: str, assistant: bool) -> str:
    """A refusal (a content part's or the message's ``refusal``, named ``field``): the assistant's words,
    rendered as its text."""
    if not assistant:
        raise bad_request(f"{field}: a refusal belongs to an assistant message only", field)
    if not isinstance(refusal, str):
        raise bad_request(f"{field}: must be a string", field)
    return refusal


def joined_parts(parts: list[Any]) -> str | list[dict]:
    """Text parts joined; with images, adjacent text merged into text parts around them."""
    if not any(isinstance(p, dict) for p in parts):
        return "".join(parts)
    out: list[dict] = []
    for p in parts:
        if isinstance(p, dict):
            out.append(p)
        elif out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p}
        elif p:
            out.append({"type": "text", "text": p})
    return out


# ---- images

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def image_part(data: Any, media_type: Any, where: str) -> dict:
    """A canonical image part from base64 ``data``: the sha256 of the file's bytes (the id it is stored under in
    the trajectory) and the base64 text as sent (JSON-safe: parked sessions and pod requests carry it as is).
    The file itself is checked by the pod, which decodes it."""
    if media_type not in IMAGE_MEDIA_TYPES:
        raise bad_request(
            f"{where}: unsupported image media type {media_type!r}; supported: {', '.join(IMAGE_MEDIA_TYPES)}", where
        )
    if not isinstance(data, str):
        raise bad_request(f"{where}: image data must be a base64 string", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: image data is not valid base64", where) from None
    if not raw:
        raise bad_request(f"{where}: the image is empty", where)
    return {"type": "image", "sha256": hashlib.sha256(raw).hexdigest(), "data": data}


def data_url_part(url: Any, where: str) -> dict:
    """``data:image/png;base64,...`` -> an image part. Other URLs are refused (with --gateway.fetch_images they
    were fetched and inlined before parsing: services/gateway/image_fetch.py)."""
    if not isinstance(url, str):
        raise bad_request(f"{where}: expected an image URL string (data:image/png;base64,...)", where)
    head, sep, data = url.partition(",")
    if url.startswith(("http://", "https://")):
        raise bad_request(
            f"{where}: image URLs are not fetched by this gateway (--gateway.fetch_images is off); send the "
            "image inline as a data URL (data:image/png;base64,...)",
            where,
        )
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad_request(f"{where}: expected a base64 data URL (data:image/png;base64,...), got {url[:40]!r}", where)
    return image_part(data, head[len("data:") : -len(";base64")], where)


def message_images(messages: list[dict]) -> list[dict]:
    """The image parts of ``messages`` in render order (the order their tokens appear in the prompt)."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == "image"]


def canonical_tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(
            f"{where}: a tool call needs {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}}}", where
        )
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name: must be a non-empty string", where)
    args = fn.get("arguments")
    if args is None:  # absent or null: no arguments, as vLLM reads them
        args = "{}"
    elif not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": str(call.get("id") or new_call_id()),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as the template sees them: each tool call's JSON-object ``arguments`` parsed into a dict.

    vLLM's server does the same (``_postprocess_messages``), and tool-use templates expect it: Qwen2.5's and
    Llama 3's ``tojson`` the arguments (a string renders double-encoded), LFM2's and Nemotron's iterate them.
    Qwen3's prints a string verbatim, but ``tojson`` writes what ``parse_tool_calls`` returned (``json.dumps``), so
    a reply echoed as is renders as before, and one a client re-serialised renders as the gateway returned it.
    Empty arguments are ``{}``, as there; other text (not JSON, a JSON non-object) stays as sent, where vLLM would
    render ``{}`` and lose it."""
    if not any("tool_calls" in m for m in messages):
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [_template_call(c) for c in calls]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    args = fn["arguments"]
    if not args.strip():
        value: Any = {}
    else:
        try:
            value = json.loads(args)
        except ValueError:
            return call
        if not isinstance(value, dict):
            return call
    return {**call, "function": {**fn, "arguments": value}}


def canonical_message(msg: Any, i: int, where: str | None = None, content_where: str | None = None) -> dict:
    """One OpenAI chat message, canonical. ``where`` / ``content_where`` name the message and its content in
    the client's body for errors (another wire's names: the Responses wire's ``input[i].output``)."""
    where = where or f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(f"{where}: each message must be an object with 'role' and 'content'", where)
    role = msg.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise bad_request(f"{where}.role: must be one of {list(ROLES)} (or 'developer'), got {role!r}", where)
    assistant = role == "assistant"
    content = text_of(msg.get("content"), content_where or f"{where}.content", assistant)
    if msg.get("refusal") is not None:  # OpenAI's field for an assistant's refusal; null when it did not refuse
        refusal = refusal_text(msg["refusal"], f"{where}.refusal", assistant)
        content = joined_parts([content, refusal] if isinstance(content, str) else [*content, refusal])
    out: dict[str, Any] = {"role": role, "content": content}
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


def canonical_messages(messages: Any, wheres: list[tuple[str, str]] | None = None) -> list[dict]:
    """``wheres``: each message's (where, content where) in the client's body, when it is not ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    if wheres is None:
        return [canonical_message(m, i) for i, m in enumerate(messages)]
    return [canonical_message(m, i, *w) for i, (m, w) in enumerate(zip(messages, wheres, strict=True))]


def canonical_tools(tools: Any) -> list[dict] | None:
    """OpenAI function tools (Anthropic tools are converted by its wire before this)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    # A tool's null "type" is an absent one (a function tool), left out so it renders as one sent without it.
    tools = [{k: v for k, v in t.items() if k != "type" or v is not None} for t in tools]
    for j, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise bad_request(
                f"tools[{j}]: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}", "tools"
            )
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


_KEY_ENCODER = msgspec.json.Encoder(enc_hook=str)


def request_key(messages: list[dict], tools: list[dict] | None, extra: Any = None) -> str:
    """Digest of a request for idempotent-retry detection and the first-turn prompt cache's key.

    Keys keep the client's order: the template renders a tool schema's keys in the order it got them, so two
    requests whose JSON differs only in key order render (and tokenize) differently and must not share a cached
    prompt. msgspec writes NaN and infinities as null, so a request holding one (only a tool schema can: messages
    are canonical text) is keyed by json, which keeps them apart from null."""
    try:
        raw = _KEY_ENCODER.encode([messages, tools, extra])
        if b"null" in raw and _non_finite([messages, tools, extra]):
            raise ValueError("NaN")
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):
        raw = json.dumps([messages, tools, extra], ensure_ascii=False, default=str).encode()
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

    A block is ``<tool_call>``, one JSON value ``{"name": str, "arguments": ...}``, then ``</tool_call>``: the
    JSON is read with a decoder, so a ``</tool_call>`` inside one of its strings does not end the call. Any other
    block (up to the first ``</tool_call>`` after its opener) stays in the content as text.
    """
    if TOOL_CALL_OPEN not in text:  # most turns: the scan alone cost more than the rest of this function
        return text, []
    calls: list[dict] = []
    kept: list[str] = []
    pos = at = 0
    while (at := text.find(TOOL_CALL_OPEN, at)) >= 0:
        call, end = _tool_call_at(text, at + len(TOOL_CALL_OPEN))
        if call is None:
            # Not a call: text up to its first closer (the bounds such a block always had); no closer: all text.
            close = text.find(TOOL_CALL_CLOSE, at + len(TOOL_CALL_OPEN))
            if close < 0:
                break
            at = close + len(TOOL_CALL_CLOSE)
            continue
        kept.append(text[pos:at])
        pos = at = end
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _tool_call_at(text: str, start: int) -> tuple[dict | None, int]:
    """The call whose JSON starts at ``start`` (after whitespace) and is followed by ``</tool_call>``, and the
    index after that closer; (None, start) when there is none."""
    try:
        body, end = _JSON.raw_decode(text, _past_whitespace(text, start))
        name, args = body["name"], body.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return None, start
    close = _past_whitespace(text, end)
    if not text.startswith(TOOL_CALL_CLOSE, close):
        return None, start
    args_s = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args_s}}
    return call, close + len(TOOL_CALL_CLOSE)


def _past_whitespace(text: str, i: int) -> int:
    m = _JSON_WS.match(text, i)
    return m.end() if m else i
