"""An episode's wall-clock limit is set once, on the env workers: their /readyz reports it, and the trainer's
dispatcher waits that long (plus the finish's retries and a margin) for each episode's answer. An explicit
--envs.timeout_s below a worker's is raised with a warning, never obeyed: it would only cut episodes the worker is
still finishing and run them again."""

from __future__ import annotations

import logging
import textwrap

import httpx
import pytest

from molt.agents.testing import FakeGateway
from services.envs.app import build_app
from services.envs.config import EnvsSettings
from services.trainer.config import EnvsConfig, RolloutConfig
from services.trainer.dispatch import EPISODE_MARGIN_S, FALLBACK_TIMEOUT_S, EpisodeDispatcher, worker_limit_s

AGENT = textwrap.dedent("""
    from molt.agents import Env, Result, StepEnvRunner

    class OkEnv(Env):
        async def step(self, state):
            return Result(reward=1.0)

    class AgentRunner(StepEnvRunner):
        def __init__(self):
            super().__init__(OkEnv)
""")
BODY = {"agent": "lookup", "prompt": "q", "label": "", "group_id": "g", "sample_index": 0}


def _dispatcher(urls: list[str], transport: httpx.AsyncBaseTransport, **envs) -> EpisodeDispatcher:
    d = EpisodeDispatcher(EnvsConfig(urls=urls, agent="lookup", retry_backoff_s=0.01, **envs), RolloutConfig(), 256)
    d.client = httpx.AsyncClient(transport=transport)
    return d


def _ready(episode_timeout_s: float, finish_retry_s: float = 300.0) -> httpx.Response:
    limits = {"episode_timeout_s": episode_timeout_s, "finish_retry_s": finish_retry_s}
    return httpx.Response(200, json={"status": "ready", **limits})


@pytest.mark.parametrize(
    "readyz, limit",
    [
        ({"episode_timeout_s": 600, "finish_retry_s": 300}, 960.0),
        ({"episode_timeout_s": 3600.0, "finish_retry_s": 0}, 3600.0 + EPISODE_MARGIN_S),
        ({"status": "ready", "agents": ["a"]}, None),  # a worker that reports no limits
        ({"episode_timeout_s": 600}, None),
        ({"episode_timeout_s": "600", "finish_retry_s": 300}, None),
        ({"episode_timeout_s": True, "finish_retry_s": 300}, None),
        ({"episode_timeout_s": float("inf"), "finish_retry_s": 300}, None),
        ({"episode_timeout_s": -1, "finish_retry_s": 300}, None),
        (["not", "a", "dict"], None),
        (None, None),
    ],
)
def test_a_workers_limit_is_its_episode_timeout_plus_its_finish_retries_plus_the_margin(readyz, limit):
    assert worker_limit_s(readyz) == limit


async def test_by_default_the_trainer_follows_each_worker_and_falls_back_without_a_report():
    answers = {"w1": _ready(3600), "w2": httpx.Response(200, json={"status": "ready"})}
    d = _dispatcher(["http://w1", "http://w2"], httpx.MockTransport(lambda request: answers[request.url.host]))
    assert d.episode_timeout_s("http://w1") == FALLBACK_TIMEOUT_S  # nothing probed yet
    await d.wait_ready(lambda: False)
    assert d.episode_timeout_s("http://w1") == 3600 + 300 + EPISODE_MARGIN_S
    # a worker that reported nothing gets the most any other reported (one run's workers share their config)
    assert d.episode_timeout_s("http://w2") == 3600 + 300 + EPISODE_MARGIN_S
    short = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: _ready(5, 0)))
    await short.wait_ready(lambda: False)
    assert short.episode_timeout_s("http://w1") == 5 + EPISODE_MARGIN_S  # short limits: a hung worker found sooner
    silent = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: httpx.Response(200, text="ok")))
    await silent.wait_ready(lambda: False)
    assert silent.episode_timeout_s("http://w1") == FALLBACK_TIMEOUT_S
    for x in (d, short, silent):
        await x.close()


