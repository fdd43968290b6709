"""Gateway capture (TITO) on the tiny model's real tokenizer and template, with hand-checked token streams."""

from __future__ import annotations

import pytest

from services.gateway.capture import Capture, ChatState
from services.gateway.chat import ChatModel, canonical_messages, parse_tool_calls, same_message
from services.gateway.errors import GatewayError
from services.gateway.pods import Generation


@pytest.fixture(scope="module")
def model(tiny_qwen3) -> ChatModel:
    return ChatModel(tiny_qwen3)


def _gen(model: ChatModel, text: str, version: int = 3) -> Generation:
    ids = model.encode(text)
    return Generation(ids, [-0.5] * len(ids), "stop", version, "http://pod")


def _turn(cap: Capture, model: ChatModel, messages: list[dict], reply_text: str, tools=None):
    msgs = canonical_messages(messages)
    plan = cap.plan_chat(model, msgs, tools)
    gen = _gen(model, reply_text)
    cap.commit(plan, gen, [])
    content, calls = parse_tool_calls(model.decode(gen.token_ids, skip_special=True))
    reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    cap.chat = ChatState(msgs, tools, plan.full_render, reply, model.decode(gen.token_ids, skip_special=False))
    return plan, gen, reply


def test_multi_turn_is_one_segment_with_exact_tokens(model):
    cap = Capture(max_length=1024)
    m1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    p1, g1, r1 = _turn(cap, model, m1, "The answer is 4.<|im_end|>")
    m2 = m1 + [r1, {"role": "user", "content": "And 3 + 3?"}]
    p2, g2, _ = _turn(cap, model, m2, "6<|im_end|>")
    assert not p2.new_segment and len(cap.segments) == 1
    seg = cap.segments[0]
    prompt1 = model.encode(model.render(canonical_messages(m1), None, True))
    # The generated <|im_end|> is the model's; the template's newline after it and the next turn are the delta.
    delta = model.encode("\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert seg.token_ids == prompt1 + g1.token_ids + delta + g2.token_ids
    assert seg.spans == [(len(prompt1), len(prompt1) + len(g1.token_ids)),
                         (len(prompt1) + len(g1.token_ids) + len(delta), len(seg.token_ids))]
    assert seg.logprobs == g1.logprobs + g2.logprobs and seg.versions == [3] * (len(g1.token_ids) + len(g2.token_ids))
    # The whole stream decodes to the template's render of the full conversation.
    full = model.render(canonical_messages(m2 + [{"role": "assistant", "content": "6"}]), None, False)
    assert model.decode(seg.token_ids, skip_special=False) == full.rstrip("\n")


def test_two_tool_results_in_one_turn_are_both_appended(model):
    cap = Capture(max_length=1024)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    m1 = [{"role": "user", "content": "Add twice."}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    _, _, r1 = _turn(cap, model, m1, call + call + "<|im_end|>", tools)
    assert [c["function"]["name"] for c in r1["tool_calls"]] == ["add", "add"]
    m2 = m1 + [r1, {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "RESULT_ONE"},
               {"role": "tool", "tool_call_id": r1["tool_calls"][1]["id"], "content": "RESULT_TWO"}]
    p2, _, _ = _turn(cap, model, m2, "3 and 3<|im_end|>", tools)
    assert not p2.new_segment
    delta_text = model.decode(p2.delta_ids, skip_special=False)
    assert "RESULT_ONE" in delta_text and "RESULT_TWO" in delta_text
    assert delta_text.index("RESULT_ONE") < delta_text.index("RESULT_TWO")
    assert delta_text.endswith("<|im_start|>assistant\n")


def test_compaction_starts_a_second_segment(model):
    cap = Capture(max_length=1024)
    m1 = [{"role": "user", "content": "Long story."}]
    _, _, r1 = _turn(cap, model, m1, "Once upon a time.<|im_end|>")
    m2 = [{"role": "user", "content": "Summary: a story was told."}, {"role": "user", "content": "Continue."}]
    p2, _, _ = _turn(cap, model, m2, "The end.<|im_end|>")
    assert p2.new_segment and p2.reason == "history_rewrite"
    assert len(cap.segments) == 2 and all(s.spans for s in cap.segments)
    # An edited assistant reply is a rewrite too: its tokens were not what the model generated.
    edited = dict(r1, content="Something else.")
    p3 = cap.plan_chat(model, canonical_messages(m2 + [edited, {"role": "user", "content": "x"}]), None)
    assert p3.new_segment


def test_tool_call_arguments_compare_as_json(model):
    a = canonical_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}}]}])[0]
    b = canonical_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": {"y": 2, "x": 1}}}]}])[0]
    assert same_message(a, b)
    text, calls = parse_tool_calls('pre <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>junk'
                                   '</tool_call>')
    assert len(calls) == 1 and "junk" in text and calls[0]["function"]["arguments"] == '{"x": 1}'


