"""Bring your own code: torchrun scripts on a warm pool against ``torchrun`` itself, in one run.

What is compared, and why it is fair:

* **(a) Hugging Face Trainer, training steps per second.** ``bench/scripts/hf_trainer.py``
  builds ``BertForSequenceClassification`` from a tiny ``BertConfig`` (nothing is downloaded:
  ``HF_HUB_OFFLINE=1``), trains it with ``Trainer`` (``TrainingArguments(max_steps=N,
  per_device_train_batch_size=8, report_to=[], save_strategy="no", ...)``) on random tokens, and
  reports its own steps per second: a ``TrainerCallback`` timestamps every ``on_step_end``, and the
  figure is the steps after the first few (warm-up) over the time between their timestamps. That
  is the training loop's steady state alone; ``train_runtime`` from the metrics would also carry
  DDP's wrapping and first broadcast, the optimiser's creation and the first steps' lazy work,
  which are not what "the pool trains slower" would mean (it is recorded, for information). The
  same file runs as ``torchrun --standalone --nproc-per-node 2 hf_trainer.py OUT ...`` and as
  ``%sky run hf_trainer.py OUT ...`` on a warm 2-rank pool (``Session.run_script``, what the magic
  calls): same code, same arguments, both measured inside the script by rank 0.
* **(b) A plain DDP loop, steps per second.** ``bench/scripts/ddp_mlp.py`` is a torchrun script
  as the PyTorch ddp-tutorial-series writes one: ``init_process_group()``, an MLP in
  ``DistributedDataParallel``, ``DistributedSampler``, SGD, a few untimed steps, then ``K`` steps
  timed by ``time.perf_counter()`` between two ``barrier()``s, ``destroy_process_group()`` at the
  end. It runs under torchrun, as ``%sky run`` on the pool, and as a notebook user would paste it:
  one ``%%sky`` cell with its definitions (everything above ``if __name__ == "__main__":``, run
  once) and a ``%%sky`` cell ``main([...])`` per repetition (``Session.run_cell``).
* **(c) Wall time of a short script.** ``ddp_mlp.py`` with a handful of steps (init, DDP, a few
  steps, destroy): ``%sky run`` on the warm pool (already started, the script already run once),
  from the call to its return (the pool re-forming the group the script destroyed is inside that
  time), against ``torchrun --standalone --nproc-per-node 2 ddp_mlp.py ...`` from launch to exit.

Both sides get the same thread settings, the ones torchrun chooses: torchrun sets
``OMP_NUM_THREADS=1`` for each of several workers on one machine (unless the environment has it),
and the pool gives its ranks the same variable under the same rule and applies it with
``torch.set_num_threads``, since its ranks are forked from a template that imported torch. Each
script reports what it ran with (``torch.get_num_threads()``, interop threads,
``OMP_NUM_THREADS``, the OS threads of rank 0's process), and the benchmark stops if the torch
thread counts differ, so a faster side cannot come from more threads. Rank 0 also reports its
CPU time per timed step (``time.process_time()``: all its threads, the pool agent's included),
which tells more work per step apart from time spent waiting for a core. Both sides run in the
same working directory (the script's, as ``%sky run`` sets it) and inherit the benchmark's
environment (``HF_HUB_OFFLINE=1`` set). The pool is started once, before anything is timed. The
sides are interleaved one repetition at a time, the order rotating from one repetition to the
next, after one uncounted warm-up round (on the pool it imports ``transformers`` on the ranks, as
a notebook's first run would), so machine noise and drift hit each alike. 40 rounds by default:
on this machine the speed drifts by 10-40% over tens of seconds (three 300-step runs in one
torchrun process agree within 5%, successive torchrun runs differ by up to 40%), so the ratio's
precision comes from the number of rounds, not from longer runs. Reported:
medians, p10/p90, min/max, the ratio of the medians and a bootstrap 95% interval of it
(repetitions resampled as rounds). Any failed run (a non-zero exit, an error on a
rank, a run past ``--timeout``, a missing or inconsistent report) stops the benchmark with
``BenchError``; nothing is retried.

Both scripts pause 0.05 s before ``destroy_process_group()``: with torch 2.13 and gloo, gloo's
worker thread frees the last collective's work only once it gets the GIL, and a script that ends
at once can leave it waiting while the interpreter finalizes (SIGABRT, "terminate called without
an active exception") or while the main thread, holding the GIL, joins it (a hang). Both happened
under plain torchrun while this benchmark was written (about 1 run in 15 of ``ddp_mlp.py``; none
in 45 with the pause). The pause is after the timed steps, and inside (c)'s times on both sides.

Run ``python bench/bench_byo.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/byo.json``.
``--quick`` is a smoke run (one counted round of each, short loops; about a minute), its figures
not worth keeping; ``--reps``/``--wall-reps`` set the number of rounds.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
    interleaved,
    load_avg,
    machine_info,
    machine_line,
    rank_report,
    ratios,
    rotated,
    run_torchrun,
    spread_row,
    version,
)

sys.path.insert(0, str(REPO / "bench" / "scripts"))  # for thread_cpu, as the scripts import it

import thread_cpu

from skyward_jupyter.agent.gloo_loop import LOOP_THREAD

SCRIPT = Script("byo")
NODES = 2
GOAL_STEPS_RATIO = 0.98  # pool steps/s at least this share of torchrun's, (a) and (b)
GOAL_WALL_RATIO = 0.2  # %sky run of a short script at most this share of torchrun's wall time

SCRIPTS = REPO / "bench" / "scripts"
HF_SCRIPT = SCRIPTS / "hf_trainer.py"
DDP_SCRIPT = SCRIPTS / "ddp_mlp.py"
MAIN_GUARD = '\nif __name__ == "__main__":'
THREAD_KEYS = ("torch_threads", "torch_interop_threads", "omp_num_threads", "os_threads")
STEP_THREADS = (thread_cpu.MAIN, LOOP_THREAD.decode())
"""Rank 0's threads whose CPU time per step the tables show: the training thread, and gloo's
TCP event loop, which busy-waits while a peer's bytes wait for a buffer not yet posted (gloo's
``Pair::getBuffer``), so its time grows when the ranks reach their collectives out of step."""

# Nothing may be downloaded: the Trainer builds its model from a config. Set here, before the
# pool starts, so the ranks inherit it as torchrun's workers do from child_env().
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


# ------------------------------------------------------------------------------- launchers


class PoolSide:
    """A ``Session`` (what the magics drive) with one warm 2-rank local pool."""

    def __init__(self, timeout: float) -> None:
        from skyward_jupyter.session import PoolSpec, Session

        self.timeout = timeout
        self.spec = PoolSpec(nodes=NODES)
        self.session = Session(announce=lambda text: print(f"  [sky] {text}", file=sys.stderr))
        self.start_s: float | None = None
        self._defined: set[Path] = set()  # scripts whose definitions cell has run
        self._troubles: list[str] = []  # ranks lost or failed, as the pool saw it (IO thread)

    def _on_event(self, event: object) -> None:
        from skyward_jupyter.events import RankState, RankStateChanged

        if isinstance(event, RankStateChanged) and event.state in (
            RankState.LOST,
            RankState.FAILED,
        ):
            self._troubles.append(
                f"{time.strftime('%H:%M:%S')} ranks {[r for r, _ in event.ranks]}: "
                f"{event.state.value}, {event.detail}"
            )

    def start(self) -> None:
        t0 = time.perf_counter()
        entry = self.session.entry(None, self.spec)
        self.start_s = time.perf_counter() - t0
        entry.pool.subscribe(self._on_event)
        if entry.pool.world_size != NODES:
            raise BenchError(f"the pool has {entry.pool.world_size} ranks, not {NODES}")

    def close(self) -> None:
        from skyward_jupyter.providers import local

        try:
            self.session.down_all()
        finally:
            local.shutdown_template()

    def _check(self, what: str, run: Callable[[], Any]) -> float:
        out = io.StringIO()  # rank 0's stdout (the Trainer prints its metrics), as torchrun's
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out):
            result = run()
        elapsed = time.perf_counter() - t0
        if not result.ok or result.lost:
            errors = "\n".join(
                f"rank {e.rank} ({e.where}): {e}\n{e.traceback}" for e in result.errors
            )
            raise BenchError(
                f"{what} failed on the pool (lost ranks {list(result.lost)}):\n{errors}\n"
                f"rank state changes seen: {self._troubles}\n"
                f"rank 0's output:\n{out.getvalue()[-2000:]}"
            )
        for note in result.notes:
            if "could not recover" in note:
                raise BenchError(f"{what}: {note}")
        return elapsed

    def run_script(self, script: Path, argv: Sequence[str]) -> float:
        """``%sky run SCRIPT ARGV`` on the warm pool; the time from the call to its return."""
        return self._check(
            f"%sky run {script.name}",
            lambda: self.session.run_script(
                str(script), list(argv), spec=self.spec, timeout=self.timeout
            ),
        )

    def run_cell(self, script: Path, argv: Sequence[str]) -> float:
        """The script as a notebook has it: its definitions in one cell, ``main(argv)`` next."""
        if script not in self._defined:
            source = script.read_text()
            if MAIN_GUARD not in source:
                raise BenchError(f"{script.name} has no {MAIN_GUARD.strip()!r} to split at")
            definitions = source.split(MAIN_GUARD, 1)[0]
            self._check("definitions cell", lambda: self._cell(definitions))
            self._defined.add(script)
        call = f"main({list(argv)!r})"
        return self._check(f"{call} cell", lambda: self._cell(call))

    def _cell(self, source: str) -> Any:
        return self.session.run_cell(source, {}, spec=self.spec, timeout=self.timeout)


# ----------------------------------------------------------------------------- measuring


def _report(path: Path, what: str) -> dict[str, Any]:
    """The JSON rank 0 wrote, checked."""
    report = rank_report(path, what)
    if report.get("world_size") != NODES:
        raise BenchError(f"{what}: trained with world size {report.get('world_size')}: {report}")
    if report.get("ddp", "DistributedDataParallel") != "DistributedDataParallel":
        raise BenchError(f"{what}: the model was not wrapped in DDP: {report}")
    if not report.get("steps_per_s", 0) > 0:
        raise BenchError(f"{what}: no steps per second in {report}")
    return report


def _check_threads(what: str, reports: dict[str, dict[str, Any]]) -> None:
    threads = {side: r["torch_threads"] for side, r in reports.items()}
    if len(set(threads.values())) != 1:
        raise BenchError(f"{what}: the sides ran with different torch thread counts: {threads}")


def compare_steps(
    what: str,
    script: Path,
    argv: Sequence[str],
    sides: dict[str, Callable[[Path, Sequence[str]], float]],
    reps: int,
    out: Path,
) -> dict[str, Any]:
    """Steps/s of ``script`` on every side, interleaved, after one uncounted round."""
    names = list(sides)
    samples: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    extra: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    threads: dict[str, dict[str, Any]] = {}
    for i in range(reps + 1):
        counted = i > 0
        reports: dict[str, dict[str, Any]] = {}
        for name in rotated(names, i):
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
            seconds = sides[name](script, [str(out), *argv])
            reports[name] = _report(out, f"{what}, {name}")
            if counted:
                samples[name].append(reports[name]["steps_per_s"])
                wall[name].append(seconds)
                extra[name].append(reports[name])
        _check_threads(what, reports)
        threads = {n: {k: reports[n].get(k) for k in THREAD_KEYS} for n in names}
        label = f"rep {i}/{reps}" if counted else "warm-up"
        cells = ", ".join(f"{n} {reports[n]['steps_per_s']:.1f}" for n in rotated(names, i))
        print(f"  {what} {label}: steps/s {cells}", file=sys.stderr, flush=True)
    base = names[0]
    return {
        "steps_per_s": {n: asdict(Summary.of(v)) for n, v in samples.items()},
        "wall_s": {n: asdict(Summary.of(v)) for n, v in wall.items()},
        "cpu_ms_per_step": {
            n: asdict(Summary.of([1e3 * r["cpu_s_per_step"] for r in runs]))
            for n, runs in extra.items()
        },
        "agent_share_pct": {
            n: asdict(Summary.of([_agent_share(r) for r in runs])) for n, runs in extra.items()
        },
        "thread_ms_per_step": {
            n: {t: asdict(Summary.of([_thread_ms(r, t) for r in runs])) for t in STEP_THREADS}
            for n, runs in extra.items()
        },
        "ratios": {n: ratios(samples[base], samples[n]) for n in names if n != base},
        "threads": threads,
        "samples_steps_per_s": samples,
        "samples_wall_s": wall,
        "reports": extra,
        "argv": list(argv),
        "reps": reps,
    }


def _agent_share(report: dict[str, Any]) -> float:
    """The pool agent's threads' part of rank 0's CPU time over the timed steps, in percent."""
    total = sum(report["threads_cpu_s"].values())
    return 100.0 * report["pool_agent_cpu_s"] / total if total else 0.0


