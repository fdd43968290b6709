"""Which pods the trainer brings to its version while it waits for rollouts (``PodPublisher.behind``), and how it
finds the pods of --rollout.urls at start-up (``discover_targets``)."""

from __future__ import annotations

import pytest

from molt._proto import weightsync_pb2 as pb
from services.trainer.publish import PodDiscoveryError, PodPublisher, discover_targets


class FakePusher:
    def __init__(self, status: dict) -> None:
        self._status = status

    def status(self) -> dict:
        return self._status


def test_behind_lists_pods_on_another_version_and_pods_never_pushed_since_they_started():
    publisher = PodPublisher([], [], urls=["http://pod:1"])
    assert publisher.behind(3) == []  # pods not known yet: nothing to compare
    publisher.pusher = FakePusher(
        {
            "current:1": pb.StatusResponse(version=3, syncs_ok=4),
            "old:1": pb.StatusResponse(version=2, syncs_ok=3),
            # restarted on base weights while the trainer is still at version 0: same label, never pushed
            "fresh:1": pb.StatusResponse(version=0, syncs_ok=0),
            "down:1": ConnectionError("refused"),
        }
    )
    assert publisher.behind(3) == ["old:1", "fresh:1"]
    publisher.pusher = FakePusher({"fresh:1": pb.StatusResponse(version=0, syncs_ok=0)})
    assert publisher.behind(0) == ["fresh:1"]


def test_a_pod_that_never_answers_ends_discovery_with_the_flag_that_bounds_the_wait():
    from molt.net import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        PodDiscoveryError,
        match=rf"rollout pod {url} did not answer /readyz within "
        r"--rollout.startup_wait_s 0 \(",
    ):
        discover_targets([url], wait_s=0)
