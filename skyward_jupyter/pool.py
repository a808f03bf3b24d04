"""A pool of ranks: start them, run a cell on every one, keep the pool usable when ranks fail.

The pool owns an asyncio loop on its own thread; all IO (the wire to every rank, heartbeats,
failure handling) happens there, and the blocking API below hands work to it. The caller's
thread is never blocked in IO, only in waiting for a result, and a KeyboardInterrupt while it
waits reaches every rank.

Failure policy for a cell (the peers' main complaint is ranks that hang for minutes):

1. the first rank that fails (raises, or dies) makes the pool interrupt the ranks still running
   (SIGINT to their main thread) and tell the failed ranks to leave the process group, which
   makes a peer blocked in a collective with them fail at once instead of at the timeout;
2. ranks still running after ``interrupt_grace`` seconds are killed;
3. when ranks had to be stopped or died, dead ranks are restarted and the process group is
   re-formed on every rank with a fresh port, so the next cell finds the same world (ranks
   stopped part-way may disagree on how many collectives ran). The result says whose namespace
   was lost; objects holding the old group (a DDP-wrapped model) must be wrapped again. A cell
   that simply raised on every rank leaves the group as it was;
4. the result marks the failures that followed from another as secondary. When a rank's process
   ended on its own during the cell (not killed by the pool), the first such death the pool saw
   is the cause and every other failure is secondary, even a peer's error that reached the pool
   first: a dead rank breaks every collective. Otherwise the first rank that failed is the
   cause, and ranks stopped by the pool whose agent saw the interrupt before failing are
   secondary.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import protocol as p
from . import wire
from .events import (
    CellFinished,
    CellStarted,
    MetricsLogged,
    NodeStateChanged,
    OutputReceived,
    PoolEvent,
    PoolMessage,
    RankState,
    RankStateChanged,
    RankUsage,
)
from .launch_env import RankPlace, launcher_env
from .providers.base import Node, Provider, ProviderError, RankProcess
from .results import CellInterrupted, PoolError, RankResult, RemoteError, RunResult

T = TypeVar("T")
Subscriber = Callable[[PoolEvent], None]
log = logging.getLogger(__name__)

_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()
_WAIT_TICK = 0.05


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()


class _RankEnded(Exception):
    """A rank's process ended (or stopped answering) while the pool waited for it."""

    def __init__(self, how: str, diagnostics: str) -> None:
        super().__init__(how)
        self.how = how
        self.diagnostics = diagnostics


