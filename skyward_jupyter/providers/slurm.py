"""A Slurm allocation as a pool: ``%%sky --provider slurm --nodes N [--partition P] ...``.

The notebook runs where Slurm's client commands work (a login node, or any submit host):

- the allocation is a batch job (``sbatch``) whose only step is a keeper that ends the job once
  the pool's ranks have been gone for a while, so a killed kernel does not leave it running until
  its time limit: the ranks end when the notebook's heartbeat stops, then the keeper;
- while the job pends, each node shows ``pending`` with Slurm's reason and expected start;
  an interrupt (or the panel's shut down) cancels it;
- each rank is a job step started with ``srun --jobid J --overlap`` on its node: Slurm tracks,
  accounts and cleans it up, and the step's stdin and stdout, forwarded by Slurm over its own
  munge-authenticated connections, are the rank's wire;
- ``%sky down`` and the kernel's end cancel the job (``scancel``); the server reaps an orphan's.

The nodes must see the notebook's Python environment (a shared filesystem, as on most clusters;
``--python`` names another interpreter). ``--pip``/``--requirements``/``--mirror`` environments
are built on each node by a job step before the ranks start. Commands are argument lists, never
shell text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..environments import (
    BUILDER,
    NodeEnvironment,
    Packages,
    notebook_uv,
    run_builder,
    torch_choices,
)
from ..events import RankState
from ..gpus import NO_GPU, check_cpu_or_gpus, check_gpu_layout, gpu_model, same_gpu
from ..wire_lines import MODE, STREAM_LIMIT, LineReader, LineWriter
from .base import (
    GPUS_PER_NODE,
    PYTHON,
    Looks,
    Node,
    Progress,
    Provider,
    ProviderError,
    ProviderOptions,
    ReapReport,
    StderrTail,
    no_progress,
    option,
)

if TYPE_CHECKING:
    from ..spec import PoolSpec

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_STARTED = "sky-ranks-started"
_EXPORT = "--export=PATH,HOME,USER,LANG,SLURM_CONF,PYTHONPATH"
"""What the job and its steps take from the notebook's environment: not its secrets (Slurm
keeps a job's environment on disk). A rank's own environment travels on its stdin."""
POLL = 1.0
"""Seconds between looks at a pending job."""
KEEPER = """\
# The pool's job: ends once its ranks (job steps) have been gone for 20 s. The notebook marks the
# job's comment when it starts ranks, so ranks that came and went between two looks count too.
idle=0; waited=0
while true; do
  if squeue -h -s -j "$SLURM_JOB_ID" -o %i | grep -qv -e '\\.batch$' -e '\\.extern$'; then
    idle=0
  elif [ "$waited" -ge 120 ] || squeue -h -j "$SLURM_JOB_ID" -o %k | grep -q sky-ranks-started
  then
    idle=$((idle + 2))
  fi
  if [ "$idle" -ge 20 ]; then exit 0; fi
  sleep 2; waited=$((waited + 2))
done
"""


@dataclass(frozen=True, slots=True)
class SlurmOptions(ProviderOptions):
    """The Slurm provider's options: the job's, as sbatch reads them."""

    partition: str | None = option("Slurm partition", metavar="P")
    account: str | None = option("Slurm account to charge", metavar="A")
    time: str | None = option("Slurm time limit (e.g. 1:00:00)", metavar="T")
    qos: str | None = option("Slurm quality of service", metavar="Q")
    gpus_per_node: int | None = GPUS_PER_NODE.field()
    constraint: str | None = option("Slurm node features", metavar="C")
    extra: tuple[str, ...] = option(
        "another sbatch option, as sbatch reads it (repeatable; e.g. --slurm-arg=--exclusive)",
        default=(),
        flag="--slurm-arg",
        action="append",
        metavar="ARG",
    )
    python: str | None = PYTHON.field()
    """None: this notebook's Python, at the same path on the nodes."""
    gpu: str | None = None
    """``--gpu``: the model the nodes' GRES must name (compared by model), checked once the
    job runs."""


def _need(command: str) -> None:
    """Refuse to go on without a Slurm client command on this machine's PATH."""
    if shutil.which(command) is None:
        raise ProviderError(
            f"{command} not found: the slurm provider needs Slurm's client commands here "
            "(run the notebook on a login node or another submit host)"
        )


