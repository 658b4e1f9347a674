"""A chain of 4 stages (activations 0 -> 1 -> 2 -> 3, gradients back), no optimizer; in iteration 3 rank 2
waits for the gradient from rank 3 before it sends rank 3 its activation (an order swap after three
regular iterations). Ranks 2 and 3 then both wait in recv from each other.
Expected: UNMATCHED P2P, rank 2 (the one that left its loop), not both ranks of the cycle."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
x = torch.ones(16)
for i in range(5):
    if rank > 0:
        dist.recv(x, rank - 1)
    if rank == 2 and i == 3:                # bug: the gradient awaited before the activation is sent
        dist.recv(x, rank + 1)
        dist.send(x, rank + 1)
    elif rank < world - 1:
        dist.send(x, rank + 1)
        dist.recv(x, rank + 1)
    if rank > 0:
        dist.send(x, rank - 1)
    dist.all_reduce(x)
dist.destroy_process_group()
