"""The panel's state: a thread-safe fold of pool events, read as immutable snapshots.

Events are applied on the pool's IO thread (:meth:`PanelState.apply`); views read a
:class:`PanelSnapshot` from their own thread (:meth:`PanelState.snapshot`) and redraw only when
:attr:`PanelState.version` moved. Nothing here knows about widgets or text: the widget panel
(:mod:`.panel`), the text fallback (:mod:`.text`) and ``%sky metrics`` all read from it.

What is kept, and how much of it:

- per rank: its state (with the detail of the last change), its last :class:`RankUsage`, and its
  stdout and stderr in :class:`TextBuffer` (a cap in characters, oldest lines dropped first; a
  lone ``\\r`` rewinds the line, so a progress bar keeps one line);
- per node (from the pool: address, GPU or instance type): a row aggregated from its ranks; a
  rank the pool lost shows as lost for ``LOST_HOLD`` seconds while the pool restarts it;
- per metric name: the values of each rank for each step (the last ``max_steps`` steps), reduced
  to mean, min and max across the ranks that logged that step. A step logged again by a later
  cell replaces what the earlier cell logged for it. ``log()`` without a step numbers that
  rank's values of that metric 0, 1, 2, ... (after the last step the rank logged for it).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..events import (
    CellFinished,
    CellStarted,
    MetricsLogged,
    NodeStateChanged,
    OutputReceived,
    PoolEvent,
    PoolMessage,
    RankState,
    RankStateChanged,
    RankUsage,
)

OUTPUT_CAP = 50_000
"""Characters of stdout (and, separately, stderr) kept per rank."""
MAX_STEPS = 2000
"""Steps kept per metric (the highest ones)."""
MAX_MESSAGES = 20
LOST_HOLD = 5.0
"""Seconds a lost rank shows as lost while the pool restarts it (a restart takes milliseconds
with a warm template: without the hold nobody would see that a rank was lost)."""

# Which state a group of ranks (a node, the pool) shows: the first of these any rank is in.
# Trouble first, then the slowest stage of starting, then activity.
_PRECEDENCE = (
    RankState.LOST,
    RankState.FAILED,
    RankState.PROVISIONING,
    RankState.BOOTING,
    RankState.CONNECTING,
    RankState.RUNNING,
    RankState.IDLE,
    RankState.READY,
    RankState.TERMINATED,
)
_GONE = (RankState.LOST, RankState.TERMINATED)
_RESTARTING = (RankState.BOOTING, RankState.CONNECTING, RankState.READY)
_BREAKS = re.compile(r"(\r\n|\r|\n)")


def aggregate_state(states: Iterable[RankState]) -> RankState:
    """The state a node (or pool) shows for its ranks' states.

    Terminated only when every rank is; otherwise the first of lost, failed, provisioning,
    booting, connecting, running, idle, ready that any rank is in. No ranks yet: provisioning.
    """
    present = set(states)
    if not present:
        return RankState.PROVISIONING
    for state in _PRECEDENCE:
        if state in present:
            return state
    return RankState.TERMINATED  # pragma: no cover - every state is in _PRECEDENCE


# ------------------------------------------------------------------------------------ output


class TextBuffer:
    """A rank's output as a terminal would keep it, bounded to ``cap`` characters.

    ``\\n`` and ``\\r\\n`` end a line; a lone ``\\r`` makes the next text replace the current line
    (``\\r`` then ``\\n`` keeps it), so a progress bar redrawn a thousand times is one line. When
    the text grows past ``cap``, whole lines are dropped from the start (``dropped`` counts the
    characters); a single line longer than ``cap`` keeps its end.
    """

    def __init__(self, cap: int = OUTPUT_CAP) -> None:
        self.cap = cap
        self._lines: list[str] = []  # finished lines, each ending in "\n"
        self._start = 0  # index of the first kept line (dropping is O(1); compacted in bulk)
        self._chars = 0  # characters in the kept finished lines
        self._line = ""
        self._rewind = False
        self.dropped = 0

    def write(self, text: str) -> None:
        for piece in _BREAKS.split(text):
            if not piece:
                continue
            if piece == "\r":
                self._rewind = True
            elif piece in ("\n", "\r\n"):
                self._lines.append(self._line + "\n")
                self._chars += len(self._line) + 1
                self._line, self._rewind = "", False
            else:
                if self._rewind:
                    self._line, self._rewind = piece, False
                else:
                    self._line += piece
                if len(self._line) > self.cap:
                    self.dropped += len(self._line) - self.cap
                    self._line = self._line[-self.cap :]
        self._trim()

    def _trim(self) -> None:
        while self._chars + len(self._line) > self.cap and self._start < len(self._lines):
            line = self._lines[self._start]
            self._start += 1
            self._chars -= len(line)
            self.dropped += len(line)
        if self._start > 1024 and self._start * 2 > len(self._lines):
            del self._lines[: self._start]
            self._start = 0

    @property
    def text(self) -> str:
        return "".join(self._lines[self._start :]) + self._line

    def __len__(self) -> int:
        return self._chars + len(self._line)


# ----------------------------------------------------------------------------------- metrics


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One metric at one step, reduced across the ranks that logged it."""

    step: int
    name: str
    mean: float
    min: float
    max: float
    ranks: int

    @classmethod
    def of(cls, step: int, name: str, values: Iterable[float]) -> MetricRow:
        seq = list(values)
        return cls(step, name, sum(seq) / len(seq), min(seq), max(seq), len(seq))

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


