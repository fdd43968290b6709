"""Token-first trajectory schema: what the gateway writes to the stream and the trainer learns from.

One ``Trajectory`` is one rollout sample. It holds one or more ``Segment``s: a segment is a token-exact
sequence (prompt + everything after it) plus the spans the policy generated. A normal multi-turn episode
is one segment; a history rewrite (context compaction, a template that drops earlier reasoning) seals
the segment and starts a new one. All segments share the trajectory's ids and reward.

Alignment, per segment (checked on decode, a bad record is rejected with a message naming the field):
- ``token_ids``: int32[T], the whole sequence.
- ``action_spans``: int32[S, 2], half-open [start, end) ranges of policy-generated tokens, sorted,
  non-overlapping, non-empty, inside [0, T). Every other token (prompt, template deltas, tool
  outputs, env feedback) is masked out of the loss.
- ``logprobs``: float32[A], the rollout logprob of each action token, A = sum of span lengths.
- ``versions``: int32[A], the policy version that generated each action token.
- ``routed_experts``: optional int16[T, L, K], MoE top-k expert ids per token and layer (-1: unknown).
- ``top_ids`` / ``top_logprobs``: optional int32[A, K] / float32[A, K], for each action token (in ``logprobs``'
  order) the sampler's K most likely tokens, best first, and their logprobs over the whole vocabulary, as the
  sampled token's ``logprobs`` are (the gateway's --rollout.top_logprobs K; both or neither). A logprob may be
  -inf (a token the sampling settings rule out); the trainer's score centering reads them.
- ``images``: the sha256 of each image in the segment, in the order their token runs appear in
  ``token_ids`` (vision-language models; ``token_ids`` holds each image's tokens expanded, exactly as the
  model saw them). The image files themselves are in ``Trajectory.images``, keyed by sha256, stored once
  per episode however many segments or turns show them; running the model's processor on them gives the
  same expansion and pixel inputs the rollout pod used.

Wire encoding (v2): one msgpack map, the Python field names as keys, decoded by msgspec into typed
structs (types are checked in C). Each array is one bin of little-endian bytes in the dtype the schema
fixes for it (above), never a list; ``routed_experts`` carries its shape. Decoding makes numpy views on
those bytes: no per-element work. ``SCHEMA_VERSION`` is bumped on any incompatible change; decoders reject
versions they do not know rather than guess.

Validation is split in two: the layout (shapes, spans, alignment: plain Python on short lists) and the
value ranges (numpy reductions). ``encode_many`` / ``decode_many``, the bus's path, check the value
ranges of a whole batch in three reductions (per record, numpy's call overhead would dominate); a batch
that fails is re-checked record by record to name the culprit.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np

SCHEMA_VERSION = 2
STATUSES = ("completed", "truncated")


class SchemaError(ValueError):
    """A trajectory record that cannot be trained on; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _arr(x: Any, dtype: str) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype.str == dtype and x.flags.c_contiguous:
        return x  # decode path: already the wire dtype, no copy
    return np.ascontiguousarray(np.asarray(x, dtype=dtype))


