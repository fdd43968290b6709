"""SFT data: rows -> chat conversations -> token ids and a loss mask over the response tokens.

Rows are read with ``molt.data.read_rows`` (datasets directories, parquet, JSONL). A row becomes a
conversation as in Molt: ``--data.input_key`` holds the prompt (a string = one user turn, or a list
of messages that may already contain the assistant turns), ``--data.output_key`` the response (a
string, one message dict or a list of messages). The conversation is rendered with the chat template
and tokenised once, up front. With ``--data.tools_key`` the row's tool schemas (an OpenAI function list, or its
JSON string) go to the template as ``tools=``, as ``apply_chat_template(messages, tools=...)`` renders them.

Which tokens are the response is found in the rendered ids, not by per-template rules: probing the
template with throwaway chats yields the token run that opens an assistant reply (the generation
prompt, e.g. ``<|im_start|>assistant\\n``) and the token that closes it (``<|im_end|>``). Every token
after an opener up to and including its closer is supervised: the reply text and the stop token the
model must learn to emit. ``--data.train_on_last_turn_only`` keeps only the last such run.

A vision-language model's rows carry images (``--data.image_key``: one or a list, in any form
``molt.images.to_bytes`` reads). Each literal ``<image>`` of a user string takes the next image, as in
Molt, and so does each ``{"type": "image"}`` content part (TRL's VLM rows); the template renders it as
the model's image part and the model's processor expands it into the image's token run, so the mask
and the cut work on the ids the model sees. A cut never splits a run: an image it would split is dropped
with its run (``vision.cut_at_whole_image``).

Bad rows are counted by reason and never trained on: a missing key, a malformed message list or tool list, no
assistant turn, an empty response, a sample whose response starts past ``--data.max_len`` (nothing
left to supervise after the cut), and for images: more than ``--data.max_images_per_prompt``, an
unreadable image, markers or image parts that do not match the images one to one, image parts without
``--data.image_key``. Samples longer than ``max_len`` are cut there and counted as truncated.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from molt.images import MARKER, count_markers, inline_parts, to_bytes
from services.trainer.packing import common_prefix_len, fill_row

log = logging.getLogger("molt.trainer")


@dataclass(frozen=True)
class ReplyMarkers:
    opener: tuple[int, ...]
    """Token ids right before an assistant reply."""
    closer: int
    """Token id that ends a reply."""
    supervise_closer: bool
    """True when the closer is the model's own stop token (train it); False when it only opens the next turn."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def reply_markers(tokenizer) -> ReplyMarkers:
    """Probe the chat template with throwaway chats for the reply opener and closer (module docstring)."""

    def ids(messages, gen=False):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    user = [{"role": "user", "content": "x"}]
    a = user + [{"role": "assistant", "content": "aaa"}]
    b = user + [{"role": "assistant", "content": "bbb"}]
    base = ids(user)
    gen = ids(user, gen=True)[len(base) :]
    # A reasoning template may add a scaffold to the last turn's generation prompt only: keep the part
    # a mid-conversation reply also starts with.
    mid = ids(a + [{"role": "user", "content": "z"}])[len(base) :]
    opener = gen[: _common_prefix(gen, mid)] or gen
    if not opener:
        raise ValueError(
            "the chat template has no assistant generation prompt; SFT cannot locate the replies "
            "(set --data.tokenizer_chat_template)"
        )
    ia, ib = ids(a), ids(b)
    tail = ia[len(ia) - _common_suffix(ia, ib) :]
    if tail:
        return ReplyMarkers(tuple(opener), tail[0], True)
    nxt = ids(a + [{"role": "user", "content": "z"}])
    return ReplyMarkers(tuple(opener), nxt[len(ia)], False)


