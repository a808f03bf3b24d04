"""The least a NCCL job does: form the group, all-reduce one CUDA tensor, check it, end.

Under ``torchrun`` its wall time is what a user waits for one collective on the GPUs from a
cold start; the same body is a pool's first cell.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def first_collective() -> float:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    return float(t.sum().item())


if __name__ == "__main__":
    dist.init_process_group(backend="nccl")
    total = first_collective()
    assert total == 4.0 * dist.get_world_size(), total
    dist.destroy_process_group()
