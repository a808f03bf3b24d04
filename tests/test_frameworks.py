"""Libraries that detect a launcher see the pool's world (issue 11).

Accelerate, Lightning and the Hugging Face Trainer each decide from the environment whether they
run in a launched world; on a pool they must find the pool's two ranks and use its process
group without being told, with the code written the way their users write it for ``torchrun``.
The pool is two simulated nodes of one CPU rank each; models are tiny and built from configs,
nothing is downloaded.

Each rank initialises its model from a seed of its own, so parameters that are equal after
training show that the library both broadcast the start and averaged the gradients; each rank
records the samples it trained on, so the data was split and not repeated.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.events import CellFinished, CellStarted, PoolEvent
from skyward_jupyter.results import PoolError, RunResult

from .conftest import _module_pool_pids, agent_pids, wait_for

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CELL_TIMEOUT = 240.0
ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "t.item()"
)


def src(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def run(pool: Pool, source: str, **globals_: Any) -> RunResult:
    """Run a cell that must succeed on every rank; its per-rank values."""
    return pool.run(src(source), globals_, timeout=CELL_TIMEOUT).raise_for_errors()


class SharedPool:
    """One pool for the module's tests. A test during which a cell failed or did not finish
    gets the pool replaced: its ranks may hold half-imported modules (a rank interrupted by
    the failure policy stops wherever it was) or half-built library state, which would make
    the next test fail for the wrong reason.
    """

    def __init__(self) -> None:
        self.pool: Pool | None = None
        self.registered: set[int] = set()
        self.unfinished: set[int] = set()
        """Cells started during the current test that did not finish on every rank."""

    def get(self) -> Pool:
        if self.pool is None:
            self.pool = Pool(nodes=2, env=OFFLINE, interrupt_grace=2.0).start()
            self.pool.subscribe(self.watch)
        self.unfinished.clear()
        self.register()
        return self.pool

    def watch(self, event: PoolEvent) -> None:
        if isinstance(event, CellStarted):
            self.unfinished.add(event.cell_id)
        elif isinstance(event, CellFinished) and event.result.ok:
            self.unfinished.discard(event.cell_id)

    def register(self) -> None:
        """Tell conftest's leak check which ranks belong to the shared pool (restarts change
        them).
        """
        current = {r.hello.pid for r in self.pool.ranks if r.hello} if self.pool else set()
        _module_pool_pids.difference_update(self.registered)
        _module_pool_pids.update(current)
        self.registered = current

    def after_test(self) -> None:
        """Replace a pool that saw a failed cell; check that a clean test left it whole."""
        if self.pool is None:
            return
        if self.unfinished:
            self.close()
            return
        try:
            result = self.pool.run(ALL_REDUCE, timeout=60)
            whole = result.ok and result.values == [3.0, 3.0]
        except PoolError as e:
            result, whole = e, False
        if whole:
            self.register()
            return
        self.close()
        raise AssertionError(f"the test left the shared pool unable to all_reduce: {result!r}")

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        pids = {r.hello.pid for r in pool.ranks if r.hello} | self.registered
        try:
            with contextlib.suppress(PoolError):
                pool.close()
            wait_for(lambda: not (pids & agent_pids()), 15, "the shared pool's ranks to end")
        finally:
            self.register()


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedPool]:
    holder = SharedPool()
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def pool(shared: SharedPool) -> Iterator[Pool]:
    yield shared.get()
    shared.after_test()


def equal_across_ranks(values: list[dict[str, list[float]]]) -> None:
    import torch

    first, second = values
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(
            torch.tensor(first[name]), torch.tensor(second[name]), rtol=0, atol=1e-6, msg=name
        )


def split_between_ranks(seen: list[list[int]], total: int) -> None:
    """Each rank trained on its own half of the samples: together all of them, none twice."""
    halves = [set(s) for s in seen]
    assert [len(s) for s in seen] == [total // 2] * 2, seen
    assert [len(h) for h in halves] == [total // 2] * 2, seen
    assert halves[0] | halves[1] == set(range(total))


# --------------------------------------------------------------------------------- Accelerate


def test_accelerator_sees_the_pool_world(pool: Pool) -> None:
    result = run(
        pool,
        """
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        accelerator = Accelerator()
        (accelerator.num_processes, accelerator.distributed_type == DistributedType.MULTI_CPU,
         str(accelerator.distributed_type), accelerator.process_index,
         accelerator.local_process_index, accelerator.is_main_process, accelerator.device.type)
        """,
    )
    assert result.values == [
        (2, True, "DistributedType.MULTI_CPU", 0, 0, True, "cpu"),
        (2, True, "DistributedType.MULTI_CPU", 1, 0, False, "cpu"),
    ]


ACCELERATE_LOOP = """
import os
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(100 + int(os.environ["RANK"]))  # each rank starts from its own weights
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
start = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g)
dataset = TensorDataset(torch.arange(64), x, x.sum(dim=1, keepdim=True))
dataloader = DataLoader(dataset, batch_size=8, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
seen, losses = [], []
for epoch in range(3):
    model.train()
    for idx, inputs, targets in dataloader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        if epoch == 0:
            seen += idx.tolist()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

accelerator.wait_for_everyone()
trained = accelerator.unwrap_model(model)
end = {n: p.detach().flatten().tolist() for n, p in trained.named_parameters()}
accelerator.end_training()
(start, end, seen, losses[0], losses[-1], len(dataloader))
"""


def test_accelerate_training_loop(pool: Pool) -> None:
    result = run(pool, ACCELERATE_LOOP)
    (start0, end0, seen0, first0, last0, batches0), (start1, end1, seen1, *_rest) = result.values
    # 64 samples in batches of 8 over 2 ranks: 4 batches each, a different half per rank
    assert batches0 == 4
    split_between_ranks([seen0, seen1], 64)
    assert start0 != start1  # the ranks really started apart ...
    equal_across_ranks([end0, end1])  # ... and DDP brought them together and kept them so
    assert end0 != start0
    assert last0 < first0 / 2, (first0, last0)
    # `end_training()` destroys the process group; the pool forms it again for the next cell
    assert run(pool, ALL_REDUCE).values == [3.0, 3.0]


# ---------------------------------------------------------------------------------- Lightning

LIGHTNING_FIT = """
import os
import psutil
import torch
import torch.nn.functional as F
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.seen = []
        self.processes_during_fit = None

    def forward(self, x):
        return self.net(x)

    def on_train_start(self):
        self.processes_during_fit = len(psutil.Process().children(recursive=True))

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        if self.current_epoch == 0:
            self.seen += idx.tolist()
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(200 + int(os.environ["RANK"]))  # each rank starts from its own weights
model = Regressor()
start = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g)
train = DataLoader(TensorDataset(torch.arange(64), x, x.sum(dim=1, keepdim=True)), batch_size=8)

