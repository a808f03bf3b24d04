"""Real SSH hosts for tests: one ``sshd`` per Linux network namespace, all on one bridge.

``ssh_hosts(n, tmp)`` builds n namespaces, each with ``lo`` and an ``eth0`` (a veth whose peer is
on a bridge in the root namespace), a /24 that collides with no address or route of this machine,
and an ``sshd -D -e`` started by ``ip netns exec`` as a child of the test process. The namespaces
have no default route: nothing leaves them except to the bridge, where the root namespace answers
at ``Hosts.bridge_address``.

By default the hosts are as ordinary machines are (``private=True``), which is what hid real
problems when they were friendlier:

- each has its own hostname (a UTS namespace), which its ``/etc/hosts`` resolves to 127.0.1.1, as
  Debian and Ubuntu write it, and the other hosts' names do not resolve at all;
- each has its own filesystem view (set up by ``tests/host_view.py`` in the sshd's mount
  namespace): a private ``/tmp``, a private ``/home`` with the login's home, and the notebook's
  home, the project's checkout and this test's files hidden. Only the Python the ranks need
  (the project's venv and its base interpreter, read-only paths) stays visible, at the same path;
- the login is the unprivileged ``skyuser`` (made once on this machine if missing);
- ``max_sessions`` is each sshd's ``MaxSessions`` (OpenSSH's default 10), per host if a list;
  ``home_size`` makes the homes small filesystems (e.g. "2m"), to fill up; ``shm_size`` makes
  ``/dev/shm`` one (a container's is 64 MiB unless it is given more).

``private=False`` gives the old, friendlier hosts: root login, this machine's filesystem, the
machine's hostname resolving to the host's own address. ``Hosts.inside_argv`` runs a command in a
host's own namespaces (its filesystem view), as root, without SSH.

Needs root, ``ip`` (iproute2) and ``/usr/sbin/sshd`` (``make system-deps``).

Each run records what it creates in ``/run/sky-test-hosts/<tag>.json`` before creating it, so a
run that was killed (SIGKILL, a crashed interpreter) is cleaned up by the next one
(``reap_stale``): its sshds and session processes are killed, its namespaces and links deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from skyward_jupyter.providers import ssh

SSHD = Path("/usr/sbin/sshd")
REGISTRY = Path("/run/sky-test-hosts")
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")
PREFIX = "sky"  # namespaces sky<tag>-<i>, bridge skb<tag>, veths skv<tag>-<i>
MAX_HOSTS = 250  # .1 is the bridge, hosts are .2 ... .251


def available() -> str | None:
    """Why ``ssh_hosts`` cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    if not SSHD.exists():
        return f"needs {SSHD} (`make system-deps` installs openssh-server)"
    return None


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str  # on eth0 inside the namespace
    port: int
    sshd_pid: int
    veth: str  # the bridge-side end of the host's link (what ``down_link`` takes down)


