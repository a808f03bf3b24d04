"""The hang doctor: where every rank is, and collectives that some ranks will never join.

A hang is where a user of distributed training is most alone: nothing says which rank is where.
Here:

- :func:`stacks` asks ranks for their Python stacks; their reader thread answers at once, also
  while the cell waits in a collective (torch releases the GIL there);
- :func:`desynced` tells, once some ranks have finished a cell, which of the others wait in a
  collective that cannot complete: the finished ranks will not join it. A collective that is
  merely slow (a peer still loading data) is left alone: every rank is still in the cell. DDP's
  gradient all-reduce waits inside backward, which also computes: there, a rank counts as
  waiting only when it uses no CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from . import protocol as p
from . import wire
from .events import PoolMessage, RankState
from .flags import rank_span
from .procs import IN_IO
from .providers.base import Watchable
from .ranks import Rank, Ranks

STACKS_TIMEOUT = 1.0
"""Seconds a rank has to answer for its stacks (its reader thread needs the GIL for a moment)."""
BUSY_LOOK_EVERY = 5.0
"""Seconds between looks at a silent rank found running (one stopped later is then lost)."""
IDLE_CPU_PERCENT = 20.0
_BACKWARD = "backward"
_requests = itertools.count(1)
log = logging.getLogger(__name__)


async def stacks(
    ranks: Ranks, targets: list[Rank], timeout: float = STACKS_TIMEOUT
) -> dict[Rank, p.Stacks | None]:
    """Each live target's stacks; None for one that did not answer within ``timeout``."""
    request = next(_requests)
    futures = {r: r.expect(p.Stacks, request) for r in targets if r.alive and r.process is not None}
    frame = wire.encode(p.StackRequest(request))
    for r in futures:
        ranks.send(r, frame)
    if futures:
        await asyncio.wait(futures.values(), timeout=timeout)
    answers: dict[Rank, p.Stacks | None] = {r: None for r in targets}
    for r, future in futures.items():
        r.give_up(p.Stacks, request)
        if future.done() and not future.cancelled() and future.exception() is None:
            answers[r] = future.result()
        else:
            future.cancel()
    return answers


def report(answers: dict[Rank, p.Stacks | None]) -> str:
    """``%sky stacks``: every rank's stacks, with what it waits in, in rank order."""
    parts = []
    for r in sorted(answers, key=lambda r: r.index):
        answer = answers[r]
        title = f"rank {r.index} ({r.describe()})"
        if answer is None and not r.alive:
            how = ""
            if r.ended is not None and r.state in (RankState.LOST, RankState.TERMINATED):
                how = f" ({r.ended.how})"
            parts.append(f"{title}: {r.state.value}{how}, no process to ask\n")
            continue
        if answer is None and r.hello is None:  # started again, not serving yet
            parts.append(f"{title}: {r.state.value}, not serving yet: no stacks to show\n")
            continue
        if answer is None:
            parts.append(
                f"{title}: no answer within {STACKS_TIMEOUT:.0f} s (native code holding the "
                "GIL, a stopped process or an unreachable host)\n"
            )
            continue
        if answer.collective:
            title += f": in {answer.collective} at {answer.where} for {answer.waited:.0f} s"
        parts.append(f"{title}\n{answer.text}")
    return "\n".join(parts)


async def desynced(ranks: Ranks, pending: list[Rank], after: float) -> dict[Rank, p.Stacks] | None:
    """The pending ranks stuck in a collective for ``after`` seconds or more, when every one of
    them is (a rank still computing may yet call it: then nothing is stuck yet).
    """
    answers = await stacks(ranks, pending)
    stuck: dict[Rank, p.Stacks] = {}
    for r, answer in answers.items():
        if answer is None or answer.collective is None or answer.waited < after:
            return None
        idle = r.usage is not None and r.usage.cpu_percent < IDLE_CPU_PERCENT
        if answer.collective == _BACKWARD and not idle:
            return None
        stuck[r] = answer
    return stuck or None


def desync_message(
    stuck: dict[Rank, p.Stacks], finished: list[Rank], only: list[int] | None = None
) -> str:
    """One line: who waits in what, for whom. ``only``: the ranks the cell ran on (``--ranks``),
    when the others never ran it.
    """
    where = "; ".join(
        f"rank {r.index} in {s.collective} at {s.where}"
        for r, s in sorted(stuck.items(), key=lambda kv: kv[0].index)
    )
    done = ", ".join(str(r.index) for r in sorted(finished, key=lambda r: r.index))
    if only is not None:
        span = rank_span(only)
        return (
            f"{where}: only rank{'s' * (len(only) > 1)} {span} run{'s' * (len(only) == 1)} "
            f"this cell (--ranks {span}), and a collective on the pool's group waits for every "
            "rank; run the cell on every rank to call it"
        )
    return (
        f"{where}, waiting for ranks that had finished the cell ({done}): a collective that not "
        "every rank calls (one under `if rank == 0:`, or a different number of steps per rank)"
    )


def ahead_message(r: Rank, calls: int, only: list[int]) -> str:
    """One line: rank ``r`` left ``calls`` collectives pending that the ranks outside the cell
    (``--ranks``) never join.
    """
    span = rank_span(only)
    return (
        f"rank {r.index} called {calls} collective{'s' * (calls != 1)} the other ranks never "
        f"join: only rank{'s' * (len(only) > 1)} {span} run{'s' * (len(only) == 1)} this cell "
        f"(--ranks {span}); the pool formed its group again without them"
    )


