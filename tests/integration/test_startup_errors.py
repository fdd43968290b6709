"""Start-up mistakes a newcomer makes get one line naming the flag and the fix, before anything loads.

Each service is started as a real process (``python -m services.X``, as the README shows) with a busy port, a
missing model directory or a Redis nobody runs; ``molt up`` with a dead ``--redis-url`` stops before it starts
anything. ``--dry-run`` goes through the same validation as start-up, so a config start-up rejects is rejected
by the dry run with the same message.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from molt.bus.embedded import EmbeddedRedis
from molt.net import free_port
from molt.serve import cpu_env

ROOT = Path(__file__).resolve().parents[2]
AGENT = f"math={ROOT / 'examples' / 'agents' / 'math.py'}"


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=cpu_env({**os.environ, **(env or {})}),
        stdin=subprocess.DEVNULL,
    )


def error_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    """The process failed with exit status 2 and exactly one line on stderr, ``<prog>: error: ...``, and never
    listened."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert " listening on " not in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    return lines[0]


def valid_flags(service: str, model: Path, redis_url: str) -> list[str]:
    """A config each service accepts (it would start with it)."""
    return {
        "rollout": ["--model", str(model)],
        "gateway": ["--model", str(model), "--redis.url", redis_url],
        "envs": ["--agent", AGENT, "--gateway.url", "http://127.0.0.1:9"],
        "trainer": ["--model.path", str(model), "--redis.url", redis_url, "--train.dispatch", "false"],
    }[service]


@pytest.mark.parametrize("service", ["rollout", "gateway", "envs", "trainer"])
def test_a_busy_port_is_one_line_naming_the_flag(service, tiny_qwen3, redis_url):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run([f"services.{service}", *valid_flags(service, tiny_qwen3, redis_url), "--port", str(port)])
    line = error_line(proc, f"python -m services.{service}")
    assert f"--server.port {port}: 127.0.0.1:{port} is already in use; pass a free port" in line


def test_a_busy_weight_sync_port_names_its_flag(tiny_qwen3):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run(["services.rollout", "--model", str(tiny_qwen3), "--grpc.port", str(port)])
    assert f"--grpc.port {port}: 127.0.0.1:{port} is already in use" in error_line(proc, "python -m services.rollout")


@pytest.mark.parametrize("service", ["rollout", "gateway", "trainer"])
def test_a_missing_model_dir_is_one_line_naming_the_flag(service, tmp_path, redis_url):
    missing = tmp_path / "no-such-model"
    proc = run([f"services.{service}", *valid_flags(service, missing, redis_url)])
    line = error_line(proc, f"python -m services.{service}")
    flag = "--actor.model_name_or_path" if service == "trainer" else "--model.path"
    assert f"{flag} {missing}: no such directory; pass a local HF model directory" in line
    assert "python -m molt.models tiny" in line


@pytest.mark.parametrize("service", ["gateway", "trainer"])
def test_an_unreachable_redis_is_one_line_naming_the_flag(service, tiny_qwen3):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = run([f"services.{service}", *valid_flags(service, tiny_qwen3, dead), "--redis.startup_wait_s", "1"])
    line = error_line(proc, f"python -m services.{service}")
    assert f"--redis.url {dead}: Redis does not answer after 1 s (--redis.startup_wait_s)" in line
    assert "start Redis there" in line
    assert f"--redis.url {dead}: waiting up to 1 s (--redis.startup_wait_s; 0 fails at once)" in proc.stdout


