"""Where the trainer runs, and what only its GPU path (NeMo AutoModel) honours: one rule for the flag checks
(validation, ``--dry-run``, ``molt up``) and the loader, so a config start-up refuses is refused before it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.trainer.config import FsdpConfig


def transformers_path_problem(fsdp: FsdpConfig) -> str | None:
    """A flag only NeMo AutoModel on GPU honours, on the transformers + FSDP2 path (CPU, or --fsdp.strategy
    torch): the loader refuses it, and so does validation where the device is known, so --dry-run does too."""
    if max(fsdp.tp_size, fsdp.cp_size, fsdp.ep_size) > 1:
        return (
            "--fsdp.tp_size/cp_size/ep_size > 1 need GPUs and NeMo AutoModel; on CPU the trainer is "
            "pure FSDP2 data parallel (leave them at 1)"
        )
    if fsdp.bf16_master_weights:
        return (
            "--fsdp.bf16_master_weights: bf16 master weights are for NeMo AutoModel on GPU (--fsdp.strategy "
            "auto or nemo); here the weights stay fp32: drop the flag"
        )
    if fsdp.use_liger_kernel:
        return (
            "--fsdp.use_liger_kernel: Liger's Triton kernels come with NeMo AutoModel on GPU "
            "(--fsdp.strategy auto or nemo); drop the flag on CPU or with --fsdp.strategy torch"
        )
    if fsdp.offload != "none":
        return (
            f"--fsdp.offload {fsdp.offload}: CPU offload is NeMo AutoModel's, for GPU runs (--fsdp.strategy auto "
            "or nemo); use none on CPU or with --fsdp.strategy torch"
        )
    return None


def trainer_on_gpu() -> bool:
    """Whether this machine's trainer runs on CUDA: a GPU is visible and MOLT_TRAINER_DEVICE is not cpu."""
    import torch

    return torch.cuda.is_available() and os.environ.get("MOLT_TRAINER_DEVICE", "") != "cpu"
