"""The rendezvous store's wire: a proof of the pool's secret, then authenticated frames.

Whoever can reach the head's port (on a local pool, every user of the machine; on a network, every
host on it) could otherwise read and write the keys the process group forms through, and poison
the addresses the ranks connect to. The notebook makes a fresh secret for each formation and
sends it down each rank's own channel (never a command line, never the environment).

A connection starts with the server's nonce; the client answers with its own nonce and an HMAC
of both under the secret, the server with its own HMAC (so each side knows the other holds the
secret; a recorded answer is worthless against the next connection's nonce; a client whose
proof fails gets ``REFUSED`` in place of the server's, and is hung up on). Each direction then
has its own key, derived from the secret and both nonces, and every frame carries an HMAC over
its sequence number and contents: a frame that is altered, injected, replayed, reordered or sent
back the other way fails its check and ends the connection. Frames are authenticated, not
encrypted: store values are addresses and ids, not user data.

A frame's contents are a list of byte strings (an operation and its arguments): nothing in it is
ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence

MAGIC = b"skyward-store/1\n"
NONCE = 32
TAG = 32
HELLO = len(MAGIC) + NONCE
"""The server's first bytes: the protocol's name and its nonce."""
ANSWER = NONCE + TAG
"""The client's first bytes: its nonce and its proof."""
MAX_FRAME = 16 << 20
"""The largest frame either side sends or accepts, checked before its HMAC is: store values are
addresses and ids (NCCL's unique id is 128 bytes; a gloo rank's addresses some 8 KiB at 1024
ranks), so 16 MiB is far above any formation's and bounds what an unauthenticated peer can make
the other side buffer."""
REFUSED = b"skyward-store/1 refused proof\n".ljust(TAG, b".")
"""What the server sends, in place of its proof, to a client whose proof failed (then it hangs
up): the client can tell a wrong secret from a connection dropped before its turn."""
_LIMIT = f"at most {MAX_FRAME >> 20} MiB"
_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")


class Rejected(Exception):
    """What came in cannot be accepted (a proof or frame without the pool's secret, a frame out
    of bounds): the connection ends.
    """


class TooLarge(ValueError):
    """A frame to send is larger than ``MAX_FRAME``."""


def nonce() -> bytes:
    return secrets.token_bytes(NONCE)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), hashlib.sha256)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"client", server_nonce, client_nonce)


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"server", server_nonce, client_nonce)


def check(expected: bytes, given: bytes) -> None:
    if not hmac.compare_digest(expected, given):
        raise Rejected("the proof does not carry the pool's secret")


class Session:
    """One side of an authenticated connection: seals what it sends, opens what it receives."""

    def __init__(self, secret: bytes, server_nonce: bytes, client_nonce: bytes, client: bool):
        to_server = _mac(secret, b"key to server", server_nonce, client_nonce)
        to_client = _mac(secret, b"key to client", server_nonce, client_nonce)
        self._send_key, self._receive_key = (
            (to_server, to_client) if client else (to_client, to_server)
        )
        self._sent = 0
        self._received = 0

    def seal(self, parts: Sequence[bytes]) -> bytes:
        """A frame: length, contents, then the HMAC over its sequence number and both.
        :class:`TooLarge` (nothing sent, nothing counted) past ``MAX_FRAME``.
        """
        body = pack(parts)
        if len(body) > MAX_FRAME:
            raise TooLarge(f"{len(body)} bytes, more than the store's frames take ({_LIMIT})")
        head = _LENGTH.pack(len(body))
        tag = _mac(self._send_key, _SEQUENCE.pack(self._sent), head, body)
        self._sent += 1
        return head + body + tag

    def open(self, head: bytes, body: bytes, tag: bytes) -> list[bytes]:
        """The parts of the next frame; :class:`Rejected` when it is not the peer's next one."""
        expected = _mac(self._receive_key, _SEQUENCE.pack(self._received), head, body)
        if not hmac.compare_digest(expected, tag):
            raise Rejected("a frame failed its authentication")
        self._received += 1
        return unpack(body)


def frame_length(head: bytes) -> int:
    """The contents' length from a frame's first four bytes; :class:`Rejected` when too large."""
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME:
        raise Rejected(f"a frame of {length} bytes announced (the store's frames take {_LIMIT})")
    return int(length)


HEAD = _LENGTH.size


def pack(parts: Sequence[bytes]) -> bytes:
    return b"".join([_LENGTH.pack(len(parts)), *(_LENGTH.pack(len(p)) + p for p in parts)])


def unpack(body: bytes) -> list[bytes]:
    if len(body) < _LENGTH.size:
        raise Rejected("a frame without contents")
    (count,) = _LENGTH.unpack_from(body, 0)
    at = _LENGTH.size
    parts = []
    for _ in range(count):
        if at + _LENGTH.size > len(body):
            raise Rejected("a frame's contents end early")
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if at + length > len(body):
            raise Rejected("a frame's contents end early")
        parts.append(body[at : at + length])
        at += length
    if at != len(body):
        raise Rejected("a frame's contents run past their parts")
    return parts