@dataclass
class Segment:
    token_ids: np.ndarray
    action_spans: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routed_experts: np.ndarray | None = None
    images: list[str] = field(default_factory=list)
    """sha256 hex of each image shown in this segment, in token order (keys of Trajectory.images)."""
    top_ids: np.ndarray | None = None
    """int32[A, K]: each action token's K most likely tokens under the sampler, best first."""
    top_logprobs: np.ndarray | None = None
    """float32[A, K]: their logprobs (the whole vocabulary's normalisation, as ``logprobs``)."""

    def __post_init__(self) -> None:
        self.token_ids = _arr(self.token_ids, "<i4")
        self.action_spans = _arr(self.action_spans, "<i4").reshape(-1, 2)
        self.logprobs = _arr(self.logprobs, "<f4")
        self.versions = _arr(self.versions, "<i4")
        if self.routed_experts is not None:
            self.routed_experts = _arr(self.routed_experts, "<i2")
        if self.top_ids is not None:
            self.top_ids = _arr(self.top_ids, "<i4")
        if self.top_logprobs is not None:
            self.top_logprobs = _arr(self.top_logprobs, "<f4")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int((self.action_spans[:, 1] - self.action_spans[:, 0]).sum()) if len(self.action_spans) else 0

    def action_mask(self) -> np.ndarray:
        """bool[T]: True on tokens the policy generated."""
        mask = np.zeros(self.num_tokens, dtype=bool)
        for start, end in self.action_spans:
            mask[start:end] = True
        return mask

    def token_logprobs(self) -> np.ndarray:
        """float32[T]: rollout logprob on action tokens, 0 elsewhere."""
        out = np.zeros(self.num_tokens, dtype=np.float32)
        out[self.action_mask()] = self.logprobs
        return out

    def token_versions(self) -> np.ndarray:
        """int32[T]: policy version on action tokens, -1 elsewhere."""
        out = np.full(self.num_tokens, -1, dtype=np.int32)
        out[self.action_mask()] = self.versions
        return out

    def validate(self, where: str = "segment") -> None:
        self.check_layout(where)
        self.check_values(where)

    def check_layout(self, where: str = "segment") -> None:
        """Shapes and spans: plain Python on a short list, no pass over the token arrays."""
        tok, lp, ver = self.token_ids, self.logprobs, self.versions
        t = tok.shape[0] if tok.ndim == 1 else 0
        if t == 0:
            raise SchemaError(f"{where}.token_ids", f"must be a non-empty 1-D array, got shape {tok.shape}")
        spans = self.action_spans.tolist()
        if not spans:
            raise SchemaError(f"{where}.action_spans", "no action span: a segment must hold generated tokens")
        a, prev_end = 0, 0
        for start, end in spans:
            if start >= end:
                raise SchemaError(f"{where}.action_spans", f"empty or reversed span in {spans}")
            if start < prev_end:
                raise SchemaError(f"{where}.action_spans", f"spans overlap or are unsorted: {spans}")
            a += end - start
            prev_end = end
        if spans[0][0] < 0 or prev_end > t:
            raise SchemaError(f"{where}.action_spans", f"span outside the sequence of {t} tokens: {spans}")
        if lp.shape != (a,):
            raise SchemaError(f"{where}.logprobs", f"{lp.size} logprobs for {a} action tokens")
        if ver.shape != (a,):
            raise SchemaError(f"{where}.versions", f"{ver.size} versions for {a} action tokens")
        experts = self.routed_experts
        if experts is not None and (experts.ndim != 3 or experts.shape[0] != t):
            raise SchemaError(f"{where}.routed_experts", f"shape {experts.shape} is not (tokens={t}, layers, top_k)")
        ids, top = self.top_ids, self.top_logprobs
        if (ids is None) != (top is None):
            raise SchemaError(f"{where}.top_ids", "top_ids and top_logprobs come together")
        if ids is not None and top is not None:
            if ids.ndim != 2 or ids.shape[0] != a or ids.shape[1] < 1:
                raise SchemaError(f"{where}.top_ids", f"shape {ids.shape} is not (action tokens={a}, k >= 1)")
            if top.shape != ids.shape:
                raise SchemaError(f"{where}.top_logprobs", f"shape {top.shape} is not top_ids' {ids.shape}")

    def check_values(self, where: str = "segment") -> None:
        """The value ranges (one numpy reduction each); ``check_values_many`` does a whole batch at once."""
        if self.token_ids.min() < 0:
            raise SchemaError(f"{where}.token_ids", "negative token id")
        if not _logprobs_ok(self.logprobs):
            raise SchemaError(f"{where}.logprobs", "logprobs must be finite and <= 0")
        if self.versions.min() < 0:
            raise SchemaError(f"{where}.versions", "negative policy version")
        if self.top_ids is not None and self.top_ids.min() < 0:
            raise SchemaError(f"{where}.top_ids", "negative token id")
        top = self.top_logprobs
        if top is not None and not (top.max() <= 1e-4 and not np.isnan(top).any()):
            raise SchemaError(f"{where}.top_logprobs", "logprobs must be <= 0 (-inf allowed), never NaN")


def _logprobs_ok(lp: np.ndarray) -> bool:
    # NaN fails both comparisons; +-inf fails one. 1e-4 of slack for rounding in the engine.
    return bool(lp.max() <= 1e-4 and lp.min() > -np.inf)


_VALUES_CHUNK = 1 << 20  # tokens per concatenated pass in check_values_many


