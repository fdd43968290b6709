"""HF model directory export: the trained weights as a directory ``from_pretrained`` loads.

``save_hf`` gathers the full (unsharded) state dict (a collective: every rank calls it), and rank 0
writes ``model.safetensors`` in the source model's dtype next to the source's config, generation
config, tokenizer and (vision-language models) image processor files. The result is what a rollout pod
(``--model DIR``), ``transformers`` and the RL trainer (``--actor.model_name_or_path DIR``) load. Tied
input/output embeddings are written once, as HF writes them. The directory is written as ``.<name>.tmp``
and renamed, so a reader never sees half a model (into an existing folder, each file is renamed into place).

The RL and SFT trainers write one at the end of a run to ``--ckpt.output_dir`` unless ``--ckpt.disable_final_save``
(Molt's final save; also after a run that trained no step), and with ``--ckpt.save_hf`` one per checkpoint under
``<ckpt.path>/_hf/<tag>``.
Every resumable checkpoint also carries the model's config and tokenizer files (``hf_files/``), so
``export_checkpoint`` (``molt export CKPT OUT``) turns any checkpoint into a model directory offline.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from services.trainer import lora
from services.trainer.errors import CheckpointWriteError, write_failure
from services.trainer.model import full_state_dict

log = logging.getLogger("molt.trainer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
"""A VL model's image (and video) processor settings: copied as they are, so the export takes images as the
source did (vLLM and ``AutoProcessor`` read them)."""


def _copy_processor_files(source_dir: str | Path, out: Path) -> None:
    for name in PROCESSOR_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copyfile(Path(source_dir) / name, out / name)


def save_hf(model: nn.Module, source_dir: str | Path, out_dir: str | Path, tokenizer=None) -> Path | None:
    """Collective. Rank 0 writes the HF directory and returns its path; other ranks return None.

    ``tokenizer``: the one trained with (e.g. with an overridden chat template); default the source's."""
    state = full_state_dict(model)
    out: Path | None = None
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            out = write_hf_dir(state, source_dir, out_dir, tokenizer, lora.scale_of(model))
        except Exception as exc:  # noqa: BLE001 - raised below on every rank, so none waits on rank 0 for good
            problem[0] = _write_failed(out_dir, exc)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointWriteError(problem[0])
    return out


def note_final_export(out_dir: str | Path, step: int, first_step: int, source: str | Path, why: str) -> None:
    """Rank 0: log what the final model directory holds. A run that trained no step still writes one, as Molt's
    final save does whenever training returns: the weights it started from (the resumed checkpoint's, else the
    base model's), so the output folder holds a loadable model whatever the run did. ``why``: why it stopped."""
    if step > first_step:
        log.info("final model: the weights after step %d, to %s", step, out_dir)
    elif step > 0:
        log.warning(
            "no optimizer step in this run (%s): the final model in %s is the resumed checkpoint's weights (step %d)",
            why,
            out_dir,
            step,
        )
    else:
        log.warning(
            "no optimizer step in this run (%s): the final model in %s is the base model %s, unchanged",
            why,
            out_dir,
            source,
        )


def _write_failed(out_dir: str | Path, cause: BaseException) -> str:
    return (
        f"could not write the HF model directory {out_dir} {write_failure(cause, Path(out_dir).parent)}. Free "
        "space or choose another directory (--ckpt.output_dir), then write it from the last checkpoint: molt "
        "export <--ckpt.path> <directory> (without --ckpt.save_steps there is none)"
    )


def write_hf_dir(
    state: dict[str, torch.Tensor],
    source_dir: str | Path,
    out_dir: str | Path,
    tokenizer=None,
    lora_scale: float | None = None,
) -> Path:
    """Write a full, HF-named ``state`` as a model directory with ``source_dir``'s other files (one process).
    With ``lora_scale`` the state holds LoRA adapters: they are folded into the weights, and written alone to
    ``adapter/`` in PEFT's layout (services/trainer/lora.py)."""
    from transformers import AutoConfig

    out = Path(out_dir)
    unmerged = state
    if lora_scale is not None:
        state = lora.merge(state, lora_scale)
    config = AutoConfig.from_pretrained(source_dir)
    dtype = _DTYPES.get(str(getattr(config, "dtype", None) or "float32").replace("torch.", ""), torch.float32)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    # A name of its own: two runs may write their final models to the same folder (Molt's default ./ckpt).
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        _write_files(tmp, out, tensors, config, source_dir, tokenizer, unmerged, lora_scale)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (a full disk) must not keep what it wrote
        raise
    log.info("HF model written to %s", out)
    return out


