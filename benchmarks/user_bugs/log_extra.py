"""A 2 x 2 mesh (tp {0,1} {2,3}, dp {0,2} {1,3}), a loop with no optimizer; in iteration 2 rank 1 alone
all-reduces its loss on the world group for logging (an `if` on its rank). Its dp partner then waits
alone in a 2-member group, its tp partner in the next iteration. Expected: HANG, rank 1."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
tp = [dist.new_group(m) for m in ([0, 1], [2, 3])][rank // 2]
dp = [dist.new_group(m) for m in ([0, 2], [1, 3])][rank % 2]
act, grad, loss = torch.ones(64), torch.ones(256), torch.ones(1)
for i in range(5):
    dist.all_reduce(act, group=tp)
    if rank == 1 and i == 2:            # bug: a logging all_reduce only rank 1 runs
        dist.all_reduce(loss)
    dist.all_reduce(grad, group=dp)
dist.destroy_process_group()