async def heartbeats(ranks: Ranks) -> None:
    """Beat the live ranks; declare one silent past the timeout lost, and kill it.

    A rank heard of in any way (a heartbeat, any message, part of a large one) is not silent.
    Each silent rank is examined on its own (:func:`_examine`), while the beats go on.
    """
    interval, timeout = ranks.settings.heartbeat_interval, ranks.settings.heartbeat_timeout
    # Suspected early enough that the probe and this loop's tick end about at the timeout.
    suspect = max(timeout - STACKS_TIMEOUT - interval, 2 * interval)
    # A node's first rank hears a beat every interval; the others, which wait far longer for
    # one than the notebook waits for them, four times within that wait, on ticks spread over
    # the ranks: the notebook's idle writes (and the ranks' wake-ups) grow with its nodes.
    every = max(1, int(ranks.provider.notebook_silence / (4 * interval)))
    told_busy: set[Rank] = set()
    """Silent ranks the user was told run on (said once per silence)."""
    examining: dict[Rank, asyncio.Task[None]] = {}
    try:
        for tick in itertools.count():
            await asyncio.sleep(interval)
            now = time.monotonic()
            silent = []
            for r in ranks.all:
                if r.alive and r.process is not None:
                    if r.local_rank == 0 or (tick + r.index) % every == 0:
                        ranks.send(r, ranks.beat)
                    # Until its hello, a rank is starting (loading torch can hold the GIL for
                    # seconds): the start's own timeout applies.
                    if r.hello is not None and now - r.last_heard > suspect:
                        silent.append(r)
            told_busy.intersection_update(silent)
            for r in [r for r, task in examining.items() if task.done()]:
                del examining[r]
            for r in silent:
                if r not in examining:
                    examining[r] = asyncio.ensure_future(_examine(ranks, r, suspect, told_busy))
    finally:
        for task in list(examining.values()):
            task.cancel()


async def _examine(ranks: Ranks, r: Rank, suspect: float, told_busy: set[Rank]) -> None:
    """A silent rank's verdict. One whose reader still answers for its stacks is busy (its
    heartbeat stuck behind something), not gone, and is left alone. So is one whose process
    its provider sees running (on this machine, a host over SSH, a Slurm node, through its Ray
    actor): native code holding the GIL for long (a first import of a large library on a loaded
    machine, a C extension's call) silences every thread of a rank that still works. Any other
    is declared lost.
    """
    if r in told_busy:  # its stacks were asked for already: only whether it still runs
        # Not at once: a look may be a command on its machine (an SSH session, a Slurm step).
        await asyncio.sleep(BUSY_LOOK_EVERY)
        if time.monotonic() - r.last_heard <= suspect:
            return
        runs = await _runs(r)
        answered = False
    else:
        answers, runs = await asyncio.gather(stacks(ranks, [r]), _runs(r))
        answered = answers[r] is not None
    # Heard of while the probe waited (a slow start's first heartbeat): not silent.
    still = time.monotonic() - r.last_heard > suspect
    if answered or not still or not r.alive or r.process is None:
        return
    if runs is None:
        await _declare_lost(ranks, r)
    elif r not in told_busy:
        told_busy.add(r)
        ranks.emit(PoolMessage(_busy(r, runs)))


async def _runs(r: Rank) -> str | None:
    """How the rank's provider sees its process run (:func:`.procs.how_it_ran`); None where it
    does not, or cannot look.
    """
    process: object = r.process  # a provider's own class, which may also be Watchable
    if not isinstance(process, Watchable) or r.hello is None:
        return None
    try:
        return await process.running(r.hello.pid, STACKS_TIMEOUT)
    except Exception:  # a provider's look that failed: the rank is judged by its silence
        log.exception("looking at rank %d's process failed", r.index)
        return None


def _busy(r: Rank, how: str) -> str:
    """Why a silent rank is left to run, as its process was seen (``how``)."""
    quiet = time.monotonic() - r.last_heard
    said = f"rank {r.index} ({r.describe()}) has not answered for {quiet:.0f} s, yet its process"
    if how == IN_IO:
        return (
            f"{said} waits in the kernel for I/O (a slow or unresponsive disk or network "
            "filesystem, or memory paged out) with its GIL held; it is left to wait (a stopped "
            "one would be declared lost)"
        )
    return (
        f"{said} runs: native code holding the GIL (a long import, a C extension's call) keeps "
        "its threads from answering; it is left to run (a stopped one would be declared lost)"
    )


async def _declare_lost(ranks: Ranks, r: Rank) -> None:
    """Say why, then end it (:meth:`.Ranks.abandon`: its cell hears at once, however long its
    machine takes to answer the kill).
    """
    if r.process is None:
        return
    quiet = time.monotonic() - r.last_heard
    r.silenced = (
        f"stopped answering: no heartbeat for {quiet:.1f} s (a stopped process, a frozen host, "
        "or native code holding the GIL where the pool could not see the process run); the pool "
        "killed it"
    )
    ranks.set_state(r, RankState.LOST, f"silent for {quiet:.0f} s")
    await ranks.abandon(r)
