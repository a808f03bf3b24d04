"""Secure benchmark: what ``--secure`` (gloo through TLS tunnels between hosts) costs.

A ``--secure`` pool's gloo listens on loopback only and its traffic between hosts goes through
each rank's tunnel, TLS 1.3 with the pool's key on both ends (``skyward_jupyter/agent/
gloo_tunnel.py``). This measures what that costs against the same pool without it, on two real
SSH hosts built with ``tests.hosts.ssh_hosts`` (an ``sshd`` each in its own network namespace,
their links veths on one bridge of this machine; it needs root, iproute2 and ``/usr/sbin/sshd``),
one rank per host: ``Pool(nodes=2, procs_per_node=1, provider=SSHProvider(...), sync=(),
secure=...)``.

Per round, one cell on each pool, timed inside the cell on rank 0 (``time.perf_counter``):

* ``all_reduce`` of a float32 tensor of 64 KiB, 4 MiB and 64 MiB (after one untimed call of each
  size; 20, 5 and 3 calls averaged), and
* training steps per second of a DDP model (two linear layers, 2.1 M parameters, batch 64, 20 timed
  steps after 3), the shape of the quickstart's loop with more to reduce per step.

Both pools are open at once and interleaved round by round (the order alternating); medians of the
rounds, with ratios secure/plain. The "network" is veths on one machine whose CPUs the hosts and
this process share, so the tunnel's encryption competes with gloo for the same two cores: on real
machines, each with its own cores and a real link's lower bandwidth, the ratio is nearer 1.

Run ``python bench/bench_secure.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/secure.json``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_ssh import agents_left_after_close
from bench_transfer import provider
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
)

sys.path.insert(0, str(REPO))  # for tests.hosts (bench/ is first on the path, not the repo)

from skyward_jupyter import Pool
from tests.hosts import Hosts, available, ssh_hosts

SCRIPT = Script("secure")
SIDES = ("plain", "secure")
SIZES_KIB = (64, 4096, 65536)
CELL = """
import time, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
out = {}
for kib, calls in ((64, 20), (4096, 5), (65536, 3)):
    t = torch.ones(kib * 256)
    dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    out[f"all_reduce_{kib}_kib_s"] = (time.perf_counter() - start) / calls
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 512), torch.randn(64, 512)
def step():
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
for _ in range(3):
    step()
dist.barrier()
start = time.perf_counter()
for _ in range(20):
    step()
