"""A real Slurm cluster for tests: ``slurmctld`` here, one ``slurmd`` per network namespace.

``slurm_cluster(n, tmp)`` runs ``munged`` (own key and socket) and ``slurmctld -D`` in the root
namespace, reached by the nodes at the bridge's address, and n ``slurmd -D``, each in a network
and UTS namespace of its own (hostname = node name) on a bridge, as ``tests/hosts.py`` builds SSH
hosts. All files are in ``tmp``; clients find the cluster by ``SLURM_CONF`` (``env()``), munged by
``AuthInfo=socket=`` in it. Nodes share this filesystem; no name needs resolving (slurm.conf has
addresses). A run is recorded in ``/run/sky-test-slurm`` before it creates anything, so that the
next run cleans up after one that was killed (``reap_stale``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, STDOUT
from typing import Any

from . import hosts
from .hosts import NETNS_ETC, netns_pids

REGISTRY = Path("/run/sky-test-slurm")
PREFIX = "sls"  # namespaces sls<tag>-<i>, bridge slb<tag>, veths slv<tag>-<i>
DAEMONS = {name: Path("/usr/sbin") / name for name in ("munged", "slurmctld", "slurmd")}
CLIENTS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sinfo")
MAX_NODES = 250  # .1 is the bridge (the controller), nodes are .2 ... .251
# A slurmd runs with its UTS hostname set to its node name, so `hostname` in a job names the node.
_SET_HOSTNAME = "import os,socket,sys; a=sys.argv; socket.sethostname(a[1]); os.execv(a[2], a[2:])"


def available() -> str | None:
    """Why ``slurm_cluster`` cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [str(p) for p in DAEMONS.values() if not p.exists()]
    missing += [c for c in (*CLIENTS, "ip", "unshare") if shutil.which(c) is None]
    return f"needs {', '.join(missing)} (`make system-deps`)" if missing else None


@dataclass(frozen=True)
class SlurmNode:
    index: int
    name: str  # NodeName, and the hostname inside its namespace
    namespace: str
    address: str  # NodeAddr, on eth0 inside the namespace
    veth: str  # the bridge-side end of its link


@dataclass(frozen=True)
class SlurmCluster:
    nodes: tuple[SlurmNode, ...]
    conf: Path  # slurm.conf (SLURM_CONF)
    controller: str  # SlurmctldHost's name: this machine's hostname
    controller_address: str  # the bridge's address, where slurmctld and srun are reached
    controller_port: int
    partitions: dict[str, tuple[str, ...]]  # name -> node names; the first is the default
    cpus_per_node: int
    munge_socket: Path
    work: Path  # every file of the cluster
    bridge: str
    subnet: str
    python: str = sys.executable  # visible at this path on every node
    gpu_type: str | None = None  # every node's one GPU, a GRES with this type and no device

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def env(self) -> dict[str, str]:
        """What to merge into a subprocess environment for the client commands."""
        return {"SLURM_CONF": str(self.conf)}

    def run(
        self, *argv: str, input: str | None = None, timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster; raises with its stderr when it fails."""
        env = _environ(self.conf)
        done = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=env
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def pids(self, i: int) -> set[int]:
        """Live processes in node i's network namespace (slurmd, its steps and their tasks)."""
        return netns_pids(self.nodes[i].namespace)

    def logs(self, lines: int = 40) -> str:
        """The tails of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted(self.work.rglob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"== {log.relative_to(self.work)}\n" + "\n".join(text))
        return "\n".join(parts)


def _environ(conf: Path) -> dict[str, str]:
    """This process's environment for a client command or daemon: with SLURM_CONF, without the
    SLURM_* variables of a job this process may run in (they would point srun at that job).
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**base, "SLURM_CONF": str(conf)}


def _save(record: dict[str, Any]) -> None:
    Path(record["_path"]).write_text(json.dumps({k: v for k, v in record.items() if k != "_path"}))


