"""Pool events: what views (the widget panel, the text fallback, the lab registry) fold.

The pool emits these from its IO thread. A subscriber must return quickly and must not call back
into the pool's blocking API from the callback; views that touch a UI hand the event over to
their own thread or the kernel's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from .results import RunResult


class RankState(enum.Enum):
    PROVISIONING = "provisioning"
    BOOTING = "booting"
    CONNECTING = "connecting"
    READY = "ready"
    RUNNING = "running"
    IDLE = "idle"
    FAILED = "failed"
    LOST = "lost"
    TERMINATED = "terminated"


@dataclass(frozen=True, slots=True)
class RankStateChanged:
    """Ranks entered ``state``: one, with its detail (a loss, a failure, a restart), or several
    at once (a cell starting on every rank, the answers of one round coming in). One event for
    several: every subscriber hears each event, and a trivial cell on 16 ranks would otherwise
    be 32 of them.
    """

    ranks: tuple[tuple[int, int], ...]
    """(rank, node) of each."""
    state: RankState
    detail: str = ""

    @classmethod
    def of(cls, rank: int, node: int, state: RankState, detail: str = "") -> RankStateChanged:
        """One rank's change."""
        return cls(((rank, node),), state, detail)


@dataclass(frozen=True, slots=True)
class RankUsage:
    """A rank's resource use, with its heartbeat; ``at`` (epoch seconds) is when the rank took
    the sample (one its node's first rank passed on is a moment old when it arrives).
    """

    rank: int
    node: int
    cpu_percent: float
    rss_bytes: int
    gpu_memory_bytes: int | None
    gpu_utilization: float | None
    at: float
    waiting: str | None = None
    """The collective the rank's cell waits in and where (``all_reduce at cell line 3``)."""
    waited: float = 0.0


@dataclass(frozen=True, slots=True)
class OutputReceived:
    rank: int
    cell_id: int | None
    stream: str
    text: str


@dataclass(frozen=True, slots=True)
class DisplayReceived:
    """Rich output of a rank (a figure, ``display()``): :class:`~.protocol.Display`'s fields."""

    rank: int
    cell_id: int | None
    data: dict[str, Any]
    metadata: dict[str, Any]
    display_id: str | None = None
    update: bool = False


@dataclass(frozen=True, slots=True)
class MetricsLogged:
    rank: int
    cell_id: int | None
    rows: tuple[tuple[int | None, dict[str, float]], ...]


@dataclass(frozen=True, slots=True)
class CellStarted:
    cell_id: int
    ranks: int
    shipped_bytes: int


@dataclass(frozen=True, slots=True)
class CellFinished:
    cell_id: int
    result: RunResult


@dataclass(frozen=True, slots=True)
class NodeStateChanged:
    """A machine's progress before its ranks exist (provisioning, booting, connecting)."""

    node: int
    state: RankState
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PoolMessage:
    """Something the user should read (torch setup skipped, namespaces lost, rank restarted)."""

    text: str


PoolEvent = Union[  # noqa: UP007 - a runtime alias, usable in isinstance() on 3.10
    RankStateChanged,
    NodeStateChanged,
    RankUsage,
    OutputReceived,
    DisplayReceived,
    MetricsLogged,
    CellStarted,
    CellFinished,
    PoolMessage,
]
