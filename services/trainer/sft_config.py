"""SFT settings: Molt's ``train_sft`` flags on the RL trainer's shared blocks.

The optimizer block is un-prefixed as in Molt (``--adam.lr`` 5e-6, ``--lr_scheduler``, ``--max_norm``);
``--fsdp.*`` and ``--ckpt.*`` extend the RL trainer's blocks with the knobs SFT scripts pass. What
this build cannot do is refused by ``validate_sft`` with the reason and the fix, never ignored:
tensor/context/expert parallelism without GPUs, Muon, the ModelScope hub. Additions:
``--train.num_steps`` (stop early), ``--logger.steps_jsonl`` (as the RL trainer), ``--log_level``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from molt.config import Section
from molt.data import mix_weights
from services.trainer.config import CkptConfig, FsdpConfig, LoggerConfig
from services.trainer.optim_config import AdamConfig, LoraConfig, OptimizerConfig, checkpoint_mode


class SftModelConfig(Section):
    model_name_or_path: str | None = None
    """Local HF model directory to fine-tune (required)."""
    gradient_checkpoint: str = "full"
    """Activation checkpointing: full (recompute every decoder layer in backward) or none/off/false/0/'' (off).
    'selective' (TorchTitan per-op AC) needs NeMo AutoModel on GPU."""
    aux_loss_coef: float = Field(0.0, ge=0.0)
    """MoE load-balancing loss coefficient (HF router aux loss), 0 = off."""
    freeze_visual_encoder: bool = False
    """VLM only: keep the vision tower's weights fixed (the connector and the language model train)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("gradient_checkpoint", mode="before")
    @classmethod
    def _ac(cls, v):
        return checkpoint_mode(v)


class SftDataConfig(Section):
    dataset: str | None = None
    """Training data (required): a datasets.save_to_disk directory, a parquet/JSONL/JSON file or a folder of
    them, or a .csv / single .arrow file; several comma-separated are concatenated (or mixed by
    --data.dataset_probs)."""
    dataset_probs: str | None = None
    """Comma-separated sampling weights, one per dataset (rows are drawn per dataset in proportion)."""
    dataset_split: str = "train"
    """Split to read from a saved DatasetDict, or from a folder whose file or folder names name splits (train,
    test, validation: as HF datasets reads a folder)."""
    max_samples: int = Field(1_000_000, gt=0)
    """Use at most this many rows."""
    max_len: int = Field(2048, gt=1)
    """Max tokens per sample (prompt + response): longer samples are cut at this length; a sample with no
    response token left is dropped and counted."""
    input_key: str = "input"
    """Column of the prompt: a string (one user turn) or a list of chat messages (which may include the
    assistant turns, then --data.output_key is not needed)."""
    output_key: str | None = None
    """Column of the response: a string (one assistant turn), a message dict or a list of messages."""
    tools_key: str | None = None
    """Column of each row's tool schemas (an OpenAI function list, or its JSON string), rendered by the chat template
    as apply_chat_template(messages, tools=...) does; the RL trainer's flag of that name. Unset: not rendered."""
    tokenizer_chat_template: str | None = None
    """Chat template to use instead of the tokenizer's: a .jinja file or the template text."""
    train_on_last_turn_only: bool = False
    """Supervise only the last assistant turn; earlier assistant turns are context."""
    image_key: str | None = None
    """VLM: column of each row's images (one or a list: PIL images, {"bytes", "path"}, bytes, a file path or a
    data URL); each ``<image>`` in a user string and each ``{"type": "image"}`` content part takes the next one."""
    max_images_per_prompt: int = Field(4, ge=0)
    """VLM: rows with more images are dropped and counted (only meaningful with --data.image_key)."""
    disable_fast_tokenizer: bool = False
    """Load the slow (Python) tokenizer."""
    dataloader_num_workers: int = Field(0, ge=0)
    """Accepted for Molt's scripts; rows are tokenised once up front, so there is no loader to parallelise."""
    pad_to_max_len: bool = False
    """Pad every micro-batch to --data.max_len (fixed shapes) instead of its longest sample."""


