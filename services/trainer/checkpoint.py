"""Resumable checkpoints: model, optimizer, step, policy version and stream position, saved together.

Layout under ``--ckpt.path`` (Molt's layout, simplified)::

    global_step<N>/            written as .tmp-global_step<N>/ then renamed (atomic on one filesystem)
        model_optim/           torch.distributed.checkpoint (DCP) shards: actor, optimizer, critic, ...
        extra_state.pt         schedulers, KL controller, RNG, and the controller's client state
    latest                     the tag of the newest complete checkpoint (tmp + rename)

Every rank writes its DCP shards into the tmp dir; rank 0 writes ``extra_state.pt`` last, fsyncs,
renames the dir and then ``latest``. A crash at any point leaves either the previous checkpoint or
the new one, never a half one. The client state carries the trajectory ids trained since the last
ack (see ``controller.py``): trajectories are acked only after the rename, so a restart can tell
"trained and saved, not acked" (ack it, do not train) from "not saved" (train it again).
DCP reshards on load, so a run may resume with another world size. The SFT learner
(``services/trainer/sft.py``) saves and loads through the same code; it has no critic and no KL
controller, and its client state is its position in the dataset.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger("molt.trainer")
LATEST = "latest"
BEST_PREFIX = "best_"
"""Prefix of the --ckpt.best_metric_key checkpoint's directory (best_global_step<N>)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _stateful(learner) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(learner.actor, learner.optim)
    state = {"actor": model_sd, "actor_optim": optim_sd}
    if getattr(learner, "critic", None) is not None:  # the SFT learner has no critic
        c_sd, co_sd = get_state_dict(learner.critic, learner.critic_optim)
        state.update(critic=c_sd, critic_optim=co_sd)
    return state


def save(root: str, learner, client_state: dict[str, Any], max_num: int = 3, *, best: bool = False) -> Path:
    """Collective: every rank calls it. Returns the final directory once it is durable. ``best``: the
    ``--ckpt.best_metric_key`` checkpoint, best_global_step<N>, which replaces the previous best and is not
    what a resume loads."""
    base = Path(root)
    tag = f"{BEST_PREFIX if best else ''}global_step{learner.global_step}"
    final, tmp = base / tag, base / f".tmp-{tag}"
    if dist.get_rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save(_stateful(learner), checkpoint_id=str(tmp / "model_optim"))
    dist.barrier()
    if dist.get_rank() == 0:
        if getattr(learner, "hf_source", None):  # config + tokenizer: `molt export` rebuilds the model from them
            from services.trainer.export import HF_FILES, copy_model_files

            copy_model_files(learner.hf_source, tmp / HF_FILES)
            if getattr(learner, "lora", None):  # the adapters' scale: `molt export` folds them in
                from services.trainer.lora import write_config

                write_config(tmp / HF_FILES, learner.lora.rank, learner.lora.alpha)
        extra = {
            "global_step": learner.global_step,
            "sched": learner.sched.state_dict(),
            "critic_sched": learner.critic_sched.state_dict() if getattr(learner, "critic_sched", None) else None,
            "kl_ctl": learner.kl_ctl.state_dict() if getattr(learner, "kl_ctl", None) else None,
            "rng": torch.get_rng_state(),
            "client_state": client_state,
        }
        with open(tmp / "extra_state.pt", "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step after a resume: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(base)
        if best:
            for old in base.glob(BEST_PREFIX + "global_step*"):
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)
        else:
            _write_atomic(base / LATEST, tag.encode())
            prune(base, max_num, keep=tag)
    dist.barrier()
    return final


def prune(base: Path, max_num: int, keep: str) -> None:
    """Keep the newest ``max_num`` global_step<N> directories under ``base`` (and ``keep``); <= 0 keeps all."""
    if max_num <= 0:
        return
    dirs = sorted((p for p in base.glob("global_step*") if p.is_dir()), key=lambda p: int(p.name[11:]))
    for p in dirs[:-max_num]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)


def best_state(root: str) -> dict[str, Any] | None:
    """The client state of the best checkpoint under ``root`` (its ``best`` entry names the metric), or None."""
    found = sorted(Path(root).glob(BEST_PREFIX + "global_step*/extra_state.pt")) if Path(root).is_dir() else []
    if not found:
        return None
    return torch.load(found[-1], weights_only=False).get("client_state")


def latest_dir(root: str) -> Path | None:
    """The newest complete checkpoint: ``latest`` if loadable, else the highest complete step."""
    base = Path(root)
    if not base.is_dir():
        return None
    tag_file = base / LATEST
    if tag_file.exists():
        cand = base / tag_file.read_text().strip()
        if (cand / "extra_state.pt").exists():
            return cand
    done = [p for p in base.glob("global_step*") if (p / "extra_state.pt").exists()]
    return max(done, key=lambda p: int(p.name[11:])) if done else None


def load(root: str, learner) -> dict[str, Any] | None:
    """Collective: restore the learner from the newest checkpoint; returns its client state (None: none)."""
    path = latest_dir(root)
    flag = [str(path) if path else None]
    dist.broadcast_object_list(flag, src=0)  # every rank loads the same tag
    if flag[0] is None:
        return None
    path = Path(flag[0])
    state = _stateful(learner)
    dcp.load(state, checkpoint_id=str(path / "model_optim"))
    set_state_dict(
        learner.actor, learner.optim, model_state_dict=state["actor"], optim_state_dict=state["actor_optim"]
    )
    if getattr(learner, "critic", None) is not None:
        set_state_dict(
            learner.critic,
            learner.critic_optim,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
    extra = torch.load(path / "extra_state.pt", weights_only=False)
    learner.global_step = extra["global_step"]
    learner.sched.load_state_dict(extra["sched"])
    if getattr(learner, "critic_sched", None) is not None and extra["critic_sched"]:
        learner.critic_sched.load_state_dict(extra["critic_sched"])
    if getattr(learner, "kl_ctl", None) is not None:
        learner.kl_ctl.load_state_dict(extra["kl_ctl"])
    torch.set_rng_state(extra["rng"])
    log.info("resumed from %s (step %d)", path, learner.global_step)
    return extra["client_state"]
