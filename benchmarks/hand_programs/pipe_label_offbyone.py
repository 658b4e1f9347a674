"""torch.distributed.pipelining, a 3-stage GPipe classifier (4 microbatches). The labels are read by the
last stage from a CSV export with 1-based class ids; the part file behind steps 4-5 was written by an
older exporter with 0-based ids, so a class 0 becomes -1 and cross_entropy raises in the loss function
on rank 2 while stages 0 and 1 wait for it. 3 ranks.
Truth: rank 2 (exception), line: the `cross_entropy` in the loss function / the `sched.step` call."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

NUM_CLASSES, BATCH, STEPS = 5, 8, 8


def export_part(part):
    """One part file of the label export: 2 steps of labels, as strings (part 2 came from the old tool)."""
    g = torch.Generator().manual_seed(500 + part)
    base = 0 if part == 2 else 1
    return [str(int(v) + base) for v in torch.randint(0, NUM_CLASSES, (2 * BATCH,), generator=g)]


def read_labels(step):
    rows = export_part(step // 2)[(step % 2) * BATCH:(step % 2 + 1) * BATCH]
    return torch.tensor([int(v) - 1 for v in rows])   # the export's ids are 1-based  # <ALT>


def loss_fn(logits, target):
    return F.cross_entropy(logits, target)  # <BUG>


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
dims = [12, 24, 24, NUM_CLASSES]
stages = [nn.Sequential(nn.Linear(dims[i], dims[i + 1]), nn.ReLU() if i < 2 else nn.Identity())
          for i in range(3)]
mod = stages[rank]
mb_in = torch.empty(BATCH // 4, dims[rank])
mb_out = torch.empty(BATCH // 4, dims[rank + 1])
stage = PipelineStage(mod, rank, world, torch.device("cpu"), input_args=(mb_in,), output_args=mb_out)
last = rank == world - 1
sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn if last else None)
opt = torch.optim.SGD(mod.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(0)
for step in range(STEPS):
    x = torch.randn(BATCH, dims[0], generator=gen)
    if rank == 0:
        sched.step(x)
    elif last:
        losses = []
        sched.step(target=read_labels(step), losses=losses)  # <ALT>
        if step % 2 == 1:
            print(f"step {step} loss {torch.stack(losses).mean():.4f}", flush=True)
    else:
        sched.step()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
