"""The step loop, on every rank: rank 0 decides, every rank trains, rank 0 commits.

Per step::

    rank 0: groups <- controller.next_batch()       (stream; dispatch runs concurrently)
    all:    broadcast the plan (encoded trajectories, save?, stop?)
    all:    learner.train_step(samples)             (experience, windows, AdamW)
    all:    checkpoint.save (when due)              (durable: tmp + rename)
    rank 0: controller.commit()                     (ack only now)
    all:    gather the full state dict -> rank 0 publishes it as version + 1

The weights are also pushed before the first dispatch (resumed or not), and while rank 0 waits for a
batch it asks the pods every ``CATCH_UP_EVERY_S`` whether they serve its version: a pod that restarted
on base weights (out of routing with ``--weights.await_push`` until then) is pushed the current weights
at once, so no rollout is generated outside the staleness bound.

Stopping (``--train.num_steps``, end of the dataset, SIGTERM on rank 0) saves a final checkpoint
when checkpoints are on, commits, and broadcasts a stop so every rank leaves the loop together.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch.distributed as dist
import transformers

from molt.algorithms import filtering_metrics
from molt.bus import open_queue
from molt.schema import Trajectory, decode, encode
from services.trainer import checkpoint
from services.trainer.app import TrainerStatus
from services.trainer.batch import samples_from_trajectory, with_actions
from services.trainer.config import TrainerSettings, planned_optimizer_steps
from services.trainer.controller import Controller, LoopThread
from services.trainer.export import note_final_export, save_hf
from services.trainer.learner import Learner
from services.trainer.metrics import phase, record_step, trainer_metrics
from services.trainer.model import DistInfo, full_state_dict
from services.trainer.publish import WeightPublisher, build_publisher
from services.trainer.steplog import StepLog, info_means, rollout_stats

if TYPE_CHECKING:
    import uvicorn

    from services.trainer.evaluate import Evaluator

log = logging.getLogger("molt.trainer")
CATCH_UP_EVERY_S = 5.0  # while waiting for rollouts: how often pods are asked whether they run our version
HOLD_ENV = "MOLT_TRAINER_TEST_HOLD_BEFORE_ACK_STEP"
"""Test hook: before acking step N, log 'holding before ack' and wait to be killed."""


class Trainer:
    def __init__(
        self, settings: TrainerSettings, info: DistInfo, *, publisher: WeightPublisher | None = None, queue=None
    ) -> None:
        self.s, self.info = settings, info
        if settings.train.full_determinism_enable:  # before any model is built, as the seeds must be
            transformers.enable_full_determinism(settings.train.seed, warn_only=True)
        self.metrics = trainer_metrics()
        self.status = TrainerStatus(world_size=info.world_size)
        self.learner = Learner(settings, info, total_steps=planned_optimizer_steps(settings, self._num_prompts()))
        self.publisher = publisher
        config = getattr(self.learner.actor, "config", None)
        get_text = getattr(config, "get_text_config", None)  # a VL model's vocabulary is its decoder's
        self.vocab_size = getattr(get_text() if get_text else config, "vocab_size", None)
        self._io: LoopThread | None = None  # rank 0 only (self.io, self.controller)
        self._controller: Controller | None = None
        self.server: uvicorn.Server | None = None
        self.evaluator: Evaluator | None = None
        self.best: dict | None = None  # rank 0: the --ckpt.best_metric_key metric's best evaluation so far
        self._best_pending: dict | None = None  # rank 0: an evaluation that beat it, saved at the next plan
        self.last_metric: tuple[str | None, float | None] = (None, None)  # rank 0: latest eval's key and value
        self._batch: concurrent.futures.Future | None = None  # rank 0's pending next_batch, kept across catch-ups
        self.last_saved_step = -1
        self.first_step = 0  # the step this run started at (a resumed checkpoint's): the final export logs from it
        self._pushed_full = False  # LoRA: the first push carries every weight, later ones the adapted ones
        self._last_step_end = time.monotonic()
        if info.is_main:
            self.steplog = StepLog(settings.logger)
            if self.publisher is None:
                self.publisher = build_publisher(
                    settings.rollout,
                    self.learner.frozen_names,
                    self.learner.actor,
                    keep_unsent=self.learner.lora is not None,
                )
            self._io = LoopThread()
            dataset, dispatcher = self._dispatch_parts()
            self._controller = Controller(
                settings,
                queue or open_queue(settings.redis, self.metrics),
                self.metrics,
                dataset,
                dispatcher,
                on_bus_outage=self._bus_outage,
            )
            if settings.eval.dataset:
                from services.trainer.evaluate import Evaluator

                self.evaluator = Evaluator(settings, self.controller.dispatcher)
        flag = [self.publisher is not None]
        dist.broadcast_object_list(flag, src=0)
        self.publishing = flag[0]
        log.info(
            "rank %d of %d ready (%s, %s)", info.rank, info.world_size, info.backend, type(self.learner.actor).__name__
        )

    @property
    def io(self) -> LoopThread:
        assert self._io is not None, "rank 0 only"
        return self._io

    @property
    def controller(self) -> Controller:
        assert self._controller is not None, "rank 0 only"
        return self._controller

    def _num_prompts(self) -> int | None:
        if not self.s.train.dispatch or self.s.train.num_steps or self.s.data.prompt_dataset is None:
            return None  # (no prompt dataset: --eval.eval_only)
        from molt.data import read_mixed_rows

        d = self.s.data  # every rank reads it: the scheduler must agree
        assert d.prompt_dataset is not None  # returned above without one
        return len(
            read_mixed_rows(
                d.prompt_dataset, d.prompt_probs, d.prompt_split, d.max_samples, 0, "--data.prompt_dataset"
            )
        )

    def _dispatch_parts(self):
        if not self.s.train.dispatch:
            return None, None
        from services.trainer.dispatch import EpisodeDispatcher, PromptDataset

        d = self.s.data
        dispatcher = EpisodeDispatcher(self.s.envs, self.s.rollout, d.max_len)
        if d.prompt_dataset is None:  # --eval.eval_only: episodes of the eval set only
            return None, dispatcher
        dataset = PromptDataset(
            d.prompt_dataset,
            d.input_key,
            d.label_key,
            chat=d.apply_chat_template,
            max_samples=d.max_samples,
            seed=self.s.train.seed,
            tools_key=d.tools_key,
            image_key=d.image_key,
            max_images=d.max_images_per_prompt,
            split=d.prompt_split,
            probs=d.prompt_probs,
        )
        return dataset, dispatcher

    # ---- lifecycle

    def start_server(self) -> int:
        """Serve /healthz, /readyz, /metrics from rank 0's loop thread; returns the bound port."""
        import uvicorn

        from molt.net import listening_socket
        from molt.serve import announce_ready, freeze_heap, raise_fd_limit, uvicorn_config
        from services.trainer.app import build_app

        port = self.s.metrics.port if self.s.metrics.port is not None else self.s.server.port
        app = build_app(self.s, self.status, self.metrics)
        raise_fd_limit()
        sock = listening_socket("trainer", self.s.server.host, port)
        # The trainer's main thread handles SIGTERM (finish the step, save): the server only stops with it.
        config = uvicorn_config(app, self.s.server.model_copy(update={"log_level": "warning"}))
        server = self.server = uvicorn.Server(config)
        self._serving = self.io.spawn(server.serve(sockets=[sock]))
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("trainer HTTP server did not start")
            time.sleep(0.01)
        freeze_heap()
        announce_ready("trainer", *sock.getsockname()[:2])
        return sock.getsockname()[1]

    def _bus_outage(self, down: bool) -> None:
        """Not ready while the stream is unreachable (the controller retries meanwhile)."""
        if down:
            snap = self.status.snapshot()
            self._before_outage = {"ready": snap["ready"], "phase": snap["phase"]}
            self.status.update(ready=False, phase="waiting_for_stream")
        else:
            self.status.update(**getattr(self, "_before_outage", {"ready": True, "phase": "collecting"}))

    def request_stop(self, *_) -> None:
        if self._controller is not None:
            self._controller.stop_requested = True

    def run(self) -> dict:
        client_state = checkpoint.load(self.s.ckpt.path, self.learner) if self.s.ckpt.load_enable else None
        if client_state is not None:
            self.last_saved_step = self.learner.global_step
            best = checkpoint.best_state(self.s.ckpt.path)
            self.best = best.get("best") if best else None
            # Checkpoints saved before the next evaluation record the latest one, as in a run that never stopped
            # (a resume does not evaluate again); without it retention would prune them first, as unevaluated.
            self.last_metric = checkpoint.resumed_metric(self.s.ckpt.path)
        self.first_step = self.learner.global_step
        if self.info.is_main and self.publisher is not None:
            # Pods may start after the trainer (any order in Kubernetes, or one restarting): waited for here,
            # with /readyz answering 503 meanwhile; the other ranks wait in the push's collective.
            self.status.update(phase="waiting_for_pods")
            self.publisher.connect()
        # Push before the first dispatch, resumed or not: pods may still serve a previous run's (or a lost
        # step's) weights, and rollouts of those must not reach this run. The first push is forced.
        self._publish(self.learner.global_step)
        if (
            self.info.is_main
            and self.controller.dispatcher is not None
            and (not self.s.train.rollout_replay_dir or self.s.eval.dataset)  # a replay runs no episodes but evals
        ):
            self.status.update(phase="waiting_for_env_workers")
            self.io.run(self.controller.dispatcher.wait_ready(lambda: self.controller.stop_requested))
        if self.s.eval.eval_only:
            if self.info.is_main:
                self._evaluate()
            return {"steps": self.learner.global_step, "version": self.learner.global_step, "eval_only": True}
        if self.info.is_main:
            self.io.run(self.controller.resume(client_state))
            self._maybe_evaluate(at_start=True)
            if self.s.train.dispatch and not self.s.train.rollout_replay_dir:
                self.io.call(self.controller.start_dispatch)
            self.status.update(
                ready=True, phase="collecting", step=self.learner.global_step, policy_version=self.controller.version
            )
            self.metrics["molt_trainer_policy_version"].set(self.controller.version)
        try:
            while self._one_step():
                pass
        finally:
            if self.info.is_main:
                self.status.update(phase="stopped")
        return {"steps": self.learner.global_step, "version": self._controller.version if self._controller else None}

    def close(self) -> None:
        if self.info.is_main:
            if self.server is not None:
                self.server.should_exit = True
                self._serving.result(timeout=10)
            self.io.run(self.controller.close(), timeout=30)
            if self.publisher is not None:
                self.publisher.close()
            self.steplog.close()
            self.io.stop()

    # ---- one step

    def _plan(self) -> dict:
        c = self.controller
        max_steps = self.s.train.num_steps
        if max_steps is not None and self.learner.global_step >= max_steps:
            return {"stop": True, "why": f"--train.num_steps {max_steps} reached"}
        step = self.learner.global_step + 1
        save_steps = self.s.ckpt.save_steps
        save = save_steps > 0 and step % save_steps == 0
        if self.s.train.rollout_replay_dir:
            path = Path(self.s.train.rollout_replay_dir) / f"rollout_step{step}.msgpack"
            if not path.exists():
                log.info("--train.rollout_replay_dir: no %s, the replay ends", path.name)
                return {"stop": True, "why": f"--train.rollout_replay_dir holds no {path.name}"}
            return {"stop": False, "trajs": msgspec.msgpack.decode(path.read_bytes()), "wait_s": 0.0, "save": save}
        t0 = time.perf_counter()
        trajs: list[Trajectory] = []
        while not trajs:  # a batch of only unusable trajectories is skipped (they are acked with the next commit)
            if self._batch is None:
                self._batch = self.io.spawn(c.next_batch(self.s.rollout.batch_size))
            with phase(self.metrics, "wait_batch"):
                try:
                    groups = self._batch.result(CATCH_UP_EVERY_S if self.publishing else None)
                except concurrent.futures.TimeoutError:
                    # Waiting for rollouts: a pod that restarted on base weights (and stays out of routing
                    # until it has ours) is brought to this version now, not after the next step.
                    assert self.publisher is not None  # self.publishing
                    behind = self.publisher.behind(self.learner.global_step)
                    if behind:
                        return {"stop": False, "catch_up": behind}
                    continue
            self._batch = None
            if not groups:
                why = "a stop was requested" if c.stop_requested else "no more rollouts to train"
                return {"stop": True, "why": why}
            trajs = [t for g in groups for t in g.trajectories if self._usable(t)]
        encoded = [encode(t, validate=False) for t in trajs]
        if self.s.train.rollout_dump_dir:
            dump = Path(self.s.train.rollout_dump_dir)
            dump.mkdir(parents=True, exist_ok=True)
            tmp = dump / f".rollout_step{step}.msgpack.tmp"
            tmp.write_bytes(msgspec.msgpack.encode(encoded))
            os.replace(tmp, dump / f"rollout_step{step}.msgpack")  # a replay never reads half a file
        return {"stop": False, "trajs": encoded, "wait_s": time.perf_counter() - t0, "save": save}

    def _usable(self, traj) -> bool:
        """Token ids outside the policy's vocabulary (a producer on another model), or images for a text-only
        policy, would crash every rank's forward, and one without the sampler's top-k cannot take score
        centering's correction: such a trajectory is logged, counted and acked untrained."""
        why = self._unusable(traj)
        if why is None:
            return True
        log.error("trajectory %s %s: not trained", traj.trajectory_id, why)
        self.metrics["molt_trainer_trajectories_total"].labels("invalid").inc()
        return False

    def _unusable(self, traj) -> str | None:
        vocab, model = self.vocab_size, self.s.actor.model_name_or_path
        if vocab and any(int(seg.token_ids.max()) >= vocab for seg in traj.segments):
            return f"has token ids >= the vocabulary size {vocab} of {model} (check the gateway's --model.path)"
        if traj.images and self.learner.vision is None:
            return f"shows images but {model} is a text-only model"
        if not self.s.actor.score_centering:
            return None
        acting = [seg for seg in traj.segments if seg.num_action_tokens]
        if any(seg.top_ids is None or seg.top_logprobs is None for seg in acting):
            return (
                "has no sampler top-k log-probs, which --actor.score_centering needs (start the gateway with "
                "--rollout.top_logprobs K, e.g. 8)"
            )
        if vocab and any(seg.top_ids.size and int(seg.top_ids.max()) >= vocab for seg in acting):
            # The learner gathers the policy's log-probs at these ids.
            return f"has sampler top-k ids >= the vocabulary size {vocab} of {model} (check the gateway's model)"
        return None

    def _one_step(self) -> bool:
        box = [self._plan() if self.info.is_main else None]
        if box[0] is not None and self._best_pending is not None:
            box[0]["best"], self._best_pending = self._best_pending, None
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
        assert plan is not None  # every rank holds rank 0's plan after the broadcast
        if plan.get("best"):  # the weights evaluated are still the learner's: no step has run since
            with phase(self.metrics, "checkpoint"):
                best = plan["best"]
                checkpoint.save(
                    self.s.ckpt.path,
                    self.learner,
                    {"best": best},
                    best=True,
                    metric_key=best["key"],
                    metric_value=best["value"],
                )
        if plan["stop"]:
            self._finish(plan["why"])
            return False
        if "catch_up" in plan:
            self._publish(self.learner.global_step, plan["catch_up"])
            return True
        trajs = [decode(b) for b in plan["trajs"]]
        samples = [x for t in trajs for x in samples_from_trajectory(t, self.s.data.max_len, self.learner.vision)]
        # As Molt (no_action_tokens): a segment whose actions all lie past --data.max_len trains nothing, and its
        # reward must not weigh in its group's baseline; a rollout left with no segment drops out of the group.
        samples, idle = with_actions(samples)
        if idle and self.info.is_main:
            log.warning(
                "%d segment(s) have no action token within --data.max_len %d: dropped before the advantages",
                idle,
                self.s.data.max_len,
            )
        version = self.learner.global_step  # policy version of the weights being trained
        t0 = time.perf_counter()
        if self.info.is_main:
            self.status.update(phase="training")
        with phase(self.metrics, "train"):
            stats = self.learner.train_step(samples)
        train_s = time.perf_counter() - t0
        if self.info.is_main:
            self._record(trajs, samples, stats, version, train_s, idle)
        if plan["save"]:
            self._save()
        elif self.s.ckpt.save_steps <= 0 and self.info.is_main:
            self.io.run(self.controller.commit())
        self._publish(self.learner.global_step)
        if self.info.is_main:  # after the push: the pods serve the weights of the step being evaluated
            self._maybe_evaluate()
        return True

    def _record(self, trajs, samples, stats, version, train_s, idle: int = 0) -> None:
        staleness: collections.Counter[int] = collections.Counter()
        for x in samples:
            values, counts = (version - x.versions[x.action_mask]).unique(return_counts=True)
            staleness.update(dict(zip(values.tolist(), counts.tolist())))
        tokens = sum(x.num_actions for x in samples)
        record_step(
            self.metrics,
            self.learner.global_step,
            version,
            stats,
            tokens=tokens,
            seconds=train_s,
            rewards=[t.reward for t in trajs],
            staleness=staleness,
        )
        self.metrics["molt_trainer_trajectories_total"].labels("trained").inc(len(trajs))
        self.io.run(self.controller.refresh_lag())
        st = self.status
        self.status.update(step=self.learner.global_step, trained_trajectories=st.trained_trajectories + len(trajs))
        reward = sum(t.reward for t in trajs) / len(trajs)
        log.info(
            "step %d: %d trajectories, reward %.4f, policy_loss %.4f, grad_norm %.4f, mismatch_kl %s, %.2fs",
            self.learner.global_step,
            len(trajs),
            reward,
            stats.get("policy_loss", 0.0),
            stats.get("actor_grad_norm", 0.0),
            {k: round(v, 5) for k, v in stats["mismatch_kl"].items()},
            train_s,
        )
        now = time.monotonic()
        period, self._last_step_end = now - self._last_step_end, now
        n_stale = sum(staleness.values())
        line = {
            "step": self.learner.global_step,
            "policy_version": self.learner.global_step,
            "version": version,
            "reward_mean": reward,
            "samples": len(trajs),
            "tokens": tokens,
            "seconds": period,
            "train_seconds": train_s,
            "timing/step_total": period,  # Molt's names for the same two durations
            "timing/policy_train": train_s,
            "mismatch_kl": stats["vllm_kl_all_pods"],
            "mismatch_kl_by_pod": stats["mismatch_kl"],
            "staleness_mean": sum(k * v for k, v in staleness.items()) / n_stale if n_stale else 0.0,
            "staleness_max": max(staleness) if staleness else 0,
            "pid": os.getpid(),
            **{k: v for k, v in stats.items() if isinstance(v, float)},
            "grad_norm": stats.get("actor_grad_norm", 0.0),
        }
        # Molt's rollout metrics of dynamic filtering (pass rate, pre-filter scores, drops by reason), with the
        # segments left without an action token as Molt's per-response reason, filtering on or off.
        line.update(filtering_metrics(self.controller.take_verdicts(), no_action_tokens=idle))
        line.update(rollout_stats(trajs))
        line.update({k: v for k, v in info_means(trajs).items() if k not in line})
        line["trajectory_ids"] = [t.trajectory_id for t in trajs]
        self.steplog.log(self.learner.global_step, line)

    def _save(self) -> None:
        state = [self.io.run(self.controller.durable_state(self.learner.global_step)) if self.info.is_main else None]
        dist.broadcast_object_list(state, src=0)
        client_state = state[0]
        assert client_state is not None  # every rank holds rank 0's state after the broadcast
        with phase(self.metrics, "checkpoint"):
            key, value = self.last_metric
            saved = checkpoint.save(
                self.s.ckpt.path,
                self.learner,
                client_state,
                self.s.ckpt.resumable_max(),
                max_mem=self.s.ckpt.max_mem,
                metric_key=key,
                metric_value=value,
            )
            if self.s.ckpt.save_hf:
                hf_root = os.path.join(self.s.ckpt.path, "_hf")
                save_hf(self.learner.actor, self.learner.hf_source, os.path.join(hf_root, saved.name))
                if self.info.is_main:
                    checkpoint.prune(Path(hf_root), self.s.ckpt.max_num, keep=saved.name)
        self.last_saved_step = self.learner.global_step
        if self.info.is_main:
            hold = os.environ.get(HOLD_ENV)
            if hold and int(hold) == self.learner.global_step:
                log.warning("holding before ack of step %d (%s)", self.learner.global_step, HOLD_ENV)
                while True:
                    time.sleep(1)
            with phase(self.metrics, "commit"):
                self.io.run(self.controller.commit())

    def _publish(self, new_version: int, only: list[str] | None = None) -> None:
        """Collective: push the weights as ``new_version`` to every pod (``only``: to these, forced)."""
        if self.publishing:
            if self.info.is_main:
                self.status.update(phase="publishing")
            with phase(self.metrics, "publish"):
                tensors = full_state_dict(self.learner.actor)
                check = self._probe_check() if self.s.train.check_weight_update_equal else None
                if self.info.is_main:
                    assert self.publisher is not None  # self.publishing
                    # Forced pushes (the first, a catch-up) carry every weight: a pod may hold another run's.
                    full = bool(only) or not self._pushed_full
                    tensors = self.learner.weights_to_publish(tensors, full=full)
                    frozen = set(self.learner.frozen_names)
                    tensors = {k: v for k, v in tensors.items() if k not in frozen}
                    if only:
                        self.publisher.publish_to(only, new_version, tensors, check=check)
                    else:
                        self.publisher.publish(new_version, tensors, check=check)
                self._pushed_full = True
        if self.info.is_main:
            self.io.call(self.controller.set_version, new_version)
            self.metrics["molt_trainer_policy_version"].set(new_version)
            self.status.update(policy_version=new_version, phase="collecting")

    def _maybe_evaluate(self, at_start: bool = False) -> None:
        """Rank 0, between steps (the other ranks wait at the next step's broadcast)."""
        ev = self.evaluator
        step = self.learner.global_step
        if ev is None:
            return
        # At start only --eval.eval_at_start of a fresh run, as in Molt: a resumed step was evaluated by the run that
        # trained it, and a second, noisy evaluation of the same weights would log that step twice and rewrite its
        # checkpoint's retention metric and the best checkpoint.
        due = step == 0 and self.s.eval.eval_at_start if at_start else ev.due(step)
        if due:
            self._evaluate()

    def _evaluate(self) -> None:
        assert self.evaluator is not None  # built on rank 0 whenever --eval.dataset is set
        step = self.learner.global_step
        with phase(self.metrics, "eval"):
            metrics = self.io.run(self.evaluator.run(step, lambda: self.controller.stop_requested))
        if metrics is None:
            log.warning("eval at step %d cut short by a stop request: not recorded", step)
            return
        log.info("eval at step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
        self.steplog.log_eval(step, metrics)
        key = self._metric_key(metrics)
        self.last_metric = (key, metrics.get(key) if key else None)
        if key and step > 0 and self.last_saved_step == step:
            # The checkpoint of this step (saved before the push this evaluation needed) holds the weights just
            # evaluated: its retention metric is this one, as in Molt where the evaluation precedes the save.
            checkpoint.record_metric(self.s.ckpt.path, f"global_step{step}", *self.last_metric)
        if step > 0 and not self.s.eval.eval_only:
            self._note_best(step, metrics)

    def _metric_key(self, metrics: dict[str, float]) -> str | None:
        """--ckpt.best_metric_key as resolved for these metrics: empty = the best's key, else the first
        eval_*_pass1 metric; None for 'none' or when there is no such metric."""
        key = self.s.ckpt.best_metric_key
        if key == "none":
            return None
        if not key:
            key = self.best["key"] if self.best else next((k for k in sorted(metrics) if k.endswith("_pass1")), "")
        return key or None

    def _note_best(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0: an evaluation that beats the best so far on --ckpt.best_metric_key is saved at the next plan
        (Molt's best checkpoint; empty key: the first eval_*_pass1 metric)."""
        key = self._metric_key(metrics)
        if key is None or key not in metrics:
            return
        if self.best is None or metrics[key] > self.best["value"]:
            self.best = {"key": key, "value": metrics[key], "step": step}
            self._best_pending = self.best
            log.info("best %s so far: %.4f at step %d", key, metrics[key], step)

    def _probe_check(self):
        """``--train.check_weight_update_equal``: the probe's prompt logprobs under the weights being pushed (a
        collective forward); each pod recomputes them after loading and refuses the sync past the threshold.
        fp32 CPU engines match transformers to ~1e-6, bf16 GPU engines to ~3e-2."""
        from molt._proto import weightsync_pb2 as pb
        from molt.weightsync.check import DEFAULT_PROBE, prompt_logprobs

        vocab = self.learner.actor.get_input_embeddings().weight.shape[0]  # type: ignore[operator]  # nn.Module.__getattr__ types the HF model's methods as Tensor | Module
        ids = [t % vocab for t in DEFAULT_PROBE]
        expected = prompt_logprobs(self.learner.actor, ids)
        return pb.ProbeCheck(
            token_ids=ids, expected_logprobs=expected, max_abs_diff=5e-2 if self.info.on_gpu else 1e-3
        )

    def _finish(self, why: str) -> None:
        if self.s.ckpt.save_steps > 0 and self.last_saved_step != self.learner.global_step:
            self._save()
        elif self.info.is_main and self.controller.uncommitted:
            if self.s.ckpt.save_steps <= 0:
                self.io.run(self.controller.commit())
        if not self.s.ckpt.disable_final_save:
            # Molt's final save: the policy as an HF model directory (transformers and pods load it), also after a
            # run that trained no step, so a completed run's output folder always holds a loadable model.
            final = self.s.ckpt.final_dir()
            if self.info.is_main:
                note_final_export(final, self.learner.global_step, self.first_step, self.learner.hf_source, why)
            save_hf(self.learner.actor, self.learner.hf_source, final)
        if self.info.is_main:
            log.info("stopping at step %d (version %d)", self.learner.global_step, self.controller.version)
