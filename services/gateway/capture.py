"""Token-in/token-out accumulation of one session (the TITO capture), independent of any wire.

A session holds segments. A segment is the exact token sequence the pod saw plus the spans the pod
generated; nothing the pod generated is ever re-tokenized. A chat turn either *extends* the current
segment or *starts* a new one:

- extends: the request repeats the previous request's messages, then the assistant reply we returned
  (canonical equality), then one or more new messages, with the same tools; and the template render of
  the history through that reply is a string prefix of the render of the whole request. The masked delta
  is ``tail + full[len(through_reply):]``: ALL new messages (several tool results, tool + user), where
  ``tail`` is whatever the template renders after the generated text of the reply (e.g. the newline
  after an end-of-turn token the model generated, or the end-of-turn marker itself after a length stop).
- otherwise (first turn, compaction, edited history, a template that rewrites earlier turns): the
  current segment is sealed and a new one starts from the full render.

Planning is pure (it reads the session, renders and tokenizes); ``commit`` mutates the session and is
called only after the pod answered, so a failed or retried turn leaves no trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from molt.schema import Segment
from services.gateway.chat import ChatModel, bad_request, same_message
from services.gateway.errors import GatewayError
from services.gateway.pods import Generation


@dataclass
class SegmentState:
    token_ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    truncated: bool = False
    reason: str = "first"

    def to_segment(self) -> Segment:
        return Segment(token_ids=self.token_ids, action_spans=self.spans or [], logprobs=self.logprobs,
                       versions=self.versions)


@dataclass
class ChatState:
    """What the prefix test of the next chat turn compares against."""

    messages: list[dict]
    tools: list[dict] | None
    full_render: str
    reply: dict
    generated_text: str


@dataclass
class TurnPlan:
    prompt_ids: list[int]
    """Everything the pod is sent: the segment so far plus the delta, or a new segment's prompt."""
    delta_ids: list[int]
    new_segment: bool
    reason: str
    full_render: str = ""
    messages: list[dict] | None = None
    tools: list[dict] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Capture:
    max_length: int
    segments: list[SegmentState] = field(default_factory=list)
    chat: ChatState | None = None
    completion_text: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def current(self) -> SegmentState | None:
        return self.segments[-1] if self.segments else None

    def num_tokens(self) -> int:
        return len(self.current.token_ids) if self.current else 0

    def remaining(self, prompt_len: int) -> int:
        return self.max_length - prompt_len

    # ---- planning

    def plan_chat(self, model: ChatModel, messages: list[dict], tools: list[dict] | None,
                  key: str | None = None) -> TurnPlan:
        """``key``: the request's ``request_key``; a first turn's render and tokens are cached by it."""
        cur, st = self.current, self.chat
        if cur is None and key is not None:
            full, ids = model.prompt(key, messages, tools)
            return TurnPlan(ids, ids, True, "first", full, messages, tools)
        full = model.render(messages, tools, generation_prompt=True)
        reason = "first" if cur is None else "history_rewrite"
        if cur is not None and st is not None and tools == st.tools:
            k = len(st.messages)
            if (len(messages) > k + 1 and same_message(messages[k], st.reply)
                    and all(same_message(a, b) for a, b in zip(messages[:k], st.messages))):
                through = model.render(messages[: k + 1], tools, generation_prompt=False)
                if full.startswith(through):
                    reply_text = through[len(st.full_render):] if through.startswith(st.full_render) else ""
                    tail = reply_text[len(st.generated_text):] if reply_text.startswith(st.generated_text) else ""
                    delta = model.encode(tail + full[len(through):])
                    return TurnPlan(cur.token_ids + delta, delta, False, "extend", full, messages, tools)
                reason = "template_rewrite"
        ids = model.encode(full)
        return TurnPlan(ids, ids, True, reason, full, messages, tools)

    def plan_tokens(self, model: ChatModel, messages: list[dict] | None, append_text: str | None,
                    append_ids: list[int] | None) -> TurnPlan:
        cur = self.current
        delta = (model.encode(append_text) if append_text else []) + list(append_ids or [])
        if messages is not None:
            if cur is not None:
                raise bad_request("'messages' is for the first turn only; later turns send 'append_text' or "
                                  "'append_token_ids'", "messages")
            ids = model.encode(model.render(messages, None, generation_prompt=True)) + delta
            return TurnPlan(ids, ids, True, "first")
        if cur is None:
            if not delta:
                raise bad_request("the first turn needs 'messages' (or a raw prompt in 'append_text' / "
                                  "'append_token_ids')", "messages")
            return TurnPlan(delta, delta, True, "first")
        return TurnPlan(cur.token_ids + delta, delta, False, "extend")

    def plan_completion(self, model: ChatModel, prompt: str | list[int]) -> TurnPlan:
        cur = self.current
        if isinstance(prompt, list):
            if cur is not None and self.completion_text is None and prompt[: len(cur.token_ids)] == cur.token_ids:
                delta = prompt[len(cur.token_ids):]
                return TurnPlan(cur.token_ids + delta, delta, False, "extend")
            return TurnPlan(list(prompt), list(prompt), True, "first" if cur is None else "history_rewrite")
        prev = self.completion_text
        if cur is not None and prev is not None and prompt.startswith(prev):
            delta = model.encode(prompt[len(prev):])
            return TurnPlan(cur.token_ids + delta, delta, False, "extend")
        ids = model.encode(prompt)
        return TurnPlan(ids, ids, True, "first" if cur is None else "history_rewrite")

    # ---- committing (only after the pod answered)

    def commit(self, plan: TurnPlan, gen: Generation, events: list[dict]) -> SegmentState:
        if plan.new_segment:
            self.segments.append(SegmentState(list(plan.prompt_ids), reason=plan.reason))
        else:
            assert self.current is not None
            self.current.token_ids.extend(plan.delta_ids)
        seg = self.current
        assert seg is not None and len(seg.token_ids) == len(plan.prompt_ids)
        if gen.token_ids:
            start = len(seg.token_ids)
            seg.token_ids.extend(gen.token_ids)
            seg.spans.append((start, len(seg.token_ids)))
            seg.logprobs.extend(gen.logprobs)
            seg.versions.extend([gen.policy_version] * len(gen.token_ids))
        seg.truncated |= gen.finish_reason == "length"
        self.events.extend(events)
        self.chat = None
        self.completion_text = None
        return seg

    def check_room(self, plan: TurnPlan, hard: bool) -> int:
        """Tokens left for generation; with ``hard`` a full context is a 400 (chat wires)."""
        remaining = self.remaining(plan.num_tokens)
        if remaining <= 0 and hard:
            if self.current is not None and not plan.new_segment:
                self.current.truncated = True
            raise GatewayError(400, f"this turn needs {plan.num_tokens} tokens of context, the session allows "
                                    f"{self.max_length}: compact the history or open the session with a larger "
                                    "max_length", code="context_length_exceeded", param="messages")
        return remaining

    def trainable_segments(self) -> list[Segment]:
        return [s.to_segment() for s in self.segments if s.spans]
