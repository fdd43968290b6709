"""Port, URL and Redis URL flags are checked when the flags are parsed: a bad one is one line naming the flag and
the fix, and ``--dry-run`` refuses it the same way. Before, a port past 65535 ended in an OverflowError traceback,
an env worker served with ``--gateway.url notaurl``, and a trainer with ``--rollout.urls notaurl`` waited out
``--rollout.startup_wait_s`` before it failed."""

from __future__ import annotations

import time

import pytest
from pydantic import BaseModel

from molt.config import Port, RedisConfig, Section, ServiceUrl, host_port, http_url, parse_settings, redis_url
from molt.serve import redis_problem, redis_url_problem
from services.envs.config import EnvsSettings
from services.envs.config import validate_settings as validate_envs
from services.gateway.config import GatewaySettings
from services.gateway.config import validate_settings as validate_gateway
from services.rollout.config import RolloutSettings
from services.rollout.config import validate_settings as validate_rollout
from services.trainer.config import TrainerSettings

URL_FIX = "pass one like http://HOST:PORT"
REDIS_FIX = "(schemes: redis://, rediss://, unix://)"


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        (" https://gateway.example/ ", "https://gateway.example"),  # callers append paths
        ("http://pod-a:1/prefix/", "http://pod-a:1/prefix"),
        ("http://[fd00::7]:8080", "http://[fd00::7]:8080"),
        ("HTTP://Host:65535", "HTTP://Host:65535"),  # the scheme is case-blind, as urllib reads it
    ],
)
def test_an_http_url_with_a_host_is_accepted(given, kept):
    assert http_url(given) == kept


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("notaurl", "not an http(s) URL with a host"),
        ("127.0.0.1:8000", "not an http(s) URL with a host"),  # no scheme
        ("localhost:8000", "not an http(s) URL with a host"),  # read as scheme "localhost"
        ("ftp://host:21", "not an http(s) URL with a host"),
        ("http://", "not an http(s) URL with a host"),
        ("http://:8000", "not an http(s) URL with a host"),
        ("http://host:99999", "not an http(s) URL (Port out of range 0-65535)"),
        ("http://host:port", "not an http(s) URL (Port could not be cast to integer value as 'port')"),
    ],
)
def test_anything_else_is_refused_with_an_example(given, why):
    with pytest.raises(ValueError) as err:
        http_url(given)
    assert str(err.value).startswith(why) and URL_FIX in str(err.value)


@pytest.mark.parametrize(
    "given", ["redis://127.0.0.1:6379/0", "rediss://:pw@h:6380/1", "unix:///tmp/r.sock", "memory://"]
)
def test_a_redis_url_of_an_accepted_scheme_is_accepted(given):
    assert redis_url(given) == given


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("http://x", "not a Redis URL; "),
        ("localhost:6379", "not a Redis URL; "),
        ("redis//x", "not a Redis URL; "),
        ("redis://x:99999", "not a Redis URL (Port out of range 0-65535); "),  # redis-py's own parser
        ("redis://x?socket_timeout=soon", "not a Redis URL (Invalid value for 'socket_timeout' in connection URL.); "),
    ],
)
def test_a_malformed_redis_url_is_refused_naming_the_schemes(given, why):
    with pytest.raises(ValueError) as err:
        redis_url(given)
    assert str(err.value).startswith(why) and str(err.value).endswith(REDIS_FIX)


class _Ports(Section):
    port: Port = 0


@pytest.mark.parametrize("port", [0, 1, 8000, 65535])
def test_a_port_in_range_is_accepted(port):
    assert _Ports(port=port).port == port


@pytest.mark.parametrize("port", [-1, 65536, 99999])
def test_a_port_out_of_range_is_refused(port):
    with pytest.raises(ValueError, match=r"not a port number; pass one in 1\.\.65535, or 0 \(the kernel picks"):
        _Ports(port=port)


