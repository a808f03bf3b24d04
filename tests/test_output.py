"""CellOutput: how rank output is written into the cell (no pool: events are fed in directly).

The clock is injected, so the stderr hold window is crossed by moving time, not by sleeping.
"""

from __future__ import annotations

import io

from skyward_jupyter.display.output import STDERR_HOLD_SECONDS, VIEW_STALE_SECONDS, CellOutput
from skyward_jupyter.events import DisplayReceived, OutputReceived
from skyward_jupyter.flags import rank_span


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(ranks: int | None = 2, mode: str = "head") -> tuple[CellOutput, io.StringIO, Clock]:
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    view = CellOutput(mode, out, err, ranks=ranks, clock=clock)  # type: ignore[arg-type]
    return view, err, clock


def send(view: CellOutput, rank: int, text: str, stream: str = "stderr") -> None:
    view.on_event(OutputReceived(rank, 1, stream, text))


def test_rank_span_names_runs_as_ranges() -> None:
    assert rank_span([0, 1]) == "0-1"
    assert rank_span([3, 0, 2]) == "0,2-3"
    assert rank_span([1]) == "1"
    assert rank_span([0, 2, 4, 5, 6]) == "0,2,4-6"


def test_the_same_line_from_every_rank_is_written_once_at_once() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "UserWarning: same\n")
    send(view, 1, "UserWarning: same\n")
    view.flush()  # no time passes: every rank wrote it, so nothing waits
    assert err.getvalue() == "[ranks 0-1 stderr] UserWarning: same\n"
    view.finish()
    assert err.getvalue() == "[ranks 0-1 stderr] UserWarning: same\n"


def test_the_same_line_arriving_in_later_flushes_is_still_joined() -> None:
    view, err, clock = make(ranks=2)
    send(view, 1, "same\n")
    view.flush()
    assert err.getvalue() == ""
    clock.now += STDERR_HOLD_SECONDS / 2
    send(view, 0, "same\n")
    view.flush()
    assert err.getvalue() == "[ranks 0-1 stderr] same\n"


def test_distinct_lines_keep_their_own_rank() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "careful 0\n")
    send(view, 1, "careful 1\n")
    view.finish()
    assert err.getvalue().splitlines() == ["[rank 0 stderr] careful 0", "[rank 1 stderr] careful 1"]


def test_a_line_only_rank_0_writes_is_held_no_longer_than_the_window() -> None:
    view, err, clock = make(ranks=2)
    send(view, 0, "only the head\n")
    view.flush()
    assert err.getvalue() == ""  # waiting a moment for rank 1's copy
    clock.now += STDERR_HOLD_SECONDS
    view.flush()
    assert err.getvalue() == "[rank 0 stderr] only the head\n"


def test_without_a_rank_count_only_the_window_applies() -> None:
    view, err, clock = make(ranks=None)
    send(view, 0, "same\n")
    send(view, 1, "same\n")
    view.flush()
    assert err.getvalue() == ""
    clock.now += STDERR_HOLD_SECONDS
    view.flush()
    assert err.getvalue() == "[ranks 0-1 stderr] same\n"


def test_a_one_rank_pool_holds_nothing() -> None:
    view, err, _ = make(ranks=1)
    send(view, 0, "alone\n")
    view.flush()
    assert err.getvalue() == "[rank 0 stderr] alone\n"


def test_a_partial_or_redrawn_chunk_is_written_at_once() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "\r 10%|#   |")
    view.flush()
    assert err.getvalue() == "\r[rank 0 stderr]  10%|#   |"
    send(view, 0, "\r100%|####|\n")
    view.flush()
    assert err.getvalue() == "\r[rank 0 stderr]  10%|#   |\r[rank 0 stderr] 100%|####|\n"
    send(view, 1, "no newline yet")
    view.flush()
    assert err.getvalue().endswith("[rank 1 stderr] no newline yet")
    send(view, 1, " and the rest\n")  # continues rank 1's line: passes through, not held
    view.flush()
    assert err.getvalue().endswith("[rank 1 stderr] no newline yet and the rest\n")


