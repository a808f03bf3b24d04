"""Small SVG line charts of metrics: the mean across ranks as a line over a min-max band.

Drawn as text, no plotting library: one ``<svg class="sky-chart" data-metric=NAME>`` per metric
with a title, the y range at the left, the first and last step below, a ``<polygon
class="sky-band">`` from min to max (left out where every step's ranks agree), a ``<polyline
class="sky-mean">`` with one vertex per step, and a ``<circle class="sky-point">`` per step while
there are few enough to see. More steps than ``max_points`` are drawn in buckets (mean of the
means, lowest min, highest max), so a long run costs the same to send as a short one.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

from .format import format_number
from .metrics import MetricRow

WIDTH = 320
HEIGHT = 170
MAX_POINTS = 400
MAX_MARKERS = 60
COLOUR = "#1f6feb"
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 10, 22, 30


def _buckets(rows: Sequence[MetricRow], max_points: int) -> list[tuple[float, float, float, float]]:
    """(step, mean, min, max) per point to draw, at most ``max_points`` of them."""
    if len(rows) <= max_points:
        return [(r.step, r.mean, r.min, r.max) for r in rows]
    out = []
    size = len(rows) / max_points
    for i in range(max_points):
        chunk = rows[int(i * size) : int((i + 1) * size)] or rows[int(i * size) : int(i * size) + 1]
        out.append(
            (
                sum(r.step for r in chunk) / len(chunk),
                sum(r.mean for r in chunk) / len(chunk),
                min(r.min for r in chunk),
                max(r.max for r in chunk),
            )
        )
    return out


def _finite(x: float) -> bool:
    return math.isfinite(x)


def line_chart(
    name: str,
    rows: Sequence[MetricRow],
    *,
    width: int = WIDTH,
    height: int = HEIGHT,
    max_points: int = MAX_POINTS,
) -> str:
    """One metric's chart as an ``<svg>`` element (text)."""
    label = html.escape(name)
    head = (
        f'<svg class="sky-chart" data-metric="{label}" data-steps="{len(rows)}" '
        f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{label} by step" '
        'style="font-family: sans-serif; font-size: 10px; background: #fff">'
        f'<text class="sky-chart-title" x="{_LEFT}" y="14" font-size="12" '
        f'font-weight="bold" fill="#222">{label}</text>'
    )
    points = [p for p in _buckets(rows, max_points) if all(_finite(v) for v in p)]
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    axes = (
        f'<line class="sky-axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" '
        'stroke="#999"/>'
        f'<line class="sky-axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" '
        f'y2="{_TOP + plot_h}" stroke="#999"/>'
        f'<text class="sky-axis-label" x="{_LEFT + plot_w / 2:.1f}" y="{height - 4}" '
        'text-anchor="middle" fill="#555">step</text>'
    )
    if not points:
        empty = (
            f'<text x="{_LEFT + plot_w / 2:.1f}" y="{_TOP + plot_h / 2:.1f}" '
            'text-anchor="middle" fill="#888">no values yet</text>'
        )
        return head + axes + empty + "</svg>"
    s0, s1 = points[0][0], points[-1][0]
    lo = min(p[2] for p in points)
    hi = max(p[3] for p in points)
    if hi == lo:
        pad = abs(hi) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad

    def x(step: float) -> float:
        if s1 == s0:
            return _LEFT + plot_w / 2
        return _LEFT + (step - s0) / (s1 - s0) * plot_w

    def y(value: float) -> float:
        return _TOP + (1 - (value - lo) / (hi - lo)) * plot_h

    parts = [head, axes]
    for value, anchor_y in ((hi, _TOP + 4), (lo, _TOP + plot_h)):
        parts.append(
            f'<text class="sky-axis-label" x="{_LEFT - 4}" y="{anchor_y:.1f}" '
            f'text-anchor="end" fill="#555">{format_number(value)}</text>'
        )
    for step, anchor in ((s0, "start"), (s1, "end")):
        if step == s1 and s1 == s0 and anchor == "end":
            continue
        parts.append(
            f'<text class="sky-axis-label" x="{x(step):.1f}" y="{_TOP + plot_h + 12}" '
            f'text-anchor="{"middle" if s1 == s0 else anchor}" fill="#555">'
            f"{format_number(step)}</text>"
        )
    if any(p[2] != p[3] for p in points):
        upper = [f"{x(p[0]):.1f},{y(p[3]):.1f}" for p in points]
        lower = [f"{x(p[0]):.1f},{y(p[2]):.1f}" for p in reversed(points)]
        parts.append(
            f'<polygon class="sky-band" points="{" ".join(upper + lower)}" fill="{COLOUR}" '
            'fill-opacity="0.18" stroke="none"/>'
        )
    line = " ".join(f"{x(p[0]):.1f},{y(p[1]):.1f}" for p in points)
    parts.append(
        f'<polyline class="sky-mean" points="{line}" fill="none" stroke="{COLOUR}" '
        'stroke-width="1.5"/>'
    )
    if len(points) <= MAX_MARKERS:
        parts.extend(
            f'<circle class="sky-point" data-step="{format_number(p[0])}" cx="{x(p[0]):.1f}" '
            f'cy="{y(p[1]):.1f}" r="2.2" fill="{COLOUR}"/>'
            for p in points
        )
    parts.append("</svg>")
    return "".join(parts)


def small_multiples(series: Mapping[str, Sequence[MetricRow]], **kw: int) -> str:
    """Every metric's chart side by side (wrapping), in a ``<div class="sky-charts">``."""
    if not series:
        return '<div class="sky-charts"></div>'
    charts = "".join(line_chart(name, rows, **kw) for name, rows in series.items())
    return f'<div class="sky-charts" style="display:flex; flex-wrap:wrap; gap:8px">{charts}</div>'
