"""The pool's IO thread, and the caller's wait for what it does.

All IO of a pool (the wire to every rank, heartbeats, failure handling) runs on an asyncio loop
of its own thread, so the kernel's loop is never blocked. The caller's thread only waits for a
result, and a Ctrl-C while it waits is turned into an interrupt of the ranks.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .results import CellInterrupted, RunResult, WaitInterrupted

T = TypeVar("T")

WAIT_TICK = 0.05
"""Seconds between the caller's ``on_wait`` calls while it waits."""

_owners: weakref.WeakSet[Any] = weakref.WeakSet()
"""Objects with an IO thread, closed at the interpreter's exit: the thread is a daemon, and its
work (ending the ranks, releasing machines) would otherwise be cut off mid-way."""


def close_at_exit(owner: Any, wanted: bool = True) -> None:
    if wanted:
        _owners.add(owner)
    else:
        _owners.discard(owner)


def _close_owners() -> None:
    for owner in list(_owners):
        try:
            owner.close()
        except Exception:
            logging.getLogger(__name__).exception("closing %r at exit failed", owner)


class IOThread:
    """An asyncio loop running on a daemon thread, fed from the caller's thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._handed_out: set[concurrent.futures.Future[Any]] = set()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._handed_out.add(future)
        future.add_done_callback(self._handed_out.discard)
        return future

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, orphaned: BaseException) -> None:
        """Stop the loop; fail what it will now never finish with ``orphaned``.

        Without that, a caller waiting for such work (a cell still running when the pool was
        closed from another thread) would wait forever.
        """
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        for future in list(self._handed_out):
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # it just finished
                future.set_exception(orphaned)


class StoppedWaiting(Exception):
    """Raised on the IO thread by work that Ctrl-C stopped before it began (it waited for the
    pool); the caller's :func:`wait` raises it as a :class:`WaitInterrupted`, with its words. Not
    a KeyboardInterrupt there: asyncio lets one of those out of the loop, ending the thread.
    """


def wait(
    future: concurrent.futures.Future[T],
    interrupt: Callable[[], None],
    on_wait: Callable[[], None] | None = None,
) -> T:
    """Wait for the IO thread; Ctrl-C calls ``interrupt`` (a second one calls it again).

    After Ctrl-C the wait goes on until the ranks have stopped; a cell then raises
    :class:`CellInterrupted` (a KeyboardInterrupt) carrying how each rank ended, and work that
    never began :class:`WaitInterrupted`.
    """

    def result() -> T:
        while True:
            try:
                return future.result(timeout=WAIT_TICK if on_wait else None)
            except concurrent.futures.TimeoutError:
                assert on_wait is not None
                on_wait()

    try:
        try:
            return result()
        except KeyboardInterrupt:
            interrupt()
            try:
                outcome = result()
            except KeyboardInterrupt:
                interrupt()
                outcome = result()
            if isinstance(outcome, RunResult):
                raise CellInterrupted(outcome) from None
            raise
    # Whichever Ctrl-C (this caller's first or second, or Pool.interrupt elsewhere) stopped it:
    except concurrent.futures.CancelledError:
        raise KeyboardInterrupt from None  # a start, cancelled
    except StoppedWaiting as stopped:
        raise WaitInterrupted(str(stopped)) from None


# At the interpreter's exit, before the threads are joined and before concurrent.futures shuts
# its thread pools: closing a pool hands blocking work to threads (asyncio.to_thread), which an
# atexit hook could no longer do ("cannot schedule new futures after shutdown"). These hooks
# run newest first, and concurrent.futures registers its own as its thread module is imported,
# which asyncio does only at its first executor: imported here, so that this one is newer.
getattr(threading, "_register_atexit", atexit.register)(_close_owners)
