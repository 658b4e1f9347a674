"""Generated SPMD program (randprog seed 20261213, #371): 2-d mesh [2, 2], 6 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist

torch.set_num_threads(1)


def fetch_all(t, group=None):
    out = torch.empty(dist.get_world_size(group) * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t, group=group)
    return out

def combine(t, group=None):
    out = torch.empty(t.numel() // dist.get_world_size(group), dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
    global_rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(1234 + global_rank)
    layout = {
        "cp": [[0, 2], [1, 3]],
        "dp": [[0, 1], [2, 3]],
    }
    groups, all_groups = {}, {}
    dim_order = ['cp', 'dp']
    for dim in dim_order:
        for members in layout[dim]:
            g = dist.new_group(members)
            all_groups[(dim, tuple(members))] = g
            if global_rank in members:
                groups[dim] = g
    cp_group = groups["cp"]
    dp_group = groups["dp"]
    cp_size = dist.get_world_size(cp_group)
    cp_rank = dist.get_rank(cp_group)
    dp_size = dist.get_world_size(dp_group)
    dp_rank = dist.get_rank(dp_group)
    for t in range(6):
        emb = torch.full((512,), float(global_rank))
        emb_in = torch.empty(512)
        peer = global_rank ^ 1
        if peer < world_size:
            send_first = global_rank % 2 == 0
            if send_first:
                dist.send(emb, peer)
                dist.recv(emb_in, peer)
            else:
                dist.recv(emb_in, peer)
                dist.send(emb, peer)
        kernel = torch.randn(16, 16) / 16
        tokens = torch.randn(4, 16)
        for _ in range(20):
            tokens = torch.tanh(tokens @ kernel)
        dist.barrier()
        z = torch.ones(world_size * 100, dtype=torch.float32)
        z = combine(z, None)
        mom = torch.full((512,), float(global_rank))
        mom_in = torch.empty(512)
        reqs = [dist.isend(mom, (global_rank + 1) % world_size), dist.irecv(mom_in, (global_rank - 1) % world_size)]
        for req in reqs:
            req.wait()
        proj = torch.randn(64, 64) / 64
        state = torch.randn(4, 64)
        for _ in range(3):
            state = torch.tanh(state @ proj)
        msg = torch.full((100,), global_rank + 1, dtype=torch.int64)
        msg = fetch_all(msg, cp_group)
        x = torch.arange(3, dtype=torch.int64) + global_rank
        x_parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(x_parts, x, group=cp_group)
        buf = torch.full((1,), global_rank + 1.0, dtype=torch.float32)
        buf = fetch_all(buf, dp_group)
        if global_rank == 0 and t == 3:
            dist.all_reduce(torch.tensor([float(t)]), group=cp_group)  # log progress
        acc = torch.ones(cp_size * 1000, dtype=torch.float32)
        acc = combine(acc, group=cp_group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
