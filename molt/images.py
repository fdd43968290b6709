"""Dataset images on their way to an agent: data URLs of the image file, and Molt's inlining rule.

The trainer reads a row's images (``--data.image_key``) in whatever form the dataset holds them (a PIL image,
``{"bytes", "path"}`` as a ``datasets`` Image column stores them, raw bytes, a file path, a data URL or the
bare base64 of the file) and
sends each to the env worker as ``data:<media type>;base64,<file>``. Files in a format the gateway takes (PNG,
JPEG, WebP, GIF) travel unchanged, anything else is re-encoded as PNG (same pixels).

A ChatAgent gets them as Molt gives them: ``ctx.images`` (PIL images) and ``ctx.messages`` in which each
literal ``<image>`` of a user string consumes the next image, inlined as an OpenAI ``image_url`` part. Markers
beyond the images stay literal text; images beyond the markers are only on ``ctx.images``.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path
from typing import Any

MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MARKER = "<image>"


def _open(raw: bytes, where: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"{where}: not a readable image ({type(exc).__name__})") from None
    return image


def _encode(raw: bytes | None, image, where: str) -> str:
    """``raw`` (the file, when there is one) or ``image`` (PIL) -> data URL."""
    if raw is not None:
        image = _open(raw, where)
        media_type = MEDIA_TYPES.get(image.format or "")
        if media_type is not None:
            return f"data:{media_type};base64,{base64.b64encode(raw).decode('ascii')}"
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def to_data_url(value: Any, where: str) -> str:
    """One dataset image -> ``data:image/...;base64,...``; ValueError naming ``where`` if it is not an image."""
    if isinstance(value, str) and value.startswith("data:"):
        # Passed on as it is: the env worker decodes every image of a request (a bad one is its 400).
        if not (value.startswith("data:image/") and ";base64," in value[:64]):
            raise ValueError(f"{where}: expected a base64 image data URL, got {value[:40]!r}")
        return value
    return _encode(*_source(value, where), where)


def to_image(value: Any, where: str):
    """One dataset image (any form ``to_data_url`` takes) -> PIL image, decoded from its file as it is (no
    re-encoding); a PIL image is returned as given. ValueError naming ``where`` if it is not an image."""
    raw, image = _source(value, where)
    return image if raw is None else _open(raw, where)


def _source(value: Any, where: str) -> tuple[bytes | None, Any]:
    """``(file bytes, None)``, or ``(None, PIL image)`` for an image already decoded."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return None, value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = value.get("bytes") or value["path"]  # a datasets Image column, not decoded
    if isinstance(value, bytes | bytearray):
        return bytes(value), None
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: expected an image (PIL image, bytes, path or data URL), got {type(value).__name__}"
        )
    if value.startswith("data:"):
        return _payload(value, where), None
    if _is_file(value):
        return Path(value).read_bytes(), None
    raw = _b64decode(re.sub(r"\s+", "", value))  # line breaks allowed, as the base64 tool writes them
    if raw is not None and _is_image(raw):
        return raw, None  # bare base64 of the file, as Molt's load_images takes it
    raise ValueError(f"{where}: {value[:80]!r} is neither a data URL nor an image file (nor base64 of an image)")


# Longer than any path the OS takes: such a string (a base64 payload) never reaches the filesystem, where
# it would be an OSError (ENAMETOOLONG) instead of the ValueError naming the image.
_PATH_MAX = 4096


def _is_file(value: str) -> bool:
    if len(value) > _PATH_MAX or "\0" in value:
        return False
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a name component over NAME_MAX, say
        return False


def _b64decode(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _is_image(raw: bytes) -> bool:
    """Whether PIL knows the file's header (the pixels are decoded where the image is used)."""
    from PIL import Image, UnidentifiedImageError

    try:
        Image.open(io.BytesIO(raw)).close()
    except (UnidentifiedImageError, OSError, ValueError):
        return False
    return True


def _payload(url: str, where: str) -> bytes:
    """The file a ``data:image/...;base64,...`` URL holds; ValueError naming ``where`` otherwise."""
    head, sep, data = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise ValueError(f"{where}: expected a base64 image data URL (data:image/png;base64,...), got {url[:40]!r}")
    raw = _b64decode(data)
    if raw is None:
        raise ValueError(f"{where}: the data URL's payload is not valid base64")
    return raw


def to_bytes(value: Any, where: str) -> bytes:
    """One dataset image -> its file (re-encoded as PNG where ``to_data_url`` would); ValueError naming ``where``."""
    return _payload(to_data_url(value, where), where)


def from_data_url(url: str, where: str):
    """``data:image/...;base64,...`` -> PIL image; ValueError naming ``where`` otherwise."""
    image = _open(_payload(url, where), where)
    if image.format not in MEDIA_TYPES:
        raise ValueError(f"{where}: a {image.format} image; supported: {', '.join(MEDIA_TYPES)}")
    return image


def count_markers(messages: list[dict[str, Any]]) -> int:
    """How many ``<image>`` markers the user strings of ``messages`` hold."""
    return sum(
        m["content"].count(MARKER) for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)
    )


def inline_images(messages: list[dict[str, Any]], urls: list[str]) -> list[dict[str, Any]]:
    """Molt's rule: each ``<image>`` in a user string, in order, becomes the next image's ``image_url`` part."""
    return inline_parts(messages, [{"type": "image_url", "image_url": {"url": url}} for url in urls])


def inline_parts(messages: list[dict[str, Any]], images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``inline_images`` with the image parts given (``{"type": "image"}`` for a template that renders the
    model's placeholder with no URL, as SFT's rendering does)."""
    left = list(images)
    out = []
    for message in messages:
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, str) or MARKER not in content or not left:
            out.append(message)
            continue
        out.append({**message, "content": split_markers(content, left)})
    return out


def split_markers(content: str, left: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``content`` as text parts with each ``<image>`` replaced by the next part taken (popped) from ``left``;
    markers beyond ``left`` stay literal text."""
    pieces = content.split(MARKER)
    parts: list[dict[str, Any]] = []
    text = pieces[0]
    for piece in pieces[1:]:
        if not left:
            text += MARKER + piece
            continue
        if text:
            parts.append({"type": "text", "text": text})
        parts.append(left.pop(0))
        text = piece
    if text:
        parts.append({"type": "text", "text": text})
    return parts


_EXPANDED = re.compile(r"the prompt has (\d+) tokens with its images expanded")


def expanded_prompt_error(tokens: int, context: int) -> str:
    """The rollout pod's ``context_length_exceeded`` message for a prompt whose images, expanded by the model's
    processor, take it past the context; ``expanded_prompt_length`` reads the length back (the gateway)."""
    return f"the prompt has {tokens} tokens with its images expanded, over the context length {context}"


def expanded_prompt_length(message: str) -> int | None:
    found = _EXPANDED.search(message)
    return int(found.group(1)) if found else None
