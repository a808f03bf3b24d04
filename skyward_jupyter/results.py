"""A cell's outcome on every rank, and the exceptions that carry remote failures to the notebook."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, overload

from .flags import rank_span
from .protocol import cell_name

if TYPE_CHECKING:
    from . import protocol as p
    from .events import RankState


def _what(error: RemoteError) -> str:
    return f"{error.type_name}: {error.message}" if error.message else error.type_name


def _alike(errors: Sequence[RemoteError], say: Callable[[RemoteError], str]) -> list[str]:
    """``rank 3: ...``, ``ranks 0-2,4: ...``: one entry per thing said, in order of rank."""
    ranks: dict[str, list[int]] = {}
    for error in errors:
        ranks.setdefault(say(error), []).append(error.rank)
    return [f"rank{'s' * (len(who) > 1)} {rank_span(who)}: {what}" for what, who in ranks.items()]


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a cell's code was stopped on every rank: the user's interrupt (Ctrl-C, the
    toolbar's stop, the panel's Interrupt), or the pool at the cell's ``--timeout``.
    """

    timeout: float | None = None
    """The cell's ``--timeout`` in seconds, when that stopped it; None: the user did."""

    def __str__(self) -> str:
        return "interrupted" if self.timeout is None else f"timed out after {self.timeout} s"


class PoolError(Exception):
    """The pool could not do what was asked (start, form its process group, run)."""


class RanksRestarted(PoolError):
    """Rank processes started again (a lost rank, mended) after the cell's globals were chosen:
    the new ones lack those taken for already there. Nothing ran; choose them again.
    """


class RankEnded(Exception):
    """A rank's process ended (or stopped answering) while the pool waited for it."""

    def __init__(self, how: str, diagnostics: str) -> None:
        super().__init__(how)
        self.how = how
        self.diagnostics = diagnostics


