"""What a pool's record says: its owner, its nodes and their ranks' states, its price, and how
to end it without its kernel.

The record holds what the lab panel shows (owner kernel, provider, nodes and their ranks' states,
start time, price) and what is needed to end the pool without its kernel (``teardown``: local rank
and template pids with their start times; SSH hosts and remote pids; for AWS the region, the
pool's tag and its instances). No secrets: no environment, no keys, no tokens.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..model import EntryFacts, aggregate_state, price_of
from ..procs import process_start
from .files import FORMAT

if TYPE_CHECKING:
    from ..results import RankInfo


@dataclass(frozen=True, slots=True)
class Owner:
    """The process whose session owns a pool, and its Jupyter kernel id if it is a kernel."""

    pid: int
    start: str | None
    host: str
    kernel_id: str | None

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start(pid), socket.gethostname(), kernel_id())

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start": self.start,
            "host": self.host,
            "kernel_id": self.kernel_id,
        }


def kernel_id() -> str | None:
    """This kernel's id, from its connection file (``kernel-<id>.json``); None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # noqa: BLE001 - not a kernel (terminal IPython, a script): no id
        return None
    match = re.fullmatch(r"kernel-(.+)\.json", name)
    return match.group(1) if match else None


def pool_record(
    pool_id: str,
    entry: EntryFacts,
    owner: Owner,
    *,
    created_at: float,
    ready_at: float | None,
) -> dict[str, Any]:
    """What the registry says of a pool now; its ``teardown`` is what the pool's provider
    needs to end the pool without its kernel, and names the module that defines it.
    """
    pool = entry.pool
    ranks = pool.ranks
    by_node: dict[int, list[RankInfo]] = {}  # once: per node it was ranks times nodes
    for r in ranks:
        by_node.setdefault(r.node, []).append(r)
    nodes = []
    for node in pool.nodes:
        own = by_node.get(node.index, [])
        nodes.append(
            {
                "index": node.index,
                "address": node.address,
                "gpus": len(node.gpus),
                "gpu_type": node.gpu_type,
                "instance_type": node.instance_type,
                "state": aggregate_state(r.state for r in own).value,
                "ranks": [
                    {
                        "rank": r.rank,
                        "local_rank": r.local_rank,
                        "state": r.state.value,
                        "pid": r.hello.pid if r.hello else None,
                        "hostname": r.hello.hostname if r.hello else None,
                        "process": r.process,
                    }
                    for r in own
                ],
            }
        )
    pids = {
        node.index: [r.hello.pid for r in by_node.get(node.index, []) if r.hello]
        for node in pool.nodes
    }
    teardown = {"provider": pool.provider.name, **pool.provider.record(pids)}
    price = price_of(pool)
    return {
        "format": FORMAT,
        "id": pool_id,
        "name": entry.name,
        "owner": owner.as_dict(),
        "provider": pool.provider.name,
        "description": entry.spec.describe(),
        "state": aggregate_state(r.state for r in ranks).value,
        "ready": ready_at is not None and pool.running,
        "nodes_requested": pool.requested_nodes,
        "world_size": len(ranks),
        "backend": pool.group_backend,
        "created_at": created_at,
        "started_at": pool.started_at,
        "ready_at": ready_at,
        "updated_at": time.time(),
        "price_per_hour": price,
        "currency": "USD" if price is not None else None,
        "nodes": nodes,
        "teardown": teardown,
    }
