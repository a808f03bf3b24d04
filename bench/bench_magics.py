"""Magics benchmark: ``%%sky`` against ipyparallel's ``%%px``, measured through real kernels.

What is compared, and why it is fair:

* **Where it is measured.** Two real IPython kernels (``ipykernel``, started with
  ``jupyter_client`` exactly as a notebook server starts them) run side by side: one has
  ``%load_ext skyward_jupyter`` and a 2-rank pool (``%sky up --nodes 2``), the other an
  ``ipyparallel`` client on a 2-engine cluster that this script starts
  (``ipyparallel.Cluster(n=2)``) and stops. Every figure is the wall time a notebook frontend
  sees: from sending the ``execute_request`` to having both the ``execute_reply`` and the
  kernel's ``idle`` status on IOPub (so every output of the cell has arrived). A plain cell
  ``1`` in each kernel is timed the same way, as the floor that the kernel itself costs.
* **(a) Trivial cell.** ``%%sky`` + ``1`` against ``%%px`` + ``1`` (blocking, the default of
  ``rc.activate()``), after an uncounted warm-up of each, in interleaved blocks (sky block, px
  block, baselines, sky block, ...) so machine noise hits both alike; medians are compared.
* **(b) Shipping a 100 MiB numpy global to both ranks.** Before each timed cell the array is
  re-created (``big = np.random.rand(100*2**20//8)``, untimed) in both kernels, so it must
  travel. ``%%sky --out r`` + ``big.shape`` (the cell captures ``big`` and ships it) against
  ``view.push({"big": big}, block=True)``; ``r.shipped_bytes`` is read afterwards (untimed) to
  check that the array really travelled. The two sides alternate, and which goes first
  alternates too.
* **(c) The same ``%%sky`` cell with the array unchanged.** ``skyward_jupyter`` sends a global
  only when its pickled bytes hash differently from what the ranks have, so the bytes shipped
  should be about 0; the time is reported, and for reference ``%%px`` + ``big.shape`` on the
  engines that already hold the array.
* **Clean-up.** Every process the benchmark started (kernels, rank template, ranks, the
  ipyparallel controller and engines) is recorded from the process tree before the teardown
  (``%sky down --all``, ``shutdown_template()``, ``Cluster.stop_cluster_sync()``, kernel
  shutdown), and the report says whether any of them was still alive afterwards.

Run ``python bench/bench_magics.py --markdown-out BENCHMARKS.md`` to regenerate the figures in
``BENCHMARKS.md``; they are never edited by hand. JSON goes to ``bench/results/magics.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
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
    fmt_ms,
    fmt_s,
    load_avg,
    machine_info,
    machine_line,
    range_row,
    rotated,
    spread_row,
    version,
)

SCRIPT = Script("magics")
NODES = 2
GOAL_RATIO = 0.5  # sky / ipyparallel, for the trivial cell and for the 100 MiB shipment
BIG_ELEMENTS = 100 * 2**20 // 8  # float64: 100 MiB
BIG_BYTES = BIG_ELEMENTS * 8

SKY_TRIVIAL = "%%sky\n1"
PX_TRIVIAL = "%%px\n1"
PLAIN_TRIVIAL = "1"
MAKE_BIG = f"big = np.random.rand({BIG_ELEMENTS})"
SKY_SHIP = "%%sky --out r\nbig.shape"
PX_PUSH = 'view.push({"big": big}, block=True);'
PX_READ = "%%px\nbig.shape"
SKY_REPORT = "print('SHIPPED', r.shipped_bytes, r.values)"


# ------------------------------------------------------------------------------ kernels


@dataclass
class Execution:
    seconds: float
    texts: list[str] = field(default_factory=list)  # stream text and text/plain, in order
    errors: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Kernel:
    """A real ipykernel, driven the way a notebook frontend drives it."""

    def __init__(self, label: str, timeout: float) -> None:
        import zmq
        from jupyter_client import KernelManager

        self.label = label
        self.timeout = timeout
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=child_env(), cwd=str(REPO))
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._shell = self.kc.shell_channel
        self._iopub = self.kc.iopub_channel
        self._poller = zmq.Poller()
        self._poller.register(self._shell.socket, zmq.POLLIN)
        self._poller.register(self._iopub.socket, zmq.POLLIN)

    @property
    def pid(self) -> int | None:
        process = getattr(self.km.provisioner, "process", None)
        return getattr(process, "pid", None)

    def execute(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code`` as a notebook cell; the time ends when all its output has arrived."""
        limit = timeout or self.timeout
        while self._iopub.msg_ready():  # nothing left over from an earlier cell
            self._iopub.get_msg(timeout=0)
        started = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
        deadline = started + limit
        reply: dict[str, Any] | None = None
        idle = False
        out = Execution(0.0)
        while reply is None or not idle:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise BenchError(f"{self.label}: no answer within {limit:.0f} s to {code!r}")
            self._poller.poll(remaining * 1000)
            while self._shell.msg_ready():
                msg = self._shell.get_msg(timeout=0)
                if msg["parent_header"].get("msg_id") == msg_id:
                    reply = msg
            while self._iopub.msg_ready():
                msg = self._iopub.get_msg(timeout=0)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "status" and content["execution_state"] == "idle":
                    idle = True
                elif kind == "stream":
                    out.texts.append(content["text"])
                elif kind in ("execute_result", "display_data"):
                    out.texts.append(content["data"].get("text/plain", "") + "\n")
                elif kind == "error":
                    out.errors.append(f"{content['ename']}: {content['evalue']}")
        out.seconds = time.perf_counter() - started
        if reply["content"]["status"] != "ok":
            content = reply["content"]
            out.errors.append(f"{content.get('ename')}: {content.get('evalue')}")
        return out

    def check(
        self, code: str, expect: str | None = None, timeout: float | None = None
    ) -> Execution:
        """Run ``code``; fail unless it raised nothing and its output contains ``expect``."""
        out = self.execute(code, timeout)
        if out.errors or (expect is not None and expect not in out.text):
            raise BenchError(
                f"{self.label}: {code!r} failed: errors {out.errors}, output {out.text[-2000:]!r}"
            )
        return out

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=False)
        with contextlib.suppress(Exception):
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)


