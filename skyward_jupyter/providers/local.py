"""The embedded default: every node is simulated on this machine, every rank a spawned process.

Ranks are never forked from the notebook, so the kernel's state (CUDA included) cannot leak into
them. They come from a warm template process (:mod:`skyward_jupyter.agent.template`) that has
imported torch once, so a pool starts, and a failed rank restarts, without paying torch's import
again; when the template cannot serve a rank (its environment changes what torch reads at import)
the rank is spawned cold with ``python -m skyward_jupyter.agent``. Either way each rank gets its
own session, so the kernel's Ctrl-C reaches it only through the pool, which decides how to
escalate.

The machine's GPUs are split evenly across the simulated nodes; each node sees only its own
through ``CUDA_VISIBLE_DEVICES``, as a real separate machine would. All the ranks share this
machine, so each gets one OpenMP thread unless the user chose (``OMP_NUM_THREADS``), as torchrun
does for several workers on one machine.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import fcntl
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from .base import Node, Progress, ProviderError, no_progress

_DIAGNOSTIC_LINES = 40
_PIPE_BYTES = 1 << 20
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "LD_")
# Variables the template's import of torch does not read: the agent applies the thread count
# itself (torch.set_num_threads), and NCCL's error handling is read when a group forms.
_SET_AFTER_START = {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


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


def split_gpus(gpus: tuple[str, ...], nodes: int) -> list[tuple[str, ...]]:
    """Split ``gpus`` evenly across ``nodes``; an uneven split is an error a user can act on."""
    if not gpus:
        return [() for _ in range(nodes)]
    if len(gpus) % nodes:
        raise ProviderError(
            f"{len(gpus)} GPUs cannot be split evenly across {nodes} local nodes; "
            f"use a number of nodes that divides {len(gpus)}"
        )
    per = len(gpus) // nodes
    return [gpus[i * per : (i + 1) * per] for i in range(nodes)]


# ------------------------------------------------------------------------------ the template


class Template:
    """The notebook's handle on its template process; one per notebook process, shared by pools.

    Blocking calls, made from a pool's IO thread through ``asyncio.to_thread``; a reader thread
    routes the template's replies and its reports of ranks that ended.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "skyward_jupyter.agent.template", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        theirs.close()
        self._sock = ours
        self._request_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, object]] = queue.Queue()
        self._ready = threading.Event()
        self._alive = True
        self._exit_lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._watchers: dict[int, Callable[[int], None]] = {}
        threading.Thread(target=self._read, name="skyward-template", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._alive

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            message = json.loads(data)
            if "exited" in message:
                self._ended(int(message["exited"]), int(message["status"]))
            elif "ready" in message:
                self._ready.set()
            else:
                self._replies.put(message)
        self._alive = False
        self._ready.set()
        self._replies.put({"error": "the template process ended"})

    def _ended(self, pid: int, status: int) -> None:
        with self._exit_lock:
            watcher = self._watchers.pop(pid, None)
            if watcher is None:
                self._exits[pid] = status
        if watcher is not None:
            watcher(status)

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None:
        """Call ``on_exit(status)`` (from the reader thread) when rank ``pid`` ends."""
        with self._exit_lock:
            status = self._exits.pop(pid, None)
            if status is None:
                self._watchers[pid] = on_exit
        if status is not None:
            on_exit(status)

    def spawn(self, env: Mapping[str, str], fds: tuple[int, int, int], timeout: float) -> int:
        """Fork a rank with ``env`` and descriptors (stdin, stdout, stderr); return its pid."""
        if not self._ready.wait(timeout) or not self._alive:
            raise ProviderError("the rank template process is not running")
        with self._request_lock:
            socket.send_fds(self._sock, [json.dumps({"env": dict(env)}).encode()], list(fds))
            reply = self._replies.get(timeout=timeout)
        if "pid" not in reply:
            raise ProviderError(f"the rank template could not start a rank: {reply.get('error')}")
        return int(str(reply["pid"]))

    def close(self) -> None:
        self._sock.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_template: Template | None = None
_retired: list[Template] = []  # replaced templates whose ranks may still be running
_template_lock = threading.Lock()


def _base_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")) if p
    )
    return env


