"""Sizes, durations and numbers as the panel and its text fallback write them, alike in both."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .snapshot import Progress


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def format_seconds(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_number(x: float) -> str:
    if x != x:  # NaN
        return "nan"
    if x in (math.inf, -math.inf):  # a diverged loss: as Python writes it
        return "inf" if x > 0 else "-inf"
    if x == int(x) and abs(x) < 1e12:
        return str(int(x))
    return f"{x:.4g}"


def format_rate(steps_per_second: float) -> str:
    """``12.5 steps/s``; below one a second, ``4.0 s/step`` (as tqdm turns it round)."""
    if steps_per_second >= 1 or steps_per_second <= 0:
        return f"{steps_per_second:.1f} steps/s"
    return f"{1 / steps_per_second:.1f} s/step"


def text_bar(fraction: float, width: int = 20) -> str:
    filled = round(fraction * width)
    return "|" + "#" * filled + " " * (width - filled) + "|"


def progress_parts(progress: Progress, now: float) -> list[str]:
    """A cell's progress as the panel's header and the text write it: ``In [7] running``,
    ``1 min 05 s``, ``step 140/500``, ``2.3 steps/s``, ``28%``, ``2 min 36 s left``.
    """
    p = progress
    elapsed = format_seconds(p.elapsed(now))
    parts = [f"{p.label} {p.outcome}", elapsed if p.running else f"took {elapsed}"]
    if p.step is not None:
        parts.append(f"step {p.step}" + (f"/{p.total}" if p.total else ""))
    if p.rate:
        parts.append(format_rate(p.rate))
    if p.fraction is not None:
        parts.append(f"{p.fraction:.0%}")
    if p.eta is not None:
        parts.append(f"{format_seconds(p.eta)} left")
    return parts


def step_pace(step: int, total: int | None, rate: float | None, running: bool = True) -> str:
    """``step 140/500 (28%, 2.3 steps/s, 2 min 36 s left)``, as much of it as is known (the
    time left only while ``running``).
    """
    extra = []
    if total:
        extra.append(f"{min(1.0, step / total):.0%}")
    if rate:
        extra.append(format_rate(rate))
        if running and total and step < total:
            extra.append(f"{format_seconds((total - step) / rate)} left")
    head = f"step {step}" + (f"/{total}" if total else "")
    return head + (f" ({', '.join(extra)})" if extra else "")
