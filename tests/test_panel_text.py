"""The text fallback: state changes and per-step metrics as plain lines, from the kernel thread."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.display.text import TextReport
from skyward_jupyter.display.views import PoolViews
from skyward_jupyter.events import (
    CellFinished,
    CellStarted,
    MetricsLogged,
    NodeStateChanged,
    OutputReceived,
    PoolMessage,
    RankState,
    RankStateChanged,
    RankUsage,
)
from skyward_jupyter.providers.base import Node, Progress, no_progress
from skyward_jupyter.providers.local import LocalProvider
from skyward_jupyter.results import CellError, RankResult, RemoteError, RunResult, Stop
from skyward_jupyter.runtime import TOTAL_KEY
from skyward_jupyter.session import PoolSpec, Session

S = RankState
ESCAPES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(**kw: object) -> tuple[TextReport, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return TextReport(out, clock=clock, **kw), out, clock  # type: ignore[arg-type]


def lines(out: io.StringIO) -> list[str]:
    text = out.getvalue()
    assert not ESCAPES.search(text), f"control characters in {text!r}"
    return text.splitlines()


def test_notable_state_changes_are_lines_and_routine_ones_are_not() -> None:
    text, out, _ = report()
    for state in (S.BOOTING, S.CONNECTING, S.READY, S.RUNNING, S.IDLE):
        text.on_event(RankStateChanged.of(0, 0, state))
    text.on_event(RankStateChanged.of(1, 1, S.LOST, "killed by SIGKILL"))
    text.on_event(RankStateChanged.of(1, 1, S.BOOTING))
    text.on_event(RankStateChanged.of(1, 1, S.READY, "gloo, port 1234"))
    text.on_event(RankStateChanged.of(0, 0, S.FAILED))
    text.on_event(RankStateChanged.of(0, 0, S.READY))
    assert out.getvalue() == "", "nothing is written from the IO thread"
    text.flush()
    assert lines(out) == [
        "rank 1 (node 1): lost, killed by SIGKILL",
        "rank 1 (node 1): ready again",
        "rank 0 (node 0): failed",
    ]


def test_lost_ranks_back_in_one_batched_event_are_said_ready_again_on_one_line() -> None:
    """A round's answers come as one event for several ranks: the lost ones among them are
    told, on one line as they were lost, the others stay routine.
    """
    text, out, _ = report()
    text.on_event(RankStateChanged.of(2, 1, S.LOST, "killed by SIGKILL"))
    text.on_event(RankStateChanged.of(3, 1, S.LOST, "killed by SIGKILL"))
    text.on_event(RankStateChanged(((0, 0), (2, 1), (3, 1)), S.READY))
    text.flush()
    assert lines(out) == [
        "ranks 2-3 (node 1): lost, killed by SIGKILL",
        "ranks 2-3 (node 1): ready again",
    ]


def test_hundreds_of_ranks_changing_alike_are_one_line_and_a_real_pool_reads_by_node(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """256 ranks failing together are one line, not 256; on a real pool of 20 ranks over 10
    nodes, ``%sky panel``'s text puts the failed ranks first (one line for one error), their
    nodes next with their ranks counted per state, and folds the healthy nodes.
    """
    text, out, _ = report()
    text.on_event(RankStateChanged(tuple((r, r // 8) for r in range(256)), S.FAILED))
    text.on_event(RankStateChanged.of(3, 0, S.LOST, "killed by SIGKILL"))
    text.on_event(RankStateChanged.of(4, 0, S.LOST, "killed by SIGKILL"))
    text.flush()
    assert lines(out) == [
        "ranks 0-255 (nodes 0-31): failed",
        "ranks 3-4 (node 0): lost, killed by SIGKILL",
    ]

    views = PoolViews(shell=None)
    session = Session(announce=lambda _: None, views=views)
    views.attach(session.down_pool)
    spec = PoolSpec(nodes=10, procs_per_node=2, frameworks=("none",))
    try:
        # Ranks 5 and 13 both raise: each ignores the pool's interrupt (which the first
        # failure sends the others) once both are past a barrier, so neither is stopped first.
        cell = (
            "import os, signal, time\n"
            "if rank in (5, 13):\n"
            "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            f"    open(os.path.join({str(tmp_path)!r}, str(rank)), 'w').close()\n"
            f"    while len(os.listdir({str(tmp_path)!r})) < 2:\n"
            "        time.sleep(0.01)\n"
            "    raise ValueError('boom')\n"
        )
        result = session.run_cell(cell, {}, spec=spec)
        told = capsys.readouterr().out.splitlines()
        session.panel()
        summary = capsys.readouterr().out.splitlines()
    finally:
        session.down_all()
    failed = [r.rank for r in result if r.error is not None and not result.only_stopped(r)]
    assert failed == [5, 13], failed
    assert told == ["ranks 5,13 (nodes 2,6): failed"], "the ranks only stopped are not told"
    assert summary[0].startswith("pool 'default' (local): 10 nodes x 2 ranks per node (20 ranks)")
    assert summary[1] == "  ranks 5,13 (nodes 2,6): failed, ValueError: boom"
    assert [line.split(":")[0] for line in summary[2:]] == [
        "  node 2",
        "  node 6",
        "  nodes 0-1",
        "  nodes 3-5",
        "  nodes 7-9",
        "  note",
    ], summary
    assert "failed (1 failed, 1 idle), ranks 4-5" in summary[2]
    assert summary[3].startswith("  node 6: 127.0.0.1, cpu, failed (1 failed, 1 idle), ranks 12-13")
    assert summary[4].startswith("  nodes 0-1: 4 ranks, cpu, idle, ranks 0-3")


def test_a_cell_failing_on_hundreds_of_ranks_says_so_in_a_few_lines() -> None:
    """The cell's error: the cause in full, then one line per other error, not one per rank."""
    errors = [
        RemoteError(255, "node 31", "RankLost", "killed by SIGKILL", "RankLost: killed\n"),
        *(
            RemoteError(r, f"node {r // 8}", "KeyboardInterrupt", "", "", secondary=True)
            for r in range(255)
            if r != 7
        ),
        RemoteError(7, "node 0", "ValueError", "boom", "ValueError: boom\n", secondary=True),
    ]
    error = CellError(errors)
    assert error.render().splitlines()[-2:] == [
        "ranks 0-6,8-254: KeyboardInterrupt (after the failure above)",
        "rank 7: ValueError: boom (after the failure above)",
    ]
    assert str(error).splitlines()[1] == (
        "and on 255 other rank(s): ranks 0-6,8-254: KeyboardInterrupt; rank 7: ValueError"
    )


