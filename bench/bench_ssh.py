"""SSH benchmark: the SSH provider's pool start, cell round trip and package shipping, beside local.

Everything comes from one run of this script, which builds two real SSH hosts with
``tests.hosts.ssh_hosts`` (importing the test helper is deliberate: it is the project's one way to
get real ``sshd`` hosts without other machines; it needs root, iproute2 and ``/usr/sbin/sshd``,
``make system-deps``). Each host is an ``sshd`` in its own Linux network namespace on a bridge;
the filesystem is shared, so the hosts run this checkout's venv (``SSHOptions(python=
sys.executable)``). The "network" is a veth pair on one machine: it adds almost no latency, and
the hosts share this machine's CPUs with the notebook side, so the SSH figures are the protocol's
and the processes' own costs (key exchange, channels, encryption, a fresh interpreter per rank),
a lower bound for hosts across a real network. The SSH side is
``SSHProvider([Host(address, "root", 2222), ...], SSHOptions(identity=..., known_hosts=...,
python=sys.executable, cache_dir=...))`` with strict host-key checking, as in ``tests/test_ssh.py``.

What is compared, and why it is fair:

* **(1) Start to first cell finished.** ``Pool(nodes=2, provider=...).start()`` plus a first cell
  that crosses the process group (``import torch.distributed as d; d.barrier()``), timed from
  ``Pool(...)`` to the cell's result; the pool's ``close()`` is not counted (it is reported apart).
  SSH pools are started in this process, which has already imported ``skyward_jupyter`` and
  ``asyncssh``, as a notebook kernel has; the package is already in the hosts' cache (**warm
  cache**). Each SSH rank is a fresh ``python -m skyward_jupyter.agent`` on its host that imports
  torch, and ``provision`` probes each host's Python and package versions, so the time spent
  in ``provision`` (connect, probe, cache check) is reported apart from the rest (ranks, group,
  first cell). The local pool forks its ranks from a template process that has imported torch, so
  it is measured as ``bench_core.py`` measures it, in a fresh ``python -c`` subprocess after its
  import of ``skyward_jupyter`` (the same child, imported from ``bench_core``): **cold**, the first
  pool of the process (it starts the template), then **warm template**, a second pool after the
  first one's ``close()``. Ratios ssh/local are given against both. One round is: an SSH pool on
  the warm cache, an SSH pool on a fresh cache (see (3)), a local subprocess (cold + warm); the
  order rotates from round to round, after one uncounted round.
* **(2) Round trip of a trivial cell.** ``pool.run("1")`` on a warm 2-rank SSH pool and on a warm
  2-rank local pool, both open at once (so both see the other's idle heartbeats), alternating one
  call at a time (the order inside a pair alternating too), after an untimed warm-up of each;
  median, p10 and p90 from the call to the returned result.
* **(3) First-time package shipping.** The SSH provider ships this package (pure Python, a tar.gz)
  to ``<cache_dir>/<content hash>`` on a host that lacks it. (a) In (1), the SSH pool on a
  **fresh** ``cache_dir`` (a new empty directory each round) against the one on the **warm**
  cache: what a user waits for the first time. Both hosts share one filesystem here, so they race
  to unpack into the same directory (one or both ship; the count is reported); separate machines
  would each ship their own copy, in parallel. (b) The shipping step alone, on one open
  connection to one host: the provider's ``_ship`` (local content hash, ``$HOME``, ``test -d``,
  and for a fresh ``cache_dir`` also building the tarball and ``mkdir``/``tar -x``/``mv`` over
  the channel), fresh and present interleaved.

Hosts, pools, the local rank template (``skyward_jupyter.providers.local.shutdown_template()``)
and any local subprocess are torn down at the end, also on an error or Ctrl-C; after the SSH
pools are closed the script checks that no rank is left running on the hosts.

Run ``python bench/bench_ssh.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/ssh.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_core import FIRST_CELL, time_pool_start
from common import (
    REPO,
    BenchError,
    Script,
    Summary,
    command_line,
    count,
    fmt_ms,
    fmt_s,
    load_avg,
    machine_info,
    machine_line,
    range_row,
    spread_row,
    version,
)

sys.path.insert(0, str(REPO))  # for tests.hosts (bench/ is first on the path, not the repo)

from skyward_jupyter import Pool
from skyward_jupyter.providers import local
from skyward_jupyter.providers.base import Node, Progress, no_progress
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider
from skyward_jupyter.providers.ssh_prepare import package_tarball
from tests.hosts import Hosts, available, ssh_hosts

SCRIPT = Script("ssh")
NODES = 2


class TimedSSHProvider(SSHProvider):
    """The SSH provider, timing its ``provision`` (connect, probe Python, check or ship)."""

    provision_s: float | None = None

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        t0 = time.perf_counter()
        out = await super().provision(nodes, progress)
        self.provision_s = time.perf_counter() - t0
        return out


def ssh_provider(hosts: Hosts, cache_dir: Path) -> TimedSSHProvider:
    return TimedSSHProvider(
        [Host(h.address, hosts.user, h.port) for h in hosts],
        SSHOptions(
            identity=str(hosts.client_key),
            known_hosts=str(hosts.known_hosts),
            python=sys.executable,
            connect_timeout=10,
            cache_dir=str(cache_dir),
        ),
    )


def time_ssh_start(hosts: Hosts, cache_dir: Path) -> dict[str, Any]:
    """One SSH pool: start + first cell (timed), then close (timed apart)."""
    provider = ssh_provider(hosts, cache_dir)
    t0 = time.perf_counter()
    pool = Pool(nodes=NODES, provider=provider)
    try:
        pool.start()
        result = pool.run(FIRST_CELL)
        t1 = time.perf_counter()
        if not result.ok:
            raise BenchError(f"first SSH cell failed: {result.errors!r}")
    finally:
        t2 = time.perf_counter()
        pool.close()
        t3 = time.perf_counter()
    if provider.provision_s is None:
        raise BenchError("the SSH provider's provision was not timed")
    return {
        "start_s": t1 - t0,
        "provision_s": provider.provision_s,
        "after_provision_s": t1 - t0 - provider.provision_s,
        "close_s": t3 - t2,
        "shipped": len(provider.shipped),
    }


def compare_start(
    hosts: Hosts, tmp: Path, repeat: int, warmup: int, timeout: float
) -> dict[str, Any]:
    warm_cache = tmp / "cache-warm"
    sides: dict[str, Callable[[int], dict[str, Any]]] = {
        "ssh_warm": lambda _: time_ssh_start(hosts, warm_cache),
        "ssh_fresh": lambda i: time_ssh_start(hosts, tmp / f"cache-fresh-{i}"),
        "local": lambda _: time_pool_start(timeout),
    }
    # The warm cache is filled before anything is timed, so "warm" never ships.
    time_ssh_start(hosts, warm_cache)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    order = list(sides)
    for i in range(warmup + repeat):
        counted = i >= warmup
        label = f"round {i - warmup + 1}/{repeat}" if counted else f"warm-up {i + 1}/{warmup}"
        turn = order[i % len(order) :] + order[: i % len(order)]
        got = {name: sides[name](i) for name in turn}
        if got["ssh_warm"]["shipped"] != 0:
            raise BenchError("the SSH pool on the warm cache shipped the package again")
        if got["ssh_fresh"]["shipped"] < 1:
            raise BenchError("the SSH pool on a fresh cache shipped nothing")
        print(
            f"  start {label} ({', '.join(turn)}): ssh warm cache "
            f"{got['ssh_warm']['start_s']:.3f} s, ssh fresh cache "
            f"{got['ssh_fresh']['start_s']:.3f} s (shipped to {got['ssh_fresh']['shipped']}), "
            f"local cold {got['local']['cold_start_s']:.3f} s, "
            f"warm template {got['local']['warm_start_s']:.3f} s",
            file=sys.stderr,
            flush=True,
        )
        if counted:
            for name, values in got.items():
                for key, value in values.items():
                    samples[name].setdefault(key, []).append(float(value))
    summaries = {
        f"{name}_{key}": asdict(Summary.of(values))
        for name, by_key in samples.items()
        for key, values in by_key.items()
        if key != "shipped"
    }
    ssh, fresh = summaries["ssh_warm_start_s"]["median"], summaries["ssh_fresh_start_s"]["median"]
    cold = summaries["local_cold_start_s"]["median"]
    warm = summaries["local_warm_start_s"]["median"]
    return {
        **summaries,
        "ratio_ssh_over_local_cold": ssh / cold,
        "ratio_ssh_over_local_warm": ssh / warm,
        "ratio_ssh_fresh_over_ssh_warm": fresh / ssh,
        "ssh_fresh_minus_warm_s": fresh - ssh,
        "fresh_shipped_counts": [int(x) for x in samples["ssh_fresh"]["shipped"]],
        "samples": samples,
        "repeat": repeat,
        "warmup": warmup,
    }


async def _time_ship(hosts: Hosts, tmp: Path, runs: int, warmup: int) -> dict[str, Any]:
    """The provider's shipping step alone, on one open connection to host 0."""
    warm_cache = tmp / "cache-warm"  # filled by compare_start
    present = ssh_provider(hosts, warm_cache)
    host = present.hosts[0]
    conn = await present._connect(host)
    samples: dict[str, list[float]] = {"fresh_ms": [], "present_ms": [], "command_ms": []}
    try:
        for i in range(warmup + runs):
            fresh = ssh_provider(hosts, tmp / "ship" / str(i))
            steps: list[tuple[str, SSHProvider]] = [("fresh_ms", fresh), ("present_ms", present)]
            for key, provider in steps if i % 2 == 0 else steps[::-1]:
                t0 = time.perf_counter_ns()
                await provider._ship(host, conn, str(Path.home()))  # the hosts share this home
                t1 = time.perf_counter_ns()
                if i >= warmup:
                    samples[key].append((t1 - t0) / 1e6)
            if fresh.shipped != [str(host)] or present.shipped:
                raise BenchError(
                    f"shipping went wrong: fresh {fresh.shipped}, present {present.shipped}"
                )
            t0 = time.perf_counter_ns()
            await conn.run("true", check=True)
            t1 = time.perf_counter_ns()
            if i >= warmup:
                samples["command_ms"].append((t1 - t0) / 1e6)
    finally:
        conn.close()
        await conn.wait_closed()
    fresh_ms = Summary.of(samples["fresh_ms"])
    present_ms = Summary.of(samples["present_ms"])
    return {
        "fresh_ms": asdict(fresh_ms),
        "present_ms": asdict(present_ms),
        "command_ms": asdict(Summary.of(samples["command_ms"])),
        "ratio_fresh_over_present": fresh_ms.median / present_ms.median,
        "fresh_minus_present_ms": fresh_ms.median - present_ms.median,
        "tarball_bytes": len(package_tarball()),
        "package_files": sum(1 for _ in (REPO / "skyward_jupyter").rglob("*.py")),
        "samples": samples,
        "runs": runs,
        "warmup": warmup,
    }


