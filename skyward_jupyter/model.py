"""What the views of a pool share: the shape they read it in, its state, its price.

The widget panel, the text fallback (:mod:`.display`) and the lab panel's registry
(:mod:`.registry`, served by :mod:`.server`) all show one state per node and per pool, folded
from the ranks' states by :func:`aggregate_state`, and a price where the provider has one
(:func:`price_of`). :class:`EntryFacts` is the session's entry for a pool as they read it,
so that they depend on neither :mod:`.pool` nor :mod:`.session` at run time.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from .events import RankState

if TYPE_CHECKING:
    from .pool import Pool

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
GONE = (RankState.LOST, RankState.TERMINATED)
"""States of a rank whose process is no more: its usage and heartbeat are history."""


# ------------------------------------------------------------------ the words for states


@dataclass(frozen=True, slots=True)
class StateWord:
    """How every view (the cell's panel, the lab's side panel, the text) names a state: the
    word, its tone (which colour) and what it means (the views' tooltip).
    """

    word: str
    tone: str
    """``starting``, ``good``, ``busy``, ``bad`` or ``over``."""
    meaning: str


RECORD_GONE = "gone"
"""The side panel's state of a registry record whose kernel or ranks are no more."""

STATE_WORDS: dict[str, StateWord] = {
    w.word: w
    for w in (
        StateWord("provisioning", "starting", "asking the provider for machines"),
        StateWord("booting", "starting", "starting the rank processes"),
        StateWord("connecting", "starting", "forming the process group"),
        StateWord("ready", "good", "started; no cell has run on it yet"),
        StateWord("running", "busy", "running a cell"),
        StateWord("idle", "good", "ran a cell; waiting for the next one"),
        StateWord("failed", "bad", "a cell raised on it"),
        StateWord("lost", "bad", "a rank's process or machine is gone"),
        StateWord("terminated", "over", "shut down"),
        StateWord(RECORD_GONE, "over", "its kernel or its ranks are gone: nothing runs"),
    )
}
"""Every state a view may show, in one place: the rank states and the side panel's ``gone``."""

TONE_COLOURS = {
    "starting": "#9a6700",
    "good": "#1a7f37",
    "busy": "#0969da",
    "bad": "#cf222e",
    "over": "#6e7781",
}
"""The colour of each tone where a view has no theme of its own (the cell's panel)."""


def state_colour(state: RankState) -> str:
    return TONE_COLOURS[STATE_WORDS[state.value].tone]


def state_words() -> dict[str, dict[str, str]]:
    """The vocabulary as JSON, for the lab's side panel (the server sends it with each list)."""
    return {word: asdict(w) for word, w in STATE_WORDS.items()}


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


def state_counts(states: Iterable[RankState]) -> tuple[tuple[RankState, int], ...]:
    """How many ranks are in each state, in :func:`aggregate_state`'s order (trouble first)."""
    counts = collections.Counter(states)
    return tuple((state, counts[state]) for state in _PRECEDENCE if counts[state])


def price_of(pool: Pool) -> float | None:
    """$/hour of a pool where its provider knows prices; local has none."""
    return pool.provider.price_per_hour


# ------------------------------------------------------------- what the views read of a pool


class EntryFacts(Protocol):
    """A pool as the session hands it to its views and the registry (the session's
    ``PoolEntry``): they read the pool itself, typed as :class:`~skyward_jupyter.pool.Pool`
    for the checker only, so that neither imports the session or the pool at run time.
    """

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> _Described: ...

    @property
    def pool(self) -> Pool: ...


class _Described(Protocol):
    def describe(self) -> str: ...
