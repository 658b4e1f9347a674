"""Rank 1 receives its third message from rank 0 with another tag than the two before (the sends
all keep tag 1). Expected: UNMATCHED P2P, rank 1 (not a deadlock between the pair)."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
t = torch.ones(8)
for i in range(3):
    dist.all_reduce(t)
    if rank == 0:
        dist.send(t, 1, tag=1)
    elif rank == 1:
        dist.recv(t, 0, tag=2 if i == 2 else 1)
dist.barrier()
dist.destroy_process_group()
