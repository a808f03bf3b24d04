"""Processes a cell detaches on a rank, the way daemons and careless scripts do, for the tests
that check they end with the rank (tests/test_lifetime.py, tests/test_ssh.py).

Each detached process is a ``sleep`` with a tag of its own as its argument, so a test finds
exactly its own, alive or not, on this machine or in a host's namespace (same pid namespace).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterable
from pathlib import Path


def new_tag() -> str:
    """A ``sleep`` argument no other process has: 1000 seconds and a random fraction."""
    return f"1000.{random.randrange(10**8, 10**9)}"


def detach(tag: str) -> str:
    """A cell that detaches three ``sleep tag`` processes and returns their pids: a daemon's
    double fork (``setsid`` between the forks), ``Popen(start_new_session=True)``, and
    ``nohup ... &`` from a shell that then exits.
    """
    return f"""
import os, subprocess
def _detach():
    pids = []
    read, write = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        second = os.fork()
        if second == 0:
            os.execvp("sleep", ["sleep", "{tag}"])
        os.write(write, str(second).encode())
        os._exit(0)
    os.waitpid(first, 0)
    pids.append(int(os.read(read, 32)))
    os.close(read)
    os.close(write)
    pids.append(subprocess.Popen(["sleep", "{tag}"], start_new_session=True).pid)
    shell = subprocess.run(
        "nohup sleep {tag} >/dev/null 2>&1 & echo $!", shell=True, capture_output=True, text=True
    )
    pids.append(int(shell.stdout))
    return pids
_detach()
"""


def running(tag: str) -> list[int]:
    """The live (non-zombie) processes running ``sleep tag``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "cmdline").read_bytes() != b"sleep\0" + tag.encode() + b"\0":
                continue
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue  # ended while we looked
        if state not in (b"Z", b"X"):
            found.append(int(proc.name))
    return found


def flat(values: Iterable[object]) -> list[int]:
    """The pids every rank returned from :func:`detach`'s cell."""
    return sorted(int(pid) for pids in values for pid in pids)  # type: ignore[attr-defined]


def kill_all(tag: str) -> None:
    """Leave nothing running whatever a test found (called when it ends)."""
    for pid in running(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
