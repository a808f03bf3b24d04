"""TLS with the pool's own certificate: one self-signed certificate per pool, made in the
notebook (:mod:`skyward_jupyter.relay_keys`), trusted alone by the pool's ranks.

The relay (:mod:`.relay`) serves with it; a ``--secure`` pool's gloo tunnels
(:mod:`.gloo_tunnel`) use it on both ends, each proving it holds the key. TLS 1.3 only.
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile


def server_context(cert: str, key: str, clients_prove: bool = False) -> ssl.SSLContext:
    """Serve with the pool's certificate; ``clients_prove``: a client must present it too."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # every connection is new: nothing to resume
    _load_chain(context, (cert + key).encode())
    if clients_prove:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=cert)
    return context


def client_context(cert: str, key: str | None = None) -> ssl.SSLContext:
    """Trust the pool's certificate alone; with ``key``, also present it (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the pool's certificate alone is trusted: no name to check
    context.load_verify_locations(cadata=cert)
    if key is not None:
        _load_chain(context, (cert + key).encode())
    return context


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    """``load_cert_chain`` reads a file: an anonymous in-memory one (memfd) where the OS has
    them, so the key touches no disk; elsewhere a 0600 file in a 0700 directory, gone at once.
    """
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("sky-pool-key", os.MFD_CLOEXEC)
        try:
            _write_all(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="sky-pool-key-") as private:
        path = os.path.join(private, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, pem)
        finally:
            os.close(fd)
        try:
            context.load_cert_chain(path)
        finally:
            os.unlink(path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def read_exact(conn: socket.socket, n: int, before: str) -> bytes:
    """``n`` bytes from ``conn``; ``ConnectionError`` ("closed before ``before``") when it ends
    first (a TLS read returns at most one record, so a short read is normal).
    """
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed before {before}")
        data += chunk
    return bytes(data)
