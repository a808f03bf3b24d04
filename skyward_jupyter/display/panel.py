"""The live panel of a pool, in ipywidgets: header, nodes, output per rank, metrics, buttons.

A :class:`SkyPanel` draws a :class:`~.state.PanelState` (which the pool's events feed on the
pool's IO thread) from its own timer thread, at most ``1 / interval`` times a second and only
when the state's version moved (the uptime and heartbeat ages also tick once a second). Widget
updates are comm messages, safe from a background thread; nothing is printed from it. The timer
ends when the pool has ended (after drawing the end) or when the widget is closed.

Displayed (``IPython.display.display(panel)``), it is a mimebundle carrying the widget view and a
``text/plain`` summary, so a frontend without widgets and nbconvert to text read the pool's state
rather than ``VBox(...)``.

DOM classes, for styling and for browser tests:

=====================  ==========================================================================
``sky-panel``          the whole panel (a VBox)
``sky-header``         the pool line: name, provider, nodes x ranks, state, uptime, cost
``sky-buttons``        the row of buttons: ``sky-interrupt`` and ``sky-shutdown`` (Buttons)
``sky-nodes``          the node table; one ``tr.sky-node[data-node=K][data-state=STATE]`` per node
``sky-state``          a state label, also ``sky-state-<state>`` (coloured), ``data-state=STATE``
``sky-tabs``           the Tab of rank outputs: "rank 0 (head)", "rank 1", ...
``sky-output``         a rank's output (HTML widget); inside, ``pre.sky-stdout[data-rank=K]`` and
                       ``pre.sky-stderr[data-rank=K]``
``sky-metrics``        the latest-values table; ``tr.sky-metric[data-metric=NAME]`` per metric
``sky-charts``         the charts: ``svg.sky-chart[data-metric=NAME]`` (see :mod:`.chart`)
``sky-messages``       the pool's last notes
=====================  ==========================================================================
"""

from __future__ import annotations

import concurrent.futures
import html
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped]

from ..events import RankState
from .chart import small_multiples
from .state import (
    Header,
    NodeRow,
    PanelSnapshot,
    PanelState,
    RankRow,
    format_bytes,
    format_number,
    format_seconds,
    summary_text,
)

log = logging.getLogger(__name__)

INTERVAL = 0.25
"""Seconds between redraws at most (about 4 a second)."""
SHOWN_OUTPUT = 20_000
"""Characters of a rank's output the panel sends (the state keeps more)."""
SETTLE = 30.0
"""After the pool ended, how long to keep drawing while its ranks report how they ended."""

STATE_COLOURS = {
    RankState.PROVISIONING: "#9a6700",
    RankState.BOOTING: "#9a6700",
    RankState.CONNECTING: "#9a6700",
    RankState.READY: "#1a7f37",
    RankState.RUNNING: "#0969da",
    RankState.IDLE: "#1a7f37",
    RankState.FAILED: "#cf222e",
    RankState.LOST: "#cf222e",
    RankState.TERMINATED: "#6e7781",
}
_GONE = (RankState.LOST, RankState.TERMINATED)
_CELL = "padding: 2px 10px 2px 0; text-align: left; white-space: nowrap"
_TABLE = "border-collapse: collapse; font-size: 12px; font-family: sans-serif"


# ------------------------------------------------------------------------------- drawing


def state_label(state: RankState, detail: str = "") -> str:
    title = f' title="{html.escape(detail)}"' if detail else ""
    return (
        f'<span class="sky-state sky-state-{state.value}" data-state="{state.value}"{title} '
        f'style="color: {STATE_COLOURS[state]}; font-weight: bold">{state.value}</span>'
    )


