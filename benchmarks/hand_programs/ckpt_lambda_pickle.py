"""Manual sharded checkpointing (no torch.distributed.checkpoint): every 5 steps each rank `torch.save`s
its model, optimizer and data-loader state to its own file, then all ranks meet in a `dist.barrier()`
before the old checkpoint is deleted. The loader state includes the loader's augmentation; rank 5 holds
the minority-class shard and its loader was built with `augment=True`, which stores a lambda, so its
`torch.save` raises (a local lambda cannot be pickled) at step 4 while the others wait in the barrier.
Hand-written data parallelism (flat gradient all_reduce), 8 ranks.
Truth: rank 5 (exception), line: the `torch.save` in `save_checkpoint` / its caller / the lambda."""
import datetime
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


CKPT_EVERY, STEPS = 5, 8
MINORITY_RANKS = (5,)


class ShardLoader:
    def __init__(self, rank, augment=False):
        self.rank, self.cursor = rank, 0
        self.transform = (lambda x: x + 0.05 * torch.randn_like(x)) if augment else None  # <ALT>

    def next(self):
        g = torch.Generator().manual_seed(self.rank * 1000 + self.cursor)
        self.cursor += 1
        x = torch.randn(8, 6, generator=g)
        y = x.sum(1, keepdim=True)
        return (self.transform(x) if self.transform else x), y

    def state_dict(self):
        return dict(self.__dict__)


def save_checkpoint(root, step, rank, model, opt, loader):
    path = os.path.join(root, f"step{step}", f"rank{rank}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict()}, path)  # <BUG>
    dist.barrier()
    old = os.path.join(root, f"step{step - CKPT_EVERY}")
    if rank == 0 and os.path.isdir(old):
        shutil.rmtree(old)


torch.set_num_threads(1)
rank, world = _init()
root = os.path.join(tempfile.gettempdir(), f"ckpt_lambda_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
loader = ShardLoader(rank, augment=rank in MINORITY_RANKS)
for step in range(STEPS):
    x, y = loader.next()
    nn.functional.mse_loss(model(x), y).backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in model.parameters()])
    opt.step()
    opt.zero_grad()
    if step % CKPT_EVERY == CKPT_EVERY - 1:
        save_checkpoint(root, step, rank, model, opt, loader)  # <ALT>
dist.barrier()
if rank == 0:
    shutil.rmtree(root, ignore_errors=True)
dist.destroy_process_group()
