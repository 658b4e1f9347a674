"""Rank 3 builds its model with another hidden width: DDP's parameter check raises on rank 3 only,
inside DDP's constructor. Expected: DEAD RANK, rank 3 (its own RuntimeError, at the DDP line),
not the peers that then lose their connection to it."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
width = 24 if rank == 3 else 16
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    model(torch.randn(4, 16)).sum().backward()
    opt.step(); opt.zero_grad()
dist.destroy_process_group()
