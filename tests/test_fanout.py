"""Large values fan out among the nodes: 8 SSH hosts in network namespaces, 4 ranks each.

A global of a few MiB goes from the notebook to the head once, the nodes pass it on in a tree
of their relays, and the ranks of a node share one copy. Bytes are counted on each host's link
(its veth on the bridge): ``rx_bytes`` of the bridge-side end is what the host sent,
``tx_bytes`` what it received.
"""

from __future__ import annotations

import pwd
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from skyward_jupyter import Pool
from skyward_jupyter.agent.node_blobs import NodeBlobs
from skyward_jupyter.frameworks import Frameworks

from .conftest import ssh_hosts_fixture, wait_for
from .hosts import Hosts, available, ssh_provider

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

NODES, PER_NODE = 8, 4

hosts = ssh_hosts_fixture(NODES, "fanout-hosts")


@pytest.fixture(scope="module")
def pool(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """The pool; once it is closed, every node's store of large values is gone with it."""
    provider = ssh_provider(hosts, NODES, tmp_path_factory.mktemp("fanout"))
    with Pool(NODES, PER_NODE, provider=provider, frameworks=Frameworks(torch=False)) as made:
        made.run("1").raise_for_errors()
        relay = made._ranks.settings.relay
        assert relay is not None
        base = Path(f"/dev/shm/skyward-{pwd.getpwnam(hosts.user).pw_uid}")
        stores = [NodeBlobs(relay.token, i, base).dir for i in range(NODES)]
        assert all(store.is_dir() for store in stores), stores
        yield made
    wait_for(lambda: not any(s.exists() for s in stores), 10, "the nodes' stores to go")


def _link(hosts: Hosts, i: int, which: str) -> int:
    return int(Path(f"/sys/class/net/{hosts[i].veth}/statistics/{which}").read_text())


def _links(hosts: Hosts) -> list[tuple[int, int]]:
    """Per host: (bytes it sent, bytes it received) on its link so far."""
    return [(_link(hosts, i, "rx_bytes"), _link(hosts, i, "tx_bytes")) for i in range(NODES)]


CELL = r"""
import os, re
node = os.environ["GROUP_RANK"]
copy = re.compile(rf"/skyward-\d+/[0-9a-f]{{20}}-n{node}/[0-9a-f]{{64}}( \(deleted\))?$")
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
