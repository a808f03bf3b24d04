"""A real Ray cluster for tests: a head and workers, each in a network namespace, on a bridge.

``ray_cluster(tmp)`` runs ``ray start --head --block`` in one network namespace and
``ray start --address=<head> --block`` in one more per worker, on a bridge as ``tests/hosts.py``
builds SSH hosts; each node's ``--node-ip-address`` is its namespace's address, its CPUs are fixed.
Every daemon is a child of the test (``--block``), in a session of its own.

A Ray driver (``ray.init(address=...)``) attaches to a raylet on its own machine (by its unix
sockets) and fails without one, so the notebook's side is a node too, as it must be on real
machines: a raylet with no CPUs in the root namespace at the bridge's address (``notebook``), to
which ``ray.init(**cluster.init_kwargs)`` attaches (its ``_node_ip_address`` picks it: every
raylet's process is visible here, and without it the driver would take the head's, which works
here only because the namespaces share this machine's files). Work that asks for no CPUs may run
on it, as on real machines: ranks belong in placement-group bundles.

Ray's files are under ``/tmp/sr<tag>`` (its socket paths must stay under 108 bytes), each node's
``ray start`` output under ``tmp``. Every Ray process carries ``SKY_TEST_RAY=<tag>`` in its
environment (Ray's children inherit it): teardown kills what carries it, then every process in
the namespaces, and removes the namespaces, links and files. A run is recorded in
``/run/sky-test-ray`` before it creates anything, so the next run cleans up after one that was
killed (``reap_stale``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from typing import Any

from . import hosts
from .hosts import netns_pids

REGISTRY = Path("/run/sky-test-ray")
PREFIX = "sry"  # namespaces sry<tag>-<i> (0 the head), bridge srb<tag>, veths srv<tag>-<i>
MARKER = "SKY_TEST_RAY"  # in the environment of every process of a cluster: its tag
RAY = Path(sys.executable).with_name("ray")  # the venv's CLI
GCS_PORT = 6379  # in the head's own namespace: no other run's port can collide with it
MAX_WORKERS = 200
PRIORITY = -20  # `nice` of every Ray daemon: see _start


def available() -> str | None:
    """Why ``ray_cluster`` cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if importlib.util.find_spec("ray") is None or not RAY.exists():
        return "needs ray (`pip install -e '.[dev]'`)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return None


@dataclass(frozen=True)
class RayNode:
    name: str  # "head", "worker1", ..., "notebook"
    address: str  # --node-ip-address
    namespace: str | None  # None: the root namespace (the notebook's node)
    node_id: str  # hex, as ray.nodes() gives NodeID
    cpus: int
    temp_dir: Path  # --temp-dir: its session's logs are under temp_dir/session_latest/logs
    pid: int  # `ray start --block`


@dataclass(frozen=True)
class RayCluster:
    address: str  # the GCS, "ip:port": what a driver passes to ray.init(address=...)
    head: RayNode
    workers: tuple[RayNode, ...]
    notebook: RayNode  # no CPUs, at the bridge's address, in the root namespace
    bridge: str
    subnet: str
    tag: str
    temp_root: Path
    logs: Path  # each node's `ray start` output

    @property
    def nodes(self) -> tuple[RayNode, ...]:
        """The nodes that run work: the head and the workers."""
        return (self.head, *self.workers)

    @property
    def init_kwargs(self) -> dict[str, str]:
        """``ray.init(**init_kwargs)`` from this machine's root namespace (the notebook)."""
        return {"address": self.address, "_node_ip_address": self.notebook.address}

    def pids(self) -> set[int]:
        """Live processes of the cluster (daemons, agents, workers), wherever they run."""
        return _marked({self.tag}).union(*self._namespaced().values())

    def _namespaced(self) -> dict[str, set[int]]:
        return {n.name: netns_pids(n.namespace) for n in self.nodes if n.namespace is not None}

    def memory(self) -> dict[str, int]:
        """Proportional set size (bytes) of each node's processes, the notebook's included."""
        nodes = self._namespaced()
        nodes[self.notebook.name] = _marked({self.tag}).difference(*nodes.values())
        return {name: sum(map(_pss, pids)) for name, pids in nodes.items()}

    def tails(self, lines: int = 30) -> str:
        """The end of each node's `ray start` output and raylet log, for failure messages."""
        return _tails(self.logs, self.temp_root, lines)


# -- processes -----------------------------------------------------------------------------------


def _marked(tags: set[str]) -> set[int]:
    """Live processes whose environment carries the marker of one of ``tags``."""
    wanted = {f"{MARKER}={tag}".encode() for tag in tags}
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if wanted.isdisjoint((proc / "environ").read_bytes().split(b"\0")):
                continue
        except OSError:
            continue  # ended while we looked
        if hosts._alive(int(proc.name)):
            found.add(int(proc.name))
    return found


