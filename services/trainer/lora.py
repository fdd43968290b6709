"""LoRA adapters for SFT (``--model.lora.rank/alpha/target_modules``) and RL (``--actor.lora.*``), laid out as
NeMo AutoModel lays them.

Each targeted ``nn.Linear`` keeps its weight and bias under their own names, frozen, and gains
``lora_A`` (rank x in, Xavier-normal) and ``lora_B`` (out x rank, zero, so training starts from the base
model) whose product, scaled by ``alpha / rank``, adds to the weight; ``--model.lora.dropout`` drops
the branch's input. Only the adapters train. The same names on CPU (this module) and on GPU (NeMo
AutoModel's own LoRA) keep checkpoints, ``merge`` and the export alike on both paths. A pattern must match
a module's whole dotted name, ``*`` standing for any run of characters (dots included), as in Molt:
``*_proj`` takes every ``...self_attn.q_proj``, ``...mlp.gate_proj``, ...

The export merges: ``W + (alpha / rank) * B @ A`` under the base name, adapters dropped, so what a rollout
pod, ``transformers`` and the RL trainer load is a plain model of the base architecture. The adapters also
go alone to ``adapter/`` in HF PEFT's layout (what Molt's LoRA runs write), for PEFT or a LoRA-serving engine.
The RL trainer's weight sync sends the same merge, restricted to the adapted weights (``merged_targets``): the
others are the base model's, which the pods already hold.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import torch
from torch import nn

CONFIG_FILE = "lora.json"
"""Rank and alpha next to a checkpoint's model files, so ``molt export`` merges offline."""


class LoraLinear(nn.Linear):
    """``nn.Linear`` with a frozen base and a trainable low-rank update."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, generator: torch.Generator | None = None
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.xavier_normal_(self.lora_A.weight, generator=generator)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def apply(
    model: nn.Module,
    rank: int,
    alpha: float,
    patterns: list[str],
    dropout: float = 0.0,
    seed: int = 0,
    flag: str = "--model.lora",
) -> list[str]:
    """Adapters on every ``nn.Linear`` whose name matches; everything else frozen. Returns the adapted names;
    ValueError naming the flag (``flag``.target_modules) when none matches. ``A`` is drawn from ``seed`` alone:
    every rank (each shards its own copy) and every world size start from the same adapters."""
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and matches(n, patterns)]
    if not names:
        raise ValueError(
            f"{flag}.target_modules {' '.join(patterns)}: no linear layer of the model matches "
            "(patterns take * wildcards over dotted module names, e.g. '*_proj')"
        )
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LoraLinear(getattr(owner, child), rank, alpha, dropout, generator))
    return names


def merge(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the base model's state dict, each update folded into its weight."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    out.update(merged_targets(state, scale))
    return out


def adapted(names) -> list[str]:
    """The modules that carry adapters, from a state dict's (or a model's parameter) names."""
    return sorted(n[: -len(".lora_A.weight")] for n in names if n.endswith(".lora_A.weight"))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_targets(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Only the adapted weights of a full state dict with adapters, each merged, under its base name: what
    changes when the adapters train (biases, norms, embeddings and untargeted layers stay the base's)."""
    out = {}
    for module in adapted(state):
        w, a, b = state[f"{module}.weight"], state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        out[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


ADAPTER_DIR = "adapter"


def write_peft_adapter(state: dict[str, torch.Tensor], scale: float, out: Path, base_model: str) -> None:
    """The adapters of a full state dict as a PEFT adapter directory (``adapter_model.safetensors`` and
    ``adapter_config.json``; ``PeftModel.from_pretrained(base, out)`` loads it)."""
    from safetensors.torch import save_file

    modules = sorted(k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight"))
    rank = int(state[f"{modules[0]}.lora_A.weight"].shape[0])
    tensors = {
        f"base_model.model.{m}.lora_{ab}.weight": state[f"{m}.lora_{ab}.weight"].contiguous()
        for m in modules
        for ab in "AB"
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",  # AutoPeftModelForCausalLM reads it to pick the class the base loads as
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "base_model_name_or_path": base_model,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def scale_of(model: nn.Module) -> float | None:
    """``alpha / rank`` of the model's adapters, None without LoRA."""
    for m in model.modules():
        scale = getattr(m, "scale", None)
        if hasattr(m, "lora_A") and isinstance(scale, float | int):
            return float(scale)
    return None


def write_config(out: Path, rank: int, alpha: float) -> None:
    (out / CONFIG_FILE).write_text(json.dumps({"rank": rank, "alpha": alpha}))


def read_scale(files: Path) -> float | None:
    path = files / CONFIG_FILE
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    return config["alpha"] / config["rank"]
