"""The panel's state: pool events folded into rows, aggregates, bounded buffers and a version."""

from __future__ import annotations

import html
import threading
from typing import Any

import pytest

from skyward_jupyter.display.buffers import TextBuffer
from skyward_jupyter.display.grouping import MAX_TABS, tab_ranks
from skyward_jupyter.display.metrics import GRACE
from skyward_jupyter.display.panel_html import (
    header_html,
    metrics_html,
    nodes_html,
    output_html,
    tab_title,
)
from skyward_jupyter.display.snapshot import NodeInfo, Waiting
from skyward_jupyter.display.state import WAITING_MARK_AFTER, PanelState
from skyward_jupyter.display.summary import summary_text
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
from skyward_jupyter.model import aggregate_state
from skyward_jupyter.results import RankResult, RemoteError, RunResult, Stop
from skyward_jupyter.runtime import TOTAL_KEY

from .conftest import wait_for

S = RankState


def state_with(ranks: dict[int, int], **kw: Any) -> PanelState:
    """A state whose ranks (rank -> node) are idle on nodes at 10.0.0.<node>."""
    nodes = sorted(set(ranks.values()))
    state = PanelState(
        "p", "test", nodes=[NodeInfo(n, f"10.0.0.{n}", "T4", 1) for n in nodes], **kw
    )
    for rank, node in ranks.items():
        state.apply(RankStateChanged.of(rank, node, S.IDLE))
    return state


def usage(rank: int, node: int, cpu: float, rss: int, gpu: int | None = None, at: float = 0.0):
    return RankUsage(rank, node, cpu, rss, gpu, None, at)


def beat(rank: int, node: int, waiting: str | None = None, waited: float = 0.0) -> RankUsage:
    """A heartbeat of a rank whose cell waits in ``waiting`` for ``waited`` seconds."""
    return RankUsage(rank, node, 1.0, 100, None, None, 0.0, waiting, waited)


def metrics(rank: int, *rows: tuple[int | None, dict[str, float]], cell: int | None = 1):
    return MetricsLogged(rank, cell, tuple(rows))


# --------------------------------------------------------------------------- output buffers


def test_a_carriage_return_progress_bar_keeps_one_line() -> None:
    buf = TextBuffer()
    buf.write("start\n")
    for i in range(1000):
        buf.write(f"\r{i / 10:5.1f}%|{'#' * (i // 50)}")
    buf.write("\n")
    buf.write("done\n")
    assert buf.text == f"start\n{99.9:5.1f}%|{'#' * 19}\ndone\n"


def test_crlf_ends_a_line_and_a_return_split_from_its_newline_keeps_the_line() -> None:
    buf = TextBuffer()
    buf.write("a\r\nb\r")
    buf.write("\nc")
    assert buf.text == "a\nb\nc"
    buf.write("\rd")  # the open line is replaced
    assert buf.text == "a\nb\nd"


def test_output_is_bounded_oldest_lines_first() -> None:
    buf = TextBuffer(cap=100)
    for i in range(1000):
        buf.write(f"line {i:04d}\n")  # 10 characters each
    assert len(buf) <= 100
    assert buf.text.endswith("line 0999\n")
    assert buf.text.startswith("line 0990\n")
    assert buf.dropped == 990 * 10


def test_a_line_longer_than_the_cap_keeps_its_end() -> None:
    buf = TextBuffer(cap=50)
    buf.write("x" * 200 + "END")
    assert len(buf) == 50 and buf.text.endswith("END")


def test_each_ranks_output_is_kept_apart_and_bounded() -> None:
    state = state_with({0: 0, 1: 1}, output_cap=30)
    for i in range(20):
        state.apply(OutputReceived(0, 1, "stdout", f"head {i:02d}\n"))
    state.apply(OutputReceived(1, 1, "stdout", "other\n"))
    state.apply(OutputReceived(1, 1, "stderr", "warning\n"))
    ranks = {r.rank: r for r in state.snapshot().ranks}
    assert ranks[0].stdout == "head 17\nhead 18\nhead 19\n"
    assert ranks[0].dropped == 17 * 8
    assert (ranks[1].stdout, ranks[1].stderr) == ("other\n", "warning\n")


# ---------------------------------------------------------------------------------- states


@pytest.mark.parametrize(
    ("states", "shown"),
    [
        ([], S.PROVISIONING),
        ([S.IDLE, S.LOST], S.LOST),
        ([S.FAILED, S.RUNNING], S.FAILED),
        ([S.READY, S.BOOTING], S.BOOTING),
        ([S.CONNECTING, S.READY], S.CONNECTING),
        ([S.RUNNING, S.IDLE], S.RUNNING),
        ([S.IDLE, S.READY], S.IDLE),
        ([S.TERMINATED, S.IDLE], S.IDLE),
        ([S.TERMINATED, S.TERMINATED], S.TERMINATED),
    ],
)
def test_a_group_of_ranks_shows_trouble_first_then_the_slowest_start_then_activity(
    states: list[RankState], shown: RankState
) -> None:
    assert aggregate_state(states) is shown


