"""An uneven data shard: each rank iterates over its own list of batches and rank 1 has one batch fewer
(the dataset did not split evenly and drop_last was off); after the loop every rank all-reduces its
epoch loss. DDP, 4 ranks.
Truth: rank 1 (left its loop early), line: the `for batch in shard` loop."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
shard = [torch.randn(4, 8) for _ in range(5 if rank == 1 else 6)]  # <ALT>
total = torch.zeros(1)
for batch in shard:  # <BUG>
    loss = model(batch).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total += loss.detach()
dist.all_reduce(total)
dist.destroy_process_group()
