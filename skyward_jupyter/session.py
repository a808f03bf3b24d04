"""The kernel's pools: which one a cell runs on, keeping them warm, replacing and ending them.

One session per IPython shell. A cell without pool options runs on the current pool (started
with the configured defaults the first time); a cell whose options describe a different pool
replaces the pool of that name, and says so. Pools end with ``%sky down``, with the kernel, or
when the extension is unloaded. The display (``views``) and the watchers (the lab panel's
registry) are told of every pool's creation, start and end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .capture import Shipment, Shipper
from .display.output import CellOutput, StdoutMode
from .pool import Pool
from .providers.base import Provider
from .results import CellError, CellInterrupted, RunResult

KNOWN_GPUS = ("T4", "A10G", "L4", "L40S", "V100", "A100", "H100")
PROVIDERS = ("local", "ssh", "aws")
Announce = Callable[[str], None]


class SessionError(Exception):
    """Bad input or a state the user must change; shown as one line, nothing else changes."""


class CellView(Protocol):
    def flush(self) -> None:
        """Kernel thread, while the cell waits (about 20 times a second)."""

    def finish(self) -> None:
        """Kernel thread, once the cell ended (also when it failed)."""


class Views(Protocol):
    """The display layer's part in a pool's life (``display/views.py``); no widgets here."""

    def pool_created(self, entry: PoolEntry) -> None:
        """The pool exists and is about to start."""

    def pool_started(self, entry: PoolEntry) -> None: ...

    def pool_ended(self, entry: PoolEntry) -> None: ...

    def cell(self, entry: PoolEntry) -> CellView:
        """A cell is about to run on the pool."""
        ...

    def show(self, name: str | None, current: str | None) -> None:
        """Show a pool's panel (``%sky panel``); LookupError when there is no such pool."""

    def metrics(self, name: str | None, current: str | None) -> Any:
        """A pool's metrics as rows (``%sky metrics``); LookupError when there is no such pool."""


class PoolWatcher(Protocol):
    """Another view of a pool's life beside the display (the lab panel's registry)."""

    def pool_created(self, entry: PoolEntry) -> None: ...

    def pool_started(self, entry: PoolEntry) -> None: ...

    def pool_ended(self, entry: PoolEntry) -> None: ...


class _NoCellView:
    def flush(self) -> None:
        pass

    def finish(self) -> None:
        pass


