"""Where a kernel's pools publish themselves for the Jupyter server (the lab's "Sky" panel).

One JSON file per pool, ``<id>.json``, in a per-user directory (``$SKYWARD_REGISTRY_DIR``, else
``jupyter_runtime_dir()/skyward``; the directory is 0700, the files 0600, and a file is always
replaced whole, by rename, so a reader never sees half of one). A record holds what the panel
shows (owner kernel, provider, nodes and their ranks' states, start time, price) and what is
needed to end the pool without its kernel (``teardown``: local rank and template pids with their
start times; SSH hosts and remote pids; for AWS the region, the pool's tag and its instances).
No secrets: no environment, no keys, no tokens.

The kernel side is :class:`Registry`, one more watcher of the session's pools: it writes a
record when a pool is created and when it is ready, removes it when the pool ends (and at exit),
and rewrites it from a small thread of its own when rank states change (at most every
:attr:`Registry.interval` seconds; the pool's IO thread only marks the record stale).

The server asks a live owner to shut a pool down by creating ``<id>.down`` beside the record:
the same thread sees it within :attr:`Registry.interval` and shuts the pool down through the
panel's path (a running cell is interrupted first), which removes the record. A pool whose owner
is dead is reaped by the server from ``teardown`` (:mod:`skyward_jupyter.server.reap`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .events import PoolEvent, RankState, RankStateChanged

if TYPE_CHECKING:
    from .session import PoolEntry

log = logging.getLogger(__name__)

FORMAT = 1
"""The record format's version; readers skip records of other versions."""
RECORD_SUFFIX = ".json"
DOWN_SUFFIX = ".down"
POOL_ID = re.compile(r"[0-9a-f]{12}")
Shutdown = Callable[[str, Any], None]
"""``shutdown(name, pool)``: end a pool the way the panel's "Shut down" does."""


class RegistryError(Exception):
    """The registry directory cannot be used safely (not ours, or open to others)."""


# ----------------------------------------------------------------------------- the directory


def registry_dir() -> Path:
    """The per-user directory of pool records (``$SKYWARD_REGISTRY_DIR`` overrides)."""
    override = os.environ.get("SKYWARD_REGISTRY_DIR")
    if override:
        return Path(override)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "skyward"


def ensure_dir(directory: Path) -> Path:
    """Create ``directory`` (0700) if needed; refuse one that is not ours or that others can use."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_dir(directory)
    return directory


def check_dir(directory: Path) -> None:
    info = directory.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RegistryError(f"{directory} belongs to another user")
    if info.st_mode & 0o077:
        raise RegistryError(f"{directory} is open to other users (mode {info.st_mode & 0o777:o})")


def record_path(directory: Path, pool_id: str) -> Path:
    _check_id(pool_id)
    return directory / f"{pool_id}{RECORD_SUFFIX}"


def down_path(directory: Path, pool_id: str) -> Path:
    _check_id(pool_id)
    return directory / f"{pool_id}{DOWN_SUFFIX}"


def _check_id(pool_id: str) -> None:
    if not POOL_ID.fullmatch(pool_id):
        raise ValueError(f"not a pool id: {pool_id!r}")


def new_pool_id() -> str:
    return secrets.token_hex(6)


def write_record(directory: Path, record: dict[str, Any]) -> Path:
    """Replace ``<id>.json`` with ``record`` at once (a temporary file renamed over it), 0600."""
    path = record_path(directory, str(record["id"]))
    data = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp made it 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_record(directory: Path, pool_id: str) -> dict[str, Any] | None:
    """The record of ``pool_id``; None when there is none (or it is of another format)."""
    try:
        data = json.loads(record_path(directory, pool_id).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if _valid(data) and data["id"] == pool_id else None


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every record in ``directory``, oldest first; files that are not records are skipped."""
    records = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        stem, suffix = os.path.splitext(name)
        if suffix != RECORD_SUFFIX or not POOL_ID.fullmatch(stem):
            continue  # temporary files (".<id>.*.tmp"), control files, strangers
        record = read_record(directory, stem)
        if record is not None:
            records.append(record)
    records.sort(key=lambda r: (r.get("created_at") or 0, r["id"]))
    return records


def _valid(data: object) -> bool:
    return (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("id"), str)
        and isinstance(data.get("owner"), dict)
    )


def remove_record(directory: Path, pool_id: str) -> None:
    """Remove a pool's record and its shutdown request, if there are any."""
    for path in (record_path(directory, pool_id), down_path(directory, pool_id)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def request_shutdown(directory: Path, pool_id: str) -> None:
    """Ask the pool's owner to shut it down (``<id>.down``; the owner removes it with the pool)."""
    path = down_path(directory, pool_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"requested_at": time.time()}))


def shutdown_requested(directory: Path, pool_id: str) -> bool:
    return down_path(directory, pool_id).exists()


# ------------------------------------------------------------------------------- processes