def test_failed_turn_leaves_no_trace_and_context_limit(model):
    cap = Capture(max_length=40)
    msgs = canonical_messages([{"role": "user", "content": "hi"}])
    plan = cap.plan_chat(model, msgs, None)
    assert cap.segments == []  # planning commits nothing
    long = canonical_messages([{"role": "user", "content": "word " * 200}])
    with pytest.raises(GatewayError) as err:
        cap.check_room(cap.plan_chat(model, long, None), hard=True)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert cap.check_room(plan, hard=True) == 40 - plan.num_tokens


def test_token_level_turns(model):
    cap = Capture(max_length=1024)
    p1 = cap.plan_tokens(model, canonical_messages([{"role": "user", "content": "hi"}]), None, None)
    g1 = _gen(model, "yo<|im_end|>")
    cap.commit(p1, g1, [])
    p2 = cap.plan_tokens(model, None, "\n<|im_start|>user\nmore<|im_end|>\n", [5, 6])
    assert p2.delta_ids[-2:] == [5, 6] and not p2.new_segment
    with pytest.raises(GatewayError):
        cap.plan_tokens(model, canonical_messages([{"role": "user", "content": "again"}]), None, None)


def test_render_is_what_apply_chat_template_renders(model):
    # ChatModel.render calls the compiled template directly; it must match transformers' own entry point.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    chats = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "3 + 3?"}],
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    ]
    for messages in chats:
        for tl in (None, tools):
            for gp in (False, True):
                want = model.tokenizer.apply_chat_template(messages, tools=tl, tokenize=False, add_generation_prompt=gp)
                assert model.render(messages, tl, gp) == want


def test_first_turn_prompt_cache_is_keyed_by_the_request_and_hands_out_copies(model):
    from services.gateway.chat import request_key

    m1, m2 = [{"role": "user", "content": "One"}], [{"role": "user", "content": "Two"}]
    k1, k2 = request_key(m1, None), request_key(m2, None)
    text, ids = model.prompt(k1, m1, None)
    assert text == model.render(m1, None, True) and ids == model.encode(text)
    ids.append(-1)  # a caller mutating its list must not change the cache
    assert model.prompt(k1, m1, None) == (text, model.encode(text))
    assert model.prompt(k2, m2, None)[0] == model.render(m2, None, True)
    plan = Capture(max_length=1024).plan_chat(model, m1, None, k1)
    assert plan.new_segment and plan.reason == "first" and plan.prompt_ids == model.encode(text)


def test_request_key_ignores_key_order_and_keeps_nan_apart_from_null():
    from services.gateway.chat import request_key

    m = [{"role": "user", "content": "One"}]
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": None}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    reordered = [{"function": {"parameters": dict(reversed(list(schema.items()))), "name": "f"}, "type": "function"}]
    assert request_key(m, tools) == request_key(m, reordered)
    for odd in (float("nan"), float("inf")):
        bad = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "number", "maximum": odd}}}}}]
        assert request_key(m, bad) != request_key(m, tools)
    assert request_key(m, None) != request_key([{"role": "user", "content": "Two"}], None)
