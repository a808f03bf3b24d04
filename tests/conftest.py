"""Shared fixtures: every test ends with none of the rank processes it started still running.

Ranks are found by a marker in their environment (the local provider passes the notebook's
environment on), so ranks orphaned by a killed parent are found too, and ranks of unrelated
sessions on the same machine are not.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

MARKER = f"SKYWARD_TEST_SESSION={uuid.uuid4().hex}"
os.environ["SKYWARD_TEST_SESSION"] = MARKER.split("=", 1)[1]
# Pools of in-process shells register here, not in the developer's Jupyter runtime directory.
_REGISTRY = tempfile.mkdtemp(prefix="skyward-registry-")
os.environ["SKYWARD_REGISTRY_DIR"] = _REGISTRY
atexit.register(shutil.rmtree, _REGISTRY, ignore_errors=True)


def agent_pids(name: bytes = b"sky-rank-") -> set[int]:
    """Live (non-zombie) processes of this test session whose name starts with ``name``.

    Ranks name themselves ``sky-rank-N``, the template ``sky-template``.
    """
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"skyward_jupyter.agent" not in cmdline:
                continue
            if not (proc / "comm").read_bytes().startswith(name):
                continue
            if MARKER.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.add(int(proc.name))
        except OSError:
            continue  # the process ended while we looked
    return found


def agents_among(pids: Iterable[int]) -> list[int]:
    """Which of ``pids`` run the package's agent: ranks, and a node's warm template (wherever
    they are: a host's namespace, a cluster).
    """
    found = []
    for pid in pids:
        try:
            if b"skyward_jupyter.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue  # ended while we looked
    return found


def ranks_among(pids: Iterable[int]) -> list[int]:
    """Which of ``pids`` are ranks (a node's template forks them, so they share its command)."""
    found = []
    for pid in agents_among(pids):
        try:
            if not Path(f"/proc/{pid}/comm").read_bytes().startswith(b"sky-node-templ"):
                found.append(pid)
        except OSError:
            continue
    return found


def skip_where_nccl_runs() -> None:
    """Skip a test of ``--backend nccl`` refused where torch cannot run it, on a machine where
    ranks started here (locally, or on the test hosts, which share this Python) can: a torch
    built with NCCL, and a GPU.
    """
    import torch

    if torch.distributed.is_nccl_available() and torch.cuda.device_count():
        pytest.skip("this torch runs NCCL on this machine")


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def kill_and_await_replacement(pool: Any, index: int) -> None:
    """SIGKILL rank ``index`` of ``pool`` and wait until the pool has a new one ready."""
    from skyward_jupyter.events import RankState

    victim = pool.ranks[index].hello
    assert victim is not None
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(
        lambda: (
            pool.ranks[index].hello is not None
            and pool.ranks[index].hello.pid != victim.pid
            and pool.ranks[index].state is RankState.READY
        ),
        30,
        f"rank {index} to be replaced",
    )


def hold_rank_ones_gil(pool: Any, seconds: float = 8.0) -> tuple[Any, list[str]]:
    """Run a cell in which rank 1 computes in C without letting its GIL go (a builtin's loop,
    as a long import or a C extension's call does) for about ``seconds`` of its CPU time (more
    wall time on a busy machine) while the other ranks wait in a barrier; the cell's result, and the
    pool's messages about rank 1 meanwhile.
    """
    from skyward_jupyter.events import PoolMessage

    # CPU time, not wall time: calibrated on a loaded machine by the wall clock, the hold would
    # come out shorter than asked once the load eases; by CPU time it lasts at least as long.
    per_item = pool.run(
        "import time\nstarted = time.thread_time()\nsum(range(5 * 10**7))\n"
        "(time.thread_time() - started) / (5 * 10**7)"
    ).values[1]
    told: list[str] = []
    unsubscribe = pool.subscribe(
        lambda event: told.append(event.text) if isinstance(event, PoolMessage) else None
    )
    try:
        result = pool.run(
            "import torch.distributed as dist\n"
            f"if dist.get_rank() == 1:\n    sum(range({int(seconds / per_item)}))\n"
            "dist.barrier()\n'done'"
        )
    finally:
        unsubscribe()
    return result, [text for text in told if text.startswith("rank 1 (")]


class _Unretrieved(logging.Handler):
    """asyncio's "Task exception was never retrieved" (logged when such a task is collected)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "never retrieved" in record.getMessage():
            self.found.append(self.format(record))


@pytest.fixture(autouse=True, scope="module")
def no_unretrieved_task_exceptions() -> Iterator[None]:
    """A task that failed with nobody to hear it is a lost error: no module may leave one."""
    handler = _Unretrieved()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        yield
        gc.collect()
        assert not handler.found, "\n".join(handler.found)
    finally:
        logging.getLogger("asyncio").removeHandler(handler)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C raises KeyboardInterrupt in the main thread, as in a kernel, however pytest was
    started: one started in the background by a shell without job control inherits SIGINT
    ignored, and Python keeps it so (a test pressing Ctrl-C then waited out its deadlines).
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def ctrl_c() -> None:
    """Press Ctrl-C in the notebook: SIGINT to the main thread."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


TEMPLATE = b"sky-template"
_module_pool_pids: set[int] = set()


@pytest.fixture(autouse=True, scope="module")
def template_ends_with_the_module() -> Iterator[None]:
    """The rank template is a process-wide cache: each module ends it and checks that it ended."""
    yield
    from skyward_jupyter.providers.local import shutdown_template

    shutdown_template()
    wait_for(lambda: not agent_pids(TEMPLATE), 10, "the rank template to end")


@pytest.fixture(autouse=True)
def no_leaked_ranks() -> Iterator[None]:
    before = agent_pids()
    yield
    allowed = before | _module_pool_pids
    try:
        wait_for(lambda: not (agent_pids() - allowed), 15, "the test's rank processes to end")
    except AssertionError:
        leaked = agent_pids() - allowed
        for pid in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        raise AssertionError(
            f"rank processes left running after the test: {sorted(leaked)}"
        ) from None


@pytest.fixture(scope="module")
def pool2() -> Iterator[object]:
    """A 2-rank local pool shared by a module's tests that leave it as they found it."""
    from skyward_jupyter import Pool

    pool = Pool(nodes=2, interrupt_grace=2.0)
    pool.start()
    pids = {r.hello.pid for r in pool.ranks if r.hello}
    _module_pool_pids.update(pids)
    try:
        yield pool
    finally:
        pool.close()
        _module_pool_pids.difference_update(pids)
        wait_for(lambda: not (pids & agent_pids()), 15, "the shared pool's ranks to end")


def outputs_of(
    client: Any,
    msg_id: str,
    deadline: float,
    what: str,
    seen: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The iopub messages of kernel request ``msg_id`` (not its status or echoed input), until
    the kernel is idle for it; ``seen`` gets every iopub message, the other requests' too.
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{what}: the kernel did not finish in time")
        try:
            msg = client.get_iopub_msg(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if seen is not None:
            seen(msg)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "idle":
                return
            continue
        if msg["msg_type"] != "execute_input":
            yield msg


def reply_of(client: Any, msg_id: str, deadline: float, what: str) -> dict[str, Any]:
    """The shell reply's content of kernel request ``msg_id``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{what}: no execute_reply in time")
        try:
            reply = client.get_shell_msg(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"])


def ssh_hosts_fixture(count: int, folder: str = "hosts") -> Any:
    """A module's ``hosts`` fixture: ``count`` real SSH hosts (tests/hosts.py) for the whole
    module, in a temporary ``folder``; the module is skipped where they cannot be made.
    """
    from .hosts import available, ssh_hosts

    @pytest.fixture(scope="module")
    def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
        if available() is not None:
            pytest.skip(str(available()))
        with ssh_hosts(count, tmp_path_factory.mktemp(folder)) as made:
            yield made

    return hosts
