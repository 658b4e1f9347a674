"""Rank 0 reads the schedule (warmup and decay steps) from the job config at every epoch and broadcasts
it as a tensor; the others receive into `torch.empty(2)` (float32), but rank 0 builds its tensor from
Python ints, which makes it int64, so the broadcast's item size differs on the root. 4 ranks, 3 epochs.
Truth: rank 0 (dtype differs), line: the `dist.broadcast(sched, src=0)`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def read_schedule(epoch):
    return {"warmup_steps": 3 if epoch == 0 else 0, "decay_every": 2}


rank, world = _init()
w = torch.zeros(16)
lr = 0.1
for epoch in range(3):
    if rank == 0:
        sched = torch.tensor(list(read_schedule(epoch).values()))  # <ALT>
    else:
        sched = torch.empty(2)
    dist.broadcast(sched, src=0)  # <BUG>
    warmup, decay_every = (int(v) for v in sched.tolist())
    for step in range(4):
        g = torch.randn(16)
        dist.all_reduce(g)
        scale = min(1.0, (step + 1) / warmup) if warmup else 1.0
        w -= lr * scale * g / world
        if (step + 1) % decay_every == 0:
            lr *= 0.9
dist.destroy_process_group()