def _sessions(daemons: Sequence[Mapping[str, Any]]) -> set[int]:
    """Live processes in the daemons' sessions (each was started in a session of its own, which
    its children share), not older than the daemon: a session id may be a reused pid.
    """
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            words = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        state, sid, started = words[0], int(words[3]), int(words[19])
        for d in daemons:  # a start time of None: the daemon was gone before it was recorded
            if sid == d["pid"] and started >= int(d["start_time"] or 0) and state not in "ZX":
                found.add(int(proc.name))
    return found


def _teardown_record(record: dict[str, Any], timeout: float = 10.0) -> None:
    """SIGKILL what is left in the daemons' sessions (root namespace), then tear down what
    ``tests/hosts.py`` does: processes in the namespaces, namespaces, links, /etc/netns files,
    the record; each checked gone.
    """

    def gone() -> bool:
        for pid in (pids := _sessions(record["daemons"])):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    hosts._wait(gone, timeout, "the daemons to die")
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


# No systemd, no cgroups: processes are tracked by parentage, tasks are not confined, nothing is
# accounted. config_overrides: a node has the CPUs written here, whatever this machine has.
# batch_sched_delay=0: a batch job is scheduled at the next pass (a second), not up to 3 s later.
# auth/munge and cred/munge (the defaults) use one munged for every node: a credential forwarded
# from node to node is decoded twice, which Debian's build accepts (it is built for multiple
# slurmds per machine, which -N needs too).
SLURM_CONF = """\
ClusterName=sky{tag}
SlurmctldHost={c.controller}({c.controller_address})
SlurmctldPort={c.controller_port}
AuthInfo=socket={c.work}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={c.work}/state
SlurmctldPidFile={c.work}/slurmctld.pid
SlurmctldLogFile={c.work}/slurmctld.log
SlurmdSpoolDir={c.work}/%n/spool
SlurmdPidFile={c.work}/%n/slurmd.pid
SlurmdLogFile={c.work}/%n/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=5
KillWait=2
MailProg=/bin/true
"""

# slurmd loads a cgroup plugin whatever the other plugins are. Named here, it is only loaded;
# otherwise slurmd looks for a cgroup filesystem, which `ip netns exec`'s fresh /sys lacks.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"


def _write_files(cluster: SlurmCluster, tag: str) -> None:
    """slurm.conf, cgroup.conf, munged's key and the daemons' directories."""
    work = cluster.work
    work.mkdir(parents=True, mode=0o700)
    key = work / "munge.key"
    key.touch(mode=0o600)  # munged wants it readable by its user only
    key.write_bytes(secrets.token_bytes(1024))
    (work / "state").mkdir()
    lines = [SLURM_CONF.format(c=cluster, tag=tag).rstrip("\n")]
    for node in cluster.nodes:
        (work / node.name / "spool").mkdir(parents=True)
        cpus = cluster.cpus_per_node
        gres = f" Gres=gpu:{cluster.gpu_type}:1" if cluster.gpu_type else ""
        lines.append(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus}{gres}")
    if cluster.gpu_type:  # what Slurm schedules and reports; no GPU behind it
        lines.insert(1, "GresTypes=gpu")
        gres_conf = f"AutoDetect=off\nName=gpu Type={cluster.gpu_type} File=/dev/null\n"
        (work / "gres.conf").write_text(gres_conf)  # a device file Slurm finds; no GPU
    for i, (name, members) in enumerate(cluster.partitions.items()):
        default = "YES" if i == 0 else "NO"
        lines.append(f"PartitionName={name} Nodes={','.join(members)} MaxTime=60 Default={default}")
    (work / "cgroup.conf").write_text(CGROUP_CONF)
    cluster.conf.write_text("\n".join(lines) + "\n")


