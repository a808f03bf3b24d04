"""How a running cell ends when ranks fail: the pool's failure policy.

The peers' main complaint is ranks that hang for minutes. So, for a cell:

1. the first rank that fails (raises, or dies) makes the pool interrupt the ranks still running
   (SIGINT to their main thread); those still running :data:`LEAVE_AFTER` seconds later may be
   blocked in a collective, which SIGINT cannot end, so the failed ranks then leave the process
   group, which makes a peer blocked in a collective with them fail at once instead of at the
   timeout;
2. ranks still running after ``interrupt_grace`` seconds are killed;
3. when ranks left the group or died, or stopped at different counts of collectives in some
   group (each rank reports torch's sequence number of every group), dead ranks are restarted
   and the process group is re-formed on every rank with a fresh port, so the next cell finds
   the same world. The result says so and whose namespace was lost; DDP models are wrapped
   again on the new group, and what torch cannot move to it is named, to be built again (see
   :mod:`.agent.earlier_groups`). Ranks that all stopped in step (a cell that raised on every
   rank, an interrupt that found every rank outside a collective) keep the group, and what was
   built on it;
4. the result marks the failures that followed from another as secondary. When a rank's process
   ended on its own during the cell (not killed by the pool), the first such death the pool saw
   is the cause and every other failure is secondary, even a peer's error that reached the pool
   first: a dead rank breaks every collective. Otherwise the first rank that failed is the
   cause, and ranks stopped by the pool whose agent saw the interrupt before failing are
   secondary.

:class:`Cell` takes steps 1 and 2 while the cell runs (:meth:`Cell.drive`), step 4 in its
results (:meth:`Cell.results`) and step 3 after them (:meth:`Cell.recover`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

from . import doctor, wire
from . import protocol as p
from .events import PoolMessage, RankState
from .flags import rank_span
from .providers.base import ProviderError
from .ranks import Rank, Ranks
from .results import PoolError, RankEnded, RankResult, RemoteError, Stop

DESYNC_AFTER = 1.5
"""Seconds a rank may wait in a collective after others finished the cell, before it is stuck."""
DESYNC_CHECK_EVERY = 0.5
LEAVE_AFTER = 0.25
"""Seconds the ranks still running get to stop at the interrupt before the failed ranks leave
the group under them (a rank stopped in Python by then keeps the group usable)."""


class Cell:
    """One running cell: what each rank answered, and the stopping of the rest."""

    def __init__(
        self,
        cell_id: int,
        ranks: Ranks,
        live: list[Rank],
        timeout: float | None,
        grace: float,
        running: list[Rank] | None = None,
    ) -> None:
        """``live`` get the command; ``running`` (default: all of them) run the cell's code,
        the others only bind its globals (``--ranks``).
        """
        self.cell_id = cell_id
        self.ranks = ranks
        self.running = set(live if running is None else running)
        self.outside = [r for r in live if r not in self.running]
        """(``--ranks``) The ranks that only bind the cell's globals."""
        self.futures: dict[Rank, asyncio.Future[p.CellDone]] = {
            r: r.expect(p.CellDone, cell_id) for r in live
        }
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.grace = grace
        self.wake = asyncio.Event()
        self.outcomes: dict[Rank, p.CellDone | BaseException] = {}
        self.first_failure: Rank | None = None
        self.first_death: Rank | None = None
        """The first rank whose process ended on its own: the cause, whatever reached the pool
        first."""
        self.stop_at: float | None = None
        self.leave_at: float | None = None
        """From then on, failed ranks leave the group while others still run."""
        self.kill_now = False
        self.interrupts = 0
        """How often the user interrupted the cell (the first stops it, a later one kills)."""
        self.closing = False
        """The pool is closing: deaths are its doing, and what still runs is killed now."""
        self.asked_to_stop: set[Rank] = set()
        self.killed: set[Rank] = set()
        """Ranks the pool killed itself: their deaths are its doing, never a cause."""
        self.left_group: set[Rank] = set()
        self.notes: list[str] = []
        self.stop: Stop | None = None
        """Why the cell's code was stopped on every rank (the user, or its timeout)."""
        self.desync_after = ranks.settings.desync_after
        self.desync: dict[Rank, str] = {}
        """Ranks found waiting in a collective that finished ranks will never join: the cause."""
        self.check_at: float | None = None

    # ------------------------------------------------------------ commands from the pool

    def interrupt(self) -> None:
        """Ctrl-C (or the panel's button): stop the cell; a second call kills what still runs
        (as does the first, where the cell was stopped already: its timeout, a failed rank).
        """
        self.interrupts += 1
        if self.stop_at is None:
            self._stop(Stop())
        else:
            self.kill_now = True
        self.wake.set()

    def close(self) -> None:
        """The pool is closing: kill the ranks still running the cell, now."""
        self.closing = self.kill_now = True
        self.wake.set()

    async def drive(self) -> None:
        """Wait for every rank's answer, applying the policy as answers and deadlines come.

        An answer, a command and the next deadline each set ``wake``: one wait a round,
        whatever the number of ranks (waiting on every rank's future again each round cost
        the pool's thread more with every rank).
        """
        loop = asyncio.get_running_loop()
        arrived: list[Rank] = []
        """Ranks whose answer came since the last round: a round reads only those (scanning
        every pending rank each round cost the pool's thread the ranks squared a cell)."""

        def on_answer(r: Rank) -> Callable[[asyncio.Future[p.CellDone]], None]:
            def answered(_: asyncio.Future[p.CellDone]) -> None:
                arrived.append(r)
                self.wake.set()

            return answered

        for r, future in self.futures.items():
            future.add_done_callback(on_answer(r))
        pending = dict(self.futures)
        while pending:
            now = time.monotonic()
            check = self.check_at if self.stop_at is None else None
            leave = self.leave_at if self.leave_at is not None and now < self.leave_at else None
            limits = [t - now for t in (self.stop_at, self.deadline, check, leave) if t is not None]
            timer = loop.call_later(max(0.0, min(limits)), self.wake.set) if limits else None
            await self.wake.wait()
            if timer is not None:
                timer.cancel()
            self.wake.clear()
            finished: list[Rank] = []
            news, arrived[:] = arrived[:], []
            for r in news:
                if r not in pending:
                    continue
                future = pending.pop(r)
                if self._answered(r, future.exception() or future.result()):
                    finished.append(r)
            self.ranks.set_states(finished, RankState.IDLE)
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline and self.stop_at is None:
                self._stop(Stop(self.timeout))
            if pending and self.leave_at is not None and now >= self.leave_at:
                self._free_peers()
            if pending and (self.kill_now or (self.stop_at is not None and now >= self.stop_at)):
                await self._kill_stuck(pending)
            if pending and self.stop_at is None and self.check_at and now >= self.check_at:
                await self._check_desync(list(pending))
        if self.stop is not None and not any(map(_stopped, self.outcomes.values())):
            # The stop came while the last answers were on their way: every rank finished the
            # cell, and nothing was stopped (a timeout of a microsecond, a late click on the
            # panel's Interrupt; a Ctrl-C still raises in the kernel, so a Run All stops).
            self.notes.remove(str(self.stop))
            self.stop = None

    async def _check_desync(self, pending: list[Rank]) -> None:
        """Some ranks finished: are the others waiting for them in a collective?"""
        stuck = await doctor.desynced(self.ranks, pending, self.desync_after)
        self.check_at = time.monotonic() + DESYNC_CHECK_EVERY
        if stuck is None or self.stop_at is not None or any(self.futures[r].done() for r in stuck):
            return  # (one that finished while asked is no longer stuck: look again)
        finished = [r for r, o in self.outcomes.items() if isinstance(o, p.CellDone)]
        only = None if self.running >= set(finished) else self._only()
        message = doctor.desync_message(stuck, finished, only)
        self.desync = {r: message for r in stuck}
        self.notes.append("a collective desync was found; the stuck ranks were freed")
        self._stop()
        for r in finished:  # their sockets closing frees the stuck collectives at once
            self.left_group.add(r)
            self.ranks.send(r, wire.encode(p.LeaveGroup()))

    # ------------------------------------------------------------------ the policy

    def _only(self) -> list[int]:
        return sorted(r.index for r in self.running)

    def _ahead(self) -> dict[Rank, int]:
        """(``--ranks``) The ranks that ran the cell and called collectives in a group the
        others share, which the others never join (an ``async_op``, or NCCL's, returns at once
        and stays pending): how many, by rank. Left pending, they would pair with the next
        cell's collectives.
        """
        base = next(
            (
                dict(o.collectives)
                for r in self.outside
                if isinstance(o := self.outcomes.get(r), p.CellDone) and o.collectives is not None
            ),
            None,
        )
        if base is None:
            return {}
        ahead = {}
        for r in self.running:
            outcome = self.outcomes.get(r)
            if isinstance(outcome, p.CellDone) and outcome.collectives is not None:
                extra = sum(c - base[g] for g, c in outcome.collectives if base.get(g, c) < c)
                if extra:
                    ahead[r] = extra
        return ahead

    def _answered(self, r: Rank, outcome: p.CellDone | BaseException) -> bool:
        """Apply the policy to ``r``'s answer; True when it finished the cell (now idle)."""
        self.outcomes[r] = outcome
        failed = isinstance(outcome, BaseException) or outcome.error is not None
        if not failed:
            if self.check_at is None:
                self.check_at = time.monotonic() + DESYNC_CHECK_EVERY
            return True
        self.ranks.set_state(r, RankState.FAILED if r.alive else RankState.LOST)
        # A rank the pool killed (stuck after the interrupt, or at shutdown) is no cause.
        ended_on_its_own = (
            isinstance(outcome, RankEnded) and r not in self.killed and not self.closing
        )
        if ended_on_its_own and self.first_death is None:
            self.first_death = r
        if self.first_failure is None and self.stop_at is None:
            self.first_failure = r
            self._stop()
        return False

    def _stop(self, why: Stop | None = None) -> None:
        """Interrupt the ranks still running; failed ranks leave the group if they do not stop
        within :data:`LEAVE_AFTER`. ``why``: the user or the timeout stopped the cell (said
        among its notes), not another rank's failure.
        """
        if why is not None:
            self.stop = why
            self.notes.append(str(why))
        now = time.monotonic()
        self.stop_at = now + self.grace
        self.leave_at = now + LEAVE_AFTER
        interrupt = wire.encode(p.Interrupt(self.cell_id))
        for r, future in self.futures.items():
            if not future.done():
                self.asked_to_stop.add(r)
                self.ranks.send(r, interrupt)

    def _free_peers(self) -> None:
        """Make failed ranks leave the group while peers may still wait in a collective with them.

        A peer blocked in a gloo collective does not see SIGINT: only the failed ranks' sockets
        closing free it before the group's timeout (or the kill after ``interrupt_grace``).
        """
        leave = wire.encode(p.LeaveGroup())
        for r, outcome in self.outcomes.items():
            failed = isinstance(outcome, p.CellDone) and outcome.error is not None
            if failed and r not in self.left_group:
                self.left_group.add(r)
                self.ranks.send(r, leave)

    async def _kill_stuck(self, pending: dict[Rank, asyncio.Future[p.CellDone]]) -> None:
        """Kill the ranks still running, and say so once; their ends come in over the next
        rounds, which wait for them (or another grace: then what is still there is killed again,
        unsaid).
        """
        stuck = [r for r in pending if r.process is not None]
        named = [r.index for r in stuck if r not in self.killed]
        if named:
            who = f"rank{'s' * (len(named) > 1)} {rank_span(named)}"
            were = "were" if len(named) > 1 else "was"
            early = self.stop_at is not None and time.monotonic() < self.stop_at
            which = "second interrupt" if self.interrupts > 1 else "interrupt"
            self.notes.append(
                f"{who} {were} killed at the {which}, before {self.grace:.0f} s were up"
                if self.kill_now and early and not self.closing  # the user's interrupt
                else f"{who} did not stop within {self.grace:.0f} s of the interrupt and {were} "
                "killed"
            )
        self.asked_to_stop.update(stuck)
        self.killed.update(stuck)
        self.kill_now = False
        self.stop_at = time.monotonic() + self.grace
        await asyncio.gather(*(r.kill() for r in stuck))

    def results(self) -> tuple[RankResult, ...]:
        """Every rank's result, the failures that followed from another's marked secondary.

        A rank that died on its own is the cause even when a peer's error reached the pool
        first: a dead rank breaks every collective its peers wait in, and their errors often
        arrive before the pool learns of the death. Otherwise the first failure the pool saw is
        the cause, and every other failure follows from it: the pool stopped those ranks and
        broke the group under them (a peer's "Connection closed" can even reach its rank before
        the interrupt does). Only a stop without a cause (the user's interrupt, a timeout)
        asks each rank whether its error came after the interrupt.
        """
        cause = self.first_death or self._lowest_alike(self.first_failure)
        out = []
        ahead = {} if self.desync else self._ahead()
        for r in self.ranks.all:
            outcome = self.outcomes.get(r)
            if r not in self.running and not _failed(outcome):
                continue  # (--ranks) it did not run the cell, and binding the globals worked
            if r in ahead and not _failed(outcome):
                out.append(_desynced(r, outcome, doctor.ahead_message(r, ahead[r], self._only())))
                continue
            if r in self.desync:
                out.append(_desynced(r, outcome, self.desync[r]))
                continue
            if self.desync:
                secondary = True
            elif cause is not None:
                secondary = r is not cause
            else:
                secondary = r in self.asked_to_stop and _consequence(outcome)
            if isinstance(outcome, p.CellDone):
                error = (
                    _remote_error(r, outcome.error, secondary)
                    if outcome.error is not None
                    else None
                )
                value = _load_value(outcome) if error is None else None
                out.append(
                    RankResult(
                        r.index, r.node.index, value, outcome.value_repr, error, outcome.seconds
                    )
                )
            else:
                how = outcome.how if isinstance(outcome, RankEnded) else repr(outcome)
                diag = outcome.diagnostics if isinstance(outcome, RankEnded) else ""
                error = RemoteError(
                    r.index,
                    r.describe(),
                    "RankLost",
                    f"the rank's process {how}",
                    f"RankLost: the rank's process {how}\n{diag}".rstrip() + "\n",
                    secondary,
                )
                out.append(RankResult(r.index, r.node.index, None, None, error, 0.0))
        return tuple(out)

    def _lowest_alike(self, first: Rank | None) -> Rank | None:
        """Of the ranks that failed as the first failure did (the same exception and message:
        the cell's own error on every rank, not one the stop caused), the lowest: which of them
        the pool heard first is chance, and the user reads rank 0's as the cell's.
        """
        seen = self.outcomes.get(first) if first is not None else None
        if not isinstance(seen, p.CellDone) or seen.error is None:
            return first
        what = (seen.error.type_name, seen.error.message)
        for r in self.ranks.all:
            outcome = self.outcomes.get(r)
            error = outcome.error if isinstance(outcome, p.CellDone) else None
            if error is not None and (error.type_name, error.message) == what:
                return r
        return first

    def bound(self) -> frozenset[str]:
        """Global names the cell (re)bound on any rank: they are the ranks' now."""
        done = (o for o in self.outcomes.values() if isinstance(o, p.CellDone))
        return frozenset(name for o in done for name in o.bound)

    def deleted(self) -> frozenset[str]:
        """Global names the cell deleted on any rank: no longer theirs."""
        done = (o for o in self.outcomes.values() if isinstance(o, p.CellDone))
        return frozenset(name for o in done for name in o.deleted)

    async def recover(self) -> bool:
        """Restart dead ranks and re-form the group when the cell left it out of step.

        Returns whether the group was formed again after the cell's own code destroyed it.
        """
        done = [o for o in self.outcomes.values() if isinstance(o, p.CellDone)]
        self.notes.extend(dict.fromkeys(n for o in done for n in o.notes))
        destroyed = any(o.group_destroyed for o in done)
        lost = any(not r.alive for r in self.ranks.all)
        # Ranks stopped part-way may disagree on how many collectives ran: a group is kept only
        # when they agree. A group the cell destroyed is formed again before the next cell.
        astray = (bool(self.asked_to_stop) or bool(self.outside)) and not (
            len(done) == len(self.ranks.all) and _in_step(done)
        )
        if not (astray or self.left_group or lost or destroyed):
            return False
        failed = bool(astray or self.left_group or lost)
        try:
            self.notes.extend(await self.ranks.restart_dead(after_failure=failed))
        except (PoolError, ProviderError) as exc:
            # The cell's own result still matters most; the next cell says more.
            self.notes.append(f"the pool could not recover: {exc}")
            self.ranks.emit(PoolMessage(self.notes[-1]))
            return False
        return destroyed


