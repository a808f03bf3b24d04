"""A tiny BERT trained with the Hugging Face ``Trainer``, as a torchrun script.

``python hf_trainer.py OUT.json [--steps N] [--warmup W]`` under ``torchrun
--nproc-per-node 2`` (or ``%sky run``) trains ``BertForSequenceClassification`` built from a
config (nothing is downloaded) on random tokens for ``N`` optimiser steps with batch 8 per rank.
A ``TrainerCallback`` timestamps every ``on_step_end``; the steps after the first ``W`` give the
training steps per second, so the figure is the training loop's steady state alone: not the
imports, the model's construction, DDP's wrapping and first broadcast, or the lazy work of the
first steps (``train_runtime`` in the metrics carries all of those; it is written too, for
information). Rank 0 writes the JSON report; the script ends the process group, as a torchrun
script should.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import thread_cpu
import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

BATCH = 8
SEQ_LEN = 32
VOCAB = 100


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long),
            "labels": self.labels[i],
        }


class StepClock(TrainerCallback):
    """``time.perf_counter()`` (and this process's CPU time) at the end of every optimiser step;
    each thread's CPU time from the end of step ``warmup`` to the last.
    """

    def __init__(self, warmup: int) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.warmup = warmup
        self.threads: dict[int, tuple[str, float]] = {}
        self.threads_cpu: dict[str, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if len(self.ends) == self.warmup + 1:
            self.threads = thread_cpu.per_thread()
        elif len(self.ends) == args.max_steps:
            self.threads_cpu = thread_cpu.spent(self.threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)

    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=37,
        )
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = RandomTokens(BATCH * world * (args.steps + 1))
    training_args = TrainingArguments(
        output_dir=args.output_dir or os.path.join(os.path.dirname(args.out), "hf_trainer_out"),
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=True,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    clock = StepClock(args.warmup)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[clock])
    metrics = trainer.train().metrics
    ends = clock.ends
    if len(ends) != args.steps:
        raise RuntimeError(f"{len(ends)} steps timed, {args.steps} asked")
    timed, cpu = ends[args.warmup :], clock.cpu[args.warmup :]
    report = {
        "steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]),
        "cpu_s_per_step": (cpu[-1] - cpu[0]) / (len(cpu) - 1),
        "threads_cpu_s": clock.threads_cpu,
        "pool_agent_cpu_s": thread_cpu.pool_agent(clock.threads_cpu),
        "timed_steps": len(timed) - 1,
        "warmup_steps": args.warmup,
        "train_runtime_s": metrics["train_runtime"],
        "train_steps_per_second": metrics["train_steps_per_second"],
        "world_size": training_args.world_size,
        "parallel_mode": str(training_args.parallel_mode),
        "ddp": type(trainer.model_wrapped).__name__,
        "dist_initialized": dist.is_available() and dist.is_initialized(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python_threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "pid": os.getpid(),
    }
    if training_args.process_index == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    # The Trainer leaves the group it (or torchrun's environment) made: end it, as a torchrun
    # script should. torch 2.13, gloo: the last collective's work (the Trainer's final
    # all-gather) is freed by gloo's worker thread, which needs the GIL for that. Ending right
    # after the collective can leave it waiting while the interpreter finalizes (the thread is
    # then killed: "terminate called without an active exception", SIGABRT) or while the main
    # thread holds the GIL joining it as the DDP model goes (a hang); both were seen under plain
    # torchrun. Sleeping releases the GIL so that the work is freed first.
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
