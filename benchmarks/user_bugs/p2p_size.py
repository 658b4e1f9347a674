"""Pairs (0,1) and (2,3) exchange a buffer each iteration and all-reduce; in iteration 2 rank 1 sends
24 floats where it always sent 16. gloo aborts the receiver, rank 0 (SIGABRT).
Expected: MISMATCH, rank 1 (the sender that changed), the abort as its consequence."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
peer = rank ^ 1
for i in range(4):
    n = 24 if (rank == 1 and i == 2) else 16       # bug: a bigger buffer, once
    if rank % 2 == 0:
        dist.recv(torch.empty(16), peer)
        dist.send(torch.ones(16), peer)
    else:
        dist.send(torch.ones(n), peer)
        dist.recv(torch.empty(16), peer)
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
