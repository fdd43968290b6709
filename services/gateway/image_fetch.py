"""``--gateway.fetch_images``: image URLs that clients send are fetched and inlined before the body is parsed.

OpenAI ``image_url`` parts and Anthropic ``{"type": "url"}`` image sources naming an http(s) URL are replaced
by the fetched file (a data URL, a base64 source), so everything after this sees inline images only and the
trajectory stores the bytes the model saw. All of a request's URLs are fetched concurrently; each must answer
200 with a PNG, JPEG, WebP or GIF file within ``--gateway.fetch_timeout_s`` and ``--gateway.fetch_max_bytes``,
otherwise the request is a 400 naming the part. Responses ``input_image`` parts (``image_url`` a URL string) too.

Which hosts: with ``--gateway.fetch_allow_hosts`` empty, any host whose every address is public (not loopback,
private, link-local such as cloud metadata at 169.254.169.254, or reserved); each redirect hop is checked the
same way. With it set, only the hosts it names (exact, or ``*.domain``), wherever they resolve: the operator
vouches for them. The check resolves the name and the connection resolves it again, so a name whose answers
change in between could pass the public-address rule; name the hosts where that matters.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import socket
from typing import Any

import httpx

from molt.images import MEDIA_TYPES
from services.gateway.chat import bad_request
from services.gateway.config import FetchConfig

MAX_REDIRECTS = 3


def _is_http(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def _url_parts(body: dict) -> list[tuple[dict, str, str, str]]:
    """(part, wire, url, where) for each image part that names an http(s) URL: in ``body["messages"]`` (OpenAI
    chat, Anthropic) or ``body["input"]`` (Responses items, a tool output's parts included)."""
    found = []
    for key in ("messages", "input"):
        items = body.get(key)
        for i, item in enumerate(items if isinstance(items, list) else []):
            for field in ("content", "output"):
                content = item.get(field) if isinstance(item, dict) else None
                for j, part in enumerate(content if isinstance(content, list) else []):
                    hit = _url_of(part) if isinstance(part, dict) else None
                    if hit is not None:
                        wire, url, sub = hit
                        found.append((part, wire, url, f"{key}[{i}].{field}[{j}]{sub}"))
    return found


def _url_of(part: dict) -> tuple[str, str, str] | None:
    """(wire, url, sub-field) when ``part`` is an image part naming an http(s) URL."""
    kind = part.get("type")
    if kind == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        return ("openai", str(url), ".image_url") if _is_http(url) else None
    if kind == "input_image":
        url = part.get("image_url")
        return ("responses", str(url), ".image_url") if _is_http(url) else None
    if kind == "image":
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "url" and _is_http(source.get("url")):
            return "anthropic", source["url"], ".source"
    return None


def host_allowed(host: str, allow: list[str]) -> bool:
    """Whether ``host`` is one of ``allow``'s names: exact (case-insensitive), or ``*.domain`` for any name
    under that domain."""
    host = host.lower().rstrip(".")
    for name in allow:
        name = name.lower().rstrip(".")
        if host == name or (name.startswith("*.") and host.endswith(name[1:])):
            return True
    return False


def _not_public(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global


class _HostRefused(Exception):
    """A URL (or a redirect hop) names a host the fetcher may not reach; the message says why."""


class ImageFetcher:
    def __init__(self, cfg: FetchConfig) -> None:
        self.cfg = cfg
        self.client = httpx.AsyncClient(
            timeout=cfg.fetch_timeout_s,
            follow_redirects=True,
            max_redirects=MAX_REDIRECTS,
            event_hooks={"request": [self._check_host]},  # every hop, redirects included
        )

    async def _check_host(self, request: httpx.Request) -> None:
        host, allow = request.url.host, self.cfg.fetch_allow_hosts
        if allow:
            if not host_allowed(host, allow):
                raise _HostRefused(f"{host} is not in --gateway.fetch_allow_hosts")
            return
        try:
            port = request.url.port or (443 if request.url.scheme == "https" else 80)
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return  # unresolvable: the connection fails and says so
        private = sorted({str(info[4][0]) for info in infos if _not_public(str(info[4][0]))})
        if private:
            raise _HostRefused(
                f"{host} resolves to a non-public address ({private[0]}); name it in --gateway.fetch_allow_hosts "
                "to fetch from it"
            )

    async def inline(self, body: dict) -> None:
        """Replace every http(s) image URL of ``body`` by the fetched file, in place; a 400 if one fails."""
        parts = _url_parts(body)
        if not parts:
            return
        if len(parts) > self.cfg.fetch_max_images:
            raise bad_request(
                f"{len(parts)} image URLs in one request; --gateway.fetch_max_images is {self.cfg.fetch_max_images}",
                parts[0][3].split("[", 1)[0],
            )
        files = await asyncio.gather(*(self._fetch(url, where) for _, _, url, where in parts))
        for (part, wire, _, _), (raw, media_type) in zip(parts, files):
            data = base64.b64encode(raw).decode("ascii")
            if wire == "openai":
                detail = part["image_url"] if isinstance(part["image_url"], dict) else {}
                part["image_url"] = {**detail, "url": f"data:{media_type};base64,{data}"}
            elif wire == "responses":
                part["image_url"] = f"data:{media_type};base64,{data}"
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
        except _HostRefused as exc:
            raise bad_request(f"{where}: not fetched: {exc}", where) from None
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