def _in_step(done: list[p.CellDone]) -> bool:
    """Whether the ranks called as many collectives as each other in every group they share."""
    counts: dict[str, int] = {}
    for outcome in done:
        if outcome.collectives is None:
            return False
        for name, count in outcome.collectives:
            if counts.setdefault(name, count) != count:
                return False
    return True


def _desynced(r: Rank, outcome: p.CellDone | BaseException | None, message: str) -> RankResult:
    """The stuck rank's result: the desync is its error, with the traceback of where it was."""
    tb = outcome.error.traceback if isinstance(outcome, p.CellDone) and outcome.error else ""
    tb = _where_it_waited(tb)
    error = RemoteError(
        r.index, r.describe(), "CollectiveDesync", message, f"{tb}CollectiveDesync: {message}\n"
    )
    seconds = outcome.seconds if isinstance(outcome, p.CellDone) else 0.0
    return RankResult(r.index, r.node.index, None, None, error, seconds)


_TRACEBACK = "Traceback (most recent call last):\n"
_LIBRARY = re.compile(r'  File "[^"]*(/site-packages/|/dist-packages/|/lib/python3\.\d+/)')


def _where_it_waited(traceback: str) -> str:
    """Of a freed rank's traceback, the frames down to the user's code that called the
    collective: not the error that freeing it caused in torch (gloo's "Connection closed by
    peer ... a remote worker crashing", then the ``KeyboardInterrupt``), which would blame a
    crash that never happened.
    """
    start = traceback.rfind(_TRACEBACK)
    if start < 0:
        return ""
    lines = traceback[start + len(_TRACEBACK) :].splitlines(keepends=True)
    frames: list[list[str]] = []
    for line in lines:
        if line.startswith("  File "):
            frames.append([line])
        elif frames and line.startswith("    "):
            frames[-1].append(line)
        else:
            break  # the exception's own line(s)
    users = [i for i, frame in enumerate(frames) if not _LIBRARY.match(frame[0])]
    kept = frames[: users[-1] + 1] if users else frames
    return _TRACEBACK + "".join(line for frame in kept for line in frame)


