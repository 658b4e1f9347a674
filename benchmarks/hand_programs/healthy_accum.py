"""Healthy: DDP gradient accumulation with no_sync() (every rank syncs every 4 micro-steps), a metric
all_reduce and a gather_object at the end. 4 ranks. Truth: no finding of error severity, exit 0."""
import contextlib
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(timeout_s=30.0)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for micro in range(12):
    sync = (micro + 1) % 4 == 0
    with contextlib.nullcontext() if sync else model.no_sync():
        model(torch.randn(4, 8)).square().mean().backward()
    if sync:
        opt.step()
        opt.zero_grad()
        m = torch.tensor([float(micro)])
        dist.all_reduce(m)
out = [None] * world if rank == 0 else None
dist.gather_object({"rank": rank}, out, dst=0)
dist.destroy_process_group()
