"""Nothing outlives a local pool: what a cell detaches on a rank (double fork, ``setsid``,
``nohup``) ends with the rank however the rank ends, and the rank's private files go with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.providers import local
from skyward_jupyter.providers.local import LocalProvider
from skyward_jupyter.providers.local_template import template

from .conftest import agent_pids, wait_for
from .lifetime import detach, flat, kill_all, new_tag, running


@pytest.fixture
def tag() -> Iterator[str]:
    made = new_tag()
    yield made
    kill_all(made)


def _detached(pool: Pool, tag: str) -> list[list[int]]:
    """Each rank's detached processes, all running."""
    result = pool.run(detach(tag))
    assert result.ok, result.errors
    pids = flat(result.values)
    assert len(pids) == 3 * pool.world_size
    wait_for(lambda: sorted(running(tag)) == pids, 10, "the detached processes to run sleep")
    return list(result.values)


def test_detached_children_end_with_the_pool(tag: str) -> None:
    """``%sky down``: the ranks end on the pool's word, and take what their cells detached."""
    pool = Pool(nodes=2).start()
    try:
        _detached(pool, tag)
    finally:
        pool.close()
    wait_for(lambda: not running(tag), 10, "the detached processes to end with the pool")


@pytest.mark.parametrize("use_template", [True, False], ids=["forked", "spawned"])
def test_detached_children_end_with_a_restart(tag: str, use_template: bool) -> None:
    """``%sky restart`` kills the old ranks (forked from the template or spawned directly):
    what they detached goes with them, and the new ranks still work.
    """
    with Pool(nodes=2, provider=LocalProvider(use_template=use_template)) as pool:
        _detached(pool, tag)
        pool.restart()
        wait_for(lambda: not running(tag), 10, "the detached processes to end with the restart")
        assert pool.run("1").values == [1, 1]


def test_a_rank_killed_outside_the_pool_leaves_nothing(tag: str) -> None:
    """A rank that dies without a word (SIGKILL, the OOM killer): its template ends the rest."""
    with Pool(nodes=2) as pool:
        first, second = _detached(pool, tag)
        victim = pool.ranks[0].hello
        assert victim is not None
        os.kill(victim.pid, 9)
        wait_for(lambda: not set(running(tag)) & set(first), 10, "rank 0's detached ones to end")
        assert set(running(tag)) == set(second)  # rank 1's, still running with rank 1
    wait_for(lambda: not running(tag), 10, "the rest to end with the pool")


def test_a_rank_started_again_as_the_pool_closes_ends_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank lost while idle is started again; the pool closes while that start still waits
    for the new rank's pipes. Nothing else knows of the new rank yet: it ends with the start
    (it waited on its open wire for ever).
    """
    before = agent_pids()
    real = local._pipe_reader
    connected: list[int] = []
    stalled = threading.Event()

    async def stalling(fd: int) -> asyncio.StreamReader:
        made = await real(fd)
        connected.append(fd)
        if len(connected) == 2:  # the new rank's second pipe: the pool closes meanwhile
            stalled.set()
            await asyncio.Event().wait()
        return made

    with Pool(nodes=2) as pool:
        victim = pool.ranks[0].hello
        assert victim is not None
        monkeypatch.setattr(local, "_pipe_reader", stalling)
        os.kill(victim.pid, 9)
        assert stalled.wait(30), "rank 0 was not started again"
    wait_for(lambda: not agent_pids() - before, 10, "the rank started as the pool closed to end")


def test_detached_children_end_when_the_notebook_is_killed(tmp_path: Path, tag: str) -> None:
    """The kernel's death (SIGKILL: no exit hook runs): the ranks see their wire close."""
    script = tmp_path / "notebook.py"
    script.write_text(
        "import json, time\n"
        "from skyward_jupyter import Pool\n"
        "from tests.lifetime import detach\n"
        "pool = Pool(nodes=2).start()\n"
        f"print(json.dumps(pool.run(detach({tag!r})).values), flush=True)\n"
        "time.sleep(600)\n"
    )
    notebook = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert notebook.stdout is not None
        pids = flat(json.loads(notebook.stdout.readline()))
        assert len(pids) == 6
        wait_for(lambda: sorted(running(tag)) == pids, 10, "the detached processes to run sleep")
    finally:
        notebook.kill()
        notebook.wait()
    wait_for(lambda: not running(tag), 30, "the detached processes to end after the notebook")
    wait_for(lambda: not agent_pids(), 30, "the notebook's ranks to end")


def test_a_notebook_that_exits_without_closing_its_pool_ends_it_quietly(
    tmp_path: Path, tag: str
) -> None:
    """The kernel ends without ``%sky down`` (the interpreter's exit): the pool is closed by
    its exit hook, whose blocking work still gets threads, without a traceback; the ranks and
    what they detached end with it.
    """
    script = tmp_path / "notebook.py"
    script.write_text(
        "import json\n"
        "from skyward_jupyter import Pool\n"
        "from tests.lifetime import detach\n"
        "pool = Pool(nodes=2).start()\n"
        f"print(json.dumps(pool.run(detach({tag!r})).values), flush=True)\n"
    )
    ended = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert ended.returncode == 0 and len(flat(json.loads(ended.stdout))) == 6, ended
    assert "Traceback" not in ended.stderr and "failed" not in ended.stderr, ended.stderr
    wait_for(lambda: not running(tag), 30, "the detached processes to end with the notebook")