class NoViews:
    def pool_created(self, entry: PoolEntry) -> None:
        pass

    def pool_started(self, entry: PoolEntry) -> None:
        pass

    def pool_ended(self, entry: PoolEntry) -> None:
        pass

    def cell(self, entry: PoolEntry) -> CellView:
        return _NoCellView()

    def show(self, name: str | None, current: str | None) -> None:
        raise LookupError("this session has no panel")

    def metrics(self, name: str | None, current: str | None) -> Any:
        raise LookupError("this session keeps no metrics")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a pool is: two cells asking for equal specs share a pool."""

    provider: str = "local"
    nodes: int = 1
    procs_per_node: int | None = None
    gpu: str | None = None
    backend: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    hosts: tuple[str, ...] = ()
    """SSH hosts (``user@host[:port]``); given, they decide the provider and the node count."""
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_keys: bool | None = None
    python: str | None = None
    head_addr: str | None = None

    def __post_init__(self) -> None:
        if self.hosts:
            object.__setattr__(self, "provider", "ssh")
            object.__setattr__(self, "nodes", len(self.hosts))

    def describe(self) -> str:
        ranks = f"{self.procs_per_node} ranks" if self.procs_per_node else "1 rank per GPU or CPU"
        gpu = f", {self.gpu}" if self.gpu else ""
        where = f"ssh to {', '.join(self.hosts)}" if self.hosts else self.provider
        return f"{self.nodes} node{'s' * (self.nodes != 1)} x {ranks}, {where}{gpu}"


def check_gpu_name(name: str) -> str:
    match = next((g for g in KNOWN_GPUS if g.lower() == name.lower()), None)
    if match is None:
        raise SessionError(f"unknown GPU {name!r}; known: {', '.join(KNOWN_GPUS)}")
    return match


def make_provider(spec: PoolSpec) -> Provider:
    if spec.provider == "ssh":
        return _ssh_provider(spec)
    if spec.provider != "local":
        raise SessionError(
            f"--provider {spec.provider} is not available in this version yet; "
            "use --provider local (the default)"
        )
    from .providers.local import LocalProvider, visible_gpus

    if spec.gpu:
        ids, model = visible_gpus()
        if not ids:
            raise SessionError(
                f"--gpu {spec.gpu}: this machine has no GPU, and the local provider runs on "
                "this machine; leave out --gpu to train on CPUs"
            )
        if model and spec.gpu.lower() not in model.lower():
            raise SessionError(f"--gpu {spec.gpu}: this machine's GPUs are {model}")
    return LocalProvider()


def _ssh_provider(spec: PoolSpec) -> Provider:
    from .providers.ssh import Host, SSHOptions, SSHProvider

    if not spec.hosts:
        raise SessionError("--provider ssh needs --hosts user@host[:port],...")
    try:
        hosts = [Host.parse(h) for h in spec.hosts]
    except ValueError as exc:
        raise SessionError(f"--hosts: {exc}") from None
    options = SSHOptions(
        identity=spec.identity,
        known_hosts=spec.known_hosts,
        accept_new_host_keys=bool(spec.accept_new_host_keys),
        python=spec.python or "python3",
        head_addr=spec.head_addr,
    )
    return SSHProvider(hosts, options)


@dataclass
class PoolEntry:
    name: str
    spec: PoolSpec
    pool: Pool
    shipper: Shipper = field(default_factory=Shipper)


class Session:
    def __init__(
        self,
        announce: Announce | None = None,
        views: Views | None = None,
        watchers: Sequence[PoolWatcher] = (),
    ) -> None:
        self._pools: dict[str, PoolEntry] = {}
        self.views: Views = views or NoViews()
        self.watchers: tuple[PoolWatcher, ...] = tuple(watchers)
        self.current: str | None = None
        self.defaults = PoolSpec()
        self.stdout_mode: StdoutMode = "head"
        self._announce = announce or (lambda text: print(text, file=sys.stderr))

    @property
    def pools(self) -> dict[str, PoolEntry]:
        return dict(self._pools)

    def spec_from(self, options: Mapping[str, Any], base: PoolSpec | None = None) -> PoolSpec:
        """A spec from the defaults (or ``base``) overlaid with the options given."""
        changes = {k: v for k, v in options.items() if v is not None}
        if "env" in changes:
            changes["env"] = tuple(sorted(changes["env"]))
        return replace(base or self.defaults, **changes)

    def _reusable(self, name: str | None, spec: PoolSpec | None) -> tuple[str, PoolEntry | None]:
        name = name or self.current or "default"
        entry = self._pools.get(name)
        if entry is not None and entry.pool.running and spec in (None, entry.spec):
            return name, entry
        return name, None

    def entry(
        self,
        name: str | None = None,
        spec: PoolSpec | None = None,
        shipper: Shipper | None = None,
    ) -> PoolEntry:
        """The pool a cell runs on, started or replaced as the spec asks."""
        name, reusable = self._reusable(name, spec)
        if reusable is not None:
            self.current = name
            return reusable
        entry = self._pools.get(name)
        wanted = spec or (entry.spec if entry else self.defaults)
        provider = make_provider(wanted)
        if entry is not None:
            self._announce(
                f"pool {name!r}: replacing {entry.spec.describe()} with {wanted.describe()}"
            )
            self.down(name, quiet=True)
        self._announce(f"pool {name!r}: starting {wanted.describe()} ...")
        started = time.perf_counter()
        pool = Pool(
            wanted.nodes,
            wanted.procs_per_node,
            provider=provider,
            name=name,
            backend=wanted.backend,
            env=dict(wanted.env),
        )
        entry = PoolEntry(name, wanted, pool, shipper or Shipper())
        self.views.pool_created(entry)
        for watcher in self.watchers:
            watcher.pool_created(entry)
        try:
            pool.start()
        except BaseException:
            self._ended(entry)
            raise
        group = (
            pool.torch_note or f"torch.distributed {pool.group_backend}, port {pool.master_port}"
        )
        self._announce(
            f"pool {name!r}: {pool.world_size} ranks ready in "
            f"{time.perf_counter() - started:.1f} s ({group})"
        )
        for warning in getattr(provider, "warnings", ()):
            self._announce(f"warning: {warning}")
        self._pools[name] = entry
        self.current = name
        self.views.pool_started(entry)
        for watcher in self.watchers:
            watcher.pool_started(entry)
        return entry

    def run_cell(
        self,
        source: str,
        user_ns: Mapping[str, Any],
        *,
        name: str | None = None,
        spec: PoolSpec | None = None,
        stdout: StdoutMode | None = None,
        timeout: float | None = None,
    ) -> RunResult:
        """Ship what the cell needs, run it, stream its output into this cell.

        The globals are pickled before any pool starts or is replaced, so a global that cannot
        be sent costs nothing but the error.
        """
        _, reusable = self._reusable(name, spec)
        shipper = reusable.shipper if reusable else Shipper()
        shipment = shipper.prepare(source, user_ns)
        entry = self.entry(name, spec, shipper)
        for warning in shipment.warnings:
            self._announce(f"warning: {warning}")
        view = CellOutput(stdout or self.stdout_mode)
        panel = self.views.cell(entry)

        def on_wait() -> None:
            view.flush()
            panel.flush()

        try:
            result = entry.pool.run(
                source,
                shipment.globals,
                timeout=timeout,
                observer=view.on_event,
                on_wait=on_wait,
            )
        except CellInterrupted as interrupted:
            self._settle(entry, shipment, interrupted.result)
            raise
        finally:
            view.flush()
            panel.finish()
        self._settle(entry, shipment, result)
        return result

    def _settle(self, entry: PoolEntry, shipment: Shipment, result: RunResult) -> None:
        if result.lost:
            entry.shipper.forget()
        else:
            entry.shipper.commit(shipment, result.bound)
        for note in result.notes:
            self._announce(f"pool {entry.name!r}: {note}")

    def pull(self, name: str, ranks: str | int = 0) -> Any:
        """A rank's value of ``name`` (``ranks="all"``: every rank's, as a list)."""
        entry = self._require()
        if not name.isidentifier():
            raise SessionError(f"{name!r} is not a variable name")
        result = entry.pool.run(name)
        if not result.ok:
            raise CellError(result.errors)
        if ranks == "all":
            return result.values
        if not 0 <= int(ranks) < len(result):
            raise SessionError(f"--rank {ranks}: the pool has ranks 0..{len(result) - 1}")
        return result.values[int(ranks)]

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> RunResult:
        """Send notebook variables to every rank now, even ones the ranks already bound."""
        entry = self._require()
        missing = [n for n in names if n not in user_ns]
        if missing:
            raise SessionError(f"not defined in the notebook: {', '.join(missing)}")
        shipment = entry.shipper.prepare("", user_ns, force=frozenset(names))
        result = entry.pool.run("", shipment.globals).raise_for_errors()
        entry.shipper.commit(shipment, result.bound)
        return result

    def restart(self, name: str | None = None) -> PoolEntry:
        """Fresh processes and a fresh process group for the pool, same spec."""
        entry = self._require(name)
        self.down(entry.name, quiet=True)
        return self.entry(entry.name, entry.spec)

    def down(self, name: str | None = None, *, quiet: bool = False) -> list[str]:
        """End a pool (the current one by default); returns the names ended."""
        target = name or self.current
        if target is None or target not in self._pools:
            if quiet:
                return []
            raise SessionError(f"no pool named {target!r}" if target else "no pool is running")
        entry = self._pools.pop(target)
        try:
            entry.pool.close()
        finally:
            self._ended(entry)
        if self.current == target:
            self.current = next(iter(self._pools), None)
        if not quiet:
            self._announce(f"pool {target!r}: shut down")
        return [target]

    def _ended(self, entry: PoolEntry) -> None:
        try:
            self.views.pool_ended(entry)
        finally:
            for watcher in self.watchers:
                watcher.pool_ended(entry)

    def down_pool(self, name: str, pool: Pool) -> None:
        """End ``pool`` if it is still the pool called ``name`` (a panel's "Shut down")."""
        entry = self._pools.get(name)
        if entry is not None and entry.pool is pool:
            self.down(name, quiet=True)
        else:
            pool.close()

    def down_all(self) -> list[str]:
        return [n for name in list(self._pools) for n in self.down(name, quiet=True)]

    def panel(self, name: str | None = None) -> None:
        """Show the live panel of a pool (the current one by default)."""
        try:
            self.views.show(name, self.current)
        except LookupError as exc:
            raise SessionError(str(exc.args[0] if exc.args else exc)) from None

    def metrics(self, name: str | None = None) -> Any:
        """What ``log()`` recorded on a pool's ranks: (step, name, mean, min, max, ranks) rows."""
        try:
            return self.views.metrics(name, self.current)
        except LookupError as exc:
            raise SessionError(str(exc.args[0] if exc.args else exc)) from None

    def status(self) -> str:
        if not self._pools:
            return "no pools"
        lines = []
        for name, entry in self._pools.items():
            pool = entry.pool
            mark = "*" if name == self.current else " "
            uptime = time.time() - (pool.started_at or time.time())
            state = "running" if pool.running else "ended"
            lines.append(
                f"{mark} {name}: {entry.spec.describe()}, {state}, up {uptime:.0f} s, "
                f"{pool.group_backend or 'no process group'}"
            )
            for rank in pool.ranks:
                lines.append(
                    f"    rank {rank.rank} (node {rank.node}, {rank.address}, {rank.process}): "
                    f"{rank.state.value}"
                )
        return "\n".join(lines)

    def _require(self, name: str | None = None) -> PoolEntry:
        target = name or self.current
        if target is None or target not in self._pools:
            raise SessionError("no pool is running; run a %%sky cell or %sky up first")
        return self._pools[target]
