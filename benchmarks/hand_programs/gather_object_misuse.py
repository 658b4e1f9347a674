"""Collecting per-rank results: every rank calls `dist.gather_object` to rank 0, but rank 2 (a code
path for a different output format) calls `all_gather_object`. 4 ranks.
Truth: rank 2, line: its all_gather_object call."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
x = torch.ones(16)
for step in range(3):
    dist.all_reduce(x)
    x /= world
result = {"rank": rank, "score": float(x.sum())}
if rank == 2:  # <ALT>
    everyone = [None] * world
    dist.all_gather_object(everyone, result)  # <BUG>
else:
    out = [None] * world if rank == 0 else None
    dist.gather_object(result, out, dst=0)
dist.barrier()
dist.destroy_process_group()
