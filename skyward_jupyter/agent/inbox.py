"""Who reads a rank's wire: the main thread while it waits for a command, the reader thread while
the main thread runs one.

A message handed from one thread to another costs a thread's wake-up and the interpreter's lock
changing hands, a large part of what a trivial cell costs a rank (BENCHMARKS.md, "Measurements
behind the code"). So the idle main thread reads the next command itself. While it runs one (a
cell, a rendezvous), the messages that must be answered at once (heartbeats, interrupts, stack
and names requests, input replies) still need a reader: at the watchdog's next tick the reader
thread takes the wire and reads until the command ends, queueing any command that comes
meanwhile. A command shorter than a tick never wakes it; one that is longer hears an interrupt a
tick later at most.

Where the pool's ranks on this machine (every node there) are no more than the CPUs the rank
may use (its affinity, and its cgroup's quota: a container's ``--cpus``), the waiting main
thread is a batch task (Linux's ``SCHED_BATCH``), and a normal one again as soon as a command is
in: a waking rank then does not preempt the notebook thread that is still writing the same cell
to the other ranks, which shortens a trivial cell's round trip (ibid.). With more ranks than
CPUs, the switch back costs each rank a preemption every cell, more than it saves, so they stay
normal (ibid.).
The user's code and the threads it starts run as normal tasks; only what the main thread runs
while it waits (a signal handler, a finaliser) runs as a batch one. A policy other than the
normal one (set by whoever started the rank, or by a cell) is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
from collections.abc import Callable
from pathlib import Path

from ..wire import SyncChannel


class _BatchWhileWaiting:
    """The calling thread as a batch task for a wait, and normal again after it: only from the
    normal policy, and only where the system has the call and allows it.
    """

    def __init__(self, ranks_here: int) -> None:
        self._usable = (
            hasattr(os, "sched_setscheduler")
            and hasattr(os, "SCHED_BATCH")
            and ranks_here <= usable_cpus()
        )
        self._switched = False

    def begin(self) -> None:
        if not self._usable or self._switched:
            return
        try:
            if os.sched_getscheduler(0) != os.SCHED_OTHER:
                return  # chosen by someone: left alone
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            self._usable = False  # refused (a sandbox): wait as before, and stop asking
            return
        self._switched = True

    def end(self) -> None:
        if self._switched:
            self._switched = False
            with contextlib.suppress(OSError):  # allowed a moment ago; still, never fail a cell
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def usable_cpus() -> float:
    """The CPUs this process may use: its affinity, less where its cgroup (v2) has a quota."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return cpus if quota == "max" else min(cpus, int(quota) / int(period))
    except (OSError, ValueError):  # no cgroup v2 here, or a file of another shape
        return cpus


class Inbox:
    def __init__(
        self, channel: SyncChannel, route: Callable[[object], bool], ranks_here: int
    ) -> None:
        self._channel = channel
        self._route = route
        """Answers a message at once and says True; says False for a command (main's to run)."""
        self._wire = threading.Lock()
        """Held by the thread that reads the channel."""
        self._queued: queue.SimpleQueue[object] = queue.SimpleQueue()
        """Commands the reader thread read while the main thread was busy."""
        self._busy = True
        """The main thread runs something (at first: the rank's start, which may import torch)."""
        self._reader_reads = False
        self._take_over = threading.Event()
        self._give_back_r, self._give_back_w = os.pipe()
        """A byte here stops the reader's wait on the channel: the main thread is idle."""
        self._batch = _BatchWhileWaiting(ranks_here)

    def next_command(self) -> object:
        """Main thread: the next command, answering whatever comes before it."""
        self._busy = False
        if self._reader_reads:
            os.write(self._give_back_w, b"\0")
        while True:
            try:
                command = self._queued.get_nowait()
            except queue.Empty:
                self._batch.begin()
                with self._wire:
                    if not self._queued.empty():  # queued while this thread waited for the wire
                        continue
                    command = self._channel.recv()
                if self._route(command):
                    continue
            self._busy = True
            self._batch.end()
            return command

    def tick(self) -> None:
        """The watchdog's tick: the main thread is busy, so the reader thread reads."""
        if self._busy and not self._reader_reads:
            self._take_over.set()

    def read_while_busy(self) -> None:
        """The reader thread: each time it is asked, read until the main thread is idle."""
        while True:
            self._take_over.wait()
            self._take_over.clear()
            with self._wire:
                self._reader_reads = True
                try:
                    while self._busy:
                        if not self._channel.pending():
                            ready, _, _ = select.select(
                                [self._channel.read_fd, self._give_back_r], [], []
                            )
                            if self._give_back_r in ready:
                                os.read(self._give_back_r, 64)
                                continue  # the main thread may be idle now: look again
                        message = self._channel.recv()
                        if not self._route(message):
                            self._queued.put(message)
                finally:
                    self._reader_reads = False
