"""A plain DDP training loop, written as the PyTorch ddp-tutorial-series writes a torchrun script.

``python ddp_mlp.py OUT.json [--steps K] [--warmup W]`` under ``torchrun --nproc-per-node 2`` (or
``%sky run``): ``init_process_group()``, an MLP in ``DistributedDataParallel``, a
``DistributedSampler`` over random data, SGD; ``W`` untimed steps, then ``K`` steps timed by
``time.perf_counter()`` between two ``barrier()``s, then ``destroy_process_group()`` (after a short
pause: see ``main()``). Rank 0 writes the steps per second (and the thread settings it ran with)
to ``OUT.json``. ``main(argv)`` can also be called from a notebook cell.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import thread_cpu
import torch
import torch.nn.functional as F
from torch.distributed import barrier, destroy_process_group, get_world_size, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, HIDDEN, CLASSES, BATCH = 128, 256, 10, 64


def ddp_setup() -> None:
    init_process_group(backend="gloo")  # CPU: gloo, as torchrun scripts without GPUs use


class Trainer:
    def __init__(
        self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer
    ) -> None:
        self.rank = int(os.environ["RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)
        self.epoch = 0

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_steps(self, steps: int) -> None:
        done = 0
        while done < steps:
            self.train_data.sampler.set_epoch(self.epoch)
            self.epoch += 1
            for source, targets in self.train_data:
                self._run_batch(source, targets)
                done += 1
                if done == steps:
                    return

    def train(self, steps: int, warmup: int) -> tuple[float, float, dict[str, float]]:
        """Run ``warmup`` steps, then time ``steps`` more: wall and CPU seconds (this process),
        and the CPU seconds of each of its threads.
        """
        self._run_steps(warmup)
        barrier()
        threads = thread_cpu.per_thread()
        started, cpu_started = time.perf_counter(), time.process_time()
        self._run_steps(steps)
        barrier()
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return seconds, cpu, thread_cpu.spent(threads)


def load_train_objs(samples: int):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, FEATURES, generator=g),
        torch.randint(0, CLASSES, (samples,), generator=g),
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return data, model, optimizer


def prepare_dataloader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    ddp_setup()
    torch.manual_seed(0)
    dataset, model, optimizer = load_train_objs(BATCH * get_world_size() * 32)
    trainer = Trainer(model, prepare_dataloader(dataset, BATCH), optimizer)
    seconds, cpu_seconds, threads_cpu = trainer.train(args.steps, args.warmup)
    if trainer.rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "steps_per_s": args.steps / seconds,
                    "seconds": seconds,
                    "cpu_s_per_step": cpu_seconds / args.steps,
                    "threads_cpu_s": threads_cpu,
                    "pool_agent_cpu_s": thread_cpu.pool_agent(threads_cpu),
                    "timed_steps": args.steps,
                    "warmup_steps": args.warmup,
                    "world_size": get_world_size(),
                    "torch_threads": torch.get_num_threads(),
                    "torch_interop_threads": torch.get_num_interop_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "python_threads": threading.active_count(),
                    "os_threads": len(os.listdir("/proc/self/task")),
                    "pid": os.getpid(),
                },
                f,
            )
    # torch 2.13, gloo: the last collective's work is freed by gloo's worker thread, which needs
    # the GIL for that. Ending right after the collective can leave it waiting while the
    # interpreter finalizes (the thread is then killed: "terminate called without an active
    # exception", SIGABRT; about 1 in 15 plain torchrun runs here) or while the main thread holds
    # the GIL joining it (a hang). Sleeping releases the GIL so that the work is freed first.
    time.sleep(0.05)
    destroy_process_group()


if __name__ == "__main__":
    main()
