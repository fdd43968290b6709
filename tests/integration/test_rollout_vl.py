"""A rollout pod serving the tiny vision-language model with real vLLM image inputs, over HTTP on loopback."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from rollout_testlib import ServerThread, max_abs_diff, tiny_settings
from vl_testlib import hf_inputs, hf_token_logprobs_vl, image_bytes, wire_image

from molt.models.tiny_vl import IMAGE_SEQ_LEN
from services.rollout.app import build_app

pytestmark = pytest.mark.timeout(300)
TOL = 1e-4
MAX_PIXELS = 200 * 200


@pytest.fixture(scope="module")
def pod(tiny_idefics3):
    settings = tiny_settings(tiny_idefics3, max_images_per_prompt=2, max_image_pixels=MAX_PIXELS)
    with ServerThread(build_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_idefics3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_idefics3)


def _chat(n_images: int) -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    return [{"role": "user", "content": parts}]


def _prompt(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def test_tiny_vl_builds_offline_and_loads(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path / "vl"
    subprocess.run(
        [sys.executable, "-m", "molt.models", "tiny", "--arch", "idefics3", "--out", str(out)],
        check=True,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    inputs = hf_inputs(out, _chat(1), [image_bytes(0)])
    image_token = AutoProcessor.from_pretrained(out).tokenizer.convert_tokens_to_ids("<image>")
    assert int((inputs["input_ids"] == image_token).sum()) == IMAGE_SEQ_LEN
    with torch.no_grad():
        assert model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("n_images", [1, 2])
def test_generate_with_images_matches_transformers(pod, tokenizer, tiny_idefics3, n_images):
    images = [image_bytes(i, fmt=fmt) for i, fmt in zip(range(n_images), ["PNG", "JPEG"])]
    body = {
        "prompt_token_ids": _prompt(tokenizer, _chat(n_images)),
        "images": [wire_image(b) for b in images],
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True},
    }
    r = httpx.post(f"{pod}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    reference = hf_inputs(tiny_idefics3, _chat(n_images), images)
    # The pod answers with the prompt the model saw: each image token expanded exactly as the HF processor does.
    assert answer["prompt_token_ids"] == reference["input_ids"][0].tolist()
    assert answer["prompt_token_count"] == len(answer["prompt_token_ids"])
    out = answer["outputs"][0]
    assert len(out["token_ids"]) == 6
    assert max_abs_diff(out["logprobs"], hf_token_logprobs_vl(tiny_idefics3, reference, out["token_ids"])) < TOL


def test_the_image_changes_the_output(pod, tokenizer):
    prompt = _prompt(tokenizer, _chat(1))
    params = {"max_tokens": 4, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    lps = []
    for seed in (10, 11):
        body = {"prompt_token_ids": prompt, "images": [wire_image(image_bytes(seed))], "sampling_params": params}
        lps.append(httpx.post(f"{pod}/v1/generate", json=body, timeout=60).json()["outputs"][0]["logprobs"])
    assert lps[0] != lps[1]


def test_text_only_request_to_vl_model(pod, tokenizer):
    prompt = _prompt(tokenizer, [{"role": "user", "content": "hello"}])
    r = httpx.post(
        f"{pod}/v1/generate", json={"prompt_token_ids": prompt, "sampling_params": {"max_tokens": 2}}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert "prompt_token_ids" not in r.json()


@pytest.mark.parametrize(
    "images, n_placeholders, code",
    [
        ([{"data": "bm90IGFuIGltYWdl"}], 1, "invalid_image"),  # base64 of "not an image"
        ([{"data": "@@@"}], 1, "invalid_image"),
        ([wire_image(image_bytes(0, fmt="BMP"))], 1, "unsupported_image_format"),
        ([wire_image(image_bytes(0, size=(300, 300)))], 1, "image_too_large"),
        ([wire_image(image_bytes(i)) for i in range(3)], 3, "too_many_images"),
        ([wire_image(image_bytes(0))], 0, "image_placeholder_mismatch"),
        ([wire_image(image_bytes(0))["data"]], 1, "invalid_value"),
    ],
)
def test_bad_images_get_a_400_naming_the_problem(pod, tokenizer, images, n_placeholders, code):
    body = {
        "prompt_token_ids": _prompt(tokenizer, _chat(n_placeholders)),
        "images": images,
        "sampling_params": {"max_tokens": 2},
    }
    r = httpx.post(f"{pod}/v1/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"].startswith("images"), error
    # The pod is fine afterwards.
    ok = {**body, "prompt_token_ids": _prompt(tokenizer, _chat(1)), "images": [wire_image(image_bytes(1))]}
    assert httpx.post(f"{pod}/v1/generate", json=ok, timeout=60).status_code == 200
