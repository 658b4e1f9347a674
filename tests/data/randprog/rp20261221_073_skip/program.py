"""Generated SPMD program (randprog seed 20261221, #73): 2-d mesh [2, 2], 3 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)


def gather_feats(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)

def avg_across(t, group=None):
    dist.all_reduce(t, group=group)
    return t


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    my_rank = dist.get_rank()
    nranks = dist.get_world_size()
    torch.manual_seed(1234 + my_rank)
    layout = {
        "fsdp": [[0, 2], [1, 3]],
        "row": [[0, 1], [2, 3]],
    }
    groups, all_groups = {}, {}
    dim_order = ['fsdp', 'row']
    for dim in dim_order:
        for members in layout[dim]:
            g = dist.new_group(members)
            all_groups[(dim, tuple(members))] = g
            if my_rank in members:
                groups[dim] = g
    fsdp_group = groups["fsdp"]
    row_group = groups["row"]
    fsdp_size = dist.get_world_size(fsdp_group)
    fsdp_rank = dist.get_rank(fsdp_group)
    row_size = dist.get_world_size(row_group)
    row_rank = dist.get_rank(row_group)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    net = DDP(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for k in range(3):
        state = torch.ones(4096, dtype=torch.int64) * my_rank
        dist.reduce(state, dst=2)
        delta = torch.ones(100, dtype=torch.float64) * (my_rank + 1)
        delta = avg_across(delta, group=fsdp_group)
        acc = torch.full((128,), float(my_rank))
        acc_in = torch.empty(128)
        ops = [dist.P2POp(dist.isend, acc, (my_rank + 1) % nranks), dist.P2POp(dist.irecv, acc_in, (my_rank - 1) % nranks)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        mat = torch.randn(8, 8) / 8
        buf = torch.randn(8, 8)
        for _ in range(15):
            buf = torch.tanh(buf @ mat)
        dist.barrier()
        z = torch.ones(4096, dtype=torch.int64) * (my_rank + 1)
        z = avg_across(z, row_group)
        act = torch.full((100,), my_rank + 1.0, dtype=torch.float32)
        act = gather_feats(act, group=row_group)
        if not (my_rank == 1 and k == 1):
            scores = torch.full((1000,), my_rank + 1.0, dtype=torch.float32)
            scores = gather_feats(scores, fsdp_group)
        w = torch.randn(32, 32) / 32
        feats = torch.randn(1, 32)
        for _ in range(17):
            feats = torch.tanh(feats @ w)
        batch = torch.randn(2, 32)
        loss = net(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
