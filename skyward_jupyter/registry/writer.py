"""The kernel's side of the registry: a session's pools kept published while they live.

:class:`Registry` is one more listener of the session's pools: it writes a record when a pool is
created and when it is ready, removes it when the pool ends (and at exit), and rewrites it from a
small thread of its own when rank states change (at most every :attr:`Registry.interval`
seconds; the pool's IO thread only marks the record stale).

The server asks a live owner to shut a pool down by creating ``<id>.down`` beside the record:
the same thread sees it within :attr:`Registry.interval` and shuts the pool down through the
panel's path (a running cell is interrupted first), which removes the record.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..events import PoolEvent, RankStateChanged
from ..model import EntryFacts
from .files import (
    ensure_dir,
    new_pool_id,
    registry_dir,
    remove_record,
    shutdown_requested,
    write_record,
)
from .record import Owner, pool_record

log = logging.getLogger(__name__)

Shutdown = Callable[[str, Any], None]
"""``shutdown(name, pool)``: end a pool the way the panel's "Shut down" does."""


@dataclass(eq=False)
class _Tracked:
    pool_id: str
    entry: EntryFacts
    created_at: float
    ready_at: float | None = None
    dirty: bool = False
    requested: bool = False
    unsubscribe: Callable[[], None] | None = None


_live: weakref.WeakSet[Registry] = weakref.WeakSet()


class Registry:
    """A session's pools, published in the registry directory (a session listener).

    Never raises into the session: a registry that cannot write says so once in the log and
    the pools work on without it.
    """

    interval = 0.25
    """Seconds between the writer thread's rounds: rewrites of stale records, shutdown requests."""

    def __init__(self, directory: Path | None = None, owner: Owner | None = None) -> None:
        self._directory = directory
        self._owner = owner
        self._tracked: dict[int, _Tracked] = {}  # by id() of the pool
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._shutdown: Shutdown | None = None
        self._warned = False
        _live.add(self)

    def attach(self, shutdown: Shutdown) -> None:
        """How a shutdown request from the server ends a pool: ``shutdown(name, pool)``."""
        self._shutdown = shutdown

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = registry_dir()
        return self._directory

    @property
    def owner(self) -> Owner:
        if self._owner is None:
            self._owner = Owner.current()
        return self._owner

    def pool_id(self, entry: EntryFacts) -> str | None:
        """The registry id of ``entry``'s pool while it is registered."""
        tracked = self._tracked.get(id(entry.pool))
        return tracked.pool_id if tracked is not None and tracked.entry is entry else None

    # ------------------------------------------------------------------ session hooks

    def pool_created(self, entry: EntryFacts) -> None:
        tracked = _Tracked(new_pool_id(), entry, time.time())
        with self._cond:
            if self._closed:
                return
            self._tracked[id(entry.pool)] = tracked
            self._ensure_thread()
            self._cond.notify_all()
        tracked.unsubscribe = entry.pool.subscribe(lambda event: self._on_event(tracked, event))
        self._write(tracked)

    def pool_starting(self, entry: EntryFacts) -> None:
        """Nothing to write: the start's progress reaches the record through the pool's events."""

    def pool_started(self, entry: EntryFacts) -> None:
        tracked = self._tracked.get(id(entry.pool))
        if tracked is None or tracked.entry is not entry:
            return
        tracked.ready_at = time.time()
        self._write(tracked)

    def pool_ended(self, entry: EntryFacts) -> None:
        with self._cond:
            tracked = self._tracked.get(id(entry.pool))
            if tracked is None or tracked.entry is not entry:
                return
            del self._tracked[id(entry.pool)]
            self._remove(tracked)
        if tracked.unsubscribe is not None:
            tracked.unsubscribe()

    def close(self) -> None:
        """Remove every record of this registry; no more writes (at exit)."""
        with self._cond:
            self._closed = True
            for tracked in self._tracked.values():
                self._remove(tracked)
            self._tracked.clear()
            self._cond.notify_all()

    # ----------------------------------------------------------------------- internals

    @staticmethod
    def _on_event(tracked: _Tracked, event: PoolEvent) -> None:
        """The pool's IO thread: only mark the record stale; the writer thread rewrites it."""
        if isinstance(event, RankStateChanged):
            tracked.dirty = True

    def _ensure_thread(self) -> None:
        """Start the writer thread unless it runs (under the lock; it ends with the last pool)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="skyward-registry", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._tracked:
                    self._thread = None  # the next pool starts another
                    return
                self._cond.wait(self.interval)
                for tracked in list(self._tracked.values()):
                    if tracked.dirty:
                        tracked.dirty = False  # before reading the pool: a later change re-marks
                        self._write(tracked)
                    self._check_request(tracked)

    def _check_request(self, tracked: _Tracked) -> None:
        if tracked.requested:
            return
        try:
            if not shutdown_requested(self.directory, tracked.pool_id):
                return
        except OSError:
            return
        tracked.requested = True
        entry = tracked.entry
        log.info("pool %r: shutdown requested through the Jupyter server", entry.name)
        shutdown = self._shutdown
        threading.Thread(
            target=self._shut_down,
            args=(shutdown, entry),
            name=f"skyward-registry-down-{entry.name}",
            daemon=True,
        ).start()

    @staticmethod
    def _shut_down(shutdown: Shutdown | None, entry: EntryFacts) -> None:
        try:
            if shutdown is not None:
                shutdown(entry.name, entry.pool)
            else:
                entry.pool.close()
        except Exception:
            log.exception("pool %r could not be shut down on request", entry.name)

    def _write(self, tracked: _Tracked) -> None:
        with self._cond:
            if self._closed or self._tracked.get(id(tracked.entry.pool)) is not tracked:
                return  # ended meanwhile: a late write must not bring the record back
            try:
                record = pool_record(
                    tracked.pool_id,
                    tracked.entry,
                    self.owner,
                    created_at=tracked.created_at,
                    ready_at=tracked.ready_at,
                )
                write_record(ensure_dir(self.directory), record)
            except Exception as exc:  # noqa: BLE001 - the pool works on without the registry
                self._warn(exc)

    def _remove(self, tracked: _Tracked) -> None:
        try:
            remove_record(self.directory, tracked.pool_id)
        except Exception as exc:  # noqa: BLE001 - the pool works on without the registry
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the pool registry for the lab panel is not available: %s", exc)


def live_registries() -> Iterator[Registry]:
    return iter(list(_live))


@atexit.register
def _close_all() -> None:
    """A kernel that exits (shut down, restarted) leaves no record behind."""
    for registry in live_registries():
        registry.close()
