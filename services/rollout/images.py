"""Images on the pod's wire: checked and decoded before anything reaches the engine.

A request carries its images as ``"images": [{"data": "<base64 of the image file>"}, ...]`` (PNG, JPEG,
WebP or GIF bytes, never pixel lists) in the order their placeholders appear in ``prompt_token_ids``.
The prompt holds ONE image token per image, as the model's chat template renders an image part; vLLM's
multimodal processor expands each into the run of tokens the model sees, and the pod answers with that
expanded ``prompt_token_ids`` so the caller records exactly what the model was given.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from services.rollout.params import RolloutInputError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImageLimits:
    image_token_id: int | None
    """The model's image placeholder token; None for a text-only model (images are refused)."""
    max_images: int
    max_image_bytes: int
    max_image_pixels: int


def _bad(msg: str, param: str, code: str) -> RolloutInputError:
    return RolloutInputError(msg, param=param, code=code)


def decode_image(data: bytes, limits: ImageLimits, param: str):
    """One image file's bytes -> an RGB PIL image; RolloutInputError naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise _bad(
            f"{param} is {len(data)} bytes; this pod accepts images up to {limits.max_image_bytes} bytes "
            "(--rollout.max_image_bytes)",
            param,
            "image_too_large",
        )
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise _bad(
            f"{param} is not a decodable image (expected {', '.join(ALLOWED_FORMATS)} bytes)", param, "invalid_image"
        ) from None
    if image.format not in ALLOWED_FORMATS:
        raise _bad(
            f"{param} is a {image.format} image; supported formats: {', '.join(ALLOWED_FORMATS)}",
            param,
            "unsupported_image_format",
        )
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _bad(
            f"{param} is {width}x{height} pixels; this pod accepts at most {limits.max_image_pixels} pixels "
            "(--rollout.max_image_pixels)",
            param,
            "image_too_large",
        )
    try:
        image.load()  # a truncated or corrupt file fails here, not inside the engine
    except (OSError, SyntaxError, ValueError) as exc:
        raise _bad(f"{param} could not be decoded: {exc}", param, "invalid_image") from None
    return image.convert("RGB")


def check_images(images: Any, prompt_token_ids: list[int], limits: ImageLimits | None) -> list:
    """The request's images as PIL images (empty list when it has none), after every check."""
    if images is None or images == []:
        token = None if limits is None else limits.image_token_id
        if token is not None and token in prompt_token_ids:  # placeholders with nothing to fill them
            raise _bad(
                f"prompt_token_ids hold {prompt_token_ids.count(token)} image token(s) (id {token}) but no images "
                "were sent; send one image per image token",
                "images",
                "image_placeholder_mismatch",
            )
        return []
    if limits is None or limits.image_token_id is None:
        raise _bad(
            "this model takes no images (it is a text-only model); send text only", "images", "images_unsupported"
        )
    if not isinstance(images, list):
        raise _bad('images must be a list of {"data": "<base64 image file>"} objects', "images", "invalid_value")
    if len(images) > limits.max_images:
        raise _bad(
            f"{len(images)} images in one request; this pod accepts at most {limits.max_images} "
            "(--rollout.max_images_per_prompt)",
            "images",
            "too_many_images",
        )
    placeholders = prompt_token_ids.count(limits.image_token_id)
    if placeholders != len(images):
        raise _bad(
            f"prompt_token_ids hold {placeholders} image token(s) (id {limits.image_token_id}) but {len(images)} "
            "image(s) were sent; render one image token per image with the model's chat template",
            "images",
            "image_placeholder_mismatch",
        )
    decoded = []
    for i, item in enumerate(images):
        param = f"images[{i}]"
        if not isinstance(item, dict) or set(item) != {"data"} or not isinstance(item["data"], str):
            raise _bad(f'{param} must be {{"data": "<base64 image file>"}}', param, "invalid_value")
        try:
            data = base64.b64decode(item["data"], validate=True)
        except (binascii.Error, ValueError):
            raise _bad(f"{param}.data is not valid base64", param, "invalid_image") from None
        decoded.append(decode_image(data, limits, param))
    return decoded
