"""The rank process on its own: it must end by itself when the notebook goes away."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from skyward_jupyter import protocol as p
from skyward_jupyter.wire import SyncChannel

from .conftest import wait_for


@pytest.fixture
def agent() -> Iterator[tuple[subprocess.Popen[bytes], SyncChannel]]:
    """An agent whose heartbeat timeout no loaded machine reaches: the tests that use it are
    not about heartbeats, and a worker starved for a second and a half must not end it.
    """
    yield from _agent(heartbeat_timeout=120)


@pytest.fixture
def quick_agent() -> Iterator[tuple[subprocess.Popen[bytes], SyncChannel]]:
    """An agent that takes the notebook for gone after 1.5 s without a heartbeat."""
    yield from _agent(heartbeat_timeout=1.5)


def _agent(heartbeat_timeout: float) -> Iterator[tuple[subprocess.Popen[bytes], SyncChannel]]:
    settings = {"heartbeat_interval": 0.2, "heartbeat_timeout": heartbeat_timeout}
    env = {**os.environ, "SKYWARD_AGENT": json.dumps(settings), "RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyward_jupyter.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    channel = SyncChannel(proc.stdout.fileno(), proc.stdin.fileno())
    try:
        yield proc, channel
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _beating(channel: SyncChannel) -> Iterator[None]:
    """Send heartbeats, as a live notebook does, while the block runs."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(0.2):
            channel.send(p.Beat())

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


def _block_in_a_cell(channel: SyncChannel) -> None:
    """Start a cell that sleeps, heartbeating until it has printed that it is blocked."""
    channel.send(
        p.RunCell(1, "import time\nprint('blocked', flush=True)\ntime.sleep(600)", "<sky-cell-1>")
    )
    with _beating(channel):
        while True:
            message = channel.recv()
            if isinstance(message, p.Output) and "blocked" in message.text:
                return


