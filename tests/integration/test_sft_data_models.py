"""SFT data on real tokenizers and models: the loss mask per chat template in use, bad-row accounting,
and sample packing (plain, or with the samples' common prefix laid out once) computing the same loss and
gradients as padding."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.sft_data import Tokenized, collate

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "The answer is 6."},
]


@pytest.fixture(scope="module", params=["tiny_qwen3", "smollm2"])
def tokenizer(request):
    """Loaded once per model for the module: the tests only read it, and SmolLM2's is slow to load."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue(request.param))


def _split(tok, ex):
    """(decoded supervised tokens, decoded other tokens)."""
    ids = ex.input_ids.tolist()
    return (
        tok.decode([t for t, m in zip(ids, ex.loss_mask) if m]),
        tok.decode([t for t, m in zip(ids, ex.loss_mask) if not m]),
    )


def test_mask_is_exactly_the_response_and_its_stop_token(tokenizer):
    tk = Tokenized(tokenizer, 512, "prompt", "response")
    ex, why, _ = tk.example({"prompt": "reverse: a b c", "response": "reversed: c b a"})
    assert why == ""
    sup, rest = _split(tokenizer, ex)
    assert sup == "reversed: c b a<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse: a b c"}, {"role": "assistant", "content": "reversed: c b a"}],
        tokenize=False,
    )
    assert rest == text.replace("reversed: c b a<|im_end|>", "")


def test_mask_covers_every_assistant_turn_or_only_the_last(tokenizer):
    sup, _ = _split(tokenizer, Tokenized(tokenizer, 512, "messages", None).example({"messages": CHAT})[0])
    assert sup == "4<|im_end|>The answer is 6.<|im_end|>"
    last = Tokenized(tokenizer, 512, "messages", None, last_turn_only=True).example({"messages": CHAT})[0]
    assert _split(tokenizer, last)[0] == "The answer is 6.<|im_end|>"


def test_bad_rows_are_counted_and_dropped_and_long_ones_cut(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    rows = [
        {"prompt": "hi", "response": "yo"},
        {"prompt": "hi"},
        {"prompt": "hi", "response": ""},
        {"prompt": "word " * 40, "response": "late"},
        {"prompt": "hi", "response": "long " * 40},
    ]
    examples, report = Tokenized(tok, 24, "prompt", "response").build(rows, "--data.dataset")
    assert (report.rows, report.used, report.truncated) == (5, 2, 1)
    assert dict(report.dropped) == {"missing 'response'": 1, "empty response": 1, "response past --data.max_len": 1}
    assert max(e.num_tokens for e in examples) == 24
    with pytest.raises(ValueError, match="no usable row"):
        Tokenized(tok, 24, "question", "answer").build(rows, "--data.dataset")


def test_packed_rows_give_the_padded_loss(tiny_qwen3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="sdpa")
    rows = [{"prompt": f"reverse: {' '.join('abcdefg'[:n])}", "response": "ok " * n} for n in (2, 5, 3, 7)]
    examples, _ = Tokenized(tok, 64, "prompt", "response").build(rows, "--data.dataset")

    def loss(batch):
        labels = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )

    with torch.no_grad():
        padded, packed = loss(collate(examples, 0)), loss(collate(examples, 0, packed=True, pad_to=80))
        alone = sum(loss(collate([e], 0)) for e in examples)
    assert float(packed) == pytest.approx(float(padded), abs=1e-4)
    assert float(packed) == pytest.approx(float(alone), abs=1e-4)
    assert math.isfinite(float(packed))


