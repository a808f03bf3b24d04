"""A Ray cluster as a pool: ``%%sky --provider ray --nodes N [--ray-address ADDR]``.

The notebook joins the cluster as a Ray driver (``--ray-address``, else ``RAY_ADDRESS``, else
``auto``), reserves a placement group with one bundle per node (the node's ranks' CPUs and GPUs,
strictly spread over N nodes when N > 1), and starts each rank inside its node's bundle: a small
actor runs the agent as its child process and relays its stdin and stdout. That relay, Ray's own
calls between the driver and the actor, is the rank's wire: nothing of ours listens on any
interface, and the wire is as authenticated and as encrypted as the cluster's own traffic: in
clear unless Ray's TLS is on (``RAY_USE_TLS``); the pool warns when it is off and a rank is on
another node than the notebook's. This package reaches the nodes as a Ray ``py_modules`` entry,
so nothing needs installing there but Python, torch, cloudpickle and ray.

Everything belongs to the driver's job: ``%sky down`` removes the placement group and the actors;
when the kernel dies, Ray ends the job's actors and placement group itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agent.descendants import ProcStat, end_rank, read_stat
from ..events import RankState
from ..gpus import check_cpu_or_gpus
from ..procs import how_it_ran
from .base import (
    GPUS_PER_NODE,
    LOOK_WITHIN,
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

_PACKAGE = str(Path(__file__).resolve().parents[1])
_CHUNK = 1 << 20
CONNECT_TIMEOUT = 30.0
_CONNECT_LIMITS = (
    "RAY_gcs_server_port_wait_time_s",
    "RAY_gcs_rpc_server_connect_timeout_s",
    "RAY_py_gcs_connect_timeout_s",
)


class RankHost:
    """The actor that runs one rank's agent and carries its wire (runs on the node)."""

    def __init__(self, run_id: str | None = None) -> None:
        import skyward_jupyter

        self._run_id = run_id
        """The pool's run id: where the rank's private directory is, to remove with it."""

        package_parent = str(Path(skyward_jupyter.__file__).resolve().parents[1])
        child_env = {**os.environ, "PYTHONPATH": _prepended(package_parent)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "skyward_jupyter.agent", "--env-from-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
        )

    def pid(self) -> int:
        return self._proc.pid

    def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def read(self) -> bytes:
        """What the agent wrote since the last read (blocks until there is some); b"" at its end."""
        assert self._proc.stdout is not None
        return self._proc.stdout.read1(_CHUNK)  # type: ignore[attr-defined, no-any-return]

    def stderr(self) -> bytes:
        assert self._proc.stderr is not None
        return self._proc.stderr.read1(_CHUNK)  # type: ignore[attr-defined, no-any-return]

    def wait(self) -> int:
        return self._proc.wait()

    def look(self, pid: int, within: float) -> tuple[ProcStat | None, ProcStat | None]:
        """Process ``pid``'s ``/proc`` stat, and again ``within`` seconds later (None where it
        is gone): how a silent rank runs, seen from its node.
        """
        before = read_stat(pid)
        time.sleep(within)
        return before, read_stat(pid)

    def kill(self) -> None:
        """The rank, with every process below it (what its cells detached too), and its
        private directory.
        """
        end_rank(self._proc.pid, self._run_id)


class _Reader:
    """``readexactly`` over the actor's ``read``."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._buffer = bytearray()

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self._actor.read.remote()
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(self._buffer), n)
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


class _Writer:
    """``write``/``drain`` onto the actor's ``write``, in order, one call per batch."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._pending: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None

    def write(self, data: Any) -> None:
        self._pending.append(bytes(data))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = b"".join(self._pending), []
            await self._actor.write.remote(batch)

    async def drain(self) -> None:
        if self._flushing is not None:
            await self._flushing