out["ddp_steps_per_s"] = 20 / (time.perf_counter() - start)
out
"""
METRICS = (*(f"all_reduce_{kib}_kib_s" for kib in SIZES_KIB), "ddp_steps_per_s")


def one_round(pool: Pool, side: str) -> dict[str, float]:
    result = pool.run(CELL)
    if not result.ok:
        raise BenchError(f"the {side} cell failed: {result.errors!r}")
    figures: dict[str, float] = result.values[0]
    return figures


def measure(hosts: Hosts, reps: int, warmup: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    starts: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        pools = {}
        for side in SIDES:
            t0 = time.perf_counter()
            pool = Pool(
                nodes=2, procs_per_node=1, provider=provider(hosts, 2), sync=(),
                secure=side == "secure",
            )  # fmt: skip
            pools[side] = stack.enter_context(pool)
            starts[side] = time.perf_counter() - t0
        for i in range(warmup + reps):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            got = {side: one_round(pools[side], side) for side in order}
            label = f"round {i - warmup + 1}/{reps}" if i >= warmup else f"warm-up {i + 1}"
            print(
                f"  {label}: "
                + "; ".join(
                    f"{side} 64 MiB all_reduce {got[side]['all_reduce_65536_kib_s'] * 1000:.0f} "
                    f"ms, DDP {got[side]['ddp_steps_per_s']:.1f} steps/s"
                    for side in order
                ),
                file=sys.stderr,
                flush=True,
            )
            if i >= warmup:
                for side, values in got.items():
                    for key in METRICS:
                        samples[side].setdefault(key, []).append(values[key])
    out: dict[str, Any] = {"samples": samples, "start_seconds": starts}
    for side in SIDES:
        for key in METRICS:
            out[f"{side}_{key}"] = asdict(Summary.of(samples[side][key]))
    for key in METRICS:
        out[f"ratio_{key}"] = out[f"secure_{key}"]["median"] / out[f"plain_{key}"]["median"]
    return out


def run_all(args: Any) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_secure_")))
        print("making 2 SSH hosts in network namespaces", file=sys.stderr, flush=True)
        hosts = stack.enter_context(ssh_hosts(2, tmp))
        print(f"{args.reps} interleaved rounds after {args.warmup} warm-up", file=sys.stderr)
        row = measure(hosts, args.reps, args.warmup)
        left = agents_left_after_close(hosts)
        if left:
            raise BenchError(f"SSH ranks still running on the hosts after close: {left}")
    return {**row, "reps": args.reps, "warmup": args.warmup, "remote_ranks_left": 0}


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]

    def ms(s: dict[str, float]) -> str:
        return f"{s['median'] * 1000:.1f} ms ({s['min'] * 1000:.1f}-{s['max'] * 1000:.1f})"

    def rate(s: dict[str, float]) -> str:
        return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"

    table = [
        "| measure | plain | **--secure** | secure/plain (medians) |",
        "|---|---:|---:|---:|",
    ]
    for kib in SIZES_KIB:
        key = f"all_reduce_{kib}_kib_s"
        size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
        table.append(
            f"| `all_reduce` of {size}, time per call | {ms(report[f'plain_{key}'])} "
            f"| **{ms(report[f'secure_{key}'])}** | {report[f'ratio_{key}']:.2f} |"
        )
    key = "ddp_steps_per_s"
    table.append(
        f"| DDP training steps/s (2.1 M parameters) | {rate(report[f'plain_{key}'])} "
        f"| **{rate(report[f'secure_{key}'])}** | {report[f'ratio_{key}']:.2f} |"
    )
    starts = report["start_seconds"]
    lines = [
        "## Secure: gloo through TLS tunnels between hosts (`--secure`) against plain gloo",
        "",
        machine_line(m),
        "",
        "Two SSH hosts made by `tests/hosts.py` (an `sshd` each in its own network namespace on a "
        "bridge of this machine), one rank per host, two warm pools open at once: **plain** "
        "(gloo connects the ranks directly, in cleartext, on the hosts' addresses) and "
        "**--secure** (gloo on loopback, its traffic through each rank's TLS 1.3 tunnel, both ends "
        "proving the pool's key). One cell per pool per round, timed inside the cell on rank 0, "
        f"interleaved: {report['reps']} counted rounds after {report['warmup']} untimed. Medians, "
        "with (min-max) over the rounds.",
        "",
        *table,
        "",
        f"Pool start to ready, once each, for information: plain {starts['plain']:.1f} s, "
        f"--secure {starts['secure']:.1f} s. The hosts share this machine's two CPUs, so the "
        "tunnels' encryption and copies compete with gloo and the training for the same cores, "
        "and the veth link is far faster than a real one: the ratios are an upper bound on the "
        "cost on machines with their own cores and a real network between them. No SSH rank was "
        f"left running after the pools closed ({report['remote_ranks_left']} found).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--reps", 5, "counted rounds")
    count(parser, "--warmup", 1, "untimed rounds of each first", minimum=0)
    args = SCRIPT.parse_args(parser, argv)
    if (why := available()) is not None:
        raise SystemExit(f"bench_secure.py cannot make SSH test hosts here: it {why}")
    load_before = load_avg()
    results = run_all(args)
    report: dict[str, Any] = {
        "machine": machine_info(load_before),
        "command": command_line(),
        **results,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
