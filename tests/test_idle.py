"""``--idle-timeout``: a pool stops after that long without a cell, never during one."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from skyward_jupyter.auto_cells import AutoCells
from skyward_jupyter.results import PoolError, RunResult
from skyward_jupyter.session import PoolSpec, Session

from .conftest import wait_for


def test_defaults_on_for_aws_only_and_zero_disables() -> None:
    assert PoolSpec(provider="aws").idle_minutes() == 30
    assert PoolSpec(provider="aws", idle_timeout=0).idle_minutes() is None
    assert PoolSpec(provider="aws", idle_timeout=5).idle_minutes() == 5
    assert PoolSpec().idle_minutes() is None
    assert PoolSpec(idle_timeout=2).idle_minutes() == 2


def test_an_idle_pool_stops_but_a_long_cell_is_not_stopped() -> None:
    said: list[str] = []
    session = Session(announce=said.append, auto_cells=AutoCells(shell=None))
    session.idle.check = 0.1
    spec = PoolSpec(nodes=1, idle_timeout=0.02)  # 1.2 s
    session.auto(True)  # and %sky auto goes off with the pool its cells run on
    cell: concurrent.futures.Future[RunResult] = concurrent.futures.Future()

    def run_cell() -> None:
        try:
            cell.set_result(session.run_cell("import time\ntime.sleep(4)\n'done'", {}, spec=spec))
        except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
            cell.set_exception(exc)

    # The cell runs well past the idle timeout: it is not idle, so it finishes. It runs on a
    # thread so that a cell the idle stop wrongly ends, or leaves waiting, fails the test in time.
    threading.Thread(target=run_cell, name="idle-test-cell", daemon=True).start()
    try:
        try:
            result = cell.result(timeout=45)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"the 4 s cell did not end within 45 s; said: {said}") from None
        except PoolError as exc:
            raise AssertionError(f"the idle stop ended the running cell ({exc}): {said}") from None
        stopped = [s for s in said if "--idle-timeout" in s]
        assert not stopped, f"the idle stop ran while a cell was running: {stopped}"
        assert result.values == ["done"]
        ended = time.monotonic()
        assert "default" in session.pools
        wait_for(lambda: "default" not in session.pools, 20, "the idle pool to stop")
        # Idle is counted from the cell's end, not the pool's start: the pool outlived the cell
        # by most of its 1.2 s (the margin is the cell's result reaching this thread).
        outlived = time.monotonic() - ended
        assert outlived >= 0.6, f"the pool stopped {outlived:.2f} s after its cell ended"
        assert any("no cell for 0.02 min, shutting down (--idle-timeout)" in s for s in said)
        assert not session.auto_on
        assert any("auto: off, as pool 'default' ended" in s for s in said)
        # The next cell starts a pool again; the panel's "Shut down" of it turns auto off too.
        session.auto(True)
        assert session.run_cell("1", {}, spec=PoolSpec(nodes=1)).values == [1]
        said.clear()
        session.down_pool("default", session.pools["default"].pool)
        assert not session.auto_on
        assert any("auto: off, as pool 'default' ended" in s for s in said), said
    finally:
        session.down_all()
