"""Sandboxed Python execution for tool envs: a subprocess with time, memory and output limits, no network.

Model-written code never runs in the worker. Each call starts ``python -I`` in a fresh temp dir and
process group, with:
- time: a wall-clock limit, after which the whole process group is killed (plus RLIMIT_CPU);
- memory: RLIMIT_AS (soft limit, hard = 1.5x, as Molt's executor) and RLIMIT_FSIZE for files;
- output: stdout and stderr are each cut to ``output_chars`` (the rest is drained and dropped);
- network: a fresh network namespace (``unshare -n``: only a downed loopback exists) when the worker
  may create one (root / CAP_SYS_ADMIN), else an audit hook in the child that refuses socket use
  (best effort: the namespace is the real fence);
- processes: an audit hook refuses subprocesses, fork and ctypes in both modes.

Defaults come from Molt's ``PYTHON_EXECUTOR_TIMEOUT`` (10 s), ``PYTHON_EXECUTOR_MEM_BYTES`` (1 GiB)
and ``PYTHON_EXECUTOR_OUTPUT_CHARS`` (2048).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

Isolation = Literal["auto", "netns", "audit"]

# Runs in the child before the user's code (read from stdin): limits first, then the network fence.
_BOOTSTRAP = r"""
import resource, sys
soft_as, cpu_s, fsize, block_net = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
resource.setrlimit(resource.RLIMIT_AS, (soft_as, soft_as * 3 // 2))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
source = sys.stdin.read()
sys.stdin.close()
_blocked = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "pty.spawn",
            "ctypes.dlopen", "ctypes.cdata")
if block_net:
    _blocked += ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto")
def _fence(event, args, _blocked=_blocked):
    if event.startswith(_blocked):
        raise PermissionError(f"blocked in the sandbox: {event} (no network, no new processes)")
sys.addaudithook(_fence)
del _fence, _blocked
del resource, soft_as, cpu_s, fsize, block_net
exec(compile(source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """Process exit status; negative for a signal; None if killed on timeout."""
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def as_observation(self) -> str:
        """stdout, then stderr, then a note on a timeout: the text a tool env feeds back to the model."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        if self.timed_out:
            parts.append("TimeoutError: execution timed out")
        return "\n".join(p for p in parts if p).rstrip("\n")


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """True if this process may run a child in a fresh network namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _env_default(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


async def _read_capped(stream: asyncio.StreamReader, cap_bytes: int) -> tuple[bytes, bool]:
    kept = bytearray()
    cut = False
    while chunk := await stream.read(65536):
        room = cap_bytes - len(kept)
        if len(chunk) > room:
            cut = True
        kept += chunk[: max(room, 0)]
    return bytes(kept), cut


def _clip(raw: bytes, chars: int) -> tuple[str, bool]:
    text = raw.decode("utf-8", errors="replace")
    if len(text) <= chars:
        return text, False
    return text[:chars] + f"\n...[truncated to {chars} chars]", True


async def run_python(
    code: str,
    timeout_s: float | None = None,
    mem_bytes: int | None = None,
    output_chars: int | None = None,
    isolation: Isolation = "auto",
) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess and return what it printed."""
    timeout_s = timeout_s if timeout_s is not None else _env_default("PYTHON_EXECUTOR_TIMEOUT", 10.0)
    mem_bytes = int(mem_bytes if mem_bytes is not None else _env_default("PYTHON_EXECUTOR_MEM_BYTES", 1 << 30))
    if output_chars is None:
        output_chars = int(_env_default("PYTHON_EXECUTOR_OUTPUT_CHARS", 2048))
    if isolation == "auto":
        isolation = "netns" if netns_available() else "audit"
    if isolation == "netns" and not netns_available():
        raise ValueError("isolation='netns' needs `unshare -n` (root or CAP_SYS_ADMIN); use 'auto' or 'audit'")
    cpu_s = max(1, int(timeout_s) + 1)
    # The audit hook always refuses new processes (they could outlive the kill of the group); it refuses
    # sockets only when there is no namespace to do it.
    block_net = "0" if isolation == "netns" else "1"
    argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(mem_bytes), str(cpu_s), str(64 << 20), block_net]
    if isolation == "netns":
        argv = [shutil.which("unshare") or "unshare", "-n", "--"] + argv
    with tempfile.TemporaryDirectory(prefix="molt-sandbox-") as workdir:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"},
        )
        cap_bytes = output_chars * 4 + 64  # utf-8: at most 4 bytes a char
        readers = asyncio.ensure_future(
            asyncio.gather(_read_capped(proc.stdout, cap_bytes), _read_capped(proc.stderr, cap_bytes)))
        timed_out = False
        try:
            proc.stdin.write(code.encode("utf-8"))
            await proc.stdin.drain()
            proc.stdin.close()
            async with asyncio.timeout(timeout_s):
                (out, cut_out), (err, cut_err) = await asyncio.shield(readers)
                exit_code = await proc.wait()
        except (TimeoutError, BrokenPipeError, ConnectionResetError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            _kill_group(proc)
            await proc.wait()
            (out, cut_out), (err, cut_err) = await readers
            exit_code = None if timed_out else proc.returncode
        except BaseException:  # cancelled (episode timeout): never leave the child behind
            _kill_group(proc)
            readers.cancel()
            raise
    stdout, clip_out = _clip(out, output_chars)
    stderr, clip_err = _clip(err, output_chars)
    return SandboxResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err or clip_out or clip_err)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
