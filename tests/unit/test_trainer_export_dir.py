"""The final HF model directory: two runs saving to the same folder at once (Molt's default ./ckpt) both
succeed and leave a loadable model, with no temporary folder behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load_file

from services.trainer.export import write_hf_dir


def test_concurrent_final_saves_to_one_folder_both_succeed(tiny_qwen3, tmp_path):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: F401 - lazy imports race in threads

    state = load_file(str(tiny_qwen3 / "model.safetensors"))
    out = tmp_path / "ckpt"
    out.mkdir()  # Molt's ./ckpt already holds the checkpoints: the model's files are replaced one by one
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: write_hf_dir(dict(state), tiny_qwen3, out), range(4)))
    assert done == [out] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .ckpt.tmp-* left
    saved = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(saved[k], state[k]) for k in saved)
