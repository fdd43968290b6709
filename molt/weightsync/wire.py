"""Protobuf glue: manifest <-> messages, and the Chunk codec of the Push stream.

Chunks are encoded and decoded by hand so the (MiB-sized) payload is copied once into the
message and read back as a memoryview, instead of passing through protobuf's bytes fields twice
(measured 2x slower). The bytes on the wire are a standard ``Chunk`` message: any protobuf
client can send them and ``Chunk.FromString`` reads what we send.
"""

from __future__ import annotations

import ctypes
import logging

from molt._proto import weightsync_pb2 as pb
from molt.weightsync.layout import Layout, TensorEntry

log = logging.getLogger("molt.weightsync")

SERVICE = "molt.weightsync.v1.WeightSync"
_DATA_TAG = bytes([(5 << 3) | 2])  # field 5 (data), wire type LEN


def grpc_options(max_message_bytes: int = 64 << 20) -> list[tuple[str, int]]:
    """Channel/server args for the data path: big messages allowed, large TCP reads (1.5-2x faster)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
        ("grpc.experimental.tcp_max_read_chunk_size", 8 << 20),
        ("grpc.http2.max_frame_size", 4 << 20),
    ]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_malloc_tuned: bool | None = None


def keep_malloc_hot(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Stop glibc from returning gRPC's MiB-sized receive buffers to the kernel between messages.

    Every received TCP chunk and message (1-4 MiB) is a fresh allocation, partly in gRPC's own
    threads' arenas. With glibc's default (dynamic) thresholds much of that memory is trimmed or
    unmapped as soon as it is freed, so the next buffer is page-faulted in again: measured 130-270
    faults per MB received on the pod, and 0.9 instead of 0.6 CPU s/GB (bench/weightsync.py).
    Serving buffers below ``mmap_threshold`` from the heap and keeping up to ``trim_threshold``
    of free heap mapped removes that. Process-wide and idempotent (the pod calls it when its
    server starts); returns False off glibc, where nothing changes.
    """
    global _malloc_tuned
    if _malloc_tuned is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _malloc_tuned = False
        else:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
                mallopt(_M_TRIM_THRESHOLD, trim_threshold)
            )
            log.debug("glibc malloc kept hot for weight-sync buffers: %s", _malloc_tuned)
    return _malloc_tuned


def layout_to_begin(layout: Layout, **fields) -> pb.BeginRequest:
    tensors = [
        pb.TensorEntry(
            name=e.name, dtype=e.dtype, shape=list(e.shape), bucket=e.bucket, offset=e.offset, nbytes=e.nbytes
        )
        for e in layout.entries
    ]
    return pb.BeginRequest(
        tensors=tensors,
        bucket_bytes=layout.bucket_bytes,
        num_buckets=layout.num_buckets,
        total_bytes=layout.total_bytes,
        **fields,
    )


def layout_from_begin(req: pb.BeginRequest) -> Layout:
    entries = tuple(TensorEntry(t.name, t.dtype, tuple(t.shape), t.bucket, t.offset, t.nbytes) for t in req.tensors)
    return Layout(entries, req.bucket_bytes, req.total_bytes)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_chunk(sync_id: str, bucket: int, offset: int, checksum: int, pieces: list) -> bytes:
    """A serialized Chunk whose data is the concatenation of ``pieces`` (bytes-like), one copy."""
    head = pb.Chunk(sync_id=sync_id, bucket=bucket, offset=offset, checksum=checksum).SerializeToString()
    size = sum(len(p) for p in pieces)
    return b"".join([head, _DATA_TAG, _varint(size), *pieces])


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint in Chunk")


def decode_chunk(raw: bytes) -> tuple[str, int, int, int, memoryview]:
    """(sync_id, bucket, offset, checksum, data) of a serialized Chunk; data is a view of ``raw``."""
    buf = memoryview(raw)
    pos, n = 0, len(buf)
    sync_id, bucket, offset, checksum, data = "", 0, 0, 0, buf[0:0]
    while pos < n:
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 2:
                bucket = value
            elif field == 3:
                offset = value
            elif field == 4:
                checksum = value
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > n:
                raise ValueError("truncated Chunk")
            view = buf[pos : pos + size]
            pos += size
            if field == 1:
                sync_id = bytes(view).decode()
            elif field == 5:
                data = view
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire} in Chunk")
    return sync_id, bucket, offset, checksum, data


def identity(b: bytes) -> bytes:
    return b
