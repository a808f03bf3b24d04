"""Core benchmark: pool start against ``torchrun``, and the round trip of a trivial cell.

What is compared, and why it is fair:

* **Start to first cell.** A notebook user of ``skyward_jupyter`` already has a running kernel
  with the package imported, and waits for ``Pool(nodes=2).start()`` plus a first cell that
  crosses the process group (``barrier()``). That is timed inside a fresh ``python -c``
  subprocess *after* it has imported ``skyward_jupyter``, so neither the interpreter start nor
  the import is counted, and the pool's later ``close()`` is not counted either (it happens when
  the user is done; it is reported apart). Ranks are forked from a warm template process that
  has imported torch (``skyward_jupyter.providers.local``), so two pool figures are reported,
  both from the same subprocess: **cold**, the first pool of a fresh process without
  ``LocalProvider.prewarm()`` (it starts the template, which imports torch, then forks the
  ranks), and **warm template**, a second pool started after the first one's ``close()`` while
  the template still runs, which is what a user gets after ``%load_ext skyward_jupyter`` (it
  prewarms the template in the background) or for any later pool in the same kernel.
  ``shutdown_template()`` ends the template before the subprocess exits. A ``torchrun`` user
  waits for the whole command, so
  ``torchrun --standalone --nproc_per_node=2 script.py`` is timed from launch to exit, with a
  script that does ``init_process_group("gloo")`` + ``barrier()`` + ``destroy_process_group()``.
  Both sides start two fresh Python processes with torch imported and form a 2-rank gloo group
  on localhost; the two are alternated (pool subprocess, torchrun, pool subprocess, ...) after
  an uncounted warm-up of each, so page-cache warmth and machine noise hit both alike.
* **Round trip.** ``pool.run("1")`` on a warm 2-rank pool, timed from the call to the returned
  result, 300 times after 20 warm-up runs; median, p10 and p90 are reported.

Run ``python bench/bench_core.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/core.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

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
    run_to_end,
    run_torchrun,
    spread_row,
    torchrun_path,
)

SCRIPT = Script("core")
RESULT_PREFIX = "BENCH_RESULT "
NODES = 2
GOAL_START_RATIO = 1.0  # pool start no slower than torchrun
GOAL_ROUND_TRIP_MS = 3.0  # median round trip of a trivial cell

FIRST_CELL = "import torch.distributed as d; d.barrier()"

# Runs in a fresh interpreter; only the part after the import is timed. The first pool finds no
# template process (no prewarm), so it pays the template's start and torch's import: "cold". The
# second pool, in the same process after the first is closed, forks its ranks from the template
# that is still running, as after ``%load_ext skyward_jupyter`` or for any later pool in a kernel:
# "warm". The template is ended before the process exits.
POOL_CHILD = textwrap.dedent(
    f"""
    import json, time
    from skyward_jupyter import Pool
    from skyward_jupyter.providers import local_template as local

    def first_cell():
        t0 = time.perf_counter()
        pool = Pool(nodes={NODES})
        try:
            pool.start()
            result = pool.run({FIRST_CELL!r})
            t1 = time.perf_counter()
            if not result.ok:
                raise SystemExit("first cell failed: " + repr(result.errors))
        finally:
            t2 = time.perf_counter()
            pool.close()
            t3 = time.perf_counter()
        return t1 - t0, t3 - t2

    try:
        if local._template is not None:
            raise SystemExit("a template was running before the cold pool")
        cold_start, cold_close = first_cell()
        template = local._template
        if template is None or not template.alive:
            raise SystemExit("the cold pool left no running template (ranks spawned cold?)")
        warm_start, warm_close = first_cell()
        if local._template is not template:
            raise SystemExit("the template was replaced between the two pools")
    finally:
        local.shutdown_template()
    print({RESULT_PREFIX!r} + json.dumps({{
        "cold_start_s": cold_start, "cold_close_s": cold_close,
        "warm_start_s": warm_start, "warm_close_s": warm_close,
    }}), flush=True)
    """
)

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    """
)


def time_pool_start(timeout: float) -> dict[str, float]:
    _, out = run_to_end([sys.executable, "-c", POOL_CHILD], timeout, REPO)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise BenchError(f"the pool child printed no result:\n{out[-4000:]}")
    result: dict[str, float] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return result


def compare_start(repeat: int, warmup: int, timeout: float) -> dict[str, Any]:
    torchrun = torchrun_path()
    keys = ("cold_start_s", "cold_close_s", "warm_start_s", "warm_close_s")
    pool_samples: dict[str, list[float]] = {k: [] for k in keys}
    torchrun_wall: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_core_") as tmp:
        script = Path(tmp) / "ddp_barrier.py"
        script.write_text(TORCHRUN_SCRIPT)
        for i in range(warmup + repeat):
            counted = i >= warmup
            label = f"rep {i - warmup + 1}/{repeat}" if counted else f"warm-up {i + 1}/{warmup}"
            pool = time_pool_start(timeout)
            tr = run_torchrun(script, [], NODES, timeout)
            print(
                f"  start {label}: pool cold {pool['cold_start_s']:.3f} s, "
                f"warm template {pool['warm_start_s']:.3f} s, torchrun {tr:.3f} s",
                file=sys.stderr,
                flush=True,
            )
            if counted:
                for k in keys:
                    pool_samples[k].append(pool[k])
                torchrun_wall.append(tr)
    summaries = {f"pool_{k}": asdict(Summary.of(v)) for k, v in pool_samples.items()}
    tr_summary = Summary.of(torchrun_wall)
    return {
        **summaries,
        "torchrun_s": asdict(tr_summary),
        "ratio_cold_over_torchrun": summaries["pool_cold_start_s"]["median"] / tr_summary.median,
        "ratio_warm_over_torchrun": summaries["pool_warm_start_s"]["median"] / tr_summary.median,
        "samples": {
            **{f"pool_{k}": v for k, v in pool_samples.items()},
            "torchrun_s": torchrun_wall,
        },
        "torchrun": str(torchrun),
        "repeat": repeat,
        "warmup": warmup,
    }


