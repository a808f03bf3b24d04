"""A rank's rich output (agent/rich_output.py), in this process: figures drawn with the ranks'
backend and ``display`` calls, sent as a rank would send them (to a list here).
"""

from __future__ import annotations

import base64
import builtins
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from skyward_jupyter import protocol as p
from skyward_jupyter.agent import rich_output
from skyward_jupyter.agent.cell_head import CellHead
from skyward_jupyter.agent.rank import Agent

plt = pytest.importorskip("matplotlib.pyplot")


class Rank:
    """A :class:`RichOutput` as rank 0 builds it, with what it sends and notes kept."""

    def __init__(self, rank: int = 0, head: int = 0, cell_id: int | None = 7) -> None:
        self.sent: list[p.Display] = []
        self.notes: list[str] = []
        self.flushed = 0
        self.cell: tuple[int | None, int] = (cell_id, head)
        head = CellHead(rank, self.sent.append, lambda: self.cell, self._flush)
        self.output = rich_output.RichOutput(head, self.notes.append)

    def _flush(self) -> None:
        self.flushed += 1

    def images(self) -> list[str]:
        return [m.data["text/plain"] for m in self.sent if "image/png" in m.data]


@pytest.fixture
def backend() -> Iterator[None]:
    """pyplot on the ranks' backend; this process's own (Agg) again after the test."""
    plt.switch_backend(rich_output.BACKEND)
    try:
        yield
    finally:
        plt.switch_backend("Agg")
        rich_output._current = None


@pytest.mark.parametrize(
    ("inherited", "chosen"),
    [
        (None, rich_output.BACKEND),
        ("module://matplotlib_inline.backend_inline", rich_output.BACKEND),  # ipykernel's
        ("inline", rich_output.BACKEND),
        ("", rich_output.BACKEND),
        ("module://ipympl.backend_nbagg", rich_output.BACKEND),  # a frontend a rank lacks
        ("Agg", "Agg"),  # the user's own choice
        ("module://my_backend", "module://my_backend"),
    ],
)
def test_a_rank_uses_its_backend_unless_the_user_chose_one(
    monkeypatch: pytest.MonkeyPatch, inherited: str | None, chosen: str
) -> None:
    monkeypatch.setenv("MPLBACKEND", inherited or "")  # recorded, so put back after the test
    if inherited is None:
        monkeypatch.delenv("MPLBACKEND")
    monkeypatch.setattr(rich_output, "_current", None)
    monkeypatch.setattr(builtins, "display", None, raising=False)
    rank = Rank()
    rank.output.install()
    assert os.environ["MPLBACKEND"] == chosen
    assert rich_output._current is rank.output
    assert builtins.display == rank.output.display  # type: ignore[attr-defined]


@pytest.mark.usefixtures("backend")
def test_the_head_sends_its_open_figures_as_pngs_then_closes_them() -> None:
    rank = Rank()
    rich_output._current = rank.output
    plt.figure(figsize=(4, 3))
    plt.plot([1, 2, 3])
    plt.figure(figsize=(2, 2))  # nothing drawn on it: its text only, as IPython shows it
    plt.show()
    assert [m.data["text/plain"] for m in rank.sent] == [
        "<Figure size 400x300 with 1 Axes>",
        "<Figure size 200x200 with 0 Axes>",
    ]
    png = base64.b64decode(rank.sent[0].data["image/png"])
    assert png.startswith(b"\x89PNG") and "image/png" not in rank.sent[1].data
    assert all(m.cell_id == 7 for m in rank.sent) and rank.flushed >= 1
    assert plt.get_fignums() == []


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(
    ("rank", "head", "cell_id"),
    [(1, 0, 7), (0, 0, None)],
    ids=["not the head", "no cell running"],
)
def test_other_ranks_and_threads_between_cells_close_figures_undrawn(
    monkeypatch: pytest.MonkeyPatch, rank: int, head: int, cell_id: int | None
) -> None:
    drawn: list[Any] = []
    monkeypatch.setattr(rich_output, "figure_forms", drawn.append)
    other = Rank(rank, head, cell_id)
    plt.plot([1, 2])
    other.output.show_open()
    assert other.sent == [] and drawn == [] and plt.get_fignums() == []


