"""Gradient accumulation with DDP `no_sync()`; the accumulation count comes from the local batch size,
and rank 2's loader gives a bigger batch, so it syncs every 2 micro-steps while the others sync every 4.
Rank 2 issues twice as many gradient all_reduces. 4 ranks, 8 micro-steps.
Truth: rank 2, line: the accumulation `if` / backward outside no_sync."""
import contextlib
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
local_batch = 8 if rank == 2 else 4  # <ALT>
accum = 16 // local_batch  # <ALT>
for micro in range(8):
    x = torch.randn(local_batch, 8)
    sync = (micro + 1) % accum == 0
    ctx = contextlib.nullcontext() if sync else model.no_sync()
    with ctx:
        model(x).square().mean().backward()  # <BUG>
    if sync:
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
