"""Intel AMX on CPU pods: the tile state has to be asked for before the first AMX instruction.

vLLM's CPU attention takes its AMX kernel for bf16 whenever the CPU advertises AMX tiles, but Linux hands a
process the tile registers only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; without that
the first bf16 request kills the pod with SIGILL. The permission is per process and does not survive exec,
so each process that runs the model asks (services/rollout/worker_ext.py does, on import).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

from services.rollout.cpu_dtype import cpu_flags

log = logging.getLogger("molt.rollout")

# Linux x86-64 ABI (arch/x86/include/uapi/asm/prctl.h, asm/unistd_64.h): the syscall number, the request and
# the xstate component of AMX tile data.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx_tiles() -> bool:
    """The CPU advertises AMX tiles (``amx_tile`` in /proc/cpuinfo's flags)."""
    return "amx_tile" in cpu_flags()


def request_amx_permission() -> bool:
    """Ask for the AMX tile state where the CPU has it; True when granted (or already held)."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or not cpu_has_amx_tiles():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return True
    # The kernel refused (too old, or AMX disabled by the hypervisor): bf16 attention may then die with SIGILL.
    log.warning(
        "the CPU advertises AMX but Linux refused its tile state (errno %d); serve with --vllm.dtype float32 "
        "if bf16 requests crash the pod",
        ctypes.get_errno(),
    )
    return False
