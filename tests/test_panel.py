"""The widget panel, without a browser: its widgets' values from real pools, and its buttons.

In this process ipywidgets has no frontend (its comms go nowhere), which is enough to read what
the panel would send. The last test runs the panel in a real kernel, where a click is a comm
message from the frontend, sent here by a jupyter_client while a cell runs.
"""

from __future__ import annotations

import html
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.display.panel import SkyPanel
from skyward_jupyter.display.state import PanelState
from skyward_jupyter.events import RankState

from .conftest import wait_for
from .test_magics import Kernel

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def pool() -> Iterator[Pool]:
    pool = Pool(nodes=2, interrupt_grace=2.0)
    try:
        yield pool
    finally:
        pool.close()


def node_states(panel: SkyPanel) -> list[str]:
    return re.findall(r'<tr class="sky-node" data-node="\d+" data-state="(\w+)"', panel.nodes.value)


def _chart_steps(panel: SkyPanel, metric: str) -> int | None:
    chart = panel.charts.charts.get(metric)
    return None if chart is None else chart.steps


def _chart_points(panel: SkyPanel, metric: str, key: str) -> list[float] | None:
    chart = panel.charts.charts.get(metric)
    return None if chart is None else chart.points.get(key)


def test_the_panel_draws_nodes_a_tab_per_rank_metrics_and_a_point_per_step(pool: Pool) -> None:
    panel = SkyPanel(pool, interval=0.05)
    try:
        assert "provisioning" in panel.header.value, "drawn before the pool starts"
        pool.start()
        result = pool.run(
            "from skyward_jupyter import log, instance_info\n"
            "rank = instance_info().rank\n"
            "for i in range(4):\n"
            "    log(step=i, loss=1.0 + rank + i)\n"
            "    print(f'progress {i}', end='\\r', flush=True)\n"
            "print()\n"
            "print(f'done on rank {rank}')\n"
        )
        assert result.ok, result
        # Each rank's values reach the panel on their own: the chart has its 4 steps once either
        # rank's did, and both ranks' values once the other's came too.
        wait_for(
            lambda: _chart_points(panel, "loss", "mean") == [1.5, 2.5, 3.5, 4.5],
            10,
            "the chart of 4 steps with both ranks' values",
        )
        wait_for(lambda: node_states(panel) == ["idle", "idle"], 10, "both nodes idle")

        assert "2 nodes &times; 1 rank" in panel.header.value
        assert "pool-wide view (every cell)" in panel.header.value, "not a cell's view"
        assert "local" in panel.header.value
        assert panel.nodes.value.count("127.0.0.1") == 2

        assert panel.tabs.titles == ("rank 0 (head)", "rank 1")
        assert len(panel.tabs.children) == 2
        for rank, view in enumerate(panel.outputs):
            assert f'<pre class="sky-stdout" data-rank="{rank}"' in view.value
            assert f"progress 3\ndone on rank {rank}\n" in view.value, "one line per progress bar"
            assert "progress 2" not in view.value

        chart = panel.charts.charts["loss"]
        assert panel.charts.widget.children == (chart,)
        assert chart.points["step"] == [0, 1, 2, 3], "a point per step"
        assert chart.points["mean"] == [1.5, 2.5, 3.5, 4.5]
        assert chart.points["min"] == [1, 2, 3, 4], "the ranks differ: a min-max band"
        assert chart.points["max"] == [2, 3, 4, 5]

        (row,) = re.findall(
            r'<tr class="sky-metric" data-metric="loss" data-waiting="false">(.*?)</tr>',
            panel.metrics.value,
        )
        assert re.findall(r">([^<]*)</td>", row) == ["loss", "3", "4.5", "4", "5", "2"]

        data, metadata = panel._repr_mimebundle_()
        assert data[WIDGET_VIEW]["model_id"] == panel.widget.model_id
        assert data["text/plain"].startswith("pool 'default' (local): 2 nodes")
        assert "loss" in data["text/plain"] and "VBox" not in data["text/plain"]
        assert metadata == {"skyward_jupyter": {"panel": "default"}}
    finally:
        panel.close()
    assert not panel.live


