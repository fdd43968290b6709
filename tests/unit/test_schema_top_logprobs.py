"""A segment's optional sampler top-k (``top_ids`` / ``top_logprobs``, one row per action token): they travel
as bytes with their k, are checked against the action tokens, and a batch holding a bad one is caught and named."""

from __future__ import annotations

import numpy as np
import pytest

from molt.schema import SchemaError, decode, decode_many, encode, encode_many
from tests.unit.test_schema import make_segment, make_traj


def _with_top(k: int = 3, a: int = 5):
    seg = make_segment()
    seg.top_ids = np.arange(a * k).reshape(a, k)
    seg.top_logprobs = -np.arange(1, a * k + 1, dtype=np.float32).reshape(a, k) / 10
    seg.top_logprobs[-1, -1] = -np.inf  # a token the sampling settings rule out
    seg.__post_init__()
    return seg


def test_round_trip_keeps_the_rows_and_k():
    seg = _with_top()
    back = decode(encode(make_traj(segments=[seg, make_segment(6, ((1, 3),))])))
    got, plain = back.segments
    assert got.top_ids.dtype == np.int32 and got.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(got.top_ids, seg.top_ids)
    np.testing.assert_array_equal(got.top_logprobs, seg.top_logprobs)
    assert plain.top_ids is None and plain.top_logprobs is None


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: setattr(s, "top_logprobs", None), "top_ids"),
        (lambda s: setattr(s, "top_ids", s.top_ids[:-1]), "top_ids"),
        (lambda s: setattr(s, "top_logprobs", s.top_logprobs[:, :2].copy()), "top_logprobs"),
        (lambda s: s.top_ids.__setitem__((0, 0), -1), "top_ids"),
        (lambda s: s.top_logprobs.__setitem__((0, 0), np.nan), "top_logprobs"),
        (lambda s: s.top_logprobs.__setitem__((0, 0), 0.5), "top_logprobs"),
    ],
)
def test_bad_rows_are_refused_naming_the_field(mutate, field):
    seg = _with_top()
    mutate(seg)
    with pytest.raises(SchemaError) as err:
        encode(make_traj(segments=[seg]))
    assert err.value.field == f"segments[0].{field}"
    with pytest.raises(SchemaError, match=field):
        encode_many([make_traj(), make_traj(segments=[seg])])


def test_a_batch_decode_names_the_bad_record_only():
    good, bad = make_traj(segments=[_with_top()]), make_traj(segments=[_with_top()])
    raw_bad = bytearray(encode(bad))
    at = raw_bad.rindex(np.float32(-0.1).tobytes())  # top_logprobs[0, 0]: the segment's last array
    raw_bad[at + 3] ^= 0x80  # its sign bit (little-endian): -0.1 -> 0.1
    out = decode_many([encode(good), bytes(raw_bad)])
    assert not isinstance(out[0], SchemaError) and isinstance(out[1], SchemaError)
    assert out[1].field == "segments[0].top_logprobs"
