"""Rank 2 hangs outside any collective (a blocking call that never returns) at step 3, with the
process group's timeout far away; the job is then stopped from outside, as a scheduler's time
limit does: user_scripts.py SIGTERMs its whole process group. Expected: STUCK IN COMPUTE, rank 2
(every rank ends by SIGTERM; none of those is the cause)."""
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init(timeout_s=600)
w = torch.nn.Parameter(torch.ones(256))
opt = torch.optim.SGD([w], lr=0.1)
for i in range(5):
    loss = (w * w).sum(); loss.backward()
    if rank == 2 and i == 3:
        time.sleep(600)
    dist.all_reduce(w.grad)
    opt.step(); opt.zero_grad()
dist.destroy_process_group()
