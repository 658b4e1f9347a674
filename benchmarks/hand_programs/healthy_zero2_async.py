"""Healthy: a hand-written ZeRO-2 step with async collectives: the flat gradient is reduce-scattered with
async_op=True (the loss is logged while it runs), the shard's norm feeds a global-norm helper called from
both `clip()` and `log()` (every rank logs), the updated shards are all-gathered back asynchronously, and
a padded validation loop and a monitored_barrier follow training. 4 ranks. Truth: silent, exit 0."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


STEPS, LOG_EVERY, MAX_NORM, N_VAL, VAL_BATCH = 9, 3, 0.5, 30, 4


def global_norm(shard):
    sq = shard.square().sum().reshape(1)
    dist.all_reduce(sq)
    return math.sqrt(sq.item())


class Zero2:
    def __init__(self, model, rank, world, lr=0.05, momentum=0.9):
        self.params = list(model.parameters())
        self.rank, self.world, self.lr, self.momentum = rank, world, lr, momentum
        self.numel = sum(p.numel() for p in self.params)
        self.padded = math.ceil(self.numel / world) * world
        self.shard_len = self.padded // world
        self.buf = torch.zeros(self.shard_len)

    def flat(self, tensors):
        flat = torch.cat([t.detach().flatten() for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.padded - self.numel)])

    def reduce_grads_async(self):
        shard = torch.empty(self.shard_len)
        work = dist.reduce_scatter_tensor(shard, self.flat([p.grad for p in self.params]), async_op=True)
        return shard, work

    def clip(self, shard):
        norm = global_norm(shard)
        return shard * min(1.0, MAX_NORM / (norm + 1e-6))

    def log(self, step, shard, loss):
        norm = global_norm(shard)
        if self.rank == 0:
            print(f"step {step} loss {loss:.4f} grad norm {norm:.4f}", flush=True)

    def update(self, shard):
        mine = self.flat(self.params).chunk(self.world)[self.rank]
        self.buf.mul_(self.momentum).add_(shard)
        full = torch.empty(self.padded)
        dist.all_gather_into_tensor(full, mine - self.lr * self.buf, async_op=True).wait()
        torch.nn.utils.vector_to_parameters(full[:self.numel], self.params)


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 3))
zero = Zero2(model, rank, world)
gen = torch.Generator().manual_seed(rank)
for step in range(STEPS):
    x = torch.randn(12, 10, generator=gen)
    loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long() + (x[:, 1] > 1).long())
    loss.backward()
    shard, work = zero.reduce_grads_async()
    local_loss = loss.item()
    work.wait()
    shard /= world
    if step % LOG_EVERY == LOG_EVERY - 1:
        zero.log(step, shard, local_loss)
    zero.update(zero.clip(shard))
    model.zero_grad()

vg = torch.Generator().manual_seed(99)
val_x = torch.randn(N_VAL, 10, generator=vg)
per = math.ceil(N_VAL / world)
idx = [(rank * per + i) % N_VAL for i in range(per)]    # padded like DistributedSampler
correct = torch.zeros(2)
with torch.no_grad():
    for i in range(0, per, VAL_BATCH):
        xb = val_x[idx[i:i + VAL_BATCH]]
        yb = (xb[:, 0] > 0).long() + (xb[:, 1] > 1).long()
        hits = torch.tensor([float((model(xb).argmax(-1) == yb).sum()), float(len(yb))])
        dist.all_reduce(hits)
        correct += hits
dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
if rank == 0:
    print(f"val acc {correct[0] / correct[1]:.3f}", flush=True)
dist.destroy_process_group()