def _free_port() -> int:
    """A TCP port free on every address of the root namespace now (slurmctld binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _start(
    argv: Sequence[str], out: Path, env: dict[str, str], record: dict[str, Any] | None = None
) -> subprocess.Popen[bytes]:
    """A daemon, our child, in a session of its own, with SLURM_CONF in its environment (and its
    descendants'). One in the root namespace (``record`` given) is recorded at once.
    """
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            argv, stdin=DEVNULL, stdout=log, stderr=STDOUT, env=env, start_new_session=True
        )
    if record is not None:
        record["daemons"].append({"pid": proc.pid, "start_time": hosts._start_time(proc.pid)})
        with hosts._registry_lock():
            _save(record)
    return proc


def _query(env: dict[str, str], *argv: str) -> str | None:
    """A client command's output, or None when it fails (the daemons may not be up yet)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=15, env=env)
    return done.stdout if done.returncode == 0 else None


def _stop(cluster: SlurmCluster, procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """Cancel every job, wait until none is left (their steps end on their nodes), SIGTERM the
    slurmds, slurmctld, munged (last: the others use it); the teardown SIGKILLs what is left.
    """
    env = _environ(cluster.conf)
    ctld_up = len(procs) > 1 and procs[1].poll() is None
    if ctld_up and (jobs := (_query(env, "squeue", "-h", "-o", "%A") or "").split()):
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=15, env=env)
        hosts._wait(
            lambda: _query(env, "squeue", "-h", "-o", "%A") in ("", None), timeout, "no jobs"
        )
    for proc in reversed(procs):
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout / 2)


def _network(cluster: SlurmCluster) -> None:
    """The nodes' namespaces on the bridge, each with its address and /etc/hosts."""
    names = ["127.0.0.1 localhost", f"{cluster.controller_address} {cluster.controller}"]
    names += [f"{node.address} {node.name}" for node in cluster.nodes]
    prefixlen = ipaddress.ip_network(cluster.subnet).prefixlen
    for node in cluster.nodes:
        ns, veth, address = node.namespace, node.veth, node.address
        hosts._ip("netns", "add", ns)
        hosts._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        hosts._ip("link", "set", veth, "master", cluster.bridge)
        hosts._ip("link", "set", veth, "up")
        hosts._ip("-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
        hosts._ip("-n", ns, "link", "set", "eth0", "up")
        hosts._ip("-n", ns, "link", "set", "lo", "up")
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "hosts").write_text("\n".join(names) + "\n")


def _daemons(
    procs: list[subprocess.Popen[bytes]], record: dict[str, Any], cluster: SlurmCluster, t: float
) -> None:
    """Start munged, then slurmctld, then the slurmds (into ``procs``, which the caller stops),
    each once the one before answers; return once every node is idle.
    """
    work, conf, sock, names = cluster.work, cluster.conf, cluster.munge_socket, cluster.node_names
    env = _environ(conf)
    outs = [work / "munged.log", work / "slurmctld.out", *(work / f"{n}.out" for n in names)]

    def wait(check: Callable[[], bool], what: str) -> None:
        """Wait for ``check``; fail at once, with its output, when a daemon has exited."""

        def ready() -> bool:
            for proc, out in zip(procs, outs, strict=False):
                if proc.poll() is not None:
                    tail = out.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {tail}")
            return check()

        hosts._wait(ready, t, what)

    # -f: munged wants every directory above its socket open to all (root needs no such thing).
    munged = [str(DAEMONS["munged"]), "-F", "-f", f"--socket={sock}", "--num-threads=8"]
    munged += [f"--{f}-file={work / f'munge.{f}'}" for f in ("key", "pid", "seed")]
    procs.append(_start(munged, outs[0], env, record))
    wait(sock.exists, "munged")
    procs.append(_start([str(DAEMONS["slurmctld"]), "-D", "-f", str(conf)], outs[1], env, record))
    wait(lambda: "is UP" in (_query(env, "scontrol", "ping") or ""), "slurmctld")
    for node, out in zip(cluster.nodes, outs[2:], strict=True):
        argv = ["ip", "netns", "exec", node.namespace, "unshare", "--uts", "--"]
        argv += [sys.executable, "-c", _SET_HOSTNAME, node.name]
        argv += [str(DAEMONS["slurmd"]), "-D", "-N", node.name, "-f", str(conf)]
        procs.append(_start(argv, out, env))
    idle = ["sinfo", "-hN", "-t", "idle", "-o", "%N"]
    wait(lambda: set((_query(env, *idle) or "").split()) == set(names), "every node idle")


