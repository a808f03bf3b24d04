"""The notebook's side of the warm rank template (:mod:`skyward_jupyter.agent.template`).

One template per notebook process, shared by its local pools: it has imported torch once and
forks ranks on request, so a pool starts, and a failed rank restarts, without paying torch's
import again. It is replaced when the notebook's environment moves in a way that changes what
torch reads at import, and ended (with any replaced ones) when the notebook exits.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from .base import ProviderError

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "LD_")
"""Environment variables a process reads at start-up or when torch is imported."""
SET_AFTER_START = frozenset(
    {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE"}
)
"""Of those, the ones that still take effect in a forked rank (the agent sets the thread count;
torch reads the others when the process group forms)."""


def differs_at_import(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether ``env`` changes what a process read at start-up or when torch was imported,
    against ``base`` (the template's environment): then a rank cannot be forked from it.
    """
    return any(
        k.startswith(IMPORT_TIME_PREFIXES) and base.get(k) != v
        for k, v in env.items()
        if k not in SET_AFTER_START
    )


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


def base_env() -> dict[str, str]:
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
        if k.startswith(IMPORT_TIME_PREFIXES) or k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }


def template() -> Template:
    """The warm template, started on first use (or again if it died or the environment moved)."""
    global _template
    with _template_lock:
        base = base_env()
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


@atexit.register
def shutdown_template() -> None:
    """End the template (and replaced ones); their ranks then see their channel close."""
    global _template
    with _template_lock:
        for old in [*_retired, *([_template] if _template else [])]:
            old.close()
        _retired.clear()
        _template = None
