"""The panel as one block of plain text: what a frontend without widgets, nbconvert to text and
``%sky panel`` in a terminal show instead of the widgets.
"""

from __future__ import annotations

import time

from ..events import RankState
from ..flags import rank_span
from ..model import GONE
from .format import format_bytes, format_number, format_seconds, progress_parts, text_bar
from .grouping import NODE_LINES, NodeGroup, counts_text, node_groups, trouble_lines
from .snapshot import PanelSnapshot, Progress


def summary_text(snap: PanelSnapshot, now: float | None = None, live: bool = True) -> str:
    """A cell's progress line (a cell's view), the pool line, the ranks in trouble, a line per
    node (or group of nodes, :mod:`.grouping`), the latest metrics and the last notes.

    ``live=False`` leaves out the figures that tick by themselves (uptime, cost, usage,
    heartbeat ages): what is left changes only when the pool's state does.
    """
    now = time.time() if now is None else now
    h = snap.header
    size = f"{h.nodes} node{'s' * (h.nodes != 1)}"
    if h.ranks:
        size += (
            f" x {h.ranks_per_node} rank{'s' * (h.ranks_per_node != '1')} per node "
            f"({h.ranks} rank{'s' * (h.ranks != 1)})"
        )
    line = f"pool {h.name!r} ({h.provider or '?'}): {size}, {h.state.value}"
    if live:
        line += f", up {format_seconds(h.uptime(now))}"
    cost = h.cost(now)
    if live and h.price_per_hour is not None and cost is not None:
        line += f", ${h.price_per_hour:.2f}/hour, ${cost:.2f} so far"
    if h.auto:
        line += f"; {h.auto_mark}"
    lines = [line]
    if snap.progress is not None:
        lines.insert(0, progress_line(snap.progress, now, live))
    lines.extend(f"  {line}" for line in trouble_lines(snap.ranks))
    for group in node_groups(snap.nodes):
        node = group.first
        state = node.state.value
        if group.mixed:
            state += f" ({counts_text(group.counts)})"
        if len(group.nodes) == 1:
            parts = [node.address or "-", node.kind or "-", state]
        else:
            parts = [f"{len(group.ranks)} ranks", node.kind or "-", state]
        if len(snap.nodes) > NODE_LINES:
            parts.append(f"ranks {rank_span(group.ranks)}")
        if live:
            parts.extend(_usage(group, now))
        if node.detail and node.state in (RankState.FAILED, RankState.LOST):
            parts.append(node.detail)
        parts.extend(w.label for w in node.waiting)
        lines.append(f"  {group.label}: " + ", ".join(parts))
    if snap.latest:
        lines.append("  metrics (mean, min-max across ranks):")
        width = max(len(r.name) for r in snap.latest)
        for row in snap.latest:
            spread = (
                ""
                if row.min == row.max or row.waiting
                else f" ({format_number(row.min)} - {format_number(row.max)})"
            )
            ranks = f"{row.ranks_text} rank{'s' * (row.ranks_text != '1')}"
            lines.append(
                f"    {row.name:<{width}}  step {row.step}: {format_number(row.mean)}{spread}, "
                + (f"{ranks}, waiting for the others" if row.waiting else ranks)
            )
    for message in snap.messages[-3:]:
        lines.append(f"  note: {message}")
    return "\n".join(lines)


def progress_line(progress: Progress, now: float, live: bool = True) -> str:
    """``In [7] running, 1 min 05 s, step 140/500, 2.3 steps/s, |#####     | 28%, 36 s left``;
    not ``live``: only what changes with the cell's state (outcome and step).
    """
    parts = progress_parts(progress, now)
    if not live:
        parts = [parts[0], *(p for p in parts if p.startswith("step "))]
    elif progress.fraction is not None:
        at = next(i for i, p in enumerate(parts) if p.endswith("%"))
        parts[at] = f"{text_bar(progress.fraction)} {parts[at]}"
    return ", ".join(parts)


def _usage(node: NodeGroup, now: float) -> list[str]:
    parts = []
    if node.cpu_percent is not None:
        parts.append(f"cpu {node.cpu_percent:.0f}%")
    if node.rss_bytes is not None:
        parts.append(f"mem {format_bytes(node.rss_bytes)}")
    if node.gpu_memory_bytes is not None:
        parts.append(f"gpu mem {format_bytes(node.gpu_memory_bytes)}")
    age = node.heartbeat_age(now)
    if age is not None and node.first.state not in GONE:
        parts.append(f"heartbeat {age:.1f} s ago")
    return parts
