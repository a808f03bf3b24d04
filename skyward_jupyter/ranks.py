"""The ranks of a pool: their processes, the wire to each, and the process group.

Commands come down from the pool (spawn, form the group, send a frame); what the ranks say goes
up as events (the pool's ``emit``), as answers the pool waits for (:meth:`Rank.expect`), and, when
a rank's process ends, through ``on_ended``: the pool decides what a lost rank means.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from . import limits, wire
from . import protocol as p
from .environments import NodeEnvironment, Packages
from .events import (
    DisplayReceived,
    MetricsLogged,
    NodeStateChanged,
    OutputReceived,
    PoolEvent,
    PoolMessage,
    RankState,
    RankStateChanged,
    RankUsage,
)
from .flags import rank_span
from .formation import Rebuilt, check_hellos, form_worlds, nothing_to_form, reformed
from .frameworks import TORCH_ONLY, Frameworks
from .gpus import lay_out
from .launch_env import RankPlace, launcher_env
from .memory import named_kill
from .providers.base import Node, Provider, ProviderError, RankProcess, notebook_silence
from .relay_keys import RelaySecrets
from .results import PoolError, RankEnded, RankInfo

log = logging.getLogger(__name__)
A = TypeVar("A", bound=p.Answer)
ABANDON_AFTER = 1.0
"""Seconds a lost rank's machine has to answer its kill before the rank is ended here."""


@dataclass(frozen=True, slots=True)
class _Layout:
    pool: str
    """``SKYWARD_POOL``: the pool's nodes and their ranks, as JSON."""
    per_address: collections.Counter[str]
    """How many of the pool's ranks share each machine (address)."""


class Rank:
    """One rank: its process, its state, and the answers the pool waits for from it."""

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
        self._waiting: dict[tuple[type, int | str | None], asyncio.Future[Any]] = {}
        self.usage: p.Usage | None = None
        """The rank's last heartbeat: its CPU use, the collective it waits in."""
        self.silenced: str | None = None
        """Why the pool declared it lost (it stopped answering), for the loss's message."""
        self.abandoned = ""
        """The process the pool ended here without waiting for its machine (``host pid N``):
        what the loss names until the rank runs again."""
        self.reader: asyncio.Task[None] | None = None
        self.ended: RankEnded | None = None
        """How its process ended (or why it could not start), until it is started again: an
        answer asked for then never comes."""
        self.killed = False
        """The pool killed this process: its SIGKILL is the pool's, not for lack of memory."""

    async def kill(self) -> None:
        """End its process now."""
        if self.process is not None:
            self.killed = True
            await self.process.kill()

    def describe(self) -> str:
        where = self.process.describe() if self.process else self.abandoned or "not started"
        return f"node {self.node.index}, {where}"

    def info(self) -> RankInfo:
        where = self.process.describe() if self.process else ""
        return RankInfo(
            self.index,
            self.node.index,
            self.local_rank,
            self.node.address,
            self.state,
            where,
            self.hello,
        )

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def expect(self, answer: type[A], request: int | str | None = None) -> asyncio.Future[A]:
        """A future for this rank's ``answer`` to ``request`` (:func:`.protocol.request_of`).
        When the rank ends first it fails with RankEnded, which the pool reports anyway
        (``on_ended``): nobody has to be there to retrieve it.
        """
        future: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        if self.ended is not None:  # it ended before the request (a cell's files were syncing)
            future.set_exception(self.ended)
        else:
            self._waiting[answer, request] = future
        return future

    def waiting(
        self, answer: type[A], request: int | str | None = None
    ) -> asyncio.Future[A] | None:
        """The future :meth:`expect` gave for that answer, while it is not answered yet."""
        future: asyncio.Future[A] | None = self._waiting.get((answer, request))
        return future

    def resolve(self, answer: p.Answer) -> None:
        """The rank answered: the future waiting for it (if any) has its answer."""
        future = self._waiting.pop((type(answer), p.request_of(answer)), None)
        if future is not None and not future.done():
            future.set_result(answer)

    def give_up(self, answer: type[p.Answer], request: int | str | None = None) -> None:
        """No longer wait for that answer (one that comes later is dropped)."""
        self._waiting.pop((answer, request), None)

    def fail_all(self, exc: RankEnded) -> None:
        """The process ended (or could not start): every answer waited for, and every one
        asked for later, fails.
        """
        self.ended = exc
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(exc)
        self._waiting.clear()


