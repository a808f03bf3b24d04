"""A cell's rich output on the ranks: matplotlib figures and ``display()``, shown in the
notebook as Jupyter shows them.

A rank has no frontend. The notebook's kernel names Jupyter's inline backend in ``MPLBACKEND``
and local ranks inherit it, but there it finds no shell to display into and prints a figure's
text (``<Figure size 640x480 with 1 Axes>``), once per rank; and ``display``, a builtin in a
notebook, did not exist on a rank at all. So the ranks use :mod:`.mpl_backend`, which acts as the
inline backend does: ``plt.show()``, and every figure still open when a cell ends, goes to the
notebook as a PNG and is closed; and ``display(obj)`` sends what Jupyter would show of ``obj``
(its ``_repr_html_`` and the like, and its repr).

Only the cell's head sends rich output (the notebook shows it whatever ``--stdout`` says: it is
not stdout): the other ranks close their figures undrawn, so figures neither cost them a
rendering nor pile up over cells, and their ``display`` prints the object's text, as their
stdout. A backend the user chose (``matplotlib.use("Agg")`` in a cell, or ``MPLBACKEND``, which
only local and Ray ranks take from the notebook: elsewhere ``--env MPLBACKEND=Agg``) is left as
it is. The processes a cell starts inherit the variable; the backend module imports only
matplotlib, so where such a process cannot import this package, pyplot is all that fails.
"""

from __future__ import annotations

import base64
import builtins
import io
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import protocol as p

BACKEND = "module://skyward_jupyter.agent.mpl_backend"
FRONTEND_BACKENDS = frozenset(
    {
        "",
        "inline",
        "module://matplotlib_inline.backend_inline",
        "module://ipykernel.pylab.backend_inline",
        "widget",
        "ipympl",
        "module://ipympl.backend_nbagg",
        "nbagg",
    }
)
"""Backends that draw into a notebook's frontend (lower case): a rank has none, so they give
way to :data:`BACKEND`. Jupyter's kernel sets the first ones; the rest a user may."""
MAX_RICH_BYTES = 8 * 2**20
"""The most one figure or ``display`` may send: a cell's output is saved in the notebook."""
_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
    ("application/pdf", "_repr_pdf_"),
)
"""The methods Jupyter's display asks an object for its forms, and the type of each."""