def response_mask(token_ids: list[int], markers: ReplyMarkers, last_turn_only: bool = False) -> np.ndarray:
    """True at every supervised token: after each reply opener, up to and including its closer."""
    mask = np.zeros(len(token_ids), dtype=bool)
    op, width = list(markers.opener), len(markers.opener)
    runs = []
    i = 0
    while i <= len(token_ids) - width:
        if token_ids[i : i + width] != op:
            i += 1
            continue
        start = j = i + width
        while j < len(token_ids) and token_ids[j] != markers.closer:
            j += 1
        end = min(j + 1, len(token_ids)) if markers.supervise_closer else j
        runs.append((start, end))
        i = max(j, start)
    for start, end in runs[-1:] if last_turn_only else runs:
        mask[start:end] = True
    return mask


def _content(content):
    """A message's content as templates take it: a string, text parts joined into one, or (with an image part) a
    list of ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts (a datasets column fills a part's
    absent keys with None, dropped here); None when it is none of these."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    parts: list[dict] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            parts.append({"type": "image"})
        else:
            return None
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


TOOLS_COLUMN = "tools"
"""The column tool-calling SFT datasets keep their schemas in: rows holding it without --data.tools_key are logged."""


def row_tools(row: dict, tools_key: str | None) -> tuple[list[dict] | None, str]:
    """The row's tool schemas for the template's ``tools=`` (None: none), or (None, reason) for a bad row."""
    value = row.get(tools_key) if tools_key else None
    if isinstance(value, str):  # datasets often store the schemas as one JSON string
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError:
            return None, "malformed tools"
    elif value is not None:
        # A parquet / datasets column merges every row's schemas into one struct type, filling the keys a row
        # lacks with None: rendered, they would be parameters the tool does not have ("q": null). Calls'
        # arguments (to_messages) are cleaned the same way.
        value = _drop_none(value)
    if value is None or (isinstance(value, list) and not value):
        return None, ""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None, "malformed tools"
    return value, ""


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value


def image_parts(messages: list[dict]) -> int:
    return sum(p["type"] == "image" for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def to_messages(row: dict, input_key: str, output_key: str | None) -> tuple[list[dict] | None, str]:
    """The row's conversation, or (None, reason) for a bad row."""
    if input_key not in row or row[input_key] is None:
        return None, f"missing {input_key!r}"
    prompt = row[input_key]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if output_key is not None:
        reply = row.get(output_key)
        if reply is None:
            return None, f"missing {output_key!r}"
        if isinstance(reply, list):
            messages += reply
        elif isinstance(reply, dict):
            messages.append(reply)
        else:
            messages.append({"role": "assistant", "content": reply})
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, "malformed messages"
        content = _content(m.get("content"))
        if content is None and not (m.get("role") == "assistant" and m.get("tool_calls")):
            return None, "malformed messages"
        if content is not m.get("content"):
            messages[k] = {**m, "content": content}
        if isinstance(m.get("tool_calls"), list):  # a merged struct column's null keys, as for the tool schemas
            messages[k] = {**messages[k], "tool_calls": _drop_none(m["tool_calls"])}
    replies = [m for m in messages if m["role"] == "assistant"]
    if not replies:
        return None, "no assistant turn"
    if not any(isinstance(m.get("content"), str) and m["content"].strip() or m.get("tool_calls") for m in replies):
        return None, "empty response"
    return messages, ""