def test_the_interrupt_button_stops_the_running_cell(pool: Pool) -> None:
    panel = SkyPanel(pool.start(), interval=0.05)
    try:

        def click_once_running() -> None:
            wait_for(
                lambda: "started" in panel.state.snapshot().ranks[0].stdout, 30, "the cell to run"
            )
            panel.interrupt_button.click()

        clicker = threading.Thread(target=click_once_running)
        clicker.start()
        started = time.monotonic()
        result = pool.run("import time\nprint('started', flush=True)\ntime.sleep(120)\n")
        clicker.join()
        assert time.monotonic() - started < 60
        assert not result.ok
        assert {e.type_name for e in result.errors} == {"KeyboardInterrupt"}
        assert pool.run("1 + 1").values == [2, 2], "the pool is usable after the interrupt"
    finally:
        panel.close()


def test_a_cells_panel_follows_its_cell_then_keeps_how_it_ended(pool: Pool, tmp_path: Path) -> None:
    """Interrupt only while the cell runs; the head's output only in the cell; at the end a
    failed rank is red and its tab badged, the group's re-forming said, and the view frozen.
    """
    pool.start()
    cell_state = PanelState("default").for_cell(7)
    feed = pool.subscribe(cell_state.apply)
    panel = SkyPanel(pool, cell_state, interval=0.05, in_cell={0})
    try:
        assert panel.interrupt_button.disabled, "no cell runs yet"
        assert not panel.shutdown_button.disabled
        seen_running: list[bool] = []

        looked = tmp_path / "looked"  # rank 1 fails once the running panel was looked at

        def watch() -> None:
            try:
                wait_for(lambda: "started" in cell_state.snapshot().ranks[1].stdout, 30, "the cell")
                wait_for(lambda: not panel.interrupt_button.disabled, 5, "Interrupt enabled")
                panel.show_stacks()  # the Stacks button's click
                seen_running.append("sky-stacks-title" in panel.stacks_view.value)
            finally:
                looked.touch()

        watcher = threading.Thread(target=watch)
        watcher.start()
        result = pool.run(
            "import os, time, torch.distributed as dist\n"
            "from skyward_jupyter import log\n"
            "log(step=1, total=4, loss=0.5)\n"
            "print('started', flush=True)\n"
            "store = dist.distributed_c10d._get_default_store()\n"
            "if dist.get_rank() == 1:\n"
            "    store.wait(['rank 0 waits'])  # rank 0 has called its barrier\n"
            f"    while not os.path.exists({str(looked)!r}):\n"
            "        time.sleep(0.01)\n"
            "    raise ValueError('only rank one fails')\n"
            "barrier = dist.barrier(async_op=True)\n"
            "store.set('rank 0 waits', '1')\n"
            "barrier.wait()\n"
        )
        watcher.join()
        assert seen_running == [True] and not result.ok
        assert any("formed its process group again" in note for note in result.notes), result.notes
        wait_for(lambda: not panel.live, 10, "the cell's panel to stop at the cell's end")
        assert 'data-node="1" data-state="failed"' in panel.nodes.value
        assert panel.tabs.titles[1] == "rank 1 \u2716 ValueError: only rank one fails"
        assert "only rank one fails" in panel.outputs[1].value
        assert "sky-in-cell" in panel.outputs[0].value and "started" not in panel.outputs[0].value
        assert "started" in panel.outputs[1].value
        assert "the pool formed its process group again" in panel.messages.value
        assert 'data-cell="7" data-state="ended"' in panel.header.value
        assert "In [7] failed on rank" in panel.header.value
        assert 'data-fraction="0.250"' in panel.header.value and "step 1/4" in panel.header.value
        assert panel.interrupt_button.disabled and panel.stacks_button.disabled
        assert not panel.shutdown_button.disabled, "the pool still runs: it can be shut down"
        assert panel.stacks_view.value == "", "where the ranks were is not how the cell ended"

        # Still subscribed: the next cell's events do not reach the ended cell's view.
        version, header = cell_state.version, panel.header.value
        assert pool.run("print('the next cell')").ok
        assert cell_state.version == version and not panel.live
        panel.refresh(force=True)
        # The cell's own line (its progress and elapsed time) stays as the cell ended; the
        # pool's line below it may say a later uptime (the pool still runs).
        assert 'class="sky-progress"' in header and "#6e7781" in header
        assert _cell_line(panel.header.value) == _cell_line(header), "its elapsed time ticks on"
        assert "the next cell" not in panel.outputs[0].value + panel.outputs[1].value
    finally:
        feed()
        panel.close()


