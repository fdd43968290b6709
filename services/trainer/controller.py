"""The controller (rank 0 only): stream consumption, group assembly, dispatch and commits.

Everything here is asyncio and runs on one event-loop thread beside the training thread (torch
work and collectives stay on the main thread). The training thread calls in through
``LoopThread.run``.

Exactly-once (with ``--ckpt.save_steps N > 0``): the deliveries of trained (and filtered) groups stay
unacked in ``uncommitted`` until the checkpoint of their step is durable; the checkpoint records their
trajectory ids; only then are they acked (``TrajectoryQueue.ack`` = XACK + mark consumed, atomically).
On restart ``resume`` reads this consumer's pending entries first: ids the checkpoint already holds are
acked without training, the rest are trained again (their updates were lost with the process). Entries
another consumer left pending are reclaimed periodically; this consumer's own never are (it holds them).
Without checkpoints a crash loses the model anyway, so trajectories are acked right after their step.

Exactly-once by prompt (dispatch mode): a prompt's group id is ``<run tag>-<position>``, and the run
tag, the dispatch position and the positions dispatched but not yet trained (``open``) are saved in
the same checkpoint. A restarted trainer adopts what the stream already holds for its open positions,
re-dispatches only the samples they miss, and acks without training anything else: rollouts of groups
already trained (an episode of the dead trainer that finished late) and rollouts of another run (a
trainer started without a checkpoint starts a new run tag). Every stream call is retried with capped
backoff through an outage of the bus, with the trainer reported not ready meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from molt.algorithms import GroupVerdict, filter_group
from molt.bus import Delivery, TrajectoryQueue
from services.trainer.config import TrainerSettings, max_versions_ahead
from services.trainer.groups import DispatchGate, Group, GroupAssembler

log = logging.getLogger("molt.trainer")
PENDING_READ_MAX = 1_000_000
RECLAIM_EVERY_S = 30.0
BUS_BACKOFF_S = (0.5, 10.0)  # first wait and cap of the retries through a bus outage
GROUP_STALL_S = 60.0  # a group whose written rollouts are not on the stream this long after its dispatch


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
    def __init__(
        self,
        settings: TrainerSettings,
        queue: TrajectoryQueue,
        metrics,
        dataset=None,
        dispatcher=None,
        on_bus_outage=None,
    ) -> None:
        self.s = settings
        self.queue = queue
        self.metrics = metrics
        self.consumer = settings.train.consumer
        self.own_groups = dataset is not None  # dispatch mode: only this run's prompt groups are trained
        self.assembler = GroupAssembler(settings.rollout.n_samples_per_prompt, by_sample=self.own_groups)
        steps = settings.train.num_steps
        self.gate = DispatchGate(
            settings.rollout.batch_size,
            max_versions_ahead(settings.train),
            steps * settings.rollout.batch_size if steps else None,
        )
        self.dataset, self.dispatcher = dataset, dispatcher
        self.on_bus_outage = on_bus_outage or (lambda down: None)
        self.version = 0
        self.position = 0  # prompts dispatched (dataset position)
        self.open: set[int] = set()  # positions dispatched whose group was not trained (or dropped) yet
        self._redispatch: list[int] = []  # open positions of a checkpoint: dispatched again first
        self.uncommitted: list[Delivery] = []
        self.stop_requested = False
        self.fatal: BaseException | None = None
        self.inflight_groups = 0
        self.dropped = {"dynamic_filter": 0, "incomplete_group": 0}
        self.verdicts: list[GroupVerdict] = []  # judged since the last step's record (take_verdicts)
        self.batches = 0  # batches handed to the training loop by this process
        self.run_tag = uuid.uuid4().hex[:8]
        self._version_changed: asyncio.Event | None = None
        self._dispatch_task: asyncio.Task[None] | None = None
        self._group_tasks: set[asyncio.Task] = set()
        self._last_reclaim = 0.0
        self._resync = False  # after a bus outage: look for own pending entries a lost reply delivered
        self._settled: dict[int, float] = {}  # position -> when its dispatch ended (rollouts on their way)
        self.group_stall_s = GROUP_STALL_S

    # ---- state carried by checkpoints

    def client_state(self, version: int | None = None) -> dict:
        """What a checkpoint carries; ``version``: the policy version of the weights being saved. Call it on the
        loop thread (``durable_state``): dispatch changes ``position`` and ``open`` there."""
        return {
            "version": self.version if version is None else version,
            "position": self.position,
            "refills": self.gate.refills,
            "run_tag": self.run_tag,
            "open": sorted(self.open),
            "unacked_ids": sorted({d.trajectory.trajectory_id for d in self.uncommitted}),
        }

    async def durable_state(self, version: int) -> dict:
        return self.client_state(version)

    async def resume(self, client_state: dict | None) -> None:
        """Restore counters, then settle this consumer's pending entries (see the module docstring)."""
        saved: set[str] = set()
        if client_state:
            self.version = client_state["version"]
            self.position = client_state["position"]
            self.gate.refills = client_state["refills"]
            saved = set(client_state["unacked_ids"])
            # A checkpoint without a run tag predates exactly-once by prompt: keep the new tag (its
            # groups in flight are then acked untrained, and their prompts are not dispatched again).
            self.run_tag = client_state.get("run_tag", self.run_tag)
            self._redispatch = sorted(client_state.get("open", []))
            self.open = set(self._redispatch)
        self.gate.dispatched = self.position
        pending = await self._bus(self.queue.read_pending, self.consumer, PENDING_READ_MAX)
        done = [d for d in pending if d.trajectory.trajectory_id in saved]
        if done:
            await self._bus(self.queue.ack, done)
            self.metrics["molt_trainer_trajectories_total"].labels("already_trained").inc(len(done))
        await self._route([d for d in pending if d.trajectory.trajectory_id not in saved])
        log.info(
            "resume: version %d, %d pending entries (%d already trained and now acked, %d to train)",
            self.version,
            len(pending),
            len(done),
            len(pending) - len(done),
        )
        if self.own_groups:  # adopt what the stream holds before dispatching the samples still missing
            while batch := await self._bus(self.queue.read, self.consumer, 256, block_s=0):
                await self._route(batch)
            if self._redispatch:
                log.info(
                    "resume: run %s, %d groups in flight at the checkpoint are completed first, then "
                    "prompts from position %d",
                    self.run_tag,
                    len(self._redispatch),
                    self.position,
                )
        await self._reclaim(force=True)

    # ---- the bus, through outages

    async def _bus(self, fn, *args, **kwargs):
        """``fn(*args)`` on the queue, retried with capped backoff for as long as the bus is unreachable."""
        delay, cap = BUS_BACKOFF_S
        down_since = None
        while True:
            try:
                result = await fn(*args, **kwargs)
            except self.queue.transient_errors as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("stream unavailable (%s: %s); retrying with backoff", type(exc).__name__, exc)
                    self.on_bus_outage(True)
                self.metrics["molt_trainer_bus_retries_total"].inc()
                self._resync = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                continue
            if down_since is not None:
                log.warning("stream back after %.1f s", time.monotonic() - down_since)
                self.on_bus_outage(False)
            return result

    async def _route(self, deliveries: list[Delivery]) -> None:
        """Hand deliveries to the assembler; ack at once (untrained) the ones no group of this run wants."""
        if not deliveries:
            return
        # A repeat of a trajectory trained in a step not durable yet (a producer's retried write) passes the
        # bus's check, which knows only committed ids: it is acked with that step, never trained again.
        trained = {d.trajectory.trajectory_id for d in self.uncommitted}
        repeats = [d for d in deliveries if d.trajectory.trajectory_id in trained]
        self.uncommitted.extend(repeats)
        if repeats:
            self.metrics["molt_trainer_trajectories_total"].labels("already_trained").inc(len(repeats))
        deliveries = [d for d in deliveries if d.trajectory.trajectory_id not in trained]
        unwanted = [d for d in deliveries if not self._wanted(d.trajectory.group_id)]
        for d in deliveries:
            if self._wanted(d.trajectory.group_id):
                self.assembler.add(d)
        if unwanted:
            await self._bus(self.queue.ack, unwanted)
            self.metrics["molt_trainer_trajectories_total"].labels("not_this_run").inc(len(unwanted))
            log.info("acked %d rollouts untrained: of another run, or of a group already trained", len(unwanted))

    def group_id(self, position: int) -> str:
        return f"{self.run_tag}-{position}"

    def _position(self, group_id: str) -> int | None:
        tag, _, pos = group_id.rpartition("-")
        return int(pos) if tag == self.run_tag and pos.isdigit() else None

    def _wanted(self, group_id: str) -> bool:
        if not self.own_groups:
            return True
        p = self._position(group_id)
        return p is not None and (p in self.open or self.position <= p < self._total_prompts())

    async def _reclaim(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_reclaim < RECLAIM_EVERY_S and not self._resync:
            return
        self._last_reclaim = now
        if self._resync:  # a read whose reply was lost delivered entries nobody holds: pick them up
            self._resync = False
            known = self.assembler.entry_ids() | {d.entry_id for d in self.uncommitted}
            mine = await self._bus(self.queue.read_pending, self.consumer, PENDING_READ_MAX)
            await self._route([d for d in mine if d.entry_id not in known])
        taken = await self._bus(self.queue.reclaim, self.consumer, self.s.train.reclaim_idle_s, 10_000)
        await self._route(taken)
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
        return self.dataset is None or (
            self.position >= self._total_prompts() and self.inflight_groups == 0 and not self._redispatch
        )

    def _room_in_flight(self) -> bool:
        cap = self.s.rollout.vllm_generate_batch_size
        return cap is None or self.inflight_groups < cap

    async def _wait_until(self, ready) -> bool:
        """Wait, woken by a new policy version or a freed slot, until ``ready()``; False once a stop is requested."""
        version_changed = self._version_changed
        assert version_changed is not None  # start_dispatch created it before this task
        while not ready() and not self.stop_requested:
            version_changed.clear()
            try:
                await asyncio.wait_for(version_changed.wait(), 1.0)
            except TimeoutError:
                pass
        return not self.stop_requested

    async def _dispatch_loop(self) -> None:
        # A checkpoint's open groups were allowed by the gate when first dispatched, but they can outnumber
        # the in-flight cap (rollouts written, not trained yet): they are dispatched again under it.
        while self._redispatch:
            if not await self._wait_until(self._room_in_flight):
                return
            self._launch(self._redispatch.pop(0))
        while self.position < self._total_prompts() and not self.stop_requested:
            if not await self._wait_until(lambda: self.gate.may_dispatch(self.version) and self._room_in_flight()):
                return
            position = self.position
            self.position += 1
            self.gate.dispatched = self.position
            self._launch(position)

    def _launch(self, position: int, again: bool = False) -> None:
        group_id = self.group_id(position)
        if again:  # the samples it still misses: whatever was expected before no longer holds
            self.assembler.reopen(group_id)
        else:
            self.open.add(position)
            self.assembler.dispatched(group_id)
        held = self.assembler.held_samples(group_id)
        missing = [k for k in range(self.s.rollout.n_samples_per_prompt) if k not in held]
        if not missing:  # all its rollouts are on the stream already: nothing runs, no slot is taken
            self._settled[position] = time.monotonic()
            return
        self.inflight_groups += 1
        task = asyncio.get_running_loop().create_task(self._run_group(self.dataset.get(position), position, missing))
        self._group_tasks.add(task)
        task.add_done_callback(self._group_tasks.discard)

    async def _run_group(self, prompt, position: int, missing: list[int]) -> None:
        from services.trainer.dispatch import DispatchError

        group_id = self.group_id(position)
        n = self.s.rollout.n_samples_per_prompt
        try:
            written = await self.dispatcher.run_group(prompt, group_id, missing) if missing else []
        except DispatchError as exc:  # configuration error, or an env failing every episode: stop with the reason
            if self.fatal is None:
                log.error("stopping the run: %s", exc)
            self.fatal = exc
            written = []
        except Exception:  # supervisor: a broken group must not kill the loop; it is logged and refilled
            log.exception("group %s: dispatch failed", group_id)
            written = []
        total = n - len(missing) + len(written)
        if total > 0:
            self._settled[position] = time.monotonic()
        if total < n:
            self.assembler.expect(group_id, total)
            if total == 0:
                self.gate.refills += 1
                self.open.discard(position)
        self.inflight_groups -= 1
        if self._version_changed is not None:  # a slot under --rollout.vllm_generate_batch_size is free
            self._version_changed.set()

    async def _rescue_stalled(self) -> None:
        """Dispatch again the missing samples of a group whose rollouts were reported written but never reached
        this trainer (a Redis crash that lost its last writes, a dead-lettered record): without this the group
        would block every younger one forever. A late original is then a duplicate, acked untrained."""
        now, drained = time.monotonic(), None
        for position, since in list(self._settled.items()):
            group_id = self.group_id(position)
            if position not in self.open or group_id not in self.assembler.waiting():
                del self._settled[position]
                continue
            if now - since < self.group_stall_s:
                continue
            if drained is None:
                drained = (await self._bus(self.queue.lag)).undelivered == 0
            if not drained or not self._room_in_flight():  # its samples run under the cap too: retried later
                return
            del self._settled[position]
            # Before any batch, the likelier cause is a gateway writing elsewhere than this trainer reads.
            hint = (
                "; nothing of this run has arrived yet: check that the gateway's --redis.url and --redis.stream "
                "are this trainer's"
                if not self.batches
                else ""
            )
            log.warning(
                "group %s: rollouts reported written never reached stream %r after %.0f s; dispatching its "
                "missing samples again%s",
                group_id,
                self.s.redis.stream,
                now - since,
                hint,
            )
            self._launch(position, again=True)

    # ---- consumption

    def _keep(self, group: Group) -> bool:
        if not self.s.algo.dynamic_filtering_enable:
            return True
        trajs = group.trajectories
        verdict = filter_group(  # one entry per segment: a drop counts samples, as Molt's rollout/dropped/*
            [t.trajectory_id for t in trajs for _ in t.segments],
            [t.score if t.score is not None else t.reward for t in trajs for _ in t.segments],
            n_samples_per_prompt=self.s.rollout.n_samples_per_prompt,
            score_range=self.s.algo.dynamic_filtering_range,
        )
        self.verdicts.append(verdict)
        if not verdict.keep:
            assert verdict.reason is not None  # every dropped group carries its reason
            self.dropped[verdict.reason] += 1
        return verdict.keep

    def take_verdicts(self) -> list[GroupVerdict]:
        """The dynamic-filtering verdicts since the last call (the step's rollout metrics)."""
        out, self.verdicts = self.verdicts, []
        return out

    async def next_batch(self, num_groups: int) -> list[Group] | None:
        """Block until ``num_groups`` complete, kept groups are available (fewer at the end of the
        dataset); None when there is nothing more to train or a stop was requested."""
        kept: list[Group] = []
        while len(kept) < num_groups:
            # Checked before taking groups, not only while waiting: with a backlog on the stream the batch never
            # waits, and a stop (SIGTERM) must end the run between steps rather than when the stream runs dry.
            if self.fatal is not None:
                raise self.fatal
            if self.stop_requested:
                return None
            for group in self.assembler.pop_complete(num_groups - len(kept)):
                position = self._position(group.group_id) if self.own_groups else None
                if self._keep(group):
                    # Open until the batch is returned: a stop before that drops the group untrained, and the
                    # checkpoint the stop saves must dispatch it again (or adopt its rollouts) on resume.
                    kept.append(group)
                else:
                    self.open.discard(position)
                    self.uncommitted.extend(group.all_deliveries())
                    self.metrics["molt_trainer_trajectories_total"].labels("filtered").inc(len(group.deliveries))
                    self.gate.refills += 1
            if len(kept) >= num_groups:
                break
            self._refill_lost(num_groups)
            if (
                self.s.train.dispatch
                and self.dispatch_exhausted()
                and self.assembler.num_partial == 0
                and self.assembler.num_complete == 0
            ):
                lag = await self._bus(self.queue.lag)
                if lag.undelivered == 0:
                    if not kept and not self.batches:
                        self._check_failures()
                    break
            await self._route(await self._bus(self.queue.read, self.consumer, 256, block_s=self.s.train.read_block_s))
            await self._reclaim()
            await self._rescue_stalled()
        for group in kept:
            self.open.discard(self._position(group.group_id) if self.own_groups else None)
            self.uncommitted.extend(group.all_deliveries())
        self.batches += bool(kept)
        return kept or None

    def _refill_lost(self, num_groups: int) -> None:
        """Liveness: a batch must be able to fill from the groups still open (taken into it included) and those the
        gate lets dispatch before the next step. Fewer means groups were lost (dispatched, never trained, no longer
        open: a checkpoint that missed them), and the run would wait forever at the gate; new prompts take their
        place instead, said loudly, since those prompts go untrained this epoch."""
        if not (self.own_groups and self.s.train.dispatch) or self.position >= self._total_prompts():
            return
        may = min(self.gate.allowed(self.version) - self.gate.dispatched, self._total_prompts() - self.position)
        lost = num_groups - len(self.open) - max(may, 0)
        if lost <= 0:
            return
        log.error(
            "%d prompt group(s) of run %s were lost (dispatched before position %d, never trained, not in the "
            "checkpoint's open groups): dispatching as many new prompts so the run goes on",
            lost,
            self.run_tag,
            self.position,
        )
        self.gate.refills += lost
        if self._version_changed is not None:
            self._version_changed.set()

    def _check_failures(self) -> None:
        """At the end of the dataset with nothing trained by this run: if episodes failed, that is why, and the
        run must not end as if it succeeded (fewer failures than --envs.max_consecutive_failures, a small
        dataset)."""
        last = self.dispatcher.last_failure if self.dispatcher is not None else None
        if last is not None:
            from services.trainer.dispatch import DispatchError

            exc = DispatchError(
                f"the dataset ran out with no step trained: {self.dispatcher.failed} episodes failed for good (after "
                f"--envs.max_retries {self.s.envs.max_retries} retries each) and too few were written to fill a "
                f"group; the last, {last} (fix the env, its traceback is in the env worker's log)"
            )
            log.error("stopping the run: %s", exc)
            raise exc
        if any(self.dropped.values()):
            # Otherwise the run ends as "done" with 0 steps, no step log and the base model as its final model, and
            # nothing says why (a small model on a hard task fails every sample, so every group is uniform).
            low, high = self.s.algo.dynamic_filtering_range
            log.warning(
                "the dataset ran out with no step trained: --algo.dynamic_filtering_enable dropped every group "
                "(%d with a mean score outside the open interval (%g, %g) of --algo.dynamic_filtering_range, %d "
                "incomplete); widen the range, use an easier dataset or turn filtering off",
                self.dropped["dynamic_filter"],
                low,
                high,
                self.dropped["incomplete_group"],
            )

    async def commit(self) -> int:
        """Ack every uncommitted delivery (call only once their step is durable)."""
        done = self.uncommitted
        await self._bus(self.queue.ack, done)  # idempotent: a retry after a lost reply acks nothing twice
        self.uncommitted = []
        await self.refresh_lag()
        return len(done)

    async def refresh_lag(self) -> None:
        """Refresh the molt_queue_* gauges (skipped while the bus is down: they are only gauges)."""
        try:
            await self.queue.lag()
        except self.queue.transient_errors:
            pass

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
