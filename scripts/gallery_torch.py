"""The gallery's PyTorch notebooks: FSDP2, the HF Trainer, Accelerate, Lightning, a torchrun
script (``scripts/make_gallery.py`` writes them).
"""

from __future__ import annotations

from gallery_cells import DOWN, LOAD, Cell

TORCH: dict[str, list[Cell]] = {}

TORCH["02_fsdp2"] = [
    (
        "md",
        """
# FSDP2: a sharded model that stays sharded across cells

`fully_shard` (PyTorch's FSDP2) splits every parameter between the ranks: each holds only its
shard, and gathers a layer's full weights just for its forward and backward. On a pool the model,
its shards and the optimizer's state live on in the ranks between cells, so the second cell
carries on training where the first stopped. gloo runs it here on CPU; on GPUs the same cell
uses NCCL.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from skyward_jupyter import instance_info

torch.manual_seed(0)                      # the same initial model everywhere
layers = [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1)]
model = nn.Sequential(*layers)
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

data = torch.Generator().manual_seed(dist.get_rank())   # each rank its own batches
true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(42))

def train(steps):
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data)
        loss = nn.functional.mse_loss(model(x), x @ true_w)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()

first_loss = train(1)
loss = train(60)
mine = sum(p.to_local().numel() for p in model.parameters())
full = sum(p.numel() for p in model.parameters())
if instance_info().is_head:
    print(f"loss {first_loss:.2f} -> {loss:.3f}; this rank holds {mine} of {full} parameters")
""",
    ),
    (
        "code",
        """
%%sky
# Still sharded, still warm: train on, then gather the full model on every rank.
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

loss = train(60)
state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
flat = torch.cat([v.flatten() for v in state.values()])
copies = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(copies, flat)
{"world_size": dist.get_world_size(), "first_loss": round(first_loss, 3), "loss": round(loss, 4),
 "shard_fraction": round(mine / full, 2), "parameters": flat.numel(),
 "same_model_on_every_rank": all(torch.equal(copies[0], c) for c in copies)}
""",
        "result",
    ),
    DOWN,
]

TORCH["03_hf_trainer"] = [
    (
        "md",
        """
# The Hugging Face Trainer, as written for torchrun

The `Trainer` finds the pool's world the way it finds torchrun's (`LOCAL_RANK`, `WORLD_SIZE`,
the process group already up), so the usual script body runs unchanged in a `%%sky` cell: it
trains data parallel over both ranks. The model is a tiny BERT built from a config, so nothing
is downloaded; a Hugging Face token in the notebook's `HF_TOKEN` would reach every rank (over
the ranks' channel only) for a model that needs one.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2
import tempfile
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class RandomSentences(Dataset):
    def __init__(self, n=256, length=16):
        g = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, 100, (n, length), generator=g)
        self.labels = (self.input_ids[:, 0] > 50).long()   # learnable: look at the first token

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i],
                "attention_mask": torch.ones_like(self.input_ids[i]),
                "labels": self.labels[i]}


torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=37)
model = BertForSequenceClassification(config)
with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(output_dir=output_dir, max_steps=40, per_device_train_batch_size=8,
                             learning_rate=2e-3, logging_steps=10, save_strategy="no",
                             report_to=[])
    trainer = Trainer(model=model, args=args, train_dataset=RandomSentences())
    output = trainer.train()
""",
    ),
    (
        "code",
        """
%%sky
{"world_size": args.world_size, "parallel_mode": str(args.parallel_mode),
 "steps": output.global_step, "loss": round(output.training_loss, 4)}
""",
        "result",
    ),
    DOWN,
]

TORCH["04_accelerate"] = [
    (
        "md",
        """
# An Accelerate training loop

`Accelerator()` reads the launcher's variables, which every rank of a pool has, so it reports
both processes and distributes the model, the optimizer and the data loader over them, as
under `accelerate launch`. `end_training()` ends the process group at the end, as scripts do;
the pool forms it again before the next cell.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
x = torch.randn(512, 4, generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

for epoch in range(5):
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
    mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
    accelerator.print(f"epoch {epoch}: loss {mean_loss:.4f}")   # the main process prints
accelerator.end_training()
result = {"num_processes": accelerator.num_processes,
          "distributed_type": str(accelerator.distributed_type),
          "batches_per_rank": len(loader), "loss": round(mean_loss, 4)}
""",
    ),
    (
        "code",
        """
%%sky
result
""",
        "result",
    ),
    DOWN,
]

TORCH["05_lightning"] = [
    (
        "md",
        """
# A Lightning module, trained by the pool's ranks

Lightning sees torchrun's variables on every rank and takes the processes as already launched:
`Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp")` trains on the pool's two
ranks and starts no processes of its own.
""",
    ),
    LOAD,
    (
        "code",
        """
%%sky --nodes 2
import torch
import torch.nn.functional as F
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(512, 4, generator=torch.Generator().manual_seed(1))
train = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
model = Regressor()
trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_epochs=5,
                    enable_progress_bar=False, enable_model_summary=False, logger=False,
                    enable_checkpointing=False)
trainer.fit(model, train)
""",
    ),
    (
        "code",
        """
%%sky
environment = type(trainer.strategy.cluster_environment).__name__
{"world_size": trainer.world_size, "environment": environment, "finished": trainer.state.finished,
 "loss": round(trainer.callback_metrics["train_loss"].item(), 4)}
""",
        "result",
    ),
    DOWN,
]

TORCH["06_torchrun_script"] = [
    (
        "md",
        """
# A torchrun script on the warm pool

`ddp_script.py` beside this notebook is an ordinary torchrun script: it parses its arguments,
calls `init_process_group()`, trains a DDP model and calls `destroy_process_group()`. `%sky run`
runs it on every rank as `__main__` with its own `sys.argv`; its `init_process_group` finds the
pool's group, and the pool forms the group again after the script destroyed it. A second run
starts no interpreter, imports no torch and waits for no rendezvous.
""",
    ),
    LOAD,
    ("code", "%sky run --nodes 2 ddp_script.py --epochs 3 --lr 0.05"),
    ("code", "%sky run ddp_script.py --epochs 2 --lr 0.02"),
    (
        "code",
        """
%%sky
import torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
{"world_size": dist.get_world_size(), "all_reduce": t.item()}
""",
        "result",
    ),
    DOWN,
]
