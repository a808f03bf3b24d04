"""The panel as lines of text, for terminal IPython (no widget frontend).

Like :class:`~skyward_jupyter.display.output.CellOutput`, events are only queued on the pool's
IO thread; :meth:`TextReport.flush` writes on the kernel's thread while a cell waits (the pool's
``on_wait`` hook) and once more when it ends (``final=True``). What it says:

- each node's progress while its machine is provisioned (``node 0: booting, i-0abc pending``);
- rank state changes worth reading: ``rank 1 (node 1): lost, killed by SIGKILL``, ``... failed``,
  and ``rank 1 (node 1): ready again`` when a lost rank was restarted; ranks that changed the
  same way one after the other share a line (``ranks 0-255 (nodes 0-31): failed``). A rank
  that fails in a cell is told when the cell ends, unless the pool only stopped it after another
  rank's failure. Changes that happen between cells (a rank lost while idle) are written when
  the next cell starts.
  Starting, running and idle are not news; the session already says when a pool starts and
  ends.
- notes of the pool made between cells (notes made during a cell come with its result);
- a rank inside a collective for ``WAITING_MARK_AFTER`` seconds (from its heartbeat), once per
  rank and collective call site in a cell: ``rank 0 (node 0): waiting 3 s in barrier at cell
  line 4`` (ranks that pass the mark together share a line). ``%sky stacks`` says more;
- one line per step of the running cell's ``log()`` metrics, once the step is complete (every
  rank of the cell logged it, or ``grace`` seconds passed since its first value, or the cell
  ended): ``step 3: loss 0.4123 (0.4012 - 0.4234), accuracy 91.2``, mean first and the range
  across ranks when they differ. Never more than one line per step; when steps complete faster
  than a person reads (more than ``burst`` lines, then ``per_second``), the lines in between are
  left out, the last one is always written, and the cell ends with how many were left out. Each
  step line says the pace as tqdm does: ``step 140/500 (28%, 2.3 steps/s, 2 min 36 s left)``
  (the total from ``log(..., total=N)``), and a cell that logged steps ends with a line saying
  how it ended, after how long, at which step and pace.

Plain text only: no ANSI escape codes, control characters are replaced.
"""

from __future__ import annotations

import collections
import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import TextIO

from ..events import (
    CellFinished,
    CellStarted,
    MetricsLogged,
    NodeStateChanged,
    PoolEvent,
    PoolMessage,
    RankState,
    RankStateChanged,
    RankUsage,
)
from ..flags import rank_span
from ..runtime import TOTAL_KEY
from .format import format_number, format_seconds, step_pace
from .metrics import GRACE, MetricRow, Pace, StepNumbers, step_complete, total_of
from .snapshot import Waiting
from .state import WAITING_MARK_AFTER

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_QUEUE_LIMIT = 100_000


def plain(text: str) -> str:
    """One line of plain text: control characters (ESC included) become spaces."""
    return _CONTROL.sub(" ", text).strip()


def metric_line(step: int, rows: list[MetricRow], expected: int = 0, pace: str = "") -> str:
    parts = []
    for row in rows:
        value = format_number(row.mean)
        if row.min != row.max:
            value += f" ({format_number(row.min)} - {format_number(row.max)})"
        parts.append(f"{row.name} {value}")
    line = f"{pace or f'step {step}'}: " + ", ".join(parts)
    ranks = max(r.ranks for r in rows)
    if expected and ranks < expected:
        line += f" [{ranks} of {expected} ranks]"
    return plain(line)


class _Lines:
    """The lines of one flush; ranks whose state changed the same way in a row share one
    (``ranks 8-15 (node 1): lost, killed by SIGKILL``), however many there are.
    """

    def __init__(self) -> None:
        self._lines: list[str | tuple[str, list[int], list[int]]] = []

    def append(self, line: str) -> None:
        self._lines.append(line)

    def extend(self, lines: Iterable[str]) -> None:
        self._lines.extend(lines)

    def rank(self, rank: int, node: int, what: str) -> None:
        last = self._lines[-1] if self._lines else None
        if isinstance(last, tuple) and last[0] == what:
            last[1].append(rank)
            if node not in last[2]:
                last[2].append(node)
        else:
            self._lines.append((what, [rank], [node]))

    def text(self) -> str:
        return "".join(
            (line if isinstance(line, str) else plain(_ranks_line(*line))) + "\n"
            for line in self._lines
        )


