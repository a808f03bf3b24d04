"""Machines the user already has, over SSH: one connection per host, one channel per rank.

This is also the path the cloud providers take once their instances are up. What it does:

- connects with host keys verified against ``known_hosts`` (accepting an unknown key is an
  explicit option), with errors that name the host and say what to do;
- checks the host's Python, torch and cloudpickle against the notebook's, and ships this
  package there once per content hash (both in :mod:`.ssh_prepare`);
- starts each rank as ``python -m skyward_jupyter.agent --env-from-stdin``: its environment (which
  may hold tokens) travels over the encrypted channel, not on a command line other users can read.

Remote commands are argument lists quoted with :func:`shlex.join`, never shell text built from
user input. A root login's channel cannot be signalled through sshd, so each rank first prints
its pid, and ending it is a command over the connection that ends the rank with every process it
started (``agent/descendants.py``: a cell's detached children too) and removes its private
directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import shlex
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh

from ..environments import (
    BUILDER,
    TORCH_WANTED,
    NodeEnvironment,
    Packages,
    PackagesError,
    follow,
    notebook_torch,
    notebook_uv,
    torch_choices,
    uv_tarball,
    wheels_tarball,
)
from ..events import RankState
from ..gpus import NO_GPU, gpu_model, same_gpu
from .base import (
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
from .ssh_bundles import Bundle, Receiver, pass_bundle
from .ssh_clean import clean_host
from .ssh_keys import changed_key, known_hosts_file, record_if_new
from .ssh_prepare import check_versions, probe, ship, unpack
from .ssh_template import HostTemplate

if TYPE_CHECKING:
    from ..spec import PoolSpec

Connect = Callable[["Host"], Awaitable[asyncssh.SSHClientConnection]]


@dataclass(frozen=True, slots=True)
class Host:
    """``user@host:port`` as the user wrote it."""

    host: str
    user: str | None = None
    port: int = 22

    @classmethod
    def parse(cls, text: str) -> Host:
        user, _, rest = text.rpartition("@")
        host, port = rest, 22
        if rest.count(":") == 1:
            host, _, port_text = rest.partition(":")
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ValueError(f"bad port in {text!r}: expected user@host[:port]")
            port = int(port_text)
        if not host:
            raise ValueError(f"no host in {text!r}: expected user@host[:port]")
        return cls(host, user or None, port)

    def __str__(self) -> str:
        who = f"{self.user}@" if self.user else ""
        return f"{who}{self.host}" + (f":{self.port}" if self.port != 22 else "")


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise ValueError("expected user@host[:port],...")
    seen: dict[tuple[str, int], str] = {}
    for text in hosts:
        host = Host.parse(text)
        where = (host.host.lower(), host.port)
        if where in seen:
            # Two nodes on one machine would each take its first GPU, and its ports.
            raise ValueError(
                f"{seen[where]} and {text} are the same host: one node per host "
                "(--procs-per-node N runs N ranks on each)"
            )
        seen[where] = text
    return hosts


@dataclass(frozen=True, slots=True)
class SSHOptions(ProviderOptions):
    hosts: tuple[str, ...] = option(
        "machines to use over SSH, one node each (implies --provider ssh)",
        default=(),
        type=_hosts,
        metavar="USER@HOST[:PORT],...",
    )
    identity: str | None = option("SSH private key file", metavar="KEY")
    known_hosts: str | None = option("known_hosts file for host keys", metavar="FILE")
    accept_new_host_keys: bool = option(
        "record an unknown host's key in known_hosts and trust it (OpenSSH's accept-new; "
        "a changed key is still refused)",
        default=False,
        action="store_true",
    )
    python: str = PYTHON.field(default="python3")
    head_addr: str | None = option("the head's address as the other hosts reach it", metavar="ADDR")
    connect_timeout: float = 15.0
    keepalive_interval: float = 5.0
    cache_dir: str = ".cache/skyward_jupyter"
    """Where the package goes on the hosts, relative to the login's home unless absolute."""
    gpu: str | None = None
    """``--gpu``: the model every host must report (compared by model), checked on connect."""


