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
The template exits when its own channel closes: the pool's release, or the notebook's end.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import sys
import tempfile
import threading

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
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, socket.socket] = {}
        """Rank pid -> the connection that asked for it (told when the rank ends)."""
        self._children = threading.Event()

    def serve(self) -> None:
        import cloudpickle  # noqa: F401 - imported here so that forked ranks start with it

        from . import rank  # imported here so that forked ranks start with the agent loaded
        from .process import set_process_name
        from .torch_setup import torch_version

        del rank
        set_process_name("sky-node-template")
        torch_version()  # the point of the template
        # What torch and the agent allocated is never garbage: frozen, a rank's first collection
        # skips it (it took 100 ms, and copied every page it touched out of the template).
        gc.collect()
        gc.freeze()
        directory = tempfile.mkdtemp(prefix="skyward-template-")  # mode 0700
        path = os.path.join(directory, "spawn.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(64)
        threading.Thread(target=self._reap, name="reaper", daemon=True).start()
        threading.Thread(target=self._watch_channel, args=(path,), daemon=True).start()
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
            with self._lock:
                conn = self._waiting.pop(pid, None)
            if conn is not None:
                # its spawner may be gone (its channel closed): then nobody is left to tell
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"exited": pid, "status": code}).encode())
                conn.close()

    @staticmethod
    def _watch_channel(path: str) -> None:
        """The pool's end (or the notebook's) closes this channel: leave nothing behind."""
        while os.read(0, 1 << 16):
            continue
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
        os._exit(0)


if __name__ == "__main__":
    NodeTemplate().serve()
