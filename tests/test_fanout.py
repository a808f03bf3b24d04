"""Large values fan out among the nodes: 8 SSH hosts in network namespaces, 4 ranks each.

A global of a few MiB goes from the notebook to the head once, the nodes pass it on in a tree
of their relays, and the ranks of a node share one copy. Bytes are counted on each host's link
(its veth on the bridge): ``rx_bytes`` of the bridge-side end is what the host sent,
``tx_bytes`` what it received.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import pwd
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from skyward_jupyter import Pool
from skyward_jupyter import protocol as p
from skyward_jupyter.agent.node_blobs import NodeBlobs
from skyward_jupyter.environments import Packages, notebook_uv, uv_tarball, wheels_tarball
from skyward_jupyter.failure_policy import Cell
from skyward_jupyter.frameworks import Frameworks

from .conftest import ssh_hosts_fixture, wait_for
from .hosts import Hosts, available, ssh_provider

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

NODES, PER_NODE = 8, 4

hosts = ssh_hosts_fixture(NODES, "fanout-hosts")


SHIPPED = Packages(("sympy",), wheels=True)
"""What the pool's nodes install, from wheels the notebook sends (sympy and mpmath: about 7 MB,
with uv where the notebook has it): the hosts reach no index."""


@dataclass
class Start:
    """The module's pool, and the bytes on each link while it started."""

    pool: Pool
    before: list[tuple[int, int]]
    after: list[tuple[int, int]]
    uplink: int
    """What the notebook sent the hosts meanwhile."""
    wheels: Path
    """The folder of wheels the notebook downloaded for the hosts."""


