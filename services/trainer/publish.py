"""Where new weights go after a step: a small interface with two backends.

- ``PodPublisher``: the rollout pods (``--rollout.grpc_targets``, or each ``--rollout.urls`` pod's
  ``grpc_port`` from its ``/readyz``), through ``molt.weightsync``'s trainer-side ``WeightPusher``
  (owned by the weight-sync service; imported lazily so the trainer runs without it when no pod is
  configured). Frozen names (``--actor.freeze_moe_router``) are excluded.
- ``CallbackPublisher``: an in-process callable (tests; tools that sample from the trainer's policy).

The trainer gathers the full state dict on rank 0 only when a publisher exists (the gather is a
collective, every rank takes part) and publishes with the new policy version.
"""

from __future__ import annotations

import abc
import logging
from typing import Callable
from urllib.parse import urlparse

import torch

log = logging.getLogger("molt.trainer")


class WeightPublisher(abc.ABC):
    @abc.abstractmethod
    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make ``tensors`` (full, unsharded, frozen names already removed) live as ``version``."""

    def close(self) -> None:
        return None


class CallbackPublisher(WeightPublisher):
    def __init__(self, fn: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        self.fn = fn

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.fn(version, tensors)


def discover_targets(urls: list[str], timeout_s: float = 10.0) -> list[str]:
    """HOST:GRPC_PORT of each pod, read from its /readyz (``grpc_port``)."""
    import httpx

    targets = []
    for url in urls:
        try:
            body = httpx.get(url.rstrip("/") + "/readyz", timeout=timeout_s).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ValueError(f"rollout pod {url} did not answer /readyz ({exc}); start it first or pass "
                             "--rollout.grpc_targets HOST:PORT") from exc
        port = body.get("grpc_port")
        if not port:
            raise ValueError(f"rollout pod {url} reports no grpc_port on /readyz; pass --rollout.grpc_targets")
        targets.append(f"{urlparse(url).hostname}:{port}")
    return targets


class PodPublisher(WeightPublisher):
    """``WeightPusher`` to every pod. The first push after a (re)start is forced (a resumed trainer may be
    behind the pods' version). A pod that fails stays on its old weights and is retried next step: the
    failure is logged and counted, training goes on."""

    def __init__(self, targets: list[str], frozen: list[str], model: torch.nn.Module | None = None) -> None:
        try:
            from molt.weightsync import WeightPusher
            from molt.weightsync.manifest import hf_adapter
        except ImportError as exc:
            raise ValueError("pushing weights to --rollout.urls/--rollout.grpc_targets needs molt.weightsync."
                             f"WeightPusher, which is not importable ({exc})") from exc
        self.frozen = set(frozen)
        tie = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
        self.pusher = WeightPusher(targets, frozen=sorted(self.frozen), tie_word_embeddings=tie,
                                   to_hf=hf_adapter(model) if model is not None else None)
        self.targets = targets
        self.failures = 0
        self._pushed = False

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        from molt.weightsync import WeightPushError

        try:
            report = self.pusher.push(tensors, version, force=not self._pushed)
            log.info("pushed version %d: %.1f MB in %.2fs", version, report.bytes / 1e6, report.total_s)
        except WeightPushError as exc:
            self.failures += 1
            log.error("weight push of version %d: %s", version, exc)
        self._pushed = True

    def close(self) -> None:
        close = getattr(self.pusher, "close", None)
        if close:
            close()


def build_publisher(rollout_cfg, frozen: list[str], model: torch.nn.Module | None = None) -> WeightPublisher | None:
    targets = list(rollout_cfg.grpc_targets)
    if not targets and rollout_cfg.urls:
        targets = discover_targets(rollout_cfg.urls)
    if not targets:
        return None
    log.info("weights go to %s", ", ".join(targets))
    return PodPublisher(targets, frozen, model)