@dataclass(frozen=True)
class Hosts:
    hosts: tuple[Host, ...]
    client_key: Path  # ed25519 private key (OpenSSH format); the .pub is next to it
    known_hosts: Path  # "[address]:port ssh-ed25519 ..." for every host
    bridge: str
    bridge_address: str  # the root namespace, as the hosts reach it
    subnet: str
    interface: str = "eth0"  # the hosts' interface (e.g. for GLOO_SOCKET_IFNAME)
    user: str = "root"
    hostnames: tuple[str, ...] = ()
    private: bool = False
    python: str = sys.executable  # visible at this path on every host
    _sshd: tuple[subprocess.Popen[bytes], ...] = field(default=(), repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    def asyncssh_options(self, i: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``asyncssh.connect``: strict host key checking against
        ``known_hosts``, only ``client_key`` (no agent, no ~/.ssh/config). With ``i``, also
        ``host`` and ``port`` of host i, so ``asyncssh.connect(**hosts.asyncssh_options(i))``.
        """
        options: dict[str, Any] = {
            "port": self.hosts[0].port if self.hosts else 22,
            "username": self.user,
            "client_keys": [str(self.client_key)],
            "known_hosts": str(self.known_hosts),
            "agent_path": None,
            "config": [],
        }
        if i is not None:
            options["host"] = self.hosts[i].address
            options["port"] = self.hosts[i].port
        return options

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """An OpenSSH client command line for host i (strict host keys, batch mode)."""
        h = self.hosts[i]
        return [
            "ssh", "-F", "/dev/null", "-i", str(self.client_key),
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-p", str(h.port), f"{self.user}@{h.address}", *command,
        ]  # fmt: skip

    def netns_argv(self, i: int, *command: str) -> list[str]:
        """``command`` run in host i's network namespace (no SSH), on this machine's files."""
        return ["ip", "netns", "exec", self.hosts[i].namespace, *command]

    def inside_argv(self, i: int, *command: str) -> list[str]:
        """``command`` run as root in all of host i's namespaces: its network, its hostname,
        its own filesystem view (what its sessions see).
        """
        pid = str(self.hosts[i].sshd_pid)
        return ["nsenter", "-t", pid, "-n", "-m", "-u", "--", *command]

    def pids(self, i: int) -> set[int]:
        """Live (non-zombie) processes in host i's network namespace."""
        return netns_pids(self.hosts[i].namespace)

    def kill_sshd(self, i: int, timeout: float = 10.0) -> set[int]:
        """SIGKILL host i's sshd and every process in its namespace (sessions, and what they
        started); returns once they are gone. Returns the pids killed.
        """
        killed = kill_namespace(self.hosts[i].namespace, timeout)
        with contextlib.suppress(IndexError):
            self._sshd[i].wait(timeout)  # reap our child
        return killed

    def down_link(self, i: int) -> None:
        """Take host i's link down on the bridge side: its packets are dropped silently (no RST),
        like a network partition. The processes in the namespace keep running.
        """
        _ip("link", "set", self.hosts[i].veth, "down")

    def up_link(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "up")


# -- processes in a namespace ------------------------------------------------------------------


def _netns_id(namespace: str) -> tuple[int, int] | None:
    try:
        st = os.stat(NETNS_RUN / namespace)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def netns_pids(namespace: str) -> set[int]:
    """Like ``ip netns pids``, without zombies (a zombie no longer holds its namespace)."""
    wanted = _netns_id(namespace)
    if wanted is None:
        return set()
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            st = os.stat(proc / "ns" / "net")
            if (st.st_dev, st.st_ino) != wanted:
                continue
            if _state(int(proc.name)) in ("Z", "X", None):
                continue
        except OSError:
            continue  # ended while we looked, or a zombie
        found.add(int(proc.name))
    return found


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in ("Z", "X", None)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_namespace(namespace: str, timeout: float = 10.0) -> set[int]:
    """SIGKILL every process in the namespace until none is left (a process may fork while we
    look, so kill again until the set stays empty). Raises at the deadline.
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := netns_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in netns {namespace} survive SIGKILL: {sorted(pids)}")
        time.sleep(0.01)
    return killed


# -- ip ------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


def _links() -> set[str]:
    names = set()
    for line in _ip("-o", "link", "show").splitlines():
        # "7: skvab12cd-0@if2: <...>"
        names.add(line.split(":", 2)[1].strip().split("@")[0])
    return names


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "blackhole", "unreachable"):
            words = words[1:]
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(words[0], strict=False))
    for record in _records():
        nets.append(ipaddress.ip_network(record["subnet"]))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.Random(os.getpid() ^ secrets.randbits(32))
    for _ in range(1000):
        candidate = ipaddress.IPv4Network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(n) for n in used):
            return candidate
    raise RuntimeError("no free 10.2xx.yy.0/24 for the test hosts")


# -- registry of runs (for cleanup after a killed run) -------------------------------------------


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _records() -> list[dict[str, Any]]:
    records = []
    for path in sorted(REGISTRY.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append({**json.loads(path.read_text()), "_path": str(path)})
    return records


def _teardown(record: dict[str, Any], timeout: float = 10.0) -> None:
    """Remove everything ``record`` names (any part may be missing); verify it is gone."""
    errors: list[str] = []
    namespaces: list[str] = record["namespaces"]
    for ns in namespaces:
        try:
            kill_namespace(ns, timeout)
        except RuntimeError as e:
            errors.append(str(e))
    existing = _namespaces()
    for ns in namespaces:
        if ns in existing:
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    ours = {*record["veths"], record["bridge"]}
    for link in sorted(ours & _links()):
        _ip("link", "del", link, check=False)  # a veth may go away with its namespace meanwhile
    deadline = time.monotonic() + timeout
    while True:
        left_ns = set(namespaces) & _namespaces()
        left_links = ours & _links()
        left_etc = [ns for ns in namespaces if (NETNS_ETC / ns).exists()]
        if not (left_ns or left_links or left_etc):
            break
        if time.monotonic() > deadline:
            errors.append(f"left after teardown: netns {left_ns}, links {left_links}, {left_etc}")
            break
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only if empty
    if errors:
        raise RuntimeError("; ".join(errors))
    Path(record["_path"]).unlink(missing_ok=True)


def reap_stale() -> list[str]:
    """Tear down what runs whose process is gone left behind; returns their tags."""
    reaped = []
    with _registry_lock():
        for record in _records():
            owner, started = record["pid"], record["start_time"]
            if _alive(owner) and _start_time(owner) == started:
                continue
            _teardown(record)
            reaped.append(record["tag"])
    return reaped


# -- keys and config -----------------------------------------------------------------------------


def _write_key(path: Path) -> str:
    """A new ed25519 key pair at path and path.pub; returns the public key line."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    path.write_bytes(key.export_private_key("openssh"))
    path.chmod(0o600)
    public = key.export_public_key("openssh").decode().strip()
    path.with_name(path.name + ".pub").write_text(public + "\n")
    return public


SSHD_CONFIG = """\
Port {port}
ListenAddress 0.0.0.0
AddressFamily inet
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
AllowTcpForwarding yes
X11Forwarding no
AcceptEnv LANG LC_*
MaxStartups 100:30:200
MaxSessions {max_sessions}
Subsystem sftp internal-sftp
"""


def _banner(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5) as s:
            s.settimeout(1.0)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# -- private hosts -------------------------------------------------------------------------------

USER = "skyuser"
HOST_VIEW = Path(__file__).with_name("host_view.py")
_PROJECT = Path(__file__).resolve().parents[1]


def ensure_user() -> str:
    """The unprivileged login of private hosts, made on this machine the first time (it stays:
    an account, not a process). Its password field is ``*``: no password, yet not locked, which
    sshd would refuse.
    """
    try:
        pwd.getpwnam(USER)
    except KeyError:
        with _registry_lock():
            if subprocess.run(["id", USER], capture_output=True).returncode != 0:
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", "--home-dir", f"/home/{USER}",
                     "--shell", "/bin/bash", "--password", "*", USER],
                    check=True, capture_output=True,
                )  # fmt: skip
    return USER


