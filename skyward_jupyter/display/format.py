"""Sizes, durations and numbers as the panel and its text fallback write them, alike in both."""

from __future__ import annotations


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
    if x == int(x) and abs(x) < 1e12:
        return str(int(x))
    return f"{x:.4g}"
