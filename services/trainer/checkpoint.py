"""Resumable checkpoints: model, optimizer, step, policy version and stream position, saved together.

Layout under ``--ckpt.path`` (Molt's layout, simplified)::

    global_step<N>/            written as .tmp-global_step<N>/ then renamed (atomic on one filesystem)
        model_optim/           torch.distributed.checkpoint (DCP) shards: actor, optimizer, critic, ...
        extra_state.pt         schedulers, KL controller, RNG, and the controller's client state
        metric.json            {"metric_key", "metric_value"}: the eval metric it was saved with (retention)
    best_global_step<N>/       the --ckpt.best_metric_key checkpoint (same layout; never pruned)
    latest                     the tag of the newest complete checkpoint (tmp + rename)

Every rank writes its DCP shards into the tmp dir; rank 0 writes ``extra_state.pt`` last, fsyncs,
renames the dir and then ``latest``. A crash at any point leaves either the previous checkpoint or
the new one, never a half one. The client state carries the trajectory ids trained since the last
ack (see ``controller.py``): trajectories are acked only after the rename, so a restart can tell
"trained and saved, not acked" (ack it, do not train) from "not saved" (train it again).
DCP reshards on load, so a run may resume with another world size. The SFT learner
(``services/trainer/sft.py``) saves and loads through the same code; it has no critic and no KL
controller, and its client state is its position in the dataset.

Retention (``prune``, rank 0 after each regular save), Molt's rule: while more than ``max_num`` regular
checkpoints are kept, or they and the best one take more than ``max_mem`` GB, the worst regular one goes:
one without a metric first, then the lowest metric (higher is better: pass rates), then the oldest. The one
just saved and ``best_global_step<N>`` are never removed. Without evaluations this keeps the newest
``max_num``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from molt import strict_json
from services.trainer.errors import CheckpointWriteError, size, write_failure

log = logging.getLogger("molt.trainer")
LATEST = "latest"
BEST_PREFIX = "best_"
"""Prefix of the --ckpt.best_metric_key checkpoint's directory (best_global_step<N>)."""
METRIC_FILE = "metric.json"
"""The eval metric a checkpoint was saved with: ``{"metric_key": str | None, "metric_value": float | None}``."""
STEP_PREFIX = "global_step"
GB = 1024**3


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


