"""Pair groups built on every rank; at step 2 rank 1 passes the even ranks' group, which it is not in:
torch returns at once (with a warning) and rank 3 waits on the odd group. Expected: WRONG GROUP, rank 1."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
evens = dist.new_group([0, 2])
odds = dist.new_group([1, 3])
mine = evens if rank % 2 == 0 else odds
x = torch.ones(4)
for step in range(4):
    g = evens if (rank == 1 and step == 2) else mine          # BUG on rank 1
    dist.all_reduce(x, group=g)
    dist.all_reduce(x)
dist.destroy_process_group()
