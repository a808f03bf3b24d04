"""What the REST API says about pools: registry records, judged from the server's side.

A record becomes the API's pool by dropping ``teardown`` (the server's business) and adding what
only the server can tell: whether the owner process still runs, whether the owner kernel is one
of this server's, ``orphan``, the notebook of its kernel, the uptime and the cost so far, and
whether a shutdown was asked.

A record is only as true as its writer: a kernel that died (or whose ranks died) cannot say so.
Before a record's own state is shown, its liveness is checked here: a record whose owner process
ended, or all of whose ranks' processes on this machine ended, is ``gone`` (with ``gone_why``),
whatever its last state said, and has no uptime (nor cost so far) any more.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..model import RECORD_GONE
from ..procs import process_alive
from ..registry import read_records, shutdown_requested

HOST = socket.gethostname()


def owner_alive(record: dict[str, Any]) -> bool | None:
    """Whether the pool's owner process runs; None when it ran on another machine."""
    owner = record["owner"]
    if owner.get("host") != HOST:
        return None
    return process_alive(int(owner.get("pid") or 0), owner.get("start"))


def concerns(record: dict[str, Any], kernel_ids: Collection[str]) -> bool:
    """Whether this server lists the pool: one of its kernels owns it, or it ran on this machine.

    The registry directory may be shared with servers on other machines (a home on NFS); their
    pools are theirs to show.
    """
    return record["owner"].get("kernel_id") in kernel_ids or record["owner"].get("host") == HOST


def ranks_gone(record: dict[str, Any]) -> bool:
    """Whether every rank of the record ran on this machine and none of their processes runs."""
    ranks = [r for node in record.get("nodes") or () for r in node.get("ranks") or ()]
    pids = [r.get("pid") for r in ranks if r.get("hostname") == HOST]
    if not ranks or len(pids) < len(ranks) or not all(pids):
        return False  # not started, or a rank elsewhere: only its owner can tell
    return not any(process_alive(int(pid), None) for pid in pids)


def gone_why(record: dict[str, Any], alive: bool | None) -> str | None:
    """Why a record no longer describes a running pool, or None while it may."""
    if alive is False:
        return "its kernel's process ended"
    if ranks_gone(record):
        return "its ranks' processes ended"
    return None


def public(
    record: dict[str, Any],
    kernel_ids: Collection[str],
    directory: Path,
    now: float | None = None,
    notebooks: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The API's pool for ``record``; ``notebooks`` maps this server's kernel ids to the paths
    of their notebooks (its sessions).
    """
    now = time.time() if now is None else now
    owner = record["owner"]
    alive = owner_alive(record)
    kernel_id = owner.get("kernel_id")
    known = kernel_id is not None and kernel_id in kernel_ids
    why = gone_why(record, alive)
    started = record.get("started_at")
    # Gone: when it ended is not known (its record was last written at its last state change).
    counting = why is None and isinstance(started, int | float)
    uptime = max(0.0, now - float(started)) if counting and started is not None else None
    price = record.get("price_per_hour")
    spent = price * uptime / 3600 if price is not None and uptime is not None else None
    hidden = ("format", "owner", "teardown", "price_per_hour", "currency")
    pool = {k: v for k, v in record.items() if k not in hidden}
    notebook = (notebooks or {}).get(kernel_id) if kernel_id else None
    pool.update(
        state=RECORD_GONE if why else record.get("state"),
        gone_why=why,
        kernel_id=kernel_id,
        notebook=notebook,
        owner={
            "pid": owner.get("pid"),
            "host": owner.get("host"),
            "alive": alive,
            "kernel_known": known,
        },
        orphan=alive is False or (kernel_id is not None and not known),
        shutdown_requested=shutdown_requested(directory, record["id"]),
        uptime_s=uptime,
        cost={"price_per_hour": price, "spent": spent, "currency": record.get("currency")},
    )
    return pool


def stamp(pools: Iterable[dict[str, Any]]) -> str:
    """A short digest of what the listing says, less what changes with the clock alone (uptime,
    cost, when the record was last rewritten): the panel asks for it often and for the listing
    only when it changes.
    """
    clock = ("uptime_s", "cost", "updated_at")
    steady = [{k: v for k, v in p.items() if k not in clock} for p in pools]
    return hashlib.sha1(json.dumps(steady, sort_keys=True).encode()).hexdigest()[:16]


def listing(
    directory: Path,
    kernel_ids: Collection[str],
    now: float | None = None,
    notebooks: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    return [
        public(r, kernel_ids, directory, now, notebooks)
        for r in read_records(directory)
        if concerns(r, kernel_ids)
    ]


def find(pools: Iterable[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The pools whose id is ``key``, else those named ``key`` (names repeat across kernels)."""
    pools = list(pools)
    by_id = [p for p in pools if p["id"] == key]
    return by_id or [p for p in pools if p.get("name") == key]