def _hidden_paths(tmp: Path) -> list[str]:
    """What a private host must not see: this machine's /tmp (the test's files and notebooks),
    the notebook's home, and the project's checkout (the notebook's directory).
    """
    return sorted({"/tmp", "/root", str(Path.home()), str(_PROJECT), str(tmp.resolve())} - {"/"})


def _python_paths() -> list[str]:
    """The paths the ranks' Python needs: the venv and the interpreter it was made from."""
    paths = {str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())}
    return sorted(paths)


# -- the context manager -------------------------------------------------------------------------


@contextlib.contextmanager
def ssh_hosts(
    n: int,
    tmp: Path,
    port: int = 2222,
    timeout: float = 15.0,
    *,
    private: bool = True,
    max_sessions: int | Sequence[int] = 10,
    home_size: str | None = None,
    shm_size: str | None = None,
) -> Iterator[Hosts]:
    """n SSH hosts, each in its own network namespace; torn down (and checked) on exit."""
    sessions = [max_sessions] * n if isinstance(max_sessions, int) else list(max_sessions)
    if len(sessions) != n:
        raise ValueError("max_sessions: one value, or one per host")
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"1 <= n <= {MAX_HOSTS}")
    if (why := available()) is not None:
        raise RuntimeError(f"ssh_hosts {why}")
    reap_stale()
    tag = secrets.token_hex(3)
    namespaces = [f"{PREFIX}{tag}-{i}" for i in range(n)]
    veths = [f"skv{tag}-{i}" for i in range(n)]
    bridge = f"skb{tag}"
    with _registry_lock():
        subnet = _pick_subnet()
        record: dict[str, Any] = {
            "tag": tag,
            "pid": os.getpid(),
            "start_time": _start_time(os.getpid()),
            "namespaces": namespaces,
            "veths": veths,
            "bridge": bridge,
            "subnet": str(subnet),
        }
        path = REGISTRY / f"{tag}.json"
        path.write_text(json.dumps(record))
        record["_path"] = str(path)
    gateway = str(subnet.network_address + 1)
    addresses = [str(subnet.network_address + 2 + i) for i in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        work = tmp / f"ssh-hosts-{tag}"
        work.mkdir(parents=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir

        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hostnames = [f"{ns}-host" if private else socket.gethostname() for ns in namespaces]
        for ns, veth, address, hostname in zip(
            namespaces, veths, addresses, hostnames, strict=True
        ):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # The machine's hostname is this host's own address (gloo binds to what the hostname
            # resolves to); every address, also in its IPv4-mapped form (how a dual-stack listener
            # such as torch's TCPStore sees a peer), resolves back to a name, or c10d warns.
            if private:  # Debian's default, and nothing about the other hosts
                lines = ["127.0.0.1 localhost", f"127.0.1.1 {hostname}"]
            else:
                lines = ["127.0.0.1 localhost", f"{address} {hostname} {ns}"]
                lines += [f"{a} {o}" for o, a in zip(namespaces, addresses, strict=True) if o != ns]
                lines += [f"{gateway} {bridge}"]
                lines += [f"::ffff:{a} {o}" for o, a in zip(namespaces, addresses, strict=True)]
                lines += [f"::ffff:{gateway} {bridge}"]
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

        user = ensure_user() if private else "root"
        client_key = work / "client_ed25519"
        authorized = work / "authorized_keys"  # one file, linked into each host's directory
        authorized.write_text(_write_key(client_key) + "\n")
        authorized.chmod(0o644)
        known = []
        for i, address in enumerate(addresses):
            # A private host reads its sshd files from its own copy (tests/host_view.py).
            files = work / f"sshd{i}"
            files.mkdir()
            seen = Path("/mnt/sshd") if private else files
            public = _write_key(files / "host_ed25519").split()
            name = address if port == 22 else f"[{address}]:{port}"
            known.append(f"{name} {public[0]} {public[1]}")
            os.link(authorized, files / "authorized_keys")
            (files / "sshd.conf").write_text(
                SSHD_CONFIG.format(
                    port=port,
                    host_key=seen / "host_ed25519",
                    authorized_keys=seen / "authorized_keys",
                    max_sessions=sessions[i],
                )
            )
        known_hosts = work / "known_hosts"
        known_hosts.write_text("\n".join(known) + "\n")

        for i, ns in enumerate(namespaces):
            log = work / f"sshd{i}.log"
            logs.append(log)
            files = work / f"sshd{i}"
            if private:
                view = {
                    "hostname": hostnames[i],
                    "sshd_files": str(files),
                    "user": user,
                    "hide": _hidden_paths(tmp),
                    "keep": _python_paths(),
                    "home_size": home_size,  # a small one: a disk that fills up
                    "shm_size": shm_size,
                }
                argv = ["unshare", "--uts", sys.executable, str(HOST_VIEW), json.dumps(view)]
            else:
                argv = [str(SSHD), "-D", "-e", "-f", str(files / "sshd.conf")]
            with open(log, "wb") as out:
                # `ip netns exec`, `unshare` and host_view.py exec in place: the pid is sshd's.
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *argv],
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip
        for proc, address, log in zip(procs, addresses, logs, strict=True):

            def ready(
                proc: subprocess.Popen[bytes] = proc, address: str = address, log: Path = log
            ) -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"sshd for {address} exited {proc.returncode}: {log.read_text()[-2000:]}"
                    )
                return _banner(address, port)

            _wait(ready, timeout, f"the SSH banner of {address}:{port}")

        yield Hosts(
            hosts=tuple(
                Host(i, ns, address, port, proc.pid, veth)
                for i, (ns, address, proc, veth) in enumerate(
                    zip(namespaces, addresses, procs, veths, strict=True)
                )
            ),
            client_key=client_key,
            known_hosts=known_hosts,
            bridge=bridge,
            bridge_address=gateway,
            subnet=str(subnet),
            interface="eth0",
            user=user,
            hostnames=tuple(hostnames),
            private=private,
            _sshd=tuple(procs),
        )
    finally:
        try:
            _teardown(record, timeout)
        finally:
            for proc in procs:  # killed by _teardown with the rest of its namespace; reap it
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout)


def ssh_provider(
    hosts: Hosts, count: int, tmp: Path, which: tuple[int, ...] = (), **changes: object
) -> ssh.SSHProvider:
    """An SSH provider on the first ``count`` hosts (or those in ``which``: a test that killed
    host 1 leaves it dead for the rest of the module).
    """
    options = ssh.SSHOptions(
        identity=str(hosts.client_key),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
        connect_timeout=5,
        cache_dir=str(tmp / "cache"),
    )
    return ssh.SSHProvider(
        [ssh.Host(hosts[i].address, hosts.user, hosts[i].port) for i in which or range(count)],
        dataclasses.replace(options, **changes),  # type: ignore[arg-type]
    )
