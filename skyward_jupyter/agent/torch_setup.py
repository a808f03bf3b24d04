"""torch.distributed on a rank: the process group the cell finds already initialised.

The head hosts the rendezvous store on a socket it binds itself, on the head's pool address and
port 0: the port is free by construction (no fixed 29500, no race between "found free" and "in
use"), and the store does not listen on every interface. Each re-formation after a failure gets
a fresh port, so a port that torch failed to release cannot block the next group. The store
serves only connections that prove the formation's secret (see :mod:`.store_server`), which the
notebook sends down each rank's channel with the command to form.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .gloo_loop import LoopPriority
from .gloo_tunnel import GlooTunnel
from .network import (
    CONNECT_TIMEOUT,
    Route,
    check_peers,
    choose_interfaces,
    reach,
    socket_inodes,
)
from .store_server import StoreServer


@dataclass(frozen=True, slots=True)
class GroupSettings:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    backend: str | None
    timeout: float
    secure: bool = False
    """gloo listens on loopback only; its traffic between hosts goes through TLS tunnels."""
    pool_keys: tuple[str, str] | None = None
    """The pool's certificate and key (PEM) the tunnels prove (multi-host ``--secure`` pools)."""


FORM_TIMEOUT = 60.0
"""Seconds the ranks wait for each other while the group forms (the collectives' own timeout,
``GroupSettings.timeout``, is far longer: see the README's "Timeouts")."""


class GroupError(Exception):
    """The group cannot form, for a reason a person can act on (the message says how)."""


def _from(route: Route | None) -> str:
    if route is None:
        return ""
    return f" from {route.address} ({route.interface or 'unknown interface'})"


