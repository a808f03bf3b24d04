"""Scale benchmark: how a pool's costs grow from 2 ranks to hundreds, on local simulated nodes.

One IPython ``InteractiveShell`` in this process (the notebook) with ``%load_ext
skyward_jupyter``; for each size in turn a pool of ``--framework none`` ranks (``--procs-per-node
8`` from 8 ranks on, as on 8-GPU nodes; one node below that) is started, measured and ended:

* **start**: ``%sky up`` to every rank ready, wall time;
* **trivial cell**: ``%%sky`` + ``1``, timed around ``shell.run_cell`` after a warm-up;
* **idle CPU**: the notebook process's CPU time (every thread, user and system) over an idle
  window with the pool up, as a percentage of one core;
* **down**: ``%sky down``, wall time;
* **failing rank named**: a cell that raises on the last rank while every other rank sleeps,
  from ``run_cell`` to the cell's error naming that rank (the pool interrupts the others); and
  the last rank killed with SIGKILL while a cell sleeps on every rank, from the kill to the
  cell's error naming it.

Run ``python bench/bench_scale.py --markdown-out BENCHMARKS.md`` to regenerate the block in
``BENCHMARKS.md``; JSON goes to ``bench/results/scale.json``. Never edit the figures by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from common import (
    BenchError,
    Script,
    Summary,
    command_line,
    fmt_ms,
    load_avg,
    machine_info,
    machine_line,
)

from skyward_jupyter.limits import MAX_RANKS
from skyward_jupyter.providers.local_template import template_pids

SCRIPT = Script("scale")
SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
PER_NODE = 8
MODELLED = (1024, 4096)
GOALS = {"start_s": 5.0, "cell_ms": 30.0, "idle_cpu_percent": 5.0, "named_s": 3.0}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The cells' values and the pool's lines go nowhere."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def layout(ranks: int) -> tuple[int, int]:
    """(nodes, ranks per node) for a pool of ``ranks``."""
    return (ranks // PER_NODE, PER_NODE) if ranks >= PER_NODE else (1, ranks)


def cell(shell: Any, code: str) -> tuple[float, Any]:
    started = time.perf_counter()
    with quiet():
        result = shell.run_cell(code, store_history=False)
    return time.perf_counter() - started, result


def ok_cell(shell: Any, code: str) -> float:
    seconds, result = cell(shell, code)
    if not result.success:
        raise BenchError(f"cell failed: {code!r}: {result.error_in_exec}")
    return seconds


def failed_on(shell: Any, code: str, rank: int) -> float:
    seconds, result = cell(shell, code)
    error = str(result.error_in_exec or "")
    if result.success or f"rank {rank}" not in error:
        raise BenchError(f"the cell did not fail naming rank {rank}: {error[:300]!r}")
    return seconds


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def pid_cpu(pids: Sequence[int]) -> float:
    """CPU seconds (user and system) the processes ``pids`` used so far, those gone aside."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def rank_pids(shell: Any, name: str) -> list[int]:
    pool = shell._skyward_session.pools[name].pool
    return [r.process.pid for r in pool._ranks.all if r.process is not None]


def idle_cpu(window: float) -> float:
    """Percent of one core this process used over ``window`` seconds while nothing ran."""
    began, cpu = time.perf_counter(), cpu_seconds()
    time.sleep(window)
    return 100 * (cpu_seconds() - cpu) / (time.perf_counter() - began)


def private_mib(shell: Any, name: str) -> float:
    """The ranks' own memory (private pages, from ``smaps_rollup``), mean per rank in MiB."""
    pool = shell._skyward_session.pools[name].pool
    sizes = []
    for r in pool._ranks.all:
        fields = {}
        with open(f"/proc/{r.process.pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    fields[key] = int(rest.split()[0])
        sizes.append((fields["Private_Clean"] + fields["Private_Dirty"]) / 1024)
    return sum(sizes) / len(sizes)


def kill_named(shell: Any, name: str, rank: int) -> float:
    """SIGKILL ``rank`` a moment into a sleeping cell: seconds from the kill to the error."""
    pool = shell._skyward_session.pools[name].pool
    pid = next(r.process.pid for r in pool._ranks.all if r.index == rank)
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.5)  # the cell is running on every rank by then
        killed_at.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    _, result = cell(shell, f"%%sky --name {name}\nimport time\ntime.sleep(20)")
    ended = time.perf_counter()
    killer.join()
    error = str(result.error_in_exec or "")
    if result.success or f"rank {rank}" not in error:
        raise BenchError(f"the kill was not named (rank {rank}): {error[:300]!r}")
    return ended - killed_at[0]


