"""Healthy: groups that leave ranks out (every rank creates every group, as torch requires); collectives
only by members, some groups of 3, a broadcast from a non-zero root, a barrier on a subgroup. 4 ranks.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
g012 = dist.new_group([0, 1, 2])
g13 = dist.new_group([1, 3])
g23 = dist.new_group([2, 3])
t = torch.ones(8)
for step in range(5):
    if rank in (0, 1, 2):
        dist.all_reduce(t, group=g012)
    if rank in (1, 3):
        dist.broadcast(t, src=3, group=g13)
    if rank in (2, 3):
        dist.barrier(group=g23)
    dist.all_reduce(t)
    t /= t.max()
dist.destroy_process_group()
