"""Resuming a DistributedSampler's position from per-rank checkpoint shards, with a "repair from rank 0" path that only a stale rank takes.
Each rank restores its model, epoch and loader state from its own shard of the last checkpoint. The
loader state is written after the model, and a rank whose loader state is older than its epoch (the
crash hit between the two writes) is meant to "fetch the sampler seed and epoch from rank 0 so that the
shards still partition the data": `resync_from_main()` broadcasts them from rank 0. Only rank 4's shard
is torn, so rank 4 alone posts that broadcast; rank 0 never calls the helper. Rank 4's broadcast of 2
int64 pairs with the first parameter broadcast of `sync_weights()` on the other ranks (768 bytes), and
gloo aborts rank 4 on the size mismatch while the others wait for it. 6 ranks.
Truth: rank 4 (extra broadcast), line: the `dist.broadcast` in `resync_from_main` / the `if` in `restore_sampler`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


EPOCHS, DIM = 5, 12


def load_shard(rank):
    """What each rank finds in <ckpt>/shard-<rank>.pt: the epoch to resume and the loader state."""
    state = {"epoch": 3, "loader": {"seed": 1234, "epoch": 3}}
    if rank == 4:  # the job was killed between rank 4's model write and its loader-state write
        state["loader"] = {"seed": 1234, "epoch": 2}
    return state


def resync_from_main(sampler):
    t = torch.tensor([sampler.seed, sampler.epoch])
    dist.broadcast(t, src=0)  # <BUG>
    sampler.seed, sampler.epoch = int(t[0]), int(t[1])


def restore_sampler(sampler, state):
    sampler.seed, sampler.epoch = state["loader"]["seed"], state["loader"]["epoch"]
    if state["loader"]["epoch"] != state["epoch"]:  # <ALT>
        resync_from_main(sampler)  # <ALT>


def sync_weights(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def make_dataset(n=96):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, DIM, generator=g)
    y = x[:, :3].sum(1, keepdim=True) - 0.5 * x[:, 3:6].sum(1, keepdim=True)
    return TensorDataset(x, y)


torch.set_num_threads(1)
rank, world = _init()
dataset = make_dataset()
sampler = DistributedSampler(dataset, shuffle=True)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)
state = load_shard(rank)
restore_sampler(sampler, state)
torch.manual_seed(rank)  # replicas differ until sync_weights()
model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
sync_weights(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(state["epoch"], EPOCHS):
    sampler.set_epoch(epoch)
    seen, loss_sum = 0, 0.0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        seen += len(x)
        loss_sum += loss.item() * len(x)
    book = torch.tensor([float(seen), loss_sum])
    dist.all_reduce(book)
    assert int(book[0]) == len(dataset), f"epoch {epoch}: the shards covered {int(book[0])} samples"
    if rank == 0:
        print(f"epoch {epoch} samples {int(book[0])} train mse {book[1].item() / book[0].item():.4f}", flush=True)
dist.destroy_process_group()
