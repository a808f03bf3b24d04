"""The names bound on ranks, asked for without their values: what the notebook's Tab completion
offers of the head's names (``model.<Tab>``) and what ``%sky who`` lists.

A rank's reader thread answers (:mod:`.agent.names`), also while a cell runs; a rank that does
not answer by the deadline (a cell holding its GIL in native code, a lost host) is left out, so
that no one waits on it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from . import protocol as p
from . import wire
from .ranks import Rank, Ranks

_requests = itertools.count(1)
_UNANSWERED = "(native code holding the GIL, a stopped process or an unreachable host)"


async def ask(
    ranks: Ranks, targets: Sequence[Rank], path: tuple[str, ...], timeout: float
) -> dict[int, p.Names | None]:
    """Each target's names (or attributes of the object at ``path``), by rank; None for a rank
    that did not answer within ``timeout``.
    """
    request = next(_requests)
    live = [r for r in targets if r.alive and r.process is not None]
    futures = {r: r.expect(p.Names, request) for r in live}
    frame = wire.encode(p.NamesRequest(request, path))
    try:
        for r in futures:
            ranks.send(r, frame)
        if futures:
            await asyncio.wait(futures.values(), timeout=timeout)
    finally:  # also when the caller gave up first (a cancelled ask)
        for r, future in futures.items():
            r.give_up(p.Names, request)
            if not future.done():
                future.cancel()
    answers: dict[int, p.Names | None] = {r.index: None for r in targets}
    for r, future in futures.items():
        if not future.cancelled() and future.exception() is None:
            answers[r.index] = future.result()
    return answers


def table(rank: int, answer: p.Names | None, timeout: float) -> str:
    """``%sky who`` for one rank: as ``%whos`` shows the notebook's, a row per name (modules
    and ``_`` names left out) with its type and, for a tensor or an array, its shape, dtype and
    device; or why there is none.
    """
    if answer is None:
        return f"rank {rank}: no answer within {timeout:.0f} s {_UNANSWERED}"
    if answer.error is not None:
        return f"rank {rank}: {answer.error}"
    shown = sorted(
        (n for n in answer.names if n.kind != "module" and not n.name.startswith("_")),
        key=lambda n: n.name,
    )
    if not shown:
        return f"rank {rank}: no names bound"
    header = ("Variable", "Type", "Shape", "Dtype", "Device")
    rows = [
        (
            n.name,
            n.type_name,
            "" if n.shape is None else "x".join(map(str, n.shape)) or "scalar",
            n.dtype or "",
            n.device or "",
        )
        for n in shown
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return f"rank {rank}:\n" + "\n".join(lines)
