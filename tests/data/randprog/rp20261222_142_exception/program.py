"""Generated SPMD program (randprog seed 20261222, #142): 1-d mesh [2], 5 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def avg_across(t, group=None):
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(t, src=src, group=group)
    return t

def reduce_stats(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(1234 + rank)
    layout = {
        "dp": [[0, 1]],
    }
    groups, all_groups = {}, {}
    dim_order = ['dp']
    for dim in dim_order:
        for members in layout[dim]:
            g = dist.new_group(members)
            all_groups[(dim, tuple(members))] = g
            if rank in members:
                groups[dim] = g
    dp_group = groups["dp"]
    dp_size = dist.get_world_size(dp_group)
    dp_rank = dist.get_rank(dp_group)
    for n_iter in range(5):
        chunk = torch.full((1000,), rank + 1.0, dtype=torch.float32)
        chunk = avg_across(chunk, None)
        grad = torch.arange(64, dtype=torch.bfloat16) + rank
        grad_parts = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(grad_parts, grad)
        state = torch.ones(1, dtype=torch.float32) * rank
        state_all = torch.empty(world * state.numel(), dtype=state.dtype)
        dist.all_gather_into_tensor(state_all, state)
        stats = torch.full((8,), rank + 1.0, dtype=torch.float64)
        stats = avg_across(stats, group=None)
        dist.barrier()
        msg = torch.full((4096,), rank + 1.0, dtype=torch.float32)
        msg = reduce_stats(msg, None)
        mom = torch.full((100,), rank + 1.0, dtype=torch.float64)
        mom = reduce_stats(mom, None)
        kernel = torch.randn(8, 8) / 8
        tokens = torch.randn(1, 8)
        for _ in range(14):
            tokens = torch.tanh(tokens @ kernel)
        if n_iter == 4 and rank == 0:
            raise AssertionError(f"corrupt sample in batch {n_iter}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
