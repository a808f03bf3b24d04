"""A pool of ranks: start them, run a cell on every one, keep the pool usable when ranks fail.

All IO happens on the pool's own asyncio thread (:mod:`.io_thread`); the blocking API below
hands work to it, and a KeyboardInterrupt while the caller waits reaches every rank. The ranks
and their process group are :mod:`.ranks`; ranks failing during a cell, :mod:`.failure_policy`;
hangs, :mod:`.doctor`; what leaves the notebook once, :mod:`.transfer`; the names the ranks
bind, :mod:`.rank_names`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from . import doctor, limits, rank_names, relay_keys, wire
from . import protocol as p
from .checked_source import CheckedSource
from .environments import NodeEnvironment, Packages
from .events import (
    CellFinished,
    CellStarted,
    PoolEvent,
    PoolMessage,
    RankState,
)
from .failure_policy import DESYNC_AFTER, Cell
from .fanout import Fanout, Subscriber
from .flags import rank_span
from .frameworks import TORCH_ONLY, Frameworks
from .io_thread import IOThread, StoppedWaiting, close_at_exit, wait
from .launch_env import check_user_env
from .prompts import Prompts
from .providers import DEFAULT, provider_class
from .providers.base import Node, Provider, ProviderError
from .ranks import Rank, Ranks, RankSettings
from .relay_keys import RelaySecrets
from .results import PoolError, RankInfo, RanksRestarted, RunResult
from .transfer import DEFAULT_SYNC_CAP, Transfer, pickle_global
from .wire import encode
from .workdir import Manifest

__all__ = ["Pool", "RankInfo", "Subscriber"]
PG_TIMEOUT = 1800.0
"""The collectives' timeout: torch's own default. Death, silence and desync are found directly,
in seconds, so it only has to let real training's long collectives (and a peer in pdb) be."""

MENDING_WAIT = 5.0
"""Seconds a failed cell's end waits for the pool to mend itself (lost ranks started again, the
group formed again): long enough for a local or SSH restart, so its notes come with the cell.
A machine that does not answer holds a restart for its connection's timeout; the cell ends
then, and the next cell waits for the rest."""

log = logging.getLogger(__name__)
F = TypeVar("F", bound="asyncio.Future[Any]")