def _failed(outcome: p.CellDone | BaseException | None) -> bool:
    return isinstance(outcome, BaseException) or (
        isinstance(outcome, p.CellDone) and outcome.error is not None
    )


def _stopped(outcome: p.CellDone | BaseException | None) -> bool:
    """Whether the cell did not simply run to its end there: it failed, or the interrupt
    reached its code (caught or not).
    """
    return _failed(outcome) or (isinstance(outcome, p.CellDone) and outcome.stopped)


def _consequence(outcome: p.CellDone | BaseException | None) -> bool:
    """Whether a stopped rank's failure came from the stop (its agent saw the interrupt first)."""
    if not isinstance(outcome, p.CellDone) or outcome.error is None:
        return True  # killed, or lost
    return outcome.error.after_interrupt


def _remote_error(rank: Rank, info: p.ErrorInfo, secondary: bool) -> RemoteError:
    exception: BaseException | None = None
    if info.exception is not None:
        try:
            exception = info.exception.load()
        except Exception:  # noqa: BLE001 - its type may not exist here; the text form is kept
            exception = None
    return RemoteError(
        rank.index,
        rank.describe(),
        info.type_name,
        info.message,
        info.traceback,
        secondary,
        exception,
    )


def _load_value(done: p.CellDone) -> Any:
    if done.value is None:
        return None
    try:
        return done.value.load()
    except Exception:  # noqa: BLE001 - a value that cannot be loaded here is shown by its repr
        return None
