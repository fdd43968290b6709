"""Where new weights go after a step: a small interface with two backends.

- ``PodPublisher``: the rollout pods (``--rollout.grpc_targets``, or each ``--rollout.urls`` pod's
  ``grpc_port`` from its ``/readyz``), through ``molt.weightsync``'s trainer-side ``WeightPusher``
  (owned by the weight-sync service; imported lazily so the trainer runs without it when no pod is
  configured). Frozen names (``--actor.freeze_moe_router``) are excluded. With ``keep_unsent`` (``--actor.lora``)
  a push may carry only the weights that changed: the pods keep every other one they hold.
- ``CallbackPublisher``: an in-process callable (tests; tools that sample from the trainer's policy).

The trainer gathers the full state dict on rank 0 only when a publisher exists (the gather is a
collective, every rank takes part) and publishes with the new policy version.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from urllib.parse import urlparse

import torch

from molt.net import host_port

log = logging.getLogger("molt.trainer")
DISCOVER_BACKOFF_S = (0.5, 5.0)  # first wait and cap while a --rollout.urls pod does not answer at start-up


class WeightPublisher(abc.ABC):
    @abc.abstractmethod
    def publish(self, version: int, tensors: dict[str, torch.Tensor], check=None) -> None:
        """Make ``tensors`` (full, unsharded, frozen names already removed) live as ``version``; ``check``: a
        ``ProbeCheck`` the receivers verify before promoting (``--train.check_weight_update_equal``)."""

    def connect(self) -> None:  # noqa: B027 - optional: most publishers have nothing to wait for
        """Block until the receivers are known (the trainer reports not ready meanwhile); PodDiscoveryError if
        they never are."""

    def behind(self, version: int) -> list[str]:
        """Pods that answer but serve another version than ``version`` (restarted on base weights, missed a
        push, or pushed by a trainer that died before its checkpoint): the trainer pushes to them again."""
        return []

    def publish_to(  # noqa: B027 - optional: publishers without pods have no one to bring up to date
        self, targets: list[str], version: int, tensors: dict[str, torch.Tensor], check=None
    ) -> None:
        """Bring ``targets`` to ``version`` (forced: a pod may be ahead)."""

    def close(self) -> None:
        return None


class CallbackPublisher(WeightPublisher):
    def __init__(self, fn: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        self.fn = fn

    def publish(self, version: int, tensors: dict[str, torch.Tensor], check=None) -> None:
        self.fn(version, tensors)


class PodDiscoveryError(ValueError):
    """A --rollout.urls pod never answered /readyz at start-up, or answers without a weight-sync port."""


def discover_targets(urls: list[str], wait_s: float, timeout_s: float = 10.0) -> list[str]:
    """HOST:GRPC_PORT of each pod, read from its /readyz (``grpc_port``; a pod awaiting its first push answers
    503 with it). A pod that does not answer yet is waited for with capped backoff, ``wait_s`` in all."""
    import httpx

    deadline = time.monotonic() + wait_s
    targets = []
    for url in urls:
        delay = DISCOVER_BACKOFF_S[0]
        while True:
            try:
                body = httpx.get(url.rstrip("/") + "/readyz", timeout=timeout_s).json()
                break
            except (httpx.HTTPError, ValueError) as exc:  # not up yet, or a proxy's error page in front of it
                if time.monotonic() + delay > deadline:
                    raise PodDiscoveryError(
                        f"rollout pod {url} did not answer /readyz within --rollout.startup_wait_s {wait_s:g} "
                        f"({exc}); start it, wait longer, or pass --rollout.grpc_targets HOST:PORT"
                    ) from exc
                if delay == DISCOVER_BACKOFF_S[0]:  # once per pod, not once per try
                    log.warning("rollout pod %s does not answer /readyz yet (%s): waiting for it", url, exc)
                time.sleep(delay)
                delay = min(delay * 2, DISCOVER_BACKOFF_S[1])
        port = body.get("grpc_port") if isinstance(body, dict) else None
        if not port:
            raise PodDiscoveryError(f"rollout pod {url} reports no grpc_port on /readyz; pass --rollout.grpc_targets")
        targets.append(host_port(urlparse(url).hostname or "", port))
    return targets


class PodPublisher(WeightPublisher):
    """``WeightPusher`` to every pod. The first push after a (re)start is forced (a resumed trainer may be
    behind the pods' version). A pod that fails stays on its old weights and is retried next step: the
    failure is logged and counted, training goes on. ``behind`` asks every pod its version, so that a pod
    that restarted is brought to the trainer's version (``publish_to``) without waiting for the next step."""

    def __init__(
        self,
        targets: list[str],
        frozen: list[str],
        model: torch.nn.Module | None = None,
        *,
        urls: list[str] | None = None,
        wait_s: float = 0.0,
        keep_unsent: bool = False,
    ) -> None:
        try:
            from molt.weightsync import WeightPusher
            from molt.weightsync.manifest import hf_adapter
        except ImportError as exc:
            raise ValueError(
                "pushing weights to --rollout.urls/--rollout.grpc_targets needs molt.weightsync."
                f"WeightPusher, which is not importable ({exc})"
            ) from exc
        self.frozen = set(frozen)
        tie = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
        self._make = lambda pods: WeightPusher(
            pods,
            frozen=sorted(self.frozen),
            tie_word_embeddings=tie,
            to_hf=hf_adapter(model) if model is not None else None,
            keep_unsent=keep_unsent,
        )
        self.urls, self.wait_s = list(urls or []), wait_s
        self.targets = targets
        self.pusher = self._make(targets) if targets else None  # else once connect() found the pods' ports
        self.failures = 0
        self._pushed = False

    def connect(self) -> None:
        if self.pusher is None:
            self.targets = discover_targets(self.urls, self.wait_s)
            log.info("weights go to %s", ", ".join(self.targets))
            self.pusher = self._make(self.targets)

    def publish(self, version: int, tensors: dict[str, torch.Tensor], check=None) -> None:
        from molt.weightsync import WeightPushError

        self.connect()
        assert self.pusher is not None  # connect() made it
        try:
            report = self.pusher.push(tensors, version, force=not self._pushed, check=check)
            log.info("pushed version %d: %.1f MB in %.2fs", version, report.bytes / 1e6, report.total_s)
        except WeightPushError as exc:
            self.failures += 1
            log.error("weight push of version %d: %s", version, exc)
        self._pushed = True

    def behind(self, version: int) -> list[str]:
        if self.pusher is None:
            return []
        status = self.pusher.status()
        # syncs_ok 0: a pod (re)started on its base weights, labelled version 0 like a trainer that has not
        # stepped yet; with --weights.await_push it serves nothing until pushed, whatever the versions say.
        return [
            t
            for t, r in status.items()
            if not isinstance(r, BaseException) and (r.version != version or r.syncs_ok == 0)
        ]

    def publish_to(self, targets: list[str], version: int, tensors: dict[str, torch.Tensor], check=None) -> None:
        from molt.weightsync import WeightPushError

        pusher = self._make(targets)
        try:
            report = pusher.push(tensors, version, force=True, check=check)
            log.info(
                "brought %s to version %d: %.1f MB in %.2fs",
                ", ".join(targets),
                version,
                report.bytes / 1e6,
                report.total_s,
            )
        except WeightPushError as exc:
            self.failures += 1
            log.error("catch-up push of version %d: %s", version, exc)
        finally:
            pusher.close()

    def close(self) -> None:
        close = getattr(self.pusher, "close", None) if self.pusher is not None else None
        if close:
            close()


def build_publisher(
    rollout_cfg, frozen: list[str], model: torch.nn.Module | None = None, *, keep_unsent: bool = False
) -> WeightPublisher | None:
    """The pods' publisher, or None without pods. ``--rollout.urls`` are resolved later (``connect``): the
    trainer serves /readyz (not ready) while it waits for pods that are not up yet. ``keep_unsent``: pushes may
    be partial (the pods keep what a push does not carry)."""
    targets = list(rollout_cfg.grpc_targets)
    if not targets and not rollout_cfg.urls:
        return None
    if targets:
        log.info("weights go to %s", ", ".join(targets))
    return PodPublisher(
        targets, frozen, model, urls=rollout_cfg.urls, wait_s=rollout_cfg.startup_wait_s, keep_unsent=keep_unsent
    )