def check_values_many(segments: list[Segment]) -> bool:
    """Whether every segment passes ``check_values``, with three reductions per ~1M tokens of the batch
    (per segment, numpy's call overhead would dominate). False: check one by one."""
    start, size = 0, 0
    for k, seg in enumerate(segments):
        size += seg.token_ids.size
        if size < _VALUES_CHUNK and k + 1 < len(segments):
            continue
        chunk = segments[start : k + 1]  # bounded, so the concatenated copies stay a few MB
        ints = np.concatenate([a for s in chunk for a in (s.token_ids, s.versions)])
        if ints.min() < 0 or not _logprobs_ok(np.concatenate([s.logprobs for s in chunk])):
            return False
        if any(s.top_ids is not None for s in chunk):  # rare (--rollout.top_logprobs): checked one by one
            try:
                for s in chunk:
                    s.check_values()
            except SchemaError:
                return False
        start, size = k + 1, 0
    return True


@dataclass
class Provenance:
    """Where a trajectory came from: enough to audit and re-score it."""

    model: str = ""
    weight_version: int = 0
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    env_name: str = ""
    env_version: str = ""


MAX_ABS_REWARD = 1e6
"""The bound on a reward's (and score's) magnitude, checked where rewards enter (gateway finish, env worker):
advantages and their standard deviations must stay finite in float32 (a reward of 1e308 squares to inf)."""


def check_reward(value: Any, name: str = "reward") -> float:
    """``value`` as a float when it is a finite number within +-MAX_ABS_REWARD; else SchemaError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(name, f"must be a number, got {str(value)[:80]!a}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or abs(value) > MAX_ABS_REWARD:
        raise SchemaError(name, f"must be a finite number within +-{MAX_ABS_REWARD:g}, got {value!r}")
    return value


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    sample_index: int
    segments: list[Segment]
    reward: float
    score: float | None = None
    info: dict[str, float] = field(default_factory=dict)
    status: str = "completed"
    provenance: Provenance = field(default_factory=Provenance)
    events: list[dict[str, Any]] = field(default_factory=list)
    """Notable things that happened during the episode, e.g. {"kind": "pod_switch", ...}."""
    created_at: float = field(default_factory=time.time)
    images: dict[str, bytes] = field(default_factory=dict)
    """Image files (PNG, JPEG, ...) the segments show, keyed by their sha256 hex: each stored once."""

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @property
    def num_action_tokens(self) -> int:
        return sum(s.num_action_tokens for s in self.segments)

    def min_version(self) -> int:
        return min(int(s.versions.min()) for s in self.segments)

    def validate(self) -> None:
        self._validate_fields()
        for i, seg in enumerate(self.segments):
            seg.validate(f"segments[{i}]")

    def _validate_fields(self) -> None:
        """Everything but the segments' arrays."""
        if not self.trajectory_id or not isinstance(self.trajectory_id, str):
            raise SchemaError("trajectory_id", f"must be a non-empty string, got {self.trajectory_id!r}")
        if not self.group_id or not isinstance(self.group_id, str):
            raise SchemaError("group_id", f"must be a non-empty string, got {self.group_id!r}")
        if self.sample_index < 0:
            raise SchemaError("sample_index", f"must be >= 0, got {self.sample_index}")
        if not self.segments:
            raise SchemaError("segments", "a trajectory needs at least one segment")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise SchemaError("reward", f"must be a finite number, got {self.reward!r}")
        if self.score is not None and not math.isfinite(self.score):
            raise SchemaError("score", f"must be finite or null, got {self.score!r}")
        for k, v in self.info.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SchemaError(f"info.{k}", f"info values must be finite numbers, got {v!r}")
        if self.status not in STATUSES:
            raise SchemaError("status", f"must be one of {STATUSES}, got {self.status!r}")
        if self.images or any(seg.images for seg in self.segments):
            self._validate_images()

    def _validate_images(self) -> None:
        shown = {d for seg in self.segments for d in seg.images}
        for i, seg in enumerate(self.segments):
            missing = [d for d in seg.images if d not in self.images]
            if missing:
                raise SchemaError(f"segments[{i}].images", f"image {missing[0]} is not in the trajectory's images")
        for digest, data in self.images.items():
            if digest not in shown:
                raise SchemaError("images", f"image {digest} is not shown by any segment")
            if not isinstance(data, bytes) or hashlib.sha256(data).hexdigest() != digest:
                raise SchemaError("images", f"the bytes stored under {digest} do not have that sha256")


