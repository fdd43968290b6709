"""molt.agents.params.SamplingParams as a Molt agent uses a vLLM SamplingParams: ``clone()``, and every field
an Env hands back either carried to the gateway, read only, or refused with a ValueError naming it (a dropped
field would change the sampled distribution without a word)."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from molt.agents import Env, Episode, Result, StepEnvRunner
from molt.agents.gateway import GatewayClient
from molt.agents.params import IGNORED, REFUSED, WIRE_FIELDS, SamplingParams
from molt.agents.testing import FakeGateway


def test_clone_is_a_deep_copy_that_keeps_what_was_given():
    sp = SamplingParams.from_any({"temperature": 1.0, "stop": ["</a>"], "max_tokens": 8})
    twin = sp.clone()
    twin.stop.append("</b>")
    twin.max_tokens = 3
    assert sp.stop == ["</a>"] and sp.max_tokens == 8
    # temperature 1.0 is vLLM's default but was given: it still travels (the gateway's default may differ)
    assert twin.wire() == {"temperature": 1.0, "stop": ["</a>", "</b>"], "max_tokens": 3}


@pytest.mark.parametrize(
    "name,value",
    [
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["no"]),
        ("extra_args", {"plugin": 1}),
        ("thinking_token_budget", 64),
        ("trace_decode_token_ids", [3]),
        ("truncate_prompt_tokens", 100),
    ],
)
def test_a_field_the_session_api_cannot_apply_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"Result\.sampling_params\.{name} = .*Refused rather than dropped"):
        SamplingParams.from_any({name: value}, "Result.sampling_params")
    sp = SamplingParams()  # the state's copy, edited by the Env
    setattr(sp, name, value)
    with pytest.raises(ValueError, match=rf"Result\.sampling_params\.{name}"):
        SamplingParams.from_any(sp, "Result.sampling_params")
    with pytest.raises(ValueError, match=rf"sampling_params\.{name}"):
        sp.wire()


def test_unset_refused_fields_and_read_only_fields_pass_and_are_not_sent():
    sp = SamplingParams.from_any(
        {"logit_bias": {}, "bad_words": [], "extra_args": None, "include_stop_str_in_output": True, "logprobs": 1}
    )
    assert sp.include_stop_str_in_output and sp.wire() == {}


def test_include_stop_str_in_output_with_stop_strings_is_refused():
    # The session API answers the text cut before the stop string; the Env would read other text than it asked.
    with pytest.raises(ValueError, match="include_stop_str_in_output: the gateway returns"):
        SamplingParams.from_any({"include_stop_str_in_output": True, "stop": ["</tool>"]}, "Result.sampling_params")


def test_the_fields_sent_are_the_ones_the_gateway_session_api_takes():
    from molt.sampling import SESSION_KEYS
    from services.rollout.params import SAMPLING_FIELDS

    assert WIRE_FIELDS == SESSION_KEYS - {"n"}  # n: one session is one sample
    assert WIRE_FIELDS - {"stop"} <= set(SAMPLING_FIELDS)  # stop strings: the gateway applies them
    # A refused field the session API starts taking is to be carried instead: this fails until it is.
    assert not set(REFUSED) & SESSION_KEYS
    assert not (set(REFUSED) | IGNORED) & WIRE_FIELDS


class _Future(msgspec.Struct, omit_defaults=True):
    """A vLLM SamplingParams of a later release: msgspec lists its fields and their defaults."""

    temperature: float = 1.0
    new_knob: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    _internal: int = 0


def test_an_unknown_vllm_field_off_its_default_is_refused():
    at_defaults = SamplingParams.from_any(_Future(temperature=0.5, _internal=3))  # "_": vLLM's internals
    assert at_defaults.wire() == {"temperature": 0.5}
    with pytest.raises(ValueError, match=r"Result\.sampling_params\.new_knob = 4: a vLLM sampling field"):
        SamplingParams.from_any(_Future(new_knob=4), "Result.sampling_params")


async def test_an_env_that_hands_back_a_refused_field_fails_its_episode_naming_it():
    class Banning(Env):
        async def step(self, state):
            sp = state["sampling_params"].clone()
            sp.bad_words = ["sorry"]
            return Result(reward=0.0, observation="again", terminated=False, sampling_params=sp)

    fake = FakeGateway(policy=lambda prompt, turn: "ok")
    gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
    with pytest.raises(ValueError, match=r"Result\.sampling_params\.bad_words"):
        await StepEnvRunner(Banning).execute(Episode(prompt="Q", group_id="g", label="x"), gateway)


def test_a_real_vllm_sampling_params():
    vllm_sampling = pytest.importorskip("vllm.sampling_params")
    vllm_sp = vllm_sampling.SamplingParams

    known = {n for n in SamplingParams.__dataclass_fields__ if not n.startswith("_")} | IGNORED
    unclassified = [n for n in vllm_sp.__struct_fields__ if not n.startswith("_") and n not in known]
    assert not unclassified, f"classify these vLLM fields in molt/agents/params.py: {unclassified}"

    sp = SamplingParams.from_any(vllm_sp(temperature=0.6, top_k=20, max_tokens=7, stop=["x"], seed=3))
    wire = sp.wire()
    assert {k: wire[k] for k in ("temperature", "top_k", "max_tokens", "stop", "seed")} == {
        "temperature": 0.6,
        "top_k": 20,
        "max_tokens": 7,
        "stop": ["x"],
        "seed": 3,
    }
    assert set(wire) <= WIRE_FIELDS
    for kw in ({"allowed_token_ids": [5]}, {"bad_words": ["x"]}):
        with pytest.raises(ValueError, match=f"sampling_params.{next(iter(kw))} = "):
            SamplingParams.from_any(vllm_sp(**kw))
    # A grammar and a bias travel: the grammar as the one constraint vLLM's params object holds.
    structured = vllm_sampling.StructuredOutputsParams(choice=["yes", "no"])
    sp = SamplingParams.from_any(vllm_sp(structured_outputs=structured, logit_bias={5: 1.0}))
    assert {k: sp.wire()[k] for k in ("structured_outputs", "logit_bias")} == {
        "structured_outputs": {"choice": ["yes", "no"]},
        "logit_bias": {5: 1.0},
    }
    json_mode = vllm_sampling.StructuredOutputsParams(json_object=True)
    assert SamplingParams.from_any(vllm_sp(structured_outputs=json_mode)).wire()["structured_outputs"] == {
        "json_object": True
    }
    loose = vllm_sampling.StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    with pytest.raises(ValueError, match="structured_outputs.disable_any_whitespace' is set"):
        SamplingParams.from_any(vllm_sp(structured_outputs=loose))


def test_logit_bias_and_a_grammar_are_carried_and_checked_where_the_env_sets_them():
    sp = SamplingParams()  # the state's copy, edited by the Env (Molt's pattern)
    sp.logit_bias = {7: -100.0}
    sp.structured_outputs = {"regex": "[0-9]+"}
    assert SamplingParams.from_any(sp).wire() == {"logit_bias": {7: -100.0}, "structured_outputs": {"regex": "[0-9]+"}}
    for name, value, says in (
        ("logit_bias", {7: 500.0}, r"logit_bias\[7\]"),
        ("logit_bias", {"x": 1.0}, "is not a token id"),
        ("structured_outputs", {"regex": "a", "choice": ["a"]}, "exactly one of"),
        ("structured_outputs", "a+", "StructuredOutputsParams or a dict"),
    ):
        with pytest.raises(ValueError, match=says):
            SamplingParams.from_any({name: value}, "Result.sampling_params")
