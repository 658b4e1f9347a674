"""Generated SPMD program (randprog seed 20261208, #377): 0-d mesh [], 4 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist

torch.set_num_threads(1)


def spread(t, group=None):
    out = torch.empty(dist.get_world_size(group) * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=12))
    global_rank = dist.get_rank()
    ws = dist.get_world_size()
    torch.manual_seed(1234 + global_rank)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for k in range(4):
        if not (k == 1 and global_rank == 4):
            chunk = torch.full((16,), global_rank + 1.0, dtype=torch.float64)
            chunk = spread(chunk, None)
        stats = torch.full((16,), float(global_rank))
        stats_in = torch.empty(16)
        reqs = [dist.isend(stats, (global_rank + 1) % ws), dist.irecv(stats_in, (global_rank - 1) % ws)]
        for req in reqs:
            req.wait()
        proj = torch.randn(16, 16) / 16
        msg = torch.randn(4, 16)
        for _ in range(9):
            msg = torch.tanh(msg @ proj)
        act = torch.full((4,), float(global_rank))
        act_in = torch.empty(4)
        ops = [dist.P2POp(dist.isend, act, (global_rank + 1) % ws), dist.P2POp(dist.irecv, act_in, (global_rank - 1) % ws)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        tokens = torch.full((4096,), global_rank + 1.0, dtype=torch.float32)
        tokens = spread(tokens, group=None)
        grad = torch.ones(8, dtype=torch.float64) * (global_rank + 1)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        batch = torch.randn(4, 16)
        l = net(batch).pow(2).mean()
        l.backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ws
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
