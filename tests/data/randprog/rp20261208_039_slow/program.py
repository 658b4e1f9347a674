"""Generated SPMD program (randprog seed 20261208, #39): 1-d mesh [2], 9 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

torch.set_num_threads(1)


def collect(t, group=None):
    out = torch.empty(t.numel() // dist.get_world_size(group), dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    global_rank = dist.get_rank()
    nranks = dist.get_world_size()
    torch.manual_seed(1234 + global_rank)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    shard_group = mesh.get_group("shard")
    shard_size = dist.get_world_size(shard_group)
    shard_rank = dist.get_rank(shard_group)
    pipe_ranks = dist.get_process_group_ranks(shard_group)
    head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(head.parameters(), lr=0.01)
    samples = list(range((global_rank + 1) % nranks, 72, nranks))  # this rank's shard
    batches = [samples[j:j + 4] for j in range(0, len(samples) - 4 + 1, 4)]
    for k, batch_ids in enumerate(batches):
        grad = torch.ones(shard_size * 100, dtype=torch.float64)
        grad = collect(grad, shard_group)
        act = torch.full((4,), float(global_rank))
        act_in = torch.empty(4)
        pos = pipe_ranks.index(global_rank)
        if pos > 0:
            dist.recv(act, pipe_ranks[pos - 1])
        act = act * 0.5 + 1.0
        if pos < len(pipe_ranks) - 1:
            dist.send(act, pipe_ranks[pos + 1])
        in_splits = [1 + (global_rank + 2 * j + 2) % 3 for j in range(nranks)]
        out_splits = [1 + (j + 2 * global_rank + 2) % 3 for j in range(nranks)]
        emb = torch.randn(sum(in_splits), 64, dtype=torch.float32)
        emb_out = torch.empty(sum(out_splits), emb.shape[1], dtype=torch.float32)
        dist.all_to_all_single(emb_out, emb, output_split_sizes=out_splits, input_split_sizes=in_splits)
        weight = torch.randn(64, 64) / 64
        state = torch.randn(1, 64)
        for _ in range(23):
            state = torch.tanh(state @ weight)
        if global_rank == 0:
            time.sleep(0.15)
        chunk = torch.full((16,), float(global_rank))
        chunk_in = torch.empty(16)
        peer = global_rank ^ 1
        if peer < nranks:
            send_first = global_rank % 2 == 0
            if send_first:
                dist.send(chunk, peer)
                dist.recv(chunk_in, peer)
            else:
                dist.recv(chunk_in, peer)
                dist.send(chunk, peer)
        x = torch.ones(1000, dtype=torch.float32) * global_rank
        dist.reduce(x, dst=dist.get_global_rank(shard_group, 1), group=shard_group)
        inputs = torch.randn(2, 16)
        l = head(inputs).pow(2).mean()
        l.backward()
        for p in head.parameters():
            dist.all_reduce(p.grad)
            p.grad /= nranks
        optimizer.step()
        optimizer.zero_grad()
        buf = torch.ones(nranks * 4096, dtype=torch.float64)
        buf = collect(buf, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