# ------------------------------------------------------------------------ processes


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: str  # /proc starttime, to tell a pid from a later process that reuses it
    name: str
    cmdline: str


def _proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has ended; only its parent's wait is missing
    cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return Proc(pid, int(fields[1]), fields[19], name, cmd[:160])


def descendants(root: int) -> dict[int, Proc]:
    """Every live process under ``root`` in the process tree (children, theirs, ...)."""
    procs = [p for p in (_proc(int(d)) for d in os.listdir("/proc") if d.isdigit()) if p]
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found: dict[int, Proc] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child.pid not in found:
                found[child.pid] = child
                todo.append(child.pid)
    return found


def still_alive(procs: dict[int, Proc]) -> list[Proc]:
    alive = []
    for p in procs.values():
        now = _proc(p.pid)
        if now is not None and now.start == p.start:
            alive.append(p)
    return alive


def wait_gone(procs: dict[int, Proc], seconds: float) -> list[Proc]:
    deadline = time.monotonic() + seconds
    while True:
        alive = still_alive(procs)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def role(p: Proc, tree: dict[int, Proc], kernels: dict[int, str]) -> str:
    """What a process started by the benchmark is, for the report."""
    parent = tree.get(p.ppid)
    if p.pid in kernels:
        return f"kernel ({kernels[p.pid]})"
    if "skyward_jupyter.agent.template" in p.cmdline:
        if parent is not None and "skyward_jupyter.agent.template" in parent.cmdline:
            return "skyward rank"  # forked from the template
        return "skyward rank template"
    if "skyward_jupyter.agent" in p.cmdline:
        return "skyward rank"  # spawned cold
    if "ipyparallel.engine" in p.cmdline:
        return "ipyparallel engine" + (" nanny" if "nanny" in p.cmdline else "")
    if "ipyparallel.controller" in p.cmdline:
        if parent is not None and "ipyparallel.controller" in parent.cmdline:
            return "ipyparallel controller subprocess"
        return "ipyparallel controller"
    return "other"


# ------------------------------------------------------------------------ measurements