def test_ranks_that_change_state_together_are_each_shown_in_it() -> None:
    """A cell starts on every rank with one event; a waiting mark is cleared as with one rank's."""
    state = state_with({0: 0, 1: 0, 2: 1, 3: 1})
    state.apply(beat(2, 1, "all_reduce at train.py:3", 30.0))
    state.apply(RankStateChanged(((0, 0), (1, 0), (2, 1)), S.RUNNING))
    node0, node1 = state.snapshot().nodes
    assert (node0.state, node1.state) == (S.RUNNING, S.RUNNING)
    state.apply(RankStateChanged(((2, 1),), S.IDLE))
    assert [n.state for n in state.snapshot().nodes] == [S.RUNNING, S.IDLE]
    assert state.snapshot().nodes[1].waiting == ()


def test_a_node_shows_the_state_aggregated_from_its_ranks() -> None:
    state = state_with({0: 0, 1: 0, 2: 1, 3: 1})
    state.apply(RankStateChanged.of(1, 0, S.RUNNING))
    state.apply(RankStateChanged.of(3, 1, S.LOST, "killed by SIGKILL"))
    node0, node1 = state.snapshot().nodes
    assert (node0.state, node0.ranks) == (S.RUNNING, (0, 1))
    assert (node1.state, node1.detail, node1.ranks) == (S.LOST, "killed by SIGKILL", (2, 3))
    assert (node1.address, node1.kind) == ("10.0.0.1", "T4")
    assert state.snapshot().header.state is S.LOST


def test_a_lost_rank_shows_as_lost_for_a_moment_while_it_restarts() -> None:
    now = [0.0]
    state = state_with({0: 0, 1: 1}, lost_hold=5.0, clock=lambda: now[0])
    state.apply(RankStateChanged.of(1, 1, S.LOST, "killed by SIGKILL"))
    state.apply(RankStateChanged.of(1, 1, S.BOOTING))
    node = state.snapshot().nodes[1]
    assert (node.state, node.detail) == (S.LOST, "killed by SIGKILL; restarting (booting)")
    state.apply(RankStateChanged.of(1, 1, S.READY))
    now[0] = 4.9
    assert state.snapshot().nodes[1].detail == "killed by SIGKILL; restarted"
    now[0] = 5.0
    assert state.snapshot().nodes[1].state is S.READY
    state.apply(RankStateChanged.of(1, 1, S.LOST, "exited with status 1"))
    state.apply(RankStateChanged.of(1, 1, S.RUNNING))
    assert state.snapshot().nodes[1].state is S.RUNNING, "a running rank is not held"


def test_usage_is_summed_over_a_nodes_live_ranks() -> None:
    state = state_with({0: 0, 1: 0, 2: 1})
    state.apply(usage(0, 0, 50.0, 100, 1000, at=10.0))
    state.apply(usage(1, 0, 25.0, 200, None, at=11.0))
    state.apply(usage(2, 1, 10.0, 300, None, at=12.0))
    node0, node1 = state.snapshot().nodes
    assert (node0.cpu_percent, node0.rss_bytes, node0.gpu_memory_bytes) == (75.0, 300, 1000)
    assert node0.last_heartbeat == 11.0 and node0.heartbeat_age(13.0) == 2.0
    assert (node1.cpu_percent, node1.gpu_memory_bytes) == (10.0, None)
    state.apply(RankStateChanged.of(1, 0, S.LOST, "exited with status 1"))
    node0 = state.snapshot().nodes[0]
    assert (node0.cpu_percent, node0.rss_bytes) == (50.0, 100), "a lost rank uses nothing"


def test_header_counts_nodes_and_ranks_and_prices_only_when_known() -> None:
    state = state_with({0: 0, 1: 0, 2: 1, 3: 1})
    state.describe_pool(started_at=1000.0)
    header = state.snapshot().header
    assert (header.nodes, header.ranks, header.ranks_per_node) == (2, 4, "2")
    assert header.uptime(1060.0) == 60.0
    assert header.price_per_hour is None and header.cost(1060.0) is None
    assert "$" not in summary_text(state.snapshot(), now=1060.0)
    state.describe_pool(price_per_hour=3.6)
    assert state.snapshot().header.cost(1000.0 + 3600) == pytest.approx(3.6)
    assert "$3.60/hour" in summary_text(state.snapshot(), now=1060.0)


