"""Fan-out benchmark: a large global to 2, 4 and 8 SSH hosts of 4 ranks each.

The acceptance point of "Fan-out that does not grow at the head": a large value crosses each
node's link once, the nodes pass it on among themselves in a tree, so the head sends at most
twice the value whatever the number of nodes, and the time grows as log N or better.

Everything comes from one run of this script, which builds eight real SSH hosts (the largest of
``--nodes``) with ``tests.hosts.ssh_hosts`` (an ``sshd`` each in its own network namespace, its
link a veth pair on one bridge of this machine; it needs root, iproute2 and ``/usr/sbin/sshd``).
A pool on ``n`` hosts uses the first ``n``, ``--per-node`` ranks each, ``--framework none``.

What is measured, per round: a fresh ``numpy.random.rand`` array of ``--mib`` MiB reaches every
rank, which answers its sum; the time from the call to the result. Bytes per link come from the
veths' counters around the round: **head sent** is the ``rx_bytes`` of host 0's bridge-side
veth, **most received** the largest ``tx_bytes`` of any host's, **notebook sent** the bridge's
``tx_bytes``.

The three sides, interleaved round by round in the same run (the order rotating):

* **fanout**: as shipped (``pool.run("float(x.sum())", {"x": x})``): the value goes to the head,
  the nodes pass it on in a binary tree of their relays, each node's ranks map its one copy.
* **before**: the same call on the package as it was before the fan-out (``--before``, a commit
  of this repository, extracted to a temporary folder and run in a process of its own on the
  same hosts): the head's relay served the value once per other rank.
* **scp**: what a user would do without either: ``numpy.save`` to a file, ``scp`` it to every
  host at once, then a cell in which every rank loads it (``numpy.load``).

For each host count both pools are started and kept warm across the rounds (an untimed round
of each side first); both are closed before the next host count. The hosts share this
machine's CPUs and the links add almost no latency, so the times are the processes' own costs
(TLS, SSH encryption, copies, unpickling) on a shared machine, not a real network's; the bytes
are what a real network would carry.

Run ``python bench/bench_fanout.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/fanout.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import numpy as np
from bench_ssh import agents_left_after_close
from common import (
    REPO,
    BenchError,
    Script,
    Summary,
    command_line,
    load_avg,
    machine_info,
    machine_line,
    rotated,
    version,
)

sys.path.insert(0, str(REPO))  # for tests.hosts (bench/ is first on the path, not the repo)

from skyward_jupyter import Pool
from skyward_jupyter.frameworks import Frameworks
from tests.hosts import Hosts, available, ssh_hosts, ssh_provider

SCRIPT = Script("fanout")
MIB = 1 << 20
SIDES = ("fanout", "before", "scp")
CELL = "float(x.sum())"
BEFORE = "953c956"
"""The last commit whose head served a large value once per other rank."""
REMOTE = "fanout-x.npy"
"""The file the scp side sends, in the login's home on each host."""

DRIVER = r"""
import json, sys, time
import numpy as np
from skyward_jupyter import Pool
from skyward_jupyter.frameworks import Frameworks
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider

args = json.loads(sys.stdin.readline())
options = SSHOptions(identity=args["identity"], known_hosts=args["known_hosts"],
                     python=sys.executable, connect_timeout=5)
provider = SSHProvider([Host(a, args["user"], p) for a, p in args["hosts"]], options)
with Pool(len(args["hosts"]), args["per_node"], provider=provider, sync=(),
          frameworks=Frameworks(torch=False)) as pool:
    pool.run("1").raise_for_errors()
    print(json.dumps("ready"), flush=True)
    for _ in sys.stdin:
        x = np.random.rand(args["size"] // 8)
        t0 = time.perf_counter()
        result = pool.run(args["cell"], {"x": x})
        took = time.perf_counter() - t0
        right = result.ok and result.values == [float(x.sum())] * len(result.values)
        print(json.dumps([took, right, repr(result.errors)]), flush=True)
"""