def header_html(header: Header, now: float) -> str:
    h = header
    parts = [
        f"<b>pool {html.escape(repr(h.name))}</b>",
        html.escape(h.provider or "?"),
        f"{h.nodes} node{'s' * (h.nodes != 1)}"
        + (f" &times; {h.ranks_per_node} rank{'s' * (h.ranks_per_node != '1')}" if h.ranks else ""),
        state_label(h.state),
        f"up {format_seconds(h.uptime(now))}",
    ]
    cost = h.cost(now)
    if h.price_per_hour is not None and cost is not None:
        parts.append(f"${h.price_per_hour:.2f}/hour, ${cost:.2f} so far")
    if h.cell is not None:
        parts.append(f"cell {h.cell} running")
    return (
        '<div class="sky-header" style="font-family: sans-serif; font-size: 13px">'
        + " &middot; ".join(parts)
        + "</div>"
    )


def nodes_html(nodes: Sequence[NodeRow], now: float) -> str:
    heads = ("node", "address", "type", "state", "ranks", "CPU", "memory", "GPU memory", "heard")
    rows = []
    for n in nodes:
        age = n.heartbeat_age(now)
        heard = "-" if age is None or n.state in _GONE else f"{age:.1f} s ago"
        note = (
            f' <span class="sky-detail" style="color: #6e7781">{html.escape(n.detail)}</span>'
            if n.detail and n.state in (RankState.FAILED, RankState.LOST)
            else ""
        )
        cells = (
            str(n.index),
            html.escape(n.address or "-"),
            html.escape(n.kind or "-"),
            state_label(n.state, n.detail) + note,
            ", ".join(map(str, n.ranks)) or "-",
            "-" if n.cpu_percent is None else f"{n.cpu_percent:.0f}%",
            format_bytes(n.rss_bytes),
            format_bytes(n.gpu_memory_bytes),
            heard,
        )
        rows.append((f'class="sky-node" data-node="{n.index}" data-state="{n.state.value}"', cells))
    return _table("sky-nodes", heads, rows)