class _IOThread:
    """An asyncio loop running on a daemon thread, fed from the caller's thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(frozen=True, slots=True)
class RankInfo:
    """A read-only view of one rank, for status displays."""

    rank: int
    node: int
    local_rank: int
    address: str
    state: RankState
    process: str
    hello: p.Hello | None


class _Rank:
    def __init__(self, index: int, node: Node, local_rank: int, local_world: int) -> None:
        self.index = index
        self.node = node
        self.local_rank = local_rank
        self.local_world = local_world
        self.process: RankProcess | None = None
        self.state = RankState.PROVISIONING
        self.hello: p.Hello | None = None
        self.alive = False
        self.last_heard = 0.0
        self.waiters: dict[str, asyncio.Future[Any]] = {}
        self.reader: asyncio.Task[None] | None = None

    def describe(self) -> str:
        where = self.process.describe() if self.process else "not started"
        return f"node {self.node.index}, {where}"

    def expect(self, key: str) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters[key] = future
        return future

    def resolve(self, key: str, value: object) -> None:
        future = self.waiters.pop(key, None)
        if future is not None and not future.done():
            future.set_result(value)

    def fail_all(self, exc: BaseException) -> None:
        for future in self.waiters.values():
            if not future.done():
                future.set_exception(exc)
        self.waiters.clear()


@dataclass
class _Cell:
    """The bookkeeping of one running cell, for the failure policy."""

    cell_id: int
    futures: dict[_Rank, asyncio.Future[p.CellDone]]
    deadline: float | None
    timeout: float | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: dict[_Rank, p.CellDone | BaseException] = field(default_factory=dict)
    first_failure: _Rank | None = None
    first_death: _Rank | None = None
    """The first rank whose process ended on its own: the cause, whatever reached the pool first."""
    stop_at: float | None = None
    kill_now: bool = False
    asked_to_stop: set[_Rank] = field(default_factory=set)
    killed: set[_Rank] = field(default_factory=set)
    """Ranks the pool killed itself: their deaths are its doing, never a cause."""
    left_group: set[_Rank] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


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
        pg_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 30.0,
        interrupt_grace: float = 3.0,
        start_timeout: float = 180.0,
    ) -> None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a whole number of at least 1, got {nodes!r}")
        if procs_per_node is not None and (
            not isinstance(procs_per_node, int) or procs_per_node < 1
        ):
            raise ValueError(f"procs_per_node must be at least 1, got {procs_per_node!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if provider is None:
            from .providers.local import LocalProvider

            provider = LocalProvider()
        self.name = name
        self.provider: Provider = provider
        self.requested_nodes = nodes
        self.procs_per_node = procs_per_node
        self.backend = backend
        self.env = dict(env or {})
        self.pg_timeout = pg_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.interrupt_grace = interrupt_grace
        self.start_timeout = start_timeout
        self.nodes: tuple[Node, ...] = ()
        self.started_at: float | None = None
        self.torch_note: str | None = None
        self.group_problem: str | None = None
        """Why the process group cannot run a collective now (None: it can); a restart mends it."""
        self.group_backend: str | None = None
        self.master_port: int | None = None
        self._ranks: list[_Rank] = []
        self._subscribers: list[Subscriber] = []
        self._observers: dict[int, Subscriber] = {}
        self._io: _IOThread | None = None
        self._op_lock: asyncio.Lock | None = None
        self._cell: _Cell | None = None
        self._cell_ids = itertools.count(1)
        self._generation = 0
        self._closing = False
        self._lost_while_idle: list[int] = []
        self._monitor: asyncio.Task[None] | None = None
        self._start_task: asyncio.Task[Any] | None = None
        self._beat = wire.encode(p.Beat())
        self._said_reformed = False
        self.run_id = str(uuid.uuid4())
        """The pool's ``TORCHELASTIC_RUN_ID``: one id for the pool's life, as for one torchrun."""

    # ------------------------------------------------------------------------- blocking API

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return tuple(
            RankInfo(
                r.index,
                r.node.index,
                r.local_rank,
                r.node.address,
                r.state,
                r.process.describe() if r.process else "",
                r.hello,
            )
            for r in self._ranks
        )

    @property
    def running(self) -> bool:
        return self._io is not None and not self._closing

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` with every event, on the pool's IO thread; returns an unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def start(self, on_wait: Callable[[], None] | None = None) -> Pool:
        """Start every rank and form the process group; blocks until the pool is ready.

        ``on_wait`` is called on the caller's thread while it waits (a view showing the boot).
        """
        if self._io is not None:
            return self
        self._io = _IOThread(f"skyward-pool-{self.name}")
        _live_pools.add(self)
        try:
            self._wait(self._io.submit(self._start()), on_wait)
        except BaseException:
            self.close()
            raise
        return self

    def run(
        self,
        source: str,
        globals: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        filename: str | None = None,
        script: p.Script | None = None,
        observer: Subscriber | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> RunResult:
        """Run ``source`` on every rank with ``globals`` bound first; one result per rank.

        With ``script``, the source runs as that script would under torchrun (its own
        ``__main__``, argv and directory) and the ranks' namespaces are left as they were.
        A syntax error or a global that cannot be pickled fails here, before anything is sent.
        ``observer`` gets this cell's events only (on the IO thread); ``on_wait`` is called on
        the caller's thread about 20 times a second while it waits, so a view can draw output
        from the thread that owns the notebook cell.
        """
        if self._io is None or self._closing:
            raise PoolError(f"pool {self.name!r} is not running; start it first")
        cell_id = next(self._cell_ids)
        filename = filename or f"<sky-cell-{cell_id}>"
        compile(source, filename, "exec")
        shipped = {name: _pickle_global(name, value) for name, value in (globals or {}).items()}
        command = p.RunCell(cell_id, source, filename, shipped, script)
        if observer is not None:
            self._observers[cell_id] = observer
        try:
            return self._wait(self._io.submit(self._run(command, timeout)), on_wait)
        finally:
            self._observers.pop(cell_id, None)

    def interrupt(self) -> None:
        """Interrupt the running cell on every rank (a second call kills what is still running)."""
        if self._io is not None:
            self._io.call_soon(self._request_stop)

    def close(self) -> None:
        """End every rank (leaving the process group first) and release the provider's resources."""
        io, self._io = self._io, None
        if io is None:
            return
        _live_pools.discard(self)
        # A cloud provider waits for its instances to be gone: give it the time it asks for.
        release = float(getattr(self.provider, "release_timeout", 0.0))
        try:
            io.submit(self._shutdown()).result(timeout=self.interrupt_grace + 30 + release)
        finally:
            io.stop()

    def _wait(
        self, future: concurrent.futures.Future[T], on_wait: Callable[[], None] | None = None
    ) -> T:
        """Wait for the IO thread; Ctrl-C interrupts the ranks, a second one kills them.

        After Ctrl-C the wait goes on until the ranks have stopped; a cell then raises
        :class:`CellInterrupted` (a KeyboardInterrupt) carrying how each rank ended.
        """

        def settle() -> T:
            while True:
                try:
                    return future.result(timeout=_WAIT_TICK if on_wait else None)
                except concurrent.futures.TimeoutError:
                    assert on_wait is not None
                    on_wait()

        try:
            return settle()
        except KeyboardInterrupt:
            self.interrupt()
            try:
                outcome = settle()
            except KeyboardInterrupt:
                self.interrupt()
                outcome = settle()
            except concurrent.futures.CancelledError:
                raise KeyboardInterrupt from None  # the start was cancelled by this Ctrl-C
            if isinstance(outcome, RunResult):
                raise CellInterrupted(outcome) from None
            raise

    # ---------------------------------------------------------------------- IO thread: start

    def _emit(self, event: PoolEvent) -> None:
        cell_id = getattr(event, "cell_id", None)
        if cell_id is None and self._cell is not None and isinstance(event, RankStateChanged):
            cell_id = self._cell.cell_id
        observer = self._observers.get(cell_id) if cell_id is not None else None
        callbacks = [*self._subscribers, *([observer] if observer else [])]
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("a pool event subscriber failed on %r", event)

    def _set_state(self, rank: _Rank, state: RankState, detail: str = "") -> None:
        rank.state = state
        self._emit(RankStateChanged(rank.index, rank.node.index, state, detail))

    async def _start(self) -> None:
        self._op_lock = asyncio.Lock()
        self.started_at = time.time()
        self._start_task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def progress(text: str, node: int | None = None, state: RankState | None = None) -> None:
            # Providers boot machines from worker threads: events reach views from this loop.
            event = (
                PoolMessage(text)
                if node is None or state is None
                else (NodeStateChanged(node, state, text))
            )
            loop.call_soon_threadsafe(self._emit, event)

        self.nodes = tuple(await self.provider.provision(self.requested_nodes, progress))
        for node in self.nodes:
            per_node = self.procs_per_node or len(node.gpus) or 1
            for local in range(per_node):
                self._ranks.append(_Rank(len(self._ranks), node, local, per_node))
        async with self._op_lock:
            await asyncio.gather(*(self._spawn(r) for r in self._ranks))
            await self._await_hellos(self._ranks)
            await self._form_group()
        self._monitor = asyncio.get_running_loop().create_task(self._heartbeats())

    def _pool_description(self) -> str:
        nodes = [
            {
                "node": n.index,
                "addr": n.address,
                "ranks": [r.index for r in self._ranks if r.node is n],
                "accelerators": len(n.gpus),
            }
            for n in self.nodes
        ]
        return json.dumps({"name": self.name, "provider": self.provider.name, "nodes": nodes})

    def _rank_env(self, rank: _Rank) -> dict[str, str]:
        settings = {
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.heartbeat_timeout,
            "backend": self.backend,
            "pg_timeout": self.pg_timeout,
        }
        place = RankPlace(
            rank=rank.index,
            world_size=len(self._ranks),
            local_rank=rank.local_rank,
            local_world_size=rank.local_world,
            node=rank.node.index,
            nodes=len(self.nodes),
            ranks_on_machine=sum(r.node.address == rank.node.address for r in self._ranks),
            has_gpu=bool(rank.node.gpus),
        )
        env = launcher_env(
            place,
            master_addr=self.nodes[0].address,
            run_id=self.run_id,
            user_env=self.env,
            notebook_env=os.environ,
        )
        return {
            **env,
            "SKYWARD_POOL": self._pool_description(),
            "SKYWARD_AGENT": json.dumps(settings),
        }

    async def _spawn(self, rank: _Rank) -> None:
        self._set_state(rank, RankState.BOOTING)
        process = await self.provider.start_rank(rank.node, self._rank_env(rank))
        rank.process, rank.alive, rank.hello = process, True, None
        rank.last_heard = time.monotonic()
        rank.expect("hello")
        rank.reader = asyncio.get_running_loop().create_task(self._read(rank, process))

    async def _await_hellos(self, ranks: list[_Rank]) -> None:
        futures = [r.waiters["hello"] for r in ranks if "hello" in r.waiters]
        try:
            await asyncio.wait_for(asyncio.gather(*futures), self.start_timeout)
        except _RankEnded:
            failed = next(r for r in ranks if not r.alive)
            raise PoolError(self._start_failure(failed)) from None
        except asyncio.TimeoutError:
            slow = [r.index for r in ranks if r.hello is None]
            raise PoolError(
                f"ranks {slow} did not start within {self.start_timeout:.0f} s "
                "(importing torch on a slow disk? raise start_timeout)"
            ) from None
        missing = [r for r in ranks if r.hello is not None and r.hello.torch is None]
        if missing and len(missing) < len(self._ranks):
            where = ", ".join(f"rank {r.index} ({r.describe()})" for r in missing)
            have = next(r.hello.torch for r in self._ranks if r.hello and r.hello.torch)
            raise PoolError(
                f"torch is missing on {where}; the other ranks have torch {have}: install it there"
            )

    def _start_failure(self, rank: _Rank) -> str:
        diagnostics = rank.process.diagnostics() if rank.process else ""
        text = f"rank {rank.index} ({rank.describe()}) failed to start"
        return f"{text}:\n{diagnostics}" if diagnostics else text

    async def _form_group(self) -> None:
        """(Re-)form torch.distributed everywhere: the head hosts the store, then the rest join."""
        if all(r.hello is not None and r.hello.torch is None for r in self._ranks):
            self.torch_note = "torch is not installed on the ranks: torch.distributed setup skipped"
            self._emit(PoolMessage(self.torch_note))
            for r in self._ranks:
                self._set_state(r, RankState.READY, self.torch_note)
            return
        self._generation += 1
        generation = self._generation
        head, others = self._ranks[0], self._ranks[1:]
        for r in self._ranks:
            self._set_state(r, RankState.CONNECTING)
        states = {r: r.expect("group") for r in self._ranks}
        port_future = head.expect("port")
        self._send(head, wire.encode(p.FormGroup(generation, None)))
        try:
            await asyncio.wait(
                [port_future, states[head]],
                timeout=self.pg_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not port_future.done():
                state = states[head].result() if states[head].done() else None
                reason = state.message if state else "no answer"
                raise PoolError(
                    f"rank 0 ({head.describe()}) could not host the rendezvous: {reason}"
                )
            port = port_future.result()
            frame = wire.encode(p.FormGroup(generation, port))
            for r in others:
                self._send(r, frame)
            results = await asyncio.wait_for(asyncio.gather(*states.values()), self.pg_timeout + 10)
        except _RankEnded as exc:
            raise PoolError(f"a rank ended while the process group formed: {exc.how}") from None
        except asyncio.TimeoutError:
            raise PoolError(
                f"the process group did not form within {self.pg_timeout:.0f} s"
            ) from None
        failed = [(r, s) for r, s in zip(self._ranks, results, strict=True) if not s.ok]
        if failed:
            r, s = failed[0]
            raise PoolError(
                f"rank {r.index} ({r.describe()}) could not join the process group: {s.message}"
            )
        self.group_backend = results[0].backend
        self.group_problem = None
        self.master_port = port
        for r in self._ranks:
            self._set_state(r, RankState.READY, f"{self.group_backend}, port {port}")

    # ---------------------------------------------------------------- IO thread: the wire

    def _send(self, rank: _Rank, frame: list[wire.Segment]) -> None:
        if rank.alive and rank.process is not None:
            wire.write_segments(rank.process.writer, frame)

    async def _read(self, rank: _Rank, process: RankProcess) -> None:
        try:
            while True:
                message = await wire.read_message(process.reader)
                rank.last_heard = time.monotonic()
                self._dispatch(rank, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the process ended; how it ended is read below
        except Exception as exc:  # noqa: BLE001 - an unreadable rank is reported, then killed
            log.error("rank %d sent an unreadable message (%r); killing it", rank.index, exc)
            await process.kill()
        how = await process.wait()
        if rank.process is not process:
            return
        rank.alive = False
        rank.fail_all(_RankEnded(how, process.diagnostics()))
        if self._closing:
            self._set_state(rank, RankState.TERMINATED, how)
            return
        self._set_state(rank, RankState.LOST, how)
        if self._cell is None:
            asyncio.get_running_loop().create_task(self._recover_idle(rank, how))

    def _dispatch(self, rank: _Rank, message: object) -> None:
        if isinstance(message, p.Output):
            self._emit(OutputReceived(rank.index, message.cell_id, message.stream, message.text))
        elif isinstance(message, p.Metrics):
            self._emit(MetricsLogged(rank.index, message.cell_id, message.rows))
        elif isinstance(message, p.CellDone):
            rank.resolve("cell", message)
        elif isinstance(message, p.Usage):
            self._emit(
                RankUsage(
                    rank.index,
                    rank.node.index,
                    message.cpu_percent,
                    message.rss_bytes,
                    message.gpu_memory_bytes,
                    message.gpu_utilization,
                    time.time(),
                )
            )
        elif isinstance(message, p.Hello):
            rank.hello = message
            rank.resolve("hello", message)
        elif isinstance(message, p.GroupPort) and message.generation == self._generation:
            rank.resolve("port", message.port)
        elif isinstance(message, p.GroupState) and message.generation == self._generation:
            rank.resolve("group", message)

    async def _heartbeats(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            for r in self._ranks:
                if not r.alive or r.process is None:
                    continue
                self._send(r, self._beat)
                if now - r.last_heard > self.heartbeat_timeout:
                    self._set_state(r, RankState.LOST, f"silent for {self.heartbeat_timeout:.0f} s")
                    await r.process.kill()

    # ----------------------------------------------------------------- IO thread: cells

    async def _run(self, command: p.RunCell, timeout: float | None) -> RunResult:
        assert self._op_lock is not None
        async with self._op_lock:
            lost_before, self._lost_while_idle = self._lost_while_idle, []
            live = [r for r in self._ranks if r.alive]
            if len(live) < len(self._ranks):
                raise PoolError(
                    f"pool {self.name!r} has lost ranks it could not restart; restart it"
                )
            if self.group_problem:
                raise PoolError(
                    f"pool {self.name!r} has no working process group ({self.group_problem}); "
                    "restart it (%sky restart)"
                )
            deadline = time.monotonic() + timeout if timeout else None
            cell = _Cell(command.cell_id, {r: r.expect("cell") for r in live}, deadline, timeout)
            self._cell = cell
            frame = wire.encode(command)
            for r in live:
                self._set_state(r, RankState.RUNNING)
                self._send(r, frame)
            shipped = sum(v.nbytes for v in command.globals.values())
            self._emit(CellStarted(command.cell_id, len(live), shipped))
            try:
                await self._drive(cell)
                results = self._results(cell)
                lost = [r.index for r in self._ranks if not r.alive]
                done = [o for o in cell.outcomes.values() if isinstance(o, p.CellDone)]
                cell.notes.extend(dict.fromkeys(n for o in done for n in o.notes))
                destroyed = any(o.group_destroyed for o in done)
                if cell.asked_to_stop or cell.left_group or lost or destroyed:
                    # Ranks stopped part-way may disagree on how many collectives ran; a group
                    # the cell destroyed is formed again before the next cell needs it.
                    try:
                        cell.notes.extend(await self._recover())
                    except (PoolError, ProviderError) as exc:
                        # The cell's own result still matters most; the next cell says more.
                        cell.notes.append(f"the pool could not recover: {exc}")
                        self.group_problem = str(exc)
                        self._emit(PoolMessage(cell.notes[-1]))
                    else:
                        if destroyed and not self._said_reformed:
                            self._said_reformed = True
                            cell.notes.append(
                                "the code destroyed the process group; the pool formed it again "
                                f"({self.group_backend}, port {self.master_port}) and does so "
                                "after every cell that destroys it"
                            )
            finally:
                self._cell = None
            for r in self._ranks:
                if r.state is RankState.RUNNING:
                    self._set_state(r, RankState.IDLE)
            bound = frozenset(
                name
                for outcome in cell.outcomes.values()
                if isinstance(outcome, p.CellDone)
                for name in outcome.bound
            )
            result = RunResult(
                command.cell_id,
                results,
                shipped,
                tuple(sorted(set(lost_before + lost))),
                tuple(cell.notes),
                bound=bound,
            )
            self._emit(CellFinished(command.cell_id, result))
            return result

    def _request_stop(self) -> None:
        cell = self._cell
        if cell is None:
            if self._start_task is not None and not self._start_task.done():
                self._start_task.cancel()  # Ctrl-C while starting: the provider cleans up
            return
        if cell.stop_at is None:
            cell.notes.append("interrupted")
            self._stop(cell)
        else:
            cell.kill_now = True
        cell.wake.set()

    def _stop(self, cell: _Cell) -> None:
        """Interrupt the ranks still running; make failed ranks leave the group to free peers."""
        cell.stop_at = time.monotonic() + self.interrupt_grace
        interrupt = wire.encode(p.Interrupt())
        for r, future in cell.futures.items():
            if not future.done():
                cell.asked_to_stop.add(r)
                self._send(r, interrupt)
        for r, outcome in cell.outcomes.items():
            if isinstance(outcome, p.CellDone) and outcome.error is not None:
                self._leave(cell, r)

    def _leave(self, cell: _Cell, rank: _Rank) -> None:
        """Make a failed rank leave the group while peers may still wait in a collective with it."""
        if any(not f.done() for f in cell.futures.values()):
            cell.left_group.add(rank)
            self._send(rank, wire.encode(p.LeaveGroup()))

    async def _drive(self, cell: _Cell) -> None:
        pending = dict(cell.futures)
        while pending:
            now = time.monotonic()
            limits = [t - now for t in (cell.stop_at, cell.deadline) if t is not None]
            waker: asyncio.Future[Any] = asyncio.ensure_future(cell.wake.wait())
            await asyncio.wait(
                [*pending.values(), waker],
                timeout=max(0.0, min(limits)) if limits else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            waker.cancel()
            cell.wake.clear()
            for r, future in list(pending.items()):
                if not future.done():
                    continue
                del pending[r]
                outcome: p.CellDone | BaseException = future.exception() or future.result()
                cell.outcomes[r] = outcome
                failed = isinstance(outcome, BaseException) or outcome.error is not None
                if not failed:
                    self._set_state(r, RankState.IDLE)
                    continue
                self._set_state(r, RankState.FAILED if r.alive else RankState.LOST)
                # A rank the pool killed (stuck after the interrupt, or at shutdown) is no cause.
                ended_on_its_own = (
                    isinstance(outcome, _RankEnded) and r not in cell.killed and not self._closing
                )
                if ended_on_its_own and cell.first_death is None:
                    cell.first_death = r
                if cell.first_failure is None and cell.stop_at is None:
                    cell.first_failure = r
                    self._stop(cell)
                elif isinstance(outcome, p.CellDone):
                    self._leave(cell, r)
            now = time.monotonic()
            if cell.deadline is not None and now >= cell.deadline and cell.stop_at is None:
                cell.notes.append(f"timed out after {cell.timeout} s")
                self._stop(cell)
            if pending and (cell.kill_now or (cell.stop_at is not None and now >= cell.stop_at)):
                await self._kill_stuck(cell, pending)

    async def _kill_stuck(
        self, cell: _Cell, pending: dict[_Rank, asyncio.Future[p.CellDone]]
    ) -> None:
        stuck = [r for r in pending if r.process is not None]
        cell.notes.append(
            f"ranks {[r.index for r in stuck]} did not stop within {self.interrupt_grace:.0f} s "
            "of the interrupt and were killed"
        )
        cell.asked_to_stop.update(stuck)
        cell.killed.update(stuck)
        await asyncio.gather(*(r.process.kill() for r in stuck if r.process is not None))

    def _results(self, cell: _Cell) -> tuple[RankResult, ...]:
        """Every rank's result, the failures that followed from another's marked secondary.

        A rank that died on its own is the cause even when a peer's error reached the pool
        first: a dead rank breaks every collective its peers wait in, and their errors often
        arrive before the pool learns of the death.
        """
        cause = cell.first_death or cell.first_failure
        out = []
        for r in self._ranks:
            outcome = cell.outcomes.get(r)
            secondary = r is not cause and (
                cell.first_death is not None or (r in cell.asked_to_stop and _consequence(outcome))
            )
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
                how = outcome.how if isinstance(outcome, _RankEnded) else repr(outcome)
                diag = outcome.diagnostics if isinstance(outcome, _RankEnded) else ""
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

    # ------------------------------------------------------------- IO thread: recovery

    async def _recover(self) -> list[str]:
        """Restart dead ranks and re-form the process group everywhere; say what was lost."""
        dead = [r for r in self._ranks if not r.alive]
        notes = []
        if dead:
            await asyncio.gather(*(self._spawn(r) for r in dead))
            await self._await_hellos(dead)
            notes.append(
                f"ranks {[r.index for r in dead]} were restarted: their namespaces were lost"
            )
            self._emit(PoolMessage(notes[-1]))
        await self._form_group()
        return notes

    async def _recover_idle(self, rank: _Rank, how: str) -> None:
        assert self._op_lock is not None
        async with self._op_lock:
            if rank.alive or self._closing:
                return
            self._emit(PoolMessage(f"rank {rank.index} ({rank.describe()}) {how} while idle"))
            try:
                await self._recover()
            except PoolError as exc:
                self._emit(PoolMessage(f"could not recover rank {rank.index}: {exc}"))
                self.group_problem = str(exc)
                return
            self._lost_while_idle.append(rank.index)

    async def _shutdown(self) -> None:
        self._closing = True
        if self._monitor is not None:
            self._monitor.cancel()
        if self._cell is not None:
            self._cell.kill_now = True
            self._cell.wake.set()
        bye = wire.encode(p.Shutdown())
        live = [r for r in self._ranks if r.alive and r.process is not None]
        for r in live:
            self._send(r, bye)
        readers = [r.reader for r in live if r.reader is not None]
        if readers:
            # Idle ranks leave the group and run their exit hooks; only stuck ones are killed.
            _, stuck = await asyncio.wait(readers, timeout=max(self.interrupt_grace, 5.0))
            if stuck:
                await asyncio.gather(*(r.process.kill() for r in live if r.alive and r.process))
                await asyncio.wait(stuck, timeout=5)
        await self.provider.release()


def _consequence(outcome: p.CellDone | BaseException | None) -> bool:
    """Whether a stopped rank's failure came from the stop (its agent saw the interrupt first)."""
    if not isinstance(outcome, p.CellDone) or outcome.error is None:
        return True  # killed, or lost
    return outcome.error.after_interrupt


def _pickle_global(name: str, value: Any) -> p.Pickled:
    if isinstance(value, p.Pickled):
        return value
    try:
        return p.Pickled.dump(value)
    except Exception as exc:
        raise PoolError(
            f"global {name!r} ({type(value).__name__}) cannot be sent to the ranks: {exc}"
        ) from exc


def _remote_error(rank: _Rank, info: p.ErrorInfo, secondary: bool) -> RemoteError:
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
