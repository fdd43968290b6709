"""molt.agents.sandbox: tool code runs OS-isolated (bubblewrap); every escape of the old audit hook fails.

Real child processes on this host (no fakes): each escape that worked against the audit-hook sandbox
(switching the hook off, a connection to Redis, subprocesses and fork bombs, the worker's env and
/proc/<pid>/environ, writes into the project, a setsid double-forked child outliving the timeout) is
tried again here and must fail, while ordinary tool code still prints its result.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from molt.agents import sandbox
from molt.agents.sandbox import SandboxSupport, SandboxUnavailable, bwrap_status, run_python

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not bwrap_status()[0], reason=f"no OS sandbox on this host: {bwrap_status()[1]}")


@pytest.fixture(params=["with /proc", "without /proc"])
def proc_mode(request, monkeypatch):
    """Both ways the sandbox runs: with its own /proc, and without one (containers that forbid mounting it)."""
    with_proc = request.param == "with /proc"
    if with_proc and not bwrap_status().with_proc:
        pytest.skip("this host cannot mount a /proc in the sandbox")
    monkeypatch.setattr(sandbox, "bwrap_status", lambda: SandboxSupport(True, "", with_proc))
    return with_proc


def _alive_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (a sandbox child that outlived its call)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _gone(marker: str, grace_s: float = 3.0) -> bool:
    deadline = time.monotonic() + grace_s
    while _alive_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_stdout_stderr_and_exit_code():
    r = await run_python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("42\n", "oops\n", 3, False)
    assert r.as_observation() == "42\n\noops"


async def test_ordinary_tool_code_still_works(proc_mode):
    code = (
        "import math, numpy, sympy\nx = sympy.symbols('x')\nprint(sorted(sympy.solve(x**2 - 4, x)), "
        "int(numpy.arange(5).sum()), math.isqrt(49))\nopen('scratch.txt', 'w').write('kept')\n"
        "print(open('scratch.txt').read())"
    )
    r = await run_python(code)
    assert r.ok and r.stdout == "[-2, 2] 10 7\nkept\n", r.stderr


async def test_runs_as_nobody_with_a_clean_environment(monkeypatch, proc_mode):
    monkeypatch.setenv("MOLT_GATEWAY__API_KEY", "sk-worker-secret")
    r = await run_python("import os\nprint(os.getuid(), os.getgid(), os.getcwd())\nprint(sorted(os.environ))")
    uid_line, env_line = r.stdout.splitlines()
    assert uid_line == "65534 65534 /tmp"
    assert "sk-worker-secret" not in r.stdout and "MOLT_GATEWAY__API_KEY" not in env_line


async def test_worker_env_and_proc_are_out_of_reach(monkeypatch, proc_mode):
    monkeypatch.setenv("MOLT_GATEWAY__API_KEY", "sk-worker-secret")
    code = (
        f"import glob, os\ntry:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as e:\n    print('worker environ:', type(e).__name__)\n"
        "seen = b''\nfor p in glob.glob('/proc/[0-9]*/environ'):\n    try:\n        seen += open(p, 'rb').read()\n"
        "    except OSError:\n        pass\n"
        "print(b'sk-worker-secret' in seen, sorted(int(p.split('/')[2]) for p in glob.glob('/proc/[0-9]*')))"
    )
    r = await run_python(code)
    assert "sk-worker-secret" not in r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "worker environ: FileNotFoundError" and lines[1].startswith("False [")
    pids = eval(lines[1].split(" ", 1)[1])
    assert (pids[:2] == [1, 2] and max(pids) < 10) if proc_mode else pids == []  # only the sandbox's own pids


# One line that switches the audit hook off: its blocklist is a default argument, reachable through gc.
UNHOOK = (
    "import gc\nfor f in gc.get_objects():\n    if getattr(f, '__name__', '') == '_fence': f.__defaults__ = ((),)\n"
)


async def test_disabling_the_old_hook_frees_nothing(redis_url):
    """A tool call that switches the audit hook off, then talks to the trajectory store (Redis)."""
    redis_port = urlparse(redis_url).port
    code = (
        UNHOOK + f"import socket\ns = socket.create_connection(('127.0.0.1', {redis_port}), timeout=2)\n"
        "s.sendall(b'PING\\r\\n')\nprint('reached redis', s.recv(16))"
    )
    # Isolation "none" (the old sandbox, kept as an explicit opt-out for trusted code) falls to the line ...
    if urlparse(redis_url).hostname in ("127.0.0.1", "localhost"):
        assert "reached redis b'+PONG" in (await run_python(code, isolation="none")).stdout
    # ... the OS sandbox has no hook to lift: the connection fails in its own network namespace.
    r = await run_python(code)
    assert "reached redis" not in r.stdout and r.exit_code == 1 and "ConnectionRefusedError" in r.stderr


async def test_no_network():
    """A connect to a listening loopback port fails inside the sandbox and never reaches the listener."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(0.2)
        port = srv.getsockname()[1]
        r = await run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        assert "connected" not in r.stdout and r.exit_code == 1 and "ConnectionRefusedError" in r.stderr
        with pytest.raises(TimeoutError):
            srv.accept()
        r = await run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
        assert r.exit_code == 1 and "Network is unreachable" in r.stderr


