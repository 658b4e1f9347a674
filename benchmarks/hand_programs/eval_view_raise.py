"""Evaluation under `torch.no_grad()` after every 2 training steps: the 50 validation examples are split
into contiguous chunks of ceil(50 / 6) = 9, so rank 5 gets only 5, and the eval loop flattens each batch
with `.view(EVAL_BATCH, -1)`; rank 5's last batch holds 2 examples and the view raises a RuntimeError,
while the other ranks wait for it in the all_reduce of the eval loss. DDP, 6 ranks.
Truth: rank 5 (exception), line: the `.view(EVAL_BATCH, -1)` / the `evaluate(...)` call."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


EVAL_BATCH = 3


def val_shard(rank, world, n=50):
    data = torch.randn(n, 4, 2, generator=torch.Generator().manual_seed(7))
    per = math.ceil(n / world)
    return data[rank * per:(rank + 1) * per]


def evaluate(model, shard):
    model.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for i in range(0, len(shard), EVAL_BATCH):
            x = shard[i:i + EVAL_BATCH].view(EVAL_BATCH, -1)  # <BUG>
            total += torch.stack([model(x).square().sum(), torch.tensor(float(len(x)))])
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
shard = val_shard(rank, world)
for step in range(6):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if step % 2 == 1:
        val_loss = evaluate(model.module, shard)  # <ALT>
        if rank == 0:
            print(f"step {step}: val loss {val_loss:.4f}", flush=True)
dist.destroy_process_group()
