"""Red-team checks of --gateway.fetch_images' public-address rule (services/gateway/image_fetch.py).

A loopback HTTP server stands in for an internal service. DNS rebinding is played by a resolver (a fake: no DNS
server here) that answers 127.0.0.1 to the first lookup and a public address to every later one; IPv6 forms
that reach an IPv4 address through a NAT64 gateway or a 6to4 relay are tried as literals.
"""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import time

import pytest
from PIL import Image

from molt.net import free_port
from services.gateway.config import FetchConfig
from services.gateway.errors import GatewayError
from services.gateway.image_fetch import ImageFetcher, _not_public
from tests.gateway_testlib import file_server


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (9, 9, 9)).save(buf, format="PNG")
    return buf.getvalue()


def _chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def _fetch(body: dict) -> dict:
    async def go():
        fetcher = ImageFetcher(FetchConfig(fetch_images=True))  # no allow-list: public hosts only
        try:
            await fetcher.inline(body)
        finally:
            await fetcher.close()
        return body

    return asyncio.run(go())


def test_a_name_is_looked_up_once_and_judged_by_the_address_connected_to(monkeypatch):
    """DNS rebinding: a name that answers loopback now and a public address on any later lookup. The fetcher
    looks it up once per connection and judges that very answer, so there is no later lookup to pass."""
    hits: list[str] = []
    secret = _png()

    def answer(path: str):
        hits.append(path)
        return 200, {}, secret

    real = socket.getaddrinfo
    lookups = []

    def rebinding(host, port, *args, **kwargs):
        if host == "rebind.example":
            lookups.append(host)
            host = "127.0.0.1" if len(lookups) == 1 else "93.184.216.34"
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with file_server(answer) as base:
        port = base.rsplit(":", 1)[1]
        with pytest.raises(GatewayError) as err:
            _fetch(_chat(f"http://rebind.example:{port}/internal.png"))
    assert err.value.status == 400
    assert "non-public address (127.0.0.1)" in str(err.value), str(err.value)
    assert hits == []  # the internal server was never reached
    assert lookups == ["rebind.example"]


@pytest.mark.parametrize(
    "literal",
    [
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a9fe:a9fe",  # NAT64 of the metadata address 169.254.169.254
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "::7f00:1",  # IPv4-compatible 127.0.0.1
    ],
)
def test_ipv6_forms_of_internal_ipv4_addresses_are_refused(literal):
    assert _not_public(literal)
    with pytest.raises(GatewayError) as err:
        _fetch(_chat(f"http://[{literal}]:9/a.png"))
    assert "non-public address" in str(err.value), str(err.value)


def test_public_ipv6_and_nat64_of_public_addresses_stay_allowed():
    for addr in ("2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::1", "8.8.8.8"):
        assert not _not_public(addr), addr


def test_a_decompression_bomb_header_is_a_400_not_a_crash():
    """A 300-byte PNG that declares 20000 x 20000 pixels: PIL refuses it on open with DecompressionBombError."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\0" * 20001, 9))
        + chunk(b"IEND", b"")
    )
    with pytest.raises(GatewayError) as err:
        ImageFetcher._media_type(bomb, "http://x/bomb.png", "messages[0].content[0]")
    assert err.value.status == 400 and "declares more pixels" in str(err.value)


def test_a_name_that_does_not_resolve_is_a_400(monkeypatch):
    real = socket.getaddrinfo

    def gone(host, port, *args, **kwargs):
        if host == "gone.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", gone)
    with pytest.raises(GatewayError) as err:
        _fetch(_chat("http://gone.example/a.png"))
    assert err.value.status == 400 and "could not fetch" in str(err.value), str(err.value)


def test_a_compressed_answer_is_refused_before_it_is_inflated():
    """An 8 KiB zstd body inflates to 256 MiB in one step, past --gateway.fetch_max_bytes before it is counted:
    the fetcher asks for the file as it is and refuses a Content-Encoding instead of decoding it."""
    zstandard = pytest.importorskip("zstandard")
    import zlib

    bombs = {
        "/z.png": ("zstd", zstandard.ZstdCompressor(level=19).compress(b"\0" * (256 << 20))),
        "/g.png": ("gzip", zlib.compress(b"\0" * (1 << 20), 9)),
    }
    asked: list[str] = []

    def answer(path: str):
        asked.append(path)
        encoding, body = bombs[path]
        return 200, {"content-encoding": encoding}, body

    with file_server(answer) as base:
        for path, (encoding, body) in bombs.items():
            assert len(body) < 70_000
            with pytest.raises(GatewayError) as err:

                async def go(url=f"{base}{path}"):
                    fetcher = ImageFetcher(FetchConfig(fetch_images=True, fetch_allow_hosts=["127.0.0.1"]))
                    try:
                        await fetcher.inline(_chat(url))
                    finally:
                        await fetcher.close()

                asyncio.run(go())
            assert err.value.status == 400
            assert f"Content-Encoding '{encoding}'" in str(err.value), str(err.value)
    assert asked == list(bombs)


def test_the_public_only_transport_fetches_follows_redirects_and_fails_as_a_400(monkeypatch):
    """The transport the address rule runs in serves what httpx's own does: loopback counts as public here so
    the real server answers through it (a file, a redirect, a refused port, a stall, the size cap)."""
    from services.gateway import image_fetch

    monkeypatch.setattr(image_fetch, "_not_public", lambda addr: False)
    png, big = _png(), b"x" * 5000

    def answer(path: str):
        if path == "/moved":
            return 302, {"location": "/a.png"}, b""
        if path == "/slow.png":
            time.sleep(2)
        return (200, {}, big) if path == "/big.png" else (200, {}, png)

    def fetch(url: str, **cfg) -> dict:
        async def go():
            fetcher = ImageFetcher(FetchConfig(fetch_images=True, **cfg))
            try:
                return await fetcher.inline(body := _chat(url)) or body
            finally:
                await fetcher.close()

        return asyncio.run(go())

    data = "data:image/png;base64," + base64.b64encode(png).decode()
    with file_server(answer) as base:
        for path in ("/a.png", "/moved"):
            assert fetch(base + path)["messages"][0]["content"][0]["image_url"]["url"] == data
        for url, cfg, says in (
            (f"{base}/big.png", {"fetch_max_bytes": 1000}, "over --gateway.fetch_max_bytes"),
            (f"{base}/slow.png", {"fetch_timeout_s": 0.5}, "timed out"),
            (f"http://127.0.0.1:{free_port()}/a.png", {}, "could not fetch"),
        ):
            with pytest.raises(GatewayError) as err:
                fetch(url, **cfg)
            assert err.value.status == 400 and says in str(err.value), str(err.value)
