"""Packages benchmark: a node's first environment build against pip by hand, and what a cached
environment adds to a pool's start.

Everything comes from one run of this script, on this machine (the local provider: the node is
this machine, its Python the notebook's venv). The packages are ``tabulate`` (pure Python) and
``ujson`` (a compiled wheel), which the venv lacks; pip's own HTTP cache is warm after the first
round for both sides alike (it is not cleared: a node that installs twice has it too).

* **(a) First build on a node.** The builder that a pool runs on each node
  (``python -m skyward_jupyter.agent.environments build``: a venv with
  ``--system-site-packages`` over the node's Python, a ``.pth`` naming its site directories,
  ``uv pip install`` (or ``pip install``) ``-r ... -c <torch pin>``, then the rename into the
  cache) on an empty cache, with uv (the binary the notebook sends) and with pip, against
  ``uv pip install --target <new dir> tabulate ujson`` and ``pip install --target ...`` run by
  hand with the same Python (what a user would type to add packages to a node without touching
  its Python), in an order rotated each round, each in a fresh directory.
* **(b) A pool on a cached environment.** ``Pool(nodes=2, procs_per_node=1)`` from the
  constructor to a first cell's result (``1``), with ``packages=`` whose environment is already
  built (found by its hash; no process runs), against the same pool without packages,
  alternating, after one uncounted round of each; ranks are forked from the warm template for
  both. Goal: at most 0.5 s added.
* **(c) The same on an SSH host** (``--ssh``, on by default where ``tests/hosts.py`` can make
  hosts: root, iproute2, sshd): one private host in a network namespace whose Python has torch,
  cloudpickle and pip only (``tests/honest_python.py``), no route out, and this machine's file
  index (``file:///opt/pypi/simple``) as its package index. A 1-node pool's start to a first
  cell with ``packages=`` on the host's **empty** environment cache (removed before each round)
  against the same pool without packages; the difference is the build as the user waits for it,
  compared with ``pip install --target DIR --index-url ... tabulate ujson`` run by hand on the
  host over SSH (the OpenSSH client, timed from here, a fresh directory each time). Then the
  start with the environment **cached** against the start without packages (in alternating
  order). One uncounted round of each first (which also sends uv to the host, once).

Run ``python bench/bench_packages.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/packages.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    child_env,
    command_line,
    count,
    fmt_s,
    interleaved,
    load_avg,
    machine_info,
    machine_line,
    range_row,
    rotated,
)

from skyward_jupyter.agent.environments import uv_settings
from skyward_jupyter.environments import BUILDER, Packages, notebook_uv
from skyward_jupyter.pool import Pool
from skyward_jupyter.providers.local import shutdown_template
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider

sys.path.insert(0, str(REPO))  # for tests.hosts (bench/ is first on the path, not the repo)

from tests.honest_python import honest_python
from tests.hosts import available, ssh_hosts

SCRIPT = Script("packages")
PACKAGES = ("tabulate", "ujson")
INDEX = "file:///opt/pypi/simple"


def _timed(argv: list[str], env: dict[str, str], stdin: str = "") -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"{argv[:4]} failed: {done.stderr[-500:]}{done.stdout[-500:]}")
    return elapsed


def first_builds(rounds: int, scratch: Path) -> dict[str, Any]:
    packages = Packages(PACKAGES)
    uv = notebook_uv()
    if uv is None:
        raise BenchError("no uv here: pip download uv found none")
    with_uv = packages.request(None, str(uv)).decode()
    with_pip = packages.request().decode()

    def builder(request: str) -> Callable[[], float]:
        def build() -> float:
            envs = Path(tempfile.mkdtemp(dir=scratch))
            try:
                return _timed([sys.executable, *BUILDER],
                              {**child_env(), "SKYWARD_ENVS": str(envs)}, request)  # fmt: skip
            finally:
                shutil.rmtree(envs)

        return build

    def by_hand(installer: list[str], extra: dict[str, str]) -> Callable[[], float]:
        def install() -> float:
            target = Path(tempfile.mkdtemp(dir=scratch))
            try:
                return _timed([*installer, "--target", str(target), *PACKAGES],
                              {**child_env(), **extra})  # fmt: skip
            finally:
                shutil.rmtree(target)

        return install

    sides = {
        "uv": builder(with_uv),
        "pip": builder(with_pip),
        "uv_hand": by_hand(
            [str(uv), "pip", "install", "-q", "--python", sys.executable], uv_settings()
        ),
        "pip_hand": by_hand([sys.executable, "-m", "pip", "install", "-q"], {}),
    }
    samples = interleaved("(a)", sides, rounds, fmt_s, warmup=0)
    return {
        "builder_s": asdict(Summary.of(samples["uv"])),
        "builder_pip_s": asdict(Summary.of(samples["pip"])),
        "uv_target_s": asdict(Summary.of(samples["uv_hand"])),
        "pip_target_s": asdict(Summary.of(samples["pip_hand"])),
        "uv": subprocess.run([str(uv), "--version"], capture_output=True, text=True).stdout.strip(),
    }


def _start_to_first_cell(
    packages: Packages | None, built: bool = True, provider: SSHProvider | None = None
) -> float:
    start = time.perf_counter()
    nodes = 1 if provider else 2
    with Pool(nodes=nodes, procs_per_node=1, packages=packages, provider=provider) as pool:
        result = pool.run("1")
        elapsed = time.perf_counter() - start
        cached = all(e.cached for e in pool.environments.values())
        if not result.ok or (packages and built != cached):
            raise BenchError(f"the pool did not run as measured: {result!r}")
    return elapsed


def cached_starts(rounds: int, scratch: Path) -> dict[str, Any]:
    os.environ["SKYWARD_ENVS"] = str(scratch / "cached")
    packages = Packages(PACKAGES)
    _start_to_first_cell(packages, built=False)  # builds it: not counted
    sides = {
        "with": lambda: _start_to_first_cell(packages),
        "without": lambda: _start_to_first_cell(None),
    }
    samples = interleaved("(b)", sides, rounds, fmt_s)
    with_env, without = samples["with"], samples["without"]
    added = [a - b for a, b in zip(with_env, without, strict=True)]
    return {
        "with_s": asdict(Summary.of(with_env)),
        "without_s": asdict(Summary.of(without)),
        "added_s": asdict(Summary.of(added)),
    }


def ssh_starts(rounds: int, scratch: Path) -> dict[str, Any]:
    packages = Packages((f"--index-url={INDEX}", *PACKAGES))
    with honest_python() as python, ssh_hosts(1, scratch / "hosts") as hosts:

        def provider() -> SSHProvider:
            options = SSHOptions(
                identity=str(hosts.client_key),
                known_hosts=str(hosts.known_hosts),
                python=python,
                cache_dir=str(scratch / "cache"),
            )
            return SSHProvider([Host(hosts[0].address, hosts.user, hosts[0].port)], options)

        envs = f"/home/{hosts.user}/.cache/skyward_jupyter/envs"

        def forget() -> None:
            subprocess.run(hosts.inside_argv(0, "rm", "-rf", envs), check=True)

        def by_hand(i: int) -> float:
            target = f"/tmp/by-hand-{i}"
            argv = hosts.ssh_argv(0, python, "-m", "pip", "install", "-q", "--target", target,
                                  "--index-url", INDEX, *PACKAGES)  # fmt: skip
            elapsed = _timed(argv, dict(os.environ))
            subprocess.run(hosts.ssh_argv(0, "rm", "-rf", target), check=True)
            return elapsed

        built: list[float] = []
        cached: list[float] = []
        plain: list[float] = []
        hand: list[float] = []
        forget()
        _start_to_first_cell(packages, built=False, provider=provider())  # not counted
        _start_to_first_cell(None, provider=provider())
        by_hand(-1)
        for i in range(rounds):
            forget()
            built.append(_start_to_first_cell(packages, built=False, provider=provider()))
            sides = [(cached, packages), (plain, None)]
            for samples, given in rotated(sides, i):
                samples.append(_start_to_first_cell(given, provider=provider()))
            hand.append(by_hand(i))
        forget()
    return {
        "built_s": asdict(Summary.of(built)),
        "cached_s": asdict(Summary.of(cached)),
        "without_s": asdict(Summary.of(plain)),
        "build_added_s": asdict(Summary.of([b - p for b, p in zip(built, plain, strict=True)])),
        "cached_added_s": asdict(Summary.of([c - p for c, p in zip(cached, plain, strict=True)])),
        "pip_by_hand_s": asdict(Summary.of(hand)),
    }


def render_markdown(report: dict[str, Any]) -> str:
    first, starts = report["first_build"], report["cached_start"]
    rounds = first["builder_s"]["n"]
    lines = [
        "## Packages on the nodes: `--pip` environments",
        "",
        machine_line(report["machine"], {"pip": report["pip"]}),
        "",
        f"Command: `{report['command']}`",
        "",
        f"### (a) First build on a node, `{' '.join(PACKAGES)}` ({rounds} rounds, alternating)",
        "",
        "| | median | min | max | goal |",
        "|---|---:|---:|---:|---:|",
        range_row(f"the pool's builder with {first['uv']}", first["builder_s"], fmt_s, ""),
        range_row("the pool's builder with pip", first["builder_pip_s"], fmt_s, ""),
        range_row("`uv pip install --target DIR` by hand", first["uv_target_s"], fmt_s, ""),
        range_row("`pip install --target DIR` by hand", first["pip_target_s"], fmt_s, ""),
        "",
        f"The builder with uv costs "
        f"{first['builder_s']['median'] / first['pip_target_s']['median']:.2f} times pip by hand "
        f"({first['builder_pip_s']['median'] / first['pip_target_s']['median']:.2f} with pip): "
        "it makes a venv over the node's Python, has the installer count what is there already "
        "(torch pinned to the node's), installs what is missing and renames the environment into "
        "the cache. pip's and uv's caches are warm for all sides.",
        "",
        f"### (b) Start to first cell, 2 local ranks ({starts['with_s']['n']} rounds, alternating)",
        "",
        "| | median | min | max | goal |",
        "|---|---:|---:|---:|---:|",
        range_row("with `--pip` (environment cached)", starts["with_s"], fmt_s, ""),
        range_row("without packages", starts["without_s"], fmt_s, ""),
        range_row("added by the cached environment", starts["added_s"], fmt_s, "at most 0.5 s"),
        "",
        "A cached environment is found by its hash without a process; its ranks put its site "
        "directory first on `sys.path` as they start.",
    ]
    ssh = report.get("ssh")
    if ssh:
        ratio = ssh["build_added_s"]["median"] / ssh["pip_by_hand_s"]["median"]
        lines += [
            "",
            f"### (c) One SSH host (honest Python, file index), start to first cell "
            f"({ssh['built_s']['n']} rounds)",
            "",
            "| | median | min | max | goal |",
            "|---|---:|---:|---:|---:|",
            range_row("with `--pip`, empty environment cache", ssh["built_s"], fmt_s, ""),
            range_row("with `--pip`, environment cached", ssh["cached_s"], fmt_s, ""),
            range_row("without packages", ssh["without_s"], fmt_s, ""),
            range_row("added by the first build", ssh["build_added_s"], fmt_s, ""),
            range_row(
                "`pip install --target DIR` by hand over SSH", ssh["pip_by_hand_s"], fmt_s, ""
            ),
            range_row(
                "added by the cached environment", ssh["cached_added_s"], fmt_s, "at most 0.5 s"
            ),
            "",
            f"The first build adds {ratio:.2f} times what pip by hand takes on that host; the "
            "cached environment costs one "
            "command over the pool's SSH connection (the builder finds it by its hash).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--builds", 4, "first-build rounds")
    count(parser, "--starts", 6, "counted pool start rounds")
    count(parser, "--ssh-rounds", 4, "SSH rounds (0: none)", minimum=0)
    args = SCRIPT.parse_args(parser, argv)
    load_before = load_avg()
    pip = json.loads(
        subprocess.run(
            [sys.executable, "-c", "import json, pip; print(json.dumps(pip.__version__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    with tempfile.TemporaryDirectory(prefix="sky-bench-packages-") as scratch:
        try:
            first = first_builds(args.builds, Path(scratch))
            starts = cached_starts(args.starts, Path(scratch))
            ssh = None
            if args.ssh_rounds and available() is None:
                ssh = ssh_starts(args.ssh_rounds, Path(scratch))
        finally:
            shutdown_template()
    report: dict[str, Any] = {
        "machine": machine_info(load_before),
        "command": command_line(),
        "pip": pip,
        "first_build": first,
        "cached_start": starts,
        "ssh": ssh,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
