"""``--gateway.fetch_images``: image URLs that clients send are fetched and inlined before the body is parsed.

OpenAI ``image_url`` parts and Anthropic ``{"type": "url"}`` image sources naming an http(s) URL are replaced
by the fetched file (a data URL, a base64 source), so everything after this sees inline images only and the
trajectory stores the bytes the model saw. All of a request's URLs are fetched concurrently; each must answer
200 with a PNG, JPEG, WebP or GIF file within ``--gateway.fetch_timeout_s`` and ``--gateway.fetch_max_bytes``,
otherwise the request is a 400 naming the part. Off by default: the gateway would fetch any address a client
names (internal services included), so it is for deployments whose egress is restricted.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import httpx

from molt.images import MEDIA_TYPES
from services.gateway.chat import bad_request
from services.gateway.config import FetchConfig

MAX_REDIRECTS = 3


def _is_http(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def _url_parts(body: dict) -> list[tuple[dict, str, str, str]]:
    """(part, wire, url, where) for each image part of ``body["messages"]`` that names an http(s) URL."""
    found = []
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            where = f"messages[{i}].content[{j}]"
            if part.get("type") == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                if _is_http(url):
                    found.append((part, "openai", str(url), where + ".image_url"))
            elif part.get("type") == "image":
                source = part.get("source")
                if isinstance(source, dict) and source.get("type") == "url" and _is_http(source.get("url")):
                    found.append((part, "anthropic", source["url"], where + ".source"))
    return found


class ImageFetcher:
    def __init__(self, cfg: FetchConfig) -> None:
        self.cfg = cfg
        self.client = httpx.AsyncClient(
            timeout=cfg.fetch_timeout_s, follow_redirects=True, max_redirects=MAX_REDIRECTS
        )

    async def inline(self, body: dict) -> None:
        """Replace every http(s) image URL of ``body`` by the fetched file, in place; a 400 if one fails."""
        parts = _url_parts(body)
        if not parts:
            return
        if len(parts) > self.cfg.fetch_max_images:
            raise bad_request(
                f"{len(parts)} image URLs in one request; --gateway.fetch_max_images is {self.cfg.fetch_max_images}",
                "messages",
            )
        files = await asyncio.gather(*(self._fetch(url, where) for _, _, url, where in parts))
        for (part, wire, _, _), (raw, media_type) in zip(parts, files):
            data = base64.b64encode(raw).decode("ascii")
            if wire == "openai":
                detail = part["image_url"] if isinstance(part["image_url"], dict) else {}
                part["image_url"] = {**detail, "url": f"data:{media_type};base64,{data}"}
            else:
                part["source"] = {"type": "base64", "media_type": media_type, "data": data}

    async def _fetch(self, url: str, where: str) -> tuple[bytes, str]:
        try:
            async with asyncio.timeout(self.cfg.fetch_timeout_s):
                async with self.client.stream("GET", url) as answer:
                    if answer.status_code != 200:
                        raise bad_request(f"{where}: fetching {url[:200]} answered HTTP {answer.status_code}", where)
                    chunks, size = [], 0
                    async for chunk in answer.aiter_bytes():
                        size += len(chunk)
                        if size > self.cfg.fetch_max_bytes:
                            raise bad_request(
                                f"{where}: the image at {url[:200]} is over --gateway.fetch_max_bytes "
                                f"({self.cfg.fetch_max_bytes} bytes)",
                                where,
                            )
                        chunks.append(chunk)
        except (httpx.HTTPError, TimeoutError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError | httpx.TimeoutException) else type(exc).__name__
            raise bad_request(f"{where}: could not fetch {url[:200]} ({reason})", where) from None
        raw = b"".join(chunks)
        return raw, self._media_type(raw, url, where)

    @staticmethod
    def _media_type(raw: bytes, url: str, where: str) -> str:
        """From the file itself (a server's Content-Type is not trusted)."""
        from PIL import Image, UnidentifiedImageError

        try:
            fmt = Image.open(io.BytesIO(raw)).format
        except (UnidentifiedImageError, OSError):
            fmt = None
        if fmt not in MEDIA_TYPES:
            raise bad_request(
                f"{where}: {url[:200]} is not a {', '.join(MEDIA_TYPES)} image" + (f" (it is {fmt})" if fmt else ""),
                where,
            )
        return MEDIA_TYPES[fmt]

    async def close(self) -> None:
        await self.client.aclose()
