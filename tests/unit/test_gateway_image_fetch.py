"""--gateway.fetch_images: URL images inlined before parsing, against a real loopback HTTP server; every way a
fetch can fail is a 400 naming the part, and nothing is fetched that the body does not name as an image."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import pytest
from PIL import Image

from molt.net import free_port
from services.gateway.config import FetchConfig
from services.gateway.errors import GatewayError
from services.gateway.image_fetch import ImageFetcher
from tests.gateway_testlib import file_server


def _png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


PNG, BIG = _png(), _png((600, 600))


@pytest.fixture(scope="module")
def server():
    hits: list[str] = []
    files = {"/a.png": PNG, "/slow.png": PNG, "/big.png": BIG}

    def answer(path: str) -> tuple[int, dict[str, str], bytes]:
        hits.append(path)
        if path == "/moved":
            return 302, {"location": "/a.png"}, b""
        if path == "/slow.png":
            time.sleep(2)
        return (200, {}, files[path]) if path in files else (404, {}, b"")

    with file_server(answer) as url:
        yield url, hits


def _inline(body: dict, **cfg) -> dict:
    async def go():
        fetcher = ImageFetcher(FetchConfig(fetch_images=True, **cfg))
        try:
            await fetcher.inline(body)
        finally:
            await fetcher.close()
        return body

    return asyncio.run(go())


def _error(body: dict, **cfg) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        _inline(body, **cfg)
    assert err.value.status == 400
    return err.value


def _chat(*urls: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]}


def test_both_wires_get_the_file_inline_and_a_redirect_is_followed(server):
    base, _ = server
    body = _chat(f"{base}/a.png", f"{base}/moved")
    body["messages"][0]["content"][0]["image_url"]["detail"] = "low"
    body["messages"].append(
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": f"{base}/a.png"}}]}
    )
    out = _inline(body)["messages"]
    data = base64.b64encode(PNG).decode()
    assert out[0]["content"][0]["image_url"] == {"url": f"data:image/png;base64,{data}", "detail": "low"}
    assert out[0]["content"][1]["image_url"] == {"url": f"data:image/png;base64,{data}"}
    assert out[1]["content"][0]["source"] == {"type": "base64", "media_type": "image/png", "data": data}


def test_only_image_parts_are_fetched(server):
    base, hits = server
    before = len(hits)
    body = {"messages": [{"role": "user", "content": f"see {base}/a.png"}], "metadata": {"url": f"{base}/a.png"}}
    assert _inline(dict(body)) == body and len(hits) == before


def test_each_failure_is_a_400_naming_the_part(server):
    base, _ = server
    where = "messages[0].content[0].image_url"
    assert _error(_chat(f"{base}/big.png"), fetch_max_bytes=1000).param == where
    assert "over --gateway.fetch_max_bytes" in str(_error(_chat(f"{base}/big.png"), fetch_max_bytes=1000))
    assert "timed out" in str(_error(_chat(f"{base}/slow.png"), fetch_timeout_s=0.5))
    assert "could not fetch" in str(_error(_chat(f"http://127.0.0.1:{free_port()}/a.png")))  # refused
    err = _error(_chat(*[f"{base}/a.png"] * 3), fetch_max_images=2)
    assert "--gateway.fetch_max_images is 2" in str(err)
