"""The server extension's routes in a real JupyterLab, with pools of real kernels.

Kernels are started through the server's REST API and driven with jupyter_client over their
connection files; the pools they start register in the server's runtime directory, which is
where the extension reads them.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import procs, registry

from .conftest import agent_pids, wait_for
from .lab import Kernel, Lab, api, jupyter_lab, rank_pids


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with jupyter_lab(tmp_path_factory.mktemp("server")) as server:
        yield server


def pools(lab: Lab) -> list[dict[str, Any]]:
    status, body = api(lab, "GET", "/skyward/pools")
    assert status == 200, body
    return list(body["pools"])


def pools_of(lab: Lab, kernel: Kernel) -> list[dict[str, Any]]:
    return [p for p in pools(lab) if p["kernel_id"] == kernel.id]


@pytest.fixture
def kernels(lab: Lab) -> Iterator[list[Kernel]]:
    """Kernels a test starts; shut down through the server when it ends (their ranks go too)."""
    started: list[Kernel] = []
    try:
        yield started
    finally:
        for kernel in started:
            kernel.close()
        wait_for(lambda: not agent_pids(), 30, "the kernels' ranks to end with them")


def test_routes_need_authentication(lab: Lab, kernels: list[Kernel]) -> None:
    kernel = Kernel(lab)
    kernels.append(kernel)
    kernel.run("%load_ext skyward_jupyter\n%sky up --nodes 1")
    (pool,) = pools_of(lab, kernel)
    for token in (None, "not-the-token"):
        for method, path in (
            ("GET", "/skyward/pools"),
            ("GET", f"/skyward/pools/{pool['id']}"),
            ("GET", "/skyward/pools/default"),
            ("DELETE", f"/skyward/pools/{pool['id']}"),
            ("GET", "/skyward/stamp"),
            ("DELETE", "/skyward/pools?gone=1"),
        ):
            status, body = api(lab, method, path, token=token)
            assert status == 403, (method, path, token, status)
            assert pool["id"] not in str(body) and kernel.id not in str(body)
    assert [p["id"] for p in pools_of(lab, kernel)] == [pool["id"]]  # the DELETEs did nothing
    assert rank_pids(pool) <= agent_pids()


def test_delete_from_a_browser_session_needs_the_xsrf_token(lab: Lab) -> None:
    """Cookie-authenticated (the panel): DELETE without the XSRF header is refused."""
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with browser.open(lab.page_url("lab"), timeout=60) as response:
        assert response.status == 200
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    missing = registry.new_pool_id()

    status, _ = api(lab, "GET", "/skyward/pools", token=None, opener=browser)
    assert status == 200  # a GET needs no XSRF token
    status, body = api(lab, "DELETE", f"/skyward/pools/{missing}", token=None, opener=browser)
    assert status == 403 and "_xsrf" in str(body)
    status, body = api(
        lab,
        "DELETE",
        f"/skyward/pools/{missing}",
        token=None,
        headers={"X-XSRFToken": xsrf},
        opener=browser,
    )
    assert status == 404, body  # past authentication and XSRF: there is no such pool


def test_list_one_delete_and_reap_orphans(lab: Lab, kernels: list[Kernel]) -> None:
    first, second = Kernel(lab), Kernel(lab)
    kernels += [first, second]
    first.run("%load_ext skyward_jupyter\n%sky up --nodes 2")

    # The list: the pool, its kernel, 2 nodes of one live rank each.
    (pool,) = pools(lab)
    assert pool["kernel_id"] == first.id and pool["name"] == "default"
    assert pool["provider"] == "local" and pool["ready"] and pool["state"] == "ready"
    assert pool["world_size"] == 2 and pool["nodes_requested"] == 2
    assert [len(n["ranks"]) for n in pool["nodes"]] == [1, 1]
    assert {n["state"] for n in pool["nodes"]} == {"ready"}
    assert pool["orphan"] is False and pool["shutdown_requested"] is False
    assert pool["owner"] == {
        "pid": first.pid(),
        "host": socket.gethostname(),
        "alive": True,
        "kernel_known": True,
    }
    assert pool["cost"] == {"price_per_hour": None, "spent": None, "currency": None}
    assert pool["uptime_s"] >= 0 and "teardown" not in pool
    first_ranks = rank_pids(pool)
    assert len(first_ranks) == 2 and first_ranks <= agent_pids()

    # On disk: a private directory, a private file.
    directory = lab.runtime_dir / "skyward"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / f"{pool['id']}.json").stat().st_mode) == 0o600

    # One pool, by id or by name; a cell's rank states reach the record.
    first.run("%%sky\nx = 1")
    wait_for(
        lambda: api(lab, "GET", f"/skyward/pools/{pool['id']}")[1]["state"] == "idle",
        10,
        "the pool's record to say idle after a cell",
    )
    status, one = api(lab, "GET", "/skyward/pools/default")
    assert status == 200 and one["id"] == pool["id"] and one["state"] == "idle"
    status, _ = api(lab, "GET", f"/skyward/pools/{registry.new_pool_id()}")
    assert status == 404

    # A second kernel's pool appears beside it; its name is then ambiguous.
    second.run("%load_ext skyward_jupyter\n%sky up --nodes 2")
    (other,) = pools_of(lab, second)
    assert len(pools(lab)) == 2 and other["id"] != pool["id"]
    status, body = api(lab, "GET", "/skyward/pools/default")
    assert status == 409 and pool["id"] in str(body) and other["id"] in str(body)

    # Shut the first pool down through the server: its kernel ends it; %sky status knows.
    status, body = api(lab, "DELETE", f"/skyward/pools/{pool['id']}")
    assert status == 200 and body == {"id": pool["id"], "name": "default", "how": "kernel"}
    assert not first_ranks & agent_pids()
    assert pools_of(lab, first) == []
    assert first.run("%sky status").strip() == "no pools"

    # The same while a cell runs on the pool: the cell is interrupted, then the pool ends.
    first.run("%sky up --nodes 2")
    (busy,) = pools_of(lab, first)
    cell = first.client.execute(
        "%%sky\nimport time\nprint('sleeping', flush=True)\ntime.sleep(300)"
    )
    first.collect(cell, 60, until="sleeping")
    status, body = api(lab, "DELETE", f"/skyward/pools/{busy['id']}")
    assert status == 200 and body["how"] == "kernel"
    reply, text = first.collect(cell, 60)
    assert reply["status"] == "error" and "CellInterrupted: cell interrupted" in text
    assert not rank_pids(busy) & agent_pids()
    assert first.run("%sky status").strip() == "no pools"

    # The second kernel dies: its pool is an orphan, and DELETE reaps what is left of it.
    os.kill(second.pid(), signal.SIGKILL)
    wait_for(lambda: pools_of(lab, second)[0]["orphan"], 30, "the pool to be an orphan")
    (orphan,) = pools_of(lab, second)
    assert orphan["owner"]["alive"] is False
    status, body = api(lab, "DELETE", f"/skyward/pools/{orphan['id']}")
    assert status == 200 and body["how"] == "reaped", body
    assert rank_pids(orphan) <= set(body["killed"]) | set(body["gone"])  # and its template
    assert body["spared"] == []
    wait_for(lambda: not rank_pids(orphan) & agent_pids(), 10, "the orphan's ranks to end")
    assert api(lab, "GET", f"/skyward/pools/{orphan['id']}")[0] == 404
    assert pools(lab) == []


def stamp(lab: Lab) -> str:
    status, body = api(lab, "GET", "/skyward/stamp")
    assert status == 200, body
    return str(body["stamp"])


def test_a_dead_kernels_pool_is_gone_and_cleaned_in_one_action(
    lab: Lab, kernels: list[Kernel]
) -> None:
    """A notebook's pool is titled by its notebook; its kernel killed, the record (still
    saying "ready") is shown ``gone``, without uptime, and one DELETE cleans every gone pool.
    The listing's stamp changes with what it says, not with the clock.
    """
    dying, living = Kernel(lab, "dying.ipynb"), Kernel(lab, "living.ipynb")
    kernels += [dying, living]
    dying.run("%load_ext skyward_jupyter\n%sky up --nodes 2 --name big")
    living.run("%load_ext skyward_jupyter\n%sky up --nodes 1")

    status, body = api(lab, "GET", "/skyward/pools")
    assert status == 200 and body["states"]["gone"]["tone"] == "over"
    assert body["stamp"] == stamp(lab)
    (pool,) = pools_of(lab, dying)
    assert pool["notebook"] == "dying.ipynb" and pool["state"] == "ready"
    assert pool["gone_why"] is None
    assert pools_of(lab, living)[0]["notebook"] == "living.ipynb"
    before = stamp(lab)
    wait_for(lambda: pools_of(lab, dying)[0]["uptime_s"] > pool["uptime_s"], 10, "a second")
    assert stamp(lab) == before  # the clock alone changes nothing the panel must fetch

    ranks = rank_pids(pool)
    os.kill(dying.pid(), signal.SIGKILL)
    wait_for(lambda: pools_of(lab, dying)[0]["state"] == "gone", 30, "the pool to be gone")
    (gone,) = pools_of(lab, dying)
    assert gone["gone_why"] == "its kernel's process ended" and gone["orphan"] is True
    assert registry.read_record(lab.runtime_dir / "skyward", gone["id"])["state"] == "ready"
    assert stamp(lab) != before
    assert gone["uptime_s"] is None  # no uptime counting on for what no longer runs

    status, body = api(lab, "DELETE", "/skyward/pools")
    assert status == 400 and "gone=1" in body["message"]
    status, body = api(lab, "DELETE", "/skyward/pools?gone=1")
    assert status == 200, body
    (cleaned,) = body["cleaned"]
    assert cleaned["id"] == gone["id"] and cleaned["how"] == "reaped"
    wait_for(lambda: not ranks & agent_pids(), 10, "the gone pool's ranks to end")
    assert pools_of(lab, dying) == []
    assert [p["state"] for p in pools_of(lab, living)] == ["ready"]  # the live one stays


def _fake_rank(rank: int) -> subprocess.Popen[bytes]:
    """A real agent process that stays up (its wire open, a long heartbeat timeout)."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "skyward_jupyter.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={
            **os.environ,
            "RANK": str(rank),
            "SKYWARD_AGENT": json.dumps({"heartbeat_timeout": 600}),
        },
        start_new_session=True,
    )
    wait_for(lambda: agent.pid in agent_pids(), 60, f"agent {rank} to name itself")
    return agent


