"""Pod side of a weight sync, transport-agnostic (gRPC and the in-memory client are adapters).

A sync is staged in full before the engine sees a byte: Begin checks the manifest against the
engine's ``expected_parameters()`` and allocates one staging buffer for the whole stream; chunks
(gRPC) or broadcast buckets (collective) fill it in order while a checksum per bucket is checked;
Commit then hands zero-copy views of the staging buffer to ``engine.apply_weights`` (atomic:
pause, load, repack, version bump, resume). Any failure before that drops the staging buffer and
leaves the engine untouched on its old weights and version; the reason is kept for Status.

With a probe check in Commit the pod compares its prompt logprobs after the load with the
trainer's; above the threshold it re-applies its copy of the previous sync's weights and version
(the staging buffer of the last sync is kept for this) and reports ``promoted = False``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from molt.metrics import Metrics
from molt.weightsync import collective as coll
from molt.weightsync.layout import Hasher, Layout, validate_layout, view_tensors
from molt.weightsync.manifest import ManifestError, verify_manifest

log = logging.getLogger("molt.weightsync")

POD_METRICS = (
    "molt_weightsync_bytes_total",
    "molt_weightsync_phase_seconds",
    "molt_weightsync_failures_total",
    "molt_weightsync_version",
)


class SyncError(Exception):
    """A refused or failed sync. ``code`` maps to a gRPC status at the edge; ``reason`` labels metrics."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # invalid_argument | failed_precondition | data_loss | aborted | unavailable | internal
        self.reason = reason


@dataclass
class _Pending:
    sync_id: str
    version: int
    layout: Layout
    keep: list[str]
    transport: str
    checksum: str
    staging: torch.Tensor | None
    started: float = field(default_factory=time.perf_counter)
    pos: int = 0  # stream bytes received in order
    buckets_done: int = 0
    digests: list[int] = field(default_factory=list)
    hasher: Hasher | None = None  # over the current bucket's chunks so far (gRPC)
    receiver: asyncio.Future | None = None  # collective receive
    staged_s: float | None = None
    force: bool = False  # Begin's force: may roll back, or replace the weights behind the current version


@dataclass
class _Applied:
    version: int
    tensors: dict[str, torch.Tensor]  # views of staging
    keep: list[str]
    staging: torch.Tensor