def measure_ship(hosts: Hosts, tmp: Path, runs: int, warmup: int) -> dict[str, Any]:
    return asyncio.run(_time_ship(hosts, tmp, runs, warmup))


def round_trip(ssh_pool: Pool, local_pool: Pool, runs: int, warmup: int) -> dict[str, Any]:
    pools = {"ssh": ssh_pool, "local": local_pool}
    for pool in pools.values():
        for _ in range(warmup):
            pool.run("1").raise_for_errors()
    samples: dict[str, list[float]] = {name: [] for name in pools}
    order = list(pools)
    for i in range(runs):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter_ns()
            result = pools[name].run("1")
            t1 = time.perf_counter_ns()
            if not result.ok or result.values != [1] * NODES:
                raise BenchError(f"trivial cell failed on the {name} pool: {result.errors!r}")
            samples[name].append((t1 - t0) / 1e6)
    ssh, loc = Summary.of(samples["ssh"]), Summary.of(samples["local"])
    return {
        "ssh_ms": asdict(ssh),
        "local_ms": asdict(loc),
        "ratio_ssh_over_local": ssh.median / loc.median,
        "backends": {name: pool.group_backend for name, pool in pools.items()},
        "samples_ms": samples,
        "runs": runs,
        "warmup": warmup,
    }


