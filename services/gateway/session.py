"""A gateway session and a turn's result: the state one replica holds per episode (services/gateway/lifecycle.py
and core.py drive it; services/gateway/handoff.py parks it for another replica)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.capture import Capture

CONTEXT_FULL = ("error", "length")
"""A session's ``context_full`` choices (``Session.context_full``)."""
REPLIES = ("parsed", "raw")
"""A session's ``replies`` choices (``Session.replies``)."""


@dataclass
class TurnResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    text: str
    """Decoded generation without special tokens (what a client sees)."""
    raw_text: str
    """Decoded generation with special tokens kept (what the template saw)."""
    content: str
    tool_calls: list[dict]
    prompt_tokens: int
    num_tokens: int
    remaining_tokens: int
    pod_wait_s: float = 0.0
    cached: bool = False
    stop_sequence: str | None = None
    """The stop string that ended the generation (the text is cut before it), if one did."""
    reasoning: str = ""
    """The reply's think block (templates that have them), split out of ``content``."""
    top_logprobs: list | None = None
    """Per token, the pod's most likely ``[token id, logprob]`` pairs, best first (a request's ``top_logprobs``)."""
    prompt_text: str | None = None
    """A first turn's prompt as kept after ``truncate_prompt`` cut it (decoded, special tokens kept)."""
    prompt_tokens_dropped: int = 0

    @property
    def reply(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass(eq=False)
class Session:
    id: str
    owner: str | None
    group_id: str
    sample_index: int
    label: Any
    env_name: str
    env_version: str
    sampling_params: dict
    metadata: dict
    capture: Capture
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    pod: str | None = None
    state: str = "open"
    result: dict | None = None
    turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    finishing: asyncio.Event | None = None
    """Set while a finish holding ``lock`` writes this session (lifecycle.py): an abort waits for it, so its
    answer says what the stream holds."""
    last_key: str | None = None
    last_result: TurnResult | None = None
    closed_at: float = 0.0
    context_full: str = "error"
    """One of ``CONTEXT_FULL``: what a chat or completion turn gets when the context is full. "error": a 400
    context_length_exceeded (OpenAI's answer). "length": a 200 with no tokens and finish_reason "length", the
    segment marked truncated (Molt's answer to a ChatAgent, whose episode is then trained as truncated)."""
    replies: str = "parsed"
    """One of ``REPLIES``: how a chat turn's text comes back. "parsed" (vLLM's server): a think block apart
    (``reasoning_content`` / a thinking block) and, when the request offers tools, ``<tool_call>`` blocks as
    structured tool calls. "raw" (Molt's chat server, which its ChatAgents parse themselves): the text as
    generated, think and tool-call blocks inline, finish reason "stop"."""
    lease_s: float | None = None
    """A shorter idle TTL the client asked for (``lease_s`` at open) and renews while it holds the session
    (``POST /v1/sessions/{id}/renew``): a client that dies has its sessions closed this soon."""

    def summary(self) -> dict:
        cap = self.capture
        return {
            "session_id": self.id,
            "state": self.state,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "env_name": self.env_name,
            "turns": self.turns,
            "segments": len(cap.segments),
            "num_tokens": cap.num_tokens(),
            "action_tokens": sum(e - s for seg in cap.segments for s, e in seg.spans),
            "truncated": any(seg.truncated for seg in cap.segments),
            "max_length": cap.max_length,
            "pod": self.pod,
            "events": cap.events,
            "result": self.result,
            "metadata": self.metadata,
            "lease_s": self.lease_s,
        }