@dataclass(frozen=True, slots=True)
class RankSettings:
    """What every rank of a pool is started with (the pool's constructor arguments)."""

    pool_name: str
    procs_per_node: int | None
    backend: str | None
    env: Mapping[str, str]
    pg_timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    desync_after: float
    start_timeout: float
    run_id: str
    relay: RelaySecrets | None = None
    """The head's relay secrets (None: no relay, for ranks on the notebook's own machine)."""
    frameworks: Frameworks = TORCH_ONLY
    secure: bool = False
    """gloo's traffic between hosts through TLS tunnels, gloo on loopback (``--secure``)."""
    gpu: str | None = None
    """``--gpu``: the model asked for (the ranks need NCCL), or ``none`` (CPU ranks)."""
    packages: Packages | None = None
    """What every node installs before its ranks start (``--pip``, ``--requirements``)."""


class Ranks:
    """Every rank of one pool; runs on the pool's IO thread."""

    def __init__(
        self,
        provider: Provider,
        settings: RankSettings,
        emit: Callable[[PoolEvent], None],
        on_ended: Callable[[Rank, str], None],
    ) -> None:
        self.provider = provider
        self.settings = settings
        provider.notebook_silence = notebook_silence(settings.heartbeat_timeout)
        provider.packages = settings.packages
        self.emit = emit
        self.on_ended = on_ended
        self.all: list[Rank] = []
        self.nodes: tuple[Node, ...] = ()
        self.environments: dict[int, NodeEnvironment] = {}
        """Each node's environment (``--pip``, ``--requirements``), by node index."""
        self.worlds_note = ""
        """What the ranks formed ("torch.distributed gloo, port 4242"), or why nothing."""
        self.group_problem: str | None = None
        """Why the process group cannot run a collective now (None: it can); a restart mends it."""
        self.group_backend: str | None = None
        self.backend: str | None = settings.backend
        """The backend the ranks are told (None: they choose), once the layout is known."""
        self.cpu_nodes: frozenset[int] = frozenset()
        """Nodes whose ranks the layout keeps off their GPUs."""
        self.master_port: int | None = None
        self._layout = _Layout("{}", collections.Counter())
        self.generation = 0
        """Formations of the worlds so far; answers from older ones are ignored."""
        self.restarts = 0
        """Formations after a failure: the ranks' ``TORCHELASTIC_RESTART_COUNT``."""
        self.started = 0
        """Rank processes started so far: each one began with an empty namespace."""
        self.beat = wire.encode(p.Beat())
        self._killing: set[asyncio.Task[None]] = set()
        """Kills of abandoned ranks' processes still waiting for their machines."""
        self.on_input: Callable[[Rank, p.InputRequest], None] = lambda rank, request: None
        """Where the head's prompts go (the pool answers them on the caller's thread)."""

    def set_state(self, rank: Rank, state: RankState, detail: str = "") -> None:
        self.set_states((rank,), state, detail)

    def set_states(self, ranks: Sequence[Rank], state: RankState, detail: str = "") -> None:
        """Ranks into ``state`` with one event (none for no ranks)."""
        for rank in ranks:
            rank.state = state
        if ranks:
            self.emit(
                RankStateChanged(tuple((r.index, r.node.index) for r in ranks), state, detail)
            )

    async def provision(self, nodes: int) -> None:
        """Get the machines and lay out one rank per GPU (or ``procs_per_node``) on each."""
        loop = asyncio.get_running_loop()

        def progress(text: str, node: int | None = None, state: RankState | None = None) -> None:
            # Providers boot machines from worker threads: events reach views from this loop.
            event = (
                PoolMessage(text)
                if node is None or state is None
                else (NodeStateChanged(node, state, text))
            )
            loop.call_soon_threadsafe(self.emit, event)

        found = await self.provider.provision(nodes, progress)
        s = self.settings
        layout = lay_out([len(n.gpus) for n in found], s.procs_per_node, s.backend, s.gpu)
        limits.check_world(
            sum(layout.ranks),
            f"{len(found)} node{'s' * (len(found) != 1)} with one rank per GPU",
        )
        self.backend, self.cpu_nodes = layout.backend, layout.cpu_nodes
        self.nodes = tuple(
            replace(n, gpus=(), gpu_type=None) if n.index in layout.cpu_nodes else n for n in found
        )
        if layout.note:
            self.provider.warnings.append(layout.note)
            progress(layout.note)
        for node, count in zip(self.nodes, layout.ranks, strict=True):
            for local in range(count):
                self.all.append(Rank(len(self.all), node, local, count))
        self._layout = self._describe_layout()
        if s.packages is not None:
            self.environments = await self.provider.build_environments(
                self.nodes, s.packages, progress
            )

    # ------------------------------------------------------------------ processes

    def _describe_layout(self) -> _Layout:
        """What every rank's environment says of the whole pool, worked out once: per rank it
        would cost a pass over every rank, hundreds of times over for a large pool.
        """
        ranks: dict[int, list[int]] = {n.index: [] for n in self.nodes}
        per_address: collections.Counter[str] = collections.Counter()
        for r in self.all:
            ranks[r.node.index].append(r.index)
            per_address[r.node.address] += 1
        nodes = [
            {
                "node": n.index,
                "addr": n.address,
                "ranks": ranks[n.index],
                "accelerators": len(n.gpus),
            }
            for n in self.nodes
        ]
        pool = {"name": self.settings.pool_name, "provider": self.provider.name, "nodes": nodes}
        return _Layout(json.dumps(pool), per_address)

    def _rank_env(self, rank: Rank) -> dict[str, str]:
        s = self.settings
        on_machine = self._layout.per_address[rank.node.address]
        agent = {
            "heartbeat_interval": s.heartbeat_interval,
            "heartbeat_timeout": notebook_silence(s.heartbeat_timeout),
            "backend": self.backend,
            "pg_timeout": s.pg_timeout,
            "secure": s.secure,
            "ranks_on_machine": on_machine,
            **(s.relay.agent_settings(rank.local_rank == 0, s.secure) if s.relay else {}),
            **s.frameworks.agent_settings(),
        }
        place = RankPlace(
            rank=rank.index,
            world_size=len(self.all),
            local_rank=rank.local_rank,
            local_world_size=rank.local_world,
            node=rank.node.index,
            nodes=len(self.nodes),
            ranks_on_machine=on_machine,
            has_gpu=bool(rank.node.gpus),
        )
        env = launcher_env(
            place,
            master_addr=self.nodes[0].address,
            run_id=s.run_id,
            user_env={**s.frameworks.rank_env(place.has_gpu, os.environ), **s.env},
            notebook_env=os.environ,
        )
        if rank.node.index in self.cpu_nodes:
            env["CUDA_VISIBLE_DEVICES"] = ""
        built = self.environments.get(rank.node.index)
        return {
            **env,
            **({"SKYWARD_SITE": built.site} if built else {}),
            "SKYWARD_POOL": self._layout.pool,
            "SKYWARD_AGENT": json.dumps(agent),
        }

    async def spawn(self, rank: Rank) -> None:
        self.set_state(rank, RankState.BOOTING)
        try:
            process = await self.provider.start_rank(rank.node, self._rank_env(rank))
        except (PoolError, ProviderError) as exc:  # its machine refused: lost, not booting
            rank.fail_all(RankEnded(f"could not be started: {exc}", ""))
            self.set_state(rank, RankState.LOST, f"could not be started: {exc}")
            raise
        rank.process, rank.alive, rank.hello, rank.killed = process, True, None, False
        self.started += 1
        rank.ended = None
        rank.usage = None  # the last process's: this one reports its own
        rank.last_heard = time.monotonic()
        rank.expect(p.Hello)
        rank.reader = asyncio.get_running_loop().create_task(self._read(rank, process))

    async def await_hellos(self, ranks: list[Rank]) -> None:
        futures = [f for r in ranks if (f := r.waiting(p.Hello)) is not None]
        try:
            hellos = asyncio.gather(*futures)
            # A cancelled wait (the pool going down) leaves the gathering's error to nobody.
            hellos.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.wait_for(hellos, self.settings.start_timeout)
        except RankEnded:
            failed = next(r for r in ranks if not r.alive)
            raise PoolError(self._start_failure(failed)) from None
        except asyncio.TimeoutError:
            slow = [r.index for r in ranks if r.hello is None]
            raise PoolError(
                f"ranks {slow} did not start within {self.settings.start_timeout:.0f} s "
                "(importing torch on a slow disk? raise start_timeout)"
            ) from None
        check_hellos(self, ranks)

    def _start_failure(self, rank: Rank) -> str:
        diagnostics = rank.process.diagnostics() if rank.process else ""
        text = f"rank {rank.index} ({rank.describe()}) failed to start"
        return f"{text}:\n{diagnostics}" if diagnostics else text

    async def restart_dead(self, after_failure: bool = True) -> list[str]:
        """Restart dead ranks and re-form the process group everywhere; say what was lost.
        Should that fail, :attr:`group_problem` says why until a restart mends it.

        ``after_failure``: the group is formed again because a cell failed (torchrun would have
        restarted its workers: ``TORCHELASTIC_RESTART_COUNT`` counts it), not because the
        cell's own code destroyed it.
        """
        try:
            return await self._restart_dead(after_failure)
        except (PoolError, ProviderError) as exc:
            self.group_problem = str(exc)
            raise

    async def _restart_dead(self, after_failure: bool) -> list[str]:
        self.restarts += after_failure
        dead = [r for r in self.all if not r.alive]
        notes = []
        jax = self.settings.frameworks.jax and bool(dead)
        if jax:
            await self._retire([r for r in self.all if r.alive])
            dead = self.all
        if dead:
            await asyncio.gather(*(self.spawn(r) for r in dead))
            await self.await_hellos(dead)
            notes.append(
                f"rank{'s' * (len(dead) > 1)} {rank_span(r.index for r in dead)} "
                f"{'were' if len(dead) > 1 else 'was'} restarted: "
                f"{'their namespaces were' if len(dead) > 1 else 'its namespace was'} lost"
                + (" (JAX's world cannot be formed again in running processes)" * jax)
            )
            self.emit(PoolMessage(notes[-1]))
        rebuilt = await self.form_group(jax)
        if self.group_backend is not None and (after_failure or rebuilt != Rebuilt()):
            notes.append(reformed(self.group_backend, self.master_port, bool(dead), rebuilt))
            self.emit(PoolMessage(notes[-1]))
        return notes

    async def shut_down(self, grace: float, keep_files: bool = False) -> None:
        """Ask every live rank to end; kill those still there after ``grace`` seconds (idle
        ranks leave the group and run their exit hooks; only stuck ones are killed).
        ``keep_files``: the nodes keep their copy of the synced directories.
        """
        live = [r for r in self.all if r.alive and r.process is not None]
        bye = wire.encode(p.Shutdown(keep_files))
        for r in live:
            self.send(r, bye)
        readers = [r.reader for r in live if r.reader is not None]
        if readers:
            _, stuck = await asyncio.wait(readers, timeout=grace)
            if stuck:
                await asyncio.gather(*(r.kill() for r in live if r.alive))
                await asyncio.wait(stuck, timeout=5)
        if self._killing:  # abandoned ranks' kills: their machines get the same time, no more
            await asyncio.wait(set(self._killing), timeout=grace)

    async def restart_all(self) -> None:
        """Every rank afresh on its node (``%sky restart``): new namespaces, new worlds."""
        await self._retire([r for r in self.all if r.alive])
        await asyncio.gather(*(self.spawn(r) for r in self.all))
        await self.await_hellos(self.all)
        await self.form_group(self.settings.frameworks.jax)

    async def _retire(self, ranks: list[Rank]) -> None:
        """End live ranks that are to be replaced (their end is no loss to report)."""
        processes = [r.process for r in ranks if r.process is not None]
        for r in ranks:
            r.process, r.alive = None, False
            r.fail_all(RankEnded("replaced", ""))
        await asyncio.gather(*(process.kill() for process in processes))

    # -------------------------------------------------------------- process group

    async def form_group(self, jax: bool = False) -> Rebuilt:
        """(Re-)form the ranks' distributed worlds (see :mod:`.formation`); ``jax``: JAX's too.
        Returns what the ranks had built on the earlier group.
        """
        skipped = nothing_to_form(self, jax)
        if skipped is not None:
            self.group_problem = None  # no group to form is no problem (a restart mended it)
            if skipped and skipped != self.worlds_note:  # said once, not again at each re-form
                self.worlds_note = skipped
                self.emit(PoolMessage(skipped))
            for r in self.all:
                self.set_state(r, RankState.READY, skipped or self.worlds_note)
            return Rebuilt()
        self.generation += 1
        formed = await form_worlds(self, self.generation, jax)
        self.group_problem = None
        if formed.port is not None:
            self.group_backend, self.master_port = formed.backend, formed.port
        self.worlds_note = formed.note
        for r in self.all:
            self.set_state(r, RankState.READY, self.worlds_note)
        return formed.rebuilt

    # ------------------------------------------------------------------- the wire

    def send(self, rank: Rank, frame: list[wire.Segment]) -> None:
        """Queue ``frame`` for ``rank``, unless its channel is gone: a rank that died (or was
        killed) is found by its reader, which reports how it ended; the sender must not raise
        a broken pipe over that cause (the process may end before its reader has seen it).
        """
        if rank.alive and rank.process is not None:
            with contextlib.suppress(ConnectionError):  # closed: _read says how it ended
                wire.write_segments(rank.process.writer, frame)

    async def abandon(self, rank: Rank) -> None:
        """End a rank declared lost: kill its process and, should its machine not answer within
        :data:`ABANDON_AFTER` (an unreachable host, whose connection takes far longer to time
        out), end it here without waiting: its cell fails now, and the kill goes on meanwhile.
        """
        process = rank.process
        if process is None:
            return
        rank.killed = True
        killing = asyncio.ensure_future(process.kill())
        self._killing.add(killing)
        killing.add_done_callback(self._killed)
        await asyncio.wait([killing], timeout=ABANDON_AFTER)
        if rank.process is not process or not rank.alive:
            return  # its end was read meanwhile, and said
        how, rank.silenced = rank.silenced or "lost", None
        rank.abandoned = process.describe()
        rank.process, rank.alive = None, False
        rank.fail_all(RankEnded(how, process.diagnostics()))
        self.on_ended(rank, how)

    def _killed(self, task: asyncio.Task[None]) -> None:
        self._killing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("killing a lost rank's process failed: %r", task.exception())

    async def _read(self, rank: Rank, process: RankProcess) -> None:
        try:
            while True:
                message = await wire.read_message(process.reader, rank.heard)
                rank.last_heard = time.monotonic()
                self._dispatch(rank, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the process ended; how it ended is read below
        except Exception as exc:  # noqa: BLE001 - an unreadable rank is reported, then killed
            log.error("rank %d sent an unreadable message (%r); killing it", rank.index, exc)
            rank.killed = True
            await process.kill()
        how = await process.wait()
        if rank.process is not process:
            return
        if not rank.killed:
            how = named_kill(how, rank.usage, self.provider.on_notebook_machine)
        if rank.silenced:
            how, rank.silenced = f"{rank.silenced} ({how})", None
        rank.alive = False
        rank.fail_all(RankEnded(how, process.diagnostics()))
        self.on_ended(rank, how)

    def _dispatch(self, rank: Rank, message: object) -> None:
        if isinstance(message, p.Output):
            self.emit(OutputReceived(rank.index, message.cell_id, message.stream, message.text))
        elif isinstance(message, p.Display):
            self.emit(
                DisplayReceived(
                    rank.index,
                    message.cell_id,
                    message.data,
                    message.metadata,
                    message.display_id,
                    message.update,
                )
            )
        elif isinstance(message, p.Metrics):
            self.emit(MetricsLogged(rank.index, message.cell_id, message.rows))
        elif isinstance(message, p.ANSWERS):
            if isinstance(message, p.Hello):
                rank.hello = message
            rank.resolve(message)
        elif isinstance(message, p.NodeUsage):
            now = time.monotonic()
            # A sample passed on waited up to an interval for the first rank's next beat: that
            # wait is not the rank's silence (its own channel would have brought it at once).
            waited = self.settings.heartbeat_interval
            for index, pid, age, usage in message.ranks:
                peer = self.all[index] if 0 <= index < len(self.all) else None
                # The node's own processes only: a replaced one's last sample is no news.
                if peer and peer.node is rank.node and peer.hello and peer.hello.pid == pid:
                    self._usage(peer, usage, now - max(age - waited, 0.0), age)
        elif isinstance(message, p.Usage):
            self._usage(rank, message, time.monotonic(), 0.0)
        elif isinstance(message, p.InputRequest):
            self.on_input(rank, message)

    def _usage(self, rank: Rank, usage: p.Usage, heard: float, age: float) -> None:
        """A rank's usage sample, taken ``age`` seconds ago; the rank counts as heard at
        ``heard`` (monotonic).
        """
        rank.usage = usage
        rank.last_heard = max(rank.last_heard, heard)
        self.emit(
            RankUsage(
                rank.index,
                rank.node.index,
                usage.cpu_percent,
                usage.rss_bytes,
                usage.gpu_memory_bytes,
                usage.gpu_utilization,
                time.time() - age,
                usage.waiting,
                usage.waited,
            )
        )
