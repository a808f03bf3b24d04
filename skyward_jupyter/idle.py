"""The idle stop: a pool without a cell for its ``--idle-timeout`` ends by itself.

Paid providers set a default (a forgotten cloud pool must not run for days); a running cell is
never stopped. One daemon thread per session, running only while some pool has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class _Spec(Protocol):
    def idle_minutes(self) -> float | None: ...


class IdleEntry(Protocol):
    """What the idle stop reads of a session's pool."""

    name: str
    busy: int
    """Cells running (or about to) on the pool."""
    last_active: float
    """``time.monotonic()`` when the last cell ended (or the pool started)."""

    @property
    def spec(self) -> _Spec: ...


E = TypeVar("E", bound=IdleEntry)


class IdlePools(Protocol[E]):
    """What the idle stop asks of the session that owns the pools."""

    def take_pools(self, chosen: Callable[[Sequence[E]], Sequence[E]]) -> Sequence[E]:
        """Under the session's lock (no cell can take a pool meanwhile): take the pools that
        ``chosen`` picks among the session's out of it, and return them.
        """

    def end_pool(self, entry: E, why: str) -> None:
        """End a pool already taken out (outside the lock: a cloud pool's teardown waits
        minutes for its instances, and the notebook's cells must not wait for that); ``why``
        is said first, and a failure to end it is said too.
        """


class IdleStop(Generic[E]):
    def __init__(self, pools: IdlePools[E]) -> None:
        self.check = 15.0
        """Seconds between rounds (at most; shorter for short idle timeouts)."""
        self._pools = pools
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wait = self.check

    def watch(self) -> None:
        """Make sure the watcher runs (a pool with an idle timeout started)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="skyward-idle", daemon=True)
                self._thread.start()

    def _idle(self, entries: Sequence[E]) -> Sequence[E]:
        """The pools past their timeout with no cell; with none watched, the watcher ends.

        Runs under the session's lock, so a pool that starts meanwhile calls :meth:`watch`
        after this round saw it or after the watcher was marked gone.
        """
        watched = [(e, m * 60) for e in entries if (m := e.spec.idle_minutes())]
        if not watched:
            with self._lock:
                self._thread = None
            return ()
        now = time.monotonic()
        self._wait = min([self.check, *(limit / 4 for _, limit in watched)])
        return [e for e, limit in watched if e.busy == 0 and now - e.last_active >= limit]

    def _loop(self) -> None:
        while True:
            idle = self._pools.take_pools(self._idle)
            with self._lock:
                if self._thread is not threading.current_thread():
                    return
            for entry in idle:
                minutes = entry.spec.idle_minutes()
                self._pools.end_pool(
                    entry,
                    f"pool {entry.name!r}: no cell for {minutes:g} min, shutting down "
                    "(--idle-timeout)",
                )
            time.sleep(max(self._wait, 0.05))