@contextlib.contextmanager
def slurm_cluster(
    nodes: int,
    tmp: Path,
    *,
    cpus_per_node: int = 2,
    partitions: Mapping[str, Sequence[int]] | None = None,
    timeout: float = 20.0,
    gpu_type: str | None = None,
) -> Iterator[SlurmCluster]:
    """A Slurm cluster of ``nodes`` nodes; torn down (and checked) on exit.

    ``partitions`` maps a partition's name to its nodes' indices, the first being the default;
    by default ``debug`` (every node) and ``tiny`` (node 0 only: a job wanting more pends).
    After a failure the cluster's files stay in ``tmp`` for their logs. ``gpu_type`` gives every
    node one GRES GPU of that type (Slurm's name, e.g. ``nvidia_h200``), with no device behind it.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"1 <= nodes <= {MAX_NODES}")
    if (why := available()) is not None:
        raise RuntimeError(f"slurm_cluster {why}")
    names = [f"node{i}" for i in range(nodes)]
    parts = {"debug": range(nodes), "tiny": [0]} if partitions is None else partitions
    reap_stale()
    tag = secrets.token_hex(3)
    work = tmp / f"slurm-{tag}"
    if len(str(work / "munge.socket").encode()) > 100:  # a unix socket's path: 108 bytes at most
        raise ValueError(f"tmp is too deep for munged's socket: {work}")
    me = os.getpid()
    record: dict[str, Any] = {"tag": tag, "pid": me, "start_time": hosts._start_time(me)}
    record |= {"namespaces": [f"{PREFIX}{tag}-{i}" for i in range(nodes)], "bridge": f"slb{tag}"}
    record |= {"veths": [f"slv{tag}-{i}" for i in range(nodes)], "daemons": []}
    record["_path"] = str(REGISTRY / f"{tag}.json")
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as teardown:  # last in, first out; each runs whatever the others do
        teardown.callback(lambda: [p.wait(timeout) for p in procs])  # dead by then: reap them
        teardown.callback(_teardown_record, record, timeout)  # whatever part of it exists
        # Under tests/hosts.py's lock, which its runs hold to pick theirs, the subnet is taken: on
        # the bridge before the lock is let go, where their next pick sees it.
        with hosts._registry_lock():
            subnet = hosts._pick_subnet()
            record["subnet"] = str(subnet)
            _save(record)
            gateway = f"{subnet.network_address + 1}"
            hosts._ip("link", "add", record["bridge"], "type", "bridge")
            hosts._ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", record["bridge"])
            hosts._ip("link", "set", record["bridge"], "up")
        addresses = [f"{subnet.network_address + 2 + i}" for i in range(nodes)]
        node_list = zip(names, record["namespaces"], addresses, record["veths"], strict=True)
        cluster = SlurmCluster(
            nodes=tuple(SlurmNode(i, *node) for i, node in enumerate(node_list)),
            conf=work / "slurm.conf",
            controller=socket.gethostname().split(".")[0],  # slurmctld runs only where so named
            controller_address=gateway,
            controller_port=_free_port(),
            partitions={p: tuple(names[i] for i in indices) for p, indices in parts.items()},
            cpus_per_node=cpus_per_node,
            munge_socket=work / "munge.socket",
            work=work,
            bridge=record["bridge"],
            subnet=str(subnet),
            gpu_type=gpu_type,
        )
        teardown.callback(_stop, cluster, procs, timeout)
        _write_files(cluster, tag)
        _network(cluster)
        _daemons(procs, record, cluster, timeout)
        yield cluster
    shutil.rmtree(work)  # not reached after a failure: the files stay, for their logs