def _interleaved(
    series: dict[str, tuple[Kernel, str, str]], runs: int, warmup: int, block: int
) -> dict[str, list[float]]:
    """Time each series' cell ``runs`` times, in blocks that take turns (after a warm-up)."""
    for name, (kernel, code, expect) in series.items():
        for _ in range(warmup):
            kernel.check(code, expect)
        print(f"  (a) warm-up of {name} done", file=sys.stderr, flush=True)
    samples: dict[str, list[float]] = {name: [] for name in series}
    while any(len(s) < runs for s in samples.values()):
        for name, (kernel, code, expect) in series.items():
            for _ in range(min(block, runs - len(samples[name]))):
                samples[name].append(kernel.check(code, expect).seconds * 1e3)
        done = min(len(s) for s in samples.values())
        medians = ", ".join(f"{n} {Summary.of(s).median:.2f} ms" for n, s in samples.items())
        print(f"  (a) {done}/{runs}: {medians}", file=sys.stderr, flush=True)
    return samples


_SHIPPED = re.compile(r"SHIPPED (\d+)")


def _shipped(sky: Kernel) -> int:
    match = _SHIPPED.search(sky.check(SKY_REPORT, "SHIPPED").text)
    assert match is not None
    return int(match.group(1))


def measure_trivial(sky: Kernel, px: Kernel, runs: int, warmup: int, block: int) -> dict[str, Any]:
    series = {
        "sky": (sky, SKY_TRIVIAL, "1"),
        "px": (px, PX_TRIVIAL, "1"),
        "plain_sky_kernel": (sky, PLAIN_TRIVIAL, "1"),
        "plain_px_kernel": (px, PLAIN_TRIVIAL, "1"),
    }
    samples = _interleaved(series, runs, warmup, block)
    summaries = {name: asdict(Summary.of(s)) for name, s in samples.items()}
    return {
        **{f"{name}_ms": s for name, s in summaries.items()},
        "ratio_sky_over_px": summaries["sky"]["median"] / summaries["px"]["median"],
        "cells": {name: code for name, (_, code, _) in series.items()},
        "example_output": {
            "sky": sky.check(SKY_TRIVIAL, "1").text,
            "px": px.check(PX_TRIVIAL, "1").text,
        },
        "runs": runs,
        "warmup": warmup,
        "block": block,
        "samples_ms": samples,
    }


def measure_shipping(sky: Kernel, px: Kernel, reps: int, warmup: int) -> dict[str, Any]:
    expect_shape = f"({BIG_ELEMENTS},)"
    sky_s: list[float] = []
    px_s: list[float] = []
    sky_bytes: list[int] = []
    example = ""

    def sky_side(counted: bool) -> None:
        nonlocal example
        sky.check(MAKE_BIG)
        out = sky.check(SKY_SHIP, expect_shape, timeout=300)
        shipped = _shipped(sky)
        if shipped < BIG_BYTES:
            raise BenchError(f"the re-created array was not shipped: {shipped} bytes")
        example = out.text
        if counted:
            sky_s.append(out.seconds)
            sky_bytes.append(shipped)

    def px_side(counted: bool) -> None:
        px.check(MAKE_BIG)
        out = px.check(PX_PUSH, timeout=300)
        if counted:
            px_s.append(out.seconds)

    for i in range(warmup + reps):
        counted = i >= warmup
        order: list[Callable[[bool], None]] = rotated([px_side, sky_side], i)
        for side in order:
            side(counted)
        label = f"rep {i - warmup + 1}/{reps}" if counted else f"warm-up {i + 1}/{warmup}"
        last = f"sky {sky_s[-1]:.3f} s, px push {px_s[-1]:.3f} s" if counted else ""
        print(f"  (b) {label} {last}", file=sys.stderr, flush=True)
    px.check(PX_READ, expect_shape)  # the engines really hold it
    sky_summary, px_summary = Summary.of(sky_s), Summary.of(px_s)
    return {
        "sky_s": asdict(sky_summary),
        "px_push_s": asdict(px_summary),
        "ratio_sky_over_px": sky_summary.median / px_summary.median,
        "sky_shipped_bytes": sky_bytes,
        "array_bytes": BIG_BYTES,
        "cells": {"make": MAKE_BIG, "sky": SKY_SHIP, "px": PX_PUSH},
        "example_output": {"sky": example},
        "reps": reps,
        "warmup": warmup,
        "samples_s": {"sky": sky_s, "px_push": px_s},
    }