class Pool:
    """N nodes x P ranks of persistent, DDP-ready processes.

    >>> with Pool(nodes=2) as pool:                       # doctest: +SKIP
    ...     result = pool.run("import torch.distributed as d; d.get_rank()")
    ...     result.values
    [0, 1]
    """

    def __init__(
        self,
        nodes: int = 1,
        procs_per_node: int | None = None,
        *,
        provider: Provider | None = None,
        name: str = "default",
        backend: str | None = None,
        env: Mapping[str, str] | None = None,
        pg_timeout: float = PG_TIMEOUT,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        desync_after: float = DESYNC_AFTER,
        interrupt_grace: float = 3.0,
        start_timeout: float = 180.0,
        sync: Sequence[str] = (),
        sync_cap_bytes: int | None = None,
        sync_chosen: bool = True,
        frameworks: Frameworks = TORCH_ONLY,
        secure: bool = False,
        gpu: str | None = None,
        packages: Packages | None = None,
    ) -> None:
        limits.NODES.check(nodes)
        if procs_per_node is not None:
            limits.PROCS_PER_NODE.check(procs_per_node)
            limits.check_layout(nodes, procs_per_node)
        limits.HEARTBEAT_TIMEOUT.check(heartbeat_timeout)
        limits.DESYNC_AFTER.check(desync_after)
        limits.PG_TIMEOUT.check(pg_timeout)
        limits.HEARTBEAT_INTERVAL.check(heartbeat_interval)
        limits.INTERRUPT_GRACE.check(interrupt_grace)
        limits.START_TIMEOUT.check(start_timeout)
        if sync_cap_bytes is not None:
            limits.SYNC_CAP_BYTES.check(sync_cap_bytes)
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if secure and (backend == "nccl" or frameworks.jax):
            raise ValueError(
                "secure=True carries torch's gloo traffic only: use backend='gloo', no JAX"
            )
        check_user_env(env or {})
        if provider is None:  # the default provider takes no arguments (its options are none)
            provider = provider_class(DEFAULT)()
        self.name = name
        self.provider: Provider = provider
        self.requested_nodes = nodes
        self.interrupt_grace = interrupt_grace
        self.started_at: float | None = None
        self.run_id = str(uuid.uuid4())
        """The pool's ``TORCHELASTIC_RUN_ID`` for its cells (and its directories on the nodes);
        each script run has one of its own."""
        settings = RankSettings(
            pool_name=name,
            procs_per_node=procs_per_node,
            backend=backend,
            env=dict(env or {}),
            pg_timeout=pg_timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            desync_after=desync_after,
            start_timeout=start_timeout,
            run_id=self.run_id,
            # Ranks on the notebook's machine get values over their own pipes: no relay there.
            relay=None
            if provider.on_notebook_machine
            else RelaySecrets.make(relay_keys.ENCRYPTED or secure),
            frameworks=frameworks,
            secure=secure,
            gpu=gpu,
            packages=packages,
        )
        self._ranks = Ranks(provider, settings, self._emit, self._rank_ended)
        self._prompts = Prompts()
        self._ranks.on_input = self._prompts.ask
        cap = sync_cap_bytes or DEFAULT_SYNC_CAP
        # sync_chosen: the user named the directories (a home directory is then fine to sync)
        self._transfer = Transfer(self._ranks, sync, cap, provider, self._emit, sync_chosen)
        self._fanout = Fanout()
        self._io: IOThread | None = None
        self._op_lock: asyncio.Lock | None = None
        self._cell: Cell | None = None
        self._cell_task: asyncio.Task[Any] | None = None
        self._cell_ids = itertools.count(1)
        self._closing = False
        self._lost_while_idle: list[int] = []
        self._monitor: asyncio.Task[None] | None = None
        self._recoveries: set[asyncio.Future[Any]] = set()
        """Every recovery under way (an idle rank's, a failed cell's): the pool's shutdown
        stops them, so that no rank is started while it goes down."""
        self._queued: set[asyncio.Task[Any]] = set()
        """Cells and restarts waiting for the pool's operations lock (held by a recovery)."""
        self._mending: asyncio.Task[None] | None = None
        """A failed cell's recovery that outlasted :data:`MENDING_WAIT`, holding the pool's
        operations until it ends."""
        self._handed_over = False
        """The cell ending now hands the operations lock to its recovery (not released)."""
        self._mend_wait: asyncio.Future[None] | None = None
        """Set to end a failed cell's wait for its recovery (Ctrl-C)."""
        self._start_task: asyncio.Task[Any] | None = None
        self._said_reformed = False

    # ------------------------------------------------------------------------- blocking API

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return len(self._ranks.all)

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return tuple(r.info() for r in self._ranks.all)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._ranks.nodes

    @property
    def environments(self) -> dict[int, NodeEnvironment]:
        """Each node's environment of ``packages`` (none without), by node index."""
        return dict(self._ranks.environments)

    @property
    def worlds_note(self) -> str:
        """What the ranks formed ("torch.distributed gloo, port 4242"), or why nothing."""
        return self._ranks.worlds_note

    @property
    def group_backend(self) -> str | None:
        return self._ranks.group_backend

    @property
    def master_port(self) -> int | None:
        return self._ranks.master_port

    @property
    def group_problem(self) -> str | None:
        """Why the process group cannot run a collective now (None: it can); a restart mends it."""
        return self._ranks.group_problem

    @property
    def running(self) -> bool:
        return self._io is not None and not self._closing

    @property
    def ranks_started(self) -> int:
        """Rank processes started so far: more than when last asked means some rank began
        again with an empty namespace (also one restarted while the pool was idle).
        """
        return self._ranks.started

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` with every event, on the pool's IO thread; returns an unsubscribe."""
        return self._fanout.subscribe(callback)

    def start(self, on_wait: Callable[[], None] | None = None) -> Pool:
        """Start every rank and form the process group; blocks until the pool is ready.
        ``on_wait`` is called on the caller's thread while it waits (a view showing the boot).
        """
        if self._io is not None:
            return self
        self.check()
        self._io = IOThread(f"skyward-pool-{self.name}")
        close_at_exit(self)
        try:
            wait(self._io.submit(self._start()), self.interrupt, on_wait)
        except BaseException:
            self.close()
            raise
        return self

    def check(self) -> None:
        """Refuse what starting would refuse before reaching any machine (a directory that
        cannot be synced), as a :class:`PoolError`.
        """
        self._transfer.scan()

    def run(
        self,
        source: str | CheckedSource,
        globals: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        filename: str | None = None,
        script: p.Script | None = None,
        observer: Subscriber | None = None,
        on_wait: Callable[[], None] | None = None,
        ranks: Sequence[int] | None = None,
        keep: Collection[str] = (),
        fill: Collection[str] = (),
        started: int | None = None,
    ) -> RunResult:
        """Run ``source`` on every rank with ``globals`` bound first; one result per rank.

        ``ranks`` (``%%sky --ranks``): only those run it, and only their results come back
        (with any other rank's failure); the others bind the globals and are idle at once,
        keeping their state. A collective the cell calls then fails within ``desync_after``
        seconds, saying that only those ranks run the cell. ``keep``: globals a rank binds only
        where none of its cells bound that name; ``fill``: globals a rank binds only where it
        lacks that name. ``started``: :attr:`ranks_started` when ``globals`` were chosen; should
        more have started by the time the cell may run (a recovery it waited for), it raises
        :class:`RanksRestarted` and runs nothing.

        With ``script``, the source runs as that script would under torchrun (its own
        ``__main__``, argv and directory). A syntax error or an unpicklable global fails here; a
        :class:`CheckedSource` (the session's) was checked already and is sent as it is.
        ``observer`` gets this cell's events only (on the IO thread); ``on_wait`` is called on
        the caller's thread about 20 times a second while it waits, so a view can draw output
        from the thread that owns the notebook cell. Closing the pool meanwhile ends the cell
        with a :class:`PoolError`.
        """
        if timeout is not None:
            limits.TIMEOUT.check(timeout)
        io = self._io
        if io is None or self._closing:
            raise PoolError(f"pool {self.name!r} is not running; start it first")
        cell_id = next(self._cell_ids)
        filename = filename or p.pool_cell_filename(cell_id)
        if not isinstance(source, CheckedSource):
            source = CheckedSource.check(source, filename)
        if ranks is not None:
            ranks = self.check_ranks(ranks)
        shipped = {name: pickle_global(name, value) for name, value in (globals or {}).items()}
        run_id = None
        if script is not None:  # a launch of its own, under the run id --env chose, if any
            run_id = self._ranks.settings.env.get("TORCHELASTIC_RUN_ID") or str(uuid.uuid4())
        command = p.RunCell(
            cell_id,
            source.text,
            filename,
            dict(shipped),
            script,
            run_id=run_id,
            keep=tuple(sorted(set(keep) & set(shipped))),
            fill=tuple(sorted(set(fill) & set(shipped))),
            head=ranks[0] if ranks else 0,
        )
        files = self._transfer.scan()
        if observer is not None:
            self._fanout.observers[cell_id] = observer

        def waiting() -> None:
            if on_wait is not None:
                on_wait()
            self._prompts.answer(lambda r, reply: io.call_soon(self._ranks.send, r, encode(reply)))

        try:
            return wait(
                io.submit(self._run(command, files, timeout, ranks, started)),
                self.interrupt,
                waiting,
            )
        finally:
            self._fanout.observers.pop(cell_id, None)

    def check_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """``ranks`` sorted, once each, or a :class:`PoolError` naming those this pool lacks."""
        chosen = tuple(sorted(set(ranks)))
        size = self.world_size
        missing = [r for r in chosen if not 0 <= r < size]
        if not chosen or missing:
            has = f"ranks 0-{size - 1}" if size > 1 else "rank 0 only"
            raise PoolError(
                f"--ranks {rank_span(missing) or '(none)'}: pool {self.name!r} has {has}"
            )
        return chosen

    def restart(self) -> None:
        """Fresh rank processes and worlds on the same machines (``%sky restart``): no machine
        is provisioned again, and a node's warm template forks the ranks.
        """
        if self._io is None or self._closing or self._op_lock is None:
            raise PoolError(f"pool {self.name!r} is not running")

        async def restart() -> None:
            async with self._operation():
                await self._ranks.restart_all()

        wait(self._io.submit(restart()), self.interrupt)

    def stacks(self) -> str:
        """Every rank's stacks and what it waits in (``%sky stacks``), also while a cell runs."""
        io = self._io
        if io is None or self._closing:
            raise PoolError(f"pool {self.name!r} is not running")
        answers = io.submit(doctor.stacks(self._ranks, self._ranks.all))
        try:
            return doctor.report(answers.result(timeout=doctor.STACKS_TIMEOUT + 10))
        except TimeoutError:
            raise PoolError(f"pool {self.name!r}: its IO thread did not answer") from None

    def names(
        self, ranks: Sequence[int], path: tuple[str, ...], timeout: float
    ) -> dict[int, p.Names | None]:
        """What each of ``ranks`` binds (``path``: the attributes of that object there), also
        while a cell runs; None for a rank with no answer by ``timeout``, when the caller stops
        waiting, whatever the IO thread is doing.
        """
        io = self._io
        if io is None or self._closing:
            raise PoolError(f"pool {self.name!r} is not running")
        targets = [self._ranks.all[r] for r in self.check_ranks(ranks)]
        answers = io.submit(rank_names.ask(self._ranks, targets, path, timeout))
        try:
            return answers.result(timeout=timeout)
        except TimeoutError:
            answers.cancel()
            return dict.fromkeys((r.index for r in targets), None)

    def interrupt(self) -> None:
        """Interrupt the running cell on every rank (a second call kills what is still running)."""
        if self._io is not None:
            self._io.call_soon(self._request_stop)

    def close(self, keep_files: bool = False) -> None:
        """End every rank (leaving the process group first) and release the provider's resources.
        A cell still running is ended: its ranks are killed and its ``run`` raises PoolError.
        The nodes remove their copy of the synced directories (one no other pool uses) unless
        ``keep_files``.
        """
        io, self._io = self._io, None
        if io is None:
            return
        close_at_exit(self, wanted=False)
        # A cloud provider waits for its instances to be gone: give it the time it asks for.
        release = self.provider.release_timeout
        try:
            shutdown = io.submit(self._shutdown(keep_files))
            shutdown.result(timeout=self.interrupt_grace + 30 + release)
        finally:
            io.stop(PoolError(f"pool {self.name!r} was closed before it could answer"))

    # --------------------------------------------------------------------- IO thread: events

    def _emit(self, event: PoolEvent) -> None:
        self._fanout.emit(event, self._cell.cell_id if self._cell is not None else None)

    def _rank_ended(self, rank: Rank, how: str) -> None:
        """A rank's process ended: the running cell hears of it; an idle rank is restarted
        (while starting, the start itself fails, naming the rank; while a failed cell's
        recovery goes on, that recovery fails, and the next cell says so).
        """
        if self._closing:
            self._ranks.set_state(rank, RankState.TERMINATED, how)
            return
        self._ranks.set_state(rank, RankState.LOST, how)
        if (
            self._cell is None
            and not self._still_mending()
            and self._start_task is not None
            and self._start_task.done()
        ):
            self._track(asyncio.get_running_loop().create_task(self._recover_idle(rank, how)))

    # ---------------------------------------------------------------------- IO thread: start

    async def _start(self) -> None:
        self._op_lock = asyncio.Lock()
        self.started_at = time.time()
        self._start_task = asyncio.current_task()
        await self._ranks.provision(self.requested_nodes)
        everyone = self._ranks.all
        # Beats from the first rank on: starting may take longer than a rank waits for one.
        self._monitor = asyncio.get_running_loop().create_task(doctor.heartbeats(self._ranks))
        async with self._op_lock:
            await asyncio.gather(*(self._ranks.spawn(r) for r in everyone))
            await self._ranks.await_hellos(everyone)
            await self._ranks.form_group(self._ranks.settings.frameworks.jax)

    # ---------------------------------------------------------------------- IO thread: cells

    async def _run(
        self,
        command: p.RunCell,
        files: list[Manifest],
        timeout: float | None,
        ranks: tuple[int, ...] | None,
        started: int | None,
    ) -> RunResult:
        assert self._op_lock is not None
        if self._recovering():
            self._emit(
                PoolMessage(f"the cell waits for the pool to start {self._starting()} again")
            )
        async with self._operation():
            if self._closing:
                raise PoolError(f"pool {self.name!r} was closed before the cell could run")
            if started is not None and self._ranks.started != started:
                raise RanksRestarted(f"pool {self.name!r} started ranks again before the cell ran")
            lost_before, self._lost_while_idle = self._lost_while_idle, []
            everyone = self._ranks.all
            live = [r for r in everyone if r.alive]
            if len(live) < len(everyone):
                dead = [r for r in everyone if not r.alive]
                why = f" ({self._ranks.group_problem})" if self._ranks.group_problem else ""
                raise PoolError(
                    f"pool {self.name!r} has lost {_where(dead)} and could not start "
                    f"{'them' if len(dead) > 1 else 'it'} again{why}; %sky restart once that "
                    "machine answers, or %sky down and start the pool without it"
                )
            if self._ranks.group_problem:
                raise PoolError(
                    f"pool {self.name!r} has no working process group "
                    f"({self._ranks.group_problem}); restart it (%sky restart)"
                )
            try:
                workdir = await self._transfer.workdir(files)
            finally:
                said = self._transfer.take_notes()
            command = await self._transfer.relay_globals(replace(command, workdir=workdir), live)
            running = live if ranks is None else [r for r in live if r.index in ranks]
            cell = Cell(command.cell_id, self._ranks, live, timeout, self.interrupt_grace, running)
            cell.notes.extend(said)
            self._cell, self._cell_task = cell, asyncio.current_task()
            # Encoded once, the same bytes written to each rank. The others (``--ranks``) bind
            # the globals only: the notebook's record of what the ranks hold stays true for
            # every rank, and they are idle at once.
            frame = wire.encode(command)
            chosen = set(running)  # looked up once per rank: a list would cost ranks squared
            idle = (
                frame
                if len(chosen) == len(live)
                else wire.encode(replace(command, source="", script=None))
            )
            self._ranks.set_states(running, RankState.RUNNING)
            for r in live:
                self._ranks.send(r, frame if r in chosen else idle)
            shipped = sum(v.nbytes for v in p.each_once(command.globals.values()))
            self._emit(CellStarted(command.cell_id, len(running), shipped))
            try:
                await cell.drive()
                if cell.closing:
                    raise PoolError(f"pool {self.name!r} was closed while the cell ran")
                results = cell.results()
                lost = [r.index for r in everyone if not r.alive]
                if await self._mend_after(cell) and (note := self._reformed()) is not None:
                    cell.notes.append(note)
            finally:
                self._cell = self._cell_task = None
                shipped_once = p.each_once(command.globals.values())
                relayed = [v.digest for v in shipped_once if isinstance(v, p.Relayed)]
                self._transfer.drop(relayed)
            self._ranks.set_states(
                [r for r in everyone if r.state is RankState.RUNNING], RankState.IDLE
            )
            result = RunResult(
                command.cell_id,
                results,
                shipped,
                tuple(sorted(set(lost_before + lost))),
                tuple(cell.notes),
                bound=cell.bound(),
                deleted=cell.deleted(),
                stop=cell.stop,
            )
            self._emit(CellFinished(command.cell_id, result))
            return result

    def _reformed(self) -> str | None:
        """The note that the pool formed the group the code destroyed: said once a pool."""
        if self._said_reformed:
            return None
        self._said_reformed = True
        return (
            "the code destroyed the process group; the pool formed it again "
            f"({self.group_backend}, port {self.master_port}) and does so after every cell "
            "that destroys it"
        )

    @contextlib.asynccontextmanager
    async def _operation(self) -> AsyncIterator[None]:
        """The pool's operations lock, for a cell or a restart; Ctrl-C while it waits (a
        recovery holds the lock) stops the wait, and the cell does not run.
        """
        assert self._op_lock is not None
        task = asyncio.current_task()
        assert task is not None
        self._queued.add(task)
        try:
            await self._op_lock.acquire()
        except asyncio.CancelledError as cancelled:
            if cancelled.args:  # stopped by Ctrl-C, which says what it waited for
                raise StoppedWaiting(cancelled.args[0]) from None
            raise
        finally:
            self._queued.discard(task)
        try:
            yield
        finally:
            if self._handed_over:
                self._handed_over = False  # a cell's recovery holds it on, and releases it
            else:
                self._op_lock.release()

    def _request_stop(self) -> None:
        if self._mend_wait is not None and not self._mend_wait.done():
            # The cell has ended; Ctrl-C while it waits for the pool to mend itself ends that
            # wait (the recovery goes on, and the next cell waits for it).
            self._mend_wait.set_result(None)
        elif self._cell is not None:
            self._cell.interrupt()
        elif self._queued:
            waited = (
                f"the pool to start {self._starting()} again (that goes on; the next cell "
                "waits for it)"
                if self._recovering()
                else "the pool's operation under way to end"
            )
            for task in self._queued:
                # _operation raises the words for wait() to turn into a WaitInterrupted
                task.cancel(f"stopped before it began, while it waited for {waited}")
        elif self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()  # Ctrl-C while starting: the provider cleans up

    # ----------------------------------------------------------------- IO thread: recovery

    async def _mend_after(self, cell: Cell) -> bool:
        """The cell's recovery (:meth:`Cell.recover`), waited for up to :data:`MENDING_WAIT`;
        beyond that it goes on, and the pool's next operation waits for it.
        """
        lock = self._op_lock
        assert lock is not None
        mending = self._track(asyncio.ensure_future(cell.recover()))
        self._mend_wait = stop = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait(
                [mending, stop], timeout=MENDING_WAIT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._mend_wait = None
            stop.cancel()
        if self._closing or mending.cancelled():
            mending.cancel()  # the pool goes down: nothing to mend
            return False
        if mending.done():
            return mending.result()
        cell.notes.append(
            f"the pool is still starting {self._starting()} again ({MENDING_WAIT:.0f} s so far); "
            "the next cell waits for it"
        )
        self._mending = self._track(
            asyncio.get_running_loop().create_task(self._mending_goes_on(mending, cell))
        )
        # No other operation runs between the cell and its recovery: the lock passes to it, and
        # is released as it ends, however it ends (also cancelled before it began).
        self._handed_over = True
        self._mending.add_done_callback(lambda _: lock.release())
        return False

    def _still_mending(self) -> bool:
        """Whether a failed cell's recovery goes on after its cell (:data:`MENDING_WAIT`)."""
        return self._mending is not None and not self._mending.done()

    def _recovering(self) -> bool:
        """Whether a recovery holds the pool's operations (a failed cell's, an idle rank's)."""
        return any(not recovery.done() for recovery in self._recoveries)

    def _starting(self) -> str:
        """What a recovery under way starts again, in words: the ranks not yet up (lost, or
        started but not yet said hello), else the process group.
        """
        starting = [r for r in self._ranks.all if not r.alive or r.hello is None]
        return _where(starting) if starting else "the process group"

    def _track(self, recovery: F) -> F:
        """A recovery under way, for the pool's shutdown to stop."""
        self._recoveries.add(recovery)
        recovery.add_done_callback(self._recoveries.discard)
        return recovery

    async def _mending_goes_on(self, mending: asyncio.Future[bool], cell: Cell) -> None:
        """Wait, holding the pool's operations lock (handed over by the cell), for the cell's
        recovery to end (Ctrl-C, for the user's operations, does not stop it). What it says
        meanwhile goes out as the pool's messages, as it happens.
        """
        try:
            reformed = await mending  # cancelled with it (the pool going down)
        except Exception as exc:  # a fault of the recovery's own: told, not lost
            log.error("the recovery after cell %d failed", cell.cell_id, exc_info=exc)
            self._ranks.group_problem = f"its recovery after the last failure failed: {exc!r}"
            return
        if reformed and (note := self._reformed()) is not None:
            self._emit(PoolMessage(note))

    async def _recover_idle(self, rank: Rank, how: str) -> None:
        assert self._op_lock is not None
        async with self._op_lock:
            if rank.alive or self._closing:
                return
            self._emit(PoolMessage(f"rank {rank.index} ({rank.describe()}) {how} while idle"))
            try:
                await self._ranks.restart_dead()
            except (PoolError, ProviderError) as exc:
                self._emit(PoolMessage(f"could not recover rank {rank.index}: {exc}"))
                return
            self._lost_while_idle.append(rank.index)

    async def _shutdown(self, keep_files: bool) -> None:
        self._closing = True
        if self._monitor is not None:
            self._monitor.cancel()
        recoveries = list(self._recoveries)
        for recovery in recoveries:
            recovery.cancel()  # no rank is started while the pool goes down
        if recoveries:
            await asyncio.wait(recoveries, timeout=5)
        cell_task = self._cell_task
        if self._cell is not None:
            self._cell.close()
        await self._ranks.shut_down(max(self.interrupt_grace, 5.0), keep_files)
        if cell_task is not None:
            # The cell's ranks are gone: its run ends now, with the error that says why.
            await asyncio.wait([cell_task], timeout=5)
        await self.provider.release()


def _where(ranks: Sequence[Rank]) -> str:
    """``rank 1 on HOST``, ``ranks 2-3 on HOST, HOST``: which ranks, and their machines."""
    machines = ", ".join(dict.fromkeys(r.node.address for r in ranks))
    return f"rank{'s' * (len(ranks) > 1)} {rank_span(r.index for r in ranks)} on {machines}"
