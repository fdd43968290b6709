"""Where a train step's metrics go: ``--logger.steps_jsonl``, TensorBoard and W&B, as Molt logs them.

Molt's backends: TensorBoard iff ``--logger.tensorboard_dir`` (log dir ``<dir>/<run_name>``, scalars
``train/<key>``), W&B iff ``--logger.wandb.key`` (``train/<key>`` against ``train/global_step``;
``--logger.wandb.mode offline`` writes the run locally and needs no key), every
``--logger.logging_steps`` steps. The keys are Molt's (``policy_loss``, ``actor_grad_norm``,
``reward``, ``vllm_kl``, ...) plus the mean of every numeric ``Result.info`` key of the step's
trajectories under its own name, as Molt averages per-sample info into the step's metrics.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Literal

from molt import strict_json


def info_means(trajectories) -> dict[str, float]:
    """Mean of each ``info`` key over the trajectories that carry it."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for k, v in (t.info or {}).items():
            sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def rollout_stats(trajectories) -> dict[str, float]:
    """Molt's ``rollout/*`` statistics of a step's trajectories, every one consumed (also those whose segments
    trained nothing). Rewards count once per rollout, as Molt regroups its per-turn rows before averaging
    (a long failing episode would otherwise outweigh a short success); ``pass1`` is the mean of the prompt
    groups' mean rewards, the quantity eval's ``pass1`` is. Lengths and truncation are per segment, as Molt's
    rows are per generation."""
    rewards = [float(t.reward) for t in trajectories]
    groups: dict[str, list[float]] = {}
    for t, r in zip(trajectories, rewards, strict=True):
        groups.setdefault(t.group_id, []).append(r)
    segments = [(seg, t.status == "truncated") for t in trajectories for seg in t.segments]
    lengths = [sum(int(e - s) for s, e in seg.action_spans) for seg, _ in segments]
    return {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/pass1": statistics.fmean(statistics.fmean(g) for g in groups.values()) if groups else 0.0,
        "rollout/num_rollouts": float(len(rewards)),
        "rollout/num_prompt_groups": float(len(groups)),
        "rollout/response_length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/truncated_rate": statistics.fmean(float(cut) for _, cut in segments) if segments else 0.0,
        "rollout/num_samples": float(len(segments)),
    }


def default_run_name() -> str:
    return time.strftime("rl_%m%dT%H:%M")


def open_jsonl(path: str):
    """Open a metrics file for appending, its folder made first: a path into a folder not made yet would
    otherwise fail at the first step's line, after that step trained and before it was saved."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "a")


class StepLog:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        for path in (cfg.steps_jsonl, cfg.eval_jsonl):  # their folders, made (or refused) before anything trains
            if path:
                open_jsonl(path).close()
        self.run_name = cfg.wandb.run_name or default_run_name()
        self.tb = None
        self.wandb = None
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=os.path.join(cfg.tensorboard_dir, self.run_name))
        # WANDB_MODE=offline in the environment wins over the flag's default, as it does for Molt (which
        # passes no mode): an explicit mode argument would override what wandb reads from the environment.
        env_mode = os.environ.get("WANDB_MODE", "").lower()
        offline = cfg.wandb.mode == "offline" or env_mode in ("offline", "dryrun")
        mode: Literal["online", "offline"] = "offline" if offline else "online"
        if cfg.wandb.key or mode == "offline":
            import wandb

            if cfg.wandb.key and mode != "offline":
                wandb.login(key=cfg.wandb.key)
            self.wandb = wandb.init(
                entity=cfg.wandb.org,
                project=cfg.wandb.project,
                group=cfg.wandb.group,
                name=self.run_name,
                mode=mode,
                dir=cfg.wandb.dir,
                config=None,
                reinit="finish_previous",
            )
            self.wandb.define_metric("train/global_step")
            self.wandb.define_metric("train/*", step_metric="train/global_step", step_sync=True)
            self.wandb.define_metric("eval/global_step")
            self.wandb.define_metric("eval/*", step_metric="eval/global_step", step_sync=True)

    def log(self, step: int, line: dict[str, Any]) -> None:
        if self.cfg.steps_jsonl:
            with open_jsonl(self.cfg.steps_jsonl) as f:
                f.write(strict_json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if step % self.cfg.logging_steps:
            return
        scalars = {
            k: float(v)
            for k, v in line.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "pid")
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(f"train/{k}", v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"train/global_step": step, **{f"train/{k}": v for k, v in scalars.items()}})

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self.cfg.eval_jsonl:
            with open_jsonl(self.cfg.eval_jsonl) as f:
                f.write(strict_json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"eval/{k}", v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"eval/global_step": step, **{f"eval/{k}": v for k, v in metrics.items()}})

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
