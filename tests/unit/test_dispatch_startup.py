"""The trainer waits for an env worker to be ready before its first episode: services start in any order
(`molt up` starts the trainer with the pods; Kubernetes in any order), and episodes sent to a worker still
starting would each meet an outage, its warning and its backoff."""

from __future__ import annotations

import logging

import httpx

from services.trainer.config import EnvsConfig, RolloutConfig
from services.trainer.dispatch import EpisodeDispatcher
from tests.unit.test_dispatch_failures import _worker


def _dispatcher(urls: list[str], transport: httpx.AsyncBaseTransport) -> EpisodeDispatcher:
    d = EpisodeDispatcher(EnvsConfig(urls=urls, agent="lookup"), RolloutConfig(), 256)
    d.client = httpx.AsyncClient(transport=transport)
    return d


async def test_refused_then_not_ready_then_ready(monkeypatch, caplog):
    """A worker not listening yet, then answering 503 (its gateway not ready): waited for, logged once."""
    monkeypatch.setattr("services.trainer.dispatch.READY_POLL_S", 0.0)
    answers = iter(["refused", 503, 503, 200])
    probes = []

    def handler(request: httpx.Request) -> httpx.Response:
        probes.append(request.url.path)
        answer = next(answers)
        if answer == "refused":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(answer, json={})

    d = _dispatcher(["http://w1"], httpx.MockTransport(handler))
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        await d.wait_ready(lambda: False)
    assert probes == ["/readyz"] * 4
    waits = [r.getMessage() for r in caplog.records if "waiting for an env worker" in r.getMessage()]
    assert len(waits) == 1 and "ConnectError" in waits[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await d.close()


async def test_one_ready_worker_is_enough(monkeypatch):
    monkeypatch.setattr("services.trainer.dispatch.READY_POLL_S", 0.0)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if request.url.host == "w2" else 503, json={})

    d = _dispatcher(["http://w1", "http://w2"], httpx.MockTransport(handler))
    await d.wait_ready(lambda: False)
    await d.close()


async def test_a_worker_without_readyz_is_not_waited_for():
    """Only what an episode would meet as an outage is waited out: a 404 (a worker of one's own making that
    serves no /readyz) is not."""
    d = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: httpx.Response(404)))
    await d.wait_ready(lambda: False)
    await d.close()


async def test_a_stop_ends_the_wait(monkeypatch):
    monkeypatch.setattr("services.trainer.dispatch.READY_POLL_S", 0.0)
    calls = []
    d = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: httpx.Response(503)))
    await d.wait_ready(lambda: calls.append(1) or len(calls) > 3)
    assert len(calls) == 4
    await d.close()


async def test_the_real_worker_app_answers_ready(tmp_path):
    d = _dispatcher(["http://w1"], httpx.ASGITransport(app=_worker(tmp_path)))
    await d.wait_ready(lambda: False)
    await d.close()
