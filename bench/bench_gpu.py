"""GPU benchmark: a NCCL pool in a notebook cell against ``torchrun``, on this machine's GPUs.

Run where CUDA is present; elsewhere it says so in one line and exits 0 (CI has no GPU). One
rank per GPU on this machine, ``--backend nccl``, on both sides.

* **(a) A launch-bound DDP loop, steps per second.** ``bench/scripts/ddp_cuda.py`` is a torchrun
  script: a small MLP in ``DistributedDataParallel`` on ``cuda:LOCAL_RANK``, a fixed batch on the
  GPU, SGD. Its kernels are tiny, so a step's time is the CPU launching them and DDP's hooks:
  the part a pool's agent threads could slow down. It runs under ``torchrun --standalone`` and as
  a notebook user pastes it: one ``%%sky`` cell with its definitions, then a ``%%sky`` cell
  ``main([...])`` per round (``Session.run_cell``, what the magic calls), on one warm pool. A
  third side runs torchrun with NCCL's flight recorder on, as the pool sets it on GPU ranks for
  the hang doctor, so that the recorder's cost is told apart from the rest of the pool's. The
  sides alternate round by round, the order rotating, after one uncounted round; reported are
  medians, spreads, ratios of medians with a bootstrap 95% interval, and the CPU time per step
  of the launching thread and of the pool agent's threads.
* **(b) The first collective from cold.** A fresh pool's start and its first cell (set the
  device, all-reduce a CUDA tensor) against ``torchrun`` of ``bench/scripts/nccl_first.py`` (the
  same body between ``init_process_group`` and ``destroy_process_group``), launch to exit;
  interleaved, each pool ended after its round; the ratio of medians with its bootstrap 95%
  interval.

Run ``python bench/bench_gpu.py --markdown-out BENCHMARKS.md`` to regenerate its block; JSON
goes to ``bench/results/gpu.json``. Figures are never edited by hand. Both are written once (a)
is measured and again after (b): a lent GPU is lent by the minute, and a run stopped during (b)
keeps (a)'s figures, its block saying that (b) was not measured.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
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
    fmt_s,
    interleaved,
    load_avg,
    machine_info,
    machine_line,
    rank_report,
    ratios,
    run_torchrun,
    spread_row,
)

from skyward_jupyter.launch_env import FLIGHT_RECORDER_ENTRIES

SCRIPT = Script("gpu")
GOAL_STEPS_RATIO = 0.98
SCRIPTS = REPO / "bench" / "scripts"
DDP_SCRIPT = SCRIPTS / "ddp_cuda.py"
FIRST_SCRIPT = SCRIPTS / "nccl_first.py"
MAIN_GUARD = '\nif __name__ == "__main__":'


def cuda_gpus() -> tuple[int, str]:
    """How many GPUs torch sees here, and the first one's name (0 and "" without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0, ""
    if not torch.cuda.is_available():
        return 0, ""
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def definitions(script: Path) -> str:
    """What a notebook user pastes into a cell: the script above its ``__main__`` guard."""
    source = script.read_text()
    if MAIN_GUARD not in source:
        raise BenchError(f"{script.name} has no {MAIN_GUARD.strip()!r} to split at")
    return source.split(MAIN_GUARD, 1)[0]


class Notebook:
    """A ``Session``, as the magics drive it, with NCCL pools of one rank per GPU."""

    def __init__(self, gpus: int, timeout: float) -> None:
        from skyward_jupyter.session import PoolSpec, Session

        self.timeout = timeout
        self.session = Session(announce=lambda text: print(f"  [sky] {text}", file=sys.stderr))
        self.spec = PoolSpec(nodes=1, procs_per_node=gpus, backend="nccl")

    def cell(self, source: str, name: str = "warm") -> float:
        """Run ``source`` on the pool called ``name`` (started if need be); its wall time."""
        out = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(out):
            result = self.session.run_cell(
                source, {}, name=name, spec=self.spec, timeout=self.timeout
            )
        elapsed = time.perf_counter() - started
        if not result.ok or result.lost:
            errors = "\n".join(
                f"rank {e.rank} ({e.where}): {e}\n{e.traceback}" for e in result.errors
            )
            raise BenchError(f"a cell failed on pool {name!r}:\n{errors}\n{out.getvalue()[-2000:]}")
        return elapsed

    def down(self, name: str) -> None:
        self.session.down(name, quiet=True)

    def close(self) -> None:
        from skyward_jupyter.providers import local

        try:
            self.session.down_all()
        finally:
            local.shutdown_template()


