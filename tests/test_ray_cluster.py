"""The Ray test cluster (tests/ray_cluster.py): a driver here reaches the nodes in their
namespaces, placement groups spread over them, actors in bundles run programs, a wrong address
fails in bounded time, and nothing is left after the cluster, even after a killed run.

Each driver is a subprocess: ``ray.init`` changes its process for good (hooks, handlers, threads),
which the other test modules would inherit. One of them connects, shuts down and connects again,
as the provider will in the notebook's process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import hosts
from .hosts import netns_pids
from .ray_cluster import (
    MARKER,
    PREFIX,
    REGISTRY,
    RayCluster,
    available,
    ray_cluster,
    reap_stale,
)

pytestmark = pytest.mark.skipif(available() is not None, reason=f"ray cluster: {available()}")

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
# A driver's prelude: connect as the notebook would; `out` hands a value back to the test.
PRELUDE = """\
import json, subprocess, sys, time
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

def out(value):
    print("OUT " + json.dumps(value), flush=True)

ray.init(**json.loads(sys.argv[1]))
"""
# ray.init against an address where no GCS answers retries for about 14 minutes by default
# (20 tries of 5 s + 5 s + 30 s); these make it 4 s. Ray reads them when it is imported.
FAST_FAIL = {
    "RAY_gcs_server_port_wait_time_s": "1",  # tries
    "RAY_gcs_rpc_server_connect_timeout_s": "1",
    "RAY_py_gcs_connect_timeout_s": "1",
}


def drive(cluster: RayCluster, body: str, timeout: float = 120.0) -> list[Any]:
    """Run ``body`` in a driver process connected to the cluster; the values it ``out``s."""
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run(
        [PYTHON, "-c", code, json.dumps(cluster.init_kwargs)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(
            f"driver exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}\n"
            + cluster.tails()
        )
    return [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("OUT ")]


def leftovers(tag: str) -> list[str]:
    """What of cluster ``tag`` still exists on this machine (empty once it is torn down)."""
    left = []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [line.split()[0] for line in namespaces.splitlines() if f"{PREFIX}{tag}-" in line]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [w for w in links.split() if f"srb{tag}" in w or f"srv{tag}-" in w]
    left += [str(p) for p in (Path(f"/tmp/sr{tag}"), REGISTRY / f"{tag}.json") if p.exists()]
    for proc in Path("/proc").iterdir():  # Ray's processes: by their marker, by their files
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # not a process, or it ended while we looked
        if stat[0] not in "ZX" and (
            f"{MARKER}={tag}".encode() in environ or f"/tmp/sr{tag}/".encode() in cmdline
        ):
            left.append(f"pid {proc.name}: {cmdline[:200]!r}")
    return left


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    started = time.monotonic()
    with ray_cluster(tmp_path_factory.mktemp("ray")) as c:
        print(f"ray cluster up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield c
        memory = {name: f"{size / 2**20:.0f} MiB" for name, size in c.memory().items()}
        print(f"ray cluster memory (PSS): {memory}", file=sys.stderr)
    assert not leftovers(c.tag)


def test_a_driver_here_sees_the_head_and_the_worker_alive(cluster: RayCluster) -> None:
    (nodes, me) = drive(
        cluster,
        """
        out({n["NodeID"]: [n["Alive"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0)]
             for n in ray.nodes()})
        out([ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()])
        """,
    )
    head, worker, notebook = cluster.head, cluster.workers[0], cluster.notebook
    assert nodes == {
        head.node_id: [True, head.address, 2],
        worker.node_id: [True, worker.address, 2],
        notebook.node_id: [True, notebook.address, 0],
    }
    assert me == [notebook.node_id, notebook.address]  # the driver is on the notebook's node


def test_strict_spread_bundles_run_on_different_nodes(cluster: RayCluster) -> None:
    (ips, available_before, available_after) = drive(
        cluster,
        """
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=60)

        @ray.remote(num_cpus=1)
        def where():
            return ray.util.get_node_ip_address()

        def in_bundle(i):
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        out(ray.get([where.options(scheduling_strategy=in_bundle(i)).remote() for i in (0, 1)]))
        out(ray.available_resources().get("CPU", 0))
        remove_placement_group(pg)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        out(ray.available_resources().get("CPU", 0))
        """,
    )
    assert sorted(ips) == sorted([cluster.head.address, cluster.workers[0].address])
    assert available_before == 2  # the group holds one CPU on each node
    assert available_after == 4  # removed, it holds none


def test_an_actor_in_a_bundle_runs_a_program(cluster: RayCluster) -> None:
    (result,) = drive(
        cluster,
        """
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=60)

        @ray.remote(num_cpus=1)
        class Rank:
            def run(self, argv):
                done = subprocess.run(argv, capture_output=True, text=True, check=True)
                return [ray.util.get_node_ip_address(), done.stdout]

        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
        rank = Rank.options(scheduling_strategy=strategy).remote()
        argv = [sys.executable, "-c", "import torch; print(torch.__version__)"]
        out(ray.get(rank.run.remote(argv), timeout=120))
        ray.kill(rank)
        remove_placement_group(pg)
        """,
    )
    import torch

    ip, stdout = result
    assert ip in (cluster.head.address, cluster.workers[0].address)
    assert stdout.strip() == torch.__version__


def test_connect_shut_down_and_connect_again_in_one_process(cluster: RayCluster) -> None:
    rounds = drive(
        cluster,
        """
        @ray.remote(num_cpus=1)
        def where():
            return ray.util.get_node_ip_address()

        out(ray.get(where.remote(), timeout=60))
        ray.shutdown()
        out(ray.is_initialized())
        ray.init(**json.loads(sys.argv[1]))
        out(ray.get(where.remote(), timeout=60))
        ray.shutdown()
        """,
    )
    nodes = {cluster.head.address, cluster.workers[0].address}
    assert rounds[0] in nodes and rounds[1] is False and rounds[2] in nodes


@pytest.mark.parametrize("where", ["nowhere", "silent", "refused"])
def test_an_address_without_a_gcs_fails_in_bounded_time(cluster: RayCluster, where: str) -> None:
    """A ConnectionError naming the address; its cause (a RuntimeError) holds a traceback."""
    subnet = cluster.subnet.rsplit(".", 1)[0]
    address = {
        "nowhere": "10.255.255.1:6379",  # here a proxy answers it (HTTP 404); elsewhere silence
        "silent": f"{subnet}.250:6379",  # on the bridge, no such host: nothing answers
        "refused": f"{cluster.head.address}:6380",  # the head answers with a reset
    }[where]
    code = """\
        import sys, time, ray
        started = time.monotonic()
        try:
            ray.init(address=sys.argv[1])
        except Exception as e:
            print(type(e).__name__, time.monotonic() - started, str(e), sep="\\t")
        """
    done = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code), address],
        capture_output=True, text=True, timeout=120, env={**os.environ, **FAST_FAIL},
    )  # fmt: skip
    kind, seconds, message = done.stdout.strip().split("\t")
    print(f"{address}: {kind} after {float(seconds):.1f} s: {message}", file=sys.stderr)
    assert kind == "ConnectionError"
    assert message == f"Failed to connect to Ray cluster at {address}"
    assert float(seconds) < 20


def test_nothing_is_left_after_an_exception_with_a_driver_here(tmp_path: Path) -> None:
    """A driver in the test's own process (shut down by the cluster) and a detached actor (whose
    worker outlives every driver): after an exception in the context, nothing is left.
    """
    code = f"""\
        import os
        import ray
        from pathlib import Path
        from tests.ray_cluster import ray_cluster

        try:
            with ray_cluster(Path({str(tmp_path)!r}), workers=0) as c:
                print("TAG", c.tag, flush=True)
                ray.init(**c.init_kwargs)

                @ray.remote(num_cpus=1)
                class Keeper:
                    def pid(self):
                        return os.getpid()

                keeper = Keeper.options(lifetime="detached", name="keeper").remote()
                print("KEEPER", ray.get(keeper.pid.remote()), flush=True)
                1 / 0
        except ZeroDivisionError:
            print("DRIVER", ray.is_initialized(), flush=True)
        """
    done = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    said = dict(
        line.split()
        for line in done.stdout.splitlines()
        if line.startswith(("TAG", "KEEPER", "DRIVER"))
    )
    tag, initialized = said["TAG"], said["DRIVER"]
    assert initialized == "False"
    assert not leftovers(tag)
    assert not hosts._alive(int(said["KEEPER"]))


def test_a_killed_run_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    """A run SIGKILLed inside the context leaves its cluster; ``reap_stale`` (which every
    ``ray_cluster`` calls first) removes it: processes, namespaces, links, files.
    """
    code = f"""\
        import sys
        from pathlib import Path
        from tests.ray_cluster import ray_cluster

        with ray_cluster(Path({str(tmp_path)!r}), workers=0) as c:
            print(c.tag, c.head.namespace, flush=True)
            sys.stdin.read()
        """
    child = subprocess.Popen(
        [PYTHON, "-c", textwrap.dedent(code)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        tag, namespace = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert netns_pids(namespace)  # the head's processes outlive the run
    assert leftovers(tag)

    assert tag in reap_stale()
    assert not leftovers(tag)
