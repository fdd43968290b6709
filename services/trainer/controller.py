"""The controller (rank 0 only): stream consumption, group assembly, dispatch and commits.

Everything here is asyncio and runs on one event-loop thread beside the training thread (torch
work and collectives stay on the main thread). The training thread calls in through
``LoopThread.run``.

Exactly-once (with ``--ckpt.save_steps N > 0``): the deliveries of trained (and filtered) groups stay
unacked in ``uncommitted`` until the checkpoint of their step is durable; the checkpoint records their
trajectory ids; only then are they acked (``TrajectoryQueue.ack`` = XACK + mark consumed, atomically).
On restart ``resume`` reads this consumer's pending entries first: ids the checkpoint already holds are
acked without training, the rest are trained again (their updates were lost with the process). Stale
entries of dead consumers are reclaimed periodically. Without checkpoints a crash loses the model
anyway, so trajectories are acked right after their step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from molt.algorithms import filter_group
from molt.bus import Delivery, TrajectoryQueue
from services.trainer.config import TrainerSettings, max_versions_ahead
from services.trainer.groups import DispatchGate, Group, GroupAssembler

log = logging.getLogger("molt.trainer")
PENDING_READ_MAX = 1_000_000
RECLAIM_EVERY_S = 30.0


class LoopThread:
    """An asyncio loop on a daemon thread; ``run`` blocks the caller until a coroutine finishes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trainer-io", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class Controller:
    def __init__(self, settings: TrainerSettings, queue: TrajectoryQueue, metrics, dataset=None,
                 dispatcher=None) -> None:
        self.s = settings
        self.queue = queue
        self.metrics = metrics
        self.consumer = settings.train.consumer
        self.assembler = GroupAssembler(settings.rollout.n_samples_per_prompt)
        steps = settings.train.num_steps
        self.gate = DispatchGate(settings.rollout.batch_size, max_versions_ahead(settings.train),
                                 steps * settings.rollout.batch_size if steps else None)
        self.dataset, self.dispatcher = dataset, dispatcher
        self.version = 0
        self.position = 0  # prompts dispatched (dataset position)
        self.uncommitted: list[Delivery] = []
        self.stop_requested = False
        self.fatal: BaseException | None = None
        self.inflight_groups = 0
        self.dropped = {"dynamic_filter": 0, "incomplete_group": 0}
        self.run_tag = uuid.uuid4().hex[:8]
        self._version_changed: asyncio.Event | None = None
        self._dispatch_task = None
        self._group_tasks: set[asyncio.Task] = set()
        self._last_reclaim = 0.0

    # ---- state carried by checkpoints

    def client_state(self, version: int | None = None) -> dict:
        """What a checkpoint carries; ``version``: the policy version of the weights being saved."""
        return {"version": self.version if version is None else version, "position": self.position,
                "refills": self.gate.refills,
                "unacked_ids": sorted({d.trajectory.trajectory_id for d in self.uncommitted})}

    async def resume(self, client_state: dict | None) -> None:
        """Restore counters, then settle this consumer's pending entries (see the module docstring)."""
        saved: set[str] = set()
        if client_state:
            self.version = client_state["version"]
            self.position = client_state["position"]
            self.gate.refills = client_state["refills"]
            saved = set(client_state["unacked_ids"])
        self.gate.dispatched = self.position
        pending = await self.queue.read_pending(self.consumer, PENDING_READ_MAX)
        done = [d for d in pending if d.trajectory.trajectory_id in saved]
        for d in pending:
            if d.trajectory.trajectory_id not in saved:
                self.assembler.add(d)
        if done:
            await self.queue.ack(done)
            self.metrics["molt_trainer_trajectories_total"].labels("already_trained").inc(len(done))
        log.info("resume: version %d, %d pending entries (%d already trained and now acked, %d to train)",
                 self.version, len(pending), len(done), len(pending) - len(done))
        await self._reclaim(force=True)

    async def _reclaim(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_reclaim < RECLAIM_EVERY_S:
            return
        self._last_reclaim = now
        taken = await self.queue.reclaim(self.consumer, self.s.train.reclaim_idle_s, 10_000)
        for d in taken:
            self.assembler.add(d)
        if taken:
            log.info("reclaimed %d stale entries from other consumers", len(taken))

    # ---- dispatch

    def start_dispatch(self) -> None:
        self._version_changed = asyncio.Event()
        self._dispatch_task = asyncio.get_running_loop().create_task(self._dispatch_loop())

    def set_version(self, version: int) -> None:
        """Called on the loop thread after each step's weights are published."""
        self.version = version
        if self._version_changed is not None:
            self._version_changed.set()

    def _total_prompts(self) -> int:
        return len(self.dataset) * self.s.train.num_episodes

    def dispatch_exhausted(self) -> bool:
        return self.dataset is None or (self.position >= self._total_prompts() and self.inflight_groups == 0)

    async def _dispatch_loop(self) -> None:
        while self.position < self._total_prompts() and not self.stop_requested:
            while not self.gate.may_dispatch(self.version) and not self.stop_requested:
                self._version_changed.clear()
                try:
                    await asyncio.wait_for(self._version_changed.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
            if self.stop_requested:
                return
            prompt = self.dataset.get(self.position)
            group_id = f"{self.run_tag}-{self.position}"
            self.assembler.dispatched(group_id)
            self.position += 1
            self.gate.dispatched = self.position
            self.inflight_groups += 1
            task = asyncio.get_running_loop().create_task(self._run_group(prompt, group_id))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_tasks.discard)

    async def _run_group(self, prompt, group_id: str) -> None:
        from services.trainer.dispatch import DispatchError

        try:
            written = await self.dispatcher.run_group(prompt, group_id)
        except DispatchError as exc:  # configuration error: stop training with the reason
            self.fatal = exc
            written = 0
        except Exception:  # supervisor: a broken group must not kill the loop; it is logged and refilled
            log.exception("group %s: dispatch failed", group_id)
            written = 0
        if written < self.s.rollout.n_samples_per_prompt:
            self.assembler.expect(group_id, written)
            if written == 0:
                self.gate.refills += 1
        self.inflight_groups -= 1

    # ---- consumption

    def _keep(self, group: Group) -> bool:
        if not self.s.algo.dynamic_filtering_enable:
            return True
        trajs = group.trajectories
        verdict = filter_group([t.trajectory_id for t in trajs],
                               [t.score if t.score is not None else t.reward for t in trajs],
                               n_samples_per_prompt=self.s.rollout.n_samples_per_prompt,
                               score_range=self.s.algo.dynamic_filtering_range)
        if not verdict.keep:
            self.dropped[verdict.reason] += 1
        return verdict.keep

    async def next_batch(self, num_groups: int) -> list[Group] | None:
        """Block until ``num_groups`` complete, kept groups are available (fewer at the end of the
        dataset); None when there is nothing more to train or a stop was requested."""
        kept: list[Group] = []
        while len(kept) < num_groups:
            for group in self.assembler.pop_complete(num_groups - len(kept)):
                if self._keep(group):
                    kept.append(group)
                else:
                    self.uncommitted.extend(group.all_deliveries())
                    self.metrics["molt_trainer_trajectories_total"].labels("filtered").inc(len(group.deliveries))
                    self.gate.refills += 1
            if len(kept) >= num_groups:
                break
            if self.fatal is not None:
                raise self.fatal
            if self.stop_requested:
                return None
            if self.s.train.dispatch and self.dispatch_exhausted() and self.assembler.num_partial == 0 \
                    and self.assembler.num_complete == 0:
                lag = await self.queue.lag()
                if lag.undelivered == 0:
                    break
            deliveries = await self.queue.read(self.consumer, 256, block_s=self.s.train.read_block_s)
            for d in deliveries:
                self.assembler.add(d)
            await self._reclaim()
        for group in kept:
            self.uncommitted.extend(group.all_deliveries())
        return kept or None

    async def commit(self) -> int:
        """Ack every uncommitted delivery (call only once their step is durable)."""
        done, self.uncommitted = self.uncommitted, []
        await self.queue.ack(done)
        await self.queue.lag()  # refreshes the molt_queue_* gauges
        return len(done)

    async def close(self) -> None:
        self.stop_requested = True
        if self._dispatch_task is not None:
            self._dispatch_task.cancel()
        # Episodes still running are abandoned (their trajectories, if written, stay on the stream for the next
        # run); cancel them before closing the HTTP client so none of them fails noisily.
        tasks = list(self._group_tasks) + ([self._dispatch_task] if self._dispatch_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await self.queue.close()
