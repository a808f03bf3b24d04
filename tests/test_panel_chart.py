"""The panel's charts without a browser: what each chart widget is sent, and what it keeps.

ipywidgets has no frontend in this process (its comms go nowhere), which is enough to read the
points a chart would send and to hand it the state a frontend's toggle sends.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.display.chart import MAX_POINTS, SEND_INTERVAL, ChartGrid, decimate
from skyward_jupyter.display.metrics import MetricRow
from skyward_jupyter.display.panel import SkyPanel

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pool() -> Iterator[Pool]:
    pool = Pool(nodes=2, interrupt_grace=2.0)
    try:
        yield pool.start()
    finally:
        pool.close()


def rows(n: int) -> list[MetricRow]:
    """Two ranks' ``loss`` per step: rank 0 logs 1/(s+1), rank 1 twice that."""
    return [MetricRow.of(s, "loss", (1 / (s + 1), 2 / (s + 1))) for s in range(n)]


def test_a_few_steps_are_sent_as_they_are() -> None:
    points = decimate(rows(3))
    assert points == {
        "step": [0, 1, 2],
        "first": [0, 1, 2],
        "mean": [1.5, 0.75, 0.5],
        "min": [1.0, 0.5, 1 / 3],
        "max": [2.0, 1.0, 2 / 3],
        "ranks": [2, 2, 2],
    }


def test_many_steps_are_bucketed_keeping_the_band_and_the_last_step() -> None:
    many = rows(10_000)
    many[4321] = MetricRow.of(4321, "loss", (-7.0, 99.0))  # a spike inside a bucket
    points = decimate(many)
    assert len(points["step"]) == MAX_POINTS
    assert points["step"][-1] == 9999 and points["first"][0] == 0
    assert points["first"][1] == points["step"][0] + 1, "buckets are consecutive steps"
    assert min(points["min"]) == -7.0 and max(points["max"]) == 99.0, "the spike stays in the band"
    assert all(lo < hi for lo, hi in zip(points["min"], points["max"], strict=True))


def test_non_finite_values_are_gaps_that_json_can_carry() -> None:
    points = decimate([MetricRow.of(0, "loss", (float("nan"),)), *rows(2)[1:]])
    assert points["mean"][0] is None and points["min"][0] is None
    json.dumps(points, allow_nan=False)


def test_toggles_are_widget_state_kept_as_points_arrive() -> None:
    grid = ChartGrid(interval=0)
    try:
        grid.update({"loss": rows(5)}, now=0.0, force=True)
        chart = grid.charts["loss"]
        # What a frontend sends when the user ticks "log" and "smooth".
        chart.set_state({"log_scale": True, "smooth": True})
        grid.update({"loss": rows(50), "lr": rows(50)}, now=1.0, force=False)
        assert grid.charts["loss"] is chart, "the same chart: the user's toggles stay"
        assert chart.steps == 50
        state = chart.get_state()
        assert state["log_scale"] is True and state["smooth"] is True
        assert grid.charts["lr"].get_state()["log_scale"] is False, "a toggle is per chart"
        assert [c.metric for c in grid.widget.children] == ["loss", "lr"]
    finally:
        grid.close()


def test_a_fast_long_run_sends_bounded_points_at_a_bounded_rate(pool: Pool) -> None:
    panel = SkyPanel(pool, interval=0.02)
    sends: list[int] = []  # points per send of loss's chart
    results: list[Any] = []
    cell = threading.Thread(
        target=lambda: results.append(
            pool.run(
                "import time\n"
                "from skyward_jupyter import log, instance_info\n"
                "rank = instance_info().rank\n"
                "log(step=0, loss=rank + 1.0)\n"
                "time.sleep(1)\n"  # the chart appears and is watched
                "t0 = time.monotonic()\n"
                "for i in range(1, 6000):\n"
                "    log(step=i, loss=(rank + 1) / (i + 1))\n"
                "    if i % 100 == 0:\n"
                "        time.sleep(0.05)\n"
                "time.monotonic() - t0\n"
            )
        )
    )
    try:
        cell.start()
        wait_for(lambda: "loss" in panel.charts.charts, 20, "the loss chart")
        chart = panel.charts.charts["loss"]
        chart.observe(lambda change: sends.append(len(change.new["step"])), "points")
        cell.join(timeout=120)
        (result,) = results
        assert result.ok, result
        took = max(result.values)
        panel.stop()  # the last draw sends what is left
        assert chart.points["step"][-1] == 5999
        assert len(chart.points["step"]) == MAX_POINTS
        assert sends and all(n <= MAX_POINTS for n in sends)
        assert chart.points["min"][-1] < chart.points["max"][-1], "the ranks differ: a band"
        # Throttled: at most a send per SEND_INTERVAL while the steps came (and the last
        # draw's), where the panel redrew up to every 0.02 s.
        assert len(sends) <= took / SEND_INTERVAL + 3, (len(sends), took)
    finally:
        cell.join(timeout=120)
        panel.close()


def test_the_vendored_uplot_is_the_version_package_json_pins() -> None:
    pinned = json.loads((ROOT / "labextension" / "package.json").read_text())["devDependencies"]
    vendored = (ROOT / "skyward_jupyter" / "display" / "static" / "uPlot.iife.min.js").read_text()
    (version,) = re.findall(r"\(v([\d.]+)\)", vendored.splitlines()[0])
    assert pinned["uplot"] == version, "make vendor-uplot copies the pinned version"
