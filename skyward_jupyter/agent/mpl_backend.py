"""The ranks' matplotlib backend (``MPLBACKEND``; :mod:`.rich_output` says why): Agg draws, and
``plt.show()`` sends the open figures to the notebook.

matplotlib imports this module by name when pyplot is first used, also in the processes a cell
starts, which inherit the variable: so it imports nothing but matplotlib, and in a process that
is not a rank its ``show`` does nothing, as Agg's.
"""

from __future__ import annotations

import sys
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg


class FigureCanvas(FigureCanvasAgg):
    def draw_idle(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is on a screen to redraw: a figure is drawn when it is shown. (Agg's would
        draw it whole on every pyplot call in interactive mode, on every rank.)
        """


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show(block=...)``: nothing blocks here, so the arguments change nothing."""
    rich_output = sys.modules.get("skyward_jupyter.agent.rich_output")
    if rich_output is not None:
        rich_output.show()