def measure_unchanged(sky: Kernel, px: Kernel, reps: int) -> dict[str, Any]:
    expect_shape = f"({BIG_ELEMENTS},)"
    sky_s: list[float] = []
    px_s: list[float] = []
    shipped: list[int] = []
    for _ in range(reps):
        sky_s.append(sky.check(SKY_SHIP, expect_shape, timeout=300).seconds)
        shipped.append(_shipped(sky))
        px_s.append(px.check(PX_READ, expect_shape).seconds)
    return {
        "sky_s": asdict(Summary.of(sky_s)),
        "px_read_s": asdict(Summary.of(px_s)),
        "sky_shipped_bytes": shipped,
        "cells": {"sky": SKY_SHIP, "px": PX_READ},
        "reps": reps,
        "samples_s": {"sky": sky_s, "px_read": px_s},
    }


# ----------------------------------------------------------------------- the whole run


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import ipyparallel as ipp

    me = os.getpid()
    kernels: list[Kernel] = []
    cluster: Any = None
    started: dict[int, Proc] = {}
    setup: dict[str, float] = {}
    teardown: dict[str, Any] = {}
    results: dict[str, Any] = {}
    kernel_roles: dict[int, str] = {}
    try:
        print("starting the ipyparallel cluster (2 engines) and two kernels", file=sys.stderr)
        t0 = time.perf_counter()
        cluster = ipp.Cluster(n=NODES)
        cluster.start_cluster_sync()
        client = cluster.connect_client_sync()
        client.wait_for_engines(NODES, timeout=120)
        setup["ipyparallel_cluster_start_s"] = time.perf_counter() - t0
        url_file = str(
            Path(cluster.profile_dir)
            / "security"
            / f"ipcontroller-{cluster.cluster_id}-client.json"
        )
        client.close()

        sky = Kernel("sky kernel", args.timeout)
        kernels.append(sky)
        px = Kernel("px kernel", args.timeout)
        kernels.append(px)
        for kernel in kernels:
            kernel.check("import sys; print(sys.executable)", sys.executable)
            if kernel.pid is not None:
                kernel_roles[kernel.pid] = kernel.label

        sky.check("%load_ext skyward_jupyter")
        setup["sky_up_right_after_load_ext_s"] = sky.check(
            f"%sky up --nodes {NODES}", timeout=300
        ).seconds
        sky.check("import numpy as np")
        px.check(
            "import numpy as np, ipyparallel as ipp\n"
            f"rc = ipp.Client({url_file!r})\n"
            f"rc.wait_for_engines({NODES}, timeout=60)\n"
            "view = rc.activate()  # blocking DirectView on every engine; registers %%px"
        )
        sky.check("%%sky\nimport torch.distributed as d; d.get_world_size()", str(NODES))
        px.check("%%px\nimport os; os.getpid()", "Out[")

        print(f"(a) trivial cell: {args.runs} runs each", file=sys.stderr, flush=True)
        results["trivial"] = measure_trivial(sky, px, args.runs, args.warmup, args.block)
        print(f"(b) 100 MiB global: {args.ship_reps} each", file=sys.stderr, flush=True)
        results["shipping"] = measure_shipping(sky, px, args.ship_reps, args.ship_warmup)
        print(f"(c) unchanged global: {args.ship_reps}", file=sys.stderr, flush=True)
        results["unchanged"] = measure_unchanged(sky, px, args.ship_reps)
    finally:
        started = descendants(me)
        roles = {pid: role(p, started, kernel_roles) for pid, p in started.items()}
        teardown = _teardown(kernels, cluster, started, roles)
    counts: dict[str, int] = {}
    for r in roles.values():
        counts[r] = counts.get(r, 0) + 1
    teardown["started_by_role"] = counts
    teardown["started"] = [{**asdict(p), "role": roles[pid]} for pid, p in started.items()]
    return {"setup": setup, **results, "processes": teardown}


