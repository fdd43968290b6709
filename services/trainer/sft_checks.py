"""SFT's start-up checks (``check``): everything a run would fail on later, refused before the model or the data
loads, one line naming the flag; ``--dry-run`` runs the same."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from molt.data import check_dataset
from molt.serve import model_dir_problem
from services.trainer import checkpoint
from services.trainer.model import is_vision_language
from services.trainer.sft_config import SftSettings, validate_sft


def check(s: SftSettings, on_gpu: bool) -> None:
    """Every start-up check, before anything loads (``--dry-run`` runs them too): the flags (``validate_sft``),
    the model directory, the datasets (``check_datasets``), image flags only on a model that takes images."""
    validate_sft(s, on_gpu=on_gpu)
    path = s.model.model_name_or_path
    problem = model_dir_problem(path, "--model.model_name_or_path")
    if problem or path is None:
        raise ValueError(problem)
    check_datasets(s)
    check_output_dirs(s)
    check_fresh_ckpt_path(s)
    if s.model.lora.rank > 0 and not on_gpu:
        check_lora_targets(s, path)
    flags = {"--data.image_key": s.data.image_key, "--model.freeze_visual_encoder": s.model.freeze_visual_encoder}
    for flag, on in flags.items():
        if on and not is_vision_language(path):
            raise ValueError(f"{flag}: {path} takes no images (its config has no vision_config); drop the flag")


def check_output_dirs(s: SftSettings) -> None:
    """A folder flag naming a file fails only where it is first written: the final export after the whole run, the
    first checkpoint after its step. Refused before anything loads."""
    dirs: dict[str, str | None] = {"--ckpt.path": s.ckpt.path, "--ckpt.output_dir": s.ckpt.output_dir}
    dirs["--logger.tensorboard_dir"] = s.logger.tensorboard_dir
    for flag, path in dirs.items():
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: a file, not a directory; name a folder (it is made if missing)")


def check_fresh_ckpt_path(s: SftSettings) -> None:
    """A run that saves checkpoints into a --ckpt.path holding another run's, without --ckpt.load_enable, would
    restart at step 0 and mix the two runs under one retention (the old run's higher steps outlive the new
    ones): refused, naming the two ways out."""
    if s.ckpt.load_enable or s.ckpt.save_steps <= 0:
        return
    found = checkpoint.latest_dir(s.ckpt.path)
    if found is not None:
        raise ValueError(
            f"--ckpt.path {s.ckpt.path} holds checkpoints of an earlier run (newest {found.name}): pass "
            "--ckpt.load_enable to resume it, or remove them or pick another --ckpt.path to start over"
        )


def check_lora_targets(s: SftSettings, path: str) -> None:
    """--model.lora.target_modules against the CPU path's linears (``lora.apply``'s match), on a model built from
    config.json on the meta device: no weights load. NeMo's GPU path matches its own way, so it is not checked."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from services.trainer.lora import matches

    try:
        auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(AutoConfig.from_pretrained(path))
    except Exception:  # noqa: BLE001  # an architecture that will not build here: the real load reports it
        return
    patterns = s.model.lora.target_modules
    if not any(type(m) is torch.nn.Linear and matches(n, patterns) for n, m in model.named_modules()):
        raise ValueError(
            f"--model.lora.target_modules {' '.join(patterns)}: no linear layer of the model matches "
            "(patterns take * wildcards over dotted module names, e.g. '*_proj')"
        )


def check_datasets(s: SftSettings) -> None:
    """--data.dataset and --eval.dataset, cheaply (``molt.data.check_dataset``): the path, the split, a row, the
    keys. Rows without a key are dropped and counted (``sft_data``), so only a key no row holds is refused."""
    d = s.data
    keys = {"--data.input_key": d.input_key, "--data.output_key": d.output_key, "--data.tools_key": d.tools_key}
    if d.dataset:
        check_dataset(d.dataset, d.dataset_split, keys, "--data.dataset", every_row=False)
    if s.eval.dataset:
        check_dataset(s.eval.dataset, s.eval.split, keys, "--eval.dataset", every_row=False)


def same_rows(s: SftSettings) -> bool:
    """--eval.dataset and its split are --data.dataset's (the same paths, the same split)."""

    def paths(spec: str | None) -> list[Path]:
        return [Path(p.strip()).resolve() for p in (spec or "").split(",") if p.strip()]

    return paths(s.eval.dataset) == paths(s.data.dataset) and s.eval.split == s.data.dataset_split