class RichOutput:
    def __init__(
        self,
        rank: int,
        send: Callable[[object], None],
        cell: Callable[[], tuple[int | None, int]],
        flush: Callable[[], None],
        note: Callable[[str], None],
    ) -> None:
        """``send``: a message to the notebook, sent whole even if the cell is interrupted;
        ``cell``: the running cell's id and its head rank; ``flush``: the rank's output sent on,
        so what the cell printed before a figure shows before it; ``note``: a line for the
        cell's result (a figure that could not be drawn).
        """
        self.rank = rank
        self._send = send
        self._cell = cell
        self._flush = flush
        self._note = note
        self._pid = os.getpid()

    def install(self) -> None:
        """At the rank's start, before any cell imports matplotlib (which reads the variable)."""
        global _current
        _current = self
        builtins.display = self.display  # type: ignore[attr-defined]
        if os.environ.get("MPLBACKEND", "").lower() in FRONTEND_BACKENDS:
            os.environ["MPLBACKEND"] = BACKEND

    # ------------------------------------------------------------------------------ display

    def display(self, *objs: Any, raw: bool = False, **options: Any) -> None:
        """The notebook's builtin ``display``: on the cell's head, what Jupyter would show of
        each object (``raw``: each is a MIME bundle already); elsewhere its text, as ``print``.
        ``display_id``, ``metadata`` and the other options of IPython's have no effect here.
        """
        head = self._head_cell()
        for obj in objs:
            if head is None:
                print(obj.get("text/plain", "") if raw and isinstance(obj, dict) else repr(obj))
                continue
            data = dict(obj) if raw and isinstance(obj, dict) else self._forms(obj)
            self._show(head, data, f"display of {type(obj).__name__}")

    def _forms(self, obj: Any) -> dict[str, Any]:
        """What Jupyter's display shows of ``obj``: a figure as a PNG, else the forms its
        ``_repr_*_`` methods give (a method that raises is said and left out), and its repr.
        """
        if _is_figure(obj):
            return figure_forms(obj)
        data: dict[str, Any] = {}
        if not isinstance(obj, type):  # a class's _repr_html_ is an unbound function
            bundle = self._asked(obj, "_repr_mimebundle_", include=None, exclude=None)
            data.update(bundle if isinstance(bundle, dict) else {})
            for mime, name in _REPR_METHODS:
                if mime not in data and (value := self._asked(obj, name)) is not None:
                    data[mime] = value
        data.setdefault("text/plain", repr(obj))
        return data

    def _asked(self, obj: Any, name: str, **kwargs: Any) -> Any:
        method = getattr(obj, name, None)
        if not callable(method):
            return None
        try:
            value = method(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's method; said, and shown without it
            self._note(f"rank {self.rank}: {type(obj).__name__}.{name} raised {_said(exc)}")
            return None
        return value[0] if isinstance(value, tuple) else value  # (data, metadata)

    # ------------------------------------------------------------------------------ figures

    def cell_ended(self, failed: bool = False) -> None:
        """After every cell, as the inline backend does: the figures left open are shown. After
        a failed cell, nothing here may replace its error (the pool stops the other ranks, and
        may interrupt this one while it draws): what goes wrong is said instead.
        """
        if "matplotlib.pyplot" not in sys.modules:
            return  # no figure can be open: most cells pay one lookup
        import matplotlib

        if matplotlib.get_backend() != BACKEND:
            return  # the user's own backend keeps its figures as it does anywhere
        if not failed:
            self.show_open()
            return
        try:
            self.show_open()
        except BaseException as exc:  # noqa: BLE001 - the cell's own error is its result
            self._note(f"rank {self.rank}: its open figures were not shown: {_said(exc)}")

    def show_open(self) -> None:
        """``plt.show()``: the open figures to the notebook from the head rank, then closed."""
        import matplotlib.pyplot as plt
        from matplotlib._pylab_helpers import Gcf

        try:
            head = self._head_cell()
            if head is None:
                return
            for manager in Gcf.get_all_fig_managers():
                try:
                    data = figure_forms(manager.canvas.figure)
                except Exception as exc:  # noqa: BLE001 - the user's figure; said, not raised
                    self._note(
                        f"rank {self.rank}: figure {manager.num} could not be drawn: {_said(exc)}"
                    )
                    continue
                self._show(head, data, f"figure {manager.num}")
        finally:
            plt.close("all")

    def discard(self) -> None:
        """After a script (``%sky run``): its figures closed unshown, as when it ends under
        torchrun; the next cell would otherwise show them.
        """
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")

    # ------------------------------------------------------------------------------ internals

    def _head_cell(self) -> int | None:
        """The running cell's id where this process is the cell's head rank, else None (a rank
        that is not the head, no cell running, or a process a cell forked from the rank, which
        must not write on the rank's wire).
        """
        cell_id, head = self._cell()
        if cell_id is None or self.rank != head or os.getpid() != self._pid:
            return None
        return cell_id

    def _show(self, cell_id: int, data: dict[str, Any], what: str) -> None:
        for mime, value in data.items():
            if isinstance(value, bytes):  # an image; the notebook's format has it in base64
                data[mime] = base64.b64encode(value).decode("ascii")
        size = sum(len(v) for v in data.values() if isinstance(v, str))
        if size > MAX_RICH_BYTES:
            self._note(
                f"rank {self.rank}: {what} was not shown: {size / 2**20:.1f} MiB, over the "
                f"{MAX_RICH_BYTES / 2**20:.0f} MiB a cell shows (its output is saved in the "
                "notebook); save it to a file instead (a figure: savefig, at a lower dpi)"
            )
            return
        self._flush()
        self._send(p.Display(cell_id, data))


def figure_forms(figure: Any) -> dict[str, Any]:
    """A figure as Jupyter's inline backend shows it: a PNG cut to what is drawn, and its
    text; a figure with nothing on it (``plt.figure()`` alone) as its text only.
    """
    data: dict[str, Any] = {"text/plain": repr(figure)}
    if figure.axes or figure.lines:
        png = io.BytesIO()
        figure.savefig(png, format="png", bbox_inches="tight")
        data["image/png"] = png.getvalue()
    return data


def _is_figure(obj: Any) -> bool:
    module = sys.modules.get("matplotlib.figure")
    return module is not None and isinstance(obj, module.Figure)


def _said(exc: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__


_current: RichOutput | None = None
"""The rank's :class:`RichOutput`, for :mod:`.mpl_backend`, which matplotlib loads by name."""


def show() -> None:
    """The backend's ``show``: the open figures shown, where a rank installed
    :class:`RichOutput`.
    """
    if _current is not None:
        _current.show_open()