def _teardown(
    kernels: list[Kernel], cluster: Any, started: dict[int, Proc], roles: dict[int, str]
) -> dict[str, Any]:
    """Stop everything, in the order a user would; record what each step left running."""
    steps: dict[str, Any] = {}

    def of(*prefixes: str) -> dict[int, Proc]:
        return {pid: p for pid, p in started.items() if roles[pid].startswith(prefixes)}

    ranks = {pid: p for pid, p in started.items() if roles[pid] == "skyward rank"}

    def gone_after(step: str, procs: dict[int, Proc], seconds: float) -> None:
        steps[step] = {
            "expected_gone": len(procs),
            "still_alive": [asdict(p) for p in wait_gone(procs, seconds)],
        }

    sky = next((k for k in kernels if k.label == "sky kernel"), None)
    px = next((k for k in kernels if k.label == "px kernel"), None)
    if sky is not None:
        try:
            sky.check("%sky down --all")
            gone_after("%sky down --all: ranks", ranks, 10)
            sky.check(
                "from skyward_jupyter.providers.local import shutdown_template\nshutdown_template()"
            )
            gone_after("shutdown_template(): template and ranks", of("skyward"), 10)
        except BenchError as exc:
            steps["sky_teardown_error"] = str(exc)
    if px is not None:
        with contextlib.suppress(BenchError):
            px.check("rc.close()")
    if cluster is not None:
        try:
            cluster.stop_cluster_sync()
        except Exception as exc:  # noqa: BLE001 - reported, and the processes are checked below
            steps["cluster_stop_error"] = repr(exc)
        gone_after("Cluster.stop_cluster_sync(): controller, engines", of("ipyparallel"), 15)
        for leftover in (Path(cluster.profile_dir) / "log").glob(f"*{cluster.cluster_id}*"):
            leftover.unlink(missing_ok=True)  # the launcher's engine-set file
    for kernel in kernels:
        kernel.shutdown()
    left = wait_gone(started, 15)
    steps["left_alive"] = [asdict(p) for p in left]
    for p in left:  # the benchmark fails below, but leaves nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    return steps


# ----------------------------------------------------------------------------- report


def _met(ratio: float) -> str:
    return "met" if ratio <= GOAL_RATIO else "NOT met"


