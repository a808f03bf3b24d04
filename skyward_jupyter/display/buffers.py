"""A rank's output as a terminal would keep it: bounded, and a ``\\r`` progress bar is one line.

Ranks print for hours; the panel keeps the tail of each rank's stdout and stderr, in the shape a
terminal would show it, so that redrawing it costs the same after a thousand progress updates
as after one.
"""

from __future__ import annotations

import re

OUTPUT_CAP = 50_000
"""Characters of stdout (and, separately, stderr) kept per rank."""
_BREAKS = re.compile(r"(\r\n|\r|\n)")


class TextBuffer:
    """A rank's output as a terminal would keep it, bounded to ``cap`` characters.

    ``\\n`` and ``\\r\\n`` end a line; a lone ``\\r`` makes the next text replace the current line
    (``\\r`` then ``\\n`` keeps it), so a progress bar redrawn a thousand times is one line. When
    the text grows past ``cap``, whole lines are dropped from the start (``dropped`` counts the
    characters); a single line longer than ``cap`` keeps its end.
    """

    def __init__(self, cap: int = OUTPUT_CAP) -> None:
        self.cap = cap
        self._lines: list[str] = []  # finished lines, each ending in "\n"
        self._start = 0  # index of the first kept line (dropping is O(1); compacted in bulk)
        self._chars = 0  # characters in the kept finished lines
        self._line = ""
        self._rewind = False
        self.dropped = 0

    def write(self, text: str) -> None:
        for piece in _BREAKS.split(text):
            if not piece:
                continue
            if piece == "\r":
                self._rewind = True
            elif piece in ("\n", "\r\n"):
                self._lines.append(self._line + "\n")
                self._chars += len(self._line) + 1
                self._line, self._rewind = "", False
            else:
                if self._rewind:
                    self._line, self._rewind = piece, False
                else:
                    self._line += piece
                if len(self._line) > self.cap:
                    self.dropped += len(self._line) - self.cap
                    self._line = self._line[-self.cap :]
        self._trim()

    def _trim(self) -> None:
        while self._chars + len(self._line) > self.cap and self._start < len(self._lines):
            line = self._lines[self._start]
            self._start += 1
            self._chars -= len(line)
            self.dropped += len(line)
        if self._start > 1024 and self._start * 2 > len(self._lines):
            del self._lines[: self._start]
            self._start = 0

    @property
    def text(self) -> str:
        return "".join(self._lines[self._start :]) + self._line

    def __len__(self) -> int:
        return self._chars + len(self._line)
