"""The quickstart notebook and its live panel in a real JupyterLab, driven in headless Chromium."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from .conftest import agent_pids, wait_for
from .lab import ARTIFACTS, Lab, chromium_page, end_kernels, jupyter_lab, picture, screenshot

QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
PROMPTS_NUMBERED = (
    "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];"
    " return [p.filter(e => /\\[\\d+\\]/.test(e.textContent)).length, p.length]; }"
)
"""How many code cells have run (their prompt has a number), and how many there are."""


def wait_until_all_cells_ran(page: Any, stalled: float = 120.0) -> None:
    """Wait until every code cell has run, as long as cells keep finishing: a cell that takes
    no more than ``stalled`` seconds is waited for, however loaded the machine; a run that
    stops moving fails, with a picture of the page in test-artifacts/.
    """
    seen, moved = -1, time.monotonic()
    while True:
        ran, cells = page.evaluate(PROMPTS_NUMBERED)
        if cells and ran == cells:
            return
        if ran != seen:
            seen, moved = ran, time.monotonic()
        elif time.monotonic() - moved > stalled:
            screenshot(page, "cells-stalled")
            raise AssertionError(f"{ran} of {cells} cells ran; none more in {stalled:.0f} s")
        time.sleep(0.2)


RUN_QUEUED = (
    "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
    ".every(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"
)
"""Every code cell is queued or has run: "Run All Cells" reached the kernel whole."""


STEPS = 60
TRAINING = f"""%%sky --nodes 2
import time
from skyward_jupyter import instance_info, log
rank = instance_info().rank
for step in range({STEPS}):
    log(step=step, total={STEPS}, loss=(rank + 1) / (step + 1))
    time.sleep(0.25)
"""
RANK_ONE_FAILS = """%%sky
import torch.distributed as dist
store = dist.distributed_c10d._get_default_store()
if dist.get_rank() == 1:
    store.wait(['rank 0 waits'])  # rank 0 has called its barrier
    raise ValueError('only rank one fails')
barrier = dist.barrier(async_op=True)
store.set('rank 0 waits', '1')
barrier.wait()
"""
LATER = "%%sky\nimport time\nprint('a later cell', flush=True)\ntime.sleep(6)"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A lab serving the quickstart without its final ``%sky down`` (the pool stays to inspect)
    and a notebook that trains, then fails on rank 1; one server for the module's tests.
    """
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.read(QUICKSTART, as_version=4)
    assert nb.cells[-1].source.strip() == "%sky down"
    nb.cells = nb.cells[:-1]
    nbformat.write(nb, root / QUICKSTART.name)
    cells = nbformat.v4.new_notebook()
    cells.cells = [
        nbformat.v4.new_code_cell(source)
        for source in ("%load_ext skyward_jupyter", TRAINING, RANK_ONE_FAILS)
    ]
    nbformat.write(cells, root / "cells.ipynb")
    with jupyter_lab(root) as server:
        yield server
    wait_for(lambda: not agent_pids(), 20, "the lab kernels' ranks to end with the server")


def _epochs() -> int:
    source = next(c.source for c in nbformat.read(QUICKSTART, 4).cells if "EPOCHS =" in c.source)
    return int(source.split("EPOCHS =")[1].split()[0])


def _open(lab: Lab, page: Any, notebook: str) -> None:
    """Open ``notebook`` alone, in a workspace of its own: the lab does not restore the tabs
    the module's earlier test left open.
    """
    page.goto(lab.page_url(f"lab/workspaces/{Path(notebook).stem}/tree/{notebook}"))
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)


def _run_all_cells(page: Any) -> None:
    """Run > Run All Cells, until every cell is visibly queued.

    The notebook must be the lab's current widget, or "Run All Cells" runs nothing, and on a
    loaded machine nothing on the page says when the lab has made it current: a click that
    came too early shows no running prompt, and is made again (3 tries). A run that the lab
    lost part of (the kernel it had just started replaced as the page opened: the first cell
    ran, the others never queued) is made again too.
    """
    for _ in range(3):
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(
            ".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel", has_text="Run All Cells"
        ).first.click(timeout=60_000)
        try:
            page.wait_for_function(RUN_QUEUED, timeout=20_000)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")  # close the menu if it is still open
    raise AssertionError("Run All Cells did not start the notebook in 3 tries")


