"""No bug but a slow rank: rank 2's data loading takes 150 ms more every step (a slow disk). DDP, 4 ranks,
12 steps. Truth: straggler rank 2, no hang; the job exits 0."""
import datetime
import sys
import time

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
for step in range(12):
    if rank == 2:
        time.sleep(0.15)
    x = torch.randn(8, 8)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