def test_nodes_being_provisioned_are_a_line_per_step() -> None:
    text, out, _ = report()
    text.on_event(NodeStateChanged(0, S.PROVISIONING, "requesting g4dn.xlarge"))
    text.on_event(NodeStateChanged(0, S.BOOTING, "i-0abc pending"))
    text.on_event(NodeStateChanged(0, S.CONNECTING))
    text.flush()
    assert lines(out) == [
        "node 0: provisioning, requesting g4dn.xlarge",
        "node 0: booting, i-0abc pending",
        "node 0: connecting",
    ]


def test_no_escape_codes_even_when_a_detail_carries_them() -> None:
    text, out, _ = report()
    text.on_event(RankStateChanged.of(1, 1, S.LOST, "\x1b[31mkilled\x1b[0m by SIGKILL\r\n"))
    text.on_event(CellStarted(1, 1, 0))
    text.on_event(MetricsLogged(0, 1, ((0, {"lo\x1bss": 1.0}),)))
    text.flush(final=True)
    assert lines(out)[0] == "rank 1 (node 1): lost,  [31mkilled [0m by SIGKILL"
    assert "\x1b" not in out.getvalue()


def test_a_step_is_written_once_when_every_rank_logged_it() -> None:
    text, out, _ = report()
    text.on_event(CellStarted(1, 2, 0))
    text.on_event(MetricsLogged(0, 1, ((0, {"loss": 1.0, "acc": 50.0}), (1, {"loss": 0.5}))))
    text.flush()
    assert lines(out) == [], "rank 1 has not logged step 0 yet"
    text.on_event(MetricsLogged(1, 1, ((0, {"loss": 3.0, "acc": 50.0}),)))
    text.flush()
    text.flush()
    assert lines(out) == ["step 0: loss 2 (1 - 3), acc 50"]
    text.on_event(MetricsLogged(1, 1, ((1, {"loss": 0.5}),)))
    text.on_event(MetricsLogged(0, 1, ((0, {"loss": 9.0}),)))  # late value of a written step
    text.on_event(CellFinished(1, RunResult(1, ())))
    text.flush(final=True)
    assert lines(out) == ["step 0: loss 2 (1 - 3), acc 50", "step 1: loss 0.5"]


