"""Tensor parallel with DTensor (parallelize_module, colwise then rowwise) on a 2 x 2 mesh (dp x tp);
rank 3 skips the forward of step 2 (a rank-local "bad batch" `continue`), so its tp partner waits in the
rowwise all_reduce. 4 ranks.
Truth: rank 3, line: the `continue`."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
mlp = parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
for step in range(5):
    x = torch.randn(4, 16)
    if rank == 3 and step == 2:  # <ALT>
        continue  # <BUG>
    y = mlp(x)  # <ALT>
    loss = y.to_local().square().mean() if hasattr(y, "to_local") else y.square().mean()
    loss.backward()
dist.destroy_process_group()
