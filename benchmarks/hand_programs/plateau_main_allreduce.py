"""DDP classifier whose learning rate is driven by a ReduceLROnPlateau scheduler that only the main rank owns; the validation stats reach it through a helper that mixes reduce and all_reduce.
After every epoch each rank evaluates its own validation shard and sums [loss, correct, count] over the
ranks with `aggregate()`. To save bandwidth the helper lets ranks that only contribute call `dist.reduce`
to rank 0, while a rank that consumes the result (the one holding the scheduler and the early-stopping
tracker) calls `dist.all_reduce`, on the belief that the two pair up. They do not: rank 0 posts an
all_reduce where the other five post a reduce at the same point, and the job hangs in the first
validation. Rank 0 would then broadcast the new lr and the stop flag. 6 ranks, up to 5 epochs of 4 steps.
Truth: rank 0 (all_reduce for reduce), line: the `dist.all_reduce(stats)` in `aggregate()` / its `if need_result` / the `aggregate(...)` call."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


FEATURES, CLASSES, BATCH, STEPS_PER_EPOCH, EPOCHS, VAL_BATCHES = 20, 5, 16, 4, 5, 3


class EarlyStopping:
    def __init__(self, patience, min_delta=1e-3):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad_epochs = float("inf"), 0

    def update(self, val_loss):
        if val_loss < self.best - self.min_delta:
            self.best, self.bad_epochs = val_loss, 0
        else:
            self.bad_epochs += 1
        return self.bad_epochs >= self.patience


def make_split(rank, n_batches, salt):
    g = torch.Generator().manual_seed(97 * rank + salt)
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(3))
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        x = centers[y] + 0.8 * torch.randn(BATCH, FEATURES, generator=g)
        out.append((x, y))
    return out


def aggregate(stats, need_result):
    """Sum `stats` over the ranks. Ranks that only contribute send to rank 0 with a reduce (cheaper);
    the rank that consumes the sum gets it with an all_reduce."""
    if need_result:  # <ALT>
        dist.all_reduce(stats)  # <BUG>
    else:
        dist.reduce(stats, dst=0)
    return stats


@torch.no_grad()
def evaluate(model, val_batches):
    model.eval()
    stats = torch.zeros(3)
    for x, y in val_batches:
        logits = model.module(x)          # plain module: no DDP forward hooks during eval
        stats[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += len(y)
    model.train()
    return stats


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, CLASSES)))
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
scheduler = stopper = None
if rank == 0:   # the main process owns the lr schedule and the stopping decision, and broadcasts them
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    stopper = EarlyStopping(patience=2)
val_batches = make_split(rank, VAL_BATCHES, salt=1)

for epoch in range(EPOCHS):
    for x, y in make_split(rank, STEPS_PER_EPOCH, salt=100 + epoch):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    stats = aggregate(evaluate(model, val_batches), need_result=scheduler is not None)  # <ALT>
    control = torch.zeros(2)          # [lr, stop]
    if rank == 0:
        val_loss = (stats[0] / stats[2]).item()
        scheduler.step(val_loss)
        stop = stopper.update(val_loss)
        control[0], control[1] = opt.param_groups[0]["lr"], float(stop)
        print(f"epoch {epoch}: val loss {val_loss:.4f} acc {(stats[1] / stats[2]).item():.3f} "
              f"lr {control[0].item():.3g}", flush=True)
    dist.broadcast(control, src=0)
    for group in opt.param_groups:
        group["lr"] = control[0].item()
    if control[1].item():
        break
dist.destroy_process_group()