def _thread_ms(report: dict[str, Any], name: str) -> float:
    """Milliseconds of CPU per timed step that rank 0's threads called ``name`` used."""
    return 1e3 * report["threads_cpu_s"].get(name, 0.0) / report["timed_steps"]


def compare_wall(
    pool: PoolSide, script: Path, argv: Sequence[str], reps: int, timeout: float, out: Path
) -> dict[str, Any]:
    """Wall time of ``%sky run`` on the warm pool against torchrun, interleaved."""

    runs: dict[str, Callable[[], float]] = {
        "torchrun": lambda: run_torchrun(script, [str(out), *argv], NODES, timeout),
        "sky_run": lambda: pool.run_script(script, [str(out), *argv]),
    }

    def timed(name: str) -> float:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        seconds = runs[name]()
        _report(out, f"wall, {name}")
        return seconds

    samples = interleaved("wall", {n: functools.partial(timed, n) for n in runs}, reps, fmt_s)
    return {
        "wall_s": {n: asdict(Summary.of(v)) for n, v in samples.items()},
        "ratio": ratios(samples["torchrun"], samples["sky_run"]),
        "samples_wall_s": samples,
        "argv": list(argv),
        "reps": reps,
    }


def run_benchmark(args: Any) -> dict[str, Any]:
    pool = PoolSide(args.timeout)
    with tempfile.TemporaryDirectory(prefix="bench_byo_") as tmp:
        out = Path(tmp) / "report.json"

        def torchrun(script: Path, argv: Sequence[str]) -> float:
            return run_torchrun(script, argv, NODES, args.timeout)

        # The notebook sits beside the scripts, as a user's would: the cells import what the
        # scripts import from their directory (thread_cpu.py), and torchrun runs there too.
        notebook_dir = os.getcwd()
        os.chdir(DDP_SCRIPT.parent)
        try:
            print(f"starting a {NODES}-rank pool", file=sys.stderr)
            pool.start()
            hf_argv = ["--steps", str(args.hf_steps), "--warmup", str(args.hf_warmup)]
            hf_argv += ["--output-dir", str(Path(tmp) / "hf_out")]
            print(f"(a) HF Trainer: {args.reps} rounds after 1 warm-up", file=sys.stderr)
            hf = compare_steps(
                "(a)",
                HF_SCRIPT,
                hf_argv,
                {"torchrun": torchrun, "sky_run": pool.run_script},
                args.reps,
                out,
            )
            ddp_argv = ["--steps", str(args.ddp_steps), "--warmup", str(args.ddp_warmup)]
            print(f"(b) DDP loop: {args.reps} rounds after 1 warm-up", file=sys.stderr)
            ddp = compare_steps(
                "(b)",
                DDP_SCRIPT,
                ddp_argv,
                {"torchrun": torchrun, "sky_run": pool.run_script, "cell": pool.run_cell},
                args.reps,
                out,
            )
            wall_argv = ["--steps", str(args.wall_steps), "--warmup", "1"]
            print(f"(c) wall time: {args.wall_reps} rounds after 1 warm-up", file=sys.stderr)
            wall = compare_wall(pool, DDP_SCRIPT, wall_argv, args.wall_reps, args.timeout, out)
        finally:
            pool.close()
            os.chdir(notebook_dir)
    return {"hf": hf, "ddp": ddp, "short": wall, "pool_start_s": pool.start_s}


