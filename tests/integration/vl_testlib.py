"""Helpers of the vision-language tests: small images as file bytes and the transformers reference."""

from __future__ import annotations

import base64
import io
from functools import lru_cache
from pathlib import Path

import torch


def image_bytes(seed: int, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    """A random RGB image (width, height) encoded as ``fmt``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def wire_image(data: bytes) -> dict:
    return {"data": base64.b64encode(data).decode("ascii")}


@lru_cache(maxsize=2)
def _hf(model: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return (
        AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval(),
        AutoProcessor.from_pretrained(model),
    )


def hf_inputs(model: Path, messages: list[dict], images: list[bytes]) -> dict:
    """The HF processor's expansion of a chat with images: input_ids and pixel inputs, as transformers runs it."""
    from PIL import Image

    _, processor = _hf(str(model))
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[text], images=[pil] if pil else None, return_tensors="pt")


def hf_token_logprobs_vl(model: Path, inputs: dict, completion: list[int]) -> list[float]:
    """transformers' log_softmax of each completion token after the (expanded) prompt with its images (fp32)."""
    hf, _ = _hf(str(model))
    prompt = inputs["input_ids"]
    ids = torch.cat([prompt, torch.tensor([completion])], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = hf(input_ids=ids, **extra).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = prompt.shape[1] - 1
    return [lp[start + i, tok].item() for i, tok in enumerate(completion)]


def hf_sequence_logprobs(model: Path, token_ids: list[int], images: list[bytes]) -> list[float]:
    """log p(token_i | tokens_<i, images) for i >= 1 of an already expanded sequence, as a trainer computes them:
    the image files through the model's own processor, the tokens as recorded (fp32)."""
    from PIL import Image

    hf, processor = _hf(str(model))
    pixels = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        pixels = dict(processor.image_processor(images=[pil], return_tensors="pt"))
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = hf(input_ids=ids, **pixels).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, tok].item() for i, tok in enumerate(token_ids) if i >= 1]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")
