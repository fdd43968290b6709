"""Red-team checks of molt.agents.sandbox on real bubblewrap: memory the address-space limit does not see.

RLIMIT_AS counts mapped memory only. A memfd filled with ``posix_fallocate`` (or a SysV shm segment touched
and detached) holds memory no rlimit counts: tool code could take far past ``PYTHON_EXECUTOR_MEM_BYTES``
(up to RLIMIT_NOFILE x RLIMIT_FSIZE) and push the worker's node into the OOM killer. The sandbox's seccomp
filter refuses those calls, and foreign syscall ABIs (x32) that would route around it. Socket buffers are the
same kind of memory (a socketpair queues MBs in the kernel): the descriptor limit bounds them.

A new user namespace gives the code a full capability set over namespaces of its own (netfilter, mounts: the
kernel surface most privilege escalations go through); docs/envs.md promises no capabilities. The filter
refuses unshare/clone with CLONE_NEWUSER (clone3, whose flags it cannot read, answers ENOSYS and libc falls
back to clone), while threads, fork and subprocesses go on working. The kernel keyring of the sandbox's uid
outlives a call: a key one call adds, the next could read; the filter refuses the keyring calls.
"""

from __future__ import annotations

import platform

import pytest

from molt.agents.sandbox import bwrap_status, run_python, seccomp_program

pytestmark = [
    pytest.mark.skipif(not bwrap_status()[0], reason=f"no OS sandbox on this host: {bwrap_status()[1]}"),
    pytest.mark.skipif(seccomp_program() is None, reason=f"no seccomp filter for {platform.machine()}"),
]

_MEMFD_OVER_LIMIT = r"""
import os
fds = []
try:
    for _ in range(6):  # 6 x 64 MiB: three times the 128 MiB address-space limit
        fd = os.memfd_create("hoard")
        os.posix_fallocate(fd, 0, 64 << 20)
        fds.append(fd)
    print("HELD", len(fds) * 64, "MiB")
except OSError as exc:
    print("REFUSED", type(exc).__name__, exc.errno)
"""


async def test_memfd_cannot_hold_memory_past_the_address_space_limit():
    r = await run_python(_MEMFD_OVER_LIMIT, timeout_s=20, mem_bytes=128 << 20)
    assert "HELD" not in r.stdout, r.as_observation()
    assert r.stdout.startswith("REFUSED PermissionError 1"), r.as_observation()


async def test_sysv_shm_and_the_x32_abi_are_refused():
    code = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("shmget", libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())
if __import__("platform").machine() == "x86_64":
    print("x32", libc.syscall(0x40000000 | 319, b"x", 0), ctypes.get_errno())
"""
    r = await run_python(code, timeout_s=20)
    assert r.exit_code == 0, r.as_observation()
    assert "shmget -1 1" in r.stdout, r.stdout
    if platform.machine() == "x86_64":
        assert "x32 -1 1" in r.stdout, r.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 ABI is x86_64's foreign one")
async def test_the_i386_abi_and_memfd_secret_are_refused():
    """An `int 0x80` call enters the kernel through the i386 ABI, whose syscall numbers the filter does not list
    (i386 getpid is 20, x86_64's 20 is writev): the arch check refuses it whole. Outside the sandbox the same
    code gets its pid and memfd_secret a file descriptor."""
    code = r"""
import ctypes, mmap
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20 (i386 getpid); int 0x80; ret
print("i386", ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))())
libc = ctypes.CDLL(None, use_errno=True)
print("memfd_secret", libc.syscall(447, 0), ctypes.get_errno())
"""
    r = await run_python(code, timeout_s=20)
    assert r.exit_code == 0, r.as_observation()
    assert r.stdout.splitlines() == ["i386 -1", "memfd_secret -1 1"], r.stdout


async def test_ordinary_tool_code_still_runs_under_the_filter():
    code = r"""
import os, subprocess, threading, numpy
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start()
t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print(int(numpy.arange(4).sum()), subprocess.run(["true"]).returncode, box, os.waitpid(pid, 0)[1] >> 8)
"""
    r = await run_python(code, timeout_s=20)
    assert (r.stdout, r.exit_code) == ("6 0 [1] 7\n", 0), r.as_observation()


async def test_tool_code_cannot_make_a_user_namespace_and_regain_capabilities():
    code = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
rc = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
print("unshare", rc, ctypes.get_errno())
nr_clone = {"x86_64": 56, "aarch64": 220}[__import__("platform").machine()]
pid = libc.syscall(nr_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
print("clone", pid, ctypes.get_errno())
"""
    r = await run_python(code, timeout_s=20)
    assert r.exit_code == 0, r.as_observation()
    assert "unshare -1 1" in r.stdout and "clone -1 1" in r.stdout, r.stdout


async def test_socketpairs_stop_at_the_descriptor_limit():
    """No bytes are queued here: only how many socketpairs one process may hold (each can queue MBs)."""
    code = r"""
import socket
pairs = []
try:
    while len(pairs) < 2000:
        pairs.append(socket.socketpair())
except OSError as exc:
    print("stopped", len(pairs), exc.errno)
else:
    print("held", len(pairs))
"""
    r = await run_python(code, timeout_s=20)
    assert r.stdout.startswith("stopped"), r.as_observation()
    assert int(r.stdout.split()[1]) < 130, r.stdout


async def test_a_key_stashed_in_the_kernel_keyring_does_not_reach_the_next_call():
    stash = r"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 248, "aarch64": 217}[platform.machine()]
print("add_key", libc.syscall(nr, b"user", b"molt-stash", b"from-call-1", 11, -4), ctypes.get_errno())
"""
    look = r"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 249, "aarch64": 218}[platform.machine()]
print("request_key", libc.syscall(nr, b"user", b"molt-stash", None, 0), ctypes.get_errno())
"""
    first = await run_python(stash, timeout_s=20)
    second = await run_python(look, timeout_s=20)
    assert first.stdout == "add_key -1 1\n", first.as_observation()
    assert second.stdout.startswith("request_key -1 "), second.as_observation()
