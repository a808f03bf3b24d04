"""A cell's rank output, written into the notebook cell that ran it.

Events arrive on the pool's IO thread; they are only queued there. The text is written by
:meth:`CellOutput.flush`, which the pool calls on the kernel's own thread while the cell waits
(about 20 times a second) and once at the end. Writing from the thread that runs the cell is what
keeps output in that cell (a background thread's print can land in whichever cell runs later),
and batching per flush is what keeps a flood of output from freezing the browser.
"""

from __future__ import annotations

import collections
import re
import sys
from typing import Literal, TextIO

from ..events import OutputReceived, PoolEvent

StdoutMode = Literal["head", "all", "none"]
MAX_FLUSH_CHARS = 200_000
_BREAKS = re.compile(r"([\r\n])")


class CellOutput:
    def __init__(
        self, mode: StdoutMode = "head", stdout: TextIO | None = None, stderr: TextIO | None = None
    ) -> None:
        self.mode = mode
        self._stdout = stdout
        self._stderr = stderr
        self._queue: collections.deque[OutputReceived] = collections.deque()
        self._at_line_start: dict[tuple[int, str], bool] = {}
        # Per stream of the notebook: whose line is still open (no final newline yet).
        self._open_line: dict[str, tuple[int, str] | None] = {"stdout": None, "stderr": None}
        self.skipped_chars = 0

    def on_event(self, event: PoolEvent) -> None:
        """IO thread: keep the event for the next flush."""
        if isinstance(event, OutputReceived):
            self._queue.append(event)

    def _label(self, event: OutputReceived) -> str | None:
        """The prefix for this event's lines; None when it is not shown in the cell."""
        if event.stream == "stderr":
            return f"[rank {event.rank} stderr] "
        if self.mode == "all":
            return f"[rank {event.rank}] "
        if self.mode == "head" and event.rank == 0:
            return ""
        return None

    def _prefixed(self, event: OutputReceived, label: str) -> str:
        if not label:
            return event.text
        key = (event.rank, event.stream)
        out = []
        at_start = self._at_line_start.get(key, True)
        for piece in _BREAKS.split(event.text):
            if not piece:
                continue
            if at_start and piece not in "\r\n":
                out.append(label)
            out.append(piece)
            at_start = piece in ("\r", "\n")
        self._at_line_start[key] = at_start
        return "".join(out)

    def flush(self) -> None:
        """Kernel thread: write what arrived since the last flush, one write per stream."""
        chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}
        while self._queue:
            event = self._queue.popleft()
            label = self._label(event)
            if label is None or not event.text:
                continue
            target = event.stream if event.stream in chunks else "stderr"
            key = (event.rank, event.stream)
            other = self._open_line[target]
            if other is not None and other != key:
                # Another rank's line is unfinished: end it here rather than glue onto it.
                chunks[target].append("\n")
                self._at_line_start[other] = True
            chunks[target].append(self._prefixed(event, label))
            self._open_line[target] = None if event.text.endswith("\n") else key
        for stream, parts in chunks.items():
            if not parts:
                continue
            text = "".join(parts)
            if len(text) > MAX_FLUSH_CHARS:
                cut = len(text) - MAX_FLUSH_CHARS
                self.skipped_chars += cut
                text = (
                    f"[skyward_jupyter: {cut} characters of rank output skipped to keep the "
                    f"notebook responsive]\n" + text[cut:]
                )
            out = (
                (self._stdout or sys.stdout) if stream == "stdout" else (self._stderr or sys.stderr)
            )
            out.write(text)
            out.flush()
