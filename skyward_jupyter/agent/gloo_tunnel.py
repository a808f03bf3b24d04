"""A ``--secure`` pool's gloo traffic between hosts, through mutual TLS with the pool's key.

gloo connects its ranks directly, in cleartext, to a port each rank listens on, and accepts
whoever connects. In a secure pool each rank's gloo listens on loopback only
(``GLOO_SOCKET_IFNAME=lo``), and each rank runs a tunnel: a TLS server on its host's pool
address, and, for every peer on another host, a loopback port whose connections it carries to
that peer's tunnel. Both ends prove the pool's key (:mod:`.pool_tls`); a tunnel forwards only to
its own rank's gloo ports.

The rewiring happens in the pool's store (:class:`.pool_store.PoolStore`), where gloo publishes
each rank's address (its ``Rank`` record: hostname, a 136-byte ``sockaddr_storage`` and sequence
number, pair identifiers). What a rank publishes is turned from ``127.0.0.1:<gloo port>`` into its
host's address and its tunnel's port; what a rank reads back is turned into a loopback address:

- a peer on the same host: that peer's ``127.0.0.1:<gloo port>``, as without tunnels;
- a peer elsewhere that this rank dials: a tunnel port on ``127.0.0.0``;
- a peer elsewhere that dials this rank: ``127.0.0.2`` (never dialled).

gloo picks which side of a pair dials by comparing the two addresses it holds (the side whose
own address is larger dials). The two addresses above are chosen so that both sides agree: the
side whose host address and gloo port are larger dials, seeing its peer below its own
``127.0.0.1``; the other sees its peer above it and waits.

Loopback is open to every process of the host: a dial port carries only a connection whose
socket is this process's own (gloo's), never another process's (another user's would reach the
peer's gloo with the pool's key).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from . import pool_tls
from .network import from_this_process

MARK = b"skyward-tunnel\x00\x00"
"""Written into the unused tail of a published ``sockaddr_storage``: this record is tunnelled."""
ADDRESS_SIZE = 136  # sockaddr_storage (128) and gloo's sequence number (8)
_SOCKADDR_IN = struct.Struct("=H2s4s8x")  # family (host order), port and address (network order)
_PORT = struct.Struct("!H")
_LENGTH = struct.Struct("=Q")  # size_t, as gloo serialises lengths
DIAL = "127.0.0.0"
"""The loopback address of this rank's ports to peers it dials (below gloo's 127.0.0.1)."""
WAIT = "127.0.0.2"
"""Where a peer that dials this rank appears to be (above gloo's 127.0.0.1): never dialled."""
HANDSHAKE_WITHIN = 10.0
"""Seconds a connection to a tunnel has to prove the pool's key and name its gloo port."""
MAX_HANDSHAKES = 64
"""Connections proving themselves at once, each on its own thread. Past that, the oldest of the
address with the most is dropped: connections held open from one host drop their own."""
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class _Published:
    host: bytes
    gloo_port: int
    tunnel_port: int


def _address_offset(value: bytes) -> int | None:
    """Where the ``sockaddr_storage`` of gloo's ``Rank`` record ``value`` starts, or None when
    ``value`` is not one holding an IPv4 address.
    """
    if len(value) < 2 * _LENGTH.size:
        return None
    (name_length,) = _LENGTH.unpack_from(value, 0)
    if name_length > 1024 or len(value) < 2 * _LENGTH.size + name_length + ADDRESS_SIZE:
        return None
    (address_length,) = _LENGTH.unpack_from(value, _LENGTH.size + name_length)
    offset = 2 * _LENGTH.size + name_length
    if address_length != ADDRESS_SIZE or (len(value) - offset - ADDRESS_SIZE) % 8:
        return None
    family = _SOCKADDR_IN.unpack_from(value, offset)[0]
    return offset if family == socket.AF_INET else None


def _with_address(value: bytes, offset: int, host: bytes, port: int, tail: bytes) -> bytes:
    """``value`` with its address set to ``host:port`` and ``tail`` after the ``sockaddr_in``."""
    record = bytearray(value)
    record[offset : offset + _SOCKADDR_IN.size] = _SOCKADDR_IN.pack(
        socket.AF_INET, _PORT.pack(port), host
    )
    start = offset + _SOCKADDR_IN.size
    record[start : start + len(MARK) + _PORT.size] = tail.ljust(len(MARK) + _PORT.size, b"\0")
    return bytes(record)


class GlooTunnel:
    """This rank's tunnel, serving on ``address`` (its host's pool address)."""

    def __init__(
        self, address: str, cert: str, key: str, say: Callable[[str], None] | None = None
    ) -> None:
        self.address = address
        self._host = socket.inet_aton(address)
        self._say = say
        self._server_tls = pool_tls.server_context(cert, key, clients_prove=True)
        self._client_tls = pool_tls.client_context(cert, key)
        self._lock = threading.Lock()
        self._gloo_ports: set[int] = set()
        """This rank's gloo listeners: the only ports the tunnel forwards to."""
        self._own: dict[str, tuple[bytes, int]] = {}
        """Per store prefix (one per group): this rank's published host and gloo port."""
        self._dials: dict[tuple[bytes, int, int], socket.socket] = {}
        """Per peer (host, tunnel port, gloo port): the loopback port gloo dials it through."""
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._proving: dict[str, dict[ssl.SSLSocket, None]] = {}
        """Connections still proving the pool's key, by their address, oldest first."""
        self._proving_count = 0
        self._listener = socket.create_server((address, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, name="tunnel", daemon=True).start()

    # --------------------------------------------------------------- the store's records

    def published(self, key: str, value: bytes) -> bytes:
        """What the store keeps for ``value`` set under ``key``: gloo's own record on loopback
        becomes this host's address and tunnel port; anything else is kept as it is.
        """
        offset = _address_offset(value)
        if offset is None:
            return value
        _, port, host = _SOCKADDR_IN.unpack_from(value, offset)
        if host != socket.inet_aton("127.0.0.1"):
            return value
        gloo_port = _PORT.unpack(port)[0]
        with self._lock:
            self._gloo_ports.add(gloo_port)
            self._own[_prefix(key)] = (self._host, gloo_port)
        return _with_address(value, offset, self._host, gloo_port, MARK + _PORT.pack(self.port))

    def fetched(self, key: str, value: bytes) -> bytes:
        """What gloo reads for ``value`` fetched from ``key``: a peer's loopback address (see the
        module's description).
        """
        peer = _peer(value)
        if peer is None:
            return value
        offset, published = peer
        if published.host == self._host:
            return _with_address(
                value, offset, socket.inet_aton("127.0.0.1"), published.gloo_port, b""
            )
        with self._lock:
            own = self._own.get(_prefix(key))
        if own is None:
            # gloo publishes its own record before it reads any peer's; a read without one is
            # not gloo's (the user's code reading the store): it gets the record as stored
            return value
        if own > (published.host, published.gloo_port):
            port = self._dial_port(published)
            return _with_address(value, offset, socket.inet_aton(DIAL), port, b"")
        return _with_address(value, offset, socket.inet_aton(WAIT), published.gloo_port, b"")

    def _dial_port(self, peer: _Published) -> int:
        """The loopback port whose connection goes to ``peer``'s gloo (opened on first use,
        until that connection).
        """
        where = (peer.host, peer.tunnel_port, peer.gloo_port)
        with self._lock:
            listener = self._dials.get(where)
            if listener is None:
                listener = socket.create_server((DIAL, 0), backlog=16)
                self._dials[where] = listener
                threading.Thread(
                    target=self._carry_out,
                    args=(listener, peer, where),
                    name="tunnel",
                    daemon=True,
                ).start()
            return int(listener.getsockname()[1])

    def forget(self) -> None:
        """The group is gone: stop carrying its connections' successors (the next formation
        publishes new ports).
        """
        with self._lock:
            dials, self._dials = list(self._dials.values()), {}
            self._gloo_ports.clear()
            self._own.clear()
        for listener in dials:
            listener.close()

    # --------------------------------------------------------------------- the traffic

    def _carry_out(
        self, listener: socket.socket, peer: _Published, where: tuple[bytes, int, int]
    ) -> None:
        """Carry the connection gloo makes to ``listener`` to ``peer``'s tunnel. A gloo pair
        connects once: the port closes then, so a group the code forms and destroys again and
        again leaves no port and no thread behind.
        """
        target = (socket.inet_ntoa(peer.host), peer.tunnel_port)
        try:
            local = self._gloos(listener)
        except OSError:
            return  # closed by forget()
        finally:
            with self._lock:
                if self._dials.get(where) is listener:
                    del self._dials[where]
            listener.close()
        try:
            remote = socket.create_connection(target, timeout=HANDSHAKE_WITHIN)
            remote.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            secured = self._client_tls.wrap_socket(remote)
            secured.sendall(_PORT.pack(peer.gloo_port))
            secured.settimeout(None)
        except OSError as exc:
            self._note(f"cannot reach the tunnel of the rank at {target[0]}:{target[1]}: {exc}")
            local.close()
            return
        _join(local, secured)

    def _gloos(self, listener: socket.socket) -> socket.socket:
        """The first connection to ``listener`` that this rank's gloo made: loopback is open to
        every user of the host, and another's would be carried into a peer's gloo with the
        pool's key. The others are closed (the first one said).
        """
        refused = 0
        while True:
            local, (address, port) = listener.accept()
            ours = from_this_process(local)
            if ours:
                return local
            local.close()
            refused += 1
            if refused == 1:
                why = (
                    "it is not this rank's gloo (another process of this host)"
                    if ours is False
                    else "this host's /proc cannot tell whose it is (/proc/self/net/tcp)"
                )
                self._note(
                    f"refused a connection from {address}:{port} to a tunnel's port on "
                    f"loopback: {why}"
                )

    def _serve(self) -> None:
        while True:
            try:
                conn, (address, _) = self._listener.accept()
            except OSError as exc:
                if self._listener.fileno() < 0:
                    return
                self._note(f"tunnel accept failed: {exc}")
                continue
            try:
                conn.settimeout(HANDSHAKE_WITHIN)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # no handshake yet: that is the connection's own thread's
                secured = self._server_tls.wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False
                )
            except OSError:
                conn.close()  # gone already
                continue
            with self._lock:
                if self._proving_count >= MAX_HANDSHAKES:
                    self._drop(max(self._proving.values(), key=len))
                self._proving.setdefault(address, {})[secured] = None
                self._proving_count += 1
            self._handshakes.acquire()  # a dropped handshake's thread ends at once
            threading.Thread(
                target=self._admit, args=(secured, address), name="tunnel", daemon=True
            ).start()

    def _drop(self, same: dict[ssl.SSLSocket, None]) -> None:
        """Hang up on the oldest of ``same``, connections proving the key (holding the lock)."""
        oldest = next(iter(same))
        self._proven(oldest, same)
        with contextlib.suppress(OSError):
            # the socket's own shutdown, not SSLSocket's: its handshake runs on another thread
            socket.socket.shutdown(oldest, socket.SHUT_RDWR)

    def _proven(self, secured: ssl.SSLSocket, same: dict[ssl.SSLSocket, None]) -> None:
        """Out of the connections proving the key (holding the lock)."""
        if secured in same:
            del same[secured]
            self._proving_count -= 1

    def _admit(self, secured: ssl.SSLSocket, address: str) -> None:
        """Prove the pool's key both ways, read the gloo port asked for, and carry the rest."""
        try:
            secured.do_handshake()
            (port,) = _PORT.unpack(pool_tls.read_exact(secured, _PORT.size, "naming a port"))
            with self._lock:
                self._proven(secured, self._proving.get(address, {}))
                ours = port in self._gloo_ports
            if not ours:
                secured.close()
                return
            local = socket.create_connection(("127.0.0.1", port), timeout=HANDSHAKE_WITHIN)
            secured.settimeout(None)
        except OSError:
            secured.close()  # not the pool's, or gone: nothing to carry
            return
        finally:
            with self._lock:
                same = self._proving.get(address, {})
                self._proven(secured, same)
                if not same:
                    self._proving.pop(address, None)
            self._handshakes.release()
        _join(local, secured)

    def _note(self, line: str) -> None:
        if self._say is not None:
            self._say(line)

    def close(self) -> None:
        self.forget()
        self._listener.close()


def _peer(value: bytes) -> tuple[int, _Published] | None:
    offset = _address_offset(value)
    if offset is None:
        return None
    start = offset + _SOCKADDR_IN.size
    if value[start : start + len(MARK)] != MARK:
        return None
    _, port, host = _SOCKADDR_IN.unpack_from(value, offset)
    (tunnel_port,) = _PORT.unpack_from(value, start + len(MARK))
    return offset, _Published(host, _PORT.unpack(port)[0], tunnel_port)


def _prefix(key: str) -> str:
    """The group's part of a gloo key (``<prefix>/<rank>``)."""
    return key.rpartition("/")[0]


def _join(local: socket.socket, secured: socket.socket) -> None:
    """Carry bytes both ways between gloo's connection and the tunnel until either ends."""
    local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    local.settimeout(None)
    pair = _Pair(local, secured)
    for source, sink in ((local, secured), (secured, local)):
        threading.Thread(target=pair.pump, args=(source, sink), name="tunnel", daemon=True).start()


class _Pair:
    """gloo's connection and its tunnel: when either direction ends, both end (gloo sees its
    peer gone), and the last pump out closes them.
    """

    def __init__(self, local: socket.socket, secured: socket.socket) -> None:
        self._sockets = (local, secured)
        self._running = 2
        self._lock = threading.Lock()

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        try:
            while n := source.recv_into(view):
                sink.sendall(view[:n])
        except OSError:
            pass  # either side ended (ssl.SSLError is an OSError): both end below
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                # the socket's own shutdown: SSLSocket's drops its TLS first, and a send the
                # other direction made meanwhile would go out in cleartext
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            for sock in self._sockets:
                sock.close()
