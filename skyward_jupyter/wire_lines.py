"""Frames over a stream that moves whole lines only: Slurm's step I/O.

``slurmstepd`` forwards a task's stdout to ``srun`` a line at a time (``srun -u`` would not, but
puts a terminal in between, which mangles binary data). So on such a transport every write is
sent as one base64 line, and the reader decodes lines back into the byte stream the wire reads:
the frames themselves are unchanged. Used when a rank's ``SKYWARD_WIRE`` is ``lines``.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

MODE = "lines"
STREAM_LIMIT = 1 << 31
"""asyncio's per-line limit for such a stream: a line carries a whole frame segment."""


class LineReader:
    """``readexactly`` over an asyncio stream of base64 lines."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            line = await self._stream.readline()
            if not line:
                raise asyncio.IncompleteReadError(bytes(self._buffer), n)
            self._buffer += base64.b64decode(line)
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


class LineWriter:
    """``write``/``drain`` over an asyncio stream, one base64 line per write."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def write(self, data: Any) -> None:
        self._writer.write(base64.b64encode(data) + b"\n")

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


def encode_line(data: Any) -> bytes:
    return base64.b64encode(data) + b"\n"
