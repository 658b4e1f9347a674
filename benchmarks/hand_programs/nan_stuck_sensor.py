"""Sensor regression with FSDP2 (fully_shard per layer and at the root), each batch standardized with its
own mean and std. A sensor in rank 1's shard got stuck for a few readings (a constant column in its
ninth batch), so that batch's std is 0, the standardized input is 0/0 = NaN at step 8, and the gradient
reduce-scatter spreads it to rank 0. 2 ranks, 16 steps.
Truth: NaN first from rank 1 (its data); the job exits 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


BATCH, FEATURES, STEPS = 8, 6, 16


def load_readings(rank):
    g = torch.Generator().manual_seed(40 + rank)
    readings = torch.randn(STEPS * BATCH, FEATURES, generator=g) * 3.0 + 10.0
    if rank == 1:
        readings[64:72, 3] = 9.75        # the stuck sensor: the same reading eight times
    return readings


def standardize(x):
    return (x - x.mean(0)) / x.std(0)


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
readings = load_readings(rank)
for step in range(STEPS):
    raw = readings[step * BATCH:(step + 1) * BATCH]
    target = raw[:, :1].sum(1, keepdim=True) * 0.1
    x = standardize(raw)
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 4 == 3:
        logged = loss.detach().reshape(1)
        dist.all_reduce(logged)
        if rank == 0:
            print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
