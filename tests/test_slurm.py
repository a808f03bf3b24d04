"""The Slurm provider against a real cluster (tests/slurm_cluster.py): munged, slurmctld, slurmds.

A pool is a Slurm job; its ranks are job steps whose stdio is the wire. Covered: a DDP cell over
two nodes, a failing rank, an interrupt, a job that pends (shown, then cancelled by the
interrupt), bad input, and a killed kernel leaving nothing in the queue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.environments import Packages
from skyward_jupyter.events import NodeStateChanged, PoolEvent
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.slurm import SlurmOptions, SlurmProvider

from .conftest import hold_rank_ones_gil, wait_for
from .slurm_cluster import SlurmCluster, available, slurm_cluster

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

ALL_REDUCE = (
    "import socket, torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "(t.item(), socket.gethostname())"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(2, tmp_path_factory.mktemp("slurm")) as made:
        saved = {k: os.environ.get(k) for k in made.env()}
        os.environ.update(made.env())  # the notebook's client commands find the cluster
        try:
            yield made
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _queue(cluster: SlurmCluster) -> str:
    return cluster.run("squeue", "-h", "-o", "%i %j %T").stdout.strip()


def test_a_ddp_cell_on_two_slurm_nodes_and_nothing_left(cluster: SlurmCluster) -> None:
    provider = SlurmProvider(SlurmOptions(time="10"))
    with Pool(nodes=2, provider=provider) as pool:
        result = pool.run(ALL_REDUCE)
        assert result.values == [(3.0, "node0"), (3.0, "node1")], result.errors
        job = provider.job
        assert [n.instance_type for n in pool.nodes] == [
            f"slurm node0, job {job}",
            f"slurm node1, job {job}",
        ]  # what the panel and the lab's registry show of each machine
        assert job and f"{job} sky-default" in _queue(cluster).replace("-", " ", 0)
        steps = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()
        assert {f"{job}.0", f"{job}.1"} <= set(steps)  # each rank is a job step Slurm tracks
        failed = pool.run("if dist.get_rank() == 1:\n    raise ValueError('rank one says no')")
        (cause,) = [e for e in failed.errors if not e.secondary]
        assert cause.rank == 1 and "rank one says no" in cause.message
        assert "slurm job" in cause.where and "node1" in cause.where
        assert pool.run(ALL_REDUCE).ok
    wait_for(lambda: not _queue(cluster), 20, "the job to leave the queue")


def test_an_interrupt_reaches_the_ranks_on_slurm(cluster: SlurmCluster) -> None:
    with Pool(nodes=2, provider=SlurmProvider(), interrupt_grace=3) as pool:
        timer = threading.Timer(3.0, pool.interrupt)
        timer.start()
        result = pool.run("import time\nprint('working', flush=True)\ntime.sleep(60)")
        timer.join()
        assert {e.type_name for e in result.errors} == {"KeyboardInterrupt"}
        assert pool.run("1").values == [1, 1]
    wait_for(lambda: not _queue(cluster), 20, "the job to leave the queue")


def test_a_pending_job_is_shown_and_an_interrupt_cancels_it(cluster: SlurmCluster) -> None:
    blocker = cluster.run(
        "sbatch",
        "--parsable",
        "--partition=tiny",
        "--exclusive",
        "--wrap=sleep 300",
        "--output=/dev/null",
    ).stdout.strip()
    wait_for(lambda: f"{blocker} " in _queue(cluster) and "RUNNING" in _queue(cluster), 20,
             "the blocking job to run")  # fmt: skip
    pool = Pool(nodes=1, provider=SlurmProvider(SlurmOptions(partition="tiny")))
    seen: list[str] = []

    def watch(event: PoolEvent) -> None:
        if isinstance(event, NodeStateChanged) and "pending (Resources" in event.detail:
            seen.append(event.detail)
            pool.interrupt()  # what Ctrl-C (or the panel's button) does while it starts

    pool.subscribe(watch)
    with pytest.raises(KeyboardInterrupt):
        pool.start()
    assert "expected start" in seen[0]
    wait_for(lambda: _queue(cluster).count("\n") == 0, 20, "the pool's job to be cancelled")
    cluster.run("scancel", blocker)
    wait_for(lambda: not _queue(cluster), 20, "the queue to empty")


def test_a_rank_holding_its_gil_on_a_slurm_node_runs_on_and_a_stopped_one_is_lost(
    cluster: SlurmCluster,
) -> None:
    """Rank 1 computes in C without letting its GIL go for over twice the heartbeat timeout:
    the notebook looks at its process on its node (a short step of the pool's job), leaves it
    to finish and says why it is silent. Stopped (SIGSTOP), the same rank is declared lost.
    (The timeout leaves room for beats forwarded by Slurm's daemons on a loaded machine.)
    """
    with Pool(nodes=2, provider=SlurmProvider(), heartbeat_timeout=5.0) as pool:
        result, busy = hold_rank_ones_gil(pool, seconds=12.0)
        assert result.values == ["done", "done"] and not result.lost, result.errors
        assert len(busy) == 1 and "yet its process runs" in busy[0] and "node1" in busy[0], busy
        pid = pool.ranks[1].hello.pid  # type: ignore[union-attr]
        stopper = threading.Timer(1.0, lambda: os.kill(pid, signal.SIGSTOP))
        stopper.start()
        stopped = pool.run(
            "import time, torch.distributed as dist\ntime.sleep(1.5)\ndist.barrier()"
        )
        stopper.join()
        lost = {e.rank: e for e in stopped.errors}[1]
        assert lost.type_name == "RankLost" and "stopped answering" in lost.message, lost
    wait_for(lambda: not _queue(cluster), 20, "the job to leave the queue")


def test_bad_input_is_one_line(cluster: SlurmCluster) -> None:
    with pytest.raises(
        ProviderError,
        match=r"the Slurm job was refused \(.*--partition=nope.*\): .*Invalid partition",
    ):
        Pool(nodes=1, provider=SlurmProvider(SlurmOptions(partition="nope"))).start()
    assert not _queue(cluster)


def test_a_killed_notebook_leaves_nothing_in_the_queue(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(
        textwrap.dedent("""
            import time
            from skyward_jupyter import Pool
            from skyward_jupyter.providers.slurm import SlurmProvider
            provider = SlurmProvider()
            pool = Pool(nodes=2, provider=provider).start()
            print(provider.job, flush=True)
            time.sleep(600)
        """)
    )
    notebook = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert notebook.stdout is not None
        job = notebook.stdout.readline().strip()
        assert job and job in _queue(cluster)
    finally:
        notebook.kill()
        notebook.wait()
    # The ranks end when their channel closes (or the notebook's heartbeat stops, 30 s), then
    # the job's keeper, 20 s later.
    try:
        wait_for(lambda: not _queue(cluster), 90, f"job {job} to end after its notebook died")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {cluster.run('squeue', '-s', '-h').stdout}") from None


def test_the_time_limit_is_said_and_an_orphans_job_is_reaped(cluster: SlurmCluster) -> None:
    from types import SimpleNamespace

    from skyward_jupyter.registry.record import Owner, pool_record
    from skyward_jupyter.spec import PoolSpec

    provider = SlurmProvider(SlurmOptions(time="5"))
    pool = Pool(nodes=1, provider=provider).start()
    try:
        assert any("ends at its time limit" in w for w in provider.warnings), provider.warnings
        job = provider.job
        # What the lab panel lists: the pool, its state, its node as Slurm names it, the job.
        spec = PoolSpec(provider="slurm", options=SlurmOptions(time="5"))
        entry = SimpleNamespace(name="default", spec=spec, pool=pool)
        listed = pool_record("p1", entry, Owner.current(), created_at=0.0, ready_at=1.0)  # type: ignore[arg-type]
        assert listed["provider"] == "slurm" and listed["state"] == "ready"
        assert listed["nodes"][0]["instance_type"] == f"slurm node0, job {job}"
        assert listed["teardown"]["job"] == job
        record = provider.record({})
        assert record["job"] == job and record["slurm_conf"] == str(cluster.conf)
        # What the server does for a pool whose kernel is gone: from the record alone.
        report = SlurmProvider.reap(record)
        assert report.notes == [f"slurm job {job} cancelled"]
        wait_for(lambda: not _queue(cluster), 20, "the reaped job to leave the queue")
    finally:
        pool.close()


def test_pip_packages_are_built_on_each_slurm_node_before_its_ranks(
    cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each allocated node runs the builder in a job step; the nodes share this filesystem, so
    one builds and the other finds the environment built (the lock), and every rank imports the
    package from it.
    """
    monkeypatch.setenv("SKYWARD_ENVS", str(tmp_path / "envs"))
    packages = Packages(("--index-url=file:///opt/pypi/simple", "tabulate"))
    with Pool(nodes=2, provider=SlurmProvider(SlurmOptions(time="10")), packages=packages) as pool:
        result = pool.run("import socket, tabulate\n(tabulate.__file__, socket.gethostname())")
        assert result.ok, result.errors
        assert [v[1] for v in result.values] == ["node0", "node1"]
        assert all(v[0].startswith(str(tmp_path / "envs")) for v in result.values), result.values
        built = pool.environments
        assert sorted(built[n].cached for n in (0, 1)) == [False, True], built
        assert built[0].site == built[1].site and built[0].packages == 1
    wait_for(lambda: not _queue(cluster), 20, "the job to leave the queue")
