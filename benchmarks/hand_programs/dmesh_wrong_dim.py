"""A 2 x 2 DeviceMesh (dp, tp); gradients are all-reduced over dp and activations over tp. Rank 1 takes
its data-parallel group from the wrong mesh dimension at step 2 (`mesh.get_group("tp")` in a branch).
Truth: rank 1 (wrong group), line: its all_reduce on the wrong group."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


from torch.distributed.device_mesh import init_device_mesh

rank, world = _init()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
act, grad = torch.ones(32), torch.ones(128)
for step in range(5):
    dist.all_reduce(act, group=tp_group)
    g = tp_group if (rank == 1 and step == 2) else dp_group  # <ALT>
    dist.all_reduce(grad, group=g)  # <BUG>
dist.destroy_process_group()
