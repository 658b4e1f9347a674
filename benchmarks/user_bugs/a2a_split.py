"""Rank 1 passes a wrong input_split_sizes to all_to_all_single at step 2 (same total rows, so no
size check can see it). Expected: MISMATCH, rank 1 (what it sends is not what its peers expect)."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
for step in range(4):
    splits = [2] * world
    if rank == 1 and step == 2:
        splits = [3, 1] + [2] * (world - 2)
    out = torch.empty(2 * world, 4)
    dist.all_to_all_single(out, torch.ones(sum(splits), 4), output_split_sizes=[2] * world,
                           input_split_sizes=splits)
dist.destroy_process_group()
