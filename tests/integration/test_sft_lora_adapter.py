"""The LoRA export's adapter/ loads with peft.AutoPeftModelForCausalLM from anywhere, from a relative model path."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.integration.sft_testlib import ROOT, reversal_rows, run_sft, write_jsonl

pytestmark = pytest.mark.timeout(600)


def test_the_adapter_loads_with_auto_peft_from_another_directory(tiny_qwen3, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    write_jsonl(tmp_path / "train.jsonl", reversal_rows(8, seed=1))
    flags = ["--model.model_name_or_path", os.path.relpath(tiny_qwen3, ROOT), "--data.dataset"]
    flags += [str(tmp_path / "train.jsonl"), "--data.input_key", "prompt", "--data.output_key", "response"]
    flags += ["--train.batch_size", "4", "--train.micro_batch_size", "2", "--train.num_steps", "1"]
    flags += ["--model.lora.rank", "2", "--model.gradient_checkpoint", "none", "--adam.lr", "1e-2"]
    flags += ["--ckpt.path", str(tmp_path / "state"), "--ckpt.output_dir", str(tmp_path / "hf")]
    run_sft(flags)
    adapter = tmp_path / "hf" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(tiny_qwen3.resolve())
    monkeypatch.chdir(tmp_path)  # not where the run started
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32)
    assert sum("lora_A" in n for n, _ in model.named_parameters()) > 0
