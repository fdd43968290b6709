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

Wire encoding: msgpack; arrays travel as {dtype, shape, bytes} (little-endian), never as lists, so
encode/decode is a memcpy. ``SCHEMA_VERSION`` is bumped on any incompatible change; decoders reject
versions they do not know rather than guess.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
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

    def __post_init__(self) -> None:
        self.token_ids = _arr(self.token_ids, "<i4")
        self.action_spans = _arr(self.action_spans, "<i4").reshape(-1, 2)
        self.logprobs = _arr(self.logprobs, "<f4")
        self.versions = _arr(self.versions, "<i4")
        if self.routed_experts is not None:
            self.routed_experts = _arr(self.routed_experts, "<i2")

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
        # Hot path (every encode and decode): few numpy reductions, spans checked as a short Python list.
        tok, lp, ver = self.token_ids, self.logprobs, self.versions
        t = tok.shape[0] if tok.ndim == 1 else 0
        if t == 0:
            raise SchemaError(f"{where}.token_ids", f"must be a non-empty 1-D array, got shape {tok.shape}")
        if tok.min() < 0:
            raise SchemaError(f"{where}.token_ids", "negative token id")
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
            raise SchemaError(f"{where}.logprobs", f"{lp.shape[0]} logprobs for {a} action tokens")
        # NaN fails both comparisons; +-inf fails one.
        if not (lp.max() <= 1e-4 and lp.min() > -np.inf):
            raise SchemaError(f"{where}.logprobs", "logprobs must be finite and <= 0")
        if ver.shape != (a,):
            raise SchemaError(f"{where}.versions", f"{ver.shape[0]} versions for {a} action tokens")
        if ver.min() < 0:
            raise SchemaError(f"{where}.versions", "negative policy version")
        re = self.routed_experts
        if re is not None and (re.ndim != 3 or re.shape[0] != t):
            raise SchemaError(f"{where}.routed_experts", f"shape {re.shape} is not (tokens={t}, layers, top_k)")


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

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @property
    def num_action_tokens(self) -> int:
        return sum(s.num_action_tokens for s in self.segments)

    def min_version(self) -> int:
        return min(int(s.versions.min()) for s in self.segments)

    def validate(self) -> None:
        if not self.trajectory_id:
            raise SchemaError("trajectory_id", "must be non-empty")
        if not self.group_id:
            raise SchemaError("group_id", "must be non-empty")
        if self.sample_index < 0:
            raise SchemaError("sample_index", f"must be >= 0, got {self.sample_index}")
        if not self.segments:
            raise SchemaError("segments", "a trajectory needs at least one segment")
        for i, seg in enumerate(self.segments):
            seg.validate(f"segments[{i}]")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise SchemaError("reward", f"must be a finite number, got {self.reward!r}")
        if self.score is not None and not math.isfinite(self.score):
            raise SchemaError("score", f"must be finite or null, got {self.score!r}")
        for k, v in self.info.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SchemaError(f"info.{k}", f"info values must be finite numbers, got {v!r}")
        if self.status not in STATUSES:
            raise SchemaError("status", f"must be one of {STATUSES}, got {self.status!r}")


# ---- wire encoding


# Encode/decode are on the bus's hot path (tens of thousands of records/s): dtypes are cached and
# segments decoded in their wire dtypes are built without re-checking them.
_DTYPES: dict[str, np.dtype] = {}
_I4, _I2, _F4 = np.dtype("<i4"), np.dtype("<i2"), np.dtype("<f4")


def _pack_array(a: np.ndarray) -> dict[str, Any]:
    return {"d": a.dtype.str, "s": list(a.shape), "b": a.tobytes()}


def _unpack_array(obj: Any, name: str) -> np.ndarray:
    try:
        code = obj["d"]
        dtype = _DTYPES.get(code) or _DTYPES.setdefault(code, np.dtype(code))
        return np.frombuffer(obj["b"], dtype=dtype).reshape(obj["s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SchemaError(name, f"malformed array ({exc})") from None


def _segment(t: np.ndarray, a: np.ndarray, lp: np.ndarray, v: np.ndarray, r: np.ndarray | None) -> Segment:
    if t.dtype != _I4 or a.dtype != _I4 or lp.dtype != _F4 or v.dtype != _I4 or a.ndim != 2 or (
            r is not None and r.dtype != _I2):
        return Segment(t, a, lp, v, r)  # another producer's dtypes: convert
    seg = object.__new__(Segment)
    seg.token_ids, seg.action_spans, seg.logprobs, seg.versions, seg.routed_experts = t, a, lp, v, r
    return seg


def encode(traj: Trajectory, validate: bool = True) -> bytes:
    """Trajectory -> bytes. Validates first so a bad record never reaches the stream."""
    if validate:
        traj.validate()
    segs = []
    for s in traj.segments:
        seg = {"t": _pack_array(s.token_ids), "a": _pack_array(s.action_spans),
               "l": _pack_array(s.logprobs), "v": _pack_array(s.versions)}
        if s.routed_experts is not None:
            seg["r"] = _pack_array(s.routed_experts)
        segs.append(seg)
    p = traj.provenance
    return msgpack.packb(
        {
            "schema": SCHEMA_VERSION,
            "id": traj.trajectory_id,
            "group": traj.group_id,
            "idx": traj.sample_index,
            "segments": segs,
            "reward": float(traj.reward),
            "score": None if traj.score is None else float(traj.score),
            "info": {k: float(v) for k, v in traj.info.items()},
            "status": traj.status,
            "prov": {
                "model": p.model, "weight_version": p.weight_version, "tokenizer_hash": p.tokenizer_hash,
                "chat_template_hash": p.chat_template_hash, "sampling_params": p.sampling_params,
                "env_name": p.env_name, "env_version": p.env_version,
            },
            "events": traj.events,
            "created_at": traj.created_at,
        },
        use_bin_type=True,
    )


def decode(data: bytes) -> Trajectory:
    """bytes -> validated Trajectory; raises SchemaError naming the field on any problem."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise SchemaError("record", f"not a msgpack trajectory ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise SchemaError("record", f"expected a map, got {type(obj).__name__}")
    version = obj.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError("schema", f"unsupported schema version {version!r} (this decoder reads {SCHEMA_VERSION})")
    try:
        segments = []
        for i, s in enumerate(obj["segments"]):
            where = f"segments[{i}]"
            segments.append(_segment(
                _unpack_array(s["t"], f"{where}.token_ids"),
                _unpack_array(s["a"], f"{where}.action_spans"),
                _unpack_array(s["l"], f"{where}.logprobs"),
                _unpack_array(s["v"], f"{where}.versions"),
                _unpack_array(s["r"], f"{where}.routed_experts") if "r" in s else None,
            ))
        prov = obj.get("prov") or {}
        traj = Trajectory(
            trajectory_id=obj["id"],
            group_id=obj["group"],
            sample_index=obj["idx"],
            segments=segments,
            reward=obj["reward"],
            score=obj.get("score"),
            info=obj.get("info") or {},
            status=obj.get("status", "completed"),
            provenance=Provenance(**prov),
            events=obj.get("events") or [],
            created_at=obj.get("created_at", 0.0),
        )
    except KeyError as exc:
        raise SchemaError(str(exc.args[0]), "missing required field") from None
    except TypeError as exc:
        raise SchemaError("record", f"malformed field ({exc})") from None
    traj.validate()
    return traj
