"""How a cell's code reaches the notebook from its rank: ``input()`` prompts (:mod:`.console`)
and rich output (:mod:`.rich_output`) go up the rank's own wire, from the cell's head only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CellHead:
    rank: int
    send: Callable[[object], None]
    """A message to the notebook, written whole even if a signal comes meanwhile."""
    cell: Callable[[], tuple[int | None, int]]
    """The running cell's id (None between cells) and its head rank."""
    flush: Callable[[], None]
    """The rank's output sent on, so what the cell printed before shows first."""
    pid: int = field(default_factory=os.getpid)
    """The rank's process: one a cell forks from it must not write on its wire."""

    def forked(self) -> bool:
        """Whether the caller is a process a cell forked from the rank."""
        return os.getpid() != self.pid