def _import_signature(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that a process reads at start-up or when torch is imported."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_IMPORT_TIME_PREFIXES) or k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }


def template() -> Template:
    """The warm template, started on first use (or again if it died or the environment moved)."""
    global _template
    with _template_lock:
        base = _base_env()
        if (
            _template is None
            or not _template.alive
            or _import_signature(_template.env) != _import_signature(base)
        ):
            if _template is not None:
                # Its ranks may still run, and it reports how they end: close it at shutdown.
                _retired.append(_template)
            _template = Template(base)
        return _template


def template_pids() -> list[int]:
    """This process's live rank templates (the current one and replaced ones still serving)."""
    with _template_lock:
        templates = [*_retired, *([_template] if _template else [])]
    return [t.process.pid for t in templates if t.alive]


def prewarm() -> None:
    """Start the template now, so the first pool does not wait for torch's import."""
    template()


@atexit.register
def shutdown_template() -> None:
    """End the template (and replaced ones); their ranks then see their channel close."""
    global _template
    with _template_lock:
        for old in [*_retired, *([_template] if _template else [])]:
            old.close()
        _retired.clear()
        _template = None


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
    """Writes frames to a rank's pipe from a thread of its own, straight from their buffers.

    asyncio's pipe transport copies whatever the pipe does not take at once into its own buffer
    (a 100 MB global, once per rank) and re-copies it as it drains; a blocking writer thread
    sends the caller's memory as it is. Frames are queued whole, so a heartbeat never lands
    inside a large frame.
    """

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._broken = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._broken:
            self._queue.put(memoryview(data).cast("B"))

    async def drain(self) -> None:
        """Nothing to wait for: queued frames hold references, not copies."""

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (view := self._queue.get()) is not None:
            try:
                while view.nbytes and not self._broken:
                    view = view[os.write(self._fd, view) :]
            except OSError:
                self._broken = True  # the rank is gone; its reader reports how it ended
        os.close(self._fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: signal 0 said it exists


class LocalRank:
    """A rank process on this machine, reached through three pipes the notebook created."""

    def __init__(
        self,
        pid: int,
        reader: asyncio.StreamReader,
        writer: PipeWriter,
        stderr: asyncio.StreamReader,
        exited: asyncio.Future[int],
    ) -> None:
        self.pid = pid
        self.reader = reader
        self.writer = writer
        self._exited = exited
        self._diagnostics: collections.deque[str] = collections.deque(maxlen=_DIAGNOSTIC_LINES)
        self._stderr_task = asyncio.get_running_loop().create_task(self._collect(stderr))

    def describe(self) -> str:
        return f"local pid {self.pid}"

    async def _collect(self, stderr: asyncio.StreamReader) -> None:
        async for line in stderr:
            self._diagnostics.append(line.decode(errors="replace").rstrip())

    def diagnostics(self) -> str:
        return "\n".join(self._diagnostics)

    async def kill(self) -> None:
        if not self._exited.done():
            with contextlib.suppress(ProcessLookupError):  # it ended after the check
                os.kill(self.pid, signal.SIGKILL)
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
        await asyncio.wait([self._stderr_task], timeout=1.0)
        self.writer.close()
        if code is None:
            return "ended (exit status unknown)"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class LocalProvider:
    name = "local"

    def __init__(
        self,
        gpus: tuple[str, ...] | None = None,
        gpu_type: str | None = None,
        use_template: bool = True,
    ) -> None:
        self._gpus = gpus
        self._gpu_type = gpu_type
        self._use_template = use_template
        self._ranks: list[LocalRank] = []
        self._threads = 0

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        gpus, name = (self._gpus, self._gpu_type) if self._gpus is not None else visible_gpus()
        return [
            Node(index=i, address="127.0.0.1", gpus=share, gpu_type=name if share else None)
            for i, share in enumerate(split_gpus(gpus, nodes))
        ]

    def _rank_env(self, node: Node, env: Mapping[str, str]) -> dict[str, str]:
        full = {**_base_env(), **env}
        if node.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            full["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpus)
        return full

    def _template_can_serve(self, env: Mapping[str, str]) -> bool:
        """False when the rank's environment changes what torch reads when it is imported."""
        base = _base_env()
        return self._use_template and not any(
            k.startswith(_IMPORT_TIME_PREFIXES) and base.get(k) != v
            for k, v in env.items()
            if k not in _SET_AFTER_START
        )

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> LocalRank:
        full_env = self._rank_env(node, env)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()

        def settle(status: int) -> None:
            if not exited.done():
                exited.set_result(status)

        def on_exit(status: int) -> None:
            loop.call_soon_threadsafe(settle, status)

        wire_in_r, wire_in_w = _pipe()
        wire_out_r, wire_out_w = _pipe()
        diag_r, diag_w = os.pipe()
        theirs = (wire_in_r, wire_out_w, diag_w)
        try:
            if self._template_can_serve(env):
                tmpl = await asyncio.to_thread(template)
                pid = await asyncio.to_thread(tmpl.spawn, full_env, theirs, 60.0)
                tmpl.watch(pid, on_exit)
            else:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "skyward_jupyter.agent"],
                    stdin=wire_in_r,
                    stdout=wire_out_w,
                    stderr=diag_w,
                    env=full_env,
                    start_new_session=True,
                )
                pid = popen.pid
                threading.Thread(
                    target=lambda: on_exit(popen.wait()), name=f"wait-{pid}", daemon=True
                ).start()
        except BaseException:
            for fd in (wire_in_w, wire_out_r, diag_r):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        rank = LocalRank(
            pid,
            await _pipe_reader(wire_out_r),
            PipeWriter(wire_in_w, f"skyward-write-{pid}"),
            await _pipe_reader(diag_r),
            exited,
        )
        self._ranks.append(rank)
        return rank

    async def release(self) -> None:
        await asyncio.gather(*(r.kill() for r in self._ranks))
        self._ranks.clear()
