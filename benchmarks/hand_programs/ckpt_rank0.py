"""Rank 0 alone gathers the full parameters for a checkpoint (every rank should call it: the helper
all-gathers). 4 ranks, dp-style all_reduce of grads each step; at step 3 rank 0 saves.
Truth: rank 0 (extra all_gather), line: the `save(full_params(...))` call."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()




def full_params(shards):
    out = []
    for s in shards:
        parts = [torch.empty_like(s) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, s)
        out.append(torch.cat(parts))
    return out


def save(tensors):
    torch.save(tensors, "/dev/null")


rank, world = _init()
shards = [torch.randn(32), torch.randn(8)]
for step in range(6):
    grads = [torch.randn_like(s) for s in shards]
    for g in grads:
        dist.all_reduce(g)
        g /= world
    for s, g in zip(shards, grads):
        s.sub_(0.1 * g)
    if step == 3 and rank == 0:  # <ALT>
        save(full_params(shards))  # <BUG>
dist.destroy_process_group()