def measure_round_trip(runs: int, warmup: int) -> dict[str, Any]:
    from skyward_jupyter import Pool

    samples_ms: list[float] = []
    with Pool(nodes=NODES) as pool:
        for _ in range(warmup):
            pool.run("1").raise_for_errors()
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            result = pool.run("1")
            t1 = time.perf_counter_ns()
            if not result.ok or result.values != [1] * NODES:
                raise BenchError(f"trivial cell failed: {result!r} {result.errors}")
            samples_ms.append((t1 - t0) / 1e6)
        backend = pool.group_backend
    return {
        "round_trip_ms": asdict(Summary.of(samples_ms)),
        "runs": runs,
        "warmup": warmup,
        "backend": backend,
        "samples_ms": samples_ms,
    }


def render_markdown(report: dict[str, Any]) -> str:
    m, start, rt = report["machine"], report["start"], report["round_trip"]
    cold, warm = start["pool_cold_start_s"], start["pool_warm_start_s"]
    cold_close, warm_close = start["pool_cold_close_s"], start["pool_warm_close_s"]
    tr = start["torchrun_s"]
    r = rt["round_trip_ms"]
    cold_ratio, warm_ratio = start["ratio_cold_over_torchrun"], start["ratio_warm_over_torchrun"]
    rt_ok = r["median"] < GOAL_ROUND_TRIP_MS

    def row(label: str, s: dict[str, float], ratio: str) -> str:
        return range_row(label, s, fmt_s, ratio)

    def met(ratio: float) -> str:
        return "met" if ratio <= GOAL_START_RATIO else "NOT met"

    lines = [
        "## Core: pool start and cell round trip",
        "",
        machine_line(m),
        "",
        f"### Start to first cell finished ({NODES} ranks, gloo, {start['repeat']} alternating "
        f"repetitions each after {start['warmup']} uncounted warm-up)",
        "",
        "| | median | min | max | ratio to torchrun (medians) |",
        "|---|---:|---:|---:|---:|",
        row(
            f"`Pool(nodes={NODES}).start()` + `run(barrier)`, **cold**: no template process yet "
            "(first pool of a fresh process, no prewarm)",
            cold,
            f"**{cold_ratio:.3f}**",
        ),
        row(
            f"`Pool(nodes={NODES}).start()` + `run(barrier)`, **warm template**: template already "
            "running (after `%load_ext skyward_jupyter`, or any later pool in the kernel)",
            warm,
            f"**{warm_ratio:.3f}**",
        ),
        row(
            f"`torchrun --standalone --nproc_per_node={NODES}` (init + barrier + destroy)",
            tr,
            "1.00",
        ),
        row("*pool `close()` after the cold start, not counted above*", cold_close, ""),
        row("*pool `close()` after the warm start, not counted above*", warm_close, ""),
        "",
        "torchrun's figure is the whole command a user waits for: its launcher's start "
        "(which imports torch), the workers, and its exit. The pool's figures start at "
        "`Pool(...)` in an interpreter that has already imported `skyward_jupyter` (a running "
        "kernel) and end when the first cell's result is back; its `close()` is shown apart. "
        "Both pool rows come from the same fresh process: the cold pool first (it starts the "
        "rank template, which imports torch, then forks the ranks from it), then, after its "
        "`close()`, a second pool whose ranks are forked from that still-running template.",
        "",
        f"Goal: pool start no slower than torchrun (ratio <= {GOAL_START_RATIO:.2f}): "
        f"cold **{met(cold_ratio)}**, warm template **{met(warm_ratio)}**.",
        "",
        f'### Round trip of a trivial cell (`pool.run("1")`, {NODES} ranks, '
        f"{rt['runs']} runs after {rt['warmup']} warm-up)",
        "",
        "| median | p10 | p90 | min | max |",
        "|---:|---:|---:|---:|---:|",
        spread_row(None, r, fmt_ms),
        "",
        f"Goal: median round trip under {GOAL_ROUND_TRIP_MS:.0f} ms: "
        f"**{'met' if rt_ok else 'NOT met'}**.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--repeat", 5, "start repetitions of each side")
    count(parser, "--start-warmup", 1, "uncounted start pairs first", minimum=0)
    count(parser, "--runs", 300, "timed trivial-cell round trips")
    count(parser, "--warmup", 20, "untimed round trips first", minimum=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launched command")
    args = SCRIPT.parse_args(parser, argv)

    load_before = load_avg()
    print(f"start: pool vs torchrun, {args.repeat} each, alternating", file=sys.stderr)
    start = compare_start(args.repeat, args.start_warmup, args.timeout)
    print(f"round trip: {args.runs} runs after {args.warmup} warm-up", file=sys.stderr)
    round_trip = measure_round_trip(args.runs, args.warmup)
    report: dict[str, Any] = {
        "machine": machine_info(load_before),
        "command": command_line(),
        "goals": {
            "start_ratio_max": GOAL_START_RATIO,
            "round_trip_median_ms_max": GOAL_ROUND_TRIP_MS,
        },
        "start": start,
        "round_trip": round_trip,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