def test_a_rank_lost_while_idle_shows_as_lost_then_ready_again(pool: Pool) -> None:
    panel = SkyPanel(pool.start(), interval=0.05)
    drawn: list[str] = []
    panel.nodes.observe(lambda change: drawn.append(change["new"]), "value")
    try:
        pid = next(r.hello.pid for r in pool.ranks if r.rank == 1 and r.hello)
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: any('data-node="1" data-state="lost"' in v for v in drawn),
            20,
            "node 1 drawn as lost",
        )
        wait_for(lambda: node_states(panel) == ["ready", "ready"], 60, "the rank restarted")
        assert any("killed by SIGKILL" in v for v in drawn)
    finally:
        panel.close()


def test_shut_down_ends_the_pool_and_the_panel_stops_drawing(pool: Pool) -> None:
    panel = SkyPanel(pool.start(), interval=0.05)
    assert panel.live
    panel.shutdown_button.click()
    assert not pool.running
    wait_for(lambda: not panel.live, 30, "the panel's timer to stop")
    assert node_states(panel) == ["terminated", "terminated"]
    assert 'data-state="terminated"' in panel.header.value
    assert panel.interrupt_button.disabled and panel.shutdown_button.disabled
    assert panel.widget.comm is not None, "the last state stays on show"
    panel.close()


def test_closing_the_widget_stops_the_timer(pool: Pool) -> None:
    panel = SkyPanel(pool.start(), interval=0.05)
    assert panel.live
    panel.widget.close()  # as Widget.close_all() or a frontend would
    wait_for(lambda: not panel.live, 10, "the panel's timer to stop")
    assert pool.running, "closing the view leaves the pool alone"
    assert pool.subscribe  # the panel unsubscribed: the pool's events reach nothing of it
    assert panel.state.apply not in pool._fanout._subscribers


def stacks_text(panel: SkyPanel) -> str:
    """The Stacks view as its reader sees it: its title line, then every rank's stacks."""
    value = panel.stacks_view.value.replace("</div>", "\n")
    return html.unescape(re.sub(r"<[^>]+>", "", value)).strip()


BARRIER_AFTER_A_NAP = (
    "import time, torch.distributed as dist\n"
    "if dist.get_rank() == 1:\n"
    "    time.sleep(6)\n"
    "dist.barrier()\n"
)