def _report(path: Path, what: str, gpus: int) -> dict[str, Any]:
    report = rank_report(path, what)
    if report.get("world_size") != gpus or report.get("backend") != "nccl":
        raise BenchError(f"{what}: ran as {report}, not {gpus} NCCL ranks")
    return report


def compare_steps(nb: Notebook, gpus: int, args: Any, out: Path) -> dict[str, Any]:
    """(a): steps/s of the DDP loop under torchrun, under torchrun with the flight recorder the
    pool turns on for the hang doctor, and in a cell, interleaved.
    """
    argv = [str(out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    nb.cell(definitions(DDP_SCRIPT))
    recorder = {"TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES}
    runs: dict[str, Callable[[], object]] = {
        "torchrun": lambda: run_torchrun(DDP_SCRIPT, argv, gpus, args.timeout),
        "torchrun_recorder": lambda: run_torchrun(DDP_SCRIPT, argv, gpus, args.timeout, recorder),
        "cell": lambda: nb.cell(f"main({argv!r})"),
    }
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}

    def steps_per_s(name: str) -> float:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        runs[name]()
        report = _report(out, f"(a) {name}", gpus)
        reports[name].append(report)
        return float(report["steps_per_s"])

    sides = {name: functools.partial(steps_per_s, name) for name in runs}
    samples = interleaved("(a)", sides, args.reps, _rate)
    counted = {name: kept[-args.reps :] for name, kept in reports.items()}  # warm-up left out
    return {
        "steps_per_s": {n: asdict(Summary.of(v)) for n, v in samples.items()},
        "ratio": ratios(samples["torchrun"], samples["cell"]),
        "recorder_ratio": ratios(samples["torchrun"], samples["torchrun_recorder"]),
        "cell_to_recorder_ratio": ratios(samples["torchrun_recorder"], samples["cell"]),
        "main_cpu_ms_per_step": {
            n: asdict(Summary.of([r["main_cpu_ms_per_step"] for r in kept]))
            for n, kept in counted.items()
        },
        "agent_cpu_pct": asdict(
            Summary.of([100.0 * r["pool_agent_cpu_s"] / r["seconds"] for r in counted["cell"]])
        ),
        "flight_recorder": {n: kept[-1]["flight_recorder"] for n, kept in counted.items()},
        "samples": samples,
        "argv": argv[1:],
    }


def compare_first(nb: Notebook, gpus: int, args: Any) -> dict[str, Any]:
    """(b): a fresh pool's start and first collective against torchrun's launch to exit."""
    body = definitions(FIRST_SCRIPT) + "\nassert first_collective() == 4.0 * dist.get_world_size()"

    def pool() -> float:
        try:
            return nb.cell(body, name="first")
        finally:
            nb.down("first")

    sides = {"torchrun": lambda: run_torchrun(FIRST_SCRIPT, [], gpus, args.timeout), "pool": pool}
    samples = interleaved("(b)", sides, args.first_reps, fmt_s)
    return {
        "wall_s": {n: asdict(Summary.of(v)) for n, v in samples.items()},
        "ratio": ratios(samples["torchrun"], samples["pool"]),
        "samples": samples,
    }


def _ratio_text(r: dict[str, Any]) -> str:
    lo, hi = r["of_medians_bootstrap_95"]
    return f"{r['of_medians']:.3f} ({lo:.3f} to {hi:.3f})"


def _rate(x: float) -> str:
    return f"{x:.0f}/s"


def render_markdown(report: dict[str, Any]) -> str:
    m, a, cfg = report["machine"], report["steps"], report["config"]
    r = a["ratio"]
    lo, hi = r["of_medians_bootstrap_95"]
    goal = "**met**" if r["of_medians"] >= GOAL_STEPS_RATIO else "**NOT met**"
    if lo < GOAL_STEPS_RATIO <= r["of_medians"]:
        goal += f" by the medians (the interval reaches down to {lo:.3f})"
    lines = [
        "## GPU: a NCCL pool against torchrun\n",
        f"Device: {cfg['gpus']} x {cfg['device']}, one rank per GPU, `--backend nccl`. "
        + machine_line(m)
        + "\n",
        f"Command: `{report['command']}`.\n",
        f"**(a) Launch-bound DDP loop** (`bench/scripts/ddp_cuda.py`, {cfg['steps']} timed steps "
        f"after {cfg['warmup']}), {cfg['reps']} rounds interleaved after one warm-up. "
        f"Goal: the cell at least {GOAL_STEPS_RATIO:.2f}x torchrun's steps per second: {goal}.\n",
        "| side | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        spread_row("`torchrun --standalone`", a["steps_per_s"]["torchrun"], _rate),
        spread_row(
            f"`torchrun`, `TORCH_FR_BUFFER_SIZE={a['flight_recorder']['torchrun_recorder']}`",
            a["steps_per_s"]["torchrun_recorder"],
            _rate,
        ),
        spread_row("`%%sky` cell `main([...])`", a["steps_per_s"]["cell"], _rate),
        "",
        f"Cell / torchrun, ratio of medians: **{r['of_medians']:.3f}** (bootstrap 95% interval "
        f"{lo:.3f} to {hi:.3f}; per round median {r['per_round']['median']:.3f}).\n",
        "The pool turns on NCCL's flight recorder on GPU ranks (`TORCH_FR_BUFFER_SIZE="
        f"{a['flight_recorder']['cell']}`): the hang doctor reads from it which collectives a rank "
        "still waits for. The middle side is torchrun with the same setting, so the recorder's "
        f"cost and the rest of the pool's are told apart: torchrun with it / without, "
        f"{_ratio_text(a['recorder_ratio'])}; the cell / torchrun with it, "
        f"{_ratio_text(a['cell_to_recorder_ratio'])}.\n",
        "CPU time of the launching (main) thread per step, and the pool agent's threads' share of "
        "the timed wall time (`bench/scripts/thread_cpu.py`):\n",
        "| side | main thread, ms per step (median) | p10 | p90 |",
        "|---|---:|---:|---:|",
        *(
            f"| {label} | {a['main_cpu_ms_per_step'][n]['median']:.3f} "
            f"| {a['main_cpu_ms_per_step'][n]['p10']:.3f} "
            f"| {a['main_cpu_ms_per_step'][n]['p90']:.3f} |"
            for n, label in (
                ("torchrun", "`torchrun`"),
                ("torchrun_recorder", "`torchrun` with the recorder"),
                ("cell", "cell"),
            )
        ),
        "",
        f"The pool agent's threads in the cell's rank: {a['agent_cpu_pct']['median']:.2f}% of a "
        "core over the timed steps (median).\n",
        f"**(b) First collective from cold**, {cfg['first_reps']} rounds interleaved after one "
        "warm-up: a fresh pool's start and first cell (all-reduce of a CUDA tensor) against "
        "`torchrun` of `bench/scripts/nccl_first.py`, launch to exit.\n",
        *_first_lines(report.get("first")),
    ]
    return "\n".join(lines) + "\n"


def _first_lines(b: dict[str, Any] | None) -> list[str]:
    """(b)'s table and ratio, or a line saying that this run ended before (b) was measured."""
    if b is None:
        return ["Not measured: this run ended before (b) finished.\n"]
    lo, hi = b["ratio"]["of_medians_bootstrap_95"]
    return [
        "| side | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        spread_row("`torchrun --standalone`", b["wall_s"]["torchrun"], fmt_s),
        spread_row("pool start + first cell", b["wall_s"]["pool"], fmt_s),
        "",
        f"Pool / torchrun, ratio of medians: **{b['ratio']['of_medians']:.3f}** (bootstrap 95% "
        f"interval {lo:.3f} to {hi:.3f}).\n",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--reps", 10, "counted rounds of (a)")
    count(parser, "--steps", 2000, "timed DDP steps per run")
    count(parser, "--warmup", 100, "untimed DDP steps per run", minimum=0)
    count(parser, "--first-reps", 3, "counted rounds of (b)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = SCRIPT.parse_args(parser, argv)
    gpus, device = cuda_gpus()
    if not gpus:
        print("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured")
        return 0
    # torchrun's plain side runs as torchrun does by default; the pool sets its own value
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    load_before = load_avg()
    config = {k: getattr(args, k) for k in ("reps", "steps", "warmup", "first_reps")}
    report: dict[str, Any] = {
        "command": command_line(),
        "config": {**config, "gpus": gpus, "device": device},
        "first": None,
    }

    def write(**measured: Any) -> None:
        report.update(measured, machine=machine_info(load_before))
        SCRIPT.write_outputs(args, report, render_markdown(report))

    nb = Notebook(gpus, args.timeout)
    notebook_dir = os.getcwd()
    os.chdir(SCRIPTS)  # torchrun and the cells run beside the scripts, as a user's notebook
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
            print(f"(a) DDP loop, {gpus} NCCL ranks: {args.reps} rounds", file=sys.stderr)
            write(steps=compare_steps(nb, gpus, args, Path(tmp) / "report.json"))
            print(f"(b) first collective: {args.first_reps} rounds", file=sys.stderr)
            write(first=compare_first(nb, gpus, args))
    finally:
        nb.close()
        os.chdir(notebook_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
