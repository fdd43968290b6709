"""gRPC adapter of the pod-side core: ``start_weightsync_server(engine, host, port)``.

Handlers are registered by hand (not through the generated servicer) so that Push can read its
Chunks without a protobuf copy of the payload; the method names and messages are those of
proto/weightsync.proto. This is the one place that maps SyncError to gRPC status codes. With a
token every RPC must carry it (``molt.weightsync.auth``): a call without it is refused UNAUTHENTICATED
before any handler runs.
"""

from __future__ import annotations

import logging

import grpc

from molt._proto import weightsync_pb2 as pb
from molt.metrics import Metrics
from molt.net import host_port
from molt.weightsync.auth import BearerInterceptor, check_exposure
from molt.weightsync.core import SyncError, WeightSyncCore
from molt.weightsync.wire import SERVICE, decode_chunk, grpc_options, identity, keep_malloc_hot, layout_from_begin

log = logging.getLogger("molt.weightsync")

_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "data_loss": grpc.StatusCode.DATA_LOSS,
    "aborted": grpc.StatusCode.ABORTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
TRANSPORTS = {pb.TRANSPORT_UNSPECIFIED: "grpc", pb.GRPC: "grpc", pb.COLLECTIVE: "collective"}


def check_from_commit(req: pb.CommitRequest) -> dict | None:
    if not (req.HasField("check") and req.check.token_ids):
        return None
    return {
        "token_ids": list(req.check.token_ids),
        "expected_logprobs": list(req.check.expected_logprobs),
        "max_abs_diff": req.check.max_abs_diff,
    }


def status_message(core: WeightSyncCore, include_parameters: bool = False) -> pb.StatusResponse:
    out = pb.StatusResponse(**core.status())
    if include_parameters:
        out.serving_dtype = core.engine.serving_dtype
        for name, (shape, dtype) in sorted(core.engine.expected_parameters().items()):
            out.parameters.add(name=name, dtype=str(dtype).removeprefix("torch."), shape=list(shape))
    return out


class WeightSyncServicer:
    def __init__(self, core: WeightSyncCore) -> None:
        self.core = core

    async def _guard(self, context, coro):
        try:
            return await coro
        except SyncError as err:
            await context.abort(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), f"[{err.reason}] {err}")

    async def Begin(self, req: pb.BeginRequest, context) -> pb.BeginResponse:
        out = await self._guard(
            context,
            self.core.begin(
                req.sync_id,
                req.version,
                layout_from_begin(req),
                list(req.keep),
                TRANSPORTS.get(req.transport, "?"),
                req.checksum or "xxh3_64",
                req.force,
            ),
        )
        return pb.BeginResponse(**out)

    async def Push(self, request_iterator, context) -> pb.PushResponse:
        async def chunks():
            async for raw in request_iterator:
                try:
                    yield decode_chunk(raw)
                except ValueError as exc:
                    raise SyncError("invalid_argument", "protocol", f"malformed Chunk: {exc}") from None

        buckets, nbytes = await self._guard(context, self.core.push(chunks()))
        return pb.PushResponse(buckets=buckets, bytes=nbytes)

    async def Commit(self, req: pb.CommitRequest, context) -> pb.CommitResponse:
        out = await self._guard(
            context, self.core.commit(req.sync_id, req.version, list(req.checksums), check_from_commit(req))
        )
        return pb.CommitResponse(**out)

    async def Abort(self, req: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self.core.abort(req.sync_id, req.reason))

    async def Status(self, req: pb.StatusRequest, context) -> pb.StatusResponse:
        return status_message(self.core, req.include_parameters)

    async def InitCollective(self, req: pb.InitCollectiveRequest, context) -> pb.InitCollectiveResponse:
        desc = await self._guard(
            context,
            self.core.init_collective(
                req.backend, req.master_addr, req.master_port, req.world_size, req.rank, req.group_name, req.timeout_s
            ),
        )
        return pb.InitCollectiveResponse(collective=desc)


def _handler(servicer: WeightSyncServicer) -> grpc.GenericRpcHandler:
    def unary(fn, req_cls):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req_cls.FromString, response_serializer=lambda m: m.SerializeToString()
        )

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Begin": unary(servicer.Begin, pb.BeginRequest),
            "Push": grpc.stream_unary_rpc_method_handler(
                servicer.Push, request_deserializer=identity, response_serializer=lambda m: m.SerializeToString()
            ),
            "Commit": unary(servicer.Commit, pb.CommitRequest),
            "Abort": unary(servicer.Abort, pb.AbortRequest),
            "Status": unary(servicer.Status, pb.StatusRequest),
            "InitCollective": unary(servicer.InitCollective, pb.InitCollectiveRequest),
        },
    )


async def start_weightsync_server(
    engine,
    host: str,
    port: int,
    *,
    metrics: Metrics | None = None,
    keep_rollback_copy: bool = True,
    reuse_staging: bool = True,
    max_message_bytes: int = 64 << 20,
    token: str | None = None,
    allow_unauthenticated: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the WeightSync gRPC server for ``engine`` on the running event loop.

    Returns (server, bound port); port 0 lets the kernel pick. ``metrics`` is the rollout app's
    Metrics holding the ``molt_weightsync_*`` names (a private registry otherwise).
    ``keep_rollback_copy`` keeps the last sync's weights for a refused check (1x the weights in RAM);
    ``reuse_staging`` keeps a finished sync's staging buffer for the next one (another 1x, saves
    the page faults of a fresh buffer). ``token``: the bearer token every RPC must carry; without one
    the server binds only a loopback ``host`` unless ``allow_unauthenticated`` (ValueError otherwise).
    ``credentials``: TLS or mutual TLS (``auth.server_credentials``); plaintext without.
    Stop with ``await server.stop(grace)``.
    """
    check_exposure(token, host, allow_unauthenticated)
    keep_malloc_hot()
    core = WeightSyncCore(engine, metrics=metrics, keep_rollback_copy=keep_rollback_copy, reuse_staging=reuse_staging)
    interceptors = [BearerInterceptor(token)] if token is not None else []
    # gRPC's default SO_REUSEPORT would let a second pod on this machine bind the same port and share its
    # connections (a trainer's pushes split between two pods); off, the second bind fails instead.
    options = [*grpc_options(max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers([_handler(WeightSyncServicer(core))])
    address = host_port(host, port)
    try:  # grpc.aio raises RuntimeError where the sync API returns 0
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"weight-sync gRPC server could not bind {address} (in use, or not a local address)")
    await server.start()
    server.weightsync_core = core  # for the rollout app's /readyz and tests
    log.info("weight-sync gRPC server on %s", host_port(host, bound))
    return server, bound
