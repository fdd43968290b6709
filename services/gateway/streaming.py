"""The text of a streamed turn as the pod generates it (the wires' SSE encoders read it).

The pod sends a streamed call's tokens after each engine step (services/rollout/stream.py); they are queued
here and decoded into text the client may already see. Text that may still change is held back until the
turn's result: an unfinished UTF-8 character, a ``<tool_call>`` block when the request offers tools (it becomes
structured tool calls) and a stop string (it is cut), or the start of either at the end of the text so far. With a
template that has think blocks, the reasoning is held until its block closes, then kept apart (``reasoning``) from
the text. A "raw" session's text streams as generated (services/gateway/session.py, ``replies``). The turn's
result is built from the pod's final answer exactly as for a call that is not streamed, so what a client assembles
from the pieces plus the rest is the non-streamed content, and usage and the captured trajectory are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.chat import ChatModel, split_reasoning

HELD = ("<tool_call>",)


class TextFeed:
    def __init__(self, model: ChatModel, stop: list[str] | None, tools: bool = False, raw: bool = False) -> None:
        self.model, self.raw = model, raw
        self.markers = [*(HELD if tools and not raw else ()), *(s for s in stop or () if s)]
        self.ids: list[int] = []
        self.sent = ""
        self.reasoning = ""
        """The reply's think block, once it has closed (templates that have them)."""
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()

    def push(self, token_ids: list[int], logprobs: list[float]) -> None:
        """The pod's new tokens (called by the pod channel, on the loop)."""
        self.queue.put_nowait(token_ids)

    def close(self, *_: object) -> None:
        """No more tokens (the turn is over, or failed): ``pieces`` ends."""
        self.queue.put_nowait(None)

    async def pieces(self) -> AsyncIterator[str]:
        """New text the client may see, as it comes; ends when the turn does."""
        done = False
        while not done:
            ids = await self.queue.get()
            while True:  # a slow reader: everything queued so far in one piece
                if ids is None:
                    done = True
                    break
                self.ids.extend(ids)
                if self.queue.empty():
                    break
                ids = self.queue.get_nowait()
            piece = self._safe()
            if piece:
                yield piece

    def _safe(self) -> str:
        text = self.model.decode(self.ids, skip_special=True)
        if self.model.thinks and not self.raw:
            head = text.lstrip()
            if not head or "<think>".startswith(head[:7]) and "</think>" not in text:
                return ""  # thinking (or about to): held until the block closes
            self.reasoning, text = split_reasoning(text)
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        for marker in self.markers:
            at = text.find(marker)
            if at >= 0:
                end = min(end, at)
            for k in range(len(marker) - 1, 0, -1):
                if text.endswith(marker[:k]):
                    end = min(end, len(text) - k)
                    break
        if end <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) : end], text[:end]
        return piece

    def rest(self, content: str) -> str:
        """What of the turn's final ``content`` the client has not seen yet ("" where what was sent is not its
        prefix: whitespace around tool-call blocks that the parse trims)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""