def _table(css_class: str, heads: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> str:
    """An HTML table; each row is (attributes of its ``tr``, its cells' HTML)."""
    head = "".join(f'<th style="{_CELL}">{h}</th>' for h in heads)
    body = "".join(
        f"<tr {attrs}>" + "".join(f'<td style="{_CELL}">{c}</td>' for c in cells) + "</tr>"
        for attrs, cells in rows
    )
    return (
        f'<table class="{css_class}" style="{_TABLE}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def _tail(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    cut = text.find("\n", len(text) - limit)
    cut = len(text) - limit if cut < 0 else cut + 1
    return text[cut:], cut


def output_html(rank: RankRow, limit: int = SHOWN_OUTPUT) -> str:
    """A rank's stdout (and stderr, when there is any), newest at the bottom, in view."""
    stdout, cut_out = _tail(rank.stdout, limit)
    stderr, cut_err = _tail(rank.stderr, limit // 4)
    dropped = rank.dropped + cut_out + cut_err
    pre = "margin: 0; white-space: pre-wrap; font-size: 12px"
    parts = [
        f'<div class="sky-rank-state" style="font-family: sans-serif; font-size: 12px">'
        f"rank {rank.rank} on node {rank.node}: {state_label(rank.state, rank.detail)}</div>"
    ]
    if dropped:
        parts.append(
            f'<div class="sky-dropped" style="color: #6e7781; font-size: 11px">'
            f"[{dropped} earlier characters not shown]</div>"
        )
    parts.append(
        f'<pre class="sky-stdout" data-rank="{rank.rank}" style="{pre}">{html.escape(stdout)}</pre>'
    )
    if stderr:
        parts.append(
            f'<pre class="sky-stderr" data-rank="{rank.rank}" style="{pre}; color: #cf222e">'
            f"{html.escape(stderr)}</pre>"
        )
    # column-reverse keeps the scroll position at the bottom when the content is replaced.
    return (
        '<div style="max-height: 320px; overflow-y: auto; display: flex; '
        'flex-direction: column-reverse"><div>' + "".join(parts) + "</div></div>"
    )


def metrics_html(snap: PanelSnapshot) -> str:
    if not snap.latest:
        return (
            '<div class="sky-metrics sky-metrics-empty" style="font-family: sans-serif; '
            'font-size: 12px; color: #6e7781">no metrics yet: call '
            "<code>log(step=..., loss=...)</code> in a %%sky cell</div>"
        )
    heads = ("metric", "step", "mean", "min", "max", "ranks")
    rows = []
    for r in snap.latest:
        cells = (
            html.escape(r.name),
            str(r.step),
            format_number(r.mean),
            format_number(r.min),
            format_number(r.max),
            str(r.ranks),
        )
        rows.append((f'class="sky-metric" data-metric="{html.escape(r.name)}"', cells))
    return _table("sky-metrics", heads, rows)


def messages_html(messages: Sequence[str]) -> str:
    items = "".join(f"<li>{html.escape(m)}</li>" for m in messages[-3:])
    style = "font-family: sans-serif; font-size: 12px; color: #6e7781; margin: 0"
    return f'<ul class="sky-messages" style="{style}">{items}</ul>' if items else ""


def tab_title(rank: int) -> str:
    return "rank 0 (head)" if rank == 0 else f"rank {rank}"


# ------------------------------------------------------------ clicks while a cell runs

_subshell: str | None = None
_subshell_lock = threading.Lock()


def _click_subshell() -> str | None:
    """A kernel subshell for the buttons' messages, so a click is handled while a cell runs.

    A running cell blocks the kernel's main thread, and with it every message the frontend sends
    on the shell channel, widget clicks included. ipykernel 7 (kernel subshells) can route a
    comm's messages to another thread; without it (older kernels, terminal IPython) the buttons
    act when the kernel is next idle.
    """
    global _subshell
    with _subshell_lock:
        if _subshell is not None:
            return _subshell
        try:
            from ipykernel.kernelbase import Kernel

            if not Kernel.initialized():
                return None
            channel = Kernel.instance().shell_channel_thread
            create = channel.manager._create_subshell
            loop = channel.io_loop
        except (ImportError, AttributeError):
            return None
        made: concurrent.futures.Future[str] = concurrent.futures.Future()

        def make() -> None:
            try:
                made.set_result(create())
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                made.set_exception(exc)

        try:
            loop.add_callback(make)
            _subshell = made.result(timeout=10)
        except Exception:  # the buttons still work when the kernel is idle
            log.debug("no kernel subshell for the panel's buttons", exc_info=True)
            return None
        return _subshell


def _route_clicks(buttons: Sequence[widgets.Button]) -> bool:
    subshell = _click_subshell()
    if subshell is None:
        return False
    for button in buttons:
        comm = button.comm
        if comm is not None and hasattr(comm, "_reply_subshell_for"):
            comm._reply_subshell_for = lambda data, default, _s=subshell: _s
    return True


# ----------------------------------------------------------------------------- the panel


class SkyPanel:
    """The live panel of one pool.

    ``state`` may be shared (then whoever made it feeds it); without one, the panel makes its
    own and subscribes it to the pool. ``on_interrupt`` and ``on_shutdown`` are what the buttons
    do (default: ``pool.interrupt()`` and ``pool.close()``); the session's views pass a shut
    down that goes through the session.
    """

    def __init__(
        self,
        pool: Any,
        state: PanelState | None = None,
        *,
        on_interrupt: Callable[[], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
        interval: float = INTERVAL,
        start: bool = True,
    ) -> None:
        self.pool = pool
        self._unsubscribe: Callable[[], None] | None = None
        if state is None:
            state = PanelState(pool.name)
            self._unsubscribe = pool.subscribe(state.apply)
        self.state = state
        self.state.sync(pool)
        self.interval = interval
        self._on_interrupt = on_interrupt or pool.interrupt
        self._on_shutdown = on_shutdown or pool.close

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
        self.interrupt_button.on_click(lambda _: self._click(self._on_interrupt))
        self.shutdown_button.on_click(lambda _: self._click(self._on_shutdown))
        self.buttons = widgets.HBox([self.interrupt_button, self.shutdown_button]).add_class(
            "sky-buttons"
        )
        self.nodes = widgets.HTML().add_class("sky-nodes")
        self.tabs = widgets.Tab().add_class("sky-tabs")
        self.outputs: list[widgets.HTML] = []
        self.metrics = widgets.HTML().add_class("sky-metrics")
        self.charts = widgets.HTML().add_class("sky-charts")
        self.messages = widgets.HTML().add_class("sky-messages")
        self.widget = widgets.VBox(
            [
                self.header,
                self.buttons,
                self.nodes,
                self.tabs,
                self.metrics,
                self.charts,
                self.messages,
            ]
        ).add_class("sky-panel")
        self.routed_clicks = _route_clicks([self.interrupt_button, self.shutdown_button])

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
        """Draw once more and stop redrawing; the widgets stay (showing the last state)."""
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)
        if self.widget.comm is not None:
            self.state.sync(self.pool)
            self.refresh(force=True)
        self._release()

    def close(self) -> None:
        """Stop redrawing and close every widget of the panel."""
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)
        self._release()
        for child in [*self.outputs, *self.buttons.children, *self.widget.children]:
            child.close()
        self.widget.close()

    def _release(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()

    def _pool_ended(self) -> bool:
        return getattr(self.pool, "started_at", None) is not None and not self.pool.running

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.widget.comm is None:  # closed (Widget.close_all, or by its view)
                break
            try:
                self.state.sync(self.pool)
                self.refresh()
                if self._pool_ended() and self._settled():
                    self.refresh(force=True)
                    break
            except Exception:  # a drawing bug must not kill the timer silently
                log.exception("the panel of pool %r failed to draw", self.pool.name)
        self._release()
        self._set_buttons()

    def _settled(self) -> bool:
        """After the pool ended: whether every rank said how it ended (or long enough passed)."""
        now = time.monotonic()
        if self._ended_at is None:
            self._ended_at = now
        ranks = self.state.snapshot().ranks
        return all(r.state in _GONE for r in ranks) or now - self._ended_at > SETTLE

    def _click(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # a click has nowhere to raise to; the log has it
            log.exception("panel button of pool %r failed", self.pool.name)

    def _set_buttons(self) -> None:
        ended = self._pool_ended()
        for button in (self.interrupt_button, self.shutdown_button):
            if button.disabled != ended and button.comm is not None:
                button.disabled = ended

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
            self.header.value = header_html(snap.header, now)
            self.nodes.value = nodes_html(snap.nodes, now)
            if force or changed:
                self._draw_outputs(snap)
                self.metrics.value = metrics_html(snap)
                self.charts.value = small_multiples(snap.series)
                self.messages.value = messages_html(snap.messages)
            self._set_buttons()
            self._drawn_version, self._drawn_at = snap.version, now
            return True

    def _draw_outputs(self, snap: PanelSnapshot) -> None:
        ranks = snap.ranks
        if len(self.outputs) < len(ranks):
            missing = len(ranks) - len(self.outputs)
            self.outputs += [widgets.HTML().add_class("sky-output") for _ in range(missing)]
            self.tabs.children = tuple(self.outputs)
            self.tabs.titles = tuple(tab_title(r.rank) for r in ranks)
            if self.tabs.selected_index is None:
                self.tabs.selected_index = 0
        for view, rank in zip(self.outputs, ranks, strict=False):
            view.value = output_html(rank)

    # --------------------------------------------------------------------- display

    def summary(self) -> str:
        return summary_text(self.state.snapshot())

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The widget view and a text/plain summary; ``metadata["skyward_jupyter"]`` marks it."""
        data: dict[str, Any] = {}
        if self.widget.comm is not None:
            data.update(self.widget._repr_mimebundle_())
        data["text/plain"] = self.summary()
        return data, {"skyward_jupyter": {"panel": self.pool.name}}

    def __repr__(self) -> str:
        return self.summary()