class Before:
    """The ``before`` side: a pool of the older package, driven in a process of its own."""

    def __init__(self, tree: Path, hosts: Hosts, n: int, per_node: int, size: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=tree,  # ``-c`` puts the working directory first on the path
        )
        given = {
            "identity": str(hosts.client_key),
            "known_hosts": str(hosts.known_hosts),
            "user": hosts.user,
            "hosts": [(h.address, h.port) for h in hosts.hosts[:n]],
            "per_node": per_node,
            "size": size,
            "cell": CELL,
        }
        self._say(json.dumps(given))
        if self._answer() != "ready":
            raise BenchError("the older package's pool did not start")

    def _say(self, line: str) -> None:
        stdin: IO[str] | None = self._proc.stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def _answer(self) -> Any:
        stdout: IO[str] | None = self._proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise BenchError(f"the older package's driver ended ({self._proc.wait()})")
        return json.loads(line)

    def round(self) -> float:
        self._say("round")
        took, right, errors = self._answer()
        if not right:
            raise BenchError(f"the before cell failed or got a wrong sum: {errors}")
        return float(took)

    def close(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        stdin.close()
        if self._proc.wait(120):
            raise BenchError(f"the older package's driver failed ({self._proc.returncode})")


def counter(device: str, which: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/{which}").read_text())


def links(hosts: Hosts, n: int) -> list[int]:
    """The notebook's bytes sent, the head's sent, then each host's received."""
    return [
        counter(hosts.bridge, "tx_bytes"),
        counter(hosts[0].veth, "rx_bytes"),
        *(counter(hosts[i].veth, "tx_bytes") for i in range(n)),
    ]


def scp_round(pool: Pool, hosts: Hosts, n: int, size: int, tmp: Path) -> float:
    """What a user would do: save, scp to every host at once, load on every rank."""
    x = np.random.rand(size // 8)
    t0 = time.perf_counter()
    path = tmp / REMOTE
    np.save(path, x)
    scp = [
        "scp",
        "-q",
        "-i",
        str(hosts.client_key),
        "-o",
        f"UserKnownHostsFile={hosts.known_hosts}",
    ]
    copies = [
        subprocess.Popen([*scp, "-P", str(h.port), str(path), f"{hosts.user}@{h.address}:{REMOTE}"])
        for h in hosts.hosts[:n]
    ]
    if any(c.wait(300) for c in copies):
        raise BenchError("scp to a host failed")
    cell = f"float(__import__('numpy').load(__import__('os').path.expanduser('~/{REMOTE}')).sum())"
    result = pool.run(cell)
    took = time.perf_counter() - t0
    if not result.ok or result.values != [float(x.sum())] * len(result.values):
        raise BenchError(f"the scp cell failed or got a wrong sum: {result.errors!r}")
    return took


def fanout_round(pool: Pool, size: int) -> float:
    x = np.random.rand(size // 8)
    t0 = time.perf_counter()
    try:
        result = pool.run(CELL, {"x": x})
    except Exception as exc:
        raise BenchError(f"the fanout cell failed: {exc!r}\n{_said(pool)}") from exc
    took = time.perf_counter() - t0
    if not result.ok or result.values != [float(x.sum())] * len(result.values):
        said = "".join(e.render() for e in result.errors[:2])
        raise BenchError(f"the fanout cell failed or got a wrong sum:\n{said}\n{_said(pool)}")
    return took


def _said(pool: Pool) -> str:
    """What each rank wrote to its diagnostics (why a lost one ended)."""
    return "\n".join(
        f"rank {r.index}: {r.process.diagnostics()[-2000:]}" for r in pool._ranks.all if r.process
    )


def measure(hosts: Hosts, n: int, args: Any, tree: Path, tmp: Path) -> dict[str, Any]:
    """The three sides on ``n`` hosts, interleaved round by round."""
    size = args.mib * MIB
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    provider = ssh_provider(hosts, n, tmp)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(
            Pool(n, args.per_node, provider=provider, sync=(), frameworks=Frameworks(torch=False))
        )
        pool.run("1").raise_for_errors()
        before = Before(tree, hosts, n, args.per_node, size)
        stack.callback(before.close)
        rounds = {
            "fanout": lambda: fanout_round(pool, size),
            "before": before.round,
            "scp": lambda: scp_round(pool, hosts, n, size, tmp),
        }
        for i in range(args.warmup + args.reps):
            got = {}
            for side in rotated(SIDES, i):
                start = links(hosts, n)
                seconds = rounds[side]()
                moved = [b - a for a, b in zip(start, links(hosts, n), strict=True)]
                got[side] = {
                    "seconds": seconds,
                    "notebook_sent": moved[0] / size,
                    "head_sent": moved[1] / size,
                    "most_received": max(moved[2:]) / size,
                }
            label = f"round {i - args.warmup + 1}/{args.reps}" if i >= args.warmup else "warm-up"
            print(
                f"  {n} hosts {label}: "
                + ", ".join(
                    f"{s} {g['seconds']:.2f} s head {g['head_sent']:.2f}x" for s, g in got.items()
                ),
                file=sys.stderr,
                flush=True,
            )
            if i >= args.warmup:
                for side, values in got.items():
                    for key, value in values.items():
                        samples[side].setdefault(key, []).append(value)
    out: dict[str, Any] = {"hosts": n, "ranks": n * args.per_node, "samples": samples}
    for side in SIDES:
        for key, values in samples[side].items():
            out[f"{side}_{key}"] = asdict(Summary.of(values))
    return out


def run_all(args: Any) -> dict[str, Any]:
    counts = sorted(set(args.nodes))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_fanout_")))
        tree = tmp / "before"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before, "skyward_jupyter"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        print(f"making {counts[-1]} SSH hosts in network namespaces", file=sys.stderr, flush=True)
        hosts = stack.enter_context(ssh_hosts(counts[-1], tmp / "hosts"))
        rows = []
        for n in counts:
            rows.append(measure(hosts, n, args, tree, tmp))
            left = agents_left_after_close(hosts)
            if left:
                raise BenchError(f"SSH ranks still running on the hosts after close: {left}")
    return {
        "rows": rows,
        "global_bytes": args.mib * MIB,
        "per_node": args.per_node,
        "before": args.before,
        "reps": args.reps,
        "warmup": args.warmup,
    }


def render_markdown(report: dict[str, Any]) -> str:
    m, rows = report["machine"], report["rows"]
    mib = report["global_bytes"] // MIB

    def x(s: dict[str, float]) -> str:
        return f"{s['median']:.2f}x"

    def sec(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"

    table = [
        "| hosts (ranks) | time, **fanout** | time, before | time, scp | head sent, **fanout** "
        "| head sent, before | most received by a host, **fanout** | most received, before "
        "| notebook sent, scp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        table.append(
            f"| {r['hosts']} ({r['ranks']}) | **{sec(r['fanout_seconds'])}** "
            f"| {sec(r['before_seconds'])} | {sec(r['scp_seconds'])} "
            f"| **{x(r['fanout_head_sent'])}** | {x(r['before_head_sent'])} "
            f"| **{x(r['fanout_most_received'])}** | {x(r['before_most_received'])} "
            f"| {x(r['scp_notebook_sent'])} |"
        )
    first, last = rows[0], rows[-1]
    growth = last["fanout_seconds"]["median"] / first["fanout_seconds"]["median"]
    lines = [
        f"## Fan-out: a {mib} MiB global to 2, 4 and 8 hosts of {report['per_node']} ranks",
        "",
        machine_line(m, {"asyncssh": m["asyncssh"], "numpy": m["numpy"]}),
        "",
        f'`pool.run("{CELL}", {{"x": x}})` with `x` a fresh {mib} MiB `numpy.random.rand` '
        "array each round, on SSH hosts made by `tests/hosts.py` (an `sshd` each in its own "
        f"network namespace on a bridge of this machine), {report['per_node']} ranks per host, "
        "`--framework none`. **fanout**: as shipped: the value goes to the head, the nodes pass "
        "it on in a binary tree of their relays, each node's ranks map its one copy. **before**: "
        f"the same call on the package at commit `{report['before']}` (run in a process of its "
        "own on the same hosts), where the head's relay served the value once per other rank. "
        "**scp**: `numpy.save`, `scp` to every host at once, then every rank `numpy.load`s it. "
        f"Interleaved round by round (order rotating): {report['reps']} counted rounds each "
        f"after {report['warmup']} untimed. Medians; times with (min-max). Bytes per link from "
        "the veths' counters around the round, over the global's size: head sent is what host "
        "0 sent, most received the most any one host received.",
        "",
        *table,
        "",
        f"From {first['hosts']} to {last['hosts']} hosts the fanout's time grew {growth:.2f}x. "
        "The hosts share this machine's two cores with every rank (and, in this run, with other "
        "work: see the load above), and the links add almost no latency, so the times are the "
        "processes' own costs (TLS, copies, unpickling) rather than a network's; the bytes are "
        "what a real network would carry.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    parser.add_argument("--reps", type=int, default=3, help="counted rounds per host count")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of each first")
    parser.add_argument("--mib", type=int, default=64, help="size of the global in MiB")
    parser.add_argument("--per-node", type=int, default=4, help="ranks per host")
    parser.add_argument("--before", default=BEFORE, help="the commit the before side runs")
    parser.add_argument(
        "--nodes", type=int, nargs="+", default=[2, 4, 8], help="host counts to measure"
    )
    args = SCRIPT.parse_args(parser, argv)
    if args.reps < 1 or args.warmup < 0 or args.mib < 2 or min(args.nodes) < 2:
        parser.error("--reps at least 1, --warmup at least 0, --mib at least 2, --nodes 2 up")
    if (why := available()) is not None:
        raise SystemExit(f"bench_fanout.py cannot make SSH test hosts here: it {why}")
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
