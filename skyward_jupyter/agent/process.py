"""The rank's own process as the operating system sees it: its name, its C stdio, its usage.

These are the agent's few reaches below Python: ``prctl`` names the process so ``ps`` and
``top`` tell ranks from other Pythons, ``fflush`` pushes out what C code buffered before output
is synced, and ``/proc`` and torch's CUDA counters give the usage the panel shows. Each does
nothing, rather than fail, where the platform lacks it.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import functools
import os
import sys
import termios
import time

from .. import protocol as p
from ..memory import MemoryLimits, read_small


class UsageMeter:
    """CPU share since the last sample, resident memory, and GPU memory once CUDA is in use.

    It never initialises CUDA itself (that would take GPU memory on a rank that uses none).
    """

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._wall = time.monotonic()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._memory = MemoryLimits()

    def sample(self, torch_ready: bool) -> p.Usage:
        cpu, wall = time.process_time(), time.monotonic()
        percent = 100.0 * (cpu - self._cpu) / max(wall - self._wall, 1e-6)
        self._cpu, self._wall = cpu, wall
        try:
            rss = int(read_small("/proc/self/statm").split()[1]) * self._page
        except OSError:
            rss = 0
        gpu_memory, gpu_util = None, None
        torch = sys.modules.get("torch") if torch_ready else None
        if torch is not None and torch.cuda.is_initialized():
            gpu_memory = int(torch.cuda.memory_reserved())
            with contextlib.suppress(ImportError, RuntimeError):  # needs NVML, maybe absent
                gpu_util = float(torch.cuda.utilization())
        limit, record, kills = self._memory.read()
        return p.Usage(
            percent,
            rss,
            gpu_memory,
            gpu_util,
            memory_limit_bytes=limit,
            oom_record=record,
            oom_kills=kills,
        )


def set_process_name(name: str) -> None:
    """Name the process as ``ps``/``top`` show it, so a user can tell ranks from other Pythons."""
    libc = _libc()
    if libc is not None and sys.platform.startswith("linux"):
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None  # no C library to flush (not Linux/macOS); Python's own streams still are


def flush_c_stdio() -> None:
    """Flush C's stdio buffers (a C extension's ``printf``) into the captured descriptors."""
    libc = _libc()
    if libc is not None:
        libc.fflush(None)


def unread_bytes(fd: int) -> int:
    """Bytes waiting in the pipe or socket ``fd`` that nobody has read yet (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]