class _Metric:
    def __init__(self, max_steps: int) -> None:
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

    def latest(self, name: str) -> MetricRow | None:
        """The highest step the most recent cell logged (what a latest-values table shows)."""
        steps = [s for s, r in self.steps.items() if r.cell_id == self.last_cell] or self.steps
        if not steps:
            return None
        step = max(steps)
        return MetricRow.of(step, name, self.steps[step].values.values())


# ------------------------------------------------------------------------------- snapshots


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the provider said about a node."""

    index: int
    address: str = ""
    kind: str = ""  # GPU or instance type, "cpu" when it has no GPU
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    node: int
    state: RankState
    detail: str
    stdout: str
    stderr: str
    dropped: int  # characters of output dropped from the start of the buffers
    usage: RankUsage | None


@dataclass(frozen=True, slots=True)
class NodeRow:
    index: int
    address: str
    kind: str
    state: RankState
    detail: str  # the detail of the rank whose state the node shows
    ranks: tuple[int, ...]
    cpu_percent: float | None  # summed over the node's live ranks
    rss_bytes: int | None
    gpu_memory_bytes: int | None  # None when no rank reports GPU memory
    last_heartbeat: float | None  # epoch seconds of the newest usage report

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, now - self.last_heartbeat)


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    provider: str
    nodes: int
    ranks: int
    state: RankState
    started_at: float | None
    ended_at: float | None
    price_per_hour: float | None
    cell: int | None  # the cell running now
    cells: int  # cells run so far

    def uptime(self, now: float) -> float:
        if self.started_at is None:
            return 0.0
        return max(0.0, (self.ended_at or now) - self.started_at)

    def cost(self, now: float) -> float | None:
        if self.price_per_hour is None:
            return None
        return self.price_per_hour * self.uptime(now) / 3600

    @property
    def ranks_per_node(self) -> str:
        if not self.nodes or not self.ranks:
            return "?"
        per = self.ranks / self.nodes
        return str(int(per)) if per == int(per) else f"{per:.1f}"


@dataclass(frozen=True, slots=True)
class PanelSnapshot:
    version: int
    header: Header
    nodes: tuple[NodeRow, ...]
    ranks: tuple[RankRow, ...]
    latest: tuple[MetricRow, ...]  # one per metric name, in the order names first appeared
    series: Mapping[str, tuple[MetricRow, ...]]  # per metric name, by step
    messages: tuple[str, ...]


@dataclass(slots=True)
class _RankState:
    node: int
    state: RankState = RankState.PROVISIONING
    detail: str = ""
    usage: RankUsage | None = None
    lost_at: float | None = None  # monotonic time of the last loss, while it is held
    lost_detail: str = ""


# ------------------------------------------------------------------------------------ state


class PanelState:
    """Pool events folded into what the panel shows. ``apply`` from any thread; readers too."""

    def __init__(
        self,
        name: str = "default",
        provider: str = "",
        *,
        nodes: Sequence[NodeInfo] = (),
        started_at: float | None = None,
        price_per_hour: float | None = None,
        output_cap: int = OUTPUT_CAP,
        max_steps: int = MAX_STEPS,
        lost_hold: float = LOST_HOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self.lost_hold = lost_hold
        self._clock = clock
        self.name = name
        self.provider = provider
        self.output_cap = output_cap
        self.max_steps = max_steps
        self._nodes: dict[int, NodeInfo] = {n.index: n for n in nodes}
        self._expected_nodes = 0  # asked for, shown until the provider says what it gave
        self._started_at = started_at
        self._ended_at: float | None = None
        self._price = price_per_hour
        self._ranks: dict[int, _RankState] = {}
        self._booting: dict[int, tuple[RankState, str]] = {}
        """Node states from the provider, shown until the node's ranks have states of their own."""
        self._stdout: dict[int, TextBuffer] = {}
        self._stderr: dict[int, TextBuffer] = {}
        self._metrics: dict[str, _Metric] = {}
        self._steps = StepNumbers()
        self._messages: list[str] = []
        self._cell: int | None = None
        self._cells = 0
        self._version = 0

    @property
    def version(self) -> int:
        """Moves whenever anything a view shows changed."""
        return self._version

    # -------------------------------------------------------------------- pool facts

    def describe_pool(
        self,
        *,
        nodes: Sequence[NodeInfo] | None = None,
        ranks: Mapping[int, int] | None = None,
        started_at: float | None = None,
        ended: bool = False,
        price_per_hour: float | None = None,
        provider: str | None = None,
        expected_nodes: int | None = None,
    ) -> None:
        """Facts the pool knows that its events do not carry (nodes, ranks, start, end, price).

        ``ranks`` maps rank -> node. Changes the version only when something changed.
        """
        with self._lock:
            changed = False
            if nodes is not None:
                new = {n.index: n for n in nodes}
                if new != self._nodes:
                    self._nodes, changed = new, True
            for rank, node in (ranks or {}).items():
                if rank not in self._ranks:
                    self._ranks[rank] = _RankState(node)
                    changed = True
            if started_at is not None and started_at != self._started_at:
                self._started_at, changed = started_at, True
            if ended and self._ended_at is None:
                self._ended_at, changed = time.time(), True
            if price_per_hour is not None and price_per_hour != self._price:
                self._price, changed = price_per_hour, True
            if provider is not None and provider != self.provider:
                self.provider, changed = provider, True
            if expected_nodes is not None and expected_nodes != self._expected_nodes:
                self._expected_nodes, changed = expected_nodes, True
            if changed:
                self._version += 1

    def sync(self, pool: Any) -> None:
        """Read the facts of a :class:`~skyward_jupyter.pool.Pool` (any thread, cheap)."""
        provider = getattr(pool, "provider", None)
        nodes = [
            NodeInfo(
                n.index,
                n.address,
                n.gpu_type or n.instance_type or ("gpu" if n.gpus else "cpu"),
                len(n.gpus),
            )
            for n in getattr(pool, "nodes", ())
        ]
        ranks = {r.rank: r.node for r in getattr(pool, "ranks", ())}
        started_at = getattr(pool, "started_at", None)
        self.describe_pool(
            nodes=nodes or None,
            ranks=ranks,
            started_at=started_at,
            ended=started_at is not None and not getattr(pool, "running", True),
            price_per_hour=price_of(pool),
            provider=getattr(provider, "name", None),
            expected_nodes=getattr(pool, "requested_nodes", None),
        )

    # ------------------------------------------------------------------------ events

    def apply(self, event: PoolEvent) -> None:
        """Fold one event (the pool's IO thread calls this through ``Pool.subscribe``)."""
        with self._lock:
            if isinstance(event, RankStateChanged):
                rank = self._rank(event.rank, event.node)
                rank.node, rank.state, rank.detail = event.node, event.state, event.detail
                if event.state is RankState.LOST:
                    rank.lost_at, rank.lost_detail = self._clock(), event.detail
                elif event.state not in _RESTARTING:
                    rank.lost_at = None
            elif isinstance(event, NodeStateChanged):
                self._booting[event.node] = (event.state, event.detail)
            elif isinstance(event, RankUsage):
                self._rank(event.rank, event.node).usage = event
            elif isinstance(event, OutputReceived):
                buffers = self._stderr if event.stream == "stderr" else self._stdout
                buffer = buffers.get(event.rank)
                if buffer is None:
                    buffer = buffers[event.rank] = TextBuffer(self.output_cap)
                buffer.write(event.text)
            elif isinstance(event, MetricsLogged):
                self._log(event)
            elif isinstance(event, CellStarted):
                self._cell = event.cell_id
                self._cells += 1
            elif isinstance(event, CellFinished):
                if self._cell == event.cell_id:
                    self._cell = None
            elif isinstance(event, PoolMessage):
                self._messages = [*self._messages, event.text][-MAX_MESSAGES:]
            self._version += 1

    __call__ = apply  # so the state itself can be given to Pool.subscribe

    def _rank(self, rank: int, node: int) -> _RankState:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _RankState(node)
        return state

    def _log(self, event: MetricsLogged) -> None:
        now = self._clock()
        for step, values in event.rows:
            for name, value in values.items():
                metric = self._metrics.get(name)
                if metric is None:
                    metric = self._metrics[name] = _Metric(self.max_steps)
                resolved = self._steps.resolve(event.rank, name, step)
                metric.put(resolved, event.rank, value, event.cell_id, now)

    # ----------------------------------------------------------------------- reading

    def metric_rows(self) -> list[MetricRow]:
        """Every kept step of every metric, by step then name (what ``%sky metrics`` returns)."""
        with self._lock:
            rows = [row for name, m in self._metrics.items() for row in m.rows(name)]
        return sorted(rows, key=lambda r: (r.step, r.name))

    def snapshot(self) -> PanelSnapshot:
        with self._lock:
            now = self._clock()
            ranks = tuple(self._rank_row(i, r, now) for i, r in sorted(self._ranks.items()))
            nodes = self._node_rows(ranks)
            state = (
                RankState.TERMINATED
                if self._ended_at is not None
                else aggregate_state(r.state for r in ranks)
            )
            header = Header(
                self.name,
                self.provider,
                len(nodes) or self._expected_nodes,
                len(ranks),
                state,
                self._started_at,
                self._ended_at,
                self._price,
                self._cell,
                self._cells,
            )
            latest = tuple(
                row
                for name, metric in self._metrics.items()
                if (row := metric.latest(name)) is not None
            )
            series = {name: tuple(m.rows(name)) for name, m in self._metrics.items()}
            return PanelSnapshot(
                self._version, header, nodes, ranks, latest, series, tuple(self._messages)
            )

    def _rank_row(self, index: int, rank: _RankState, now: float) -> RankRow:
        out = self._stdout.get(index)
        err = self._stderr.get(index)
        state, detail = rank.state, rank.detail
        held = rank.lost_at is not None and now - rank.lost_at < self.lost_hold
        if held and state in _RESTARTING:
            # Restarting after a loss: show the loss for a moment, and what happens now.
            where = "restarted" if state is RankState.READY else f"restarting ({state.value})"
            state, detail = RankState.LOST, f"{rank.lost_detail}; {where}".lstrip("; ")
        return RankRow(
            index,
            rank.node,
            state,
            detail,
            out.text if out else "",
            err.text if err else "",
            (out.dropped if out else 0) + (err.dropped if err else 0),
            rank.usage,
        )

    def _node_rows(self, ranks: Sequence[RankRow]) -> tuple[NodeRow, ...]:
        indexes = sorted(set(self._nodes) | set(self._booting) | {r.node for r in ranks})
        rows = []
        for index in indexes:
            info = self._nodes.get(index, NodeInfo(index))
            mine = [r for r in ranks if r.node == index]
            if mine:
                state = aggregate_state(r.state for r in mine)
                detail = next((r.detail for r in mine if r.state is state and r.detail), "")
            else:
                state, detail = self._booting.get(index, (RankState.PROVISIONING, ""))
            live = [r.usage for r in mine if r.usage is not None and r.state not in _GONE]
            heard = [r.usage.at for r in mine if r.usage is not None]
            gpu = [u.gpu_memory_bytes for u in live if u.gpu_memory_bytes is not None]
            rows.append(
                NodeRow(
                    index,
                    info.address,
                    info.kind,
                    state,
                    detail,
                    tuple(r.rank for r in mine),
                    sum(u.cpu_percent for u in live) if live else None,
                    sum(u.rss_bytes for u in live) if live else None,
                    sum(gpu) if gpu else None,
                    max(heard) if heard else None,
                )
            )
        return tuple(rows)


