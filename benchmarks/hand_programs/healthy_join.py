"""Healthy: DDP with uneven inputs handled by the Join context manager: rank r has 4 + 2*r batches by
design, and `with Join([model]):` shadows the finished ranks' gradient all_reduces until every rank is
done; then a final all_reduce of the sample counts. 3 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [torch.randn(4, 8) for _ in range(4 + 2 * rank)]
seen = torch.zeros(1)
with Join([model]):
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen += x.shape[0]
dist.all_reduce(seen)
dist.destroy_process_group()
