"""The Slurm test cluster (tests/slurm_cluster.py): real slurmctld, slurmds in network namespaces
and munged; batch jobs with steps across nodes, ``srun --jobid`` I/O from this (the notebook's)
side, a job that pends with its reason, and nothing left afterwards, also after a killed run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import wait_for
from .slurm_cluster import REGISTRY, SlurmCluster, available, reap_stale, slurm_cluster

pytestmark = pytest.mark.skipif(available() is not None, reason=f"slurm cluster: {available()}")

REPO = Path(__file__).resolve().parents[1]
# What the packages made; a cluster writes none of it (its files are all in its tmp).
SYSTEM_DIRS = [Path(p) for p in ("/etc/slurm", "/var/lib/slurm", "/var/log/slurm", "/run/munge")]


def system_files() -> set[Path]:
    return {p for d in SYSTEM_DIRS if d.exists() for p in d.rglob("*")}


def processes(conf: Path) -> list[str]:
    """Live processes with this SLURM_CONF in their environment: every daemon of a cluster (it
    starts them so) and what they start (steps, jobs' tasks).
    """
    marker = f"SLURM_CONF={conf}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"pid {proc.name}: {(proc / 'cmdline').read_bytes()!r}")
        except OSError:
            continue  # ended while we looked
    return found


def leftovers(cluster: SlurmCluster) -> list[str]:
    """What of ``cluster`` still exists on this machine (empty once it is torn down): its
    processes, namespaces, links, /etc/netns entries, registry record and files.
    """
    left = processes(cluster.conf)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    namespaces = {line.split()[0] for line in netns.stdout.splitlines() if line.strip()}
    left += [n.namespace for n in cluster.nodes if n.namespace in namespaces]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    for name in [cluster.bridge, *(n.veth for n in cluster.nodes)]:
        if f" {name}:" in links.stdout or f" {name}@" in links.stdout:
            left.append(name)
    left += [str(p) for n in cluster.nodes if (p := Path("/etc/netns") / n.namespace).exists()]
    left += [str(p) for p in REGISTRY.glob(f"{cluster.bridge[len('slb') :]}.json")]
    if cluster.work.exists():
        left.append(str(cluster.work))
    return left


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(2, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def state(cluster: SlurmCluster, job: str) -> list[str]:
    """The job's state, reason and (expected) start time, as squeue shows them."""
    return cluster.run("squeue", "-h", "-j", job, "-o", "%T|%r|%S").stdout.strip().split("|")


def job_state(cluster: SlurmCluster, job: str) -> str:
    """JobState as scontrol shows it (also once the job has ended, unlike squeue)."""
    return cluster.run("scontrol", "-o", "show", "job", job).stdout.split("JobState=")[1].split()[0]


def wait_state(cluster: SlurmCluster, job: str, *states: str, timeout: float = 30.0) -> None:
    """Until the job is in one of ``states`` ("": it has left squeue's list)."""
    wait_for(lambda: state(cluster, job)[0] in states, timeout, f"job {job} in {states}")


def sbatch(cluster: SlurmCluster, *args: str) -> str:
    out = f"--output={cluster.work}/job-%j.out"
    return cluster.run("sbatch", "--parsable", out, *args).stdout.strip()


def test_the_cluster_is_up(cluster: SlurmCluster) -> None:
    """A client command finds the cluster with ``env()`` merged into its environment."""
    sinfo = ["sinfo", "-h", "-N", "-o", "%N %P %t %c"]
    done = subprocess.run(
        sinfo, env={**os.environ, **cluster.env()}, capture_output=True, text=True, check=True
    )
    assert sorted(done.stdout.splitlines()) == [
        "node0 debug* idle 2",
        "node0 tiny idle 2",
        "node1 debug* idle 2",
    ]
    assert cluster.partitions == {"debug": ("node0", "node1"), "tiny": ("node0",)}
    assert cluster.node_names == ["node0", "node1"]
    assert cluster.conf.is_relative_to(cluster.work)


def test_a_batch_job_runs_a_step_on_both_nodes(cluster: SlurmCluster) -> None:
    job = sbatch(cluster, "--nodes", "2", "--wrap", "srun hostname")
    live = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
    wait_for(lambda: job_state(cluster, job) not in live, 30, f"job {job} to end")
    assert job_state(cluster, job) == "COMPLETED", cluster.logs()
    output = (cluster.work / f"job-{job}.out").read_text().split()
    assert sorted(output) == ["node0", "node1"], cluster.logs()


def test_srun_from_here_runs_on_both_nodes(cluster: SlurmCluster) -> None:
    done = cluster.run("srun", "--nodes", "2", "hostname")
    assert sorted(done.stdout.split()) == ["node0", "node1"]


def test_srun_from_here_runs_on_a_node_with_its_stdin_and_stdout(cluster: SlurmCluster) -> None:
    """The notebook's side: a step in a running allocation whose stdin and stdout are this
    process's pipes (slurmstepd connects back to srun, here, at the bridge's address).
    """
    job = sbatch(cluster, "--nodes", "2", "--wrap", "sleep 300")
    try:
        wait_state(cluster, job, "RUNNING")
        srun = ["srun", "--jobid", job, "--overlap", "-N1", "-n1", "-w", "node1"]
        code = "import socket; print(input().upper(), socket.gethostname())"
        done = cluster.run(*srun, cluster.python, "-c", code, input="ping\n")
        assert done.stdout.split() == ["PING", "node1"], done.stderr
    finally:
        cluster.run("scancel", job)
    wait_state(cluster, job, "CANCELLED", "")


def test_a_job_that_cannot_start_pends_with_its_reason(cluster: SlurmCluster) -> None:
    """The one-node partition is full: the next job pends (Resources) until it is cancelled."""
    busy = sbatch(cluster, "--partition", "tiny", "--ntasks", "2", "--wrap", "sleep 300")
    waiting = ""
    try:
        wait_state(cluster, busy, "RUNNING")
        waiting = sbatch(cluster, "--partition", "tiny", "--ntasks", "1", "--wrap", "true")
        wait_for(lambda: state(cluster, waiting)[1] != "None", 15, f"a reason for {waiting}")
        pending, reason, _start = state(cluster, waiting)
        assert (pending, reason) == ("PENDING", "Resources")
    finally:
        cluster.run("scancel", busy, *filter(None, [waiting]))
    for job in (busy, waiting):
        wait_state(cluster, job, "CANCELLED", "")
    assert not cluster.run("squeue", "-h").stdout.strip()


def test_nothing_is_left_after_the_cluster(tmp_path: Path) -> None:
    before = system_files()
    with slurm_cluster(2, tmp_path) as cluster:
        job = sbatch(cluster, "--nodes", "2", "--wrap", "srun sleep 300")
        wait_state(cluster, job, "RUNNING")
        wait_for(lambda: all(len(cluster.pids(i)) > 1 for i in range(2)), 15, "the step's tasks")
        running = "\n".join(leftovers(cluster))  # the check sees the cluster's every part:
        for part in ("munged", "slurmctld", "slurmd", "slurmstepd", "sleep", cluster.bridge):
            assert part in running, running
    assert not leftovers(cluster)
    assert system_files() == before


def test_nothing_is_left_after_an_exception(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), slurm_cluster(1, tmp_path) as cluster:
        1 / 0  # noqa: B018
    assert leftovers(cluster) == [str(cluster.work)]  # its logs stay, for the failure


def test_a_killed_run_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    """A run SIGKILLed inside the context leaves its daemons (in sessions of their own) and
    namespaces; ``reap_stale`` (which every ``slurm_cluster`` calls first) removes them.
    """
    script = f"""
        import sys
        from pathlib import Path
        from tests.slurm_cluster import slurm_cluster
        with slurm_cluster(1, Path({str(tmp_path)!r})) as cluster:
            print(cluster.conf, cluster.bridge, cluster.nodes[0].namespace, flush=True)
            sys.stdin.read()
    """
    argv = [sys.executable, "-c", textwrap.dedent(script)]
    child = subprocess.Popen(
        argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        conf, bridge, namespace = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    tag = bridge[len("slb") :]
    assert (REGISTRY / f"{tag}.json").exists()
    running = "\n".join(processes(Path(conf)))
    assert all(name in running for name in ("munged", "slurmctld", "slurmd")), running
    assert tag in reap_stale()
    assert not processes(Path(conf))
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert namespace not in netns.stdout
    assert bridge not in links.stdout
    assert not Path(f"/etc/netns/{namespace}").exists()
    assert not (REGISTRY / f"{tag}.json").exists()
