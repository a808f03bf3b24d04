"""gloo's network threads run a little behind the rank's training, never in its way.

Each gloo group has one thread (``gloo_tcp_loop``) that polls the group's sockets. While a
peer's bytes have arrived for a buffer this rank has not posted yet, the thread spins: tens of
thousands of ``epoll_wait`` a second, a whole core for as long as the rank takes to reach the
collective. On a CPU-bound rank that core is the training thread's, which then reaches the
collective later still. A nice value 5 above the rank's keeps the thread running whenever a core
is free and still gives it a quarter of a contended one, so messages keep flowing.

What it changes in steps per second and in the loop's CPU per step is measured beside torchrun
in BENCHMARKS.md ("Bring your own code", and "Measurements behind the code").

The rank lowers the threads of its own group as it forms and, at each watchdog tick, those of
groups the user's code forms. It finds the thread by the name gloo gives it in the torch this
project pins (2.13); a build whose gloo leaves it unnamed keeps it as it is. Raising a thread's
own nice value needs no privilege; a system that refuses it, or lacks the calls, is asked no
more. Nothing here may raise: the watchdog thread that calls it ends the rank when it dies.
"""

from __future__ import annotations

import errno
import os
import threading
import time

LOOP_THREAD = b"gloo_tcp_loop"
"""The name gloo's TCP transport gives its event-loop thread, as ``/proc`` shows it."""
NICE_ABOVE_RANK = 5
NAMED_WITHIN = 0.2
"""Seconds after a thread is first seen by which it has its name (a thread is named as it
starts): one still under another name then is not gloo's loop."""
_TASKS = "/proc/self/task"


class LoopPriority:
    """Lowers each gloo event-loop thread of this process once, to the rank's nice value at that
    moment + 5.
    """

    def __init__(self) -> None:
        self._usable = os.path.isdir(_TASKS) and hasattr(os, "setpriority")
        self._lock = threading.Lock()
        self._decided: set[int] = set()
        """Threads lowered, or known not to be a loop thread."""
        self._first_seen: dict[int, float] = {}
        """Threads seen under another name, and when they were first seen."""

    def lower(self) -> None:
        """Lower the loop threads not lowered yet: any thread may call this, at any time; a
        call that finds no new thread costs one directory listing.
        """
        if not self._usable:
            return
        with self._lock:
            try:
                tids = {int(tid) for tid in os.listdir(_TASKS)}
                now = time.monotonic()
                self._decided &= tids
                self._first_seen = {t: s for t, s in self._first_seen.items() if t in tids}
                for tid in tids - self._decided:
                    self._look_at(tid, now)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    return  # out of descriptors or memory for now: the next tick tries again
                self._usable = False  # refused or unsupported (a sandbox): gloo's as they are

    def _look_at(self, tid: int, now: float) -> None:
        try:
            with open(f"{_TASKS}/{tid}/comm", "rb") as f:
                name = f.read().strip()
            if name == LOOP_THREAD:
                target = min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + NICE_ABOVE_RANK, 19)
                if os.getpriority(os.PRIO_PROCESS, tid) < target:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                self._decided.add(tid)
            elif now - self._first_seen.setdefault(tid, now) >= NAMED_WITHIN:
                self._decided.add(tid)
        except (FileNotFoundError, ProcessLookupError):
            self._decided.add(tid)  # it ended meanwhile (its group was destroyed)
