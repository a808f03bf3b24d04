"""What a view of hundreds of ranks shows first, and what it folds together.

A pool of 32 nodes of 8 ranks would be 32 node lines and 256 rank tabs, with the one rank that
failed somewhere among them. Every view (the widget panel's node table, its text/plain summary,
``%sky panel`` in a terminal) reads the nodes through :func:`node_groups` and the ranks in
trouble through :func:`rank_trouble`, so they agree:

- ranks that failed or were lost come first, one line per error (ranks with the same error
  share it: ``ranks 0-255 (nodes 0-31): failed, ValueError: ...``), at most
  :data:`TROUBLE_LINES` lines, then how many more;
- nodes in trouble (a failed or lost rank, or ranks long inside a collective) come next, each
  on its own line with its ranks counted per state (``1 failed, 7 idle``);
- then the others, each on its own line while there are at most :data:`NODE_LINES` nodes; above
  that, neighbouring nodes whose ranks are in the same states fold into one line
  (``nodes 0-30``), their usage summed and their oldest heartbeat shown;
- a rank tab per rank up to :data:`MAX_TABS`; above that the head's, the ranks in trouble and
  the lowest others (:func:`tab_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..events import RankState
from ..flags import rank_span
from .snapshot import NodeRow, RankRow

_N = TypeVar("_N", int, float)
TROUBLE = (RankState.LOST, RankState.FAILED)
NODE_LINES = 8
"""Nodes shown one by one; a pool with more folds its healthy neighbours together."""
TROUBLE_LINES = 10
"""Lines of ranks in trouble (one per error) before the rest are counted."""
MAX_TABS = 16
"""Rank tabs at most: the head's, the ranks in trouble, then the lowest others."""


def counts_text(counts: Sequence[tuple[RankState, int]]) -> str:
    """``1 failed, 7 idle``"""
    return ", ".join(f"{n} {state.value}" for state, n in counts)


def in_trouble(node: NodeRow) -> bool:
    return node.state in TROUBLE or bool(node.waiting)


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """One node, or neighbouring healthy nodes whose ranks are in the same states."""

    nodes: tuple[NodeRow, ...]

    @property
    def first(self) -> NodeRow:
        return self.nodes[0]

    @property
    def span(self) -> str:
        """Its nodes' indexes: ``3``, ``0-30``"""
        return rank_span(n.index for n in self.nodes)

    @property
    def label(self) -> str:
        """``node 3`` or ``nodes 0-30``"""
        return f"node{'s' * (len(self.nodes) > 1)} {self.span}"

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for n in self.nodes for r in n.ranks)

    @property
    def counts(self) -> tuple[tuple[RankState, int], ...]:
        totals: dict[RankState, int] = {}
        for node in self.nodes:
            for state, n in node.counts:
                totals[state] = totals.get(state, 0) + n
        return tuple(totals.items())

    @property
    def mixed(self) -> bool:
        """Whether its ranks are in more than one state (then the counts say which)."""
        return len(self.counts) > 1

    @property
    def cpu_percent(self) -> float | None:
        return _sum([n.cpu_percent for n in self.nodes])

    @property
    def rss_bytes(self) -> int | None:
        return _sum([n.rss_bytes for n in self.nodes])

    @property
    def gpu_memory_bytes(self) -> int | None:
        return _sum([n.gpu_memory_bytes for n in self.nodes])

    def heartbeat_age(self, now: float) -> float | None:
        """The oldest of its nodes' heartbeats: a node gone quiet shows."""
        ages = [a for n in self.nodes if (a := n.heartbeat_age(now)) is not None]
        return max(ages) if ages else None


def _sum(values: Sequence[_N | None]) -> _N | None:
    known = [v for v in values if v is not None]
    return sum(known[1:], known[0]) if known else None


def node_groups(nodes: Sequence[NodeRow], fold_above: int = NODE_LINES) -> list[NodeGroup]:
    """Nodes in trouble first, each alone; then the others, folded when there are many."""
    troubled = [NodeGroup((n,)) for n in nodes if in_trouble(n)]
    healthy = [n for n in nodes if not in_trouble(n)]
    if len(nodes) <= fold_above:
        return troubled + [NodeGroup((n,)) for n in healthy]
    folded: list[list[NodeRow]] = []
    for node in healthy:
        last = folded[-1][-1] if folded else None
        if (
            last is not None
            and node.index == last.index + 1
            and (node.state, node.counts, node.kind) == (last.state, last.counts, last.kind)
        ):
            folded[-1].append(node)
        else:
            folded.append([node])
    return troubled + [NodeGroup(tuple(run)) for run in folded]


@dataclass(frozen=True, slots=True)
class Trouble:
    """Ranks that failed or were lost with the same error."""

    state: RankState
    detail: str
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]

    @property
    def line(self) -> str:
        """``rank 255 (node 31): failed, ValueError: ...``"""
        many = len(self.ranks) > 1
        who = f"rank{'s' * many} {rank_span(self.ranks)}"
        where = f"node{'s' * (len(self.nodes) > 1)} {rank_span(self.nodes)}"
        detail = f", {self.detail}" if self.detail else ""
        return f"{who} ({where}): {self.state.value}{detail}"


def rank_trouble(ranks: Sequence[RankRow]) -> list[Trouble]:
    """Failed and lost ranks, one entry per (state, error): lost first, then by first rank."""
    groups: dict[tuple[RankState, str], list[RankRow]] = {}
    for r in ranks:
        if r.state in TROUBLE:
            groups.setdefault((r.state, r.detail), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (TROUBLE.index(kv[0][0]), kv[1][0].rank))
    return [
        Trouble(state, detail, tuple(r.rank for r in rows), tuple(sorted({r.node for r in rows})))
        for (state, detail), rows in ordered
    ]


def trouble_lines(ranks: Sequence[RankRow], limit: int = TROUBLE_LINES) -> list[str]:
    """:func:`rank_trouble` as lines, at most ``limit`` and then how many ranks more."""
    trouble = rank_trouble(ranks)
    lines = [t.line for t in trouble[:limit]]
    rest = sum(len(t.ranks) for t in trouble[limit:])
    if rest:
        lines.append(f"and {rest} more rank{'s' * (rest > 1)} failed or lost")
    return lines


def tab_ranks(ranks: Sequence[RankRow], limit: int = MAX_TABS) -> list[RankRow]:
    """The ranks that get a tab, in rank order: all of them up to ``limit``; above, the head's,
    those in trouble or long in a collective, then the lowest others.
    """
    if len(ranks) <= limit:
        return list(ranks)
    first = [r for i, r in enumerate(ranks) if i == 0 or r.state in TROUBLE or r.waiting]
    chosen = {r.rank for r in first[:limit]}
    for r in ranks:
        if len(chosen) >= limit:
            break
        chosen.add(r.rank)
    return [r for r in ranks if r.rank in chosen]