async def _run(*argv: str, timeout: float = 30) -> str:
    """Run a Slurm client command; its stdout, or :class:`ProviderError` with its stderr."""
    _need(argv[0])
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise ProviderError(f"{argv[0]} did not answer within {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"status {proc.returncode}"
        raise ProviderError(last if last.startswith(argv[0]) else f"{argv[0]}: {last}")
    return out.decode(errors="replace")


class SlurmRank:
    """A rank as a job step: the ``srun`` process here, whose pipes reach the task."""

    def __init__(
        self, proc: asyncio.subprocess.Process, job: str, node: str, name: str, looks: Looks
    ) -> None:
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        self._proc = proc
        self._job, self._node, self._name = job, node, name
        self._looks = looks
        self.reader = LineReader(proc.stdout)  # slurmstepd forwards whole lines only
        self.writer = LineWriter(proc.stdin)
        self._stderr = StderrTail()
        self._stderr.follow(proc.stderr)

    def describe(self) -> str:
        return f"slurm job {self._job} on {self._node}"

    def diagnostics(self) -> str:
        return self._stderr.text()

    async def running(self, pid: int, within: float) -> str | None:
        """Two looks at the process's ``/proc`` entry on its node (a job step of the pool's
        job), ``within`` seconds apart.
        """
        return await self._looks.running(pid, within)

    async def kill(self) -> None:
        """Cancel the step in Slurm (its task dies wherever it runs), then end ``srun``."""
        with contextlib.suppress(ProviderError):
            steps = await _run("squeue", "-h", "-s", "-j", self._job, "-o", "%i %j", timeout=10)
            for line in steps.splitlines():
                step, _, name = line.partition(" ")
                if name.strip() == self._name:
                    await _run("scancel", "--signal=KILL", step, timeout=10)
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        await self._proc.wait()

    async def wait(self) -> str:
        code = await self._proc.wait()
        await self._stderr.drain()
        if code < 0:
            return f"srun killed by signal {-code} ({self.describe()})"
        return f"exited with status {code} on {self._node} (slurm job {self._job})"


def gres_gpu_types(gres: str) -> list[str]:
    """The GPU types in a node's ``Gres`` (``gpu:h100:8(S:0-1),gpu:a100:2``): ``["h100",
    "a100"]``; ``""`` for GPUs given without a type.
    """
    types = []
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) > 1:
            types.append(parts[1] if len(parts) > 2 else "")
    return types


def check_gres_gpu(node: str, gres: str, asked: str | None) -> str | None:
    """``--gpu``: the node's GRES names that model (compared by model: ``nvidia_h100_80gb_hbm3``
    is H100); its GPU type for the panel. A GRES without types cannot tell the model: accepted.
    """
    types = gres_gpu_types(gres)
    named = [t for t in types if t]
    if asked and not types:
        raise ProviderError(
            f"--gpu {asked}: slurm node {node} has no GPU (Gres={gres or '(null)'}); choose a "
            "partition with GPUs (--partition), or leave out --gpu"
        )
    if asked and named and not any(same_gpu(asked, t) for t in named):
        raise ProviderError(
            f"--gpu {asked}: slurm node {node} has {', '.join(named)} (Gres={gres}); pass "
            f"--gpu {gpu_model(named[0])}, or place the job on {asked} nodes (--partition, "
            "--constraint)"
        )
    return next((gpu_model(t) for t in named if not asked or same_gpu(asked, t)), None)


def _own(spec: PoolSpec) -> SlurmOptions:
    assert isinstance(spec.options, SlurmOptions), spec.options
    return spec.options


