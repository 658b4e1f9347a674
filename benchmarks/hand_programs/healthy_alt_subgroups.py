"""Healthy: a 2 x 3 grid of ranks with row groups ({0,1,2}, {3,4,5}) and column groups ({0,3}, {1,4},
{2,5}), every group created by every rank in the same order; even steps all_reduce activations over the
row, odd steps all_reduce gradients over the column, every third step the row-0 member broadcasts a
scale down its column, and a world all_reduce of the loss ends each step. 6 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


ROWS, COLS = 2, 3


def build_groups(rank):
    rows = [dist.new_group([r * COLS + c for c in range(COLS)]) for r in range(ROWS)]
    cols = [dist.new_group([r * COLS + c for r in range(ROWS)]) for c in range(COLS)]
    return rows[rank // COLS], cols[rank % COLS]


torch.set_num_threads(1)
rank, world = _init(30.0)
row_group, col_group = build_groups(rank)
col_root = rank % COLS  # global rank of the row-0 member of this column
act, grad, scale = torch.ones(24), torch.ones(40), torch.ones(1)
for step in range(8):
    if step % 2 == 0:
        dist.all_reduce(act, group=row_group)
        act /= COLS
    else:
        dist.all_reduce(grad, group=col_group)
        grad /= ROWS
    if step % 3 == 0:
        if rank == col_root:
            scale.fill_(1.0 + 0.1 * step)
        dist.broadcast(scale, src=col_root, group=col_group)
    loss = (act.mean() * scale + grad.mean()).reshape(1)
    dist.all_reduce(loss)
dist.destroy_process_group()
