"""Hand-written tensor-parallel MLP serving loop: a row-parallel helper skips its all_reduce when the rank's
partial sum is all zero ("nothing to add"), so when rank 2's ReLU shard of the first block is all dead
for one request (step 3) it posts no all_reduce there while ranks 0, 1, 3 do; its head all_reduce then
meets their block all_reduce (another size). Column-parallel up projections, row-parallel down
projections, the request broadcast from rank 0 each step. 4 ranks.
Truth: rank 2 (skipped all_reduce), line: the early return in `row_parallel`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


D, HIDDEN, OUT = 8, 16, 4


def load_sharded_weights(rank, world, seed=16):
    """Every rank builds the same full matrices and keeps its slice of the hidden dimension."""
    g = torch.Generator().manual_seed(seed)
    w1a = torch.randn(HIDDEN, D, generator=g)
    w2a = torch.randn(D, HIDDEN, generator=g) / HIDDEN ** 0.5
    w1b = torch.randn(HIDDEN, D, generator=g)
    w2b = torch.randn(OUT, HIDDEN, generator=g) / HIDDEN ** 0.5
    s = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    return {"block": (w1a[s], w2a[:, s]), "head": (w1b[s], w2b[:, s])}


def row_parallel(h_local, w_down_local):
    partial = h_local @ w_down_local.t()
    if not partial.any():  # <BUG>
        return partial  # this rank's shard adds nothing to the sum
    dist.all_reduce(partial)  # <ALT>
    return partial


def tp_mlp(x, weights):
    w_up, w_down = weights
    h = torch.relu(x @ w_up.t())  # column parallel: no communication
    return row_parallel(h, w_down)


torch.set_num_threads(1)
rank, world = _init()
weights = load_sharded_weights(rank, world)
requests = torch.Generator().manual_seed(1016)
with torch.no_grad():
    for step in range(6):
        x = torch.randn(1, D, generator=requests)
        dist.broadcast(x, src=0)  # rank 0 owns the request queue
        y = tp_mlp(x, weights["block"]) + x  # <ALT>
        logits = tp_mlp(y, weights["head"])
        if rank == 0:
            print(f"request {step}: class {int(logits.argmax())}", flush=True)
dist.destroy_process_group()
