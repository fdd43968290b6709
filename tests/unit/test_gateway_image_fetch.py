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
from services.gateway.image_fetch import ImageFetcher, host_allowed
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
    cfg.setdefault("fetch_allow_hosts", ["127.0.0.1"])  # the test server is on loopback, refused by default

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


def test_responses_input_image_urls_are_fetched_in_input_items_and_tool_outputs(server):
    base, _ = server
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": f"{base}/a.png"}]},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": f"{base}/a.png"}],
            },
        ]
    }
    out = _inline(body)["input"]
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert out[0]["content"][0]["image_url"] == url and out[1]["output"][0]["image_url"] == url
    err = _error({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": f"{base}/nope.png"}]}]})
    assert err.param == "input[0].content[0].image_url"


def test_by_default_only_public_hosts_are_fetched_every_redirect_hop_too(server):
    base, hits = server
    before = len(hits)
    for url in (
        f"{base}/a.png",
        "http://localhost:9/a.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]:9/a",
    ):
        err = _error(_chat(url), fetch_allow_hosts=[])
        assert "non-public address" in str(err) and "--gateway.fetch_allow_hosts" in str(err), str(err)
    assert len(hits) == before  # refused before any connection
    err = _error(_chat(f"{base}/a.png"), fetch_allow_hosts=["images.example.com"])
    assert "127.0.0.1 is not in --gateway.fetch_allow_hosts" in str(err)


def test_a_redirect_to_a_host_off_the_list_is_refused():
    with file_server(lambda path: (302, {"location": "http://169.254.169.254/x.png"}, b"")) as url:
        err = _error(_chat(f"{url}/go"))
    assert "169.254.169.254 is not in --gateway.fetch_allow_hosts" in str(err)


def test_host_allowed_matches_names_and_wildcard_domains():
    allow = ["cdn.example.com", "*.images.example.org"]
    assert host_allowed("CDN.example.com.", allow) and host_allowed("a.b.images.example.org", allow)
    assert not host_allowed("images.example.org", allow) and not host_allowed("evilcdn.example.com", allow)
    assert not host_allowed("xcdn.example.com", allow)
