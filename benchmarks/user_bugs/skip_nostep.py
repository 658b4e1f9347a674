"""Rank 2 skips the first of two all_reduces in iteration 3 of a loop with no optimizer (no step numbers).
Expected: HANG (skipped), rank 2."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
a, b = torch.ones(256), torch.ones(8)
for i in range(5):
    if not (rank == 2 and i == 3):       # bug: rank 2 skips the gradient all_reduce once
        dist.all_reduce(a)
    dist.all_reduce(b)
dist.destroy_process_group()