def test_shared_prefix_row_gives_the_padded_loss_and_gradients(tiny_qwen3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="sdpa")
    rows = [
        {
            "prompt": [{"role": "system", "content": "Reverse the letters."}, {"role": "user", "content": w}],
            "response": w[::-1],
        }
        for w in ("a b", "c d e f g", "h i j", "k l m n o p q")
    ]
    examples, _ = Tokenized(tok, 64, "prompt", "response").build(rows, "--data.dataset")

    def loss_and_grads(batch):
        model.zero_grad()
        if "targets" in batch:
            flat, targets = batch.pop("flat_index"), batch.pop("targets")
            logits = model(**batch, use_cache=False).logits[0, flat]
        else:
            labels = batch.pop("labels")
            logits = model(**batch, use_cache=False).logits[:, :-1].reshape(-1, model.config.vocab_size)
            targets = labels[:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters()]

    shared_batch = collate(examples, 0, packed=True, share_prefix=True, pad_to=120)
    plain = collate(examples, 0, packed=True)["input_ids"].shape[1]
    unpadded = collate(examples, 0, packed=True, share_prefix=True)["input_ids"].shape[1]
    assert shared_batch["input_ids"].shape[1] == 120 and plain - unpadded > 3 * 10  # three copies of the prefix gone
    shared, g_shared = loss_and_grads(shared_batch)
    padded, g_padded = loss_and_grads(collate(examples, 0))
    assert shared == pytest.approx(padded, rel=1e-5)
    for a, b in zip(g_shared, g_padded, strict=True):  # fp32 summation order apart
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def _png(colour) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 12), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_images_expand_in_place_and_bad_image_rows_are_counted(tiny_idefics3):
    from transformers import AutoTokenizer

    from molt.models.tiny_vl import IMAGE_SEQ_LEN
    from services.trainer.vision import VisionInputs

    tok, vision = AutoTokenizer.from_pretrained(tiny_idefics3), VisionInputs(str(tiny_idefics3))
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    two_turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = [
        {"prompt": "what colour? <image>", "response": "red", "images": [red]},
        {"prompt": "<image> then <image>", "response": "both", "images": [red, {"bytes": blue, "path": None}]},
        {"prompt": "text only", "response": "fine"},
        {"prompt": "no marker", "response": "x", "images": [red]},
        {"prompt": "<image><image><image>", "response": "x", "images": [red] * 3},
        {"prompt": "<image>", "response": "x", "images": ["/no/such/file.png"]},
        # TRL's VLM rows: content parts, as a datasets column returns them (absent keys None)
        {
            "prompt": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "c?"}]}],
            "response": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
            "images": [blue],
        },
    ]
    tokenized = Tokenized(tok, 64, "prompt", "response", vision=vision, image_key="images", max_images=2)
    examples, report = tokenized.build(rows, "--data.dataset")
    assert (report.rows, report.used, report.truncated) == (7, 4, 0)
    assert dict(report.dropped) == {
        "1 images for 0 <image> markers or image parts": 1,
        "more than --data.max_images_per_prompt 2 images": 1,
        "unreadable image": 1,
    }
    one, two, text, parts = examples
    assert parts.images == [blue] and _split(tok, parts)[0] == "blue<|im_end|>"
    for ex, n in ((one, 1), (two, 2), (text, 0), (parts, 1)):
        assert len(ex.images) == n and int((ex.input_ids == vision.image_token_id).sum()) == n * IMAGE_SEQ_LEN
    assert one.images == [red] and two.images == [red, blue]
    assert _split(tok, one)[0] == "red<|im_end|>" and "<image>" in _split(tok, one)[1]
    # the pixel inputs line up with the expanded ids: the model takes them together
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_idefics3, dtype=torch.float32)
    out = model(input_ids=torch.as_tensor(two.input_ids)[None], **vision.pixel_inputs(two.images))
    assert out.logits.shape[1] == two.num_tokens

    # without --data.image_key an "<image>" in a row is its text: the row is kept
    text_only = Tokenized(tok, 64, "prompt", "response")
    literal, _, _ = text_only.example({"prompt": "say <image>", "response": "ok"})
    assert literal is not None and literal.images == []
    assert text_only.example(rows[-1])[:2] == (None, "image parts without --data.image_key")

    # a cut inside the second turn's image: the image goes with its run, the first reply stays supervised
    row = {"prompt": [*two_turns, {"role": "user", "content": "look <image>"}], "response": "ok", "images": [blue]}
    whole, _, _ = tokenized.example(row)
    at = whole.input_ids.tolist().index(vision.image_token_id) + 2
    cut, _, truncated = Tokenized(tok, at, "prompt", "response", vision=vision, image_key="images").example(row)
    assert truncated and cut.images == [] and vision.image_token_id not in cut.input_ids.tolist()
    assert _split(tok, cut)[0] == "yo<|im_end|>"
