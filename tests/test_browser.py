"""The quickstart notebook and its live panel in a real JupyterLab, driven in headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from .conftest import agent_pids, wait_for
from .lab import Lab, chromium_page, jupyter_lab, screenshot

QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
ALL_PROMPTS_NUMBERED = (
    "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];"
    " return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }"
)

RUN_STARTED = (
    "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
    ".some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"
)


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A lab serving the quickstart without its final ``%sky down``: the pool stays to inspect."""
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.read(QUICKSTART, as_version=4)
    assert nb.cells[-1].source.strip() == "%sky down"
    nb.cells = nb.cells[:-1]
    nbformat.write(nb, root / QUICKSTART.name)
    with jupyter_lab(root) as server:
        yield server
    wait_for(lambda: not agent_pids(), 20, "the lab kernels' ranks to end with the server")


def _epochs() -> int:
    source = next(c.source for c in nbformat.read(QUICKSTART, 4).cells if "EPOCHS =" in c.source)
    return int(source.split("EPOCHS =")[1].split()[0])


def _run_all_cells(page: Any) -> None:
    """Run > Run All Cells, until the run has visibly started.

    The notebook must be the lab's current widget, or "Run All Cells" runs nothing, and on a
    loaded machine nothing on the page says when the lab has made it current: a click that
    came too early shows no running prompt, and is made again (3 tries)."""
    for _ in range(3):
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(
            ".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel", has_text="Run All Cells"
        ).first.click(timeout=60_000)
        try:
            page.wait_for_function(RUN_STARTED, timeout=20_000)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")  # close the menu if it is still open
    raise AssertionError("Run All Cells did not start the notebook in 3 tries")


def test_quickstart_panel_then_interrupt(lab: Lab) -> None:
    with chromium_page() as page_:
        page: Any = page_
        page.goto(lab.page_url(f"lab/tree/{QUICKSTART.name}"))
        page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        try:
            _run_all_cells(page)
            page.wait_for_function(ALL_PROMPTS_NUMBERED, timeout=120_000)

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
