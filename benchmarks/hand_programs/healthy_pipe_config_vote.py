"""Healthy: two data-parallel replicas of a hand-written 2-stage pipeline (ranks 0-1 and 2-3; stage =
rank % 2) with blocking send/recv of activations forward and of their gradients backward. The number of
micro-batches is read from the job config by rank 0 and broadcast to everyone each epoch; each stage
all-reduces its gradients with its peer stage ({0, 2} and {1, 3}); the last stages keep an early-stopping
tracker and every rank votes with `all_reduce(MAX)` of a float flag (first stages vote 0.0); the epoch
loss is `dist.reduce`d to rank 1. 4 ranks.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


CONFIG = {0: {"micro_batches": 3}, 1: {"micro_batches": 4}, 2: {"micro_batches": 4}}  # per epoch
EPOCHS, MB_SIZE, HID, PATIENCE = 6, 4, 12, 2


def read_micro_batches(epoch):
    return CONFIG.get(epoch, CONFIG[max(CONFIG)])["micro_batches"]


torch.set_num_threads(1)
rank, world = _init()
stage, replica = rank % 2, rank // 2
stage_group = [dist.new_group([0, 2]), dist.new_group([1, 3])][stage]
torch.manual_seed(stage)
part = nn.Sequential(nn.Linear(6, HID), nn.Tanh()) if stage == 0 else nn.Linear(HID, 1)
opt = torch.optim.SGD(part.parameters(), lr=0.05)
g = torch.Generator().manual_seed(replica)
best, bad = float("inf"), 0
for epoch in range(EPOCHS):
    n_mb = torch.tensor([read_micro_batches(epoch) if rank == 0 else 0])
    dist.broadcast(n_mb, src=0)
    xs = [torch.randn(MB_SIZE, 6, generator=g) for _ in range(int(n_mb))]
    ys = [x.sum(1, keepdim=True).tanh() for x in xs]
    saved, total = [], torch.zeros(1)
    for x, y in zip(xs, ys):
        if stage == 0:
            act = part(x)
            dist.send(act.detach(), rank + 1)
            saved.append(act)
        else:
            act = torch.empty(MB_SIZE, HID)
            dist.recv(act, rank - 1)
            saved.append(act.requires_grad_())
    if stage == 1:                      # GPipe: all forwards first, then the backwards in order
        for act, y in zip(saved, ys):
            loss = nn.functional.mse_loss(part(act), y) / len(xs)
            loss.backward()
            dist.send(act.grad, rank - 1)
            total += loss.detach()
    else:
        for act in saved:
            grad = torch.empty_like(act)
            dist.recv(grad, rank + 1)
            act.backward(grad)
    for p in part.parameters():
        dist.all_reduce(p.grad, group=stage_group)
        p.grad /= 2
    opt.step()
    opt.zero_grad()
    dist.reduce(total, dst=1)
    stop = 0.0
    if stage == 1:
        if total.item() < best - 1e-4:
            best, bad = total.item(), 0
        else:
            bad += 1
        stop = 1.0 if bad >= PATIENCE else 0.0
    flag = torch.tensor([stop])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if rank == 1:
        print(f"epoch {epoch} micro-batches {int(n_mb)} loss {total.item() / 2:.4f}", flush=True)
    if flag.item() > 0:
        break
dist.destroy_process_group()