def test_the_exit_hook_closes_pools_while_threads_can_still_be_had(tmp_path: Path) -> None:
    """The close at exit runs before concurrent.futures shuts its thread pools, however late
    the notebook first used one (asyncio imports their module at its first executor).
    """
    script = tmp_path / "notebook.py"
    script.write_text(
        "import asyncio\n"
        "from skyward_jupyter.io_thread import close_at_exit\n"
        "class Owner:\n"
        "    def close(self):\n"
        "        done = asyncio.run(asyncio.to_thread(lambda: 'ok'))\n"
        "        print('closed:', done, flush=True)\n"
        "owner = Owner()\n"
        "close_at_exit(owner)\n"
        "asyncio.run(asyncio.to_thread(print, 'first executor'))\n"
    )
    ended = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert ended.stdout.splitlines() == ["first executor", "closed: ok"], ended
    assert "Traceback" not in ended.stderr, ended.stderr


RECORD = (
    "import os\n"
    "from torch.distributed.elastic.multiprocessing.errors import record\n"
    "@record\n"
    "def main():\n"
    "    raise ValueError('secret-ish')\n"
    "try:\n"
    "    main()\n"
    "except ValueError:\n"
    "    pass\n"
    "os.environ['TORCHELASTIC_ERROR_FILE']"
)


def test_record_error_files_are_private_and_end_with_the_pool() -> None:
    with Pool(nodes=2) as pool:
        result = pool.run(RECORD)
        assert result.ok, result.errors
        paths = [Path(p) for p in result.values]
        assert len(set(paths)) == 2
        for path in paths:
            assert "secret-ish" in path.read_text()  # torch's @record wrote it
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            assert path.parent.stat().st_uid == os.getuid()
    wait_for(lambda: not any(p.parent.exists() for p in paths), 10, "the error files to go")


def _private_dirs(pool: Pool) -> list[Path]:
    """Each rank's private directory (its torch error file's)."""
    found = pool.run("__import__('os').environ['TORCHELASTIC_ERROR_FILE']")
    assert found.ok, found.errors
    return [Path(path).parent for path in found.values]


def test_private_directories_go_with_a_restart_and_a_killed_ranks_with_the_pool() -> None:
    """``%sky restart`` kills the old ranks: their private directories go with them. One whose
    rank was killed outside the pool (the OOM killer) goes with the pool.
    """
    with Pool(nodes=2) as pool:
        first = _private_dirs(pool)
        parent = first[0].parent
        assert parent.name == f"skyward-{pool.run_id}" and all(d.parent == parent for d in first)
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700
        pool.restart()
        second = _private_dirs(pool)
        assert not set(first) & set(second) and all(d.is_dir() for d in second)
        assert not any(d.exists() for d in first)
        victim = pool.ranks[0].hello
        assert victim is not None
        os.kill(victim.pid, 9)
        wait_for(
            lambda: (hello := pool.ranks[0].hello) is not None and hello.pid != victim.pid,
            30,
            "rank 0 to be replaced",
        )
        assert pool.run("1").ok and second[0].is_dir()  # nobody could remove it yet
    assert not parent.exists()


def test_a_start_cancelled_while_the_template_forks_leaves_no_rank() -> None:
    """Ctrl-C while twelve ranks start: those still queued at the template are forked with the
    pipes their start made, not with whatever the notebook opened after the cancel under the
    same descriptor numbers (a rank reading such a pipe would wait forever), and every rank the
    cancelled start made is ended.
    """
    before = agent_pids()
    held: list[int] = []

    async def start_then_cancel() -> None:
        provider = LocalProvider()
        nodes = await provider.provision(12)
        starts = [asyncio.ensure_future(provider.start_rank(node, {})) for node in nodes]
        await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
        queue = template()._request_lock  # the other starts queue behind the one forking now
        queue.acquire()  # held for one fork at most
        try:
            for start in starts:
                start.cancel()
            await asyncio.sleep(0)  # the starts see their cancel
            for _ in range(32):  # what the notebook opens next takes the numbers it closed
                held.extend(os.pipe())
            # Each of those numbers made one end of a socket pair the test keeps open, which a
            # rank can write to and read from: one forked with them would wait on it for good.
            ours, theirs = socket.socketpair()
            for fd in held:
                os.dup2(theirs.fileno(), fd)
            held.extend((ours.detach(), theirs.detach()))
        finally:
            queue.release()
        await asyncio.gather(*starts, return_exceptions=True)
        await provider.release()

    try:
        asyncio.run(start_then_cancel())
        wait_for(lambda: agent_pids() <= before, 10, "every rank of the cancelled start to end")
    finally:
        for fd in held:
            os.close(fd)
