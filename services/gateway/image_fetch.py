"""``--gateway.fetch_images``: image URLs that clients send are fetched and inlined before the body is parsed.

OpenAI ``image_url`` parts and Anthropic ``{"type": "url"}`` image sources naming an http(s) URL are replaced
by the fetched file (a data URL, a base64 source), so everything after this sees inline images only and the
trajectory stores the bytes the model saw. All of a request's URLs are fetched concurrently; each must answer
200 with a PNG, JPEG, WebP or GIF file, uncompressed (no Content-Encoding), within ``--gateway.fetch_timeout_s``
and ``--gateway.fetch_max_bytes``, otherwise the request is a 400 naming the part. Responses ``input_image``
parts (``image_url`` a URL string) too.

Which hosts: with ``--gateway.fetch_allow_hosts`` empty, any host whose every address is public (not loopback,
private, link-local such as cloud metadata at 169.254.169.254, or reserved); each redirect hop is checked the
same way. With it set, only the hosts it names (exact, or ``*.domain``), wherever they resolve: the operator
vouches for them. The public-address rule is applied where the connection is made, to the very addresses it
connects to (a name that answers a public address once and a private one the next time, DNS rebinding, is judged
by the address connected to); an IPv6 address that embeds an IPv4 one (NAT64, 6to4, Teredo) is judged by that one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import certifi
import httpcore
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


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _not_public(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        # A NAT64 gateway, a 6to4 relay or a Teredo server forwards these to the IPv4 address they embed, which
        # Python still calls global (64:ff9b::a9fe:a9fe reaches 169.254.169.254): judge that address instead.
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif ip.teredo is not None:
            ip = ip.teredo[1]
        elif any(ip in net for net in _NAT64) or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return not ip.is_global


def _refusal(host: str, private: list[str]) -> _HostRefused:
    return _HostRefused(
        f"{host} resolves to a non-public address ({private[0]}); name it in --gateway.fetch_allow_hosts "
        "to fetch from it"
    )


class _HostRefused(Exception):
    """A URL (or a redirect hop) names a host the fetcher may not reach; the message says why."""


class _PublicOnlyBackend(httpcore.AsyncNetworkBackend):
    """Resolves a host once, refuses it unless every address is public, and connects to those addresses.

    A check that resolved the name apart from the connection could pass an address the connection then does not
    use (DNS rebinding to 127.0.0.1 or the metadata address): here the address checked is the address connected
    to."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self.inner = inner

    # httpcore's backend interface: it passes these by name, ``timeout`` included.
    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):  # noqa: ASYNC109
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:  # as httpcore's own backends report a name that does not resolve
            raise httpcore.ConnectError(str(exc)) from None
        addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        private = sorted(a for a in addrs if _not_public(a))
        if private:
            raise _refusal(host, private)
        failure: Exception | None = None
        for addr in addrs:
            try:
                return await self.inner.connect_tcp(addr, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                failure = exc
        raise failure or httpcore.ConnectError(f"{host} has no address")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):  # noqa: ASYNC109
        raise _HostRefused("unix sockets are never fetched from")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _ByteStream(httpx.AsyncByteStream):
    """httpcore's response body as httpx's, with httpcore's errors as httpx's."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for chunk in self.stream:
                yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except httpcore.TimeoutException as exc:
        raise httpx.TimeoutException(str(exc)) from exc
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError) as exc:
        raise httpx.TransportError(str(exc)) from exc


class _PublicOnlyTransport(httpx.AsyncBaseTransport):
    """httpx's custom-transport interface over an httpcore pool on ``_PublicOnlyBackend`` (both public APIs:
    httpx's own transport takes no network backend). No proxy: a proxy resolves names itself, out of reach of
    the address rule."""

    def __init__(self) -> None:
        self.pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl.create_default_context(cafile=certifi.where()),  # httpx's default trust store
            network_backend=_PublicOnlyBackend(httpcore.AnyIOBackend()),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(
            scheme=request.url.raw_scheme,
            host=request.url.raw_host,
            port=request.url.port,
            target=request.url.raw_path,
        )
        core = httpcore.Request(
            method=request.method,
            url=url,
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx_errors():
            answer = await self.pool.handle_async_request(core)
        return httpx.Response(
            status_code=answer.status,
            headers=answer.headers,
            stream=_ByteStream(answer.stream),
            extensions=answer.extensions,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()


class ImageFetcher:
    def __init__(self, cfg: FetchConfig) -> None:
        self.cfg = cfg
        # Named hosts are fetched wherever they resolve (no address rule), through httpx's own transport.
        transport = None if cfg.fetch_allow_hosts else _PublicOnlyTransport()
        self.client = httpx.AsyncClient(
            timeout=cfg.fetch_timeout_s,
            follow_redirects=True,
            max_redirects=MAX_REDIRECTS,
            transport=transport,
            event_hooks={"request": [self._check_host]},  # every hop, redirects included
        )

    async def _check_host(self, request: httpx.Request) -> None:
        """The allow-list, on every hop. Without one, the public-address rule is ``_PublicOnlyBackend``'s, applied
        to the addresses each connection is made to (resolving here too would only look the name up twice)."""
        host, allow = request.url.host, self.cfg.fetch_allow_hosts
        if allow and not host_allowed(host, allow):
            raise _HostRefused(f"{host} is not in --gateway.fetch_allow_hosts")

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
                async with self.client.stream("GET", url, headers={"accept-encoding": "identity"}) as answer:
                    if answer.status_code != 200:
                        raise bad_request(f"{where}: fetching {url[:200]} answered HTTP {answer.status_code}", where)
                    # Decoded bytes are counted only after a whole network chunk is inflated, and zstd turns 8 KiB
                    # into 256 MiB: the size cap would come too late. Images are fetched as sent, never inflated.
                    encoding = answer.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):
                        raise bad_request(
                            f"{where}: {url[:200]} answered with Content-Encoding {encoding[:40]!r}; images are "
                            "fetched uncompressed only",
                            where,
                        )
                    chunks, size = [], 0
                    async for chunk in answer.aiter_raw():
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
        except Image.DecompressionBombError:
            # A small file whose header claims billions of pixels: PIL refuses it on open, with an exception that
            # is not an OSError; it is the client's bad image (a 400), not the gateway's failure.
            raise bad_request(
                f"{where}: {url[:200]} declares more pixels than any image the gateway takes", where
            ) from None
        if fmt not in MEDIA_TYPES:
            raise bad_request(
                f"{where}: {url[:200]} is not a {', '.join(MEDIA_TYPES)} image" + (f" (it is {fmt})" if fmt else ""),
                where,
            )
        return MEDIA_TYPES[fmt]

    async def close(self) -> None:
        await self.client.aclose()
