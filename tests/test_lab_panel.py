"""The lab's "Sky" side panel in a real JupyterLab, in headless Chromium, over real kernels' pools.

Two notebooks' kernels (sessions, as JupyterLab opens them) start pools; the panel lists both,
titled by notebook and name (a click opens the notebook). The second's kernel is killed: its pool
is shown ``gone``, greyed, and "Clean up" removes it; the first's button shuts it down through its
kernel. A record written just after the panel's listing shows within a second, not at the next
3 s listing. Screenshots go to ``test-artifacts/``; the panel alone, a pool gone, is
``docs/side-panel.png``, the one the README shows.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from skyward_jupyter import registry

from .conftest import agent_pids, wait_for
from .lab import DOCS, Kernel, Lab, api, chromium_page, jupyter_lab, rank_pids, screenshot

PANEL = "#skyward-pools"
PANEL_SHOT = DOCS / "side-panel.png"


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("lab-panel")
    empty = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    for name in ("first.ipynb", "second.ipynb"):
        (root / name).write_text(json.dumps(empty))
    with jupyter_lab(root) as server:
        yield server


def pool_named(lab: Lab, name: str) -> dict[str, Any]:
    status, body = api(lab, "GET", f"/skyward/pools/{name}")
    assert status == 200, body
    return dict(body)


def item(name: str) -> str:
    return f'{PANEL} li.sky-lab-pool[data-pool-name="{name}"]'


def open_lab_with_panel(lab: Lab, page: Any) -> None:
    """Load JupyterLab and open the Sky panel from its side-bar tab."""
    page.goto(lab.page_url("lab"))
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=60_000)
    tab = page.locator('.jp-SideBar li[data-id="skyward-pools"]')
    try:
        tab.wait_for(timeout=10_000)
    except PlaywrightTimeout as exc:
        raise AssertionError(
            "JupyterLab has no Sky tab: the side panel is not installed in this environment "
            "(make setup builds it and links it into .venv/share/jupyter/labextensions)"
        ) from exc
    tab.click()


def shoot_panel(page: Any, path: Path) -> None:
    """A PNG of the side panel down to its last pool (small enough for the README)."""
    panel = page.locator(PANEL).bounding_box()
    pools = page.locator(f"{PANEL} .sky-lab-pools").bounding_box()
    height = pools["y"] + pools["height"] - panel["y"] + 8
    path.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(path), clip={**panel, "height": height})


def confirm(page: Any) -> None:
    page.locator(".jp-Dialog .jp-mod-accept").click()
    page.wait_for_selector(".jp-Dialog", state="detached")


def test_side_panel_lists_shuts_down_and_reaps(lab: Lab) -> None:
    kernels: list[Kernel] = []
    try:
        with chromium_page() as page:
            _scenario(lab, page, kernels)
    finally:
        for kernel in kernels:
            kernel.close()
        wait_for(lambda: not agent_pids(), 30, "every rank to end with its kernel")


def _scenario(lab: Lab, page: Any, kernels: list[Kernel]) -> None:
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/skyward/" in r.url else None)

    def seen() -> int:
        """Requests so far: a round trip to the page first, so that its events are delivered."""
        page.evaluate("0")
        return len(requests)

    # The panel is a tab of the left side bar; opened, with no pool yet, it says how to get one.
    open_lab_with_panel(lab, page)
    page.wait_for_selector(f"{PANEL} .sky-lab-empty", timeout=30_000)

    # A notebook starts a 2-node pool: the panel lists it, titled by notebook and name, 2 nodes.
    first = Kernel(lab, "first.ipynb")
    kernels.append(first)
    first.run("%load_ext skyward_jupyter\n%sky up --nodes 2 --name first")
    page.wait_for_selector(f'{item("first")}[data-state="ready"]', timeout=30_000)
    page.locator(f"{item('first')} .sky-lab-toggle").click()
    assert page.locator(f"{item('first')} tr.sky-lab-node").count() == 2
    head = page.locator(f"{item('first')} .sky-lab-details").inner_text()
    assert "local · 2 nodes · gloo" in head, head
    title = page.locator(f"{item('first')} .sky-lab-title")
    wait_for(lambda: title.inner_text() == "first.ipynb · first", 30, "the pool's title")
    state = page.locator(f"{item('first')} .sky-lab-state").first
    assert state.get_attribute("title") == "started; no cell has run on it yet"  # model.py's

    # The destructive button is a quiet secondary one (a dialog confirms).
    button = page.locator(f"{item('first')} .sky-lab-shutdown")
    assert "jp-mod-warn" not in (button.get_attribute("class") or "")
    look = button.evaluate(
        "b => { const s = getComputedStyle(b); return [s.backgroundColor, s.fontSize]; }"
    )
    assert look[0] == "rgba(0, 0, 0, 0)", look

    # The title opens its notebook.
    title.click()
    current = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
    wait_for(
        lambda: current.count() == 1 and current.inner_text() == "first.ipynb",
        30,
        "the title's click to open first.ipynb",
    )

    # A second notebook's pool appears beside it.
    second = Kernel(lab, "second.ipynb")
    kernels.append(second)
    second.run("%load_ext skyward_jupyter\n%sky up --nodes 2 --name second")
    page.wait_for_selector(item("second"), timeout=30_000)
    assert page.locator(f"{PANEL} .sky-lab-clean").is_hidden()  # nothing gone: no clean-up
    screenshot(page, "lab_panel_two_pools")

    # The second kernel dies. Its record still says "ready"; the panel shows it gone, greyed,
    # after the live one, its uptime stopped, and offers to clean it up.
    second_ranks = rank_pids(pool_named(lab, "second"))
    os.kill(int(second.run("import os; print(os.getpid())")), signal.SIGKILL)
    gone = f'{item("second")}[data-state="gone"].sky-lab-gone'
    page.wait_for_selector(gone, timeout=30_000)
    assert page.locator(f"{gone} .sky-lab-owner").inner_text() == (
        "gone: its kernel's process ended"
    )
    opacity = page.locator(gone).evaluate("e => Number(getComputedStyle(e).opacity)")
    assert opacity < 0.8, opacity
    names = page.locator(f"{PANEL} li.sky-lab-pool").evaluate_all(
        "items => items.map(i => i.dataset.poolName)"
    )
    assert names == ["first", "second"], names
    details = page.locator(f"{gone} .sky-lab-details").inner_text()
    assert details == "local · 2 nodes · gloo", details  # no uptime counting on
    clean = page.locator(f"{PANEL} .sky-lab-clean")
    assert clean.inner_text() == "Clean up 1 gone"
    DOCS.mkdir(exist_ok=True)
    shoot_panel(page, PANEL_SHOT)
    screenshot(page, "lab_panel_gone")

    # One action cleans it: what it left running ends, its record goes.
    clean.click()
    confirm(page)
    page.wait_for_selector(f"{PANEL} .sky-lab-message >> text=Cleaned 1 gone pool", timeout=60_000)
    page.wait_for_selector(item("second"), state="detached")
    wait_for(lambda: not second_ranks & agent_pids(), 10, "the gone pool's ranks to end")
    assert clean.is_hidden()

    # The shut-down button ends the first pool through its kernel; %sky status says so.
    first_ranks = rank_pids(pool_named(lab, "first"))
    assert len(first_ranks) == 2 and first_ranks <= agent_pids()
    page.locator(f"{item('first')} .sky-lab-shutdown").click()
    confirm(page)
    page.wait_for_selector(f"{PANEL} .sky-lab-message >> text=shut down by its kernel")
    page.wait_for_selector(item("first"), state="detached")
    assert not first_ranks & agent_pids()
    assert first.run("%sky status").strip() == "no pools"
    assert not agent_pids()
    page.wait_for_selector(f"{PANEL} .sky-lab-empty")

    # Refreshed on change: a pool registered just after a listing shows within a second, long
    # before the next listing (3 s), and its end as soon.
    ticks = page.get_attribute(PANEL, "data-poll-ticks")
    wait_for(lambda: page.get_attribute(PANEL, "data-poll-ticks") != ticks, 10, "a listing")
    record = {
        "format": registry.FORMAT,
        "id": registry.new_pool_id(),
        "name": "fresh",
        "owner": registry.Owner.current().as_dict(),
        "provider": "local",
        "state": "provisioning",
        "nodes": [],
        "created_at": time.time(),
        "teardown": {"provider": "local", "ranks": [], "templates": []},
    }
    directory = lab.runtime_dir / "skyward"
    registry.write_record(directory, record)
    page.wait_for_selector(f'{item("fresh")}[data-state="provisioning"]', timeout=1500)
    registry.remove_record(directory, record["id"])
    page.wait_for_selector(item("fresh"), state="detached", timeout=1500)

    # Hidden (another side-bar tab), the panel's poll stands by: it ticks, but asks nothing.
    page.locator('.jp-SideBar li[data-id="filebrowser"]').click()
    wait_for(
        lambda: page.get_attribute(PANEL, "data-poll") == "standby", 30, "the poll to stand by"
    )
    asked, ticks = seen(), int(page.get_attribute(PANEL, "data-poll-ticks"))
    wait_for(
        lambda: int(page.get_attribute(PANEL, "data-poll-ticks")) >= ticks + 2,
        30,
        "two more ticks of the poll",
    )
    assert seen() == asked, requests[asked:]

    # Shown again, it asks at once.
    page.locator('.jp-SideBar li[data-id="skyward-pools"]').click()
    wait_for(lambda: seen() > asked, 10, "a refresh when the panel is shown")


def test_errors_show_in_the_panel_and_the_poll_backs_off(lab: Lab) -> None:
    registry_dir = lab.runtime_dir / "skyward"
    registry_dir.mkdir(mode=0o700, exist_ok=True)
    with chromium_page() as browser_page:
        page: Any = browser_page
        open_lab_with_panel(lab, page)
        page.wait_for_selector(f"{PANEL} .sky-lab-empty", timeout=30_000)

        # A registry others may write is refused by the server: the panel says why, and backs off.
        registry_dir.chmod(0o777)
        error = f"{PANEL} .sky-lab-message.sky-lab-error"
        page.wait_for_selector(f"{error} >> text=not safe to use", timeout=30_000)
        wait_for(
            lambda: int(page.get_attribute(PANEL, "data-poll-interval")) > 3000,
            60,
            "the poll to back off",
        )
        screenshot(page, "lab_panel_error")

        # Fixed, the next poll clears the error and the interval comes back.
        registry_dir.chmod(0o700)
        page.wait_for_selector(error, state="detached", timeout=90_000)
        wait_for(
            lambda: int(page.get_attribute(PANEL, "data-poll-interval")) == 3000,
            30,
            "the poll's interval to come back",
        )
