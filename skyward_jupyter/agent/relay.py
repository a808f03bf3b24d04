"""The nodes' relays: what the notebook sends once, the nodes pass on among themselves.

Without them, a 1 GB global goes from the notebook to every node over the user's uplink, once
per node. With them, the notebook sends it to the head only
(:class:`~skyward_jupyter.protocol.Stash`) and the other nodes fetch it over the pool's own
network, in a tree: each node's first rank runs a relay, fetches the value from its parent's
(:class:`~skyward_jupyter.protocol.Fetch`) and serves it to its children, so no relay sends
more than two copies whatever the number of nodes. A parent that cannot serve (gone, or its own
fetch failed: its relay then answers "not here" at once) sends its children to the next relay
up, the head last.

Trust: the value's sha256 comes to every rank over its authenticated channel (the wire) with the
command that needs it, and a fetched blob is checked against it before it is unpickled, so the
relay can only deliver what the notebook sent. Who may read: every connection gets a fresh random
nonce and must answer HMAC(pool token, nonce + digest), so only the pool's ranks can ask and a
recorded request is worth nothing on a later connection. What others see: with the pool's
certificate (multi-host pools) the exchange runs in TLS, and clients trust that certificate
alone. Token, certificate and key reached the ranks over the wire (the key only each node's
first rank's, which serves). A relay hands the key to TLS through an anonymous in-memory file
(memfd, Linux), so it touches no disk; where the OS has none, through a 0600 file in a 0700
temporary directory, removed as soon as it is loaded.

Abuse: one thread serves every connection (a selector loop). A connection that has not made a
valid request within ``REQUEST_WITHIN`` seconds is dropped, at most ``MAX_UNANSWERED`` such
connections are held (the oldest makes room), and running out of descriptors pauses accepting
instead of ending it. An unexpected error is reported (the rank's diagnostics) and the loop
goes on: one client's drops that client, any other the round it happened in. Clients retry a
connection the relay dropped before answering, and take from it only a blob of the size the
notebook announced.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from . import pool_tls
from .accepting import CONNECTION_GONE, OUT_OF_DESCRIPTORS

_NONCE = 32
_REQUEST = struct.Struct("!64s32s")  # digest (64 hex), HMAC-SHA256(token, nonce + digest)
_LENGTH = struct.Struct("!q")  # -1: not found within the wait
_CHUNK = 1 << 20
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_DONE, _REQUESTED = 0, -1
"""What a connection's :meth:`~_Connection.pump` may return besides an event to wait for."""

MAX_UNANSWERED = 128
"""Connections held that have not made a valid request yet: a new one closes the oldest."""
REQUEST_WITHIN = 5.0
"""Seconds from accept to a complete request (handshake included); slower clients are dropped."""
SEND_STALL = 60.0
"""Seconds a client that asked may take no bytes before it is dropped."""
RETRY_WITHIN = 30.0
"""Seconds a client keeps retrying a relay that drops it before answering (it is busy)."""
SAID = 20
"""Lines the relay writes to the rank's diagnostics at most."""
_KEEPALIVE = (
    (socket.TCP_KEEPIDLE, 5),
    (socket.TCP_KEEPINTVL, 2),
    (socket.TCP_KEEPCNT, 3),
)
_GONE = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


class RelayError(Exception):
    """A blob could not be fetched: the message names the relays asked and what went wrong."""


@dataclass(frozen=True, slots=True)
class Source:
    """A relay a node fetches from: the node it runs on, and where it listens."""

    node: int
    address: str
    port: int

    def __str__(self) -> str:
        head = ", the head" if self.node == 0 else ""
        return f"node {self.node}{head} ({self.address}:{self.port})"


@dataclass(frozen=True, slots=True)
class RelayKeys:
    """The pool's relay secrets, from the notebook over the wire."""

    token: str = field(repr=False)
    cert: str | None = None
    """The pool's certificate (PEM): TLS, trusting it alone. None: cleartext."""
    key: str | None = field(default=None, repr=False)
    """Its private key (PEM), on the head only."""


