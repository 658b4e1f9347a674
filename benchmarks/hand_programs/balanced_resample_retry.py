"""A class-balanced sampler draws a batch from the rank's current shard part and, if the batch holds no
positive example, draws again ("rejection sampling keeps every batch informative"), with no cap on the
tries. The positives of rank 1's second part (from step 4) were all dropped by an upstream filter, so
rank 1 spins in the sampler forever. Its peers wrap the gradient all_reduce in a retry loop that catches
the timeout `RuntimeError` and retries three times (the group is dead after the first timeout, so the
retries fail at once) before giving up. Hand-written data parallelism, 3 ranks.
Truth: rank 1 (stuck in compute), line: the `while` of the rejection loop / the `sample_batch` call."""
import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


PART_STEPS, BATCH, RETRIES = 4, 8, 3


def shard_part(rank, part):
    g = torch.Generator().manual_seed(100 * rank + part)
    x = torch.randn(64, 5, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0.8).float()
    if rank == 1 and part == 1:          # the upstream filter dropped every positive of this part
        x, y = x[y == 0], y[y == 0]
    return x, y


def sample_batch(x, y, g):
    idx = torch.randint(len(x), (BATCH,), generator=g)
    while y[idx].sum() == 0:  # <BUG>
        idx = torch.randint(len(x), (BATCH,), generator=g)
    return x[idx], y[idx]


def all_reduce_with_retry(t, rank):
    for attempt in range(RETRIES):
        try:
            dist.all_reduce(t)
            return t
        except RuntimeError as e:
            print(f"[rank {rank}] all_reduce failed ({str(e)[:80]}...), retry {attempt + 1}/{RETRIES}",
                  flush=True)
            time.sleep(1.0)
    raise RuntimeError(f"gradient all_reduce failed {RETRIES} times")


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for step in range(8):
    if step % PART_STEPS == 0:
        x_all, y_all = shard_part(rank, step // PART_STEPS)
    xb, yb = sample_batch(x_all, y_all, g)  # <ALT>
    loss = nn.functional.binary_cross_entropy_with_logits(model(xb).squeeze(1), yb)
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    all_reduce_with_retry(flat, rank)
    torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in model.parameters()])
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
