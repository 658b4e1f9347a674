"""A ring of sends and recvs (0 -> 1 -> 2 -> 3 -> 0) and an all_reduce per iteration, no optimizer; in
iteration 2 rank 0 sends to rank 2 instead of rank 1 (an off-by-one in its peer). Ranks 0-2 then wait
on each other in a cycle, rank 3 on rank 0. Expected: UNMATCHED P2P, rank 0, at its send."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
x = torch.ones(16)
for i in range(4):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if rank == 0 and i == 2:
        nxt = 2                          # bug: the wrong peer
    if rank % 2 == 0:
        dist.send(x, nxt)
        dist.recv(x, prv)
    else:
        dist.recv(x, prv)
        dist.send(x, nxt)
    dist.all_reduce(x)
dist.destroy_process_group()