class BlobStore:
    """The blobs the head holds for the others, by digest; a fetch waits for one in transit."""

    def __init__(self) -> None:
        self._blobs: dict[str, memoryview] = {}
        self._failed: set[str] = set()
        """Digests this node could not get: a client asking for one is told at once."""
        self._changed = threading.Condition()
        self._watchers: list[Callable[[], None]] = []

    def put(self, digest: str, blob: memoryview | bytes | bytearray) -> None:
        with self._changed:
            self._blobs[digest] = memoryview(blob).cast("B")
            self._changed.notify_all()
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher()

    def fail(self, digest: str) -> None:
        """This node will not have ``digest``: clients waiting for it go elsewhere."""
        with self._changed:
            self._failed.add(digest)
            self._changed.notify_all()
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher()

    def failed(self, digest: str) -> bool:
        with self._changed:
            return digest in self._failed

    def get(self, digest: str, timeout: float = 0.0) -> memoryview | None:
        with self._changed:
            self._changed.wait_for(lambda: digest in self._blobs or digest in self._failed, timeout)
            return self._blobs.get(digest)

    def drop(self, digests: tuple[str, ...]) -> None:
        with self._changed:
            for digest in digests:
                self._blobs.pop(digest, None)
                self._failed.discard(digest)

    def watch(self, watcher: Callable[[], None]) -> None:
        """Call ``watcher`` (from the putting thread) after every put."""
        with self._changed:
            self._watchers.append(watcher)


def ancestors(position: int) -> list[int]:
    """Where the node at ``position`` in a binary tree of relays (0: the root) fetches from:
    its parent first, then the parent's ancestors up to the root, where it turns when a parent
    cannot serve.
    """
    chain = []
    while position:
        position = (position - 1) // 2
        chain.append(position)
    return chain


def _mac(token: str, nonce: bytes, digest: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + digest, hashlib.sha256).digest()


class _Connection:
    """One client's exchange, moved on by the relay's loop as far as its socket allows:
    TLS handshake, our nonce out, its request in, then (once answered) the length and blob.
    """

    def __init__(self, sock: socket.socket, deadline: float, handshake: bool) -> None:
        self.sock = sock
        self.deadline = deadline
        self.nonce = secrets.token_bytes(_NONCE)
        self.request = bytearray()
        self.digest = ""
        self.answered = False
        self.events = 0
        self._handshake = handshake
        self._out = [memoryview(self.nonce)]

    def answer(self, blob: memoryview | None, now: float) -> None:
        self._out = [memoryview(_LENGTH.pack(-1 if blob is None else blob.nbytes))]
        if blob is not None and blob.nbytes:
            self._out.append(blob)
        self.answered = True
        self.deadline = now + SEND_STALL

    def pump(self) -> int:
        """The event to wait for; ``_REQUESTED`` when the request is in and wants an answer;
        ``_DONE`` when the exchange is over (answered, or the client left).
        """
        if self._handshake:
            try:
                self.sock.do_handshake()  # type: ignore[attr-defined]
            except ssl.SSLWantReadError:
                return _READ
            except ssl.SSLWantWriteError:
                return _WRITE
            self._handshake = False
        while self._out:
            try:
                sent = self.sock.send(self._out[0][:_CHUNK])
            except (BlockingIOError, ssl.SSLWantWriteError):
                return _WRITE
            except ssl.SSLWantReadError:
                return _READ
            self._out[0] = self._out[0][sent:]
            if not self._out[0].nbytes:
                self._out.pop(0)
            if self.answered:
                self.deadline = time.monotonic() + SEND_STALL
        if self.answered:
            return _DONE
        while len(self.request) < _REQUEST.size:
            try:
                chunk = self.sock.recv(_REQUEST.size - len(self.request))
            except (BlockingIOError, ssl.SSLWantReadError):
                return _READ
            except ssl.SSLWantWriteError:
                return _WRITE
            if not chunk:
                return _DONE
            self.request += chunk
        return _REQUESTED


