"""Image inputs of a vision-language policy: what the trainer feeds next to the recorded tokens.

A VL trajectory records each image's tokens expanded exactly as the model saw them, and the image files
(molt/schema.py). The trainer runs the model's own image processor on those files, the same processor and
bytes the rollout pod's vLLM used, and passes the pixel inputs to the forward with the recorded tokens.
The model scatters image features over its image tokens in order, row-major over the batch, so a
micro-batch's images travel as one list in token order whatever each row's image count.

With several ranks every forward must run the vision tower: FSDP2 gathers and reduce-scatters its
parameters collectively, and a rank that skipped it would leave the others waiting. A micro-batch
without images then feeds one blank image, whose features land on no token (zero gradient).
"""

from __future__ import annotations

import io
from functools import lru_cache

import torch
from torch import Tensor

from molt.schema import SchemaError


class VisionInputs:
    """The image processor of a VL model at a local HF directory, and its image token."""

    def __init__(self, path: str) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.image_token_id: int = AutoConfig.from_pretrained(path).image_token_id
        self.image_token: str = self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.num_tokens = lru_cache(maxsize=256)(self._num_tokens)

    def _num_tokens(self, image: bytes) -> int:
        """Image tokens the processor expands ``image`` into (what the pod's prompt held for it)."""
        out = self.processor(text=[self.image_token], images=[[open_image(image)]], return_tensors="pt")
        return int((out["input_ids"] == self.image_token_id).sum())

    def pixel_inputs(self, images: list[bytes]) -> dict[str, Tensor]:
        """The model's pixel keyword arguments for ``images`` (in token order over the whole micro-batch)."""
        return dict(self.processor.image_processor(images=[[open_image(b) for b in images]], return_tensors="pt"))

    def blank_inputs(self) -> dict[str, Tensor]:
        """Pixel inputs of one white image: runs the vision tower, touches no token (module docstring)."""
        from PIL import Image

        size = (16, 16)
        out = self.processor.image_processor(images=[[Image.new("RGB", size, (255, 255, 255))]], return_tensors="pt")
        return dict(out)


def open_image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise SchemaError("images", f"an image file no decoder reads ({exc})") from None


def cut_at_whole_image(token_ids, t: int, images: list[bytes], vision: VisionInputs) -> tuple[int, list[bytes]]:
    """A cut at ``t`` tokens that keeps only whole images: an image whose token run the cut would split is
    dropped with its run (the cut moves to its first image token). Returns (cut, images kept)."""
    if t >= len(token_ids) or not images:
        return t, images
    positions = (torch.as_tensor(token_ids) == vision.image_token_id).nonzero().flatten().tolist()
    start = 0
    for k, image in enumerate(images):
        end = start + vision.num_tokens(image)
        if end > len(positions):
            raise SchemaError("images", f"{len(images)} images need more than the {len(positions)} image tokens")
        if positions[end - 1] >= t:
            return min(t, positions[start]), images[:k]
        start = end
    return t, images
