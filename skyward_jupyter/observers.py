"""Who the session tells of a pool's life: the display (:class:`Views`) and watchers (the lab
panel's registry). The session holds them as these protocols only, so it knows no display
module; ``display/views.py`` and ``registry/`` implement them.
"""

from __future__ import annotations

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


class Views(Protocol):
    """The display layer's part in a pool's life (``display/views.py``); no widgets here."""

    def pool_created(self, entry: EntryFacts) -> None:
        """The pool exists and is about to start."""

    def pool_starting(self, entry: EntryFacts) -> None:
        """Kernel thread, while the pool starts (about 20 times a second): show its progress."""

    def pool_started(self, entry: EntryFacts) -> None: ...

    def pool_ended(self, entry: EntryFacts) -> None: ...

    def cell(self, entry: EntryFacts, stdout: StdoutMode) -> CellView:
        """A cell is about to run on the pool; ``stdout``: whose output it shows."""
        ...

    def cell_number(self) -> int | None:
        """The running notebook cell's number (``In [7]``: 7), where the notebook numbers it."""

    def show(self, name: str | None, current: str | None) -> None:
        """Show a pool's panel (``%sky panel``); LookupError when there is no such pool."""

    def metrics(self, name: str | None, current: str | None) -> Any:
        """A pool's metrics as rows (``%sky metrics``); LookupError when there is no such pool."""


class PoolWatcher(Protocol):
    """Another view of a pool's life beside the display (the lab panel's registry)."""

    def pool_created(self, entry: EntryFacts) -> None: ...

    def pool_started(self, entry: EntryFacts) -> None: ...

    def pool_ended(self, entry: EntryFacts) -> None: ...


class _NoCellView:
    def on_event(self, event: PoolEvent) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        pass


class NoViews:
    """No display: pools run, and their ranks' output is not shown (the extension's views
    write it into the cell)."""

    def pool_created(self, entry: EntryFacts) -> None:
        pass

    def pool_starting(self, entry: EntryFacts) -> None:
        pass

    def pool_started(self, entry: EntryFacts) -> None:
        pass

    def pool_ended(self, entry: EntryFacts) -> None:
        pass

    def cell(self, entry: EntryFacts, stdout: StdoutMode) -> CellView:
        return _NoCellView()

    def cell_number(self) -> int | None:
        return None

    def show(self, name: str | None, current: str | None) -> None:
        raise LookupError("this session has no panel")

    def metrics(self, name: str | None, current: str | None) -> Any:
        raise LookupError("this session keeps no metrics")
