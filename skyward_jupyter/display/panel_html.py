"""The panel's parts as HTML: the pool line, the node table, a rank's output, the metrics table.

Pure functions of a :class:`~.snapshot.PanelSnapshot`'s rows and the time they are drawn at; the
widget panel (:mod:`.panel`) puts their HTML in its widgets. The DOM classes they use are listed
in :mod:`.panel`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..events import RankState
from ..flags import rank_span
from ..model import GONE, STATE_WORDS, state_colour
from .format import format_bytes, format_number, format_seconds, progress_parts
from .grouping import counts_text, node_groups
from .snapshot import Header, NodeRow, PanelSnapshot, Progress, RankRow, Waiting

SHOWN_OUTPUT = 20_000
"""Characters of a rank's output the panel sends (the state keeps more)."""

_CELL = "padding: 2px 10px 2px 0; text-align: left; white-space: nowrap"
_TABLE = "border-collapse: collapse; font-size: 12px; font-family: sans-serif"
_WAITING = "#9a6700"


def state_label(state: RankState, detail: str = "") -> str:
    title = f' title="{html.escape(detail or STATE_WORDS[state.value].meaning)}"'
    return (
        f'<span class="sky-state sky-state-{state.value}" data-state="{state.value}"{title} '
        f'style="color: {state_colour(state)}; font-weight: bold">{state.value}</span>'
    )


def waiting_html(waiting: Waiting, *, label: bool = True) -> str:
    """A rank (or ranks) inside a collective for a while: what it waits in, where, how long."""
    ranks = ",".join(map(str, waiting.ranks))
    text = waiting.label if label else waiting.mark
    return (
        f'<span class="sky-waiting" data-ranks="{ranks}" style="color: {_WAITING}">'
        f"{html.escape(text)}</span>"
    )


def progress_html(progress: Progress, now: float) -> str:
    """A cell's line: In [7], how it is going, elapsed, step, rate; with a total a bar and ETA."""
    parts = [html.escape(p) for p in progress_parts(progress, now)]
    parts[0] = f"<b>{parts[0]}</b>"
    bar = ""
    if progress.fraction is not None:
        colour = "#0969da" if progress.running else "#6e7781"
        bar = (
            f'<span class="sky-bar" data-fraction="{progress.fraction:.3f}" style="display: '
            "inline-block; width: 160px; height: 8px; background: #eaeef2; border-radius: 4px; "
            f'vertical-align: middle; margin: 0 4px"><span style="display: block; height: 100%; '
            f'width: {progress.fraction * 100:.1f}%; background: {colour}; border-radius: 4px">'
            "</span></span>"
        )
        parts.insert(3 if progress.step is not None else 2, bar)
    state = "running" if progress.running else "ended"
    return (
        f'<div class="sky-progress" data-cell="{progress.number}" data-state="{state}" '
        f'data-step="{progress.step if progress.step is not None else ""}" '
        'style="font-family: sans-serif; font-size: 13px">' + " &middot; ".join(parts) + "</div>"
    )


def header_html(header: Header, now: float, progress: Progress | None = None) -> str:
    """The pool line; in a cell's view, the cell's progress line above it, and no cell count."""
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
    if progress is None:
        parts.insert(1, "pool-wide view (every cell)")
        if h.cell is not None:
            parts.append("a cell running")
    if h.auto:
        parts.append(f'<b class="sky-auto">{html.escape(h.auto_mark)}</b>')
    pool = " &middot; ".join(parts)
    if progress is not None:
        pool = (
            progress_html(progress, now)
            + f'<div style="color: #6e7781; font-size: 12px">{pool}</div>'
        )
    return f'<div class="sky-header" style="font-family: sans-serif; font-size: 13px">{pool}</div>'


