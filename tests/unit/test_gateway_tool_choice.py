"""Tool choice as a constraint in the template's own call format (services/gateway/tool_choice.py), on the
tiny model's real template: the structural tag the pod gets for each choice, and the choices refused."""

from __future__ import annotations

import pytest

from services.gateway import tool_choice as tc
from services.gateway.chat import ChatModel
from services.gateway.errors import GatewayError

ASK = [{"role": "user", "content": "hi"}]
FNS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]
BEGIN = '<tool_call>{"name": "'


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    return ChatModel(tiny_qwen3)


def _tag(name: str, schema: dict) -> dict:
    return {
        "type": "tag",
        "begin": BEGIN + name + '", "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema},
        "end": "}</tool_call>",
    }


def test_the_call_format_is_read_off_the_template(model):
    fmt = tc.call_format(model, ASK, FNS)
    assert (fmt.begin, fmt.middle, fmt.end, fmt.opener) == (BEGIN, '", "arguments": ', "}</tool_call>", "<tool_call>")
    # A call rendered back by the template is begin + name + middle + arguments + end, verbatim.
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"x": 1}'}}
    text = model.render([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}], FNS, False)
    assert fmt.begin + "get_time" + fmt.middle + '{"x": 1}' + fmt.end in text


def test_each_choice_becomes_its_structural_tag(model):
    def spec(choice: tc.ToolChoice) -> dict | None:
        out = tc.constraint(model, ASK, FNS, choice)
        return out and out["structural_tag"]["format"]

    both = [_tag("get_weather", {"type": "object"}), _tag("get_time", {"type": "object"})]
    assert spec(tc.ToolChoice("auto")) is None
    assert spec(tc.ToolChoice("required")) == {"type": "or", "elements": both}
    assert spec(tc.ToolChoice("named", "get_time")) == both[1]
    assert spec(tc.ToolChoice("none")) == {"type": "any_text", "excludes": ["<tool_call>"]}
    assert spec(tc.ToolChoice("auto", parallel=False)) == {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": both,
        "stop_after_first": True,
    }
    assert tc.constraint(model, ASK, None, tc.ToolChoice("none")) is None  # no tools: nothing to forbid


def test_the_wires_map_onto_one_choice():
    assert tc.from_openai(None, None) == tc.ToolChoice("auto")
    assert tc.from_openai("required", False) == tc.ToolChoice("required", parallel=False)
    assert tc.from_openai({"type": "function", "function": {"name": "f"}}, None) == tc.ToolChoice("named", "f")
    assert tc.from_anthropic({"type": "any"}) == tc.ToolChoice("required")
    assert tc.from_anthropic({"type": "tool", "name": "f", "disable_parallel_tool_use": True}) == tc.ToolChoice(
        "named", "f", parallel=False
    )
    assert tc.from_anthropic({"type": "none"}) == tc.ToolChoice("none")


def test_strict_tools_constrain_their_arguments_under_auto_as_vllm_does(model):
    """A strict tool's arguments match its schema, the others' are any JSON object, text and calls come as the
    model likes; without a strict tool, auto with parallel calls constrains nothing. Anthropic's and Responses'
    marks arrive as ToolChoice.strict (their tools render without them)."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    fns = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": True}},
        FNS[1],
    ]
    expected = {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": [_tag("get_weather", weather), _tag("get_time", {"type": "object"})],
    }
    out = tc.apply(model, ASK, fns, {"tool_choice": tc.ToolChoice("auto")})
    assert out["structured_outputs"]["structural_tag"]["format"] == expected
    plain = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}, FNS[1]]
    assert tc.apply(model, ASK, plain, {"tool_choice": tc.ToolChoice("auto")}) == {}
    marked = tc.apply(model, ASK, plain, {"tool_choice": tc.ToolChoice("auto", strict=frozenset({"get_weather"}))})
    assert marked["structured_outputs"]["structural_tag"]["format"] == expected
    # without parallel calls, every tool's arguments were constrained already (at most one call)
    one = tc.apply(model, ASK, fns, {"tool_choice": tc.ToolChoice("auto", parallel=False)})
    assert one["structured_outputs"] == tc.constraint(model, ASK, fns, tc.ToolChoice("auto", parallel=False))


def test_a_response_format_beside_a_choice_that_forces_or_forbids_calls(model):
    """Required or a named tool: this reply is a call, so the call's constraint replaces the format (a later
    turn's text reply takes it); none: the JSON holds no call, so the format alone."""
    fmt = {"json": {"type": "object"}}

    def pod_gets(choice: tc.ToolChoice) -> dict:
        return tc.apply(model, ASK, FNS, {"structured_outputs": dict(fmt), "tool_choice": choice})

    for choice in (tc.ToolChoice("required"), tc.ToolChoice("named", "get_time")):
        assert pod_gets(choice) == {"structured_outputs": tc.constraint(model, ASK, FNS, choice)}
    assert pod_gets(tc.ToolChoice("none")) == {"structured_outputs": fmt}


def test_a_grammar_other_than_json_beside_callable_tools_constrains_the_whole_reply(model):
    """JSON or calls is OpenAI's answer to a JSON format; a regex or a choice is vLLM's structured_outputs, which
    constrains the whole reply: it reaches the pod as sent, never swapped for any JSON object."""
    for grammar in ({"regex": "[0-9]{3}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}):
        for parallel in (True, False):
            choice = tc.ToolChoice("auto", parallel=parallel)
            out = tc.apply(model, ASK, FNS, {"structured_outputs": dict(grammar), "tool_choice": choice})
            assert out == {"structured_outputs": grammar}


def test_a_sessions_grammar_is_the_turns_unless_the_request_names_one(model):
    held = {"choice": ["ok", "no"]}
    assert tc.apply(model, ASK, None, {}, held) == {"structured_outputs": held}
    own = {"regex": "o+"}
    assert tc.apply(model, ASK, None, {"structured_outputs": own}, held) == {"structured_outputs": own}
    # a forced call: the call's constraint, as beside a request's own format
    forced = tc.apply(model, ASK, FNS, {"tool_choice": tc.ToolChoice("required")}, held)
    assert forced == {"structured_outputs": tc.constraint(model, ASK, FNS, tc.ToolChoice("required"))}
    with pytest.raises(GatewayError, match="cannot continue a final assistant message") as err:
        tc.apply(model, ASK, None, {"continue_final_message": True}, held)
    assert err.value.param == "sampling_params.structured_outputs"


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda m: tc.from_openai("any", None), "'tool_choice' must be"),
        (lambda m: tc.from_openai("auto", "no"), "parallel_tool_calls"),
        (lambda m: tc.from_anthropic({"type": "tool"}), "'tool_choice' must be"),
        (lambda m: tc.constraint(m, ASK, None, tc.ToolChoice("required")), "needs 'tools'"),
        (lambda m: tc.constraint(m, ASK, FNS, tc.ToolChoice("named", "nope")), "not one of 'tools'"),
    ],
)
def test_choices_that_cannot_be_honoured_are_400s(model, call, needle):
    with pytest.raises(GatewayError) as err:
        call(model)
    assert err.value.status == 400 and needle in err.value.message