def render_markdown(report: dict[str, Any]) -> str:
    m, v = report["machine"], report["versions"]
    a, b, c = report["trivial"], report["shipping"], report["unchanged"]
    setup, procs = report["setup"], report["processes"]

    def ms_row(label: str, s: dict[str, float]) -> str:
        return spread_row(label, s, fmt_ms)

    def s_row(label: str, s: dict[str, float], extra: str) -> str:
        return range_row(label, s, fmt_s, extra)

    sky_net = a["sky_ms"]["median"] - a["plain_sky_kernel_ms"]["median"]
    px_net = a["px_ms"]["median"] - a["plain_px_kernel_ms"]["median"]
    shipped_b = sorted(set(b["sky_shipped_bytes"]))
    shipped_c = sorted(set(c["sky_shipped_bytes"]))
    roles = ", ".join(f"{n} {r}" for r, n in sorted(procs["started_by_role"].items()))
    left = procs["left_alive"]
    steps = []
    for step, check in procs.items():
        if isinstance(check, dict) and "expected_gone" in check:
            alive = len(check["still_alive"])
            state = "all ended" if not alive else f"{alive} still running"
            steps.append(f"`{step}`: {check['expected_gone']} processes, {state}.")
        elif step.endswith("_error"):
            steps.append(f"{step}: {check}.")
    mib = b["array_bytes"] / 2**20
    lines = [
        "## Magics: `%%sky` against ipyparallel's `%%px`",
        "",
        machine_line(m, v),
        "",
        f"Two real ipykernel kernels side by side, driven through `jupyter_client` like a "
        f"notebook frontend: one with `%load_ext skyward_jupyter` and a {NODES}-rank local pool, "
        f"one with an ipyparallel client on `ipyparallel.Cluster(n={NODES})` (started and "
        "stopped by the script). Each time runs from sending the `execute_request` to having "
        "the `execute_reply` and the kernel's `idle` status (all the cell's output has arrived).",
        "",
        f"### (a) Trivial cell round trip ({a['runs']} runs each after {a['warmup']} warm-up, "
        f"interleaved in blocks of {a['block']})",
        "",
        "| cell | median | p10 | p90 | min | max |",
        "|---|---:|---:|---:|---:|---:|",
        ms_row("`%%sky` / `1`", a["sky_ms"]),
        ms_row("`%%px` / `1` (blocking)", a["px_ms"]),
        ms_row("*plain `1` in the sky kernel (the kernel's own cost)*", a["plain_sky_kernel_ms"]),
        ms_row("*plain `1` in the px kernel (the kernel's own cost)*", a["plain_px_kernel_ms"]),
        "",
        f"Ratio `%%sky` / `%%px` (medians): **{a['ratio_sky_over_px']:.2f}**. "
        f"Goal <= {GOAL_RATIO:.2f}: **{_met(a['ratio_sky_over_px'])}**. "
        f"Above each kernel's plain-cell floor (difference of medians): `%%sky` "
        f"{fmt_ms(sky_net)}, `%%px` {fmt_ms(px_net)}.",
        "",
        f"### (b) Shipping a {mib:.0f} MiB numpy global to {NODES} ranks ({b['reps']} each "
        f"after {b['warmup']} warm-up, alternating; the array is re-created before each)",
        "",
        "| how | median | min | max | bytes shipped per rank |",
        "|---|---:|---:|---:|---:|",
        s_row(
            "`%%sky --out r` / `big.shape` (captures and ships `big`)",
            b["sky_s"],
            " / ".join(str(x) for x in shipped_b) + " (`r.shipped_bytes`)",
        ),
        s_row('`view.push({"big": big}, block=True)`', b["px_push_s"], f"{b['array_bytes']}"),
        "",
        f"Ratio `%%sky` / `view.push` (medians): **{b['ratio_sky_over_px']:.2f}**. "
        f"Goal <= {GOAL_RATIO:.2f}: **{_met(b['ratio_sky_over_px'])}**. "
        "The `%%sky` figure is the whole cell (capture, transfer, running `big.shape` on both "
        "ranks, the result and the warning it prints for a global over 100 MiB); `view.push` is "
        "the transfer alone. `r.shipped_bytes` counts the pickled global (array plus pickle "
        "header) sent to each rank.",
        "",
        f"### (c) The same `%%sky` cell again, `big` unchanged ({c['reps']} runs)",
        "",
        "| cell | median | min | max | bytes shipped per rank |",
        "|---|---:|---:|---:|---:|",
        s_row(
            "`%%sky --out r` / `big.shape`",
            c["sky_s"],
            " / ".join(str(x) for x in shipped_c) + " (`r.shipped_bytes`)",
        ),
        s_row("*for reference: `%%px` / `big.shape` (engines hold `big`)*", c["px_read_s"], "0"),
        "",
        "### Start and clean-up (for information)",
        "",
        f"`ipyparallel.Cluster(n={NODES})` start until {NODES} engines registered: "
        f"{fmt_s(setup['ipyparallel_cluster_start_s'])}; `%sky up --nodes {NODES}` in the kernel "
        f"right after `%load_ext skyward_jupyter` (its template still warming up): "
        f"{fmt_s(setup['sky_up_right_after_load_ext_s'])}.",
        "",
        f"Processes the benchmark started (from its process tree just before the teardown): "
        f"{roles}. "
        + " ".join(steps)
        + " After the kernels' shutdown, "
        + (
            "**none of them was left running**."
            if not left
            else f"**{len(left)} were still running** (then killed): "
            + ", ".join(f"{p['pid']} {p['cmdline'][:60]}" for p in left)
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = SCRIPT.parser(__doc__)
    count(parser, "--runs", 200, "timed trivial cells of each kind")
    count(parser, "--warmup", 20, "untimed trivial cells first", minimum=0)
    count(parser, "--block", 20, "trivial cells per interleaved block")
    count(parser, "--ship-reps", 7, "timed 100 MiB shipments each")
    count(parser, "--ship-warmup", 1, "untimed shipments first", minimum=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per cell")
    args = SCRIPT.parse_args(parser, argv)

    load_before = load_avg()
    measured = run_benchmark(args)
    report: dict[str, Any] = {
        "machine": machine_info(load_before),
        "versions": {
            d: version(d) for d in ("ipyparallel", "ipykernel", "jupyter_client", "numpy")
        },
        "command": command_line(),
        "goals": {"ratio_sky_over_ipyparallel_max": GOAL_RATIO},
        **measured,
    }
    SCRIPT.write_outputs(args, report, render_markdown(report))
    if report["processes"]["left_alive"]:
        print("error: processes were left running after the teardown", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