def _replace_rank_one(pool: Pool, timeout: float = 60.0) -> float:
    """Kill rank 1 while idle; seconds until its replacement is ready (the group re-formed)."""
    old = pool.ranks[1].hello
    assert old is not None
    t0 = time.perf_counter()
    os.kill(old.pid, signal.SIGKILL)  # the hosts share this machine's process table
    while time.perf_counter() - t0 < timeout:
        now = pool.ranks[1]
        if now.hello is not None and now.hello.pid != old.pid and now.state.value == "ready":
            return time.perf_counter() - t0
        time.sleep(0.002)
    raise BenchError(f"rank 1 was not replaced within {timeout:.0f} s")


def measure_restart(ssh_pool: Pool, local_pool: Pool, reps: int) -> dict[str, Any]:
    """``%sky restart`` (``Pool.restart``) and a lost rank's replacement, both pools
    interleaved; each checked with a cell across the fresh group.
    """
    pools = {"ssh": ssh_pool, "local": local_pool}
    restart: dict[str, list[float]] = {name: [] for name in pools}
    replace: dict[str, list[float]] = {name: [] for name in pools}
    for i in range(reps):
        for name in list(pools) if i % 2 == 0 else list(pools)[::-1]:
            pool = pools[name]
            t0 = time.perf_counter()
            pool.restart()
            restart[name].append(time.perf_counter() - t0)
            pool.run(FIRST_CELL).raise_for_errors()
            replace[name].append(_replace_rank_one(pool))
            pool.run(FIRST_CELL).raise_for_errors()
    return {
        "restart_s": {name: asdict(Summary.of(s)) for name, s in restart.items()},
        "replace_s": {name: asdict(Summary.of(s)) for name, s in replace.items()},
        "reps": reps,
    }