# ------------------------------------------------------------------------------ markdown


def _rounds(n: int) -> str:
    return f"{n} round" if n == 1 else f"{n} rounds"


def _rate(x: float) -> str:
    return f"{x:.1f}/s"


def _goal_steps(ratio: dict[str, Any]) -> str:
    r, (lo, hi) = ratio["of_medians"], ratio["of_medians_bootstrap_95"]
    if lo >= GOAL_STEPS_RATIO:
        return "**met** (the whole 95% interval lies above it)"
    if r >= GOAL_STEPS_RATIO:
        return (
            f"**met** by the medians; the 95% interval reaches down to {lo:.3f}, so this run's "
            f"noise cannot rule out a ratio under {GOAL_STEPS_RATIO:.2f}"
        )
    if hi >= GOAL_STEPS_RATIO:
        return (
            f"**NOT met** by the medians, though the 95% interval reaches {hi:.3f}: this run's "
            "noise cannot tell"
        )
    return "**NOT met**"


def _ratio_cell(ratio: dict[str, Any]) -> str:
    lo, hi = ratio["of_medians_bootstrap_95"]
    pr = ratio["per_round"]
    return (
        f"**{ratio['of_medians']:.3f}** ({lo:.3f} to {hi:.3f}) | {pr['median']:.3f} "
        f"({pr['min']:.3f} / {pr['max']:.3f})"
    )