# ---- wire encoding
#
# v2 structs. Bins decode to bytes (one copy) rather than memoryviews: memoryviews are tracked by the
# cyclic GC, which cost more than the copy, and bytes give aligned arrays. The structs themselves are
# short-lived: gc=False.

_I4, _I2, _F4 = np.dtype("<i4"), np.dtype("<i2"), np.dtype("<f4")


class _SegmentWire(msgspec.Struct, omit_defaults=True, gc=False):
    token_ids: bytes  # <i4[T]
    action_spans: bytes  # <i4[S, 2]
    logprobs: bytes  # <f4[A]
    versions: bytes  # <i4[A]
    routed_experts: bytes | None = None  # <i2[T, L, K]
    routed_experts_shape: tuple[int, int, int] | None = None
    images: list[str] | None = None  # sha256 hex, in token order
    top_ids: bytes | None = None  # <i4[A, K]
    top_logprobs: bytes | None = None  # <f4[A, K]
    top_k: int | None = None


class _TrajectoryWire(msgspec.Struct, omit_defaults=True, gc=False):
    schema: int  # first, so a decoder can tell the version from the record's first bytes
    trajectory_id: str
    group_id: str
    sample_index: int
    segments: list[_SegmentWire]
    reward: float
    score: float | None
    info: dict[str, Any]
    status: str
    provenance: Provenance
    events: list[dict[str, Any]]
    created_at: float
    images: dict[str, bytes] | None = None  # sha256 hex -> image file (absent for text-only episodes)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_TrajectoryWire)
_V2_PREFIX = b"\xa6schema" + msgspec.msgpack.encode(SCHEMA_VERSION)  # after the map header byte


def _wire_bytes(a: np.ndarray, dtype: np.dtype) -> Any:
    """The array's bytes as a memoryview, for a bytes field: msgspec encodes it as bin without a copy."""
    view = a.data
    if a.dtype is not dtype or not view.c_contiguous:  # `is`: numpy reuses its builtin dtype objects
        view = np.ascontiguousarray(a, dtype=dtype).data
    return view


def encode(traj: Trajectory, validate: bool = True) -> bytes:
    """Trajectory -> bytes. Validates first so a bad record never reaches the stream."""
    if validate:
        traj.validate()
    segs = []
    for s in traj.segments:
        experts, top_ids, top = s.routed_experts, s.top_ids, s.top_logprobs
        segs.append(
            _SegmentWire(
                _wire_bytes(s.token_ids, _I4),
                _wire_bytes(s.action_spans, _I4),
                _wire_bytes(s.logprobs, _F4),
                _wire_bytes(s.versions, _I4),
                None if experts is None else _wire_bytes(experts, _I2),
                None if experts is None else experts.shape,
                list(s.images) or None,
                None if top_ids is None else _wire_bytes(top_ids, _I4),
                None if top is None else _wire_bytes(top, _F4),
                None if top_ids is None else int(top_ids.shape[1]),
            )
        )
    return _ENCODER.encode(
        _TrajectoryWire(
            SCHEMA_VERSION,
            traj.trajectory_id,
            traj.group_id,
            int(traj.sample_index),
            segs,
            float(traj.reward),
            None if traj.score is None else float(traj.score),
            {k: float(v) for k, v in traj.info.items()},
            traj.status,
            traj.provenance,
            traj.events,
            float(traj.created_at),
            traj.images or None,
        )
    )


def encode_many(trajectories: list[Trajectory]) -> list[bytes]:
    """``encode`` for a batch, its value ranges checked in one pass; raises on the first bad record."""
    for traj in trajectories:
        traj._validate_fields()
        for i, seg in enumerate(traj.segments):
            seg.check_layout(f"segments[{i}]")
    if not check_values_many([s for t in trajectories for s in t.segments]):
        for traj in trajectories:
            traj.validate()  # raises, naming the record's field
    return [encode(t, validate=False) for t in trajectories]


def decode(data: bytes) -> Trajectory:
    """bytes -> validated Trajectory; raises SchemaError naming the field on any problem."""
    traj = _decode_layout(data)
    for i, seg in enumerate(traj.segments):
        seg.check_values(f"segments[{i}]")
    return traj


