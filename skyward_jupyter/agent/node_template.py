"""A warm template on a remote node: ranks forked with torch already imported, for the pool's life.

The SSH provider starts one per host when the pool starts (``python -m
skyward_jupyter.agent.node_template``, on its own channel) and each rank through
:mod:`.node_spawn`, a stdlib-only client that starts in milliseconds: it hands the template its
environment and its channel's three descriptors over a Unix socket, and the template forks the
rank. A restart, or the replacement of a lost rank, then costs a fork rather than an interpreter
and a torch import.

The socket lives in a directory only this user can enter; its path is the template's first line
of output, once torch is imported (so the path also says "ready"). Each connection asks for one
rank: ``{"env": {...}}`` with 3 descriptors; the answer is ``{"pid": N}``, then
``{"exited": N, "status": S}`` when the rank ends (the template is its parent and reaps it). The
rank writes its pid as its first line (the provider ends it with ``kill``), then speaks the wire.
The template exits when its own channel closes (the pool's release, or the notebook's end) and,
as a rank does, when the notebook has been silent on it for ``--heartbeat-timeout`` seconds (a
partition leaves the channel open on this side for as long as it lasts): the notebook writes a
byte on it every second, and the template waits as long as the ranks do. It is a child
subreaper: what a rank that died without ending it (killed, crashed) had started is reparented
here, and ended (see :mod:`.descendants`); as it ends it removes its pool's private directories,
which ranks killed on the host (by the OOM killer too) left.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from .descendants import become_subreaper, end_orphans, pool_dir

_MAX_PACKET = 1 << 20


def _child(env: dict[str, str], fds: list[int]) -> None:
    """In the forked child: become a rank on the spawner's channel (new session)."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                continue  # the listing's own descriptor, already closed
    os.environ.update(env)
    os.write(1, f"{os.getpid()}\n".encode())
    from .start import main

    main()


class NodeTemplate:
    def __init__(self, heartbeat_timeout: float) -> None:
        self._heartbeat_timeout = heartbeat_timeout
        self._last_heard = time.monotonic()
        self._lock = threading.Lock()
        self._waiting: dict[int, socket.socket] = {}
        """Rank pid -> the connection that asked for it (told when the rank ends)."""
        self._children = threading.Event()
        self._run_ids: set[str] = set()
        """The pools of the ranks forked (one, the pool's): their private directories go with
        the template (see :mod:`.descendants`)."""

    def serve(self) -> None:
        import cloudpickle  # noqa: F401 - imported here so that forked ranks start with it

        from . import rank  # imported here so that forked ranks start with the agent loaded
        from .process import set_process_name
        from .torch_setup import torch_version

        del rank
        set_process_name("sky-node-template")
        become_subreaper()
        torch_version()  # the point of the template
        # What torch and the agent allocated is never garbage: frozen, a rank's first collection
        # skips it (walking it would copy every page it touches out of the template).
        gc.collect()
        gc.freeze()
        directory = tempfile.mkdtemp(prefix="skyward-template-")  # mode 0700
        path = os.path.join(directory, "spawn.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(64)
        threading.Thread(target=self._reap, name="reaper", daemon=True).start()
        self._last_heard = time.monotonic()  # beats sent during torch's import wait unread
        threading.Thread(target=self._watch_channel, args=(path,), daemon=True).start()
        threading.Thread(target=self._watchdog, args=(path,), daemon=True).start()
        sys.stdout.write(path + "\n")
        sys.stdout.flush()
        while True:
            conn, _ = listener.accept()
            try:
                self._spawn(conn)
            except OSError:
                conn.close()  # the spawner went away before its rank started

    def _spawn(self, conn: socket.socket) -> None:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_PACKET, 3)
        if not data or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        env = json.loads(data)["env"]
        if env.get("TORCHELASTIC_RUN_ID"):
            self._run_ids.add(str(env["TORCHELASTIC_RUN_ID"]))
        with self._lock:  # the reaper must find the connection when the child ends at once
            pid = os.fork()
            if pid == 0:
                try:
                    _child(env, fds)
                finally:
                    os._exit(1)  # main() exits on its own; reaching here means it raised
            self._waiting[pid] = conn
        for fd in fds:
            os.close(fd)
        self._children.set()
        conn.send(json.dumps({"pid": pid}).encode())

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self._children.wait()
                self._children.clear()
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with self._lock:  # a rank forked meanwhile is not taken for an orphan
                conn = self._waiting.pop(pid, None)
                if conn is not None:
                    end_orphans(self._waiting)
            if conn is not None:
                # its spawner may be gone (its channel closed): then nobody is left to tell
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"exited": pid, "status": code}).encode())
                conn.close()

    def _watch_channel(self, path: str) -> None:
        """The pool's end (or the notebook's) closes this channel: leave nothing behind."""
        while os.read(0, 1 << 16):
            self._last_heard = time.monotonic()
        self._leave(path)

    def _watchdog(self, path: str) -> None:
        """A silent notebook (its machine gone, the network cut) ends the template too."""
        while True:
            time.sleep(min(0.25, self._heartbeat_timeout / 4))
            if time.monotonic() - self._last_heard > self._heartbeat_timeout:
                os.write(
                    2,
                    f"skyward_jupyter node template: no heartbeat from the notebook for "
                    f"{self._heartbeat_timeout:.0f} s; exiting\n".encode(),
                )
                self._leave(path)

    def _leave(self, path: str) -> None:
        """End the template, with its socket and its pool's private directories."""
        with contextlib.suppress(FileNotFoundError):  # both watchers may get here
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
        for run_id in list(self._run_ids):
            shutil.rmtree(pool_dir(run_id), ignore_errors=True)
        os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m skyward_jupyter.agent.node_template")
    parser.add_argument("--heartbeat-timeout", type=float, required=True)
    NodeTemplate(parser.parse_args().heartbeat_timeout).serve()
