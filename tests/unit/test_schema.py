"""Trajectory schema: every field round-trips; each misalignment is rejected naming the field."""

import msgpack
import numpy as np
import pytest

from molt.schema import SCHEMA_VERSION, Provenance, SchemaError, Segment, Trajectory, decode, encode


def make_segment(t=10, spans=((3, 5), (7, 10)), experts=False) -> Segment:
    a = sum(e - s for s, e in spans)
    return Segment(
        token_ids=np.arange(t) + 100,
        action_spans=np.array(spans),
        logprobs=-np.linspace(0.1, 2.0, a),
        versions=np.full(a, 3),
        routed_experts=np.arange(t * 2 * 2).reshape(t, 2, 2) % 4 if experts else None,
    )


def make_traj(**kw) -> Trajectory:
    base = dict(
        trajectory_id="t1", group_id="g1", sample_index=2,
        segments=[make_segment(experts=True), make_segment(6, ((1, 3),))],
        reward=1.5, score=0.5, info={"turns": 2.0, "len": 16},
        status="truncated",
        provenance=Provenance(model="m", weight_version=3, tokenizer_hash="th", chat_template_hash="ch",
                              sampling_params={"temperature": 1.0, "n": 1}, env_name="math", env_version="1"),
        events=[{"kind": "pod_switch", "segment": 0, "at_token": 7, "from": "a", "to": "b"}],
        created_at=123.5,
    )
    base.update(kw)
    return Trajectory(**base)


def test_round_trip_every_field():
    traj = make_traj()
    back = decode(encode(traj))
    for name in ("trajectory_id", "group_id", "sample_index", "reward", "score", "info", "status", "provenance",
                 "events", "created_at"):
        assert getattr(back, name) == getattr(traj, name), name
    assert len(back.segments) == 2
    for a, b in zip(traj.segments, back.segments):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.action_spans, b.action_spans)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
        if a.routed_experts is None:
            assert b.routed_experts is None
        else:
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            assert b.routed_experts.dtype == np.int16
    assert back.segments[0].token_ids.dtype == np.int32
    assert back.segments[0].logprobs.dtype == np.float32


def test_arrays_travel_as_bytes_not_lists():
    obj = msgpack.unpackb(encode(make_traj()), raw=False)
    assert obj["schema"] == SCHEMA_VERSION
    assert isinstance(obj["segments"][0]["t"]["b"], bytes)


def test_masks_and_per_token_views():
    seg = make_segment()
    assert seg.action_mask().tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    lp = seg.token_logprobs()
    assert lp[:3].tolist() == [0, 0, 0] and lp[3] == pytest.approx(-0.1)
    assert seg.token_versions().tolist() == [-1, -1, -1, 3, 3, -1, -1, 3, 3, 3]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: setattr(s, "logprobs", s.logprobs[:-1]), "segments[0].logprobs"),
        (lambda s: setattr(s, "versions", np.append(s.versions, 1).astype("<i4")), "segments[0].versions"),
        (lambda s: setattr(s, "action_spans", np.array([[3, 5], [7, 11]], "<i4")), "segments[0].action_spans"),
        (lambda s: setattr(s, "action_spans", np.array([[3, 8], [7, 10]], "<i4")), "segments[0].action_spans"),
        (lambda s: setattr(s, "action_spans", np.array([[5, 3]], "<i4")), "segments[0].action_spans"),
        (lambda s: setattr(s, "action_spans", np.zeros((0, 2), "<i4")), "segments[0].action_spans"),
        (lambda s: setattr(s, "token_ids", np.zeros(0, "<i4")), "segments[0].token_ids"),
        (lambda s: setattr(s, "logprobs", np.full(5, 0.5, "<f4")), "segments[0].logprobs"),
        (lambda s: setattr(s, "logprobs", np.full(5, np.nan, "<f4")), "segments[0].logprobs"),
        (lambda s: setattr(s, "routed_experts", np.zeros((9, 2, 2), "<i2")), "segments[0].routed_experts"),
    ],
)
def test_misaligned_segment_rejected(mutate, field):
    traj = make_traj()
    mutate(traj.segments[0])
    with pytest.raises(SchemaError) as err:
        encode(traj)
    assert err.value.field == field
    # The same record bypassing the encoder's check is rejected by the decoder.
    with pytest.raises(SchemaError) as err:
        decode(encode(traj, validate=False))
    assert err.value.field == field


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"trajectory_id": ""}, "trajectory_id"),
        ({"group_id": ""}, "group_id"),
        ({"sample_index": -1}, "sample_index"),
        ({"segments": []}, "segments"),
        ({"reward": float("nan")}, "reward"),
        ({"score": float("inf")}, "score"),
        ({"info": {"x": "text"}}, "info.x"),
        ({"status": "weird"}, "status"),
    ],
)
def test_bad_trajectory_fields_rejected(kw, field):
    with pytest.raises(SchemaError) as err:
        encode(make_traj(**kw))
    assert err.value.field == field
    assert field in str(err.value)


def test_garbage_and_unknown_version_rejected():
    with pytest.raises(SchemaError, match="record"):
        decode(b"\xc1\xff not msgpack")
    obj = msgpack.unpackb(encode(make_traj()), raw=False)
    obj["schema"] = 99
    with pytest.raises(SchemaError, match="unsupported schema version 99"):
        decode(msgpack.packb(obj, use_bin_type=True))
    del obj["id"]
    obj["schema"] = SCHEMA_VERSION
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.field == "id"
