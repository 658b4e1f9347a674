"""Checkpointing on rank 0 followed by a barrier "so that nobody reads a half-written file", but the
`dist.barrier()` is indented one level too deep, under `if rank == 0:`: only rank 0 posts it, while the
others go on to the next step's gradient all_reduces. Manual gradient averaging, 4 ranks, a checkpoint
every 3 steps.
Truth: rank 0 (extra barrier), line: the `dist.barrier()`."""
import datetime
import os
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(7):
    model(torch.randn(8, 16)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
    if step % 3 == 2:
        if rank == 0:  # <ALT>
            torch.save(model.state_dict(), os.devnull)
            dist.barrier()  # <BUG>
dist.destroy_process_group()