OPENSSH_IDENTITIES = (
    "id_ed25519_sk",
    "id_ecdsa_sk",
    "id_ed448",
    "id_ed25519",
    "id_ecdsa",
    "id_rsa",
    "id_dsa",
)
"""The private keys in ``~/.ssh`` that OpenSSH (and asyncssh) try without ``--identity``."""


def _unloadable_key(host: Host, identity: str | None, exc: Exception) -> ProviderError:
    """A private key that cannot be loaded, named with what to do (asyncssh's error names no
    file, and without ``--identity`` the user may not know which of the defaults it read).
    """
    if identity:
        return ProviderError(
            f"{host}: cannot load the SSH key {identity} given by --identity ({exc}); "
            "check that it is a private key, or pass another"
        )
    for name in OPENSSH_IDENTITIES:
        path = Path("~", ".ssh", name).expanduser()
        try:
            asyncssh.load_keypairs(path, ignore_encrypted=True)
        except OSError:
            continue  # absent or unreadable: asyncssh skips it too
        except asyncssh.KeyImportError as bad:
            return ProviderError(
                f"{host}: cannot load the SSH key {path} ({bad}); fix or remove that file, or "
                "pass --identity KEY to use another key"
            )
    return ProviderError(f"{host}: cannot load an SSH key ({exc}); pass --identity KEY")


def check_host_gpu(host: Host, reported: str | None, asked: str | None) -> None:
    """``--gpu``: the host reports that model (``nvidia-smi``'s name, compared by model)."""
    if not asked:
        return
    if not reported:
        raise ProviderError(
            f"--gpu {asked}: {host} reports no GPU (no nvidia-smi, or it lists none); leave out "
            "--gpu for CPU ranks, or drop that host"
        )
    if not same_gpu(asked, reported):
        raise ProviderError(
            f"--gpu {asked}: {host} has {reported}; pass --gpu {gpu_model(reported)}, or leave "
            "out --gpu"
        )


class SSHRank:
    """One rank on a host: an SSH channel running the agent."""

    def __init__(
        self, host: Host, sessions: Sessions, process: Any, pid: int, ender: Sequence[str]
    ) -> None:
        self._host = host
        self._sessions = sessions
        self._process = process
        self.pid = pid
        self._ender = ender
        """The command that ends the rank with everything below it, and its private directory
        (``agent/descendants.py PID RUN_ID``)."""
        self.reader = process.stdout
        self.writer = process.stdin
        self._stderr = StderrTail()
        self._stderr.follow(process.stderr, ends=(asyncssh.Error, OSError))

    def describe(self) -> str:
        return f"{self._host} pid {self.pid}"

    def diagnostics(self) -> str:
        return self._stderr.text()

    async def running(self, pid: int, within: float) -> str | None:
        """Two looks at the process's ``/proc`` entry on its host, ``within`` seconds apart."""
        return await self._sessions.looks.running(pid, within)

    async def kill(self) -> None:
        # An unreachable host cannot be asked: closing the channel is then all that is left.
        with contextlib.suppress(asyncssh.Error, OSError, asyncio.TimeoutError, ProviderError):
            await asyncio.wait_for(self._sessions.run(self._ender), 5)
        self._process.close()

    async def wait(self) -> str:
        try:
            await asyncio.wait_for(self._process.wait_closed(), 10)
        except (asyncssh.Error, OSError, asyncio.TimeoutError):
            return f"lost: the connection to {self._host} dropped"
        if self._process.exit_signal:
            return f"killed by SIG{self._process.exit_signal[0]} on {self._host}"
        if self._process.exit_status is None:
            return f"lost: the connection to {self._host} dropped"
        return f"exited with status {self._process.exit_status} on {self._host}"


