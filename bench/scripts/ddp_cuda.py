"""A launch-bound DDP loop on one GPU per rank, written as a torchrun script is written.

``python ddp_cuda.py OUT.json [--steps K] [--warmup W]`` under ``torchrun`` (or in a notebook
cell, as ``main(argv)``): ``init_process_group("nccl")``, a small MLP in
``DistributedDataParallel`` on ``cuda:LOCAL_RANK``, a fixed batch already on the GPU, SGD. The
model is small on purpose: each step is a handful of tiny kernels, so its time is the CPU's
launching them (and DDP's hooks), the part a pool's agent could slow down, not the GPU's
arithmetic. ``W`` untimed steps, then ``K`` steps timed between two synchronised barriers. Rank 0
writes the steps per second to ``OUT.json``, with the CPU time its threads used over those steps
(``thread_cpu.py``, beside this script): the launching thread's per step, and a pool agent's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import thread_cpu
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, HIDDEN, CLASSES, BATCH = 128, 256, 10, 64


def _sync() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args(argv)
    if not dist.is_initialized():  # a notebook pool has already formed the group
        dist.init_process_group(backend="nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).to(device)
    ddp = DDP(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-2, momentum=0.9)
    source = torch.randn(BATCH, FEATURES, device=device)
    targets = torch.randint(0, CLASSES, (BATCH,), device=device)

    def steps(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            F.cross_entropy(ddp(source), targets).backward()
            optimizer.step()

    steps(args.warmup)
    _sync()
    threads = thread_cpu.per_thread()
    started = time.perf_counter()
    steps(args.steps)
    _sync()
    seconds = time.perf_counter() - started
    threads_cpu = thread_cpu.spent(threads)
    main_cpu_ms = 1e3 * threads_cpu.get(thread_cpu.MAIN, 0.0)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "steps_per_s": args.steps / seconds,
                    "seconds": seconds,
                    "main_cpu_ms_per_step": main_cpu_ms / args.steps,
                    "pool_agent_cpu_s": thread_cpu.pool_agent(threads_cpu),
                    "threads_cpu_s": threads_cpu,
                    "flight_recorder": os.environ.get("TORCH_FR_BUFFER_SIZE"),
                    "world_size": dist.get_world_size(),
                    "backend": dist.get_backend(),
                    "device": torch.cuda.get_device_name(device),
                },
                f,
            )


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