def _pss(pid: int) -> int:
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0  # ended while we looked
    return next(
        (int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:")), 0
    )


def _raylet(tag: str, address: str) -> str | None:
    """The node id of the cluster's raylet at ``address`` (it is on its command line)."""
    for pid in _marked({tag}):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # ended while we looked
        if Path(argv[0]).name == "raylet" and f"--node_ip_address={address}" in argv:
            return next(a.split("=", 1)[1] for a in argv if a.startswith("--node_id="))
    return None


def _tails(logs: Path, temp_root: Path, lines: int) -> str:
    files = sorted(logs.glob("*.out")) + sorted(temp_root.glob("*/session_latest/logs/raylet.out"))
    parts = []
    for log in files:
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"== {log}\n" + "\n".join(text))
    return "\n".join(parts)


# -- teardown and the registry -------------------------------------------------------------------


def _save(record: dict[str, Any]) -> None:
    Path(record["_path"]).write_text(json.dumps({k: v for k, v in record.items() if k != "_path"}))


def _teardown_record(record: dict[str, Any], timeout: float = 10.0) -> None:
    """SIGKILL every marked process (until none is left: one may fork meanwhile), then tear down
    what ``tests/hosts.py`` does (the namespaces' processes, namespaces, links, the record); Ray's
    files go between the two, once nothing writes them. Each is checked gone.
    """

    def gone() -> bool:
        for pid in (pids := _marked({record["tag"]})):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    hosts._wait(gone, timeout, f"the processes of ray cluster {record['tag']} to die")
    for namespace in record["namespaces"]:
        hosts.kill_namespace(namespace, timeout)
    if Path(record["temp_root"]).exists():  # it may not have been made yet
        shutil.rmtree(record["temp_root"])
    hosts._teardown(record, timeout)


def reap_stale() -> list[str]:
    """Tear down what runs whose process is gone left behind; returns their tags."""
    reaped = []
    with hosts._registry_lock():
        REGISTRY.mkdir(parents=True, exist_ok=True)
        for path in sorted(REGISTRY.glob("*.json")):
            record = {**json.loads(path.read_text()), "_path": str(path)}
            pid = record["pid"]
            if hosts._alive(pid) and hosts._start_time(pid) == record["start_time"]:
                continue
            _teardown_record(record)
            reaped.append(record["tag"])
    return reaped


# -- starting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    namespace: str | None
    address: str
    cpus: int
    extra: tuple[str, ...]  # `ray start` arguments of this kind of node


def _start(spec: _Spec, temp_root: Path, logs: Path, env: dict[str, str], mb: int) -> Popen[bytes]:
    """A node's `ray start --block`, our child, in a session of its own (`nice` and `ip netns
    exec` exec in place: the pid is ray's).

    At a raised priority, which its children inherit: a raylet gives its Python agents a fixed
    15 s to report their ports and aborts otherwise, which on a machine busy with the rest of
    the suite they miss (their imports alone are seconds of CPU); no setting lengthens it. Where
    the kernel groups processes by session for scheduling (autogroup), a process's nice counts
    only within its session, so the new session's group gets the priority too.
    """
    netns = ["ip", "netns", "exec", spec.namespace] if spec.namespace else []
    argv = [
        "nice", "-n", str(PRIORITY), *netns, str(RAY), "start", "--block", "--disable-usage-stats",
        f"--node-ip-address={spec.address}", f"--num-cpus={spec.cpus}", "--num-gpus=0",
        f"--temp-dir={temp_root / spec.name}", f"--object-store-memory={mb * 2**20}", *spec.extra,
    ]  # fmt: skip
    with open(logs / f"{spec.name}.out", "wb") as out:
        proc = Popen(
            argv, stdin=DEVNULL, stdout=out, stderr=STDOUT, env=env, start_new_session=True
        )
    with contextlib.suppress(FileNotFoundError):  # a kernel without autogroup
        Path(f"/proc/{proc.pid}/autogroup").write_text(str(PRIORITY))
    return proc