def _share_cell(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f}% ({s['max']:.2f}%)"


def _step_threads_cell(t: dict[str, Any]) -> str:
    return " / ".join(fmt_ms(t[name]["median"]) for name in STEP_THREADS)


def _threads_cell(t: dict[str, Any]) -> str:
    return (
        f"{t['torch_threads']} / {t['torch_interop_threads']} / "
        f"{t['omp_num_threads'] or 'unset'} / {t['os_threads']}"
    )


def render_markdown(report: dict[str, Any]) -> str:
    m, hf, ddp, wall = report["machine"], report["hf"], report["ddp"], report["short"]
    cfg = report["config"]
    labels = {
        "torchrun": f"`torchrun --standalone --nproc-per-node {NODES}`",
        "sky_run": "`%sky run` on the warm pool",
        "cell": "`%%sky` cell `main([...])` (definitions cell run once before)",
    }

    def steps_rows(block: dict[str, Any]) -> list[str]:
        return [
            spread_row(labels[n], s, _rate)
            + f" {fmt_ms(block['cpu_ms_per_step'][n]['median'])} "
            + f"| {_share_cell(block['agent_share_pct'][n])} "
            + f"| {_step_threads_cell(block['thread_ms_per_step'][n])} "
            + f"| {_threads_cell(block['threads'][n])} |"
            for n, s in block["steps_per_s"].items()
        ]

    def ratio_rows(block: dict[str, Any]) -> list[str]:
        return [
            f"| {labels[n]} / torchrun | {_ratio_cell(r)} |" for n, r in block["ratios"].items()
        ]

    steps_head = [
        "| launcher | median | p10 | p90 | min | max | rank 0 CPU time per step, median "
        "| the pool agent's threads' share of it, median (max) "
        "| of which the training thread / gloo's event loop, medians "
        "| torch threads / interop / `OMP_NUM_THREADS` / OS threads of rank 0 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratio_head = [
        "| ratio | of the medians (bootstrap 95%) | per round: median (min / max) |",
        "|---|---:|---:|",
    ]
    hf_rt = {
        n: statistics.median(r["train_steps_per_second"] for r in runs)
        for n, runs in hf["reports"].items()
    }
    w = wall["wall_s"]
    wall_ratio = wall["ratio"]["of_medians"]
    wall_low, wall_high = wall["ratio"]["of_medians_bootstrap_95"]
    wall_ok = "met" if wall_ratio <= GOAL_WALL_RATIO else "NOT met"
    lines = [
        "## Bring your own code: torchrun scripts on the pool against torchrun",
        "",
        machine_line(m, {"transformers": m["transformers"], "accelerate": m["accelerate"]})
        + " Regenerate with `.venv/bin/python bench/bench_byo.py --markdown-out BENCHMARKS.md` "
        "(raw samples in `bench/results/byo.json`).",
        "",
        f"The same unmodified torchrun scripts (`bench/scripts/`) run under `torchrun "
        f"--standalone --nproc-per-node {NODES}` and on one warm {NODES}-rank local pool "
        "(`Session.run_script`, what `%sky run` calls), interleaved one round at a time with the "
        "order rotating, after one uncounted warm-up round. Steps per second are measured inside "
        "each script by rank 0, so launcher start-up is not in them; both sides ran with the "
        "thread settings torchrun chooses (the table's last column, read inside the scripts). "
        "Rank 0's CPU time per step (`time.process_time()` over the same steps: all its threads, "
        "the pool agent's included) shows whether a side does more work per step, apart from "
        "time spent waiting for the CPU; the next column is the part of it that the pool's own "
        "threads in the rank (reader, watchdog, output capture: "
        "`bench/scripts/thread_cpu.py` reads each thread's CPU time from `/proc`) used over the "
        "timed steps, which is what the pool can take from training (none of them exist under "
        "torchrun). "
        "With 2 cores for 2 ranks, anything else running on the machine moves these figures; "
        "the load average above says how busy it was.",
        "",
        f"### (a) Hugging Face `Trainer`, tiny BERT: training steps per second "
        f"({_rounds(hf['reps'])}; {cfg['hf_steps']} steps of batch 8 per rank, the first "
        f"{cfg['hf_warmup']} not timed)",
        "",
        "`BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, "
        "num_hidden_layers=1, num_attention_heads=2, intermediate_size=37))` on random tokens "
        "(sequence length 32), `TrainingArguments(max_steps, per_device_train_batch_size=8, "
        'report_to=[], save_strategy="no", use_cpu=True, ...)`, `Trainer.train()`. Steps per '
        "second from a `TrainerCallback` timestamping `on_step_end`, after the warm-up steps: "
        "the loop's steady state, without DDP's wrapping and the first steps' lazy set-up that "
        "`train_runtime` carries.",
        "",
        *steps_head,
        *steps_rows(hf),
        "",
        *ratio_head,
        *ratio_rows(hf),
        "",
        "For information, the Trainer's own `train_steps_per_second` (from `train_runtime`, all "
        "steps, set-up included), median: "
        + ", ".join(f"{labels[n]} {_rate(v)}" for n, v in hf_rt.items())
        + ".",
        "",
        f"Goal: pool at least {GOAL_STEPS_RATIO:.2f} of torchrun's steps per second: "
        f"{_goal_steps(hf['ratios']['sky_run'])}.",
        "",
        f"### (b) Plain DDP loop: steps per second ({_rounds(ddp['reps'])}; {cfg['ddp_steps']} "
        f"timed steps after {cfg['ddp_warmup']})",
        "",
        "The ddp-tutorial-series shape: `init_process_group()`, MLP 128->256->256->10 in "
        "`DistributedDataParallel`, `DistributedSampler`, SGD with momentum, batch 64 per rank, "
        "the timed steps between two `barrier()`s, `destroy_process_group()`. On the pool it runs "
        "as `%sky run` and as notebook cells (its definitions in one cell, `main([...])` in "
        "the next); the pool forms its group again after each run destroyed it, outside the "
        "timed loop.",
        "",
        *steps_head,
        *steps_rows(ddp),
        "",
        *ratio_head,
        *ratio_rows(ddp),
        "",
        f"Goal: pool at least {GOAL_STEPS_RATIO:.2f} of torchrun's steps per second: `%sky run` "
        f"{_goal_steps(ddp['ratios']['sky_run'])}; cells {_goal_steps(ddp['ratios']['cell'])}.",
        "",
        f"### (c) Wall time of a short script ({_rounds(wall['reps'])}; `ddp_mlp.py` with "
        f"{cfg['wall_steps']} timed steps: init, DDP, a few steps, destroy)",
        "",
        "| | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        spread_row(
            "`%sky run` on the warm pool (started, the script run once before), from the call "
            "to its return",
            w["sky_run"],
            fmt_s,
        ),
        spread_row(
            f"`torchrun --standalone --nproc-per-node {NODES}`, from launch to exit",
            w["torchrun"],
            fmt_s,
        ),
        "",
        f"Ratio `%sky run` / torchrun of the medians: **{wall_ratio:.3f}** (bootstrap 95% "
        f"interval {wall_low:.3f} to {wall_high:.3f}). Goal <= "
        f"{GOAL_WALL_RATIO:.1f}: **{wall_ok}**. torchrun starts its launcher and two workers "
        "that import torch and form a group each time; the pool's ranks are running with torch "
        "imported, and the time includes re-forming the group the script destroyed. Both include "
        "the script's own 0.05 s pause before `destroy_process_group()` (it lets gloo's worker "
        "thread free the last collective first: without it, plain torchrun runs of these scripts "
        "aborted at exit or hung now and then with torch 2.13; see `bench/scripts/ddp_mlp.py`). "
        f"(The pool itself started in {report['pool_start_s']:.2f} s, once, before the first "
        "round; not counted.)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--reps", 40, "counted rounds of (a) and (b)")
    count(parser, "--wall-reps", 8, "counted rounds of (c)")
    count(parser, "--hf-steps", 300, "Trainer max_steps in (a)")
    count(parser, "--hf-warmup", 20, "untimed steps in (a)", minimum=0)
    count(parser, "--ddp-steps", 600, "timed steps in (b)")
    count(parser, "--ddp-warmup", 20, "untimed steps in (b)", minimum=0)
    count(parser, "--wall-steps", 5, "steps of the script in (c)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 counted round of each, short loops (figures not worth keeping)",
    )
    args = SCRIPT.parse_args(parser, argv)
    if args.quick:
        args.reps, args.wall_reps = 1, 1
        args.hf_steps, args.hf_warmup, args.ddp_steps, args.ddp_warmup = 40, 5, 100, 5
    if args.hf_steps - args.hf_warmup < 2:
        parser.error("--hf-steps must exceed --hf-warmup by at least 2")

    load_before = load_avg()
    started = time.perf_counter()
    measured = run_benchmark(args)
    machine = machine_info(load_before)
    machine.update(transformers=version("transformers"), accelerate=version("accelerate"))
    report: dict[str, Any] = {
        "machine": machine,
        "command": command_line(),
        "goals": {"steps_ratio_min": GOAL_STEPS_RATIO, "wall_ratio_max": GOAL_WALL_RATIO},
        "config": {
            k: getattr(args, k)
            for k in ("reps", "wall_reps", "hf_steps", "hf_warmup", "ddp_steps", "ddp_warmup")
        }
        | {"wall_steps": args.wall_steps, "quick": args.quick},
        **measured,
        "wall_s": time.perf_counter() - started,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report), note=f" ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