def test_a_step_only_some_ranks_log_is_written_after_a_grace_or_at_the_end() -> None:
    text, out, clock = report(grace=2.0)
    text.on_event(CellStarted(1, 2, 0))
    text.on_event(MetricsLogged(0, 1, ((0, {"loss": 1.0}),)))
    text.flush()
    clock.now += 1.0
    text.on_event(MetricsLogged(0, 1, ((1, {"loss": 0.5}),)))
    text.flush()
    assert lines(out) == []
    clock.now += 1.5
    text.flush()
    assert lines(out) == ["step 0: loss 1 [1 of 2 ranks]"]
    text.flush(final=True)
    assert lines(out)[-1] == "step 1 (1.0 steps/s): loss 0.5 [1 of 2 ranks]"


@pytest.mark.parametrize(
    ("error", "stop", "how"),
    [
        ("ValueError", None, "failed on rank 0"),
        ("KeyboardInterrupt", Stop(), "interrupted"),
        ("KeyboardInterrupt", Stop(4.0), "timed out"),
    ],
)
def test_steps_say_their_pace_as_tqdm_does_and_the_cell_ends_with_how_it_went(
    error: str, stop: Stop | None, how: str
) -> None:
    text, out, clock = report(burst=100)
    text.on_event(CellStarted(1, 1, 0))
    for step in range(11):
        text.on_event(MetricsLogged(0, 1, ((step, {"loss": 1.0, TOTAL_KEY: 50.0}),)))
        clock.now += 0.5  # two steps a second
        text.flush()
    written = lines(out)
    assert written[0] == "step 0/50 (0%): loss 1", "the total is no metric"
    assert written[-1] == "step 10/50 (20%, 2.0 steps/s, 20 s left): loss 1"
    ended = RankResult(0, 0, None, None, RemoteError(0, "n", error, "x", ""), 0.1)
    notes = () if stop is None else (str(stop),)
    text.on_event(CellFinished(1, RunResult(1, (ended,), notes=notes, stop=stop)))
    text.flush(final=True)
    assert lines(out)[-1] == f"cell {how} after 5 s: step 10/50 (20%, 2.0 steps/s)"


def test_many_steps_do_not_flood_the_terminal() -> None:
    text, out, clock = report(burst=3, per_second=1.0)
    text.on_event(CellStarted(1, 1, 0))
    for step in range(1000):
        text.on_event(MetricsLogged(0, 1, ((step, {"loss": float(step)}),)))
        if step % 100 == 0:
            clock.now += 0.5
            text.flush()
    text.on_event(CellFinished(1, RunResult(1, ())))
    text.flush(final=True)
    written = lines(out)
    assert len(written) < 15, written
    steps = [int(m) for line in written for m in re.findall(r"^step (\d+):", line)]
    assert steps == sorted(set(steps)), "each step at most once, in order"
    assert steps[-1] == 999, "the last step is always written"
    assert written[-1] == f"({1000 - len(steps)} steps not shown; %sky metrics lists every step)"


def test_notes_between_cells_are_written_and_notes_during_a_cell_are_left_to_its_result() -> None:
    text, out, _ = report()
    text.on_event(PoolMessage("torch is not installed"))  # while starting: the session says it
    text.on_event(CellStarted(1, 1, 0))
    text.on_event(PoolMessage("rank 1 was restarted"))  # the cell's result says it
    text.on_event(CellFinished(1, RunResult(1, ())))
    text.on_event(PoolMessage("rank 1 (node 1, local pid 9) killed by SIGKILL while idle"))
    text.on_event(OutputReceived(0, 1, "stdout", "output is the cell's business\n"))
    text.flush()
    assert lines(out) == ["rank 1 (node 1, local pid 9) killed by SIGKILL while idle"]


def beat(rank: int, node: int, waiting: str | None, waited: float = 0.0) -> RankUsage:
    return RankUsage(rank, node, 1.0, 100, None, None, 0.0, waiting, waited)