def _write_files(tmp: Path, out: Path, tensors, config, source_dir, tokenizer, unmerged, lora_scale) -> None:
    """``write_hf_dir``'s files, written into ``tmp`` and then moved to ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    try:
        GenerationConfig.from_pretrained(source_dir).save_pretrained(tmp)
    except OSError:  # the source has no generation_config.json
        pass
    (tokenizer or AutoTokenizer.from_pretrained(source_dir)).save_pretrained(tmp)
    _copy_processor_files(source_dir, tmp)
    if lora_scale is not None:
        # Absolute: PEFT loads the base from wherever the adapter is used, not from this run's directory.
        lora.write_peft_adapter(unmerged, lora_scale, tmp / lora.ADAPTER_DIR, os.path.abspath(source_dir))
    _give_open_mode(tmp)
    if not out.exists():
        os.replace(tmp, out)
    else:  # an existing folder (Molt's ./ckpt also holds the checkpoints): replace the model's files one by one
        for f in tmp.iterdir():
            if f.is_dir() and (out / f.name).is_dir():  # a directory is replaced whole (adapter/)
                shutil.rmtree(out / f.name)
            os.replace(f, out / f.name)
        tmp.rmdir()
        _drop_stale_model_files(out, lora_scale is not None)


# Files a model directory's loaders read first or beside model.safetensors: left from an earlier export into the
# same folder they would be loaded with the new one (PEFT loads an old adapter/; an index names old shards).
_STALE_WEIGHTS = ("model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin*")


def _drop_stale_model_files(out: Path, with_adapter: bool) -> None:
    for pattern in _STALE_WEIGHTS:
        for f in out.glob(pattern):
            f.unlink()
    if not with_adapter and (out / lora.ADAPTER_DIR).is_dir():
        shutil.rmtree(out / lora.ADAPTER_DIR)


def _give_open_mode(folder: Path) -> None:
    """Every file under ``folder`` gets the mode ``open()`` gives a new file here (0666 less the umask).
    safetensors writes its files 0600, so another user (a rollout pod, a colleague) could not load the
    weights although every other file of the model is readable; a probe file reads the umask without
    ``os.umask``, which would change it for the process's other threads meanwhile."""
    probe = folder / f".mode-{uuid.uuid4().hex[:8]}"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for f in folder.rglob("*"):
        if f.is_file():
            f.chmod(mode)


HF_FILES = "hf_files"


def copy_model_files(source_dir: str | Path, out: Path) -> None:
    """``source_dir``'s config, generation config and tokenizer (with its chat template), no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source_dir).save_pretrained(out)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(out)
    _copy_processor_files(source_dir, out)
    try:
        GenerationConfig.from_pretrained(source_dir).save_pretrained(out)
    except OSError:
        pass


def export_checkpoint(step_dir: str | Path, out: str | Path) -> Path:
    """The actor of one checkpoint (a ``global_step<N>`` folder) as a model directory.

    One process, no process group: DCP reads the saved shards into a model built from the checkpoint's own
    config (``hf_files/``), as the trainer built it (a vision-language config as an image-text model); LoRA
    adapters (``hf_files/lora.json`` names their scale) are folded into the weights as ``save_hf`` does."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(step_dir)
    files = path / HF_FILES
    if not (files / "config.json").exists():
        raise ValueError(
            f"{path}: the checkpoint has no {HF_FILES}/ (saved by an older trainer), so the model's "
            "architecture is unknown"
        )
    config = AutoConfig.from_pretrained(files)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        shapes = auto.from_config(config).state_dict()
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in shapes.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    scale = lora.read_scale(files)
    if scale is not None:  # the adapters are in the checkpoint next to the frozen base: load them too, then fold
        reader = dcp.FileSystemReader(str(path / "model_optim"))
        for key, meta in reader.read_metadata().state_dict_metadata.items():
            if key.startswith("actor.") and (".lora_A." in key or ".lora_B." in key):
                state[key[len("actor.") :]] = torch.empty(tuple(meta.size), dtype=torch.float32)  # type: ignore[union-attr]  # tensor entries carry a size
    dcp.load({"actor": state}, checkpoint_id=str(path / "model_optim"), no_dist=True)
    return write_hf_dir(state, files, out, lora_scale=scale)
