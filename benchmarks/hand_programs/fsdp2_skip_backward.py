"""FSDP2 on 4 ranks; at step 2 rank 0 finds a non-finite loss and skips backward and the optimizer step
(a rank-local guard), so its reduce-scatters of gradients are missing for that step.
Truth: rank 0 (skipped reduce_scatter), line: the `continue`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


from torch.distributed.fsdp import fully_shard

rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
fully_shard(model[0])
fully_shard(model[2])
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    loss = model(torch.randn(8, 16)).square().mean()
    if rank == 0 and step == 2:  # <ALT>
        continue  # <BUG>
    loss.backward()  # <ALT>
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
