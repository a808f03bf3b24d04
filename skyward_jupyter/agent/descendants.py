"""Every process a rank starts ends with the rank, however detached (double fork, ``setsid``,
``nohup``, ``Popen(start_new_session=True)``).

Process groups and sessions cannot hold such a process (it leaves both), and a cgroup needs
privileges. What holds instead is the tree of processes: a rank is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so whatever a cell detaches is reparented to the rank, not to init,
and stays below it while the rank lives. Whoever ends a rank ends that tree:

- the rank itself on its way out (:func:`end_descendants`: the pool's end, the notebook's, a
  silent notebook);
- a provider that kills the rank (:func:`end_tree`; on a host, this file run as
  ``python -I -S descendants.py PID``);
- the warm template a rank was forked from, itself a subreaper, when the rank died without a word
  (:func:`end_orphans`: what the rank left is reparented to the template).

A tree is frozen (SIGSTOP) until no new process appears in it, then killed: a process that forks
while its parent is being killed would otherwise escape to init. Linux only (``/proc`` and
``prctl``); elsewhere nothing is done. Standard library only: it runs on the nodes, as a file too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

PR_SET_CHILD_SUBREAPER = 36
FREEZE_TIMEOUT = 5.0
"""Seconds to freeze a tree that keeps forking before what was found is killed anyway."""


def become_subreaper() -> None:
    """Keep what this process's descendants detach below it (not inherited by its children)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every live (non-zombie) process: pid -> (parent pid, state letter), from ``/proc``."""
    found: dict[int, tuple[int, bytes]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # ended while we looked
            if fields[0] not in (b"Z", b"X"):  # a zombie holds nothing; its parent reaps it
                found[int(name)] = (int(fields[1]), fields[0])
    return found


def _below(pid: int, processes: dict[int, tuple[int, bytes]]) -> set[int]:
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


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    return _below(pid, _processes())


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    return {child for child, (parent, _) in _processes().items() if parent == pid}


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
    stopped mid-fork shows its child only then), then kill them all."""
    frozen: set[int] = set()
    refused: set[int] = set()
    deadline = time.monotonic() + FREEZE_TIMEOUT
    while time.monotonic() < deadline:
        processes = _processes()
        found = _below(pid, processes)
        new = found - frozen
        if not new and all(processes[p][1] in (b"T", b"t") for p in found - refused):
            break
        refused |= _send(new, signal.SIGSTOP)
        frozen |= new
        if not new:
            time.sleep(0.001)  # a signalled process is not stopped yet: let it take the signal
    _send(frozen, signal.SIGKILL)


def end_tree(pid: int) -> None:
    """Kill ``pid`` and every process below it (the root is frozen first: it forks no more)."""
    _send((pid,), signal.SIGSTOP)
    end_descendants(pid)
    _send((pid,), signal.SIGKILL)


def end_orphans(keep: Iterable[int]) -> None:
    """Kill, with their trees, this process's children other than ``keep`` (in a subreaper
    those are what ended children left behind)."""
    for child in children(os.getpid()) - set(keep):
        end_tree(child)


if __name__ == "__main__":
    end_tree(int(sys.argv[1]))
