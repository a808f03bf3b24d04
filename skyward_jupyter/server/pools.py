"""What the REST API says about pools: registry records, judged from the server's side.

A record becomes the API's pool by dropping ``teardown`` (the server's business) and adding what
only the server can tell: whether the owner process still runs, whether the owner kernel is one
of this server's, ``orphan``, the uptime and the cost so far, and whether a shutdown was asked.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

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


def public(
    record: dict[str, Any],
    kernel_ids: Collection[str],
    directory: Path,
    now: float | None = None,
) -> dict[str, Any]:
    now = time.time() if now is None else now
    owner = record["owner"]
    alive = owner_alive(record)
    kernel_id = owner.get("kernel_id")
    known = kernel_id is not None and kernel_id in kernel_ids
    started = record.get("started_at")
    uptime = max(0.0, now - started) if isinstance(started, int | float) else None
    price = record.get("price_per_hour")
    spent = price * uptime / 3600 if price is not None and uptime is not None else None
    hidden = ("format", "owner", "teardown", "price_per_hour", "currency")
    pool = {k: v for k, v in record.items() if k not in hidden}
    pool.update(
        kernel_id=kernel_id,
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


def listing(
    directory: Path, kernel_ids: Collection[str], now: float | None = None
) -> list[dict[str, Any]]:
    return [
        public(r, kernel_ids, directory, now)
        for r in read_records(directory)
        if concerns(r, kernel_ids)
    ]


def find(pools: Iterable[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The pools whose id is ``key``, else those named ``key`` (names repeat across kernels)."""
    pools = list(pools)
    by_id = [p for p in pools if p["id"] == key]
    return by_id or [p for p in pools if p["name"] == key]
