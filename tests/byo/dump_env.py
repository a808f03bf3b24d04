# Writes what a worker sees of its launcher, for comparing a pool with torchrun.
import json
import os
import socket
import sys

import torch.distributed as dist

dist.init_process_group()
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # PrefixStores around the launcher's TCPStore
    store = store.underlying_store
out = {
    "env": dict(os.environ),
    "store_port": store.port,
    "master_ip": socket.gethostbyname(os.environ["MASTER_ADDR"]),
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
