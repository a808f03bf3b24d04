"""Logging benchmark: does ``log()`` on every training step slow the quickstart's DDP loop?

What is compared, and why it is fair:

* **Training loop, with and without ``log()``.** One 2-rank pool (``Pool(nodes=2)``, gloo) runs
  the quickstart's training loop (``notebooks/01_quickstart.ipynb``: an MLP 100->256->10 wrapped
  in ``DistributedDataParallel``, ``DistributedSampler`` over 4096 synthetic samples, SGD with
  momentum, batch 64, so 32 steps per epoch and rank). A setup cell builds the data, the model and
  two training functions whose source is identical except for one line: the **log** variant calls
  ``log(step=global_step, loss=loss.item(), accuracy=...)`` after *every* step (the worst case;
  the quickstart logs once per epoch), the **plain** variant does not. Both keep the quickstart's
  per-step bookkeeping (``loss.item()``, the batch's correct count, the epoch's ``all_reduce``),
  so the only difference is the ``log()`` call and the extra ``loss.item()`` a user writes in it.
  Each timed cell runs a couple of epochs (2, 64 steps, by default: on a 2-core machine a step's
  time jitters by tens of percent, so many short pairs resolve the overhead better in the same
  time than a few long ones); rank 0 times them with ``time.perf_counter()`` from
  just after a ``barrier()`` to just after a closing ``barrier()``, and the cell returns the time
  as its value. The variants are interleaved, one pair at a time, with the order inside a pair
  alternating (plain-log, log-plain, ...) so drift and position within the pair hit both alike,
  after one uncounted warm-up pair. Both variants keep training the same model (its weights do
  not change the cost of a step). Reported: the median time per step of each variant, the
  overhead ``log/plain - 1`` of the medians, its spread over the pairs (each pair's own
  overhead: median, min, max), a bootstrap 95% interval of the overhead of the medians, and the
  overhead of the means. To see where time goes, the same is reported for CPU time per step: rank
  0's (``time.process_time()``, all its threads, including the one that sends the rows) and the
  notebook process's during the cell (its IO thread decodes the rows).
  The notebook side subscribes to the pool's events and counts the metric rows that arrive, so
  the figures are only reported if every logged step really reached the notebook.
* **One ``log()`` call.** On rank 0 of the same pool (rank 1 idles meanwhile), 100k calls of each
  case in a tight loop, timed in chunks of 100 with the cases interleaved chunk by chunk; the
  median chunk gives ns per call, an empty loop's subtracted (the mean is reported too: it also
  carries preemptions and the rank's background thread pickling the rows). Cases: ``log()`` with
  Python floats, with a 0-d tensor (``log()`` calls ``.item()``), the agent's buffer append alone
  (the sink that ``runtime`` calls after validating), ``tensor.item()`` alone, and the deferred
  cost per row of pickling a batch of rows for the wire (what the rank's background thread does
  every ~0.25 s). From these, the cost of the training loop's log line is predicted as a share of
  a step.

Run ``python bench/bench_log.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/log.json``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from common import (
    REPO,
    BenchError,
    Script,
    Summary,
    bootstrap_ratio,
    command_line,
    count,
    fmt_us,
    load_avg,
    machine_info,
    machine_line,
    rotated,
    spread_row,
)

sys.path.insert(0, str(REPO / "scripts"))  # the quickstart's workload, as its notebook has it
from make_quickstart import DATA_AND_MODEL, HYPERPARAMETERS

SCRIPT = Script("log")
NODES = 2
GOAL_OVERHEAD_PCT = 2.0  # log() on every step slows training by at most this much
HYPER = {k: v for k, v in HYPERPARAMETERS.items() if k != "EPOCHS"}  # epochs: ours to choose
SAMPLES, BATCH_SIZE = HYPER["SAMPLES"], HYPER["BATCH_SIZE"]

LOG_LINE = "log(step=global_step, loss=loss.item(), accuracy=100.0 * correct / len(by))"

# Runs once on every rank: the quickstart's own data, model and optimiser (taken from the script
# that writes the notebook), then the counters of the two variants.
SETUP_CELL = (
    """
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from skyward_jupyter import log

"""
    + DATA_AND_MODEL
    + """bench_epoch = 0