def test_reap_kills_the_pools_processes_and_nothing_else(lab: Lab) -> None:
    """An orphan whose ranks still run (here their wire stays open): DELETE ends them.

    The record also lists a process that is some other program now (left alone), and a pid
    whose start time does not match, a pid reused by another process (left alone, counted as
    gone).
    """
    rank0, rank1 = _fake_rank(0), _fake_rank(1)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    dead = subprocess.Popen(["sleep", "300"])
    dead_start = procs.process_start(dead.pid)
    dead.kill()
    dead.wait()
    try:
        directory = registry.ensure_dir(lab.runtime_dir / "skyward")
        record = {
            "format": registry.FORMAT,
            "id": registry.new_pool_id(),
            "name": "left",
            "owner": registry.Owner(dead.pid, dead_start, socket.gethostname(), None).as_dict(),
            "provider": "local",
            "created_at": time.time(),
            "started_at": time.time(),
            "nodes": [],
            "teardown": {
                "provider": "local",
                "host": socket.gethostname(),
                "ranks": [
                    {"pid": rank0.pid, "start": procs.process_start(rank0.pid)},
                    {"pid": rank1.pid, "start": "proc:1"},  # the pid of a process reused
                    {"pid": stranger.pid, "start": procs.process_start(stranger.pid)},
                    {"pid": dead.pid, "start": dead_start},
                ],
                "templates": [],
            },
        }
        registry.write_record(directory, record)
        (listed,) = [p for p in pools(lab) if p["id"] == record["id"]]
        assert listed["orphan"] is True and listed["owner"]["alive"] is False

        status, body = api(lab, "DELETE", f"/skyward/pools/{record['id']}")
        assert status == 200 and body["how"] == "reaped", body
        assert body["killed"] == [rank0.pid]
        assert body["spared"] == [stranger.pid]
        assert body["gone"] == sorted([rank1.pid, dead.pid])
        assert rank0.wait(timeout=10) == -signal.SIGKILL  # with its tree: no SIGTERM first
        assert rank1.poll() is None and stranger.poll() is None
        assert registry.read_record(directory, record["id"]) is None
    finally:
        for process in (rank0, rank1, stranger):
            process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()


def test_the_extension_is_enabled_by_its_config_file() -> None:
    config = Path(__file__).resolve().parents[1] / "jupyter-config" / "jupyter_server_config.d"
    assert json.loads((config / "skyward_jupyter.json").read_text()) == {
        "ServerApp": {"jpserver_extensions": {"skyward_jupyter": True}}
    }
    import skyward_jupyter
    from skyward_jupyter import server

    points = skyward_jupyter._jupyter_server_extension_points()
    assert points == [{"module": "skyward_jupyter.server"}]
    assert callable(server._load_jupyter_server_extension)
