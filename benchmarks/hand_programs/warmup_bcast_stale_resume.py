"""A loss-driven learning-rate warmup broadcast from rank 0, skipped by a rank that resumed from a stale
checkpoint left in its node-local scratch.
Every rank looks for the newest checkpoint in its own scratch directory and, if it finds one, restores
the model, the optimizer and the `warmup_done` flag from it; the weights are then broadcast from rank 0
anyway "so that everyone starts from the same point". While warming up, rank 0 alone raises the LR
(it grows while rank 0's smoothed loss keeps falling) and broadcasts it to the others every step; once
the peak is reached every rank sets `warmup_done` and follows a local cosine decay. The job is a fresh
start, but rank 3's scratch still holds a checkpoint from an earlier job that had finished its warmup:
rank 3 restores `warmup_done=True` and never posts the LR broadcast, so its gradient all_reduce meets the
others' 1-element broadcast. 4 ranks.
Truth: rank 3 (skipped broadcast), line: the `if not warmup_done` / the LR broadcast."""
import datetime
import glob
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


PEAK_LR, BASE_LR, STEPS, DIM = 0.05, 0.005, 12, 10


def previous_jobs_leftovers(scratch, rank):
    # node-local scratch is not wiped between jobs; rank 3's node ran the previous job's rank 3
    if rank == 3:
        torch.save({"step": 340, "warmup_done": True, "model": None}, os.path.join(scratch, "ckpt-000340.pt"))


def latest_checkpoint(scratch):
    files = sorted(glob.glob(os.path.join(scratch, "ckpt-*.pt")))
    return torch.load(files[-1], weights_only=False) if files else None


def warmup_lr(lr, loss_ema, warmup_done, rank):
    if not warmup_done:  # <BUG>
        t = torch.tensor([min(lr * 1.5, PEAK_LR) if rank == 0 and loss_ema[0] < loss_ema[1] else lr])
        dist.broadcast(t, src=0)  # <ALT>
        lr = t.item()
        warmup_done = lr >= PEAK_LR
    return lr, warmup_done


def cosine(step, lr):
    return BASE_LR + 0.5 * (lr - BASE_LR) * (1 + math.cos(math.pi * step / STEPS))


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
with tempfile.TemporaryDirectory(prefix=f"scratch-r{rank}-") as scratch:
    previous_jobs_leftovers(scratch, rank)
    state = latest_checkpoint(scratch)
    warmup_done = bool(state and state["warmup_done"])  # <ALT>
    if state and state["model"] is not None:
        model.load_state_dict(state["model"])
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    gen = torch.Generator().manual_seed(rank)
    lr, loss_ema = BASE_LR, [float("inf"), float("inf")]
    for step in range(STEPS):
        x = torch.randn(16, DIM, generator=gen)
        y = x[:, :3].sum(1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss_ema = [0.7 * loss_ema[0] + 0.3 * loss.item() if step else loss.item(), loss_ema[0]]
        lr, warmup_done = warmup_lr(lr, loss_ema, warmup_done, rank)  # <ALT>
        for group in opt.param_groups:
            group["lr"] = lr if not warmup_done else cosine(step, lr)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0 and step % 4 == 3:
            print(f"step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.4f}", flush=True)
dist.destroy_process_group()
