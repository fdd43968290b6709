"""Dataset images on their way to an agent: every form a dataset holds them in becomes a data URL, rows with
too many images are an error naming the flag, and a ChatAgent's messages get them inlined by Molt's rule."""

from __future__ import annotations

import base64
import io
import json

import datasets
import pytest
from PIL import Image

from molt.images import from_data_url, inline_images, to_data_url


def _png(color=(255, 0, 0), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format=fmt)
    return buf.getvalue()


def _url(raw: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def test_every_form_of_a_dataset_image_becomes_a_data_url_of_the_same_pixels(tmp_path):
    png, jpeg, bmp = _png(), _png((0, 0, 255), "JPEG"), _png((0, 255, 0), "BMP")
    (tmp_path / "a.png").write_bytes(png)
    assert to_data_url(png, "x") == to_data_url({"bytes": png, "path": None}, "x") == _url(png)  # file unchanged
    assert to_data_url(str(tmp_path / "a.png"), "x") == to_data_url({"path": str(tmp_path / "a.png")}, "x")
    assert to_data_url(jpeg, "x").startswith("data:image/jpeg;base64,")
    assert to_data_url(_url(png), "x") == _url(png)
    for value, raw in ((Image.open(io.BytesIO(png)), png), (bmp, bmp)):  # no file, or a format the gateway refuses
        url = to_data_url(value, "x")
        assert url.startswith("data:image/png;base64,")
        pixels = Image.open(io.BytesIO(raw)).convert("RGB").getdata()
        assert list(from_data_url(url, "x").convert("RGB").getdata()) == list(pixels)


@pytest.mark.parametrize(
    "value,match",
    [
        (b"not an image", "images\\[0\\]: not a readable image"),
        ("data:text/plain;base64,aGk=", "expected a base64 image data URL"),
        ("http://example.com/a.png", "neither a data URL nor an image file"),
        (3, "expected an image"),
    ],
)
def test_what_is_not_an_image_is_an_error_naming_where(value, match):
    with pytest.raises(ValueError, match=match):
        to_data_url(value, "images[0]")


def test_bare_base64_of_an_image_is_taken_and_a_long_string_is_a_value_error(tmp_path):
    png = _png()
    b64 = base64.b64encode(png).decode()
    assert to_data_url(b64, "x") == to_data_url("\n".join([b64[:40], b64[40:]]), "x") == _url(png)
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (1, 2, 3)).save(buf, format="BMP")
    big = base64.b64encode(buf.getvalue()).decode()  # a BMP (re-encoded), longer than any path
    assert len(big) > 4096 and to_data_url(big, "x").startswith("data:image/png;base64,")
    (tmp_path / "AAAA").write_bytes(png)  # a file wins over the same string read as base64
    assert to_data_url(str(tmp_path / "AAAA"), "x") == _url(png)
    # Over NAME_MAX, over PATH_MAX, base64 of no image: the ValueError naming where, not the filesystem's OSError.
    for value in ("A" * 1000, "A" * 10_000, base64.b64encode(b"no image").decode()):
        with pytest.raises(ValueError, match="images\\[0\\]: .* is neither a data URL nor an image file"):
            to_data_url(value, "images[0]")


def test_a_data_url_is_passed_on_and_decoded_where_it_is_used():
    # The env worker decodes every image of a request (its 400 when one is no image).
    assert to_data_url("data:image/png;base64,@@@", "images[0]") == "data:image/png;base64,@@@"
    with pytest.raises(ValueError, match="not valid base64"):
        from_data_url("data:image/png;base64,@@@", "images[0]")


def test_each_marker_of_a_user_string_takes_the_next_image_and_the_rest_stay_as_they_are():
    a, b = _url(_png()), _url(_png((0, 0, 9)))
    messages = [
        {"role": "system", "content": "<image> in a system prompt is text"},
        {"role": "user", "content": "<image>Find x.<image> and y <image>"},
    ]
    out = inline_images(messages, [a, b])
    assert out[0] == messages[0]
    assert out[1]["content"] == [
        {"type": "image_url", "image_url": {"url": a}},
        {"type": "text", "text": "Find x."},
        {"type": "image_url", "image_url": {"url": b}},
        {"type": "text", "text": " and y <image>"},  # more markers than images: literal
    ]
    assert inline_images([{"role": "user", "content": "no marker"}], [a]) == [{"role": "user", "content": "no marker"}]


def test_prompt_dataset_sends_a_rows_images_as_data_urls_and_refuses_rows_over_the_cap(tmp_path, caplog):
    from services.trainer.dispatch import PromptDataset

    rows = [{"problem": "<image>Find x.", "images": [{"bytes": _png(), "path": None}]}, {"problem": "q", "images": []}]
    features = datasets.Features({"problem": datasets.Value("string"), "images": datasets.Sequence(datasets.Image())})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    ds = PromptDataset(str(tmp_path / "hf"), "problem", None, chat=True, max_samples=9, seed=0, max_images=1)
    fields = {p.prompt[0]["content"]: p.episode_fields() for p in ds.rows}
    assert fields["<image>Find x."] == {"images": [_url(_png())]}
    assert fields["q"] == {}
    with caplog.at_level("WARNING", logger="molt.trainer"):
        text_only = PromptDataset(str(tmp_path / "hf"), "problem", None, chat=True, max_samples=9, seed=0)
    assert all(p.images is None for p in text_only.rows)  # --data.max_images_per_prompt 0: not read, and said
    assert "1 of 2 rows hold images in 'images' that are not read: --data.max_images_per_prompt is 0" in caplog.text
    (tmp_path / "two.jsonl").write_text(json.dumps({"problem": "q", "pics": [_url(_png())] * 2}) + "\n")
    with pytest.raises(ValueError, match="row 0 has 2 images in 'pics'; --data.max_images_per_prompt is 1"):
        PromptDataset(
            str(tmp_path / "two.jsonl"),
            "problem",
            None,
            chat=True,
            max_samples=9,
            seed=0,
            image_key="pics",
            max_images=1,
        )
