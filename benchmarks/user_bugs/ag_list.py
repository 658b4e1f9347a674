"""all_gather into a list of output tensors; in iteration 2 rank 3's list is one short. gloo raises on
rank 3 inside the call; its peers then fail with "connection closed by peer".
Expected: DEAD RANK, rank 3, raised at its all_gather."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
for i in range(4):
    k = world - 1 if (rank == 3 and i == 2) else world      # bug: an output list one short
    out = [torch.empty(8) for _ in range(k)]
    dist.all_gather(out, torch.ones(8))
dist.destroy_process_group()