def test_the_header_says_while_plain_cells_run_on_the_pool_and_a_cells_view_too() -> None:
    state = state_with({0: 0})
    mark = "auto: cells run on pool 'p'"
    assert mark not in summary_text(state.snapshot(), now=0.0)
    drawn = state.version
    state.set_auto(True)
    assert state.version != drawn, "the panel redraws to show the mark"
    for snap in (state.snapshot(), state.for_cell(7).snapshot()):
        assert mark in summary_text(snap, now=0.0)
        assert html.escape(mark) in header_html(snap.header, 0.0, snap.progress)
    state.set_auto(False)
    assert html.escape(mark) not in header_html(state.snapshot().header, 0.0)


def test_an_ended_pool_is_terminated_and_its_uptime_stops() -> None:
    state = state_with({0: 0})
    state.describe_pool(started_at=1.0, ended=True)
    header = state.snapshot().header
    assert header.state is S.TERMINATED
    assert header.uptime(10**12) == header.uptime(10**13)


def test_the_running_cell_is_known() -> None:
    state = state_with({0: 0})
    state.apply(CellStarted(7, 1, 0))
    assert state.snapshot().header.cell == 7
    state.apply(CellFinished(7, RunResult(7, ())))
    header = state.snapshot().header
    assert (header.cell, header.cells) == (None, 1)


def test_pool_messages_are_kept_newest_last_and_bounded() -> None:
    state = state_with({0: 0})
    for i in range(50):
        state.apply(PoolMessage(f"note {i}"))
    messages = state.snapshot().messages
    assert messages[-1] == "note 49" and len(messages) == 20


# --------------------------------------------------------------------- waiting in collectives


def marks(state: PanelState) -> tuple[dict[int, str], dict[int, list[str]]]:
    """What each marked rank's row says, and each node's marks (with their ranks)."""
    snap = state.snapshot()
    ranks = {r.rank: r.waiting.mark for r in snap.ranks if r.waiting is not None}
    return ranks, {n.index: [w.label for w in n.waiting] for n in snap.nodes}


def test_a_rank_long_in_a_collective_is_marked_until_a_heartbeat_says_it_left() -> None:
    state = state_with({0: 0, 1: 0, 2: 1})
    state.apply(CellStarted(1, 3, 0))
    for rank, node in ((0, 0), (1, 0), (2, 1)):
        state.apply(RankStateChanged.of(rank, node, S.RUNNING))
    assert WAITING_MARK_AFTER == 3.0
    state.apply(beat(0, 0, "all_reduce at cell line 3", 2.9))
    assert marks(state) == ({}, {0: [], 1: []}), "a moment in a collective is normal"
    state.apply(beat(0, 0, "all_reduce at cell line 3", 3.0))
    assert marks(state) == (
        {0: "waiting 3 s in all_reduce at cell line 3"},
        {0: ["rank 0 waiting 3 s in all_reduce at cell line 3"], 1: []},
    )
    state.apply(beat(0, 0, "all_reduce at cell line 3", 12.2))
    state.apply(beat(1, 0, "all_reduce at cell line 3", 11.8))
    state.apply(beat(2, 1, "barrier at train.py line 40", 5.0))
    ranks, nodes = marks(state)
    assert ranks == {
        0: "waiting 12 s in all_reduce at cell line 3",
        1: "waiting 12 s in all_reduce at cell line 3",
        2: "waiting 5 s in barrier at train.py line 40",
    }
    assert nodes == {
        0: ["ranks 0, 1 waiting 12 s in all_reduce at cell line 3"],
        1: ["rank 2 waiting 5 s in barrier at train.py line 40"],
    }
    text = summary_text(state.snapshot(), now=0.0)
    assert "node 0: 10.0.0.0, T4, running" in text
    assert text.splitlines()[1].endswith(", ranks 0, 1 waiting 12 s in all_reduce at cell line 3")
    assert text.splitlines()[2].endswith(", rank 2 waiting 5 s in barrier at train.py line 40")

    state.apply(beat(1, 0, None))  # rank 1 left the collective
    state.apply(beat(2, 1, "barrier at train.py line 40", 2.0))  # and is in the next one
    assert marks(state) == (
        {0: "waiting 12 s in all_reduce at cell line 3"},
        {0: ["rank 0 waiting 12 s in all_reduce at cell line 3"], 1: []},
    )
    state.apply(RankStateChanged.of(0, 0, S.LOST, "killed by SIGKILL"))
    assert marks(state) == ({}, {0: [], 1: []}), "a lost rank waits for nothing"
    state.apply(beat(0, 0, "all_reduce at cell line 3", 13.2))  # its last words, heard late
    assert marks(state) == ({}, {0: [], 1: []})


