"""Image files in trajectories (molt/schema.py): stored once by sha256, referenced per segment in token order."""

from __future__ import annotations

import hashlib

import pytest

from molt.schema import SchemaError, Segment, Trajectory, decode, encode

A, B = b"image-a-bytes", b"image-b-bytes"
HA, HB = hashlib.sha256(A).hexdigest(), hashlib.sha256(B).hexdigest()


def _traj(images: dict, seg_images: list[list[str]]) -> Trajectory:
    segs = [Segment([1, 9, 9, 2, 5, 6], [(4, 6)], [-0.5, -0.25], [0, 0], images=imgs) for imgs in seg_images]
    return Trajectory("t", "g", 0, segs, reward=1.0, images=images)


def test_images_round_trip_once_per_episode():
    back = decode(encode(_traj({HA: A, HB: B}, [[HA, HB], [HA]])))
    assert back.images == {HA: A, HB: B}
    assert [s.images for s in back.segments] == [[HA, HB], [HA]]
    plain = decode(encode(_traj({}, [[]])))
    assert plain.images == {} and plain.segments[0].images == []


@pytest.mark.parametrize(
    "images, seg_images, field",
    [
        ({HA: A}, [[HA, HB]], "segments[0].images"),  # shown but not stored
        ({HA: A, HB: B}, [[HA]], "images"),  # stored but never shown
        ({HA: B}, [[HA]], "images"),  # bytes that do not hash to their key
    ],
)
def test_inconsistent_images_are_refused(images, seg_images, field):
    with pytest.raises(SchemaError) as err:
        encode(_traj(images, seg_images))
    assert err.value.field == field
