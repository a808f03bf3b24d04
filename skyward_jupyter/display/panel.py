"""The live panel of a pool, in ipywidgets: header, nodes, output per rank, metrics, buttons.

A :class:`SkyPanel` draws a :class:`~.state.PanelState` (which the pool's events feed on the
pool's IO thread) from its own timer thread, at most ``1 / interval`` times a second and only
when the state's version moved (the uptime and heartbeat ages also tick once a second). Widget
updates are comm messages, safe from a background thread; nothing is printed from it. The timer
ends when the pool has ended (after drawing the end), when its cell has ended (a cell's view,
whose state is :meth:`~.state.PanelState.for_cell`'s: then it keeps the cell's final state) or
when the widget is closed. A panel of the pool's own state (``%sky panel``) says it is
pool-wide. Buttons are enabled only when they can act: Interrupt while a cell runs, Stacks while
the view is live, Shut down while the pool runs.

Displayed (``IPython.display.display(panel)``), it is a mimebundle carrying the widget view and a
``text/plain`` summary, so a frontend without widgets and nbconvert to text read the pool's state
rather than ``VBox(...)``.

DOM classes, for styling and for browser tests:

=====================  ==========================================================================
``sky-panel``          the whole panel (a VBox)
``sky-header``         the pool line: name, provider, nodes x ranks, state, uptime, cost; in
                       a cell's view first ``sky-progress[data-cell=N][data-state=running|ended]
                       [data-step=S]``: In [N], outcome, elapsed, step, steps/s, and with a
                       total ``span.sky-bar[data-fraction=F]`` and the time left
``sky-buttons``        the row of buttons: ``sky-interrupt``, ``sky-stacks`` and ``sky-shutdown``
``sky-nodes``          the node table, trouble first; one ``tr.sky-node[data-node=K]
                       [data-state=STATE]`` per node, or in a large pool per group of healthy
                       neighbours ``tr.sky-node.sky-node-group[data-nodes=0-30]``; ranks in more
                       than one state are counted in ``.sky-counts`` (``1 failed, 7 idle``)
``sky-state``          a state label, also ``sky-state-<state>`` (coloured), ``data-state=STATE``
``sky-waiting``        ranks inside a collective for a while (``span[data-ranks=0,1]``), on the
                       node's row and in the rank's output: ``waiting 12 s in barrier at cell
                       line 3``
``sky-stacks-view``    what the Stacks button showed last: ``.sky-stacks-title`` (when it was
                       taken, or why there are none), then every rank's stacks in a ``pre``
``sky-tabs``           the Tab of rank outputs: "rank 0 (head)", "rank 1", ... (in a large pool
                       the head's, the ranks in trouble and the lowest others: :mod:`.grouping`)
``sky-output``         a rank's output (HTML widget); inside, ``pre.sky-stdout[data-rank=K]`` and
                       ``pre.sky-stderr[data-rank=K]``, ``.sky-error`` (a failed or lost rank's
                       error), or ``.sky-in-cell`` where the cell's own output shows the rank's
                       (the head's, by default: shown once, in the cell, where it is saved)
``sky-metrics``        the latest-values table; ``tr.sky-metric[data-metric=NAME]
                       [data-waiting=true|false]`` per metric: its last complete step, or
                       while none is, the last step with ``1 of 2`` ranks and min and max
                       ``.sky-metric-waiting``
``sky-charts``         the charts, a live uPlot chart per metric: ``.sky-chart[data-metric=NAME]``
                       with its hover readout and its log and smooth toggles (see :mod:`.chart`)
``sky-messages``       the pool's last notes
=====================  ==========================================================================
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets  # type: ignore[import-untyped]

from ..model import GONE
from .chart import ChartGrid
from .clicks import route_clicks
from .grouping import tab_ranks
from .panel_html import (
    header_html,
    messages_html,
    metrics_html,
    nodes_html,
    output_html,
    stacks_html,
    tab_title,
)
from .snapshot import PanelSnapshot
from .state import PanelState
from .summary import summary_text

if TYPE_CHECKING:
    from ..pool import Pool

log = logging.getLogger(__name__)

INTERVAL = 0.25
"""Seconds between redraws at most (about 4 a second)."""
ENDING_GRACE = 30.0
"""After the pool ended, how long to keep drawing while its ranks report how they ended."""


class SkyPanel:
    """The live panel of one pool.

    ``state`` may be shared (then whoever made it feeds it); without one, the panel makes its
    own and subscribes it to the pool. ``on_interrupt``, ``on_stacks`` and ``on_shutdown`` are
    what the buttons do (default: ``pool.interrupt()``, ``pool.stacks()`` and ``pool.close()``);
    the session's views pass a shut down that goes through the session. Clicks are handled on
    a kernel subshell where there is one (:mod:`.clicks`), so they act while a cell runs.
    """

    def __init__(
        self,
        pool: Pool,
        state: PanelState | None = None,
        *,
        on_interrupt: Callable[[], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
        on_stacks: Callable[[], str] | None = None,
        interval: float = INTERVAL,
        start: bool = True,
        in_cell: Collection[int] = (),
    ) -> None:
        """``in_cell``: ranks whose output the cell itself shows (their tabs do not repeat it)."""
        self.pool = pool
        self.in_cell = frozenset(in_cell)
        self._widget_view: dict[str, Any] | None = None
        self._unsubscribe: Callable[[], None] | None = None
        if state is None:
            state = PanelState(pool.name)
            self._unsubscribe = pool.subscribe(state.apply)
        self.state = state
        self.state.sync(pool)
        self.interval = interval
        self._on_interrupt = on_interrupt or pool.interrupt
        self._on_shutdown = on_shutdown or pool.close
        self._on_stacks = on_stacks or pool.stacks

        self.header = widgets.HTML().add_class("sky-header")
        self.interrupt_button = widgets.Button(
            description="Interrupt",
            icon="stop",
            button_style="warning",
            tooltip="Interrupt the running cell on every rank (again: kill what still runs)",
        ).add_class("sky-interrupt")
        self.shutdown_button = widgets.Button(
            description="Shut down",
            icon="power-off",
            button_style="danger",
            tooltip="End every rank of this pool",
        ).add_class("sky-shutdown")
        self.stacks_button = widgets.Button(
            description="Stacks",
            icon="list",
            tooltip="Show where every rank is: its Python stacks, also inside a collective",
        ).add_class("sky-stacks")
        self.interrupt_button.on_click(lambda _: self._click(self._on_interrupt))
        self.stacks_button.on_click(lambda _: self.show_stacks())
        self.shutdown_button.on_click(lambda _: self._click(self._on_shutdown))
        self.buttons = widgets.HBox(
            [self.interrupt_button, self.stacks_button, self.shutdown_button]
        ).add_class("sky-buttons")
        self.nodes = widgets.HTML().add_class("sky-nodes")
        self.stacks_view = widgets.HTML().add_class("sky-stacks-view")
        self.tabs = widgets.Tab().add_class("sky-tabs")
        self.outputs: list[widgets.HTML] = []
        self.metrics = widgets.HTML().add_class("sky-metrics")
        self.charts = ChartGrid()
        self.messages = widgets.HTML().add_class("sky-messages")
        self.widget = widgets.VBox(
            [
                self.header,
                self.buttons,
                self.nodes,
                self.stacks_view,
                self.tabs,
                self.metrics,
                self.charts.widget,
                self.messages,
            ]
        ).add_class("sky-panel")
        self.routed_clicks = route_clicks(list(self.buttons.children))

        self._draw_lock = threading.Lock()
        self._drawn_version = -1
        self._drawn_at = 0.0
        self._ended_at: float | None = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.refresh(force=True)
        if start:
            self.start()

    # ------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._timer is None and not self._stop.is_set():
            self._timer = threading.Thread(
                target=self._run, name=f"skyward-panel-{self.pool.name}", daemon=True
            )
            self._timer.start()

    @property
    def live(self) -> bool:
        """Whether the timer still redraws."""
        return self._timer is not None and self._timer.is_alive()

    def stop(self) -> None:
        """Draw once more and stop redrawing; the widgets stay (showing the last state, less
        a Stacks dump: that was where the ranks were then, not how the cell ended). Once only:
        a cell's view stopped at its cell's end keeps that state when the pool ends later.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)
        if self.widget.comm is not None:
            self.state.sync(self.pool)
            self._last_draw()
        self._release()

    def _last_draw(self) -> None:
        """The view as it ended, less a Stacks dump (where the ranks were then, not how the
        cell or the pool ended).
        """
        self.refresh(force=True)
        if self.stacks_view.comm is not None and self.stacks_view.value:
            self.stacks_view.value = ""

    def close(self) -> None:
        """Stop redrawing and close every widget of the panel."""
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)
        self._release()
        self.charts.close()
        for child in [*self.outputs, *self.buttons.children, *self.widget.children]:
            child.close()
        self.widget.close()

    def _release(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()

    def _pool_ended(self) -> bool:
        return self.pool.started_at is not None and not self.pool.running

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.widget.comm is None:  # closed (Widget.close_all, or by its view)
                break
            try:
                self.state.sync(self.pool)
                self.refresh()
                if self._cell_ended() or (self._pool_ended() and self._ends_known()):
                    self._last_draw()
                    break
            except Exception:  # a drawing bug must not kill the timer silently
                log.exception("the panel of pool %r failed to draw", self.pool.name)
        self._release()
        self._set_buttons()

    def _cell_ended(self) -> bool:
        progress = self.state.progress
        return progress is not None and not progress.running

    def _ends_known(self) -> bool:
        """After the pool ended: whether every rank said how it ended (or long enough passed)."""
        now = time.monotonic()
        if self._ended_at is None:
            self._ended_at = now
        ranks = self.state.snapshot().ranks
        return all(r.state in GONE for r in ranks) or now - self._ended_at > ENDING_GRACE

    def _click(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # a click has nowhere to raise to; the log has it
            log.exception("panel button of pool %r failed", self.pool.name)

    def show_stacks(self) -> None:
        """Every rank's stacks in the view, replacing the last ones (the Stacks button's click).

        Blocks the click's thread (a kernel subshell while a cell runs) for about a second: the
        ranks answer from their reader thread. A failure is the view's one line, not raised.
        """
        taken = time.strftime("%H:%M:%S")
        started = time.monotonic()
        try:
            text = self._on_stacks()
        except Exception as exc:  # noqa: BLE001 - a click has nowhere to raise to
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            title, text = f"no stacks at {taken}: {first}", ""
        else:
            took = time.monotonic() - started
            title = f"every rank's stacks at {taken} (took {took:.1f} s)"
        if self.stacks_view.comm is not None:
            self.stacks_view.value = stacks_html(title, text)

    def _set_buttons(self) -> None:
        """Each button enabled only when it can act: Interrupt while a cell runs, Stacks while
        the view is live and the pool runs, Shut down while the pool runs.
        """
        pool_up = not self._pool_ended()
        live = pool_up and not self._cell_ended() and not self._stop.is_set()
        wanted = {
            self.interrupt_button: live and self.state.cell_running,
            self.stacks_button: live,
            self.shutdown_button: pool_up,
        }
        for button, enabled in wanted.items():
            if button.disabled == enabled and button.comm is not None:
                button.disabled = not enabled

    # --------------------------------------------------------------------- drawing

    def refresh(self, force: bool = False) -> bool:
        """Redraw from the state if its version moved (or a second passed, for the clocks)."""
        with self._draw_lock:
            now = time.time()
            version = self.state.version
            changed = version != self._drawn_version
            if not (force or changed or now - self._drawn_at >= 1.0):
                return False
            snap = self.state.snapshot()
            self.header.value = header_html(snap.header, now, snap.progress)
            self.nodes.value = nodes_html(snap.nodes, now)
            self.charts.update(snap.series, now, force)
            if force or changed:
                self._draw_outputs(snap)
                self.metrics.value = metrics_html(snap)
                self.messages.value = messages_html(snap.messages)
            self._set_buttons()
            self._drawn_version, self._drawn_at = snap.version, now
            return True

    def _draw_outputs(self, snap: PanelSnapshot) -> None:
        ranks = tab_ranks(snap.ranks)
        if len(self.outputs) < len(ranks):
            missing = len(ranks) - len(self.outputs)
            self.outputs += [widgets.HTML().add_class("sky-output") for _ in range(missing)]
            self.tabs.children = tuple(self.outputs)
            if self.tabs.selected_index is None:
                self.tabs.selected_index = 0
        titles = tuple(tab_title(r.rank, r) for r in ranks)
        if tuple(self.tabs.titles) != titles:
            self.tabs.titles = titles
        for view, rank in zip(self.outputs, ranks, strict=False):
            view.value = output_html(rank, in_cell=rank.rank in self.in_cell)

    # --------------------------------------------------------------------- display

    def summary(self) -> str:
        return summary_text(self.state.snapshot())

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The widget view and a text/plain summary; ``metadata["skyward_jupyter"]`` marks it."""
        data: dict[str, Any] = {}
        if self.widget.comm is not None:
            if self._widget_view is None:
                # ipywidgets' bundle, without its text (the repr of every trait: a millisecond
                # each time; the panel's own summary replaces it), kept for the panel's life.
                view = self.widget._repr_mimebundle_()
                self._widget_view = {k: v for k, v in view.items() if k != "text/plain"}
            data.update(self._widget_view)
        data["text/plain"] = self.summary()
        return data, {"skyward_jupyter": {"panel": self.pool.name}}

    def __repr__(self) -> str:
        return self.summary()
