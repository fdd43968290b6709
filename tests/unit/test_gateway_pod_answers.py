"""What the gateway accepts from a pod's answer before it records a single token (services/gateway/pods.py)."""

from __future__ import annotations

import math

import pytest

from services.gateway.pods import _logprob_list, _token_ids


def test_plain_answers_pass_as_they_are():
    ids = [5, 17, 0]
    lps = [-0.5, -1e-9, -12.25]
    assert _token_ids(ids) is ids
    assert _logprob_list(lps, ids) is lps


@pytest.mark.parametrize("bad", [[1, 2.0], [1, True], ["3"], (1, 2), None, {"0": 1}])
def test_token_ids_are_integers_only(bad):
    with pytest.raises(ValueError, match="token_ids must be a list of integers"):
        _token_ids(bad)


@pytest.mark.parametrize("bad", [[-0.1, math.nan], [math.inf, -0.2], [-math.inf, -0.3], [-0.1, None]])
def test_logprobs_must_be_finite(bad):
    with pytest.raises(ValueError, match="logprob for token"):
        _logprob_list(bad, [1, 2])


def test_other_logprob_shapes_and_sums_past_the_float_range():
    huge = [-1e308, -1e308]  # each finite, their sum is not: the one-pass check falls back to per-token checks
    assert _logprob_list(huge, [1, 2]) == huge
    assert _logprob_list([{"logprob": -0.5}, {"7": -1.0}, -2], [3, 7, 9]) == [-0.5, -1.0, -2.0]
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        _logprob_list([-0.5], [1, 2])


def test_routed_experts_arrive_as_int16_bytes_with_their_shape():
    import base64

    import numpy as np

    from services.gateway.pods import _routed_experts

    rows = np.array([[[0, 3], [1, 2]], [[2, 1], [-1, -1]]], dtype="<i2")  # 2 tokens, 2 layers, top-2
    wire = {"dtype": "int16", "shape": [2, 2, 2], "data": base64.b64encode(rows.tobytes()).decode()}
    np.testing.assert_array_equal(_routed_experts(wire), rows)
    assert _routed_experts(None) is None
    with pytest.raises(ValueError, match="int16"):
        _routed_experts({**wire, "dtype": "int32"})
    with pytest.raises(ValueError, match="shape"):
        _routed_experts({**wire, "shape": [8]})
    with pytest.raises(ValueError):  # 16 bytes are not 3 x 2 x 2 int16
        _routed_experts({**wire, "shape": [3, 2, 2]})
