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
import json
import os
import sys
import uuid
from collections.abc import Callable, Collection
from typing import Any

from .. import protocol as p
from .cell_head import CellHead

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
_RANK_ONLY = frozenset({"application/vnd.jupyter.widget-view+json"})
"""Forms that name an object living on the rank (a widget's model): the notebook has none."""
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
    """The rank's ``display`` builtin and figures (see the module's docstring)."""

    def __init__(self, head: CellHead, note: Callable[[str], None]) -> None:
        """``note``: a line for the cell's result (a figure that could not be drawn)."""
        self.rank = head.rank
        self._head = head
        self._note = note

    def install(self) -> None:
        """At the rank's start, before any cell imports matplotlib (which reads the variable)."""
        global _current
        _current = self
        builtins.display = self.display  # type: ignore[attr-defined]
        if os.environ.get("MPLBACKEND", "").lower() in FRONTEND_BACKENDS:
            os.environ["MPLBACKEND"] = BACKEND

    # ------------------------------------------------------------------------------ display

    def display(
        self,
        *objs: Any,
        raw: bool = False,
        include: Collection[str] | None = None,
        exclude: Collection[str] | None = None,
        metadata: dict[str, Any] | None = None,
        display_id: str | bool | None = None,
        **options: Any,
    ) -> DisplayHandle | None:
        """The notebook's builtin ``display``: on the cell's head, what Jupyter would show of
        each object (``raw``: each is a MIME bundle already); elsewhere its text, as ``print``.
        With ``display_id`` (``True``: a new one) it returns a handle whose ``update`` replaces
        what was shown, as IPython's does. Its other options (``transient``, ``clear``) do
        nothing here.
        """
        if display_id is True:
            display_id = uuid.uuid4().hex
        shown_id = display_id or None
        for obj in objs:
            self._display(obj, raw, include, exclude, metadata, shown_id, update=False)
        return DisplayHandle(self, shown_id) if shown_id else None

    def _display(
        self,
        obj: Any,
        raw: bool,
        include: Collection[str] | None,
        exclude: Collection[str] | None,
        metadata: dict[str, Any] | None,
        display_id: str | None,
        update: bool,
    ) -> None:
        head = self._head_cell()
        if head is None:
            text = obj.get("text/plain", "") if raw and isinstance(obj, dict) else _repr(obj)
            print(text)
            return
        if raw and isinstance(obj, dict):
            data, forms_metadata = dict(obj), dict[str, Any]()
        else:
            data, forms_metadata = self._forms(obj)
        data = {
            mime: value
            for mime, value in data.items()
            if (include is None or mime in include) and (exclude is None or mime not in exclude)
        }
        shown_metadata = {**forms_metadata, **(metadata or {})}
        self._show(
            head, data, f"display of {type(obj).__name__}", shown_metadata, display_id, update
        )

    def _forms(self, obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """What Jupyter's display shows of ``obj``, and its metadata: a figure as a PNG, else
        the forms its ``_repr_*_`` methods give (a method that raises is said and left out),
        and its repr.
        """
        if _is_figure(obj):
            return figure_forms(obj), {}
        data: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        bundle = self._asked(obj, "_repr_mimebundle_", include=None, exclude=None)
        if isinstance(bundle, tuple) and len(bundle) == 2:
            bundle, bundle_metadata = bundle
            metadata.update(bundle_metadata if isinstance(bundle_metadata, dict) else {})
        data.update(bundle if isinstance(bundle, dict) else {})
        for mime, name in _REPR_METHODS:
            if mime in data:
                continue
            value = self._asked(obj, name)
            if isinstance(value, tuple) and len(value) == 2:  # (data, its metadata)
                value, metadata[mime] = value
            if value is not None:
                data[mime] = value
        data.setdefault("text/plain", _repr(obj))
        return data, metadata

    def _asked(self, obj: Any, name: str, **kwargs: Any) -> Any:
        """``obj``'s method ``name`` called, where it has a real one (as IPython asks: not a
        class's, not a proxy's that answers every name); None if not, or if it raises (said).
        """
        method = _real_method(obj, name)
        if method is None:
            return None
        try:
            return method(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's method; said, and shown without it
            self._note(f"rank {self.rank}: {type(obj).__name__}.{name} raised {_said(exc)}")
            return None

    # ------------------------------------------------------------------------------ figures

    def cell_ended(self, failed: bool = False) -> None:
        """After every cell, as the inline backend does: the figures left open are shown. A
        failed cell's are closed undrawn: the pool stops the other ranks at once, and drawing
        would race that stop (shown or not by chance, and an interrupt said for its error).
        """
        if "matplotlib.pyplot" not in sys.modules:
            return  # no figure can be open: most cells pay one lookup
        import matplotlib

        if matplotlib.get_backend() != BACKEND:
            return  # the user's own backend keeps its figures as it does anywhere
        if failed:
            self.discard()
        else:
            self.show_open()

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
        """The open figures closed undrawn: after a failed cell, and after a script (``%sky
        run``), whose figures left open go unshown as when it ends under torchrun (what its
        ``plt.show()`` showed, it showed); the next cell would otherwise show them.
        """
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")

    # ------------------------------------------------------------------------------ internals

    def _head_cell(self) -> int | None:
        """The running cell's id where this process is the cell's head rank, else None (a rank
        that is not the head, no cell running, or a process a cell forked from the rank, which
        must not write on the rank's wire).
        """
        cell_id, head = self._head.cell()
        if cell_id is None or self.rank != head or self._head.forked():
            return None
        return cell_id

    def _show(
        self,
        cell_id: int,
        data: dict[str, Any],
        what: str,
        metadata: dict[str, Any] | None = None,
        display_id: str | None = None,
        update: bool = False,
    ) -> None:
        """Send what ``data`` and ``metadata`` hold that Jupyter's messages can carry, so the
        notebook can read and show it whatever the rank's own types; what cannot go, or is
        over :data:`MAX_RICH_BYTES` in all, is said instead.
        """
        carried = {}
        for mime, value in data.items():
            form = self._carried(mime, value, what)
            if form is not None:
                carried[mime] = form
        size = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in carried.values())
        if size > MAX_RICH_BYTES:
            self._note(
                f"rank {self.rank}: {what} was not shown: {size / 2**20:.1f} MiB, over the "
                f"{MAX_RICH_BYTES / 2**20:.0f} MiB a cell shows (its output is saved in the "
                "notebook); save it to a file instead (a figure: savefig, at a lower dpi)"
            )
            return
        if not carried:
            return
        self._head.flush()
        shown_metadata = _as_json(metadata or {}) or {}
        self._head.send(p.Display(cell_id, carried, shown_metadata, display_id, update))

    def _carried(self, mime: Any, value: Any, what: str) -> Any:
        """``value`` as a MIME bundle carries it (text; an image in base64; JSON), or None."""
        if mime in _RANK_ONLY:
            self._note(f"rank {self.rank}: {what}: a widget shows only where it lives")
            return None
        if not isinstance(mime, str):
            return None
        if isinstance(value, bytes):
            return base64.b64encode(value).decode("ascii")
        if isinstance(value, str):
            return str(value)  # a subclass of str would need its class in the notebook
        if mime.endswith("json") and (form := _as_json(value)) is not None:
            return form
        self._note(
            f"rank {self.rank}: {what}: its {mime} form ({type(value).__name__}) is not text, "
            "an image or JSON, so it was left out"
        )
        return None


class DisplayHandle:
    """What ``display(..., display_id=...)`` returns on a rank, as IPython's does: ``update``
    replaces what was shown under the id, ``display`` shows the object again under it.
    """

    def __init__(self, output: RichOutput, display_id: str) -> None:
        self._output = output
        self.display_id = display_id

    def display(self, obj: Any, raw: bool = False, **options: Any) -> None:
        self._again(obj, raw, options, update=False)

    def update(self, obj: Any, raw: bool = False, **options: Any) -> None:
        self._again(obj, raw, options, update=True)

    def _again(self, obj: Any, raw: bool, options: dict[str, Any], update: bool) -> None:
        metadata = options.get("metadata")
        self._output._display(obj, raw, None, None, metadata, self.display_id, update)


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


def _real_method(obj: Any, name: str) -> Callable[..., Any] | None:
    """``obj``'s method ``name``, as IPython looks for one: not on a class (its method is
    unbound), not on a proxy that answers any name, and None where looking raises.
    """
    if isinstance(obj, type):
        return None
    try:
        if getattr(obj, "_skyward_no_such_method_", None) is not None:
            return None  # answers every name: a mock, a proxy
        method = getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - an object whose __getattr__ raises has no such method
        return None
    return method if callable(method) else None


def _as_json(value: Any) -> Any:
    """``value`` as plain JSON (dicts, lists, strings, numbers), or None where it is not."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def _repr(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is shown as such, as IPython does
        return f"<{type(obj).__name__} object (its repr raised {_said(exc)})>"


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
