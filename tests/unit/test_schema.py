"""Trajectory schema: every field round-trips; each misalignment is rejected naming the field."""

import msgpack
import numpy as np
import pytest

from molt.schema import (
    SCHEMA_VERSION,
    Provenance,
    SchemaError,
    Segment,
    Trajectory,
    decode,
    decode_many,
    encode,
    encode_many,
)


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
        trajectory_id="t1",
        group_id="g1",
        sample_index=2,
        segments=[make_segment(experts=True), make_segment(6, ((1, 3),))],
        reward=1.5,
        score=0.5,
        info={"turns": 2.0, "len": 16},
        status="truncated",
        provenance=Provenance(
            model="m",
            weight_version=3,
            tokenizer_hash="th",
            chat_template_hash="ch",
            sampling_params={"temperature": 1.0, "n": 1},
            env_name="math",
            env_version="1",
        ),
        events=[{"kind": "pod_switch", "segment": 0, "at_token": 7, "from": "a", "to": "b"}],
        created_at=123.5,
    )
    base.update(kw)
    return Trajectory(**base)


def test_round_trip_every_field():
    traj = make_traj()
    back = decode(encode(traj))
    for name in (
        "trajectory_id",
        "group_id",
        "sample_index",
        "reward",
        "score",
        "info",
        "status",
        "provenance",
        "events",
        "created_at",
    ):
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
    traj = make_traj()
    obj = msgpack.unpackb(encode(traj), raw=False)
    assert obj["schema"] == SCHEMA_VERSION == 2
    seg = obj["segments"][0]
    assert seg["token_ids"] == traj.segments[0].token_ids.astype("<i4").tobytes()
    assert seg["action_spans"] == np.array([[3, 5], [7, 10]], "<i4").tobytes()
    assert seg["routed_experts_shape"] == [10, 2, 2] and len(seg["routed_experts"]) == 10 * 2 * 2 * 2
    assert "routed_experts" not in obj["segments"][1]  # absent, not null


def test_other_schema_versions_are_rejected_by_name():
    for version in (1, 3, None):
        with pytest.raises(SchemaError, match=f"unsupported schema version {version!r}") as err:
            decode(msgpack.packb({"schema": version, "id": "t1"}, use_bin_type=True))
        assert err.value.field == "schema"


def test_batch_codec_isolates_the_bad_record():
    good = [make_traj(trajectory_id=f"t{i}") for i in range(4)]
    bad = make_traj(trajectory_id="bad")
    bad.segments[1].versions = np.array([3, -1], "<i4")
    with pytest.raises(SchemaError) as err:
        encode_many(good[:2] + [bad] + good[2:])
    assert err.value.field == "segments[1].versions"
    out = decode_many([encode(good[0]), encode(bad, validate=False), b"garbage", encode(good[1])])
    assert [t.trajectory_id for t in (out[0], out[3])] == ["t0", "t1"]
    assert isinstance(out[1], SchemaError) and out[1].field == "segments[1].versions"
    assert isinstance(out[2], SchemaError) and out[2].field == "record"
    assert [decode(b).trajectory_id for b in encode_many(good)] == ["t0", "t1", "t2", "t3"]


def test_wire_type_and_length_errors_name_the_field():
    obj = msgpack.unpackb(encode(make_traj()), raw=False)
    obj["segments"][1]["logprobs"] = obj["segments"][1]["logprobs"][:-1]  # 7 bytes: not whole float32s
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.field == "segments[1].logprobs"
    obj = msgpack.unpackb(encode(make_traj()), raw=False)
    obj["sample_index"] = "two"
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.field == "sample_index"
    del obj["segments"][0]["versions"]
    obj["sample_index"] = 2
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.field == "segments[0].versions"


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
    del obj["trajectory_id"]
    obj["schema"] = SCHEMA_VERSION
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.field == "trajectory_id"
    # A v2 record whose writer ordered the keys differently is still read.
    reordered = {k: v for k, v in reversed(list(msgpack.unpackb(encode(make_traj()), raw=False).items()))}
    assert decode(msgpack.packb(reordered, use_bin_type=True)).trajectory_id == "t1"
