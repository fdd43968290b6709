"""Molt's ``molt.utils.vlm_utils`` for agents: ``load_images`` and the ``<image>`` placeholder helpers.

An agent's images already arrive decoded (``ctx.images`` are PIL images), so ``load_images`` mostly passes
them through; it also takes what Molt's does (paths, ``file://`` paths, data URLs, bare base64, bytes, a
``datasets`` ``{"bytes", "path"}`` dict, http(s) URLs) through ``molt.images``, and skips what is no image
with a warning, as Molt's does. The processor and tensor helpers of Molt's module are trainer code: the
gateway and the trainer run that part here (importing one says so).
"""

from __future__ import annotations

import http.client
import logging
from typing import Any, NoReturn

from molt.images import MARKER, split_markers, to_image
from molt.utils import left_out

logger = logging.getLogger(__name__)

FETCH_MAX_BYTES = 64 << 20
"""A larger download is skipped as no image (a misdirected URL must not fill the worker's memory)."""


def load_images(image_refs: Any, *, timeout: float = 30.0) -> list[Any]:
    """PIL images (RGB) from one image reference or a list of them; one that cannot be loaded is skipped with a
    warning. An http(s) URL is downloaded here, in the caller's process, only because the caller passed it
    (``timeout``: seconds per socket operation); nothing else touches the network."""
    if image_refs is None:
        return []
    refs = image_refs if isinstance(image_refs, list) else [image_refs]
    images = []
    for i, ref in enumerate(refs):
        try:
            image = _load(ref, f"load_images[{i}]", timeout)
        except (ValueError, OSError, http.client.HTTPException) as exc:  # OSError: a file or a URL's failure
            logger.warning("load_images: skipping image %d: %s", i, str(exc)[:300])
            continue
        # RGB whatever the file held: VLM processors refuse RGBA or grayscale input.
        images.append(image if image.mode == "RGB" else image.convert("RGB"))
    return images


def _load(ref: Any, where: str, timeout: float) -> Any:
    if isinstance(ref, str) and ref.startswith(("http://", "https://")):
        return to_image(_fetch(ref, timeout), where)
    if isinstance(ref, str) and ref.startswith("file://"):
        ref = ref.removeprefix("file://")
    return to_image(ref, where)


def _fetch(url: str, timeout: float) -> bytes:
    from urllib.request import urlopen

    logger.info("load_images: downloading %s", url[:200])
    with urlopen(url, timeout=timeout) as response:  # an http(s) URL: _load sends nothing else here
        raw = response.read(FETCH_MAX_BYTES + 1)
    if len(raw) > FETCH_MAX_BYTES:
        raise ValueError(f"{url[:200]} is over {FETCH_MAX_BYTES} bytes")
    return raw


def split_image_placeholder(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose string content holds ``<image>`` markers, with that content as structured parts:
    ``{"type": "image"}`` for each marker, ``{"type": "text"}`` between them (what chat templates that iterate
    parts, such as Qwen-VL's, render). Any other message is returned as it is."""
    content = message.get("content")
    if not isinstance(content, str) or MARKER not in content:
        return message
    return {**message, "content": split_markers(content, [{"type": "image"}] * content.count(MARKER))}


def should_expand_image_placeholder(tokenizer: Any) -> bool:
    """Whether a model's chat template needs ``split_image_placeholder``: its processor's image token is not
    the literal ``<image>`` (a template that renders ``<image>`` verbatim must get it unsplit)."""
    return getattr(tokenizer, "image_token", MARKER) != MARKER


_TRAINER_SIDE = "the gateway and the trainer tokenize images with the model's processor here; an agent sends images"
LEFT_OUT = dict.fromkeys(
    (
        "media_token_ids",
        "estimate_vllm_input_expansion_delta",
        "process_prompt_with_images",
        "accumulate_mm_inputs",
        "merge_mm_train_inputs",
    ),
    f"{_TRAINER_SIDE} (ctx.images, Result.images, image_url parts) and never handles the tensors",
)


def __getattr__(name: str) -> NoReturn:
    left_out(__name__, name, LEFT_OUT)
