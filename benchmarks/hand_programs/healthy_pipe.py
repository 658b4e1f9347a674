"""Healthy: the hand-written 2-stage pipeline of pipe_microbatches.py with every rank on 4 microbatches,
plus a backward pass (stage 1 sends gradients back). 4 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(timeout_s=30.0)
stage = rank % 2
dp = [dist.new_group(m) for m in ([0, 2], [1, 3])][stage]
for step in range(4):
    for mb in range(4):
        if stage == 0:
            dist.send(torch.full((64,), float(mb)), rank + 1)
        else:
            act = torch.empty(64)
            dist.recv(act, rank - 1)
    for mb in range(4):
        if stage == 1:
            dist.send(torch.ones(64), rank - 1)
        else:
            g = torch.empty(64)
            dist.recv(g, rank + 1)
    grad = torch.ones(128)
    dist.all_reduce(grad, group=dp)
dist.destroy_process_group()
