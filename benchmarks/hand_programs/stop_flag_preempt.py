"""A while-loop driven by a stop flag that rank 0 broadcasts every 3 steps (it stops the job at a target
loss or a step budget). A later patch lets a rank that gets a preemption notice stop everyone by voting
with all_reduce(MAX); only that rank takes the new path, so at step 9 rank 2 posts an all_reduce where
its peers post the broadcast. DDP, 5 ranks.
Truth: rank 2 (all_reduce for broadcast), line: the vote's `dist.all_reduce` / the `if preempted`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


CHECK_EVERY, MAX_STEPS, TARGET_LOSS = 3, 24, 1e-3
# what each node's metadata endpoint answers (simulated): the node of rank 2 is reclaimed from step 8
RECLAIM_AT = {2: 8}


def preemption_notice(rank, step):
    return step >= RECLAIM_AT.get(rank, 1 << 30)


def should_stop(rank, step, loss):
    if preemption_notice(rank, step):  # <ALT>
        # preempted: any rank must be able to stop the job, so vote with MAX
        flag = torch.ones(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # <BUG>
    else:
        done = rank == 0 and (step >= MAX_STEPS or loss < TARGET_LOSS)
        flag = torch.tensor([1.0 if done else 0.0])
        dist.broadcast(flag, src=0)
    return flag.item() > 0


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.02)
gen = torch.Generator().manual_seed(rank)
step, stop = 0, False
while not stop:
    x = torch.randn(8, 10, generator=gen)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    opt.step()
    opt.zero_grad()
    step += 1
    if step % CHECK_EVERY == 0:
        stop = should_stop(rank, step, loss.item())
if rank == 0:
    torch.save(model.module.state_dict(), f"/tmp/stop_flag_preempt_{step}.pt")
dist.barrier()
dist.destroy_process_group()
