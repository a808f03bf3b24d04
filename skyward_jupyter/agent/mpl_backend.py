"""The ranks' matplotlib backend (``MPLBACKEND``; :mod:`.figures` says why): Agg draws, and
``plt.show()`` sends the open figures to the notebook.

matplotlib imports this module by name when a cell first uses pyplot, so it holds only what a
backend module must: its canvas, its figure manager and ``show``.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from . import figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show(block=...)``: nothing blocks here, so the arguments change nothing."""
    figures.show()