@pytest.mark.usefixtures("backend")
def test_a_process_forked_from_the_rank_does_not_write_on_its_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rank = Rank()
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what the child sees: another pid
    plt.plot([1, 2])
    rank.output.show_open()
    assert rank.sent == [] and plt.get_fignums() == []


@pytest.mark.usefixtures("backend")
def test_a_figure_that_cannot_be_drawn_or_is_too_large_is_said_and_the_rest_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rank = Rank()
    plt.figure()
    plt.title(r"$\frac$")  # mathtext that fails as it is drawn
    plt.figure(figsize=(3, 3))
    plt.plot([1, 2])
    plt.figure(figsize=(8, 8))
    plt.imshow(np.random.default_rng(0).random((400, 400)))  # noise: a PNG of about 1.5 MB
    monkeypatch.setattr(rich_output, "MAX_RICH_BYTES", 200_000)
    rank.output.show_open()
    assert rank.images() == ["<Figure size 300x300 with 1 Axes>"], rank.sent
    first, second = rank.notes
    assert (
        first.startswith("rank 0: figure 1 could not be drawn: ValueError: ") and "\n" not in first
    )
    assert second.startswith("rank 0: figure 3 was not shown: ") and "savefig" in second
    assert plt.get_fignums() == []


@pytest.mark.usefixtures("backend")
def test_a_failed_cells_figures_are_closed_undrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool stops the other ranks as soon as one fails: drawing would race that stop (and
    its interrupt would be said in place of the cell's error).
    """
    drawn: list[Any] = []
    monkeypatch.setattr(rich_output, "figure_forms", drawn.append)
    rank = Rank()
    plt.plot([1, 2])
    rank.output.cell_ended(failed=True)
    assert rank.sent == [] and drawn == [] and rank.notes == [] and plt.get_fignums() == []


@pytest.mark.usefixtures("backend")
def test_a_scripts_figures_are_closed_unshown() -> None:
    rank = Rank()
    plt.plot([1, 2])
    rank.output.discard()
    assert rank.sent == [] and plt.get_fignums() == []


class Table:
    def _repr_html_(self) -> str:
        return "<table><tr><td>1</td></tr></table>"

    def _repr_markdown_(self) -> str:
        raise ValueError("no markdown\nsecond line")

    def __repr__(self) -> str:
        return "Table(1)"


def test_display_on_the_head_sends_what_jupyter_would_show(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rank = Rank()
    rank.output.display(Table(), "text", Table)
    rank.output.display({"text/plain": "raw", "image/png": b"\x89PNG"}, raw=True)
    table, text, cls, raw = (m.data for m in rank.sent)
    assert table == {"text/html": "<table><tr><td>1</td></tr></table>", "text/plain": "Table(1)"}
    assert text == {"text/plain": "'text'"}
    assert cls == {"text/plain": repr(Table)}  # a class's _repr_html_ is not called
    assert raw == {"text/plain": "raw", "image/png": base64.b64encode(b"\x89PNG").decode()}
    assert rank.notes == ["rank 0: Table._repr_markdown_ raised ValueError: no markdown"]
    assert capsys.readouterr().out == ""


class Point:
    """A type of the rank's own, which the notebook could not unpickle."""


class Odd:
    def _repr_json_(self) -> dict[str, Any]:
        return {"p": Point()}

    def _repr_html_(self) -> Any:
        return Point()

    def _repr_png_(self) -> tuple[bytes, dict[str, Any]]:
        return b"\x89PNG", {"width": 300}

    def __repr__(self) -> str:
        raise RuntimeError("broken repr")


class Proxy:
    """Answers every name, as a mock does."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: Point()

    def __repr__(self) -> str:
        return "Proxy()"


def test_display_sends_only_what_the_notebook_can_read_and_says_the_rest() -> None:
    """A form of a type the notebook lacks made the rank's message unreadable there (the rank
    was killed), and a proxy's answers failed to pickle: only text, images and JSON go.
    """
    rank = Rank()
    rank.output.display(Odd(), Proxy(), metadata={"isolated": True})
    rank.output.display(
        {"text/plain": "w", "application/vnd.jupyter.widget-view+json": {}}, raw=True
    )
    odd, proxy, widget = rank.sent
    assert odd.data == {
        "image/png": base64.b64encode(b"\x89PNG").decode(),
        "text/plain": "<Odd object (its repr raised RuntimeError: broken repr)>",
    }
    assert odd.metadata == {"image/png": {"width": 300}, "isolated": True}
    assert proxy.data == {"text/plain": "Proxy()"} and widget.data == {"text/plain": "w"}
    said = "\n".join(rank.notes)
    assert "application/json form (dict) is not text, an image or JSON" in said
    assert "text/html form (Point) is not text" in said and "a widget shows only" in said
    for message in rank.sent:  # what the notebook reads: builtins only
        assert type(message.data) is dict and all(
            type(v) in (str, dict) for v in message.data.values()
        )


def test_display_include_exclude_and_a_handle_that_updates_in_place() -> None:
    rank = Rank()
    handle = rank.output.display(Table(), exclude={"text/html"}, display_id=True)
    assert handle is not None
    handle.update(Table(), raw=False)
    rank.output.display(Table(), include={"text/html"})
    first, updated, only_html = rank.sent
    assert first.data == {"text/plain": "Table(1)"} and not first.update
    assert updated.display_id == first.display_id == handle.display_id and updated.update
    assert only_html.data == {"text/html": "<table><tr><td>1</td></tr></table>"}
    assert only_html.display_id is None and rank.output.display(Table()) is None


def test_display_elsewhere_prints_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    rank = Rank(rank=1, head=0)
    rank.output.display(Table(), {"text/plain": "raw"}, "x")
    rank.output.display({"text/plain": "raw"}, raw=True)
    handle = rank.output.display(Table(), display_id="progress")
    assert handle is not None
    handle.update("done")
    assert rank.sent == []
    out = capsys.readouterr().out
    assert out == "Table(1)\n{'text/plain': 'raw'}\n'x'\nraw\nTable(1)\n'done'\n"


class Wire:
    """A channel whose frame a signal cuts halfway, as the pool's interrupt or a cell's alarm
    would.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.frames: list[str] = []

    def send(self, message: object) -> None:
        self.frames.append("first half")
        signal.raise_signal(self.signum)
        self.frames.append("second half")


def _timed_out(signum: int, frame: object) -> None:
    raise TimeoutError("the cell's own alarm")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGALRM])
def test_a_signal_during_a_frame_the_cell_sends_is_handled_after_the_frame(signum: int) -> None:
    """Raised inside the write, the handler's exception left half a frame on the wire, and the
    notebook read what followed as its rest (the rank was then lost).
    """
    assert threading.current_thread() is threading.main_thread()
    agent = Agent.__new__(Agent)  # only what the handler and the sender use
    wire = Wire(signum)
    agent.channel = wire  # type: ignore[assignment]
    agent._in_cell = True
    handlers = {signal.SIGINT: agent._on_sigint, signal.SIGALRM: _timed_out}
    expected = {signal.SIGINT: KeyboardInterrupt, signal.SIGALRM: TimeoutError}[signum]
    previous = signal.signal(signum, handlers[signum])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        with pytest.raises(expected):
            agent._send_whole(p.Display(1, {"text/plain": "x"}, {}))
        assert wire.frames == ["first half", "second half"]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == mask  # the mask is put back
    finally:
        signal.signal(signum, previous)
