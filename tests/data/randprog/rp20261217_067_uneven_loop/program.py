"""Generated SPMD program (randprog seed 20261217, #67): 2-d mesh [2, 2], 6 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist

torch.set_num_threads(1)


def exchange_all(t, group=None):
    dist.all_reduce(t, group=group)
    return t


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    global_rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(1234 + global_rank)
    layout = {
        "fsdp": [[0, 2], [1, 3]],
        "dp": [[0, 1], [2, 3]],
    }
    groups, all_groups = {}, {}
    dim_order = ['fsdp', 'dp']
    for dim in dim_order:
        for members in layout[dim]:
            g = dist.new_group(members)
            all_groups[(dim, tuple(members))] = g
            if global_rank in members:
                groups[dim] = g
    fsdp_group = groups["fsdp"]
    dp_group = groups["dp"]
    fsdp_size = dist.get_world_size(fsdp_group)
    fsdp_rank = dist.get_rank(fsdp_group)
    dp_size = dist.get_world_size(dp_group)
    dp_rank = dist.get_rank(dp_group)
    samples = list(range((global_rank + 0) % world_size, 47, world_size))  # this rank's shard
    batches = [samples[j:j + 2] for j in range(0, len(samples) - 2 + 1, 2)]
    for epoch, batch_ids in enumerate(batches):
        dist.barrier(group=dist.group.WORLD)
        state = torch.full((64,), global_rank + 1.0, dtype=torch.float32)
        state = exchange_all(state, fsdp_group)
        weight = torch.randn(64, 64) / 64
        stats = torch.randn(1, 64)
        for _ in range(15):
            stats = torch.tanh(stats @ weight)
        payload = torch.ones(1, dtype=torch.float64) * (global_rank + 1)
        payload = exchange_all(payload, fsdp_group)
        z = torch.full((128,), float(global_rank))
        z_in = torch.empty(128)
        ops = [dist.P2POp(dist.isend, z, (global_rank + 1) % world_size), dist.P2POp(dist.irecv, z_in, (global_rank - 1) % world_size)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        scores = torch.full((512,), float(global_rank))
        scores_in = torch.empty(512)
        peer = global_rank ^ 1
        if peer < world_size:
            send_first = global_rank % 2 == 0
            if send_first:
                dist.send(scores, peer)
                dist.recv(scores_in, peer)
            else:
                dist.recv(scores_in, peer)
                dist.send(scores, peer)
        chunk = [None] * fsdp_size
        dist.all_gather_object(chunk, {"rank": global_rank, "step": epoch}, group=fsdp_group)
        acc = [None] * fsdp_size
        dist.all_gather_object(acc, {"rank": global_rank, "step": epoch}, group=fsdp_group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
