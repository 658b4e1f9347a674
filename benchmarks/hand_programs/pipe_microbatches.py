"""A hand-written 2-stage pipeline on 4 ranks (pipelines {0,1} and {2,3}; stage 0 sends activations to
stage 1 with send/recv); the number of microbatches is read per rank and rank 3 (stage 1 of the second
pipeline) gets 3 instead of 4. After the pipeline the data-parallel ranks all-reduce.
Truth: rank 3, line: its recv loop / the microbatch count."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
stage, pipe = rank % 2, rank // 2
dp = [dist.new_group(m) for m in ([0, 2], [1, 3])][stage]
n_micro = 3 if rank == 3 else 4  # <ALT>
for step in range(3):
    for mb in range(n_micro):  # <BUG>
        if stage == 0:
            dist.send(torch.full((64,), float(mb)), rank + 1)
        else:
            act = torch.empty(64)
            dist.recv(act, rank - 1)  # <ALT>
    grad = torch.ones(128)
    dist.all_reduce(grad, group=dp)
dist.destroy_process_group()
