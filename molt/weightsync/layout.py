"""Byte layout of one sync: tensors back to back in a virtual stream, cut into fixed-size buckets.

Every tensor starts at a 64-byte aligned offset of the stream (so the receiver can view its bytes
as any dtype without copying) and may span bucket boundaries; bucket ``b`` is stream bytes
``[b * bucket_bytes, (b + 1) * bucket_bytes)``, the last one shorter. A bucket is the unit of the
checksum, of a collective broadcast and of staging; on gRPC it travels as chunks of a few MiB.

Tensors travel as raw bytes + dtype name + shape: never lists, never pickles. A floating tensor may travel
narrower than it is held (``wire_dtype``): cast one tensor at a time as the stream reaches it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 2 << 20

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


WIRE_DTYPES = frozenset(_DTYPES)
"""The dtype names a tensor may travel in."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16, 'torch.bfloat16' or 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} on the weight-sync wire; supported: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[dtype_name(name)]


def is_floating(name: str) -> bool:
    return torch_dtype(name).is_floating_point


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the sync stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # inside `bucket`
    nbytes: int

    def start(self, bucket_bytes: int) -> int:
        """Offset in the whole stream."""
        return self.bucket * bucket_bytes + self.offset


@dataclass(frozen=True)
class Layout:
    entries: tuple[TensorEntry, ...]
    bucket_bytes: int
    total_bytes: int

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes) if self.total_bytes else 0

    def bucket_size(self, bucket: int) -> int:
        return min(self.bucket_bytes, self.total_bytes - bucket * self.bucket_bytes)


