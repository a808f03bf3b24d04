"""The head's rendezvous store: the keys torch.distributed forms its groups through, served only
to connections that prove the pool's secret (see :mod:`.store_auth`).

One thread and a selector serve every connection, so a flood of connections costs descriptors,
not threads. A connection has ``HANDSHAKE_TIMEOUT`` seconds to prove the secret; at most
``MAX_UNPROVEN`` may be proving at once (past that the oldest is dropped); a connection that
fails its proof or any later frame is dropped and counted in :attr:`StoreServer.refused`, with
its reason and address in :attr:`StoreServer.refusals` and on the rank's diagnostics. Nothing
about the keys is sent before the proof.

Semantics are TCPStore's: values are bytes, ``add`` keeps a decimal counter, ``compare_set``
sets when the value is the expected one (or when the key is absent and nothing was expected),
and ``get``/``wait`` block until their keys exist or their deadline passes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import itertools
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import store_auth as auth

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to prove the pool's secret."""
MAX_UNPROVEN = 64
"""Connections proving the secret at once; a new one beyond this drops the oldest."""
ACCEPT_PAUSE = 0.5
"""Seconds the server stops accepting when the process is out of descriptors."""
_SAID = 20
"""Refusals written to the diagnostics (all are counted)."""
_READ = 1 << 16
WAITING_OPS = frozenset({b"get", b"wait", b"multi_get"})


@dataclass(eq=False)
class _Wait:
    op: bytes
    keys: list[bytes]
    deadline: float | None


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    nonce: bytes
    deadline: float
    session: auth.Session | None = None
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    wait: _Wait | None = None
    closed: bool = False


