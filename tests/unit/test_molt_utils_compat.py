"""molt.utils for Molt agents: ``load_images`` takes every form Molt's does and skips a bad one with a warning
(an http(s) URL is fetched only when passed, tested on a loopback server), the placeholder helpers, and
``init_logger`` configuring nothing at import; Molt's trainer-side names fail with an ImportError saying why."""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from PIL import Image

from molt.utils.vlm_utils import load_images, should_expand_image_placeholder, split_image_placeholder


def _png(mode="RGB", color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (6, 4), color if mode == "RGB" else None).save(buf, format="PNG")
    return buf.getvalue()


def test_every_form_molt_takes_loads_as_an_rgb_image(tmp_path, monkeypatch):
    import urllib.request

    def no_network(*args, **kwargs):
        raise AssertionError("load_images went to the network")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    raw = _png()
    (tmp_path / "a.png").write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))  # as the base64 tool writes it
    refs = [
        str(tmp_path / "a.png"),
        f"file://{tmp_path / 'a.png'}",
        f"data:image/png;base64,{b64}",
        b64,
        wrapped,
        raw,
        {"bytes": raw, "path": None},
        {"bytes": None, "path": str(tmp_path / "a.png")},
    ]
    images = load_images(refs)
    assert len(images) == len(refs)
    assert all(im.mode == "RGB" and im.size == (6, 4) and im.getpixel((0, 0)) == (200, 10, 10) for im in images)


def test_pil_images_pass_through_and_others_become_rgb():
    rgb = Image.new("RGB", (2, 2))
    assert load_images(rgb)[0] is rgb  # ctx.images are PIL images already
    rgba, gray = Image.new("RGBA", (2, 2)), Image.open(io.BytesIO(_png("L")))
    assert [im.mode for im in load_images([rgba, gray])] == ["RGB", "RGB"]
    assert load_images(None) == [] and load_images([]) == []


def test_what_is_no_image_is_skipped_with_a_warning(tmp_path, caplog):
    good = Image.new("RGB", (2, 2))
    bad = [b"not an image", "/no/such/file.png", "x" * 100_000, "y" * 1000, "bm90IGFuIGltYWdl", {"path": None}, None]
    with caplog.at_level(logging.WARNING, logger="molt.utils.vlm_utils"):
        assert load_images([*bad, good]) == [good]
    assert len(caplog.records) == len(bad)
    # long strings (over PATH_MAX, over NAME_MAX): the ValueError naming them, never the filesystem's OSError
    assert all("neither a data URL nor an image file" in caplog.records[i].getMessage() for i in (2, 3))


class _Server(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path in ("/a.png", "/slow.png"):
            body = _png()
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
                pass
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def loopback():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_an_http_url_is_downloaded_when_passed_and_a_failure_is_skipped(loopback, caplog):
    with caplog.at_level(logging.INFO, logger="molt.utils.vlm_utils"):
        images = load_images([f"{loopback}/a.png", f"{loopback}/missing.png"])
        slow = load_images(f"{loopback}/slow.png", timeout=0.2)
    assert [im.size for im in images] == [(6, 4)] and slow == []
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"load_images: downloading {loopback}/a.png") for m in messages)  # never silent
    assert any("skipping image 1" in m and "404" in m for m in messages)
    assert any("skipping image 0" in m and "timed out" in m for m in messages)


def test_split_image_placeholder_as_molt():
    message = {"role": "user", "content": "<image>\nFind x.<image>"}
    assert split_image_placeholder(message) == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "\nFind x."}, {"type": "image"}],
    }
    plain = {"role": "user", "content": "no marker"}
    parts = {"role": "user", "content": [{"type": "text", "text": "<image>"}]}
    assert split_image_placeholder(plain) is plain and split_image_placeholder(parts) is parts
    assert should_expand_image_placeholder(SimpleNamespace(image_token="<|image_pad|>"))
    assert not should_expand_image_placeholder(SimpleNamespace(image_token="<image>"))
    assert not should_expand_image_placeholder(object())


def test_init_logger_prints_info_to_its_own_stdout_handler_and_touches_nothing_else():
    molt_logger = logging.getLogger("molt")
    before = (list(molt_logger.handlers), molt_logger.propagate, list(logging.getLogger().handlers))
    from molt.utils.logging_utils import init_logger

    log = init_logger("my_agent")
    assert init_logger("my_agent") is log and len(log.handlers) == 1
    assert log.level == logging.DEBUG and not log.propagate
    assert (list(molt_logger.handlers), molt_logger.propagate, list(logging.getLogger().handlers)) == before
    handler = log.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    out = io.StringIO()
    previous = handler.setStream(out)
    try:
        log.debug("hidden")
        log.info("first\nsecond")
    finally:
        handler.setStream(previous)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("INFO ") and lines[0].endswith("] first")
    assert lines[1] == lines[0].removesuffix("first") + "second"  # each line keeps the prefix


@pytest.mark.parametrize(
    "module,name,why",
    [
        ("molt.utils.vlm_utils", "process_prompt_with_images", "model's processor"),
        ("molt.utils.vlm_utils", "merge_mm_train_inputs", "model's processor"),
        ("molt.utils.logging_utils", "WandbLogger", "Result.info"),
        ("molt.utils", "get_tokenizer", "AutoTokenizer"),
    ],
)
def test_molts_trainer_side_helpers_fail_with_an_import_error_saying_why(module, name, why):
    import importlib

    mod = importlib.import_module(module)
    with pytest.raises(ImportError, match=f"{module}.{name} is Molt trainer code.*{why}"):
        exec(f"from {module} import {name}", {})
    assert not hasattr(mod, "no_such_name")  # other names: the usual AttributeError
