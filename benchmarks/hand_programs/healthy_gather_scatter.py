"""Healthy: a parameter-server step. Every rank gathers its gradient to the server (the last rank; the
`gather_list` exists only there), the server averages and clips, then scatters the update back (the
`scatter_list` exists only on the server); a world all_reduce of the loss closes each step. 4 ranks.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
server = world - 1
w = torch.zeros(16)
for step in range(5):
    x = torch.randn(8, 16)
    grad = x.t() @ (x @ w - 1.0) / 8
    parts = [torch.empty(16) for _ in range(world)] if rank == server else None
    dist.gather(grad, gather_list=parts, dst=server)
    updates = None
    if rank == server:
        avg = torch.stack(parts).mean(0)
        avg = avg * min(1.0, 1.0 / (avg.norm().item() + 1e-6))
        updates = [avg.clone() for _ in range(world)]
    upd = torch.empty(16)
    dist.scatter(upd, scatter_list=updates, src=server)
    w -= 0.1 * upd
    loss = ((x @ w - 1.0) ** 2).mean().reshape(1)
    dist.all_reduce(loss)
dist.destroy_process_group()
