"""What a model dir holds, read from its safetensors headers (no tensor data is read).

``expected_parameters`` is the contract with the weight sender: the HF checkpoint names the engine
loads from, each with its shape and dtype. A tied ``lm_head.weight`` is absent there by design (the
engine reuses the embedding), so senders skip it too (Molt's refit does the same).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

# safetensors header dtype codes -> torch dtype names (the names used on the weight wire).
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files; pass a model dir saved in HF safetensors format")
    return files


def read_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def expected_parameters(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, torch dtype name), over every safetensors file of the dir."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in safetensors_files(model_dir):
        for name, meta in read_header(path).items():
            out[name] = (tuple(meta["shape"]), SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"].lower()))
    return out


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a model dir, file by file."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(model_dir))


def is_vision_language(model_dir: str | Path) -> bool:
    """Whether config.json describes a vision-language model (it has a vision tower config)."""
    config = Path(model_dir) / "config.json"
    return config.exists() and "vision_config" in json.loads(config.read_text())