@contextlib.contextmanager
def _no_gc():
    """A batch decode allocates thousands of objects that all stay alive: the cyclic collector's young-generation
    passes over them find nothing and cost time per record (bench/bus.py). Paused for the batch only."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def decode_many(payloads: list[bytes]) -> list[Trajectory | SchemaError]:
    """``decode`` for a batch, value ranges checked in one pass; a bad record yields its SchemaError in place."""
    out: list[Trajectory | SchemaError] = []
    with _no_gc():
        for data in payloads:
            try:
                out.append(_decode_layout(data))
            except SchemaError as exc:
                out.append(exc)
    if not check_values_many([s for t in out if isinstance(t, Trajectory) for s in t.segments]):
        out = [_values_checked(t) if isinstance(t, Trajectory) else t for t in out]
    return out


def _values_checked(traj: Trajectory) -> Trajectory | SchemaError:
    try:
        for i, seg in enumerate(traj.segments):
            seg.check_values(f"segments[{i}]")
    except SchemaError as exc:
        return exc
    return traj


def _decode_layout(data: bytes) -> Trajectory:
    """Decode and check everything but the arrays' value ranges."""
    return _decode_v2(data) if data[1:9] == _V2_PREFIX else _decode_other(data)


def _decode_v2(data: bytes) -> Trajectory:
    try:
        wire = _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise SchemaError(_msgspec_field(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise SchemaError("record", f"not a msgpack trajectory ({exc})") from None
    segments = [_segment_from_wire(w, i) for i, w in enumerate(wire.segments)]
    traj = Trajectory(
        wire.trajectory_id,
        wire.group_id,
        wire.sample_index,
        segments,
        wire.reward,
        wire.score,
        wire.info,
        wire.status,
        wire.provenance,
        wire.events,
        wire.created_at,
        wire.images or {},
    )
    traj._validate_fields()
    return traj


def _segment_from_wire(w: _SegmentWire, i: int) -> Segment:
    # The arrays are already in the wire dtypes and shapes: skip __post_init__'s conversions.
    seg = object.__new__(Segment)
    try:
        seg.token_ids = np.frombuffer(w.token_ids, _I4)
        seg.action_spans = np.frombuffer(w.action_spans, _I4).reshape(-1, 2)
        seg.logprobs = np.frombuffer(w.logprobs, _F4)
        seg.versions = np.frombuffer(w.versions, _I4)
        seg.routed_experts = (
            None if w.routed_experts is None else np.frombuffer(w.routed_experts, _I2).reshape(w.routed_experts_shape)
        )
        seg.images = w.images or []
        seg.top_ids = seg.top_logprobs = None
        if w.top_ids is not None or w.top_logprobs is not None:
            k = w.top_k or 1
            seg.top_ids = None if w.top_ids is None else np.frombuffer(w.top_ids, _I4).reshape(-1, k)
            seg.top_logprobs = None if w.top_logprobs is None else np.frombuffer(w.top_logprobs, _F4).reshape(-1, k)
    except (TypeError, ValueError):
        sizes = {
            "token_ids": (w.token_ids, 4),
            "action_spans": (w.action_spans, 8),
            "logprobs": (w.logprobs, 4),
            "versions": (w.versions, 4),
        }
        name = next((k for k, (b, n) in sizes.items() if len(b) % n), "routed_experts or top_ids")
        raise SchemaError(f"segments[{i}].{name}", "byte length does not match the dtype and shape") from None
    seg.check_layout(f"segments[{i}]")
    return seg


def _msgspec_field(message: str) -> str:
    """The field a msgspec validation message points at: "... - at `$.segments[0]`" -> "segments[0]"."""
    at = re.search(r" - at `\$\.?(.*)`$", message)
    path = at.group(1) if at else ""
    missing = re.search(r"missing required field `(\w+)`", message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or "record"


def _decode_other(data: bytes) -> Trajectory:
    """Anything but a v2 record with its keys in the usual order: the same record in another order, another
    version (rejected) or garbage (rejected)."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for garbage input
        raise SchemaError("record", f"not a msgpack trajectory ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise SchemaError("record", f"expected a map, got {type(obj).__name__}")
    version = obj.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError("schema", f"unsupported schema version {version!r} (this decoder reads {SCHEMA_VERSION})")
    return _decode_v2(data)