def test_the_marks_go_when_the_cell_ends() -> None:
    state = state_with({0: 0, 1: 1})
    state.apply(CellStarted(4, 2, 0))
    state.apply(beat(0, 0, "barrier at cell line 4", 8.0))
    state.apply(beat(1, 1, "barrier at cell line 4", 8.0))
    assert len(marks(state)[0]) == 2
    state.apply(RankStateChanged.of(1, 1, S.IDLE))  # rank 1 is done with the cell
    assert marks(state)[0] == {0: "waiting 8 s in barrier at cell line 4"}
    v = state.version
    state.apply(CellFinished(4, RunResult(4, ())))
    assert state.version > v
    assert marks(state) == ({}, {0: [], 1: []})
    assert "waiting" not in summary_text(state.snapshot(), now=0.0)


def test_the_panels_rows_show_the_marks() -> None:
    state = state_with({0: 0, 1: 0})
    state.apply(CellStarted(1, 2, 0))
    state.apply(beat(0, 0, "barrier at cell line 4", 4.4))
    state.apply(beat(1, 0, "barrier at cell line 4", 2.0))
    snap = state.snapshot()
    row = nodes_html(snap.nodes, 0.0)
    assert (
        '<span class="sky-waiting" data-ranks="0" style="color: #9a6700">'
        "rank 0 waiting 4 s in barrier at cell line 4</span>" in row
    )
    rank0, rank1 = (output_html(r) for r in snap.ranks)
    assert 'class="sky-waiting" data-ranks="0"' in rank0
    assert "waiting 4 s in barrier at cell line 4</span>" in rank0
    assert "sky-waiting" not in rank1, "rank 1 has waited 2 s only"
    state.apply(beat(0, 0, None))
    assert "sky-waiting" not in nodes_html(state.snapshot().nodes, 0.0)


def test_ranks_waiting_at_the_same_line_share_a_mark() -> None:
    grouped = Waiting.grouped(
        [
            Waiting((3,), "barrier at cell line 2", 4.0),
            Waiting((0,), "all_reduce at cell line 5", 6.0),
            Waiting((1,), "barrier at cell line 2", 9.6),
        ]
    )
    assert [w.label for w in grouped] == [
        "rank 0 waiting 6 s in all_reduce at cell line 5",
        "ranks 1, 3 waiting 10 s in barrier at cell line 2",
    ]


# --------------------------------------------------------------------------------- metrics


def test_each_step_is_reduced_across_the_ranks_that_logged_it() -> None:
    state = state_with({0: 0, 1: 1, 2: 2})
    state.apply(metrics(0, (0, {"loss": 1.0}), (1, {"loss": 0.5, "acc": 10.0})))
    state.apply(metrics(1, (0, {"loss": 3.0}), (1, {"loss": 1.5})))
    state.apply(metrics(2, (0, {"loss": 2.0})))
    rows = {(r.step, r.name): r for r in state.metric_rows()}
    loss0 = rows[(0, "loss")]
    assert (loss0.mean, loss0.min, loss0.max, loss0.ranks) == (2.0, 1.0, 3.0, 3)
    loss1 = rows[(1, "loss")]
    assert (loss1.mean, loss1.min, loss1.max, loss1.ranks) == (1.0, 0.5, 1.5, 2)
    acc1 = rows[(1, "acc")]
    assert (acc1.mean, acc1.ranks) == (10.0, 1), "only the ranks that logged the step count"
    assert [(r.step, r.name) for r in state.metric_rows()] == [
        (0, "loss"),
        (1, "acc"),
        (1, "loss"),
    ]
    snap = state.snapshot()
    assert [(r.name, r.step) for r in snap.latest] == [("loss", 1), ("acc", 1)]
    assert [r.step for r in snap.series["loss"]] == [0, 1]


def test_a_step_not_every_rank_logged_yet_waits_rather_than_show_one_ranks_min_and_max() -> None:
    now = [100.0]
    state = state_with({0: 0, 1: 1}, clock=lambda: now[0])
    state.apply(CellStarted(1, 2, 0))
    state.apply(metrics(0, (0, {"loss": 4.0})))
    (row,) = state.snapshot().latest
    assert (row.step, row.ranks_text, row.waiting) == (0, "1 of 2", True)
    table = metrics_html(state.snapshot())
    assert 'data-metric="loss" data-waiting="true"' in table
    assert table.count(">waiting</span>") == 2 and "<td" in table and ">1 of 2</td>" in table
    assert "loss  step 0: 4, 1 of 2 ranks, waiting for the others" in summary_text(state.snapshot())

    # Once both logged it, the step is whole; a step one rank alone reached does not replace it.
    state.apply(metrics(1, (0, {"loss": 6.0})))
    state.apply(metrics(0, (1, {"loss": 3.0})))
    (row,) = state.snapshot().latest
    assert (row.step, row.mean, row.min, row.max, row.ranks_text, row.waiting) == (
        0, 5.0, 4.0, 6.0, "2", False
    )  # fmt: skip
    assert 'data-waiting="false"' in metrics_html(state.snapshot())
    assert "loss  step 0: 5 (4 - 6), 2 ranks" in summary_text(state.snapshot())

    # A rank that does not log it within the grace: the step stands without it, as the text's.
    now[0] += GRACE
    (row,) = state.snapshot().latest
    assert (row.step, row.ranks_text, row.waiting) == (1, "1 of 2", False)
    state.apply(metrics(0, (2, {"loss": 2.0})))
    state.apply(CellFinished(1, RunResult(1, (done(0, 0), done(1, 1)))))
    (row,) = state.snapshot().latest
    assert (row.step, row.waiting) == (2, False), "the cell's end: every step is all there is"