def save(
    root: str,
    learner,
    client_state: dict[str, Any],
    max_num: int = 3,
    *,
    best: bool = False,
    max_mem: float = math.inf,
    metric_key: str | None = None,
    metric_value: float | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final directory once it is durable. ``best``: the
    ``--ckpt.best_metric_key`` checkpoint, best_global_step<N>, which replaces the previous best and is not
    what a resume loads. ``metric_key``/``metric_value`` (rank 0's are used): the eval metric recorded in
    ``metric.json`` for retention; ``max_num``/``max_mem``: see ``prune``."""
    base = Path(root)
    tag = f"{BEST_PREFIX if best else ''}global_step{learner.global_step}"
    final, tmp = base / tag, base / f".tmp-{tag}"
    if dist.get_rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
        # Partial saves of a process killed mid-write (one trainer writes under a --ckpt.path) would hold their
        # disk space until the same step is saved again, which a resume on another cadence never does.
        for partial in base.glob(".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    try:  # collective: a write that fails on any rank raises on every rank
        dcp.save(_stateful(learner), checkpoint_id=str(tmp / "model_optim"))
    except dcp.CheckpointException as exc:
        failures = list(exc.failures.values())
        raise _write_failed(base, tmp, tag, failures[0][0] if failures else exc) from exc
    dist.barrier()
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            _finish_save(
                base, tmp, final, tag, learner, client_state, max_num, best, max_mem, metric_key, metric_value
            )
        except (OSError, RuntimeError) as exc:
            problem[0] = str(_write_failed(base, tmp, tag, exc))
    dist.broadcast_object_list(problem, src=0)  # the other ranks wait here, and fail with rank 0
    if problem[0] is not None:
        raise CheckpointWriteError(problem[0])
    return final


def _write_failed(base: Path, tmp: Path, tag: str, cause: BaseException) -> CheckpointWriteError:
    """The error for a save that failed, its partial directory removed (rank 0)."""
    what = write_failure(cause, base)  # before the partial directory goes: the free space when it failed
    partial = dir_size(tmp)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = sum(dir_size(p) for p in _ckpt_dirs(base, STEP_PREFIX) + _ckpt_dirs(base, BEST_PREFIX + STEP_PREFIX))
    return CheckpointWriteError(
        f"could not write checkpoint {tag} under {base} {what} when it failed, after {size(partial)} of this "
        f"checkpoint (removed), and the checkpoints kept there take {size(kept)}. If it is full: free space, give "
        "--ckpt.path a larger volume, or keep fewer checkpoints (--ckpt.max_num, --ckpt.dcp_max_num, "
        "--ckpt.max_mem). A restart resumes from the last complete checkpoint"
    )


def _finish_save(
    base: Path,
    tmp: Path,
    final: Path,
    tag: str,
    learner,
    client_state: dict[str, Any],
    max_num: int,
    best: bool,
    max_mem: float,
    metric_key: str | None,
    metric_value: float | None,
) -> None:
    """Rank 0's part of ``save``: the files besides the shards, the atomic rename, ``latest`` and retention."""
    if getattr(learner, "hf_source", None):  # config + tokenizer: `molt export` rebuilds the model from them
        from services.trainer.export import HF_FILES, copy_model_files

        copy_model_files(learner.hf_source, tmp / HF_FILES)
        if getattr(learner, "lora", None):  # the adapters' scale: `molt export` folds them in
            from services.trainer.lora import write_config

            write_config(tmp / HF_FILES, learner.lora.rank, learner.lora.alpha)
    _write_metric(tmp, metric_key, metric_value, sync_dir=False)  # the tmp dir is fsynced below
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
        prune(base, max_num, keep=tag, max_mem=max_mem)


def _write_metric(ckpt_dir: Path, key: str | None, value: float | None, *, sync_dir: bool = True) -> None:
    data = strict_json.dumps({"metric_key": key or None, "metric_value": value}).encode()
    if sync_dir:
        _write_atomic(ckpt_dir / METRIC_FILE, data)
    else:
        with open(ckpt_dir / METRIC_FILE, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def record_metric(root: str, tag: str, key: str | None, value: float | None) -> bool:
    """Rank 0: set the metric of the saved checkpoint ``tag`` (an evaluation of the very weights it holds,
    which runs after the save in the trainer's step). False when there is no such checkpoint."""
    ckpt_dir = Path(root) / tag
    if not (ckpt_dir / "extra_state.pt").exists():
        return False
    _write_metric(ckpt_dir, key, value)
    return True


def read_metric(ckpt_dir: Path) -> float | None:
    """The metric value a checkpoint was saved with; None when it has none (no file, null, not a number)."""
    try:
        value = json.loads((ckpt_dir / METRIC_FILE).read_text()).get("metric_value")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def resumed_metric(root: str) -> tuple[str | None, float | None]:
    """(key, value) of ``metric.json`` in the newest complete checkpoint under ``root``; (None, None) without one."""
    path = latest_dir(root)
    if path is None:
        return None, None
    try:
        key = json.loads((path / METRIC_FILE).read_text()).get("metric_key")
    except (OSError, ValueError, AttributeError):
        return None, None
    return (key if isinstance(key, str) and key else None), read_metric(path)


def _step(p: Path) -> int:
    name = p.name.removeprefix(BEST_PREFIX)
    return int(name[len(STEP_PREFIX) :])


def _ckpt_dirs(base: Path, prefix: str) -> list[Path]:
    return [p for p in base.glob(prefix + "*") if p.is_dir() and p.name[len(prefix) :].isdigit()]


def dir_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def prune(base: Path, max_num: int, keep: str, max_mem: float = math.inf) -> None:
    """Molt's retention over the global_step<N> directories under ``base``: while more than ``max_num`` (<= 0:
    no bound) are kept, or they and best_global_step<N> take more than ``max_mem`` GB (1024**3 bytes), remove
    one other than ``keep``: first one without a metric, then the lowest ``metric.json`` value (higher is
    better), then the oldest. ``keep`` and best_* are never removed; a budget still exceeded when nothing
    else is left is logged."""
    count_bound = max_num > 0
    if not count_bound and math.isinf(max_mem):
        return
    regular = _ckpt_dirs(base, STEP_PREFIX)
    # Age is the step, not the mtime Molt reads: the same order for a run's own saves, and it survives a
    # copy or a metric.json rewrite. With no metrics anywhere this is today's "keep the newest max_num".
    metrics = {p: read_metric(p) for p in regular if p.name != keep}
    ranked = sorted(metrics, key=lambda p: (0, 0.0, _step(p)) if metrics[p] is None else (1, metrics[p], _step(p)))
    sized = [*regular, *_ckpt_dirs(base, BEST_PREFIX + STEP_PREFIX)] if not math.isinf(max_mem) else []
    sizes = {p: dir_size(p) for p in sized}
    budget = max_mem * GB
    kept = len(regular)
    used = sum(sizes.values())
    for victim in ranked:
        if not (count_bound and kept > max_num) and used <= budget:
            break
        shutil.rmtree(victim, ignore_errors=True)
        kept -= 1
        used -= sizes.pop(victim, 0)
        log.info("checkpoint retention: removed %s (metric %s)", victim.name, metrics[victim])
    if used > budget:
        log.warning(
            "checkpoint retention: %.3f GB kept under %s exceeds --ckpt.max_mem %g with nothing left to remove "
            "(the checkpoint just saved and the best one stay)",
            used / GB,
            base,
            max_mem,
        )


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
    done = [p for p in _ckpt_dirs(base, STEP_PREFIX) if (p / "extra_state.pt").exists()]
    return max(done, key=_step) if done else None


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