def price_of(pool: Any) -> float | None:
    """$/hour of a pool where its provider knows prices (``price_per_hour``); local has none."""
    price = getattr(getattr(pool, "provider", None), "price_per_hour", None)
    if isinstance(price, int | float) and not isinstance(price, bool):
        return float(price)
    return None


# ---------------------------------------------------------------------------- formatting


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


def summary_text(snap: PanelSnapshot, now: float | None = None) -> str:
    """The panel as plain text: what a frontend without widgets, or nbconvert to text, shows."""
    now = time.time() if now is None else now
    h = snap.header
    size = f"{h.nodes} node{'s' * (h.nodes != 1)}"
    if h.ranks:
        size += (
            f" x {h.ranks_per_node} rank{'s' * (h.ranks_per_node != '1')} per node "
            f"({h.ranks} rank{'s' * (h.ranks != 1)})"
        )
    line = (
        f"pool {h.name!r} ({h.provider or '?'}): {size}, {h.state.value}, "
        f"up {format_seconds(h.uptime(now))}"
    )
    cost = h.cost(now)
    if h.price_per_hour is not None and cost is not None:
        line += f", ${h.price_per_hour:.2f}/hour, ${cost:.2f} so far"
    lines = [line]
    for node in snap.nodes:
        parts = [f"  node {node.index}", node.address or "-", node.kind or "-", node.state.value]
        if node.cpu_percent is not None:
            parts.append(f"cpu {node.cpu_percent:.0f}%")
        if node.rss_bytes is not None:
            parts.append(f"mem {format_bytes(node.rss_bytes)}")
        if node.gpu_memory_bytes is not None:
            parts.append(f"gpu mem {format_bytes(node.gpu_memory_bytes)}")
        age = node.heartbeat_age(now)
        if age is not None and node.state not in _GONE:
            parts.append(f"heartbeat {age:.1f} s ago")
        if node.detail and node.state in (RankState.FAILED, RankState.LOST):
            parts.append(node.detail)
        lines.append(", ".join(parts[:1]) + ": " + ", ".join(parts[1:]))
    if snap.latest:
        lines.append("  metrics (mean, min-max across ranks):")
        width = max(len(r.name) for r in snap.latest)
        for row in snap.latest:
            spread = (
                ""
                if row.min == row.max
                else f" ({format_number(row.min)} - {format_number(row.max)})"
            )
            lines.append(
                f"    {row.name:<{width}}  step {row.step}: {format_number(row.mean)}{spread}, "
                f"{row.ranks} rank{'s' * (row.ranks != 1)}"
            )
    for message in snap.messages[-3:]:
        lines.append(f"  note: {message}")
    return "\n".join(lines)