def test_progress_bars_on_several_ranks_keep_one_line_redrawing() -> None:
    """tqdm on every rank: the first rank's bar redraws the line in view; another rank's
    redraws wait, and its last state shows as a line once that line ends (or at the cell's end),
    not a line per redraw.
    """
    view, err, _ = make(ranks=2)
    for step in ("  0%", " 50%"):
        send(view, 0, f"\r{step}|")
        send(view, 1, f"\r{step}|")
        view.flush()
    assert err.getvalue() == "\r[rank 0 stderr]   0%|\r[rank 0 stderr]  50%|"
    send(view, 0, "\r100%|\n")
    view.flush()
    assert err.getvalue().endswith("\r[rank 0 stderr] 100%|\n\r[rank 1 stderr]  50%|\n")
    send(view, 1, "\r 75%|")  # no other bar in view now: redrawn at once
    send(view, 1, "\r100%|\n")
    view.flush()
    assert err.getvalue().endswith("|\n\r[rank 1 stderr]  75%|\r[rank 1 stderr] 100%|\n")
    send(view, 0, "\r 10%|")
    send(view, 1, "\r 20%|")
    view.finish()  # the cell ended: the waiting state is not lost
    assert err.getvalue().endswith("\r[rank 0 stderr]  10%|\n\r[rank 1 stderr]  20%|\n")


def test_a_waiting_bar_keeps_its_ranks_order_and_its_end_continues_it() -> None:
    view, err, _ = make(ranks=3)
    send(view, 0, "\r 10%|")
    send(view, 1, "a warning first\n")  # held: the other ranks may write it too
    send(view, 1, "\r 50%|")  # waits: rank 0's bar is the line in view
    send(view, 2, "\r 20%|")
    view.flush()
    send(view, 0, "\r100%|\n")
    view.flush()
    assert err.getvalue().endswith(
        "\r[rank 0 stderr] 100%|\n[rank 1 stderr] a warning first\n"
        "\r[rank 1 stderr]  50%|\n\r[rank 2 stderr]  20%|\n"
    ), err.getvalue()
    send(view, 0, "\r 10%|")
    send(view, 2, "\r100%|")
    view.flush()
    send(view, 2, "\n")  # tqdm's close: ends the bar that waited, with no empty line
    view.finish()
    assert err.getvalue().endswith("\r[rank 0 stderr]  10%|\n\r[rank 2 stderr] 100%|\n")


def test_a_partial_line_left_open_hands_the_view_to_other_ranks_bars() -> None:
    """Rank 0 leaves a partial stderr line open (a prompt, a stalled bar): rank 1's bar waits
    only until that line has gone unwritten for a while, then shows its last state and goes on
    redrawing in view, rather than stay hidden until the cell ends.
    """
    view, err, clock = make(ranks=2)
    send(view, 0, "waiting for the data")
    send(view, 1, "\r 10%|")
    view.flush()
    assert err.getvalue() == "[rank 0 stderr] waiting for the data"  # rank 1's bar waits
    clock.now += VIEW_STALE_SECONDS
    view.flush()  # nothing new: the waiting bar's last state shows all the same
    assert err.getvalue().endswith("the data\n\r[rank 1 stderr]  10%|\n"), err.getvalue()
    send(view, 1, "\r 20%|")
    view.flush()
    assert err.getvalue().endswith("10%|\n\r[rank 1 stderr]  20%|"), err.getvalue()


def test_a_line_another_rank_ended_takes_its_own_closing_newline_as_its_end() -> None:
    """Rank 1's partial line ended rank 0's in view; rank 0's own newline, when it comes, is
    that line's end (already written), not an empty labelled line.
    """
    view, err, _ = make(ranks=2)
    send(view, 0, "loading")
    send(view, 1, "warming up")
    send(view, 0, "\n")
    send(view, 1, " done\n")
    view.finish()
    assert err.getvalue() == ("[rank 0 stderr] loading\n[rank 1 stderr] warming up done\n"), (
        err.getvalue()
    )


