"""The idle stop: a pool without a cell for its ``--idle-timeout`` ends by itself.

Paid providers set a default (a forgotten cloud pool must not run for days); a running cell is
never stopped. One daemon thread per session, running only while some pool has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
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


class IdleStop(Generic[E]):
    def __init__(
        self,
        lock: threading.RLock,
        pools: Callable[[], Iterable[E]],
        forget: Callable[[str], object],
        close: Callable[[E], None],
        announce: Callable[[str], None],
    ) -> None:
        """``forget`` takes a pool out of the session (under ``lock``, so no cell can take it
        any more); ``close`` ends it, outside the lock."""
        self.check = 15.0
        """Seconds between rounds (at most; shorter for short idle timeouts)."""
        self._lock = lock
        self._pools = pools
        self._forget = forget
        self._close = close
        self._announce = announce
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """Make sure the watcher runs (a pool with an idle timeout started)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="skyward-idle", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                watched = [(e, m * 60) for e in self._pools() if (m := e.spec.idle_minutes())]
                if not watched:
                    self._thread = None
                    return
                now = time.monotonic()
                idle = [
                    (e, limit)
                    for e, limit in watched
                    if e.busy == 0 and now - e.last_active >= limit
                ]
                for entry, _ in idle:
                    self._forget(entry.name)  # no cell can take it from here on
                wait = min([self.check, *(limit / 4 for _, limit in watched)])
            # Outside the lock: a cloud pool's teardown waits minutes for its instances to go,
            # and the notebook's cells must not wait for that.
            for entry, limit in idle:
                self._announce(
                    f"pool {entry.name!r}: no cell for {limit / 60:g} min, shutting down "
                    "(--idle-timeout)"
                )
                try:
                    self._close(entry)
                except Exception as exc:  # noqa: BLE001 - said, and the loop goes on
                    self._announce(f"pool {entry.name!r}: idle shutdown failed: {exc}")
            time.sleep(max(wait, 0.05))
