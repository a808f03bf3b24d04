"""``log()`` metrics per step, reduced across the ranks that logged the step (mean, min, max).

Shared by the panel's state (every kept step, for the table, the chart and ``%sky metrics``) and
the text fallback (one line per completed step). A step logged again by a later cell replaces
what the earlier cell logged for it. ``log()`` without a step numbers that rank's values of that
metric 0, 1, 2, ... (after the last step the rank logged for it).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..events import MetricsLogged
from ..runtime import TOTAL_KEY

MAX_STEPS = 2000
"""Steps kept per metric (the highest ones)."""
RATE_STEPS = 20
"""Steps per second are measured over this many of the last new steps."""
GRACE = 2.0
"""Seconds after a step's first value from which it counts as complete though some ranks of the
cell have not logged it (they may never: a metric that rank 0 alone logs)."""


def step_complete(ranks: int, expected: int, first_at: float, now: float, grace: float) -> bool:
    """Whether a step's values are all there is to wait for: every rank of the cell
    (``expected``) logged it, or ``grace`` seconds passed since its first value.
    """
    return (expected > 0 and ranks >= expected) or now - first_at >= grace


class Pace:
    """A cell's last step, its steps per second (over the last :data:`RATE_STEPS` new steps)
    and its total once ``log(..., total=N)`` gave one: what tqdm shows, for the panel's
    progress and the text fallback alike. Feed it each :class:`MetricsLogged` of the cell,
    with the steps :class:`StepNumbers` resolved.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.total: int | None = None
        self._marks: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_STEPS)

    def note(self, now: float, steps: Iterable[int], total: float | None) -> None:
        if total is not None:
            self.total = int(total)
        last = max(steps, default=None)
        if last is None or (self.step is not None and last <= self.step):
            return
        self.step = last
        self._marks.append((now, last))

    @property
    def rate(self) -> float | None:
        if len(self._marks) < 2:
            return None
        (t0, s0), (t1, s1) = self._marks[0], self._marks[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def total_of(event: MetricsLogged) -> float | None:
    """The total steps a log() batch gave (``log(..., total=N)``), if any."""
    totals = [values[TOTAL_KEY] for _, values in event.rows if TOTAL_KEY in values]
    return totals[-1] if totals else None


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One metric at one step, reduced across the ranks that logged it.

    ``expected``: the ranks of the cell (0: not known); ``waiting``: the step is not complete
    (:func:`step_complete`), so its min and max are not yet the ranks' (a view says "1 of 2").
    """

    step: int
    name: str
    mean: float
    min: float
    max: float
    ranks: int
    expected: int = 0
    waiting: bool = False

    @classmethod
    def of(
        cls,
        step: int,
        name: str,
        values: Iterable[float],
        expected: int = 0,
        waiting: bool = False,
    ) -> MetricRow:
        seq = list(values)
        if any(v != v for v in seq):  # a NaN on any rank is the step's, wherever it came in
            nan = math.nan
            return cls(step, name, nan, nan, nan, len(seq), expected, waiting)
        total = sum(seq)
        # Near the largest float the sum overflows though each value is finite: a mean of
        # shares then stays between the least and the greatest, as a mean must.
        mean = total / len(seq) if math.isfinite(total) else sum(v / len(seq) for v in seq)
        return cls(step, name, mean, min(seq), max(seq), len(seq), expected, waiting)

    @property
    def ranks_text(self) -> str:
        """``2``; ``1 of 2`` while fewer ranks than the cell's logged the step."""
        if self.expected and self.ranks < self.expected:
            return f"{self.ranks} of {self.expected}"
        return str(self.ranks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "name": self.name,
            "mean": self.mean,
            "min": self.min,
            "max": self.max,
            "ranks": self.ranks,
        }


class StepNumbers:
    """Steps for ``log()`` calls that gave none: per rank and metric, one after the last."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str], int] = {}

    def resolve(self, rank: int, name: str, step: int | None) -> int:
        if step is None:
            step = self._last.get((rank, name), -1) + 1
        self._last[(rank, name)] = step
        return step


@dataclass(slots=True)
class _Step:
    cell_id: int | None
    values: dict[int, float]  # rank -> value
    first_at: float  # monotonic time of the first value


class MetricSteps:
    """One metric's values per step and rank, the highest ``max_steps`` steps kept."""

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self.max_steps = max_steps
        self.steps: dict[int, _Step] = {}
        self.last_cell: int | None = None  # the cell that logged most recently

    def put(self, step: int, rank: int, value: float, cell_id: int | None, now: float) -> None:
        record = self.steps.get(step)
        if record is None or record.cell_id != cell_id:
            record = self.steps[step] = _Step(cell_id, {}, now)
        record.values[rank] = value
        self.last_cell = cell_id
        if len(self.steps) > self.max_steps + max(16, self.max_steps // 10):
            for old in sorted(self.steps)[: len(self.steps) - self.max_steps]:
                del self.steps[old]

    def rows(self, name: str) -> list[MetricRow]:
        return [MetricRow.of(s, name, self.steps[s].values.values()) for s in sorted(self.steps)][
            -self.max_steps :
        ]

    def latest(
        self, name: str, expected: int = 0, now: float = 0.0, running: bool = False
    ) -> MetricRow | None:
        """The highest complete step the most recent cell logged (what a latest-values table
        shows): while the cell is ``running``, a step that some of its ``expected`` ranks have
        not logged yet waits (:func:`step_complete`); when no step is complete, the highest
        one, marked waiting.
        """
        steps = [s for s, r in self.steps.items() if r.cell_id == self.last_cell] or self.steps
        if not steps:
            return None
        ready = [
            s
            for s in steps
            if not running
            or step_complete(
                len(self.steps[s].values), expected, self.steps[s].first_at, now, GRACE
            )
        ]
        step = max(ready or steps)
        values = self.steps[step].values.values()
        return MetricRow.of(step, name, values, expected, waiting=not ready)