class Sessions:
    """A host's SSH connections: as many as its sshd's ``MaxSessions`` makes necessary.

    OpenSSH allows 10 sessions per connection by default, and some hosts fewer; a node with
    more ranks (one session each) than that, plus the commands that manage them, would fail
    with "Session request failed". A refused session opens another connection instead.
    """

    def __init__(self, host: Host, first: asyncssh.SSHClientConnection, connect: Connect) -> None:
        self.host = host
        self.conns = [first]
        self._connect = connect
        self._connecting = asyncio.Lock()
        """Held while a new connection is opened: callers that find every connection full wait
        for it rather than each opening one (sshd's MaxStartups refuses a burst)."""
        self.looks = Looks(
            lambda argv, timeout: asyncio.wait_for(self.output(argv), timeout), (asyncssh.Error,)
        )
        """How the host's silent ranks run: one session for those silent at once."""

    async def process(self, command: str) -> Any:
        """A new session running ``command`` (bytes in, bytes out)."""
        tried = list(self.conns)
        for conn in tried:
            try:
                return await conn.create_process(command, encoding=None)
            except asyncssh.ChannelOpenError:
                continue  # this connection has all the sessions its sshd allows
        async with self._connecting:
            for conn in self.conns[len(tried) :]:  # opened by another caller meanwhile
                with contextlib.suppress(asyncssh.ChannelOpenError):
                    return await conn.create_process(command, encoding=None)
            conn = await self._connect(self.host)
            self.conns.append(conn)
        try:
            return await conn.create_process(command, encoding=None)
        except asyncssh.ChannelOpenError as exc:
            raise ProviderError(
                f"{self.host}: sshd refuses a session even on a new connection ({exc.reason}); "
                "check its MaxSessions and MaxStartups"
            ) from None

    async def output(self, argv: Sequence[str]) -> bytes:
        """Run a command (an argument list) to its end; what it wrote to its stdout."""
        process = await self.process(shlex.join(argv))
        try:
            process.stdin.write_eof()
            said = await process.stdout.read()
            await process.wait_closed()
        finally:
            process.close()  # also when the caller gave up waiting
        return bytes(said)

    async def run(self, argv: Sequence[str]) -> int | None:
        """Run a command (an argument list) to its end; its exit status."""
        process = await self.process(shlex.join(argv))
        process.stdin.write_eof()
        await process.wait_closed()
        return process.exit_status  # type: ignore[no-any-return]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(*(c.wait_closed() for c in self.conns), return_exceptions=True)


def _own(spec: PoolSpec) -> SSHOptions:
    assert isinstance(spec.options, SSHOptions), spec.options
    return spec.options


