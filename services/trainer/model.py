"""Process group, model loading and FSDP2 sharding for the trainer.

CPU (tests, this machine): a plain transformers model in fp32, sharded with FSDP2 over gloo, one
``fully_shard`` per decoder layer plus the root, either by NeMo AutoModel's
``fsdp2_strategy_parallelize`` (``--fsdp.strategy nemo``; ``auto`` picks it when importable) or by
``torch.distributed.fsdp.fully_shard`` directly (``torch``). Mixed precision is off on CPU.

GPU (nccl): the policy is loaded through ``NeMoAutoModelForCausalLM`` with a ``DistributedSetup``
carrying ``--fsdp.tp_size/ep_size/cp_size`` and ``--fsdp.offload``; bf16 params, fp32 reduce. That
path is only exercised on GPU machines; every import of it is lazy, so CPU never touches CUDA.

A single plain process (no torchrun) runs the same code in a world of one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.device import trainer_on_gpu, transformers_path_problem

log = logging.getLogger("molt.trainer")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def init_distributed() -> DistInfo:
    """Join torchrun's group (nccl on GPU, gloo on CPU), or make a world of one for a plain process."""
    use_cuda = trainer_on_gpu()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return DistInfo(rank, world, device, backend)


def _use_nemo(strategy: str) -> bool:
    if strategy == "torch":
        return False
    try:
        import nemo_automodel.components.distributed.parallelizer  # noqa: F401
    except Exception as exc:  # any import failure (triton mismatch, missing extras) means: not usable here
        if strategy == "nemo":
            raise ValueError(
                f"--fsdp.strategy nemo: nemo_automodel is not importable ({exc}); use --fsdp.strategy torch"
            ) from exc
        return False
    return True


def _attn(fsdp, on_gpu: bool) -> str:
    """The kernel asked for, else flash_attention_2 on GPU where flash-attn is installed, else sdpa. The images
    ship without flash-attn (a long compile, not in the lock): a default that needs it would fail at load."""
    if fsdp.attn_implementation:
        return fsdp.attn_implementation
    if on_gpu and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if on_gpu:
        log.info("flash-attn is not installed: attention runs on sdpa (--fsdp.attn_implementation picks one)")
    return "sdpa"


def _mp_policy(fsdp, on_gpu: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not on_gpu:
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=_DTYPES[fsdp.param_dtype], reduce_dtype=torch.float32)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", None) or getattr(model, "backbone", None) or model
    # Vision-language models keep their decoder one level down (Idefics3: .model.text_model).
    base = getattr(base, "text_model", None) or getattr(base, "language_model", None) or base
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__} (expected .model.layers)")
    return list(layers)


def is_vision_language(path: str) -> bool:
    """Whether the HF model at ``path`` takes images (its config has a vision tower)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def vision_tower(model: nn.Module) -> nn.Module:
    """The image encoder of a vision-language model (the connector / projector is not part of it)."""
    base = getattr(model, "model", None) or model
    for name in ("vision_model", "vision_tower", "visual"):
        tower = getattr(base, name, None)
        if isinstance(tower, nn.Module):
            return tower
    raise ValueError(f"--actor.freeze_visual_encoder: no vision tower found on {type(model).__name__}")


def freeze_visual_encoder(model: nn.Module) -> list[str]:
    """``--actor.freeze_visual_encoder``: requires_grad=False on the vision tower; returns its parameter names.
    The connector and the language model stay trainable: the tower's features are fixed, their use is not."""
    tower = vision_tower(model)
    frozen = {id(p) for p in tower.parameters()}
    tower.requires_grad_(False)
    return sorted(name for name, p in model.named_parameters() if id(p) in frozen)


def shard(model: nn.Module, fsdp, info: DistInfo) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root, over every rank (pure data parallel)."""
    from torch.distributed.device_mesh import init_device_mesh

    mp = _mp_policy(fsdp, info.on_gpu)
    if _use_nemo(fsdp.strategy):
        from nemo_automodel.components.distributed import DistributedSetup, ParallelismSizes
        from nemo_automodel.components.distributed.parallelizer import fsdp2_strategy_parallelize

        setup = DistributedSetup.build("fsdp2", ParallelismSizes(dp_size=info.world_size), world_size=info.world_size)
        return fsdp2_strategy_parallelize(model, setup.mesh_context.device_mesh, mp_policy=mp)
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _load_nemo_gpu(path: str, fsdp, info: DistInfo, gradient_checkpoint: str = "off", lora=None) -> nn.Module:
    """GPU path: NeMo AutoModel with TP/EP/CP/offload passed through (see the module docstring); LoRA is
    NeMo's own (the adapters' names and scale are services/trainer/lora.py's)."""
    from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
    from nemo_automodel.components.distributed import DistributedSetup, FSDP2Config, ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy

    cfg = FSDP2Config(
        mp_policy=_mp_policy(fsdp, True),
        offload_policy=CPUOffloadPolicy() if fsdp.offload != "none" else None,
        activation_checkpointing="selective" if gradient_checkpoint == "selective" else gradient_checkpoint == "full",
        sequence_parallel=fsdp.sequence_parallel,
    )
    sizes = ParallelismSizes(tp_size=fsdp.tp_size, cp_size=fsdp.cp_size, ep_size=fsdp.ep_size)
    setup = DistributedSetup.build(cfg, sizes, world_size=info.world_size)
    vision = is_vision_language(path)
    if vision and fsdp.use_liger_kernel:
        raise ValueError(
            "--fsdp.use_liger_kernel: Liger patches text decoders only; drop it for a vision-language model"
        )
    auto = NeMoAutoModelForImageTextToText if vision else NeMoAutoModelForCausalLM
    peft = None
    if lora is not None:
        peft = _nemo_peft_config()(
            target_modules=lora.target_modules, dim=lora.rank, alpha=lora.alpha, dropout=lora.dropout
        )
    return auto.from_pretrained(
        path,
        distributed_setup=setup,
        torch_dtype=torch.bfloat16 if fsdp.bf16_master_weights else torch.float32,
        attn_implementation=_attn(fsdp, True),
        peft_config=peft,
        use_liger_kernel=fsdp.use_liger_kernel,  # NeMo defaults to True; Molt applies Liger only when asked
    )