def test_a_rank_long_in_a_collective_is_a_line_once_per_call_site_and_cell() -> None:
    text, out, _ = report()
    text.on_event(beat(0, 0, "barrier at cell line 4", 9.0))  # between cells: not news
    text.flush()
    text.on_event(CellStarted(1, 3, 0))
    text.on_event(beat(0, 0, "barrier at cell line 4", 2.5))
    text.flush()
    assert lines(out) == [], "a moment in a collective is normal"
    text.on_event(beat(0, 0, "barrier at cell line 4", 3.1))
    assert out.getvalue() == "", "nothing is written from the IO thread"
    text.flush()
    assert lines(out) == ["rank 0 (node 0): waiting 3 s in barrier at cell line 4"]
    text.on_event(beat(0, 0, "barrier at cell line 4", 4.1))
    text.on_event(beat(1, 0, "all_reduce at cell line 6", 3.4))
    text.on_event(beat(2, 1, "all_reduce at cell line 6", 3.2))
    text.flush()
    assert lines(out)[1:] == ["ranks 1, 2 (nodes 0, 1): waiting 3 s in all_reduce at cell line 6"]
    text.on_event(beat(0, 0, None))
    text.on_event(beat(0, 0, "barrier at cell line 4", 30.0))
    text.flush()
    assert len(lines(out)) == 2, "once per rank and call site in a cell"
    text.on_event(CellFinished(1, RunResult(1, ())))
    text.flush(final=True)
    text.on_event(CellStarted(2, 3, 0))
    text.on_event(beat(0, 0, "barrier at cell line 4", 3.0))
    text.flush()
    assert lines(out)[2:] == ["rank 0 (node 0): waiting 3 s in barrier at cell line 4"]


def test_terminal_ipython_gets_lines_from_a_real_pool(capsys: pytest.CaptureFixture[str]) -> None:
    views = PoolViews(shell=None)  # no kernel: the text fallback
    assert views.kind == "text"
    session = Session(announce=lambda _: None, views=views)
    views.attach(session.down_pool)
    try:
        result = session.run_cell(
            "from skyward_jupyter import log, instance_info\n"
            "r = instance_info().rank\n"
            "for i in range(3):\n"
            "    log(step=i, loss=1.0 + r + i)\n"
            "print('trained')\n",
            {},
            spec=PoolSpec(nodes=2),
        )
        assert result.ok
        out = capsys.readouterr().out
        assert not ESCAPES.search(out.replace("\n", ""))
        assert sorted(out.splitlines()) == [
            "step 0: loss 1.5 (1 - 2)",
            "step 1: loss 2.5 (2 - 3)",
            "step 2: loss 3.5 (3 - 4)",
            "trained",
        ], out
        rows = session.metrics()
        if hasattr(rows, "to_dict"):  # a DataFrame where pandas is installed
            rows = rows.to_dict("records")
        assert rows[0] == {
            "step": 0,
            "name": "loss",
            "mean": 1.5,
            "min": 1.0,
            "max": 2.0,
            "ranks": 2,
        }
        session.panel()
        summary = capsys.readouterr().out
        assert summary.startswith("pool 'default' (local): 2 nodes") and "VBox" not in summary
    finally:
        session.down_all()


class BootingProvider(LocalProvider):
    """Local ranks, after a boot step that lasts until the notebook's thread has shown it."""

    def __init__(self, shown: threading.Event) -> None:
        super().__init__()
        self.shown = shown

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        progress("i-0abc pending", 0, RankState.BOOTING)
        deadline = time.monotonic() + 30
        while not self.shown.is_set():
            assert time.monotonic() < deadline, "the boot step was not shown while starting"
            await asyncio.sleep(0.01)
        return await super().provision(nodes, progress)


def test_boot_progress_is_written_while_the_pool_starts() -> None:
    """Pool.start(on_wait) flushes the text report on the caller's thread during provisioning."""
    text, out, _ = report()
    shown = threading.Event()

    def on_wait() -> None:
        text.flush()
        if "node 0: booting, i-0abc pending" in out.getvalue():
            shown.set()

    pool = Pool(nodes=1, provider=BootingProvider(shown))
    pool.subscribe(text.on_event)
    try:
        pool.start(on_wait=on_wait)  # returns only once the line was written while it waited
        assert lines(out) == ["node 0: booting, i-0abc pending"]
    finally:
        pool.close()
