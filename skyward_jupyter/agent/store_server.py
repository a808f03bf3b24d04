"""The head's rendezvous store: the keys torch.distributed forms its groups through, served only
to connections that prove the pool's secret (see :mod:`.store_auth`).

One thread and a selector serve every connection, so a flood of connections costs descriptors,
not threads. A connection has ``HANDSHAKE_TIMEOUT`` seconds to prove the secret, and at most
``max(MIN_UNPROVEN, 2 * ranks)`` may be proving at once (every rank connects at once as the group
forms, after a probe of the port). Past that, the oldest connection of the address with the most
connections proving is dropped: a flood from one host drops its own, and a rank whose connection
was dropped before its turn connects again (see :class:`~.pool_store.PoolStore`). A connection
that fails its proof is told so, then dropped; one that fails any later frame is dropped. Both
are counted in :attr:`StoreServer.refused`, with their reason and address in
:attr:`StoreServer.refusals` and on the rank's diagnostics. Nothing about the keys is sent
before the proof. An error on one connection, or in accepting one, is written to the
diagnostics too and drops that connection alone: the store goes on serving the others.

Semantics are TCPStore's: values are bytes, ``add`` keeps a decimal counter, ``compare_set``
sets when the value is the expected one (or when the key is absent and nothing was expected),
and ``get``/``wait`` block until their keys exist or their deadline passes.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import store_auth as auth
from .accepting import CONNECTION_GONE, OUT_OF_DESCRIPTORS

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to prove the pool's secret."""
MIN_UNPROVEN = 64
"""Connections proving the secret at once, at the least (twice the ranks when more)."""
ACCEPT_PAUSE = 0.5
"""Seconds the server stops accepting when the process is out of descriptors, or accepting
failed for a reason that is not the connection's own."""
_SAID = 20
"""Lines written to the diagnostics (every refusal is counted)."""
_READ = 1 << 16
_COMPACT_FLOOR = 256
"""Deadlines kept before the stale ones (answered waits, proven connections) are swept."""
WAITING_OPS = frozenset({b"get", b"wait", b"multi_get"})


@dataclass(eq=False)
class _Wait:
    op: bytes
    keys: list[bytes]
    on: bytes | None = None
    """The missing key this wait is listed under in ``StoreServer._waiting``."""


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    host: str
    port: int
    nonce: bytes
    session: auth.Session | None = field(default=None, repr=False)
    inbox: bytearray = field(default_factory=bytearray, repr=False)
    outbox: bytearray = field(default_factory=bytearray, repr=False)
    wait: _Wait | None = None
    closed: bool = False

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"