def test_stacks_show_every_rank_and_a_rank_long_in_a_collective_is_marked() -> None:
    pool = Pool(nodes=1, procs_per_node=2)
    panel = SkyPanel(pool, interval=0.05)
    try:
        panel.stacks_button.click()
        assert re.fullmatch(
            r"no stacks at \d\d:\d\d:\d\d: pool 'default' is not running", stacks_text(panel)
        ), stacks_text(panel)
        pool.start()
        results: list[Any] = []
        cell = threading.Thread(target=lambda: results.append(pool.run(BARRIER_AFTER_A_NAP)))
        cell.start()

        def waiting(rank: int) -> str | None:
            usage = panel.state.snapshot().ranks[rank].usage
            return usage.waiting if usage else None

        wait_for(lambda: waiting(0) == "barrier at cell line 4", 30, "rank 0 in the barrier")
        started = time.monotonic()
        panel.stacks_button.click()  # on this thread, as on the kernel's subshell
        assert time.monotonic() - started < 1.5
        text = stacks_text(panel)
        title, rest = text.split("\n", 1)
        assert re.fullmatch(r"every rank's stacks at \d\d:\d\d:\d\d \(took \d\.\d s\)", title)
        rank0, rank1 = rest.split("\nrank 1 ", 1)
        assert rank0.startswith("rank 0 ") and re.search(r": in barrier at cell line 4 for", rank0)
        assert 'File "<sky-cell-1>", line 4, in <module>\n    dist.barrier()' in rank0
        assert 'File "<sky-cell-1>", line 3, in <module>\n    time.sleep(6)' in rank1
        assert "barrier" not in rank1, "rank 1 naps"

        def marked() -> str | None:
            row = panel.state.snapshot().ranks[0]
            return row.waiting.mark if row.waiting else None

        wait_for(lambda: marked() is not None, 30, "rank 0 marked as waiting")
        assert re.fullmatch(r"waiting \d s in barrier at cell line 4", marked() or "")
        assert panel.state.snapshot().ranks[1].waiting is None
        wait_for(lambda: "sky-waiting" in panel.nodes.value, 5, "the node's row to show it")
        assert re.search(
            r'<span class="sky-waiting" data-ranks="0"[^>]*>rank 0 waiting \d s in barrier at '
            r"cell line 4</span>",
            panel.nodes.value,
        )
        assert "waiting" in panel.summary().splitlines()[1]

        cell.join(timeout=60)
        assert results and results[0].ok, results
        assert marked() is None, "the cell ended"
        wait_for(lambda: "sky-waiting" not in panel.nodes.value, 5, "the mark to go")
        panel.stacks_button.click()
        rank0 = stacks_text(panel).split("\nrank 1 ", 1)[0]
        assert "sky-cell" not in rank0 and "barrier" not in rank0, "replaced on each click"
        pool.close()
        wait_for(lambda: panel.stacks_button.disabled, 30, "Stacks disabled with the pool ended")
    finally:
        panel.close()
        pool.close()


# ----------------------------------------------------------------------- in a real kernel


def _panel_displays(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        m["content"]
        for m in messages
        if m["msg_type"] == "display_data"
        and "panel" in m["content"].get("metadata", {}).get("skyward_jupyter", {})
    ]


class _Heard(list):  # type: ignore[type-arg]
    """A kernel's list of iopub messages that also hands each new one to ``hook``."""

    def __init__(self, seen: list[dict[str, Any]], hook: Any) -> None:
        super().__init__(seen)
        self.hook = hook

    def append(self, msg: dict[str, Any]) -> None:
        super().append(msg)
        self.hook(msg)


def _click(kernel: Kernel, comm_id: str) -> None:
    data = {"method": "custom", "content": {"event": "click"}}
    kernel.kc.shell_channel.send(
        kernel.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
    )


