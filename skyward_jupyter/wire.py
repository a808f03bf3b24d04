"""Framed messages over any byte stream: pipes now, SSH channels later.

A frame is a small fixed header, a table of segment lengths, then the segments::

    b"SKY" | version:u8 | count:u32 | count x length:u64 | segment 0 | segment 1 | ...

Segment 0 is a pickle (protocol 5) of a :mod:`.protocol` message; the others are its
out-of-band buffers. A message travels as a tuple of its kind's name and its fields
(:func:`register`): a class named in a pickle is looked up through the import system as it is
written and as it is read, which on the hottest path, a trivial cell at hundreds of ranks, cost
each rank more than the rest of its message (BENCHMARKS.md, "Measurements behind the code").
What a message holds pickles as usual: a nested message or :class:`~.protocol.Pickled` by its
class. Messages hold only the protocol's own types and builtins; a user's value
travels inside as :class:`~skyward_jupyter.protocol.Pickled`, already pickled with cloudpickle (so
notebook-defined functions travel by value), so the frame itself needs only the C pickler: on
the pool's hottest path, a trivial cell, that is much cheaper than cloudpickle's. A
large numpy array or tensor is written straight from its own memory and read straight into a
fresh buffer, never copied into or out of the pickle stream; a buffer that was ``bytes`` on the
sending side is read straight into a new ``bytes`` object (its length carries a flag), so a
large ``bytes`` value is held once on a rank, not as the frame and its copy. Only authenticated
channels (local pipes, SSH) ever carry frames: unpickling is code execution, and the channel is
the trust boundary.
"""

from __future__ import annotations

import base64
import ctypes
import os
import pickle
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .wire_lines import encode_line

MAGIC = b"SKY"
VERSION = 2
_HEADER = struct.Struct("!3sBI")
_LENGTH = struct.Struct("!Q")
_START = _HEADER.size + _LENGTH.size
"""A frame's header and its first length, read together: every frame has a body."""
_SINGLE = struct.Struct(_HEADER.format + _LENGTH.format[1:])
"""The header and length of a frame of one segment (a message without buffers: a cell, its
answer, a heartbeat), packed and read in one call on the hottest path."""
_AS_BYTES = 1 << 63
"""Set in a segment's length: the buffer was ``bytes``, and the agent reads it into one."""
_SIZE = _AS_BYTES - 1
_MAX_SEGMENTS = 1 << 20
_CHUNK = 1 << 20
_FILL = 1 << 16
"""Bytes one read of the agent's channel asks for: a pipe's capacity (a larger request costs
an allocation of its size on every read)."""
_JOIN_BELOW = 1 << 16
"""Frames up to this size are copied into one write."""
_BLOB_ALIGN = 64
"""Where each segment of a blob starts (a multiple of it): as a large allocation is aligned."""
_IOV_MAX = 1024
"""Buffers one ``writev`` takes (Linux's ``IOV_MAX``)."""

Segment = bytes | bytearray | memoryview
_PARTIAL = object()


class WireError(Exception):
    """The stream does not carry frames of this protocol (wrong peer, version, corruption)."""


class AsyncByteReader(Protocol):
    """What the wire needs from an async stream: asyncio.StreamReader and asyncssh's reader fit."""

    async def readexactly(self, n: int) -> bytes: ...


class AsyncByteWriter(Protocol):
    def write(self, data: Any) -> None: ...

    async def drain(self) -> None: ...


_FORMS: dict[type, tuple[str, Callable[[Any], tuple[Any, ...]]]] = {}
"""Each message kind's name on the wire and what gives its fields, in its constructor's order."""
_KINDS: dict[str, Callable[..., Any]] = {}


def register(kind: type, fields: Callable[[Any], tuple[Any, ...]]) -> None:
    """Let ``kind`` travel as its name and ``fields(message)``, rebuilt by calling ``kind`` with
    them. Named, not numbered: a message the other side lacks is an error, never another one.
    """
    if kind.__qualname__ in _KINDS:
        raise ValueError(f"two message kinds are named {kind.__qualname__!r} on the wire")
    _FORMS[kind] = (kind.__qualname__, fields)
    _KINDS[kind.__qualname__] = kind