class RayRank:
    def __init__(self, actor: Any, pid: int, node: str) -> None:
        self._actor = actor
        self.pid = pid
        self._node = node
        self.reader = _Reader(actor)
        self.writer = _Writer(actor)
        import ray

        self._stderr = StderrTail()
        self._stderr.follow(self._chunks(), ends=(ray.exceptions.RayError,))

    def describe(self) -> str:
        return f"ray node {self._node} pid {self.pid}"

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self._actor.stderr.remote():
            yield chunk

    def diagnostics(self) -> str:
        return self._stderr.text()

    async def running(self, pid: int, within: float) -> str | None:
        """Two looks at the process's ``/proc`` entry by its actor, ``within`` seconds apart;
        an actor that cannot answer in time (its node frozen or gone) says no.
        """
        import ray

        try:
            before, after = await asyncio.wait_for(
                self._actor.look.remote(pid, within), within + LOOK_WITHIN
            )
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return None
        return how_it_ran(before, after, within)

    async def kill(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError, asyncio.TimeoutError):
            await asyncio.wait_for(self._actor.kill.remote(), 10)
        with contextlib.suppress(ray.exceptions.RayError):
            await asyncio.to_thread(ray.kill, self._actor)  # a frozen node: the actor goes too

    async def wait(self) -> str:
        import ray

        try:
            code = await asyncio.wait_for(self._actor.wait.remote(), 10)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return f"lost: its actor on ray node {self._node} is gone"
        if code < 0:
            return f"killed by signal {-code} on ray node {self._node}"
        return f"exited with status {code} on ray node {self._node}"


def _ray_tls() -> bool:
    """Whether this driver speaks TLS to the cluster, read as Ray reads it."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


_NO_RAY = "--provider ray needs the ray package here: pip install 'skyward_jupyter[ray]'"


@dataclass(frozen=True, slots=True)
class RayOptions(ProviderOptions):
    """The Ray provider's options: the cluster to join and what each node's bundle holds."""

    address: str | None = option(
        "the Ray cluster to join (default: RAY_ADDRESS, else auto)",
        flag="--ray-address",
        metavar="ADDR",
    )
    gpus_per_node: int | None = GPUS_PER_NODE.field()
    """What each node's bundle of the placement group holds."""


def _own(spec: PoolSpec) -> RayOptions:
    assert isinstance(spec.options, RayOptions), spec.options
    return spec.options