def test_agent_exits_when_heartbeat_stops_while_cell_blocks(
    quick_agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    proc, channel = quick_agent
    _block_in_a_cell(channel)
    # No heartbeats are sent from here on, and the channel stays open.
    wait_for(lambda: proc.poll() is not None, 10, "the agent to exit after its heartbeat timeout")
    assert proc.returncode == 75


def test_agent_exits_when_channel_closes_while_cell_blocks(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    proc, channel = agent
    _block_in_a_cell(channel)
    assert proc.stdin is not None
    proc.stdin.close()
    wait_for(lambda: proc.poll() is not None, 5, "the agent to exit after its channel closed")
    assert proc.returncode == 0


def test_agent_answers_with_hello_and_runs_a_cell(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    _, channel = agent
    channel.send(p.RunCell(7, "x = 2\nx * 21", "<sky-cell-7>"))
    received = []
    with _beating(channel):
        while not isinstance(message := channel.recv(), p.CellDone):
            received.append(message)
    hellos = [m for m in received if isinstance(m, p.Hello)]
    assert len(hellos) == 1 and hellos[0].pid > 0 and hellos[0].torch
    assert message.cell_id == 7 and message.error is None
    assert message.value is not None and message.value.load() == 42


def _until_done(channel: SyncChannel, cell_id: int) -> p.CellDone:
    with _beating(channel):
        while True:
            message = channel.recv()
            if isinstance(message, p.CellDone) and message.cell_id == cell_id:
                return message


def test_an_interrupt_that_overtakes_its_cell_stops_it_as_it_starts(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    """The pool may interrupt a cell before a busy rank has started it: the interrupt must
    neither be lost (the rank would run the cell in full and wait in its collectives until it
    is killed) nor stop the cell still running before it.
    """
    _, channel = agent
    channel.send(p.RunCell(1, "import time\ntime.sleep(1.0)\n'first done'", "<sky-cell-1>"))
    channel.send(p.RunCell(2, "import time\ntime.sleep(60)", "<sky-cell-2>"))
    channel.send(p.Interrupt(2))
    first = _until_done(channel, 1)
    assert first.error is None and first.value_repr == "'first done'"
    second = _until_done(channel, 2)
    assert second.error is not None and second.error.type_name == "KeyboardInterrupt"
    assert second.error.after_interrupt and second.seconds < 5


def test_an_interrupt_sent_as_its_cell_starts_stops_it(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    """While the rank's main thread runs a cell, another thread must read the wire: an
    interrupt sent right behind the cell (before it printed anything) still stops it.
    """
    _, channel = agent
    channel.send(p.RunCell(1, "import time\ntime.sleep(600)", "<sky-cell-1>"))
    channel.send(p.Interrupt(1))
    done = _until_done(channel, 1)
    assert done.error is not None and done.error.type_name == "KeyboardInterrupt"


def test_a_cell_run_again_names_its_own_run_in_tracebacks(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    """The same source run as two cells is compiled once, yet each run's code, the functions
    it defines included, carries that run's name, and its traceback shows the cell's line.
    """
    _, channel = agent
    source = "def f():\n    return 1 / 0\n\nf.__code__.co_filename, f()"
    for cell_id in (1, 2):
        channel.send(p.RunCell(cell_id, source, f"<sky-cell-{cell_id}>"))
        done = _until_done(channel, cell_id)
        assert done.error is not None and done.error.type_name == "ZeroDivisionError"
        assert f'File "<sky-cell-{cell_id}>", line 2, in f\n    return 1 / 0' in (
            done.error.traceback
        )
        assert f"<sky-cell-{3 - cell_id}>" not in done.error.traceback
    channel.send(p.RunCell(3, "def g():\n    pass\n\ng.__code__.co_filename", "<sky-cell-3>"))
    channel.send(p.RunCell(4, "def g():\n    pass\n\ng.__code__.co_filename", "<sky-cell-4>"))
    assert _until_done(channel, 3).value_repr == "'<sky-cell-3>'"
    assert _until_done(channel, 4).value_repr == "'<sky-cell-4>'"


def test_a_future_import_holds_for_later_cells_as_in_ipython(
    agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    """Annotations are evaluated until a cell imports ``annotations`` from ``__future__``; from
    then on they are strings, in that cell and the cells after it, as IPython has it.
    """
    _, channel = agent
    check = "def f(x: int): ...\n\nf.__annotations__['x']"
    cells = [check, f"from __future__ import annotations\n{check}", check]
    for cell_id, source in enumerate(cells, 1):
        channel.send(p.RunCell(cell_id, source, f"<sky-cell-{cell_id}>"))
    assert [_until_done(channel, i).value_repr for i in (1, 2, 3)] == [
        "<class 'int'>",
        "'int'",
        "'int'",
    ]
    # A script (%sky run) has only its own: python would run it so.
    script = "def f(x: int): ...\n\nassert f.__annotations__['x'] is int, 'inherited'"
    path = os.path.join(os.getcwd(), "typed.py")
    channel.send(p.RunCell(4, script, path, script=p.Script(path)))
    assert _until_done(channel, 4).error is None


def test_beats_the_agent_has_not_read_yet_count_as_heard(
    quick_agent: tuple[subprocess.Popen[bytes], SyncChannel],
) -> None:
    """A rank whose main thread cannot read its wire for longer than the heartbeat timeout
    (importing torch on a loaded node; here, stopped as it starts) while the notebook beats
    must not take the notebook for gone: the beats wait on its wire, unread.
    """
    proc, channel = quick_agent
    # Its watchdog and reader run (five threads with the output pumps); its main thread is
    # importing torch, and nothing reads the wire until it is done.
    wait_for(lambda: len(os.listdir(f"/proc/{proc.pid}/task")) >= 5, 30, "the agent's threads")
    os.kill(proc.pid, signal.SIGSTOP)
    with _beating(channel):
        try:
            stopped = time.monotonic()
            wait_for(lambda: time.monotonic() - stopped > 3, 10, "3 s to pass")  # 2 x the timeout
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        channel.send(p.RunCell(1, "2", "<sky-cell-1>"))
        done = _until_done(channel, 1)
    assert proc.poll() is None
    assert done.error is None and done.value is not None and done.value.load() == 2


def test_a_cells_code_renamed_for_its_file_keeps_its_own_qualified_names() -> None:
    """Two cells run under one file name (one notebook cell calling ``%%sky`` twice) whose
    methods compare equal as code: each keeps its own class's qualified name, which code
    equality does not look at.
    """
    from skyward_jupyter.agent.cells import _cell_named, _compiled_once

    first, _ = _compiled_once("class A:\n    def f(self, x):\n        return x\n", 0)
    second, _ = _compiled_once("class B:\n    def f(self, x):\n        return x\n", 0)
    namespace: dict[str, object] = {}
    exec(_cell_named(first, "<In [3]>"), namespace)
    exec(_cell_named(second, "<In [3]>"), namespace)
    method = namespace["B"].f  # type: ignore[attr-defined]
    assert method.__qualname__ == "B.f" and method.__code__.co_filename == "<In [3]>"
    assert namespace["B"]().f(1) == 1  # type: ignore[operator]
