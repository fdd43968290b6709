"""The text of a streamed turn as the pod generates it (the wires' SSE encoders read it).

The pod sends a streamed call's tokens after each engine step (services/rollout/stream.py); they are queued
here and decoded into text the client may already see. Text that may still change is held back until the
turn's result: an unfinished UTF-8 character, a ``<tool_call>`` block when the request offers tools (it becomes
structured tool calls) and a stop string (it is cut), or the start of either at the end of the text so far. With a
template that has think blocks, a reply's think block (from its start, or where the prompt opened it:
services/gateway/thinking.py) is kept apart from the text: ``parts`` streams its text as it comes (less trailing
whitespace, which the final reasoning drops, and the start of ``</think>``), ``pieces`` leaves it out
(``reasoning`` holds it whole once the block has closed). A "raw" session's text streams as generated
(services/gateway/session.py, ``replies``). The turn's result is built from the pod's final answer exactly as for
a call that is not streamed, so what a client assembles from the pieces plus the rest is the non-streamed content
(and reasoning), and usage and the captured trajectory are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.chat import ChatModel
from services.gateway.thinking import CLOSE, OPEN, split_reasoning

HELD = ("<tool_call>",)


class TextFeed:
    def __init__(
        self, model: ChatModel, stop: list[str] | None, tools: bool = False, raw: bool = False, opened: bool = False
    ) -> None:
        self.model, self.raw = model, raw
        self.opened = opened
        """The prompt opened a think block (``prompt_opened``): the reply starts as reasoning."""
        self.stops = [s for s in stop or () if s]
        self.markers = [*(HELD if tools and not raw else ()), *self.stops]
        self.ids: list[int] = []
        self.sent = ""
        self.reasoning = ""
        """The reply's think block, once it has closed (templates that have them)."""
        self.thought = ""
        """What of the think block ``parts`` has sent."""
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()

    def push(self, token_ids: list[int], logprobs: list[float]) -> None:
        """The pod's new tokens (called by the pod channel, on the loop)."""
        self.queue.put_nowait(token_ids)

    def prompt_opened(self, opened: bool) -> None:
        """Whether the turn's prompt opened a think block (called by the turn, before its first tokens)."""
        self.opened = opened

    def close(self, *_: object) -> None:
        """No more tokens (the turn is over, or failed): ``pieces`` ends."""
        self.queue.put_nowait(None)

    async def parts(self) -> AsyncIterator[tuple[str, str]]:
        """New reasoning and text the client may see, as they come: ``("reasoning", piece)`` while the think
        block is open and once as it closes (then its piece may be empty: the block is all out), then
        ``("text", piece)``; ends when the turn does."""
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
            for part in self._safe():
                yield part

    async def pieces(self) -> AsyncIterator[str]:
        """New text the client may see, as it comes (not the reasoning: ``reasoning`` once its block closes)."""
        async for kind, piece in self.parts():
            if kind == "text":
                yield piece

    def _safe(self) -> list[tuple[str, str]]:
        text = self.model.decode(self.ids, skip_special=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:  # the turn's result ends there (the pod may run past it), think block or not
            text = text[: min(cuts)]
        out: list[tuple[str, str]] = []
        if (self.model.thinks or self.opened) and not self.raw:
            head = text.lstrip()
            if CLOSE not in text and (self.opened or OPEN.startswith(head[: len(OPEN)])):
                # thinking (or about to): what of the block cannot change yet, as split_reasoning will read it
                if head.startswith(OPEN):
                    shown = head[len(OPEN) :].lstrip()
                else:  # where the prompt opened the block, a reply may still open it again (the tag is dropped)
                    shown = head if self.opened and not OPEN.startswith(head) else ""
                shown = shown[: _held(shown, [*self.stops, CLOSE])]
                while shown != (cut := shown.rstrip().rstrip("\ufffd")):
                    shown = cut
                return [("reasoning", self._more_thought(shown))] if len(shown) > len(self.thought) else []
            reasoning, text = split_reasoning(text, self.opened)
            if reasoning and not self.reasoning:
                out.append(("reasoning", self._more_thought(reasoning)))
            self.reasoning = reasoning
        end = _held(text, self.markers)
        if end > len(self.sent):
            piece, self.sent = text[len(self.sent) : end], text[:end]
            out.append(("text", piece))
        return out

    def _more_thought(self, shown: str) -> str:
        """What of ``shown`` (the think block so far) ``parts`` has not sent ("" where it does not extend it)."""
        if not shown.startswith(self.thought):
            return ""
        piece, self.thought = shown[len(self.thought) :], shown
        return piece

    def rest(self, content: str) -> str:
        """What of the turn's final ``content`` the client has not seen yet ("" where what was sent is not its
        prefix: whitespace around tool-call blocks that the parse trims)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


def _held(text: str, markers: list[str]) -> int:
    """How much of ``text`` cannot change any more: up to an unfinished character at its end, a marker, or the
    start of one at its end."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for marker in markers:
        at = text.find(marker)
        if at >= 0:
            end = min(end, at)
        for k in range(len(marker) - 1, 0, -1):
            if text.endswith(marker[:k]):
                end = min(end, len(text) - k)
                break
    return end
