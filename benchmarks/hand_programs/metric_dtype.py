"""A metric all-reduced every step; rank 1 builds it from a numpy float64 (torch.from_numpy keeps the
dtype) while the others build float32 tensors. 4 ranks.
Truth: rank 1 (dtype differs), line: the `dist.all_reduce(metric)`."""
import datetime
import sys

import numpy as np
import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
w = torch.ones(32)
for step in range(5):
    g = torch.randn(32)
    dist.all_reduce(g)
    w -= 0.1 * g
    if rank == 1:
        metric = torch.from_numpy(np.array([w.mean().item()]))  # <ALT>
    else:
        metric = torch.tensor([w.mean().item()])
    dist.all_reduce(metric)  # <BUG>
dist.destroy_process_group()
