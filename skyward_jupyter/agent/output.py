"""Capture a rank's output at the file-descriptor level, so C libraries' prints are seen too.

The stream's descriptor (1 or 2) is pointed at a pipe; a thread reads the pipe and hands text on
in chunks that end at a line break, or with the text after a carriage return (``\\r`` is kept
and sent with the redraw it starts, so progress bars redraw in place). A chunk with neither is
held briefly, then sent anyway, so ``print(x, end="")`` shows. Whatever is readable at once is
sent as one chunk, which coalesces a flood of small writes.

The capture keeps a write end of its own, so a cell that closes the descriptor (``os.close(1)``)
neither ends the pump nor lets the sync marker land in whatever file takes the number next:
:meth:`FdCapture.mend` puts the descriptor back between cells and says what the cell did.

stdout and stderr are two pipes with a pump each, so what reaches both pipes at nearly the same
time could be sent in either order. The rank's ``sys.stdout`` and ``sys.stderr`` keep the order
they are written in, as a terminal shows it: each writes straight to its descriptor (unbuffered,
as ``PYTHONUNBUFFERED`` has it), and the first write to one after the other waits until the
other's pump has sent what it had (:class:`WriteOrder`); the log handlers torch made before
them are pointed at them. Writes that bypass them (``os.write``, C code, child processes) keep
their order within each stream.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import select
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TextIO

from .process import unread_bytes

if TYPE_CHECKING:
    from typing_extensions import Buffer

_SYNC = "\x00skyward-sync\x00"
_HOLD_SECONDS = 0.05
_READ_SIZE = 1 << 16
_FDS = {"stdout": 1, "stderr": 2}


class FdCapture:
    def __init__(self, fd: int, stream: str, emit: Callable[[str, str], None]) -> None:
        self.stream = stream
        self._fd = fd
        self._emit = emit
        self._marks = threading.Condition()
        self._marks_written = 0
        self._marks_passed = 0
        """Sync markers written into the pipe, and those the pump has passed (after sending
        everything before them): a sync waits for its own, whichever thread asks."""
        self._holding = False
        """The pump has read text it has not emitted yet (or is reading it)."""
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        self._write_end = write_end
        self._read_end = read_end
        self._pipe = _identity(write_end)
        self._elsewhere: tuple[int, int] | None = None
        """Where a cell pointed the descriptor instead, once named (named once)."""
        self._pid = os.getpid()
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
        if not self._holding and unread_bytes(self._read_end) == 0 and not self._holding:
            return
        if threading.current_thread() is self._thread or os.getpid() != self._pid:
            # The pump itself wrote (a failure report), or a process the cell forked did (its
            # copy of this object is not the pump's): neither can wait for it.
            return
        with self._marks:
            self._marks_written += 1
            mark = self._marks_written
        # Written outside the lock: a full pipe blocks until the pump reads, and the pump takes
        # the lock to count what it passed. A later mark lands after this one's text anyway.
        os.write(self._write_end, _SYNC.encode())
        with self._marks:
            self._marks.wait_for(lambda: self._marks_passed >= mark, timeout)

    def mend(self) -> str | None:
        """Point the descriptor at the capture again if a cell closed it; say what happened.

        A descriptor the cell pointed elsewhere (``os.dup2`` onto a file) is the cell's choice
        and stays; it is named, since its output then no longer reaches the notebook.
        """
        try:
            now = _identity(self._fd)
        except OSError:
            os.dup2(self._write_end, self._fd)
            return (
                f"the cell closed its {self.stream} (fd {self._fd}); "
                "it was reopened for the next cells"
            )
        if now in (self._pipe, self._elsewhere):
            self._elsewhere = None if now == self._pipe else now
            return None
        self._elsewhere = now
        return (
            f"the cell pointed its {self.stream} (fd {self._fd}) elsewhere: "
            "what it writes there no longer reaches the notebook"
        )

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
            marks = pending.count(_SYNC)
            if marks:
                pending = pending.replace(_SYNC, "")
                if pending:
                    self._emit(self.stream, pending)
                    pending = ""
                self._holding = False
                with self._marks:
                    self._marks_passed += marks
                    self._marks.notify_all()
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


def _identity(fd: int) -> tuple[int, int]:
    """What ``fd`` is open on (device, inode); OSError when it is closed."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class WriteOrder:
    """Keeps the order of writes to the rank's ``sys.stdout`` and ``sys.stderr`` across the two
    pipes: before writing to one descriptor after the other, the other's pump sends what it has.

    Only a switch costs anything (a look at the other pipe; a round trip through its pump while
    it still holds text), so a loop printing to one stream pays nothing.
    """

    def __init__(self, captures: Mapping[str, FdCapture]) -> None:
        self._captures = captures
        self._last: str | None = None

    def before(self, stream: str) -> None:
        last, self._last = self._last, stream
        if last is not None and last != stream:
            self._captures[last].sync()