async def test_subprocesses_work_and_fork_bombs_are_bounded(monkeypatch, proc_mode):
    monkeypatch.setenv("MOLT_SANDBOX_MAX_PROCS", "16")
    r = await run_python("import subprocess\nprint(subprocess.run(['id', '-u'], capture_output=True).stdout.decode())")
    assert r.ok and r.stdout.strip() == "65534", r.stderr
    marker = f"molt-bomb-{uuid.uuid4().hex}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}]"
    code = (
        "import os, sys\nn = 0\ntry:\n    for _ in range(500):\n        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, {sleeper})\n"
        "        n += 1\nexcept OSError as e:\n    print('refused after', n, type(e).__name__)"
    )
    r = await run_python(code, timeout_s=20)
    assert r.stdout.startswith("refused after") and int(r.stdout.split()[2]) < 16, (r.stdout, r.stderr)
    assert _gone(marker)  # the sleepers died with the sandbox when its program ended


async def test_no_writes_outside_the_scratch_dir():
    target = ROOT / f"escape-{uuid.uuid4().hex}.txt"
    site = Path(os.__file__).parent / f"escape-{uuid.uuid4().hex}.py"
    for path in (target, site, Path("/usr") / target.name):
        r = await run_python(f"open({str(path)!r}, 'w').write('pwned')")
        assert r.exit_code == 1 and (
            "Read-only file system" in r.stderr or "No such file" in r.stderr or "Permission denied" in r.stderr
        ), r.stderr
        assert not path.exists()


async def test_file_size_and_memory_limits():
    r = await run_python("open('big', 'wb').write(b'x' * (80 << 20))")
    assert r.exit_code != 0 and (
        "File too large" in r.stderr or "No space left" in r.stderr or "MemoryError" in r.stderr
    ), r.stderr
    r = await run_python("x = bytearray(1 << 30)\nprint('allocated')", mem_bytes=256 << 20)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


async def test_a_setsid_double_forked_child_does_not_outlive_the_timeout(proc_mode):
    marker = f"molt-orphan-{uuid.uuid4().hex}"
    code = (
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\nprint('start', flush=True)\ntime.sleep(60)"
    )
    r = await run_python(code, timeout_s=1.5)
    assert r.timed_out and r.exit_code is None and r.stdout == "start\n"
    assert r.as_observation().endswith("TimeoutError: execution timed out")
    assert _gone(marker)


async def test_output_limit(monkeypatch):
    monkeypatch.setenv("PYTHON_EXECUTOR_OUTPUT_CHARS", "100")
    r = await run_python("print('a' * 100000)")
    assert r.truncated and r.stdout.startswith("a" * 100) and len(r.stdout) < 150


async def test_without_a_usable_sandbox_the_call_is_refused_unless_isolation_none(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_binary", lambda: "/nonexistent/bwrap")
    sandbox.bwrap_status.cache_clear()
    try:
        assert bwrap_status()[0] is False
        with pytest.raises(SandboxUnavailable, match="--sandbox.isolation none"):
            await run_python("print(1)")
        monkeypatch.setenv("MOLT_SANDBOX__ISOLATION", "none")  # the explicit opt-out: trusted code only
        r = await run_python("import socket\nsocket.socket()")
        assert r.exit_code == 1 and "blocked in the sandbox" in r.stderr
        assert (await run_python("print(6 * 7)")).stdout == "42\n"
    finally:
        sandbox.bwrap_status.cache_clear()
    with pytest.raises(ValueError, match="auto, bwrap or none"):
        await run_python("print(1)", isolation="chroot")


async def test_the_env_workers_flag_reaches_the_tool_calls(monkeypatch):
    from services.envs.__main__ import configure_sandbox

    monkeypatch.delenv("MOLT_SANDBOX__ISOLATION", raising=False)
    configure_sandbox("none")
    assert "blocked in the sandbox" in (await run_python("import socket\nsocket.socket()")).stderr
    configure_sandbox("auto")
    assert (
        "ConnectionRefusedError"
        in (await run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))")).stderr
    )


def test_an_interpreter_under_tmp_is_bound_over_the_scratch_tmpfs_not_hidden_by_it(monkeypatch):
    """A checkout under /tmp (its venv there): the tmpfs comes first and the venv is bound on top of it, and /tmp
    keeps its 1777 mode (the sandbox user writes its scratch files there)."""
    monkeypatch.setattr(sandbox.sys, "prefix", "/tmp/ci/.venv")
    argv, _ = sandbox._bwrap_argv("bwrap", 1 << 20)
    tmpfs = argv.index("--tmpfs")
    bind = next(i for i in range(len(argv) - 2) if argv[i : i + 3] == ["--ro-bind", "/tmp/ci/.venv", "/tmp/ci/.venv"])
    assert argv[tmpfs + 1] == "/tmp" and tmpfs < bind
    assert ["--dir", "/tmp"] not in [argv[i : i + 2] for i in range(len(argv) - 1)]
    pairs = [argv[i : i + 2] for i in range(tmpfs, len(argv) - 1)]
    assert ["--dir", "/tmp/ci"] in pairs  # its parent made reachable (0755) inside the tmpfs