def wire_dtype(held: torch.dtype, serving: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor held in ``held`` travels in to pods that all serve in ``serving`` (None: unknown or
    not one dtype): ``serving`` where both are floating and it is narrower, else ``held``. The engine would
    cast on load with the same rounding, so only the bytes change."""
    if serving is None or not (held.is_floating_point and serving.is_floating_point):
        return held
    return serving if serving.itemsize < held.itemsize else held


def plan_layout(
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    serving: torch.dtype | None = None,
) -> Layout:
    """Assign every tensor an aligned place in the stream, in its ``wire_dtype``. Names must be unique."""
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    entries, seen, pos = [], set(), 0
    for name, t in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the state dict")
        seen.add(name)
        pos = -(-pos // ALIGN) * ALIGN
        dtype = wire_dtype(t.dtype, serving)
        nbytes = t.numel() * dtype.itemsize
        entries.append(
            TensorEntry(name, dtype_name(dtype), tuple(t.shape), pos // bucket_bytes, pos % bucket_bytes, nbytes)
        )
        pos += nbytes
    return Layout(tuple(entries), bucket_bytes, pos)


def validate_layout(layout: Layout) -> None:
    """Raise ValueError if entries overlap, leave the stream or are misaligned (a malformed Begin)."""
    if layout.bucket_bytes < ALIGN or layout.bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {layout.bucket_bytes}")
    end = 0
    for e in sorted(layout.entries, key=lambda e: e.start(layout.bucket_bytes)):
        start = e.start(layout.bucket_bytes)
        if e.offset >= layout.bucket_bytes or start % ALIGN or start < end:
            raise ValueError(f"tensor {e.name} at bucket {e.bucket} offset {e.offset} is misplaced")
        itemsize = torch_dtype(e.dtype).itemsize
        numel = 1
        for d in e.shape:
            numel *= d
        if e.nbytes != numel * itemsize:
            raise ValueError(f"tensor {e.name}: nbytes {e.nbytes} != {numel} x {itemsize} ({e.dtype} {e.shape})")
        end = start + e.nbytes
    if end > layout.total_bytes:
        raise ValueError(f"tensors end at byte {end}, past total_bytes {layout.total_bytes}")


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> memoryview:
    """A byte view of a tensor in ``dtype`` (None: its own), zero-copy for a contiguous CPU tensor already in it.
    A cast happens before a device tensor is copied to the CPU, so only the narrower bytes cross."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data


def iter_stream(layout: Layout, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[int, int, memoryview]]:
    """Yield (bucket, offset in bucket, bytes) pieces covering the stream in order, padding included.

    No copy: pieces are views of the tensors (and of a shared zero block for padding).
    """
    zeros = memoryview(bytes(ALIGN))
    bb, pos = layout.bucket_bytes, 0
    for e in layout.entries:
        start = e.start(bb)
        pieces = [zeros[: start - pos]] if start > pos else []
        pieces.append(tensor_bytes(tensors[e.name], torch_dtype(e.dtype)))
        for piece in pieces:
            while len(piece):
                room = bb - pos % bb
                head, piece = piece[:room], piece[room:]
                yield pos // bb, pos % bb, head
                pos += len(head)
    assert pos == layout.total_bytes


def iter_chunks(
    layout: Layout, tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[int, int, list[memoryview], bool]]:
    """Group stream pieces into chunks of about chunk_bytes that never cross a bucket.

    Yields (bucket, offset, pieces, completes_bucket).
    """
    cur: list[memoryview] = []
    cur_bucket, cur_off, size = 0, 0, 0
    for bucket, off, piece in iter_stream(layout, tensors):
        while len(piece):
            if bucket != cur_bucket or size >= chunk_bytes:
                if cur:
                    yield cur_bucket, cur_off, cur, cur_off + size == layout.bucket_size(cur_bucket)
                cur_bucket, cur_off, cur, size = bucket, off, [], 0
            take = piece[: chunk_bytes - size]
            cur.append(take)
            size += len(take)
            off += len(take)
            piece = piece[len(take) :]
    if cur:
        yield cur_bucket, cur_off, cur, True


def iter_buckets(
    layout: Layout, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Pack bucket after bucket into one reused contiguous uint8 buffer (for collective broadcast).

    The yielded tensor is only valid until the next iteration.
    """
    if out is None:
        out = torch.empty(min(layout.bucket_bytes, layout.total_bytes), dtype=torch.uint8)
    view = out.numpy().data
    current = 0
    for bucket, off, piece in iter_stream(layout, tensors):
        if bucket != current:
            yield current, out[: layout.bucket_size(current)]
            current = bucket
        view[off : off + len(piece)] = piece
    if layout.total_bytes:
        yield current, out[: layout.bucket_size(current)]


def view_tensors(layout: Layout, staging: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a staging buffer holding the whole stream (uint8, total_bytes)."""
    out = {}
    bb = layout.bucket_bytes
    for e in layout.entries:
        start = e.start(bb)
        raw = staging[start : start + e.nbytes]
        out[e.name] = raw.view(torch_dtype(e.dtype)).view(e.shape)
    return out


# ---- checksums: xxh3_64 when the xxhash wheel is present (several times crc32's speed), else zlib's crc32

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash ships with the project's venv
    _xxhash = None  # type: ignore[assignment]  # no wheel: the module is absent and crc32 is the only checksum

CHECKSUMS = ("xxh3_64", "crc32") if _xxhash is not None else ("crc32",)
DEFAULT_CHECKSUM = CHECKSUMS[0]


class Hasher:
    """Incremental checksum over the pieces of one bucket."""

    def __init__(self, algo: str) -> None:
        if algo not in CHECKSUMS and algo != "none":
            raise ValueError(f"checksum {algo!r} not available here; use one of {CHECKSUMS}")
        self.algo = algo
        self._h = _xxhash.xxh3_64() if algo == "xxh3_64" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        elif self.algo == "crc32":
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> int:
        if self._h is not None:
            return self._h.intdigest()
        return self._crc


def checksum(data, algo: str = DEFAULT_CHECKSUM) -> int:
    h = Hasher(algo)
    h.update(data)
    return h.digest()
