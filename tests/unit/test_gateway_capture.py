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
    assert seg.spans == [
        (len(prompt1), len(prompt1) + len(g1.token_ids)),
        (len(prompt1) + len(g1.token_ids) + len(delta), len(seg.token_ids)),
    ]
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
    m2 = m1 + [
        r1,
        {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "RESULT_ONE"},
        {"role": "tool", "tool_call_id": r1["tool_calls"][1]["id"], "content": "RESULT_TWO"},
    ]
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
    a = canonical_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}}
                ],
            }
        ]
    )[0]
    b = canonical_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": {"y": 2, "x": 1}}}
                ],
            }
        ]
    )[0]
    assert same_message(a, b)
    text, calls = parse_tool_calls(
        'pre <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>junk</tool_call>'
    )
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
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {}}},
            },
        }
    ]
    chats = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3 + 3?"},
        ],
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    ]
    for messages in chats:
        for tl in (None, tools):
            for gp in (False, True):
                want = model.tokenizer.apply_chat_template(
                    messages, tools=tl, tokenize=False, add_generation_prompt=gp
                )
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


def test_request_key_keeps_key_order_and_keeps_nan_apart_from_null():
    from services.gateway.chat import request_key

    m = [{"role": "user", "content": "One"}]
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": None}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    reordered = [{"function": {"parameters": dict(reversed(list(schema.items()))), "name": "f"}, "type": "function"}]
    # The template renders keys in the client's order: another order is another prompt.
    assert request_key(m, tools) != request_key(m, reordered)
    assert request_key(m, tools) == request_key(m, [dict(t) for t in tools])
    for odd in (float("nan"), float("inf")):
        bad = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "number", "maximum": odd}}},
                },
            }
        ]
        assert request_key(m, bad) != request_key(m, tools)
    assert request_key(m, None) != request_key([{"role": "user", "content": "Two"}], None)


def test_prompt_cache_answers_each_key_order_with_its_own_rendering(model):
    from services.gateway.chat import request_key

    m = [{"role": "user", "content": "Weather?"}]
    props = {"city": {"type": "string"}, "unit": {"type": "string"}}
    tools_a = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": props}}}]
    tools_b = [
        {
            "type": "function",
            "function": {
                "name": "w",
                "parameters": {"properties": dict(reversed(list(props.items()))), "type": "object"},
            },
        }
    ]
    for tools in (tools_a, tools_b, tools_a):
        text, ids = model.prompt(request_key(m, tools), m, tools)
        assert text == model.render(m, tools, True) and ids == model.encode(text)
    assert model.render(m, tools_a, True) != model.render(m, tools_b, True)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]


def _echo_args(reply: dict, arguments: str) -> dict:
    call = reply["tool_calls"][0]
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


@pytest.mark.parametrize(
    "generated, echoed",
    [
        # pydantic-ai re-serialises the arguments compactly
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', '{"city":"Paris"}'),
        # a client that rebuilds the arguments object in another key order
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>',
            '{"unit": "C", "city": "Paris"}',
        ),
        # echoed verbatim, but the model laid the call out other than the template does
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None),
    ],
)
def test_an_echoed_tool_call_that_renders_differently_keeps_every_token(model, generated, echoed):
    cap = Capture(max_length=1024)
    p1, g1, r1 = _turn(cap, model, ASK, generated + "<|im_end|>", TOOLS)
    echo = _echo_args(r1, echoed) if echoed is not None else r1
    m2 = ASK + [echo, {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "sunny"}]
    p2, g2, _ = _turn(cap, model, m2, "It is sunny.<|im_end|>", TOOLS)
    assert not p2.new_segment and p2.reason == "extend"
    # The pod's tokens, then the template's newline after the generated <|im_end|> and the tool turn.
    delta = model.encode("\n<|im_start|>tool\n<tool_response>sunny</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert p2.delta_ids == delta
    assert cap.segments[0].token_ids == p1.prompt_ids + g1.token_ids + delta + g2.token_ids


def test_a_length_stop_gets_the_whole_closing_as_its_tail(model):
    cap = Capture(max_length=1024)
    plan = cap.plan_chat(model, canonical_messages(ASK), None)
    ids = model.encode("It is")
    cap.commit(plan, Generation(ids, [-0.1] * len(ids), "length", 1, "p"), [])
    reply = {"role": "assistant", "content": "It is"}
    cap.chat = ChatState(canonical_messages(ASK), None, plan.full_render, reply, "It is")
    p2 = cap.plan_chat(model, canonical_messages(ASK + [reply, {"role": "user", "content": "Go on."}]), None)
    assert p2.delta_ids == model.encode("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("edit", ["drop_system", "drop_reply", "edit_user", "edit_arguments"])
def test_a_history_that_really_diverges_starts_a_new_segment(model, edit):
    cap = Capture(max_length=1024)
    _, _, r1 = _turn(
        cap,
        model,
        ASK,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
        TOOLS,
    )
    result = {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "sunny"}
    m2 = {
        "drop_system": ASK[1:] + [r1, result],
        "drop_reply": ASK + [result],
        "edit_user": [ASK[0], {"role": "user", "content": "Weather in Rome?"}, r1, result],
        "edit_arguments": ASK + [_echo_args(r1, '{"city": "Rome"}'), result],
    }[edit]
    p2 = cap.plan_chat(model, canonical_messages(m2), TOOLS)
    assert p2.new_segment and p2.reason == "history_rewrite"
    assert p2.prompt_ids == model.encode(model.render(canonical_messages(m2), TOOLS, True))


def test_each_turns_routing_covers_the_segment_so_far_and_replaces_the_last(model):
    import numpy as np

    cap = Capture(max_length=1024)
    m1 = [{"role": "user", "content": "Hi."}]
    plan1 = cap.plan_chat(model, canonical_messages(m1), None)
    g1 = _gen(model, "Hello.<|im_end|>")
    t1 = len(plan1.prompt_ids) + len(g1.token_ids)
    g1.routed_experts = np.full((t1 - 1, 2, 2), 1, np.int16)  # the last generated token has no row yet
    cap.commit(plan1, g1, [])
    seg = cap.segments[0]
    assert seg.routed_experts.shape == (t1, 2, 2)
    assert (seg.routed_experts[:-1] == 1).all() and (seg.routed_experts[-1] == -1).all()  # -1: live routing
    cap.chat = ChatState(
        canonical_messages(m1), None, plan1.full_render, {"role": "assistant", "content": "Hello."}, ""
    )
    cap.chat.generated_text = model.decode(g1.token_ids, skip_special=False)
    m2 = m1 + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    plan2 = cap.plan_chat(model, canonical_messages(m2), None)
    assert not plan2.new_segment
    g2 = _gen(model, "Bye.<|im_end|>")
    g2.routed_experts = np.full((len(plan2.prompt_ids) + len(g2.token_ids) + 3, 2, 2), 2, np.int16)
    cap.commit(plan2, g2, [])
    # cut to T; first writer wins, as Molt: turn 1's rows stay, its unrouted last row and turn 2's are new
    assert seg.routed_experts.shape == (len(seg.token_ids), 2, 2)
    assert (seg.routed_experts[: t1 - 1] == 1).all() and (seg.routed_experts[t1 - 1 :] == 2).all()
    assert cap.trainable_segments()[0].routed_experts.shape == (len(seg.token_ids), 2, 2)
