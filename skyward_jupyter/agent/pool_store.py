"""The rank's side of the pool's rendezvous store: a ``torch.distributed.Store`` that reaches the
head's :class:`~.store_server.StoreServer` over an authenticated connection (:mod:`.store_auth`).

torch takes it wherever it takes a store (``init_process_group(store=...)``, ``PrefixStore``,
``new_group``, gloo's and NCCL's rendezvous), through the methods below. One request is in
flight per connection at a time, as with TCPStore's client; ``clone`` opens another connection.
"""

from __future__ import annotations

import datetime
import random
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from . import store_auth as auth

if TYPE_CHECKING:
    from .gloo_tunnel import GlooTunnel
    from .store_server import StoreServer

CONNECT_TIMEOUT = 10.0
"""Seconds to connect to the head and prove the secret."""
RETRY_FIRST = 0.01
RETRY_LAST = 1.0
"""Seconds between connections made again after the store dropped one before its proof:
doubling from the first to the last, each randomised by half."""
ANSWER_GRACE = 30.0
"""Seconds a waiting request's answer may arrive after its own deadline (the server answers a
timeout itself; past this grace the head is taken as gone)."""


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class PoolStore(dist.Store):  # type: ignore[misc,name-defined]
    """The pool's store at ``host:port``, for a holder of ``secret``."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        timeout: datetime.timedelta,
        server: StoreServer | None = None,
        tunnel: GlooTunnel | None = None,
    ) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self.server = server
        """On the head: the server it hosts (its ``refused`` counts connections it dropped)."""
        self.tunnel = tunnel
        """A ``--secure`` pool's: gloo's addresses pass through it (see :mod:`.gloo_tunnel`)."""
        self._secret = secret
        self._lock = threading.Lock()
        self.set_timeout(timeout)
        self._sock, self._session = self._connect()

    def _where(self) -> str:
        return f"the pool's rendezvous store at {self.host}:{self.port}"

    def _connect(self) -> tuple[socket.socket, auth.Session]:
        """Connect and prove the secret. A connection the store closes before its proof (it
        drops the oldest when too many prove at once, as every rank connects together) is
        made again, as TCPStore's client does, within the store's timeout.
        """
        started = time.monotonic()
        seconds = self.timeout.total_seconds()
        deadline = started + (seconds if seconds > 0 else CONNECT_TIMEOUT)
        pause = RETRY_FIRST
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT)
            except OSError as exc:
                raise dist.DistStoreError(f"cannot reach {self._where()}: {exc}") from None
            try:
                return sock, self._prove(sock)
            except auth.Rejected as exc:
                sock.close()
                raise dist.DistStoreError(f"{self._where()} {exc}; run %sky restart") from None
            except OSError as exc:
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise dist.DistStoreError(
                        f"{self._where()} dropped every connection of this rank before its "
                        f"proof, for {time.monotonic() - started:.0f} s (last: {exc}); the "
                        "head is overloaded, flooded with connections or gone: run %sky restart"
                    ) from None
                time.sleep(pause * random.uniform(0.5, 1.5))
                pause = min(RETRY_LAST, pause * 2)

    def _prove(self, sock: socket.socket) -> auth.Session:
        """The handshake (see :mod:`.store_auth`); :class:`auth.Rejected` when the proofs
        themselves fail, ``OSError`` when the connection ends before them.
        """
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _receive(sock, auth.HELLO)
        if hello[: len(auth.MAGIC)] != auth.MAGIC:
            raise auth.Rejected("does not speak the store's protocol (another service there?)")
        server_nonce, client_nonce = hello[len(auth.MAGIC) :], auth.nonce()
        sock.sendall(client_nonce + auth.client_proof(self._secret, server_nonce, client_nonce))
        proof = _receive(sock, auth.TAG)
        if proof == auth.REFUSED:
            raise auth.Rejected("refused this rank's proof: the pool's secret did not match")
        try:
            auth.check(auth.server_proof(self._secret, server_nonce, client_nonce), proof)
        except auth.Rejected:
            raise auth.Rejected(
                "answered with a proof of another secret (another pool's store?): the pool's "
                "secret did not match"
            ) from None
        return auth.Session(self._secret, server_nonce, client_nonce, client=True)

    def _call(self, parts: Sequence[bytes], waits: float | None = None) -> list[bytes]:
        """Send a request and return its answer; ``waits``: seconds the server may hold it."""
        with self._lock:
            if self._sock.fileno() < 0:
                raise dist.DistStoreError(f"{self._where()} was lost earlier; run %sky restart")
            try:
                frame = self._session.seal(parts)
            except auth.TooLarge as exc:
                raise dist.DistStoreError(
                    f"{self._where()} cannot take a request of {exc}"
                ) from None
            limit = self.timeout.total_seconds() if waits is None else waits
            self._sock.settimeout(None if limit <= 0 else limit + ANSWER_GRACE)
            try:
                self._sock.sendall(frame)
                head = _receive(self._sock, auth.HEAD)
                rest = _receive(self._sock, auth.frame_length(head) + auth.TAG)
                answer = self._session.open(head, rest[: -auth.TAG], rest[-auth.TAG :])
            except (OSError, auth.Rejected) as exc:
                self._sock.close()
                raise dist.DistStoreError(f"lost {self._where()}: {exc}") from None
        if answer[0] == b"timeout":
            keys = [k.decode(errors="replace") for k in parts[2:]]
            raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
        if answer[0] == b"error":
            raise dist.DistStoreError(f"{self._where()}: {answer[1].decode(errors='replace')}")
        return answer[1:]

    def _waiting(
        self, op: bytes, keys: Sequence[str], timeout: datetime.timedelta | None
    ) -> list[bytes]:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        millis = str(max(0, round(seconds * 1000))).encode()
        return self._call([op, millis, *map(_bytes, keys)], waits=seconds)

    # ------------------------------------------------------------------- torch's Store

    def set(self, key: str, value: str | bytes) -> None:
        self._call([b"set", _bytes(key), self._published(key, _bytes(value))])

    def get(self, key: str) -> bytes:
        return self._fetched(key, self._waiting(b"get", [key], None)[0])

    def add(self, key: str, value: int) -> int:
        return int(self._call([b"add", _bytes(key), str(int(value)).encode()])[0])

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        return self._call(
            [b"compare_set", _bytes(key), _bytes(expected_value), _bytes(desired_value)]
        )[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call([b"append", _bytes(key), _bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._waiting(b"multi_get", keys, None)
        return [self._fetched(k, v) for k, v in zip(keys, values, strict=True)]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        published = [self._published(k, _bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._call([b"multi_set", *map(_bytes, keys), *published])

    def has_extended_api(self) -> bool:
        return True

    def check(self, keys: list[str]) -> bool:
        return self._call([b"check", *map(_bytes, keys)])[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._waiting(b"wait", keys, timeout)

    def num_keys(self) -> int:
        return int(self._call([b"num_keys"])[0])

    def delete_key(self, key: str) -> bool:
        return self._call([b"delete_key", _bytes(key)])[0] == b"1"

    def clone(self) -> PoolStore:
        return PoolStore(self.host, self.port, self._secret, self.timeout, tunnel=self.tunnel)

    def _published(self, key: str, value: bytes) -> bytes:
        return value if self.tunnel is None else self.tunnel.published(key, value)

    def _fetched(self, key: str, value: bytes) -> bytes:
        return value if self.tunnel is None else self.tunnel.fetched(key, value)

    def close(self) -> None:
        """Close the connection (and, on the head, stop the server)."""
        with self._lock:
            self._sock.close()
        if self.server is not None:
            self.server.close()


def _receive(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)
