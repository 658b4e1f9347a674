"""Rank-local early stopping: each rank checks its own loss and leaves the loop; rank 3's data is easy
and it stops at step 4 while the others go on to all-reduce. 4 ranks.
Truth: rank 3 (left its loop early), line: the `break`."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
w = torch.ones(64)
scale = 0.5 if rank == 3 else 1.0
for step in range(10):  # <ALT>
    loss = (w * scale).square().mean() / (step + 1)
    if loss.item() < 0.05:  # <ALT>
        break  # <BUG>
    g = w.clone()
    dist.all_reduce(g)
    w.sub_(0.01 * g / world)
stats = torch.tensor([float(step)])
dist.all_reduce(stats)
dist.destroy_process_group()
