"""A VL sample cut at --data.max_len keeps only whole images: a split image's token run goes with it."""

from __future__ import annotations

import pytest

from molt.schema import SchemaError
from services.trainer.vision import cut_at_whole_image

IMG = 9  # the image token


class _Vision:
    """The two things the cut needs from the model's processor: its image token and each image's run."""

    image_token_id = IMG

    @staticmethod
    def num_tokens(image: bytes) -> int:
        return len(image)  # the fake "file" is as long as its run


TOKENS = [1, 5, IMG, IMG, 5, 6, IMG, IMG, IMG, 6]
A, B = b"aa", b"bbb"  # runs at 2-3 and 6-8


@pytest.mark.parametrize(
    "t, cut, kept",
    [
        (10, 10, [A, B]),  # nothing cut
        (9, 9, [A, B]),  # the cut falls after B's run
        (8, 6, [A]),  # would split B (6-8): cut before B's first image token
        (6, 6, [A]),  # right at B's start
        (3, 2, []),  # would split A: cut at 2, no image left
        (2, 2, []),
    ],
)
def test_cut_moves_back_to_the_first_token_of_a_split_image(t, cut, kept):
    assert cut_at_whole_image(TOKENS, t, [A, B], _Vision()) == (cut, kept)  # type: ignore[arg-type]


def test_more_images_than_image_tokens_is_a_schema_error():
    with pytest.raises(SchemaError, match="image tokens"):
        cut_at_whole_image(TOKENS, 9, [A, B, b"cc"], _Vision())  # type: ignore[arg-type]
