"""Healthy: a 3 x 2 DeviceMesh (dp, tp) trained in a while-loop that rank 0 ends by broadcasting a stop
flag every 2 steps (global loss under a target, or a step budget). Rank 0 scatters per-rank data seeds
at the start; each step all-reduces a row-parallel layer's output over tp and the gradients over dp;
a failing metrics-file write is caught and ignored; the final per-rank step counts are gathered to rank 0.
6 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


HIDDEN, BATCH, MAX_STEPS, TARGET = 8, 6, 14, 1e-4


def write_metrics(step, value):
    with open(f"/nonexistent-metrics-dir/step{step}.txt", "w") as f:   # a missing mount: best effort
        f.write(f"{value}\n")


torch.set_num_threads(1)
rank, world = _init()
mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
dp_size = mesh.size(0)

seeds = torch.arange(world, dtype=torch.int64) * 17 + 3 if rank == 0 else None
my_seed = torch.empty(1, dtype=torch.int64)
dist.scatter(my_seed, scatter_list=list(seeds.chunk(world)) if rank == 0 else None, src=0)
gen = torch.Generator().manual_seed(int(my_seed))

torch.manual_seed(mesh.get_local_rank("tp"))
w = (0.1 * torch.randn(HIDDEN, HIDDEN)).requires_grad_()
target_map = torch.eye(HIDDEN) * 0.5
step, stop = 0, torch.zeros(1)
while stop.item() == 0:
    x = torch.randn(BATCH, HIDDEN, generator=gen)
    partial = x @ w
    full = partial.detach().clone()
    dist.all_reduce(full, group=tp_group)
    out = partial + (full - partial.detach())
    loss = (out - x @ target_map).square().mean()
    loss.backward()
    with torch.no_grad():
        dist.all_reduce(w.grad, group=dp_group)
        w -= 0.05 * w.grad / dp_size
    w.grad = None
    step += 1
    try:
        write_metrics(step, loss.item())
    except OSError:
        pass
    if step % 2 == 0:
        global_loss = loss.detach().reshape(1)
        dist.all_reduce(global_loss)
        if rank == 0:
            stop.fill_(float(step >= MAX_STEPS or global_loss.item() / world < TARGET))
        dist.broadcast(stop, src=0)

counts = [torch.empty(1) for _ in range(world)] if rank == 0 else None
dist.gather(torch.tensor([float(step)]), gather_list=counts, dst=0)
if rank == 0:
    print("steps per rank:", [int(c.item()) for c in counts], flush=True)
dist.destroy_process_group()
