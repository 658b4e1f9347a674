"""Top-k gradient compression with error feedback whose density each rank adapts on its own.
Every step each rank flattens its gradient, adds the residual it kept from earlier steps, picks the k
entries of largest magnitude and all-gathers their indices and values (two `dist.all_gather` of k
elements); every rank then scatter-adds the gathered entries into a dense buffer, averages it and steps.
The compressor doubles k when the entries it sends capture less than a third of the gradient's energy
("send more when top-k misses most of it"), a decision each rank takes from its own local gradient.
Rank 2's shard has dense features (the others' rows are sparse bags of features), so its gradient's
energy is spread out: after step 2 its k grows from 8 to 16 while the others keep 8, and at step 3 its
index all_gather has another size. 4 ranks.
Truth: rank 2 (size), line: the indices' `dist.all_gather` / the k-doubling line."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, HIDDEN, STEPS, BATCH = 16, 24, 10, 32


class TopKCompressor:
    def __init__(self, numel, density=0.02, min_captured=1 / 3):
        self.residual = torch.zeros(numel)
        self.k = max(1, int(density * numel))
        self.min_captured = min_captured

    def compress(self, flat):
        acc = flat + self.residual
        _, idx = acc.abs().topk(self.k)
        vals = acc[idx]
        self.residual = acc.clone()
        self.residual[idx] = 0.0
        captured = vals.square().sum() / acc.square().sum().clamp_min(1e-12)
        if captured < self.min_captured and self.k * 8 <= acc.numel():
            self.k *= 2  # <ALT>
        return idx, vals


def sparse_all_reduce(idx, vals, numel, world):
    idx_list = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(idx_list, idx)  # <BUG>
    val_list = [torch.empty_like(vals) for _ in range(world)]
    dist.all_gather(val_list, vals)  # <ALT>
    dense = torch.zeros(numel)
    for i, v in zip(idx_list, val_list):
        dense.index_add_(0, i, v)
    return dense / world


def make_shard(rank, n):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(n, DIM, generator=g)
    if rank != 2:
        x = x * (torch.rand(n, DIM, generator=g) < 0.2)   # sparse bag-of-features rows
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return x, y


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
params = list(model.parameters())
numel = sum(p.numel() for p in params)
comp = TopKCompressor(numel)
opt = torch.optim.SGD(params, lr=0.2)
x_all, y_all = make_shard(rank, STEPS * BATCH)
for step in range(STEPS):
    xb, yb = x_all[step * BATCH:(step + 1) * BATCH], y_all[step * BATCH:(step + 1) * BATCH]
    loss = nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in params])
    idx, vals = comp.compress(flat)
    dense = sparse_all_reduce(idx, vals, numel, world)  # <ALT>
    for p, g in zip(params, dense.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    opt.step()
    if step % 3 == 2:
        stat = torch.tensor([loss.item(), 1.0])
        dist.all_reduce(stat)
        if rank == 0:
            print(f"step {step} loss {stat[0] / stat[1]:.4f}", flush=True)
dist.destroy_process_group()
