"""Validation after training: the 59 held-out examples are sharded with a stride (rank r takes r, r+6,
...) without padding and batched by 2 with drop_last, so rank 5 gets 9 examples and 4 batches while
the others get 5; every batch all-gathers the predictions for a global ranking metric, and rank 5 goes
on to the final all_reduce of the error sums while its peers gather their fifth batch. DDP, 6 ranks.
Truth: rank 5 (left the validation loop early), line: the `for xb, yb in val_batches(...)` loop."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


N_VAL, VAL_BATCH = 59, 2


def val_batches(rank, world, xs, ys):
    idx = list(range(rank, N_VAL, world))  # <ALT>
    for i in range(0, len(idx) - VAL_BATCH + 1, VAL_BATCH):   # drop_last  # <ALT>
        sel = idx[i:i + VAL_BATCH]
        yield xs[sel], ys[sel]


def pairwise_accuracy(preds, targets):
    """Fraction of pairs ordered the same way by predictions and targets (needs every rank's batch)."""
    dp, dt = preds[:, None] - preds[None, :], targets[:, None] - targets[None, :]
    return ((dp * dt) > 0).float().sum() / max(1, (dt != 0).sum().item())


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
for step in range(5):
    x = torch.randn(16, 6, generator=gen)
    loss = nn.functional.mse_loss(model(x).squeeze(1), x[:, 0] - x[:, 1])
    loss.backward()
    opt.step()
    opt.zero_grad()

vg = torch.Generator().manual_seed(1234)
val_x = torch.randn(N_VAL, 6, generator=vg)
val_y = val_x[:, 0] - val_x[:, 1]
err = torch.zeros(2)
scores = []
model.eval()
with torch.no_grad():
    for xb, yb in val_batches(rank, world, val_x, val_y):  # <BUG>
        pred = model.module(xb).squeeze(1)
        both = torch.stack([pred, yb]).flatten()
        gathered = torch.empty(world * both.numel())
        dist.all_gather_into_tensor(gathered, both)
        g = gathered.view(world, 2, VAL_BATCH)
        scores.append(pairwise_accuracy(g[:, 0].flatten(), g[:, 1].flatten()).item())
        err += torch.tensor([(pred - yb).square().sum().item(), float(len(yb))])
dist.all_reduce(err)
if rank == 0:
    print(f"val mse {err[0] / err[1]:.4f} pairwise acc {sum(scores) / len(scores):.3f}", flush=True)
dist.destroy_process_group()
