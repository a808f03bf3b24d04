"""Which view of its pools a kernel gets, and when: the session's hooks into the display layer.

Per pool, for the pool's whole life, a :class:`~.state.PanelState` folds the pool's events (and
stays after the pool ends, for ``%sky metrics`` and ``%sky panel``, until a pool of the same name
replaces it). On top of it:

- in a kernel with a frontend (``ZMQInteractiveShell``: JupyterLab, Notebook, VS Code, nbclient),
  a :class:`~.panel.SkyPanel` per cell, of that cell only (its state is
  :meth:`~.state.PanelState.for_cell`'s: its output per rank, its metrics, its progress, named
  ``In [N]`` as the notebook numbers the cell), displayed as the pool starts (so starting shows),
  else as soon as the cell has run :data:`QUICK_CELL_S` or its ranks wrote output (above that
  output). A quicker cell that printed nothing shows only its result: its panel would have
  nothing live to show, and in a kernel that display was most of a trivial cell's cost; one
  that failed on a rank shows it at its end, its failed ranks red, however quick. When the
  cell ends its panel stops: it keeps the cell's final state, and its display is updated once, so
  the saved notebook's ``text/plain`` says how the cell left the pool. ``%sky panel`` shows a
  pool-wide panel (every cell), which says so;
- elsewhere (terminal IPython), a :class:`~.text.TextReport` written from the kernel's thread
  while a cell waits, like the cell's own output.

What the session announces (:meth:`PoolViews.announce`) goes to stderr, except in a kernel with a
frontend, where a line that ends in ``...`` (``pool 'default': starting 2 ranks ...``) is a plain
display, not an error-coloured band, that the next announcement of the same cell replaces (``...
2 ranks ready in 0.2 s``): start-up is one line.

The panel's "Shut down" goes through the session (``%sky status`` then knows); pressed while a
cell runs on the pool, it interrupts the cell and shuts the pool down when the cell has ended.
"""

from __future__ import annotations

import html
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..events import OutputReceived, PoolEvent, PoolMessage
from ..model import EntryFacts, price_of
from ..options import StdoutMode
from .format import format_number
from .metrics import MetricRow
from .output import CellOutput
from .state import PanelState
from .summary import summary_text
from .text import TextReport

if TYPE_CHECKING:
    from ..pool import Pool
    from .panel import SkyPanel

log = logging.getLogger(__name__)
Mode = Literal["auto", "widgets", "text", "off"]

WROTE_BETWEEN_CHARS = 1 << 16
"""What the ranks wrote between cells that the next cell writes, at most (the rest is counted:
a thread printing in a loop all night must not flood one cell)."""
QUICK_CELL_S = 0.25
"""A cell done within this many seconds, with no output, is not given the panel."""


def has_widget_frontend(shell: Any) -> bool:
    """Whether displays reach a frontend that may render widgets (a kernel), not a terminal."""
    kernel = getattr(shell, "kernel", None)
    return type(shell).__name__ == "ZMQInteractiveShell" and kernel is not None


@dataclass
class _Shown:
    """A display of the panel in this cell: what its text said (less the ticking figures)."""

    handle: Any
    text: str
    at: float