@dataclass
class Example:
    input_ids: np.ndarray
    """[T] int64 token ids."""
    loss_mask: np.ndarray
    """[T] bool: token t is a supervised target (predicted from tokens < t)."""
    images: list[bytes] = field(default_factory=list)
    """Image files, in the order of their token runs in ``input_ids``."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class DataReport:
    rows: int = 0
    used: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    """Bad rows by reason."""

    def summary(self, flag: str) -> str:
        bad = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        return (
            f"{flag}: {self.rows} rows, {self.used} used, {self.truncated} truncated to --data.max_len, dropped: {bad}"
        )


class Tokenized:
    """Chat-template rendering + tokenisation + loss mask, for one tokenizer and one set of flags; with
    ``vision`` (a VL model's ``VisionInputs``) and ``image_key``, the rows' images too."""

    def __init__(
        self,
        tokenizer,
        max_len: int,
        input_key: str,
        output_key: str | None,
        last_turn_only: bool = False,
        *,
        vision=None,
        image_key: str | None = None,
        max_images: int = 4,
        tools_key: str | None = None,
    ) -> None:
        self.tok, self.max_len = tokenizer, max_len
        self.input_key, self.output_key, self.last_turn_only = input_key, output_key, last_turn_only
        self.vision, self.image_key, self.max_images = vision, image_key, max_images
        self.tools_key = tools_key
        self.markers = reply_markers(tokenizer)
        if tools_key:
            check_renders_tools(tokenizer, tools_key)

    def _images(self, row: dict, messages: list[dict]) -> tuple[list[bytes] | None, str]:
        parts = image_parts(messages)
        if not self.image_key:  # text data: an "<image>" in it is text
            return ([], "") if not parts else (None, "image parts without --data.image_key")
        value = row.get(self.image_key)
        values = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
        if len(values) > self.max_images:
            return None, f"more than --data.max_images_per_prompt {self.max_images} images"
        markers = count_markers(messages) + parts
        if markers != len(values):
            return None, f"{len(values)} images for {markers} {MARKER} markers or image parts"
        try:
            return [to_bytes(v, f"--data.image_key {self.image_key!r}") for v in values], ""
        except ValueError:
            return None, "unreadable image"

    def _ids(self, text: str, images: list[bytes]) -> list[int]:
        if not images:
            return self.tok(text, add_special_tokens=False)["input_ids"]
        from services.trainer.vision import open_image

        out = self.vision.processor(
            text=[text], images=[[open_image(b) for b in images]], add_special_tokens=False, return_tensors="np"
        )
        return out["input_ids"][0].tolist()

    def example(self, row: dict) -> tuple[Example | None, str, bool]:
        """(example, "", truncated) or (None, reason, False)."""
        from jinja2 import TemplateError

        messages, why = to_messages(row, self.input_key, self.output_key)
        if messages is None:
            return None, why, False
        tools, why = row_tools(row, self.tools_key)
        if why:
            return None, why, False
        images, why = self._images(row, messages)
        if images is None:
            return None, why, False
        if images:  # {"type": "image"}: the part VLM chat templates render as the model's own placeholder
            messages = inline_parts(messages, [{"type": "image"}] * len(images))
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
        except TemplateError as exc:
            return None, f"chat template error ({exc.message})", False
        ids = self._ids(text, images)
        mask = response_mask(ids, self.markers, self.last_turn_only)
        if not mask.any():
            return None, "no response tokens", False
        truncated = len(ids) > self.max_len
        cut = self.max_len
        if truncated and images:
            from services.trainer.vision import cut_at_whole_image

            cut, images = cut_at_whole_image(ids, cut, images, self.vision)
        ids, mask = ids[:cut], mask[:cut]
        if not mask[1:].any():  # token 0 is never a target (nothing predicts it)
            return None, "response past --data.max_len", False
        return Example(np.asarray(ids, dtype=np.int64), mask, images), "", truncated

    def build(self, rows: list[dict], flag: str) -> tuple[list[Example], DataReport]:
        report = DataReport(rows=len(rows))
        out = []
        for row in rows:
            ex, why, truncated = self.example(row)
            if ex is None:
                report.dropped[why] += 1
                continue
            report.truncated += truncated
            out.append(ex)
        report.used = len(out)
        unrendered = 0 if self.tools_key else sum(bool(row.get(TOOLS_COLUMN)) for row in rows)
        if unrendered:
            # The model would learn tool calls without the schemas it is later prompted with (RL, serving).
            log.warning(
                "%s: %d rows hold a %r column that is not rendered into the prompt; pass --data.tools_key %s",
                flag,
                unrendered,
                TOOLS_COLUMN,
                TOOLS_COLUMN,
            )
        if not out:
            # The hint follows the cause: rows that all lost their response to the cut need a longer
            # --data.max_len, not other keys.
            fix = "check --data.input_key/--data.output_key against the dataset's columns"
            if set(report.dropped) == {"response past --data.max_len"}:
                fix = f"raise --data.max_len ({self.max_len}): every response starts past it"
            raise ValueError(f"{report.summary(flag)}: no usable row ({fix})")
        return out, report


def check_renders_tools(tokenizer, tools_key: str) -> None:
    """A template that ignores ``tools=`` would drop every row's schemas without a word: refuse it."""
    chat = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
    bare = tokenizer.apply_chat_template(chat, tokenize=False)
    if tokenizer.apply_chat_template(chat, tools=[tool], tokenize=False) == bare:
        raise ValueError(
            f"--data.tools_key {tools_key}: the chat template renders no tools (it ignores tools=); "
            "pass --data.tokenizer_chat_template with one that does, or drop the flag"
        )


def collate(
    examples: list[Example],
    pad_id: int,
    *,
    packed: bool = False,
    pad_to: int | None = None,
    share_prefix: bool = False,
) -> dict:
    """A model batch with ``labels`` (-100 where not supervised), padded right or packed into one row. Packed
    with ``share_prefix``, a common token prefix of the samples is laid out once (``shared_prefix_row``)."""
    if packed and share_prefix and len(examples) > 1:
        # Each sample keeps at least one token of its own after the shared part.
        prefix = min(common_prefix_len([e.input_ids for e in examples]), min(e.num_tokens for e in examples) - 1)
        if prefix > 0:
            return shared_prefix_row(examples, prefix, pad_id, pad_to)
    if packed:
        ids = np.concatenate([e.input_ids for e in examples])
        labels = np.concatenate([np.where(e.loss_mask, e.input_ids, -100) for e in examples])
        pos = np.concatenate([np.arange(e.num_tokens) for e in examples])
        # The first token of each sample is never a target (it would be predicted across the boundary).
        starts = np.cumsum([0] + [e.num_tokens for e in examples[:-1]])
        labels[starts] = -100
        n = max(len(ids), pad_to or 0)
        pad = n - len(ids)
        # Padding continues the position count, so it reads as part of the last sample (its labels are -100).
        pos = np.concatenate([pos, np.arange(pos[-1] + 1, pos[-1] + 1 + pad)])
        return {
            "input_ids": torch.tensor(np.pad(ids, (0, pad), constant_values=pad_id))[None],
            "labels": torch.tensor(np.pad(labels, (0, pad), constant_values=-100))[None],
            "position_ids": torch.tensor(pos)[None],
        }
    n = max(max(e.num_tokens for e in examples), pad_to or 0)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    attn = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        t = e.num_tokens
        ids[i, :t] = torch.from_numpy(e.input_ids)
        labels[i, :t] = torch.from_numpy(np.where(e.loss_mask, e.input_ids, -100))
        attn[i, :t] = 1
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def shared_prefix_row(examples: list[Example], prefix: int, pad_id: int, pad_to: int | None) -> dict:
    """One row ``[prefix, rest_1, rest_2, ...]`` under a 4-D mask: each sample's tokens see the shared prefix
    and their own earlier tokens, at the positions they had alone, so every logit equals the unpacked one
    while the prefix (system prompt, template header) runs once. Supervised positions come as ``flat_index``
    (position k predicts token k + 1; a prefix position may serve several samples) and ``targets``."""
    width = max(prefix + sum(e.num_tokens - prefix for e in examples), pad_to or 0)
    ids = np.full(width, pad_id, dtype=np.int64)
    pos = np.zeros(width, dtype=np.int64)
    mask = np.zeros((width, width), dtype=bool)
    wheres = fill_row(ids, pos, mask, [e.input_ids for e in examples], prefix)
    flat, targets = [], []
    for e, where in zip(examples, wheres, strict=True):
        k = np.flatnonzero(e.loss_mask[1:])
        flat.append(where[k])
        targets.append(e.input_ids[k + 1])
    return {
        "input_ids": torch.from_numpy(ids)[None],
        "position_ids": torch.from_numpy(pos)[None],
        "attention_mask": torch.from_numpy(mask)[None, None],
        "flat_index": torch.from_numpy(np.concatenate(flat).astype(np.int64)),
        "targets": torch.from_numpy(np.concatenate(targets).astype(np.int64)),
    }