def process_start(pid: int) -> str | None:
    """An opaque token for when process ``pid`` started; None when there is no live such process.

    Two tokens are equal only for the same process, so a pid reused by another process does not
    pass for the one recorded. ``"?"``: the process exists, its start time is unknown.
    """
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start(pid)
    if fields[0] in (b"Z", b"X"):
        return None  # ended; only its exit status is left for its parent to read
    return f"proc:{int(fields[19])}"  # field 22, starttime, in clock ticks since boot


def _psutil_start(pid: int) -> str | None:
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"psutil:{proc.create_time():.2f}"
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return "?"


def process_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is still the process that had start token ``start`` (None: any)."""
    now = process_start(pid)
    if now is None:
        return False
    return start is None or now == "?" or start == "?" or now == start


# ---------------------------------------------------------------------------------- owner


@dataclass(frozen=True, slots=True)
class Owner:
    """The process whose session owns a pool, and its Jupyter kernel id if it is a kernel."""

    pid: int
    start: str | None
    host: str
    kernel_id: str | None

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start(pid), socket.gethostname(), kernel_id())

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start": self.start,
            "host": self.host,
            "kernel_id": self.kernel_id,
        }


def kernel_id() -> str | None:
    """This kernel's id, from its connection file (``kernel-<id>.json``); None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # noqa: BLE001 - not a kernel (terminal IPython, a script): no id
        return None
    match = re.fullmatch(r"kernel-(.+)\.json", name)
    return match.group(1) if match else None


# ---------------------------------------------------------------------------------- records


def _aggregate(states: list[RankState]) -> RankState:
    from .display.state import aggregate_state

    return aggregate_state(states)


def _price(pool: Any) -> float | None:
    from .display.state import price_of

    return price_of(pool)


def _template_pids() -> list[int]:
    from .providers.local import template_pids

    return template_pids()


def pool_record(
    pool_id: str,
    entry: PoolEntry,
    owner: Owner,
    *,
    created_at: float,
    ready_at: float | None,
    starts: dict[int, str | None] | None = None,
) -> dict[str, Any]:
    """What the registry says of a pool now. ``starts`` caches the ranks' start tokens by pid."""
    pool = entry.pool
    starts = {} if starts is None else starts
    local = pool.provider.name == "local"
    ranks = pool.ranks
    nodes = []
    for node in pool.nodes:
        own = [r for r in ranks if r.node == node.index]
        nodes.append(
            {
                "index": node.index,
                "address": node.address,
                "gpus": len(node.gpus),
                "gpu_type": node.gpu_type,
                "instance_type": node.instance_type,
                "state": _aggregate([r.state for r in own]).value,
                "ranks": [
                    {
                        "rank": r.rank,
                        "local_rank": r.local_rank,
                        "state": r.state.value,
                        "pid": r.hello.pid if r.hello else None,
                        "hostname": r.hello.hostname if r.hello else None,
                        "process": r.process,
                    }
                    for r in own
                ],
            }
        )
    teardown: dict[str, Any] = {"provider": pool.provider.name}
    if local:
        teardown["host"] = owner.host
        teardown["ranks"] = [
            {"pid": pid, "start": _cached_start(starts, pid)}
            for pid in (r.hello.pid for r in ranks if r.hello)
        ]
        teardown["templates"] = [
            {"pid": pid, "start": _cached_start(starts, pid)} for pid in _template_pids()
        ]
    elif pool.provider.name == "ssh":
        hosts = getattr(pool.provider, "hosts", ())
        teardown["hosts"] = [
            {
                "node": node.index,
                "host": str(hosts[node.index]) if node.index < len(hosts) else node.address,
                "pids": [r.hello.pid for r in ranks if r.node == node.index and r.hello],
            }
            for node in pool.nodes
        ]
    elif pool.provider.name == "aws":
        record_of = getattr(pool.provider, "teardown_record", None)
        if callable(record_of):
            teardown.update(record_of())
    price = _price(pool)
    return {
        "format": FORMAT,
        "id": pool_id,
        "name": entry.name,
        "owner": owner.as_dict(),
        "provider": pool.provider.name,
        "description": entry.spec.describe(),
        "state": _aggregate([r.state for r in ranks]).value,
        "ready": ready_at is not None and pool.running,
        "nodes_requested": pool.requested_nodes,
        "world_size": len(ranks),
        "backend": pool.group_backend,
        "created_at": created_at,
        "started_at": pool.started_at,
        "ready_at": ready_at,
        "updated_at": time.time(),
        "price_per_hour": price,
        "currency": "USD" if price is not None else None,
        "nodes": nodes,
        "teardown": teardown,
    }


def _cached_start(starts: dict[int, str | None], pid: int) -> str | None:
    if pid not in starts:
        starts[pid] = process_start(pid)
    return starts[pid]


# ----------------------------------------------------------------------- the kernel's side


@dataclass(eq=False)
class _Tracked:
    pool_id: str
    entry: PoolEntry
    created_at: float
    ready_at: float | None = None
    dirty: bool = False
    requested: bool = False
    starts: dict[int, str | None] = field(default_factory=dict)
    unsubscribe: Callable[[], None] | None = None


_live: weakref.WeakSet[Registry] = weakref.WeakSet()


