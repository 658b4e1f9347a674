"""Generated SPMD program (randprog seed 20261218, #2): 2-d mesh [2, 4], 7 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)



def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=12))
    rk = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(1234 + rk)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("inner", "sp"))
    inner_group = mesh.get_group("inner")
    sp_group = mesh.get_group("sp")
    inner_size = dist.get_world_size(inner_group)
    inner_rank = dist.get_rank(inner_group)
    sp_size = dist.get_world_size(sp_group)
    sp_rank = dist.get_rank(sp_group)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    samples = list(range((rk + 4) % world, 224, world))  # this rank's shard
    batches = [samples[j:j + 4] for j in range(0, len(samples) - 4 + 1, 4)]
    for it, batch_ids in enumerate(batches):
        feats = torch.full((4,), float(rk))
        feats_in = torch.empty(4)
        reqs = [dist.isend(feats, (rk + 1) % world), dist.irecv(feats_in, (rk - 1) % world)]
        for req in reqs:
            req.wait()
        inputs = torch.randn(4, 24)
        loss = model(inputs).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        weight = torch.randn(64, 64) / 64
        msg = torch.randn(4, 64)
        for _ in range(16):
            msg = torch.tanh(msg @ weight)
        if not ((rk, it) == (5, 2)):
            src = dist.get_global_rank(sp_group, 2)
            scores = [{"lr": 0.1 / (it + 1), "tag": "cfg"}, it] if rk == src else [None] * 2
            dist.broadcast_object_list(scores, src=src, group=sp_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
