"""A hand-written ZeRO-style step: the gradients are flattened, padded to a multiple of world * align and
reduce-scattered so that each rank updates its own shard; the updated shards are all-gathered back. The
alignment is a per-rank launch option and rank 1 was started with 16 instead of 8, so its flat buffer is
padded to 128 elements instead of 96 and its reduce_scatter_tensor has another size (32 vs 24 per
shard). 4 ranks.
Truth: rank 1 (size), line: its `dist.reduce_scatter_tensor`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def flat_padded(tensors, multiple):
    flat = torch.cat([t.detach().flatten() for t in tensors])
    return torch.cat([flat, flat.new_zeros((-flat.numel()) % multiple)])


rank, world = _init()
shard_align = 16 if rank == 1 else 8  # --shard-align from this rank's launch command  # <ALT>
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
params = list(model.parameters())
n = sum(p.numel() for p in params)
for step in range(3):
    model(torch.randn(8, 16)).square().mean().backward()
    grads = flat_padded([p.grad for p in params], world * shard_align)  # <ALT>
    shard = torch.empty(grads.numel() // world)
    dist.reduce_scatter_tensor(shard, grads)  # <BUG>
    flat = flat_padded(params, world * shard_align)
    mine = flat.chunk(world)[rank] - 0.01 * shard / world
    full = torch.empty_like(flat)
    dist.all_gather_into_tensor(full, mine)
    torch.nn.utils.vector_to_parameters(full[:n], params)
    model.zero_grad()
dist.destroy_process_group()
