"""Generated SPMD program (randprog seed 20261209, #69): 1-d mesh [5], 12 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist

torch.set_num_threads(1)


def gather_feats(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(1234 + rank)
    layout = {
        "rep": [[0, 1, 2, 3, 4]],
    }
    groups, all_groups = {}, {}
    dim_order = ['rep']
    for dim in dim_order:
        for members in layout[dim]:
            g = dist.new_group(members)
            all_groups[(dim, tuple(members))] = g
            if rank in members:
                groups[dim] = g
    rep_group = groups["rep"]
    rep_size = dist.get_world_size(rep_group)
    rep_rank = dist.get_rank(rep_group)
    for n_iter in range(12):
        x = torch.full((128,), float(rank))
        x_in = torch.empty(128)
        reqs = [dist.isend(x, (rank + 1) % world_size), dist.irecv(x_in, (rank - 1) % world_size)]
        for req in reqs:
            req.wait()
        h = torch.arange(100, dtype=torch.float64) + rank
        h_parts = [torch.empty_like(h) for _ in range(world_size)]
        dist.all_gather(h_parts, h, group=dist.group.WORLD)
        state = torch.full((4096,), rank + 1.0, dtype=torch.float64)
        state = gather_feats(state, None)
        scores = torch.full((64,), rank + 1.0, dtype=torch.float32)
        scores = gather_feats(scores, rep_group)
        mat = torch.randn(64, 64) / 64
        chunk = torch.randn(4, 64)
        for _ in range(4):
            chunk = torch.tanh(chunk @ mat)
        kernel = torch.randn(64, 64) / 64
        feats = torch.randn(1, 64)
        for _ in range(13):
            feats = torch.tanh(feats @ kernel)
        proj = torch.randn(8, 8) / 8
        grad = torch.randn(4, 8)
        for _ in range(13):
            grad = torch.tanh(grad @ proj)
        w = torch.randn(16, 16) / 16
        emb = torch.randn(4, 16)
        for _ in range(23):
            emb = torch.tanh(emb @ w)
        if dist.get_rank() == 3:
            time.sleep(0.15)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