class Registry:
    """A session's pools, published in the registry directory (a session watcher).

    Never raises into the session: a registry that cannot write says so once in the log and
    the pools work on without it.
    """

    interval = 0.25
    """Seconds between the writer thread's rounds: rewrites of stale records, shutdown requests."""

    def __init__(self, directory: Path | None = None, owner: Owner | None = None) -> None:
        self._directory = directory
        self._owner = owner
        self._tracked: dict[int, _Tracked] = {}  # by id() of the pool
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._shutdown: Shutdown | None = None
        self._warned = False
        _live.add(self)

    def attach(self, shutdown: Shutdown) -> None:
        """How a shutdown request from the server ends a pool: ``shutdown(name, pool)``."""
        self._shutdown = shutdown

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = registry_dir()
        return self._directory

    @property
    def owner(self) -> Owner:
        if self._owner is None:
            self._owner = Owner.current()
        return self._owner

    def pool_id(self, entry: PoolEntry) -> str | None:
        """The registry id of ``entry``'s pool while it is registered."""
        tracked = self._tracked.get(id(entry.pool))
        return tracked.pool_id if tracked is not None and tracked.entry is entry else None

    # ------------------------------------------------------------------ session hooks

    def pool_created(self, entry: PoolEntry) -> None:
        tracked = _Tracked(new_pool_id(), entry, time.time())
        with self._cond:
            if self._closed:
                return
            self._tracked[id(entry.pool)] = tracked
            self._ensure_thread()
            self._cond.notify_all()
        tracked.unsubscribe = entry.pool.subscribe(lambda event: self._on_event(tracked, event))
        self._write(tracked)

    def pool_started(self, entry: PoolEntry) -> None:
        tracked = self._tracked.get(id(entry.pool))
        if tracked is None or tracked.entry is not entry:
            return
        tracked.ready_at = time.time()
        self._write(tracked)

    def pool_ended(self, entry: PoolEntry) -> None:
        with self._cond:
            tracked = self._tracked.get(id(entry.pool))
            if tracked is None or tracked.entry is not entry:
                return
            del self._tracked[id(entry.pool)]
            self._remove(tracked)
        if tracked.unsubscribe is not None:
            tracked.unsubscribe()

    def close(self) -> None:
        """Remove every record of this registry; no more writes (at exit)."""
        with self._cond:
            self._closed = True
            for tracked in self._tracked.values():
                self._remove(tracked)
            self._tracked.clear()
            self._cond.notify_all()

    # ----------------------------------------------------------------------- internals

    @staticmethod
    def _on_event(tracked: _Tracked, event: PoolEvent) -> None:
        """The pool's IO thread: only mark the record stale; the writer thread rewrites it."""
        if isinstance(event, RankStateChanged):
            tracked.dirty = True

    def _ensure_thread(self) -> None:
        """Start the writer thread unless it runs (under the lock; it ends with the last pool)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="skyward-registry", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._tracked:
                    self._thread = None  # the next pool starts another
                    return
                self._cond.wait(self.interval)
                for tracked in list(self._tracked.values()):
                    if tracked.dirty:
                        tracked.dirty = False  # before reading the pool: a later change re-marks
                        self._write(tracked)
                    self._check_request(tracked)

    def _check_request(self, tracked: _Tracked) -> None:
        if tracked.requested:
            return
        try:
            if not shutdown_requested(self.directory, tracked.pool_id):
                return
        except OSError:
            return
        tracked.requested = True
        entry = tracked.entry
        log.info("pool %r: shutdown requested through the Jupyter server", entry.name)
        shutdown = self._shutdown
        threading.Thread(
            target=self._shut_down,
            args=(shutdown, entry),
            name=f"skyward-registry-down-{entry.name}",
            daemon=True,
        ).start()

    @staticmethod
    def _shut_down(shutdown: Shutdown | None, entry: PoolEntry) -> None:
        try:
            if shutdown is not None:
                shutdown(entry.name, entry.pool)
            else:
                entry.pool.close()
        except Exception:
            log.exception("pool %r could not be shut down on request", entry.name)

    def _write(self, tracked: _Tracked) -> None:
        with self._cond:
            if self._closed or self._tracked.get(id(tracked.entry.pool)) is not tracked:
                return  # ended meanwhile: a late write must not bring the record back
            try:
                record = pool_record(
                    tracked.pool_id,
                    tracked.entry,
                    self.owner,
                    created_at=tracked.created_at,
                    ready_at=tracked.ready_at,
                    starts=tracked.starts,
                )
                write_record(ensure_dir(self.directory), record)
            except Exception as exc:  # noqa: BLE001 - the pool works on without the registry
                self._warn(exc)

    def _remove(self, tracked: _Tracked) -> None:
        try:
            remove_record(self.directory, tracked.pool_id)
        except Exception as exc:  # noqa: BLE001 - the pool works on without the registry
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the pool registry for the lab panel is not available: %s", exc)


def live_registries() -> Iterator[Registry]:
    return iter(list(_live))


@atexit.register
def _close_all() -> None:
    """A kernel that exits (shut down, restarted) leaves no record behind."""
    for registry in live_registries():
        registry.close()
