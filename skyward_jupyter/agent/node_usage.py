"""One heartbeat a node: the node's first rank sends the usage of all its ranks at once.

A rank's usage (:class:`~skyward_jupyter.protocol.Usage`) is also its heartbeat: the notebook
declares a rank silent when it has heard nothing from it for a while. Sent by each rank on its
own channel, the notebook would read one message a second per rank, and its idle work would grow
with the pool's ranks. Instead each other rank of a node hands its sample to the node's first
rank over a Unix datagram socket in the pool's directory on the machine (mode 0700: only this
user can reach it), stamped with when it was taken; the first rank sends one
:class:`~skyward_jupyter.protocol.NodeUsage` a second for the node, with the ranks it heard since
the last one and how long ago. A rank that hangs stops appearing there and ages on the notebook's
side as its own silence would, found at most an interval later (the wait of a sample for the
first rank's next beat is not counted as silence, lest a healthy rank be suspected).

A rank sends its sample on its own channel instead whenever the first rank cannot take it: no
socket yet (the first rank is starting) or any more (it died), or the last sample still unread
after a whole interval (the first rank is stopped, or native code holds its interpreter). So a
first rank that hangs delays the others' heartbeats by an interval, and is found alone.

Standard library only: it runs on the nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import operator
import os
import socket
import stat
import struct
import termios
import threading
import time
from collections.abc import Callable

from .. import protocol as p
from .descendants import pool_dir

_MAX_DATAGRAM = 1 << 16
_USAGE_FIELDS = operator.attrgetter(*(field.name for field in dataclasses.fields(p.Usage)))
"""A sample's fields in order: ``dataclasses.astuple`` copies each one deeply, which every rank
but a node's first paid each second for flat values."""


def socket_path(run_id: str, node: int) -> str | None:
    """Where the node's first rank takes the others' samples; None when the pool's directory on
    this machine is not this user's own and private, or the system cannot say what a socket
    still holds unread (Linux can): then every rank sends its own.
    """
    if not hasattr(termios, "TIOCOUTQ"):
        return None  # a first rank that stops could not be told from a slow one: no gathering
    parent = pool_dir(run_id)
    try:
        st = os.lstat(parent)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return os.path.join(parent, f"usage-{node}.sock")


def _unread(sock: socket.socket) -> int:
    """Bytes this socket sent that its peer has not read yet (Linux's ``SIOCOUTQ``)."""
    raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    queued: int = struct.unpack("i", raw)[0]
    return queued


class NodeUsage:
    """How this rank's usage reaches the notebook each heartbeat (:meth:`beat`)."""

    def __init__(
        self,
        rank: int,
        path: str | None,
        first: bool,
        alone: bool,
        send: Callable[[object], None],
        say: Callable[[str], None],
    ) -> None:
        """``path``: the node's socket (:func:`socket_path`); ``first``: this rank gathers the
        node's samples; ``alone``: the node has no other rank (nothing to gather).
        """
        self._rank = rank
        self._path = path
        self._send = send
        self._say = say
        self._pid = os.getpid()
        self._first = first
        self._lock = threading.Lock()
        self._heard: dict[int, tuple[int, float, p.Usage]] = {}
        """Other ranks' samples since the last beat: rank -> (pid, when taken, usage)."""
        self._gathering: socket.socket | None = None
        self._to_first: socket.socket | None = None
        if first and not alone and path is not None:
            self._gathering = self._bind(path)

    def _bind(self, path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the socket of a first rank that was killed
            sock.bind(path)
        except OSError as exc:
            sock.close()
            self._say(
                f"cannot gather the node's heartbeats at {path} ({exc}); each rank sends its own"
            )
            return None
        threading.Thread(target=self._gather, args=(sock,), name="node-usage", daemon=True).start()
        return sock

    def _gather(self, sock: socket.socket) -> None:
        """The first rank's thread: keep each other rank's latest sample until the next beat."""
        while True:
            try:
                data = sock.recv(_MAX_DATAGRAM)
            except OSError:
                return  # closed as the rank leaves
            try:
                rank, pid, taken, fields = json.loads(data)
                usage = p.Usage(*fields)
            except (ValueError, TypeError) as exc:
                self._say(f"unreadable heartbeat on the node's socket: {exc}")
                continue
            with self._lock:
                self._heard[rank] = (pid, taken, usage)

    def beat(self, usage: p.Usage) -> None:
        """Send this rank's sample: with the node's (the first rank), through the first rank,
        or on its own channel.
        """
        if self._gathering is not None:
            now = time.monotonic()
            with self._lock:
                heard, self._heard = self._heard, {}
            others = ((r, pid, max(now - taken, 0.0), u) for r, (pid, taken, u) in heard.items())
            self._send(p.NodeUsage(((self._rank, self._pid, 0.0, usage), *others)))
        elif not self._through_first(usage):
            self._send(usage)

    def _through_first(self, usage: p.Usage) -> bool:
        """Hand the sample to the node's first rank; False when it cannot take it now."""
        if self._path is None or self._first:
            return False
        try:
            if self._to_first is None:
                self._to_first = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._to_first.connect(self._path)
            elif _unread(self._to_first):
                return False  # the first rank has not read the last one: it is not gathering
            sample = [self._rank, self._pid, time.monotonic(), _USAGE_FIELDS(usage)]
            self._to_first.send(json.dumps(sample).encode(), socket.MSG_DONTWAIT)
        except OSError:  # no first rank (yet, or any more), or its queue is full
            if self._to_first is not None:
                self._to_first.close()
                self._to_first = None
            return False
        return True

    def close(self) -> None:
        """As the rank leaves: its socket goes, so the pool's directory can be removed."""
        if self._gathering is not None and self._path is not None:
            self._gathering.close()
            with contextlib.suppress(OSError):
                os.unlink(self._path)
        if self._to_first is not None:
            self._to_first.close()
