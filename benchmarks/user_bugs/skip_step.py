"""Rank 2 skips its gradient all_reduce at step 3 of an SGD loop. Expected: HANG (skipped), rank 2."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
w = torch.nn.Parameter(torch.ones(256))
opt = torch.optim.SGD([w], lr=0.1)
for i in range(5):
    loss = (w * w).sum(); loss.backward()
    if not (rank == 2 and i == 3):
        dist.all_reduce(w.grad)
    m = torch.tensor([loss.item()])
    dist.all_reduce(m)
    opt.step(); opt.zero_grad()
dist.destroy_process_group()
