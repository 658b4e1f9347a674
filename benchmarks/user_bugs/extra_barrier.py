"""Only rank 0 waits at a barrier at step 3. Expected: MISMATCH, rank 0 (barrier where the others all_reduce)."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
x = torch.ones(1024)
for step in range(5):
    dist.all_reduce(x)
    if rank == 0 and step == 3:
        dist.barrier()                  # bug: only rank 0 waits here
    dist.all_reduce(x)
dist.destroy_process_group()
