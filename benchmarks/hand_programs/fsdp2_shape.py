"""FSDP2 (fully_shard) on 4 ranks; rank 1 reads a different hidden size from its config and builds a
model whose parameters differ in size, so its all_gathers of parameters differ.
Truth: rank 1 (size), line: the model call/forward (the all_gather is in FSDP)."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
hidden = 48 if rank == 1 else 32  # <ALT>
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    loss = model(torch.randn(8, 16)).square().mean()  # <BUG>
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