class RemoteError(Exception):
    """An exception raised on a rank (or the rank's death), with its remote traceback.

    ``secondary`` marks a rank whose failure followed from another's: the pool stopped it after
    another rank's failure or an interrupt, or another rank's process died during the cell. The
    primary failure, the cause, is the one to read.
    """

    def __init__(
        self,
        rank: int,
        where: str,
        type_name: str,
        message: str,
        traceback: str,
        secondary: bool = False,
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.rank = rank
        self.where = where
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.secondary = secondary
        self.exception = exception

    def __str__(self) -> str:
        return f"[rank {self.rank}, {self.where}] {_what(self)}"

    def render(self) -> str:
        return f"--- rank {self.rank} ({self.where}) ---\n{self.traceback.rstrip()}\n"

    def _render_traceback_(self) -> list[str]:
        return self.render().splitlines()


_FRAME = re.compile(r'File "([^"]*)", line (\d+)[^\n]*\n(?: +(\S[^\n]*))?')


def _stopped_at(error: RemoteError | None) -> str:
    """Where a stopped rank was: `` at In [7] line 3: time.sleep(60)`` (the deepest line of the
    cell that its traceback names; in a script, its deepest frame: `` at train.py line 9``).
    """
    frames = _FRAME.findall(error.traceback) if error is not None else []
    cell = [f for f in frames if cell_name(f[0]) is not None]
    if not (cell or frames):
        return ""
    name, line, source = (cell or frames)[-1]
    where = cell_name(name) or os.path.basename(name)
    return f" at {where} line {line}" + (f": {source.strip()}" if source else "")


class CellInterrupted(KeyboardInterrupt):
    """The user stopped a cell on every rank (Ctrl-C, the toolbar's stop or the panel's
    Interrupt); ``result`` says how each rank ended.

    Shown as one line per rank, where it stopped: the traceback of an interrupt is the
    notebook's own frames and the cell's source, which say nothing the user does not know.
    """

    def __init__(self, result: RunResult) -> None:
        super().__init__()
        self.result = result

    def __str__(self) -> str:
        return f"cell interrupted on {len(self.result)} rank{'s' * (len(self.result) != 1)}"

    def render(self) -> str:
        return "\n".join([f"KeyboardInterrupt: {self}", *_where_each_stopped(self.result)])

    def _render_traceback_(self) -> list[str]:
        return self.render().splitlines()


class WaitInterrupted(KeyboardInterrupt):
    """Ctrl-C while a cell (or a restart) waited for the pool to be free, a recovery under way,
    or while a pool started: what was waited for never began. One line saying so and what the
    pool goes on doing; no traceback (it would be the notebook's own frames).
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def _where_each_stopped(result: RunResult) -> list[str]:
    """A line per rank of a stopped cell: where it stopped, what it raised, or that it had
    finished.
    """
    lines = []
    for r in result:
        if r.error is None:
            lines.append(f"rank {r.rank}: had finished")
        elif r.error.type_name == "KeyboardInterrupt":
            lines.append(f"rank {r.rank}: stopped{_stopped_at(r.error)}")
        else:
            lines.append(f"rank {r.rank}: {_what(r.error)}{_stopped_at(r.error)}")
    return lines


class CellError(Exception):
    """A cell failed on one or more ranks: the cause in full, the others summarised.

    The cause (``primary``) is the first error not marked secondary; when a rank died during the
    cell, the pool marks every error but that rank's.
    """

    def __init__(self, errors: Sequence[RemoteError]) -> None:
        primary = [e for e in errors if not e.secondary] or list(errors)
        self.errors = tuple(errors)
        self.primary = primary[0]
        super().__init__(self.summary())

    def summary(self) -> str:
        first = self.primary
        others = [e for e in self.errors if e is not first]
        lines = [f"cell failed on rank {first.rank} ({first.where}): {_what(first)}"]
        if others:
            lines.append(
                f"and on {len(others)} other rank(s): "
                + "; ".join(_alike(others, lambda e: e.type_name))
            )
        return "\n".join(lines)

    def render(self) -> str:
        """The cause in full, then a line per other error: ranks that raised alike share it
        (``ranks 0-254: KeyboardInterrupt (after the failure above)``), however many.
        """
        others = [e for e in self.errors if e is not self.primary]
        return "\n".join(
            [self.primary.render(), *_alike(others, lambda e: _what(e) + self._relation(e))]
        )

    def _relation(self, error: RemoteError) -> str:
        """How another rank's error relates to the cause, said only where it is known: the
        same error raised on its own is not "after" the cause (both ranks ran the same code).
        """
        first = self.primary
        if error.type_name == first.type_name:
            return " (the same error)" if error.message == first.message else ""
        return " (after the failure above)" if error.secondary else ""

    def _render_traceback_(self) -> list[str]:
        return self.render().splitlines()


class CellTimedOut(CellError):
    """The pool stopped a cell at its ``--timeout``: shown as the timeout and a line per rank,
    where it stopped, as an interrupt is (each rank's ``KeyboardInterrupt`` traceback would
    blame a Ctrl-C no one pressed).
    """

    def __init__(self, result: RunResult) -> None:
        self.result = result
        super().__init__(result.errors)

    def summary(self) -> str:
        return f"cell {self.result.timed_out} (--timeout)"

    def render(self) -> str:
        return "\n".join([f"CellTimedOut: {self.summary()}", *_where_each_stopped(self.result)])


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    node: int
    value: Any
    value_repr: str | None
    error: RemoteError | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RunResult(Sequence[RankResult]):
    """One entry per rank, in rank order. ``lost`` names ranks whose namespace was lost."""

    cell_id: int
    ranks: tuple[RankResult, ...]
    shipped_bytes: int = 0
    lost: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    show_all: bool = False
    """Displayed with every rank's value rather than the head's (``%%sky --all``)."""
    bound: frozenset[str] = frozenset()
    """Global names the cell (re)bound on any rank: they are the ranks' now."""
    deleted: frozenset[str] = frozenset()
    """Global names the cell deleted on any rank (``del x``): the notebook's value travels
    again to a cell that reads the name."""
    stop: Stop | None = None
    """Why its code was stopped on every rank, if it was (also told among ``notes``)."""

    def with_display(self, every_rank: bool) -> RunResult:
        return replace(self, show_all=every_rank)

    @overload
    def __getitem__(self, i: int) -> RankResult: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RankResult]: ...
    def __getitem__(self, i: int | slice) -> RankResult | Sequence[RankResult]:
        return self.ranks[i]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RankResult]:
        return iter(self.ranks)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def interrupted(self) -> bool:
        """Whether the user stopped it (Ctrl-C, the toolbar's stop, the panel's Interrupt)."""
        return self.stop is not None and self.stop.timeout is None

    @property
    def timed_out(self) -> str | None:
        """``timed out after 2.0 s`` where the pool stopped it at its ``--timeout``, else None."""
        return str(self.stop) if self.stop is not None and self.stop.timeout is not None else None

    @property
    def stopped_by(self) -> str | None:
        """How a cell that was stopped ended (``interrupted``, ``timed out after 2.0 s``)."""
        return None if self.stop is None else str(self.stop)

    def only_stopped(self, r: RankResult) -> bool:
        """Whether rank ``r`` did not fail but was stopped: by the user's interrupt, at the
        cell's timeout, or by the pool after another rank's failure (a ``KeyboardInterrupt``
        that followed).
        """
        error = r.error
        return (
            error is not None
            and error.type_name == "KeyboardInterrupt"
            and (self.stopped_by is not None or error.secondary)
        )

    @property
    def values(self) -> list[Any]:
        return [r.value for r in self.ranks]

    @property
    def value(self) -> Any:
        """The head's (rank 0's) value."""
        return self.ranks[0].value if self.ranks else None

    @property
    def errors(self) -> list[RemoteError]:
        return [r.error for r in self.ranks if r.error is not None]

    def raise_for_errors(self) -> RunResult:
        if not self.ok:
            raise CellTimedOut(self) if self.timed_out else CellError(self.errors)
        return self

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"failed on ranks {rank_span(e.rank for e in self.errors)}"
        extra = f", lost namespaces of ranks {list(self.lost)}" if self.lost else ""
        count = len(self.ranks)
        return (
            f"<RunResult cell {self.cell_id}: {count} rank{'s' * (count != 1)}, {state}, "
            f"{self.shipped_bytes} bytes shipped{extra}>"
        )


@dataclass(frozen=True, slots=True)
class RankInfo:
    """A read-only view of one rank, for status displays."""

    rank: int
    node: int
    local_rank: int
    address: str
    state: RankState
    process: str
    hello: p.Hello | None
