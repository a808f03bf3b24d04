"""The Ray provider against a real Ray cluster: a head and a worker in network namespaces.

A pool is a placement group with a bundle per node; each rank is an actor in its node's bundle
that runs the agent and relays its wire. Covered: a DDP cell over two nodes, a failing rank, an
interrupt, a killed notebook (Ray ends its actors and placement group), and no cluster at the
address as a one-line error.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.ray import RayProvider

from .conftest import agents_among, hold_rank_ones_gil, wait_for
from .ray_cluster import RayCluster, available, ray_cluster

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "(t.item(), __import__('os').environ['MASTER_ADDR'])"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    import ray

    with ray_cluster(tmp_path_factory.mktemp("ray"), workers=1, cpus=2) as made:
        try:
            yield made
        finally:
            ray.shutdown()


def _provider(cluster: RayCluster) -> RayProvider:
    kw = cluster.init_kwargs
    return RayProvider(kw["address"], init={"_node_ip_address": kw["_node_ip_address"]})


def _groups() -> list[Any]:
    from ray.util.placement_group import placement_group_table

    return [g for g in placement_group_table().values() if g["state"] != "REMOVED"]


def test_a_ddp_cell_on_two_ray_nodes_and_everything_released(cluster: RayCluster) -> None:
    provider = _provider(cluster)
    with Pool(nodes=2, provider=provider, interrupt_grace=3) as pool:
        assert sorted(n.address for n in pool.nodes) == sorted(
            [cluster.head.address, *(w.address for w in cluster.workers)]
        )
        result = pool.run(ALL_REDUCE)
        assert [v[0] for v in result.values] == [3.0, 3.0], result.errors
        # The ranks' wires cross the bridge, and this cluster has no TLS: the pool says so.
        assert any("RAY_USE_TLS" in w for w in provider.warnings), provider.warnings
        assert len(_groups()) == 1
        group = provider.record({})["placement_group"]
        assert all(f"group {group[:12]}" in (n.instance_type or "") for n in pool.nodes)
        failed = pool.run("if dist.get_rank() == 1:\n    raise ValueError('rank one says no')")
        (cause,) = [e for e in failed.errors if not e.secondary]
        assert cause.rank == 1 and "rank one says no" in cause.message and "ray node" in cause.where
        timer = threading.Timer(3.0, pool.interrupt)
        timer.start()
        stopped = pool.run("import time\nprint('working', flush=True)\ntime.sleep(60)")
        timer.join()
        assert {e.type_name for e in stopped.errors} == {"KeyboardInterrupt"}
        assert pool.run(ALL_REDUCE).ok
    wait_for(lambda: not _groups(), 20, "the placement group to be removed")


def test_a_rank_holding_its_gil_on_a_ray_node_runs_on_and_is_said_busy(
    cluster: RayCluster,
) -> None:
    """Rank 1 computes in C without letting its GIL go for over twice the heartbeat timeout:
    its actor looks at its process on its node, so it is left to finish and the user told why.
    (The timeout leaves room for beats relayed through Ray's calls on a loaded machine.)
    """
    with Pool(nodes=2, provider=_provider(cluster), heartbeat_timeout=5.0) as pool:
        result, busy = hold_rank_ones_gil(pool, seconds=12.0)
    assert result.values == ["done", "done"] and not result.lost, result.errors
    assert len(busy) == 1 and "yet its process runs" in busy[0] and "ray node" in busy[0], busy
    wait_for(lambda: not _groups(), 20, "the placement group to be removed")


def test_no_cluster_at_the_address_is_one_line(cluster: RayCluster) -> None:
    import ray

    ray.shutdown()  # a fresh driver, as a new kernel has
    provider = RayProvider("10.255.255.1:6379", init={"_node_ip_address": cluster.notebook.address})
    with pytest.raises(ProviderError, match=r"10\.255\.255\.1:6379"):
        Pool(nodes=1, provider=provider).start()
    ray.shutdown()


def test_a_killed_notebook_leaves_nothing_in_the_cluster(
    cluster: RayCluster, tmp_path: Path
) -> None:
    import ray

    kw = cluster.init_kwargs
    script = tmp_path / "notebook.py"
    script.write_text(
        textwrap.dedent(f"""
            import time
            from skyward_jupyter import Pool
            from skyward_jupyter.providers.ray import RayProvider
            provider = RayProvider(
                {kw["address"]!r}, init={{"_node_ip_address": {kw["_node_ip_address"]!r}}}
            )
            pool = Pool(nodes=2, provider=provider).start()
            print("ready", flush=True)
            time.sleep(600)
        """)
    )
    notebook = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert notebook.stdout is not None
        assert notebook.stdout.readline().strip() == "ready"
        if not ray.is_initialized():
            ray.init(**kw)
        assert len(_groups()) == 1
        assert len(_agents(cluster)) == 2
    finally:
        notebook.kill()
        notebook.wait()
    wait_for(lambda: not _groups(), 60, "Ray to remove the dead notebook's placement group")
    wait_for(lambda: not _agents(cluster), 30, "the ranks' agents to end")


def _agents(cluster: RayCluster) -> list[int]:
    return agents_among(cluster.pids())