def test_log_without_a_step_numbers_each_ranks_values_in_order() -> None:
    state = state_with({0: 0, 1: 1})
    state.apply(metrics(0, (None, {"loss": 1.0}), (None, {"loss": 2.0})))
    state.apply(metrics(1, (None, {"loss": 3.0})))
    state.apply(metrics(1, (None, {"loss": 4.0})))
    rows = state.metric_rows()
    assert [(r.step, r.mean, r.ranks) for r in rows] == [(0, 2.0, 2), (1, 3.0, 2)]
    state.apply(metrics(0, (10, {"loss": 0.0}), (None, {"loss": 0.0})))
    assert [r.step for r in state.metric_rows()] == [0, 1, 10, 11]


def test_a_step_logged_again_by_a_later_cell_replaces_the_earlier_values() -> None:
    state = state_with({0: 0, 1: 1})
    state.apply(metrics(0, (0, {"loss": 1.0}), cell=1))
    state.apply(metrics(1, (0, {"loss": 3.0}), cell=1))
    state.apply(metrics(0, (0, {"loss": 10.0}), cell=2))
    (row,) = state.metric_rows()
    assert (row.mean, row.ranks) == (10.0, 1)


def test_metrics_keep_the_last_steps_only() -> None:
    state = state_with({0: 0}, max_steps=100)
    for step in range(1000):
        state.apply(metrics(0, (step, {"loss": float(step)})))
    steps = [r.step for r in state.metric_rows()]
    assert steps == list(range(900, 1000))
    assert len(state.snapshot().series["loss"]) == 100


# --------------------------------------------------------------------------------- version


def test_the_version_moves_with_every_change_and_only_then() -> None:
    state = state_with({0: 0})
    v = state.version
    state.snapshot()
    state.metric_rows()
    assert state.version == v, "reading changes nothing"
    state.apply(OutputReceived(0, 1, "stdout", "x"))
    assert state.version == v + 1
    assert state.snapshot().version == v + 1
    state.describe_pool(nodes=[NodeInfo(0, "10.0.0.0", "T4", 1)])
    assert state.version == v + 1, "the same facts again are no change"
    state.describe_pool(nodes=[NodeInfo(0, "10.0.0.9", "T4", 1)])
    assert state.version == v + 2


