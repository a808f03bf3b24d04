"""The head's relay: what the notebook sends once, the other ranks fetch from the head.

Without it, a 1 GB global goes from the notebook to every node over the user's uplink, once per
node. With it, the notebook sends it to the head only (:class:`~skyward_jupyter.protocol.Stash`)
and the others fetch it over the pool's own network.

Trust: the value's sha256 comes to every rank over its authenticated channel (the wire) with the
command that needs it, and a fetched blob is checked against it before it is unpickled, so the
relay can only deliver what the notebook sent. A per-pool token (which reached the ranks over the
wire too) keeps others on the network from reading the blobs. The relay listens only on the
head's pool address.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct
import threading
import time

_REQUEST = struct.Struct("!32s64s")  # token (32 bytes), digest (64 hex)
_LENGTH = struct.Struct("!q")  # -1: not found within the wait
_CHUNK = 1 << 20


class RelayError(Exception):
    """A blob could not be fetched: the message names the head and what went wrong."""


class BlobStore:
    """The blobs the head holds for the others, by digest; a fetch waits for one in transit."""

    def __init__(self) -> None:
        self._blobs: dict[str, memoryview] = {}
        self._changed = threading.Condition()

    def put(self, digest: str, blob: memoryview | bytes) -> None:
        with self._changed:
            self._blobs[digest] = memoryview(blob).cast("B")
            self._changed.notify_all()

    def get(self, digest: str, timeout: float = 0.0) -> memoryview | None:
        with self._changed:
            self._changed.wait_for(lambda: digest in self._blobs, timeout)
            return self._blobs.get(digest)

    def drop(self, digests: tuple[str, ...]) -> None:
        with self._changed:
            for digest in digests:
                self._blobs.pop(digest, None)


class RelayServer:
    """Serves the store's blobs to ranks that present the pool's token."""

    def __init__(self, store: BlobStore, address: str, token: str, wait: float = 600.0) -> None:
        self.store = store
        self._token = hashlib.sha256(token.encode()).digest()
        self._wait = wait
        self._listener = socket.create_server((address, 0), backlog=128)
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(conn,), name="relay", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a client that went away needs nothing more
            conn.settimeout(30)
            request = _read_exact(conn, _REQUEST.size)
            token, digest = _REQUEST.unpack(request)
            if not hmac.compare_digest(token, self._token):
                return
            blob = self.store.get(digest.decode(), self._wait)
            if blob is None:
                conn.sendall(_LENGTH.pack(-1))
                return
            conn.settimeout(None)
            conn.sendall(_LENGTH.pack(blob.nbytes))
            conn.sendall(blob)


def fetch(head: tuple[str, int], token: str, digest: str, timeout: float = 600.0) -> bytearray:
    """The blob ``digest`` from the head's relay, checked against its digest."""
    where = f"{head[0]}:{head[1]}"
    started = time.monotonic()
    try:
        with socket.create_connection(head, timeout=10) as conn:
            conn.settimeout(timeout)
            token_hash = hashlib.sha256(token.encode()).digest()
            conn.sendall(_REQUEST.pack(token_hash, digest.encode()))
            (length,) = _LENGTH.unpack(_read_exact(conn, _LENGTH.size))
            if length < 0:
                raise RelayError(f"the head's relay at {where} does not have {digest[:12]}")
            blob = bytearray(length)
            view = memoryview(blob)
            got = 0
            while got < length:
                n = conn.recv_into(view[got:], min(_CHUNK, length - got))
                if n == 0:
                    raise RelayError(f"the head's relay at {where} closed after {got} bytes")
                got += n
    except OSError as exc:
        raise RelayError(
            f"cannot fetch a value from the head's relay at {where} "
            f"after {time.monotonic() - started:.0f} s: {exc.strerror or exc}"
        ) from None
    if hashlib.sha256(blob).hexdigest() != digest:
        raise RelayError(f"the value fetched from {where} does not match its digest; not loaded")
    return blob


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed early")
        data += chunk
    return bytes(data)
