"""Batches are read from shard files that a preprocessing step writes; the loader polls until its file
appears. The preprocessing of rank 2's shard for step 3 never happened (its worker crashed), so rank 2
polls forever inside the loader while the others wait for it in the DDP gradient all_reduce. 4 ranks.
Truth: rank 2 (stuck in compute), line: the `wait_for_shard(...)` call / its poll loop."""
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def preprocess(rank, out_dir, steps):
    for step in range(steps):
        if rank == 2 and step == 3:
            continue  # this shard's preprocessing worker crashed
        torch.save(torch.randn(8, 8), os.path.join(out_dir, f"shard-{rank}-{step}.pt"))


def wait_for_shard(path, poll_s=0.5):
    while not os.path.exists(path):  # <ALT>
        time.sleep(poll_s)  # <ALT>
    return torch.load(path)


rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with tempfile.TemporaryDirectory(prefix=f"shards-r{rank}-") as out_dir:
    preprocess(rank, out_dir, 6)
    for step in range(6):
        x = wait_for_shard(os.path.join(out_dir, f"shard-{rank}-{step}.pt"))  # <BUG>
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
