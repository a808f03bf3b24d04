"""The hang doctor with real ranks: stacks on demand, desyncs, silent ranks, and prompts.

A desync is the classic bug of a collective under ``if rank == 0``; without the doctor it waits
out gloo's timeout and breaks the next cell too. A silent rank is one that stopped (SIGSTOP, as a
frozen host looks); one whose native code holds its GIL while it runs is left to run. Prompts
(``input``, ``getpass``, ``breakpoint``) on the head rank are answered through a real kernel's
stdin requests.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import Pool
from skyward_jupyter import protocol as p
from skyward_jupyter.agent.descendants import parse_stat, read_stat
from skyward_jupyter.doctor import report
from skyward_jupyter.events import RankState, RankUsage
from skyward_jupyter.procs import COMPUTING, IN_IO, how_it_ran
from skyward_jupyter.providers.base import Node
from skyward_jupyter.ranks import Rank
from skyward_jupyter.results import RankEnded

from .conftest import hold_rank_ones_gil, outputs_of, reply_of, wait_for

DESYNC = (
    "import torch, torch.distributed as dist\n"
    "x = torch.ones(1)\n"
    "if dist.get_rank() == 0:\n"
    "    dist.all_reduce(x)\n"
    "x.item()"
)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    with Pool(nodes=1, procs_per_node=2, interrupt_grace=2.0) as made:
        yield made


def test_a_collective_only_some_ranks_call_fails_in_seconds_and_the_next_cell_works(
    pool: Pool,
) -> None:
    started = time.monotonic()
    result = pool.run(DESYNC)
    took = time.monotonic() - started
    assert took < 15, took  # not gloo's timeout (the collectives' is 30 minutes)
    (cause,) = [e for e in result.errors if not e.secondary]
    assert cause.rank == 0 and cause.type_name == "CollectiveDesync"
    assert "rank 0 in all_reduce at cell line 4" in cause.message
    assert "finished the cell (1)" in cause.message
    assert "line 4" in cause.traceback
    # The stuck rank was freed, not killed: its namespace is still there, and the next cell runs
    # a collective at once.
    assert not result.lost
    after = pool.run(
        "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n(t.item(), x.item())"
    )
    assert after.values == [(3.0, 1.0), (3.0, 1.0)], after.errors


def test_ddp_backward_on_one_rank_only_is_a_desync(pool: Pool) -> None:
    result = pool.run(
        "import torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(nn.Linear(4, 1))\n"
        "if dist.get_rank() == 1:\n"
        "    model(torch.randn(8, 4)).sum().backward()\n"
    )
    (cause,) = [e for e in result.errors if not e.secondary]
    assert cause.rank == 1 and "backward at cell line 5" in cause.message, cause.message
    assert pool.run("dist.barrier()\n'ok'").values == ["ok", "ok"]


def test_a_slow_peer_is_not_a_desync(pool: Pool) -> None:
    """Every rank is still in the cell: rank 0 waits in the collective while rank 1 loads."""
    result = pool.run(
        "import time\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(5)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "t.item()"
    )
    assert result.values == [2.0, 2.0], result.errors


def test_stacks_show_where_each_rank_is_while_one_waits_in_a_collective(pool: Pool) -> None:
    stacks: list[str] = []

    def ask_when_waiting() -> None:
        wait_for(lambda: "in barrier" in (s := pool.stacks()) and stacks.append(s) is None, 20,
                 "rank 0 to wait in the barrier")  # fmt: skip

    asker = threading.Thread(target=ask_when_waiting)
    asker.start()
    result = pool.run(
        "import time\nif dist.get_rank() == 1:\n    time.sleep(4)\ndist.barrier()\n'done'"
    )
    asker.join()
    assert result.values == ["done", "done"]
    text = stacks[-1]
    rank0, rank1 = text.split("\nrank 1 (")
    assert "rank 0 (" in rank0 and "in barrier at cell line 4" in rank0
    assert 'File "<sky-cell-' in rank0 and "dist.barrier()" in rank0
    assert "time.sleep(4)" in rank1 and "in barrier" not in rank1
    assert "skyward_jupyter/agent" not in text  # the agent's own frames are not the user's


def test_a_stopped_rank_is_declared_lost_within_seconds() -> None:
    with Pool(nodes=1, procs_per_node=2, interrupt_grace=2.0) as pool:
        pid = pool.ranks[1].hello.pid  # type: ignore[union-attr]
        stopper = threading.Timer(1.0, lambda: os.kill(pid, signal.SIGSTOP))
        stopper.start()
        started = time.monotonic()
        result = pool.run("import time, torch.distributed as dist\ntime.sleep(1.5)\ndist.barrier()")
        stopper.join()
        assert time.monotonic() - started < 15  # found by its silence, not by a timeout
        lost = {e.rank: e for e in result.errors}[1]
        assert lost.type_name == "RankLost" and "stopped answering" in lost.message
        assert 1 in result.lost
        again = pool.run("import torch.distributed as dist\ndist.get_world_size()")
        assert again.values == [2, 2], again.errors


def test_a_lost_rank_whose_machine_does_not_answer_the_kill_fails_its_cell_at_once() -> None:
    """Rank 1 stops, and its kill hangs (as an SSH kill to an unreachable host waits for its
    timeout): the cell fails with the loss while that kill still waits, not after it.
    """
    with Pool(nodes=1, procs_per_node=2, interrupt_grace=2.0) as pool:
        rank = pool._ranks.all[1]
        process, pid = rank.process, rank.hello.pid  # type: ignore[union-attr]
        assert process is not None
        killed = threading.Event()
        kill = process.kill

        async def slow_kill() -> None:
            await asyncio.sleep(8)  # the machine answers late
            await kill()
            killed.set()

        process.kill = slow_kill  # type: ignore[method-assign]
        stopper = threading.Timer(1.0, lambda: os.kill(pid, signal.SIGSTOP))
        stopper.start()
        try:
            result = pool.run(
                "import time, torch.distributed as dist\ntime.sleep(1.5)\ndist.barrier()"
            )
            assert not killed.is_set(), "the cell waited for the kill"
        finally:
            stopper.join()
        lost = {e.rank: e for e in result.errors}[1]
        assert lost.type_name == "RankLost" and "stopped answering" in lost.message
        assert f"pid {pid}" in lost.where, lost.where  # named as it was, though ended here
        assert pool.run("1").values == [1, 1]
        wait_for(killed.is_set, 30, "the late kill to end the stopped process")


def test_a_rank_holding_its_gil_in_native_code_runs_on_while_a_stopped_one_is_lost() -> None:
    """Rank 1 computes in C without letting its GIL go (a builtin's loop; as a long import or
    a C extension's call does) for twice the heartbeat timeout: its threads cannot answer, yet
    its process runs, so it is left to finish, and the user is told why it is silent.
    """
    with Pool(nodes=1, procs_per_node=2, heartbeat_timeout=3.0) as pool:
        result, busy = hold_rank_ones_gil(pool)
    assert result.values == ["done", "done"], result.errors
    assert not result.lost
    assert len(busy) == 1 and "yet its process runs" in busy[0], busy


def test_a_stat_line_is_read_after_the_last_parenthesis_and_a_foreign_line_is_refused() -> None:
    """A process may name itself anything, parentheses and state letters too: the fields are
    read after the last ``)``. What is not a stat line (a host's shell said something else) is
    refused, and a process seen once, or another with the pid, did not run.
    """
    real = Path("/proc/self/stat").read_bytes()
    fields = real.rpartition(b")")[2]
    named = b"%d (x) R 1 (evil) T 1 2)%s" % (os.getpid(), fields)
    seen = parse_stat(named)
    now = read_stat(os.getpid())
    assert seen is not None and now is not None  # the CPU time may have moved in between
    assert seen._replace(cpu_ticks=0) == now._replace(cpu_ticks=0)
    assert seen.state == "R" and seen.parent == os.getppid() and not seen.ended
    assert parse_stat(fields) is None  # no parenthesis
    assert parse_stat(b"sh: cat: not found") is None
    assert parse_stat(b"1 (x) S 1 2 3") is None  # too short
    later = seen._replace(cpu_ticks=seen.cpu_ticks + 50, state="S")
    asleep = seen._replace(state="S")
    assert how_it_ran(asleep, later, 2.0) == COMPUTING  # half a core over 2 s
    assert how_it_ran(asleep, asleep._replace(state="D"), 2.0) == IN_IO  # no CPU, in the kernel
    assert how_it_ran(asleep, asleep, 2.0) is None
    assert how_it_ran(asleep._replace(state="T"), asleep._replace(state="T"), 2.0) is None
    assert how_it_ran(seen, later._replace(start=seen.start + 1), 2.0) is None  # the pid's next
    assert how_it_ran(seen, None, 2.0) is None


def test_a_look_at_a_machine_tells_each_silent_rank_apart_whatever_the_others_did() -> None:
    """One look asks about a machine's silent ranks together: a busy one runs even when another
    listed after it has gone (the look still succeeds, as a command whose status is checked, a
    Slurm step's); a look that fails in an unexpected way answers no for all, never hangs.
    """
    from skyward_jupyter.providers.base import Looks, ProviderError

    async def checked(argv: list[str], timeout: float) -> bytes:
        made = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(made.communicate(), timeout)
        if made.returncode:
            raise ProviderError(f"the look exited with status {made.returncode}")
        return out

    async def broken(argv: list[str], timeout: float) -> bytes:
        raise RuntimeError("a connection in a state nobody expected")

    async def ask(looks: Looks, pids: list[int]) -> list[str | None]:
        return await asyncio.wait_for(
            asyncio.gather(*(looks.running(pid, 0.5) for pid in pids)), 10
        )

    gone = subprocess.Popen(["true"])
    gone.wait()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert asyncio.run(ask(Looks(checked, ()), [busy.pid, gone.pid])) == [COMPUTING, None]
        assert asyncio.run(ask(Looks(broken, ()), [busy.pid, gone.pid])) == [None, None]
    finally:
        busy.kill()
        busy.wait()


def test_usage_comes_once_a_node_and_a_stopped_first_rank_is_found_alone() -> None:
    """The notebook reads usage from each node's first rank only, for all its ranks; when that
    rank stops, it is found by its silence as any rank is, and the others of its node are heard
    on their own channels meanwhile (none is taken for silent); its replacement gathers again.
    """
    with Pool(nodes=2, procs_per_node=3, interrupt_grace=2.0) as pool:
        ranks = pool._ranks
        dispatch = ranks._dispatch
        channels: collections.Counter[int] = collections.Counter()
        heard: dict[int, float] = {}

        def counting(rank: Any, message: object) -> None:
            if isinstance(message, p.Usage | p.NodeUsage):
                channels[rank.index] += 1
            dispatch(rank, message)

        def note(event: object) -> None:
            if isinstance(event, RankUsage):
                heard[event.rank] = event.at

        def heard_since(since: float) -> bool:
            return len(heard) == 6 and min(heard.values()) > since

        def streams() -> set[int]:
            """The channels that carried usage in the second of two rounds in which every rank
            was heard (in the first, a rank may still find its way).
            """
            for _ in range(2):
                since = time.time()
                channels.clear()
                wait_for(functools.partial(heard_since, since), 15, "every rank's usage")
            return set(channels)

        unsubscribe = pool.subscribe(note)
        ranks._dispatch = counting  # type: ignore[method-assign]  # counts, then dispatches
        try:
            assert streams() == {0, 3}  # the nodes' first ranks
            first = pool.ranks[3].hello.pid  # type: ignore[union-attr]
            os.kill(first, signal.SIGSTOP)
            wait_for(lambda: {4, 5} <= set(channels), 10, "node 1's others on their own")
            wait_for(lambda: (h := pool.ranks[3].hello) is not None and h.pid != first, 20,
                     "the stopped first rank found and replaced")  # fmt: skip
            assert streams() == {0, 3}  # the new first rank gathers again
        finally:
            ranks._dispatch = dispatch  # type: ignore[method-assign]
            unsubscribe()
        result = pool.run("import os\nos.getpid()")
        assert result.lost == (3,), result.notes  # alone: its node's others kept their namespaces
        assert len(set(result.values)) == 6 and first not in result.values


# ---------------------------------------------------------------- prompts, through a kernel


def _answering(kernel: Any, code: str, answers: list[str], timeout: float = 90) -> tuple[Any, list]:
    """Run ``code`` in the kernel with stdin allowed, answering its prompts from ``answers``."""
    from .test_magics import Cell

    prompts: list[tuple[str, bool]] = []
    msg_id = kernel.kc.execute(code, allow_stdin=True)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                msg = kernel.kc.get_stdin_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "input_request":
                prompts.append((msg["content"]["prompt"], msg["content"]["password"]))
                kernel.kc.input(answers.pop(0) if answers else "")

    answerer = threading.Thread(target=answer)
    answerer.start()
    deadline = time.monotonic() + timeout
    try:
        mine = list(outputs_of(kernel.kc, msg_id, deadline, code))
        reply = reply_of(kernel.kc, msg_id, deadline, code)
    finally:
        stop.set()
        answerer.join()
    return Cell(code, msg_id, reply, mine), prompts


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    from .test_magics import Kernel

    made = Kernel()
    try:
        made.ok("%load_ext skyward_jupyter")
        made.ok("%%sky --nodes 1 --procs-per-node 2\nimport torch.distributed as dist")
        yield made
        made.ok("%sky down")
    finally:
        made.km.shutdown_kernel(now=True)
        made.kc.stop_channels()


def test_input_and_getpass_on_the_head_are_asked_in_the_notebook(kernel: Any) -> None:
    cell, prompts = _answering(
        kernel,
        "%%sky --all\n"
        "import getpass\n"
        "box = [None, None]\n"
        "if dist.get_rank() == 0:\n"
        "    box = [input('your name? '), getpass.getpass('token: ')]\n"
        "dist.broadcast_object_list(box)\n"
        "box",
        ["ada", "s3cret"],
    )
    assert cell.status == "ok", cell
    assert prompts == [("your name? ", False), ("token: ", True)]
    assert " ".join(cell.shown).count("['ada', 's3cret']") == 2, cell


def test_breakpoint_on_the_head_is_a_debugger_in_the_notebook(kernel: Any) -> None:
    cell, prompts = _answering(
        kernel,
        "%%sky --all\n"
        "x = 41\n"
        "if dist.get_rank() == 0:\n"
        "    breakpoint()\n"
        "    x += 1\n"
        "dist.barrier()\n"
        "x",
        ["p x * 100", "c"],
    )
    assert cell.status == "ok", cell
    assert [p for p, _ in prompts] == ["(Pdb) ", "(Pdb) "]
    assert "4100" in cell.stdout  # pdb's output streams with the head's stdout
    assert "[rank 0] 42" in " ".join(cell.shown) and "[rank 1] 41" in " ".join(cell.shown)
    quit_cell, _ = _answering(
        kernel, "%%sky\nif dist.get_rank() == 0:\n    breakpoint()\ndist.barrier()", ["q"]
    )
    assert quit_cell.status == "error" and "BdbQuit" in str(quit_cell)
    assert kernel.ok("%%sky --all\ndist.get_world_size()").status == "ok"


def test_input_on_another_rank_says_what_to_do(kernel: Any) -> None:
    cell, prompts = _answering(kernel, "%%sky\nif dist.get_rank() == 1:\n    input('x? ')", [])
    assert prompts == []
    assert cell.status == "error" and "only the cell's head rank (rank 0)" in str(cell), cell


def test_input_in_a_ranks_cell_is_asked_by_its_head(kernel: Any) -> None:
    """``--ranks 1``: rank 1 is the cell's head, so its ``input()`` is the notebook's prompt."""
    cell, prompts = _answering(kernel, "%%sky --ranks 1 --out got\ninput('x? ')", ["typed"])
    assert cell.status == "ok", cell
    assert prompts == [("x? ", False)], prompts
    assert kernel.eval("got.values") == ["typed"]


def test_nccl_pending_collectives_are_read_from_the_flight_recorder() -> None:
    """No GPU here: the flight recorder's entries (as torch's ``_dump_fr_trace`` gives them) are
    read by the same function the ranks use under NCCL.
    """
    from skyward_jupyter.agent.stacks import pending_from

    now = 10_000_000_000
    entries = [
        {"profiling_name": "nccl:all_reduce", "state": "completed", "time_created_ns": 1},
        {
            "profiling_name": "nccl:all_gather",
            "state": "started",
            "time_created_ns": now - 4_000_000_000,
            "frames": [
                {"filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 9},
                {"filename": "<sky-cell-7>", "line": 3},
            ],
        },
    ]
    ((waiting, age),) = pending_from(entries, now)
    assert (waiting.collective, waiting.where, age) == ("all_gather", "cell line 3", 4.0)
    entries[1]["frames"][1]["filename"] = "<In [7]>"  # a notebook's cell, as it numbers it
    ((waiting, _),) = pending_from(entries, now)
    assert waiting.where == "In [7] line 3"


def test_sky_stacks_lists_every_rank(kernel: Any) -> None:
    text = kernel.ok("%sky stacks").stdout
    assert "rank 0 (node 0, local pid" in text and "rank 1 (node 0, local pid" in text, text
    assert text.count("(between cells)") == 2, text


def test_a_rank_heard_while_its_stacks_probe_waited_is_not_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank silent past the suspicion mark whose heartbeat comes while the doctor waits for
    its stacks (a slow start's first beat) is not silent any more: it lives. One that stays
    silent through the probe is killed.
    """
    import asyncio
    import types

    from skyward_jupyter import doctor

    class FakeRank:
        """What the doctor reads of a rank; hashed by identity, as a rank is."""

        def __init__(self, index: int) -> None:
            self.index, self.local_rank, self.alive = index, 0, True
            self.hello, self.process, self.silenced = object(), object(), None
            self.last_heard = time.monotonic() - 60  # long silent
            self.killed = False

        async def kill(self) -> None:
            self.killed = True

    def rank(index: int) -> FakeRank:
        return FakeRank(index)

    heard, silent = rank(0), rank(1)
    ranks: Any = types.SimpleNamespace(
        all=[heard, silent],
        settings=types.SimpleNamespace(heartbeat_interval=0.05, heartbeat_timeout=2.0),
        provider=types.SimpleNamespace(notebook_silence=30.0),
        beat=b"",
        send=lambda r, frame: None,
        set_state=lambda r, state, detail: None,
        abandon=lambda r: r.kill(),
    )
    probed = asyncio.Event()

    async def stacks(ranks: Any, suspects: list[Any]) -> dict[Any, None]:
        heard.last_heard = time.monotonic()  # its beat arrives while the probe waits
        probed.set()
        return dict.fromkeys(suspects)  # neither answered the probe

    monkeypatch.setattr(doctor, "stacks", stacks)

    async def run() -> None:
        task = asyncio.create_task(doctor.heartbeats(ranks))
        await asyncio.wait_for(probed.wait(), 10)
        while not silent.killed:  # the verdict follows the probe in the same tick
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 20))
    assert silent.killed and not heard.killed


def test_stacks_say_why_a_rank_without_an_answer_has_none() -> None:
    """A rank with no process (lost, and how), one started again that does not serve yet, and
    one that did not answer in time are each told as what they are.
    """
    lost, booting, silent = (Rank(i, Node(i, "127.0.0.1"), 0, 1) for i in range(3))
    lost.state, lost.ended = RankState.LOST, RankEnded("killed by SIGKILL", "")
    booting.state, booting.alive = RankState.BOOTING, True
    silent.state, silent.alive = RankState.RUNNING, True
    silent.hello = p.Hello(1, "host", "3.11", "3", None, 0)
    lines = report({lost: None, booting: None, silent: None}).splitlines()
    assert [line for line in lines if line] == [
        "rank 0 (node 0, not started): lost (killed by SIGKILL), no process to ask",
        "rank 1 (node 1, not started): booting, not serving yet: no stacks to show",
        "rank 2 (node 2, not started): no answer within 1 s (native code holding the GIL, a "
        "stopped process or an unreachable host)",
    ]