def test_quickstart_panel_then_interrupt(lab: Lab) -> None:
    with chromium_page() as page_:
        page: Any = page_
        _open(lab, page, QUICKSTART.name)
        try:
            _run_all_cells(page)
            wait_until_all_cells_ran(page)

            # The training cell's panel: both nodes ran the cell and are idle now.
            panel = page.locator(".sky-panel").first
            nodes = panel.locator("tr.sky-node")
            wait_for(lambda: nodes.count() == 2, 30, "two node rows")
            page.wait_for_function(
                "() => { const p = document.querySelector('.sky-panel');"
                " const rows = p ? [...p.querySelectorAll('tr.sky-node')] : [];"
                " return rows.length === 2 && rows.every(r => r.dataset.state === 'idle'); }",
                timeout=30_000,
            )
            # The head's output once, in the cell (its tab says so); a chart point per step.
            assert panel.locator("pre.sky-stdout[data-rank='0']").inner_text() == ""
            assert "the cell's own" in panel.locator(".sky-in-cell").first.inner_text()
            chart = panel.locator(".sky-chart[data-metric='loss']")
            assert chart.get_attribute("data-steps") == str(_epochs())
            assert chart.get_attribute("data-points") == str(_epochs())
            outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "'world_size': 2" in outputs
            assert outputs.count("epoch 5: loss") == 1, outputs
            screenshot(page, "quickstart-panel")

            # Tab completes what the ranks bound: the notebook never held the model. The lab
            # drops a kernel's answer after 1 s, and Jedi's first one in a kernel may take
            # longer on a loaded machine: Tab again until the popup shows.
            page.locator(".jp-CodeCell").last.click()
            page.keyboard.press("Escape")
            page.keyboard.press("b")
            page.keyboard.press("Enter")
            page.keyboard.type("model.modu")
            offered = page.locator(".jp-Completer .jp-Completer-item")
            for _ in range(20):
                page.keyboard.press("Tab")
                with contextlib.suppress(PlaywrightTimeout):
                    offered.and_(page.locator("[data-value='model.modules']")).wait_for(
                        timeout=3_000
                    )
                    break
            values = {item.get_attribute("data-value") for item in offered.all()}
            assert {"model.module", "model.modules"} <= values, values
            screenshot(page, "quickstart-completion")
            page.keyboard.press("Escape")

            # A long cell, stopped with the panel's Interrupt button.
            page.locator(".jp-CodeCell").last.click()
            page.keyboard.press("Escape")
            page.keyboard.press("b")
            page.keyboard.press("Enter")  # edit the new cell
            page.keyboard.type("%%sky\nimport time\nprint('sleeping', flush=True)\ntime.sleep(300)")
            page.keyboard.press("Shift+Enter")
            page.wait_for_selector(  # the cell's own output (the head's is shown there only)
                ".jp-RenderedText[data-mime-type='application/vnd.jupyter.stdout']"
                " >> text=sleeping",
                timeout=60_000,
            )
            long_cell = page.locator(".jp-CodeCell", has_text="time.sleep(300)").last
            prompt = long_cell.locator(".jp-InputPrompt")
            assert prompt.inner_text().strip() == "[*]:"
            long_cell.locator(".sky-interrupt").click()
            wait_for(lambda: prompt.inner_text().strip() != "[*]:", 30, "the long cell to stop")
            assert "KeyboardInterrupt" in long_cell.inner_text()
        finally:
            screenshot(page, "quickstart-interrupt")
            end_kernels(lab)


PROGRESS_AT = (
    "([cell, step]) => { const p = document.querySelectorAll('.jp-CodeCell')[cell]"
    "?.querySelector('.sky-progress[data-state=running]');"
    " return !!p && Number(p.dataset.step) >= step && p.textContent.includes(' left'); }"
)


