"""A ring exchange with batch_isend_irecv on 4 ranks (send to rank+1, receive from rank-1); at step 3
rank 2 computes its source as rank+1 (a sign error in a refactored helper), so rank 2 waits for a message
rank 3 never sends and rank 1's send to rank 2 is never received.
Truth: rank 2 (wrong peer), line: its irecv."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()




def neighbours(r, w, step):
    src = (r + 1) % w if (r == 2 and step == 3) else (r - 1) % w  # <BUG>
    return (r + 1) % w, src


rank, world = _init()
for step in range(5):
    dst, src = neighbours(rank, world, step)  # <ALT>
    out, inp = torch.full((32,), float(rank)), torch.empty(32)
    ops = [dist.P2POp(dist.isend, out, dst), dist.P2POp(dist.irecv, inp, src)]  # <ALT>
    for req in dist.batch_isend_irecv(ops):  # <ALT>
        req.wait()
    dist.all_reduce(inp)
dist.destroy_process_group()
