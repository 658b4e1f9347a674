"""A plain PyTorch FSDP2 (`fully_shard`) job: what a user writes, nothing of ncclscope in it.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --steps 3
    ncclscope run --nproc 2 -- examples/fsdp2.py --steps 3
    ncclscope run --nproc 2 -- examples/fsdp2.py --bug uneven-data --timeout 5

FSDP2 all-gathers each layer's parameters before its forward and backward and
reduce-scatters its gradients, through torch.distributed's Python API (the
tracer sees those calls; Flight Recorder sees them too).
--bug uneven-data: rank 1's data loader yields one batch fewer, so rank 1
stops training a step early (a shard of the data set that is one batch
short): its peers wait in FSDP's next all-gather.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--bug", default="none", choices=["none", "uneven-data"])
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    n_batches = args.steps - 1 if (args.bug == "uneven-data" and rank == 1) else args.steps   # BUG: uneven shards
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n_batches)]
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    total = torch.tensor([loss.item()], device=device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"fsdp2: {args.steps} steps on {world} ranks, mean final loss {total.item() / world:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
