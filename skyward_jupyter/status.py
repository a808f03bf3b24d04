"""The text of ``%sky status``: every pool of the session, its state and its ranks, a line each.

A pool's state is said in the words of both panels (:data:`..model.STATE_WORDS`): its ranks'
states folded as the panels fold them (``ready``, ``running``, ``idle``, ``lost``, ...), or
``terminated``. A pool whose process group cannot run a collective is shown ``broken`` with the
reason, never ``ready``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .events import RankState
from .model import aggregate_state
from .pool import Pool


def status_text(
    pools: Mapping[str, tuple[str, Pool]], failed: Mapping[str, str], current: str | None
) -> str:
    """Per pool (``*`` the current one), its description and :class:`Pool`; then the names
    whose pool did not start, with their description.
    """
    lines = [_pool_status(n, text, pool, n == current) for n, (text, pool) in pools.items()]
    lines += [_failed_status(n, text, n == current) for n, text in failed.items() if n not in pools]
    return "\n".join(line for status in lines for line in status) or "no pools"


def _pool_status(name: str, description: str, pool: Pool, current: bool) -> list[str]:
    """A pool's lines in ``%sky status``: its state (``broken`` when its group cannot run a
    collective), then one line per rank.
    """
    uptime = time.time() - (pool.started_at or time.time())
    ranks = (r.state for r in pool.ranks)
    state = (aggregate_state(ranks) if pool.running else RankState.TERMINATED).value
    group = pool.group_backend or "no process group"
    if pool.running and pool.group_problem:
        state = "broken"
        group = f"process group down ({pool.group_problem}): run %sky restart"
    mark = "*" if current else " "
    lines = [f"{mark} {name}: {description}, {state}, up {uptime:.0f} s, {group}"]
    lines += [
        f"    rank {r.rank} (node {r.node}, {r.address}, {r.process}): {r.state.value}"
        for r in pool.ranks
    ]
    lines += [
        f"    node {node} packages: {env.describe()}, {env.site}"
        for node, env in sorted(pool.environments.items())
    ]
    return lines


def _failed_status(name: str, description: str, current: bool) -> list[str]:
    """The line of a name whose pool did not start: cells without pool options refuse it."""
    mark = "*" if current else " "
    return [
        f"{mark} {name}: {description}, did not start (cells without pool options refuse to "
        "run; give its options again, or %sky down forgets it)"
    ]