def test_events_from_several_threads_fold_completely() -> None:
    state = state_with({r: r for r in range(4)})
    v = state.version
    barrier = threading.Barrier(5)

    def feed(rank: int) -> None:
        barrier.wait()
        for step in range(500):
            state.apply(metrics(rank, (step, {"loss": float(rank)})))
            state.apply(OutputReceived(rank, 1, "stdout", f"{step}\n"))

    threads = [threading.Thread(target=feed, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    barrier.wait()
    while any(t.is_alive() for t in threads):
        state.snapshot()  # reading while they write
    for t in threads:
        t.join()
    rows = state.metric_rows()
    assert len(rows) == 500 and all((r.ranks, r.mean) == (4, 1.5) for r in rows)
    assert state.version == v + 4 * 500 * 2


# ----------------------------------------------------------------------- with a real pool


def test_a_real_pool_logs_are_aggregated_per_step(pool2: Any) -> None:
    state = PanelState(pool2.name)
    unsubscribe = pool2.subscribe(state.apply)
    try:
        state.sync(pool2)
        result = pool2.run(
            "from skyward_jupyter import log, instance_info\n"
            "rank = instance_info().rank\n"
            "for i in range(5):\n"
            "    log(step=i, loss=10.0 * (rank + 1) + i, lr=0.1)\n"
        )
        assert result.ok, result
        # Every rank's metrics arrive before its cell is done: no waiting needed here.
        rows = {(r.step, r.name): r for r in state.metric_rows()}
        for i in range(5):
            loss = rows[(i, "loss")]
            assert (loss.min, loss.max, loss.mean, loss.ranks) == (10.0 + i, 20.0 + i, 15.0 + i, 2)
            assert (rows[(i, "lr")].mean, rows[(i, "lr")].ranks) == (0.1, 2)
        snap = state.snapshot()
        assert [r.rank for r in snap.ranks] == [0, 1]
        assert [n.index for n in snap.nodes] == [0, 1]
        assert all(n.state is S.IDLE and n.kind for n in snap.nodes)
        wait_for(
            lambda: all(n.rss_bytes for n in state.snapshot().nodes), 10, "usage from every node"
        )
    finally:
        unsubscribe()


def test_nodes_show_the_providers_progress_until_their_ranks_take_over() -> None:
    state = PanelState("p", "aws")
    state.apply(NodeStateChanged(0, RankState.PROVISIONING, "requesting g4dn.xlarge"))
    state.apply(NodeStateChanged(1, RankState.BOOTING, "i-1 pending"))
    rows = state.snapshot().nodes
    assert [(r.index, r.state, r.detail) for r in rows] == [
        (0, RankState.PROVISIONING, "requesting g4dn.xlarge"),
        (1, RankState.BOOTING, "i-1 pending"),
    ]
    state.apply(NodeStateChanged(0, RankState.CONNECTING, "i-0 running, waiting for SSH"))
    state.apply(RankStateChanged.of(1, 1, RankState.READY))
    rows = state.snapshot().nodes
    assert [(r.state, r.detail) for r in rows] == [
        (RankState.CONNECTING, "i-0 running, waiting for SSH"),
        (RankState.READY, ""),  # node 1's rank speaks for it now
    ]


# ------------------------------------------------------------------------- a cell's view


def failure(rank: int, node: int, type_name: str, message: str) -> RankResult:
    error = RemoteError(rank, f"node {node}", type_name, message, f"{type_name}: {message}\n")
    return RankResult(rank, node, None, None, error, 0.1)


def done(rank: int, node: int) -> RankResult:
    return RankResult(rank, node, None, None, None, 0.1)


def test_a_cells_view_shows_that_cell_only_and_keeps_its_final_state() -> None:
    pool = state_with({0: 0, 1: 1})
    pool.apply(CellStarted(1, 2, 0))
    pool.apply(OutputReceived(1, 1, "stdout", "old cell\n"))
    pool.apply(metrics(1, (139, {"lr": 0.1}), cell=1))
    pool.apply(PoolMessage("an old note"))
    pool.apply(CellFinished(1, RunResult(1, (done(0, 0), done(1, 1)))))

    cell = pool.for_cell(7)
    for event in (
        CellStarted(2, 2, 0),
        OutputReceived(1, 1, "stdout", "late line of the cell before\n"),
        OutputReceived(1, 2, "stdout", "this cell\n"),
        metrics(0, (0, {"loss": 1.0}), cell=2),
        RankStateChanged(((0, 0), (1, 1)), S.IDLE),
        CellFinished(2, RunResult(2, (done(0, 0), done(1, 1)))),
    ):
        pool.apply(event)
        cell.apply(event)
    snap = cell.snapshot()
    assert [r.stdout for r in snap.ranks] == ["", "this cell\n"]
    assert [r.name for r in snap.latest] == ["loss"] and not snap.messages
    assert snap.progress is not None and snap.progress.label == "In [7]"
    assert snap.progress.outcome == "done" and not snap.progress.running
    assert [r.state for r in snap.ranks] == [S.IDLE, S.IDLE], "the pool's states carried over"

    # What follows the cell's end (the next cell, a rank lost) leaves its view as it ended.
    frozen = cell.version
    for event in (
        CellStarted(3, 2, 0),
        OutputReceived(0, 3, "stdout", "the next cell\n"),
        RankStateChanged.of(1, 1, S.LOST, "killed"),
    ):
        cell.apply(event)
    assert cell.version == frozen and cell.snapshot().ranks[0].stdout == ""
    assert "old cell" in pool.snapshot().ranks[1].stdout, "the pool's state keeps every cell's"


def test_a_failed_or_lost_rank_is_red_with_its_errors_first_line_until_the_next_cell() -> None:
    state = state_with({0: 0, 1: 1, 2: 1})
    state.apply(CellStarted(1, 3, 0))
    state.apply(RankStateChanged(((0, 0), (1, 1), (2, 1)), S.IDLE))
    result = RunResult(
        1,
        (
            done(0, 0),
            failure(1, 1, "ValueError", "only rank one fails\nsecond line"),
            failure(2, 1, "RankLost", "the rank's process was killed by SIGKILL"),
        ),
    )
    state.apply(CellFinished(1, result))
    state.apply(RankStateChanged(((1, 1), (2, 1)), S.READY))  # restarted, group re-formed
    snap = state.snapshot()
    assert [(r.state, r.detail) for r in snap.ranks] == [
        (S.IDLE, ""),
        (S.FAILED, "ValueError: only rank one fails"),
        (S.LOST, "RankLost: the rank's process was killed by SIGKILL"),
    ]
    assert [n.state for n in snap.nodes] == [S.IDLE, S.LOST]  # the worse of its ranks
    assert 'data-node="1" data-state="lost"' in nodes_html(snap.nodes, 0.0)
    assert tab_title(1, snap.ranks[1]) == "rank 1 \u2716 ValueError: only rank one fails"
    assert tab_title(0, snap.ranks[0]) == "rank 0 (head)"
    assert "sky-error" in output_html(snap.ranks[1]) and "only rank one fails" in output_html(
        snap.ranks[1]
    )
    assert "node 1: 10.0.0.1, T4, lost" in summary_text(snap)
    state.apply(CellStarted(2, 3, 0))
    assert [r.state for r in state.snapshot().ranks] == [S.IDLE, S.READY, S.READY]


def test_a_failure_on_every_rank_marks_each_red_with_its_error_whatever_its_number() -> None:
    state = state_with({0: 0, 1: 1, 2: 1})
    cell = state.for_cell(5)
    same = "ValueError: same everywhere"
    failed = tuple(
        failure(r, n, "ValueError", "same everywhere") for r, n in ((0, 0), (1, 1), (2, 1))
    )
    for event in (
        CellStarted(1, 3, 0),
        # The pool marks each failed rank as its answer comes, before the cell's result.
        RankStateChanged(((0, 0), (1, 1), (2, 1)), S.FAILED),
        CellFinished(1, RunResult(1, failed)),
    ):
        state.apply(event)
        cell.apply(event)
    assert cell.cell_failed and state.cell_failed
    for snap in (state.snapshot(), cell.snapshot()):
        assert [(r.state, r.detail) for r in snap.ranks] == [(S.FAILED, same)] * 3
        assert [(n.state, n.detail) for n in snap.nodes] == [(S.FAILED, same)] * 2
        assert [tab_title(r.rank, r) for r in snap.ranks] == [
            f"rank 0 (head) \u2716 {same}",
            f"rank 1 \u2716 {same}",
            f"rank 2 \u2716 {same}",
        ]
        assert "node 0: 10.0.0.0, T4, failed, ValueError: same everywhere" in summary_text(snap)
    state.apply(CellStarted(2, 3, 0))
    assert not state.cell_failed


def test_a_rank_the_pool_stopped_after_anothers_failure_is_not_marked_failed() -> None:
    state = state_with({0: 0, 1: 1})
    cell = state.for_cell(3)
    stopped = RemoteError(0, "node 0", "KeyboardInterrupt", "", "KeyboardInterrupt\n", True)
    result = RunResult(
        1, (RankResult(0, 0, None, None, stopped, 0.1), failure(1, 1, "ValueError", "x"))
    )
    for event in (
        CellStarted(1, 2, 0),
        RankStateChanged(((1, 1), (0, 0)), S.FAILED),  # the pool marks each rank that raised
        CellFinished(1, result),
    ):
        state.apply(event)
        cell.apply(event)
    for snap in (state.snapshot(), cell.snapshot()):
        assert [(r.state, r.detail) for r in snap.ranks] == [
            (S.IDLE, ""),
            (S.FAILED, "ValueError: x"),
        ]
        assert tab_title(0, snap.ranks[0]) == "rank 0 (head)"
    progress = cell.snapshot().progress
    assert progress is not None and progress.outcome == "failed on rank 1"


@pytest.mark.parametrize(
    ("stop", "note"), [(Stop(), "interrupted"), (Stop(2.0), "timed out after 2.0 s")]
)
def test_a_stopped_cell_says_how_and_marks_no_rank_failed(stop: Stop, note: str) -> None:
    """Stopped by the user's interrupt or at its timeout: every rank's KeyboardInterrupt is the
    stop's, not a failure, and the cell's outcome says which stop it was.
    """
    state = state_with({0: 0, 1: 1})
    cell = state.for_cell(4)
    stopped = RunResult(
        1,
        tuple(failure(r, r, "KeyboardInterrupt", "") for r in (0, 1)),
        notes=(note,),
        stop=stop,
    )
    for event in (CellStarted(1, 2, 0), CellFinished(1, stopped)):
        state.apply(event)
        cell.apply(event)
    assert {r.state for r in state.snapshot().ranks} == {S.IDLE}
    progress = cell.snapshot().progress
    assert progress is not None and progress.outcome == note


def test_a_cells_progress_is_its_step_pace_and_with_a_total_a_bar_and_the_time_left() -> None:
    now = [100.0]
    state = state_with({0: 0, 1: 1}, clock=lambda: now[0]).for_cell(7)
    state.apply(CellStarted(1, 2, 0))
    progress = state.snapshot().progress
    assert progress is not None and progress.step is None and progress.fraction is None
    for step in range(0, 11):
        state.apply(metrics(0, (step, {"loss": 1.0 / (step + 1), TOTAL_KEY: 50.0})))
        state.apply(metrics(1, (step, {"loss": 1.0 / (step + 1)})))
        now[0] += 0.5  # two steps a second
    snap = state.snapshot()
    progress = snap.progress
    assert progress is not None
    assert (progress.step, progress.total, progress.rate) == (10, 50, pytest.approx(2.0))
    assert progress.fraction == pytest.approx(0.2) and progress.eta == pytest.approx(20.0)
    assert [r.name for r in snap.latest] == ["loss"], "the total is no metric"
    started = progress.started_at
    header = header_html(snap.header, started + 65, progress)
    assert 'class="sky-progress" data-cell="7" data-state="running" data-step="10"' in header
    assert 'data-fraction="0.200"' in header
    assert "<b>In [7] running</b> &middot; 1 min 05 s &middot; step 10/50" in header
    assert "2.0 steps/s &middot; 20% &middot; 20 s left" in header
    text = summary_text(snap, now=started + 65)
    assert text.splitlines()[0] == (
        "In [7] running, 1 min 05 s, step 10/50, 2.0 steps/s, |####                | 20%, 20 s left"
    )
    assert summary_text(snap, live=False).splitlines()[0] == "In [7] running, step 10/50"
    state.apply(CellFinished(1, RunResult(1, (done(0, 0), done(1, 1)))))
    ended = state.snapshot().progress
    assert ended is not None and ended.eta is None and not ended.running
    assert 'data-state="ended"' in header_html(snap.header, 0.0, ended)


def test_hundreds_of_ranks_read_as_trouble_first_then_nodes_folded_by_state() -> None:
    """256 ranks on 32 nodes: the failed and lost ranks first, one line per error; their
    nodes next with their ranks counted per state; the healthy ones folded; a tab per rank up
    to the limit, the head's and the troubled ones among them.
    """
    state = state_with({r: r // 8 for r in range(256)})
    state.apply(CellStarted(1, 256, 0))
    state.apply(RankStateChanged(tuple((r, r // 8) for r in range(256)), S.RUNNING))
    state.apply(RankStateChanged.of(9, 1, S.LOST, "killed by SIGKILL"))
    state.apply(beat(100, 12, "barrier at cell line 2", 9.0))
    results = [
        failure(r, r // 8, "ValueError", "boom") if r in (200, 255) else done(r, r // 8)
        for r in range(256)
        if r != 9
    ]
    state.apply(CellFinished(1, RunResult(1, tuple(results))))
    state.apply(RankStateChanged(tuple((r, r // 8) for r in range(256) if r != 9), S.IDLE))
    state.apply(beat(100, 12, "barrier at cell line 2", 9.0))
    snap = state.snapshot()
    lines = summary_text(snap, now=0.0, live=False).splitlines()
    assert lines[1:3] == [
        "  rank 9 (node 1): lost, killed by SIGKILL",
        "  ranks 200,255 (nodes 25,31): failed, ValueError: boom",
    ]
    troubled = [line.split(":")[0].strip() for line in lines[3:7]]
    assert troubled == ["node 1", "node 12", "node 25", "node 31"], lines
    assert "lost (1 lost, 7 idle), ranks 8-15" in lines[3]
    assert "failed (1 failed, 7 idle), ranks 248-255" in lines[6]
    assert lines[7:] == [
        "  node 0: 10.0.0.0, T4, idle, ranks 0-7",
        "  nodes 2-11: 80 ranks, T4, idle, ranks 16-95",
        "  nodes 13-24: 96 ranks, T4, idle, ranks 104-199",
        "  nodes 26-30: 40 ranks, T4, idle, ranks 208-247",
    ]
    table = nodes_html(snap.nodes, 0.0)
    assert table.index('data-node="1"') < table.index('data-node="0"'), "trouble first"
    assert 'class="sky-node sky-node-group" data-nodes="2-11" data-state="idle"' in table
    assert '<span class="sky-counts">(1 failed, 7 idle)</span>' in table
    assert table.count("<tr ") == len(lines) - 3, "a row per line of the summary's nodes"
    tabs = [r.rank for r in tab_ranks(snap.ranks)]
    assert len(tabs) == MAX_TABS and {0, 9, 100, 200, 255} <= set(tabs) and tabs == sorted(tabs)