def test_in_a_kernel_a_cell_worth_watching_shows_the_panel_once_and_its_buttons_act() -> None:
    kernel = Kernel()
    try:
        kernel.ok("%load_ext skyward_jupyter")
        cell = kernel.ok(
            "%%sky --nodes 2\n"
            "from skyward_jupyter import log\n"
            "import torch.distributed as dist\n"
            "for i in range(3):\n"
            "    log(step=i, loss=i + dist.get_rank())\n"
        )
        (shown,) = _panel_displays(cell.messages)
        assert WIDGET_VIEW in shown["data"]
        updates = [
            m["content"]["data"]["text/plain"]
            for m in cell.messages
            if m["msg_type"] == "update_display_data"
        ]
        assert updates and "loss  step 2: 2.5 (2 - 3), 2 ranks" in updates[-1], updates
        assert re.match(r"In \[2\] done, took \d+ s, step 2\n", updates[-1]), "as In [2] is"

        # A quick cell that prints nothing shows only its result, and updates no earlier panel.
        again = kernel.ok("%%sky\n1 + 1")
        assert again.shown == ["2"]
        assert not _panel_displays(again.messages), "a quick cell shows no panel"
        assert not [m for m in again.messages if m["msg_type"] == "update_display_data"]

        # A quick cell that fails on every rank shows its panel at its end, each rank red.
        failed = kernel.execute("%%sky\nraise ValueError('on every rank')")
        assert failed.status == "error"
        (red,) = _panel_displays(failed.messages)
        lines = red["data"]["text/plain"].splitlines()
        assert re.match(r"In \[4\] failed on ranks 0, 1, took \d+ s$", lines[0]), lines
        for node in (0, 1):
            assert re.search(
                rf"^  node {node}: .*, failed, .*ValueError: on every rank$",
                "\n".join(lines[2:]),
                re.M,
            ), lines

        # A cell that runs a while shows it once, while it runs.
        watched = kernel.ok("%%sky\nimport time\ntime.sleep(0.6)\n3")
        (shown_again,) = _panel_displays(watched.messages)
        assert WIDGET_VIEW in shown_again["data"] and watched.shown == ["3"]
        model = shown_again["data"][WIDGET_VIEW]["model_id"]
        assert model != shown["data"][WIDGET_VIEW]["model_id"], "each cell has its own panel"
        kinds = [m["msg_type"] for m in watched.messages if m["msg_type"] != "status"]
        assert kinds.index("display_data") < kinds.index("execute_result"), kinds

        # The panel comes first, above the output of the cell.
        printed = kernel.ok("%%sky\nprint('from the ranks')")
        kinds = [
            "panel" if "skyward_jupyter" in m["content"].get("metadata", {}) else m["msg_type"]
            for m in printed.messages
            if m["msg_type"] in ("display_data", "stream")
        ]
        assert kinds[:2] == ["panel", "stream"], kinds

        metrics = kernel.ok("%sky metrics")
        # step, name, mean, min, max, ranks (a DataFrame also shows its index first)
        assert re.search(r"\b2\s+loss\s+2\.5\s+2(\.0)?\s+3(\.0)?\s+2$", metrics.shown[0], re.M)
        assert len(_panel_displays(kernel.ok("%sky panel").messages)) == 1

        buttons = {
            m["content"]["data"]["state"].get("description"): m["content"]["comm_id"]
            for m in kernel.iopub
            if m["msg_type"] == "comm_open"
            and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"
        }

        # While the cell runs: Stacks, and once its view shows the ranks' stacks, Interrupt.
        # The view's update is not the cell's message: every iopub message is looked at.
        stacks: list[str] = []

        def stacks_then_interrupt(msg: dict[str, Any]) -> None:
            state = msg["content"].get("data", {}).get("state", {})
            if msg["msg_type"] == "comm_open" and state.get("_model_name") == "ButtonModel":
                buttons[state["description"]] = msg["content"]["comm_id"]  # this cell's own
            elif msg["msg_type"] == "stream" and "started" in msg["content"].get("text", ""):
                _click(kernel, buttons["Stacks"])
            elif msg["msg_type"] == "comm_msg" and not stacks:
                value = msg["content"]["data"].get("state", {}).get("value", "")
                if "sky-stacks-title" in value:
                    stacks.append(html.unescape(value))
                    _click(kernel, buttons["Interrupt"])

        kernel.iopub = _Heard(kernel.iopub, stacks_then_interrupt)
        started = time.monotonic()
        stopped = kernel.execute(
            "%%sky\nimport time\nprint('started', flush=True)\ntime.sleep(120)\n",
            timeout=90,
        )
        assert stopped.status == "error" and stopped.reply["ename"] == "CellInterrupted"
        number = stopped.reply["execution_count"]
        assert stopped.errors[0]["traceback"] == [
            "KeyboardInterrupt: cell interrupted on 2 ranks",
            f"rank 0: stopped at In [{number}] line 3: time.sleep(120)",
            f"rank 1: stopped at In [{number}] line 3: time.sleep(120)",
        ], "the panel's Interrupt says what the toolbar's stop says"
        assert time.monotonic() - started < 60, "the clicks were handled while the cell ran"
        (view,) = stacks
        assert "every rank's stacks at" in view and "\nrank 1 (" in view
        assert view.count("time.sleep(120)") == 2, "both ranks' cell threads, in their nap"

        _click(kernel, buttons["Shut down"])
        wait_for(lambda: kernel.status().strip() == "no pools", 30, "the pool to shut down")
    finally:
        kernel.close()


def test_rank_states_are_the_events_states() -> None:
    assert {s.value for s in RankState} == {
        "provisioning",
        "booting",
        "connecting",
        "ready",
        "running",
        "idle",
        "failed",
        "lost",
        "terminated",
    }


def _cell_line(header: str) -> str:
    """A cell view's header without the pool's line, whose uptime goes on with the pool."""
    return header.split('<div style="color: #6e7781', 1)[0]
