"""SFT teaches the tiny random model a task it cannot do (answer with the reversed prompt), and a rollout pod
serving the exported directory does it; with Muon a few steps lower its held-out loss."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.integration.rollout_testlib import ServerThread, tiny_settings
from tests.integration.sft_testlib import lines, reversal_rows, run_sft, write_jsonl

pytestmark = pytest.mark.timeout(600)


def _prompt_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _base_answers(model_dir, tok, rows) -> list[str]:
    """Greedy answers of the model at ``model_dir``, all rows in one left-padded batch: one generate call instead
    of one per row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [_prompt_ids(tok, r["prompt"]) for r in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    return [tok.decode(g[width:], skip_special_tokens=True).strip() for g in gen]


def _pod_answer(url: str, body: dict, tok) -> str:
    res = httpx.post(f"{url}/v1/generate", json=body, timeout=60)
    assert res.status_code == 200, res.text
    return tok.decode(res.json()["outputs"][0]["token_ids"], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_sft_teaches_reversal_and_a_pod_serving_the_export_answers(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    from services.rollout.app import build_app

    train = reversal_rows(2048, seed=1)
    seen = {r["prompt"] for r in train}
    held_out = [r for r in reversal_rows(200, seed=7) if r["prompt"] not in seen][:40]
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "eval.jsonl", held_out)
    out = tmp_path / "hf"
    run_sft(
        [
            "--model.model_name_or_path",
            str(tiny_qwen3),
            "--data.dataset",
            str(tmp_path / "train.jsonl"),
            "--data.input_key",
            "prompt",
            "--data.output_key",
            "response",
            "--data.max_len",
            "64",
            "--eval.dataset",
            str(tmp_path / "eval.jsonl"),
            "--train.batch_size",
            "8",
            "--train.micro_batch_size",
            "8",
            "--train.max_epochs",
            "1",
            "--adam.lr",
            "5e-3",
            "--lr_scheduler",
            "cosine_with_min_lr",
            "--model.gradient_checkpoint",
            "none",
            "--fsdp.packing_samples",
            "--ckpt.output_dir",
            str(out),
            "--logger.steps_jsonl",
            str(tmp_path / "steps.jsonl"),
        ],
        timeout=400,
    )
    tok = AutoTokenizer.from_pretrained(out)
    assert not any(a == r["response"] for a, r in zip(_base_answers(tiny_qwen3, tok, held_out), held_out))

    # All prompts at once, as a pod is used: the engine decodes them in one batch, not one prompt at a time.
    bodies = [
        {"prompt_token_ids": _prompt_ids(tok, r["prompt"]), "sampling_params": {"max_tokens": 16, "temperature": 0.0}}
        for r in held_out
    ]
    with ServerThread(build_app(tiny_settings(out))) as url, ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: _pod_answer(url, body, tok), bodies))
    correct = sum(a == r["response"] for a, r in zip(answers, held_out, strict=True))
    # The untrained model reverses none (checked above). One epoch in small batches gets most right; the lr
    # sits mid-way in the range that does (a higher one overshoots).
    assert correct / len(held_out) >= 0.5, f"{correct}/{len(held_out)} reversed"


def _heldout_loss(model_dir, rows) -> float:
    """Token-mean response loss of the untrained model, computed as the trainer's eval does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.sft_data import Tokenized, collate

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples, _ = Tokenized(tok, 64, "prompt", "response").build(rows, "--eval.dataset")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = collate(examples, tok.pad_token_id)
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    return float(ce) / int((labels[:, 1:] != -100).sum())


# Muon orthogonalizes every weight matrix each step, which on one CPU core is minutes for SmolLM2's, so Muon
# learns on the tiny model here. SmolLM2's held-out loss under SFT is bench/sft.py's (against TRL's).
@pytest.mark.slow
def test_heldout_loss_falls_with_muon(tiny_qwen3, tmp_path):
    model_dir = tiny_qwen3
    optim = ["--optim", "muon", "--muon.lr", "0.02", "--adam.lr", "1e-3"]
    held_out = reversal_rows(16, seed=7)
    write_jsonl(tmp_path / "train.jsonl", reversal_rows(48, seed=1))
    write_jsonl(tmp_path / "eval.jsonl", held_out)
    before = _heldout_loss(model_dir, held_out)
    run_sft(
        [
            "--model.model_name_or_path",
            str(model_dir),
            "--data.dataset",
            str(tmp_path / "train.jsonl"),
            "--data.input_key",
            "prompt",
            "--data.output_key",
            "response",
            "--data.max_len",
            "64",
            "--eval.dataset",
            str(tmp_path / "eval.jsonl"),
            "--eval.steps",
            "6",
            "--train.batch_size",
            "8",
            "--train.micro_batch_size",
            "8",
            "--train.max_epochs",
            "1",
            *optim,
            "--model.gradient_checkpoint",
            "none",
            "--fsdp.packing_samples",
            "--ckpt.disable_final_save",
            "--ckpt.path",
            str(tmp_path / "state"),
            "--logger.steps_jsonl",
            str(tmp_path / "steps.jsonl"),
        ],
        timeout=400,
    )
    after = [x["eval_loss"] for x in lines(tmp_path / "steps.jsonl") if "eval_loss" in x]
    assert len(after) == 1 and after[0] < 0.8 * before, (before, after)


@pytest.mark.slow
def test_vl_sft_teaches_colours_and_a_pod_serving_the_export_sees_them(tiny_idefics3, tmp_path):
    """SFT on a dataset's images: the tiny VLM learns to name a picture's colour, and a rollout pod serving
    the exported directory (its vLLM reads the image processor files the export carries) names held-out
    pictures' colours."""
    import base64
    import io

    from PIL import Image
    from transformers import AutoTokenizer

    from services.rollout.app import build_app
    from tests.integration.sft_testlib import COLOURS, save_colour_data

    train, _ = save_colour_data(tmp_path / "data", 192, 0, text_rows=False)
    out = tmp_path / "hf"
    run_sft(
        [
            "--model.model_name_or_path",
            str(tiny_idefics3),
            "--data.dataset",
            str(train),
            "--data.input_key",
            "prompt",
            "--data.output_key",
            "response",
            "--data.image_key",
            "images",
            "--data.max_len",
            "64",
            "--train.batch_size",
            "32",
            "--train.micro_batch_size",
            "16",
            "--train.max_epochs",
            "2",
            "--adam.lr",
            "3e-3",
            "--model.gradient_checkpoint",
            "none",
            "--ckpt.output_dir",
            str(out),
        ],
        timeout=400,
    )
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with ServerThread(build_app(tiny_settings(out))) as url:
        answers = {}
        for name, rgb in COLOURS.items():
            buf = io.BytesIO()
            Image.new("RGB", (40, 28), tuple(int(c * 0.9) for c in rgb)).save(buf, format="PNG")  # unseen size, shade
            body = {
                "prompt_token_ids": prompt,
                "images": [{"data": base64.b64encode(buf.getvalue()).decode()}],
                "sampling_params": {"max_tokens": 4, "temperature": 0.0},
            }
            answers[name] = _pod_answer(url, body, tok)
    assert answers == {name: name for name in COLOURS}, answers
