"""Who the session tells of a pool's life: its listeners (:class:`PoolListener`), the display
(:class:`Views`, a listener that also draws cells) and the lab panel's registry among them. The
session holds them as these protocols only, so it knows no display module; ``display/views.py``
and ``registry/`` implement them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .events import PoolEvent
from .model import EntryFacts
from .options import StdoutMode


class CellView(Protocol):
    """One cell's output and panel: fed the cell's events, drawn from the kernel's thread."""

    def on_event(self, event: PoolEvent) -> None:
        """IO thread: an event of this cell (its ranks' output among them)."""

    def flush(self) -> None:
        """Kernel thread, while the cell waits (about 20 times a second)."""

    def finish(self) -> None:
        """Kernel thread, once the cell ended (also when it failed)."""


class PoolListener(Protocol):
    """One listener of a pool's life: every listener hears every event, in this order."""

    def pool_created(self, entry: EntryFacts) -> None:
        """The pool exists and is about to start (its own events can be subscribed to now)."""

    def pool_starting(self, entry: EntryFacts) -> None:
        """Kernel thread, while the pool starts (about 20 times a second): show its progress."""

    def pool_started(self, entry: EntryFacts) -> None:
        """The pool is ready and the session's own."""

    def pool_ended(self, entry: EntryFacts) -> None:
        """The pool ended, or failed to start."""


class Views(PoolListener, Protocol):
    """The display layer (``display/views.py``): the listener that also draws; no widgets here."""

    def cell(
        self, entry: EntryFacts, stdout: StdoutMode, ranks: Sequence[int] | None = None
    ) -> CellView:
        """A cell is about to run on the pool; ``stdout``: whose output it shows, among
        ``ranks``, those that run it (None: every rank).
        """
        ...

    def operation_ended(self, entry: EntryFacts) -> None:
        """``%sky pull``, ``push`` or ``restart`` ran on the pool without a cell's view: what
        the pool said meanwhile is told now.
        """

    def cell_number(self) -> int | None:
        """The running notebook cell's number (``In [7]``: 7), where the notebook numbers it."""

    def show(self, name: str | None, current: str | None) -> None:
        """Show a pool's panel (``%sky panel``); LookupError when there is no such pool."""

    def metrics(self, name: str | None, current: str | None) -> Any:
        """A pool's metrics as rows (``%sky metrics``); LookupError when there is no such pool."""

    def auto(self, name: str | None) -> None:
        """Plain cells now run on the pool ``name`` (``%sky auto on``; None: in the notebook):
        its views say so while it lasts.
        """


class _NoCellView:
    def on_event(self, event: PoolEvent) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        pass


class NoViews:
    """No display: pools run, and their ranks' output is not shown (the extension's views
    write it into the cell).
    """

    def pool_created(self, entry: EntryFacts) -> None:
        pass

    def pool_starting(self, entry: EntryFacts) -> None:
        pass

    def pool_started(self, entry: EntryFacts) -> None:
        pass

    def pool_ended(self, entry: EntryFacts) -> None:
        pass

    def cell(
        self, entry: EntryFacts, stdout: StdoutMode, ranks: Sequence[int] | None = None
    ) -> CellView:
        return _NoCellView()

    def operation_ended(self, entry: EntryFacts) -> None:
        pass

    def cell_number(self) -> int | None:
        return None

    def show(self, name: str | None, current: str | None) -> None:
        raise LookupError("this session has no panel")

    def metrics(self, name: str | None, current: str | None) -> Any:
        raise LookupError("this session keeps no metrics")

    def auto(self, name: str | None) -> None:
        pass
