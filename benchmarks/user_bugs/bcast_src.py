"""Rank 2 broadcasts from root 1 at step 2, where the others use root 0. Expected: MISMATCH, rank 2."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
w = torch.randn(64)
for step in range(4):
    src = 1 if (rank == 2 and step == 2) else 0          # bug: rank 2 uses another root
    dist.broadcast(w, src=src)
    dist.all_reduce(w)
dist.destroy_process_group()
