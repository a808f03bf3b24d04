"""Run a torchrun script in fresh processes, one per rank, started by the ranks of a pool.

``%sky run in_fresh_processes.py SCRIPT ARGV...``: each rank starts ``python SCRIPT ARGV...``
with its own torch variables and waits for it; rank 0's child hosts a new rendezvous store on a
port rank 0 chose. The children share the pool's machine, its neighbours and its environment
but none of a rank's process state (the agent's threads, the forked template's memory, the
pool's process group): ``diagnose_byo.py`` compares this against the script run in the ranks
themselves and under torchrun.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
port: list[int | None] = [None]
if dist.get_rank() == 0:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port[0] = probe.getsockname()[1]
dist.broadcast_object_list(port)
env = {
    **os.environ,
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": str(port[0]),
    "TORCHELASTIC_USE_AGENT_STORE": "False",  # the child of rank 0 hosts the store itself
}
status = subprocess.run([sys.executable, *sys.argv[1:]], env=env).returncode
dist.barrier()
if status:
    raise SystemExit(f"{os.path.basename(sys.argv[1])} exited with status {status}")
