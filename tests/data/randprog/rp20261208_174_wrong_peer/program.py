"""Generated SPMD program (randprog seed 20261208, #174): 0-d mesh [], 3 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)



def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(1234 + rank)
    chain = list(range(world_size))
    samples = list(range((rank + 0) % world_size, 18, world_size))  # this rank's shard
    batches = [samples[j:j + 2] for j in range(0, len(samples) - 2 + 1, 2)]
    for epoch, batch_ids in enumerate(batches):
        acc = torch.full((128,), float(rank))
        acc_in = torch.empty(128)
        pos = chain.index(rank)
        if pos > 0:
            dist.recv(acc, chain[pos - 1])
        acc = acc * 0.5 + 1.0
        if pos < len(chain) - 1:
            dist.send(acc, chain[pos + 1])
        dist.barrier()
        state = torch.full((16,), float(rank))
        state_in = torch.empty(16)
        dst = (rank + 2) % world_size if rank == 1 and epoch == 1 else (rank + 1) % world_size
        reqs = [dist.isend(state, dst), dist.irecv(state_in, (rank - 1) % world_size)]
        for req in reqs:
            req.wait()
        w = torch.randn(32, 32) / 32
        mom = torch.randn(1, 32)
        for _ in range(24):
            mom = torch.tanh(mom @ w)
        src = 0
        scores = [{"lr": 0.1 / (epoch + 1), "tag": "cfg"}, epoch] if rank == src else [None] * 2
        dist.broadcast_object_list(scores, src=src, group=dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
