"""``python -m services.trainer.push --model DIR --pods HOST:PORT[,HOST:PORT...] [--version N]``.

Pushes a saved model dir's weights to running rollout pods over the weight-sync path the trainer
uses (operators roll a fleet back to a checkpoint with it). The pods' gRPC port is the rollout
service's ``--grpc.port`` (shown on its ``/readyz``). Without ``--version`` the weights become
version max(pod versions) + 1. Exits 0 when every pod committed, 1 otherwise (the report says why), 2 with one error
line and no report when a pod cannot be reached or refuses the token.
The pods' weight-sync token comes from ``MOLT_WEIGHTS_TOKEN`` (as for the trainer; never a flag).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal

from molt.config import Field, Section, parse_settings
from molt.serve import configure_logging
from molt.weightsync.layout import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES

PROG = "python -m services.trainer.push"


class PushSettings(Section):
    """Push a saved model dir's weights to running rollout pods."""

    model: str = ""
    """Model directory (HF layout: config.json + *.safetensors) whose weights to push."""
    pods: list[str] = Field(default_factory=list)
    """Pods' weight-sync gRPC addresses, HOST:PORT, comma- or space-separated."""
    version: int | None = None
    """Policy version the pods serve afterwards. Unset: max(pod versions) + 1."""
    transport: Literal["grpc", "gloo", "nccl"] = "grpc"
    """Data path: grpc streams; gloo/nccl broadcast over a process group this command hosts."""
    collective_host: str = "127.0.0.1"
    """Address the pods reach this process on for gloo/nccl (its TCPStore binds there)."""
    frozen: list[str] = Field(default_factory=list)
    """Tensor names not to send (the pods keep theirs), e.g. a frozen MoE router."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bytes per bucket (checksum / broadcast unit)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per gRPC message of the Push stream."""
    check: bool = False
    """Verify: compare a probe's prompt logprobs on each pod with transformers on this model (loads it)."""
    check_max_abs_diff: float = 1e-3
    """Largest probe logprob difference a pod may show before it refuses (and rolls back) the sync."""
    timeout_s: float = 600.0
    """Deadline of each RPC."""


def load_model_dir(path: str | Path):
    """(tensors in file order, tie_word_embeddings) of an HF model dir."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files: pass --model a saved HF model dir")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    tie = bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))
    return tensors, tie


def run(s: PushSettings) -> int:
    from molt.weightsync.check import probe_check
    from molt.weightsync.pusher import WeightPusher, WeightPushError

    log = logging.getLogger("molt.trainer.push")
    pods = [p for item in s.pods for p in item.replace(",", " ").split()]
    if not s.model or not pods:
        raise ValueError("both --model DIR and --pods HOST:PORT[,HOST:PORT...] are required")
    t0 = time.perf_counter()
    tensors, tie = load_model_dir(s.model)
    load_s = time.perf_counter() - t0
    check = None
    if s.check:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32).eval()
        check = probe_check(model, max_abs_diff=s.check_max_abs_diff)
        del model
    pusher = WeightPusher(
        pods,
        frozen=s.frozen,
        tie_word_embeddings=tie,
        transport=s.transport,
        bucket_bytes=s.bucket_bytes,
        chunk_bytes=s.chunk_bytes,
        timeout_s=s.timeout_s,
        collective_host=s.collective_host,
    )
    try:
        status = pusher.status()
        down = {t: str(r) for t, r in status.items() if isinstance(r, BaseException)}
        if down:
            raise ValueError(f"pod(s) unreachable or refusing (check MOLT_WEIGHTS_TOKEN): {down}")
        current = max(r.version for r in status.values() if not isinstance(r, BaseException))
        version = current + 1 if s.version is None else s.version
        force = s.version is not None and version <= current
        try:
            report = pusher.push(tensors, version, force=force, check=check)
            ok = True
        except WeightPushError as exc:
            report, ok = exc.report, False
    finally:
        pusher.close()
    out = {
        "version": version,
        "ok": ok,
        "transport": s.transport,
        "bytes": report.bytes,
        "tensors": report.tensors,
        "read_s": round(load_s, 3),
        "gather_s": round(report.gather_s, 3),
        "transfer_s": round(report.transfer_s, 3),
        "load_s": round(report.load_s, 3),
        "pods": report.pods,
        "failed": report.failed,
    }
    print(json.dumps(out, indent=2))
    if not ok:
        log.error("push of version %d failed on %s", version, sorted(report.failed))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_logging("info")
    settings = parse_settings(PushSettings, sys.argv[1:] if argv is None else argv, prog=PROG)
    try:
        return run(settings)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