def _envelope(obj: object) -> tuple[Any, ...]:
    form = _FORMS.get(type(obj))
    return (None, obj) if form is None else (form[0], *form[1](obj))


def _opened(envelope: tuple[Any, ...]) -> Any:
    if envelope[0] is None:
        return envelope[1]
    kind = _KINDS.get(envelope[0])
    if kind is None:
        raise WireError(
            f"a message of a kind this side does not know ({envelope[0]!r}): the notebook and "
            "the ranks run different skyward_jupyter versions"
        )
    try:
        return kind(*envelope[1:])
    except TypeError as exc:
        raise WireError(
            f"message {envelope[0]!r} of another shape ({exc}): the notebook and the ranks run "
            "different skyward_jupyter versions"
        ) from None


def encode(obj: object) -> list[Segment]:
    """Serialise ``obj`` into the segments of one frame (header first).

    A small frame (a cell, a heartbeat) comes joined into one segment: it is written at once,
    so its reader wakes once for it, and a frame sent to every rank is joined only once.
    """
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(_envelope(obj), protocol=5, buffer_callback=buffers.append)
    if not buffers and len(body) <= _JOIN_BELOW - _START:
        return [_SINGLE.pack(MAGIC, VERSION, 1, len(body)) + body]
    segments: list[Segment] = [body, *(b.raw() for b in buffers)]
    lengths = [len(s) if not isinstance(s, memoryview) else s.nbytes for s in segments]
    flags = [_AS_BYTES * (isinstance(s, memoryview) and type(s.obj) is bytes) for s in segments]
    head = _HEADER.pack(MAGIC, VERSION, len(segments)) + b"".join(
        _LENGTH.pack(n | flag) for n, flag in zip(lengths, flags, strict=True)
    )
    if len(head) + sum(lengths) <= _JOIN_BELOW:
        return [b"".join([head, *segments])]
    return [head, *segments]


def decode(segments: Sequence[Segment]) -> Any:
    """Inverse of :func:`encode` minus the header: segment 0 is the pickle, the rest its buffers."""
    return _opened(pickle.loads(segments[0], buffers=segments[1:]))


def encode_blob(obj: object) -> bytearray:
    """``obj`` as one frame in one buffer, each segment starting on a multiple of
    ``_BLOB_ALIGN``: what a node keeps in a file and maps (:func:`decode_blob`), so that a large
    array is read from the mapping, aligned as a fresh allocation would be (numpy's loops, and
    so a float sum's last bit, depend on it), not copied.
    """
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(_envelope(obj), protocol=5, buffer_callback=buffers.append)
    segments = [memoryview(body), *(b.raw() for b in buffers)]
    head = _HEADER.pack(MAGIC, VERSION, len(segments)) + b"".join(
        _LENGTH.pack(s.nbytes) for s in segments
    )
    starts, end = [], len(head)
    for segment in segments:
        end += -end % _BLOB_ALIGN
        starts.append(end)
        end += segment.nbytes
    blob = bytearray(end)
    blob[: len(head)] = head
    for start, segment in zip(starts, segments, strict=True):
        blob[start : start + segment.nbytes] = segment
    return blob


def decode_blob(blob: memoryview) -> Any:
    """Inverse of :func:`encode_blob`; the buffers are slices of ``blob`` (no copy)."""
    count = _check_header(bytes(blob[: _HEADER.size]))
    end = _HEADER.size + _LENGTH.size * count
    segments = []
    for (n,) in _LENGTH.iter_unpack(blob[_HEADER.size : end]):
        end += -end % _BLOB_ALIGN
        segments.append(blob[end : end + (n & _SIZE)])
        end += n & _SIZE
    if end != blob.nbytes:
        raise WireError(f"corrupt blob: {blob.nbytes} bytes for a frame of {end}")
    return decode(segments)


