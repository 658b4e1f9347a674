"""A loss logger: every 4 steps each rank `dist.reduce`s its running loss to rank 0, which writes the
TensorBoard scalars. The checkpoints are written by the last rank (the only one on the node with the
shared disk), and a later patch makes it keep the checkpoint with the best global loss; the patch author
needed the global loss on the last rank too and changed the call in `log_loss()` to `dist.all_reduce` for
that rank only, so at step 3 rank 6 posts an all_reduce where its peers post a reduce. DDP, 7 ranks.
Truth: rank 6 (all_reduce for reduce), line: its `dist.all_reduce` in `log_loss()` / the `if`."""
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


LOG_EVERY = 4


def log_loss(running, steps, rank, world, ckpt_rank):
    t = torch.tensor([running / steps])
    if rank == ckpt_rank:  # <ALT>
        dist.all_reduce(t)  # the checkpointing rank needs the global loss too  # <BUG>
    else:
        dist.reduce(t, dst=0)
    global_loss = t.item() / world
    if rank == 0:
        print(f"loss {global_loss:.4f}", flush=True)
    return global_loss


torch.set_num_threads(1)
rank, world = _init()
ckpt_rank = world - 1
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(rank)
best, running = float("inf"), 0.0
ckpt = os.path.join(tempfile.gettempdir(), f"reduce_logger_best_{os.getpid()}.pt")
for step in range(12):
    x = torch.randn(16, 12, generator=gen)
    y = (x[:, :3] > 0).long().sum(1)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    running += loss.item()
    if step % LOG_EVERY == LOG_EVERY - 1:
        global_loss = log_loss(running, LOG_EVERY, rank, world, ckpt_rank)  # <ALT>
        running = 0.0
        if rank == ckpt_rank and global_loss < best:
            best = global_loss
            torch.save(model.module.state_dict(), ckpt)
if rank == ckpt_rank and os.path.exists(ckpt):
    os.remove(ckpt)
dist.destroy_process_group()