@pytest.fixture(scope="module")
def started(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    """The pool, started with ``--ship-wheels``; once it is closed, every node's store of
    large values is gone with it.
    """
    tmp = tmp_path_factory.mktemp("fanout")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SKYWARD_WHEELS", str(tmp / "wheels"))
        provider = ssh_provider(hosts, NODES, tmp)
        before, uplink = _links(hosts), _uplink(hosts)
        with Pool(
            NODES, PER_NODE, provider=provider, frameworks=Frameworks(torch=False), packages=SHIPPED
        ) as made:
            after, uplink = _links(hosts), _uplink(hosts) - uplink
            made.run("1").raise_for_errors()
            relay = made._ranks.settings.relay
            assert relay is not None
            # named as the hosts' login names them: by its id, where this process's would be
            uid, shm = pwd.getpwnam(hosts.user).pw_uid, Path("/dev/shm")
            mine = [NodeBlobs(relay.token, i, shm).dir.name for i in range(NODES)]
            ours = f"skyward-values-{os.getuid()}-"
            stores = [shm / name.replace(ours, f"skyward-values-{uid}-", 1) for name in mine]
            assert all(store.is_dir() for store in stores), stores
            yield Start(made, before, after, uplink, next((tmp / "wheels").iterdir()))
    wait_for(lambda: not any(s.exists() for s in stores), 10, "the nodes' stores to go")


@pytest.fixture(scope="module")
def pool(started: Start) -> Pool:
    return started.pool


def _link(hosts: Hosts, i: int, which: str) -> int:
    return int(Path(f"/sys/class/net/{hosts[i].veth}/statistics/{which}").read_text())


def _uplink(hosts: Hosts) -> int:
    """What the notebook (this machine's root namespace) has sent to the hosts so far."""
    return int(Path(f"/sys/class/net/{hosts.bridge}/statistics/tx_bytes").read_text())


def _links(hosts: Hosts) -> list[tuple[int, int]]:
    """Per host: (bytes it sent, bytes it received) on its link so far."""
    return [(_link(hosts, i, "rx_bytes"), _link(hosts, i, "tx_bytes")) for i in range(NODES)]


CELL = r"""
import os, re
node = os.environ["GROUP_RANK"]
copy = re.compile(rf"/skyward-values-\d+-[0-9a-f]{{20}}-n{node}/[0-9a-f]{{64}}( \(deleted\))?$")
mapped = any(copy.search(line) for line in open("/proc/self/maps"))
x[0] = -1.0  # each rank's own value: a copy-on-write page, not its neighbours'
(int(x[1:].sum()), mapped, bool(x.flags.owndata))
"""


def test_a_large_global_crosses_each_link_once_and_the_head_sends_it_at_most_twice(
    hosts: Hosts, pool: Pool
) -> None:
    """32 ranks on 8 nodes get a 6 MiB global. The head sends it twice at most (to its two
    children in the tree, not once per rank), each other node receives it once for its 4 ranks,
    and every rank reads it from a mapping of its node's one copy, writable (its own pages).
    """
    value = np.random.default_rng(0).integers(0, 1 << 20, 6 << 17)  # 6 MiB
    size = value.nbytes
    before = _links(hosts)
    result = pool.run(CELL, {"x": value}, timeout=120)
    after = _links(hosts)
    sent = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    received = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert result.values == [(int(value[1:].sum()), True, False)] * NODES * PER_NODE, result.errors
    shares = f"sent/size {[round(s / size, 2) for s in sent]}, received/size " + str(
        [round(r / size, 2) for r in received]
    )
    assert sent[0] < 2.2 * size, shares
    assert all(size < r < 1.3 * size for r in received), shares
    assert sum(sent) < (NODES - 1 + 0.5) * size, shares


def test_the_same_large_global_sent_again_reaches_every_rank(pool: Pool) -> None:
    """A value the nodes dropped after one cell (the same global sent again, as after a rank's
    restart) is kept again on every node, not thrown away as it arrives.
    """
    value = np.random.default_rng(1).integers(0, 1 << 20, 1 << 18)  # 2 MiB
    for _ in range(2):
        result = pool.run("int(x.sum())", {"x": value}, timeout=30)
        assert result.values == [int(value.sum())] * NODES * PER_NODE, result.errors


def test_sending_to_a_rank_whose_channel_closed_leaves_its_end_to_the_failure_policy(
    pool: Pool,
) -> None:
    """A rank's channel closes (its process ended, or the pool killed it) before its reader has
    seen it: what a cell's end sends it then (the drop of its relayed values, the failure
    policy's "leave the group") must not raise a broken pipe over the real cause. The rank's
    end is then reported as any other, and the next cell runs on every rank again.
    """
    ranks = pool._ranks
    victim = next(r for r in ranks.all if r.node.index == 1 and r.local_rank == 0)
    assert pool._io is not None and victim.process is not None

    async def close_then_send() -> None:
        victim.process._process.close()  # as when the rank ended: asyncssh marks it closed
        assert victim.alive  # its reader has not run since
        pool._transfer.drop(["0" * 64])
        cell = Cell(0, ranks, [], None, 1.0)
        cell.outcomes[victim] = p.CellDone(0, None, None, p.ErrorInfo("E", "e", ""), 0.0)
        cell._free_peers()

    pool._io.submit(close_then_send()).result(30)
    wait_for(lambda: not victim.alive, 30, "the pool to see the rank's end")
    result = pool.run("1", timeout=120)
    assert result.values == [1] * NODES * PER_NODE, result.errors
    assert victim.index in result.lost, result.lost


def test_a_rank_killed_during_a_cell_is_named_with_its_signal_and_the_pool_goes_on(
    pool: Pool,
) -> None:
    """Node 2's first rank is killed (as the OOM killer does) while the cell with a relayed value
    runs: its result says so, the others' results stand, and the next cell runs everywhere.
    """
    value = np.random.default_rng(2).integers(0, 1 << 20, 1 << 18)  # 2 MiB
    cell = "import os\nif os.environ['RANK'] == '8': os.kill(os.getpid(), 9)\n1"
    result = pool.run(cell, {"x": value}, timeout=60)
    lost = [e for e in result.errors if not e.secondary]
    assert [e.rank for e in lost] == [8] and "killed by SIGKILL" in lost[0].message, result.errors
    assert pool.run("1", timeout=60).values == [1] * NODES * PER_NODE


def test_wheels_for_hosts_without_an_index_leave_the_notebook_once_and_the_hosts_pass_them_on(
    started: Start,
) -> None:
    """``--ship-wheels`` on 8 hosts: what the notebook sends for their packages (the wheels, and
    uv where it has it) crosses its uplink once, to one host; the hosts pass it on in a tree, so
    none sends more than two copies and each receives one. Every rank finds the package.
    """
    result = started.pool.run("import importlib.metadata as m\nm.version('sympy')", timeout=60)
    assert result.values == [metadata.version("sympy")] * NODES * PER_NODE, result.errors
    uv = notebook_uv()
    size = len(wheels_tarball(started.wheels)) + (len(uv_tarball(uv)[1]) if uv else 0)
    pairs = zip(started.after, started.before, strict=True)
    sent, received = zip(*((a[0] - b[0], a[1] - b[1]) for a, b in pairs), strict=True)
    shares = (
        f"uplink/size {started.uplink / size:.2f}, sent/size {[round(s / size, 2) for s in sent]}"
        f", received/size {[round(r / size, 2) for r in received]}"
    )
    # The start's own traffic (this package's tarball, SSH, 4 ranks) is under 1 MiB a host.
    slack = 1 << 20
    assert started.uplink < size + NODES * slack, shares
    assert all(s < 2.2 * size + slack for s in sent), shares
    assert all(size < r < 1.3 * size + slack for r in received), shares
