"""Writes notebooks/01_quickstart.ipynb from the cells below (the notebook is committed too).

Keeping the source here makes the notebook reviewable as code; re-run after editing:
``python scripts/make_quickstart.py``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

HYPERPARAMETERS = {"EPOCHS": 6, "BATCH_SIZE": 64, "LR": 0.05, "SAMPLES": 4096}

# The training cell's data, model and optimiser (the ranks' namespace: torch, nn, DDP and the
# data classes imported, the hyper-parameters above). bench/bench_log.py times this same setup.
DATA_AND_MODEL = """\
torch.manual_seed(0)                       # the same data on every rank; the sampler splits it
teacher = torch.randn(100, 10)
x = torch.randn(SAMPLES, 100)
y = (x @ teacher).argmax(dim=1)
dataset = TensorDataset(x, y)
sampler = DistributedSampler(dataset, shuffle=True)
loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

model = DDP(nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
"""

CELLS: list[tuple[str, str]] = [
    (
        "markdown",
        "# Quickstart: PyTorch DDP from a notebook cell\n\n"
        "`%%sky --nodes 2` runs the cell on two ranks of a warm pool, with `torch.distributed` "
        "already initialised (gloo here, NCCL on GPUs). The notebook's globals the cell reads "
        "travel with it; only the head's output is shown; the head's last value is the cell's "
        "value. This is the seeds' DDP guide (model, `DistributedDataParallel`, "
        "`DistributedSampler`, `all_reduce` metrics, head-only logging) on the local provider.",
    ),
    ("code", "%load_ext skyward_jupyter"),
    (
        "code",
        "# Hyper-parameters live in the notebook; the cell below reads them, so they travel.\n"
        + "\n".join(f"{name} = {value}" for name, value in HYPERPARAMETERS.items()),
    ),
    (
        "code",
        """%%sky --nodes 2
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from skyward_jupyter import instance_info, log

info = instance_info()
"""
        + DATA_AND_MODEL
        + """
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    stats = torch.zeros(3, dtype=torch.float64)   # loss sum, correct, seen
    for bx, by in loader:
        optimizer.zero_grad()
        out = model(bx)
        loss = loss_fn(out, by)
        loss.backward()
        optimizer.step()
        stats += torch.tensor([loss.item() * len(by), (out.argmax(1) == by).sum().item(), len(by)],
                              dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)  # every rank now holds the global figures
    avg_loss, accuracy = (stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()
    log(step=epoch, loss=avg_loss, accuracy=accuracy)
    if info.is_head:
        print(f"epoch {epoch}: loss {avg_loss:.4f}, accuracy {accuracy:.1f}%")

{"world_size": dist.get_world_size(), "final_loss": round(avg_loss, 4),
 "accuracy": round(accuracy, 1)}""",
    ),
    (
        "code",
        "%%sky\n# The pool is still warm: the model trained above is still here on every rank.\n"
        "params = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
        "gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]\n"
        "dist.all_gather(gathered, params)\n"
        "all(torch.equal(gathered[0], g) for g in gathered)  # DDP kept the replicas equal",
    ),
    (
        "markdown",
        "Every `%%sky` cell shows the pool's live panel: its nodes and their state, each rank's "
        "output in a tab, and what the ranks `log()`, reduced across ranks per step (mean, "
        "min and max) as a table and a chart, with buttons to interrupt the cell or shut the "
        "pool down. `%sky metrics` returns the same figures as rows:",
    ),
    ("code", "%sky metrics"),
    ("code", "%sky down"),
]


def main() -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for kind, text in CELLS:
        maker = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(maker(text))
    path = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
    nbformat.write(nb, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