class RayProvider(Provider):
    name = "ray"
    Options = RayOptions
    packages_otherwise = (
        "give the Ray cluster a runtime_env with them (pip or uv: Ray builds and caches it per "
        "environment)"
    )

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> Provider:
        options = _own(spec)
        return cls(
            options.address,
            spec.procs_per_node or 1,
            options.gpus_per_node or 0,
            extra.get("init"),
        )

    @classmethod
    def settle(cls, spec: PoolSpec) -> PoolSpec:
        """``--gpu none`` and ``--gpus-per-node`` do not go together."""
        check_cpu_or_gpus(spec.gpu, _own(spec).gpus_per_node, GPUS_PER_NODE.flag)
        return spec

    @classmethod
    def check(cls, spec: PoolSpec) -> None:
        """The ray package must be here: this kernel is the cluster's driver."""
        if importlib.util.find_spec("ray") is None:
            raise ProviderError(_NO_RAY)

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        return f"ray at {_own(spec).address or os.environ.get('RAY_ADDRESS') or 'auto'}"

    def __init__(
        self,
        address: str | None = None,
        ranks_per_node: int = 1,
        gpus: int = 0,
        init: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self._init = dict(init or {})
        """More of ``ray.init``'s arguments (tests: which local raylet the driver uses)."""
        self._per_node = ranks_per_node
        self._gpus = gpus
        self.group: Any = None
        self._bundles: list[int] = []
        self._actors: list[Any] = []

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        for name in _CONNECT_LIMITS:  # read when ray is imported; a silent address otherwise
            os.environ.setdefault(name, "10")  # holds ray.init for many minutes
        try:
            import ray
            from ray.util.placement_group import placement_group, placement_group_table
        except ImportError:
            raise ProviderError(_NO_RAY) from None
        progress(f"joining the Ray cluster at {self.address}")
        try:
            await asyncio.wait_for(asyncio.to_thread(self._connect), CONNECT_TIMEOUT)
        except asyncio.TimeoutError:
            raise ProviderError(
                f"no Ray cluster answered at {self.address} within {CONNECT_TIMEOUT:.0f} s"
            ) from None
        bundle = {
            "CPU": float(self._per_node),
            **({"GPU": float(self._gpus)} if self._gpus else {}),
        }
        strategy = "STRICT_SPREAD" if nodes > 1 else "PACK"
        self.group = placement_group([dict(bundle) for _ in range(nodes)], strategy=strategy)
        for i in range(nodes):
            progress(
                f"waiting for a placement group of {nodes} x {bundle}", i, RankState.PROVISIONING
            )
        try:
            await self.group.ready()
        except BaseException:
            await self.release()
            raise
        table = placement_group_table(self.group)["bundles_to_node_id"]
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}  # type: ignore[no-untyped-call]
        driver = ray.get_runtime_context().get_node_id()
        if not _ray_tls() and any(table[i] != driver for i in range(nodes)):
            self.warnings.append(
                "Ray's TLS is off (RAY_USE_TLS): the ranks' wires cross the network unencrypted, "
                "with the cells, globals, results and settings on them (the relay's token and "
                "the head's TLS key among them); turn Ray's TLS on, or use the pool only on a "
                "network you trust"
            )
        gpus = tuple(str(g) for g in range(self._gpus))
        group = self.group.id.hex()[:12]
        return [  # the panels show each machine as its Ray node and placement group
            Node(i, addresses[table[i]], gpus, None, f"ray {table[i][:12]}, group {group}")
            for i in range(nodes)
        ]

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        try:
            ray.init(
                address=self.address,
                runtime_env={"py_modules": [_PACKAGE]},
                logging_level=logging.ERROR,
                log_to_driver=False,
                **self._init,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ProviderError(f"cannot join the Ray cluster at {self.address}: {exc}") from None

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> RayRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host: Any = ray.remote(RankHost)
        host = host.options(
            num_cpus=1,
            num_gpus=self._gpus / self._per_node if self._gpus else 0,
            max_concurrency=5,  # read, write, stderr and a look at once
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=node.index
            ),
        )
        actor = host.remote(env.get("TORCHELASTIC_RUN_ID"))  # an id, not a secret
        self._actors.append(actor)
        try:
            pid = await actor.pid.remote()
            # The environment (it may hold tokens) goes down the wire, not into Ray's records
            # of the actor's arguments.
            await actor.write.remote(json.dumps({**env, "PYTHONUNBUFFERED": "1"}).encode() + b"\n")
        except ray.exceptions.RayError as exc:
            raise ProviderError(f"ray node {node.address}: the rank did not start: {exc}") from None
        return RayRank(actor, pid, node.address)

    async def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor)
        self._actors.clear()
        if self.group is not None:
            group, self.group = self.group, None
            with contextlib.suppress(ray.exceptions.RayError):
                remove_placement_group(group)

    def record(self, pids: Mapping[int, Any]) -> dict[str, Any]:
        group = self.group.id.hex() if self.group is not None else None
        return {"address": self.address, "placement_group": group}

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        """Nothing to do: the placement group and actors belonged to the kernel's Ray job,
        which Ray ended with the kernel.
        """
        group = record.get("placement_group") or "(none)"
        return ReapReport(
            notes=[f"Ray ended placement group {group} and its actors with the kernel's job"]
        )


def _prepended(path: str) -> str:
    """``PYTHONPATH`` with ``path`` first, the user's entries kept after it."""
    return os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p)
