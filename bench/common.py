"""What the benchmark scripts in ``bench/`` share, kept in one place so their reports agree.

Every ``bench_*.py`` describes the machine it ran on, takes its counts the same way
(:func:`count`), interleaves the sides it compares (:func:`rotated`; :func:`interleaved` where
a side is one timed call), runs what it times to the end or kills it (:func:`run_to_end`),
summarises samples (median, p10, p90, min, max; a ratio of medians with its interval), takes the
same output options (``--json-out``, ``--markdown-out``) and rewrites its own generated block of
``BENCHMARKS.md`` between its markers. Had each its own copy, a fix to one (how the git
revision is read, how a block is replaced) would silently not reach the others, and their
sections would drift apart.
The scripts import this module as ``common`` (they run as ``python bench/<script>.py``, so
``bench/`` is first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from skyward_jupyter.flags import int_at_least

REPO = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    """A measured command failed; the benchmark stops rather than report a wrong figure."""


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    min: float
    max: float
    p10: float
    p90: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        ordered = sorted(samples)
        if len(ordered) >= 2:
            deciles = statistics.quantiles(ordered, n=10, method="inclusive")
            p10, p90 = deciles[0], deciles[-1]
        else:
            p10 = p90 = ordered[0]
        return cls(len(ordered), statistics.median(ordered), ordered[0], ordered[-1], p10, p90)


T = TypeVar("T")


def rotated(sides: Sequence[T], i: int) -> list[T]:
    """The sides' order in round ``i``: rotated each round, so no side always goes first."""
    k = i % len(sides)
    return [*sides[k:], *sides[:k]]


