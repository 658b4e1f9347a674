"""Sharded checkpoints every 2 steps with a `dist.barrier()` in a `finally:` "so that every rank always
reaches it", but the check that skips a shard an earlier attempt already wrote `continue`s before the
`try`: rank 1's step-3 shard survived from the previous (crashed) attempt, so rank 1 skips the barrier
and goes on to the next step's gradient all_reduces. Manual gradient averaging, 3 ranks.
Truth: rank 1 (skipped barrier), line: the `continue` / the `if os.path.exists(...)`."""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def shard_path(ckpt_dir, step, rank):
    return os.path.join(ckpt_dir, f"step{step:04d}-shard{rank}.pt")


def leftovers_of_previous_attempt(ckpt_dir, rank):
    # the previous attempt died while saving step 3: only rank 1 had finished its shard
    if rank == 1:
        torch.save({}, shard_path(ckpt_dir, 3, rank))


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with tempfile.TemporaryDirectory(prefix=f"ckpt-r{rank}-") as ckpt_dir:
    leftovers_of_previous_attempt(ckpt_dir, rank)
    for step in range(7):
        x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            continue
        path = shard_path(ckpt_dir, step, rank)
        if os.path.exists(path):  # <ALT>
            continue  # <BUG>
        try:
            torch.save(model.state_dict(), path)
        finally:
            dist.barrier()  # <ALT>
dist.destroy_process_group()
