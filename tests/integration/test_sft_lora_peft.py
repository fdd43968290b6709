"""Our LoRA against HF PEFT's on a real model: the same adapters give the same logits, one AdamW step moves
them the same way, and our merged weights equal PEFT's ``merge_and_unload``."""

from __future__ import annotations

import torch

from services.trainer import lora


def _models(path, rank: int, alpha: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = lora.apply(ours, rank, alpha, ["*_proj"], seed=3)
    theirs = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, lora_dropout=0.0),
    )
    with torch.no_grad():  # theirs takes our A; both B the same random values, so the update is not zero
        for name in names:
            mine, peft_layer = ours.get_submodule(name), theirs.base_model.model.get_submodule(name)
            mine.lora_B.weight.normal_(std=0.02)
            peft_layer.lora_A["default"].weight.copy_(mine.lora_A.weight)
            peft_layer.lora_B["default"].weight.copy_(mine.lora_B.weight)
    return ours, theirs, names


def test_lora_matches_peft_forward_step_and_merge(tiny_qwen3):
    torch.manual_seed(0)
    ours, theirs, names = _models(tiny_qwen3, rank=4, alpha=8.0)
    ids = torch.randint(0, 500, (2, 12))
    assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5)

    trainable = [[p for p in m.parameters() if p.requires_grad] for m in (ours, theirs)]
    assert [sum(p.numel() for p in ps) for ps in trainable] == [sum(p.numel() for p in trainable[0])] * 2
    for model, params in zip((ours, theirs), trainable):
        opt = torch.optim.AdamW(params, lr=1e-2)
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5)

    merged = lora.merge(ours.state_dict(), lora.scale_of(ours))
    reference = theirs.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for key in merged:
        assert torch.allclose(merged[key], reference[key], atol=1e-6), key