def torch_version() -> str | None:
    """Import torch now (the slow part of a rank's start); None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    if torch.distributed.is_available():
        # Its functions take the default group at this import as their default ``group=``, and
        # DDP imports it. Imported now, before any group, that default is None (the group of the
        # moment); imported later, it would keep the pool's first group for the rank's life,
        # long after the group was formed again.
        import torch.distributed.nn.functional
    return str(torch.__version__)


def nccl_available() -> bool | None:
    """Whether this process's torch has NCCL (None: torch is not installed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return bool(dist.is_available() and dist.is_nccl_available())


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def rank_device(local_rank: int) -> Any:
    """The rank's ``torch.device``: its GPU (``cuda:N``, the local rank's among those it sees;
    a node's ranks share them only under gloo) when it sees any, else the CPU.
    """
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class ProcessGroup:
    """The default process group of this rank, and a way to abort it that peers notice at once.

    ``destroy_process_group`` does not close gloo's connections while anything still holds the
    group (a DDP model in the cell's namespace does), so a peer blocked in a collective with
    this rank would wait for the full timeout. The sockets the group opened are therefore
    recorded when it forms and shut down on abort: the peer's collective fails immediately.
    """

    def __init__(self, settings: GroupSettings, say: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self._say = say
        """Where the store's refusals are written (the rank's diagnostics)."""
        self._store: Any = None
        self._sockets: dict[str, int] = {}
        self.backend: str | None = None
        """The backend of the group this rank last joined."""
        self._retired: list[Any] = []
        self._routed = False
        self._route_found: Route | None = None
        self._tunnel: GlooTunnel | None = None
        self._loop_priority = LoopPriority()

    @property
    def store(self) -> Any:
        """The pool's rendezvous store (None before the group forms and after it is left)."""
        return self._store

    def host(self, secret: bytes) -> int:
        """Start the rendezvous store on the head, for holders of ``secret``; return its port."""
        from .pool_store import PoolStore

        s = self.settings
        listener = socket.create_server((s.master_addr, 0), backlog=max(128, s.world_size))
        server = StoreServer(listener, secret, s.world_size, self._say)
        try:
            self._store = PoolStore(
                s.master_addr,
                server.port,
                secret,
                datetime.timedelta(seconds=s.timeout),
                server=server,
                tunnel=self._tunnel_of(self._route()),
            )
        except BaseException:
            server.close()
            raise
        return server.port

    def join(self, port: int, secret: bytes) -> str:
        """Initialise the default process group via the store at ``port``, proving ``secret``;
        return the backend.

        Raises :class:`GroupError` naming the address and port when the head's store cannot be
        reached, or the group cannot connect, with what to set.
        """
        import torch

        from .pool_store import PoolStore

        s = self.settings
        os.environ["MASTER_PORT"] = str(port)  # as torchrun's workers find it
        route = self._route()
        timeout = datetime.timedelta(seconds=s.timeout)
        if self._store is None:
            why = reach(s.master_addr, port, min(s.timeout, CONNECT_TIMEOUT))
            if why is not None:
                raise GroupError(
                    f"cannot reach the head's rendezvous at {s.master_addr}:{port} ({why})"
                    f"{_from(route)}; if the head has an address these hosts reach, name it "
                    "with the provider's option for the head's address (see %%sky?)"
                )
            tunnel = self._tunnel_of(route)
            try:
                self._store = PoolStore(s.master_addr, port, secret, timeout, tunnel=tunnel)
            except RuntimeError as exc:
                raise GroupError(f"{exc}{_from(route)}") from None
        cuda = torch.cuda.is_available()
        backend = s.backend or ("nccl" if cuda and nccl_available() and not s.secure else "gloo")
        if s.secure and backend != "gloo":
            raise GroupError(
                f"--secure carries gloo's traffic only, and this pool asks for {backend}: "
                "use --backend gloo, or leave out --secure on a network you trust"
            )
        if cuda:
            torch.cuda.set_device(rank_device(s.local_rank))
        try:
            tunnel = self._store.tunnel
            where = (tunnel.address, tunnel.port) if tunnel is not None else None
            check_peers(self._store, s.rank, s.world_size, backend, FORM_TIMEOUT, where)
        except ConnectionError as exc:
            variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
            raise GroupError(
                f"{exc}; set --env {variable}=IFACE to an interface the other hosts reach"
            ) from None
        try:
            self._init(backend, self._store, timeout)
        except RuntimeError as exc:
            variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
            chosen = os.environ.get(variable)
            raise GroupError(
                f"the {backend} group could not connect: {str(exc).strip().splitlines()[-1]}"
                f"{_from(route)}, {variable}={chosen or '(unset)'}; set --env {variable}=IFACE "
                "to the interface that reaches the other hosts"
            ) from exc
        self.backend = backend
        return backend

    def _route(self) -> Route | None:
        """Choose the interfaces once per process (see :mod:`.network`); a secure pool's gloo
        listens on loopback, whatever was set, as its tunnel carries the rest.
        """
        if not self._routed:
            self._routed = True
            if self.settings.secure:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            self._route_found = choose_interfaces(self.settings.master_addr)
        return self._route_found

    def _tunnel_of(self, route: Route | None) -> GlooTunnel | None:
        """This rank's gloo tunnel (a multi-host ``--secure`` pool's), made once per process."""
        keys = self.settings.pool_keys
        if keys is None:
            return None
        if self._tunnel is None:
            if route is None:
                raise GroupError(
                    f"--secure: cannot resolve the head {self.settings.master_addr!r} from "
                    "this host, so there is no address to serve this rank's tunnel on"
                )
            self._tunnel = GlooTunnel(route.address, *keys, say=self._say)
        return self._tunnel

    def rejoin(self, prefix: str, backend: str, timeout: datetime.timedelta, **extra: Any) -> None:
        """Form a new default group over the pool's store, under ``prefix`` (the user's code
        asked for one after destroying the pool's); its sockets are recorded as ``join``'s are,
        so that leaving it frees peers at once too.
        """
        import torch.distributed as dist

        store = dist.PrefixStore(prefix, self._store)  # type: ignore[attr-defined]
        self._init(backend, store, timeout, **extra)

    def _init(self, backend: str, store: Any, timeout: datetime.timedelta, **extra: Any) -> None:
        """Initialise the default group, recording the sockets it opened (see :meth:`leave`)."""
        from torch.distributed import distributed_c10d

        s = self.settings
        before = socket_inodes() if os.path.isdir("/proc/self/fd") else {}
        # distributed_c10d's own function: the one in torch.distributed is the user's entry
        # point (see user_group).
        distributed_c10d.init_process_group(
            backend, store=store, rank=s.rank, world_size=s.world_size, timeout=timeout, **extra
        )
        if before or os.path.isdir("/proc/self/fd"):
            after = socket_inodes()
            self._sockets.update({k: fd for k, fd in after.items() if k not in before})
        self.lower_gloo_loops()

    def track_user_groups(self) -> None:
        """Record the sockets of the groups the user's code forms too (``new_group``, a
        DeviceMesh's), so that leaving frees a peer blocked in one of them as well: each is
        formed through ``_new_process_group_helper`` (torch 2.13, which this project pins).
        """
        from torch.distributed import distributed_c10d as c10d

        original = c10d._new_process_group_helper

        def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
            if not os.path.isdir("/proc/self/fd"):
                return original(*args, **kwargs)
            before = socket_inodes()
            try:
                return original(*args, **kwargs)
            finally:
                opened = {k: fd for k, fd in socket_inodes().items() if k not in before}
                self._sockets.update(opened)

        c10d._new_process_group_helper = new_process_group_helper

    def lower_gloo_loops(self) -> None:
        """gloo's event-loop threads below the training (see :mod:`.gloo_loop`): as each group
        forms, and at every watchdog tick for groups the user's code forms.
        """
        self._loop_priority.lower()

    def retire(self, group: Any) -> None:
        """Keep a group the user's code destroyed alive until the next formation.

        Otherwise its last reference may be a DDP model's, dropped when the script's ``main()``
        returns: gloo's destructor then runs on this thread holding the GIL and can deadlock
        with gloo's worker thread, which needs the GIL to free the last collective's work
        (seen: a rank silent until the heartbeat timeout). By the next formation that work is
        long done.
        """
        self._retired.append(group)

    @property
    def retired(self) -> tuple[Any, ...]:
        """The groups the user's code destroyed since the last formation."""
        return tuple(self._retired)

    def gone(self) -> bool:
        """Formed by the pool, but no longer initialised (something destroyed it)."""
        if self._store is None:
            return False
        from torch.distributed import distributed_c10d as c10d

        return not c10d.is_initialized()

    def leave(self) -> None:
        """Abort the group (its peers' pending collectives fail now) and destroy it."""
        from torch.distributed import distributed_c10d as c10d

        # also when the user's code destroyed the group: the next is new
        store, self._store = self._store, None
        self._retired.clear()
        if self._tunnel is not None:
            self._tunnel.forget()
        if not c10d.is_initialized():
            self._sockets = {}
        elif c10d.get_backend() == "nccl":
            self._sockets = {}
            c10d._abort_process_group()
        else:
            self._shut_sockets()
            c10d.destroy_process_group()
        if store is not None:
            store.close()

    def _shut_sockets(self) -> None:
        for inode, fd in self._sockets.items():
            try:
                copy = os.dup(fd)
            except OSError:
                continue  # gloo closed it meanwhile
            if f"socket:[{os.fstat(copy).st_ino}]" != inode:
                os.close(copy)  # the number was reused for something that is not ours
                continue
            sock = socket.socket(fileno=copy)
            try:
                # A listener is left alone: gloo aborts the process when its accept() fails.
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    with contextlib.suppress(OSError):  # the peer may have closed it first
                        sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
        self._sockets = {}
