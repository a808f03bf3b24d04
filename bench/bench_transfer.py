"""Transfer benchmark: what the notebook sends for a 100 MiB global to 1, 2 and 4 SSH hosts.

The acceptance point of "Upload once per pool": what the notebook sends leaves it once per pool,
whatever the number of nodes; the first node passes it on to the others over the pool's own
network. Goal: the notebook's bytes stay 1x the global's size.

Everything comes from one run of this script, which builds four real SSH hosts (the largest of
``--hosts``) with ``tests.hosts.ssh_hosts`` (the project's one way to get real ``sshd`` hosts
without other machines, as ``bench_ssh.py`` does; it needs root, iproute2 and
``/usr/sbin/sshd``). Each host is an ``sshd`` in its own network namespace, its link a veth pair
on one bridge of this machine; the notebook (this process) is in the root namespace. A pool on
``n`` hosts uses the first ``n``, one rank each (``Pool(nodes=n, procs_per_node=1,
provider=SSHProvider(...), sync=())``).

What is measured, per round: ``pool.run("float(x.sum())", {"x": x})`` with ``x`` a fresh
``numpy.random.rand`` array of 100 MiB (``Pool.run`` sends every global it is given; a fresh array
also rules out any caching), timed from the call to the returned result (which every rank must get
right). **Notebook bytes** are the bridge's ``tx_bytes`` (``/sys/class/net/<bridge>/statistics``)
read before and after the call: everything the root namespace sent to the hosts, with SSH, TCP/IP
and Ethernet overhead; traffic between hosts is forwarded between their veths and does not count
there. **Head bytes** are the ``rx_bytes`` of host 0's bridge-side veth: what the head sent
(to the notebook and to the other hosts), where the relay's work shows.

The two sides, interleaved round by round in the same run (the order alternating):

* **relay**: as shipped; a global of ``transfer.RELAY_MIN_BYTES`` (1 MiB) or more goes to the head
  only, the other ranks fetch it from the head's relay over TCP.
* **relay_clear**: the relay without TLS (``relay_keys.ENCRYPTED`` False while that pool is
  made; requests are still authenticated): what encrypting the relay costs.
* **direct**: ``transfer.RELAY_MIN_BYTES`` set past any size in this process for the call, so
  every rank gets the value over its own SSH channel (the behaviour before the relay).

For each host count, one pool per side is started and kept warm across the rounds (both open at
once; an untimed round of each first); both are closed before the next host count. On one host
the relay is not used (one rank has no one to pass it to), so the two sides are the same code
there. The "network" is veths on one machine with the hosts sharing its CPUs, so the times are
the processes' own costs (pickling, SSH encryption, copies), not a real uplink's; the bytes are
what a real network would carry.

Run ``python bench/bench_transfer.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/transfer.json``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from bench_ssh import agents_left_after_close
from common import (
    REPO,
    BenchError,
    Script,
    Summary,
    command_line,
    count,
    load_avg,
    machine_info,
    machine_line,
    version,
)

from skyward_jupyter.flags import int_at_least

sys.path.insert(0, str(REPO))  # for tests.hosts (bench/ is first on the path, not the repo)

from skyward_jupyter import Pool, relay_keys, transfer
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider
from tests.hosts import Hosts, available, ssh_hosts

SCRIPT = Script("transfer")
MIB = 1 << 20
SIDES = ("relay", "relay_clear", "direct")
CELL = "float(x.sum())"


def provider(hosts: Hosts, n: int) -> SSHProvider:
    """The SSH provider on the first ``n`` hosts, as ``tests/test_ssh.py`` builds it."""
    options = SSHOptions(
        identity=str(hosts.client_key),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
        connect_timeout=5,
    )
    return SSHProvider([Host(h.address, hosts.user, h.port) for h in hosts.hosts[:n]], options)


def counter(device: str, which: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/{which}").read_text())


def one_round(pool: Pool, side: str, hosts: Hosts, size: int) -> dict[str, float]:
    """One timed cell with a fresh global; the notebook's and the head's bytes around it."""
    x = np.random.rand(size // 8)
    expected = float(x.sum())
    relay_min = transfer.RELAY_MIN_BYTES
    if side == "direct":
        transfer.RELAY_MIN_BYTES = 1 << 62
    try:
        tx0, head0 = counter(hosts.bridge, "tx_bytes"), counter(hosts[0].veth, "rx_bytes")
        t0 = time.perf_counter()
        result = pool.run(CELL, {"x": x})
        t1 = time.perf_counter()
        tx1, head1 = counter(hosts.bridge, "tx_bytes"), counter(hosts[0].veth, "rx_bytes")
    finally:
        transfer.RELAY_MIN_BYTES = relay_min
    if not result.ok or result.values != [expected] * len(result.values):
        raise BenchError(f"the {side} cell failed or got a wrong sum: {result.errors!r}")
    return {
        "seconds": t1 - t0,
        "notebook_bytes": float(tx1 - tx0),
        "head_bytes": float(head1 - head0),
    }


def make_pool(hosts: Hosts, n: int, side: str) -> Pool:
    encrypted = relay_keys.ENCRYPTED
    relay_keys.ENCRYPTED = side != "relay_clear"
    try:
        return Pool(nodes=n, procs_per_node=1, provider=provider(hosts, n), sync=())
    finally:
        relay_keys.ENCRYPTED = encrypted


def measure(hosts: Hosts, n: int, reps: int, warmup: int, size: int) -> dict[str, Any]:
    """Both sides on ``n`` hosts, interleaved round by round, each on its own warm pool."""
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    with contextlib.ExitStack() as stack:
        pools = {side: stack.enter_context(make_pool(hosts, n, side)) for side in SIDES}
        # Heartbeats and the like: what the open pools send with no cell running.
        t0, tx0 = time.perf_counter(), counter(hosts.bridge, "tx_bytes")
        time.sleep(2.0)
        idle = (counter(hosts.bridge, "tx_bytes") - tx0) / (time.perf_counter() - t0)
        for i in range(warmup + reps):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            got = {side: one_round(pools[side], side, hosts, size) for side in order}
            label = f"round {i - warmup + 1}/{reps}" if i >= warmup else f"warm-up {i + 1}"
            print(
                f"  {n} host(s) {label}: "
                + ", ".join(
                    f"{side} {got[side]['seconds']:.2f} s, notebook "
                    f"{got[side]['notebook_bytes'] / size:.3f}x, head "
                    f"{got[side]['head_bytes'] / size:.3f}x"
                    for side in order
                ),
                file=sys.stderr,
                flush=True,
            )
            if i >= warmup:
                for side, values in got.items():
                    for key, value in values.items():
                        samples[side].setdefault(key, []).append(value)
    out: dict[str, Any] = {"hosts": n, "idle_notebook_bytes_per_s": idle, "samples": samples}
    for side in SIDES:
        out[f"{side}_seconds"] = asdict(Summary.of(samples[side]["seconds"]))
        for key in ("notebook_bytes", "head_bytes"):
            ratios = [b / size for b in samples[side][key]]
            out[f"{side}_{key}_over_size"] = asdict(Summary.of(ratios))
    out["ratio_seconds_relay_over_direct"] = (
        out["relay_seconds"]["median"] / out["direct_seconds"]["median"]
    )
    out["ratio_seconds_relay_over_relay_clear"] = (
        out["relay_seconds"]["median"] / out["relay_clear_seconds"]["median"]
    )
    out["ratio_notebook_bytes_direct_over_relay"] = statistics.median(
        samples["direct"]["notebook_bytes"]
    ) / statistics.median(samples["relay"]["notebook_bytes"])
    return out


def run_all(args: Any) -> dict[str, Any]:
    """Everything, with hosts and pools torn down however it ends."""
    size = args.mib * MIB
    counts = sorted(set(args.hosts))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_transfer_")))
        print(f"making {counts[-1]} SSH hosts in network namespaces", file=sys.stderr, flush=True)
        hosts = stack.enter_context(ssh_hosts(counts[-1], tmp))
        rows = []
        for n in counts:
            print(
                f"{n} host(s): {args.reps} interleaved rounds after {args.warmup} warm-up",
                file=sys.stderr,
                flush=True,
            )
            rows.append(measure(hosts, n, args.reps, args.warmup, size))
            left = agents_left_after_close(hosts)
            if left:
                raise BenchError(f"SSH ranks still running on the hosts after close: {left}")
    return {
        "rows": rows,
        "global_bytes": size,
        "relay_min_bytes": transfer.RELAY_MIN_BYTES,
        "reps": args.reps,
        "warmup": args.warmup,
        "remote_ranks_left": 0,
    }


# ------------------------------------------------------------------------------ markdown


def render_markdown(report: dict[str, Any]) -> str:
    m, rows = report["machine"], report["rows"]
    mib = report["global_bytes"] // MIB

    def x(s: dict[str, float]) -> str:
        return f"{s['median']:.3f}x"

    def sec(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"

    table = [
        "| hosts | notebook bytes / global, **relay** | notebook bytes / global, direct "
        "| head sent / global, relay | time, **relay** | time, direct "
        "| time, relay without TLS | time relay/direct (medians) | relay TLS/cleartext |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        table.append(
            f"| {r['hosts']} | **{x(r['relay_notebook_bytes_over_size'])}** "
            f"| {x(r['direct_notebook_bytes_over_size'])} | {x(r['relay_head_bytes_over_size'])} "
            f"| {sec(r['relay_seconds'])} | {sec(r['direct_seconds'])} "
            f"| {sec(r['relay_clear_seconds'])} "
            f"| **{r['ratio_seconds_relay_over_direct']:.2f}** "
            f"| {r['ratio_seconds_relay_over_relay_clear']:.2f} |"
        )
    worst = max(r["relay_notebook_bytes_over_size"]["max"] for r in rows)
    most = rows[-1]
    idle = max(r["idle_notebook_bytes_per_s"] for r in rows)
    lines = [
        f"## Transfer: a {mib} MiB global to 1, 2 and 4 hosts, sent once per pool",
        "",
        machine_line(m, {"asyncssh": m["asyncssh"], "numpy": m["numpy"]}),
        "",
        f'`pool.run("{CELL}", {{"x": x}})` with `x` a fresh {mib} MiB `numpy.random.rand` array '
        "each round, on SSH hosts made by `tests/hosts.py` (an `sshd` each in its own network "
        "namespace on a bridge of this machine, one rank per host). **relay**: the package as "
        f"shipped: a global of {report['relay_min_bytes'] // MIB} MiB or more goes to the head "
        "only, the other ranks fetch it from the head's relay. **direct**: `transfer."
        "RELAY_MIN_BYTES` set past any size for the call, so every rank gets it over its own SSH "
        "channel (the behaviour before the relay). **relay without TLS**: the relay's TLS "
        "turned off for that pool (requests still authenticated), to show what encryption costs. "
        "Every side on its own warm pool, open at "
        f"once, interleaved round by round: {report['reps']} counted rounds each after "
        f"{report['warmup']} untimed. Medians; times with (min-max).",
        "",
        *table,
        "",
        "Notebook bytes: the bridge's `tx_bytes` around the call, everything the notebook's "
        "namespace sent to the hosts, SSH, TCP/IP and Ethernet overhead included (traffic between "
        "hosts is forwarded between their links and not counted there). Head sent: the `rx_bytes` "
        "of host 0's link on the bridge, what the head sent to the notebook and to the other "
        f"hosts. With the relay the notebook's bytes were at most {worst:.3f}x the global's size "
        f"in any round; direct, {x(most['direct_notebook_bytes_over_size'])} on "
        f"{most['hosts']} hosts. With the pools open and no cell running the notebook sent about "
        f"{idle:.0f} bytes/s (heartbeats), "
        "included in the figures. On one host the relay is not used (no other rank to pass it "
        "to): both sides run the same code there. The hosts share this machine's CPUs and the "
        "link adds almost no latency, so the times are the processes' own costs (pickling, SSH "
        "encryption, copies), not an uplink's; the bytes are what a real network would carry.",
        "",
        f"No SSH rank was left running on the hosts after the pools were closed "
        f"({report['remote_ranks_left']} found); hosts and pools were torn down at the end.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--reps", 5, "counted rounds per host count")
    count(parser, "--warmup", 1, "untimed rounds of each first", minimum=0)
    count(parser, "--mib", 100, "size of the global in MiB", minimum=2)
    parser.add_argument(
        "--hosts", type=int_at_least(1), nargs="+", default=[1, 2, 4], help="host counts to measure"
    )
    args = SCRIPT.parse_args(parser, argv)
    if (why := available()) is not None:
        raise SystemExit(f"bench_transfer.py cannot make SSH test hosts here: it {why}")

    load_before = load_avg()
    results = run_all(args)
    machine = machine_info(load_before)
    machine["asyncssh"] = version("asyncssh")
    machine["numpy"] = version("numpy")
    report: dict[str, Any] = {"machine": machine, "command": command_line(), **results}
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
