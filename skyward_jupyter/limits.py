"""The range of every number a user gives a pool or a cell, declared once.

A number out of range (``nan``, ``inf``, a typo's 100000 nodes) is refused where it is read,
before any pool is started, replaced or torn down: the option parser, the pool's spec and the
:class:`~skyward_jupyter.pool.Pool` constructor all check against these ranges, so a message
names the same bound whichever way the number came in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_RANKS = 1024
"""The most ranks one pool may have (``skyward_jupyter.limits.MAX_RANKS``): beyond it, a start
is far more likely a typo than a wish, and one notebook's connections and threads per rank would
not hold."""


class LimitError(ValueError):
    """A number out of its range; the message names the option, the range and the value."""

    def __init__(self, option: str, why: str) -> None:
        super().__init__(f"{option}: {why}")
        self.why = why
        """The message without the option's name (an option parser adds it itself)."""


@dataclass(frozen=True, slots=True)
class Range:
    """``low <= value <= high`` (``low`` excluded when ``open_low``), finite, in ``unit``."""

    option: str
    low: float
    high: float
    unit: str
    open_low: bool = False
    whole: bool = False

    def check(self, value: float) -> float:
        """``value`` when it is in range; :class:`LimitError` naming the option otherwise."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LimitError(self.option, f"expected {self._kind()}, got {value!r}")
        if self.whole and not isinstance(value, int):
            raise LimitError(self.option, f"expected a whole number, got {value!r}")
        if not math.isfinite(value):
            raise LimitError(self.option, f"expected a finite number of {self.unit}, got {value}")
        too_low = value <= self.low if self.open_low else value < self.low
        if too_low or value > self.high:
            raise LimitError(self.option, f"must be {self.describe()}, got {_shown(value)}")
        return value

    def parse(self, text: str) -> float:
        """The number in ``text``, checked (what an option's parser calls)."""
        try:
            value: float = int(text) if self.whole else float(text)
        except ValueError:
            raise LimitError(self.option, f"expected {self._kind()}, got {text!r}") from None
        return self.check(value)

    def describe(self) -> str:
        low = "more than" if self.open_low else "from"
        if self.high == MAX_RANKS and self.whole:
            return f"{low} {_shown(self.low)} to {MAX_RANKS} (MAX_RANKS, the most a pool may have)"
        return f"{low} {_shown(self.low)} to {_shown(self.high)} {self.unit}"

    def _kind(self) -> str:
        return "a whole number" if self.whole else f"a number of {self.unit}"


def _shown(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


DAY = 24 * 3600.0

NODES = Range("--nodes", 1, MAX_RANKS, "nodes", whole=True)
PROCS_PER_NODE = Range("--procs-per-node", 1, MAX_RANKS, "ranks", whole=True)
HEARTBEAT_TIMEOUT = Range("--heartbeat-timeout", 2.0, 3600.0, "seconds")
"""At least two heartbeats (one a second) must be able to go missing before a rank is lost."""
DESYNC_AFTER = Range("--desync-after", 0.0, 3600.0, "seconds", open_low=True)
SYNC_CAP = Range("--sync-cap", 0.0, float(1 << 20), "MB", open_low=True)
IDLE_TIMEOUT = Range("--idle-timeout", 0.0, 30 * DAY / 60, "minutes")
TIMEOUT = Range("--timeout", 0.0, 30 * DAY, "seconds", open_low=True)

# The Pool API's own settings (no option gives them): named as its keyword arguments.
PG_TIMEOUT = Range("pg_timeout", 0.0, 30 * DAY, "seconds", open_low=True)
HEARTBEAT_INTERVAL = Range("heartbeat_interval", 0.01, 60.0, "seconds")
INTERRUPT_GRACE = Range("interrupt_grace", 0.0, 600.0, "seconds")
START_TIMEOUT = Range("start_timeout", 0.0, DAY, "seconds", open_low=True)
SYNC_CAP_BYTES = Range("sync_cap_bytes", 1, 1 << 40, "bytes", whole=True)


def check_world(ranks: int, how: str) -> None:
    """A pool of ``ranks`` ranks is allowed; ``how`` says where the count came from."""
    if ranks > MAX_RANKS:
        raise LimitError(
            how,
            f"{ranks} ranks; a pool has at most {MAX_RANKS} "
            "(skyward_jupyter.limits.MAX_RANKS): ask for fewer nodes or fewer ranks per node",
        )


def check_layout(nodes: int, procs_per_node: int) -> None:
    """``nodes`` x ``procs_per_node`` ranks is a pool allowed."""
    check_world(nodes * procs_per_node, f"--nodes {nodes} x --procs-per-node {procs_per_node}")
