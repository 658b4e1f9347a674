"""At step 1 both ranks of each pair receive before they send (the even ranks broke their send-first
order). Expected: DEADLOCK between the ranks of a pair."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
x = torch.zeros(8)
for step in range(3):
    dist.all_reduce(x)
    peer = rank ^ 1
    if step == 1:                 # bug: both ranks of a pair receive first
        dist.recv(x, peer)
        dist.send(x, peer)
    elif rank % 2 == 0:
        dist.send(x, peer); dist.recv(x, peer)
    else:
        dist.recv(x, peer); dist.send(x, peer)
dist.destroy_process_group()
