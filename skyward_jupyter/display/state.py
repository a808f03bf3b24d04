"""The panel's state: a thread-safe fold of pool events, read as immutable snapshots.

Events are applied on the pool's IO thread (:meth:`PanelState.apply`); views read a
:class:`~.snapshot.PanelSnapshot` from their own thread (:meth:`PanelState.snapshot`) and redraw
only when :attr:`PanelState.version` moved. Nothing here knows about widgets or text: the widget
panel (:mod:`.panel`), the text fallback (:mod:`.summary`) and ``%sky metrics`` all read from it.

What is kept, and how much of it:

- per rank: its state (with the detail of the last change), its last :class:`RankUsage`, and its
  stdout and stderr in :class:`~.buffers.TextBuffer` (a cap in characters, oldest lines dropped
  first; a lone ``\\r`` rewinds the line, so a progress bar keeps one line);
- per node (from the pool: address, GPU or instance type): a row aggregated from its ranks; a
  rank the pool lost shows as lost for ``LOST_HOLD`` seconds while the pool restarts it;
- per rank, the collective its cell waits in (from its heartbeat): marked on its rows once it
  has waited ``WAITING_MARK_AFTER`` seconds, until a heartbeat says it no longer waits, the rank
  stops running the cell or the cell ends;
- per metric name: the values of each rank for each step (the last ``max_steps`` steps), reduced
  to mean, min and max across the ranks that logged that step (:mod:`.metrics`);
- per rank, how the last cell ended on it: a rank whose cell raised shows as failed (a lost one
  as lost), with the error's first line, until the next cell starts.

A cell's view has a state of its own (:meth:`PanelState.for_cell`): the pool as it was when the
cell began, then only that cell's output, metrics, notes and progress (:class:`~.snapshot.
Progress`); its view stops feeding it when the cell ends, so it keeps the cell's final state.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from ..model import GONE, aggregate_state, price_of, state_counts
from ..runtime import TOTAL_KEY
from .buffers import OUTPUT_CAP, TextBuffer
from .metrics import MAX_STEPS, MetricRow, MetricSteps, Pace, StepNumbers, total_of
from .snapshot import Header, NodeInfo, NodeRow, PanelSnapshot, Progress, RankRow, Waiting

if TYPE_CHECKING:
    from ..pool import Pool

MAX_MESSAGES = 20
LOST_HOLD = 5.0
"""Seconds a lost rank shows as lost while the pool restarts it (a restart takes milliseconds
with a warm template: without the hold nobody would see that a rank was lost)."""
WAITING_MARK_AFTER = 3.0
"""Seconds a rank has been inside the same collective before its rows say so (a collective
that takes a moment is normal; one that lasts is where a hang shows)."""
_RESTARTING = (RankState.BOOTING, RankState.CONNECTING, RankState.READY)
_AFTER_CELL = (RankState.IDLE, RankState.READY)
"""States in which a rank shows how its last cell ended (a failure), rather than the state."""


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


@dataclass(slots=True)
class _RankState:
    node: int
    state: RankState = RankState.PROVISIONING
    detail: str = ""
    usage: RankUsage | None = None
    lost_at: float | None = None  # monotonic time of the last loss, while it is held
    lost_detail: str = ""
    waiting: str | None = None  # the collective its cell waits in, and where (last heartbeat)
    waited: float = 0.0
    ended: RankState | None = None  # FAILED or LOST: how its last cell ended, until the next
    ended_detail: str = ""  # the error's first line


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
        self._metrics: dict[str, MetricSteps] = {}
        self._steps = StepNumbers()
        self._messages: list[str] = []
        self._cell: int | None = None
        self._cell_ranks = 0  # the ranks the last cell ran on: who is to log each step
        self._cells = 0
        self._version = 0
        self._progress: Progress | None = None  # a cell's view only (for_cell)
        self._auto = False  # plain cells run on this pool (%sky auto on)
        self._pace = Pace()

    def for_cell(self, number: int | None) -> PanelState:
        """A state for one cell's view: the pool as it is now (nodes, ranks' states and usage,
        start, price), none of the earlier cells' output, metrics or notes. Feed it the pool's
        events from now until the cell ends; ``number`` is the notebook's execution count.
        """
        with self._lock:
            cell = PanelState(
                self.name,
                self.provider,
                nodes=list(self._nodes.values()),
                started_at=self._started_at,
                price_per_hour=self._price,
                output_cap=self.output_cap,
                max_steps=self.max_steps,
                lost_hold=self.lost_hold,
                clock=self._clock,
            )
            cell._expected_nodes = self._expected_nodes
            cell._ranks = {
                i: dataclasses.replace(r, ended=None, ended_detail="")
                for i, r in self._ranks.items()
            }
            cell._booting = dict(self._booting)
            cell._auto = self._auto
            cell._progress = Progress(number, time.time(), None, "starting", None, None, None)
            return cell

    def set_auto(self, on: bool) -> None:
        """Whether plain cells run on this pool (``%sky auto``): its header says so."""
        with self._lock:
            if self._auto != on:
                self._auto = on
                self._version += 1

    @property
    def progress(self) -> Progress | None:
        return self._progress

    @property
    def cell_failed(self) -> bool:
        """Whether the last cell failed on a rank or lost one (until the next cell starts)."""
        with self._lock:
            return any(r.ended is not None for r in self._ranks.values())

    @property
    def cell_running(self) -> bool:
        """Whether a cell runs on the ranks now (from its start to its end)."""
        return self._cell is not None

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

    def sync(self, pool: Pool) -> None:
        """Read the facts of a :class:`~skyward_jupyter.pool.Pool` (any thread, cheap)."""
        nodes = [
            NodeInfo(
                n.index,
                n.address,
                n.gpu_type or n.instance_type or ("gpu" if n.gpus else "cpu"),
                len(n.gpus),
            )
            for n in pool.nodes
        ]
        ranks = {r.rank: r.node for r in pool.ranks}
        started_at = pool.started_at
        self.describe_pool(
            nodes=nodes or None,
            ranks=ranks,
            started_at=started_at,
            ended=started_at is not None and not pool.running,
            price_per_hour=price_of(pool),
            provider=pool.provider.name,
            expected_nodes=pool.requested_nodes,
        )

    # ------------------------------------------------------------------------ events

    def apply(self, event: PoolEvent) -> None:
        """Fold one event (the pool's IO thread calls this through ``Pool.subscribe``)."""
        with self._lock:
            if self._progress is not None and not self._mine(event):
                return
            if isinstance(event, RankStateChanged):
                for index, node in event.ranks:
                    self._set_state(index, node, event.state, event.detail)
            elif isinstance(event, NodeStateChanged):
                self._booting[event.node] = (event.state, event.detail)
            elif isinstance(event, RankUsage):
                rank = self._rank(event.rank, event.node)
                rank.usage, rank.waiting, rank.waited = event, event.waiting, event.waited
            elif isinstance(event, OutputReceived):
                buffers = self._stderr if event.stream == "stderr" else self._stdout
                buffer = buffers.get(event.rank)
                if buffer is None:
                    buffer = buffers[event.rank] = TextBuffer(self.output_cap)
                buffer.write(event.text)
            elif isinstance(event, MetricsLogged):
                self._log(event)
            elif isinstance(event, CellStarted):
                self._cell, self._cell_ranks = event.cell_id, event.ranks
                self._cells += 1
                for rank in self._ranks.values():
                    rank.ended, rank.ended_detail = None, ""
                if self._progress is not None:
                    self._progress = dataclasses.replace(self._progress, outcome="running")
            elif isinstance(event, CellFinished):
                if self._cell == event.cell_id:
                    self._cell = None
                for rank in self._ranks.values():
                    rank.waiting, rank.waited = None, 0.0
                self._finished(event)
            elif isinstance(event, PoolMessage):
                self._messages = [*self._messages, event.text][-MAX_MESSAGES:]
            self._version += 1

    __call__ = apply  # so the state itself can be given to Pool.subscribe

    def _mine(self, event: PoolEvent) -> bool:
        """A cell's view takes the events of its own cell (and the pool's), not a late line of
        the cell before, nor anything once its cell has ended.
        """
        assert self._progress is not None
        if not self._progress.running:
            return False
        if isinstance(event, CellStarted | CellFinished):
            return self._cell is None or event.cell_id == self._cell
        if isinstance(event, OutputReceived | MetricsLogged):
            return event.cell_id is None or event.cell_id == self._cell
        return True

    def _finished(self, event: CellFinished) -> None:
        """Mark the ranks the cell failed on; a cell's view records how the cell ended.

        A rank that was only stopped (the user's interrupt, or the pool's after another rank
        failed: a ``KeyboardInterrupt`` that followed) did not fail: it is not marked.
        """
        result = event.result
        failed = []
        for r in result:
            error = r.error
            if error is None:
                continue
            if result.only_stopped(r):
                stopped = self._ranks.get(r.rank)
                if stopped is not None and stopped.state is RankState.FAILED:
                    stopped.state, stopped.detail = RankState.IDLE, ""  # the pool marked it
                continue
            failed.append(r.rank)
            rank = self._rank(r.rank, r.node)
            rank.ended = RankState.LOST if error.type_name == "RankLost" else RankState.FAILED
            rank.ended_detail = first_line(f"{error.type_name}: {error.message}")
        if self._progress is None:
            return
        if result.stopped_by is not None:
            outcome = result.stopped_by
        elif failed:
            outcome = f"failed on rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))}"
        else:
            outcome = "done"
        self._progress = dataclasses.replace(self._progress, ended_at=time.time(), outcome=outcome)

    def pool_ready(self) -> None:
        """The pool this view's cell started is ready (``%sky up`` runs no cell after it)."""
        with self._lock:
            if self._progress is not None and self._progress.outcome == "starting":
                self._progress = dataclasses.replace(self._progress, outcome="pool ready")
                self._version += 1

    def end_cell(self) -> None:
        """The cell ended without a result (the pool failed or closed under it): stop here."""
        with self._lock:
            if self._progress is not None and self._progress.running:
                self._progress = dataclasses.replace(
                    self._progress, ended_at=time.time(), outcome="ended"
                )
                self._version += 1

    def _set_state(self, index: int, node: int, state: RankState, detail: str) -> None:
        rank = self._rank(index, node)
        rank.node, rank.state, rank.detail = node, state, detail
        if state is not RankState.RUNNING:
            rank.waiting, rank.waited = None, 0.0
        if state is RankState.LOST:
            rank.lost_at, rank.lost_detail = self._clock(), detail
        elif state not in _RESTARTING:
            rank.lost_at = None

    def _rank(self, rank: int, node: int) -> _RankState:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _RankState(node)
        return state

    def _log(self, event: MetricsLogged) -> None:
        now = self._clock()
        steps = []
        for step, values in event.rows:
            if step is not None:
                steps.append(step)  # log(step, total=N) alone still moves the bar
            for name, value in values.items():
                if name == TOTAL_KEY:
                    continue
                metric = self._metrics.get(name)
                if metric is None:
                    metric = self._metrics[name] = MetricSteps(self.max_steps)
                resolved = self._steps.resolve(event.rank, name, step)
                metric.put(resolved, event.rank, value, event.cell_id, now)
                steps.append(resolved)
        if self._progress is not None:
            pace = self._pace
            pace.note(now, steps, total_of(event))
            self._progress = dataclasses.replace(
                self._progress, step=pace.step, rate=pace.rate, total=pace.total
            )

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
                self._auto,
            )
            running = self._cell is not None
            latest = tuple(
                row
                for name, metric in self._metrics.items()
                if (row := metric.latest(name, self._cell_ranks, now, running)) is not None
            )
            series = {name: tuple(m.rows(name)) for name, m in self._metrics.items()}
            return PanelSnapshot(
                self._version,
                header,
                nodes,
                ranks,
                latest,
                series,
                tuple(self._messages),
                self._progress,
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
        elif rank.ended is not None and (state in _AFTER_CELL or state is rank.ended):
            # Failed in the cell, idle or re-formed since: how the cell ended, and its error.
            state, detail = rank.ended, rank.ended_detail
        return RankRow(
            index,
            rank.node,
            state,
            detail,
            out.text if out else "",
            err.text if err else "",
            (out.dropped if out else 0) + (err.dropped if err else 0),
            rank.usage,
            Waiting((index,), rank.waiting, rank.waited)
            if rank.waiting and rank.waited >= WAITING_MARK_AFTER and state not in GONE
            else None,
        )

    def _node_rows(self, ranks: Sequence[RankRow]) -> tuple[NodeRow, ...]:
        by_node: dict[int, list[RankRow]] = {}
        for r in ranks:
            by_node.setdefault(r.node, []).append(r)
        indexes = sorted(set(self._nodes) | set(self._booting) | set(by_node))
        rows = []
        for index in indexes:
            info = self._nodes.get(index, NodeInfo(index))
            mine = by_node.get(index, [])
            if mine:
                state = aggregate_state(r.state for r in mine)
                detail = next((r.detail for r in mine if r.state is state and r.detail), "")
            else:
                state, detail = self._booting.get(index, (RankState.PROVISIONING, ""))
            live = [r.usage for r in mine if r.usage is not None and r.state not in GONE]
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
                    Waiting.grouped([r.waiting for r in mine if r.waiting is not None]),
                    state_counts(r.state for r in mine),
                )
            )
        return tuple(rows)