async def test_an_explicit_timeout_below_a_workers_limit_is_raised_with_a_warning_naming_both_flags(caplog):
    d = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: _ready(3600)), timeout_s=960)
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        await d.wait_ready(lambda: False)
        await d.wait_ready(lambda: False)  # learned once: no second warning
    assert d.episode_timeout_s("http://w1") == 3960
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "--envs.timeout_s 960" in warning and "--envs.episode_timeout_s 3600" in warning
    assert "--envs.finish_retry_s 300" in warning and "waiting 3960 s" in warning
    await d.close()


async def test_an_explicit_timeout_above_a_workers_limit_is_kept_quietly(caplog):
    d = _dispatcher(["http://w1"], httpx.MockTransport(lambda request: _ready(60, 0)), timeout_s=5000)
    with caplog.at_level(logging.INFO, logger="molt.trainer"):
        await d.wait_ready(lambda: False)
    assert d.episode_timeout_s("http://w1") == 5000
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await d.close()


async def test_each_episode_is_sent_with_its_workers_timeout():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return _ready(100, 20)
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, json={"status": "ok", "written": True})

    d = _dispatcher(["http://w1"], httpx.MockTransport(handler), timeout_s=1)
    await d.wait_ready(lambda: False)
    assert (await d.run_episode(dict(BODY)))["written"]
    assert seen == [100 + 20 + EPISODE_MARGIN_S]
    await d.close()


async def test_a_worker_whose_episode_timed_out_is_probed_again_and_its_longer_limit_followed(caplog):
    """A worker restarted with a longer limit (a rolling update of the env workers alone): the episode the old
    timeout cut is retried with the new one."""
    limits = iter([600, 3600])
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return _ready(next(limits))
        seen.append(request.extensions["timeout"]["read"])
        if len(seen) == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"status": "ok", "written": True})

    d = _dispatcher(["http://w1"], httpx.MockTransport(handler), timeout_s=960)
    await d.wait_ready(lambda: False)
    with caplog.at_level(logging.WARNING, logger="molt.trainer"):
        assert (await d.run_episode(dict(BODY)))["written"]
    assert seen == [960, 3960]
    assert any("--envs.episode_timeout_s 3600" in r.getMessage() for r in caplog.records)
    await d.close()


async def test_an_episode_cut_by_the_trainer_says_how_long_it_waited_and_which_flag_sets_it():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ready"})
        raise httpx.ReadTimeout("timed out", request=request)

    d = _dispatcher(["http://w1"], httpx.MockTransport(handler), timeout_s=7, max_retries=0)
    result = await d.run_episode(dict(BODY))
    assert result["status"] == "failed" and not result["written"]
    assert result["error"] == "ReadTimeout: no answer within 7 s (the episode timeout, --envs.timeout_s)"
    await d.close()


async def test_the_real_worker_app_reports_its_limits_and_the_trainer_follows_them(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    settings = EnvsSettings(
        agent=[f"lookup={path}"],
        gateway={"url": "http://fake"},
        envs={"episode_timeout_s": 1800, "finish_retry_s": 120},
    )
    fake = FakeGateway(policy=lambda prompt, turn: "yes")
    app = build_app(settings, gateway_transport=httpx.ASGITransport(app=fake.app))
    d = _dispatcher(["http://w1"], httpx.ASGITransport(app=app))
    await d.wait_ready(lambda: False)
    assert d.episode_timeout_s("http://w1") == 1800 + 120 + EPISODE_MARGIN_S
    await d.close()


def test_the_trainers_flag_is_unset_by_default_and_still_takes_a_value():
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings

    base = ["--model.path", "/m", "--rollout.urls", "http://p", "--envs.urls", "http://w"]
    assert parse_settings(TrainerSettings, base, environ={}).envs.timeout_s is None
    assert parse_settings(TrainerSettings, [*base, "--envs.timeout_s", "4000"], environ={}).envs.timeout_s == 4000
    with pytest.raises(SystemExit):
        parse_settings(TrainerSettings, [*base, "--envs.timeout_s", "0"], environ={})
