"""What a sync sends and how the pod checks it against what its engine loads.

Trainer side (`select_tensors`): trainer state-dict names become HF checkpoint names, the names
vLLM's ``load_weights`` takes; vLLM itself maps them onto its fused/packed layouts (qkv, gate_up,
MoE expert stacks) and shards them. Like Molt's refit: skip non-tensors, names ending
``_extra_state`` and non-floating tensors; skip exactly ``lm_head.weight`` when the embeddings are
tied (nested heads such as ``mtp.lm_head.weight`` are sent). Floating tensors travel in the pods' one
serving dtype where it is narrower than theirs (``layout.wire_dtype``), else as held; the engine casts
on load either way. Unlike Molt, frozen names (e.g. a frozen MoE router) are not sent: they
travel as ``keep`` so the pod can tell "deliberately absent" from "missing".

Pod side (`verify_manifest`): every expected engine parameter is sent or kept, nothing unknown is
sent, shapes match exactly and dtypes are both floating (vLLM casts fp32 <-> bf16 on load).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from molt.weightsync.layout import TensorEntry, dtype_name, is_floating, torch_dtype

# Wrappers that torch.compile / activation checkpointing / FSDP1 put in front of parameter names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


class ManifestError(ValueError):
    """The sync's manifest does not fit the pod's engine; the message says what to change."""


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def select_tensors(
    items: Iterable[tuple[str, object]],
    tie_word_embeddings: bool,
    frozen: Iterable[str] = (),
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(tensors to send, names kept) from a state dict's items, in order.

    Accepts DTensors (FSDP2 ``state_dict()``): each is gathered with ``full_tensor()`` here, so
    iterating is the "gather" phase. Tensors land on the CPU.
    """
    frozen = {hf_name(n) for n in frozen}
    send, keep = [], []
    for raw_name, value in items:
        if not isinstance(value, torch.Tensor) or raw_name.endswith("_extra_state"):
            continue
        name = hf_name(raw_name)
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if not value.is_floating_point():
            continue
        if name in frozen:
            keep.append(name)
            continue
        send.append((name, value.detach().to("cpu")))
    return send, keep


def hf_adapter(model: torch.nn.Module):
    """state dict -> HF checkpoint names/layout, for a transformers model (``WeightPusher(to_hf=...)``).

    transformers 5 keeps some weights in a fused in-memory layout (e.g. Qwen3-MoE experts as one
    ``mlp.experts.gate_up_proj`` [E, 2I, H] tensor) while checkpoints - and so vLLM's loader - use
    per-expert names; this applies transformers' own reverse conversion (what save_pretrained does).
    """
    from transformers.core_model_loading import revert_weight_conversion

    return lambda state: revert_weight_conversion(model, dict(state))  # type: ignore[arg-type]  # an HF model typed nn.Module by its loaders


def _norm_dtype(dtype: str) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def verify_manifest(
    entries: Iterable[TensorEntry],
    keep: Iterable[str],
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    max_listed: int = 8,
) -> None:
    """Raise ManifestError unless the manifest covers exactly the engine's parameters."""
    entries = list(entries)
    sent = {e.name: e for e in entries}
    keep = set(keep)
    problems: list[str] = []

    def listed(names: Iterable[str]) -> str:
        names = sorted(names)
        more = f" (+{len(names) - max_listed} more)" if len(names) > max_listed else ""
        return ", ".join(names[:max_listed]) + more

    if len(sent) != len(entries):
        problems.append("duplicate tensor names in the manifest")
    unknown = set(sent) - set(expected)
    if unknown:
        hint = " (tied lm_head: do not send lm_head.weight)" if "lm_head.weight" in unknown else ""
        if any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in unknown):
            hint += (
                " (fused in-memory MoE experts: convert to checkpoint names, e.g. "
                "WeightPusher(to_hf=molt.weightsync.manifest.hf_adapter(model)))"
            )
        problems.append(f"{len(unknown)} tensor(s) the engine does not load: {listed(unknown)}{hint}")
    bad_keep = keep - set(expected)
    if bad_keep:
        problems.append(f"keep names the engine does not have: {listed(bad_keep)}")
    both = keep & set(sent)
    if both:
        problems.append(f"names both sent and kept: {listed(both)}")
    missing = set(expected) - set(sent) - keep
    if missing:
        problems.append(f"{len(missing)} engine parameter(s) neither sent nor kept: {listed(missing)}")
    for name, e in sent.items():
        if name not in expected:
            continue
        shape, dtype = expected[name]
        if tuple(e.shape) != tuple(shape):
            problems.append(f"shape mismatch for {name}: sent {tuple(e.shape)}, engine has {tuple(shape)}")
        elif not (is_floating(e.dtype) and is_floating(_norm_dtype(dtype))) and e.dtype != _norm_dtype(dtype):
            problems.append(f"dtype mismatch for {name}: sent {e.dtype}, engine has {dtype}")
        if e.nbytes != _numel(e.shape) * torch_dtype(e.dtype).itemsize:
            problems.append(f"nbytes of {name} is {e.nbytes}, shape and dtype say otherwise")
    if problems:
        raise ManifestError("manifest rejected: " + "; ".join(problems[:max_listed]))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
