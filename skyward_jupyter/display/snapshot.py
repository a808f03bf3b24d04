"""What a view draws: the panel's state at one moment, as immutable rows.

:meth:`~.state.PanelState.snapshot` makes one under the state's lock; views read it from their
own thread without locking, and compute what moves with the clock (uptime, cost, heartbeat ages)
from the ``now`` they draw at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..events import RankState, RankUsage
from .metrics import MetricRow


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the provider said about a node."""

    index: int
    address: str = ""
    kind: str = ""  # GPU or instance type, "cpu" when it has no GPU
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class Waiting:
    """Ranks inside the same collective for a while (:data:`~.state.WAITING_MARK_AFTER`)."""

    ranks: tuple[int, ...]
    what: str  # the collective and the user's line that called it: "all_reduce at cell line 3"
    seconds: float  # the longest any of the ranks has waited, as of its last heartbeat

    @property
    def mark(self) -> str:
        """``waiting 12 s in all_reduce at cell line 3``"""
        return f"waiting {self.seconds:.0f} s in {self.what}"

    @property
    def label(self) -> str:
        """The mark with its ranks: ``rank 0 waiting ...``, ``ranks 0, 1 waiting ...``."""
        which = "rank" if len(self.ranks) == 1 else "ranks"
        return f"{which} {', '.join(map(str, self.ranks))} {self.mark}"

    @staticmethod
    def grouped(waits: Sequence[Waiting]) -> tuple[Waiting, ...]:
        """Ranks waiting in the same collective at the same line as one, in order of rank."""
        groups: dict[str, list[Waiting]] = {}
        for w in sorted(waits, key=lambda w: w.ranks):
            groups.setdefault(w.what, []).append(w)
        return tuple(
            Waiting(tuple(r for w in same for r in w.ranks), what, max(w.seconds for w in same))
            for what, same in groups.items()
        )


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
    waiting: Waiting | None = None  # inside a collective for a while (None: not, or not long)


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
    waiting: tuple[Waiting, ...] = ()  # its ranks inside a collective for a while, by collective
    counts: tuple[tuple[RankState, int], ...] = ()  # its ranks per state, trouble first

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
    auto: bool = False  # plain cells run on this pool (%sky auto on)

    @property
    def auto_mark(self) -> str:
        """What every view of the pool says while plain cells run on it."""
        return f"auto: cells run on pool {self.name!r}" if self.auto else ""

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
class Progress:
    """One cell's progress, as tqdm shows a loop's: elapsed, last step, steps per second, and
    with a known total a fraction and the time left.
    """

    number: int | None  # the notebook's execution count: In [number]
    started_at: float  # epoch seconds
    ended_at: float | None  # None while the cell runs
    outcome: str  # "running", "done", "failed on rank 1", "interrupted"
    step: int | None  # the last step log() gave
    rate: float | None  # steps per second, over the last steps
    total: int | None  # log(..., total=N)

    @property
    def label(self) -> str:
        return f"In [{self.number}]" if self.number is not None else "cell"

    @property
    def running(self) -> bool:
        return self.ended_at is None

    def elapsed(self, now: float) -> float:
        return max(0.0, (self.ended_at or now) - self.started_at)

    @property
    def fraction(self) -> float | None:
        if not self.total or self.step is None:
            return None
        return min(1.0, max(0.0, self.step / self.total))

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate (None without a total, a rate, or once ended)."""
        if not self.running or not self.total or self.step is None or not self.rate:
            return None
        return max(0.0, (self.total - self.step) / self.rate)


@dataclass(frozen=True, slots=True)
class PanelSnapshot:
    version: int
    header: Header
    nodes: tuple[NodeRow, ...]
    ranks: tuple[RankRow, ...]
    latest: tuple[MetricRow, ...]  # one per metric name, in the order names first appeared
    series: Mapping[str, tuple[MetricRow, ...]]  # per metric name, by step
    messages: tuple[str, ...]
    progress: Progress | None = None  # a cell's view; None for the pool's own state