class SSHProvider(Provider):
    name = "ssh"
    installs_packages = True
    Options = SSHOptions
    examples = (("--hosts me@gpu1,me@gpu2", "one rank per GPU on two machines over SSH"),)

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> SSHProvider:
        options = _own(spec)
        if not options.hosts:
            raise ProviderError("--provider ssh needs --hosts user@host[:port],...")
        try:
            hosts = [Host.parse(h) for h in options.hosts]
        except ValueError as exc:
            raise ProviderError(f"--hosts: {exc}") from None
        return cls(hosts, replace(options, gpu=None if spec.gpu == NO_GPU else spec.gpu))

    @classmethod
    def check(cls, spec: PoolSpec) -> None:
        """The key and known_hosts files named must be readable here (the hosts themselves are
        reached only when the pool starts: a name may be an alias of the SSH configuration).
        """
        options = _own(spec)
        files = (("--identity", options.identity), ("--known-hosts", options.known_hosts))
        for flag, path in files:
            if path is None or (flag == "--known-hosts" and options.accept_new_host_keys):
                continue  # accepting new keys writes the file, which may not exist yet
            try:
                with Path(path).expanduser().open("rb") as file:
                    mode = os.fstat(file.fileno()).st_mode
            except OSError as exc:
                raise ProviderError(
                    f"{flag} {path}: cannot read it ({exc.strerror}); name a file this user "
                    "can read"
                ) from None
            if flag == "--identity" and mode & 0o077:
                # As ssh refuses it ("UNPROTECTED PRIVATE KEY FILE"): others may have read it.
                raise ProviderError(
                    f"--identity {path}: other users can read this private key (mode "
                    f"{stat.S_IMODE(mode):04o}); make it yours alone: chmod 600 {path}"
                )

    @classmethod
    def settle(cls, spec: PoolSpec) -> PoolSpec:
        """One node per host."""
        hosts = _own(spec).hosts
        return replace(spec, nodes=len(hosts)) if hosts else spec

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        return f"ssh to {', '.join(_own(spec).hosts)}"

    @classmethod
    def same_machines(cls, old: ProviderOptions, new: ProviderOptions) -> bool:
        """Some host of ``old`` is one of ``new``'s."""
        assert isinstance(old, SSHOptions) and isinstance(new, SSHOptions)
        return bool(set(old.hosts) & set(new.hosts))

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        return {
            "hosts": [
                {"node": i, "host": str(host), "pids": list(pids.get(i, ()))}
                for i, host in enumerate(self.hosts)
            ]
        }

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        """Nothing to do from here: the ranks ended when their SSH channel closed, which the
        kernel's end did (and their heartbeat watchdog backs that up).
        """
        hosts = ", ".join(str(h.get("host")) for h in record.get("hosts") or ())
        return ReapReport(
            notes=[
                f"the ranks on {hosts or 'the SSH hosts'} end when their SSH channel closes, "
                "which the kernel's end did"
            ]
        )

    def __init__(self, hosts: Sequence[Host], options: SSHOptions | None = None) -> None:
        super().__init__()
        if not hosts:
            raise ProviderError("--hosts needs at least one user@host")
        self.hosts = tuple(hosts)
        self.options = options or SSHOptions()
        self.shipped: list[str] = []
        self._sessions: list[Sessions] = []
        self._remote_package: list[str] = []
        self._python: list[str] = []
        self._torch: list[str | None] = []
        """Each host's torch version (None: it has none)."""
        self._templates: list[HostTemplate | None] = []
        self._progress: Progress = no_progress

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        if nodes != len(self.hosts):
            given = len(self.hosts)
            raise ProviderError(
                f"{given} host{'s' * (given != 1)} given for {nodes} node{'s' * (nodes != 1)}"
            )
        self._progress = progress  # a template lost later is said through it
        for index, host in enumerate(self.hosts):
            progress(f"connecting to {host}", index, RankState.CONNECTING)
        results = await asyncio.gather(
            *(self._prepare(h) for h in self.hosts), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for result in results:
                if not isinstance(result, BaseException):
                    result[0].close()
            raise failures[0]
        out = []
        for index, (host, result) in enumerate(zip(self.hosts, results, strict=True)):
            assert not isinstance(result, BaseException)
            conn, found, package_dir = result
            self._sessions.append(Sessions(host, conn, self._connect))
            self._remote_package.append(package_dir)
            self._python.append(str(found["executable"]))
            self._torch.append(found.get("torch"))
            address = self.options.head_addr if index == 0 and self.options.head_addr else host.host
            gpus = tuple(str(i) for i in range(int(found.get("gpus") or 0)))
            out.append(Node(index, address, gpus, found.get("gpu_model")))
        for index, host in enumerate(self.hosts):
            progress(
                f"warming a template on {host} (torch imported once)", index, RankState.BOOTING
            )
        started = await asyncio.gather(
            *(
                HostTemplate.start(s, python, package, self.notebook_silence)
                if torch is not None
                else _no_template()  # its torch comes with its packages
                for s, python, package, torch in zip(
                    self._sessions, self._python, self._remote_package, self._torch, strict=True
                )
            )
        )
        self._templates = [template for template, _ in started]
        self.warnings.extend(why for _, why in started if why)
        return out

    async def _connect(self, host: Host) -> asyncssh.SSHClientConnection:
        o = self.options
        known_hosts: Any = o.known_hosts if o.known_hosts else ()
        # --accept-new-host-keys is OpenSSH's accept-new: an unknown host's key is recorded in
        # the file first, and the connection checks strictly against that file either way.
        recording = known_hosts_file(o.known_hosts) if o.accept_new_host_keys else None
        try:
            if recording is not None:
                await record_if_new(recording, host, o.connect_timeout)
                known_hosts = str(recording)
            return await asyncio.wait_for(
                asyncssh.connect(
                    host.host,
                    port=host.port,
                    username=host.user or (),  # (): the local user, as ssh does
                    client_keys=[o.identity] if o.identity else (),
                    known_hosts=known_hosts,
                    keepalive_interval=o.keepalive_interval,
                    keepalive_count_max=3,
                ),
                o.connect_timeout,
            )
        except asyncssh.HostKeyNotVerifiable as exc:
            if recording is not None and (
                changed := await changed_key(recording, host, o.connect_timeout)
            ):
                raise changed from None
            raise ProviderError(
                f"{host}: its host key is not trusted ({exc.reason}); add it to your "
                "known_hosts (ssh-keyscan), pass --known-hosts FILE, or, if you trust this "
                "network, --accept-new-host-keys"
            ) from None
        except asyncssh.PermissionDenied:
            raise ProviderError(
                f"{host}: authentication failed for user {host.user or '(default)'}; "
                "check the user and pass --identity KEY"
            ) from None
        except asyncssh.KeyImportError as exc:
            raise _unloadable_key(host, o.identity, exc) from None
        except ConnectionRefusedError:
            raise ProviderError(
                f"{host}: connection refused on port {host.port}; is sshd running there?"
            ) from None
        except socket.gaierror as exc:
            raise ProviderError(
                f"{host}: the host name {host.host} does not resolve ({exc.strerror}); check its "
                "spelling, or give the host's IP address"
            ) from None
        except asyncio.TimeoutError:
            raise ProviderError(
                f"{host}: unreachable within {o.connect_timeout:.0f} s; check the address, "
                "the network, or a firewall"
            ) from None
        except OSError as exc:
            raise ProviderError(
                f"{host}: unreachable ({exc.strerror or exc}); check the address, the network, "
                "or a firewall"
            ) from None
        except asyncssh.Error as exc:
            raise ProviderError(f"{host}: SSH failed: {exc}") from None

    async def _prepare(
        self, host: Host
    ) -> tuple[asyncssh.SSHClientConnection, dict[str, Any], str]:
        conn = await self._connect(host)
        try:
            found = await probe(host, conn, self.options.python)
            self.warnings.extend(check_versions(host, found, brings_torch=bool(self.packages)))
            check_host_gpu(host, found.get("gpu_model"), self.options.gpu)
            package_dir = await self._ship(host, conn, str(found["home"]))
        except BaseException:
            conn.close()
            raise
        return conn, found, package_dir

    async def _ship(self, host: Host, conn: asyncssh.SSHClientConnection, home: str) -> str:
        """The package's directory on the host, shipped there when it was missing."""
        target, shipped = await ship(host, conn, self.options.cache_dir, home)
        if shipped:
            self.shipped.append(str(host))
        return target

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> SSHRank:
        sessions = self._sessions[node.index]
        host = self.hosts[node.index]
        package = self._remote_package[node.index]
        python = self._python[node.index]
        ender = [python, "-I", "-S", f"{package}/skyward_jupyter/agent/descendants.py"]
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        template = self._templates[node.index] if self._templates else None
        line = json.dumps({**env, "PYTHONUNBUFFERED": "1"}).encode() + b"\n"
        if template is not None and template.serves(env):
            rank = await self._from_template(host, sessions, template, line, ender, run_id)
            if rank is not None:
                return rank
            template.close()
            self._templates[node.index] = None
            self._progress(f"the warm template on {host} is gone; its ranks now start directly")
        agent = shlex.join(
            [
                "env",
                f"PYTHONPATH={package}",
                python,
                "-m",
                "skyward_jupyter.agent",
                "--env-from-stdin",
            ]
        )
        try:
            process = await sessions.process(f"echo $$; exec {agent}")
        except (asyncssh.Error, OSError) as exc:
            raise ProviderError(f"{host}: cannot start a rank: {exc}") from None
        pid = await _pid(host, process)
        if pid is None:
            raise ProviderError(f"{host}: the rank did not start (its shell ended at once)")
        process.stdin.write(line)
        return SSHRank(host, sessions, process, pid, [*ender, str(pid), run_id])

    @staticmethod
    async def _from_template(
        host: Host,
        sessions: Sessions,
        template: HostTemplate,
        line: bytes,
        ender: Sequence[str],
        run_id: str,
    ) -> SSHRank | None:
        """A rank forked by the host's template; None when the template is gone (killed)."""
        if not template.alive:
            return None
        # The spawner reads the environment first; the forked rank then prints its pid.
        try:
            process = await sessions.process(template.command())
        except (asyncssh.Error, OSError) as exc:
            raise ProviderError(f"{host}: cannot start a rank: {exc}") from None
        process.stdin.write(line)
        pid = await _pid(host, process)  # none: the spawner found no template to hand it to
        return (
            None
            if pid is None
            else SSHRank(host, sessions, process, pid, [*ender, str(pid), run_id])
        )

    async def build_environments(
        self, nodes: Sequence[Node], packages: Packages, progress: Progress
    ) -> dict[int, NodeEnvironment]:
        """Every host builds (or finds cached) the environment, all at once; the first host
        that fails fails the start, naming itself and the installer's reason. What is sent
        (the wheels of ``--ship-wheels``, uv for hosts without it) goes to each host once.
        """
        receivers = {
            node.index: Receiver(
                node,
                str(self.hosts[node.index]),
                self._sessions[node.index].process,
                self._sessions[node.index].run,
                partial(self._unpack, node.index),
                self._node_python(node.index),
                posixpath.dirname(self._remote_package[node.index]),
            )
            for node in nodes
        }
        wheels: dict[int, str] = {}
        """Per node: its folder of the wheels sent from here (``--ship-wheels``)."""
        if packages.wheels:
            for node in nodes:
                progress("packages: downloading wheels to send", node.index, RankState.BOOTING)
            builds = await asyncio.gather(*(self._torch_to_send(n, packages) for n in nodes))
            for build in dict.fromkeys(builds):  # a folder per torch the nodes will install
                folder = await asyncio.to_thread(packages.download, build)
                bundle = Bundle("wheels", f"wheels/{folder.name}", partial(wheels_tarball, folder))
                group = [n for n, b in zip(nodes, builds, strict=True) if b == build]
                await pass_bundle(bundle, [receivers[n.index] for n in group], progress)
                wheels.update((n.index, receivers[n.index].target(bundle)) for n in group)
        uv = await asyncio.to_thread(notebook_uv)
        uv_folder: str | None = None
        if uv is not None:
            name, tarball = await asyncio.to_thread(uv_tarball, uv)
            uv_folder = f"uv/{name}"
            bundle = Bundle("uv binary", uv_folder, lambda: tarball)
            await pass_bundle(bundle, list(receivers.values()), progress)

        async def one(node: Node) -> NodeEnvironment:
            host = self.hosts[node.index]
            cache = posixpath.dirname(self._remote_package[node.index])
            command = shlex.join([*self._node_python(node.index), *BUILDER])
            try:
                process = await self._sessions[node.index].process(command)
            except (asyncssh.Error, OSError) as exc:
                raise PackagesError(f"{host}: cannot start the package installer: {exc}") from None
            process.stdin.write(
                packages.request(
                    wheels.get(node.index), f"{cache}/{uv_folder}/uv" if uv_folder else None
                )
            )
            process.stdin.write_eof()

            async def lines() -> AsyncIterator[str]:
                async for raw in process.stdout:
                    yield raw.decode(errors="replace")

            def say(text: str) -> None:
                progress(text, node.index, RankState.BOOTING)

            try:
                built = await follow(lines(), packages.digest, str(host), say)
            except PackagesError as exc:
                said = (await process.stderr.read()).decode(errors="replace").strip()
                raise PackagesError(
                    f"{exc}: {said.splitlines()[-1]}" if said else str(exc)
                ) from None
            finally:
                process.close()
            say(f"packages ready: {built.describe()}")
            if built.own_torch and self._templates and (template := self._templates[node.index]):
                # The template imported the host's torch; the environment brings another.
                template.close()
                self._templates[node.index] = None
            return built

        built = await asyncio.gather(*(one(node) for node in nodes))
        found = {node.index: env for node, env in zip(nodes, built, strict=True)}
        if said := torch_choices({str(self.hosts[i]): env for i, env in found.items()}):
            self.warnings.append(said)
        return found

    async def _torch_to_send(self, node: Node, packages: Packages) -> str | None:
        """The torch (``2.13.0+cu126``) whose wheel goes to ``node`` with the others: what its
        build step will install (its host has none, or ``--mirror`` wants the notebook's in the
        build its driver takes), asked of the host, which decides as its build will; None where
        it keeps its own.
        """
        notebook = notebook_torch()
        if notebook is None or (self._torch[node.index] is not None and not packages.variant):
            return None
        host = self.hosts[node.index]
        argv = [*self._node_python(node.index), *TORCH_WANTED]
        asked = json.dumps({"torch": notebook, "variant": packages.variant})
        try:
            result = (
                await self._sessions[node.index]
                .conns[0]
                .run(shlex.join(argv), input=asked + "\n", check=False)
            )
        except (asyncssh.Error, OSError) as exc:
            raise PackagesError(f"{host}: cannot ask which torch it takes: {exc}") from None
        lines = str(result.stdout).strip().splitlines()
        try:
            said = json.loads(lines[-1])
            if "error" in said:
                raise PackagesError(f"{host}: {said['error']}")
            return str(said["wanted"]) if said["wanted"] else None
        except (ValueError, IndexError, KeyError, TypeError):
            why = str(result.stderr).strip().splitlines()[-1:] or [f"exit {result.exit_status}"]
            raise PackagesError(f"{host}: cannot tell which torch it takes: {why[0]}") from None

    async def _unpack(self, index: int, target: str, tarball: bytes) -> None:
        await unpack(self.hosts[index], self._sessions[index].conns[0], target, tarball)

    def _node_python(self, index: int) -> list[str]:
        """The host's Python with this package on its path: how the tools run there."""
        return ["env", f"PYTHONPATH={self._remote_package[index]}", self._python[index]]

    async def clean(self) -> list[str]:
        """``%sky clean``: on every host, remove the package's cache and the sync copies that
        no running pool uses; one line per host saying what went and how much.
        """
        return list(
            await asyncio.gather(
                *(
                    clean_host(h, self._connect, self.options.python, self.options.cache_dir)
                    for h in self.hosts
                )
            )
        )

    async def release(self) -> None:
        for template in self._templates:
            if template is not None:
                template.close()
        self._templates.clear()
        for sessions in self._sessions:
            sessions.close()
        await asyncio.gather(*(s.wait_closed() for s in self._sessions))
        self._sessions.clear()


async def _no_template() -> tuple[None, None]:
    return None, None


async def _pid(host: Host, process: Any) -> int | None:
    """The rank's first line: its pid, which ending it needs (the command that ends its tree
    and removes its private directory, run over the connection); None when the channel closed
    before a word (the channel is then closed).
    """
    try:
        first = await asyncio.wait_for(process.stdout.readline(), 30)
        if not first:
            process.close()
            return None
        return int(first.strip())
    except (ValueError, asyncio.TimeoutError, asyncssh.Error) as exc:
        process.close()
        raise ProviderError(f"{host}: the rank did not start ({exc!r})") from None
