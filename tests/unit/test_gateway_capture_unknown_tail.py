"""Gateway capture when the template's closing of an assistant turn cannot be found after a reply: the next turn
starts a new segment with ``reason="unknown_tail"`` instead of guessing a tail, and every token of both turns
is kept (docs/gateway.md, "A client may echo the reply..."). Driven on the tiny model's real tokenizer with a
template that does not render assistant content verbatim (it upper-cases it)."""

from __future__ import annotations

import pytest

from services.gateway.capture import Capture, ChatState
from services.gateway.chat import ChatModel, canonical_messages, parse_tool_calls
from services.gateway.pods import Generation

# Assistant content is rendered upper-cased: the reply's generated text never appears in the render, and the
# sentinel ChatModel.assistant_closing looks for is changed too, so no closing can be found.
UPPER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    m = ChatModel(tiny_qwen3)  # its own tokenizer instance: changing its template touches no other test
    m.tokenizer.chat_template = UPPER_TEMPLATE
    return m


def _turn(cap: Capture, model: ChatModel, messages: list[dict], reply_text: str):
    msgs = canonical_messages(messages)
    plan = cap.plan_chat(model, msgs, None)
    ids = model.encode(reply_text)
    gen = Generation(ids, [-0.5] * len(ids), "stop", 3, "http://pod")
    cap.commit(plan, gen, [])
    content, _ = parse_tool_calls(model.decode(gen.token_ids, skip_special=True))
    reply = {"role": "assistant", "content": content}
    cap.chat = ChatState(msgs, None, plan.full_render, reply, model.decode(gen.token_ids, skip_special=False))
    return plan, gen, reply


def test_the_template_in_use_has_no_findable_assistant_closing(model):
    # The precondition of the claim, checked so the test below cannot pass through the exact or closing paths.
    assert model.assistant_closing([{"role": "user", "content": "hi"}], None) is None


def test_a_turn_after_a_reply_whose_tail_is_unknown_starts_an_unknown_tail_segment_and_drops_no_token(model):
    cap = Capture(max_length=1024)
    m1 = [{"role": "user", "content": "Say hello."}]
    p1, g1, r1 = _turn(cap, model, m1, "hello there<|im_end|>")
    m2 = m1 + [r1, {"role": "user", "content": "Again."}]
    p2, g2, _ = _turn(cap, model, m2, "hello again<|im_end|>")
    # The client echoed the reply unchanged and the history is intact: only the unknown tail forces the new segment.
    assert p2.new_segment and p2.reason == "unknown_tail"
    assert [s.reason for s in cap.segments] == ["first", "unknown_tail"]
    first, second = cap.segments
    # No token dropped: the first segment is sealed with its prompt and the model's exact tokens, and the second
    # holds the template's full render of turn 2 followed by the reply's exact tokens and logprobs.
    assert first.token_ids == p1.prompt_ids + g1.token_ids
    assert first.spans == [(len(p1.prompt_ids), len(first.token_ids))] and first.logprobs == g1.logprobs
    prompt2 = model.encode(model.render(canonical_messages(m2), None, True))
    assert second.token_ids == prompt2 + g2.token_ids
    assert second.spans == [(len(prompt2), len(second.token_ids))] and second.logprobs == g2.logprobs
    assert [s.to_segment().token_ids.tolist() for s in cap.segments] == [first.token_ids, second.token_ids]