processes_before = len(psutil.Process().children(recursive=True))
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    num_nodes=2,
    strategy="ddp",
    max_epochs=3,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    enable_checkpointing=False,
    default_root_dir=root_dir,
)
trainer.fit(model, train)

environment = trainer.strategy.cluster_environment
end = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
(trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank,
 type(environment).__name__, environment.creates_processes_externally,
 list(getattr(trainer.strategy.launcher, "procs", [])), processes_before,
 model.processes_during_fit, trainer.state.finished, start, end, model.seen)
"""


def test_lightning_trainer_fits_on_the_pool(pool: Pool, tmp_path: Path) -> None:
    result = run(pool, LIGHTNING_FIT, root_dir=str(tmp_path))
    for rank, value in enumerate(result.values):
        world, global_rank, local_rank, node_rank, environment, external, procs = value[:7]
        processes_before, processes_during, finished = value[7:10]
        assert (world, global_rank, local_rank, node_rank) == (2, rank, 0, rank)
        # torchrun's variables made Lightning take the processes as launched: it started none
        assert environment == "TorchElasticEnvironment"
        assert external is True and procs == []
        assert processes_during == processes_before
        assert finished is True
    start0, end0, seen0 = result.values[0][10:]
    start1, end1, seen1 = result.values[1][10:]
    assert start0 != start1
    equal_across_ranks([end0, end1])
    assert end0 != start0
    split_between_ranks([seen0, seen1], 64)
    # a plain cell after Lightning's fit (and teardown) still has the pool's group
    assert run(pool, ALL_REDUCE).values == [3.0, 3.0]


# ------------------------------------------------------------------------ Hugging Face Trainer

HF_TRAINER = """
import os
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.training_args import ParallelMode


class RandomSentences(Dataset):
    def __init__(self, n=128, length=16):
        g = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, 100, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.fetched = []

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        self.fetched.append(int(i))
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": torch.ones_like(self.input_ids[i]),
            "labels": self.labels[i],
        }


torch.manual_seed(300 + int(os.environ["RANK"]))  # each rank starts from its own weights
config = BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
)
model = BertForSequenceClassification(config)
start = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}

args = TrainingArguments(
    output_dir=output_dir,
    max_steps=20,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    logging_steps=5,
    save_strategy="no",
    report_to=[],
)
train_dataset = RandomSentences()
trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
output = trainer.train()

end = {n: p.detach().flatten().tolist() for n, p in trainer.model.named_parameters()}
(args.world_size, args.parallel_mode == ParallelMode.DISTRIBUTED, str(args.parallel_mode),
 args.process_index, args.local_process_index, args.device.type, output.global_step,
 trainer.state.epoch, start, end, train_dataset.fetched[:64])
"""


def test_hf_trainer_trains_distributed(pool: Pool, tmp_path: Path) -> None:
    result = run(pool, HF_TRAINER, output_dir=str(tmp_path / "out"))
    for rank, value in enumerate(result.values):
        world, distributed, mode, process_index, local_index, device, steps, epoch = value[:8]
        assert (world, distributed, mode) == (2, True, "ParallelMode.DISTRIBUTED")
        assert (process_index, local_index, device) == (rank, 0, "cpu")
        # 128 samples, 8 per rank and step, 2 ranks: 8 steps an epoch, 20 steps are 2.5 epochs
        assert (steps, epoch) == (20, 2.5)
    start0, end0, seen0 = result.values[0][8:]
    start1, end1, seen1 = result.values[1][8:]
    assert start0 != start1
    equal_across_ranks([end0, end1])
    assert end0 != start0
    split_between_ranks([seen0, seen1], 128)
