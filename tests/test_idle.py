"""``--idle-timeout``: a pool stops after that long without a cell, never during one."""

from __future__ import annotations

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
    session = Session(announce=said.append)
    session.idle_check = 0.1
    spec = PoolSpec(nodes=1, idle_timeout=0.02)  # 1.2 s
    try:
        # The cell runs well past the idle timeout: it is not idle, so it finishes.
        result = session.run_cell("import time\ntime.sleep(4)\n'done'", {}, spec=spec)
        assert result.values == ["done"]
        assert "default" in session.pools
        wait_for(lambda: "default" not in session.pools, 20, "the idle pool to stop")
        assert any("no cell for 0.02 min, shutting down (--idle-timeout)" in s for s in said)
        # The next cell starts a pool again.
        assert session.run_cell("1", {}, spec=PoolSpec(nodes=1)).values == [1]
    finally:
        session.down_all()
