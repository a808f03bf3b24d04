"""A cell's rank output, written into the notebook cell that ran it.

Events arrive on the pool's IO thread; they are only queued there. The text is written by
:meth:`CellOutput.flush`, which the pool calls on the kernel's own thread while the cell waits
(about 20 times a second), and by :meth:`CellOutput.finish` once at the end. Writing from the
thread that runs the cell is what keeps output in that cell (a background thread's print can land
in whichever cell runs later), and batching per flush is what keeps a flood of output from
freezing the browser.

Every rank's stderr is shown, but a library warning printed by every rank would then appear once
per rank. So a complete stderr line is held for a moment in a table keyed by its text; the ranks
that write the same line share one entry, shown once as ``[ranks 0-1 stderr] ...``. An entry is
written as soon as every rank has written it (the usual case: all ranks warn at once), else after
:data:`STDERR_HOLD_SECONDS`, so rank 0's own stderr stays live; the cell's end writes what is left.

A rank's stdout and stderr reach the cell in the order the rank wrote them: stdout that a rank
writes after a stderr line still held waits behind that line, and one flush writes its streams in
turn, in that order (not all of stdout, then all of stderr). What the head displays (a figure,
``display()``: :class:`~..events.DisplayReceived`) is displayed in that order too, behind what it
wrote first, whatever ``--stdout`` says: it is not stdout, and only the head sends it.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

from ..events import DisplayReceived, OutputReceived, PoolEvent
from ..flags import rank_span
from ..options import StdoutMode

MAX_FLUSH_CHARS = 200_000
# How long a stderr line waits for the other ranks to write the same line. Long enough for ranks
# that run in step (their output arrives within a few flushes of each other), short enough that a
# line only rank 0 writes still reads as live.
STDERR_HOLD_SECONDS = 0.3
VIEW_STALE_SECONDS = 3.0
"""How long a partial stderr line in view that is not a progress bar (a prompt, ``end=""``) may
go unwritten before another rank's bar takes the line over: it would hide the others' bars until
the cell ends. A bar in view keeps it, however slowly it redraws (bars with minutes between
steps would otherwise leave a line per step and rank)."""
_BREAKS = re.compile(r"([\r\n])")
_LINES = re.compile(r"[^\n]*\n|[^\n]+")
_Parts = list[tuple[str, str] | DisplayReceived]
"""Output for the cell, in order: (the notebook's stream, text), or the head's rich output."""


def display_bundle(shown: DisplayReceived) -> None:
    """Display the head's rich output in the cell that runs (the kernel's thread: its cell)."""
    from IPython.display import display

    display(  # type: ignore[no-untyped-call]
        shown.data,
        raw=True,
        metadata=shown.metadata,
        display_id=shown.display_id,
        update=shown.update,  # what IPython's update_display passes: only with a display_id
    )


def stderr_label(ranks: Iterable[int]) -> str:
    """``[rank 1 stderr] `` for one rank, ``[ranks 0-1 stderr] `` for several."""
    ranks = sorted(set(ranks))
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"[{word} {rank_span(ranks)} stderr] "


@dataclass
class _Held:
    """One held stderr line (who wrote it, when it was first seen), or stdout a rank wrote after
    a stderr line of its own still held (``label`` is then its prefix): it waits behind it.
    """

    seq: int
    text: str
    since: float
    ranks: set[int] = field(default_factory=set)
    label: str | None = None
    """Set for held stdout: the prefix its lines get in the cell."""
    rich: DisplayReceived | None = None
    """Set for held rich output (with ``label`` ""): what the head displayed."""


def _seq_of(entry: _Held) -> int:
    return entry.seq


class CellOutput:
    def __init__(
        self,
        mode: StdoutMode = "head",
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        *,
        ranks: int | None = None,
        head: int = 0,
        clock: Callable[[], float] = time.monotonic,
        show: Callable[[DisplayReceived], None] = display_bundle,
    ) -> None:
        """``ranks``: how many ranks run the cell, so a line all of them wrote needs no wait
        (None: every held line waits :data:`STDERR_HOLD_SECONDS`); ``head``: the first of them,
        whose stdout ``head`` shows (``--ranks 2-3``: rank 2). ``clock`` and ``show`` (what
        displays the head's rich output) are for tests.
        """
        self.mode = mode
        self._head = head
        self._stdout = stdout
        self._stderr = stderr
        self._show = show
        self._ranks = ranks
        self._clock = clock
        self._queue: collections.deque[OutputReceived | DisplayReceived] = collections.deque()
        self._at_line_start: dict[tuple[int, str], bool] = {}
        # Per stream of the notebook: whose line is still open (no final newline yet).
        self._open_line: dict[str, tuple[int, str] | None] = {"stdout": None, "stderr": None}
        # Held stderr lines and the stdout waiting behind them, oldest first (by seq); the
        # stderr lines by text.
        self._held: dict[int, _Held] = {}
        self._held_by_text: dict[str, list[_Held]] = {}
        self._seq = 0
        # Per rank: the seq of the entry its last held line went to. A rank joins only a newer
        # entry, so a rank's lines keep their order and a repeated line is not folded into one.
        self._last_seq: dict[int, int] = {}
        # Ranks whose own stderr line is unfinished: what follows continues it, so passes through.
        self._stderr_open: set[int] = set()
        self._redraws: dict[int, str] = {}
        """Per rank, the last redraw (``\\r``) of a progress bar of its own that waits while
        another rank's bar is the line in view: one stream keeps one line redrawing."""
        self._ended_for: set[int] = set()
        """Ranks whose unfinished stderr line was ended here (another rank wrote, or their
        waiting redraw was shown as a line): the newline the rank itself writes next (tqdm's,
        as the bar closes) is that line's end, not an empty line."""
        self._stderr_written = 0.0
        """When the notebook's stderr was last written (its line in view, when one is open)."""
        self._bar_in_view = False
        """The open stderr line was last written by a redraw (``\\r``): a progress bar."""
        self.skipped_chars = 0

    def on_event(self, event: PoolEvent) -> None:
        """IO thread: keep the event for the next flush."""
        if isinstance(event, OutputReceived | DisplayReceived):
            self._queue.append(event)

    def flush(self) -> None:
        """Kernel thread: write what arrived since the last flush, one write per stream.

        Held stderr lines are written once every rank has written them or they have waited long
        enough; the rest stay held for a later flush (or :meth:`finish`).
        """
        self._drain(everything=False)

    def finish(self) -> None:
        """Kernel thread, at the cell's end (also when it failed or was interrupted): write
        everything, held stderr lines included, since no later flush will come for this cell.
        """
        self._drain(everything=True)

    def shows(self, event: OutputReceived) -> bool:
        """Whether this cell's rules write ``event`` (whose stdout it shows)."""
        return self._label(event) is not None

    @property
    def pending(self) -> bool:
        """Whether output arrived that is not written yet (held stderr lines included)."""
        return bool(self._queue or self._held)

    @property
    def held_lines(self) -> int:
        """How many stderr lines are held, waiting for other ranks."""
        return sum(entry.label is None for entry in self._held.values())

    # ------------------------------------------------------------------------------ internals

    def _label(self, event: OutputReceived) -> str | None:
        """The prefix for this event's lines; None when it is not shown in the cell."""
        if event.stream == "stderr":
            return stderr_label([event.rank])
        if self.mode == "all":
            return f"[rank {event.rank}] "
        if self.mode == "head" and event.rank == self._head:
            return ""
        return None

    def _prefixed(self, key: tuple[int, str], text: str, label: str) -> str:
        if not label:
            return text
        out = []
        at_start = self._at_line_start.get(key, True)
        for piece in _BREAKS.split(text):
            if not piece:
                continue
            if at_start and piece not in "\r\n":
                out.append(label)
            out.append(piece)
            at_start = piece in ("\r", "\n")
        self._at_line_start[key] = at_start
        return "".join(out)

    def _append(
        self, parts: _Parts, target: str, key: tuple[int, str], text: str, label: str
    ) -> None:
        """Add one rank's text to a notebook stream, ending another rank's unfinished line."""
        other = self._open_line[target]
        if other is not None and other != key:
            # Another rank's line is unfinished: end it here rather than glue onto it.
            parts.append((target, "\n"))
            self._at_line_start[other] = True
            if target == "stderr":
                self._ended_for.add(other[0])
        parts.append((target, self._prefixed(key, text, label)))
        self._open_line[target] = None if text.endswith("\n") else key
        if target == "stderr":
            self._stderr_written = self._clock()
            self._bar_in_view = "\r" in text

    def _drain(self, everything: bool) -> None:
        now = self._clock()
        parts: _Parts = []
        while self._queue:
            event = self._queue.popleft()
            if isinstance(event, DisplayReceived):
                if event.rank != self._head:
                    continue  # not the cell's (the ranks send none: see agent/rich_output.py)
                if self._last_seq.get(event.rank, -1) in self._held:
                    self._wait_behind(event.rank, "", "", now, event)
                else:
                    parts.append(event)
                continue
            label = self._label(event)
            if label is None or not event.text:
                continue
            if event.stream == "stderr":
                self._take_stderr(event, parts, now)
            elif self._last_seq.get(event.rank, -1) in self._held:
                self._wait_behind(event.rank, event.text, label, now)
            else:
                key = (event.rank, event.stream)
                self._append(parts, "stdout", key, event.text, label)
        if everything or (self._redraws and self._view_stale(now)):
            self._show_redraws(parts)
        self._release(parts, now, everything=everything)
        self._write(parts)

    def _wait_behind(
        self, rank: int, text: str, label: str, now: float, rich: DisplayReceived | None = None
    ) -> None:
        """Hold ``rank``'s stdout (or rich output) behind its stderr lines still held, to keep
        its order.
        """
        entry = _Held(self._seq, text, now, {rank}, label, rich)
        self._seq += 1
        self._held[entry.seq] = entry
        self._last_seq[rank] = entry.seq

    def _take_stderr(self, event: OutputReceived, parts: _Parts, now: float) -> None:
        """Hold a rank's complete stderr lines; pass anything else through at once.

        A partial line or a ``\\r`` redraw (a progress bar on stderr) cannot be matched against
        the other ranks' lines, and waiting would only make it stutter; the rank's held lines go
        out first, so its own output keeps its order.
        """
        rank = event.rank
        for piece in _LINES.findall(event.text):
            if rank in self._ended_for:
                self._ended_for.discard(rank)
                if piece == "\n":
                    continue
            if rank not in self._stderr_open and piece.endswith("\n") and "\r" not in piece:
                self._hold(rank, piece, now)
                continue
            in_view = self._open_line["stderr"]
            taken = in_view is not None and in_view[0] != rank and not self._view_stale(now)
            if "\r" in piece and taken:
                # Another rank's bar redraws the line in view: ending it for each redraw of
                # this one would leave a line per redraw. Its last state waits for that line.
                self._redraws[rank] = piece
                self._stderr_open.add(rank)
                continue
            # What follows a waiting redraw continues its line (tqdm ends a bar on its own).
            piece = self._redraws.pop(rank, "") + piece
            self._release(parts, now, forced={rank})
            self._append(parts, "stderr", (rank, "stderr"), piece, stderr_label([rank]))
            if piece.endswith("\n"):
                self._stderr_open.discard(rank)
                self._show_redraws(parts)
            else:
                self._stderr_open.add(rank)

    def _view_stale(self, now: float) -> bool:
        """Whether the stderr line in view is a partial line, not a bar, that has gone
        unwritten for :data:`VIEW_STALE_SECONDS`.
        """
        return not self._bar_in_view and now - self._stderr_written >= VIEW_STALE_SECONDS

    def _show_redraws(self, parts: _Parts) -> None:
        """Write the waiting redraws, each its rank's last state, as a line, after what that
        rank wrote before it.
        """
        for rank in sorted(self._redraws):
            piece = self._redraws.pop(rank)
            self._release(parts, self._clock(), forced={rank})
            if not piece.endswith("\n"):
                piece += "\n"
                self._ended_for.add(rank)
            self._append(parts, "stderr", (rank, "stderr"), piece, stderr_label([rank]))
            self._stderr_open.discard(rank)

    def _hold(self, rank: int, line: str, now: float) -> None:
        """Add ``rank`` to the oldest entry for ``line`` newer than its last one, or start one."""
        last = self._last_seq.get(rank, -1)
        same = self._held_by_text.setdefault(line, [])  # oldest first
        at = bisect.bisect_right(same, last, key=_seq_of)
        entry = same[at] if at < len(same) else None
        if entry is None:
            entry = _Held(self._seq, line, now)
            self._seq += 1
            self._held[entry.seq] = entry
            same.append(entry)
        entry.ranks.add(rank)
        self._last_seq[rank] = entry.seq

    def _ready(self, entry: _Held, now: float) -> bool:
        if entry.label is not None:
            return False  # stdout goes with the stderr lines it waits behind
        complete = self._ranks is not None and len(entry.ranks) >= self._ranks
        return complete or now >= entry.since + STDERR_HOLD_SECONDS

    def _release(
        self,
        parts: _Parts,
        now: float,
        *,
        forced: set[int] | None = None,
        everything: bool = False,
    ) -> None:
        """Write the held entries that are ready, and those of ``forced`` ranks.

        An entry that is written takes every older entry sharing one of its ranks with it, so no
        rank's line is shown before a line that rank wrote earlier; held stdout goes as soon as
        nothing older of its rank is held.
        """
        if not self._held:
            return
        pulled = set(forced or ())
        out: set[int] = set()
        for entry in reversed(self._held.values()):  # newest first, so pulled ranks reach back
            if everything or self._ready(entry, now) or not pulled.isdisjoint(entry.ranks):
                pulled |= entry.ranks
                out.add(entry.seq)
        blocked: set[int] = set()
        for entry in self._held.values():  # oldest first: stdout that nothing holds back goes
            if entry.seq not in out:
                if entry.label is not None and blocked.isdisjoint(entry.ranks):
                    out.add(entry.seq)
                else:
                    blocked |= entry.ranks
        for seq in sorted(out):
            self._write_held(parts, self._held.pop(seq))

    def _write_held(self, parts: _Parts, entry: _Held) -> None:
        if entry.rich is not None:
            parts.append(entry.rich)
            return
        if entry.label is not None:
            (rank,) = entry.ranks
            self._append(parts, "stdout", (rank, "stdout"), entry.text, entry.label)
            return
        same = self._held_by_text[entry.text]
        same.remove(entry)
        if not same:
            del self._held_by_text[entry.text]
        other = self._open_line["stderr"]
        if other is not None:
            # A rank's unfinished line is open in the cell: end it rather than glue onto it.
            parts.append(("stderr", "\n"))
            self._at_line_start[other] = True
            self._open_line["stderr"] = None
        parts.append(("stderr", stderr_label(entry.ranks) + entry.text))

    def _write(self, parts: _Parts) -> None:
        """Write the streams' texts and display the rich output in turn, as they came; text over
        :data:`MAX_FLUSH_CHARS` is skipped from the oldest on, and the cell says how much.
        """
        texts = [part for part in parts if not isinstance(part, DisplayReceived)]
        skipped = sum(len(text) for _, text in texts) - MAX_FLUSH_CHARS
        if skipped > 0:
            parts = self._skip(parts, skipped)
        for stream, group in itertools.groupby(parts, key=_stream_of):
            if stream == "display":
                for shown in group:
                    assert isinstance(shown, DisplayReceived)
                    self._display(shown)
                continue
            out = (
                (self._stdout or sys.stdout) if stream == "stdout" else (self._stderr or sys.stderr)
            )
            out.write("".join(part[1] for part in group if not isinstance(part, DisplayReceived)))
            out.flush()

    def _display(self, shown: DisplayReceived) -> None:
        """Display the head's output; one the notebook cannot show is said on stderr, and the
        cell's other output and its wait go on.
        """
        try:
            self._show(shown)
        except Exception as exc:  # noqa: BLE001 - any error of the frontend's formatting
            what = ", ".join(shown.data) or "nothing"
            err = self._stderr or sys.stderr
            err.write(
                f"[skyward_jupyter: rank {shown.rank}'s display ({what}) could not be shown: "
                f"{type(exc).__name__}: {exc}]\n"
            )
            err.flush()

    def _skip(self, parts: _Parts, skipped: int) -> _Parts:
        """``parts`` less their oldest ``skipped`` characters of text (more, to begin the rest
        with a whole line), with a line saying so; rich output is kept.
        """
        cut = skipped
        kept: _Parts = []
        rest = collections.deque(parts)
        while rest:
            part = rest.popleft()
            if isinstance(part, DisplayReceived):
                kept.append(part)
            elif len(part[1]) <= cut:
                cut -= len(part[1])
            else:
                stream, text = part
                if cut and text[cut - 1] != "\n":  # the kept output begins with a whole line
                    end = text.find("\n", cut)
                    whole = len(text) if end < 0 else end + 1
                    skipped, cut = skipped + whole - cut, whole
                kept.append(
                    (
                        stream,
                        f"[skyward_jupyter: {skipped} characters of rank output skipped to keep "
                        f"the notebook responsive]\n" + text[cut:],
                    )
                )
                break
        self.skipped_chars += skipped
        return kept + list(rest)


def _stream_of(part: tuple[str, str] | DisplayReceived) -> str:
    """What :meth:`CellOutput._write` groups a part by: its stream, or "display"."""
    return "display" if isinstance(part, DisplayReceived) else part[0]