class SftTrainConfig(Section):
    micro_batch_size: int = Field(8, gt=0)
    """Samples per forward/backward on one rank."""
    batch_size: int = Field(128, gt=0)
    """Global samples per optimizer step (micro_batch_size x data-parallel ranks x accumulation)."""
    max_epochs: int = Field(2, gt=0)
    """Passes over the training data."""
    num_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps (default: max_epochs full passes)."""
    seed: int = 42
    """Seed of the data order (shuffled per epoch)."""
    full_determinism_enable: bool = False
    """torch.use_deterministic_algorithms(True) (warn-only where no deterministic kernel exists)."""
    pack_shared_prefix: bool = True
    """Under --fsdp.packing_samples, a micro-batch's common token prefix (system prompt, template header) is
    computed once: the row is the prefix, then each sample's rest, under a 4-D mask (sdpa / eager attention;
    off with flash attention or an MoE aux loss). Same logits and loss, fewer tokens."""


class SftEvalConfig(Section):
    dataset: str | None = None
    """Held-out data in the training data's format; its loss is logged as eval_loss."""
    split: str = "train"
    """Split to read from a saved DatasetDict, or from a folder whose file or folder names name splits (train,
    test, validation: as HF datasets reads a folder)."""
    steps: int = -1
    """Evaluate every N optimizer steps; -1 = once per epoch."""


class SftFsdpConfig(FsdpConfig):
    packing_samples: bool = False
    """Sample packing: each micro-batch's samples are concatenated into one row (position ids restart per
    sample, attention stays within its sample) instead of being padded to the longest."""


class SftCkptConfig(CkptConfig):
    path: str = "./ckpt/checkpoints_sft"
    """Resumable checkpoints (model, optimizer, scheduler, data position): <path>/global_step<N>."""
    output_dir: str = "./ckpt"
    """Final HF model directory (config, safetensors, tokenizer) written at the end of training."""
    save_hf: bool = False
    """Also write an HF directory with every resumable checkpoint, under <path>/_hf/global_step<N>."""
    disable_final_save: bool = False
    """Skip the final HF export to --ckpt.output_dir."""


class WandbConfig(Section):
    key: str | None = None
    """W&B API key; unset = no W&B logging (WANDB_MODE=offline works with any key)."""
    org: str | None = None
    """W&B entity."""
    group: str | None = None
    """W&B run group."""
    project: str = "molt_train_sft"
    """W&B project."""
    run_name: str | None = None
    """W&B run name (default sft_<MMDD>T<HH:MM>)."""


class SftLoggerConfig(LoggerConfig):
    logging_steps: int = Field(1, gt=0)
    """Log train metrics every N steps."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)  # type: ignore[assignment]  # SFT's own block: no offline mode, its own project
    tensorboard_dir: str | None = None
    """TensorBoard log directory (used when W&B is off)."""


class SftAdam(AdamConfig):
    lr: float = Field(5e-6, gt=0.0)
    """AdamW learning rate."""


class SftSettings(OptimizerConfig):
    """Molt Services SFT: supervised fine-tuning on the trainer's FSDP2 stack (torchrun -m services.trainer.sft)."""

    adam: SftAdam = Field(default_factory=SftAdam)
    model: SftModelConfig = Field(default_factory=SftModelConfig)
    data: SftDataConfig = Field(default_factory=SftDataConfig)
    train: SftTrainConfig = Field(default_factory=SftTrainConfig)
    eval: SftEvalConfig = Field(default_factory=SftEvalConfig)
    fsdp: SftFsdpConfig = Field(default_factory=SftFsdpConfig)
    ckpt: SftCkptConfig = Field(default_factory=SftCkptConfig)
    logger: SftLoggerConfig = Field(default_factory=SftLoggerConfig)
    local_rank: int = -1
    """Set by old torch.distributed.launch; the rank comes from the environment."""
    use_ms: bool = False
    """Resolve models from the ModelScope hub (refused: nothing is downloaded; pass a local directory)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level."""


