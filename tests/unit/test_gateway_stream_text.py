"""TextFeed: what of a streamed turn's text the client may see while the pod is still generating."""

from __future__ import annotations

import pytest

from services.gateway.chat import ChatModel, parse_tool_calls
from services.gateway.streaming import TextFeed


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


async def _pieces(
    model: ChatModel, text: str, stop: list[str] | None = None, **kw: bool
) -> tuple[list[str], TextFeed]:
    feed = TextFeed(model, stop, **kw)
    for tok in model.encode(text):  # one token per engine step, as a pod streams them
        feed.push([tok], [-0.1])
    feed.close()
    return [p async for p in feed.pieces()], feed


async def test_plain_text_streams_whole_and_leaves_no_rest(model):
    # One piece per step once the reader keeps up; a reader that falls behind gets what queued in one piece.
    feed = TextFeed(model, None)
    out = []
    for tok in model.encode("Hello there, world."):
        feed.push([tok], [-0.1])
        it = feed.pieces()
        out.append(await it.__anext__())
    assert "".join(out) == "Hello there, world." and len(out) > 3
    assert feed.rest("Hello there, world.") == ""


async def test_tool_call_blocks_and_their_prefixes_are_held_back(model):
    text = 'Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces, feed = await _pieces(model, text, tools=True)
    assert "".join(pieces) == "Let me look. "
    content, calls = parse_tool_calls(text)
    assert calls and feed.rest(content) == ""  # the parse trims the space the client already saw: nothing more


@pytest.mark.parametrize("kw", [{}, {"tools": True, "raw": True}])
async def test_tool_call_blocks_stream_as_text_without_tools_or_in_a_raw_session(model, kw):
    # vLLM parses tool calls only for a request that offers tools; Molt's chat server never does
    text = 'Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces, feed = await _pieces(model, text, **kw)
    assert "".join(pieces) == text and feed.rest(text) == ""


async def test_a_stop_string_is_never_shown(model):
    pieces, feed = await _pieces(model, "one two END three", stop=["END"])
    assert "".join(pieces) == "one two " and feed.rest("one two ") == ""


def test_an_unfinished_character_waits_for_its_last_byte(model):
    feed = TextFeed(model, ["ENDMARK"])
    ids = model.encode("café ☕ done EN")
    pieces = []
    for tok in ids:  # what each engine step lets the client see
        feed.ids.append(tok)
        pieces.append("".join(piece for _, piece in feed._safe()))
    assert all("\ufffd" not in p for p in pieces) and "" in pieces[1:]  # some step showed nothing new
    assert "".join(pieces) == "café ☕ done "  # "EN" may still become the stop string
    assert feed.rest("café ☕ done EN") == "EN"
