"""Healthy: object collectives of every kind (broadcast_object_list, all_gather_object, gather_object,
scatter_object_list) between tensor all_reduces, on 4 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
x = torch.ones(16)
for step in range(4):
    dist.all_reduce(x)
    cfg = [{"step": step, "lr": 0.1}] if rank == 0 else [None]
    dist.broadcast_object_list(cfg, src=0)
    names = [None] * world
    dist.all_gather_object(names, f"rank{rank}-{step}")
    out = [None] * world if rank == 0 else None
    dist.gather_object({"r": rank}, out, dst=0)
    got = [None]
    dist.scatter_object_list(got, [i * step for i in range(world)] if rank == 0 else None, src=0)
dist.destroy_process_group()
