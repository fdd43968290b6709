"""The policy's optimizer and model sections, shared by the RL trainer (``--actor.*``, ``--critic.*``) and SFT
(``--optim``, ``--adam.*``, ``--model.lora.*``): Molt's flag names and defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from molt.config import Section


class AdamConfig(Section):
    lr: float = Field(1e-6, gt=0.0)
    """AdamW learning rate."""
    betas: list[float] = [0.9, 0.95]
    """AdamW betas B1 B2."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""


class MuonConfig(Section):
    lr: float = Field(0.02, gt=0.0)
    """Muon learning rate of the 2-D weight matrices (the output head's AdamW rate is lr / sqrt(fan_in))."""
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon momentum."""
    weight_decay: float | None = Field(None, ge=0.0)
    """Muon decoupled weight decay. Unset: the AdamW weight decay."""
    ns_steps: int = Field(5, gt=0)
    """Newton-Schulz iterations per update."""
    nesterov: bool = True
    """Nesterov momentum."""
    no_nesterov: bool = False
    """Molt's spelling of --muon.nesterov false."""


class OptimizerConfig(Section):
    optim: Literal["adam", "muon"] = "adam"
    """adam: AdamW on every parameter. muon: Muon on the 2-D weight matrices and AdamW (--adam.*) on embeddings,
    the output head, norms and biases, grouped as Molt groups them (services/trainer/muon.py)."""
    adam: AdamConfig = Field(default_factory=AdamConfig)
    muon: MuonConfig = Field(default_factory=MuonConfig)
    lr_scheduler: str = "constant"
    """HF scheduler name (transformers.get_scheduler): constant, cosine_with_min_lr, linear, ..."""
    lr_warmup_ratio: float = Field(0.03, ge=0.0, le=1.0)
    """Warmup steps as a fraction of --train.num_steps (schedulers with warmup only)."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final LR as a fraction of the peak (cosine_with_min_lr)."""
    max_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping max norm."""


def checkpoint_mode(value) -> str:
    """Molt's activation-checkpoint spellings -> full, selective or off (``--actor/--model.gradient_checkpoint``):
    as Molt reads them, only the off words ('', false, none, off, 0) turn it off; any other word is full."""
    v = "" if value is None else str(value).strip().lower()
    if v == "selective":
        return "selective"
    return "off" if v in ("", "false", "none", "off", "0") else "full"


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """LoRA adapter rank; 0 = full fine-tune. With a rank only the adapters train; the export is merged."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling alpha: the update is (alpha / rank) * B @ A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch's input."""
    target_modules: list[str] = Field(default_factory=lambda: ["*_proj"])
    """Linear layers that get adapters: patterns over whole dotted module names, * matching any run of
    characters (the default takes every attention and MLP projection)."""
