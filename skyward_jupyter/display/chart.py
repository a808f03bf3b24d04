"""Live charts of ``log()`` metrics: one uPlot chart per metric, in an anywidget.

Each chart draws the mean across ranks as a line over the ranks' min-max band, with axes, ticks
and a grid, the width of the panel (it follows resizes). Hovering shows the step under the
cursor with its mean, min, max and how many ranks logged it (without a cursor: the last step);
dragging zooms, a double click zooms out. Two toggles per chart, "log" (log-scale y, offered
only while every value is positive) and "smooth" (an exponential moving average of the mean,
debiased as TensorBoard does, over the raw line), are widget state: the browser redraws at once
and the kernel keeps them (a chart updated or shown again keeps its scale).

Why uPlot through anywidget: uPlot is a small (50 KB), maintained canvas charting library made
for live time series: it redraws a few thousand points in a millisecond, and has log scales,
bands between two series and cursor hooks built in. anywidget ships a plain ES module as a
Jupyter widget (a pip package with a prebuilt lab extension; JupyterLab, Notebook 7, VS Code),
so the charts need no build step of ours and no Node.js on the user's side. bqplot, the other
candidate, pulls d3 and pandas, makes every toggle a round trip through a kernel that is busy
running the cell, and shows a tooltip per mark rather than one step's mean, min and max.
uPlot's files are vendored under ``static/`` from the npm package that ``labextension/
package.json`` pins (``make vendor-uplot`` copies them again), so charts draw without internet.

What the kernel sends stays bounded however long the run: at most :data:`MAX_POINTS` points per
metric (more steps are bucketed: the bucket's last step, the mean of its means, its lowest min,
its highest max), and a chart's points at most once per :data:`SEND_INTERVAL` seconds, only when
they changed (the cell's end sends what is left).

DOM (for browser tests): ``.sky-chart[data-metric=NAME][data-steps=S][data-points=P]
[data-scale=linear|log][data-smooth=on|off][data-y-ticks=...][data-x-range=MIN MAX]`` (a range
dragged to stays while points arrive, until a double click), its toggles ``input.sky-log``
and ``input.sky-smooth``, the readout ``.sky-hover[data-step][data-mean][data-min][data-max]
[data-ranks][data-hovered]`` and the uPlot canvas in ``.sky-plot``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets as widgets  # type: ignore[import-untyped]
import traitlets

from .metrics import MetricRow

MAX_POINTS = 500
"""Points sent per metric at most (about one per pixel of a wide chart)."""
SEND_INTERVAL = 1.0
"""Seconds between two sends of one chart's points while the cell runs."""
CHART_MIN_WIDTH = 360
"""Pixels: charts sit side by side while each gets at least this width."""

_STATIC = Path(__file__).with_name("static")
Points = dict[str, list[Any]]


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a gap in the chart."""
    return value if math.isfinite(value) else None


def decimate(rows: Sequence[MetricRow], max_points: int = MAX_POINTS) -> Points:
    """The columns a chart draws (``step``, ``first``, ``mean``, ``min``, ``max``, ``ranks``),
    at most ``max_points`` long: consecutive steps share a point when there are more, keeping
    the bucket's last step (``first`` its first), the mean of its means and its extremes.
    """
    size = max(1, math.ceil(len(rows) / max_points))
    out: Points = {k: [] for k in ("step", "first", "mean", "min", "max", "ranks")}
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        means = [r.mean for r in chunk if math.isfinite(r.mean)]
        lows = [r.min for r in chunk if math.isfinite(r.min)]
        highs = [r.max for r in chunk if math.isfinite(r.max)]
        out["step"].append(chunk[-1].step)
        out["first"].append(chunk[0].step)
        out["mean"].append(_finite(sum(means) / len(means)) if means else None)
        out["min"].append(min(lows) if lows else None)
        out["max"].append(max(highs) if highs else None)
        out["ranks"].append(max(r.ranks for r in chunk))
    return out


class MetricChart(anywidget.AnyWidget):
    """One metric's live chart (the browser side is ``static/chart.js``)."""

    _esm = (_STATIC / "uPlot.iife.min.js").read_text() + (_STATIC / "chart.js").read_text()
    _css = (_STATIC / "uPlot.min.css").read_text() + (_STATIC / "chart.css").read_text()

    metric = traitlets.Unicode("").tag(sync=True)
    steps = traitlets.Int(0).tag(sync=True)
    """Steps logged (``points`` may have fewer, bucketed)."""
    points = traitlets.Dict().tag(sync=True)
    log_scale = traitlets.Bool(False).tag(sync=True)
    smooth = traitlets.Bool(False).tag(sync=True)


class ChartGrid:
    """The panel's charts: a :class:`MetricChart` per metric, side by side as the width allows,
    each sent its points only when they changed, at most once per ``interval`` seconds.
    """

    def __init__(self, interval: float = SEND_INTERVAL, max_points: int = MAX_POINTS) -> None:
        self.interval = interval
        self.max_points = max_points
        self.charts: dict[str, MetricChart] = {}
        self._sent_at = -math.inf
        layout = widgets.Layout(
            grid_template_columns=f"repeat(auto-fit, minmax({CHART_MIN_WIDTH}px, 1fr))",
            grid_gap="8px",
            width="100%",
        )
        self.widget = widgets.GridBox([], layout=layout).add_class("sky-charts")

    def update(self, series: Mapping[str, Sequence[MetricRow]], now: float, force: bool) -> None:
        """Send what changed, unless the last send was under ``interval`` ago (``force``: the
        view's first and last draw).
        """
        if not force and now - self._sent_at < self.interval:
            return
        if self.widget.comm is None:  # closed
            return
        added = False
        for name, rows in series.items():
            chart = self.charts.get(name)
            if chart is None:
                chart = self.charts[name] = MetricChart(metric=name)
                added = True
            points = decimate(rows, self.max_points)
            if points != chart.points:
                with chart.hold_sync():
                    chart.points = points
                    chart.steps = len(rows)
                self._sent_at = now
        if added:
            self.widget.children = tuple(self.charts.values())

    def close(self) -> None:
        for chart in self.charts.values():
            chart.close()
        self.widget.close()
