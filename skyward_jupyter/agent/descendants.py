"""Every process a rank starts ends with the rank, however detached (double fork, ``setsid``,
``nohup``, ``Popen(start_new_session=True)``).

Process groups and sessions cannot hold such a process (it leaves both), and a cgroup needs
privileges. What holds instead is the tree of processes: a rank is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so whatever a cell detaches is reparented to the rank, not to init,
and stays below it while the rank lives. Whoever ends a rank ends that tree:

- the rank itself on its way out (:func:`end_descendants`: the pool's end, the notebook's, a
  silent notebook);
- a provider that kills the rank (:func:`end_rank`; on a host, this file run as
  ``python -I -S descendants.py PID RUN_ID``);
- the warm template a rank was forked from, itself a subreaper, when the rank died without a word
  (:func:`end_orphans`: what the rank left is reparented to the template).

A tree is frozen (SIGSTOP) until no new process appears in it, then killed: a process that forks
while its parent is being killed would otherwise escape to init. Linux only (``/proc`` and
``prctl``); elsewhere nothing is done.

A rank's private directory (torch's ``@record`` error file) goes the same ways: it is
``<tmp>/skyward-<run id>/<pid>`` (:func:`make_private_dir`), so whoever ends a rank knows it from
the pool's run id and the pid. The rank removes it as it ends, :func:`end_rank` after a kill
(the provider's, or this file run as ``descendants.py PID RUN_ID`` on a host), and the pool's
directory goes with the pool: removed by the local provider's release, by a host's template as
it ends, or by whichever rank or kill leaves it empty.

What ``/proc/PID/stat`` says of a process is parsed here alone (:func:`parse_stat`), for the
notebook's looks at its ranks too (:mod:`..procs`, the providers' looks).

Standard library only: it runs on the nodes, as a file too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import NamedTuple

PR_SET_CHILD_SUBREAPER = 36
FREEZE_TIMEOUT = 2.0
"""Seconds to freeze a tree that keeps forking before what was found is killed anyway (a rank
that ends itself does it within the pool's 5 s shutdown grace, before the pool kills it)."""


def become_subreaper() -> None:
    """Keep what this process's descendants detach below it (not inherited by its children)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class ProcStat(NamedTuple):
    """What ``/proc/PID/stat`` says of a process: the fields this package reads."""

    state: str
    """``R`` running, ``D`` in I/O, ``S`` sleeping, ``T`` or ``t`` stopped, ``Z`` ended..."""
    parent: int
    cpu_ticks: int
    """User and system CPU time used so far, in clock ticks."""
    start: int
    """When it started, in clock ticks since boot: tells it from a later one with its pid."""

    @property
    def ended(self) -> bool:
        """A zombie: it holds nothing, only its exit status is left for its parent to read."""
        return self.state in ("Z", "X")


def parse_stat(line: bytes) -> ProcStat | None:
    """A ``/proc/PID/stat`` line, read here or on a host; None for one that is not such a line.
    The command's name, in parentheses, may hold anything: the fields start after the last one.
    """
    _, paren, rest = line.rpartition(b")")
    fields = rest.split()
    if not paren or len(fields) < 20:
        return None
    numbers = (fields[1], fields[11], fields[12], fields[19])
    if not all(f.isdigit() for f in numbers):
        return None
    parent, user, system, start = map(int, numbers)
    return ProcStat(fields[0].decode(errors="replace"), parent, user + system, start)


def read_stat(pid: int | str) -> ProcStat | None:
    """Process ``pid``'s stat; None when it is gone (or ``/proc`` cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return parse_stat(stat_file.read())
    except OSError:
        return None


def _processes() -> dict[int, tuple[int, str]]:
    """Every live (non-zombie) process: pid -> (parent pid, state letter), from ``/proc``."""
    found: dict[int, tuple[int, str]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            seen = read_stat(name)  # None: it ended while we looked
            if seen is not None and not seen.ended:
                found[int(name)] = (seen.parent, seen.state)
    return found


def _below(pid: int, processes: dict[int, tuple[int, str]]) -> set[int]:
    tree: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        tree.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _children_files(pid: int) -> set[int] | None:
    """``pid``'s children from ``/proc/PID/task/*/children``: a read per thread of ``pid``
    rather than one per process of the machine (with hundreds of ranks ending, each reading
    every process's was what their end waited on). None where the kernel has no such file.
    """
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()  # ended
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.update(int(child) for child in f.read().split())
        except FileNotFoundError:
            if os.path.exists(f"/proc/{pid}/task/{task}"):
                return None  # the thread is there, the file is not: no such file here
        except OSError:
            continue  # the thread ended while we looked
    return found


def _state(pid: int) -> str | None:
    """A process's state letter; None when it is gone or a zombie."""
    seen = read_stat(pid)
    return None if seen is None or seen.ended else seen.state


def _tree(pid: int) -> dict[int, tuple[int, str]] | None:
    """The live processes below ``pid``, as :func:`_processes` gives them, read down the tree
    from ``pid``'s children files; None where the kernel has none.
    """
    found: dict[int, tuple[int, str]] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        kids = _children_files(parent)
        if kids is None:
            return None
        for child in kids:
            letter = _state(child)
            if letter is not None and child not in found:
                found[child] = (parent, letter)
                todo.append(child)
    return found


def _around(pid: int) -> dict[int, tuple[int, str]]:
    """The processes :func:`_below` needs to find those below ``pid``: its tree where the
    kernel lists children, else every process.
    """
    tree = _tree(pid)
    return _processes() if tree is None else tree


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    return _below(pid, _around(pid))


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (with one that has ended and is not reaped yet
    where the kernel lists children: a template reaping hundreds of ranks reads no more).
    """
    kids = _children_files(pid)
    if kids is None:
        return {child for child, (parent, _) in _processes().items() if parent == pid}
    return kids


def _send(pids: Iterable[int], sig: signal.Signals) -> set[int]:
    """Signal ``pids``; those that could not be (another user's, a setuid program's)."""
    refused = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        except PermissionError:
            refused.add(pid)
    return refused


def end_descendants(pid: int) -> None:
    """Freeze every process below ``pid`` until all are stopped and none appears any more (one
    stopped mid-fork shows its child only then), then kill them all.
    """
    frozen: set[int] = set()
    refused: set[int] = set()
    deadline = time.monotonic() + FREEZE_TIMEOUT
    while time.monotonic() < deadline:
        processes = _around(pid)
        found = _below(pid, processes)
        new = found - frozen
        if not new and all(processes[p][1] in ("T", "t") for p in found - refused):
            break
        refused |= _send(new, signal.SIGSTOP)
        frozen |= new
        if not new:
            time.sleep(0.001)  # a signalled process is not stopped yet: let it take the signal
    _send(frozen, signal.SIGKILL)
    _await_exit(frozen, deadline + FREEZE_TIMEOUT / 2)


def _await_exit(pids: set[int], deadline: float) -> None:
    """Wait (until ``deadline``) for killed processes to have exited: only then are the files
    and locks they held closed (a copy's lock a forked DataLoader worker inherited).
    """
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if _state(p) is not None}  # a zombie has exited
        if pids:
            time.sleep(0.001)


def end_tree(pid: int) -> None:
    """Kill ``pid`` and every process below it (the root is frozen first: it forks no more)."""
    _send((pid,), signal.SIGSTOP)
    end_descendants(pid)
    _send((pid,), signal.SIGKILL)


def end_orphans(keep: Iterable[int]) -> None:
    """Kill, with their trees, this process's children other than ``keep`` (in a subreaper
    those are what ended children left behind).
    """
    for child in children(os.getpid()) - set(keep):
        end_tree(child)


def end_rank(pid: int, run_id: str | None) -> None:
    """Kill a rank with its tree, and remove its private directory (given its pool's run id)."""
    end_tree(pid)
    if run_id:
        remove_private_dir(private_dir(run_id, pid))


def pool_dir(run_id: str) -> str:
    """The directory of a pool's ranks' private directories on this machine."""
    return os.path.join(tempfile.gettempdir(), f"skyward-{run_id}")


def private_dir(run_id: str, pid: int) -> str:
    return os.path.join(pool_dir(run_id), str(pid))


def make_private_dir(run_id: str) -> str:
    """This process's private directory (mode 0700) in its pool's; a fresh temporary one if the
    pool's directory is not this user's own and private.
    """
    parent, mine = pool_dir(run_id), private_dir(run_id, os.getpid())
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent, 0o700)
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            continue  # an ending rank of the pool removed it as it emptied: make it again
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            break
        shutil.rmtree(mine, ignore_errors=True)  # a rank killed earlier had this pid
        try:
            os.mkdir(mine, 0o700)
        except FileNotFoundError:
            continue  # the pool's directory was removed as it emptied: make it again
        return mine
    return tempfile.mkdtemp(prefix=f"skyward-{run_id}-")


def remove_private_dir(path: str) -> None:
    """Remove a rank's private directory, and its pool's when that leaves it empty."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: other ranks of the pool still run
        os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    end_rank(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
