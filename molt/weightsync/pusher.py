"""Trainer side: ``WeightPusher`` sends one state dict to every pod, concurrently, per sync.

Phases (timed, exported as ``molt_weightsync_phase_seconds{side="trainer"}``):
- gather: iterate the state dict (FSDP2 DTensors are ``full_tensor()``-ed here, or pass the output
  of ``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``), map
  names, drop frozen ones, lay the tensors out in buckets;
- transfer: Begin on every pod, then the stream: each Chunk is encoded once and written to every
  pod's Push stream (gRPC), or each bucket is broadcast once over the process group (collective);
- load: Commit on every pod (verify, apply atomically, optional probe check).

A pod that fails is reported and left on its old weights; the others still commit. ``push``
raises ``WeightPushError`` (with the full report) if any pod failed or refused the check.
``push`` blocks (it runs on the pusher's own event-loop thread, so it is safe from sync code and
from inside another loop); ``push_async`` is the coroutine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from molt._proto import weightsync_pb2 as pb
from molt.metrics import Metrics
from molt.net import free_port
from molt.weightsync import collective as coll
from molt.weightsync.client import GrpcPodClient, PodClient, PodError
from molt.weightsync.layout import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    WIRE_DTYPES,
    Hasher,
    Layout,
    iter_buckets,
    iter_chunks,
    plan_layout,
    torch_dtype,
)
from molt.weightsync.manifest import select_tensors
from molt.weightsync.wire import encode_chunk, layout_to_begin

log = logging.getLogger("molt.weightsync")

TRAINER_METRICS = (
    "molt_weightsync_bytes_total",
    "molt_weightsync_phase_seconds",
    "molt_weightsync_failures_total",
    "molt_weightsync_version",
    "molt_weightsync_check_max_abs_diff",
    "molt_weightsync_check_failures_total",
)
TRANSPORTS = ("grpc", "gloo", "nccl")


@dataclass
class PushReport:
    version: int
    transport: str
    bytes: int = 0
    tensors: int = 0
    kept: list[str] = field(default_factory=list)
    gather_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    pods: dict[str, dict] = field(default_factory=dict)  # target -> Commit result
    failed: dict[str, str] = field(default_factory=dict)  # target -> why

    @property
    def total_s(self) -> float:
        return self.gather_s + self.transfer_s + self.load_s


class WeightPushError(RuntimeError):
    def __init__(self, report: PushReport) -> None:
        lines = "; ".join(f"{t}: {why}" for t, why in report.failed.items())
        super().__init__(
            f"weight sync of version {report.version} failed on {len(report.failed)} of "
            f"{len(report.failed) + len(report.pods)} pod(s): {lines}"
        )
        self.report = report


def make_chunks(
    layout: Layout,
    tensors: dict[str, torch.Tensor],
    sync_id: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: str = DEFAULT_CHECKSUM,
) -> Iterator[bytes]:
    """Encoded Chunks of one sync, in order; the chunk completing a bucket carries its checksum."""
    hasher = Hasher(checksum)
    for bucket, offset, pieces, completes in iter_chunks(layout, tensors, chunk_bytes):
        for piece in pieces:
            hasher.update(piece)
        digest = 0
        if completes:
            digest, hasher = hasher.digest(), Hasher(checksum)
        yield encode_chunk(sync_id, bucket, offset, digest, pieces)


class WeightPusher:
    """Pushes state dicts to rollout pods ("host:port" targets or PodClients).

    ``frozen``: names not sent (the pods keep theirs). ``tie_word_embeddings``: None asks a pod
    whether it loads ``lm_head.weight``. ``to_hf``: maps the state dict to HF checkpoint names and
    layout first (``manifest.hf_adapter(model)`` for transformers models with fused MoE experts).
    ``transport``: grpc, or gloo/nccl broadcast over a group set up at the first push. ``token``: the
    pods' weight-sync token (None: ``MOLT_WEIGHTS_TOKEN``). ``keep_unsent``: a push may be partial; every
    parameter the pods load that it does not carry is kept (LoRA: only the adapted weights change).
    """

    def __init__(
        self,
        pods: Iterable[str | PodClient],
        *,
        frozen: Iterable[str] = (),
        tie_word_embeddings: bool | None = None,
        transport: str = "grpc",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksum: str = DEFAULT_CHECKSUM,
        timeout_s: float = 600.0,
        collective_host: str = "127.0.0.1",
        to_hf: Callable[[dict], dict] | None = None,
        metrics: Metrics | None = None,
        token: str | None = None,
        keep_unsent: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not 0 < chunk_bytes <= 32 << 20:
            raise ValueError(f"chunk_bytes must be in (0, 32 MiB] (gRPC message limit 64 MiB), got {chunk_bytes}")
        self._targets = list(pods)
        if not self._targets:
            raise ValueError("WeightPusher needs at least one pod (host:port)")
        self.frozen = sorted(set(frozen))
        self.tie_word_embeddings = tie_word_embeddings
        self.transport = transport
        self.bucket_bytes, self.chunk_bytes = bucket_bytes, chunk_bytes
        self.checksum = "none" if transport == "nccl" else checksum
        self.timeout_s = timeout_s
        self.collective_host = collective_host
        self.to_hf = to_hf
        self.token = token
        self.keep_unsent = keep_unsent
        self.metrics = metrics or Metrics(TRAINER_METRICS)
        self._clients: list[PodClient] | None = None
        self._group: coll.Collective | None = None
        self._expected_names: set[str] | None = None
        self._serving: torch.dtype | None = None
        self._asked_every_pod = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- event loop plumbing

    def _run(self, coro):
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="weightsync-pusher", daemon=True)
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def push(self, state, version: int, *, force: bool = False, check: pb.ProbeCheck | None = None) -> PushReport:
        """Blocking: sync ``state`` (a state dict or (name, tensor) pairs) to every pod as ``version``."""
        return self._run(self.push_async(state, version, force=force, check=check))

    def status(self) -> dict[str, pb.StatusResponse | BaseException]:
        """Each pod's status, or the error that reaching it raised."""
        return self._run(self.status_async())

    def close(self) -> None:
        if self._loop is None:
            return
        self._run(self._close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None  # started with the loop
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = None

    async def _close_clients(self) -> None:
        for c in self._clients or []:
            await c.close()
        self._clients = None
        if self._group is not None:
            self._group.close()
            self._group = None

    def _pods(self) -> list[PodClient]:
        if self._clients is None:
            self._clients = [
                t if isinstance(t, PodClient) else GrpcPodClient(t, timeout_s=self.timeout_s, token=self.token)
                for t in self._targets
            ]
        return self._clients

    async def status_async(self) -> dict[str, pb.StatusResponse | BaseException]:
        pods = self._pods()
        out = await asyncio.gather(*(p.status() for p in pods), return_exceptions=True)
        return {p.target: r for p, r in zip(pods, out)}

    # ---- one sync

    async def _ask_pods(self) -> None:
        """Once every pod has answered: what its engine loads (a tied lm_head is not listed) and the dtype it
        serves in. Floating tensors travel in that dtype only if every pod reported the same one, so a pod never
        receives fewer bits than it keeps; until then they travel as held (the engine casts)."""
        if self._asked_every_pod:
            return
        pods = self._pods()
        answers = await asyncio.gather(*(p.status(include_parameters=True) for p in pods), return_exceptions=True)
        ok = [a for a in answers if not isinstance(a, BaseException)]
        if ok and self._expected_names is None:
            self._expected_names = {p.name for p in ok[0].parameters}
        if len(ok) == len(pods):
            self._asked_every_pod = True
            served = {a.serving_dtype for a in ok}
            one = served.pop() if len(served) == 1 else ""
            self._serving = torch_dtype(one) if one in WIRE_DTYPES else None

    async def _tied(self, items_names: set[str]) -> bool:
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        if "lm_head.weight" not in items_names:
            return False
        if self._expected_names is None:  # no pod answered _ask_pods: the first one's error says why
            status = await self._pods()[0].status(include_parameters=True)
            self._expected_names = {p.name for p in status.parameters}
        return "lm_head.weight" not in self._expected_names

    async def _unsent(self, sent: set[str]) -> set[str]:
        """With ``keep_unsent``: the pods' parameters this push does not carry (their own listing, so a tied head
        or a fused layout is named as they name it); else nothing."""
        if not self.keep_unsent:
            return set()
        if self._expected_names is None:  # no pod answered _ask_pods: the first one's error says why
            status = await self._pods()[0].status(include_parameters=True)
            self._expected_names = {p.name for p in status.parameters}
        return self._expected_names - sent

    async def push_async(
        self, state, version: int, *, force: bool = False, check: pb.ProbeCheck | None = None
    ) -> PushReport:
        t0 = time.perf_counter()
        items = list(state.items() if isinstance(state, Mapping) else state)
        if self.to_hf is not None:
            items = list(self.to_hf(dict(items)).items())
        await self._ask_pods()
        tied = await self._tied({n for n, _ in items})
        send, keep = select_tensors(items, tied, self.frozen)
        sent = {n for n, _ in send}
        keep = sorted(set(keep) | set(self.frozen) - sent | (await self._unsent(sent)))
        layout = plan_layout(send, self.bucket_bytes, self._serving)
        tensors = dict(send)
        del items, send
        report = PushReport(version, self.transport, layout.total_bytes, len(tensors), keep)
        report.gather_s = time.perf_counter() - t0
        pods = self._pods()
        if self.transport != "grpc" and self._group is None:
            await self._init_collective(pods)
        sync_id = uuid.uuid4().hex
        begin = layout_to_begin(
            layout,
            sync_id=sync_id,
            version=version,
            keep=keep,
            checksum=self.checksum,
            transport=pb.GRPC if self.transport == "grpc" else pb.COLLECTIVE,
            force=force,
        )
        t1 = time.perf_counter()
        results = await asyncio.gather(*(p.begin(begin) for p in pods), return_exceptions=True)
        live = self._drop_failed(pods, results, report, "begin")
        if self.transport == "grpc":
            live = await self._stream(live, layout, tensors, sync_id, report)
            checksums: list[int] = []
        else:
            try:
                checksums = await asyncio.get_running_loop().run_in_executor(
                    None, self._broadcast, layout, tensors, bool(live) and len(live) == len(pods)
                )
            except Exception:  # gloo/NCCL error or timeout: the group is unusable; the next push sets up a new one
                if self._group is not None:
                    self._group.close()
                self._group = None
                await asyncio.gather(
                    *(p.abort(pb.AbortRequest(sync_id=sync_id, reason="broadcast failed")) for p in live),
                    return_exceptions=True,
                )
                raise
            if len(live) != len(pods):  # the group moves in lock step: one refusal stops the sync for all
                for p in live:
                    report.failed[p.target] = "sync abandoned: another pod refused Begin"
                await asyncio.gather(
                    *(p.abort(pb.AbortRequest(sync_id=sync_id, reason="another pod refused")) for p in live),
                    return_exceptions=True,
                )
                live = []
        report.transfer_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        commit = pb.CommitRequest(sync_id=sync_id, version=version, checksums=checksums, check=check)
        results = await asyncio.gather(*(p.commit(commit) for p in live), return_exceptions=True)
        for p, r in zip(live, self._drop_failed_keep(live, results, report, "commit")):
            if r is None:
                continue
            report.pods[p.target] = {
                "version": r.version,
                "promoted": r.promoted,
                "untouched": list(r.untouched),
                "check_max_abs_diff": r.check_max_abs_diff,
                "stage_seconds": r.stage_seconds,
                "load_seconds": r.load_seconds,
            }
            if check is not None and check.token_ids:
                self.metrics["molt_weightsync_check_max_abs_diff"].labels(rollout_url=p.target).set(
                    r.check_max_abs_diff
                )
            if not r.promoted:
                self.metrics["molt_weightsync_check_failures_total"].labels(rollout_url=p.target).inc()
                report.failed[p.target] = r.detail or "weight check refused the sync"
                del report.pods[p.target]
            elif r.untouched:
                log.warning(
                    "%s: %d engine parameter(s) not touched by the sync: %s",
                    p.target,
                    len(r.untouched),
                    ", ".join(list(r.untouched)[:10]),
                )
        report.load_s = time.perf_counter() - t2
        self._record(report)
        if report.failed:
            raise WeightPushError(report)
        return report

    def _drop_failed(self, pods, results, report: PushReport, phase: str) -> list[PodClient]:
        return [p for p, r in zip(pods, self._drop_failed_keep(pods, results, report, phase)) if r is not None]

    def _drop_failed_keep(self, pods, results, report: PushReport, phase: str) -> list:
        out: list = []
        for p, r in zip(pods, results):
            if isinstance(r, BaseException):
                if not isinstance(r, (PodError, OSError, asyncio.TimeoutError)):
                    raise r
                report.failed[p.target] = f"{phase}: {r}"
                reason = getattr(r, "code", type(r).__name__).lower()
                self.metrics["molt_weightsync_failures_total"].labels(side="trainer", reason=reason).inc()
                out.append(None)
            else:
                out.append(r)
        return out

    async def _stream(
        self, live: list[PodClient], layout: Layout, tensors, sync_id: str, report: PushReport
    ) -> list[PodClient]:
        if not live:
            return []
        streams = {p.target: p.open_push() for p in live}
        alive = dict(streams)
        try:
            await self._write_all(layout, tensors, sync_id, alive, report)
        except BaseException:  # a trainer-side error: end every stream so the pods drop the partial sync
            for s in streams.values():
                s.cancel()
            raise
        for target in streams:
            if target not in alive:
                self.metrics["molt_weightsync_failures_total"].labels(side="trainer", reason="push").inc()
        return [p for p in live if p.target in alive]

    async def _write_all(self, layout: Layout, tensors, sync_id: str, alive: dict, report: PushReport) -> None:
        """Each chunk is encoded once and written to every live stream; a failing pod drops out."""

        async def write(target, stream, chunk):
            try:
                await stream.write(chunk)
            except PodError as exc:
                report.failed[target] = f"push: {exc}"
                alive.pop(target, None)

        for chunk in make_chunks(layout, tensors, sync_id, self.chunk_bytes, self.checksum):
            if not alive:
                break
            await asyncio.gather(*(write(t, s, chunk) for t, s in list(alive.items())))
        results = await asyncio.gather(*(s.done() for s in alive.values()), return_exceptions=True)
        for target, r in zip(list(alive), results):
            if isinstance(r, BaseException):
                if not isinstance(r, PodError):
                    raise r
                report.failed[target] = f"push: {r}"
                alive.pop(target)

    # ---- collective

    async def _init_collective(self, pods: list[PodClient]) -> None:
        backend, world = self.transport, len(pods) + 1
        host, timeout_s = self.collective_host, min(self.timeout_s, 300.0)
        store = None
        if backend == "gloo":
            store, port = coll.host_store(host, world, timeout_s)
        else:
            port = free_port(host)
        name = uuid.uuid4().hex[:12]
        loop = asyncio.get_running_loop()
        mine = loop.run_in_executor(
            None, lambda: coll.join(backend, host, port, 0, world, name, timeout_s, store=store)
        )
        reqs = [
            pb.InitCollectiveRequest(
                backend=backend,
                master_addr=host,
                master_port=port,
                world_size=world,
                rank=i + 1,
                group_name=name,
                timeout_s=timeout_s,
            )
            for i in range(len(pods))
        ]
        results = await asyncio.gather(
            mine, *(p.init_collective(r) for p, r in zip(pods, reqs)), return_exceptions=True
        )
        errors = [
            f"{t}: {r}"
            for t, r in zip(["trainer"] + [p.target for p in pods], results)
            if isinstance(r, BaseException)
        ]
        if errors:
            raise RuntimeError(f"setting up the {backend} weight-sync group failed: {'; '.join(errors)}")
        assert isinstance(results[0], coll.Collective)  # this side's set-up (no error above)
        self._group = results[0]
        log.info("weight-sync %s group up: %d pods", backend, len(pods))

    def _broadcast(self, layout: Layout, tensors, go: bool) -> list[int]:
        """Thread: the control broadcast, then every bucket; returns the bucket checksums."""
        group = self._group
        assert group is not None  # set up before the collective sync began
        group.control(go, layout.num_buckets, layout.total_bytes)
        if not go:
            return []
        digests = []
        device_buf = None
        for _, buf in iter_buckets(layout, tensors):
            if self.checksum != "none":
                h = Hasher(self.checksum)
                h.update(buf.numpy().data)
                digests.append(h.digest())
            if group.device.type != "cpu":
                if device_buf is None:
                    device_buf = torch.empty(layout.bucket_bytes, dtype=torch.uint8, device=group.device)
                staged = device_buf[: buf.numel()]
                staged.copy_(buf)
                buf = staged
            group.broadcast(buf)
        return digests

    def _record(self, report: PushReport) -> None:
        m = self.metrics
        transport = report.transport
        for phase, s in (("gather", report.gather_s), ("transfer", report.transfer_s), ("load", report.load_s)):
            m["molt_weightsync_phase_seconds"].labels(side="trainer", phase=phase).observe(s)
        if report.pods:
            sent = report.bytes * (len(report.pods) if transport == "grpc" else 1)
            m["molt_weightsync_bytes_total"].labels(side="trainer", transport=transport).inc(sent)
        if not report.failed:
            m["molt_weightsync_version"].labels(side="trainer").set(report.version)
        log.info(
            "weight sync v%d (%s): %.1f MB to %d pod(s), gather %.3f s, transfer %.3f s, load %.3f s%s",
            report.version,
            transport,
            report.bytes / 1e6,
            len(report.pods),
            report.gather_s,
            report.transfer_s,
            report.load_s,
            f", FAILED on {sorted(report.failed)}" if report.failed else "",
        )
