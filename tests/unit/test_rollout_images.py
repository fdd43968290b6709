"""The pod's image checks (services/rollout/images.py): every refusal names its problem."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from services.rollout.images import ImageLimits, check_images
from services.rollout.params import RolloutInputError

IMG = 7
LIMITS = ImageLimits(image_token_id=IMG, max_images=2, max_image_bytes=10_000, max_image_pixels=64 * 64)


def _png(size=(8, 6), fmt="PNG") -> dict:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format=fmt)
    return {"data": base64.b64encode(buf.getvalue()).decode()}


def _code(images, prompt, limits=LIMITS) -> str:
    with pytest.raises(RolloutInputError) as err:
        check_images(images, prompt, limits)
    return err.value.code


def test_images_decode_in_order():
    out = check_images([_png((8, 6)), _png((5, 9), "JPEG")], [1, IMG, 2, IMG], LIMITS)
    assert [im.size for im in out] == [(8, 6), (5, 9)] and all(im.mode == "RGB" for im in out)
    assert check_images(None, [1, 2], LIMITS) == [] and check_images([], [1], None) == []


def test_text_only_model_refuses_images():
    assert _code([_png()], [1, IMG], None) == "images_unsupported"
    assert _code([_png()], [1, IMG], ImageLimits(None, 2, 10_000, 4096)) == "images_unsupported"


def test_each_refusal():
    assert _code([_png()] * 3, [IMG] * 3) == "too_many_images"
    assert _code([_png()], [1, 2]) == "image_placeholder_mismatch"
    assert _code(None, [1, IMG]) == _code([], [IMG]) == "image_placeholder_mismatch"  # tokens, nothing to fill them
    assert _code([_png()], [IMG, IMG]) == "image_placeholder_mismatch"
    assert _code([{"data": "!!"}], [IMG]) == "invalid_image"
    assert _code([{"data": base64.b64encode(b"GIF89a nope").decode()}], [IMG]) == "invalid_image"
    assert _code([_png(fmt="BMP")], [IMG]) == "unsupported_image_format"
    assert _code([_png((65, 64))], [IMG]) == "image_too_large"
    assert _code([_png((40, 40))], [IMG], ImageLimits(IMG, 2, 50, 4096)) == "image_too_large"
    assert _code(["abc"], [IMG]) == "invalid_value"
    assert _code({"data": "x"}, [IMG]) == "invalid_value"


def test_truncated_file_is_refused():
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 9, 9)).save(buf, format="PNG")
    cut = {"data": base64.b64encode(buf.getvalue()[:-30]).decode()}
    assert _code([cut], [IMG]) == "invalid_image"
