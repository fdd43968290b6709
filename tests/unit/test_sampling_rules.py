"""molt.sampling's rules are vLLM's: for every knob vLLM checks, a value passes here exactly when vLLM's own
SamplingParams accepts it; the seed, which vLLM does not check, is held to what torch can seed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.sampling import (
    INT64_MAX,
    INT64_MIN,
    RULES,
    SamplingError,
    check_logit_bias,
    check_params,
    check_stop,
    check_structured,
)

vllm_sampling = pytest.importorskip("vllm.sampling_params")
from vllm.exceptions import VLLMClientError  # noqa: E402 (after the importorskip)

EDGES = [0, -1, 1, 2, -2, 2.0000001, -2.0000001, 1e-300, 0.5, 1.0, 1e308, -1e308, math.nan, math.inf, -math.inf]
CHECKED_BY_VLLM = sorted(set(RULES) - {"seed"})


def _vllm_accepts(name: str, value) -> bool:
    kwargs = {name: value, "max_tokens": None} if name == "min_tokens" else {name: value}
    try:
        vllm_sampling.SamplingParams(**kwargs)
    except (VLLMClientError, ValueError):
        return False
    return True


def _ours_accept(name: str, value) -> bool:
    try:
        check_params({name: value})
    except SamplingError:
        return False
    return True


@settings(max_examples=300, deadline=None, derandomize=True)
@given(name=st.sampled_from(CHECKED_BY_VLLM), data=st.data())
def test_each_rule_accepts_exactly_what_vllms_sampling_params_accepts(name, data):
    if RULES[name].integer:
        value = data.draw(st.one_of(st.integers(-3, 3), st.integers()))
    else:
        value = data.draw(st.one_of(st.sampled_from(EDGES), st.floats(-5, 5), st.floats()))
    assert _ours_accept(name, value) == _vllm_accepts(name, value), (name, value)


@pytest.mark.parametrize(
    "seed,ok",
    [
        (0, True),
        (INT64_MAX, True),
        (INT64_MIN, True),
        (INT64_MAX + 1, False),
        (2**64, False),
        (INT64_MIN - 1, False),
        (1.0, False),
        (True, False),
    ],
)
def test_seeds_are_64_bit_integers_that_torch_can_seed(seed, ok):
    assert _ours_accept("seed", seed) == ok
    if ok:
        torch.Generator().manual_seed(seed)  # what vLLM's sampler does with it in its first step
    elif isinstance(seed, int) and not isinstance(seed, bool) and seed > 2**64 - 1:
        with pytest.raises((RuntimeError, ValueError)):
            torch.Generator().manual_seed(seed)


def test_errors_name_the_parameter_and_numbers_past_the_float_range_are_not_finite():
    with pytest.raises(SamplingError, match="'temperature' must be a finite number") as err:
        check_params({"temperature": 10**400}, prefix="sampling_params.")
    assert err.value.param == "sampling_params.temperature"
    with pytest.raises(SamplingError, match="'min_tokens' .5. must be <= 'max_tokens' .2.") as err:
        check_params({"min_tokens": 5, "max_tokens": 2})
    assert err.value.param == "min_tokens"
    with pytest.raises(SamplingError, match="must be an integer"):
        check_params({"top_k": 1.0})
    assert check_params({"temperature": 1, "unknown": "kept"}) == {"temperature": 1.0, "unknown": "kept"}


def test_stop_strings_are_a_string_or_a_list_without_empty_ones():
    assert check_stop("x") == ["x"] and check_stop(None) is None and check_stop(["a", "b"]) == ["a", "b"]
    for bad in ([""], [1], 5, {"a": 1}):
        with pytest.raises(SamplingError):
            check_stop(bad)


def test_logit_bias_takes_token_ids_as_json_keys_and_biases_in_openais_range():
    assert check_logit_bias({"5": 1, 7: -100}, vocab_size=10) == {5: 1.0, 7: -100.0}
    for bad in ({"x": 1}, {"10": 1}, {"-1": 1}, {"5": 100.5}, {"5": math.nan}, {"5": "1"}, [5], {True: 1}):
        with pytest.raises(SamplingError) as err:
            check_logit_bias(bad, vocab_size=10)
        assert err.value.param == "logit_bias"
    # vLLM takes what passes here (ids as ints) and refuses an id past the vocabulary itself.
    vllm_sampling.SamplingParams(logit_bias=check_logit_bias({"5": 2.5}))


def test_structured_outputs_name_exactly_one_constraint_of_the_type_vllm_takes():
    assert check_structured({"json": {"type": "object"}}) == {"json": {"type": "object"}}
    assert check_structured({"json_object": True, "regex": None}) == {"json_object": True}
    for bad in ({}, {"json": {}, "regex": "a"}, {"guided_json": {}}, {"json_object": 1}, {"choice": []}, "x"):
        with pytest.raises(SamplingError) as err:
            check_structured(bad)
        assert err.value.param.startswith("structured_outputs")
    for kind, value in (("regex", "a+"), ("choice", ["a"]), ("grammar", 'root ::= "a"'), ("json", {})):
        vllm_sampling.StructuredOutputsParams(**check_structured({kind: value}))
