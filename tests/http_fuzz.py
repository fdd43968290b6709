"""Hypothesis strategies and error-shape checks shared by the property tests of every HTTP surface.

Bodies mix values each surface accepts with the ones that used to hurt it: numbers past every range
(2**64, 1e308, NaN, inf), wrong types, lone surrogates and JSON nested past Python's stack. Each test
asserts the same three things: no 5xx, an answer in time, and errors in the surface's own shape.
"""

from __future__ import annotations

import json
import math
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=int(os.environ.get("MOLT_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=not os.environ.get("MOLT_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
"""Bounded and reproducible: the same examples on every CI run, a few seconds per surface. For a longer hunt:
MOLT_FUZZ_RANDOM=1 MOLT_FUZZ_EXAMPLES=5000 (max_examples set on a test wins over the second)."""

EDGE_NUMBERS = [
    0,
    -1,
    1,
    2,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    0.5,
    -0.5,
    1e-300,
    1e308,
    -1e308,
    math.nan,
    math.inf,
    -math.inf,
]
SURROGATE = "\ud800"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_NUMBERS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just(SURROGATE),
    st.just("x" + SURROGATE),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


def fields(known: dict[str, st.SearchStrategy], junk_keys: bool = True) -> st.SearchStrategy[dict]:
    """Objects over ``known`` keys, each value from its strategy or any JSON value, plus unknown keys."""
    parts = {k: st.one_of(v, json_values) for k, v in known.items()}
    body = st.fixed_dictionaries({}, optional=parts)
    if not junk_keys:
        return body
    return st.tuples(body, st.dictionaries(st.sampled_from(["junk", SURROGATE, ""]), json_values, max_size=1)).map(
        lambda pair: {**pair[0], **pair[1]}
    )


_NUMBER = st.sampled_from(EDGE_NUMBERS)
SAMPLING_FIELDS = {
    "max_tokens": st.one_of(st.integers(1, 4), _NUMBER),
    "temperature": st.one_of(st.floats(0, 2), _NUMBER),
    "top_p": st.one_of(st.floats(0.01, 1), _NUMBER),
    "top_k": st.one_of(st.integers(-1, 50), _NUMBER),
    "min_p": st.one_of(st.floats(0, 1), _NUMBER),
    "seed": st.one_of(st.integers(0, 2**40), _NUMBER),
    "presence_penalty": st.one_of(st.floats(-2, 2), _NUMBER),
    "frequency_penalty": st.one_of(st.floats(-2, 2), _NUMBER),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), _NUMBER),
    "n": st.one_of(st.integers(1, 2), _NUMBER),
    "min_tokens": st.one_of(st.integers(0, 2), _NUMBER),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 1023), max_size=2), json_values),
}
"""vLLM's sampling knobs, mostly in range, often not (max_tokens stays small: the tests run real generations)."""


def sampling_params() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={**SAMPLING_FIELDS, "logprobs": st.one_of(st.booleans(), _NUMBER)})


def encode(body: object) -> bytes:
    """JSON with NaN/Infinity tokens and lone surrogates kept (what a careless client sends)."""
    return json.dumps(body, allow_nan=True).encode()


RAW_BODIES = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"1e999999",
    b'"\\ud800"',
    b'{"a": "\\udfff"}',
    b"\xff\xfe",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"1" * 5000,
]
"""Bodies no strategy is likely to build: broken JSON, lone surrogates, nesting past the stack, huge numbers."""


def assert_openai_error(status: int, body: bytes, expected: set[int] | None = None) -> dict:
    """The OpenAI error object of a 4xx answer (the pod's and the OpenAI wire's shape)."""
    assert status < 500, (status, body[:300])
    if expected is not None:
        assert status in expected, (status, body[:300])
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"], body[:300]
    assert {"message", "type"} <= set(err), body[:300]
    return err


def assert_anthropic_error(status: int, body: bytes) -> dict:
    assert status < 500, (status, body[:300])
    data = json.loads(body)
    assert data["type"] == "error" and isinstance(data["error"]["message"], str), body[:300]
    return data["error"]
