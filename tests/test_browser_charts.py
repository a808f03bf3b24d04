"""The panel's live charts in a real JupyterLab, driven in headless Chromium: hovered, toggled
to a log scale, resized; a picture of them is kept for the README.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest

from .conftest import agent_pids, wait_for
from .lab import Lab, chromium_page, jupyter_lab, picture, screenshot
from .test_browser import _run_all_cells, wait_until_all_cells_ran

STEPS = 60
TRAINING = f"""%%sky --nodes 2
import time
from skyward_jupyter import instance_info, log
rank = instance_info().rank
for step in range({STEPS}):
    log(step=step, total={STEPS}, loss=(rank + 1) * 10 / (step + 1), lr=0.1 * 0.95 ** step)
    time.sleep(0.02)
"""

LIVE = (
    "%%sky\nimport time\nfrom skyward_jupyter import log\n"
    "for s in range(120): log(step=s, live=1.0 + s); time.sleep(0.1)"
)


def expected(step: int) -> dict[str, float]:
    """What the two ranks logged as ``loss`` at ``step``, reduced across them."""
    low, high = 10 / (step + 1), 20 / (step + 1)
    return {"mean": (low + high) / 2, "min": low, "max": high, "ranks": 2}


def moving_average(step: int, weight: float = 0.6) -> float:
    """The smoothed mean of ``loss`` at ``step``: TensorBoard's debiased moving average."""
    last = 0.0
    for s in range(step + 1):
        last = last * weight + (1 - weight) * expected(s)["mean"]
    return last / (1 - weight ** (step + 1))


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext skyward_jupyter"),
        nbformat.v4.new_code_cell(TRAINING),
    ]
    nbformat.write(nb, root / "charts.ipynb")
    with jupyter_lab(root) as server:
        yield server
    wait_for(lambda: not agent_pids(), 20, "the lab kernels' ranks to end with the server")


def _numbers(ticks: str | None) -> list[float]:
    return [float(t) for t in (ticks or "").split()]


def test_a_chart_shows_a_steps_values_on_hover_and_a_log_scale(lab: Lab) -> None:
    with chromium_page() as page_:
        page: Any = page_
        page.goto(lab.page_url("lab/tree/charts.ipynb"))
        page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        try:
            _run_all_cells(page)
            wait_until_all_cells_ran(page)
            charts = page.locator(".sky-panel .sky-charts").first
            chart = charts.locator(".sky-chart[data-metric='loss']")
            chart.wait_for(timeout=30_000)
            wait_for(lambda: chart.get_attribute("data-steps") == str(STEPS), 30, "every step")
            assert chart.get_attribute("data-points") == str(STEPS)
            assert charts.locator(".sky-chart[data-metric='lr']").count() == 1

            # Without a cursor the readout is the last step's.
            hover = chart.locator(".sky-hover")
            assert hover.get_attribute("data-hovered") == "false"
            assert hover.get_attribute("data-step") == str(STEPS - 1)

            nudge = [0]

            def hovered(also: str = "data-hovered") -> bool:
                """The plot as drawn now (a toggle may have drawn it again, elsewhere) hovered
                again at its middle, a pixel off the last move, until the readout has ``also``:
                a single move could land before a plot drawn anew listens.
                """
                box = chart.locator(".u-over").bounding_box()
                nudge[0] = 1 - nudge[0]
                page.mouse.move(
                    box["x"] + box["width"] / 2, box["y"] + box["height"] / 2 + nudge[0]
                )
                return hover.get_attribute("data-hovered") == "true" and bool(
                    hover.get_attribute(also)
                )

            # Hovering the middle of the plot: that step's mean, min and max across ranks.
            wait_for(hovered, 10, "the hover")
            step = int(hover.get_attribute("data-step") or -1)
            assert abs(step - (STEPS - 1) / 2) <= 2, step
            for key, value in expected(step).items():
                assert math.isclose(float(hover.get_attribute(f"data-{key}") or "nan"), value)
            text = hover.inner_text()
            assert f"step {step}: mean " in text and "(2 ranks)" in text, text
            assert f"min {expected(step)['min']:.4g}" in text, text
            picture(charts, "panel-charts")

            # Linear, then log: the y ticks go from evenly spaced to powers of ten.
            assert chart.get_attribute("data-scale") == "linear"
            linear = _numbers(chart.get_attribute("data-y-ticks"))
            steps = {round(b - a, 9) for a, b in itertools.pairwise(linear)}
            assert len(linear) >= 3 and len(steps) == 1, linear
            chart.locator("input.sky-log").check()
            wait_for(lambda: chart.get_attribute("data-scale") == "log", 10, "the log scale")
            logs = _numbers(chart.get_attribute("data-y-ticks"))
            assert {1.0, 10.0} <= set(logs), logs
            assert all(math.log10(t).is_integer() for t in logs), logs

            # Smoothed: the readout adds the moving average of the mean at the hovered step.
            chart.locator("input.sky-smooth").check()
            wait_for(lambda: chart.get_attribute("data-smooth") == "on", 10, "smoothing")
            wait_for(lambda: hovered("data-smoothed"), 10, "the smoothed readout")
            step = int(hover.get_attribute("data-step") or -1)
            smoothed = float(hover.get_attribute("data-smoothed") or "nan")
            assert math.isclose(smoothed, moving_average(step)), (step, smoothed)
            assert f"smoothed {smoothed:.4g}" in hover.inner_text()

            # As wide as the panel, following the window: side by side in a wide one, then
            # one above the other, narrowing with the window.
            lr = charts.locator(".sky-chart[data-metric='lr']")

            def fits() -> bool:
                canvas = chart.locator(".sky-plot canvas").bounding_box()
                frame = chart.bounding_box()
                return bool(frame["width"] - 20 <= canvas["width"] <= frame["width"])

            def top(c: Any) -> float:
                return float(c.bounding_box()["y"])

            assert fits() and top(lr) == top(chart), "side by side, each filling its half"
            widths = []
            for width in (900, 760):
                page.set_viewport_size({"width": width, "height": 900})
                wait_for(lambda: top(lr) > top(chart) and fits(), 10, f"the charts at {width} px")
                widths.append(chart.bounding_box()["width"])
            assert widths[1] < widths[0] - 50, widths

            # A live chart zoomed in by dragging stays zoomed as points arrive; a double click
            # zooms out to every step again.
            page.locator(".jp-CodeCell").last.click()
            page.keyboard.press("Escape")
            page.keyboard.press("b")
            page.keyboard.press("Enter")
            page.keyboard.type(LIVE)
            page.keyboard.press("Shift+Enter")
            live = page.locator(".sky-chart[data-metric='live']")
            live.wait_for(timeout=60_000)
            wait_for(lambda: int(live.get_attribute("data-steps") or 0) >= 10, 30, "10 steps")
            box = live.locator(".u-over").bounding_box()
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + box["width"] * 0.1, y)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
            page.mouse.up()
            zoomed = live.get_attribute("data-x-range")
            steps = int(live.get_attribute("data-steps") or 0)
            wait_for(lambda: int(live.get_attribute("data-steps") or 0) >= steps + 10, 30, "more")
            assert live.get_attribute("data-x-range") == zoomed
            live.locator(".u-over").dblclick()
            wait_for(
                lambda: (
                    _numbers(live.get_attribute("data-x-range"))[1]
                    == int(live.get_attribute("data-steps") or 0) - 1
                ),
                30,
                "the whole range again",
            )
        finally:
            screenshot(page, "panel-charts")
