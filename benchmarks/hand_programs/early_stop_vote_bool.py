"""Early stopping by vote: each rank runs an `EarlyStopping` tracker on its own validation shard and
after every epoch the ranks vote with `all_reduce(MAX)` of a flag built by `torch.tensor([stopper.should_stop])`.
The tracker starts with `should_stop = 0.0` and sets it to `True` when patience runs out, so the rank
that runs out first votes with a bool tensor (1 byte) while the others vote with float32 (4 bytes). Rank 3's
validation shard has labels from another task (its loss never improves); it runs out of patience after
epoch 3. DDP, 5 ranks.
Truth: rank 3 (dtype), line: the vote's `dist.all_reduce` / the `should_stop = True` / the flag tensor."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


PATIENCE, EPOCHS, STEPS_PER_EPOCH = 3, 12, 3
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


class EarlyStopping:
    def __init__(self, patience, min_delta=1e-4):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad_epochs = float("inf"), 0
        self.should_stop = 0.0

    def update(self, val_loss):
        if val_loss < self.best - self.min_delta:
            self.best, self.bad_epochs = val_loss, 0
        else:
            self.bad_epochs += 1
            if self.bad_epochs >= self.patience:
                self.should_stop = True  # <ALT>


def val_shard(rank):
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(32, 4, generator=g)
    y = x @ W_TRUE
    if rank == 3:                 # exported from the wrong task: unrelated targets
        y = torch.randn(32, 1, generator=g) * 5.0
    return x, y


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
stopper = EarlyStopping(PATIENCE)
val_x, val_y = val_shard(rank)
gen = torch.Generator().manual_seed(rank)
for epoch in range(EPOCHS):
    for _ in range(STEPS_PER_EPOCH):
        x = torch.randn(16, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), x @ W_TRUE)
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        stopper.update(nn.functional.mse_loss(model.module(val_x), val_y).item())
    flag = torch.tensor([stopper.should_stop])  # <ALT>
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # <BUG>
    if rank == 0:
        print(f"epoch {epoch} val {stopper.best:.4f} stop {bool(flag.item())}", flush=True)
    if flag.item():
        break
dist.destroy_process_group()