bench_step = 0
"""
)

# The two variants differ only in {log_line}; the clock runs between two barriers on each rank.
TRAIN_TEMPLATE = """
def {name}(epochs):
    global bench_epoch, bench_step
    global_step = bench_step
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        sampler.set_epoch(bench_epoch)
        bench_epoch += 1
        stats = torch.zeros(3, dtype=torch.float64)   # loss sum, correct, seen
        for bx, by in loader:
            optimizer.zero_grad()
            out = model(bx)
            loss = loss_fn(out, by)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()
            correct = (out.argmax(1) == by).sum().item()
            stats += torch.tensor([loss_value * len(by), correct, len(by)], dtype=torch.float64)
            {log_line}
            global_step += 1
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    steps, bench_step = global_step - bench_step, global_step
    return {{"seconds": seconds, "cpu_seconds": cpu_seconds, "steps": steps,
            "loss": (stats[0] / stats[2]).item()}}
"""

VARIANTS = {"plain": "pass  # no log()", "log": LOG_LINE}

# ns per call of what one log() does, on rank 0 only (rank 1 idles, so the two do not share the
# machine's cores). The calls run in chunks of CHUNK, the cases interleaved chunk by chunk; each
# chunk is timed, and 'loop' (an empty loop) is subtracted from the others.
MICRO_CELL = """
def bench_micro(calls, chunk, encode_rows):
    import time

    from skyward_jupyter import instance_info, protocol, runtime, wire

    if not instance_info().is_head:
        return None
    sink = runtime._sink                   # the agent's batching buffer, installed at start
    if sink is None:
        raise RuntimeError("no metric sink installed: not running on a pool rank")
    t = torch.tensor(0.5)
    clock = time.perf_counter_ns

    def loop(n):
        t0 = clock()
        for i in range(n):
            pass
        return clock() - t0

    def log_floats(n):
        t0 = clock()
        for i in range(n):
            log(step=i, loss=0.5, accuracy=0.9)
        return clock() - t0

    def log_tensor(n):
        t0 = clock()
        for i in range(n):
            log(step=i, loss=t, accuracy=0.9)
        return clock() - t0

    def sink_only(n):
        t0 = clock()
        for i in range(n):
            sink(i, {"loss": 0.5, "accuracy": 0.9})
        return clock() - t0

    def item_only(n):
        t0 = clock()
        for i in range(n):
            t.item()
        return clock() - t0

    cases = {"loop": loop, "log_floats": log_floats, "log_tensor": log_tensor,
             "sink_only": sink_only, "item_only": item_only}
    ns = {name: [] for name in cases}
    for _ in range(calls // chunk):
        for name, fn in cases.items():
            ns[name].append(fn(chunk) / chunk)
    rows = tuple((i, {"loss": 0.5 + i, "accuracy": 0.9}) for i in range(encode_rows))
    encode_ns = []
    for _ in range(5):
        t0 = clock()
        frame = wire.encode(protocol.Metrics(0, rows))
        encode_ns.append((clock() - t0) / encode_rows)
    return {"ns_per_call": ns, "encode_ns_per_row": encode_ns,
            "encode_bytes_per_row": sum(len(s) for s in frame) / encode_rows,
            "logged_rows": 3 * chunk * (calls // chunk)}
"""


class RowCounter:
    """Counts the metric rows that reach the notebook, per cell (called on the pool's IO thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows: Counter[int | None] = Counter()

    def __call__(self, event: object) -> None:
        from skyward_jupyter.events import MetricsLogged

        if isinstance(event, MetricsLogged):
            with self._lock:
                self.rows[event.cell_id] += len(event.rows)

    def of(self, cell_id: int) -> int:
        with self._lock:
            return self.rows[cell_id]


def _run_train(pool: Any, counter: RowCounter, variant: str, epochs: int) -> dict[str, Any]:
    cpu_started = time.process_time()
    result = pool.run(f"train_{variant}({epochs})")
    notebook_cpu = time.process_time() - cpu_started
    if not result.ok:
        raise BenchError(f"training cell ({variant}) failed: {result.errors}")
    per_rank = result.values
    steps = per_rank[0]["steps"]
    if any(v["steps"] != steps for v in per_rank):
        raise BenchError(f"ranks ran different step counts: {per_rank}")
    rows = counter.of(result.cell_id)
    expected = steps * NODES if variant == "log" else 0
    # Every row is flushed before the rank reports the cell done, so all have arrived by now.
    if rows != expected:
        raise BenchError(f"{variant}: {rows} metric rows reached the notebook, expected {expected}")
    return {
        "seconds": per_rank[0]["seconds"],
        "seconds_by_rank": [v["seconds"] for v in per_rank],
        "cpu_seconds_by_rank": [v["cpu_seconds"] for v in per_rank],
        "notebook_cpu_seconds": notebook_cpu,
        "steps": steps,
        "loss": per_rank[0]["loss"],
        "rows_received": rows,
    }


def _overheads(plain: list[float], logged: list[float]) -> dict[str, Any]:
    """``log / plain - 1`` in %: of the medians (bootstrap interval), of the means, per pair."""
    pair = [100.0 * (q / p - 1.0) for p, q in zip(plain, logged, strict=True)]
    return {
        "of_medians_pct": 100.0 * (statistics.median(logged) / statistics.median(plain) - 1.0),
        "of_medians_bootstrap_95_pct": [100.0 * (r - 1.0) for r in bootstrap_ratio(plain, logged)],
        "of_means_pct": 100.0 * (statistics.fmean(logged) / statistics.fmean(plain) - 1.0),
        "per_pair_pct": asdict(Summary.of(pair)),
        "samples_per_pair_pct": pair,
    }


def measure_training(pool: Any, counter: RowCounter, pairs: int, epochs: int) -> dict[str, Any]:
    # per step, in us: rank 0's wall time (the figure), rank 0's CPU time (all its threads), and
    # the notebook process's CPU time during the cell (its IO thread decodes the metric rows)
    kinds = ("wall", "rank0_cpu", "notebook_cpu")
    per_step: dict[str, dict[str, list[float]]] = {k: {"plain": [], "log": []} for k in kinds}
    runs: list[dict[str, Any]] = []
    for i in range(pairs + 1):  # pair 0 is the uncounted warm-up
        order = rotated(("plain", "log"), i)
        pair: dict[str, dict[str, float]] = {}
        for variant in order:
            run = _run_train(pool, counter, variant, epochs)
            us = 1e6 / run["steps"]
            pair[variant] = {
                "wall": us * run["seconds"],
                "rank0_cpu": us * run["cpu_seconds_by_rank"][0],
                "notebook_cpu": us * run["notebook_cpu_seconds"],
            }
            if i > 0:
                runs.append({"pair": i, "variant": variant, **run})
        plain_us, log_us = pair["plain"]["wall"], pair["log"]["wall"]
        label = f"pair {i}/{pairs}" if i > 0 else "warm-up pair"
        print(
            f"  {label} ({' then '.join(order)}): plain {plain_us:.1f} us/step, "
            f"log {log_us:.1f} us/step ({100 * (log_us / plain_us - 1):+.2f}%)",
            file=sys.stderr,
            flush=True,
        )
        if i > 0:
            for kind in kinds:
                for variant in ("plain", "log"):
                    per_step[kind][variant].append(pair[variant][kind])
    return {
        "per_step_us": {
            kind: {v: asdict(Summary.of(x)) for v, x in by_variant.items()}
            for kind, by_variant in per_step.items()
        },
        "overhead": {
            kind: _overheads(by_variant["plain"], by_variant["log"])
            for kind, by_variant in per_step.items()
        },
        "samples_per_step_us": per_step,
        "runs": runs,
        "pairs": pairs,
        "epochs_per_run": epochs,
        "steps_per_run": runs[0]["steps"],
    }


def measure_micro(pool: Any, counter: RowCounter, calls: int, chunk: int) -> dict[str, Any]:
    encode_rows = 10_000
    result = pool.run(f"bench_micro({calls}, {chunk}, {encode_rows})")
    if not result.ok:
        raise BenchError(f"micro-benchmark cell failed: {result.errors}")
    head = result.values[0]
    rows = counter.of(result.cell_id)
    if rows != head["logged_rows"]:
        raise BenchError(f"micro: {rows} rows reached the notebook, expected {head['logged_rows']}")
    per_call = head["ns_per_call"]
    loop = statistics.median(per_call["loop"])
    loop_mean = statistics.fmean(per_call["loop"])
    return {
        "calls": len(per_call["loop"]) * chunk,
        "chunk": chunk,
        "loop_ns": loop,
        "median_ns_per_call_net": {
            name: statistics.median(v) - loop for name, v in per_call.items() if name != "loop"
        },
        "mean_ns_per_call_net": {
            name: statistics.fmean(v) - loop_mean for name, v in per_call.items() if name != "loop"
        },
        "encode_ns_per_row": statistics.median(head["encode_ns_per_row"]),
        "encode_bytes_per_row": head["encode_bytes_per_row"],
        "encode_rows": encode_rows,
        "rows_received": rows,
        "samples_ns_per_call": per_call,
    }


def run_benchmark(pairs: int, epochs: int, calls: int, chunk: int) -> dict[str, Any]:
    from skyward_jupyter import Pool
    from skyward_jupyter.providers import local

    counter = RowCounter()
    try:
        with Pool(nodes=NODES) as pool:
            pool.subscribe(counter)
            pool.run(SETUP_CELL, HYPER).raise_for_errors()
            for name, line in VARIANTS.items():
                source = TRAIN_TEMPLATE.format(name=f"train_{name}", log_line=line)
                pool.run(source).raise_for_errors()
                pool.run(f"train_{name}").raise_for_errors()
            pool.run(MICRO_CELL).raise_for_errors()
            print(
                f"training: {pairs} interleaved pairs of {epochs} epochs after 1 warm-up pair",
                file=sys.stderr,
            )
            training = measure_training(pool, counter, pairs, epochs)
            print(f"micro: {calls} calls of each case in chunks of {chunk}", file=sys.stderr)
            micro = measure_micro(pool, counter, calls, chunk)
            backend = pool.group_backend
    finally:
        local.shutdown_template()
    return {"training": training, "micro": micro, "backend": backend}


def _pct(x: float) -> str:
    return f"{x:+.2f}%"


def render_markdown(report: dict[str, Any]) -> str:
    m, t, mi = report["machine"], report["training"], report["micro"]
    plain, logged = t["per_step_us"]["wall"]["plain"], t["per_step_us"]["wall"]["log"]
    wall = t["overhead"]["wall"]
    overhead, (lo, hi) = wall["of_medians_pct"], wall["of_medians_bootstrap_95_pct"]
    po = wall["per_pair_pct"]
    if hi <= GOAL_OVERHEAD_PCT:
        goal = "**met** (the whole 95% interval lies under it)"
    elif overhead <= GOAL_OVERHEAD_PCT:
        goal = (
            f"**met** by the medians; the 95% interval reaches {_pct(hi)}, so this run's noise "
            f"cannot rule out more than {GOAL_OVERHEAD_PCT:.0f}%"
        )
    else:
        goal = "**NOT met**"
    net = mi["median_ns_per_call_net"]

    def overhead_row(label: str, kind: str) -> str:
        o, by = t["overhead"][kind], t["per_step_us"][kind]
        pp = o["per_pair_pct"]
        lo_k, hi_k = o["of_medians_bootstrap_95_pct"]
        return (
            f"| {label} | {fmt_us(by['plain']['median'])} | {fmt_us(by['log']['median'])} "
            f"| **{_pct(o['of_medians_pct'])}** ({_pct(lo_k)} to {_pct(hi_k)}) "
            f"| {_pct(o['of_means_pct'])} | {_pct(pp['median'])} "
            f"({_pct(pp['min'])} / {_pct(pp['max'])}) |"
        )

    def row(label: str, s: dict[str, float]) -> str:
        return spread_row(label, s, fmt_us)

    mean = mi["mean_ns_per_call_net"]

    def micro_row(label: str, key: str) -> str:
        return f"| {label} | {net[key]:.0f} | {mean[key]:.0f} |"

    predicted_ns = net["item_only"] + net["log_floats"] + mi["encode_ns_per_row"]
    predicted_pct = 100.0 * predicted_ns / 1e3 / plain["median"]
    if lo <= predicted_pct <= hi:
        verdict = f"within the measured overhead's 95% interval ({_pct(lo)} to {_pct(hi)})."
    else:
        verdict = (
            f"outside the measured overhead's 95% interval ({_pct(lo)} to {_pct(hi)}), so the "
            "training loop pays for something beyond the calls themselves (or the noise fooled "
            "the interval)."
        )
    lines = [
        "## Logging: `log()` on every training step",
        "",
        machine_line(m) + " "
        "Regenerate with `.venv/bin/python bench/bench_log.py --markdown-out BENCHMARKS.md` "
        "(raw samples in `bench/results/log.json`).",
        "",
        f"One `Pool(nodes={NODES})` ({report['backend']}) runs the quickstart's training loop "
        f"(DDP MLP 100->256->10, `DistributedSampler` over {SAMPLES} samples, SGD, batch "
        f"{BATCH_SIZE}: {t['steps_per_run']} steps per rank and timed cell, "
        f"{t['epochs_per_run']} epochs) in two variants whose source differs in one line: "
        f"**log** calls `{LOG_LINE}` after every step (the worst case; the quickstart logs "
        "once per epoch), **plain** does not. Rank 0 times each cell with "
        "`time.perf_counter()` between two `barrier()`s and returns the time. "
        f"{t['pairs']} pairs after 1 uncounted warm-up pair, interleaved one pair at a time with "
        "the order inside a pair alternating. Every logged row "
        f"({t['steps_per_run'] * NODES} per log cell) was counted arriving at the notebook.",
        "",
        f"### Time per training step ({t['pairs']} cells of each variant)",
        "",
        "| variant | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        row("plain (no `log()`)", plain),
        row("`log()` every step", logged),
        "",
        "Overhead `log / plain - 1`, in rank 0's wall time per step (the figure), and, to see "
        "where time goes, in CPU time per step of rank 0 (all its threads, including the one "
        "that pickles and sends the rows) and of the notebook process (whose IO thread decodes "
        "them):",
        "",
        "| per step | plain, median | log, median | overhead of the medians (bootstrap 95%) "
        "| overhead of the means | per pair: median (min / max) |",
        "|---|---:|---:|---:|---:|---:|",
        overhead_row("rank 0 wall time", "wall"),
        overhead_row("*rank 0 CPU time*", "rank0_cpu"),
        overhead_row("*notebook process CPU time*", "notebook_cpu"),
        "",
        f"Per-pair wall-time overhead p10 {_pct(po['p10'])}, p90 {_pct(po['p90'])}: a step's "
        "time on this machine jitters far more than `log()` costs, hence the many pairs.",
        "",
        f"Goal: at most {GOAL_OVERHEAD_PCT:.0f}% slower with `log()` on every step (wall-time "
        f"overhead of the medians, {_pct(overhead)}): {goal}.",
        "",
        f"### One `log()` call on rank 0 ({mi['calls']} calls of each, timed in chunks of "
        f"{mi['chunk']}, the cases interleaved chunk by chunk; an empty loop's "
        f"{mi['loop_ns']:.0f} ns per iteration subtracted)",
        "",
        "| what | median ns per call | mean ns per call |",
        "|---|---:|---:|",
        micro_row("`log(step=i, loss=0.5, accuracy=0.9)` (Python floats)", "log_floats"),
        micro_row(
            "`log(step=i, loss=t, accuracy=0.9)` (`t` a 0-d tensor: `log()` calls `.item()`)",
            "log_tensor",
        ),
        micro_row(
            "the agent's buffer append alone (the sink `log()` ends in; dict built by the caller)",
            "sink_only",
        ),
        micro_row("`t.item()` alone", "item_only"),
        "| *deferred, per row: pickling a batch of rows for the wire (done by the rank's "
        f"background thread every ~0.25 s; measured on {mi['encode_rows']} rows, "
        f"{mi['encode_bytes_per_row']:.0f} bytes per row)* | {mi['encode_ns_per_row']:.0f} | |",
        "",
        "The median is the cost of a call; the mean also carries the chunks in which rank 0 "
        "was preempted or its background thread held the GIL to pickle and send the rows, and "
        "the notebook process decoding them on the same cores (at this call rate, about a "
        "thousand times more rows per second than the training loop produces). "
        "The buffer append is "
        f"{net['sink_only']:.0f} ns of a {net['log_floats']:.0f} ns `log()`; the rest is "
        "`log()` checking and converting its arguments. The training loop's log line costs "
        f"about {predicted_ns / 1e3:.2f} us per step (`loss.item()` + `log()` with floats + "
        f"pickling its row), **{predicted_pct:.3f}%** of a {plain['median']:.0f} us step: "
        f"{verdict}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--pairs", 300, "timed (plain, log) pairs")
    count(parser, "--epochs", 2, "epochs (32 steps each) per cell")
    count(parser, "--calls", 100_000, "log() calls per micro loop")
    count(parser, "--chunk", 100, "micro calls timed together")
    args = SCRIPT.parse_args(parser, argv)
    if args.calls < args.chunk:
        parser.error("--calls must be at least --chunk")

    load_before = load_avg()
    started = time.perf_counter()
    measured = run_benchmark(args.pairs, args.epochs, args.calls, args.chunk)
    report: dict[str, Any] = {
        "machine": machine_info(load_before),
        "command": command_line(),
        "goals": {"overhead_pct_max": GOAL_OVERHEAD_PCT},
        "log_line": LOG_LINE,
        **measured,
        "wall_s": time.perf_counter() - started,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report), note=f" ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
