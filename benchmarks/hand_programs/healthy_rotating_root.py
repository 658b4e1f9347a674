"""Healthy: roots that rotate. At each step the step's leader (src = step % world) perturbs and broadcasts
the parameters, hands a token to the next leader with a tagged isend/irecv that only those two post,
and a per-rank norm is reduced (MAX) to the next leader, who alone uses the result; a final
all_gather of what each rank saw. 4 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
w, seen = torch.zeros(32), torch.zeros(1)
for step in range(6):
    leader, nxt = step % world, (step + 1) % world
    if rank == leader:
        w = w + 0.1 * torch.randn(32)
    dist.broadcast(w, src=leader)
    token, req = torch.tensor([float(step)]), None
    if rank == leader:
        req = dist.isend(token, dst=nxt, tag=step)
    elif rank == nxt:
        req = dist.irecv(token, src=leader, tag=step)
    norm = torch.randn(32).add(w).norm().reshape(1)
    dist.reduce(norm, dst=nxt, op=dist.ReduceOp.MAX)
    if req is not None:
        req.wait()
    if rank == nxt:
        seen = torch.maximum(seen, norm)
everyone = [torch.empty(1) for _ in range(world)]
dist.all_gather(everyone, seen)
dist.destroy_process_group()
