"""`python -m molt.models tiny` builds offline in seconds and the dir loads with transformers."""

import subprocess
import sys
import time

import pytest
import torch


@pytest.mark.parametrize(
    "arch, cls", [("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"), ("llama", "LlamaForCausalLM")]
)
def test_tiny_builds_offline_and_loads(tmp_path, arch, cls):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / arch
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "molt.models", "tiny", "--arch", arch, "--out", str(out)],
        check=True,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    elapsed = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == cls
    assert model.config.head_dim >= 32  # vLLM's CPU attention rejects smaller heads
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert elapsed < 60, f"tiny build took {elapsed:.0f}s"


def test_same_tokenizer_for_every_seed(tmp_path):
    from molt.models.tiny import build_tiny

    a = build_tiny(tmp_path / "a", seed=0)
    b = build_tiny(tmp_path / "b", seed=1)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_chat_template_appends_only(tiny_qwen3):
    """Rendering more messages only appends text: the gateway's delta rendering relies on this."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    prev = ""
    for i in range(1, len(msgs) + 1):
        text = tok.apply_chat_template(msgs[:i], tokenize=False)
        assert text.startswith(prev)
        prev = text
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|im_end|>' in prev


def test_the_cli_seed_and_no_tie_reach_the_model(tmp_path):
    """README names `--seed N` and `--no-tie`: the command line, not only build_tiny, honours them."""
    import json

    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    for name, extra in (("base", []), ("other", ["--seed", "1", "--no-tie"])):
        cmd = [sys.executable, "-m", "molt.models", "tiny", "--out", str(tmp_path / name), *extra]
        subprocess.run(cmd, check=True, env=env)
    base, other = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("base", "other"))
    assert base["tie_word_embeddings"] is True and other["tie_word_embeddings"] is False
    weights = [(tmp_path / n / "model.safetensors").read_bytes() for n in ("base", "other")]
    assert weights[0] != weights[1]