def validate_sft(s: SftSettings, *, on_gpu: bool = False) -> None:
    """Required inputs and every flag this build cannot honour, as ValueErrors naming the flag and the fix."""
    if not s.model.model_name_or_path:
        raise ValueError(
            "--model.model_name_or_path is required: a local HF model directory "
            "(build one with `python -m molt.models tiny|smollm2 --out DIR`)"
        )
    if not s.data.dataset:
        raise ValueError("--data.dataset is required: a datasets directory, a parquet/JSONL file or a folder of them")
    if s.use_ms:
        raise ValueError(
            "--use_ms: nothing is downloaded here; pass a local model directory to --model.model_name_or_path"
        )
    f = s.fsdp
    if s.optim == "muon" and f.offload != "none":
        raise ValueError(f"--optim muon with --fsdp.offload {f.offload}: offloaded optimizer steps are AdamW only")
    if f.pp_size != 1:
        raise ValueError(f"--fsdp.pp_size must be 1 (got {f.pp_size}); pipeline parallelism is not supported")
    if not on_gpu and max(f.tp_size, f.cp_size, f.ep_size) > 1:
        raise ValueError(
            f"--fsdp.tp_size/cp_size/ep_size {f.tp_size}/{f.cp_size}/{f.ep_size}: tensor, context and "
            "expert parallelism need GPUs and NeMo AutoModel; on CPU the trainer is pure FSDP2 data "
            "parallel (set them to 1)"
        )
    if f.cp_size != 1:
        raise ValueError(
            f"--fsdp.cp_size {f.cp_size}: context parallelism needs sequence sharding of the inputs, "
            "which this trainer does not do yet; use --fsdp.cp_size 1"
        )
    if f.sequence_parallel and f.tp_size == 1:
        raise ValueError("--fsdp.sequence_parallel needs --fsdp.tp_size > 1")
    if f.use_liger_kernel and not on_gpu:
        raise ValueError("--fsdp.use_liger_kernel needs GPUs (Triton kernels); drop it on CPU")
    if f.bf16_master_weights and not on_gpu:
        raise ValueError("--fsdp.bf16_master_weights is for NeMo AutoModel on GPUs; on CPU the weights stay fp32")
    if s.model.gradient_checkpoint == "selective" and not on_gpu:
        raise ValueError(
            "--model.gradient_checkpoint selective (per-op AC) needs NeMo AutoModel on GPU; use full or none"
        )
    if not on_gpu and f.attn_implementation not in (None, "sdpa", "eager"):
        raise ValueError(
            f"--fsdp.attn_implementation {f.attn_implementation} needs GPUs; on CPU use sdpa (or leave it unset)"
        )
    if f.offload != "none" and not on_gpu:
        raise ValueError(f"--fsdp.offload {f.offload}: CPU offload is for GPU runs; on CPU use none")
    template = s.data.tokenizer_chat_template
    if template and os.path.isdir(template):
        raise ValueError(
            f"--data.tokenizer_chat_template {template}: a directory; pass a .jinja file or the template text"
        )
    if template and not os.path.exists(template) and "{{" not in template and "{%" not in template:
        # Molt reads a file of that name, else the text itself as the template: a mistyped path would be it.
        raise ValueError(
            f"--data.tokenizer_chat_template {template[:120]!r}: no such file, and not a Jinja template ({{{{ or {{%)"
        )
    s.ckpt.check()
    if len(s.adam.betas) != 2:
        raise ValueError(f"--adam.betas takes two values B1 B2, got {s.adam.betas}")
    mix_weights(s.data.dataset, s.data.dataset_probs, "--data.dataset")
    check_batch(s, max(int(os.environ.get("WORLD_SIZE", "1")) // f.tp_size, 1))
    if s.eval.steps == 0 or s.eval.steps < -1:
        raise ValueError(f"--eval.steps {s.eval.steps}: give N > 0 (every N steps) or -1 (once per epoch)")
    if s.ckpt.save_steps == 0 or s.ckpt.save_steps < -1:
        raise ValueError(f"--ckpt.save_steps {s.ckpt.save_steps}: give N > 0 (every N steps) or -1 (never)")


def check_batch(s: SftSettings, dp: int) -> None:
    """--train.batch_size splits into whole micro-batches on each of the ``dp`` data-parallel ranks (torchrun's
    WORLD_SIZE over --fsdp.tp_size): a flag-only check, so --dry-run refuses what the run would."""
    t = s.train
    if t.batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"--train.batch_size {t.batch_size} must be a multiple of --train.micro_batch_size "
            f"{t.micro_batch_size} x {dp} data-parallel ranks"
        )