class SlurmProvider(Provider):
    name = "slurm"
    Options = SlurmOptions
    installs_packages = True

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> Provider:
        """The job's options; ``--gpu`` needs ``--gpus-per-node`` (a job gets only the GPUs it
        asks for), and those must carry the ranks NCCL would run.
        """
        options = _own(spec)
        gpu = None if spec.gpu == NO_GPU else spec.gpu
        if gpu and not options.gpus_per_node:
            raise ProviderError(
                f"--gpu {gpu} on slurm: pass --gpus-per-node N too (a Slurm job gets only the "
                "GPUs it asks for)"
            )
        check_gpu_layout(
            [options.gpus_per_node or 0] * spec.nodes, spec.procs_per_node, spec.backend, spec.gpu
        )
        return cls(replace(options, gpu=gpu), pool_name)

    @classmethod
    def settle(cls, spec: PoolSpec) -> PoolSpec:
        """``--gpu none`` and ``--gpus-per-node`` do not go together."""
        check_cpu_or_gpus(spec.gpu, _own(spec).gpus_per_node, GPUS_PER_NODE.flag)
        return spec

    @classmethod
    def check(cls, spec: PoolSpec) -> None:
        """Slurm's client commands must be here: a pool is a job submitted from this machine."""
        for command in ("sbatch", "srun"):
            _need(command)

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        given = _own(spec).partition
        partition = f", partition {given}" if given else ""
        return f"slurm{partition}"

    def __init__(self, options: SlurmOptions | None = None, pool_name: str = "default") -> None:
        super().__init__()
        self.options = options or SlurmOptions()
        self.job: str | None = None
        self.ends_at: str | None = None
        self._pool_name = pool_name
        self._token = secrets.token_hex(4)
        self._srun: list[asyncio.subprocess.Process] = []
        self._marked = False
        self._looks: dict[str, Looks] = {}
        """Per node: how its silent ranks run."""

    # ------------------------------------------------------------------------------ the job

    def _sbatch(self, nodes: int) -> list[str]:
        o = self.options
        argv = ["sbatch", "--parsable", f"--job-name=sky-{self._pool_name}-{self._token}"]
        argv += [f"--nodes={nodes}", "--ntasks-per-node=1", "--output=/dev/null", _EXPORT]
        for flag, value in (
            ("--partition", o.partition),
            ("--account", o.account),
            ("--time", o.time),
            ("--qos", o.qos),
            ("--constraint", o.constraint),
            ("--gpus-per-node", o.gpus_per_node),
        ):
            if value is not None:
                argv.append(f"{flag}={value}")
        return [*argv, *o.extra, "--wrap", KEEPER]

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        try:
            self.job = (await _run(*self._sbatch(nodes))).strip().split(";")[0]
        except ProviderError as exc:
            asked = " ".join(a for a in self._sbatch(nodes)[3:] if a.startswith("--") and "=" in a)
            raise ProviderError(f"the Slurm job was refused ({asked}): {exc}") from None
        progress(f"slurm job {self.job} submitted")
        try:
            names = await self._running(nodes, progress)
            return [await self._node(i, name) for i, name in enumerate(names)]
        except BaseException:
            await self.release()  # pending, failed or interrupted: the job goes
            raise

    async def _running(self, nodes: int, progress: Progress) -> list[str]:
        """Wait for the job to run (saying why it pends); its node names."""
        said = ""
        while True:
            line = (await _run("squeue", "-h", "-j", str(self.job), "-o", "%T|%r|%S|%e|%N")).strip()
            if not line:
                raise ProviderError(f"slurm job {self.job} ended before it ran (see sacct)")
            state, reason, start, end, nodelist = line.split("|", 4)
            if state == "RUNNING":
                self.ends_at = end
                if end[:1].isdigit():
                    self.warnings.append(
                        f"slurm job {self.job} ends at its time limit, {end}: the pool ends then"
                    )
                hosts = await _run("scontrol", "show", "hostnames", nodelist)
                return hosts.split()
            if state != "PENDING":
                raise ProviderError(f"slurm job {self.job} is {state} ({reason})")
            now = f"pending ({reason}), expected start {start}"
            if now != said:
                said = now
                progress(f"slurm job {self.job} {now}")
                for i in range(nodes):
                    progress(now, i, RankState.PROVISIONING)
            await asyncio.sleep(POLL)

    async def _node(self, index: int, name: str) -> Node:
        shown = await _run("scontrol", "show", "node", name, "-o")
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        gpus = tuple(str(i) for i in range(self.options.gpus_per_node or 0))
        model = check_gres_gpu(name, fields.get("Gres", ""), self.options.gpu)
        # What the panels show of the machine: its Slurm name and job.
        shown_as = f"slurm {name}, job {self.job}"
        return Node(
            index, fields.get("NodeAddr", name), gpus, model, shown_as, {"slurm_node": name}
        )

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> SlurmRank:
        if self.job is None:
            raise ProviderError("the Slurm job is not running")
        if not self._marked:  # what the job's keeper counts from (see KEEPER)
            await _run("scontrol", "update", f"JobId={self.job}", f"Comment={_STARTED}")
            self._marked = True
        name = node.labels.get("slurm_node", node.address)
        step = f"sky-rank-{self._token}-{len(self._srun)}"
        python = self.options.python or sys.executable
        argv = ["srun", f"--jobid={self.job}", "--overlap", "--nodes=1", "--ntasks=1", _EXPORT]
        argv += [f"--nodelist={name}", f"--job-name={step}", "--quiet", "--kill-on-bad-exit=0"]
        argv += [python, "-m", "skyward_jupyter.agent", "--env-from-stdin"]
        path = os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)
        child_env = {**os.environ, "PYTHONPATH": path}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            start_new_session=True,
            limit=STREAM_LIMIT,
        )
        self._srun.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(_env_line({**env, "PYTHONPATH": path, "SKYWARD_WIRE": MODE}))
        if name not in self._looks:
            self._looks[name] = Looks(partial(self._on_node, name), ())
        return SlurmRank(proc, self.job, name, step, self._looks[name])

    async def _on_node(self, name: str, argv: Sequence[str], timeout: float) -> bytes:
        """Run ``argv`` on node ``name`` as a short step of the pool's job; its stdout."""
        if self.job is None:
            raise ProviderError("the Slurm job is not running")
        step = ["srun", f"--jobid={self.job}", "--overlap", "--nodes=1", "--ntasks=1", _EXPORT]
        # A minute at most: Slurm ends a look left on a frozen node itself.
        step += [f"--nodelist={name}", f"--job-name=sky-look-{self._token}", "--time=1"]
        step += ["--quiet"]
        return (await _run(*step, *argv, timeout=timeout)).encode()

    async def build_environments(
        self, nodes: Sequence[Node], packages: Packages, progress: Progress
    ) -> dict[int, NodeEnvironment]:
        """Each allocated node builds (or finds cached) the environment in a job step of its
        own before its ranks start, the same builder as elsewhere; the nodes see this
        machine's files (uv, the wheels of ``--ship-wheels``) as they see its Python.
        """
        if self.job is None:
            raise ProviderError("the Slurm job is not running")
        wheels = str(await asyncio.to_thread(packages.download)) if packages.wheels else None
        uv = await asyncio.to_thread(notebook_uv)
        request = packages.request(wheels, str(uv) if uv else None)
        python = self.options.python or sys.executable
        path = os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)
        child_env = {**os.environ, "PYTHONPATH": path}

        async def one(node: Node) -> NodeEnvironment:
            name = node.labels.get("slurm_node", node.address)
            argv = ["srun", f"--jobid={self.job}", "--overlap", "--nodes=1", "--ntasks=1"]
            argv += [f"{_EXPORT},SKYWARD_ENVS", f"--nodelist={name}", "--quiet"]
            argv += [f"--job-name=sky-packages-{self._token}", python, *BUILDER]

            def say(text: str) -> None:
                progress(text, node.index, RankState.BOOTING)

            where = f"slurm {name}, job {self.job}"
            built = await run_builder(argv, child_env, request, packages.digest, where, say)
            say(f"packages ready: {built.describe()}")
            return built

        built = await asyncio.gather(*(one(node) for node in nodes))
        found = {node.index: env for node, env in zip(nodes, built, strict=True)}
        if said := torch_choices({f"node {i}": env for i, env in found.items()}):
            self.warnings.append(said)
        return found

    async def release(self) -> None:
        for proc in self._srun:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        await asyncio.gather(*(p.wait() for p in self._srun))
        if self.job is not None:
            job, self.job = self.job, None
            await _run("scancel", job)

    # ------------------------------------------------------------------------ for the server

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        return {
            "job": self.job,
            "ends_at": self.ends_at,
            "slurm_conf": os.environ.get("SLURM_CONF"),
        }

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        job = record.get("job")
        if not job:
            return ReapReport(notes=["no slurm job was recorded"])
        env = dict(os.environ)
        if record.get("slurm_conf"):
            env["SLURM_CONF"] = str(record["slurm_conf"])
        try:
            done = subprocess.run(
                ["scancel", str(job)], capture_output=True, text=True, env=env, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return ReapReport(notes=[f"could not run scancel {job}: {exc}"])
        if done.returncode != 0:
            return ReapReport(notes=[f"scancel {job}: {done.stderr.strip()}"])
        return ReapReport(notes=[f"slurm job {job} cancelled"])


def _env_line(env: Mapping[str, str]) -> bytes:
    """The rank's environment, as ``--env-from-stdin`` reads it: one JSON line before the wire."""
    return json.dumps({**env, "PYTHONUNBUFFERED": "1"}).encode() + b"\n"
