"""Epochs of micro-batches with a per-epoch token budget: each rank counts the tokens it has seen and
`break`s out of the micro-batch loop once it is over budget. Rank 2's shard has longer sequences, so it
leaves the inner loop after 3 micro-batches while the others run all 4; its epoch-end all_reduce of the
loss then meets their 4th DDP gradient all_reduce. DDP, 4 ranks, 3 epochs of 4 micro-batches.
Truth: rank 2 (left its inner loop early), line: the inner `for mb` loop / the `break`."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seq_len = 12 if rank == 2 else 8  # <ALT>
token_budget = 36
for epoch in range(3):
    tokens, total = 0, torch.zeros(1)
    for mb in range(4):  # <BUG>
        x = torch.randn(seq_len, 8)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total += loss.detach()
        tokens += x.shape[0]
        if tokens >= token_budget:  # <ALT>
            break  # <ALT>
    dist.all_reduce(total)
dist.destroy_process_group()