def test_a_slow_bar_in_view_keeps_it_however_long_between_its_redraws() -> None:
    """Bars with long steps on every rank: the bar in view keeps redrawing the line, the
    others wait, rather than each redraw of each rank taking the line over as a line of its own.
    """
    view, err, clock = make(ranks=2)
    for step in range(1, 4):
        send(view, 0, f"\r{step}0%|")
        view.flush()
        clock.now += VIEW_STALE_SECONDS + 1
        send(view, 1, f"\r{step}0%|")
        view.flush()
        clock.now += VIEW_STALE_SECONDS + 1
    assert err.getvalue() == "".join(f"\r[rank 0 stderr] {step}0%|" for step in range(1, 4))


def test_a_bar_shown_as_a_line_takes_its_own_closing_newline_as_that_lines_end() -> None:
    """A waiting bar's last state was shown as a line (the line in view ended); the newline its
    rank writes as the bar closes ends that line, rather than add an empty labelled one.
    """
    view, err, _ = make(ranks=3)
    send(view, 1, "\r 10%|")
    send(view, 2, "\r 20%|")
    send(view, 1, "\r100%|\n")
    send(view, 2, "\n")
    view.finish()
    assert err.getvalue() == (
        "\r[rank 1 stderr]  10%|\r[rank 1 stderr] 100%|\n\r[rank 2 stderr]  20%|\n"
    ), err.getvalue()


def test_a_pass_through_chunk_writes_that_ranks_held_lines_first() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "first\n")
    send(view, 1, "other\n")
    view.flush()
    assert err.getvalue() == ""
    send(view, 0, "\rbar")
    view.flush()
    assert err.getvalue() == "[rank 0 stderr] first\n\r[rank 0 stderr] bar"
    view.finish()
    assert err.getvalue().endswith("\n[rank 1 stderr] other\n")


def test_finish_writes_every_held_line() -> None:
    view, err, _ = make(ranks=4)
    send(view, 0, "a\n")
    send(view, 2, "a\n")
    send(view, 3, "b\n")
    view.flush()
    assert err.getvalue() == "" and view.held_lines == 2
    view.finish()
    assert err.getvalue() == "[ranks 0,2 stderr] a\n[rank 3 stderr] b\n"
    assert view.held_lines == 0


def test_four_ranks_name_the_ranks_that_wrote_it() -> None:
    view, err, clock = make(ranks=4)
    for rank in (0, 2, 3):
        send(view, rank, "UserWarning: three of four\n")
    view.flush()
    assert err.getvalue() == ""  # rank 1 may still write it
    clock.now += STDERR_HOLD_SECONDS
    view.flush()
    assert err.getvalue() == "[ranks 0,2-3 stderr] UserWarning: three of four\n"


def test_a_rank_repeating_a_line_is_not_collapsed() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "tick\ntick\n")
    view.finish()
    assert err.getvalue() == "[rank 0 stderr] tick\n[rank 0 stderr] tick\n"

    view, err, _ = make(ranks=2)
    send(view, 0, "tick\ntick\n")
    send(view, 1, "tick\n")
    send(view, 1, "tick\n")
    view.flush()
    assert err.getvalue() == "[ranks 0-1 stderr] tick\n[ranks 0-1 stderr] tick\n"


def test_each_ranks_order_is_kept() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "A\nB\n")
    send(view, 1, "B\nA\n")
    view.finish()
    lines = err.getvalue().splitlines()
    for rank in (0, 1):
        mine = [line.split("] ")[1] for line in lines if str(rank) in line.split("]")[0]]
        assert mine == (["A", "B"] if rank == 0 else ["B", "A"]), lines


def test_a_line_everyone_wrote_waits_for_that_ranks_older_lines() -> None:
    view, err, _ = make(ranks=2)
    send(view, 0, "A\nB\n")
    send(view, 1, "B\n")
    view.flush()  # B is complete, so rank 0's older A goes out first
    assert err.getvalue() == "[rank 0 stderr] A\n[ranks 0-1 stderr] B\n"


