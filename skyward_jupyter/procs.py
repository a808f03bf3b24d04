"""Which process is which: start tokens that tell a pid's process from a later one, and ending
a process provably ours (used by the registry for owners' liveness and by providers that reap).

Only processes that are provably the pool's are signalled: the pid must still be the process
recorded (same start time), run ``skyward_jupyter.agent`` and, where the OS names processes
(Linux), carry one of the expected names (``sky-rank-*``, ``sky-template``). A rank goes with
every process below it (DataLoader workers, and what a cell detached: see
:mod:`.agent.descendants`).
"""

from __future__ import annotations

import os
import time

from .agent.descendants import ProcStat, end_tree, parse_stat

_AGENT = b"skyward_jupyter.agent"


def process_start(pid: int) -> str | None:
    """An opaque token for when process ``pid`` started; None when there is no live such process.

    Two tokens are equal only for the same process, so a pid reused by another process does not
    pass for the one recorded. ``"?"``: the process exists, its start time is unknown.
    """
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            seen = parse_stat(stat.read())
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start(pid)
    if seen is None or seen.ended:
        return None  # ended; only its exit status is left for its parent to read
    return f"proc:{seen.start}"


RUNNING_SHARE = 0.1
"""The share of a core a process must use between two looks to count as running."""
_TICKS = 100
"""Clock ticks a second in ``/proc`` (USER_HZ: 100 on every Linux)."""


COMPUTING = "computing"
IN_IO = "in I/O"


def how_it_ran(before: ProcStat | None, after: ProcStat | None, within: float) -> str | None:
    """How a process seen twice, ``within`` seconds apart, ran in between: :data:`COMPUTING`
    (it used a share of a core, or was on a CPU when seen), :data:`IN_IO` (it waited in the
    kernel: a disk, a network filesystem, memory paged out), or None: it did not run (stopped,
    gone, or another process with its pid). Native code holding its GIL keeps a rank's threads
    from answering, not from running.
    """
    if before is None or after is None or before.start != after.start:
        return None
    used = (after.cpu_ticks - before.cpu_ticks) / _TICKS
    if used >= RUNNING_SHARE * within or "R" in (before.state, after.state):
        return COMPUTING
    return IN_IO if "D" in (before.state, after.state) else None


def _psutil_start(pid: int) -> str | None:
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"psutil:{proc.create_time():.2f}"
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return "?"


def process_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is still the process that had start token ``start`` (None: any)."""
    now = process_start(pid)
    if now is None:
        return False
    return start is None or now == "?" or start == "?" or now == start


def _read(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def is_agent(pid: int, start: str | None, names: tuple[bytes, ...]) -> bool:
    """Whether ``pid`` is still the recorded agent process (see the module's rules)."""
    if start is None or not process_alive(pid, start) or process_start(pid) == "?":
        return False  # without a start time a reused pid cannot be told apart: never guess
    cmdline = _read(pid, "cmdline")
    comm = _read(pid, "comm")
    if cmdline is None:
        try:
            import psutil

            proc = psutil.Process(pid)
            return _AGENT in " ".join(proc.cmdline()).encode()
        except Exception:  # noqa: BLE001 - no way to tell (no /proc, no psutil): leave it
            return False
    return _AGENT in cmdline and (comm is None or comm.startswith(names))


def end(targets: dict[int, str | None]) -> list[int]:
    """Kill each target with every process below it, and wait (5 s at most) until they are gone;
    the pids that had to be ended. No SIGTERM first: a rank has no use for one (it dies at once,
    and what it started would be left to init).
    """
    for pid in targets:
        end_tree(pid)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        process_alive(pid, start) for pid, start in targets.items()
    ):
        time.sleep(0.05)
    return list(targets)
