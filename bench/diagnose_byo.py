"""Where the pool's Hugging Face Trainer gap to torchrun lives: a diagnosis, not a benchmark.

``python bench/diagnose_byo.py [--rounds N] [--steps S]`` trains ``scripts/hf_trainer.py`` on
three sides, interleaved one round at a time with the order rotating: under ``torchrun``; with
``%sky run`` in the ranks of a warm 2-rank pool; and with ``%sky run`` of
``scripts/in_fresh_processes.py``, whose ranks each start the script in a fresh process beside
them. It prints each run's steps per second and the ratio of the medians to torchrun's. A gap
that the fresh processes do not show is in the ranks' own process state, not in the machine,
the pool's neighbours or its environment. On this machine single runs vary by 10-20%, so
telling a 5% gap apart takes tens of rounds (30 by default: about 20 minutes). Nothing goes to
``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench_byo import HF_SCRIPT, SCRIPTS, PoolSide, _report, _rotated, run_torchrun
from common import machine_info, machine_line

FRESH = SCRIPTS / "in_fresh_processes.py"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    out = Path("/tmp") / "skyward_diagnose_byo.json"
    script_args = [str(out), "--steps", str(args.steps), "--warmup", "20"]
    pool = PoolSide(args.timeout)
    pool.start()
    sides: dict[str, Callable[[], object]] = {
        "torchrun": lambda: run_torchrun(HF_SCRIPT, script_args, args.timeout),
        "pool ranks": lambda: pool.run_script(HF_SCRIPT, script_args),
        "fresh processes": lambda: pool.run_script(FRESH, [str(HF_SCRIPT), *script_args]),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for i in range(args.rounds + 1):  # round 0 warms the pool up (imports transformers)
            for name in _rotated(list(sides), i):
                with contextlib.suppress(FileNotFoundError):
                    out.unlink()
                sides[name]()
                rate = _report(out, name)["steps_per_s"]
                if i:
                    rates[name].append(rate)
                print(f"round {i} {name}: {rate:.1f} steps/s", file=sys.stderr, flush=True)
    finally:
        pool.close()
    base = statistics.median(rates["torchrun"])
    print(machine_line(machine_info(None)))
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:16s} median {median:7.1f} steps/s, {median / base:.3f} of torchrun's")
    print(json.dumps(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
