"""Which notebook cells run on the pool by themselves (``%sky auto on``), and ``%%local``.

IPython's own hook for rewriting a cell before it runs is an input transformer
(``shell.input_transformers_cleanup``): with auto on, a cell that is plain Python gets a
``%%sky`` line in front, so it runs exactly as a ``%%sky`` cell would (its globals shipped, its
output, value and errors shown as such). IPython's own syntax (line and cell magics, ``!``
escapes, ``?`` help) is the notebook's: a cell with any of it does not parse as Python and is
left alone, as is a cell with nothing to run (comments). A cell that begins with ``%%local``
runs in the notebook, as written after that line, whether auto is on or not.

The same hook checks a ``%%sky`` cell's body: a syntax error raised here is shown as IPython
shows one in any cell, at its line, rather than under the frames of the magic that would
raise it later (the session checks the body again as it runs it).

Only the cell the frontend sent is routed: IPython also transforms code while a cell runs
(``%%time``'s and ``%timeit``'s statements, ``%%capture``'s body), which stays the notebook's
as the magic that runs it is; so do the silent requests frontends send on their own (variable
inspectors).
"""

from __future__ import annotations

import ast
from typing import Any

from .checked_source import CheckedSource
from .protocol import cell_filename

LOCAL = "%%local"
"""The first line of a cell that runs in the notebook whatever auto says."""
SKY = "%%sky"


class AutoCells:
    """The input transformer of one shell: ``enabled`` routes its plain cells to ``%%sky``."""

    has_side_effects = True
    """IPython's mark for a transformer whose output depends on more than the text: it is then
    left out when IPython only asks whether the input is complete (a console's Enter)."""

    def __init__(self, shell: Any) -> None:
        self._shell = shell
        self.enabled = False
        self._depth = 0
        """Cells running now (IPython's pre/post_execute): above 0, a transform is nested."""

    def install(self) -> None:
        self._shell.input_transformers_cleanup.append(self)
        self._shell.events.register("pre_execute", self._started)
        self._shell.events.register("post_execute", self._ended)

    def uninstall(self) -> None:
        self._shell.input_transformers_cleanup.remove(self)
        self._shell.events.unregister("pre_execute", self._started)
        self._shell.events.unregister("post_execute", self._ended)

    def _started(self) -> None:
        self._depth += 1

    def _ended(self) -> None:
        # IPython says a cell ended also for an empty cell it never started
        self._depth = max(0, self._depth - 1)

    def __call__(self, lines: list[str]) -> list[str]:
        """The cell as IPython is to run it: ``%%local``'s body, or a plain cell under ``%%sky``;
        raises the SyntaxError of a ``%%sky`` cell's body.
        """
        if lines and lines[0].rstrip() == LOCAL:
            return lines[1:]
        if lines and lines[0].split(maxsplit=1)[:1] == [SKY] and not self._depth:
            filename = cell_filename(self._shell.execution_count)
            CheckedSource.check("".join(lines[1:]), filename)
        if not self.enabled or self._depth or self._silent():
            return lines
        if not _runs_python("".join(lines)):
            return lines
        return [f"{SKY}\n", *lines]

    def _silent(self) -> bool:
        """Whether the request being served is a silent one (a frontend's own code)."""
        kernel = getattr(self._shell, "kernel", None)
        if kernel is None:
            return False
        parent = kernel.get_parent() or {}
        return bool(parent.get("content", {}).get("silent"))


def _runs_python(source: str) -> bool:
    """Whether ``source`` is Python as written (no magic, escape or help syntax in it) with a
    statement to run: a cell of comments alone starts no pool.
    """
    try:
        return bool(ast.parse(source).body)
    except (SyntaxError, ValueError):  # ValueError: a null byte in the source
        return False
