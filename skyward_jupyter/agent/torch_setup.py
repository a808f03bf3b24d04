"""torch.distributed on a rank: the process group the cell finds already initialised.

The head hosts the rendezvous store on a socket it binds itself, on the head's pool address and
port 0: the port is free by construction (no fixed 29500, no race between "found free" and "in
use"), and the store does not listen on every interface. Each re-formation after a failure gets
a fresh port, so a port that torch failed to release cannot block the next group.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GroupSettings:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    backend: str | None
    timeout: float


def torch_version() -> str | None:
    """Import torch now (the slow part of a rank's start); None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


class ProcessGroup:
    def __init__(self, settings: GroupSettings) -> None:
        self.settings = settings
        self._store: Any = None

    def host(self) -> int:
        """Start the rendezvous store on the head; return its port."""
        import torch.distributed as dist

        s = self.settings
        listener = socket.create_server((s.master_addr, 0), backlog=max(128, s.world_size))
        port = int(listener.getsockname()[1])
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            s.master_addr,
            port,
            s.world_size,
            True,
            datetime.timedelta(seconds=s.timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        return port

    def join(self, port: int) -> str:
        """Initialise the default process group via the store at ``port``; return the backend."""
        import torch
        import torch.distributed as dist

        s = self.settings
        os.environ["MASTER_PORT"] = str(port)
        timeout = datetime.timedelta(seconds=s.timeout)
        if self._store is None:
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                s.master_addr, port, s.world_size, False, timeout
            )
        cuda = torch.cuda.is_available()
        backend = s.backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(s.local_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, store=self._store, rank=s.rank, world_size=s.world_size, timeout=timeout
        )
        return backend

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