@dataclass
class _View:
    name: str
    pool: Pool
    state: PanelState
    panel: SkyPanel | None = None  # the panel of the cell that runs, or ran last
    cell_state: PanelState | None = None  # its state, fed while its cell runs
    cell_feed: Callable[[], None] | None = None  # stops feeding it
    cell_key: object = None  # the cell it belongs to
    in_cell: frozenset[int] = frozenset()  # ranks whose output the cell itself shows
    pool_panel: SkyPanel | None = None  # ``%sky panel``'s, of the pool's whole life
    text: TextReport | None = None
    shown: list[_Shown] = field(default_factory=list)  # displays made in the current cell
    shown_in: object = None  # the cell it was last displayed in
    running: bool = False
    shutdown_pending: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    replacing: _View | None = None
    """The view of the pool of the same name that this one's pool replaces (a local pool
    starts before the one it replaces ends): shown again if this one fails to start."""
    said_between: list[str] = field(default_factory=list)
    """What the pool said while no cell of its ran (a rank lost while idle, and restarted
    without its namespace): a notebook with a frontend shows no panel then, so the next cell
    on the pool tells it first."""

    wrote_between: list[OutputReceived] = field(default_factory=list)
    """What the ranks wrote while none of their cells ran (a thread a cell left running, an
    import's warning as a rank started): the next cell writes it first, by its own rules."""
    wrote_chars: int = 0
    """The characters kept in ``wrote_between`` (at most about :data:`WROTE_BETWEEN_CHARS`)."""
    left_out_chars: int = 0
    """The characters written between cells past that, counted only."""

    def between_cells(self, event: PoolEvent) -> None:
        """IO thread: keep what the pool says while none of its cells' views is fed."""
        if isinstance(event, PoolMessage):
            with self.lock:  # the kernel's thread begins and ends cells under it
                if self.cell_feed is None:
                    self.said_between.append(event.text)

    def wrote_between_cells(self, event: PoolEvent) -> None:
        """IO thread: keep what a rank wrote outside any cell (its cell id is None)."""
        if isinstance(event, OutputReceived) and event.cell_id is None:
            with self.lock:
                if self.wrote_chars < WROTE_BETWEEN_CHARS:
                    self.wrote_between.append(event)
                    self.wrote_chars += len(event.text)
                else:
                    self.left_out_chars += len(event.text)


class _CellView:
    """What the session calls around one cell: the ranks' output written into the cell, and
    the pool's panel (or text report) kept current, both from the kernel's thread.
    """

    def __init__(self, views: PoolViews, view: _View | None, output: CellOutput) -> None:
        self._views = views
        self._view = view
        self._output = output
        self.on_event = output.on_event
        self._started = time.monotonic()
        self._panel_due = view is not None and views.kind == "widgets"

    def flush(self) -> None:
        self._show_panel_if_due()
        self._output.flush()
        view = self._view
        if view is not None and view.text is not None:
            view.text.flush()

    def finish(self) -> None:
        self._show_panel_if_due(ended=True)
        self._output.finish()  # also writes the stderr lines still held for other ranks
        view = self._view
        if view is not None:
            self._views._cell_finished(view)

    def _show_panel_if_due(self, ended: bool = False) -> None:
        """Display the panel (as its timer drew it last) once the cell has output to write
        below it or has run long enough to be watched; a cell that ``ended`` failing on a rank
        shows it however quick it was (its red ranks say where the failure was).
        """
        view = self._view
        if not self._panel_due or view is None:
            return
        failed = ended and view.cell_state is not None and view.cell_state.cell_failed
        if self._output.pending or failed or time.monotonic() - self._started >= QUICK_CELL_S:
            self._panel_due = False
            self._views._show(view)


