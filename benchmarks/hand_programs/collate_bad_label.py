"""A collate function turns raw records into tensors; rank 1's shard holds a malformed record (label
"n/a") in its 4th batch, so `int(label)` raises a ValueError inside the helper called from the training
loop: rank 1 dies while rank 0 waits for it in the DDP gradient all_reduce. 2 ranks.
Truth: rank 1 (exception), line: the `collate(records)` call in the loop / the `int(...)` in it."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def read_shard(rank, n_batches, batch=4):
    g = torch.Generator().manual_seed(rank)
    shard = [[{"feat": torch.randn(8, generator=g).tolist(), "label": str(i % 3)} for i in range(batch)]
             for _ in range(n_batches)]
    if rank == 1:
        shard[3][2]["label"] = "n/a"  # a malformed line in rank 1's data file
    return shard


def collate(records):
    x = torch.tensor([r["feat"] for r in records])
    y = torch.tensor([int(r["label"]) for r in records])  # <ALT>
    return x, y


rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for records in read_shard(rank, 6):
    x, y = collate(records)  # <BUG>
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