def wait_ready(shell: Any, name: str, ranks: int, timeout: float = 120) -> None:
    """After a kill, the pool restarts the rank: wait until every rank is ready again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok_cell_quiet(shell, name, ranks):
            return
        time.sleep(0.2)
    raise BenchError(f"pool {name!r} did not get its {ranks} ranks back in {timeout:.0f} s")


def ok_cell_quiet(shell: Any, name: str, ranks: int) -> bool:
    _, result = cell(shell, f"%%sky --name {name}\nworld_size")
    return bool(result.success)


def measure(shell: Any, ranks: int, runs: int, window: float, fails: int) -> dict[str, Any]:
    nodes, per = layout(ranks)
    name = f"s{ranks}"
    up = f"up --name {name} --nodes {nodes} --procs-per-node {per} --framework none"
    templates = template_pids()
    began, cpu0, tcpu0 = time.perf_counter(), cpu_seconds(), pid_cpu(templates)
    with quiet():
        shell.run_line_magic("sky", up)
    start = time.perf_counter() - began
    pids = rank_pids(shell, name)
    start_cpu = {
        "notebook_s": cpu_seconds() - cpu0,
        "template_s": pid_cpu(templates) - tcpu0,
        "ranks_s": pid_cpu(pids),
    }
    try:
        trivial = f"%%sky --name {name}\n1"
        for _ in range(max(3, runs // 10)):
            ok_cell(shell, trivial)
        cpu0, rcpu0 = cpu_seconds(), pid_cpu(pids)
        cells = [ok_cell(shell, trivial) * 1e3 for _ in range(runs)]
        cell_cpu = {
            "notebook_ms": (cpu_seconds() - cpu0) / runs * 1e3,
            "ranks_ms": (pid_cpu(pids) - rcpu0) / runs * 1e3,
        }
        cpu = idle_cpu(window)
        memory = private_mib(shell, name)
        last = ranks - 1
        raise_code = (
            f"%%sky --name {name}\nimport time\nif rank == {last}:\n"
            f"    raise ValueError('rank {last} fails')\ntime.sleep(20)"
        )
        raised = [failed_on(shell, raise_code, last) for _ in range(fails)]
        killed = []
        for _ in range(fails):
            killed.append(kill_named(shell, name, last))
            wait_ready(shell, name, ranks)
    except BaseException:
        with quiet(), contextlib.suppress(Exception):
            shell.run_line_magic("sky", f"down {name}")
        raise
    began = time.perf_counter()
    with quiet():
        shell.run_line_magic("sky", f"down {name}")
    down = time.perf_counter() - began
    row = {
        "ranks": ranks,
        "nodes": nodes,
        "per_node": per,
        "start_s": start,
        "down_s": down,
        "start_cpu": start_cpu,
        "cell_cpu": cell_cpu,
        "cell_ms": asdict(Summary.of(cells)),
        "idle_cpu_percent": cpu,
        "private_mib": memory,
        "raise_named_s": asdict(Summary.of(raised)),
        "kill_named_s": asdict(Summary.of(killed)),
    }
    print(
        f"  {ranks} ranks: start {start:.2f} s, cell {row['cell_ms']['median']:.1f} ms, "
        f"idle cpu {cpu:.1f}%, {memory:.0f} MiB a rank, "
        f"raise named {row['raise_named_s']['median']:.2f} s, "
        f"kill named {row['kill_named_s']['median']:.2f} s",
        file=sys.stderr,
    )
    print(f"  row: {json.dumps(row)}", file=sys.stderr)  # kept should a larger size fail
    return row


def run_benchmark(
    sizes: Sequence[int], runs: int, window: float, fails: int
) -> list[dict[str, Any]]:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    with quiet():
        shell.run_line_magic("load_ext", "skyward_jupyter")
        # The warm template starts with the first pool: not a cost of any size.
        shell.run_line_magic("sky", "up --name warm --nodes 1 --procs-per-node 1 --framework none")
        shell.run_line_magic("sky", "down warm")
    try:
        return [measure(shell, n, runs, window, fails) for n in sizes]
    finally:
        with quiet(), contextlib.suppress(Exception):
            shell.run_line_magic("sky", "down --all")


def per_rank(rows: Sequence[dict[str, Any]], value: Any) -> float:
    """The least-squares slope of ``value(row)`` against the ranks, over pools of 16 ranks and
    more (below, the fixed costs hide the growth).
    """
    points = [(r["ranks"], value(r)) for r in rows if r["ranks"] >= 16] or [
        (r["ranks"], value(r)) for r in rows
    ]
    if len(points) < 2:
        return points[0][1] / points[0][0]
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def model(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Costs per rank from the measured curves, and what they give for 1024 and 4096 ranks on
    8-GPU nodes: the notebook's share grows with the ranks, each node's (its template forking
    its ranks, the ranks starting and running the cell) runs on that node beside the others.
    """
    big = rows[-1]
    costs = {
        "notebook_start_s": per_rank(rows, lambda r: r["start_cpu"]["notebook_s"]),
        "notebook_cell_ms": per_rank(rows, lambda r: r["cell_cpu"]["notebook_ms"]),
        "notebook_idle_percent": per_rank(rows, lambda r: r["idle_cpu_percent"]),
        "fork_s": big["start_cpu"]["template_s"] / big["ranks"],
        "rank_start_s": big["start_cpu"]["ranks_s"] / big["ranks"],
        "rank_cell_ms": big["cell_cpu"]["ranks_ms"] / big["ranks"],
    }
    at = {}
    for ranks in MODELLED:
        at[str(ranks)] = {
            "nodes": ranks // PER_NODE,
            "start_s": ranks * costs["notebook_start_s"]
            + PER_NODE * (costs["fork_s"] + costs["rank_start_s"]),
            "cell_ms": ranks * costs["notebook_cell_ms"] + costs["rank_cell_ms"],
            "idle_cpu_percent": ranks * costs["notebook_idle_percent"],
        }
    fixed = {
        "start_s": PER_NODE * (costs["fork_s"] + costs["rank_start_s"]),
        "cell_ms": costs["rank_cell_ms"],
        "idle_cpu_percent": 0.0,
    }
    slope = {
        "start_s": costs["notebook_start_s"],
        "cell_ms": costs["notebook_cell_ms"],
        "idle_cpu_percent": costs["notebook_idle_percent"],
    }
    crossing = {
        key: (GOALS[key] - fixed[key]) / slope[key] if slope[key] > 0 else None for key in fixed
    }
    return {"per_rank": costs, "at": at, "goal_crossed_at_ranks": crossing}


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [
        "## Scale (2 to 256 ranks)",
        "",
        machine_line(report["machine"]),
        "",
        f"Command: `{report['command']}`",
        "",
        f"Local simulated nodes of {PER_NODE} `--framework none` ranks each (one node below "
        f"{PER_NODE} ranks), all on this machine; one pool at a time. Trivial cell: median of "
        f"{rows[0]['cell_ms']['n']} `%%sky` + `1` around `shell.run_cell`. Idle CPU: the "
        f"notebook process over {report['window_s']:.0f} s with the pool up and idle, percent "
        "of one core. Memory a rank: its private pages after the idle window (what it shares "
        "with its template aside). Named: a cell raising on the last rank while the others "
        "sleep (run to error naming it), and the last rank killed (SIGKILL) in a sleeping "
        f"cell (kill to error naming it), medians of {rows[0]['raise_named_s']['n']}.",
        "",
        "| ranks | nodes | start | trivial cell (p10-p90) | idle CPU | memory a rank | raise named "
        "| kill named | down |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["cell_ms"]
        lines.append(
            f"| {r['ranks']} | {r['nodes']} | {r['start_s']:.2f} s | {fmt_ms(c['median'])} "
            f"({c['p10']:.2f}-{c['p90']:.2f}) | {r['idle_cpu_percent']:.1f}% | "
            f"{r['private_mib']:.0f} MiB | "
            f"{r['raise_named_s']['median']:.2f} s | {r['kill_named_s']['median']:.2f} s | "
            f"{r['down_s']:.2f} s |"
        )
    lines += [
        "",
        "Where the CPU goes (CPU time, which the machine's load moves far less than wall time): "
        "a pool's start in the notebook, the rank template (it forks every rank) and the ranks; "
        "a trivial cell in the notebook and in all the ranks together, mean of the timed cells.",
        "",
        "| ranks | start: notebook | template | ranks | cell: notebook | ranks | "
        "idle notebook a rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, c = r["start_cpu"], r["cell_cpu"]
        lines.append(
            f"| {r['ranks']} | {s['notebook_s']:.2f} s | {s['template_s']:.2f} s | "
            f"{s['ranks_s']:.2f} s | {c['notebook_ms']:.1f} ms | {c['ranks_ms']:.1f} ms | "
            f"{r['idle_cpu_percent'] / r['ranks']:.3f}% |"
        )
    m = report["model"]
    c = m["per_rank"]
    lines += [
        "",
        "**Model of 1024 and 4096 ranks on 8-GPU nodes** (from the CPU figures above, which the "
        "load moves least). Per rank, the notebook spends "
        f"{c['notebook_start_s'] * 1e3:.2f} ms of CPU at the start, "
        f"{c['notebook_cell_ms'] * 1e3:.0f} us on a trivial cell and "
        f"{c['notebook_idle_percent']:.4f}% of a core while the pool idles (an eighth of its "
        "node's usage message and beat each second, its own usage event and a beat every few "
        "seconds): least-squares slopes over the pools of 16 ranks and more. Per node, "
        f"its template forks each rank for {c['fork_s'] * 1e3:.1f} ms of CPU, a rank takes "
        f"{c['rank_start_s'] * 1e3:.1f} ms of CPU to start and {c['rank_cell_ms'] * 1e3:.0f} us "
        f"for a trivial cell (at {rows[-1]['ranks']} ranks); on real nodes that work runs on "
        "each node, beside the others. So a pool of N ranks on N/8 nodes costs the notebook "
        "about N times its share, plus one node's: a lower bound (no network, no "
        "provisioning).",
        "",
        "| ranks | nodes | start | trivial cell | idle CPU of the notebook |",
        "|---|---|---|---|---|",
    ]
    for ranks, e in m["at"].items():
        lines.append(
            f"| {ranks} | {e['nodes']} | {e['start_s']:.1f} s | {e['cell_ms']:.0f} ms | "
            f"{e['idle_cpu_percent']:.0f}% |"
        )
    lines.append("")
    for ranks, e in m["at"].items():
        over = [
            f"{what} ({e[key]:.{digits}f}{unit} against {GOALS[key]:g}{unit})"
            for key, what, unit, digits in (
                ("cell_ms", "the trivial cell", " ms", 0),
                ("start_s", "the start", " s", 1),
                ("idle_cpu_percent", "the idle notebook's CPU", "%", 0),
            )
            if e[key] > GOALS[key]
        ]
        limit = (
            f" it is over `MAX_RANKS` ({MAX_RANKS}), so the pool is refused first;"
            if int(ranks) > MAX_RANKS
            else ""
        )
        lines.append(
            f"- {ranks} ranks:{limit} "
            + (f"past the goal: {', '.join(over)}." if over else "every goal holds.")
        )
    crossed = sorted(
        (ranks, what)
        for what, ranks in (
            ("the trivial cell", m["goal_crossed_at_ranks"]["cell_ms"]),
            ("the idle notebook's CPU", m["goal_crossed_at_ranks"]["idle_cpu_percent"]),
            ("the start", m["goal_crossed_at_ranks"]["start_s"]),
        )
        if ranks is not None
    )
    lines.append(
        "- What limits first, on real 8-GPU nodes: "
        + ", then ".join(f"{what} at about {ranks:.0f} ranks" for ranks, what in crossed)
        + " cross their goals. The start and the cell grow with the notebook's work per rank "
        "(a command written to each rank, its answer read from each); the idle notebook's "
        "mostly with the nodes (each node's first rank sends the usage of all its ranks in one "
        "message a second)."
    )
    big = rows[-1]
    named = max(big["raise_named_s"]["median"], big["kill_named_s"]["median"])
    lines += [
        "",
        f"- Goals at {big['ranks']} ranks: start at most {GOALS['start_s']:.0f} s "
        f"({_met(big['start_s'] <= GOALS['start_s'])}), a trivial cell at most "
        f"{GOALS['cell_ms']:.0f} ms ({_met(big['cell_ms']['median'] <= GOALS['cell_ms'])}), "
        f"idle CPU at most {GOALS['idle_cpu_percent']:.0f}% of a core "
        f"({_met(big['idle_cpu_percent'] <= GOALS['idle_cpu_percent'])}), a failing rank named "
        f"within {GOALS['named_s']:.0f} s ({_met(named <= GOALS['named_s'])}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--runs", type=int, default=100, help="timed trivial cells per size")
    parser.add_argument("--window", type=float, default=10.0, help="idle seconds measured")
    parser.add_argument("--fails", type=int, default=3, help="failures of each kind per size")
    args = SCRIPT.parse_args(parser, argv)
    load_before = load_avg()
    rows = run_benchmark(args.sizes, args.runs, args.window, args.fails)
    report = {
        "machine": machine_info(load_before),
        "command": command_line(),
        "window_s": args.window,
        "rows": rows,
        "model": model(rows),
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
