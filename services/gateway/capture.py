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

Images (vision-language models): the pod takes one image token per image and answers with the prompt as the
model saw it, each image token expanded. A segment with images keeps both: ``token_ids`` (what the model
saw, what is recorded) and ``wire_ids`` (the same with one token per image, what the next turn sends),
plus the sha256 of its images in order; every turn resends the segment's images with the new ones.

Planning is pure (it reads the session, renders and tokenizes); ``commit`` mutates the session and is
called only after the pod answered, so a failed or retried turn leaves no trace.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from molt.schema import Segment
from services.gateway.chat import ChatModel, bad_request, message_images, same_message
from services.gateway.errors import ContextLengthExceeded, GatewayError
from services.gateway.pods import Generation


@dataclass
class SegmentState:
    token_ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    truncated: bool = False
    reason: str = "first"
    wire_ids: list[int] | None = None
    """With images: the segment as sent to the pod (one token per image); None: the same as token_ids."""
    images: list[str] = field(default_factory=list)
    """sha256 of the segment's images, in token order."""
    routed_experts: np.ndarray | None = None
    """int16 [tokens, layers, top_k] MoE routing of the segment (-1: not recorded), when the pods return it: each
    turn's answer covers its whole prompt, which is the segment so far, so the latest one replaces the last."""
    top_ids: np.ndarray | None = None
    """int32 [action tokens, K]: the sampler's K most likely tokens at each action token, best first
    (--rollout.top_logprobs); None when not recorded for every action token of the segment."""
    top_logprobs: np.ndarray | None = None
    """float32 [action tokens, K]: their logprobs (-inf pads a row the pod returned short)."""
    plain: bool = True
    """Every turn of the segment sampled from the model's own distribution (``rescore.plain_sampling``): its
    decode logprobs then mean what a prefill pass computes (--rollout.rescore_logprobs)."""

    @property
    def sent_ids(self) -> list[int]:
        return self.token_ids if self.wire_ids is None else self.wire_ids

    def to_segment(self) -> Segment:
        return Segment(
            token_ids=np.asarray(self.token_ids, dtype="<i4"),
            action_spans=np.asarray(self.spans or [], dtype="<i4"),
            logprobs=np.asarray(self.logprobs, dtype="<f4"),
            versions=np.asarray(self.versions, dtype="<i4"),
            routed_experts=self.routed_experts,
            images=list(self.images),
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
        )

    def extend_top(self, acted: int, rows: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Append a turn's top-k ``rows`` after the segment's first ``acted`` action tokens. Both or neither per
        segment: a turn without rows (or after earlier tokens without them) leaves the segment with none, and
        rows of another K (a session adopted from a replica with another flag) keep the narrower, best first."""
        if rows is None or (acted and self.top_ids is None):
            self.top_ids = self.top_logprobs = None
        elif not acted or self.top_ids is None or self.top_logprobs is None:
            self.top_ids, self.top_logprobs = rows
        else:
            k = min(self.top_ids.shape[1], rows[0].shape[1])
            self.top_ids = np.concatenate([self.top_ids[:, :k], rows[0][:, :k]])
            self.top_logprobs = np.concatenate([self.top_logprobs[:, :k], rows[1][:, :k]])


_PAD = [[0, -np.inf]]


def top_rows(raw: object, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` rows of a pod's ``top_logprobs`` (per token, ``[id, logprob]`` pairs best first) as int32
    / float32 [n, k]; a row shorter than ``k`` (tokens the sampling settings rule out are left out) is padded
    with id 0 and -inf. Raises ValueError for rows that are not that (the pod's answer is then not recorded)."""
    if not isinstance(raw, list) or len(raw) < n:
        raise ValueError(f"{len(raw) if isinstance(raw, list) else 0} top_logprobs rows for {n} tokens")
    try:  # one conversion in C for the whole turn; the pairs' shape and types are checked by it
        rows = [r[:k] if len(r) >= k else r + _PAD * (k - len(r)) for r in raw[:n]]
        pairs = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed top_logprobs: {exc}") from None
    if pairs.shape != (n, k, 2):
        raise ValueError(f"top_logprobs rows of shape {pairs.shape[1:]}, not {k} [id, logprob] pairs")
    ids, lps = pairs[..., 0], pairs[..., 1]
    if n and not (ids.min() >= 0 and (ids == np.floor(ids)).all() and lps.max() <= 1e-4 and not np.isnan(lps).any()):
        raise ValueError("top_logprobs rows need token ids >= 0 and logprobs <= 0")
    return ids.astype(np.int32), lps.astype(np.float32)


def _fit_rows(rows: np.ndarray, tokens: int) -> np.ndarray:
    """``rows`` cut or padded with -1 (live routing) to ``tokens`` rows: a stop string cuts the generated tokens
    after the pod recorded them, and the last generated token may have no row (no forward computed it)."""
    if rows.shape[0] >= tokens:
        return rows[:tokens]
    return np.concatenate([rows, np.full((tokens - rows.shape[0], *rows.shape[1:]), -1, np.int16)])


@dataclass
class ChatState:
    """What the prefix test of the next chat turn compares against. After a prefill turn, ``messages`` is the
    conversation before the prefill, ``full_render`` ends with the prefill (the open render) and ``reply`` is
    prefill + continuation as one message, as the client sends it back."""

    messages: list[dict]
    tools: list[dict] | None
    full_render: str
    reply: dict
    generated_text: str


def reply_tail(model: ChatModel, st: ChatState, through: str) -> str | None:
    """What the template renders after the generated text of the last reply, up to the next message.

    Exact when the render of the reply starts with the generated text. A client may echo the reply in a form
    that renders differently (tool-call arguments re-serialised, keys reordered: the same message by JSON), or
    the template may write tool calls its own way: then the tail is the template's closing of an assistant
    turn (``<|im_end|>\n``) minus the end of it the model generated itself (``<|im_end|>``). None when the
    render does not end with that closing: the caller starts a new segment rather than guess."""
    gen = st.generated_text
    if through.startswith(st.full_render) and through.startswith(gen, len(st.full_render)):
        return through[len(st.full_render) + len(gen) :]
    closing = model.assistant_closing(st.messages, st.tools)
    if closing is None or not through.endswith(closing):
        return None
    for k in range(len(closing), 0, -1):
        if closing[:k].strip() and gen.endswith(closing[:k]):
            return closing[k:]
    return closing


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
    images: list[dict] = field(default_factory=list)
    """Image parts of the pod prompt, in token order: the segment's own (when extending), then the new ones."""
    new_images: int = 0
    """How many of ``images`` this turn adds (the last ones)."""
    image_tokens: int = 0
    """Tokens the pod's expansion of ``images`` adds to ``prompt_ids``: exact for the segment's own images (it
    holds them expanded), estimated for the new ones (``ImageExpansion``)."""

    @property
    def image_files(self) -> list[str]:
        """The pod prompt's image files, base64."""
        return [p["data"] for p in self.images]

    @property
    def num_tokens(self) -> int:
        """The prompt's length as the model sees it (images expanded)."""
        return len(self.prompt_ids) + self.image_tokens


def _without_images(message: dict) -> dict:
    """``message`` with its image parts left out (its text parts kept, in order)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [p for p in content if p.get("type") != "image"]}


def _images_for(model: ChatModel, messages: list[dict]) -> list[dict]:
    """The image parts of ``messages``; a 400 when the model takes none."""
    images = message_images(messages)
    if images and model.image_token_id is None:
        raise GatewayError(
            400,
            "this model takes no images (it is a text-only model); send text only",
            code="images_unsupported",
            param="messages",
        )
    return images


@dataclass
class Capture:
    max_length: int
    segments: list[SegmentState] = field(default_factory=list)
    chat: ChatState | None = None
    completion_text: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    image_data: dict[str, str] = field(default_factory=dict)
    """Image files of the session (base64) by sha256, each stored once."""

    @property
    def current(self) -> SegmentState | None:
        return self.segments[-1] if self.segments else None

    def num_tokens(self) -> int:
        return len(self.current.token_ids) if self.current else 0

    def remaining(self, prompt_len: int) -> int:
        return self.max_length - prompt_len

    # ---- planning

    def _count_images(self, model: ChatModel, plan: TurnPlan) -> TurnPlan:
        """``plan`` with ``image_tokens`` set: what the segment's images already add, plus the estimate for the
        new ones, so the room check counts the prompt the model will see."""
        if plan.images:
            plan.image_tokens = self._segment_image_tokens(plan) + plan.new_images * model.image_expansion.estimate
        return plan

    def _segment_image_tokens(self, plan: TurnPlan) -> int:
        """What the images of the segment ``plan`` extends add to it (0 for a new segment)."""
        cur = self.current
        return len(cur.token_ids) - len(cur.sent_ids) if cur is not None and not plan.new_segment else 0

    def plan_chat(
        self,
        model: ChatModel,
        messages: list[dict],
        tools: list[dict] | None,
        key: str | None = None,
        drop_new_images: bool = False,
        prefill: bool = False,
    ) -> TurnPlan:
        """``key``: the request's ``request_key``; a first turn's render and tokens are cached by it.
        ``prefill``: the final (assistant) message is rendered open and its text is prompt, which the reply
        continues (``full_render`` ends with it).
        ``drop_new_images``: a turn that extends the segment leaves out the images of its new messages (their
        image parts are not rendered); the record of what the client sent (``full_render``) keeps them, so the
        client's next turn, which repeats them in its history, still extends the segment."""
        return self._count_images(model, self._plan_chat(model, messages, tools, key, drop_new_images, prefill))

    def _plan_chat(
        self,
        model: ChatModel,
        messages: list[dict],
        tools: list[dict] | None,
        key: str | None,
        drop_new: bool,
        prefill: bool,
    ) -> TurnPlan:
        cur, st = self.current, self.chat
        images = _images_for(model, messages)
        if cur is None and key is not None:
            full, ids = model.prompt(key, messages, tools, prefill)
            return TurnPlan(ids, ids, True, "first", full, messages, tools, images, len(images))
        full = model.render(messages, tools, generation_prompt=True, prefill=prefill)
        reason = "first" if cur is None else "history_rewrite"
        if cur is not None and st is not None and tools == st.tools:
            k = len(st.messages)
            if (
                len(messages) > k + 1
                and same_message(messages[k], st.reply)
                and all(same_message(a, b) for a, b in zip(messages[:k], st.messages))
            ):
                through = model.render(messages[: k + 1], tools, generation_prompt=False)
                if full.startswith(through):
                    tail = reply_tail(model, st, through)
                    if tail is not None:
                        new = message_images(messages[k + 1 :])
                        shown = full
                        if drop_new and new:
                            rest = [_without_images(m) for m in messages[k + 1 :]]
                            stripped = model.render(messages[: k + 1] + rest, tools, True, prefill)
                            if stripped.startswith(through):  # else the template rewrote history: keep them
                                shown, new = stripped, []
                        delta = model.encode(tail + shown[len(through) :])
                        return TurnPlan(
                            cur.sent_ids + delta,
                            delta,
                            False,
                            "extend",
                            full,
                            messages,
                            tools,
                            self._segment_images(cur) + new,
                            len(new),
                        )
                    reason = "unknown_tail"
                else:
                    reason = "template_rewrite"
        ids = model.encode(full)
        return TurnPlan(ids, ids, True, reason, full, messages, tools, images, len(images))

    def _segment_images(self, seg: SegmentState) -> list[dict]:
        return [{"type": "image", "sha256": d, "data": self.image_data[d]} for d in seg.images]

    def plan_tokens(
        self,
        model: ChatModel,
        messages: list[dict] | None,
        append_text: str | None,
        append_ids: list[int] | None,
        images: list[dict] | None = None,
        append_only: bool = False,
        drop_images: bool = False,
    ) -> TurnPlan:
        """``images``: the image parts of the appended input, one per image token in it, in order. An append-only
        turn (nothing generated, so no pod expands them) drops its images and their image tokens, as Molt drops
        the images of feedback that does not fit; ``drop_images`` drops them (and their image tokens) from any
        appended input. A first turn's ``messages`` keep theirs."""
        return self._count_images(
            model, self._plan_tokens(model, messages, append_text, append_ids, images, append_only or drop_images)
        )

    def _plan_tokens(
        self,
        model: ChatModel,
        messages: list[dict] | None,
        append_text: str | None,
        append_ids: list[int] | None,
        images: list[dict] | None,
        drop_images: bool,
    ) -> TurnPlan:
        cur = self.current
        delta = (model.encode(append_text) if append_text else []) + list(append_ids or [])
        new = list(images or [])
        if new and messages is not None:
            raise bad_request(
                "'images' go with 'append_text' / 'append_token_ids'; in 'messages' use image parts", "images"
            )
        if new:
            _images_for(model, [{"content": new}])  # a 400 for a text-only model
        token = model.image_token_id
        if drop_images:
            delta, new = [t for t in delta if t != token], []
        elif new or (token is not None and token in delta):
            assert token is not None  # _images_for refused images for a text-only model
            if delta.count(token) != len(new):
                raise GatewayError(
                    400,
                    f"the appended input holds {delta.count(token)} image tokens (the model's "
                    f"{model.decode([token], skip_special=False)!r}) and 'images' {len(new)} images: send one image "
                    "per image token, in order",
                    code="image_placeholder_mismatch",
                    param="images",
                )
        if messages is not None:
            if cur is not None:
                raise bad_request(
                    "'messages' is for the first turn only; later turns send 'append_text' or 'append_token_ids'",
                    "messages",
                )
            images = _images_for(model, messages)
            ids = model.encode(model.render(messages, None, generation_prompt=True)) + delta
            return TurnPlan(ids, ids, True, "first", images=images, new_images=len(images))
        if cur is None:
            if not delta:
                raise bad_request(
                    "the first turn needs 'messages' (or a raw prompt in 'append_text' / 'append_token_ids')",
                    "messages",
                )
            return TurnPlan(delta, delta, True, "first", images=new, new_images=len(new))
        return TurnPlan(
            cur.sent_ids + delta, delta, False, "extend", images=self._segment_images(cur) + new, new_images=len(new)
        )

    def plan_completion(self, model: ChatModel, prompt: str | list[int]) -> TurnPlan:
        return self._count_images(model, self._plan_completion(model, prompt))

    def _plan_completion(self, model: ChatModel, prompt: str | list[int]) -> TurnPlan:
        cur = self.current
        if isinstance(prompt, list):
            if (
                cur is not None
                and self.completion_text is None
                and not cur.images
                and prompt[: len(cur.token_ids)] == cur.token_ids
            ):
                delta = prompt[len(cur.token_ids) :]
                return TurnPlan(cur.token_ids + delta, delta, False, "extend")
            return TurnPlan(list(prompt), list(prompt), True, "first" if cur is None else "history_rewrite")
        prev = self.completion_text
        if cur is not None and prev is not None and prompt.startswith(prev):
            delta = model.encode(prompt[len(prev) :])
            return TurnPlan(cur.sent_ids + delta, delta, False, "extend", images=self._segment_images(cur))
        ids = model.encode(prompt)
        return TurnPlan(ids, ids, True, "first" if cur is None else "history_rewrite")

    # ---- committing (only after the pod answered)

    def fit(self, model: ChatModel, plan: TurnPlan, gen: Generation, hard: bool) -> Generation | None:
        """The pod's answer held to the session's ``max_length``. With images, the prompt's expanded length is
        known only from the answer: it teaches ``model.image_expansion``, and tokens an estimate let past
        ``max_length`` are cut off (finish "length"), so no recorded segment is longer than the session allows.
        A prompt that alone fills the context is check_room's case: a 400 when ``hard``, else None (the caller
        decides: drop the turn's images, or finish "length" with nothing committed)."""
        seen = gen.extra.get("prompt_token_ids") if plan.images else None
        if seen is None:
            return gen
        if not self.expanded(model, plan, len(seen), hard):
            return None
        room = self.remaining(len(seen))
        if len(gen.token_ids) <= room:
            return gen
        extra = dict(gen.extra)
        if isinstance(extra.get("top_logprobs"), list):
            extra["top_logprobs"] = extra["top_logprobs"][:room]
        return replace(
            gen, token_ids=gen.token_ids[:room], logprobs=gen.logprobs[:room], finish_reason="length", extra=extra
        )

    def expanded(self, model: ChatModel, plan: TurnPlan, length: int, hard: bool) -> bool:
        """``plan``'s prompt is ``length`` tokens with its images expanded (the pod's answer, or its refusal of a
        prompt past its own context): learn the new images' run from it, and say whether the turn has room left
        (False; a 400 when ``hard``)."""
        known = self._segment_image_tokens(plan)
        model.image_expansion.note(length - len(plan.prompt_ids) - known, plan.new_images)
        plan.image_tokens = length - len(plan.prompt_ids)
        return self.check_room(plan, hard) > 0

    def commit(self, plan: TurnPlan, gen: Generation, events: list[dict], top_k: int = 0) -> SegmentState:
        """``top_k``: record the pod's K most likely tokens at each generated token (--rollout.top_logprobs)."""
        seen = gen.extra.get("prompt_token_ids") if plan.images else None
        if plan.images and seen is None and gen.token_ids:
            raise GatewayError(
                502, "the rollout pod did not return the expanded prompt of a request with images", code="pod_error"
            )
        top = None
        if top_k and gen.token_ids:
            # The rows of the tokens kept: a stop string or the session's max_length cut a prefix of what the
            # pod sampled, and its rows are in the same order. Converted before anything is mutated.
            try:
                top = top_rows(gen.extra.get("top_logprobs"), len(gen.token_ids), top_k)
            except ValueError as exc:
                raise GatewayError(502, f"the rollout pod's answer is not recorded: {exc}", code="pod_error") from None
        new_digests = [p["sha256"] for p in plan.images[len(plan.images) - plan.new_images :]]
        if plan.new_segment:
            self.segments.append(
                SegmentState(
                    list(seen or plan.prompt_ids),
                    reason=plan.reason,
                    wire_ids=list(plan.prompt_ids) if seen else None,
                    images=new_digests,
                )
            )
        else:
            cur = self.current
            assert cur is not None
            if seen is not None:
                if seen[: len(cur.token_ids)] != cur.token_ids:
                    raise GatewayError(
                        502,
                        "the rollout pod expanded this segment's images differently from the "
                        "previous turn; the turn is not recorded",
                        code="pod_error",
                    )
                if cur.wire_ids is None:
                    cur.wire_ids = list(cur.token_ids)
                cur.wire_ids.extend(plan.delta_ids)
                cur.token_ids.extend(seen[len(cur.token_ids) :])
                cur.images.extend(new_digests)
            else:  # no images, or an append-only turn that never reached the pod (the delta has no images)
                if cur.wire_ids is not None:
                    cur.wire_ids.extend(plan.delta_ids)
                cur.token_ids.extend(plan.delta_ids)
        for part in plan.images:
            self.image_data.setdefault(part["sha256"], part["data"])
        seg = self.current
        assert seg is not None and len(seg.sent_ids) == len(plan.prompt_ids)
        if gen.token_ids:
            start = len(seg.token_ids)
            if seg.wire_ids is not None:
                seg.wire_ids.extend(gen.token_ids)
            seg.token_ids.extend(gen.token_ids)
            seg.spans.append((start, len(seg.token_ids)))
            if top is not None or seg.top_ids is not None:
                seg.extend_top(len(seg.logprobs), top)
            seg.logprobs.extend(gen.logprobs)
            seg.versions.extend([gen.policy_version] * len(gen.token_ids))
            seg.plain = seg.plain and gen.extra.get("plain") is True  # set where the turn's params are known
        if gen.routed_experts is not None:
            rows = _fit_rows(gen.routed_experts, len(seg.token_ids))
            if seg.routed_experts is not None:
                # As Molt (first writer wins): a token keeps the routing of the turn that produced it, under
                # which its logprobs were sampled; only rows earlier turns left to live routing (-1) are
                # taken from this turn's prefill.
                old = _fit_rows(seg.routed_experts, len(seg.token_ids))
                unset = (old == -1).reshape(len(old), -1).all(axis=1).reshape(-1, *[1] * (old.ndim - 1))
                rows = np.where(unset, rows, old)
            seg.routed_experts = rows
        elif seg.routed_experts is not None:  # this turn's pod returned none: the new tokens replay live routing
            seg.routed_experts = _fit_rows(seg.routed_experts, len(seg.token_ids))
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
            raise ContextLengthExceeded(
                plan.num_tokens,
                self.max_length,
                "this session's max_length",
                "compact the history or open the session with a larger max_length",
            )
        return remaining

    def trainable_segments(self) -> list[Segment]:
        return [s.to_segment() for s in self.segments if s.spans]

    def trainable_images(self) -> dict[str, bytes]:
        """The image files the trainable segments show, each once."""
        return {d: base64.b64decode(self.image_data[d]) for s in self.segments if s.spans for d in s.images}
