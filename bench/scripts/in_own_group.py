"""Run a torchrun script in the ranks of a pool, on a process group it forms itself.

``%sky run in_own_group.py SCRIPT ARGV...``: the ranks agree on a port over the pool's group,
end that group, form a new gloo group over a store rank 0 hosts on that port (as a script that
does its own rendezvous would), then run ``SCRIPT`` as ``__main__``. The same processes train as
with ``%sky run SCRIPT``; only the group differs: ``diagnose_byo.py`` compares the two to tell a
gap in the pool's group from one in the ranks' process state.
"""

from __future__ import annotations

import datetime
import os
import runpy
import socket
import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d

dist.init_process_group("gloo")  # the pool's group, as every torchrun script asks for it
rank, world = dist.get_rank(), dist.get_world_size()
port: list[int | None] = [None]
if rank == 0:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port[0] = probe.getsockname()[1]
dist.broadcast_object_list(port)
dist.destroy_process_group()
store = dist.TCPStore(  # type: ignore[attr-defined]
    "127.0.0.1", port[0], world, rank == 0, datetime.timedelta(seconds=60)
)
# c10d's own entry point: the pool answers torch.distributed's with its own group.
distributed_c10d.init_process_group("gloo", store=store, rank=rank, world_size=world)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