def _network(record: dict[str, Any], addresses: Sequence[str], prefixlen: int) -> None:
    """A namespace per node, its eth0 on the bridge; no default route out of it."""
    for ns, veth, address in zip(record["namespaces"], record["veths"], addresses, strict=True):
        hosts._ip("netns", "add", ns)
        hosts._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        hosts._ip("link", "set", veth, "master", record["bridge"])
        hosts._ip("link", "set", veth, "up")
        hosts._ip("-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
        hosts._ip("-n", ns, "link", "set", "eth0", "up")
        hosts._ip("-n", ns, "link", "set", "lo", "up")


def _specs(
    record: dict[str, Any], addresses: Sequence[str], gateway: str, cpus: int
) -> list[_Spec]:
    """The head, the workers, and last the notebook's node."""
    gcs = f"--address={addresses[0]}:{GCS_PORT}"
    head = ("--head", f"--port={GCS_PORT}", "--include-dashboard=false")
    specs = [_Spec("head", record["namespaces"][0], addresses[0], cpus, head)]
    for i, (ns, address) in enumerate(zip(record["namespaces"][1:], addresses[1:], strict=True)):
        specs.append(_Spec(f"worker{i + 1}", ns, address, cpus, (gcs,)))
    # It runs no work: no log monitor (which forwards the output of a node's workers). In the
    # root namespace, which other runs share, every port it and its driver bind is the system's
    # pick (the dashboard agent's HTTP port, 52365 by default, binds with ray[default] only).
    notebook = (gcs, "--include-log-monitor=false", "--min-worker-port=0", "--max-worker-port=0")
    notebook += ("--dashboard-agent-listen-port=0",)
    return [*specs, _Spec("notebook", None, gateway, 0, notebook)]


@contextlib.contextmanager
def ray_cluster(
    tmp: Path,
    workers: int = 1,
    cpus: int = 2,
    *,
    object_store_mb: int = 100,
    timeout: float = 90.0,
) -> Iterator[RayCluster]:
    """A head and ``workers`` workers of ``cpus`` CPUs each, and the notebook's node (no CPUs);
    torn down (and checked) on exit, a driver of this process connected to it shut down first.
    """
    if not 0 <= workers <= MAX_WORKERS:
        raise ValueError(f"0 <= workers <= {MAX_WORKERS}")
    if (why := available()) is not None:
        raise RuntimeError(f"ray_cluster {why}")
    reap_stale()
    tag = secrets.token_hex(3)
    me = os.getpid()
    record: dict[str, Any] = {"tag": tag, "pid": me, "start_time": hosts._start_time(me)}
    record |= {"namespaces": [f"{PREFIX}{tag}-{i}" for i in range(workers + 1)]}
    record |= {"veths": [f"srv{tag}-{i}" for i in range(workers + 1)], "bridge": f"srb{tag}"}
    record |= {"temp_root": f"/tmp/sr{tag}", "_path": str(REGISTRY / f"{tag}.json")}
    temp_root, logs = Path(record["temp_root"]), tmp / f"ray-{tag}"
    env = {**os.environ, MARKER: tag, "RAY_USAGE_STATS_ENABLED": "0"}
    procs: list[Popen[bytes]] = []

    def wait(condition: Callable[[], bool], what: str) -> None:
        def ready() -> bool:
            if dead := [p.args for p in procs if p.poll() is not None]:
                raise RuntimeError(f"ray start exited: {dead}\n{_tails(logs, temp_root, 30)}")
            return condition()

        try:
            hosts._wait(ready, timeout, what)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{_tails(logs, temp_root, 30)}") from None

    with contextlib.ExitStack() as teardown:  # last in, first out
        teardown.callback(lambda: [p.wait(timeout) for p in procs])  # dead by then: reap them
        teardown.callback(_teardown_record, record, timeout)  # whatever part of it exists
        # Under tests/hosts.py's lock, which its runs hold to pick theirs, the subnet is taken: on
        # the bridge before the lock is let go, where their next pick sees it.
        with hosts._registry_lock():
            REGISTRY.mkdir(parents=True, exist_ok=True)
            subnet = hosts._pick_subnet()
            record["subnet"] = str(subnet)
            _save(record)
            gateway = f"{subnet.network_address + 1}"
            hosts._ip("link", "add", record["bridge"], "type", "bridge")
            hosts._ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", record["bridge"])
            hosts._ip("link", "set", record["bridge"], "up")
        addresses = [f"{subnet.network_address + 2 + i}" for i in range(workers + 1)]
        _network(record, addresses, subnet.prefixlen)
        temp_root.mkdir()
        logs.mkdir(parents=True)
        specs = _specs(record, addresses, gateway, cpus)
        gcs = f"{addresses[0]}:{GCS_PORT}"
        teardown.callback(_shutdown_driver, gcs)
        # One node at a time, each once the one before is registered (`ray start` writes
        # `ray_current_cluster` then): a node's `ray start` gives its raylet a fixed 30 s to
        # register, which nodes booting side by side on a loaded machine can miss.
        for spec in specs:
            procs.append(_start(spec, temp_root, logs, env, object_store_mb))
            wait((temp_root / spec.name / "ray_current_cluster").exists, f"{spec.name} to join")
        nodes = []
        for spec, proc in zip(specs, procs, strict=True):
            if (node_id := _raylet(tag, spec.address)) is None:
                raise RuntimeError(f"no raylet at {spec.address}\n{_tails(logs, temp_root, 30)}")
            temp_dir = temp_root / spec.name
            nodes.append(
                RayNode(
                    spec.name, spec.address, spec.namespace, node_id, spec.cpus, temp_dir, proc.pid
                )
            )
        yield RayCluster(
            address=gcs,
            head=nodes[0],
            workers=tuple(nodes[1:-1]),
            notebook=nodes[-1],
            bridge=record["bridge"],
            subnet=str(subnet),
            tag=tag,
            temp_root=temp_root,
            logs=logs,
        )


def _shutdown_driver(gcs: str) -> None:
    """``ray.shutdown()`` if this process is a driver of the cluster: a driver left connected to
    a cluster that is gone blocks on it.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node = ray._private.worker.global_worker.node
        if node is not None and node.gcs_address == gcs:
            ray.shutdown()
