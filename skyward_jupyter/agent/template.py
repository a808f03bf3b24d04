"""A warm template process that forks ranks with torch already imported.

Importing torch is most of a rank's start (1-2 s, for every rank, on every pool start and every
restart after a failure). The template pays it once: it imports torch and the agent, never
touches CUDA, then forks a rank for each request. Ranks stay *spawned* with respect to the
notebook (the kernel is never forked, so its CUDA state cannot leak), and each child gets the
environment and the three descriptors (wire in, wire out, diagnostics) the notebook passed over a
``SOCK_SEQPACKET`` socket with ``SCM_RIGHTS``.

Requests and replies are single JSON packets:
  -> {"env": {...}} with 3 descriptors          <- {"pid": 1234}  or  {"error": "..."}
  <- {"exited": 1234, "status": -9}   when a rank ends (the template is its parent and reaps it)
The template exits when the notebook's end of the socket closes.

The template is a child subreaper: what a rank that died without ending it (killed, crashed) had
started is reparented here, and ended (see :mod:`.descendants`).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading

_MAX_PACKET = 1 << 20


def _child(env: dict[str, str], fds: list[int]) -> None:
    """In the forked child: become a rank (new session, its own descriptors and environment)."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    keep = {0, 1, 2}
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                continue  # the directory listing's own descriptor, already closed
    os.environ.clear()
    os.environ.update(env)
    from .start import main

    main()


def serve(sock: socket.socket) -> None:
    import cloudpickle  # noqa: F401 - imported here so that forked ranks start with it

    from . import rank  # imported here so that forked ranks start with the agent loaded
    from .descendants import become_subreaper, end_orphans
    from .process import set_process_name
    from .torch_setup import torch_version

    set_process_name("sky-template")
    become_subreaper()

    torch_version()  # the point of the template; without torch, ranks report it themselves
    # What torch and the agent allocated is never garbage: frozen, a rank's first collection
    # skips it (walking it would copy every page it touches out of the template).
    gc.collect()
    gc.freeze()
    del rank

    send_lock = threading.Lock()
    ranks_lock = threading.Lock()
    ranks: set[int] = set()
    """The ranks this template forked and has not reaped; any other child is an orphan."""

    def send(message: dict[str, object]) -> None:
        with send_lock:
            sock.send(json.dumps(message).encode())

    def reap() -> None:
        # SIGCHLD handlers run in the main thread; a thread blocked in waitpid is simpler.
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                if not children_exist.wait(timeout=None):
                    return
                children_exist.clear()
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with ranks_lock:  # a rank forked meanwhile is not taken for an orphan
                if pid not in ranks:
                    continue  # an orphan, ended below when its rank was reaped
                ranks.discard(pid)
                end_orphans(ranks)
            try:
                send({"exited": pid, "status": code})
            except OSError:
                return  # the notebook is gone; the template is exiting too

    children_exist = threading.Event()
    threading.Thread(target=reap, name="reaper", daemon=True).start()
    send({"ready": True})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 3)
        except OSError:
            break
        if not data:
            break
        env = json.loads(data)["env"]
        with ranks_lock:
            pid = os.fork()
            if pid == 0:
                sock.close()
                try:
                    _child(env, fds)
                finally:
                    os._exit(1)  # main() exits on its own; reaching here means it raised
            ranks.add(pid)
        for fd in fds:
            os.close(fd)
        children_exist.set()
        send({"pid": pid})
    os._exit(0)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