class _OrderedFile(io.FileIO):
    """A rank's descriptor 1 or 2 as Python writes to it, after :meth:`WriteOrder.before`."""

    def __init__(self, stream: str, order: WriteOrder) -> None:
        super().__init__(_FDS[stream], "w", closefd=False)
        self.name = f"<{stream}>"
        self._stream = stream
        self._order = order

    def write(self, data: Buffer, /) -> int:
        self._order.before(self._stream)
        return super().write(data)


class PythonStreams:
    """``sys.stdout`` and ``sys.stderr`` as the agent set them up, over the captured descriptors.

    Unbuffered (what the ranks' ``PYTHONUNBUFFERED`` gives Python's own) and kept in order by a
    :class:`WriteOrder`. A cell may replace one (``sys.stdout = io.StringIO()``) or close it:
    its replacement gets what the cell prints while it is installed, and the next cell has the
    rank's own stream back, as if it were a fresh cell, rather than the rank falling silent.
    """

    def __init__(self, captures: Mapping[str, FdCapture]) -> None:
        self._order = WriteOrder(captures)
        self._given = {name: getattr(sys, name) for name in _FDS}
        """Python's own streams, kept: once unreferenced, they would close descriptors 1 and 2."""
        self._own = {name: self._open(name, given) for name, given in self._given.items()}
        for name, stream in self._own.items():
            self._given[name].flush()
            setattr(sys, name, stream)
        _retarget_log_handlers({id(self._given[n]): self._own[n] for n in _FDS})

    def _open(self, name: str, like: TextIO) -> TextIO:
        return io.TextIOWrapper(
            _OrderedFile(name, self._order),
            encoding=like.encoding,
            errors=like.errors,
            line_buffering=True,
            write_through=True,
        )

    def flush(self) -> None:
        """Flush the cell's replacements of the rank's streams, whatever state they are in. The
        rank's own write through to their descriptors: nothing waits in them, and a trivial
        cell need not pay for looking.
        """
        for name, own in self._own.items():
            stream = getattr(sys, name)
            if stream is not own:
                # a cell may have closed the stream or its descriptor: then nothing is left
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.flush()

    def mend(self) -> list[str]:
        """Put the rank's own streams back where a cell replaced or closed them; say so."""
        notes = []
        for name, own in self._own.items():
            if own.closed:
                closed, own = own, self._open(name, own)
                self._own[name] = own
                _retarget_log_handlers({id(closed): own})
                notes.append(f"the cell closed sys.{name}; it was reopened for the next cells")
            elif getattr(sys, name) is not own:
                notes.append(
                    f"the cell replaced sys.{name}; the rank's own was put back for the next "
                    "cells (contextlib.redirect_" + name + " keeps a replacement to one block)"
                )
            setattr(sys, name, own)
        return notes


def _retarget_log_handlers(streams: Mapping[int, TextIO]) -> None:
    """Point log handlers at the streams that replace the ones they hold (by ``id``): those made
    before the agent (torch's, at its import in the warm template), so what they log keeps its
    order with the rest of the rank's output, and those holding a stream a cell closed.
    """
    logging = sys.modules.get("logging")
    if logging is None:
        return  # nothing was logging yet: handlers made later take sys.stderr as it is then
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in streams:
                # Not setStream: it flushes the stream it replaces, which may be closed.
                handler.acquire()
                try:
                    handler.stream = streams[id(stream)]
                finally:
                    handler.release()