def nodes_html(nodes: Sequence[NodeRow], now: float) -> str:
    """A row per node, or per group of healthy neighbours in a large pool; trouble first."""
    heads = ("node", "address", "type", "state", "ranks", "CPU", "memory", "GPU memory", "heard")
    rows = []
    for group in node_groups(nodes):
        n = group.first
        age = group.heartbeat_age(now)
        heard = "-" if age is None or n.state in GONE else f"{age:.1f} s ago"
        note = (
            f' <span class="sky-detail" style="color: #6e7781">{html.escape(n.detail)}</span>'
            if n.detail and n.state in (RankState.FAILED, RankState.LOST)
            else ""
        )
        if group.mixed:
            counts = html.escape(counts_text(group.counts))
            note = f' <span class="sky-counts">({counts})</span>' + note
        note += "".join(f" {waiting_html(w)}" for w in n.waiting)
        single = len(group.nodes) == 1
        cells = (
            group.span,
            html.escape(n.address or "-") if single else f"{len(group.nodes)} nodes",
            html.escape(n.kind or "-"),
            state_label(n.state, n.detail) + note,
            html.escape(rank_span(group.ranks)) or "-",
            "-" if group.cpu_percent is None else f"{group.cpu_percent:.0f}%",
            format_bytes(group.rss_bytes),
            format_bytes(group.gpu_memory_bytes),
            heard,
        )
        where = (
            f'class="sky-node" data-node="{n.index}"'
            if single
            else f'class="sky-node sky-node-group" data-nodes="{group.span}"'
        )
        rows.append((f'{where} data-state="{n.state.value}"', cells))
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


def output_html(rank: RankRow, limit: int = SHOWN_OUTPUT, in_cell: bool = False) -> str:
    """A rank's stdout (and stderr, when there is any), newest at the bottom, in view.

    ``in_cell``: the cell's own output shows this rank's (the head's, by default); the tab
    then says so rather than show it a second time.
    """
    stdout, cut_out = _tail(rank.stdout, limit)
    stderr, cut_err = _tail(rank.stderr, limit // 4)
    if in_cell:
        stdout = stderr = ""
        cut_out = cut_err = 0
    dropped = 0 if in_cell else rank.dropped + cut_out + cut_err
    pre = "margin: 0; white-space: pre-wrap; font-size: 12px"
    parts = [
        f'<div class="sky-rank-state" style="font-family: sans-serif; font-size: 12px">'
        f"rank {rank.rank} on node {rank.node}: {state_label(rank.state, rank.detail)}"
        + (
            f' <span class="sky-error" style="color: #cf222e">{html.escape(rank.detail)}</span>'
            if rank.detail and rank.state in (RankState.FAILED, RankState.LOST)
            else ""
        )
        + (f", {waiting_html(rank.waiting, label=False)}" if rank.waiting else "")
        + "</div>"
    ]
    if in_cell:
        parts.append(
            '<div class="sky-in-cell" style="color: #6e7781; font-size: 12px">'
            "its output is the cell's own, below the panel</div>"
        )
    elif dropped:
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
    waiting = '<span class="sky-metric-waiting" style="color: #6e7781">waiting</span>'
    for r in snap.latest:
        cells = (
            html.escape(r.name),
            str(r.step),
            format_number(r.mean),
            waiting if r.waiting else format_number(r.min),
            waiting if r.waiting else format_number(r.max),
            r.ranks_text,
        )
        attrs = f'class="sky-metric" data-metric="{html.escape(r.name)}"'
        rows.append((attrs + f' data-waiting="{str(r.waiting).lower()}"', cells))
    return _table("sky-metrics", heads, rows)


def messages_html(messages: Sequence[str]) -> str:
    items = "".join(f"<li>{html.escape(m)}</li>" for m in messages[-3:])
    style = "font-family: sans-serif; font-size: 12px; color: #6e7781; margin: 0"
    return f'<ul class="sky-messages" style="{style}">{items}</ul>' if items else ""


def stacks_html(title: str, text: str = "") -> str:
    """What the Stacks button shows: a line saying when (or why not), then every rank's stacks."""
    head = (
        f'<div class="sky-stacks-title" style="font-family: sans-serif; font-size: 12px; '
        f'color: #6e7781">{html.escape(title)}</div>'
    )
    body = (
        f'<pre style="margin: 0; white-space: pre; font-size: 11px">{html.escape(text)}</pre>'
        if text
        else ""
    )
    box = "max-height: 320px; overflow: auto"
    return f'<div class="sky-stacks-view" style="{box}">{head}{body}</div>'


BADGE_CHARS = 40


def tab_title(rank: int, row: RankRow | None = None) -> str:
    """``rank 1``; a rank that failed or was lost is badged with its error's first line."""
    title = "rank 0 (head)" if rank == 0 else f"rank {rank}"
    if row is not None and row.state in (RankState.FAILED, RankState.LOST):
        what = row.detail or row.state.value
        what = what if len(what) <= BADGE_CHARS else what[: BADGE_CHARS - 1] + "\u2026"
        title += f" \u2716 {what}"
    return title
