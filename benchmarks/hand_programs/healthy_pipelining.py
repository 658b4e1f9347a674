"""Healthy: torch.distributed.pipelining, a 2-stage GPipe schedule on 2 ranks (stage 0 and stage 1), 4
microbatches, 3 steps. Truth: silent."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

rank, world = _init(30.0)
torch.manual_seed(0)
layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2 * world)]
mod = nn.Sequential(*layers[2 * rank:2 * rank + 2])
mb = torch.empty(2, 16)
stage = PipelineStage(mod, rank, world, torch.device("cpu"), input_args=(mb,), output_args=mb)
loss_fn = (lambda o, t: nn.functional.mse_loss(o, t)) if rank == world - 1 else None
sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
opt = torch.optim.SGD(mod.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(0)
for step in range(3):
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
