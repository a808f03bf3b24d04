"""gloo's network threads run a little behind the rank's training, never in its way.

Each gloo group has one thread (``gloo_tcp_loop``) that polls the group's sockets. While a
peer's bytes have arrived for a buffer this rank has not posted yet, the thread spins: tens of
thousands of ``epoll_wait`` a second, a whole core for as long as the rank takes to reach the
collective. On a CPU-bound rank that core is the training thread's, which then reaches the
collective later still. A nice value 5 above the rank's keeps the thread running whenever a core
is free and still gives it a quarter of a contended one, so messages keep flowing.

Measured by ``make bench`` (``bench/bench_byo.py``, 2 ranks on 2 cores, torchrun's workers
keeping the thread at nice 0): a plain DDP loop went from 0.96-0.98 of torchrun's steps per
second to 1.18-1.23, the Hugging Face Trainer from 0.93 to 0.96-1.02 (two runs); rank 0's loop
used 0.47 ms of CPU per DDP step against torchrun's 0.75.

The rank lowers the threads of its own group as it forms and, at each watchdog tick, those of
groups the user's code forms. Raising a thread's own nice value needs no privilege; a system
that refuses it anyway is asked no more.
"""

from __future__ import annotations

import os
import threading

LOOP_THREAD = "gloo_tcp_loop"
"""The name gloo's TCP transport gives its event-loop thread (``Loop`` in ``tcp/loop.cc``)."""
NICE_ABOVE_RANK = 5
_TASKS = "/proc/self/task"


class LoopPriority:
    """Keeps every gloo event-loop thread of this process at the rank's nice value + 5."""

    def __init__(self) -> None:
        self._usable = os.path.isdir(_TASKS) and hasattr(os, "setpriority")
        self._lock = threading.Lock()
        self._settled: set[int] = set()
        """Threads lowered, or seen twice under another name (a thread is named as it
        starts, so one seen a scan ago under another name is not gloo's loop)."""
        self._seen_once: set[int] = set()

    def lower(self) -> None:
        """Lower the loop threads not lowered yet: any thread may call this, at any time; a
        call that finds no new thread costs one directory listing."""
        if not self._usable:
            return
        with self._lock:
            tids = {int(tid) for tid in os.listdir(_TASKS)}
            self._settled &= tids
            self._seen_once &= tids
            for tid in tids - self._settled:
                try:
                    if self._lower(tid) or tid in self._seen_once:
                        self._settled.add(tid)
                    else:
                        self._seen_once.add(tid)
                except (FileNotFoundError, ProcessLookupError):
                    continue  # the thread ended meanwhile (its group was destroyed)
                except PermissionError:
                    self._usable = False  # a sandbox that refuses: threads stay as gloo made them
                    return

    @staticmethod
    def _lower(tid: int) -> bool:
        """Lower ``tid`` if it is a loop thread (True), else leave it (False)."""
        with open(f"{_TASKS}/{tid}/comm") as f:
            if f.read().strip() != LOOP_THREAD:
                return False
        target = min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + NICE_ABOVE_RANK, 19)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return True