class RelayServer:
    """Serves the store's blobs to ranks that prove they hold the pool's token; one thread."""

    def __init__(
        self,
        store: BlobStore,
        address: str,
        keys: RelayKeys,
        say: Callable[[str], None],
        wait: float = 600.0,
    ) -> None:
        self.store = store
        self._tell = say
        """Where an unexpected error goes (the rank's diagnostics)."""
        self._said = 0
        self._failures = 0
        """Rounds of the loop in a row that failed."""
        self._token = keys.token
        self._wait = wait
        self._tls = pool_tls.server_context(keys.cert, keys.key) if keys.cert and keys.key else None
        self._listener = socket.create_server((address, 0), backlog=128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, _READ)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector.register(self._wake_in, _READ)
        self._unanswered: dict[_Connection, None] = {}
        """Connections without a valid request yet, oldest first."""
        self._parked: list[_Connection] = []
        """Connections that asked for a blob not here yet."""
        self._open: set[_Connection] = set()
        self._paused_until = 0.0
        self._backoff = 0.0
        store.watch(self._wake)
        threading.Thread(target=self._loop, name="relay", daemon=True).start()

    def _say(self, line: str) -> None:
        """A line on the rank's diagnostics: the first ``SAID`` only, so that a failure
        repeating every round cannot fill them.
        """
        self._said += 1
        if self._said <= SAID:
            self._tell(line + ("" if self._said < SAID else " (further ones not said)"))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the loop has wake-ups pending already
            self._wake_out.send(b"\0")

    def _loop(self) -> None:
        """Serve until the process ends: an error in a round is said, and the next one runs
        (a dead loop would fail every later relayed value, far from the cause).
        """
        while True:
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001 - said; the loop must go on
                self._failures += 1
                self._say(f"the relay failed in its loop and goes on: {_described(exc)}")
                # The same failure every round must not spin: each waits longer, up to 1 s.
                time.sleep(min(0.01 * 2**self._failures, 1.0))
            else:
                self._failures = 0

    def _round(self) -> None:
        """Wait for the sockets or the next deadline, then move every exchange on."""
        now = time.monotonic()
        timeout = min([c.deadline for c in self._open], default=now + 1.0) - now
        if self._paused_until:
            timeout = min(timeout, self._paused_until - now)
        for key, _ in self._selector.select(max(timeout, 0.0) + 0.01):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_in:
                self._drain_wake()
            else:
                self._step(key.data)
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, _READ)
        self._unpark(now)
        for conn in [c for c in self._open if c.deadline <= now and c not in self._parked]:
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # then the open connections get their turn
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in CONNECTION_GONE:
                    continue  # that client gave up while it waited
                if exc.errno not in OUT_OF_DESCRIPTORS and not self._backoff:
                    self._say(f"the relay could not accept a connection: {_described(exc)}")
                # The waiting client stays in the backlog: try again later, not at once.
                self._backoff = min(max(self._backoff * 2, 0.05), 1.0)
                self._paused_until = time.monotonic() + self._backoff
                self._selector.unregister(self._listener)
                return
            self._backoff = 0.0
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError:
            sock.close()
            return
        conn = _Connection(sock, time.monotonic() + REQUEST_WITHIN, self._tls is not None)
        self._open.add(conn)
        self._unanswered[conn] = None
        if len(self._unanswered) > MAX_UNANSWERED:
            self._close(next(iter(self._unanswered)))
        self._step(conn)

    def _step(self, conn: _Connection) -> None:
        if conn not in self._open:
            return  # closed earlier in this round (evicted, or timed out)
        try:
            want = conn.pump()
            if want == _REQUESTED:
                want = self._take_request(conn)
            if want == _DONE:
                self._close(conn)
            elif want == _REQUESTED:  # parked until its blob arrives
                self._listen(conn, 0)
            else:
                self._listen(conn, want)
        except OSError:  # reset, a TLS alert, garbage instead of a handshake
            self._close(conn)
        except Exception as exc:  # noqa: BLE001 - said; the other clients go on being served
            self._say(f"the relay dropped a client after an unexpected error: {_described(exc)}")
            self._close(conn)

    def _take_request(self, conn: _Connection) -> int:
        digest, mac = _REQUEST.unpack(conn.request)
        if not hmac.compare_digest(mac, _mac(self._token, conn.nonce, digest)):
            return _DONE  # not the pool's, or a replay: nothing, not even a reason
        del self._unanswered[conn]
        conn.digest = digest.decode("ascii", "replace")
        blob = self.store.get(conn.digest)
        now = time.monotonic()
        if blob is None and not self.store.failed(conn.digest):
            conn.deadline = now + self._wait
            self._parked.append(conn)
            return _REQUESTED
        conn.answer(blob, now)
        return conn.pump()

    def _unpark(self, now: float) -> None:
        for conn in list(self._parked):
            blob = self.store.get(conn.digest)
            if blob is not None or conn.deadline <= now or self.store.failed(conn.digest):
                self._parked.remove(conn)
                conn.answer(blob, now)
                self._step(conn)

    def _listen(self, conn: _Connection, events: int) -> None:
        if events == conn.events:
            return
        if not conn.events:
            self._selector.register(conn.sock, events, conn)
        elif not events:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Connection) -> None:
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        self._unanswered.pop(conn, None)
        if conn in self._parked:
            self._parked.remove(conn)
        self._open.discard(conn)
        conn.sock.close()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_in.recv(4096):
                pass


