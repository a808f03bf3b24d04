"""Where the pool's Hugging Face Trainer gap to torchrun lives: a diagnosis, not a benchmark.

``python bench/diagnose_byo.py [--rounds N] [--steps S]`` trains ``scripts/hf_trainer.py`` on
four sides with ``bench_byo.compare_steps`` (interleaved, the order rotating, one uncounted
warm-up round): under ``torchrun``; with ``%sky run`` in the ranks of a warm 2-rank pool; with
``%sky run`` of ``scripts/in_fresh_processes.py``, whose ranks each start the script in a fresh
process beside them; and with ``%sky run`` of ``scripts/in_own_group.py``, whose ranks run it on
a gloo group they form themselves instead of the pool's. It prints each side's median steps per
second and its ratio to torchrun's with a bootstrap 95% interval, and rank 0's CPU time per step
in the training thread and in gloo's TCP event loop: far less noisy than steps per second, they
show where a side's time goes. A gap that the fresh processes do not show is in the ranks' own
process state, not in the machine, the pool's neighbours or its environment; one that the own
group does not show is in the pool's group. On this machine single runs vary by 10-20%, so
telling a 5% gap apart takes tens of rounds (30 by default: about 25 minutes). Nothing goes to
``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench_byo import HF_SCRIPT, SCRIPTS, STEP_THREADS, PoolSide, compare_steps, run_torchrun
from common import machine_info, machine_line

FRESH = SCRIPTS / "in_fresh_processes.py"
OWN_GROUP = SCRIPTS / "in_own_group.py"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    pool = PoolSide(args.timeout)
    with tempfile.TemporaryDirectory(prefix="diagnose_byo_") as tmp:

        def torchrun(script: Path, script_argv: Sequence[str]) -> float:
            return run_torchrun(script, script_argv, args.timeout)

        def fresh_processes(script: Path, script_argv: Sequence[str]) -> float:
            return pool.run_script(FRESH, [str(script), *script_argv])

        def own_group(script: Path, script_argv: Sequence[str]) -> float:
            return pool.run_script(OWN_GROUP, [str(script), *script_argv])

        pool.start()
        try:
            result = compare_steps(
                "HF Trainer",
                HF_SCRIPT,
                ["--steps", str(args.steps), "--warmup", "20"],
                {
                    "torchrun": torchrun,
                    "pool ranks": pool.run_script,
                    "fresh processes": fresh_processes,
                    "own group": own_group,
                },
                args.rounds,
                Path(tmp) / "report.json",
            )
        finally:
            pool.close()
    print(machine_line(machine_info(None)))
    for name, steps in result["steps_per_s"].items():
        line = f"{name:16s} median {steps['median']:7.1f} steps/s"
        if name in result["ratios"]:
            ratio = result["ratios"][name]
            low, high = ratio["of_medians_bootstrap_95"]
            line += f", {ratio['of_medians']:.3f} of torchrun's (95%: {low:.3f} to {high:.3f})"
        threads = result["thread_ms_per_step"][name]
        cpu = ", ".join(f"{t} {threads[t]['median']:.2f} ms" for t in STEP_THREADS)
        print(f"{line}; rank 0's CPU per step, medians: {cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
