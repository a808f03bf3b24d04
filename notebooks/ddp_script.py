"""A torchrun script, as the PyTorch DDP tutorial writes one: `torchrun --nproc-per-node 2
ddp_script.py --epochs 3`, or `%sky run ddp_script.py --epochs 3` on a warm pool."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x[:, :5].sum(dim=1) > 0).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        correct = seen = 0
        for bx, by in loader:
            optimizer.zero_grad()
            out = model(bx)
            nn.functional.cross_entropy(out, by).backward()
            optimizer.step()
            correct += (out.argmax(1) == by).sum().item()
            seen += len(by)
        totals = torch.tensor([correct, seen], dtype=torch.float64)
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch}: accuracy {100 * totals[0] / totals[1]:.1f}% "
                  f"on {int(totals[1])} samples from {os.environ['WORLD_SIZE']} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
