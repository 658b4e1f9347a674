"""Generated SPMD program (randprog seed 20261208, #231): 1-d mesh [4], 11 steps."""
import datetime
import os
import time

import torch
from torch import distributed as dist
from torch.distributed.device_mesh import init_device_mesh

torch.set_num_threads(1)


def avg_across(t, group=None):
    out = torch.empty(t.numel() // dist.get_world_size(group), dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out

def reduce_stats(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    my_rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(1234 + my_rank)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("inner",))
    inner_group = mesh.get_group("inner")
    inner_size = dist.get_world_size(inner_group)
    inner_rank = dist.get_rank(inner_group)
    for step in range(11):
        payload = torch.full((3,), my_rank + 1.0, dtype=torch.bfloat16)
        payload = reduce_stats(payload, None)
        acc = torch.ones(1, dtype=torch.float32) * my_rank
        acc_all = torch.empty(world * acc.numel(), dtype=acc.dtype)
        dist.all_gather_into_tensor(acc_all, acc)
        scores = torch.full((1024,), my_rank + 1.0, dtype=torch.float64)
        scores = reduce_stats(scores, None)
        act = torch.ones(inner_size * 1000, dtype=torch.float32)
        act = avg_across(act, inner_group)
        src = dist.get_global_rank(inner_group, 0)
        stats = [{"lr": 0.1 / (step + 1), "tag": "cfg"}, step] if my_rank == src else [None] * 2
        dist.broadcast_object_list(stats, src=src, group=inner_group)
        weight = torch.randn(8, 8) / 8
        tokens = torch.randn(1, 8)
        for _ in range(3):
            tokens = torch.tanh(tokens @ weight)
        if my_rank == 3:
            time.sleep(0.05)
        msg = torch.ones(world * 100, dtype=torch.float32)
        msg = avg_across(msg, group=None)
        chunk = torch.ones(100, dtype=torch.int64) * my_rank
        dist.broadcast(chunk, src=dist.get_global_rank(inner_group, 1), group=inner_group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