class WeightSyncCore:
    """One per rollout pod; ``engine`` has the RolloutEngine members (policy_version, expected_parameters,
    serving_dtype, apply_weights, prompt_logprobs)."""

    def __init__(
        self, engine, metrics: Metrics | None = None, keep_rollback_copy: bool = True, reuse_staging: bool = True
    ) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics(POD_METRICS)
        self.keep_rollback_copy = keep_rollback_copy
        # Reusing the staging buffer of a finished sync saves the page faults of a fresh one at the
        # price of keeping it resident between syncs.
        self.reuse_staging = reuse_staging
        self._spare: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._applying = False
        self._previous: _Applied | None = None
        self._last_error = ""
        self._last_error_version = -1
        self._ok = 0
        self._failed = 0
        self._collective: coll.Collective | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="weightsync-collective")
        self.metrics["molt_weightsync_version"].labels(side="pod").set(engine.policy_version)

    # ---- failures

    def _fail(self, pending: _Pending | None, err: SyncError) -> SyncError:
        """Record a failed sync (dropping its staging buffer) and return the error to raise."""
        if pending is not None and self._pending is pending:
            self._pending = None
            if pending.transport == "grpc":  # (a collective receiver thread may still write into its buffer)
                self._recycle(pending.staging)  # only once: the next Begin may take it right away
        self._failed += 1
        self._last_error = f"{err.code.upper()}: {err}"  # the code too: a trainer whose stream broke reads it
        self._last_error_version = pending.version if pending else -1
        self.metrics["molt_weightsync_failures_total"].labels(side="pod", reason=err.reason).inc()
        log.warning("weight sync %s failed (%s): %s", pending.sync_id if pending else "-", err.reason, err)
        return err

    def _recycle(self, staging: torch.Tensor | None) -> None:
        if self.reuse_staging and staging is not None:
            self._spare = staging

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == nbytes and spare.device == device:
            return spare
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    # ---- Begin

    async def begin(
        self,
        sync_id: str,
        version: int,
        layout: Layout,
        keep: list[str],
        transport: str = "grpc",
        checksum: str = "xxh3_64",
        force: bool = False,
    ) -> dict:
        if self._applying:
            raise self._fail(None, SyncError("unavailable", "busy", "a sync is being applied; retry after it"))
        if self._pending is not None:
            old = self._pending
            self._fail(old, SyncError("aborted", "superseded", f"sync {old.sync_id} superseded by {sync_id}"))
        pending = _Pending(sync_id, version, layout, list(keep), transport, checksum, None, force=force)
        try:
            if transport not in ("grpc", "collective"):
                raise SyncError("invalid_argument", "manifest", f"unknown transport {transport!r}")
            if checksum == "none" and not (
                transport == "collective" and self._collective and self._collective.backend == "nccl"
            ):
                raise SyncError("invalid_argument", "manifest", "checksum 'none' is only allowed on NCCL")
            pending.hasher = Hasher(checksum)  # raises ValueError on an unknown algorithm
            current = self.engine.policy_version
            if not force and version <= current:
                raise SyncError(
                    "failed_precondition",
                    "version",
                    f"version {version} is not newer than the pod's version {current}; "
                    "pass force (services.trainer.push --version N) to roll back on purpose",
                )
            validate_layout(layout)
            verify_manifest(layout.entries, keep, self.engine.expected_parameters())
            if transport == "collective" and self._collective is None:
                raise SyncError("failed_precondition", "collective", "no process group: call InitCollective first")
        except (ValueError, ManifestError) as exc:
            err = SyncError("invalid_argument", "manifest", str(exc))
            self._start_receiver(pending, accept=False)
            raise self._fail(pending, err) from None
        except SyncError as err:
            self._start_receiver(pending, accept=False)
            raise self._fail(pending, err) from None
        if transport == "collective":
            assert self._collective is not None  # checked above
            device = self._collective.device
        else:
            device = torch.device("cpu")
        pending.staging = self._staging(layout.total_bytes, device)
        self._pending = pending
        self._start_receiver(pending, accept=True)
        return {"current_version": self.engine.policy_version, "has_rollback_copy": self._previous is not None}

    # ---- data over a stream (gRPC Push)

    async def push(self, chunks: AsyncIterator[tuple[str, int, int, int, memoryview]]) -> tuple[int, int]:
        """Consume one Push stream of (sync_id, bucket, offset, checksum, data); returns (buckets, bytes)."""
        pending, received = None, 0
        try:
            async for sync_id, bucket, offset, digest, data in chunks:
                if pending is None:
                    pending = self._pending
                    if pending is None or pending.sync_id != sync_id or pending.transport != "grpc":
                        raise SyncError(
                            "failed_precondition", "protocol", f"no pending gRPC sync {sync_id!r}: call Begin first"
                        )
                elif self._pending is not pending:
                    raise SyncError("aborted", "superseded", f"sync {sync_id} was aborted or superseded")
                self._stage_chunk(pending, sync_id, bucket, offset, digest, data)
                received += len(data)
            if pending is None:
                raise SyncError("failed_precondition", "protocol", "empty Push stream")
            if pending.pos != pending.layout.total_bytes:
                raise SyncError(
                    "aborted",
                    "interrupted",
                    f"Push interrupted: the stream ended after {pending.buckets_done} of "
                    f"{pending.layout.num_buckets} buckets",
                )
        except SyncError as err:
            raise self._fail(pending, err) from None
        except BaseException as exc:  # the stream broke (client gone, cancelled): never apply half a sync
            self._fail(
                pending,
                SyncError(
                    "aborted", "interrupted", f"Push stream interrupted after {received} bytes: {type(exc).__name__}"
                ),
            )
            raise
        pending.staged_s = time.perf_counter() - pending.started
        self.metrics["molt_weightsync_bytes_total"].labels(side="pod", transport="grpc").inc(received)
        return pending.buckets_done, received

    def _stage_chunk(self, p: _Pending, sync_id: str, bucket: int, offset: int, digest: int, data) -> None:
        lay = p.layout
        if sync_id != p.sync_id:
            raise SyncError("failed_precondition", "protocol", f"chunk of sync {sync_id!r} inside sync {p.sync_id!r}")
        if bucket * lay.bucket_bytes + offset != p.pos or bucket >= lay.num_buckets:
            raise SyncError(
                "invalid_argument",
                "protocol",
                f"chunk at bucket {bucket} offset {offset} out of order (expected stream byte {p.pos})",
            )
        end = offset + len(data)
        size = lay.bucket_size(bucket)
        if end > size:
            raise SyncError("invalid_argument", "protocol", f"chunk overruns bucket {bucket} ({end} > {size} bytes)")
        # Hash each chunk as it is staged, while its bytes are still in the CPU cache: hashing each finished
        # 256 MiB bucket again from memory in a worker thread reads every byte twice from RAM, for no gain
        # in throughput.
        assert p.hasher is not None and p.staging is not None  # both set when Begin accepted the sync
        p.hasher.update(data)
        p.staging.numpy().data[p.pos : p.pos + len(data)] = data
        p.pos += len(data)
        if end == size:
            got, p.hasher = p.hasher.digest(), Hasher(p.checksum)
            if got != digest and p.checksum != "none":
                raise SyncError(
                    "data_loss",
                    "checksum",
                    f"bucket {bucket} checksum mismatch ({p.checksum}: sent "
                    f"{digest:#x}, received bytes hash to {got:#x})",
                )
            p.digests.append(got)
            p.buckets_done += 1

    # ---- data over the collective

    def _start_receiver(self, p: _Pending, accept: bool) -> None:
        if p.transport != "collective" or self._collective is None:
            return
        group = self._collective
        loop = asyncio.get_running_loop()
        p.receiver = loop.run_in_executor(self._executor, self._receive, group, p if accept else None)

    def _receive(self, group: coll.Collective, p: _Pending | None) -> str:
        """Blocking: the control broadcast, then every bucket into the staging buffer (thread)."""
        go, num_buckets, total = group.control()
        if not go:
            return "trainer aborted the sync"
        if p is None:  # we refused but the trainer went ahead: stay in step with the group, drop the data
            scratch = torch.empty(min(total, 64 << 20) or 1, dtype=torch.uint8, device=group.device)
            raise RuntimeError(
                f"trainer broadcast a sync this pod refused ({num_buckets} buckets); group is "
                f"now out of step ({scratch.numel()}): set it up again"
            )
        lay = p.layout
        assert p.staging is not None  # set when Begin accepted the sync
        if num_buckets != lay.num_buckets or total != lay.total_bytes:
            raise RuntimeError(
                f"broadcast announces {num_buckets} buckets / {total} bytes, "
                f"Begin said {lay.num_buckets} / {lay.total_bytes}"
            )
        for b in range(lay.num_buckets):
            start = b * lay.bucket_bytes
            view = p.staging[start : start + lay.bucket_size(b)]
            group.broadcast(view)
            if p.checksum != "none":
                h = Hasher(p.checksum)
                h.update(view.numpy().data)
                p.digests.append(h.digest())
            p.buckets_done += 1
        p.pos = lay.total_bytes
        return ""

    async def _await_receiver(self, p: _Pending, timeout_s: float) -> None:
        assert p.receiver is not None and self._collective is not None  # a collective sync started its receiver
        backend = self._collective.backend
        try:
            aborted = await asyncio.wait_for(asyncio.shield(p.receiver), timeout_s)
        except TimeoutError:
            raise SyncError("aborted", "interrupted", f"collective receive not done after {timeout_s:.0f} s") from None
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL error or timeout: the group is unusable now
            self._collective = None
            raise SyncError(
                "aborted", "collective", f"collective receive failed: {exc}; call InitCollective again"
            ) from None
        if aborted:
            raise SyncError("aborted", "interrupted", aborted)
        p.staged_s = time.perf_counter() - p.started
        self.metrics["molt_weightsync_bytes_total"].labels(side="pod", transport=backend).inc(p.layout.total_bytes)

    # ---- Commit / Abort

    async def commit(
        self,
        sync_id: str,
        version: int,
        checksums: list[int] | None = None,
        check: dict | None = None,
        receive_timeout_s: float = 600.0,
    ) -> dict:
        p = self._pending
        if p is None or p.sync_id != sync_id:
            raise self._fail(
                None,
                SyncError(
                    "failed_precondition",
                    "protocol",
                    f"no pending sync {sync_id!r} to commit (aborted, failed or never "
                    f"begun; last error: {self._last_error or 'none'})",
                ),
            )
        try:
            if version != p.version:
                raise SyncError(
                    "invalid_argument", "protocol", f"Commit version {version} != Begin version {p.version}"
                )
            if p.transport == "collective":
                await self._await_receiver(p, receive_timeout_s)
                if p.checksum != "none" and list(checksums or []) != p.digests:
                    bad = [i for i, (a, b) in enumerate(zip(checksums or [], p.digests)) if a != b]
                    raise SyncError(
                        "data_loss",
                        "checksum",
                        f"collective buckets {bad or 'all'} fail their checksums "
                        f"({len(checksums or [])} sent for {len(p.digests)} buckets)",
                    )
            if p.pos != p.layout.total_bytes:
                raise SyncError(
                    "failed_precondition",
                    "interrupted",
                    f"only {p.buckets_done} of {p.layout.num_buckets} buckets staged",
                )
        except SyncError as err:
            raise self._fail(p, err) from None
        self.metrics["molt_weightsync_phase_seconds"].labels(side="pod", phase="transfer").observe(p.staged_s or 0)
        staging = p.staging
        assert staging is not None  # every bucket was staged (checked above)
        tensors = view_tensors(p.layout, staging)
        previous_version = self.engine.policy_version
        self._pending, self._applying = None, True
        try:
            t0 = time.perf_counter()
            try:
                result = await self.engine.apply_weights(tensors, version, set(p.keep), replace=p.force)
            except Exception as exc:  # the engine's apply is atomic: it stays on the old weights
                raise self._fail(p, SyncError("internal", "apply", f"apply_weights failed: {exc}")) from exc
            load_s = time.perf_counter() - t0
            self.metrics["molt_weightsync_phase_seconds"].labels(side="pod", phase="load").observe(load_s)
            untouched = sorted(set((result or {}).get("untouched", [])) - set(p.keep))
            diff, promoted, detail = -1.0, True, ""
            if check and check.get("token_ids"):
                diff = await self._check(check)
                if diff > check["max_abs_diff"]:
                    promoted = False
                    detail = await self._roll_back(p, version, previous_version, diff, check["max_abs_diff"])
            if promoted:
                self._ok += 1
                if self.keep_rollback_copy:
                    if self._previous is not None:
                        self._recycle(self._previous.staging)
                    self._previous = _Applied(version, tensors, p.keep, staging)
                else:
                    self._recycle(staging)
                self.metrics["molt_weightsync_version"].labels(side="pod").set(version)
            return {
                "version": self.engine.policy_version,
                "promoted": promoted,
                "untouched": untouched,
                "check_max_abs_diff": diff,
                "stage_seconds": p.staged_s or 0.0,
                "load_seconds": load_s,
                "detail": detail,
            }
        finally:
            self._applying = False

    async def _check(self, check: dict) -> float:
        t0 = time.perf_counter()
        got = await self.engine.prompt_logprobs(list(check["token_ids"]))
        want = list(check["expected_logprobs"])
        self.metrics["molt_weightsync_phase_seconds"].labels(side="pod", phase="check").observe(
            time.perf_counter() - t0
        )
        if len(got) != len(want):
            return float("inf")
        # A NaN diff compares below any threshold: a pod (or trainer) producing NaN must fail the check.
        diffs = [abs(a - b) for a, b in zip(got, want)]
        return max((d if math.isfinite(d) else float("inf") for d in diffs), default=0.0)

    async def _roll_back(self, p: _Pending, version: int, previous_version: int, diff: float, limit: float) -> str:
        msg = f"weight check failed for version {version}: max |pod - trainer| logprob diff {diff:.3g} > {limit:.3g}"
        prev = self._previous
        if prev is not None and prev.version == previous_version:
            try:
                await self.engine.apply_weights(prev.tensors, prev.version, set(prev.keep), replace=True)
                msg += f"; rolled back to version {prev.version}"
            except ValueError as exc:  # an engine whose versions only move forward
                msg += (
                    f"; the engine refused the rollback to version {prev.version} ({exc}): it serves the "
                    "unverified weights"
                )
        else:
            msg += "; no rollback copy on this pod (first sync since start): it serves the unverified weights"
        self._fail(p, SyncError("aborted", "check", msg))
        return msg

    async def abort(self, sync_id: str, reason: str) -> bool:
        p = self._pending
        if p is None or (sync_id and p.sync_id != sync_id):
            return False
        self._fail(p, SyncError("aborted", "aborted", f"aborted by the trainer: {reason or 'no reason given'}"))
        return True

    # ---- collective setup / status

    async def init_collective(
        self,
        backend: str,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int,
        group_name: str,
        timeout_s: float,
    ) -> str:
        if self._pending is not None or self._applying:
            raise SyncError("unavailable", "busy", "a sync is in progress; set up the group between syncs")
        if self._collective is not None:
            self._collective.close()
            self._collective = None
        loop = asyncio.get_running_loop()
        try:
            self._collective = await loop.run_in_executor(
                self._executor,
                lambda: coll.join(backend, master_addr, master_port, rank, world_size, group_name, timeout_s or 120.0),
            )
        except ValueError as exc:
            raise SyncError("invalid_argument", "collective", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a failed join (gloo, NCCL, the store) is reported as unavailable
            raise SyncError("unavailable", "collective", f"joining the {backend} group failed: {exc}") from None
        return self._collective.describe()

    def status(self) -> dict:
        p = self._pending
        state = (
            "applying"
            if self._applying
            else ("idle" if p is None else "staged" if p.pos == p.layout.total_bytes else "receiving")
        )
        return {
            "version": self.engine.policy_version,
            "state": state,
            "sync_id": p.sync_id if p else "",
            "pending_version": p.version if p else -1,
            "buckets_staged": p.buckets_done if p else 0,
            "num_buckets": p.layout.num_buckets if p else 0,
            "last_error": self._last_error,
            "last_error_version": self._last_error_version,
            "syncs_ok": self._ok,
            "syncs_failed": self._failed,
            "collective": self._collective.describe() if self._collective else "",
            "has_rollback_copy": self._previous is not None,
        }

    def close(self) -> None:
        self._pending = None
        self._executor.shutdown(wait=False, cancel_futures=True)
