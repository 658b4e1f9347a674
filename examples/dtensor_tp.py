"""Tensor parallelism with DTensor on a 2-D mesh (dp x tp), in plain PyTorch: nothing of ncclscope in it.

    torchrun --standalone --nproc-per-node 4 examples/dtensor_tp.py --dp 2 --tp 2 --steps 3
    ncclscope run --nproc 4 -- examples/dtensor_tp.py --dp 2 --tp 2 --steps 3
    ncclscope run --nproc 4 -- examples/dtensor_tp.py --dp 2 --tp 2 --bug wrong-group --timeout 5

The MLP is split Megatron-style over the tp dimension (`ColwiseParallel` then
`RowwiseParallel`: DTensor all-reduces the output, a functional collective that
only Flight Recorder sees); the gradients of the data-parallel replicas are
averaged by hand with `dist.all_reduce(..., group=dp_group)`.
--bug wrong-group: the last rank averages its gradients over the tp group
instead of the dp group (a copy-paste slip).
--bug foreign-group: the dp groups are built by hand, one `new_group` per tp
coordinate on every rank, and the last rank indexes the list with the wrong
coordinate: it passes a group it is not a member of, which torch turns into
a no-op (with a warning), and its own replica's group waits for it.
"""
import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--bug", default="none", choices=["none", "wrong-group", "foreign-group"])
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device_type = "cuda" if args.backend == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
    if args.bug == "foreign-group":   # the same dp groups, by hand: every rank creates every one
        timeout = datetime.timedelta(seconds=args.timeout)   # new_group's own default is 30 minutes
        dp_groups = [dist.new_group([r for r in range(world) if r % args.tp == t], timeout=timeout)
                     for t in range(args.tp)]
        tp_rank = rank % args.tp
        dp_group = dp_groups[(tp_rank + 1) % args.tp if rank == world - 1 else tp_rank]   # BUG on the last rank
    torch.manual_seed(0)
    model = parallelize_module(MLP().to(device_type), mesh["tp"],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(mesh.get_coordinate()[0])   # same batch across a tp group
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=gen).to(device_type)
        loss = model(x).pow(2).mean()
        loss.backward()
        for prm in model.parameters():
            g = prm.grad.to_local() if isinstance(prm.grad, DTensor) else prm.grad
            group = tp_group if (args.bug == "wrong-group" and rank == world - 1) else dp_group   # BUG on the last rank
            dist.all_reduce(g, group=group)
            g /= args.dp
        opt.step()
        opt.zero_grad()
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if rank == 0:
        print(f"dtensor_tp: {args.steps} steps on dp={args.dp} x tp={args.tp}, mean final loss {total.item() / world:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
