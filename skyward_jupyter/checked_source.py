"""A cell's or script's source, checked as the ranks will compile it, before it leaves.

The session checks a cell before any pool starts or changes; the pool sends what was checked
and checks only a source that comes to it unchecked (its own callers'), so each source is
compiled here once. The shell's input hook checks a ``%%sky`` body too (to show its syntax error as
IPython shows one), and a cell run again has the same source: a source that compiled is
remembered (:func:`_compiles`), so neither is compiled again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CheckedSource:
    """Source that compiles; build it with :meth:`check`."""

    text: str

    @classmethod
    def check(cls, text: str, filename: str) -> CheckedSource:
        """Raise the SyntaxError a rank would, naming ``filename`` as the rank's would. Compiled
        with the source's own ``__future__`` imports only, not the notebook's (string
        annotations would reject valid code, such as a walrus in an annotation).
        """
        try:
            _compiles(text)
        except SyntaxError as exc:
            exc.filename = filename
            raise
        return cls(text)


@functools.lru_cache(maxsize=16)
def _compiles(text: str) -> None:
    """Compile ``text`` (a SyntaxError is raised, and not remembered; its file is named by the
    caller).
    """
    compile(text, "<cell>", "exec", dont_inherit=True)
