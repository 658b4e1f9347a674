"""Periodic validation: every 3 steps each rank loads its validation shard by name from a manifest and
the validation losses are all-reduced. The manifest was written for a 3-rank run, so rank 3 finds no
entry; its handler prints an error and calls `sys.exit(1)`, and the others wait for it in the
validation all_reduce. 4 ranks.
Truth: rank 3 (exit), line: the `sys.exit(1)`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VAL_MANIFEST = {0: "val-00000", 1: "val-00001", 2: "val-00002"}  # written for a 3-rank run


def load_val(rank):
    name = VAL_MANIFEST[rank]  # <ALT>
    g = torch.Generator().manual_seed(int(name.split("-")[1]))
    return torch.randn(16, 8, generator=g)


rank, world = _init()
w = torch.zeros(8)
for step in range(6):
    x = torch.randn(16, 8)
    grad = x.t() @ (x @ w - 1.0) / 16
    dist.all_reduce(grad)
    w -= 0.1 * grad / world
    if step % 3 == 2:
        try:
            val = load_val(rank)  # <ALT>
        except KeyError:  # <ALT>
            print(f"rank {rank}: no validation shard in the manifest", file=sys.stderr)
            sys.exit(1)  # <BUG>
        vloss = ((val @ w - 1.0) ** 2).mean().reshape(1)
        dist.all_reduce(vloss)
dist.destroy_process_group()