# Each service's own parse (prog, settings, cross-flag check), so the line is the one its start-up prints.
SERVICES: dict[str, tuple[type[BaseModel], object]] = {
    "rollout": (RolloutSettings, validate_rollout),
    "gateway": (GatewaySettings, validate_gateway),
    "envs": (EnvsSettings, validate_envs),
    "trainer": (TrainerSettings, None),
}
PORT_FIX = "not a port number; pass one in 1..65535, or 0 (the kernel picks a free port)"
BAD_FLAGS = [
    ("rollout", ["--model", "/m", "--port", "99999"], f"--server.port 99999: {PORT_FIX}"),
    ("rollout", ["--model", "/m", "--server.port=-1"], f"--server.port -1: {PORT_FIX}"),
    ("rollout", ["--model", "/m", "--grpc.port", "65536"], "--grpc.port 65536: not a port number; pass one in "),
    ("gateway", ["--model", "/m", "--port", "70000"], f"--server.port 70000: {PORT_FIX}"),
    ("gateway", ["--model", "/m", "--rollout.urls", "http://a:1,notaurl"], "--rollout.urls notaurl: not an http(s)"),
    ("gateway", ["--model", "/m", "--rollout.urls", "http://a:1", "b:2"], "--rollout.urls b:2: not an http(s) URL"),
    (
        "gateway",
        ["--model", "/m", "--replica.public_url", "10.0.0.7:8080", "--auth.api_keys", "k"],
        "--replica.public_url 10.0.0.7:8080: not an http(s) URL",
    ),
    ("gateway", ["--model", "/m", "--redis.url", "http://x"], "--redis.url http://x: not a Redis URL; "),
    ("envs", ["--gateway.url", "notaurl"], f"--gateway.url notaurl: not an http(s) URL with a host; {URL_FIX}"),
    ("envs", ["--gateway.url", "http://gw:1", "--port", "65536"], f"--server.port 65536: {PORT_FIX}"),
    ("trainer", ["--rollout.urls", "notaurl"], f"--rollout.urls notaurl: not an http(s) URL with a host; {URL_FIX}"),
    ("trainer", ["--envs.urls", "ftp://e:1"], "--envs.urls ftp://e:1: not an http(s) URL with a host"),
    ("trainer", ["--metrics.port", "65536"], f"--metrics.port 65536: {PORT_FIX}"),
    ("trainer", ["--port", "-5"], f"--server.port -5: {PORT_FIX}"),
    ("trainer", ["--redis.url", "localhost:6379"], "--redis.url localhost:6379: not a Redis URL; "),
    ("trainer", ["--redis.url", "redis://:hunter2@h:99999"], "--redis.url redis://:***@h:99999: not a Redis URL ("),
]


def _refusal(service: str, argv: list[str], capsys) -> tuple[str, str]:
    settings, validate = SERVICES[service]
    with pytest.raises(SystemExit) as exit_:
        parse_settings(settings, argv, prog=f"python -m services.{service}", environ={}, validate=validate)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    return out, err


