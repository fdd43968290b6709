"""Trainer-side view of one pod: a small interface with a gRPC and an in-memory implementation.

``GrpcPodClient`` talks to a pod's WeightSync server; ``LocalPodClient`` drives a
``WeightSyncCore`` in the same event loop (unit tests, and a trainer colocated with its pod).
Both speak the protobuf messages of proto/weightsync.proto; Push takes pre-encoded Chunks. The gRPC
client sends the weight-sync token (``MOLT_WEIGHTS_TOKEN`` unless given) with every call.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import NoReturn

import grpc

from molt._proto import weightsync_pb2 as pb
from molt.weightsync.auth import channel_credentials_from_env, token_from_env
from molt.weightsync.core import SyncError, WeightSyncCore
from molt.weightsync.server import TRANSPORTS, check_from_commit, status_message
from molt.weightsync.wire import SERVICE, decode_chunk, grpc_options, identity, layout_from_begin


class PodError(RuntimeError):
    """A pod refused or failed an RPC; ``code`` is the gRPC status name (e.g. DATA_LOSS)."""

    def __init__(self, target: str, code: str, message: str) -> None:
        super().__init__(f"{target}: {code}: {message}")
        self.target, self.code, self.detail = target, code, message


class PushStream(ABC):
    @abstractmethod
    async def write(self, chunk: bytes) -> None: ...

    @abstractmethod
    async def done(self) -> pb.PushResponse: ...

    @abstractmethod
    def cancel(self) -> None: ...


class PodClient(ABC):
    target: str

    @abstractmethod
    async def begin(self, req: pb.BeginRequest) -> pb.BeginResponse: ...

    @abstractmethod
    def open_push(self) -> PushStream: ...

    @abstractmethod
    async def commit(self, req: pb.CommitRequest) -> pb.CommitResponse: ...

    @abstractmethod
    async def abort(self, req: pb.AbortRequest) -> pb.AbortResponse: ...

    @abstractmethod
    async def status(self, include_parameters: bool = False) -> pb.StatusResponse: ...

    @abstractmethod
    async def init_collective(self, req: pb.InitCollectiveRequest) -> pb.InitCollectiveResponse: ...

    async def close(self) -> None:
        return None


# ---- gRPC


class _GrpcPush(PushStream):
    def __init__(self, client: GrpcPodClient) -> None:
        self.client = client
        self.call = client._push(timeout=client.timeout_s, metadata=client.metadata)

    async def write(self, chunk: bytes) -> None:
        try:
            await self.call.write(chunk)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            await self._raise(exc)

    async def done(self) -> pb.PushResponse:
        try:
            await self.call.done_writing()
            return await self.call
        except grpc.aio.AioRpcError as exc:
            await self._raise(exc)

    async def _raise(self, exc) -> NoReturn:
        # A write fails once the server has ended the call; its status says why.
        try:
            await self.call
        except grpc.aio.AioRpcError as final:
            exc = final
        except asyncio.CancelledError:
            raise PodError(self.client.target, "CANCELLED", "push cancelled") from None
        code, detail = (
            (exc.code().name, exc.details() or "") if isinstance(exc, grpc.aio.AioRpcError) else ("UNKNOWN", str(exc))
        )
        if code in ("INTERNAL", "UNAVAILABLE", "UNKNOWN"):
            # The pod may have refused the sync (e.g. DATA_LOSS on a bad checksum) while this side was still
            # writing; gRPC then sometimes reports only a transport error. The pod recorded its reason.
            code, detail = await self._pod_reason(code, detail)
        raise PodError(self.client.target, code, detail) from None

    async def _pod_reason(self, code: str, detail: str) -> tuple[str, str]:
        try:
            status = await self.client.status()
        except PodError:
            return code, detail
        if status.last_error and status.last_error_version == self.client.begun_version:
            pod_code, _, pod_detail = status.last_error.partition(": ")
            return pod_code, f"{pod_detail} (the stream ended with {code}: {detail})"
        return code, detail

    def cancel(self) -> None:
        self.call.cancel()


class GrpcPodClient(PodClient):
    """``token``: the pods' weight-sync token; None reads ``MOLT_WEIGHTS_TOKEN`` ("" sends none).
    ``credentials``: TLS to the pods; None reads ``MOLT_WEIGHTS_TLS_*`` (plaintext when unset)."""

    def __init__(
        self,
        target: str,
        timeout_s: float = 600.0,
        max_message_bytes: int = 64 << 20,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        token = token_from_env() if token is None else token
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.begun_version: int | None = None  # version of the last Begin, to match the pod's last error
        credentials = credentials or channel_credentials_from_env()
        options = grpc_options(max_message_bytes)
        self.channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(target, options=options)
        )

        def unary(name, resp_cls):
            return self.channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=resp_cls.FromString,
            )

        self._begin = unary("Begin", pb.BeginResponse)
        self._commit = unary("Commit", pb.CommitResponse)
        self._abort = unary("Abort", pb.AbortResponse)
        self._status = unary("Status", pb.StatusResponse)
        self._init = unary("InitCollective", pb.InitCollectiveResponse)
        self._push = self.channel.stream_unary(
            f"/{SERVICE}/Push", request_serializer=identity, response_deserializer=pb.PushResponse.FromString
        )

    async def _call(self, fn, req, timeout_s: float | None = None):
        try:
            return await fn(req, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise PodError(self.target, exc.code().name, exc.details() or "") from None

    async def begin(self, req):
        self.begun_version = req.version
        return await self._call(self._begin, req, 60.0)

    def open_push(self) -> PushStream:
        return _GrpcPush(self)

    async def commit(self, req):
        return await self._call(self._commit, req)

    async def abort(self, req):
        return await self._call(self._abort, req, 30.0)

    async def status(self, include_parameters: bool = False):
        return await self._call(self._status, pb.StatusRequest(include_parameters=include_parameters), 30.0)

    async def init_collective(self, req):
        return await self._call(self._init, req, req.timeout_s + 30.0)

    async def close(self) -> None:
        await self.channel.close()


# ---- in memory


_CODES = {
    "invalid_argument": "INVALID_ARGUMENT",
    "failed_precondition": "FAILED_PRECONDITION",
    "data_loss": "DATA_LOSS",
    "aborted": "ABORTED",
    "unavailable": "UNAVAILABLE",
    "internal": "INTERNAL",
}


class _LocalPush(PushStream):
    def __init__(self, client: LocalPodClient) -> None:
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=4)
        self.task = asyncio.ensure_future(client.core.push(self._chunks()))

    async def _chunks(self):
        while (raw := await self.queue.get()) is not None:
            yield decode_chunk(raw)

    async def write(self, chunk: bytes) -> None:
        put = asyncio.ensure_future(self.queue.put(chunk))
        await asyncio.wait({put, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
        if self.task.done():
            await self.done()

    async def done(self) -> pb.PushResponse:
        if not self.task.done():
            await self.queue.put(None)
        try:
            buckets, nbytes = await self.task
        except SyncError as err:
            raise PodError(self.client.target, _CODES[err.code], f"[{err.reason}] {err}") from None
        return pb.PushResponse(buckets=buckets, bytes=nbytes)

    def cancel(self) -> None:
        self.task.cancel()


class LocalPodClient(PodClient):
    def __init__(self, core: WeightSyncCore, target: str = "local") -> None:
        self.core, self.target = core, target

    async def _guard(self, coro):
        try:
            return await coro
        except SyncError as err:
            raise PodError(self.target, _CODES[err.code], f"[{err.reason}] {err}") from None

    async def begin(self, req):
        out = await self._guard(
            self.core.begin(
                req.sync_id,
                req.version,
                layout_from_begin(req),
                list(req.keep),
                TRANSPORTS.get(req.transport, "?"),
                req.checksum or "xxh3_64",
                req.force,
            )
        )
        return pb.BeginResponse(**out)

    def open_push(self) -> PushStream:
        return _LocalPush(self)

    async def commit(self, req):
        out = await self._guard(
            self.core.commit(req.sync_id, req.version, list(req.checksums), check_from_commit(req))
        )
        return pb.CommitResponse(**out)

    async def abort(self, req):
        return pb.AbortResponse(aborted=await self.core.abort(req.sync_id, req.reason))

    async def status(self, include_parameters: bool = False):
        return status_message(self.core, include_parameters)

    async def init_collective(self, req):
        desc = await self._guard(
            self.core.init_collective(
                req.backend, req.master_addr, req.master_port, req.world_size, req.rank, req.group_name, req.timeout_s
            )
        )
        return pb.InitCollectiveResponse(collective=desc)