class PoolViews:
    """The display layer's side of :class:`~skyward_jupyter.session.Session`."""

    def __init__(self, shell: Any = None, mode: Mode = "auto") -> None:
        self.shell = shell
        self.mode: Mode = mode
        self._views: dict[str, _View] = {}
        self._shutdown: Callable[[str, Any], None] | None = None
        self._pending_line: tuple[Any, object] | None = None  # ("... ..." display, its cell)
        self._auto: str | None = None  # the pool plain cells run on (%sky auto on)

    def attach(self, shutdown: Callable[[str, Any], None]) -> None:
        """How "Shut down" ends a pool: ``shutdown(name, pool)`` (the session's ``down``)."""
        self._shutdown = shutdown

    @property
    def kind(self) -> Literal["widgets", "text", "off"]:
        if self.mode != "auto":
            return self.mode
        return "widgets" if has_widget_frontend(self.shell) else "text"

    def announce(self, text: str) -> None:
        """The session's announcements (see the module's docstring)."""
        pending, self._pending_line = self._pending_line, None
        if self.kind != "widgets":
            print(text, file=sys.stderr)
            return
        from IPython.display import DisplayHandle

        key = self._cell_key()
        bundle = {"text/plain": text}
        metadata = {"skyward_jupyter": {"status": True}}
        if pending is not None and pending[1] == key:
            pending[0].update(bundle, raw=True, metadata=metadata)
        elif text.endswith("..."):
            handle = DisplayHandle()  # type: ignore[no-untyped-call]
            handle.display(bundle, raw=True, metadata=metadata)  # type: ignore[no-untyped-call]
            self._pending_line = (handle, key)
        else:
            print(text, file=sys.stderr)

    # ------------------------------------------------------------ session hooks

    def pool_created(self, entry: EntryFacts) -> None:
        """A pool was made and is about to start: fold its events from the first one."""
        pool = entry.pool
        state = PanelState(entry.name, pool.provider.name, price_per_hour=price_of(pool))
        pool.subscribe(state.apply)
        state.set_auto(entry.name == self._auto)
        view = _View(entry.name, pool, state, replacing=self._views.get(entry.name))
        kind = self.kind
        self._views[entry.name] = view
        pool.subscribe(view.wrote_between_cells)
        if kind == "widgets":
            self._begin_cell(view)  # the start is the first part of this cell's view
            pool.subscribe(view.between_cells)
            if self._panel(view) is not None:
                self._show(view)
        elif kind == "text":
            view.text = TextReport()
            pool.subscribe(view.text.on_event)

    def pool_starting(self, entry: EntryFacts) -> None:
        view = self._views.get(entry.name)
        if view is not None and view.pool is entry.pool and view.text is not None:
            view.text.flush()  # the widget panel redraws by itself

    def pool_started(self, entry: EntryFacts) -> None:
        view = self._views.get(entry.name)
        if view is not None and view.pool is entry.pool:
            if view.cell_state is not None:
                view.cell_state.pool_ready()
            self._update(view)

    def pool_ended(self, entry: EntryFacts) -> None:
        view, newer = self._views.get(entry.name), None
        while view is not None and view.pool is not entry.pool:
            newer, view = view, view.replacing
        if view is None:
            return
        if newer is not None:  # a replaced pool, ending once its replacement is ready
            newer.replacing = view.replacing
        elif view.replacing is not None and view.replacing.pool.running:
            self._views[entry.name] = view.replacing  # its replacement failed: it stays
        view.replacing = None
        view.state.sync(view.pool)
        self._end_cell(view)
        if view.pool_panel is not None:
            view.pool_panel.stop()
        self._update(view)

    def cell(
        self, entry: EntryFacts, stdout: StdoutMode, ranks: Sequence[int] | None = None
    ) -> _CellView:
        """A cell is about to run on ``entry``'s pool (kernel thread), on ``ranks`` (None:
        every rank); its head is the first of them.
        """
        running = list(range(entry.pool.world_size or 0)) if ranks is None else sorted(ranks)
        output = CellOutput(stdout, ranks=len(running), head=running[0] if running else 0)
        view = self._views.get(entry.name)
        if view is None or view.pool is not entry.pool:
            return _CellView(self, None, output)
        with view.lock:
            view.running = True
        view.in_cell = frozenset({"head": running[:1], "all": running}.get(stdout, ()))
        if self.kind == "widgets" and view.cell_key != self._cell_key():
            self._begin_cell(view)
        self._tell_said(view)
        with view.lock:
            wrote, view.wrote_between, view.wrote_chars = view.wrote_between, [], 0
            left_out, view.left_out_chars = view.left_out_chars, 0
        wrote = [event for event in wrote if output.shows(event)]
        if wrote:
            more = f" ({left_out} more characters left out)" if left_out else ""
            self.announce(f"pool {view.name!r}: the ranks wrote this between cells{more}:")
            for event in wrote:
                output.on_event(event)
        if view.panel is not None:
            view.panel.in_cell = view.in_cell
        if view.text is not None:
            view.text.flush()
        return _CellView(self, view, output)

    def operation_ended(self, entry: EntryFacts) -> None:
        """``%sky pull``, ``push`` or ``restart`` ended (kernel thread): what the pool said
        meanwhile, or since its last cell (a rank lost while idle), is told now, before the
        operation's own outcome or error; it runs without a cell's view, and the next cell
        would otherwise tell it late.
        """
        view = self._views.get(entry.name)
        if view is None or view.pool is not entry.pool:
            return
        self._tell_said(view)
        if view.text is not None:
            view.text.flush()

    def _tell_said(self, view: _View) -> None:
        with view.lock:
            said, view.said_between = view.said_between, []
        for text in said:
            self.announce(f"pool {view.name!r}: {text}")

    def _cell_finished(self, view: _View) -> None:
        with view.lock:
            view.running = False
            pending, view.shutdown_pending = view.shutdown_pending, False
        if view.text is not None:
            view.text.flush(final=True)
        self._end_cell(view)
        self._update(view)
        if pending:
            self._down(view)

    def auto(self, name: str | None) -> None:
        """Plain cells now run on the pool ``name`` (None: in the notebook): the headers of its
        panels and text say so, a cell's panel from its next cell on.
        """
        self._auto = name
        for view in list(self._views.values()):
            view.state.set_auto(view.name == name)

    def cell_number(self) -> int | None:
        """The running cell's ``In [N]``: the panel's name for it, and its file name on the
        ranks (so tracebacks name it as the notebook does).
        """
        # IPython counts the cell before running it: the running cell is In [count - 1].
        count = getattr(self.shell, "execution_count", None)
        return count - 1 if isinstance(count, int) and count > 1 else None

    def _begin_cell(self, view: _View) -> None:
        """A state of this cell's own, fed from now on; its panel is made when first shown."""
        self._end_cell(view)
        view.cell_state = view.state.for_cell(self.cell_number())
        feed = view.pool.subscribe(view.cell_state.apply)
        with view.lock:
            view.cell_feed = feed
        view.cell_key = self._cell_key()
        view.panel = None

    def _end_cell(self, view: _View) -> None:
        """The cell's view stops where the cell ended: nothing later changes it."""
        with view.lock:
            feed, view.cell_feed = view.cell_feed, None
        if feed is not None:
            feed()
        if view.cell_state is not None:
            view.cell_state.end_cell()  # a no-op when the cell's end was folded
        if view.panel is not None:
            view.panel.stop()

    def _panel(self, view: _View) -> SkyPanel | None:
        """The running cell's panel, made on first use (a quick cell never needs one)."""
        if view.panel is None and view.cell_state is not None:
            view.panel = self._make_panel(view, view.cell_state)
            if view.panel is not None and view.cell_feed is None:
                view.panel.stop()  # its cell ended before it was shown
        return view.panel

    def _make_panel(self, view: _View, state: PanelState) -> SkyPanel | None:
        try:
            from .panel import SkyPanel

            return SkyPanel(
                view.pool,
                state,
                on_shutdown=lambda: self._request_shutdown(view),
                in_cell=view.in_cell,
            )
        except Exception:  # a view must never keep a pool from starting or a cell from running
            log.exception("the panel of pool %r could not be made", view.name)
            return None

    # ---------------------------------------------------------------- commands

    def _find(self, name: str | None, current: str | None) -> _View:
        target = name or current
        if target is None and len(self._views) == 1:
            target = next(iter(self._views))
        view = self._views.get(target) if target else None
        if view is None:
            known = ", ".join(sorted(self._views)) or "none yet"
            raise LookupError(
                f"no pool named {target!r} (pools: {known})" if target else "no pool has run yet"
            )
        return view

    def show(self, name: str | None = None, current: str | None = None) -> None:
        """``%sky panel``: the pool-wide panel here (its text where widgets cannot show)."""
        view = self._find(name, current)
        view.state.sync(view.pool)
        if self.kind == "widgets":
            if view.pool_panel is None or view.pool_panel.widget.comm is None:
                view.pool_panel = self._make_panel(view, view.state)
            if view.pool_panel is not None:
                if not view.pool.running:
                    view.pool_panel.stop()
                view.pool_panel.refresh(force=True)
                self._display(view, view.pool_panel)
                return
        print(summary_text(view.state.snapshot()))

    def metrics(self, name: str | None = None, current: str | None = None) -> Any:
        """``%sky metrics``: a DataFrame (pandas importable) or a list of dicts."""
        return metrics_table(self._find(name, current).state.metric_rows())

    def state(self, name: str | None = None, current: str | None = None) -> PanelState:
        return self._find(name, current).state

    # --------------------------------------------------------------- displays

    def _cell_key(self) -> object:
        shell = self.shell
        parent = getattr(shell, "parent_header", None)
        msg_id = parent.get("header", {}).get("msg_id") if isinstance(parent, dict) else None
        return (getattr(shell, "execution_count", None), msg_id)

    def _show(self, view: _View) -> None:
        """Display the cell's panel unless it was already displayed in this cell."""
        key = self._cell_key()
        if view.shown_in == key:
            return
        panel = self._panel(view)
        if panel is None:
            return
        view.shown_in = key
        view.shown.clear()
        self._display(view, panel)

    def _display(self, view: _View, panel: SkyPanel) -> None:
        """Publish the panel's own bundle: ``display()`` would ask each of IPython's formatters
        in turn for it, on every cell's path.
        """
        from IPython.display import DisplayHandle, publish_display_data

        try:
            handle = DisplayHandle()  # type: ignore[no-untyped-call]
            data, metadata = panel._repr_mimebundle_()
            transient = {"display_id": handle.display_id}
            publish_display_data(data, metadata, transient=transient)  # type: ignore[no-untyped-call]
        except Exception:  # the cell runs on without its panel
            log.exception("the panel of pool %r could not be displayed", view.name)
            return
        if panel is view.panel:
            view.shown.append(_Shown(handle, _text_without_ticks(panel), time.monotonic()))

    def _update(self, view: _View) -> None:
        """Bring this cell's displays' text/plain up to date (the widget view draws itself).

        A display made less than a second ago whose text would change only in its ticking
        figures (uptime, usage, heartbeat ages) is left alone: a quick cell's panel says at its
        end what it said at its start, and a message to the frontend would only repeat it.
        """
        panel = view.panel
        if view.shown_in != self._cell_key() or panel is None:
            return
        text, now = _text_without_ticks(panel), time.monotonic()
        for shown in view.shown:
            if shown.text == text and now - shown.at < 1.0:
                continue
            try:
                shown.handle.update(panel)
            except Exception:
                log.exception("the panel of pool %r could not be updated", view.name)
            else:
                shown.text, shown.at = text, now

    # ---------------------------------------------------------------- shut down

    def request_shutdown(self, name: str, pool: Any) -> None:
        """Shut ``pool`` down as its panel's button does (the lab panel's request, any thread)."""
        view = self._views.get(name)
        if view is not None and view.pool is pool:
            self._request_shutdown(view)
        elif self._shutdown is not None:
            self._shutdown(name, pool)
        else:
            pool.close()

    def _request_shutdown(self, view: _View) -> None:
        """The button (whichever thread handles the click)."""
        with view.lock:
            later = view.shutdown_pending = view.running
        if later:
            view.pool.interrupt()  # the cell ends, then _cell_finished shuts the pool down
        else:
            self._down(view)

    def _down(self, view: _View) -> None:
        if self._shutdown is not None:
            self._shutdown(view.name, view.pool)
        else:
            view.pool.close()


_COLUMNS = ("step", "name", "mean", "min", "max", "ranks")


class MetricRows(list[dict[str, Any]]):
    """A list of dicts, one per (step, metric), that shows itself as a table."""

    def _cells(self) -> list[list[str]]:
        return [
            [v if isinstance(v, str) else format_number(v) for v in (r[c] for c in _COLUMNS)]
            for r in self
        ]

    def table(self) -> str:
        rows = [list(_COLUMNS), *self._cells()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.table() if self else "no metrics yet")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in _COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self._cells()
        )
        return f'<table class="sky-metric-rows"><thead><tr>{head}</tr></thead>{body}</table>'


def metrics_table(rows: list[MetricRow]) -> Any:
    """Rows as a pandas DataFrame when pandas is importable, else a list of dicts (a table)."""
    records = MetricRows(r.as_dict() for r in rows)
    try:
        import pandas as pd  # type: ignore[import-untyped]
    except ImportError:
        return records
    return pd.DataFrame.from_records(list(records), columns=list(_COLUMNS))


def _text_without_ticks(panel: SkyPanel) -> str:
    """The panel's text without its ticking figures: it changes only when the pool's does."""
    return summary_text(panel.state.snapshot(), live=False)