def remote_agents(hosts: Hosts) -> list[int]:
    """Rank processes still running on the hosts."""
    found = []
    for i in range(len(hosts)):
        for pid in hosts.pids(i):
            with contextlib.suppress(OSError):
                if b"skyward_jupyter.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
    return found


def agents_left_after_close(hosts: Hosts, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := remote_agents(hosts)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_all(args: Any) -> dict[str, Any]:
    """Everything, with hosts, pools and the local template torn down however it ends."""
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_ssh_")))
        print(f"making {NODES} SSH hosts in network namespaces", file=sys.stderr, flush=True)
        hosts = stack.enter_context(ssh_hosts(NODES, tmp))
        stack.callback(local.shutdown_template)  # after the pools below are closed

        print(
            f"(1) start: ssh (warm and fresh cache) vs local (cold, warm template), "
            f"{args.repeat} rounds after {args.start_warmup} warm-up",
            file=sys.stderr,
            flush=True,
        )
        start = compare_start(hosts, tmp, args.repeat, args.start_warmup, args.timeout)

        print(f"(3) shipping step alone: {args.ship_runs} each", file=sys.stderr, flush=True)
        ship = measure_ship(hosts, tmp, args.ship_runs, 2)

        print(
            f"(2) round trip: {args.runs} interleaved pairs after {args.warmup} warm-up",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.ExitStack() as pools:
            ssh_pool = pools.enter_context(
                Pool(nodes=NODES, provider=ssh_provider(hosts, tmp / "cache-warm"))
            )
            local_pool = pools.enter_context(Pool(nodes=NODES))
            rt = round_trip(ssh_pool, local_pool, args.runs, args.warmup)
            print(f"(4) restart and replacement: {args.restarts} each", file=sys.stderr)
            restarts = measure_restart(ssh_pool, local_pool, args.restarts)
        left = agents_left_after_close(hosts)
        if left:
            raise BenchError(f"SSH ranks still running on the hosts after close: {left}")
    return {
        "start": start,
        "ship": ship,
        "round_trip": rt,
        "restart": restarts,
        "remote_ranks_left": len(left),
    }


# ------------------------------------------------------------------------------ markdown


def render_markdown(report: dict[str, Any]) -> str:
    m, start, ship, rt = report["machine"], report["start"], report["ship"], report["round_trip"]

    def row(label: str, key: str, extra: str = "") -> str:
        return range_row(label, start[key], fmt_s, extra)

    shipped = start["fresh_shipped_counts"]
    fresh_diff = start["ssh_fresh_minus_warm_s"]
    f, w = start["ssh_fresh_start_s"], start["ssh_warm_start_s"]
    overlap = "overlap" if f["min"] <= w["max"] and w["min"] <= f["max"] else "do not overlap"
    lines = [
        "## SSH provider beside local",
        "",
        machine_line(m, {"asyncssh": m["asyncssh"]}),
        "",
        "Two SSH hosts made by `tests/hosts.py`: an `sshd` each in its own network namespace on "
        "a bridge of this machine, strict host-key checking, the hosts running this checkout's "
        "venv over the shared filesystem. The link adds almost no latency and the hosts share "
        "the machine's CPUs with the notebook side, so the SSH figures are the protocol's and the "
        "processes' own costs, a lower bound for machines across a real network.",
        "",
        f"### (1) Start to first cell finished ({NODES} ranks, gloo, {start['repeat']} rotating "
        f"rounds after {start['warmup']} uncounted)",
        "",
        "| | median | min | max | ratio ssh/local (medians) |",
        "|---|---:|---:|---:|---:|",
        row(
            f"**SSH**, {NODES} hosts, package already in the cache: `Pool(nodes={NODES}, "
            "provider=SSHProvider(...)).start()` + `run(barrier)`",
            "ssh_warm_start_s",
            f"**{start['ratio_ssh_over_local_cold']:.2f}** vs cold, "
            f"**{start['ratio_ssh_over_local_warm']:.0f}** vs warm template",
        ),
        row(
            "*of which `provision`: connect, probe Python and package versions, check the cache, "
            "start each host's template (it imports torch)*",
            "ssh_warm_provision_s",
        ),
        row(
            "*of which the rest: fork the ranks from the templates, form the group, first cell*",
            "ssh_warm_after_provision_s",
        ),
        row(
            f"**local**, **cold**: `Pool(nodes={NODES})` in a fresh process, no template yet",
            "local_cold_start_s",
            "1.00",
        ),
        row(
            f"**local**, **warm template**: `Pool(nodes={NODES})` forked from the running template",
            "local_warm_start_s",
            "1.00",
        ),
        row("*SSH pool `close()`, not counted above*", "ssh_warm_close_s"),
        row("*local pool `close()` after the cold start, not counted above*", "local_cold_close_s"),
        "",
        "The local figures are `bench_core.py`'s (its child process, run here interleaved with the "
        "SSH pools): cold is the first pool of a process without prewarm (it starts the rank "
        "template, which imports torch), warm template a later pool in the same process (as after "
        "`%load_ext skyward_jupyter`). An SSH pool starts a template on each host (it imports "
        "torch once, for the pool's life) and forks its ranks from it.",
        "",
        f'### (2) Round trip of a trivial cell (`pool.run("1")`, {NODES} ranks, {rt["runs"]} '
        f"alternating pairs after {rt['warmup']} warm-up of each)",
        "",
        "| | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        spread_row(f"SSH, {NODES} hosts", rt["ssh_ms"], fmt_ms),
        spread_row("local", rt["local_ms"], fmt_ms),
        "",
        f"Ratio ssh/local of the medians: **{rt['ratio_ssh_over_local']:.2f}**. Both pools were "
        "open at once, so each saw the other's idle heartbeats.",
        "",
        f"### (3) First-time package shipping ({ship['package_files']} files, a "
        f"{ship['tarball_bytes'] / 1024:.0f} KiB tar.gz)",
        "",
        "| | median | min | max | ratio fresh/warm (medians) |",
        "|---|---:|---:|---:|---:|",
        row(
            "SSH start to first cell, **fresh** `cache_dir` (ships the package)",
            "ssh_fresh_start_s",
            f"**{start['ratio_ssh_fresh_over_ssh_warm']:.2f}**",
        ),
        row(
            "SSH start to first cell, **warm** cache (same rounds as (1))",
            "ssh_warm_start_s",
            "1.00",
        ),
        row("*of which `provision`, fresh cache*", "ssh_fresh_provision_s"),
        range_row(
            f"shipping step alone (`_ship`, one host, one open connection, {ship['runs']} each, "
            "interleaved), **fresh**",
            ship["fresh_ms"],
            fmt_ms,
            f"**{ship['ratio_fresh_over_present']:.2f}**",
        ),
        range_row("shipping step alone, package **present**", ship["present_ms"], fmt_ms, "1.00"),
        range_row(
            '*for scale: one remote command (`conn.run("true")`) on the same connection*',
            ship["command_ms"],
            fmt_ms,
            "",
        ),
        "",
        f"Start to first cell, fresh cache minus warm cache: {fresh_diff:+.3f} s (difference of "
        f"the medians; the two min-max ranges {overlap}, and a pool start carries the hosts' "
        "torch imports, so the isolated step below is the sharper figure). The shipping step "
        f"alone costs {ship['fresh_minus_present_ms']:.1f} ms more than finding the package "
        "present. Finding it present is two remote commands (`$HOME`, `test -d`), shipping it "
        "one more (`mkdir`/`tar -x`/`mv` with the tarball on stdin), and every remote command "
        "opens an exec channel whose session the host's `sshd` starts (see the last row). The "
        "two hosts share one filesystem here and race to unpack into the same directory: per "
        f"round {', '.join(map(str, shipped))} of them shipped. Separate machines would each "
        "get their own copy, in parallel.",
        "",
        f"### (4) `%sky restart` and a lost rank's replacement ({NODES} ranks, "
        f"{report['restart']['reps']} of each, the two pools alternating)",
        "",
        "| | median | min | max | goal |",
        "|---|---:|---:|---:|---:|",
        *(
            range_row(label, report["restart"][key][name], fmt_s, goal)
            for key, what in (
                ("restart_s", "`pool.restart()` (`%sky restart`): fresh ranks and group"),
                ("replace_s", "rank 1 killed while idle until its replacement is ready"),
            )
            for name, label, goal in (
                ("ssh", f"SSH: {what}", "at most 0.5 s"),
                ("local", f"local: {what}", ""),
            )
        ),
        "",
        "A restart keeps the pool's machines and connections; the ranks are forked from each "
        "host's warm template (torch imported when the pool started). A replacement is counted "
        "from the kill until the new rank is ready, which includes noticing the loss and "
        "forming the group again on every rank.",
        "",
        f"No SSH rank was left running on the hosts after the pools were closed "
        f"({report['remote_ranks_left']} found); hosts, pools and the local template were torn "
        "down at the end.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--repeat", 5, "counted start rounds")
    count(parser, "--start-warmup", 1, "uncounted start rounds first", minimum=0)
    count(parser, "--runs", 200, "timed trivial-cell pairs")
    count(parser, "--warmup", 20, "untimed round trips of each first", minimum=0)
    count(parser, "--ship-runs", 20, "timed shipping steps of each")
    count(parser, "--restarts", 7, "restarts and replacements each")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per local child")
    args = SCRIPT.parse_args(parser, argv)
    if (why := available()) is not None:
        raise SystemExit(f"bench_ssh.py cannot make SSH test hosts here: it {why}")

    load_before = load_avg()
    results = run_all(args)
    machine = machine_info(load_before)
    machine["asyncssh"] = version("asyncssh")
    report: dict[str, Any] = {"machine": machine, "command": command_line(), **results}
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