def _nemo_peft_config() -> type:
    """NeMo's LoRA settings class: from_pretrained's peft_config reads its attributes, so a dict (its docstring's
    type) fails. NeMo's main-branch docs publish it as ``nemo_automodel.shared.peft_config``; 0.7.0 (pinned, the
    newest release) exports it from no public module, only from the private ``components._peft.lora``."""
    try:
        from nemo_automodel.shared.peft_config import PeftConfig
    except ImportError:
        from nemo_automodel.components._peft.lora import PeftConfig
    return PeftConfig


def load_causal_lm(
    path: str,
    fsdp,
    info: DistInfo,
    *,
    gradient_checkpoint: str = "off",
    trainable: bool = True,
    lora=None,
    seed: int = 0,
    lora_flag: str = "--model.lora",
) -> nn.Module:
    """A sharded causal LM from a local HF directory (fp32 master weights); ``lora`` (rank, alpha, dropout,
    target_modules) adds adapters drawn from ``seed`` before sharding and freezes the rest
    (services/trainer/lora.py); errors name its flags as ``lora_flag``.*."""
    if info.on_gpu and fsdp.strategy != "torch":
        model = _load_nemo_gpu(path, fsdp, info, gradient_checkpoint, lora)
    else:
        problem = transformers_path_problem(fsdp)
        if problem:
            raise ValueError(problem)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=_attn(fsdp, False))
        model.to(info.device)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to; mypy loses `self`
        if lora is not None:
            from services.trainer import lora as lora_mod

            lora_mod.apply(model, lora.rank, lora.alpha, lora.target_modules, lora.dropout, seed, lora_flag)
        if gradient_checkpoint == "selective":
            raise ValueError("--gradient_checkpoint selective (per-op) needs NeMo AutoModel on GPU; use full or none")
        if gradient_checkpoint == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = shard(model, fsdp, info)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    else:
        # from_pretrained returns eval mode, where HF skips activation checkpointing and dropout; training
        # passes run in train mode as Molt's do, no-grad passes switch with ``eval_mode``.
        model.train()
    return model


@contextmanager
def eval_mode(*models: nn.Module | None) -> Iterator[None]:
    """Run no-grad passes (old log-probs, values, eval loss) in eval mode, then restore each model's mode:
    dropout off makes the recorded log-probs the deterministic policy the ratios are taken against."""
    live = [m for m in models if m is not None]
    was = [m.training for m in live]
    for m in live:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(live, was, strict=True):
            m.train(mode)


class ValueModel(nn.Module):
    """Critic: a decoder backbone plus a scalar head, value of the state before each next token."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)[:, :-1].clone()  # step axis: value of state k, k < T-1


def load_critic(path: str, fsdp, info: DistInfo, gradient_checkpoint: str = "off") -> nn.Module:
    """The value model (``ValueModel`` on the backbone of ``path``); Molt checkpoints its activations as the
    actor's (``--actor.gradient_checkpoint``)."""
    from transformers import AutoConfig, AutoModel

    if info.on_gpu and fsdp.strategy != "torch":
        log.warning("critic: loaded with transformers + FSDP2 (NeMo AutoModel has no value-head model)")
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=_attn(fsdp, info.on_gpu))
    if gradient_checkpoint == "full":
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    critic = ValueModel(backbone, AutoConfig.from_pretrained(path).hidden_size).to(info.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = _mp_policy(fsdp, info.on_gpu)
    for layer in decoder_layers(critic):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(critic, mesh=mesh, mp_policy=mp)
    return critic.train()  # the backbone came from from_pretrained in eval mode


def freeze_router(model: nn.Module) -> list[str]:
    """``--actor.freeze_moe_router``: requires_grad=False on every router weight; returns their names."""
    from services.trainer.routing_replay import router_param_names

    names = set(router_param_names(model))
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    if not names:
        log.warning("--actor.freeze_moe_router: the model has no MoE router; nothing frozen")
    return sorted(names)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the unsharded state dict on rank 0 (CPU tensors); collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # a model's state dict holds only tensors