def _ranks_line(what: str, ranks: list[int], nodes: list[int]) -> str:
    who = f"rank{'s' * (len(ranks) > 1)} {rank_span(ranks)}"
    return f"{who} (node{'s' * (len(nodes) > 1)} {rank_span(nodes)}): {what}"


class TextReport:
    def __init__(
        self,
        out: TextIO | None = None,
        *,
        grace: float = GRACE,
        burst: int = 5,
        per_second: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._out = out
        self.grace = grace
        self.burst = burst
        self.per_second = per_second
        self._clock = clock
        self._queue: collections.deque[PoolEvent] = collections.deque(maxlen=_QUEUE_LIMIT)
        self._numbers = StepNumbers()
        self._cell: int | None = None
        self._cells_seen = 0
        self._expected = 0
        # This cell's metrics: step -> name -> rank -> value; when each step first arrived.
        self._steps: dict[int, dict[str, dict[int, float]]] = {}
        self._first: dict[int, float] = {}
        self._done: set[int] = set()
        self._held: int | None = None
        self._skipped = 0
        self._tokens = float(burst)
        self._refilled = clock()
        self._lost: set[int] = set()
        self._failing: dict[int, tuple[int, str]] = {}  # rank -> (node, line) until the cell ends
        # Ranks over the waiting mark, as of their last heartbeat (set on the IO thread, taken
        # on the kernel's: one entry per rank, so heartbeats never fill the queue).
        self._waits: dict[int, RankUsage] = {}
        self._told: set[tuple[int, str]] = set()  # (rank, what) written in this cell
        self._pace = Pace()
        self._cell_started = 0.0

    # ------------------------------------------------------------------- IO thread

    def on_event(self, event: PoolEvent) -> None:
        """Keep what this report may write about (called on the pool's IO thread)."""
        if isinstance(
            event,
            RankStateChanged
            | NodeStateChanged
            | MetricsLogged
            | CellStarted
            | CellFinished
            | PoolMessage,
        ):
            self._queue.append(event)
        elif (
            isinstance(event, RankUsage)
            and event.waiting is not None
            and event.waited >= WAITING_MARK_AFTER
        ):
            self._waits[event.rank] = event

    __call__ = on_event

    # ----------------------------------------------------------------- kernel thread

    def flush(self, final: bool = False) -> None:
        """Write what is new; ``final``: the cell ended, write its last metrics too."""
        lines = _Lines()
        while self._queue:
            event = self._queue.popleft()
            if isinstance(event, CellFinished):
                lines.extend(self._metric_lines(final=True))
            self._take(event, lines)
        lines.extend(self._waiting_lines())
        lines.extend(self._metric_lines(final=final))
        if final:
            self._cell = None
        text = lines.text()
        if text:
            out = self._out or sys.stdout
            out.write(text)
            out.flush()

    def _rank_state(self, rank: int, node: int, event: RankStateChanged, lines: _Lines) -> None:
        if event.state in (RankState.LOST, RankState.FAILED):
            detail = f", {event.detail}" if event.detail else ""
            if event.state is RankState.FAILED and self._cell is not None:
                # Told at the cell's end: a rank the pool only stopped after another's
                # failure is marked failed too, and is not news.
                self._failing[rank] = (node, f"{event.state.value}{detail}")
                return
            if event.state is RankState.LOST:
                self._lost.add(rank)
            lines.rank(rank, node, f"{event.state.value}{detail}")
        elif event.state is RankState.READY and rank in self._lost:
            self._lost.discard(rank)
            lines.rank(rank, node, "ready again")

    def _take(self, event: PoolEvent, lines: _Lines) -> None:
        if isinstance(event, RankStateChanged):
            for rank, node in event.ranks:
                self._rank_state(rank, node, event, lines)
        elif isinstance(event, NodeStateChanged):
            detail = f", {event.detail}" if event.detail else ""
            lines.append(plain(f"node {event.node}: {event.state.value}{detail}"))
        elif isinstance(event, PoolMessage):
            if self._cell is None and self._cells_seen:
                lines.append(plain(event.text))
        elif isinstance(event, CellStarted):
            self._cell = event.cell_id
            self._cells_seen += 1
            self._expected = event.ranks
            self._told.clear()
            self._steps.clear()
            self._first.clear()
            self._done.clear()
            self._held, self._skipped = None, 0
            self._pace, self._cell_started = Pace(), self._clock()
        elif isinstance(event, CellFinished):
            failing, self._failing = self._failing, {}
            for rank, (node, what) in sorted(failing.items()):
                if not any(r.rank == rank and event.result.only_stopped(r) for r in event.result):
                    lines.rank(rank, node, what)
            if self._cell == event.cell_id:
                self._cell = None
                lines.extend(self._end_line(event))
        elif isinstance(event, MetricsLogged):
            now = self._clock()
            steps = []
            for step, values in event.rows:
                if step is not None:
                    steps.append(step)
                for name, value in values.items():
                    if name == TOTAL_KEY:
                        continue
                    resolved = self._numbers.resolve(event.rank, name, step)
                    steps.append(resolved)
                    if resolved in self._done:
                        continue  # already written: once per step
                    by_name = self._steps.setdefault(resolved, {})
                    by_name.setdefault(name, {})[event.rank] = value
                    self._first.setdefault(resolved, now)
            self._pace.note(now, steps, total_of(event))

    def _end_line(self, event: CellFinished) -> list[str]:
        """How a cell that logged steps ended: ``cell done after 1 min 05 s: step 500/500,
        7.7 steps/s`` (failed on rank 1, interrupted).
        """
        pace = self._pace
        if pace.step is None or (pace.rate is None and pace.total is None):
            return []  # a step or two: the step lines said it all
        result = event.result
        failed = [r.rank for r in result if r.error is not None]
        how = (
            "timed out"  # (how long it took follows)
            if result.timed_out
            else "interrupted"
            if result.interrupted
            else f"failed on rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))}"
            if failed
            else "done"
        )
        took = format_seconds(self._clock() - self._cell_started)
        return [
            plain(f"cell {how} after {took}: {step_pace(pace.step, pace.total, pace.rate, False)}")
        ]

    def _waiting_lines(self) -> list[str]:
        """Ranks that passed the waiting mark since the last flush, once per call site."""
        new: list[tuple[RankUsage, Waiting]] = []
        for rank in list(self._waits):
            usage = self._waits.pop(rank, None)
            if usage is None or usage.waiting is None or self._cell is None:
                continue  # between cells: a heartbeat from the end of the last one
            if (rank, usage.waiting) not in self._told:
                self._told.add((rank, usage.waiting))
                new.append((usage, Waiting((rank,), usage.waiting, usage.waited)))
        lines = []
        for group in Waiting.grouped([w for _, w in new]):
            nodes = sorted({u.node for u, _ in new if u.rank in group.ranks})
            who = f"rank{'s' * (len(group.ranks) > 1)} {', '.join(map(str, group.ranks))}"
            where = f"node{'s' * (len(nodes) > 1)} {', '.join(map(str, nodes))}"
            lines.append(plain(f"{who} ({where}): {group.mark}"))
        return lines

    def _rows(self, step: int) -> list[MetricRow]:
        return [
            MetricRow.of(step, name, values.values())
            for name, values in self._steps.get(step, {}).items()
        ]

    def _complete(self, step: int, now: float) -> bool:
        ranks: set[int] = set()
        for values in self._steps[step].values():
            ranks.update(values)
        return step_complete(len(ranks), self._expected, self._first[step], now, self.grace)

    def _token(self, now: float) -> bool:
        self._tokens = min(
            float(self.burst), self._tokens + (now - self._refilled) * self.per_second
        )
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def _forget(self, step: int) -> None:
        self._steps.pop(step, None)
        self._first.pop(step, None)

    def _line(self, step: int) -> str:
        pace = self._pace
        rate = pace.rate if step == pace.step else None  # the pace is now's, not an old step's
        return metric_line(
            step, self._rows(step), self._expected, step_pace(step, pace.total, rate)
        )

    def _metric_lines(self, final: bool) -> list[str]:
        now = self._clock()
        ready = sorted(
            s for s in self._steps if s not in self._done and (final or self._complete(s, now))
        )
        lines = []
        for step in ready:
            self._done.add(step)
            if self._held is not None:
                self._skipped += 1  # an older step than this one, never written
                self._forget(self._held)
                self._held = None
            if self._token(now):
                lines.append(self._line(step))
                self._forget(step)
            else:
                self._held = step
        if self._held is not None and (final or (not ready and self._token(now))):
            lines.append(self._line(self._held))
            self._forget(self._held)
            self._held = None
        if final:
            if self._skipped:
                lines.append(f"({self._skipped} steps not shown; %sky metrics lists every step)")
            self._steps.clear()
            self._first.clear()
            self._skipped = 0
        return lines
