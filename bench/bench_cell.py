"""Cell benchmark: what one ``%%sky`` cell costs in-process, beside ipyparallel's ``%%px``.

Where the kernel's own cost does not hide it: one IPython ``InteractiveShell`` in this process
has both ``%load_ext skyward_jupyter`` (a 2-rank local pool and a 16-rank one, both up) and an
``ipyparallel`` client on a 2-engine cluster that this script starts and stops, registered with
``rc.activate()`` (so ``%%px`` blocks, its default). Both systems are up during every
measurement, so each pays the other's background work (heartbeats, ipyparallel's threads).

* **(a) Trivial cell.** ``%%sky`` + ``1`` against ``%%px`` + ``1``, and a plain ``1`` as the
  shell's floor, timed around ``shell.run_cell`` in interleaved blocks after a warm-up.
* **(b) 16 ranks.** The same ``%%sky`` cell on the 16-rank pool (``--name wide``), interleaved
  with (a), against the 2-rank pool: the ratio says how the cost grows with the ranks.
* **(c) An unchanged 100 MiB numpy global.** The whole cell that reads it against the trivial
  one (the goal is on the difference), and the time to recognise that it has not changed
  (``Shipper.prepare`` for a cell that reads it, after it was sent once), also for a 100 MiB
  torch CPU tensor; an in-place edit is checked to be sent again.

Run ``python bench/bench_cell.py --markdown-out BENCHMARKS.md`` to regenerate the block in
``BENCHMARKS.md``; JSON goes to ``bench/results/cell.json``. Never edit the figures by hand.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from common import (
    BenchError,
    Script,
    Summary,
    command_line,
    count,
    fmt_ms,
    load_avg,
    machine_info,
    machine_line,
    spread_row,
    version,
)

SCRIPT = Script("cell")
GOAL_PX = 0.5
GOAL_WIDE = 3.0
GOAL_UNCHANGED_MS = 5.0
WIDE = 16
MIB = 100


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The cells' displayed values go nowhere (both systems print theirs alike)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def timed(shell: Any, code: str) -> float:
    started = time.perf_counter()
    result = shell.run_cell(code, store_history=False)
    seconds = time.perf_counter() - started
    if not result.success:
        raise BenchError(
            f"cell failed: {code!r}: {result.error_in_exec or result.error_before_exec}"
        )
    return seconds * 1e3


def interleaved(
    shell: Any, series: dict[str, str], runs: int, warmup: int, block: int
) -> dict[str, list[float]]:
    with quiet():
        for code in series.values():
            for _ in range(warmup):
                timed(shell, code)
    samples: dict[str, list[float]] = {name: [] for name in series}
    while any(len(s) < runs for s in samples.values()):
        for name, code in series.items():
            with quiet():
                for _ in range(min(block, runs - len(samples[name]))):
                    samples[name].append(timed(shell, code))
        medians = ", ".join(f"{n} {Summary.of(s).median:.2f}" for n, s in samples.items())
        print(f"  {min(len(s) for s in samples.values())}/{runs}: {medians} ms", file=sys.stderr)
    return samples


def measure_unchanged(shell: Any, reps: int) -> dict[str, Any]:
    session = shell._skyward_session  # what %load_ext skyward_jupyter attached
    with quiet():
        shell.run_cell(f"import numpy as np\nbig = np.random.rand({MIB} * 2**20 // 8)")
        timed(shell, "%%sky --name default\nbig.shape")  # sent once
        shell.run_cell(f"import torch\ntbig = torch.rand({MIB} * 2**20 // 4)")
        timed(shell, "%%sky --name default\ntbig.shape")  # sent once
    shipper = session.pools["default"].shipper
    recognise: dict[str, list[float]] = {"big": [], "tbig": []}
    for _ in range(reps):
        for name, times in recognise.items():
            started = time.perf_counter()
            shipment = shipper.prepare(f"{name}.shape", shell.user_ns)
            times.append((time.perf_counter() - started) * 1e3)
            if shipment.globals or shipment.unchanged != (name,):
                raise BenchError(f"the unchanged {name} was not recognised")
    shell.user_ns["big"][12345] += 1.0
    if "big" not in shipper.prepare("big.shape", shell.user_ns).globals:
        raise BenchError("an in-place edit was not seen")
    with quiet():
        timed(shell, "%%sky --name default\nbig.shape")  # the edit travels
    cells = interleaved(
        shell,
        {"unchanged": "%%sky --name default\nbig.shape", "trivial": "%%sky --name default\n1"},
        reps,
        2,
        5,
    )
    return {
        "recognise": asdict(Summary.of(recognise["big"])),
        "recognise_torch": asdict(Summary.of(recognise["tbig"])),
        **{name: asdict(Summary.of(s)) for name, s in cells.items()},
    }


def run_benchmark(runs: int, warmup: int, block: int, reps: int) -> dict[str, Any]:
    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    cluster = ipp.Cluster(n=2)
    started = time.perf_counter()
    cluster.start_cluster_sync()
    setup: dict[str, float] = {}
    try:
        client = cluster.connect_client_sync()
        client.wait_for_engines(2, timeout=120)
        client.activate()  # %%px on a blocking view of every engine
        setup["ipyparallel_start_s"] = time.perf_counter() - started
        with quiet():
            shell.run_line_magic("load_ext", "skyward_jupyter")
            for line in ("up --nodes 2", f"up --nodes {WIDE} --name wide", "up --name default"):
                began = time.perf_counter()
                shell.run_line_magic("sky", line)
                setup[f"sky {line}"] = time.perf_counter() - began
        print(f"(a, b) trivial cells: {runs} each", file=sys.stderr)
        series = {
            "sky": "%%sky --name default\n1",
            "px": "%%px\n1",
            "plain": "1",
            "sky_wide": "%%sky --name wide\n1",
        }
        samples = interleaved(shell, series, runs, warmup, block)
        print(f"(c) unchanged {MIB} MiB global: {reps}", file=sys.stderr)
        unchanged = measure_unchanged(shell, reps)
    finally:
        with quiet(), contextlib.suppress(Exception):
            shell.run_line_magic("sky", "down --all")
        cluster.stop_cluster_sync()
    return {
        "setup": setup,
        "trivial": {name: asdict(Summary.of(s)) for name, s in samples.items()},
        "unchanged": unchanged,
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}"


def render_markdown(report: dict[str, Any]) -> str:
    t, u = report["trivial"], report["unchanged"]
    sky, px, plain, wide = (t[k]["median"] for k in ("sky", "px", "plain", "sky_wide"))
    over = u["unchanged"]["median"] - u["trivial"]["median"]
    met: Callable[[bool], str] = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    lines = [
        "## Cell (in-process)",
        "",
        machine_line(report["machine"], report["versions"]),
        "",
        f"Command: `{report['command']}`",
        "",
        f"One IPython shell with both systems up; {t['sky']['n']} cells of each kind in "
        "interleaved blocks; milliseconds around `shell.run_cell`.",
        "",
        "| cell | median | p10 | p90 | min | max |",
        "|---|---|---|---|---|---|",
        spread_row("`%%sky` (2 ranks)", t["sky"], fmt_ms),
        spread_row("`%%px` (2 engines)", t["px"], fmt_ms),
        spread_row(f"`%%sky` ({WIDE} ranks)", t["sky_wide"], fmt_ms),
        spread_row("plain `1` (the shell's floor)", t["plain"], fmt_ms),
        "",
        f"- `%%sky` / `%%px`: **{_ratio(sky, px)}** (goal at most {GOAL_PX}: "
        f"{met(sky / px <= GOAL_PX)}); above the floor: {_ratio(sky - plain, px - plain)}.",
        f"- {WIDE} ranks / 2 ranks: **{_ratio(wide, sky)}** (goal at most {GOAL_WIDE}: "
        f"{met(wide / sky <= GOAL_WIDE)}).",
        f"- An unchanged {MIB} MiB numpy global costs **{over:.2f} ms** over a trivial cell "
        f"(the cell that reads it {u['unchanged']['median']:.2f} ms against "
        f"{u['trivial']['median']:.2f} ms, medians of {u['unchanged']['n']}; goal at most "
        f"{GOAL_UNCHANGED_MS} ms: {met(over <= GOAL_UNCHANGED_MS)}); recognised unchanged in "
        f"{u['recognise']['median']:.2f} ms (`Shipper.prepare`, median of {u['recognise']['n']}), "
        f"a {MIB} MiB torch CPU tensor in {u['recognise_torch']['median']:.2f} ms. "
        "An in-place edit of one element was sent again.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--runs", 300, "timed trivial cells of each kind")
    count(parser, "--warmup", 30, "untimed cells of each kind first", minimum=0)
    count(parser, "--block", 25, "cells per interleaved block")
    count(parser, "--reps", 30, "timed unchanged-global checks")
    args = SCRIPT.parse_args(parser, argv)
    load_before = load_avg()
    measured = run_benchmark(args.runs, args.warmup, args.block, args.reps)
    report = {
        "machine": machine_info(load_before),
        "versions": {d: version(d) for d in ("ipyparallel", "ipython", "numpy", "xxhash")},
        "command": command_line(),
        **measured,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