def _check_header(raw: bytes) -> int:
    magic, version, count = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"not a skyward_jupyter stream (got {raw[:3]!r} where {MAGIC!r} belongs)")
    if version != VERSION:
        raise WireError(
            f"wire version {version} on the other side, {VERSION} here: "
            "the notebook and the ranks run different skyward_jupyter versions"
        )
    if not 0 < count <= _MAX_SEGMENTS:
        raise WireError(f"corrupt frame header: {count} segments")
    return int(count)


def _more_lengths(start: bytes | bytearray) -> int:
    """From a frame's start: the bytes of its length table still to read."""
    return _LENGTH.size * (_check_header(bytes(start[: _HEADER.size])) - 1)


def _lengths(start: bytes | bytearray, more: bytes | bytearray) -> list[int]:
    return [n for (n,) in _LENGTH.iter_unpack(bytes(start[_HEADER.size :]) + bytes(more))]


async def read_message(reader: AsyncByteReader, progress: Callable[[], None] | None = None) -> Any:
    """Read one frame; raises asyncio.IncompleteReadError at a clean end of stream.

    ``progress`` is called as each megabyte of a large frame arrives: a peer sending a value
    that takes longer than its heartbeat timeout is busy, not silent.
    """
    start = await reader.readexactly(_START)
    more = _more_lengths(start)
    lengths = _lengths(start, await reader.readexactly(more) if more else b"")
    segments: list[bytes | bytearray] = []
    for index, length in enumerate(lengths):
        n = length & _SIZE
        if n <= _CHUNK or progress is None:
            part = await reader.readexactly(n)
            # A buffer (not the pickle, segment 0) is writable unless it was bytes when sent:
            # an array loaded from read-only memory is read-only (a pulled array, a cell's value).
            segments.append(part if index == 0 or length & _AS_BYTES else bytearray(part))
            continue
        data = bytearray()
        while len(data) < n:
            data += await reader.readexactly(min(_CHUNK, n - len(data)))
            progress()
        segments.append(data)
    return decode(segments)


def write_segments(writer: AsyncByteWriter, frame: Sequence[Segment]) -> None:
    """Queue a pre-encoded frame (the same frame can go to many ranks without re-pickling);
    a large one is written from its own buffers, never copied.
    """
    for segment in frame:
        writer.write(segment)