def test_a_cells_panel_shows_its_progress_then_its_failure_and_then_stays_as_it_ended(
    lab: Lab,
) -> None:
    """Progress while a training cell runs; rank 1's failure red and badged in the next cell's
    panel with what the pool did after it; both panels frozen while a later cell runs.
    Pictures of the first two are the README's.
    """
    with chromium_page() as page_:
        page: Any = page_
        page.set_viewport_size({"width": 1000, "height": 1000})
        _open(lab, page, "cells.ipynb")
        cells = page.locator(".jp-CodeCell")
        training, failing = cells.nth(1), cells.nth(2)
        try:
            _run_all_cells(page)

            # While it runs: In [2], elapsed, step k/60, steps/s, a bar and the time left.
            page.wait_for_function(PROGRESS_AT, arg=[1, 12], timeout=120_000)
            progress = training.locator(".sky-progress")
            text = re.sub(r"(\s*·\s*)+", " · ", progress.inner_text())  # the bar has no text
            assert re.fullmatch(
                r"In \[2\] running · \d+ s · step \d+/60 · [\d.]+ (steps/s|s/step) · "
                r"\d+% · (\d+ min )?\d+ s left",
                text,
            ), text
            fraction = float(progress.locator(".sky-bar").get_attribute("data-fraction") or -1)
            assert 0 < fraction < 1, fraction
            picture(training.locator(".sky-panel"), "panel-progress")

            # Rank 1 raised: red in the node table, its tab badged with the error's first
            # line; the pool's note says the group was formed again, in the panel and below.
            page.wait_for_selector(
                ".jp-CodeCell >> nth=2 >> .sky-progress[data-state=ended]", timeout=120_000
            )
            panel = failing.locator(".sky-panel")
            header = panel.locator(".sky-progress").inner_text()
            assert re.match(r"In \[3\] failed on (rank 1|ranks 0, 1) · took \d+ s$", header), header
            node = panel.locator("tr.sky-node[data-node='1']")
            assert node.get_attribute("data-state") == "failed"
            assert "only rank one fails" in node.inner_text()
            red = node.locator(".sky-state").evaluate("e => getComputedStyle(e).color")
            assert red == "rgb(207, 34, 46)", red
            tab = panel.locator(".sky-tabs .lm-TabBar-tab").nth(1)
            assert tab.inner_text() == "rank 1 \u2716 ValueError: only rank one fails"
            note = "the pool formed its process group again"
            assert note in panel.locator("ul.sky-messages").inner_text()
            wait_for(lambda: note in failing.locator(".jp-OutputArea").inner_text(), 30, "the note")
            tab.click()
            panel.locator(".sky-error").filter(has_text="only rank one fails").wait_for()
            picture(panel, "panel-failure")

            # A later cell runs: the earlier panels stay as their cells ended (their clocks
            # stopped), and the later cell's output reaches none of them.
            frozen = {i: cells.nth(i).locator(".sky-panel").text_content() for i in (1, 2)}
            assert "In [2] done · took" in frozen[1] and "step 59/60" in frozen[1]
            cells.last.click()
            page.keyboard.press("Escape")
            page.keyboard.press("b")
            page.keyboard.press("Enter")
            page.keyboard.type(LATER)
            page.keyboard.press("Shift+Enter")
            later = cells.nth(3).locator(".sky-progress")
            wait_for(
                lambda: later.count() == 1 and re.search(r"running · [3-9] s", later.inner_text()),
                60,
                "the later cell to run 3 s",
            )
            for i, text in frozen.items():
                now = cells.nth(i).locator(".sky-panel").text_content()
                assert now == text, f"In [{i + 1}]'s panel changed after its cell ended"
                assert "a later cell" not in now
            picture(cells.nth(1).locator(".sky-panel"), "panel-ended", ARTIFACTS)
            page.wait_for_selector(
                ".jp-CodeCell >> nth=3 >> .sky-progress[data-state=ended]", timeout=60_000
            )
        finally:
            screenshot(page, "cells-panels")
            end_kernels(lab)
