"""The embedded default: every node is simulated on this machine, every rank a spawned process.

Ranks are never forked from the notebook, so the kernel's state (CUDA included) cannot leak into
them. They come from a warm template process (:mod:`skyward_jupyter.agent.template`) that has
imported torch once, so a pool starts, and a failed rank restarts, without paying torch's import
again; when the template cannot serve a rank (its environment changes what torch reads at import)
the rank is spawned cold with ``python -m skyward_jupyter.agent``. Either way each rank gets its
own session, so the kernel's Ctrl-C reaches it only through the pool, which decides how to
escalate.

The machine's GPUs are split evenly across the simulated nodes; each node sees only its own
through ``CUDA_VISIBLE_DEVICES``, as a real separate machine would. GPUs an even split leaves
over stay unused; with fewer GPUs than nodes the nodes get none (their ranks see no GPU and use
gloo), and ``--gpu none`` gives a CPU pool on purpose. All the ranks share this machine (the
pool's torchrun environment then gives each one OpenMP thread, see ``launch_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..agent import environments as node_environments
from ..agent.descendants import end_rank, pool_dir, read_stat
from ..agent.torch_setup import nccl_available
from ..environments import (
    BUILDER,
    NodeEnvironment,
    Packages,
    notebook_uv,
    run_builder,
    wheels_root,
)
from ..events import RankState
from ..gpus import NO_GPU, LayoutError, check_gpu_layout, gpu_model, same_gpu
from ..memory import meminfo
from ..procs import end, how_it_ran, is_agent, process_alive, process_start
from ..spec import backend_problem
from ..workdir import human_bytes
from .base import Node, Progress, Provider, ProviderError, ReapReport, StderrTail, no_progress
from .local_template import (
    Template,
    base_env,
    differs_at_import,
    shutdown_template,
    template,
    template_pids,
)

if TYPE_CHECKING:
    from ..spec import PoolSpec

__all__ = [
    "LocalProvider",
    "check_gpus",
    "shutdown_template",
    "split_gpus",
    "template_pids",
]

RANK_FOOTPRINT = 32 << 20
"""About what one rank forked from the warm template takes of this machine's memory at start
(its own pages; torch's, shared with the template, aside; measured in BENCHMARKS.md, "Scale"),
with room to spare: a local pool that could never fit is refused up front."""
_PIPE_BYTES = 1 << 20


def visible_gpus() -> tuple[tuple[str, ...], str | None]:
    """GPU ids this process may use, and their model, without initialising CUDA here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    name: str | None = None
    ids: tuple[str, ...] = ()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            out = ""
        rows = [line.split(",", 1) for line in out.splitlines() if "," in line]
        ids = tuple(r[0].strip() for r in rows)
        name = rows[0][1].strip() if rows else None
    if env is not None:
        ids = tuple(x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1")
    return ids, name


def split_gpus(gpus: tuple[str, ...], nodes: int) -> tuple[list[tuple[str, ...]], str]:
    """Split ``gpus`` evenly across ``nodes``, and the line that says what an uneven split
    left out ("" when nothing): the GPUs over stay unused, and fewer GPUs than nodes give
    every node none.
    """
    per = len(gpus) // nodes
    shares = [gpus[i * per : (i + 1) * per] for i in range(nodes)]
    if not gpus or len(gpus) % nodes == 0:
        return shares, ""
    count = f"{len(gpus)} GPU{'s' * (len(gpus) != 1)}"
    if not per:
        return shares, (
            f"{count} cannot be split across {nodes} local nodes: the ranks run on CPUs (no GPU "
            f"visible) with gloo; --nodes {len(gpus)} gives each node a GPU"
        )
    unused = ",".join(gpus[per * nodes :])
    return shares, (
        f"{count} over {nodes} local nodes: {per} each, GPU {unused} unused; "
        f"a number of --nodes that divides {len(gpus)} uses them all"
    )


def check_gpus(spec: PoolSpec, ids: tuple[str, ...], model: str | None) -> None:
    """Whether this machine's GPUs (``ids``, of ``model``) carry the pool ``spec`` describes:
    ``--gpu`` names their model, and NCCL (``--backend nccl``, or ``--gpu``) gets a GPU for each
    rank of every node; raises ProviderError (a LayoutError for the layout) saying what to do.
    """
    if spec.gpu and spec.gpu != NO_GPU and not ids:
        raise ProviderError(
            f"--gpu {spec.gpu}: this machine has no GPU, and the local provider runs "
            "on this machine; leave out --gpu to train on CPUs"
        )
    if spec.gpu and spec.gpu != NO_GPU and model and not same_gpu(spec.gpu, model):
        raise ProviderError(
            f"--gpu {spec.gpu}: this machine's GPUs are {model}; pass --gpu {gpu_model(model)}"
            " or leave out --gpu"
        )
    shares, _ = split_gpus(ids, spec.nodes)
    nccl = spec.backend == "nccl" or (spec.gpu not in (None, NO_GPU) and spec.backend is None)
    if nccl and ids and not shares[0]:
        why = "--backend nccl" if spec.backend == "nccl" else f"--gpu {spec.gpu}"
        raise LayoutError(
            f"{why}: this machine's {len(ids)} GPU{'s' * (len(ids) != 1)} cannot give each "
            f"of {spec.nodes} local nodes one (NCCL needs a GPU for each rank); use "
            f"--nodes {len(ids)}, or --backend gloo for ranks on CPUs"
        )
    check_gpu_layout(
        [len(s) for s in shares], spec.procs_per_node, spec.backend, spec.gpu, "local node"
    )


# ----------------------------------------------------------------------------------- ranks


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


def _pipe(size: int = _PIPE_BYTES) -> tuple[int, int]:
    """A pipe with a large kernel buffer (fewer wake-ups per large frame), where Linux allows."""
    read_end, write_end = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: keep the default
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, size)
    return read_end, write_end


class PipeWriter:
    """Writes frames to a rank's pipe straight from their buffers: at once what the pipe takes,
    the rest from a thread of its own.

    asyncio's pipe transport copies whatever the pipe does not take at once into its own buffer
    (a 100 MB global, once per rank) and re-copies it as it drains; the writer thread sends the
    caller's memory as it is. A small frame (a cell, a heartbeat) usually fits in the pipe and is
    written by the caller, without waking the thread: on a busy machine that hand-off cost more
    than the write, for every rank and every cell. Frames stay whole and in order: the caller
    writes only while the thread has nothing queued or in hand.
    """

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = True
        """Nothing queued or being written by the thread: the caller may write directly."""
        self._broken = False
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            if self._broken or self._closed:
                return
            if self._idle:
                try:
                    view = view[os.write(self._fd, view) :]
                except BlockingIOError:
                    pass  # the pipe is full: the thread waits for room
                except OSError:
                    self._broken = True  # the rank is gone; its reader reports how it ended
                    return
                if not view.nbytes:
                    return
                self._idle = False
            self._queue.put(view)

    async def drain(self) -> None:
        """Nothing to wait for: queued frames hold references, not copies."""

    def close(self) -> None:
        with self._lock:
            self._closed = True  # the thread closes the descriptor once the queue is written
        self._queue.put(None)

    def _run(self) -> None:
        while (view := self._queue.get()) is not None:
            try:
                while view.nbytes and not self._broken:
                    select.select([], [self._fd], [])
                    try:
                        view = view[os.write(self._fd, view) :]
                    except BlockingIOError:
                        continue  # less room than a small write needs at once: wait again
            except OSError:
                self._broken = True  # the rank is gone; its reader reports how it ended
            with self._lock:
                if self._queue.empty():
                    self._idle = True
        os.close(self._fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    seen = read_stat(pid)
    return seen is None or not seen.ended  # None: no /proc, and signal 0 said it exists


class LocalRank:
    """A rank process on this machine, reached through three pipes the notebook created."""

    def __init__(
        self,
        pid: int,
        reader: asyncio.StreamReader,
        writer: PipeWriter,
        stderr: asyncio.StreamReader,
        exited: asyncio.Future[int],
        run_id: str | None,
    ) -> None:
        self.pid = pid
        self._run_id = run_id
        self.reader = reader
        self.writer = writer
        self._exited = exited
        self._stderr = StderrTail()
        self._stderr.follow(stderr)

    def describe(self) -> str:
        return f"local pid {self.pid}"

    def diagnostics(self) -> str:
        return self._stderr.text()

    async def running(self, pid: int, within: float) -> str | None:
        """Two looks at the process's ``/proc`` entry, ``within`` seconds apart."""
        before = read_stat(pid)
        await asyncio.sleep(within)
        return None if self._exited.done() else how_it_ran(before, read_stat(pid), within)

    async def kill(self) -> None:
        """Kill the rank with every process below it (what its cells detached too), and remove
        its private directory.
        """
        if not self._exited.done():
            await asyncio.to_thread(end_rank, self.pid, self._run_id)
        await self._status()

    async def _status(self) -> int | None:
        """The exit status once the process has ended; None if nobody could report it.

        The status comes from the process's parent (a thread here, or the template). Should the
        template be gone, the process is still seen to end, by its pid disappearing.
        """
        while not self._exited.done():
            done, _ = await asyncio.wait([self._exited], timeout=0.05)
            if not done and not _pid_alive(self.pid):
                await asyncio.wait([self._exited], timeout=0.5)
                if not self._exited.done():
                    return None
        return self._exited.result()

    async def wait(self) -> str:
        code = await self._status()
        await self._stderr.drain()
        self.writer.close()
        if code is None:
            return "ended (exit status unknown)"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class LocalProvider(Provider):
    name = "local"
    installs_packages = True
    shares_files = True
    on_notebook_machine = True
    keeps_old_until_ready = True

    def __init__(
        self,
        gpus: tuple[str, ...] | None = None,
        gpu_type: str | None = None,
        use_template: bool = True,
        cpu_only: bool = False,
    ) -> None:
        super().__init__()
        self._starts: dict[int, str | None] = {}
        self._gpus = gpus
        self._gpu_type = gpu_type
        self._use_template = use_template
        self._cpu_only = cpu_only
        """``--gpu none``: the ranks see no GPU whatever this machine has."""
        self._gpus_left_out = cpu_only
        """This machine has GPUs that some nodes did not get: their ranks must not see them."""
        self._ranks: list[LocalRank] = []
        self._run_ids: set[str] = set()

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> LocalProvider:
        if spec.gpu == NO_GPU:
            return cls(**{"cpu_only": True, **extra})
        return cls(**extra)

    @classmethod
    def prewarm(cls) -> None:
        """Start the rank template now, so the first pool does not wait for torch's import."""
        template()

    @classmethod
    def check(cls, spec: PoolSpec) -> None:
        """This machine: its GPUs must carry the pool as described (:func:`check_gpus`), the
        ranks must fit in its memory, and ``--backend nccl`` needs this machine's torch and GPUs
        to run NCCL. Checked before a running pool is replaced.
        """
        if spec.gpu == NO_GPU:
            _check_fits(spec.nodes * (spec.procs_per_node or 1))
            return
        ids, model = visible_gpus()
        check_gpus(spec, tuple(ids), model)
        _check_fits(spec.nodes * (spec.procs_per_node or len(ids) // spec.nodes or 1))
        if spec.backend == "nccl":
            _check_nccl()

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        """The ranks' and templates' pids with their start tokens, on this machine."""
        ranks = [pid for node in sorted(pids) for pid in pids[node]]
        return {
            "host": socket.gethostname(),
            "ranks": [{"pid": pid, "start": self._start(pid)} for pid in ranks],
            "templates": [{"pid": pid, "start": self._start(pid)} for pid in template_pids()],
        }

    def _start(self, pid: int) -> str | None:
        """A process's start token, read once (the registry asks again every few seconds)."""
        if pid not in self._starts:
            self._starts[pid] = process_start(pid)
        return self._starts[pid]

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        """End the recorded ranks and templates that are provably still this pool's."""
        report = ReapReport()
        if record.get("host") not in (None, socket.gethostname()):
            report.notes.append(f"the pool ran on {record.get('host')}, not on this machine")
            return report
        for group, names in (("ranks", (b"sky-rank-",)), ("templates", (b"sky-template",))):
            targets: dict[int, str | None] = {}
            unsure: dict[int, str | None] = {}
            for item in record.get(group) or ():
                pid, start = int(item.get("pid") or 0), item.get("start")
                if not process_alive(pid, start):
                    report.gone.append(pid)  # ended, or the pid is another process's now
                elif is_agent(pid, start, names):
                    targets[pid] = start
                else:
                    unsure[pid] = start
            report.killed.extend(end(targets) if targets else ())
            # A process on its way out reads as no program at all: give those a moment.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and any(
                process_alive(pid, start) for pid, start in unsure.items()
            ):
                time.sleep(0.05)
            for pid, start in unsure.items():
                (report.spared if process_alive(pid, start) else report.gone).append(pid)
        if report.spared:
            report.notes.append(
                f"pids {sorted(report.spared)} are no longer this pool's processes; left alone"
            )
        return report

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        if self._cpu_only:
            return [Node(index=i, address="127.0.0.1") for i in range(nodes)]
        gpus, name = (self._gpus, self._gpu_type) if self._gpus is not None else visible_gpus()
        shares, note = split_gpus(gpus, nodes)
        if note:
            self.warnings.append(note)
            progress(note)
        self._gpus_left_out = len(gpus) % nodes != 0
        return [
            Node(index=i, address="127.0.0.1", gpus=share, gpu_type=name if share else None)
            for i, share in enumerate(shares)
        ]

    async def build_environments(
        self, nodes: Sequence[Node], packages: Packages, progress: Progress
    ) -> dict[int, NodeEnvironment]:
        """One environment on this machine serves every local node: found cached without a
        process, else built by the node-side builder run here.
        """

        def say(text: str) -> None:
            for node in nodes:
                progress(text, node.index, RankState.BOOTING)

        found = node_environments.cached(packages.digest)
        built = (
            NodeEnvironment.from_report(packages.digest, found)
            if found is not None
            else await _build_here(packages, say)
        )
        say(f"packages ready: {built.describe()}")
        if built.torch:
            self.warnings.append(f"torch on this machine: {built.torch}")
        return {node.index: built for node in nodes}

    async def clean(self) -> list[str]:
        """``%sky clean`` here: the package environments (``--pip``) no running rank uses, and
        the wheels downloaded for ``--ship-wheels``.
        """
        removed, kept = await asyncio.to_thread(node_environments.clean, [wheels_root()])
        envs = sum(1 for path, _ in removed if path.parent != wheels_root())
        parts = [f"{envs} package environment{'s' * (envs != 1)}"] if envs else []
        if len(removed) > envs:
            count = len(removed) - envs
            parts.append(f"{count} folder{'s' * (count != 1)} of wheels")
        text = (
            f"this machine: removed {' and '.join(parts)} "
            f"({human_bytes(sum(size for _, size in removed))})"
            if removed
            else "this machine: nothing"
        )
        return [text + (f"; kept {len(kept)} in use by a running pool" if kept else "")]

    def _rank_env(self, node: Node, env: Mapping[str, str]) -> dict[str, str]:
        """The rank's environment: its node's GPUs only (none where the node got none of this
        machine's, or the pool keeps its ranks off them).
        """
        full = {**base_env(), **env}
        if env.get("CUDA_VISIBLE_DEVICES") == "":
            return full  # the pool (or --env) keeps this node's ranks off the GPUs
        if node.gpus or self._gpus_left_out or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            full["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpus)
        return full

    def _template_can_serve(self, env: Mapping[str, str]) -> bool:
        """False when the rank's environment changes what torch reads when it is imported."""
        return self._use_template and not differs_at_import(env, base_env())

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> LocalRank:
        full_env = self._rank_env(node, env)
        run_id = env.get("TORCHELASTIC_RUN_ID")
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()

        def record_exit(status: int) -> None:
            if not exited.done():
                exited.set_result(status)

        def on_exit(status: int) -> None:
            # A rank seen gone by its pid may be reported after its pool's loop closed.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(record_exit, status)

        forked = self._template_can_serve(env)
        wire_in_r, wire_in_w = _pipe()
        wire_out_r, wire_out_w = _pipe()
        diag_r, diag_w = os.pipe()
        theirs = (wire_in_r, wire_out_w, diag_w)
        try:
            if forked:
                pid = await _forked(full_env, theirs, run_id, on_exit)
            else:
                try:
                    popen = subprocess.Popen(
                        [sys.executable, "-m", "skyward_jupyter.agent"],
                        stdin=wire_in_r,
                        stdout=wire_out_w,
                        stderr=diag_w,
                        env=full_env,
                        start_new_session=True,
                    )
                finally:
                    _close(theirs)
                pid = popen.pid
                threading.Thread(
                    target=lambda: on_exit(popen.wait()), name=f"wait-{pid}", daemon=True
                ).start()
        except BaseException:
            _close((wire_in_w, wire_out_r, diag_r))
            raise
        writer = PipeWriter(wire_in_w, f"skyward-write-{pid}")
        wire_out: asyncio.StreamReader | None = None
        try:
            wire_out = await _pipe_reader(wire_out_r)
            diagnostics = await _pipe_reader(diag_r)
        except BaseException:
            # Cancelled (the pool going down while the rank started): nothing else knows of the
            # rank, which would wait on its open wire for ever. It ends here, with its pipes (a
            # reader being connected is closed by asyncio; one connected ends at the rank's EOF).
            writer.close()
            if wire_out is None:
                os.close(diag_r)
            threading.Thread(
                target=end_rank, args=(pid, run_id), name=f"end-{pid}", daemon=True
            ).start()
            raise
        rank = LocalRank(pid, wire_out, writer, diagnostics, exited, run_id)
        self._ranks.append(rank)
        if run_id:
            self._run_ids.add(run_id)
        return rank

    async def release(self) -> None:
        """End the ranks, and remove the pool's private directories (those of ranks killed
        without a word: the OOM killer's).
        """
        await asyncio.gather(*(r.kill() for r in self._ranks))
        self._ranks.clear()
        for run_id in self._run_ids:
            shutil.rmtree(pool_dir(run_id), ignore_errors=True)


async def _forked(
    env: Mapping[str, str],
    fds: tuple[int, int, int],
    run_id: str | None,
    on_exit: Callable[[int], None],
) -> int:
    """The pid of a rank the template forked with ``fds``, which are closed once the template
    has them (or will not get them).
    """
    try:
        tmpl = await asyncio.to_thread(template)
    except BaseException:
        _close(fds)
        raise
    fork = _Fork(tmpl, env, fds, run_id)
    try:
        # Shielded: the fork's thread runs whatever happens here, and closes the descriptors.
        pid = await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, fork.run))
    except asyncio.CancelledError:
        fork.cancel()
        raise
    tmpl.watch(pid, on_exit)
    return pid


class _Fork:
    """One fork queued at the template, in a thread of its own.

    A cancel (Ctrl-C during a start, however often pressed, or the loop's end) does not stop it:
    the descriptors stay open until the template has them (closed early, their numbers could
    be the notebook's next descriptors, handed to a rank that would wait on them forever), and
    the rank it made is ended, by the thread or by the cancel, whichever comes second.
    """

    def __init__(
        self, tmpl: Template, env: Mapping[str, str], fds: tuple[int, int, int], run_id: str | None
    ) -> None:
        self._tmpl, self._env, self._fds, self._run_id = tmpl, env, fds, run_id
        self._lock = threading.Lock()
        self._cancelled = False
        self._pid: int | None = None

    def run(self) -> int:
        try:
            pid = self._tmpl.spawn(self._env, self._fds, 60.0)
        finally:
            _close(self._fds)
        with self._lock:
            self._pid = pid
            cancelled = self._cancelled
        if cancelled:
            self._end(pid)
        return pid

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            pid = self._pid
        if pid is not None:  # forked before the cancel came: its thread has handed it over
            threading.Thread(target=self._end, args=(pid,), name=f"end-{pid}", daemon=True).start()

    def _end(self, pid: int) -> None:
        self._tmpl.watch(pid, lambda status: None)
        end_rank(pid, self._run_id)


def _close(fds: Sequence[int]) -> None:
    """Close descriptors this process handed on (the rank's ends of its pipes)."""
    for fd in fds:
        os.close(fd)


async def _build_here(packages: Packages, say: Callable[[str], None]) -> NodeEnvironment:
    """Run the node-side builder on this machine and read its report."""
    wheels = str(await asyncio.to_thread(packages.download)) if packages.wheels else None
    uv = await asyncio.to_thread(notebook_uv)
    request = packages.request(wheels, str(uv) if uv else None)
    argv = (sys.executable, *BUILDER)
    return await run_builder(argv, base_env(), request, packages.digest, "this machine", say)


def _check_nccl() -> None:
    """``--backend nccl`` on ranks that run the notebook's own torch, on this machine's GPUs:
    refused here, before any rank starts, when either cannot run NCCL.
    """
    nccl = nccl_available()  # imports the notebook's torch (CUDA stays uninitialised)
    if nccl is None:
        return  # the ranks' hellos name the missing torch
    import torch

    where = "this machine (the local provider's ranks run the notebook's torch)"
    gpus = len(visible_gpus()[0])
    problem = backend_problem("nccl", where, str(torch.__version__), nccl, gpus)
    if problem is not None:
        raise ProviderError(problem)


def _check_fits(ranks: int) -> None:
    """Refuse a local pool whose ranks alone would take more memory than this machine has."""
    available = meminfo("MemAvailable")
    if available is None or ranks <= 16:
        return  # a few ranks always start: a small machine may still run a small pool
    fits = max(16, available // RANK_FOOTPRINT)
    if ranks > fits:
        raise ProviderError(
            f"{ranks} local ranks would need about {ranks * RANK_FOOTPRINT / 2**30:.0f} GiB of "
            f"memory ({RANK_FOOTPRINT >> 20} MiB a rank at start); this machine has "
            f"{available / 2**30:.1f} GiB available, room for {fits} ranks: ask for fewer "
            "--nodes or --procs-per-node"
        )