@pytest.mark.parametrize(("service", "argv", "expected"), BAD_FLAGS)
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_bad_flag_value_is_one_line_naming_the_flag(service, argv, expected, dry_run, capsys):
    out, err = _refusal(service, [*argv, *(["--dry-run"] if dry_run else [])], capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m services.{service}: error: {expected}"), err
    assert out == "" and "hunter2" not in err  # nothing printed as resolved; a URL's password masked
    if "redis" in expected:
        assert lines[0].endswith(REDIS_FIX)


def test_a_bad_value_from_the_environment_names_its_flag(capsys):
    with pytest.raises(SystemExit):
        parse_settings(RolloutSettings, ["--model", "/m"], environ={"MOLT_SERVER__PORT": "99999"})
    assert f"error: --server.port 99999: {PORT_FIX}" in capsys.readouterr().err


def test_several_bad_flags_are_listed_one_per_line(capsys):
    _, err = _refusal("trainer", ["--envs.urls", "x", "--metrics.port", "70000"], capsys)
    assert err.splitlines() == [
        "python -m services.trainer: error: invalid configuration:",
        f"  --envs.urls x: not an http(s) URL with a host; {URL_FIX}, e.g. http://127.0.0.1:8000",
        f"  --metrics.port 70000: {PORT_FIX}",
    ]


def test_good_values_parse_split_and_without_a_trailing_slash():
    s = TrainerSettings.model_validate(
        {
            "rollout": {"urls": ["http://a:1/, https://b", "http://[::1]:3"]},
            "envs": {"urls": ["http://e:1"]},
            "server": {"port": 65535},
            "metrics": {"port": 0},
            "redis": {"url": "rediss://r:6380/0"},
        }
    )
    assert s.rollout.urls == ["http://a:1", "https://b", "http://[::1]:3"] and s.envs.urls == ["http://e:1"]
    gateway = GatewaySettings.model_validate({"rollout": {"urls": ["http://a:1/ http://b:2"]}})
    assert gateway.rollout.urls == ["http://a:1", "http://b:2"]
    assert EnvsSettings.model_validate({"gateway": {"url": "http://gw:8080/"}}).gateway.url == "http://gw:8080"
    assert RolloutSettings.model_validate({"grpc": {"port": 0}}).grpc.port == 0  # 0: no weight-sync receiver


def test_a_url_list_assigned_later_is_checked_too():
    s = TrainerSettings()
    with pytest.raises(ValueError, match="not an http"):
        s.rollout.urls = ["notaurl"]


@pytest.mark.parametrize(("flag", "url"), [("--redis.url", "http://x"), ("--redis-url", "localhost:6379")])
def test_a_malformed_redis_url_is_final_at_once_not_waited_for(flag, url, capsys):
    started = time.monotonic()
    problem = redis_problem(url, flag, wait_s=60, wait_flag="--redis.startup_wait_s")
    assert time.monotonic() - started < 5  # not the 60 s wait for a Redis to come up
    assert problem == f"{flag} {url}: not a Redis URL; pass one like redis://HOST:6379/0 {REDIS_FIX}"
    assert "waiting up to" not in capsys.readouterr().out
    assert redis_url_problem(url, flag) == problem  # the dry run's check: the same line, no connection


def test_redis_config_leaves_an_unset_url_alone():
    assert RedisConfig().url is None and redis_url_problem(None) is None


def test_the_url_type_checks_any_settings_field():
    class _Urls(Section):
        url: ServiceUrl | None = None

    assert _Urls().url is None and _Urls(url="http://h:1").url == "http://h:1"
    with pytest.raises(ValueError, match="not an http"):
        _Urls(url="h:1")


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "molt-rollout-0.molt-rollout:50051", "[fd00::7]:50051"])
def test_a_grpc_target_is_host_colon_port(target):
    assert host_port(target) == target


@pytest.mark.parametrize("target", ["notahost", "http://pod:50051", "pod:0", "pod:99999", ":50051", "pod:port"])
def test_a_grpc_target_without_host_and_port_is_one_line_naming_the_flag(target, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_settings(TrainerSettings, ["--model.path", "m", "--rollout.grpc_targets", f"127.0.0.1:1,{target}"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"--rollout.grpc_targets {target}: not HOST:PORT with a port in 1..65535; pass one like 127.0.0.1:50051"
        )
    )


def test_a_host_that_cannot_be_bound_is_named_before_start_even_on_port_0():
    from molt.serve import port_problem

    assert port_problem("127.0.0.1", 0) is None
    problem = port_problem("notahost.invalid", 0) or ""  # the resolver's words vary: "Name or service not known"
    assert problem.startswith("--server.port 0: cannot bind notahost.invalid:0 (")
    assert problem.endswith("); check --server.host")
