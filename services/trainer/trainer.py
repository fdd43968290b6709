"""The step loop, on every rank: rank 0 decides, every rank trains, rank 0 commits.

Per step::

    rank 0: groups <- controller.next_batch()       (stream; dispatch runs concurrently)
    all:    broadcast the plan (encoded trajectories, save?, stop?)
    all:    learner.train_step(samples)             (experience, windows, AdamW)
    all:    checkpoint.save (when due)              (durable: tmp + rename)
    rank 0: controller.commit()                     (ack only now)
    all:    gather the full state dict -> rank 0 publishes it as version + 1

Stopping (``--train.num_steps``, end of the dataset, SIGTERM on rank 0) saves a final checkpoint
when checkpoints are on, commits, and broadcasts a stop so every rank leaves the loop together.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

import torch.distributed as dist

from molt.bus import open_queue
from molt.schema import decode, encode
from services.trainer import checkpoint
from services.trainer.app import TrainerStatus
from services.trainer.batch import samples_from_trajectory
from services.trainer.config import TrainerSettings, planned_optimizer_steps
from services.trainer.controller import Controller, LoopThread
from services.trainer.learner import Learner
from services.trainer.metrics import phase, record_step, trainer_metrics
from services.trainer.model import DistInfo, full_state_dict
from services.trainer.publish import WeightPublisher, build_publisher

log = logging.getLogger("molt.trainer")
HOLD_ENV = "MOLT_TRAINER_TEST_HOLD_BEFORE_ACK_STEP"
"""Test hook: before acking step N, log 'holding before ack' and wait to be killed."""


class Trainer:
    def __init__(self, settings: TrainerSettings, info: DistInfo, *, publisher: WeightPublisher | None = None,
                 queue=None) -> None:
        self.s, self.info = settings, info
        self.metrics = trainer_metrics()
        self.status = TrainerStatus(world_size=info.world_size)
        self.learner = Learner(settings, info, total_steps=planned_optimizer_steps(settings, self._num_prompts()))
        self.publisher = publisher
        self.vocab_size = getattr(getattr(self.learner.actor, "config", None), "vocab_size", None)
        self.io: LoopThread | None = None
        self.controller: Controller | None = None
        self.server = None
        self.last_saved_step = -1
        self._last_step_end = time.monotonic()
        if info.is_main:
            if self.publisher is None:
                self.publisher = build_publisher(settings.rollout, self.learner.frozen_names, self.learner.actor)
            self.io = LoopThread()
            self.controller = Controller(settings, queue or open_queue(settings.redis, self.metrics), self.metrics,
                                         *self._dispatch_parts())
        flag = [self.publisher is not None]
        dist.broadcast_object_list(flag, src=0)
        self.publishing = flag[0]
        log.info("rank %d of %d ready (%s, %s)", info.rank, info.world_size, info.backend,
                 type(self.learner.actor).__name__)

    def _num_prompts(self) -> int | None:
        if not self.s.train.dispatch or self.s.train.num_steps:
            return None
        with open(self.s.data.prompt_dataset) as f:  # every rank reads it: the scheduler must agree
            return min(sum(1 for line in f if line.strip()), self.s.data.max_samples)

    def _dispatch_parts(self):
        if not self.s.train.dispatch:
            return None, None
        from services.trainer.dispatch import EpisodeDispatcher, PromptDataset

        d = self.s.data
        dataset = PromptDataset(d.prompt_dataset, d.input_key, d.label_key, chat=d.apply_chat_template,
                                max_samples=d.max_samples, seed=self.s.train.seed)
        return dataset, EpisodeDispatcher(self.s.envs, self.s.rollout, d.max_len)

    # ---- lifecycle

    def start_server(self) -> int:
        """Serve /healthz, /readyz, /metrics from rank 0's loop thread; returns the bound port."""
        import uvicorn

        from services.trainer.app import build_app

        port = self.s.metrics.port if self.s.metrics.port is not None else self.s.server.port
        app = build_app(self.s, self.status, self.metrics)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.s.server.host, port=port, log_level="warning"))
        self._serving = self.io.spawn(self.server.serve())
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("trainer HTTP server did not start")
            time.sleep(0.01)
        bound = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("trainer listening on http://%s:%d", self.s.server.host, bound)
        return bound

    def request_stop(self, *_) -> None:
        if self.controller is not None:
            self.controller.stop_requested = True

    def run(self) -> dict:
        client_state = checkpoint.load(self.s.ckpt.path, self.learner) if self.s.ckpt.load_enable else None
        if client_state is not None:
            self.last_saved_step = self.learner.global_step
            self._publish(self.learner.global_step)  # pods serve the checkpoint's weights (Molt does the same)
        if self.info.is_main:
            self.io.run(self.controller.resume(client_state))
            if self.s.train.dispatch:
                self.io.call(self.controller.start_dispatch)
            self.status.update(ready=True, phase="collecting", step=self.learner.global_step,
                               policy_version=self.controller.version)
            self.metrics["molt_trainer_policy_version"].set(self.controller.version)
        try:
            while self._one_step():
                pass
        finally:
            if self.info.is_main:
                self.status.update(phase="stopped")
        return {"steps": self.learner.global_step, "version": self.controller.version if self.controller else None}

    def close(self) -> None:
        if self.info.is_main:
            if self.server is not None:
                self.server.should_exit = True
                self._serving.result(timeout=10)
            self.io.run(self.controller.close(), timeout=30)
            if self.publisher is not None:
                self.publisher.close()
            self.io.stop()

    # ---- one step

    def _plan(self) -> dict:
        c = self.controller
        max_steps = self.s.train.num_steps
        if max_steps is not None and self.learner.global_step >= max_steps:
            return {"stop": True}
        t0 = time.perf_counter()
        trajs = []
        while not trajs:  # a batch of only unusable trajectories is skipped (they are acked with the next commit)
            with phase(self.metrics, "wait_batch"):
                groups = self.io.run(c.next_batch(self.s.rollout.batch_size))
            if not groups:
                return {"stop": True}
            trajs = [t for g in groups for t in g.trajectories if self._usable(t)]
        step = self.learner.global_step + 1
        save_steps = self.s.ckpt.save_steps
        return {"stop": False, "trajs": [encode(t, validate=False) for t in trajs], "wait_s": time.perf_counter() - t0,
                "save": save_steps > 0 and step % save_steps == 0}

    def _usable(self, traj) -> bool:
        """Token ids outside the policy's vocabulary (a producer on another model) would crash every rank's
        forward: such a trajectory is logged, counted and acked untrained."""
        vocab = self.vocab_size
        if vocab and any(int(seg.token_ids.max()) >= vocab for seg in traj.segments):
            log.error("trajectory %s has token ids >= the vocabulary size %d of %s: not trained (check the "
                      "gateway's --model.path)", traj.trajectory_id, vocab, self.s.actor.model_name_or_path)
            self.metrics["molt_trainer_trajectories_total"].labels("invalid").inc()
            return False
        return True

    def _one_step(self) -> bool:
        plan = [self._plan() if self.info.is_main else None]
        dist.broadcast_object_list(plan, src=0)
        plan = plan[0]
        if plan["stop"]:
            self._finish()
            return False
        trajs = [decode(b) for b in plan["trajs"]]
        samples = [x for t in trajs for x in samples_from_trajectory(t, self.s.data.max_len)]
        version = self.learner.global_step  # policy version of the weights being trained
        t0 = time.perf_counter()
        if self.info.is_main:
            self.status.update(phase="training")
        with phase(self.metrics, "train"):
            stats = self.learner.train_step(samples)
        train_s = time.perf_counter() - t0
        if self.info.is_main:
            self._record(trajs, samples, stats, version, train_s)
        if plan["save"]:
            self._save()
        elif self.s.ckpt.save_steps <= 0 and self.info.is_main:
            self.io.run(self.controller.commit())
        self._publish(self.learner.global_step)
        return True

    def _record(self, trajs, samples, stats, version, train_s) -> None:
        staleness = collections.Counter()
        for x in samples:
            values, counts = (version - x.versions[x.action_mask]).unique(return_counts=True)
            staleness.update(dict(zip(values.tolist(), counts.tolist())))
        tokens = sum(x.num_actions for x in samples)
        record_step(self.metrics, self.learner.global_step, version, stats, tokens=tokens, seconds=train_s,
                    rewards=[t.reward for t in trajs], staleness=staleness)
        self.metrics["molt_trainer_trajectories_total"].labels("trained").inc(len(trajs))
        self.io.run(self.controller.queue.lag())  # refreshes the molt_queue_* gauges
        st = self.status
        self.status.update(step=self.learner.global_step, trained_trajectories=st.trained_trajectories + len(trajs))
        reward = sum(t.reward for t in trajs) / len(trajs)
        log.info("step %d: %d trajectories, reward %.4f, policy_loss %.4f, grad_norm %.4f, mismatch_kl %s, %.2fs",
                 self.learner.global_step, len(trajs), reward, stats.get("policy_loss", 0.0),
                 stats.get("actor_grad_norm", 0.0), {k: round(v, 5) for k, v in stats["mismatch_kl"].items()}, train_s)
        now = time.monotonic()
        period, self._last_step_end = now - self._last_step_end, now
        if self.s.logger.steps_jsonl:
            pods = stats["mismatch_kl"]
            n_stale = sum(staleness.values())
            line = {"step": self.learner.global_step, "policy_version": self.learner.global_step, "version": version,
                    "reward_mean": reward, "samples": len(trajs), "tokens": tokens,
                    "seconds": period, "train_seconds": train_s,
                    "mismatch_kl": stats["vllm_kl_all_pods"], "mismatch_kl_by_pod": pods,
                    "staleness_mean": sum(k * v for k, v in staleness.items()) / n_stale if n_stale else 0.0,
                    "staleness_max": max(staleness) if staleness else 0, "pid": os.getpid(),
                    **{k: v for k, v in stats.items() if isinstance(v, float)},
                    "grad_norm": stats.get("actor_grad_norm", 0.0),
                    "trajectory_ids": [t.trajectory_id for t in trajs]}
            with open(self.s.logger.steps_jsonl, "a") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _save(self) -> None:
        state = [self.controller.client_state(self.learner.global_step) if self.info.is_main else None]
        dist.broadcast_object_list(state, src=0)
        with phase(self.metrics, "checkpoint"):
            checkpoint.save(self.s.ckpt.path, self.learner, state[0], self.s.ckpt.max_num)
        self.last_saved_step = self.learner.global_step
        if self.info.is_main:
            hold = os.environ.get(HOLD_ENV)
            if hold and int(hold) == self.learner.global_step:
                log.warning("holding before ack of step %d (%s)", self.learner.global_step, HOLD_ENV)
                while True:
                    time.sleep(1)
            with phase(self.metrics, "commit"):
                self.io.run(self.controller.commit())

    def _publish(self, new_version: int) -> None:
        if self.publishing:
            with phase(self.metrics, "publish"):
                tensors = full_state_dict(self.learner.actor)
                if self.info.is_main:
                    frozen = set(self.learner.frozen_names)
                    self.publisher.publish(new_version, {k: v for k, v in tensors.items() if k not in frozen})
        if self.info.is_main:
            self.io.call(self.controller.set_version, new_version)
            self.metrics["molt_trainer_policy_version"].set(new_version)
            self.status.update(policy_version=new_version, phase="collecting")

    def _finish(self) -> None:
        if self.s.ckpt.save_steps > 0 and self.last_saved_step != self.learner.global_step:
            self._save()
        elif self.info.is_main and self.controller.uncommitted:
            if self.s.ckpt.save_steps <= 0:
                self.io.run(self.controller.commit())
        if self.info.is_main:
            log.info("stopping at step %d (version %d)", self.learner.global_step, self.controller.version)