class StoreServer:
    """Serves the store on ``listener`` (bound and listening) to a pool of ``ranks`` until
    :meth:`close`.
    """

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        ranks: int,
        say: Callable[[str], None] | None = None,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the store's secret must have at least 16 bytes")
        self._listener = listener
        self._secret = secret
        self._say = say
        self._said = 0
        self.port = int(listener.getsockname()[1])
        self.max_unproven = max(MIN_UNPROVEN, 2 * ranks)
        """Connections proving the secret at once (each rank's, and its probe of the port)."""
        self.refused = 0
        """Connections dropped for not proving the secret (or sending a forged frame)."""
        self.refusals: collections.deque[str] = collections.deque(maxlen=100)
        """Why, and from where, the latest refusals."""
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, dict[_Conn, None]] = {}
        """Connections waiting for a key, by the key."""
        self._unproven: dict[str, dict[_Conn, None]] = {}
        """Connections still proving the secret, by their address, oldest first."""
        self._proving = 0
        self._deadlines: list[tuple[float, int, _Conn, _Wait | None]] = []
        """Handshakes' (``None``) and waits' deadlines, some stale (see :meth:`_due`)."""
        self._compact_at = _COMPACT_FLOOR
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
        """The store's thread. Only the selector failing ends it (the agent then reports the
        thread dead and the rank exits); a connection's error drops that connection.
        """
        try:
            while not self._closing:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    elif key.data != "wake":
                        self._guarded(key.data, self._ready, key.data, mask)
                self._expire(time.monotonic())
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._listener.close()  # also when accepting was paused (no longer registered)
            self._wake_r.close()
            self._wake_w.close()

    def _guarded(self, conn: _Conn, step: Callable[..., object], *args: object) -> None:
        """Run one connection's step; an error there drops that connection alone, said."""
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - one connection's failure must not end the store
            self._note(f"store dropped the connection from {conn.peer} after an error: {exc!r}")
            self._close(conn)

    def _ready(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read(conn)
        if mask & selectors.EVENT_WRITE and not conn.closed:
            self._flush(conn)

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
            entry = heapq.heappop(self._deadlines)
            if self._due(entry):
                self._guarded(entry[2], self._expired, entry[2], entry[3])

    def _expired(self, conn: _Conn, wait: _Wait | None) -> None:
        if wait is None:
            self._refuse(conn, f"did not prove the secret within {HANDSHAKE_TIMEOUT:.0f} s")
            return
        self._unwait(conn)
        conn.wait = None
        self._reply(conn, [b"timeout"])
        self._process(conn)

    @staticmethod
    def _due(entry: tuple[float, int, _Conn, _Wait | None]) -> bool:
        """Whether a deadline still stands: its connection still proving, or still waiting."""
        _, _, conn, wait = entry
        if conn.closed:
            return False
        return conn.session is None if wait is None else conn.wait is wait

    def _at(self, deadline: float, conn: _Conn, wait: _Wait | None) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._order), conn, wait))
        if len(self._deadlines) > self._compact_at:
            self._deadlines = [entry for entry in self._deadlines if self._due(entry)]
            heapq.heapify(self._deadlines)
            self._compact_at = max(_COMPACT_FLOOR, 2 * len(self._deadlines))

    # -------------------------------------------------------------------- connections

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in CONNECTION_GONE:
                return
            if exc.errno in OUT_OF_DESCRIPTORS and self._proving:
                self._refuse(self._oldest_unproven(), "dropped: out of descriptors")
                return
            if exc.errno not in OUT_OF_DESCRIPTORS:
                self._note(f"store could not accept a connection ({exc}); pausing")
            # every descriptor is a rank's or the process's: wait for one to close
            self._selector.unregister(self._listener)
            self._accept_again = time.monotonic() + ACCEPT_PAUSE
            return
        conn = _Conn(sock, str(address[0]), int(address[1]), auth.nonce())
        self._guarded(conn, self._admit, conn)

    def _admit(self, conn: _Conn) -> None:
        conn.sock.setblocking(False)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._proving >= self.max_unproven:
            self._refuse(self._oldest_unproven(), "dropped: too many connections proving")
        self._unproven.setdefault(conn.host, {})[conn] = None
        self._proving += 1
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        self._at(time.monotonic() + HANDSHAKE_TIMEOUT, conn, None)
        self._send(conn, auth.MAGIC + conn.nonce)

    def _oldest_unproven(self) -> _Conn:
        """The oldest connection still proving, of the address with the most of them."""
        crowded = max(self._unproven.values(), key=len)
        return next(iter(crowded))

    def _proven(self, conn: _Conn) -> None:
        """Out of the connections still proving (proven, or closed)."""
        same = self._unproven.get(conn.host, {})
        if conn in same:
            del same[conn]
            self._proving -= 1
            if not same:
                del self._unproven[conn.host]

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unwait(conn)
        conn.wait = None
        self._proven(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _note(self, line: str) -> None:
        """A line on the rank's diagnostics (the first ``_SAID``; the rest are only counted)."""
        self._said += 1
        if self._say is not None and self._said <= _SAID:
            self._say(line + ("" if self._said < _SAID else " (further ones only counted)"))

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self.refused += 1
        line = f"store refused a connection from {conn.peer}: {reason}"
        self.refusals.append(line)
        self._note(line)
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
                self._send(conn, auth.REFUSED)  # then hung up on: the client knows why
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
        self._proven(conn)
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
        try:
            frame = conn.session.seal(parts)
        except auth.TooLarge as exc:
            frame = conn.session.seal([b"error", f"the answer has {exc}".encode()])
        self._send(conn, frame)

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
            conn.wait = _Wait(op, keys)
            if not self._resume(conn) and timeout > 0:
                self._at(time.monotonic() + timeout / 1000, conn, conn.wait)
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
        for waiter in self._waiting.pop(key, {}):
            wait = waiter.wait
            if waiter.closed or wait is None:
                continue  # closed by an error while earlier waiters were answered
            wait.on = None
            self._guarded(waiter, self._resume, waiter)

    def _unwait(self, conn: _Conn) -> None:
        """Take the connection off the list of the key it waits for (timed out, or closed)."""
        if conn.wait is None or conn.wait.on is None:
            return
        listed = self._waiting.get(conn.wait.on, {})
        listed.pop(conn, None)
        if not listed:
            self._waiting.pop(conn.wait.on, None)
        conn.wait.on = None

    def _resume(self, conn: _Conn) -> bool:
        """Answer the connection's wait if its keys are all there (True); else list it under
        the first missing key.
        """
        wait = conn.wait
        assert wait is not None
        missing = next((k for k in wait.keys if k not in self._data), None)
        if missing is not None:
            wait.on = missing
            self._waiting.setdefault(missing, {})[conn] = None
            return False
        conn.wait = None
        values = [self._data[k] for k in wait.keys] if wait.op != b"wait" else []
        self._reply(conn, [b"ok", *values])
        self._process(conn)
        return True
