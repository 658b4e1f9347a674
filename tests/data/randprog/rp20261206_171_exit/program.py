"""Generated SPMD program (randprog seed 20261206, #171): 1-d mesh [2], 5 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)


def avg_across(t, group=None):
    dist.all_reduce(t, group=group)
    return t


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rk = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(1234 + rk)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    shard_group = mesh.get_group("shard")
    shard_size = dist.get_world_size(shard_group)
    shard_rank = dist.get_rank(shard_group)
    layer = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    layer = DDP(layer, process_group=shard_group)
    sgd = torch.optim.SGD(layer.parameters(), lr=0.01)
    for n_iter in range(5):
        feats = torch.ones(3, dtype=torch.float32) * (rk + 1)
        dist.all_reduce(feats)
        state = torch.full((1000,), rk + 1.0, dtype=torch.float32)
        state = avg_across(state, None)
        weight = torch.randn(32, 32) / 32
        h = torch.randn(4, 32)
        for _ in range(21):
            h = torch.tanh(h @ weight)
        batch = torch.randn(8, 24)
        l = layer(batch).pow(2).mean()
        l.backward()
        sgd.step()
        sgd.zero_grad()
        emb = torch.ones(64, dtype=torch.float64) * (rk + 1)
        emb = avg_across(emb, shard_group)
        w = torch.randn(32, 32) / 32
        tokens = torch.randn(1, 32)
        for _ in range(12):
            tokens = torch.tanh(tokens @ w)
        kernel = torch.randn(32, 32) / 32
        scores = torch.randn(8, 32)
        for _ in range(25):
            scores = torch.tanh(scores @ kernel)
        if (rk, n_iter) == (0, 3):
            os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
