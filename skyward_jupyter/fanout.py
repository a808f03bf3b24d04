"""Who hears a pool's events: subscribers hear all of them, a cell's observer only its cell's.

Events are delivered on the pool's IO thread; a subscriber that raises is logged and the others
still hear the event (a broken view must not break the pool).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .events import PoolEvent, RankStateChanged

Subscriber = Callable[[PoolEvent], None]
log = logging.getLogger(__name__)


class Fanout:
    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self.observers: dict[int, Subscriber] = {}
        """Per running cell id: the view of that cell."""

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def emit(self, event: PoolEvent, running: int | None) -> None:
        """Deliver ``event``; a rank's state change during cell ``running`` is that cell's too."""
        cell_id = getattr(event, "cell_id", None)
        if cell_id is None and isinstance(event, RankStateChanged):
            cell_id = running
        observer = self.observers.get(cell_id) if cell_id is not None else None
        for callback in [*self._subscribers, *([observer] if observer else [])]:
            try:
                callback(event)
            except Exception:
                log.exception("a pool event subscriber failed on %r", event)
