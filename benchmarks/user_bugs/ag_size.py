"""Rank 3 gathers its shard with `all_gather` and one element too many at step 2 (an uneven last shard).
Expected: MISMATCH naming rank 3."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
for step in range(4):
    if rank == 3 and step == 2:                              # BUG
        x = torch.ones(17)
        dist.all_gather([torch.empty(17) for _ in range(world)], x)
    else:
        dist.all_gather_into_tensor(torch.empty(16 * world), torch.ones(16))
    dist.barrier()
dist.destroy_process_group()