def _described(exc: Exception) -> str:
    """The error and the line that raised it: what a report of a bug needs."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{exc!r}{where}"


def fetch(
    sources: tuple[Source, ...],
    keys: RelayKeys,
    digest: str,
    nbytes: int,
    timeout: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> bytearray:
    """The blob ``digest`` of ``nbytes`` bytes from the first of ``sources`` that serves it
    whole (the node's parent first, the head last), checked against its digest; ``progress``
    is told the bytes received so far from the source being read, as they come.
    """
    tried = []
    for source in sources:
        try:
            return _fetch_from(source, keys, digest, nbytes, timeout, progress)
        except RelayError as exc:
            tried.append(str(exc))
    raise RelayError("; ".join(tried) or "no relay to fetch from")


def _fetch_from(
    source: Source,
    keys: RelayKeys,
    digest: str,
    nbytes: int,
    timeout: float,
    progress: Callable[[int], None] | None,
) -> bytearray:
    """The blob from one relay. The length the relay announces is taken only if it is
    ``nbytes`` (it is not authenticated: room for whatever it said would be a way to exhaust
    the rank's memory). A relay that drops the connection before answering (busy, or flooded)
    is asked again for a while; one that is gone, says it has not the blob, or stops mid-way
    is not.
    """
    where = str(source)
    head = (source.address, source.port)
    context = pool_tls.client_context(keys.cert) if keys.cert else None
    started = time.monotonic()
    delay = 0.05
    while True:
        try:
            blob = _fetch_once(head, keys, digest, nbytes, context, timeout, where, progress)
            break
        except ssl.SSLCertVerificationError:
            raise RelayError(
                f"the relay of {where} does not hold the pool's certificate; not fetched"
            ) from None
        except OSError as exc:
            late = time.monotonic() + delay - started > RETRY_WITHIN
            gone = exc.errno in _GONE or isinstance(exc, (_Answered, TimeoutError, socket.gaierror))
            if gone or late:
                raise RelayError(
                    f"cannot fetch a value from the relay of {where} "
                    f"after {time.monotonic() - started:.0f} s: {exc.strerror or exc}"
                ) from None
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    if hashlib.sha256(blob).hexdigest() != digest:
        raise RelayError(f"the value fetched from {where} does not match its digest; not loaded")
    return blob


class _Answered(OSError):
    """The relay answered, then the transfer failed: asking again would not help."""


def _fetch_once(
    head: tuple[str, int],
    keys: RelayKeys,
    digest: str,
    nbytes: int,
    context: ssl.SSLContext | None,
    timeout: float,
    where: str,
    progress: Callable[[int], None] | None,
) -> bytearray:
    with socket.create_connection(head, timeout=10) as plain:
        # A relay's host gone while this waits for its blob (no reset comes) is found in seconds.
        plain.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in _KEEPALIVE:
            plain.setsockopt(socket.IPPROTO_TCP, option, value)
        conn = plain if context is None else context.wrap_socket(plain)
        with conn:
            conn.settimeout(2 * REQUEST_WITHIN)
            nonce = pool_tls.read_exact(conn, _NONCE, "answering")
            conn.sendall(_REQUEST.pack(digest.encode(), _mac(keys.token, nonce, digest.encode())))
            conn.settimeout(timeout)
            (length,) = _LENGTH.unpack(pool_tls.read_exact(conn, _LENGTH.size, "answering"))
            if length < 0:
                raise RelayError(f"the relay of {where} does not have {digest[:12]}")
            if length != nbytes:
                raise RelayError(
                    f"the relay of {where} offered {length} bytes for a value of {nbytes} "
                    f"({digest[:12]}); not fetched: is something other than the pool's relay "
                    "on that port?"
                )
            conn.settimeout(SEND_STALL)  # the blob is there: a stall is a relay gone mid-way
            blob = bytearray(length)
            view = memoryview(blob)
            got = 0
            while got < length:
                try:
                    n = conn.recv_into(view[got:], min(_CHUNK, length - got))
                except OSError as exc:
                    raise _Answered(exc.errno, exc.strerror or str(exc)) from None
                if n == 0:
                    raise _Answered(0, f"closed after {got} of {length} bytes")
                got += n
                if progress is not None:
                    progress(got)
    return blob
