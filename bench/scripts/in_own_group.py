"""Run a torchrun script in the ranks of a pool, on a process group it forms itself.

``%sky run in_own_group.py SCRIPT ARGV...``: rank 0 starts a store and tells the others its
port over the pool's group; the ranks end that group, form a new gloo group over the store (as
a script that does its own rendezvous would), then run ``SCRIPT`` as ``__main__``. The same
processes train as with ``%sky run SCRIPT``; only the group differs: ``diagnose_byo.py``
compares the two to tell a gap in the pool's group from one in the ranks' process state.
"""

from __future__ import annotations

import datetime
import os
import runpy
import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d

dist.init_process_group("gloo")  # the pool's group, as every torchrun script asks for it
rank, world = dist.get_rank(), dist.get_world_size()
timeout = datetime.timedelta(seconds=60)
store = None
if rank == 0:  # bound to a port of the system's choosing: no other process can take it first
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
port = [store.port if store else None]
dist.broadcast_object_list(port)
dist.destroy_process_group()
if store is None:
    store = dist.TCPStore("127.0.0.1", port[0], world, False, timeout)  # type: ignore[attr-defined]
# c10d's own entry point: the pool answers torch.distributed's with its own group.
distributed_c10d.init_process_group("gloo", store=store, rank=rank, world_size=world)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