def _fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``n`` bytes and a writable view of its storage, to fill before
    anything else holds it: what C code does to build one (CPython, which torch needs, lays
    the bytes out at the end of the object).
    """
    value = _new_bytes(None, n)
    storage = (ctypes.c_char * n).from_address(id(value) + bytes.__basicsize__ - 1)
    return value, memoryview(storage).cast("B")


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


class SyncChannel:
    """Blocking frames over a pair of file descriptors; the agent's side of the wire.

    Writes are serialised by a lock because the agent sends from several threads (output
    capture, metrics, heartbeats, the cell runner).
    """

    def __init__(
        self,
        read_fd: int,
        write_fd: int,
        lines: bool = False,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.read_fd = read_fd
        self._buffered = bytearray()
        """Read from the descriptor, not yet taken: a small frame's parts come in one read."""
        self._write_fd = write_fd
        self._lock = threading.Lock()
        self._lines = lines
        """Base64 lines on a transport that moves whole lines only (:mod:`.wire_lines`)."""
        self._decoded = bytearray()
        self._progress = progress
        """Called as parts of a frame arrive: a large one in transit is a live notebook."""

    def pending(self) -> bool:
        """Part of the stream is read already: a message may wait here while a poll of the
        descriptor says there is nothing to read.
        """
        return bool(self._buffered or self._decoded)

    def _fill(self) -> None:
        data = os.read(self.read_fd, _FILL)
        if not data:
            raise EOFError("channel closed")
        self._buffered += data

    def _readline(self) -> bytearray:
        searched = 0
        while (end := self._buffered.find(b"\n", searched)) < 0:
            searched = len(self._buffered)
            self._fill()
        line = self._buffered[: end + 1]
        del self._buffered[: end + 1]
        return line

    def _read_into(self, buf: memoryview) -> None:
        if self._lines:
            while len(self._decoded) < buf.nbytes:
                self._decoded += base64.b64decode(self._readline())
                if self._progress is not None:
                    self._progress()
            buf[:] = self._decoded[: buf.nbytes]
            del self._decoded[: buf.nbytes]
            return
        done = min(len(self._buffered), buf.nbytes)
        buf[:done] = self._buffered[:done]
        del self._buffered[:done]
        while done < buf.nbytes:  # straight into place, never through the buffer
            n = os.readv(self.read_fd, [buf[done : done + _CHUNK]])
            if not n:
                raise EOFError("channel closed")
            done += n
            if self._progress is not None:
                self._progress()

    def _read_segment(self, length: int) -> bytes | bytearray:
        """A segment of the length (and flag) its frame gives: ``bytes`` where it was ``bytes``
        when sent, read into place; otherwise writable (a numpy array loaded from it must be).
        """
        n = length & _SIZE
        if not length & _AS_BYTES or n <= _FILL:
            part = self._read_exact(n)
            return bytes(part) if length & _AS_BYTES else part
        value, storage = _fresh_bytes(n)
        self._read_into(storage)
        return value

    def _read_exact(self, n: int) -> bytearray:
        """``n`` bytes, writable (a numpy array loaded from them must be too)."""
        if n <= _FILL and not self._lines:
            # A small part, without progress calls (the frame's reader notes its arrival).
            while len(self._buffered) < n:
                self._fill()
            part = self._buffered[:n]
            del self._buffered[:n]
            return part
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return buf

    def recv(self) -> Any:
        """Read one message; raises EOFError when the other side has gone."""
        if not self._lines:
            if not self._buffered:
                self._fill()
            message = self._whole_single()
            if message is not _PARTIAL:
                return message
        start = self._read_exact(_START)
        more = _more_lengths(start)
        lengths = _lengths(start, self._read_exact(more) if more else b"")
        return decode([self._read_segment(n) for n in lengths])

    def _whole_single(self) -> Any:
        """A frame of one segment that the buffer holds whole, decoded (the usual message, read
        in one piece); ``_PARTIAL`` for any other, which :meth:`recv` reads part by part.
        """
        buffered = self._buffered
        if len(buffered) < _START:
            return _PARTIAL
        magic, version, count, length = _SINGLE.unpack_from(buffered)
        end = _START + length
        if count != 1 or magic != MAGIC or version != VERSION or len(buffered) < end:
            return _PARTIAL  # a frame of several segments, the end still to come, or an error
        body = buffered[_START:end]
        del buffered[:end]
        return _opened(pickle.loads(body))

    def send(self, obj: object) -> None:
        frame = encode(obj)
        if self._lines:
            frame = [encode_line(segment) for segment in frame]
        if len(frame) == 1:  # a small frame, joined: one write
            with self._lock:
                written = os.write(self._write_fd, frame[0])
                if written < len(frame[0]):  # cut short by a signal
                    self._write_rest([memoryview(frame[0]).cast("B")[written:]])
            return
        with self._lock:
            self._write_rest([memoryview(segment).cast("B") for segment in frame])

    def _write_rest(self, views: list[memoryview]) -> None:
        """Write ``views`` whole, as few system calls as the pipe allows (the reader wakes once
        for a frame the pipe takes at once); the caller holds the lock.
        """
        first = 0
        while first < len(views):
            written = os.writev(self._write_fd, views[first : first + _IOV_MAX])
            while first < len(views) and written >= views[first].nbytes:
                written -= views[first].nbytes
                first += 1
            if written:
                views[first] = views[first][written:]