def interleaved(
    what: str,
    sides: Mapping[str, Callable[[], float]],
    reps: int,
    fmt: Callable[[float], str],
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Each side's samples of ``reps`` rounds: every side once a round, in the order
    :func:`rotated` gives, after ``warmup`` uncounted rounds (a line of progress each round).
    Sides measured in the same rounds share the machine's moods, so their ratio is fair.
    """
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(-warmup, reps):
        seen = {name: sides[name]() for name in rotated(list(sides), i)}
        for name, value in seen.items():
            if i >= 0:
                samples[name].append(value)
        label = f"round {i + 1}/{reps}" if i >= 0 else "warm-up"
        said = ", ".join(f"{name} {fmt(seen[name])}" for name in sides)
        print(f"  {what} {label}: {said}", file=sys.stderr, flush=True)
    return samples


BOOTSTRAP_RESAMPLES = 2000


def bootstrap_ratio(base: list[float], other: list[float], seed: int = 0) -> list[float]:
    """95% interval of ``median(other) / median(base)``, resampling rounds (pairs) together."""
    rng = random.Random(seed)
    n = len(base)
    estimates = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        idx = [rng.randrange(n) for _ in range(n)]
        estimates.append(
            statistics.median(other[i] for i in idx) / statistics.median(base[i] for i in idx)
        )
    estimates.sort()
    return [estimates[int(0.025 * len(estimates))], estimates[int(0.975 * len(estimates)) - 1]]


def ratios(base: list[float], other: list[float]) -> dict[str, Any]:
    """``other`` against ``base``, sampled in the same rounds: ratio of medians, its interval."""
    per_round = [o / b for b, o in zip(base, other, strict=True)]
    return {
        "of_medians": statistics.median(other) / statistics.median(base),
        "of_medians_bootstrap_95": bootstrap_ratio(base, other),
        "per_round": asdict(Summary.of(per_round)),
        "samples_per_round": per_round,
    }


# ------------------------------------------------------------------------------ machine


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process the benchmark starts: this checkout first on its path,
    and ``extra`` over the rest.
    """
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def torchrun_path() -> Path:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        raise BenchError(f"torchrun not found next to the interpreter: {torchrun}")
    return torchrun


def run_to_end(
    cmd: Sequence[str], timeout: float, cwd: Path, env: Mapping[str, str] | None = None
) -> tuple[float, str]:
    """Run ``cmd`` in ``cwd`` (``env`` added to its environment), in its own session, to
    completion: its wall time and stdout.

    A run that fails to finish (timeout, Ctrl-C) is killed with its whole process group before
    the error propagates, so no launcher or worker outlives the benchmark.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=child_env(env),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        elapsed = time.perf_counter() - started
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"{' '.join(cmd[:6])} did not finish in {timeout:.0f} s (killed with its children)"
        ) from None
    finally:
        if proc.returncode is None:  # not reaped yet, so the group id is still ours to kill
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd[:6])} exited with {proc.returncode}:\n{err[-4000:]}")
    return elapsed, out


def run_torchrun(
    script: Path,
    argv: Sequence[str],
    nproc: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> float:
    """``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGV`` to completion, in the
    script's directory (as ``%sky run`` runs a script), ``env`` added to its environment; its
    wall time.
    """
    cmd = [str(torchrun_path()), "--standalone", "--nproc-per-node", str(nproc), str(script)]
    return run_to_end([*cmd, *argv], timeout, script.parent, env)[0]


def rank_report(path: Path, what: str) -> dict[str, Any]:
    """The JSON report a measured script's rank 0 wrote at ``path``, removed once read so the
    next run must write its own.
    """
    try:
        report: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{what}: no report from rank 0 at {path}: {exc}") from None
    path.unlink()
    return report


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


def _git_revision() -> str:
    try:
        head = _git("rev-parse", "--short", "HEAD")
        # BENCHMARKS.md itself is rewritten by each script of a `make bench` run in turn.
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!BENCHMARKS.md")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def load_avg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded; ``None`` where the OS has none."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(load_before: list[float] | None) -> dict[str, Any]:
    """The machine and versions for the report; ``load_before`` is ``load_avg()`` at the start."""
    torch_version = version("torch")
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "torch_cpu_only": torch_version.endswith("+cpu"),
        "skyward_jupyter": version("skyward_jupyter"),
        "git": _git_revision(),
        "load_avg_before": load_before,
        "load_avg_after": load_avg(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def command_line() -> str:
    """How the script was run, for the report."""
    return " ".join([Path(sys.executable).name, *sys.argv])


# ----------------------------------------------------------------------------- markdown


def load_text(load: list[float] | None) -> str:
    return "/".join(f"{x:.2f}" for x in load) if load else "unknown"


def machine_line(m: Mapping[str, Any], versions: Mapping[str, str] | None = None) -> str:
    """The section's ``Machine: ...`` sentence; ``versions`` are named after skyward_jupyter's."""
    build = "CPU-only build" if m["torch_cpu_only"] else "build with accelerator support"
    more = "".join(f", {name} {v}" for name, v in (versions or {}).items())
    return (
        f"Machine: {m['cpu_count']} CPUs ({m['affinity_cpus']} usable; {m['cpu_model']}), "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']} ({build}), "
        f"skyward_jupyter {m['skyward_jupyter']} at git {m['git']}{more}; measured {m['date']}; "
        f"load average (1/5/15 min) {load_text(m['load_avg_before'])} before, "
        f"{load_text(m['load_avg_after'])} after."
    )


def fmt_s(x: float) -> str:
    return f"{x:.3f} s"


def fmt_ms(x: float) -> str:
    return f"{x:.2f} ms"


def fmt_us(x: float) -> str:
    return f"{x:.1f} us"


def spread_row(label: str | None, s: Mapping[str, float], fmt: Callable[[float], str]) -> str:
    """A table row ``| label | median | p10 | p90 | min | max |`` (no label cell if ``None``)."""
    cells = [fmt(s[k]) for k in ("median", "p10", "p90", "min", "max")]
    return "| " + " | ".join(cells if label is None else [label, *cells]) + " |"


def range_row(label: str, s: Mapping[str, float], fmt: Callable[[float], str], extra: str) -> str:
    """A table row ``| label | median | min | max | extra |``."""
    return f"| {label} | {fmt(s['median'])} | {fmt(s['min'])} | {fmt(s['max'])} | {extra} |"


def write_markdown(path: Path, section: str, begin_mark: str, end_mark: str) -> None:
    """Replace the generated block in ``path`` (between the markers).

    A file without the block gets it appended; a missing file is created with just the block.
    """
    block = f"{begin_mark}\n{section}{end_mark}\n"
    if path.exists():
        text = path.read_text()
        begin, end = text.find(begin_mark), text.find(end_mark)
        if begin != -1 and end > begin:
            path.write_text(text[:begin] + block + text[end + len(end_mark) :].lstrip("\n"))
        else:
            path.write_text(text.rstrip("\n") + "\n\n" + block)
        return
    path.write_text(block)


# ------------------------------------------------------------------------------ scripts


def count(
    parser: argparse.ArgumentParser, flag: str, default: int, help: str, minimum: int = 1
) -> None:
    """A whole-number option (rounds, steps; a warm-up's ``minimum`` is 0), refused in
    argparse's one line below ``minimum``, so no script checks its own counts.
    """
    parser.add_argument(flag, type=int_at_least(minimum), default=default, help=help)


@dataclass(frozen=True)
class Script:
    """One benchmark script, ``bench/bench_<name>.py``: its outputs and its markdown block."""

    name: str

    @property
    def begin_mark(self) -> str:
        return (
            f"<!-- bench_{self.name}:begin "
            f"(generated by bench/bench_{self.name}.py; do not edit) -->"
        )

    @property
    def end_mark(self) -> str:
        return f"<!-- bench_{self.name}:end -->"

    @property
    def default_json(self) -> Path:
        return REPO / "bench" / "results" / f"{self.name}.json"

    def parser(self, doc: str | None) -> argparse.ArgumentParser:
        """A parser described by the first line of the script's docstring."""
        return argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)

    def parse_args(
        self, parser: argparse.ArgumentParser, argv: Sequence[str] | None
    ) -> argparse.Namespace:
        """Add ``--json-out`` and ``--markdown-out`` after the script's own options; parse."""
        parser.add_argument("--json-out", type=Path, default=self.default_json)
        parser.add_argument(
            "--markdown-out",
            type=Path,
            default=None,
            help="write the markdown section here (replaces the generated block if the file has "
            "one)",
        )
        return parser.parse_args(argv)

    def write_outputs(
        self, args: argparse.Namespace, report: Mapping[str, Any], section: str, note: str = ""
    ) -> None:
        """Print the section, write the JSON report, and the markdown block if asked to."""
        print(section)
        json_out: Path = args.json_out
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_out}{note}", file=sys.stderr)
        if args.markdown_out is not None:
            write_markdown(args.markdown_out, section, self.begin_mark, self.end_mark)
            print(f"wrote {args.markdown_out}", file=sys.stderr)
