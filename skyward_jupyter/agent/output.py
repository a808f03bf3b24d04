"""Capture a rank's output at the file-descriptor level, so C libraries' prints are seen too.

The stream's descriptor (1 or 2) is pointed at a pipe; a thread reads the pipe and hands text on
in chunks that end at a line break, or with the text after a carriage return (``\\r`` is kept
and sent with the redraw it starts, so progress bars redraw in place). A chunk with neither is
held briefly, then sent anyway, so ``print(x, end="")`` shows. Whatever is readable at once is
sent as one chunk, which coalesces a flood of small writes.
"""

from __future__ import annotations

import array
import codecs
import fcntl
import os
import select
import termios
import threading
from collections.abc import Callable

_SYNC = "\x00skyward-sync\x00"
_HOLD_SECONDS = 0.05
_READ_SIZE = 1 << 16


class FdCapture:
    def __init__(self, fd: int, stream: str, emit: Callable[[str, str], None]) -> None:
        self.stream = stream
        self._fd = fd
        self._emit = emit
        self._synced = threading.Event()
        self._holding = False
        """The pump has read text it has not emitted yet (or is reading it)."""
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name=f"capture-{stream}", daemon=True)
        self._thread.start()

    def sync(self, timeout: float = 5.0) -> None:
        """Return once everything written to the descriptor so far has been emitted.

        Called at the end of a cell, so the cell's last output is sent before the cell's result
        and lands in the cell that produced it. When the pipe is empty and the pump holds
        nothing, everything is out already: no round trip through the pump's thread (on a busy
        machine, waiting for it to be scheduled costs milliseconds every cell).
        """
        # Holding is read again after the pipe: the pump may have read it empty in between.
        if not self._holding and _unread(self._read_end) == 0 and not self._holding:
            return
        self._synced.clear()
        os.write(self._fd, _SYNC.encode())
        self._synced.wait(timeout)

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        while True:
            ready, _, _ = select.select(
                [self._read_end], [], [], _HOLD_SECONDS if pending else None
            )
            if not ready:
                self._emit(self.stream, pending)
                pending = ""
                self._holding = False
                continue
            self._holding = True
            data = os.read(self._read_end, _READ_SIZE)
            if not data:
                break
            pending += decoder.decode(data)
            synced = False
            while _SYNC in pending:
                before, pending = pending.split(_SYNC, 1)
                pending = before + pending
                synced = True
            if synced:
                if pending:
                    self._emit(self.stream, pending)
                    pending = ""
                self._holding = False
                self._synced.set()
                continue
            cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
            if cut and pending[cut - 1] == "\r":
                cut = len(pending)  # "\rtext" is a whole redraw (a progress bar): send it as one
            if cut:
                self._emit(self.stream, pending[:cut])
                pending = pending[cut:]
            self._holding = bool(pending)
        if pending:
            self._emit(self.stream, pending)


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe ``fd`` (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]