@pytest.mark.parametrize("service", ["gateway", "trainer"])
def test_a_service_started_before_its_redis_waits_for_it(service, tiny_qwen3, tmp_path):
    """Kubernetes starts pods in any order: a Redis that comes up within --redis.startup_wait_s is waited for."""
    redis_server = EmbeddedRedis()
    flags = [*valid_flags(service, tiny_qwen3, redis_server.url), "--redis.startup_wait_s", "120", "--port", "0"]
    log_path = tmp_path / "service.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{service}", *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=cpu_env({**os.environ, "PYTHONPATH": str(ROOT)}),
        )
    try:
        deadline = time.monotonic() + 60
        while "waiting up to 120 s" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        redis_server.start()
        listening = re.compile(r" listening on (http://\S+)")
        deadline = time.monotonic() + 120
        while not (found := listening.search(log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert httpx.get(found.group(1) + "/healthz", timeout=10).status_code == 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        redis_server.stop()


def test_an_agent_module_without_an_agent_runner_is_one_line(tmp_path):
    (tmp_path / "empty.py").write_text("x = 1\n")
    proc = run(["services.envs", "--agent", f"e={tmp_path / 'empty.py'}", "--gateway.url", "http://127.0.0.1:9"])
    assert "defines no AgentRunner" in error_line(proc, "python -m services.envs")  # the only line


def test_molt_up_with_a_dead_redis_starts_nothing(tmp_path):
    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    run_dir = tmp_path / "run"
    proc = run(["molt.cli", "up", "--redis-url", dead, "--run-dir", str(run_dir), "--no-progress"])
    line = error_line(proc, "molt")
    assert "--redis-url redis://:***@127.0.0.1:" in line and "Redis does not answer" in line
    assert "hunter2" not in proc.stderr
    assert not run_dir.exists()  # no model built, no log written, no process started


REJECTED = {  # a config each service's start-up rejects, and a piece of the message that names the flag
    "rollout": (["--model", "{model}", "--host", "0.0.0.0"], "MOLT_WEIGHTS_TOKEN"),
    "gateway": (["--redis.url", "{redis}"], "no model: pass --model.path DIR"),
    "envs": (["--gateway.url", "http://127.0.0.1:9"], "no agent to serve: pass --agent NAME=PATH"),
    "trainer": (
        [
            "--model.path",
            "{model}",
            "--redis.url",
            "{redis}",
            "--train.dispatch",
            "false",
            "--algo.advantage.is_correction_level",
            "seq",
            "--algo.advantage.is_correction_mode",
            "clip",
        ],
        "--algo.advantage.is_correction_level seq supports only --algo.advantage.is_correction_mode mask",
    ),
}


@pytest.mark.parametrize("service", sorted(REJECTED))
def test_dry_run_rejects_what_start_up_rejects_with_the_same_message(service, tiny_qwen3, redis_url):
    flags, expected = REJECTED[service]
    args = [f.format(model=tiny_qwen3, redis=redis_url) for f in flags]
    env = {"MOLT_WEIGHTS_TOKEN": ""}  # the rollout case: no token on a public address
    started = run([f"services.{service}", *args], env)
    dry = run([f"services.{service}", *args, "--dry-run"], env)
    line = error_line(started, f"python -m services.{service}")
    assert expected in line
    assert error_line(dry, f"python -m services.{service}") == line
    assert dry.returncode == started.returncode == 2
    assert dry.stdout == ""  # no config printed


@pytest.mark.parametrize("service", ["gateway", "trainer"])
def test_redis_startup_wait_0_fails_at_once_on_an_unreachable_redis(service, tiny_qwen3):
    """README: --redis.startup_wait_s 0 fails at once. The wait line is printed before the first backoff sleep,
    so its absence shows the service never waited, whatever the machine's start-up time."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = run([f"services.{service}", *valid_flags(service, tiny_qwen3, dead), "--redis.startup_wait_s", "0"])
    line = error_line(proc, f"python -m services.{service}")
    assert f"--redis.url {dead}: Redis does not answer (" in line and "start Redis there" in line
    assert "waiting up to" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("variable", ["MOLT_SANDBOX_TMP_BYTES", "PYTHON_EXECUTOR_TIMEOUT"])
def test_a_bad_sandbox_limit_stops_the_env_worker_at_start_up(variable):
    """A tool-sandbox limit that is not a positive number (0 would switch it off) is a start-up error naming
    the variable, not a failure of every tool call later."""
    proc = run(["services.envs", *valid_flags("envs", ROOT, "")], env={variable: "0"})
    assert f"{variable}='0' must be a positive" in error_line(proc, "python -m services.envs")


@pytest.mark.parametrize("service", ["rollout", "envs"])
def test_a_public_address_without_the_service_token_is_one_line_naming_the_fixes(service, tiny_qwen3):
    """docs/deploy.md: a pod or env worker on a non-loopback address without MOLT_INTERNAL_TOKEN exits before
    anything loads, naming the three fixes; --dry-run says the same, and the opt-out flag lets it start."""
    env = {"MOLT_WEIGHTS_TOKEN": "w", "MOLT_INTERNAL_TOKEN": ""}
    args = [f"services.{service}", *valid_flags(service, tiny_qwen3, ""), "--host", "0.0.0.0"]
    line = error_line(run(args, env), f"python -m services.{service}")
    assert line.endswith(
        "anyone who reaches 0.0.0.0: set MOLT_INTERNAL_TOKEN (the token its callers send), bind --server.host "
        "127.0.0.1, or pass --server.allow_unauthenticated"
    )
    assert error_line(run([*args, "--dry-run"], env), f"python -m services.{service}") == line
    allowed = run([*args, "--server.allow_unauthenticated", "--dry-run"], env)
    assert allowed.returncode == 0 and "allow_unauthenticated" in allowed.stdout, allowed.stderr


URL_FIX = "not an http(s) URL with a host; pass one like http://HOST:PORT, e.g. http://127.0.0.1:8000"
BAD_VALUES = {  # a flag value each service refuses as it parses it, and the line's text after "error: "
    "rollout": (
        ["--model", "{model}", "--port", "99999"],
        "--server.port 99999: not a port number; pass one in 1..65535, or 0 (the kernel picks a free port)",
    ),
    "gateway": (
        ["--model", "{model}", "--redis.url", "{redis}", "--rollout.urls", "notaurl"],
        f"--rollout.urls notaurl: {URL_FIX}",
    ),
    "envs": (["--agent", AGENT, "--gateway.url", "notaurl"], f"--gateway.url notaurl: {URL_FIX}"),
    "trainer": (  # before, it waited out --rollout.startup_wait_s for a pod at that "URL"
        [
            "--model.path",
            "{model}",
            "--redis.url",
            "{redis}",
            "--train.dispatch",
            "false",
            "--rollout.urls",
            "notaurl",
        ],
        f"--rollout.urls notaurl: {URL_FIX}",
    ),
}


@pytest.mark.parametrize("service", sorted(BAD_VALUES))
def test_a_port_or_url_flag_out_of_shape_is_one_line_at_once(service, tiny_qwen3, redis_url):
    """A port past 65535 used to end in an OverflowError traceback, a malformed URL in a worker that served and
    failed every call (or a trainer that waited 600 s for it): now each is refused as the flags are parsed,
    by --dry-run too."""
    flags, expected = BAD_VALUES[service]
    args = [f"services.{service}", *(f.format(model=tiny_qwen3, redis=redis_url) for f in flags)]
    started = time.monotonic()
    proc = run([*args, "--rollout.startup_wait_s", "600"] if service == "trainer" else args)
    assert time.monotonic() - started < 60, "waited instead of refusing the flag"
    line = error_line(proc, f"python -m services.{service}")
    assert line == f"python -m services.{service}: error: {expected}"
    dry = run([*args, "--dry-run"])
    assert error_line(dry, f"python -m services.{service}") == line and dry.stdout == ""


REDIS_FIX = "not a Redis URL; pass one like redis://HOST:6379/0 (schemes: redis://, rediss://, unix://)"


@pytest.mark.parametrize(("service", "url"), [("gateway", "http://x"), ("trainer", "localhost:6379")])
def test_a_redis_url_without_a_redis_scheme_fails_at_once_naming_the_schemes(service, url, tiny_qwen3):
    """No Redis can ever answer at such a URL: it is refused at once, not retried for --redis.startup_wait_s."""
    args = [f"services.{service}", *valid_flags(service, tiny_qwen3, url), "--redis.startup_wait_s", "600"]
    started = time.monotonic()
    proc = run(args)
    assert time.monotonic() - started < 60, "waited for a Redis at a malformed URL"
    assert error_line(proc, f"python -m services.{service}").endswith(f"error: --redis.url {url}: {REDIS_FIX}")
    assert "waiting up to" not in proc.stdout, proc.stdout
    assert error_line(run([*args, "--dry-run"]), f"python -m services.{service}").endswith(REDIS_FIX)


@pytest.mark.parametrize("command", [["up"], ["train-rl", "--dry-run"]])
def test_molt_up_with_a_redis_url_without_a_scheme_starts_nothing(command, tmp_path):
    run_dir = tmp_path / "run"
    proc = run(["molt.cli", *command, "--redis-url", "localhost:6379", "--run-dir", str(run_dir), "--no-progress"])
    assert error_line(proc, "molt") == f"molt: error: --redis-url localhost:6379: {REDIS_FIX}"
    assert not run_dir.exists()  # no model built, no log written, no process started
