"""matplotlib figures a cell draws on the ranks, shown in the notebook as images.

A rank has no frontend. The notebook's kernel names Jupyter's inline backend in ``MPLBACKEND``
and the ranks inherit it, but there it finds no shell to display into and prints a figure's
text (``<Figure size 640x480 with 1 Axes>``), once per rank. The ranks use
:mod:`.mpl_backend` instead, which acts as the inline backend does: ``plt.show()``, and every
figure still open when the cell ends, goes to the notebook as a PNG and is closed. Only the
cell's head rank sends its figures, as only its stdout is the cell's; the other ranks close
theirs unrendered, so figures neither cost them a rendering nor pile up over cells.

A backend the user chose (``MPLBACKEND=Agg`` in the notebook's environment, or
``matplotlib.use`` in a cell) is left as it is. The processes a cell starts inherit the variable:
one whose Python cannot import this package and draws with pyplot needs ``MPLBACKEND`` of its own.
"""

from __future__ import annotations

import base64
import io
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import protocol as p

BACKEND = "module://skyward_jupyter.agent.mpl_backend"
INLINE_BACKENDS = frozenset(
    {
        "inline",
        "module://matplotlib_inline.backend_inline",
        "module://ipykernel.pylab.backend_inline",
    }
)
"""What a Jupyter kernel sets ``MPLBACKEND`` to, which a rank would otherwise inherit."""


class Figures:
    def __init__(
        self,
        rank: int,
        send: Callable[[object], None],
        cell: Callable[[], tuple[int | None, int]],
        flush: Callable[[], None],
        note: Callable[[str], None],
    ) -> None:
        """``cell``: the running cell's id and its head rank; ``flush``: the rank's output
        sent on, so what the cell printed before a figure shows before it; ``note``: a line
        for the cell's result (a figure that could not be drawn).
        """
        self.rank = rank
        self._send = send
        self._cell = cell
        self._flush = flush
        self._note = note

    def install(self) -> None:
        """At the rank's start, before any cell imports matplotlib (which reads the variable)."""
        global _current
        _current = self
        if os.environ.get("MPLBACKEND", "inline") in INLINE_BACKENDS:
            os.environ["MPLBACKEND"] = BACKEND

    def cell_ended(self) -> None:
        """After every cell, as the inline backend does: the figures left open are shown."""
        if "matplotlib.pyplot" not in sys.modules:
            return  # no figure can be open: most cells pay one lookup
        import matplotlib

        if matplotlib.get_backend() == BACKEND:
            self.show_open()

    def show_open(self) -> None:
        """``plt.show()``: the open figures to the notebook from the head rank, then closed."""
        import matplotlib.pyplot as plt
        from matplotlib._pylab_helpers import Gcf

        managers = Gcf.get_all_fig_managers()
        if not managers:
            return
        cell_id, head = self._cell()
        try:
            if cell_id is not None and self.rank == head:
                self._flush()
                for manager in managers:
                    try:
                        shown = bundle(manager.canvas.figure)
                    except Exception as exc:  # noqa: BLE001 - the user's figure; said, not raised
                        self._note(
                            f"rank {self.rank}: figure {manager.num} could not be drawn: "
                            f"{type(exc).__name__}: {exc}"
                        )
                        continue
                    self._send(p.Display(cell_id, shown))
        finally:
            plt.close("all")


def bundle(figure: Any) -> dict[str, str]:
    """A figure as Jupyter's inline backend shows it: a PNG cut to what is drawn, and its text."""
    png = io.BytesIO()
    figure.savefig(png, format="png", bbox_inches="tight")
    return {
        "image/png": base64.b64encode(png.getvalue()).decode("ascii"),
        "text/plain": repr(figure),
    }


_current: Figures | None = None
"""The rank's :class:`Figures`, for :mod:`.mpl_backend`, which matplotlib loads by name."""


def show() -> None:
    """The backend's ``show``: the open figures shown, where a rank installed :class:`Figures`."""
    if _current is not None:
        _current.show_open()
