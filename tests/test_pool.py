"""The pool with real spawned ranks and real gloo process groups."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skyward_jupyter import CellError, Pool, PoolError, RunResult
from skyward_jupyter import pool as pool_module
from skyward_jupyter import protocol as p
from skyward_jupyter.events import (
    CellFinished,
    CellStarted,
    OutputReceived,
    PoolEvent,
    PoolMessage,
    RankState,
    RankStateChanged,
)
from skyward_jupyter.frameworks import Frameworks
from skyward_jupyter.providers.base import Node, ProviderError
from skyward_jupyter.providers.local import LocalProvider
from skyward_jupyter.ranks import Rank, Ranks
from skyward_jupyter.results import WaitInterrupted
from skyward_jupyter.transfer import RELAY_MIN_BYTES, Transfer

from .conftest import (
    TEMPLATE,
    agent_pids,
    ctrl_c,
    kill_and_await_replacement,
    skip_where_nccl_runs,
    wait_for,
)


def src(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


ALL_REDUCE = src(
    """
    import torch, torch.distributed as dist
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    t.item()
    """
)


def test_all_reduce_two_ranks(pool2: Pool) -> None:
    result = pool2.run(ALL_REDUCE)
    assert result.ok, result.errors
    assert result.values == [3.0, 3.0]


def test_all_reduce_four_ranks_on_two_nodes() -> None:
    with Pool(nodes=2, procs_per_node=2) as pool:
        result = pool.run(
            ALL_REDUCE + "(t.item(), dist.get_world_size(), __import__('os').environ['NODE_RANK'],"
            " (rank, local_rank, world_size))"
        )
        assert result.ok, result.errors
        assert [v[0] for v in result.values] == [10.0] * 4
        assert [v[1] for v in result.values] == [4] * 4
        assert [v[2] for v in result.values] == ["0", "0", "1", "1"]
        assert [v[3] for v in result.values] == [(0, 0, 4), (1, 1, 4), (2, 0, 4), (3, 1, 4)]


def test_world_of_one_still_has_a_process_group() -> None:
    with Pool(nodes=1) as pool:
        result = pool.run(
            "import torch.distributed as dist\n(dist.is_initialized(), dist.get_world_size())"
        )
        assert result.values == [(True, 1)]


def test_nccl_on_ranks_without_nccl_or_gpus_fails_the_start_naming_the_rank_and_why() -> None:
    """What each rank says when it starts is checked before the group forms: the cause, for
    ranks whose torch the notebook cannot see (a remote host's), never advice about
    interfaces.
    """
    skip_where_nccl_runs()
    before = agent_pids()
    pool = Pool(nodes=2, backend="nccl")
    with pytest.raises(PoolError) as failed:
        pool.start()
    message = str(failed.value)
    assert re.fullmatch(
        r"--backend nccl: rank 0 \(.*\) has (torch \S+, which is built without NCCL|no GPU "
        r"that torch can use.*); use --backend gloo.*",
        message,
    ), message
    assert "SOCKET_IFNAME" not in message
    assert not pool.running
    wait_for(lambda: agent_pids() <= before, 20, "the refused pool's ranks to end")


def test_the_agents_settings_and_secrets_are_not_in_the_ranks_environment(pool2: Pool) -> None:
    """The relay's token (and, on the head, its key) come in the agent's settings: neither a
    cell nor a process it starts finds them in its environment.
    """
    result = pool2.run(
        "import os, subprocess, sys\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.environ))'],"
        " capture_output=True, text=True, check=True).stdout\n"
        "('SKYWARD_AGENT' in os.environ, 'SKYWARD_AGENT' in child)"
    )
    assert result.ok, result.errors
    assert result.values == [(False, False), (False, False)]


def test_torch_environment_before_first_cell(pool2: Pool) -> None:
    result = pool2.run(
        src(
            """
            import os, torch.distributed as dist
            from skyward_jupyter import instance_info
            keys = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE", "NODE_RANK"]
            info = instance_info()
            ({k: os.environ[k] for k in keys}, dist.get_backend(), info.is_head, info.total_nodes,
             [p.ranks for p in info.peers])
            """
        )
    )
    assert result.ok, result.errors
    for rank, (env, backend, is_head, nodes, peers) in enumerate(result.values):
        assert env["RANK"] == env["NODE_RANK"] == str(rank)
        assert (
            env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
        )
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert int(env["MASTER_PORT"]) == pool2.master_port
        assert backend == "gloo"
        assert is_head == (rank == 0)
        assert nodes == 2 and peers == [(0,), (1,)]


def test_namespace_persists_across_cells(pool2: Pool) -> None:
    pool2.run(
        "import torch.distributed as dist\n"
        "my_value = dist.get_rank() * 10\n"
        "def bump(x): return x + my_value"
    )
    result = pool2.run("bump(1)")
    assert result.values == [1, 11]


READY_NAMES = src(
    """
    import torch
    mine = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu")
    )
    (rank, local_rank, world_size, device == mine, type(device).__name__)
    """
)


def test_each_rank_starts_with_its_ready_names_bound_again_as_the_group_forms_again(
    pool2: Pool,
) -> None:
    result = pool2.run(READY_NAMES)
    assert result.ok, result.errors
    assert result.values == [(0, 0, 2, True, "device"), (1, 0, 2, True, "device")]
    formed_again = pool2.run(
        "import torch.distributed as dist\nfirst = device\ndist.destroy_process_group()"
    )
    assert formed_again.ok, formed_again.errors
    assert pool2.run("(device is first, device == first)").values == [(False, True)] * 2
    assert pool2.run("del first").ok


def test_the_users_names_win_over_the_ready_ones() -> None:
    """A notebook global ``rank``, and a cell's ``world_size`` and ``device`` (bound to the value
    that was ours), stay the user's through formations of the group again; a name the cell
    deleted stays deleted; a rank restarted after its loss starts with all of them.
    """
    with Pool(nodes=2) as pool:
        shipped = pool.run("rank", {"rank": "the notebook's"})
        assert shipped.values == ["the notebook's"] * 2, shipped.errors
        rebound = pool.run(
            src(
                """
                import torch.distributed as dist
                world_size = "the cell's"
                device = device  # the cell's now, though the same value
                first = device
                del local_rank
                dist.destroy_process_group()  # the pool forms the group again
                """
            )
        )
        assert rebound.ok, rebound.errors
        after = pool.run("(rank, world_size, device is first, 'local_rank' in globals())")
        assert after.values == [("the notebook's", "the cell's", True, False)] * 2, after.errors
        kill_and_await_replacement(pool, 1)
        restarted = pool.run("(rank, world_size, 'local_rank' in globals(), type(device).__name__)")
        assert restarted.values == [
            ("the notebook's", "the cell's", False, "device"),
            (1, 2, True, "device"),
        ], restarted.errors


def test_a_cell_on_some_ranks_runs_there_only_and_the_others_keep_their_state_unblocked(
    pool2: Pool, tmp_path: Path
) -> None:
    assert pool2.run("kept = rank * 10").ok
    only = pool2.run("kept += 1\nkept", ranks=[1])
    assert [(r.rank, r.value) for r in only] == [(1, 11)], only.errors
    # Its globals reach every rank (the notebook's record of what the ranks hold stays true).
    shipped = pool2.run("'shipped' in globals()", {"shipped": 5}, ranks=[0])
    assert shipped.values == [True]
    assert pool2.run("(kept, shipped)").values == [(0, 5), (11, 5)]
    # While rank 1 runs, rank 0 is idle, in no cell.
    go = tmp_path / "go"
    waits = src(
        f"""
        import os, time
        deadline = time.monotonic() + 30
        while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.path.exists({str(go)!r})
        """
    )
    seen: list[RunResult] = []
    running = threading.Thread(target=lambda: seen.append(pool2.run(waits, ranks=[1])))
    running.start()
    try:
        wait_for(
            lambda: [r.state.value for r in pool2.ranks] == ["idle", "running"],
            10,
            "rank 1 to run the cell while rank 0 stays idle",
        )
    finally:
        go.touch()
        running.join(30)
    assert [r.values for r in seen] == [[True]]
    failed = pool2.run("1 / 0", ranks=[1])
    assert [(e.rank, e.type_name) for e in failed.errors] == [(1, "ZeroDivisionError")]
    assert pool2.run("del kept, shipped").ok


def test_a_collective_on_some_ranks_fails_in_seconds_saying_only_they_run_the_cell(
    pool2: Pool,
) -> None:
    assert pool2.run("kept = rank").ok
    started = time.monotonic()
    result = pool2.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)",
        ranks=[0],
    )
    assert time.monotonic() - started < 15
    assert [(e.rank, e.type_name) for e in result.errors] == [(0, "CollectiveDesync")], result
    message = result.errors[0].message
    assert message.startswith(
        "rank 0 in all_reduce at cell line 3: only rank 0 runs this cell (--ranks 0)"
    ), message
    assert "\n" not in message
    # Where it waited, down to the cell's line: not the error that freeing it caused in torch
    # (gloo's "Connection closed by peer", the KeyboardInterrupt), which blames a crash.
    shown = result.errors[0].traceback.splitlines()
    assert shown[0] == "Traceback (most recent call last):" and len(shown) == 4, shown
    assert shown[1].startswith('  File "<sky-cell-') and shown[2] == "    dist.all_reduce(t)"
    assert shown[3] == f"CollectiveDesync: {message}", shown
    # The group works again for every rank, and rank 1 kept its namespace.
    after = pool2.run(ALL_REDUCE + "(t.item(), kept)")
    assert after.values == [(3.0, 0), (3.0, 1)], after.errors
    assert pool2.run("del kept").ok


def test_a_collective_left_pending_on_some_ranks_fails_the_cell_and_not_the_next(
    pool2: Pool,
) -> None:
    """An ``async_op`` collective (or NCCL's, which returns at once) on some ranks does not
    block: it would pair with the next cell's collective on the others.
    """
    result = pool2.run(
        "import torch, torch.distributed as dist\n"
        "work = dist.all_reduce(torch.ones(1), async_op=True)\n"
        "'returned'",
        ranks=[0],
    )
    assert [(e.rank, e.type_name, e.message) for e in result.errors] == [
        (
            0,
            "CollectiveDesync",
            "rank 0 called 1 collective the other ranks never join: only rank 0 runs this cell "
            "(--ranks 0); the pool formed its group again without them",
        )
    ], result
    after = pool2.run(ALL_REDUCE, timeout=30)
    assert after.values == [3.0, 3.0], after.errors
    assert pool2.run("del work", ranks=[0]).ok


def test_an_interrupt_stops_a_cell_on_some_ranks(pool2: Pool) -> None:
    seen: list[RunResult] = []
    running = threading.Thread(
        target=lambda: seen.append(pool2.run("import time\ntime.sleep(60)", ranks=[1]))
    )
    running.start()
    try:
        wait_for(lambda: pool2.ranks[1].state.value == "running", 10, "rank 1 to run the cell")
        pool2.interrupt()
    finally:
        running.join(30)
    (result,) = seen
    assert result.interrupted and [(e.rank, e.type_name) for e in result.errors] == [
        (1, "KeyboardInterrupt")
    ], result
    assert pool2.run(ALL_REDUCE).values == [3.0, 3.0]


def test_ranks_a_pool_lacks_are_refused_in_one_line_naming_them(pool2: Pool) -> None:
    refused_as = (([2], "--ranks 2: "), ([0, 3, 4], "--ranks 3-4: "), ([], "--ranks (none): "))
    for ranks, said in refused_as:
        with pytest.raises(PoolError) as refused:
            pool2.run("print('THE CELL RAN')", ranks=ranks)
        assert str(refused.value).startswith(said), refused.value
        assert str(refused.value).endswith(f"pool {pool2.name!r} has ranks 0-1")


def test_globals_travel_and_large_arrays_arrive_intact(pool2: Pool) -> None:
    data = np.arange(2_000_000, dtype=np.float64)

    def scale(x: np.ndarray) -> float:
        return float(x.sum()) * 2

    result = pool2.run("scale(data)", {"data": data, "scale": scale})
    assert result.values == [float(data.sum()) * 2] * 2
    assert result.shipped_bytes >= data.nbytes


def test_a_large_global_goes_to_local_ranks_over_their_own_pipes(
    pool2: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relaying it through the head (for remote nodes: it leaves the notebook once) would only
    add a hop, a copy and two digests on the notebook's own machine.
    """
    stashed: list[int] = []
    stash = Transfer.stash

    async def spy(self: Transfer, blob: bytes, readers: list[object]) -> object:
        stashed.append(len(blob))
        return await stash(self, blob, readers)  # type: ignore[arg-type]

    monkeypatch.setattr(Transfer, "stash", spy)
    data = np.arange(4 * RELAY_MIN_BYTES // 8, dtype=np.float64)
    result = pool2.run("float(data.sum())", {"data": data}).raise_for_errors()
    assert result.values == [float(data.sum())] * 2
    assert stashed == []


def test_an_answer_resolves_only_the_request_it_answers() -> None:
    """A rank's answers are matched by type and request: a late CellDone of an earlier cell, or
    a GroupState of an earlier formation, leaves the wait for the current one pending.
    """

    async def answers() -> None:
        rank = Rank(0, Node(index=0, address="127.0.0.1"), 0, 1)
        cell, group = rank.expect(p.CellDone, 2), rank.expect(p.GroupState, 5)
        rank.resolve(p.CellDone(1, None, None, None, 0.0))
        rank.resolve(p.GroupState(4, True, "gloo", ""))
        rank.resolve(p.Stacks("", request=2))
        assert not cell.done() and not group.done()
        rank.resolve(p.CellDone(2, None, "2", None, 0.0))
        rank.resolve(p.GroupState(5, True, "gloo", ""))
        assert cell.result().value_repr == "2" and group.result().generation == 5

    asyncio.run(answers())


def test_unpicklable_global_fails_before_anything_runs(pool2: Pool) -> None:
    seen: list[PoolEvent] = []
    unsubscribe = pool2.subscribe(seen.append)
    try:
        with pytest.raises(PoolError, match="'lock'"):
            pool2.run("lock", {"lock": threading.Lock()})
        with pytest.raises(SyntaxError):
            pool2.run("def broken(:\n")
    finally:
        unsubscribe()
    assert not [e for e in seen if isinstance(e, CellStarted)]


def test_a_cells_unfinished_last_line_arrives_before_its_result(pool2: Pool) -> None:
    """The end-of-cell sync skips its round trip only when nothing is pending: a last line
    without its newline (held by the capture briefly) must still come before the result.
    """
    seen: list[str] = []
    unsubscribe = pool2.subscribe(
        lambda e: (
            seen.append(e.text)
            if isinstance(e, OutputReceived) and e.rank == 0
            else seen.append("FINISHED")
            if isinstance(e, CellFinished)
            else None
        )
    )
    try:
        for i in range(5):
            assert pool2.run(f"print('tail {i}', end='')").ok
    finally:
        unsubscribe()
    text = "".join(seen)
    assert text == "".join(f"tail {i}FINISHED" for i in range(5)), seen


def test_output_is_captured_at_the_descriptor_level(pool2: Pool) -> None:
    events: list[OutputReceived] = []
    unsubscribe = pool2.subscribe(
        lambda e: events.append(e) if isinstance(e, OutputReceived) else None
    )
    try:
        result = pool2.run(
            src(
                """
                import ctypes, os, sys
                print("from python")
                os.write(1, b"from the descriptor\\n")
                ctypes.CDLL(None).printf(b"from C printf\\n")
                print("progress 50%\\r", end="")
                print("progress 100%")
                print("to stderr", file=sys.stderr)
                """
            )
        )
    finally:
        unsubscribe()
    assert result.ok, result.errors
    for rank in (0, 1):
        out = "".join(e.text for e in events if e.rank == rank and e.stream == "stdout")
        err = "".join(e.text for e in events if e.rank == rank and e.stream == "stderr")
        assert (
            out == "from python\nfrom the descriptor\nfrom C printf\nprogress 50%\rprogress 100%\n"
        )
        assert err == "to stderr\n"
    assert {e.cell_id for e in events} == {result.cell_id}


def test_remote_traceback_shows_the_cells_lines(pool2: Pool) -> None:
    result = pool2.run(src("def inner():\n    return {}['missing']\n\ninner()"))
    assert not result.ok
    error = result.errors[0]
    assert error.type_name == "KeyError"
    assert "return {}['missing']" in error.traceback
    assert "inner()" in error.traceback
    assert "skyward_jupyter/agent" not in error.traceback
    assert isinstance(error.exception, KeyError)
    with pytest.raises(CellError, match="rank 0"):
        result.raise_for_errors()


def test_ddp_mlp_learns_and_stays_in_sync(pool2: Pool) -> None:
    result = pool2.run(
        src(
            """
            import torch, torch.nn as nn, torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
            torch.manual_seed(0)
            x = torch.randn(512, 10)
            y = (x.sum(dim=1, keepdim=True) > 0).float()
            dataset = TensorDataset(x, y)
            sampler = DistributedSampler(dataset, shuffle=True, seed=1)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loss_fn = nn.BCEWithLogitsLoss()
            losses = []
            for epoch in range(8):
                sampler.set_epoch(epoch)
                total = torch.zeros(2)
                for bx, by in loader:
                    opt.zero_grad()
                    loss = loss_fn(model(bx), by)
                    loss.backward()
                    opt.step()
                    total += torch.tensor([loss.item(), 1.0])
                dist.all_reduce(total)
                losses.append((total[0] / total[1]).item())
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            (losses, flat.tolist(), len(list(iter(sampler))))
            """
        )
    )
    assert result.ok, result.errors
    (losses0, params0, n0), (losses1, params1, n1) = result.values
    assert losses0 == losses1
    assert losses0[-1] < losses0[0] * 0.6
    assert params0 == params1
    assert n0 == n1 == 256


def test_rank_raising_while_peer_waits_in_collective_ends_fast(pool2: Pool) -> None:
    pool2.run("import torch, torch.distributed as dist\nkeep = 'rank %d' % dist.get_rank()")
    started = time.monotonic()
    result = pool2.run(
        src(
            """
            if dist.get_rank() == 1:
                raise ValueError("bad batch on rank 1")
            dist.all_reduce(torch.ones(1))
            """
        )
    )
    assert time.monotonic() - started < 10
    error = CellError(result.errors)
    assert error.primary.rank == 1 and error.primary.type_name == "ValueError"
    assert "bad batch on rank 1" in error.primary.traceback
    assert [e.rank for e in result.errors if e.secondary] == [0]  # stopped, not at fault
    assert result.lost == (), (result.notes, [e.traceback for e in result.errors])
    again = pool2.run(ALL_REDUCE + "(t.item(), keep)")
    assert again.values == [(3.0, "rank 0"), (3.0, "rank 1")]


def test_a_rank_failing_while_it_is_stopped_is_not_blamed(pool2: Pool) -> None:
    """Whatever a stopped rank raises on its way out (here its own cleanup error) is secondary."""
    result = pool2.run(
        src(
            """
            import time
            import torch.distributed as dist
            try:
                dist.barrier()  # both ranks are inside the try before rank 1 fails
                if dist.get_rank() == 1:
                    raise ValueError("bad batch on rank 1")
                time.sleep(60)
            except KeyboardInterrupt:
                raise RuntimeError("cleanup failed while stopping") from None
            """
        )
    )
    by_rank = {e.rank: e for e in result.errors}
    assert by_rank[1].type_name == "ValueError" and not by_rank[1].secondary
    assert by_rank[0].type_name == "RuntimeError" and by_rank[0].secondary
    assert CellError(result.errors).primary.rank == 1


def test_rank_killed_mid_cell_is_reported_restarted_and_named() -> None:
    with Pool(nodes=2, interrupt_grace=2.0) as pool:
        pool.run("import torch, torch.distributed as dist\nkeep = dist.get_rank()")
        victim = pool.ranks[1].hello
        assert victim is not None
        started = time.monotonic()
        result = pool.run(
            src(
                """
                import os, signal
                if dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()
                """
            )
        )
        assert time.monotonic() - started < 15
        by_rank = {e.rank: e for e in result.errors}
        assert by_rank[1].type_name == "RankLost" and "SIGKILL" in by_rank[1].message
        assert result.lost == (1,)
        assert "rank 1 was restarted: its namespace was lost" in result.notes
        assert victim.pid not in agent_pids()
        after = pool.run(ALL_REDUCE + "(t.item(), 'keep' in globals())")
        assert after.values == [(3.0, True), (3.0, False)]


def test_a_slow_recovery_goes_on_after_its_cell_and_the_next_cell_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost rank whose restart outlasts the wait (a machine that does not answer holds it for
    its connection's timeout) does not hold the failed cell: the cell ends saying so, and the
    next cell runs on the whole pool once the restart is done, with what it said.
    """
    monkeypatch.setattr(pool_module, "MENDING_WAIT", 0.0)  # every recovery outlasts it
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        said: list[str] = []
        pool.subscribe(lambda e: said.append(e.text) if isinstance(e, PoolMessage) else None)
        failed = pool.run("import os\nif rank == 1:\n    os._exit(3)")
        assert failed.lost == (1,)
        assert any(
            n.startswith("the pool is still starting rank 1 on ") and "next cell waits" in n
            for n in failed.notes
        ), failed.notes
        assert not any("was restarted" in n for n in failed.notes)
        after = pool.run("rank")
        assert after.values == [0, 1], after.errors
        # Told once, as it happened: not again with the next cell.
        assert "rank 1 was restarted: its namespace was lost" in said
        assert not any("was restarted" in n for n in after.notes), after.notes
        # Gone down while a recovery goes on: it stops, and nothing it started is left.
        before = agent_pids()
        assert pool.run("import os\nif rank == 0:\n    os._exit(3)").lost == (0,)
    wait_for(lambda: not (agent_pids() - before), 20, "no rank started while going down")


def test_the_same_error_on_every_rank_is_told_as_rank_0s(pool2: Pool) -> None:
    """Rank 1's error reaches the pool first; rank 0 then raises the same error on its own (it
    ignores the pool's interrupt): the cell's error is told as rank 0's, the lowest of those
    that failed alike, not as whichever the pool heard first.
    """
    result = pool2.run(
        src(
            """
            import signal, time
            if rank == 0:
                agents = signal.signal(signal.SIGINT, signal.SIG_IGN)
                try:
                    time.sleep(0.5)
                finally:
                    signal.signal(signal.SIGINT, agents)
            raise ValueError("the same failure")
            """
        )
    )
    assert {e.rank: e.type_name for e in result.errors} == {0: "ValueError", 1: "ValueError"}
    with pytest.raises(CellError) as failed:
        result.raise_for_errors()
    assert failed.value.primary.rank == 0
    assert str(failed.value).startswith("cell failed on rank 0 ("), str(failed.value)


def _gated_restarts(
    monkeypatch: pytest.MonkeyPatch, wait: float = 0.0
) -> tuple[threading.Event, threading.Event]:
    """Restarts of lost ranks wait until the first returned event is set (a host that does not
    answer yet), the second set as one begins; a failed cell waits ``wait`` seconds for them.
    The ranks themselves stay real.
    """
    gate, begun = threading.Event(), threading.Event()
    restart_dead = Ranks.restart_dead

    async def gated(self: Ranks, after_failure: bool = True) -> list[str]:
        begun.set()
        await asyncio.to_thread(gate.wait, 60)
        return await restart_dead(self, after_failure)

    monkeypatch.setattr(Ranks, "restart_dead", gated)
    monkeypatch.setattr(pool_module, "MENDING_WAIT", wait)
    return gate, begun


def _stopped_while_waiting(
    pool: Pool, said: list[str], gate: threading.Event, source: str
) -> list[str]:
    """Run ``source`` from a thread while a gated recovery holds ``pool``, press Ctrl-C once the
    pool ``said`` that the cell waits, and return what the interrupted cell shows; the gate
    opens afterwards (the recovery then ends).
    """
    outcome: list[BaseException] = []

    def waiting_cell() -> None:
        try:
            pool.run(source)
        except BaseException as exc:  # noqa: BLE001 - what the cell raised is the result
            outcome.append(exc)

    cell = threading.Thread(target=waiting_cell)
    cell.start()
    try:
        wait_for(lambda: any("the cell waits for the pool" in t for t in said), 20, "the wait")
        pool.interrupt()
        cell.join(timeout=20)
        assert not cell.is_alive(), "Ctrl-C did not stop the cell's wait"
        assert len(outcome) == 1 and isinstance(outcome[0], WaitInterrupted), outcome
        return outcome[0]._render_traceback_()
    finally:
        gate.set()
        cell.join(timeout=60)


def test_ctrl_c_stops_a_cell_that_waits_for_a_recovery(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The cell after a failed one waits for the pool to start its lost rank again; Ctrl-C
    then stops that wait at once, and the cell does not run later behind the user's back.
    """
    gate, _ = _gated_restarts(monkeypatch)
    ran = tmp_path / "ran"
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        said: list[str] = []
        pool.subscribe(lambda e: said.append(e.text) if isinstance(e, PoolMessage) else None)
        assert pool.run("import os\nif rank == 1:\n    os._exit(3)").lost == (1,)
        # One line, saying that the cell never began and what it waited for.
        assert _stopped_while_waiting(pool, said, gate, f"open({str(ran)!r}, 'w').close()") == [
            "KeyboardInterrupt: stopped before it began, while it waited for the pool to "
            "start rank 1 on 127.0.0.1 again (that goes on; the next cell waits for it)"
        ]
        after = pool.run("rank")
        assert after.values == [0, 1] and "rank 1 was restarted: its namespace was lost" in said
        assert not ran.exists(), "the stopped cell ran after the recovery"


def test_ctrl_c_stops_a_cell_that_waits_for_an_idle_ranks_recovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank lost while the pool was idle is started again; a cell run meanwhile waits for
    it, and Ctrl-C says that the cell never began and which rank it waited for.
    """
    gate, begun = _gated_restarts(monkeypatch)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        said: list[str] = []
        pool.subscribe(lambda e: said.append(e.text) if isinstance(e, PoolMessage) else None)
        pids = pool.run("import os\nos.getpid()").values
        os.kill(pids[1], signal.SIGKILL)
        assert begun.wait(20), "the pool did not begin to start rank 1 again"
        assert _stopped_while_waiting(pool, said, gate, "rank") == [
            "KeyboardInterrupt: stopped before it began, while it waited for the pool to "
            "start rank 1 on 127.0.0.1 again (that goes on; the next cell waits for it)"
        ]
        assert pool.run("rank").values == [0, 1]


def test_ctrl_c_while_a_failed_cell_waits_for_its_recovery_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failed cell ends at once with its own failure (not told as interrupted); the
    recovery goes on, and the next cell has the whole pool.
    """
    gate, begun = _gated_restarts(monkeypatch, wait=60.0)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        outcome: list[RunResult] = []
        cell = threading.Thread(
            target=lambda: outcome.append(pool.run("import os\nif rank == 1:\n    os._exit(3)"))
        )
        cell.start()
        try:
            assert begun.wait(30), "the recovery did not begin"
            pool.interrupt()
            cell.join(timeout=20)
            assert not cell.is_alive(), "Ctrl-C did not end the failed cell's wait"
        finally:
            gate.set()
            cell.join(timeout=60)
        (failed,) = outcome
        assert failed.lost == (1,) and not failed.interrupted
        assert [e.type_name for e in failed.errors] == ["RankLost"]
        assert any("still starting rank 1" in n for n in failed.notes), failed.notes
        assert pool.run("rank").values == [0, 1]


def test_a_rank_lost_again_while_its_recovery_goes_on_is_told_by_the_next_cell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The restarted rank dies before it says hello: the recovery fails, and no second one
    starts behind the user's back; the next cell says so, and a restart mends the pool.
    """
    spawn = Ranks.spawn
    doomed: list[int] = []  # the pool's own start is left alone

    async def dying(self: Ranks, rank: Rank) -> None:
        await spawn(self, rank)
        if doomed and rank.index == doomed[0] and rank.process is not None:
            doomed.clear()
            os.kill(rank.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]

    monkeypatch.setattr(Ranks, "spawn", dying)
    monkeypatch.setattr(pool_module, "MENDING_WAIT", 0.0)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        said: list[str] = []
        pool.subscribe(lambda e: said.append(e.text) if isinstance(e, PoolMessage) else None)
        doomed.append(1)
        assert pool.run("import os\nif rank == 1:\n    os._exit(3)").lost == (1,)
        wait_for(lambda: any("could not recover" in t for t in said), 30, "the recovery to fail")
        with pytest.raises(PoolError, match=r"has lost rank 1 .* could not start it again"):
            pool.run("rank")
        pool.restart()
        assert pool.run("rank").values == [0, 1]


def test_after_a_recovery_that_failed_a_restart_gives_a_whole_pool_and_no_stale_notes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lost rank could not be started again (its host did not answer): the next cell says
    so; ``%sky restart`` then mends the pool (also one without a group to form), and what the
    failed recovery said is not told again.
    """
    restart_dead = Ranks._restart_dead
    failures = ["the host did not answer"]

    async def failing_once(self: Ranks, after_failure: bool) -> list[str]:
        if failures:
            await asyncio.sleep(0.1)  # a host that does not answer: longer than MENDING_WAIT
            raise PoolError(failures.pop())
        return await restart_dead(self, after_failure)

    monkeypatch.setattr(Ranks, "_restart_dead", failing_once)
    monkeypatch.setattr(pool_module, "MENDING_WAIT", 0.0)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        assert pool.run("import os\nif rank == 1:\n    os._exit(3)").lost == (1,)
        with pytest.raises(PoolError, match=r"could not start it again \(the host did not answer"):
            pool.run("rank")
        pool.restart()
        after = pool.run("rank")
        assert after.values == [0, 1]
        assert not any("could not recover" in n for n in after.notes), after.notes


def test_a_rank_whose_machine_refuses_its_restart_is_shown_lost_not_booting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recovery cannot start the lost rank again (its machine refuses): the pool's status
    says the rank is lost and why, where it said "booting" for ever.
    """
    start_rank = LocalProvider.start_rank
    refusals: list[str] = []

    async def refusing(self: LocalProvider, node: Node, env: Any) -> Any:
        if refusals:
            raise ProviderError(refusals.pop())
        return await start_rank(self, node, env)

    monkeypatch.setattr(LocalProvider, "start_rank", refusing)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        changes: list[RankStateChanged] = []
        pool.subscribe(lambda e: changes.append(e) if isinstance(e, RankStateChanged) else None)
        refusals.append("no room for another process")
        failed = pool.run("import os\nif rank == 1:\n    os._exit(3)")
        assert failed.lost == (1,)
        assert pool.ranks[1].state is RankState.LOST, pool.ranks[1]
        last = [c for c in changes if (1, 1) in c.ranks][-1]
        assert last.state is RankState.LOST
        assert last.detail == "could not be started: no room for another process", last
        stacks = pool.stacks()
        assert ": lost (could not be started: no room for another process), no process to ask" in (
            stacks
        ), stacks
        pool.restart()
        assert pool.run("rank").values == [0, 1]


def test_a_rank_lost_while_the_cells_files_sync_fails_the_cell_rather_than_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that ends after the cell took its ranks but before it asked them for answers
    (its files or globals on their way) is a lost rank of that cell, not an answer awaited
    for ever.
    """
    workdir = Transfer.workdir
    victims: list[Rank] = []

    async def losing_one(self: Transfer, files: list[Any]) -> Any:
        if victims:
            victim = victims.pop()
            assert victim.hello is not None
            os.kill(victim.hello.pid, signal.SIGKILL)
            while victim.alive:  # its end read by the pool before the cell asks
                await asyncio.sleep(0.01)
        return await workdir(self, files)

    monkeypatch.setattr(Transfer, "workdir", losing_one)
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        pool.run("1")
        victims.append(pool._ranks.all[1])
        outcome: list[RunResult] = []
        cell = threading.Thread(target=lambda: outcome.append(pool.run("rank")))
        cell.start()
        cell.join(timeout=60)
        assert not cell.is_alive(), "the cell waited for an answer from a rank already gone"
        (result,) = outcome
        assert result.lost == (1,) and [e.type_name for e in result.errors] == ["RankLost"]
        assert pool.run("rank").values == [0, 1]


def test_a_failed_rank_leaves_the_group_so_its_peer_is_not_left_waiting() -> None:
    """Rank 1 raises while rank 0 waits for it in an all_reduce.

    SIGINT does not free a rank blocked in gloo's wait; here rank 0 ignores it altogether, so
    that an interrupt landing before it enters the collective cannot free it either. With a long
    grace before the kill, rank 0 is freed at once only because the failed rank 1 leaves the group.
    """
    with Pool(nodes=2, interrupt_grace=30.0) as pool:
        pool.run(
            "import signal, torch, torch.distributed as dist\nkeep = dist.get_rank()\n"
            "agent_sigint = signal.signal(signal.SIGINT, lambda *_: None)"
        )
        started = time.monotonic()
        result = pool.run(
            src(
                """
                if dist.get_rank() == 1:
                    raise ValueError("bad batch on rank 1")
                dist.all_reduce(torch.ones(1))
                """
            )
        )
        took = time.monotonic() - started
        assert result.lost == () and not [n for n in result.notes if "killed" in n], (
            f"rank 0 stayed in the collective until it was killed ({took:.0f} s): {result.notes}"
        )
        assert took < 15, f"the cell took {took:.0f} s to end"
        by_rank = {e.rank: e for e in result.errors}
        assert by_rank[1].type_name == "ValueError" and not by_rank[1].secondary
        assert 0 in by_rank  # its collective failed: the group it waited in is gone
        again = pool.run(
            "signal.signal(signal.SIGINT, agent_sigint)\n" + ALL_REDUCE + "(t.item(), keep)"
        )
        assert again.values == [(3.0, 0), (3.0, 1)]


def test_stuck_rank_is_killed_after_the_grace_period() -> None:
    with Pool(nodes=2, interrupt_grace=1.0) as pool:
        pool.run("import signal, time, torch.distributed as dist")
        started = time.monotonic()
        result = pool.run(
            src(
                """
                if dist.get_rank() == 0:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                dist.barrier()  # rank 1 fails once rank 0 ignores the interrupt, not before
                if dist.get_rank() == 0:
                    while True:
                        time.sleep(0.05)
                raise RuntimeError("rank 1 fails")
                """
            )
        )
        assert time.monotonic() - started < 15
        primary = CellError(result.errors).primary
        assert primary.rank == 1 and primary.type_name == "RuntimeError"
        assert result.lost == (0,)
        assert any(n.startswith("rank 0 did not stop") for n in result.notes), result.notes
        assert pool.run(ALL_REDUCE).values == [3.0, 3.0]


def test_ranks_killed_after_a_timeout_are_named_once() -> None:
    """Both ranks ignore the interrupt a timeout sends: one note names both as killed (the
    rounds while their ends come in do not kill, or say it, again).
    """
    with Pool(nodes=2, interrupt_grace=1.0) as pool:
        result = pool.run(
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "while True:\n    time.sleep(0.05)",
            timeout=2,
        )
        killed = [note for note in result.notes if "were killed" in note]
        assert killed == ["ranks 0-1 did not stop within 1 s of the interrupt and were killed"]
        assert sorted(result.lost) == [0, 1]
        assert pool.run("1").values == [1, 1]


@contextmanager
def _running_until(
    pool: Pool, code: str, said: str, timeout: float | None = None
) -> Iterator[list[RunResult]]:
    """``code`` run on a thread of its own; the block begins once every rank printed ``said``,
    and ends once the cell did (what the block does must end it): its result in the list.
    """
    heard: set[int] = set()
    unsubscribe = pool.subscribe(
        lambda e: heard.add(e.rank) if isinstance(e, OutputReceived) and said in e.text else None
    )
    outcome: list[RunResult] = []
    cell = threading.Thread(target=lambda: outcome.append(pool.run(code, timeout=timeout)))
    cell.start()
    try:
        wait_for(lambda: heard == set(range(pool.world_size)), 30, f"every rank to say {said!r}")
        yield outcome
    finally:
        unsubscribe()
        cell.join(timeout=30)
    assert not cell.is_alive(), "the cell did not end"


def test_a_second_interrupt_kills_at_once_and_says_so() -> None:
    """Ranks that ignore the interrupt: a second one kills them at once, and the note says so,
    not that they outlasted the grace period.
    """
    with Pool(nodes=2, interrupt_grace=60.0, frameworks=Frameworks(torch=False)) as pool:
        code = (
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('ignoring', flush=True)\nwhile True:\n    time.sleep(0.05)"
        )
        with _running_until(pool, code, "ignoring") as outcome:
            pool.interrupt()
            pool.interrupt()
        (result,) = outcome
        killed = [note for note in result.notes if "killed" in note]
        assert killed == ["ranks 0-1 were killed at the second interrupt, before 60 s were up"]
        assert result.interrupted and sorted(result.lost) == [0, 1]
        assert pool.run("1").values == [1, 1]


def test_an_interrupt_after_the_timeout_stopped_the_cell_kills_and_says_so() -> None:
    """The cell's timeout already asked the ranks to stop (they go on): the user's one
    interrupt kills them at once, said as that interrupt, not as a second one.
    """
    with Pool(nodes=2, interrupt_grace=60.0, frameworks=Frameworks(torch=False)) as pool:
        code = (
            "import signal, time\n"
            "signal.signal(signal.SIGINT, lambda *_: print('asked to stop', flush=True))\n"
            "while True:\n    time.sleep(0.05)"
        )
        with _running_until(pool, code, "asked to stop", timeout=1) as outcome:
            pool.interrupt()
        (result,) = outcome
        killed = [note for note in result.notes if "killed" in note]
        assert killed == ["ranks 0-1 were killed at the interrupt, before 60 s were up"]
        assert result.timed_out == "timed out after 1 s"


def test_keyboard_interrupt_in_the_caller_reaches_every_rank() -> None:
    with Pool(nodes=2, interrupt_grace=5.0) as pool:
        pool.run("import time\nkeep = 1")
        asleep: set[int] = set()

        def on_event(event: PoolEvent) -> None:
            if isinstance(event, OutputReceived) and "sleeping" in event.text:
                asleep.add(event.rank)

        pool.subscribe(on_event)

        def interrupt_when_asleep() -> None:
            wait_for(lambda: asleep == {0, 1}, 30, "both ranks to sleep")
            ctrl_c()

        helper = threading.Thread(target=interrupt_when_asleep)
        helper.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            pool.run("print('sleeping', flush=True)\ntime.sleep(120)")
        helper.join()
        assert time.monotonic() - started < 30
        after = pool.run("keep")
        assert after.values == [1, 1] and after.lost == ()


def test_timeout_stops_the_cell() -> None:
    with Pool(nodes=2, interrupt_grace=2.0) as pool:
        pool.run("import time")
        result = pool.run("time.sleep(120)", timeout=1.0)
        assert {e.type_name for e in result.errors} == {"KeyboardInterrupt"}
        assert any("timed out" in n for n in result.notes)
        assert pool.run("1").values == [1, 1]


def test_a_stop_that_finds_every_rank_finished_leaves_the_cell_a_success(pool2: Pool) -> None:
    """A timeout that passes while the answers are on their way (a microsecond's): every rank
    finished the cell, so it is neither timed out nor interrupted, and its value is kept.
    """
    result = pool2.run("1", timeout=1e-9)
    assert result.ok and result.values == [1, 1], result.errors
    assert result.stop is None and not any("timed out" in n for n in result.notes), result.notes


def test_a_cell_that_catches_its_timeouts_interrupt_is_still_said_to_have_timed_out(
    pool2: Pool,
) -> None:
    cell = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass\n2"
    result = pool2.run(cell, timeout=1.0)
    assert result.values == [2, 2], result.errors
    assert result.stop is not None and any("timed out" in n for n in result.notes), result.notes


def test_a_pool_without_a_group_says_so_once_not_at_each_restart() -> None:
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        said: list[str] = []
        pool.subscribe(lambda e: said.append(e.text) if isinstance(e, PoolMessage) else None)
        result = pool.run("import os\nif rank == 1:\n    os._exit(3)")
        assert result.lost == (1,) and "rank 1 was restarted" in str(result.notes)
        assert "--framework none: no distributed setup" not in said, said


def test_rank_lost_while_idle_is_restarted_and_reported() -> None:
    with Pool(nodes=2) as pool:
        pool.run("keep = 1")
        kill_and_await_replacement(pool, 0)
        result = pool.run(ALL_REDUCE)
        assert result.values == [3.0, 3.0]
        assert result.lost == (0,)


def test_pool_works_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shim = tmp_path / "torch"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('No module named torch (test shim)')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with Pool(nodes=2) as pool:
        assert "skipped" in pool.worlds_note
        result = pool.run("from skyward_jupyter import instance_info\ninstance_info().rank")
        assert result.values == [0, 1]


def test_closing_the_pool_ends_every_rank() -> None:
    pool = Pool(nodes=2).start()
    pids = {r.hello.pid for r in pool.ranks if r.hello}
    assert pids <= agent_pids()
    pool.close()
    wait_for(lambda: not (pids & agent_pids()), 10, "ranks to end after close")
    with pytest.raises(PoolError, match="not running"):
        pool.run("1")


def test_closing_the_pool_during_a_cell_ends_the_cell_with_a_clear_error() -> None:
    """``close()`` from another thread (the panel's shut-down, an idle stop) while a cell runs."""
    pool = Pool(nodes=2).start()
    pids = {r.hello.pid for r in pool.ranks if r.hello}
    asleep: set[int] = set()
    pool.subscribe(
        lambda e: (
            asleep.add(e.rank) if isinstance(e, OutputReceived) and "sleeping" in e.text else None
        )
    )
    outcome: list[object] = []

    def run_cell() -> None:
        try:
            outcome.append(pool.run("import time\nprint('sleeping', flush=True)\ntime.sleep(120)"))
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    runner = threading.Thread(target=run_cell, daemon=True)  # daemon: a hang fails, not blocks
    runner.start()
    try:
        wait_for(lambda: asleep == {0, 1}, 30, "both ranks to sleep in the cell")
    except AssertionError:
        pool.close()
        raise
    pool.close()  # raises TimeoutError past its own deadline
    runner.join(timeout=10)
    assert not runner.is_alive(), f"run() still waits 10 s after close() returned: {outcome}"
    assert len(outcome) == 1 and isinstance(outcome[0], PoolError), outcome
    assert str(outcome[0]) == "pool 'default' was closed while the cell ran"
    wait_for(lambda: not (pids & agent_pids()), 10, "the cell's ranks to end after close")
    assert not pool.running


def test_sigkill_of_the_notebook_process_leaves_no_rank(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "notebook.py"
    script.write_text(
        src(
            """
            import sys, time
            from skyward_jupyter import Pool
            pool = Pool(nodes=2).start()
            print(" ".join(str(r.hello.pid) for r in pool.ranks), flush=True)
            time.sleep(600)
            """
        )
    )
    before = agent_pids() | agent_pids(TEMPLATE)
    notebook = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert notebook.stdout is not None
        pids = {int(x) for x in notebook.stdout.readline().split()}
        assert len(pids) == 2 and pids <= agent_pids()
        started = (agent_pids() | agent_pids(TEMPLATE)) - before
        assert len(started) == 3  # two ranks and the notebook's rank template
    finally:
        notebook.kill()
        notebook.wait()
    wait_for(
        lambda: not (started & (agent_pids() | agent_pids(TEMPLATE))),
        10,
        "ranks and template to end after the notebook was killed",
    )


def test_gpus_are_split_across_nodes_one_rank_per_gpu() -> None:
    from skyward_jupyter.providers.local import LocalProvider

    # A machine with four (pretend) GPUs: the ranks see their node's GPUs only, one rank each
    # (uneven splits: tests/test_gpus.py).
    with Pool(nodes=2, provider=LocalProvider(gpus=("0", "1", "2", "3"), gpu_type="T4")) as pool:
        result = pool.run(
            "import os\n(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['LOCAL_RANK'], "
            "os.environ['NODE_RANK'], os.environ['LOCAL_WORLD_SIZE'])"
        )
        assert result.values == [
            ("0,1", "0", "0", "2"),
            ("0,1", "1", "0", "2"),
            ("2,3", "0", "1", "2"),
            ("2,3", "1", "1", "2"),
        ]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from skyward_jupyter.providers.local import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus()[0] == ("2", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus()[0] == ()


def test_process_group_is_destroyed_when_the_pool_ends(tmp_path: Path) -> None:
    with Pool(nodes=2) as pool:
        pool.run(
            src(
                f"""
                import atexit, os, torch.distributed as dist
                def report():
                    path = os.path.join({str(tmp_path)!r}, os.environ["RANK"])
                    with open(path + ".tmp", "w") as f:
                        f.write(str(dist.is_initialized()))
                    os.rename(path + ".tmp", path)  # seen whole or not at all
                atexit.register(report)
                """
            )
        )
    wait_for(lambda: len(list(tmp_path.glob("[01]"))) == 2, 10, "both ranks' exit hooks to run")
    assert {p.name: p.read_text() for p in tmp_path.glob("[01]")} == {"0": "False", "1": "False"}


def test_notebook_functions_see_the_ranks_namespace(pool2: Pool) -> None:
    notebook: dict[str, object] = {"__name__": "__main__"}
    exec(
        "def f():\n    return remote_value\n"
        "class C:\n    def m(self):\n        return remote_value",
        notebook,
    )
    pool2.run("import torch.distributed as dist\nremote_value = dist.get_rank() + 10")
    result = pool2.run("(f(), C().m())", {"f": notebook["f"], "C": notebook["C"]})
    assert result.values == [(10, 10), (11, 11)]


@pytest.mark.parametrize(("more_than_cpus", "waiting"), [(False, "BATCH"), (True, "OTHER")])
def test_a_rank_waits_as_a_batch_task_only_where_its_machines_ranks_fit_the_cpus(
    more_than_cpus: bool, waiting: str
) -> None:
    """With more ranks on a node than CPUs, switching back from batch costs each rank a
    preemption every cell (more than it saves): those ranks wait as normal tasks.
    """
    from skyward_jupyter.agent.inbox import _BatchWhileWaiting, usable_cpus

    cpus = max(1, int(usable_cpus()))
    seen: list[int] = []

    def wait() -> None:
        batch = _BatchWhileWaiting(cpus + 1 if more_than_cpus else cpus)
        batch.begin()
        seen.append(os.sched_getscheduler(0))
        batch.end()
        seen.append(os.sched_getscheduler(0))

    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        pytest.skip(f"this system does not let a thread switch to SCHED_BATCH and back: {exc!r}")
    thread = threading.Thread(target=wait)  # a thread's own policy: the test's stays as it is
    thread.start()
    thread.join()
    assert seen == [getattr(os, f"SCHED_{waiting}"), os.SCHED_OTHER]


def test_ranks_of_many_nodes_on_one_machine_more_than_its_cpus_wait_as_normal_tasks() -> None:
    """The count is of the machine's ranks, every node on it: single-rank nodes on the
    notebook's machine, one more than its CPUs.
    """
    from skyward_jupyter.agent.inbox import usable_cpus

    nodes = int(usable_cpus()) + 1
    if nodes > 17:
        pytest.skip(f"{nodes - 1} CPUs: a pool with more ranks than them is too large here")

    def main_thread(pid: int) -> str:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    with Pool(nodes=nodes, frameworks=Frameworks(torch=False)) as pool:
        pids = pool.run("import os\nos.getpid()").values
        for pid in pids:  # back in its read of the wire, where a batch rank would be batch
            wait_for(lambda pid=pid: main_thread(pid) == "S", 10, f"rank pid {pid} to wait")
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER


def test_a_rank_waits_as_a_batch_task_and_runs_cells_as_a_normal_one(pool2: Pool) -> None:
    """An idle rank waking for a cell must not preempt the notebook while it still writes the
    cell to the other ranks; the user's code and the threads it starts run as normal tasks, and
    a policy a cell chose is left alone.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        pytest.skip(f"this system does not let a thread switch to SCHED_BATCH and back: {exc!r}")
    result = pool2.run(
        src(
            """
            import os, threading
            seen = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
            t.start(); t.join()
            (os.getpid(), os.sched_getscheduler(0), seen[0])
            """
        )
    )
    assert result.ok, result.errors
    for pid, in_cell, in_thread in result.values:
        assert in_cell == os.SCHED_OTHER and in_thread == os.SCHED_OTHER
        wait_for(
            lambda pid=pid: os.sched_getscheduler(pid) == os.SCHED_BATCH,
            10,
            f"rank pid {pid} to wait for its next command as a batch task",
        )
    chosen = "import os\nos.sched_setscheduler(0, os.SCHED_{}, os.sched_param(0))\n"
    try:
        assert pool2.run(chosen.format("BATCH")).ok
        kept = pool2.run("import os\nos.sched_getscheduler(0)\n")
        assert kept.ok and kept.values == [os.SCHED_BATCH] * 2, "a cell's own policy was reset"
    finally:
        assert pool2.run(chosen.format("OTHER")).ok


NICES_BY_THREAD = src(
    """
    import os
    def nices_by_thread():
        seen = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                    name = f.read().strip().decode(errors="replace")
                seen.setdefault(name, []).append(os.getpriority(os.PRIO_PROCESS, int(tid)))
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
        return {name: sorted(nices) for name, nices in seen.items()}
    """
)


def test_gloo_event_loop_threads_run_below_the_training_thread(pool2: Pool) -> None:
    """gloo's event loop spins while a peer's bytes wait for this rank: it must yield the CPU to
    the rank's training. The pool's group's loop is lowered as the group forms (checked in the
    cell that forms it again, with the watchdog's lowering held off meanwhile), and one of a
    group the cell forms itself at the next tick; the training thread and gloo's workers stay as
    they are.
    """
    assert pool2.run(NICES_BY_THREAD).ok
    rank = pool2.run("import os\nos.getpriority(os.PRIO_PROCESS, os.getpid())").values
    lowered = [min(nice + 5, 19) for nice in rank]

    def lowered_loops(seen: list[dict[str, list[int]]]) -> bool:
        return [set(s.get("gloo_tcp_loop", ())) for s in seen] == [{low} for low in lowered]

    seen = pool2.run("nices_by_thread()").values
    if not all("gloo_tcp_loop" in threads for threads in seen):
        pytest.skip(f"this torch's gloo does not name its loop thread: {seen}")
    assert lowered_loops(seen), seen
    for threads, nice in zip(seen, rank, strict=True):  # the training thread, gloo's workers, ...
        assert all(set(v) == {nice} for k, v in threads.items() if k != "gloo_tcp_loop"), threads
    formed_again = pool2.run(
        src(
            """
            import torch.distributed as dist
            from skyward_jupyter.agent.worlds import Worlds
            tick, Worlds.tick = Worlds.tick, lambda self: None  # only the formation may lower
            try:
                dist.destroy_process_group()
                dist.init_process_group("gloo")
                seen = nices_by_thread()
            finally:
                Worlds.tick = tick
            seen
            """
        )
    )
    assert formed_again.ok and lowered_loops(formed_again.values), formed_again
    own = pool2.run("g = dist.new_group(backend='gloo')\nnices_by_thread()['gloo_tcp_loop']")
    assert own.ok and all(len(nices) >= 2 for nices in own.values), own
    wait_for(
        lambda: lowered_loops(pool2.run("nices_by_thread()").values),
        10,
        "the loop thread of the cell's own group to be lowered",
    )
    assert pool2.run("del g\ndist.destroy_process_group()").ok


def test_ranks_report_their_resource_use(pool2: Pool) -> None:
    from skyward_jupyter.events import RankUsage

    seen: dict[int, RankUsage] = {}
    unsubscribe = pool2.subscribe(
        lambda e: seen.__setitem__(e.rank, e) if isinstance(e, RankUsage) else None
    )
    try:
        wait_for(lambda: set(seen) == {0, 1}, 10, "usage from both ranks")
    finally:
        unsubscribe()
    for usage in seen.values():
        assert usage.rss_bytes > 10 * 2**20  # a Python process with torch imported
        assert 0 <= usage.cpu_percent < 400
        assert usage.gpu_memory_bytes is None  # CUDA never initialised on a CPU machine


def test_a_rank_that_dies_is_the_headline_not_the_peer_it_broke() -> None:
    """Rank 1 SIGKILLs itself while rank 0 waits for it in a collective: rank 1 is the cause.

    Rank 0's "connection closed by peer" often reaches the pool before rank 1's death does; the
    headline must still be the death. The race goes either way, so the scenario is repeated.
    """
    with Pool(nodes=2, interrupt_grace=2.0) as pool:
        for attempt in range(3):
            result = pool.run(
                src(
                    """
                    import os, signal, torch, torch.distributed as dist
                    dist.barrier()
                    if dist.get_rank() == 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    dist.all_reduce(torch.ones(1))  # rank 0 waits here for the dead rank 1
                    """
                )
            )
            error = CellError(result.errors)
            by_rank = {e.rank: e for e in result.errors}
            seen = (attempt, [str(e) for e in result.errors])
            assert error.primary is by_rank[1] and error.primary.type_name == "RankLost", seen
            headline = error.summary().splitlines()[0]
            assert "rank 1" in headline and "SIGKILL" in headline, seen
            assert error.render().startswith("--- rank 1"), seen
            assert by_rank[0].secondary, seen
            assert result.lost == (1,), seen
            assert pool.run(ALL_REDUCE).values == [3.0, 3.0]


def test_ranks_run_in_the_notebooks_directory_and_reload_edited_modules(tmp_path: Path) -> None:
    """The local ranks share the notebook's files: they run in its directory, and a module from
    it that was edited between cells is reloaded before the next (as %autoreload does).
    """
    (tmp_path / "mymod.py").write_text("def f():\n    return 1\n")
    with Pool(nodes=1, procs_per_node=2, sync=[str(tmp_path)]) as pool:
        first = pool.run("import os, mymod\n(os.getcwd(), mymod.f())")
        assert first.values == [(str(tmp_path), 1)] * 2, first.errors
        (tmp_path / "mymod.py").write_text("def f():\n    return 2\n")
        later = time.time() + 10
        os.utime(tmp_path / "mymod.py", (later, later))
        assert pool.run("mymod.f()").values == [2, 2]
        assert pool.run("mymod.f()").values == [2, 2]  # reloaded once, not every cell


def test_variables_only_the_pool_sets_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="the pool sets WORLD_SIZE on each rank itself"):
        Pool(env={"WORLD_SIZE": "3"})
