"""The quickstart notebook in a real JupyterLab, driven in headless Chromium."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import agent_pids, wait_for
from .lab import Lab, chromium_page, jupyter_lab, screenshot

QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(QUICKSTART, root / QUICKSTART.name)
    with jupyter_lab(root) as server:
        yield server
    wait_for(lambda: not agent_pids(), 20, "the lab kernels' ranks to end with the server")


def test_quickstart_runs_in_jupyterlab(lab: Lab) -> None:
    with chromium_page() as page:
        page.goto(lab.page_url(f"lab/tree/{QUICKSTART.name}"))  # type: ignore[attr-defined]
        page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)  # type: ignore[attr-defined]
        page.wait_for_selector(  # type: ignore[attr-defined]
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()  # type: ignore[attr-defined]
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()  # type: ignore[attr-defined]
            # The last code cell (%sky down) has run once its prompt shows a number.
            page.wait_for_function(  # type: ignore[attr-defined]
                "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];"
                " return p.length > 0 && /\\[\\d+\\]/.test(p[p.length - 1].textContent); }",
                timeout=120_000,
            )
            outputs = page.locator(".jp-OutputArea-output").all_inner_texts()  # type: ignore[attr-defined]
        finally:
            screenshot(page, "quickstart")
    text = "\n".join(outputs)
    assert "epoch 5: loss" in text
    assert "'world_size': 2" in text
