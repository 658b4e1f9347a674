"""Weights are broadcast from rank 0 by `sync_weights()` at the start, and rank 0 keeps the best
checkpoint by validation loss (it alone holds the held-out set). A later patch adds a rollback: when the
validation loss gets 10 % worse than the best, rank 0 reloads the best checkpoint and calls
`sync_weights(model)` again "so every replica restarts from it"; but only rank 0 takes that branch, so
its parameter broadcasts meet its peers' next DDP gradient all_reduce. A corrupted shard part behind
steps 4-5 (labels flipped) makes the validation loss jump at step 4. DDP, 5 ranks.
Truth: rank 0 (extra broadcasts), line: the `sync_weights(model)` call in the rollback branch / its `if`."""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


STEPS, BAD_STEPS = 10, (4, 5)


def sync_weights(module):
    for p in module.parameters():
        dist.broadcast(p.data, src=0)  # <ALT>


def batch(gen, step):
    x = torch.randn(32, 6, generator=gen)
    y = x @ torch.arange(1.0, 7.0).unsqueeze(1)
    if step in BAD_STEPS:          # the corrupted part of the shard: labels with the wrong sign
        y = -3.0 * y
    return x, y


torch.set_num_threads(1)
rank, world = _init()
net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
sync_weights(net)
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.02)
gen = torch.Generator().manual_seed(100 + rank)
ckpt = os.path.join(tempfile.gettempdir(), f"rollback_best_{os.getpid()}.pt")
if rank == 0:
    vg = torch.Generator().manual_seed(999)
    val_x = torch.randn(64, 6, generator=vg)
    val_y = val_x @ torch.arange(1.0, 7.0).unsqueeze(1)
    best = float("inf")
for step in range(STEPS):
    x, y = batch(gen, step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        with torch.no_grad():
            val = nn.functional.mse_loss(net(val_x), val_y).item()
        print(f"step {step} loss {loss.item():.3f} val {val:.3f}", flush=True)
        if val < best:
            best = val
            torch.save(net.state_dict(), ckpt)
        elif val > 1.1 * best:  # <ALT>
            net.load_state_dict(torch.load(ckpt))
            sync_weights(model)  # <BUG>
if rank == 0 and os.path.exists(ckpt):
    os.remove(ckpt)
dist.destroy_process_group()
