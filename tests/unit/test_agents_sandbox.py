"""molt.agents.sandbox: time, memory, output and network limits of the tool subprocess."""

from __future__ import annotations

import socket

import pytest

from molt.agents.sandbox import netns_available, run_python

MODES = ["audit"] + (["netns"] if netns_available() else [])


async def test_stdout_stderr_and_exit_code():
    r = await run_python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("42\n", "oops\n", 3, False)
    assert r.as_observation() == "42\n\noops"


@pytest.mark.parametrize("isolation", MODES)
async def test_no_network(isolation):
    """A connect to a listening loopback port fails inside the sandbox and never reaches the listener."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(0.2)
        port = srv.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        r = await run_python(code, isolation=isolation)
        assert "connected" not in r.stdout and r.exit_code == 1
        assert ("Network is unreachable" if isolation == "netns" else "blocked in the sandbox") in r.stderr
        with pytest.raises(TimeoutError):
            srv.accept()


async def test_no_subprocess():
    r = await run_python("import subprocess\nsubprocess.run(['true'])")
    assert r.exit_code == 1 and "blocked in the sandbox: subprocess.Popen" in r.stderr


async def test_time_limit_kills_the_process():
    r = await run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", timeout_s=0.5)
    assert r.timed_out and r.exit_code is None and r.stdout == "start\n"
    assert r.as_observation().endswith("TimeoutError: execution timed out")


async def test_memory_limit():
    r = await run_python("x = bytearray(1 << 30)\nprint('allocated')", mem_bytes=256 << 20)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


async def test_output_limit(monkeypatch):
    monkeypatch.setenv("PYTHON_EXECUTOR_OUTPUT_CHARS", "100")
    r = await run_python("print('a' * 100000)")
    assert r.truncated and r.stdout.startswith("a" * 100) and len(r.stdout) < 150