def test_stdout_is_not_held() -> None:
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    view = CellOutput("all", out, err, ranks=2, clock=clock)
    send(view, 0, "same\n", "stdout")
    send(view, 1, "same\n", "stdout")
    view.flush()
    assert sorted(out.getvalue().splitlines()) == ["[rank 0] same", "[rank 1] same"]


# ------------------------------------------------------------ the order of a rank's two streams


class Log(io.StringIO):
    """One notebook stream, recording each write as (stream, text) into a log shared by both."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self._name, self._log = name, log

    def write(self, text: str) -> int:
        self._log.append((self._name, text))
        return len(text)


def logged(ranks: int, mode: str = "head") -> tuple[CellOutput, list[tuple[str, str]], Clock]:
    log: list[tuple[str, str]] = []
    clock = Clock()
    view = CellOutput(mode, Log("stdout", log), Log("stderr", log), ranks=ranks, clock=clock)  # type: ignore[arg-type]
    return view, log, clock


def test_one_flush_writes_the_streams_in_the_order_they_came() -> None:
    view, log, _ = logged(ranks=1)
    for i in range(2):
        send(view, 0, f"out {i}\n", "stdout")
        send(view, 0, f"err {i}\n", "stderr")
    view.flush()
    assert log == [
        ("stdout", "out 0\n"),
        ("stderr", "[rank 0 stderr] err 0\n"),
        ("stdout", "out 1\n"),
        ("stderr", "[rank 0 stderr] err 1\n"),
    ]


def test_the_heads_stdout_waits_behind_its_held_stderr_line() -> None:
    view, log, clock = logged(ranks=2)
    send(view, 0, "warning\n", "stderr")  # held: rank 1 may write the same line
    send(view, 0, "after\n", "stdout")
    view.flush()
    assert log == []
    clock.now += STDERR_HOLD_SECONDS
    send(view, 0, "later\n", "stdout")
    view.flush()
    assert log == [("stderr", "[rank 0 stderr] warning\n"), ("stdout", "after\nlater\n")]


def test_stdout_behind_a_shared_line_goes_with_it_and_the_line_is_still_joined() -> None:
    view, log, _ = logged(ranks=2)
    send(view, 0, "same\n", "stderr")
    send(view, 0, "step 1\n", "stdout")
    send(view, 0, "own\n", "stderr")
    view.flush()
    send(view, 1, "same\n", "stderr")
    view.flush()  # every rank wrote "same": it goes, and rank 0's stdout after it
    assert log == [("stderr", "[ranks 0-1 stderr] same\n"), ("stdout", "step 1\n")]
    view.finish()
    assert log[2:] == [("stderr", "[rank 0 stderr] own\n")]


def test_each_ranks_streams_keep_their_order_with_every_rank_shown() -> None:
    view, log, clock = logged(ranks=2, mode="all")
    send(view, 1, "warn\n", "stderr")
    send(view, 0, "zero\n", "stdout")  # rank 0 has nothing held: not kept waiting
    send(view, 1, "one\n", "stdout")
    view.flush()
    assert log == [("stdout", "[rank 0] zero\n")]
    clock.now += STDERR_HOLD_SECONDS
    view.flush()
    assert log[1:] == [("stderr", "[rank 1 stderr] warn\n"), ("stdout", "[rank 1] one\n")]


def test_output_over_the_flush_limit_is_skipped_from_the_oldest_in_whole_lines() -> None:
    """A flood of output keeps its newest part: the first line kept is whole (not the tail of
    a line cut in two), and the cell says how many characters were skipped.
    """
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    view = CellOutput("head", out, err, ranks=1, clock=clock)
    lines = [f"line {i:06d}\n" for i in range(30_000)]  # 360,000 characters
    for line in lines:
        send(view, 0, line, "stdout")
    view.finish()
    marker, first, *rest = out.getvalue().split("\n")
    assert marker.startswith("[skyward_jupyter: ") and "skipped" in marker
    assert first.startswith("line ") and len(first) == len("line 000000"), first
    skipped = int(marker.split()[1])
    assert skipped == sum(map(len, lines)) - len(out.getvalue()) + len(marker) + 1
    assert rest[-2] == "line 029999"


class Written(io.StringIO):
    """A notebook stream that records, with the figures shown, in what order things came."""

    def __init__(self, name: str, order: list[str]) -> None:
        super().__init__()
        self._name, self._order = name, order

    def write(self, text: str) -> int:
        self._order.append(f"{self._name}: {text}")
        return super().write(text)


def shown_in_order(
    mode: str, events: list[OutputReceived | DisplayReceived], flush_each: bool = True
) -> list[str]:
    order: list[str] = []
    view = CellOutput(
        mode,  # type: ignore[arg-type]
        Written("stdout", order),
        Written("stderr", order),
        ranks=2,
        clock=Clock(),
        show=lambda shown: order.append(f"figure: {shown.data['text/plain']}"),
    )
    for event in events:
        view.on_event(event)
        if flush_each:
            view.flush()
    view.finish()
    return order


FIGURE = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 640x480 with 1 Axes>"}


def test_a_heads_figure_shows_behind_what_it_wrote_before_and_before_what_follows() -> None:
    """A warning every rank printed stays one line, though the head showed a figure after it
    (the figure waits behind it, as the head's stdout would); the figure shows whatever
    ``--stdout`` says (it is not stdout), and another rank's is not the cell's (nor sent: see
    agent/rich_output.py).
    """
    events: list[OutputReceived | DisplayReceived] = [
        OutputReceived(0, 1, "stdout", "epoch 1\n"),
        OutputReceived(0, 1, "stderr", "UserWarning: every rank\n"),
        DisplayReceived(0, 1, FIGURE, {}),
        DisplayReceived(1, 1, FIGURE, {}),
        OutputReceived(1, 1, "stderr", "UserWarning: every rank\n"),
        OutputReceived(0, 1, "stdout", "epoch 2\n"),
    ]
    assert shown_in_order("head", events) == [
        "stdout: epoch 1\n",
        "stderr: [ranks 0-1 stderr] UserWarning: every rank\n",
        "figure: <Figure size 640x480 with 1 Axes>",
        "stdout: epoch 2\n",
    ]
    assert shown_in_order("none", events) == [
        "stderr: [ranks 0-1 stderr] UserWarning: every rank\n",
        "figure: <Figure size 640x480 with 1 Axes>",
    ]


def test_figures_are_kept_when_a_flood_of_text_is_skipped() -> None:
    lines = [OutputReceived(0, 1, "stdout", f"line {i:06d}\n") for i in range(30_000)]
    order = shown_in_order("head", [DisplayReceived(0, 1, FIGURE, {}), *lines], flush_each=False)
    assert order[0] == "figure: <Figure size 640x480 with 1 Axes>"
    assert "skipped" in order[1] and order[-1].endswith("line 029999\n")


def test_a_display_the_notebook_cannot_show_is_said_and_the_cell_goes_on() -> None:
    """Raised from the flush, the frontend's error ended the notebook's wait while the ranks
    still ran, and the cell's later output never came.
    """

    def broken(shown: DisplayReceived) -> None:
        raise ValueError("Can't clean for JSON")

    out, err = io.StringIO(), io.StringIO()
    view = CellOutput("head", out, err, ranks=1, clock=Clock(), show=broken)
    view.on_event(DisplayReceived(0, 1, {"text/plain": "x", "application/json": {}}, {}))
    send(view, 0, "later\n", "stdout")
    view.flush()
    assert out.getvalue() == "later\n"
    assert err.getvalue() == (
        "[skyward_jupyter: rank 0's display (text/plain, application/json) could not be shown: "
        "ValueError: Can't clean for JSON]\n"
    )
