"""The final HF model directory: two runs saving to the same folder at once (Molt's default ./ckpt) both
succeed and leave a loadable model, with no temporary folder behind; every file is readable as open() would
have made it."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest
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


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_exported_file_gets_the_mode_open_gives_under_the_umask(tiny_qwen3, tmp_path, umask):
    # safetensors writes 0600 on its own: the weights (and the LoRA adapter's) must be as readable as the config.
    state = load_file(str(tiny_qwen3 / "model.safetensors"))
    module = "model.layers.0.self_attn.q_proj"
    out_features, in_features = state[f"{module}.weight"].shape
    state[f"{module}.lora_A.weight"] = torch.zeros(2, in_features)
    state[f"{module}.lora_B.weight"] = torch.zeros(out_features, 2)
    old = os.umask(umask)
    try:
        out = write_hf_dir(state, tiny_qwen3, tmp_path / "model", lora_scale=1.0)
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)  # 0o644 under 022, 0o600 under 077
    assert expected == 0o666 & ~umask
    files = [f for f in out.rglob("*") if f.is_file()]
    assert {"model.safetensors", "config.json", "adapter_model.safetensors"} <= {f.name for f in files}
    assert {f.relative_to(out).as_posix(): oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
        f.relative_to(out).as_posix(): oct(expected) for f in files
    }


def test_an_export_into_a_folder_holding_an_older_model_leaves_none_of_its_weights(tiny_qwen3, tmp_path):
    # An earlier LoRA run's adapter/ and a sharded export's index would be loaded with the new weights (PEFT
    # finds the adapter, transformers' index names shards): both go; the folder's other files stay.
    out = tmp_path / "ckpt"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_text("{}")
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "notes"):
        (out / name).write_text("old")
    write_hf_dir(load_file(str(tiny_qwen3 / "model.safetensors")), tiny_qwen3, out)
    left = {p.name for p in out.iterdir()}
    assert "model.safetensors" in left and "notes" in left
    assert not left & {
        "adapter",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
    }
