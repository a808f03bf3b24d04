"""How much memory a rank may use, and whether the kernel killed it for lack of memory.

A rank killed by the kernel's OOM killer just ends with SIGKILL. The rank's heartbeat says how
much it held, of how much, and where its cgroup's ``oom_kill`` counter is; after a SIGKILL the
notebook reads that counter again where it can (the rank ran on this machine) and otherwise
judges by the last report, saying that it is a judgement.
"""

from __future__ import annotations

import contextlib
import os

from . import protocol as p

LIKELY_SHARE = 0.5
"""Held this share of its memory at its last report: a SIGKILL is most likely the OOM killer's."""


class MemoryLimits:
    """The memory this process may use, and where the kernel counts its cgroup's OOM kills
    (with the count now), so that a SIGKILL can be told from an out-of-memory kill afterwards.

    cgroup v1's memory controller (``memory.limit_in_bytes``, ``memory.oom_control``) or v2's
    (``memory.max``, ``memory.events``); the machine's total when lower or no cgroup limit.
    Every rank reads this each second, so the files to read are worked out again only when the
    process's cgroup changed (it can be moved to another while it runs).
    """

    def __init__(self) -> None:
        self._total = meminfo("MemTotal")
        self._cgroups: str | None = None
        self._files: tuple[str, str] | None = None
        """(the limit's file, the OOM record) of the cgroup last seen; None: no memory cgroup."""

    def read(self) -> tuple[int | None, str | None, int | None]:
        """(the limit in bytes, the OOM record's path, its count of OOM kills now)."""
        limit = self._total
        try:
            cgroups = read_small("/proc/self/cgroup")
        except OSError:
            return limit, None, None
        if cgroups != self._cgroups:
            self._cgroups, self._files = cgroups, _memory_files(cgroups)
        if self._files is None:
            return limit, None, None
        limit_file, record = self._files
        with contextlib.suppress(OSError, ValueError):
            text = read_small(limit_file).strip()
            if text != "max":
                limit = min(int(text), limit) if limit else int(text)
        return limit, record, oom_kills(record)


def _memory_files(cgroups: str) -> tuple[str, str] | None:
    """The limit's file and the OOM record of the memory cgroup ``/proc/self/cgroup`` names."""
    found = None
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            return f"{base}/memory.limit_in_bytes", f"{base}/memory.oom_control"
        if controllers == "" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
            base = f"/sys/fs/cgroup{path}"
            found = f"{base}/memory.max", f"{base}/memory.events"
    return found


def oom_kills(record: str) -> int | None:
    """The ``oom_kill`` count in a cgroup's ``memory.oom_control`` or ``memory.events``."""
    try:
        lines = read_small(record).splitlines()
        return next(int(line.split()[1]) for line in lines if line.startswith("oom_kill "))
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def read_small(path: str) -> str:
    """A small file of the kernel's (``/proc``, a cgroup's), read with three system calls: a
    rank reads some each second, and Python's text files cost four times as much to open.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def meminfo(field: str) -> int | None:
    """A field of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in bytes; None where the
    machine has no such file or field.
    """
    try:
        with open("/proc/meminfo") as lines:
            return next(
                int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")
            )
    except (OSError, ValueError, StopIteration):
        return None


def named_kill(how: str, usage: p.Usage | None, here: bool) -> str:
    """``how`` a rank ended, with memory named when the evidence points to it: the kernel's
    count of OOM kills rose (``here``: the rank ran on this machine, so its file can be read),
    else the share of its memory it held at its last report.
    """
    if "SIGKILL" not in how or usage is None or not usage.memory_limit_bytes:
        return how
    held = f"it held {_gib(usage.rss_bytes)} of {_gib(usage.memory_limit_bytes)} at its last report"
    if here and usage.oom_record is not None and usage.oom_kills is not None:
        now = oom_kills(usage.oom_record)
        if now is not None:
            if now > usage.oom_kills:
                return f"{how} by the kernel's OOM killer: out of memory ({held})"
            return how
    if usage.rss_bytes >= LIKELY_SHARE * usage.memory_limit_bytes:
        return f"{how}, most likely out of memory: {held}"
    return how


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