class StoreServer:
    """Serves the store on ``listener`` (bound and listening) until :meth:`close`."""

    def __init__(
        self, listener: socket.socket, secret: bytes, say: Callable[[str], None] | None = None
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the store's secret must have at least 16 bytes")
        self._listener = listener
        self._secret = secret
        self._say = say
        self.port = int(listener.getsockname()[1])
        self.refused = 0
        """Connections dropped for not proving the secret (or sending a forged frame)."""
        self.refusals: collections.deque[str] = collections.deque(maxlen=100)
        """Why, and from where, the latest refusals."""
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, list[_Conn]] = {}
        self._unproven: dict[_Conn, None] = {}
        """Connections still proving the secret, oldest first."""
        self._deadlines: list[tuple[float, int, _Conn, object]] = []
        self._order = itertools.count()
        self._accept_again: float | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = False
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving: every connection closes (clients then fail at once, not at a timeout)."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5.0)

    # ----------------------------------------------------------------------- the loop

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        continue
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                self._expire(time.monotonic())
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self._accept_again is not None:
            times.append(self._accept_again)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _expire(self, now: float) -> None:
        if self._accept_again is not None and now >= self._accept_again:
            self._accept_again = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, conn, what = heapq.heappop(self._deadlines)
            if conn.closed:
                continue
            if what is None and conn.session is None:
                self._refuse(conn, f"did not prove the secret within {HANDSHAKE_TIMEOUT:.0f} s")
            elif isinstance(what, _Wait) and conn.wait is what:
                conn.wait = None
                self._reply(conn, [b"timeout"])
                self._process(conn)

    def _at(self, deadline: float, conn: _Conn, what: object) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._order), conn, what))

    # -------------------------------------------------------------------- connections

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            if self._unproven:
                self._refuse(next(iter(self._unproven)), "dropped: out of descriptors")
            else:  # every descriptor is a rank's or the process's: wait for one to close
                self._selector.unregister(self._listener)
                self._accept_again = time.monotonic() + ACCEPT_PAUSE
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, f"{address[0]}:{address[1]}", auth.nonce(), 0.0)
        conn.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        if len(self._unproven) >= MAX_UNPROVEN:
            self._refuse(next(iter(self._unproven)), "dropped: too many connections proving")
        self._unproven[conn] = None
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._at(conn.deadline, conn, None)
        self._send(conn, auth.MAGIC + conn.nonce)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.wait = None
        self._unproven.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self.refused += 1
        line = f"store refused a connection from {conn.peer}: {reason}"
        self.refusals.append(line)
        if self._say is not None and self.refused <= _SAID:
            self._say(line + ("" if self.refused < _SAID else " (further refusals only counted)"))
        self._close(conn)

    def _read(self, conn: _Conn) -> None:
        if conn.closed:
            return  # dropped earlier in this round of events
        try:
            data = conn.sock.recv(_READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        if conn.session is None:
            try:
                self._prove(conn)
            except auth.Rejected as exc:
                self._refuse(conn, str(exc))
                return
        if conn.session is not None:
            self._process(conn)

    def _prove(self, conn: _Conn) -> None:
        if len(conn.inbox) < auth.ANSWER:
            return
        client_nonce = bytes(conn.inbox[: auth.NONCE])
        proof = bytes(conn.inbox[auth.NONCE : auth.ANSWER])
        del conn.inbox[: auth.ANSWER]
        auth.check(auth.client_proof(self._secret, conn.nonce, client_nonce), proof)
        conn.session = auth.Session(self._secret, conn.nonce, client_nonce, client=False)
        self._unproven.pop(conn, None)
        self._send(conn, auth.server_proof(self._secret, conn.nonce, client_nonce))

    def _process(self, conn: _Conn) -> None:
        """Answer the connection's complete frames in order, until one waits for keys."""
        session = conn.session
        assert session is not None
        while conn.wait is None and not conn.closed and len(conn.inbox) >= auth.HEAD:
            head = bytes(conn.inbox[: auth.HEAD])
            try:
                end = auth.HEAD + auth.frame_length(head) + auth.TAG
            except auth.Rejected as exc:
                self._refuse(conn, str(exc))
                return
            if len(conn.inbox) < end:
                return
            body = bytes(conn.inbox[auth.HEAD : end - auth.TAG])
            tag = bytes(conn.inbox[end - auth.TAG : end])
            del conn.inbox[:end]
            try:
                self._handle(conn, session.open(head, body, tag))
            except (auth.Rejected, ValueError, IndexError) as exc:
                self._refuse(conn, str(exc) or type(exc).__name__)

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.outbox += data
        self._flush(conn)

    def _reply(self, conn: _Conn, parts: list[bytes]) -> None:
        assert conn.session is not None
        self._send(conn, conn.session.seal(parts))

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn)
            return
        del conn.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0)
        self._selector.modify(conn.sock, events, conn)

    # ------------------------------------------------------------------------ the store

    def _handle(self, conn: _Conn, parts: list[bytes]) -> None:
        op, args = parts[0], parts[1:]
        data = self._data
        if op in WAITING_OPS:
            # ``args``: the timeout in milliseconds (0: none), then the keys
            timeout, keys = int(args[0]), args[1:]
            deadline = time.monotonic() + timeout / 1000 if timeout > 0 else None
            conn.wait = _Wait(op, keys, deadline)
            if deadline is not None:
                self._at(deadline, conn, conn.wait)
            self._resume(conn)
            return
        if op == b"set":
            self._store(args[0], args[1])
            answer = []
        elif op == b"add":
            total = str(int(data.get(args[0], b"0")) + int(args[1])).encode()
            self._store(args[0], total)
            answer = [total]
        elif op == b"compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                self._store(key, desired)
                current = desired
            answer = [expected if current is None else current]
        elif op == b"append":
            self._store(args[0], data.get(args[0], b"") + args[1])
            answer = []
        elif op == b"multi_set":
            half = len(args) // 2
            for key, value in zip(args[:half], args[half:], strict=True):
                self._store(key, value)
            answer = []
        elif op == b"check":
            answer = [b"1" if all(k in data for k in args) else b"0"]
        elif op == b"num_keys":
            answer = [str(len(data)).encode()]
        elif op == b"delete_key":
            answer = [b"1" if data.pop(args[0], None) is not None else b"0"]
        else:
            raise auth.Rejected(f"unknown operation {op[:32]!r}")
        self._reply(conn, [b"ok", *answer])

    def _store(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        for waiter in self._waiting.pop(key, ()):
            if not waiter.closed and waiter.wait is not None:
                self._resume(waiter)

    def _resume(self, conn: _Conn) -> None:
        """Answer the connection's wait if its keys are all there; else wait for the next."""
        wait = conn.wait
        assert wait is not None
        missing = next((k for k in wait.keys if k not in self._data), None)
        if missing is not None:
            self._waiting.setdefault(missing, []).append(conn)
            return
        conn.wait = None
        values = [self._data[k] for k in wait.keys] if wait.op != b"wait" else []
        self._reply(conn, [b"ok", *values])
        self._process(conn)
