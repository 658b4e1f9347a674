"""A plain PyTorch DistributedDataParallel job: what a user writes, nothing of ncclscope in it.

    torchrun --standalone --nproc-per-node 2 examples/ddp.py --steps 3
    ncclscope run --nproc 2 -- examples/ddp.py --steps 3                     # the same, traced
    ncclscope run --nproc 2 -- examples/ddp.py --steps 3 --bug extra-allreduce --timeout 5

--bug extra-allreduce: rank 0 "logs the global loss" with an all_reduce the
other ranks never call (at step 1): its all_reduce pairs with the others' next
DDP gradient all-reduce, and the job hangs or fails.
--bug sleep: rank 1 sleeps --sleep seconds at step 1 (a straggler / apparent hang).
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--bug", default="none", choices=["none", "extra-allreduce", "sleep"])
    p.add_argument("--sleep", type=float, default=3.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randn(8, 4, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()                      # DDP's gradient all-reduce runs here, inside the C++ reducer
        opt.step()
        if args.bug == "extra-allreduce" and rank == 0 and step == 1:
            logged = loss.detach().clone()
            dist.all_reduce(logged)          # BUG: only rank 0 calls this collective
        if args.bug == "sleep" and rank == 1 and step == 1:
            time.sleep(args.sleep)
    total = torch.tensor([loss.item()], device=device)
    dist.all_reduce(total)                   # the job's own end-of-run metric
    if rank == 0:
        print(f"ddp: {args.steps} steps on {world} ranks, mean final loss {total.item() / world:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
